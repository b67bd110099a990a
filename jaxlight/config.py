"""The Trainer's arguments, written once: :data:`ARGUMENTS`, and what is made from it.

Each :class:`Argument` row holds an argument's name, the type a caller may pass, its default, its
documentation and its check (and, where the value is resolved, how). From the table come:

- the ``Trainer.__init__`` signature, annotations and ``Args:`` docstring (:func:`trainer_arguments`), which
  ``inspect.signature``, ``help(jl.Trainer)`` and the LightningCLI (jsonargparse) read;
- :class:`TrainerConfig`, the frozen dataclass of the resolved values (:meth:`TrainerConfig.from_arguments`
  checks every argument, with the numbers, before any work starts);
- the Trainer's attributes under Lightning's names (``trainer.max_epochs`` reads ``trainer.config``), whose
  assignment runs the same check (:class:`ConfigAttribute`);
- the argument table of docs/trainer.md (:func:`markdown_table`; a test keeps the page equal to it).
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import inspect
import math
import numbers
import os
import tempfile
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import jax

from jaxlight.errors import MisconfigurationError, NotADirectoryMisconfiguration
from jaxlight.loggers.csv_logs import CSVLogger
from jaxlight.loggers.logger import Logger
from jaxlight.precision import Precision, resolve_precision

RUN_AHEAD = 4
"""Steps the host may dispatch ahead of the device before it waits for the oldest one. Deep enough that
the device never idles between steps (measured: with 2, the reference workload ran 1% slower than a plain
jit loop on XLA:CPU; with 4, 0.1%), shallow enough to bound memory and how late a stop takes effect."""

Limit = int | float | None


# ---------------------------------------------------------------------------- the checks
# Each takes the argument's name and value and raises MisconfigurationError naming both. A type check comes
# before any range check, so `max_steps="10"` says so rather than raising a TypeError from `"10" < -1`.
def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _int_check(accepts: str, low: int | None = None, message: str = "", none: bool = True) -> Callable:
    """A check for an int argument: ``accepts`` says what the argument takes (the type error), ``message``
    (``{name}``/``{value}`` filled in) is the range error below ``low``; ``none=False`` refuses None in range."""

    def check(name: str, value: Any) -> None:
        if value is not None and not _is_int(value):
            raise MisconfigurationError(f"{name} must be {accepts}, got {value!r} ({type(value).__name__})")
        if (value is None and not none) or (value is not None and low is not None and value < low):
            raise MisconfigurationError(message.format(name=name, value=value))

    return check


def _flag_check(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise MisconfigurationError(f"{name} must be True, False or None, got {value!r} ({type(value).__name__})")


def _check_accelerator(name: str, accelerator: Any) -> None:
    if accelerator not in ("auto", "cpu", "gpu", "cuda", "tpu"):
        raise MisconfigurationError(f"accelerator={accelerator!r}; choose 'auto', 'cpu', 'gpu' or 'tpu'")
    if accelerator != "auto" and jax.default_backend() != {"cuda": "gpu"}.get(accelerator, accelerator):
        raise MisconfigurationError(f"accelerator={accelerator!r} but JAX's backend is {jax.default_backend()!r}")


def _check_num_nodes(name: str, num_nodes: Any) -> None:
    _int_check("an int >= 1")(name, num_nodes)
    if num_nodes != 1 and num_nodes != jax.process_count():
        raise MisconfigurationError(
            f"num_nodes={num_nodes} but jax.distributed reports {jax.process_count()} processes"
        )


def _check_fast_dev_run(name: str, fdr: Any) -> None:
    if not isinstance(fdr, bool) and not _is_int(fdr):
        raise MisconfigurationError(f"fast_dev_run must be a bool or an int >= 0, got {fdr!r} ({type(fdr).__name__})")
    if isinstance(fdr, int) and fdr < 0:
        raise MisconfigurationError(f"fast_dev_run={fdr} must be >= 0 or a bool")


def _check_val_check_interval(name: str, vci: Any) -> None:
    if vci is not None and (isinstance(vci, bool) or not isinstance(vci, (numbers.Integral, float))):
        raise MisconfigurationError(
            f"val_check_interval must be an int (batches) or a float in (0, 1] (a fraction of an epoch), "
            f"got {vci!r} ({type(vci).__name__})"
        )
    if isinstance(vci, float) and not (0.0 < vci <= 1.0):
        raise MisconfigurationError(f"val_check_interval={vci} as a float must be in (0, 1]")
    if isinstance(vci, int) and vci < 1:
        raise MisconfigurationError(f"val_check_interval={vci} as an int must be >= 1")


def check_val_cadence(val_check_interval: Any, check_val_every_n_epoch: Any) -> None:
    """A fraction of an epoch means nothing when ``check_val_every_n_epoch=None`` counts batches across
    epochs (Lightning refuses it too). ``val_check_interval`` is the value the caller gave (None: not given)."""
    if check_val_every_n_epoch is None and isinstance(val_check_interval, float):
        raise MisconfigurationError(
            f"val_check_interval={val_check_interval} is a fraction of an epoch, but check_val_every_n_epoch=None "
            f"counts batches across epochs: pass an int number of batches"
        )


def _check_accumulate(name: str, value: Any) -> None:
    _int_check("an int >= 1")(name, value)
    if not isinstance(value, int) or value < 1:
        raise MisconfigurationError(f"accumulate_grad_batches must be an int >= 1, got {value!r}")


def _check_clip_val(name: str, clip: Any) -> None:
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, numbers.Real) or not math.isfinite(clip)):
        raise MisconfigurationError(f"gradient_clip_val must be a finite number >= 0 or None, got {clip!r}")
    if clip is not None and clip < 0:
        raise MisconfigurationError(f"gradient_clip_val must be >= 0, got {clip}")


def _check_clip_algorithm(name: str, algorithm: Any) -> None:
    if algorithm not in (None, "norm", "value"):
        raise MisconfigurationError(f"gradient_clip_algorithm={algorithm!r}; choose 'norm' or 'value'")


def _check_deterministic(name: str, deterministic: Any) -> None:
    if deterministic and jax.default_backend() == "gpu":
        if "xla_gpu_deterministic_ops" not in os.environ.get("XLA_FLAGS", ""):
            raise MisconfigurationError(
                "deterministic=True on GPU needs XLA_FLAGS=--xla_gpu_deterministic_ops=true set before JAX starts"
            )


def _check_root(name: str, root: Any) -> None:
    if root is not None and not isinstance(root, (str, os.PathLike)):
        raise MisconfigurationError(
            f"default_root_dir must be a path (str or os.PathLike), got {root!r} ({type(root).__name__})"
        )


def _check_ragged(name: str, ragged: Any) -> None:
    if ragged not in ("keep", "error", "drop"):
        raise MisconfigurationError(
            f"ragged_batches={ragged!r}; choose 'error' or 'drop', or 'keep' (the default: a shorter "
            f"train batch runs in a step compiled for its own shape, as Lightning trains it)"
        )


def _plugin_list(plugins: Any) -> list[Any]:
    return [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]


def _check_plugins(name: str, plugins: Any) -> None:
    """Lightning's ``plugins=``: jaxlight has precision plugins only (``jl.MixedPrecision(...)``), at most one."""
    given = _plugin_list(plugins)
    other = [p for p in given if not isinstance(p, Precision)]
    if other:
        raise MisconfigurationError(
            f"plugins: {type(other[0]).__name__} is not a plugin jaxlight has; the only plugins are precision "
            f"policies (jl.MixedPrecision('16-mixed', scaler=jl.GradScaler(...))); environments, checkpoint I/O "
            f"and the rest of Lightning's plugins have no counterpart"
        )
    if len(given) > 1:
        raise MisconfigurationError(f"plugins holds {len(given)} precision plugins ({given}); pass one")


def _resolve_precision(value: Any, args: Mapping[str, Any]) -> Precision:
    """``precision``, or the precision plugin in ``plugins`` (Lightning refuses both; so does jaxlight, unless
    ``precision`` is the default)."""
    plugins = [p for p in _plugin_list(args.get("plugins")) if isinstance(p, Precision)]
    if not plugins:
        return resolve_precision(value)
    if not isinstance(value, Precision) and resolve_precision(value).name != "32-true":
        raise MisconfigurationError(
            f"Received both precision={value!r} and plugins={plugins[0]!r}; choose one (as in Lightning)"
        )
    return plugins[0]


def _check_prefetch(name: str, prefetch: Any) -> None:
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
        raise MisconfigurationError(
            f"prefetch must be an int >= 0 (batches read ahead on a background thread; 0 reads them inline), "
            f"got {prefetch!r}"
        )


def check_steps_per_execution(n: Any) -> None:
    """``steps_per_execution``: train batches per compiled call, an int >= 1 (Keras's argument of that name).

    Only the argument itself is checked here; whether the run's cadences (validation, checkpoints,
    ``max_steps``) fall on execution boundaries depends on the epoch length and the callbacks, and is
    checked when ``fit`` starts (:func:`jaxlight.executions.plan_executions`)."""
    if not _is_int(n) or n < 1:
        raise MisconfigurationError(
            f"steps_per_execution must be an int >= 1 (train batches run by one compiled call), got {n!r}"
        )


def check_limit(name: str, value: Limit) -> Limit:
    """A ``limit_*_batches`` value: None, an int >= 0 (batches) or a float in [0, 1] (a fraction)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MisconfigurationError(f"{name} must be an int or a float in [0, 1], got {value!r}")
    if isinstance(value, float) and not (0.0 <= value <= 1.0):
        raise MisconfigurationError(f"{name}={value} as a float must be within [0.0, 1.0]")
    if isinstance(value, int) and value < 0:
        raise MisconfigurationError(f"{name}={value} must be >= 0")
    return value


# ---------------------------------------------------------------------------- resolving
# Each takes the value and the other arguments (as given, or the config's values on assignment).
def _root(value: Any) -> str:
    return os.fspath(value) if value is not None else os.getcwd()


def _max_epochs(value: int | None, args: Mapping[str, Any]) -> int:
    if value is not None:
        return value
    return 1000 if args["max_steps"] == -1 and args["max_time"] is None else -1


def _or(default: Any) -> Callable[[Any, Mapping[str, Any]], Any]:
    """Resolve None (which every such argument keeps accepting, as Lightning's did) to ``default``."""
    return lambda value, args: default if value is None else value


# ---------------------------------------------------------------------------- the table
_DEFAULT = object()  # Argument.unset when not passing an argument means passing its default


@dataclasses.dataclass(frozen=True)
class Argument:
    """One ``Trainer`` argument, written once.

    ``type`` is what a caller may pass (None for the Trainer's own objects, ``strategy`` and ``callbacks``,
    which keep the annotation of ``Trainer.__init__`` and are not in the config); ``default`` is what the
    signature shows; ``check(name, value)`` raises :class:`MisconfigurationError`; ``resolve(value, args)``
    gives the config's value. ``field`` names the :class:`TrainerConfig` field ("" for the same name, None
    for none) and ``field_type`` its type when resolving changes it; ``attribute`` the Trainer attribute that
    reads it (``""`` for the same name, None for none). ``unset`` is what a caller who did not pass the
    argument means, where that differs from passing the default (the CLI's default is ``unset`` then).
    """

    name: str
    type: Any
    default: Any
    doc: str
    check: Callable[[str, Any], Any] | None = None
    resolve: Callable[[Any, Mapping[str, Any]], Any] | None = None
    field: str | None = ""
    field_type: Any = None
    attribute: str | None = ""
    unset: Any = _DEFAULT

    @property
    def config_field(self) -> str:
        """The :class:`TrainerConfig` field that holds the resolved value."""
        return self.field or self.name

    @property
    def not_given(self) -> Any:
        """The value ``from_arguments`` works with when the caller did not pass the argument."""
        return self.default if self.unset is _DEFAULT else self.unset


_LIMIT_DOC = "an int (that many batches) or a float fraction of the loader's length (needs `len(loader)`)"
ARGUMENTS: tuple[Argument, ...] = (
    Argument(
        "accelerator",
        str,
        "auto",
        '`"auto"`, `"cpu"`, `"gpu"`/`"cuda"`, `"tpu"`; must match JAX\'s backend (JAX picks the backend at '
        "start, the trainer cannot switch it)",
        check=_check_accelerator,
        attribute=None,
    ),
    Argument(
        "strategy",
        None,
        "auto",
        'placement: `"ddp"`/`"dp"` (data parallel), `"fsdp"`, `"tp"`, `"sp"`, `"pp"`, `"offload"`, joined '
        'with `+` (`"fsdp+tp"`), a piece (`jl.strategies.FSDP(...)`) or a `Strategy`; `"auto"` picks the '
        "fastest estimated step that fits `device_memory`, rematerialising before offloading ([verify.md](verify.md)). "
        "Unknown names raise, "
        "listing the valid ones",
        field=None,
        attribute=None,
    ),
    Argument(
        "devices",
        int | Sequence[int] | str,
        "auto",
        'an int (the first N local devices), a list of local device indices, `-1` or `"auto"` (all). More '
        "than available raises with both numbers",
        resolve=lambda value, args: tuple(resolve_devices(value)),
        field_type=tuple[Any, ...],
        attribute=None,
    ),
    Argument(
        "num_nodes",
        int,
        1,
        "must equal `jax.process_count()` when set; multi-process runs are started with `jax.distributed`",
        check=_check_num_nodes,
        attribute=None,
    ),
    Argument(
        "precision",
        str | int | Precision,
        "32-true",
        '`"32-true"`/`"32"`/`32`; `"bf16-mixed"`/`"bf16"` (fp32 master weights and optimizer state, bf16 '
        'forward/backward; normalisation layers keep bf16 activations with fp32 statistics); `"16-mixed"`/`"16"`/'
        "`16` (the same in float16, with dynamic loss scaling as torch's `GradScaler`; its settings through "
        '`jl.MixedPrecision("16-mixed", scaler=jl.GradScaler(...))`); `"bf16-true"` '
        "(parameters, and so optimizer state, stored in bf16; float inputs are cast to bf16 too); "
        '`"16-true"`; `"64-true"` (needs `jax_enable_x64`). Anything else raises, listing these',
        resolve=_resolve_precision,
        field_type=Precision,
        attribute="precision_plugin",
    ),
    Argument(
        "plugins",
        Precision | Sequence[Precision] | None,
        None,
        'Lightning\'s spelling of a precision with settings: `plugins=[jl.MixedPrecision("16-mixed", '
        "scaler=jl.GradScaler(...))]` (with `precision` left at its default; jaxlight has no other plugins: "
        "anything else raises)",
        check=_check_plugins,
        resolve=lambda value, args: tuple(_plugin_list(value)),
        field_type=tuple[Any, ...],
        attribute=None,
    ),
    Argument(
        "logger",
        Logger | Iterable[Logger] | bool | None,
        None,
        "a `Logger`, a list of them, `True`/`None` (a `CSVLogger` in `default_root_dir`), `False` (none)",
        resolve=lambda value, args: tuple(resolve_loggers(value, _root(args["default_root_dir"]))),
        field="loggers",
        field_type=tuple[Logger, ...],
        attribute=None,
    ),
    Argument(
        "callbacks",
        None,
        None,
        "a `Callback` or a list. A `TQDMProgressBar` is added unless `enable_progress_bar=False`; callbacks "
        "returned by the module's `configure_callbacks` replace ones of the same type",
        field=None,
        attribute=None,
    ),
    Argument(
        "fast_dev_run",
        int | bool,
        False,
        "`True` or N: run N batches of train/val/test/predict, no sanity check, no logger, no checkpoints, one epoch",
        check=_check_fast_dev_run,
        resolve=lambda value, args: int(value),
        field_type=int,
    ),
    Argument(
        "max_epochs",
        int | None,
        None,
        "stop after this many epochs; `None` means 1000 when neither `max_steps` nor `max_time` is set, else "
        "unlimited (`-1`)",
        check=_int_check("an int (-1: no limit) or None", -1, "max_epochs must be -1 (no limit) or >= 0, got {value}"),
        resolve=_max_epochs,
        field_type=int,
    ),
    Argument(
        "min_epochs",
        int | None,
        None,
        "early stopping (`should_stop`) is honoured only after this many completed epochs",
        check=_int_check("an int >= 0 or None", 0, "{name} must be >= 0 (or None: no minimum), got {value}"),
        resolve=_or(0),
        field_type=int,
    ),
    Argument(
        "max_steps",
        int,
        -1,
        "stop after this many optimizer steps (`-1`: no limit)",
        check=_int_check(
            "an int (-1: no limit)", -1, "max_steps must be -1 (no limit) or >= 0, got {value}", none=False
        ),
    ),
    Argument(
        "min_steps",
        int | None,
        None,
        "early stopping is honoured only after this many optimizer steps",
        check=_int_check("an int >= 0 or None", 0, "{name} must be >= 0 (or None: no minimum), got {value}"),
        resolve=_or(0),
        field_type=int,
    ),
    Argument(
        "max_time",
        str | timedelta | dict[str, int] | None,
        None,
        'wall-clock limit: `"DD:HH:MM:SS"`, a `timedelta` or a dict; checked at fit start (a budget already '
        "spent, e.g. by the run a checkpoint resumes, trains nothing) and after every step (adds a `Timer` "
        "callback)",
        attribute=None,
    ),
    Argument(
        "limit_train_batches",
        Limit,
        None,
        _LIMIT_DOC,
        check=check_limit,
    ),
    Argument(
        "limit_val_batches",
        Limit,
        None,
        _LIMIT_DOC,
        check=check_limit,
    ),
    Argument(
        "limit_test_batches",
        Limit,
        None,
        _LIMIT_DOC,
        check=check_limit,
    ),
    Argument(
        "limit_predict_batches",
        Limit,
        None,
        _LIMIT_DOC,
        check=check_limit,
    ),
    Argument(
        "val_check_interval",
        int | float | None,
        1.0,
        "float: validate after that fraction of the training epoch; int: every N training batches (an int "
        "larger than the epoch raises, unless `check_val_every_n_epoch=None`, which counts batches across "
        "epochs). `None` (the LightningCLI's default) is the same as not passing it: `1.0`, and accepted with "
        "`check_val_every_n_epoch=None`",
        check=_check_val_check_interval,
        resolve=_or(1.0),
        field_type=int | float,
        unset=None,
    ),
    Argument(
        "check_val_every_n_epoch",
        int | None,
        1,
        "validate every N epochs; `None` with an int `val_check_interval` counts batches across epochs (a "
        "float `val_check_interval` with `None` raises, as in Lightning)",
        check=_int_check("an int >= 1 or None", 1, "check_val_every_n_epoch must be >= 1 or None, got {value}"),
    ),
    Argument(
        "num_sanity_val_steps",
        int | None,
        2,
        "validation batches run before training, per validation loader (`-1`: the whole loader). Their "
        "metrics are discarded. Skipped when there is nothing to validate (`limit_val_batches=0`) and when "
        "resuming inside an epoch",
        check=_int_check(
            "an int (-1: every validation batch) or None",
            -1,
            "num_sanity_val_steps must be -1 (every validation batch) or >= 0, got {value}",
        ),
        resolve=_or(2),
        field_type=int,
    ),
    Argument(
        "log_every_n_steps",
        int | None,
        50,
        "how often step-level logged values are fetched from the device and sent to loggers and the progress bar",
        check=_int_check("an int >= 1 or None", 1, "log_every_n_steps must be >= 1, got {value}"),
        resolve=_or(50),
        field_type=int,
    ),
    Argument(
        "enable_checkpointing",
        bool | None,
        True,
        "add a default `ModelCheckpoint` when none is given (a `Preemption` handler is added too, except "
        "under `fast_dev_run`)",
        check=_flag_check,
        resolve=lambda value, args: value is not False,
        field_type=bool,
    ),
    Argument(
        "enable_progress_bar",
        bool | None,
        True,
        "the tqdm bar",
        check=_flag_check,
        attribute=None,
    ),
    Argument(
        "enable_model_summary",
        bool | None,
        True,
        "print the parameter table (parameters, bytes per device, sharding) at the start of `fit`",
        check=_flag_check,
        resolve=_or(True),
        field_type=bool,
    ),
    Argument(
        "accumulate_grad_batches",
        int,
        1,
        "apply the optimizer every N batches on the summed gradient divided by N; a partial window steps at "
        "the epoch's last batch, as in Lightning",
        check=_check_accumulate,
    ),
    Argument(
        "gradient_clip_val",
        float | None,
        None,
        "clip gradients to this value (by `gradient_clip_algorithm`) before the optimizer",
        check=_check_clip_val,
    ),
    Argument(
        "gradient_clip_algorithm",
        str | None,
        "norm",
        '`"norm"` = `optax.clip_by_global_norm`, `"value"` = `optax.clip`',
        check=_check_clip_algorithm,
        resolve=_or("norm"),
        field_type=str,
    ),
    Argument(
        "deterministic",
        bool | None,
        None,
        "on GPU requires `XLA_FLAGS=--xla_gpu_deterministic_ops=true` set before JAX starts (raises "
        "otherwise); CPU and TPU are deterministic already",
        check=_check_deterministic,
        resolve=lambda value, args: bool(value),
        field_type=bool,
    ),
    Argument(
        "seed",
        int | None,
        None,
        "calls `jl.seed_everything(seed)` (Python's `random`, numpy, torch when loaded; JAX has no global "
        "RNG, so models seed `nnx.Rngs` themselves)",
        check=_int_check("an int or None"),
    ),
    Argument(
        "default_root_dir",
        str | os.PathLike | None,
        None,
        "where the default logger and checkpoints write (`None`: the current directory)",
        check=_check_root,
        resolve=lambda value, args: _root(value),
        field_type=str,
    ),
    Argument(
        "ragged_batches",
        str,
        "keep",
        'jaxlight only, training only. `"keep"`: a train batch with another number of rows than the others '
        '(the usual last one) trains, as in Lightning, in a step compiled for its shape (below); `"error"`: '
        "it raises, before the first step when the loader tells its batch sizes (a torch `DataLoader` with a "
        '`batch_size`, a list of batches); `"drop"`: such batches are skipped (and left out of '
        "`num_training_batches`). Validation, test and predict never drop: a short batch runs as it is "
        "(below)",
        check=_check_ragged,
    ),
    Argument(
        "process_local_batches",
        bool,
        False,
        "jaxlight only. `True`: in a multi-process run each process's loader yields only its share of every "
        "global batch (see [data.md](data.md))",
        check=_flag_check,
    ),
    Argument(
        "prefetch",
        int,
        2,
        "jaxlight only. How many batches the background thread reads and transfers ahead of the step; `0` "
        "reads each batch in the loop itself (no thread: better for very small steps on few CPU cores; a "
        "list of ready batches on CPU devices is always read so, see data.md)",
        check=_check_prefetch,
    ),
    Argument(
        "compile_cache",
        bool | str | os.PathLike | None,
        None,
        "jaxlight only. Persistent XLA compilation cache: `None`/`True` = `$JAXLIGHT_COMPILE_CACHE` or "
        '`~/.cache/jaxlight/compile`, a path, or `False` (off); see "Persistent compilation cache" below',
        attribute=None,
    ),
    Argument(
        "device_memory",
        int | str | None,
        None,
        'jaxlight only, for `strategy="auto"`: bytes per device (`"16GiB"`, `"512MB"`, an int). Default: '
        'read from the device; CPU devices report none, so `"auto"` stays data parallel there and says so',
        attribute=None,
    ),
    Argument(
        "steps_per_execution",
        int,
        1,
        "Keras's argument of that name: N train batches run by one compiled call (a scan of the train step "
        "over N stacked batches, the state donated once), bit-identical to N single steps. Per-batch hooks "
        "run after the call, in order, each with its batch's outputs; cadences must fall on execution "
        'boundaries or `fit` refuses them with the numbers. See "Multi-step execution" below',
        check=lambda name, value: check_steps_per_execution(value),
        resolve=lambda value, args: int(value),
    ),
)
ARGUMENT: dict[str, Argument] = {a.name: a for a in ARGUMENTS}
CONFIG_ARGUMENTS: tuple[Argument, ...] = tuple(a for a in ARGUMENTS if a.field is not None)
"""The arguments the config holds: all but the Trainer's own objects (``strategy``, ``callbacks``)."""
_CONFIG_NAMES = frozenset(a.name for a in CONFIG_ARGUMENTS)
_FAST_DEV_RUN_LIMITS = ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches")


def _config_fields(cls: type) -> type:
    """Make ``cls`` the frozen dataclass of the resolved arguments: one field per config argument, in the
    table's order, typed as resolved."""
    cls.__annotations__ = {a.config_field: a.field_type or a.type for a in CONFIG_ARGUMENTS}
    return dataclasses.dataclass(frozen=True)(cls)


@_config_fields
class TrainerConfig:
    """Every Trainer argument, checked and resolved (Lightning's names and meanings); its fields come from
    :data:`ARGUMENTS`.

    Resolved means: ``devices`` holds the devices of the global mesh (every
    process contributes as many as this one picked); ``precision`` is the
    policy; ``fast_dev_run`` is an int (0: off) and, when set, has already
    replaced the limits, ``max_steps``, ``max_epochs``, the sanity check, the
    validation cadence, the loggers and checkpointing; ``max_epochs`` is 1000 when nothing else bounds the run
    and -1 (no limit) when ``max_steps`` or ``max_time`` does;
    ``min_epochs``/``min_steps`` are 0 when not given;
    ``val_check_interval`` is 1.0 (once per epoch) when not given;
    ``loggers`` is the list to use (a CSVLogger under ``default_root_dir``
    for ``None``/``True``, none for ``False``).

    Not here: the objects the Trainer owns and may replace during a run, the
    strategy (``strategy="auto"`` picks one at fit) and the callbacks (the
    Trainer adds its defaults, the module may add its own); they are checked
    by :func:`~jaxlight.strategies.strategy.resolve_strategy` and
    :func:`~jaxlight.hooks.check_callbacks`.
    """

    def stepping_batches(self, batches_per_epoch: int | float) -> int | float | None:
        """Optimizer steps a fit takes, as Lightning counts them: ``ceil(batches_per_epoch /
        accumulate_grad_batches) * max_epochs`` (the ceil counts the partial window that steps at each
        epoch's end) capped by ``max_steps``; ``max_steps`` (``inf`` when -1) with ``max_epochs=-1``;
        None when the epoch length is unknown and ``max_epochs`` bounds the run."""
        if self.max_epochs == -1:
            return math.inf if self.max_steps == -1 else self.max_steps
        if batches_per_epoch == math.inf:
            return None
        steps = math.ceil(batches_per_epoch / self.accumulate_grad_batches) * max(self.max_epochs, 1)
        return min(steps, self.max_steps) if self.max_steps != -1 else steps

    @classmethod
    def from_arguments(cls, **given: Any) -> TrainerConfig:
        """Check every argument (raising :class:`MisconfigurationError` with the numbers) and resolve it.

        ``given`` holds the arguments the caller passed (a ``Trainer``'s less ``strategy`` and
        ``callbacks``); the others take their defaults. An unknown name is a ``TypeError``, as Python's.
        """
        unknown = [name for name in given if name not in _CONFIG_NAMES]
        if unknown:
            close = difflib.get_close_matches(unknown[0], list(ARGUMENT), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"Trainer.__init__() got an unexpected keyword argument {unknown[0]!r}{hint}")
        args = {a.name: given.get(a.name, a.not_given) for a in CONFIG_ARGUMENTS}
        for a in CONFIG_ARGUMENTS:
            if a.check is not None:
                a.check(a.name, args[a.name])
        n = int(args["fast_dev_run"])
        if n:  # n batches of each stage, no sanity check, no loggers or checkpoints, one epoch
            args.update(dict.fromkeys(_FAST_DEV_RUN_LIMITS, n), max_steps=n, max_epochs=1, num_sanity_val_steps=0)
            args.update(val_check_interval=1.0, check_val_every_n_epoch=1, logger=False, enable_checkpointing=False)
        check_val_cadence(args["val_check_interval"], args["check_val_every_n_epoch"])
        return cls(
            **{a.config_field: a.resolve(args[a.name], args) if a.resolve else args[a.name] for a in CONFIG_ARGUMENTS}
        )

    def assign(self, name: str, value: Any) -> TrainerConfig:
        """A copy with argument ``name`` set to ``value``, after the check ``Trainer(name=value)`` runs and
        resolved as there (``trainer.max_steps = 5`` is ``trainer.config = trainer.config.assign(...)``).
        Other arguments are not re-resolved: assigning ``fast_dev_run`` sets only its own value."""
        argument = ARGUMENT[name]
        if argument.check is not None:
            argument.check(name, value)
        args = {a.name: getattr(self, a.config_field) for a in CONFIG_ARGUMENTS}
        args[name] = value
        vci = args["val_check_interval"]
        # the config holds 1.0 for a val_check_interval not given, which check_val_every_n_epoch=None accepts
        check_val_cadence(None if name != "val_check_interval" and vci == 1.0 else vci, args["check_val_every_n_epoch"])
        resolved = argument.resolve(value, args) if argument.resolve else value
        return dataclasses.replace(self, **{argument.config_field: resolved})


# ---------------------------------------------------------------------------- the Trainer's side
class ConfigAttribute:
    """A Trainer attribute that reads a :class:`TrainerConfig` field (``trainer.max_epochs``).

    Assigning runs the argument's check, as ``Trainer(max_epochs=...)`` does, and replaces ``trainer.config``
    with a copy holding the resolved value (:meth:`TrainerConfig.assign`); the loops read ``trainer.config``,
    so it takes effect at their next read (``max_steps``, ``max_epochs``, ``min_*`` and the validation
    switches are read at every check; the rest when a ``fit``/``validate``/``test``/``predict`` starts).
    """

    def __init__(self, argument: str | None = None) -> None:
        self.argument = argument

    def __set_name__(self, owner: type, name: str) -> None:
        self.argument = self.argument or name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.config, ARGUMENT[self.argument].config_field)

    def __set__(self, obj: Any, value: Any) -> None:
        obj.config = obj.config.assign(self.argument, value)


class ConfigAttributes:
    """The Trainer's argument attributes under Lightning's names, each read from ``self.config``: one
    :class:`ConfigAttribute` per :data:`ARGUMENTS` row that names an ``attribute``."""

    config: TrainerConfig

    @property
    def precision(self) -> str:
        """The precision's name (``"32-true"``, ``"bf16-mixed"`` ...)."""
        return self.config.precision.name


for _argument in ARGUMENTS:
    if _argument.attribute is not None:
        setattr(ConfigAttributes, _argument.attribute or _argument.name, ConfigAttribute(_argument.name))


def trainer_arguments(init: Callable[..., None]) -> Callable[..., None]:
    """Give ``Trainer.__init__(self, *, strategy, callbacks, **arguments)`` the signature, annotations and
    ``Args:`` docstring of :data:`ARGUMENTS`, which ``inspect.signature``, ``help()`` and jsonargparse read.

    The Trainer's own objects (``strategy``, ``callbacks``: no config field) keep ``init``'s annotation and
    default, which must equal the table's; every other argument is the table's row.
    """
    own = inspect.signature(init).parameters
    hints = typing.get_type_hints(init)
    params = [own["self"]]
    for a in ARGUMENTS:
        if a.field is None:
            if a.name not in own or own[a.name].default != a.default:
                raise TypeError(f"{init.__qualname__} must declare {a.name}={a.default!r} (jaxlight.config.ARGUMENTS)")
            params.append(own[a.name].replace(annotation=hints[a.name]))
        else:
            params.append(
                inspect.Parameter(a.name, inspect.Parameter.KEYWORD_ONLY, default=a.default, annotation=a.type)
            )
    init.__signature__ = inspect.Signature(params, return_annotation=None)  # type: ignore[attr-defined]
    init.__annotations__ = {**{p.name: p.annotation for p in params[1:]}, "return": None}
    rows = "\n".join(f"    {a.name}: {a.doc.replace('`', '')}" for a in ARGUMENTS)
    init.__doc__ = f"{inspect.cleandoc(init.__doc__ or '')}\n\nArgs:\n{rows}\n"
    return init


def _shown(value: Any) -> str:
    return f'`"{value}"`' if isinstance(value, str) else f"`{value!r}`"


def markdown_table() -> str:
    """The argument table of docs/trainer.md, made from :data:`ARGUMENTS` (consecutive arguments with the
    same default and meaning share a row)."""
    groups: list[list[Argument]] = []
    for a in ARGUMENTS:
        if groups and (groups[-1][0].doc, groups[-1][0].default) == (a.doc, a.default):
            groups[-1].append(a)
        else:
            groups.append([a])
    lines = ["| argument | default | meaning |", "|---|---|---|"]
    for g in groups:
        lines.append(f"| {', '.join(f'`{a.name}`' for a in g)} | {_shown(g[0].default)} | {g[0].doc} |")
    return "\n".join(lines) + "\n"


def resolve_devices(devices: Any) -> list[Any]:
    """The global mesh's devices for ``devices`` ("auto"/-1/None, a count, or local indices)."""
    local = jax.local_devices()
    if devices in ("auto", -1, None):
        picked = local
    elif isinstance(devices, int) and not isinstance(devices, bool):
        if devices < 1:
            raise MisconfigurationError(f"devices={devices} must be >= 1, -1 or 'auto'")
        if devices > len(local):
            raise MisconfigurationError(
                f"devices={devices} requested but only {len(local)} {local[0].platform} device(s) are available "
                f"to this process"
            )
        picked = local[:devices]
    elif isinstance(devices, (list, tuple)):
        ids = list(devices)
        bad = [i for i in ids if not (isinstance(i, int) and 0 <= i < len(local))]
        if bad:
            raise MisconfigurationError(f"devices={ids}: indices {bad} do not exist ({len(local)} local devices)")
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        if repeated:
            raise MisconfigurationError(
                f"devices={ids} names device(s) {repeated} more than once; list each local device index once"
            )
        if not ids:
            raise MisconfigurationError("devices=[] names no device; give at least one local device index")
        picked = [local[i] for i in ids]
    else:
        raise MisconfigurationError(f"devices must be an int, a list of device indices, -1 or 'auto', got {devices!r}")
    if jax.process_count() == 1:
        return picked
    # Every process contributes the same number of local devices to one global mesh.
    n = len(picked)
    by_proc: dict[int, list[Any]] = collections.defaultdict(list)
    for d in jax.devices():
        by_proc[d.process_index].append(d)
    return [d for p in sorted(by_proc) for d in by_proc[p][:n]]


def unwritable_reason(path: str | os.PathLike) -> str | None:
    """Why a new file cannot be created in directory ``path`` (or, when it does not exist yet, in its nearest
    existing parent, where it would be made); None when one can. Probes with a real file: permission bits
    say nothing about read-only mounts, and nothing at all to root."""
    here = os.path.abspath(os.fspath(path))
    while not os.path.isdir(here):
        if os.path.lexists(here):
            return f"but {here!r} is not a directory"
        parent = os.path.dirname(here)
        if parent == here:
            return "but none of its parents exists"
        here = parent
    try:
        fd, probe = tempfile.mkstemp(prefix=".jaxlight-write-check-", dir=here)
    except OSError as e:
        return f"but {here!r} does not take new files ({e.strerror or e})"
    os.close(fd)
    os.unlink(probe)
    return None


def check_log_dirs(loggers: Iterable[Logger]) -> None:
    """Refuse a logger whose local directory cannot be written: called at fit start (process 0), before any
    step is compiled, so a read-only log directory fails now rather than when the first metrics are flushed."""
    for lg in loggers:
        try:
            path = lg.log_dir
        except Exception:  # a tracker that only knows its directory once its run exists: nothing to check
            continue
        if not isinstance(path, (str, os.PathLike)) or "://" in os.fspath(path):  # None, or a remote URI
            continue
        reason = unwritable_reason(path)
        if reason is not None:
            error = NotADirectoryMisconfiguration if reason.endswith("is not a directory") else MisconfigurationError
            raise error(
                f"{type(lg).__name__} writes its logs to {os.fspath(path)!r}, {reason}; make it writable, or pass "
                f"the logger another save_dir (or the Trainer another default_root_dir)"
            )


def resolve_loggers(logger: Logger | Iterable[Logger] | bool | None, default_root_dir: str) -> list[Logger]:
    """The ``logger`` argument as a list: a CSVLogger for None/True, none for False."""
    if logger is None or logger is True:
        return [CSVLogger(default_root_dir)]
    if logger is False:
        return []
    if isinstance(logger, Logger):
        return [logger]
    loggers = list(logger)
    for lg in loggers:
        if not isinstance(lg, Logger):
            raise MisconfigurationError(f"logger must be a jaxlight Logger, got {type(lg).__name__}")
    return loggers


__all__ = [
    "ARGUMENT",
    "ARGUMENTS",
    "CONFIG_ARGUMENTS",
    "RUN_AHEAD",
    "Argument",
    "ConfigAttribute",
    "ConfigAttributes",
    "TrainerConfig",
    "check_limit",
    "check_log_dirs",
    "check_steps_per_execution",
    "check_val_cadence",
    "markdown_table",
    "trainer_arguments",
    "resolve_devices",
    "resolve_loggers",
    "unwritable_reason",
]
