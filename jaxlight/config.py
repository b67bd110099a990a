"""The Trainer's arguments after their checks, and the loop constants.

:meth:`TrainerConfig.from_arguments` is where every ``Trainer(...)`` argument
is checked (with the numbers, before any work starts) and resolved
(defaults, ``fast_dev_run``'s overrides, device indices to devices). The
result is frozen: the loops read it and never change it. The Trainer exposes
each field under its Lightning name (``trainer.max_epochs`` is
``trainer.config.max_epochs``); assigning one replaces ``trainer.config``
with a copy (:class:`ConfigAttribute`).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import numbers
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
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


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """Every Trainer argument, checked and resolved (Lightning's names and meanings).

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

    accelerator: str
    devices: tuple[Any, ...]
    num_nodes: int
    precision: Precision
    loggers: tuple[Logger, ...]
    fast_dev_run: int
    max_epochs: int
    min_epochs: int
    max_steps: int
    min_steps: int
    max_time: str | timedelta | dict[str, int] | None
    limit_train_batches: Limit
    limit_val_batches: Limit
    limit_test_batches: Limit
    limit_predict_batches: Limit
    val_check_interval: int | float
    check_val_every_n_epoch: int | None
    num_sanity_val_steps: int
    log_every_n_steps: int
    enable_checkpointing: bool
    enable_progress_bar: bool | None
    enable_model_summary: bool
    accumulate_grad_batches: int
    gradient_clip_val: float | None
    gradient_clip_algorithm: str
    deterministic: bool
    seed: int | None
    default_root_dir: str
    ragged_batches: str
    process_local_batches: bool
    prefetch: int
    compile_cache: bool | str | os.PathLike | None
    device_memory: int | str | None
    steps_per_execution: int = 1

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
    def from_arguments(
        cls,
        *,
        accelerator: str = "auto",
        devices: int | Sequence[int] | str = "auto",
        num_nodes: int = 1,
        precision: str | int = "32-true",
        logger: Logger | Iterable[Logger] | bool | None = None,
        fast_dev_run: int | bool = False,
        max_epochs: int | None = None,
        min_epochs: int | None = None,
        max_steps: int = -1,
        min_steps: int | None = None,
        max_time: str | timedelta | dict[str, int] | None = None,
        limit_train_batches: Limit = None,
        limit_val_batches: Limit = None,
        limit_test_batches: Limit = None,
        limit_predict_batches: Limit = None,
        val_check_interval: int | float | None = None,
        check_val_every_n_epoch: int | None = 1,
        num_sanity_val_steps: int | None = None,
        log_every_n_steps: int | None = None,
        enable_checkpointing: bool | None = None,
        enable_progress_bar: bool | None = None,
        enable_model_summary: bool | None = None,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
        deterministic: bool | None = None,
        seed: int | None = None,
        default_root_dir: str | os.PathLike | None = None,
        ragged_batches: str = "keep",
        process_local_batches: bool = False,
        prefetch: int = 2,
        compile_cache: bool | str | os.PathLike | None = None,
        device_memory: int | str | None = None,
        steps_per_execution: int = 1,
    ) -> TrainerConfig:
        """Check every argument (raising :class:`MisconfigurationError` with the numbers) and resolve it."""
        check_types(locals())
        if accelerator not in ("auto", "cpu", "gpu", "cuda", "tpu"):
            raise MisconfigurationError(f"accelerator={accelerator!r}; choose 'auto', 'cpu', 'gpu' or 'tpu'")
        if accelerator not in ("auto",) and jax.default_backend() != {"cuda": "gpu"}.get(accelerator, accelerator):
            raise MisconfigurationError(f"accelerator={accelerator!r} but JAX's backend is {jax.default_backend()!r}")
        plugin = resolve_precision(precision)
        picked = resolve_devices(devices)
        if num_nodes != 1 and num_nodes != jax.process_count():
            raise MisconfigurationError(
                f"num_nodes={num_nodes} but jax.distributed reports {jax.process_count()} processes"
            )
        if not isinstance(accumulate_grad_batches, int) or accumulate_grad_batches < 1:
            raise MisconfigurationError(f"accumulate_grad_batches must be an int >= 1, got {accumulate_grad_batches!r}")
        if gradient_clip_algorithm not in (None, "norm", "value"):
            raise MisconfigurationError(
                f"gradient_clip_algorithm={gradient_clip_algorithm!r}; choose 'norm' or 'value'"
            )
        if gradient_clip_val is not None and gradient_clip_val < 0:
            raise MisconfigurationError(f"gradient_clip_val must be >= 0, got {gradient_clip_val}")
        if ragged_batches not in ("keep", "error", "drop"):
            raise MisconfigurationError(
                f"ragged_batches={ragged_batches!r}; choose 'error' or 'drop', or 'keep' (the default: a shorter "
                f"train batch runs in a step compiled for its own shape, as Lightning trains it)"
            )
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise MisconfigurationError(
                f"prefetch must be an int >= 0 (batches read ahead on a background thread; 0 reads them inline), "
                f"got {prefetch!r}"
            )
        check_steps_per_execution(steps_per_execution)
        if deterministic and jax.default_backend() == "gpu":
            if "xla_gpu_deterministic_ops" not in os.environ.get("XLA_FLAGS", ""):
                raise MisconfigurationError(
                    "deterministic=True on GPU needs XLA_FLAGS=--xla_gpu_deterministic_ops=true set before JAX starts"
                )

        # fast_dev_run: n batches of each stage, no sanity check, no loggers or checkpoints.
        if fast_dev_run is True:
            fast_dev_run = 1
        if isinstance(fast_dev_run, int) and fast_dev_run < 0:
            raise MisconfigurationError(f"fast_dev_run={fast_dev_run} must be >= 0 or a bool")
        fast_dev_run = int(fast_dev_run)
        if fast_dev_run:
            n = fast_dev_run
            limit_train_batches = limit_val_batches = limit_test_batches = limit_predict_batches = n
            max_steps, max_epochs, num_sanity_val_steps = n, 1, 0
            val_check_interval, check_val_every_n_epoch = 1.0, 1
            logger, enable_checkpointing = False, False

        limits = {
            name: check_limit(name, value)
            for name, value in (
                ("limit_train_batches", limit_train_batches),
                ("limit_val_batches", limit_val_batches),
                ("limit_test_batches", limit_test_batches),
                ("limit_predict_batches", limit_predict_batches),
            )
        }
        if max_epochs is None:
            max_epochs = 1000 if max_steps == -1 and max_time is None else -1
        if max_steps is None or max_steps < -1:
            raise MisconfigurationError(f"max_steps must be -1 (no limit) or >= 0, got {max_steps}")
        if max_epochs < -1:
            raise MisconfigurationError(f"max_epochs must be -1 (no limit) or >= 0, got {max_epochs}")
        for name, value in (("min_epochs", min_epochs), ("min_steps", min_steps)):
            if value is not None and value < 0:
                raise MisconfigurationError(f"{name} must be >= 0 (or None: no minimum), got {value}")
        if num_sanity_val_steps is not None and num_sanity_val_steps < -1:
            raise MisconfigurationError(
                f"num_sanity_val_steps must be -1 (every validation batch) or >= 0, got {num_sanity_val_steps}"
            )
        if check_val_every_n_epoch is None and isinstance(val_check_interval, float):
            raise MisconfigurationError(
                f"val_check_interval={val_check_interval} is a fraction of an epoch, but check_val_every_n_epoch=None "
                f"counts batches across epochs: pass an int number of batches"
            )
        if val_check_interval is None:
            val_check_interval = 1.0
        if isinstance(val_check_interval, float) and not (0.0 < val_check_interval <= 1.0):
            raise MisconfigurationError(f"val_check_interval={val_check_interval} as a float must be in (0, 1]")
        if isinstance(val_check_interval, int) and val_check_interval < 1:
            raise MisconfigurationError(f"val_check_interval={val_check_interval} as an int must be >= 1")
        if check_val_every_n_epoch is not None and check_val_every_n_epoch < 1:
            raise MisconfigurationError(f"check_val_every_n_epoch must be >= 1 or None, got {check_val_every_n_epoch}")
        log_every_n_steps = 50 if log_every_n_steps is None else log_every_n_steps
        if log_every_n_steps < 1:
            raise MisconfigurationError(f"log_every_n_steps must be >= 1, got {log_every_n_steps}")
        root = os.fspath(default_root_dir) if default_root_dir is not None else os.getcwd()
        return cls(
            accelerator=accelerator,
            devices=tuple(picked),
            num_nodes=num_nodes,
            precision=plugin,
            loggers=tuple(resolve_loggers(logger, root)),
            fast_dev_run=fast_dev_run,
            max_epochs=max_epochs,
            min_epochs=min_epochs or 0,
            max_steps=max_steps,
            min_steps=min_steps or 0,
            max_time=max_time,
            **limits,
            val_check_interval=val_check_interval,
            check_val_every_n_epoch=check_val_every_n_epoch,
            num_sanity_val_steps=2 if num_sanity_val_steps is None else num_sanity_val_steps,
            log_every_n_steps=log_every_n_steps,
            enable_checkpointing=enable_checkpointing is not False,
            enable_progress_bar=enable_progress_bar,
            enable_model_summary=True if enable_model_summary is None else enable_model_summary,
            accumulate_grad_batches=accumulate_grad_batches,
            gradient_clip_val=gradient_clip_val,
            gradient_clip_algorithm=gradient_clip_algorithm or "norm",
            deterministic=bool(deterministic),
            seed=seed,
            default_root_dir=root,
            ragged_batches=ragged_batches,
            process_local_batches=process_local_batches,
            prefetch=prefetch,
            compile_cache=compile_cache,
            device_memory=device_memory,
            steps_per_execution=int(steps_per_execution),
        )


class ConfigAttribute:
    """A Trainer attribute that is a :class:`TrainerConfig` field (``trainer.max_epochs``).

    Reading returns the config's value; assigning replaces ``trainer.config``
    with a copy holding the new value (unchecked, as a plain attribute
    assignment was), which the next ``fit``/``validate``/``test``/``predict``
    call runs with.
    """

    def __init__(self, field: str | None = None) -> None:
        self.field = field

    def __set_name__(self, owner: type, name: str) -> None:
        self.field = self.field or name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.config, self.field)

    def __set__(self, obj: Any, value: Any) -> None:
        obj.config = dataclasses.replace(obj.config, **{self.field: value})


class ConfigAttributes:
    """The Trainer's argument attributes under Lightning's names, each read from ``self.config``."""

    config: TrainerConfig
    precision_plugin = ConfigAttribute("precision")
    fast_dev_run = ConfigAttribute()
    max_epochs = ConfigAttribute()
    min_epochs = ConfigAttribute()
    max_steps = ConfigAttribute()
    min_steps = ConfigAttribute()
    limit_train_batches = ConfigAttribute()
    limit_val_batches = ConfigAttribute()
    limit_test_batches = ConfigAttribute()
    limit_predict_batches = ConfigAttribute()
    val_check_interval = ConfigAttribute()
    check_val_every_n_epoch = ConfigAttribute()
    num_sanity_val_steps = ConfigAttribute()
    log_every_n_steps = ConfigAttribute()
    enable_checkpointing = ConfigAttribute()
    enable_model_summary = ConfigAttribute()
    accumulate_grad_batches = ConfigAttribute()
    gradient_clip_val = ConfigAttribute()
    gradient_clip_algorithm = ConfigAttribute()
    deterministic = ConfigAttribute()
    seed = ConfigAttribute()
    default_root_dir = ConfigAttribute()
    ragged_batches = ConfigAttribute()
    process_local_batches = ConfigAttribute()
    prefetch = ConfigAttribute()
    steps_per_execution = ConfigAttribute()

    @property
    def precision(self) -> str:
        """The precision's name (``"32-true"``, ``"bf16-mixed"`` ...)."""
        return self.config.precision.name


# Integer arguments, and what each accepts (the type check runs before any range check compares them)
_INT_ARGUMENTS = {
    "max_epochs": "an int (-1: no limit) or None",
    "min_epochs": "an int >= 0 or None",
    "max_steps": "an int (-1: no limit)",
    "min_steps": "an int >= 0 or None",
    "num_sanity_val_steps": "an int (-1: every validation batch) or None",
    "log_every_n_steps": "an int >= 1 or None",
    "check_val_every_n_epoch": "an int >= 1 or None",
    "accumulate_grad_batches": "an int >= 1",
    "num_nodes": "an int >= 1",
    "seed": "an int or None",
}
_FLAG_ARGUMENTS = ("enable_checkpointing", "enable_progress_bar", "enable_model_summary", "process_local_batches")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_types(arguments: Mapping[str, Any]) -> None:
    """Refuse a ``Trainer`` argument of the wrong type, naming it, its value and its type.

    Runs before the range checks, so ``max_steps="10"`` is a :class:`MisconfigurationError` saying so rather
    than a ``TypeError`` from comparing a string with -1.
    """
    for name, accepted in _INT_ARGUMENTS.items():
        value = arguments.get(name)
        if value is not None and not _is_int(value):
            raise MisconfigurationError(f"{name} must be {accepted}, got {value!r} ({type(value).__name__})")
    for name in _FLAG_ARGUMENTS:
        value = arguments.get(name)
        if value is not None and not isinstance(value, bool):
            raise MisconfigurationError(f"{name} must be True, False or None, got {value!r} ({type(value).__name__})")
    fdr = arguments.get("fast_dev_run", False)
    if not isinstance(fdr, bool) and not _is_int(fdr):
        raise MisconfigurationError(f"fast_dev_run must be a bool or an int >= 0, got {fdr!r} ({type(fdr).__name__})")
    vci = arguments.get("val_check_interval")
    if vci is not None and (isinstance(vci, bool) or not isinstance(vci, (numbers.Integral, float))):
        raise MisconfigurationError(
            f"val_check_interval must be an int (batches) or a float in (0, 1] (a fraction of an epoch), "
            f"got {vci!r} ({type(vci).__name__})"
        )
    clip = arguments.get("gradient_clip_val")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, numbers.Real) or not math.isfinite(clip)):
        raise MisconfigurationError(f"gradient_clip_val must be a finite number >= 0 or None, got {clip!r}")
    root = arguments.get("default_root_dir")
    if root is not None and not isinstance(root, (str, os.PathLike)):
        raise MisconfigurationError(f"default_root_dir must be a path (str or os.PathLike), got {type(root).__name__}")


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
    "RUN_AHEAD",
    "ConfigAttribute",
    "ConfigAttributes",
    "TrainerConfig",
    "check_limit",
    "check_log_dirs",
    "check_steps_per_execution",
    "check_types",
    "resolve_devices",
    "resolve_loggers",
    "unwritable_reason",
]
