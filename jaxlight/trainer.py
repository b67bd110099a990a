"""The Trainer: Lightning's arguments, hook dispatch and the public fit/validate/test/predict.

Read top to bottom: ``__init__`` checks every argument before any work;
``fit`` attaches the module, lets the :class:`~jaxlight.engine.Engine` create
its state on the mesh and place the optimizer, then runs the
:class:`~jaxlight.loops.FitLoop`; ``validate``/``test``/``predict`` run the
:class:`~jaxlight.loops.EvalLoop`. Hooks go through :meth:`Trainer.call_hook`
in Lightning's order: callbacks first, then the module. Logged values travel
through the :class:`~jaxlight.reporting.MetricReporter`; the fit loop's
counters live in :class:`~jaxlight.position.LoopPosition`.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import jax

from jaxlight.callbacks.callback import Callback
from jaxlight.callbacks.progress import TQDMProgressBar
from jaxlight.callbacks.timer import Timer
from jaxlight.checkpoint import find_last_checkpoint, restore_logger_states
from jaxlight.compile_cache import configure_compile_cache
from jaxlight.data import split_loaders
from jaxlight.datamodule import LightningDataModule
from jaxlight.engine import Engine
from jaxlight.errors import MisconfigurationError
from jaxlight.loggers.csv_logs import CSVLogger
from jaxlight.loggers.logger import Logger, LoggerCollection
from jaxlight.loops import EvalLoop, FitLoop, batch_limit, loader_for, train_batches
from jaxlight.module import LightningModule
from jaxlight.optim import configure as configure_optimizer
from jaxlight.planner import AutoStrategy
from jaxlight.position import LoopPosition
from jaxlight.precision import resolve_precision
from jaxlight.rank_zero import sync_rank
from jaxlight.reporting import MetricReporter
from jaxlight.stages import STAGES, TRAIN
from jaxlight.step import TrainState
from jaxlight.strategies.strategy import Piece, Strategy, resolve_strategy
from jaxlight.summary import summarize

__all__ = ["MisconfigurationError", "Trainer"]


def _check_limit(name: str, value: int | float | None) -> int | float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MisconfigurationError(f"{name} must be an int or a float in [0, 1], got {value!r}")
    if isinstance(value, float) and not (0.0 <= value <= 1.0):
        raise MisconfigurationError(f"{name}={value} as a float must be within [0.0, 1.0]")
    if isinstance(value, int) and value < 0:
        raise MisconfigurationError(f"{name}={value} must be >= 0")
    return value


def _resolve_devices(devices: Any) -> list[Any]:
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


class Trainer:
    """Runs a LightningModule: fit, validate, test, predict, on a device mesh.

    Arguments keep PyTorch Lightning's names and meanings. Guarantees: one
    compilation of the train step per fit and one per eval stage; the train
    state is donated (updated in place); no host sync per step beyond a
    bounded run-ahead of four steps, with logged values fetched only every
    ``log_every_n_steps`` and at epoch end; bad arguments raise before any
    work starts, with the numbers.
    """

    def __init__(
        self,
        *,
        accelerator: str = "auto",
        strategy: str | Strategy | Piece = "auto",
        devices: int | Sequence[int] | str = "auto",
        num_nodes: int = 1,
        precision: str | int = "32-true",
        logger: Logger | Iterable[Logger] | bool | None = None,
        callbacks: Callback | Sequence[Callback] | None = None,
        fast_dev_run: int | bool = False,
        max_epochs: int | None = None,
        min_epochs: int | None = None,
        max_steps: int = -1,
        min_steps: int | None = None,
        max_time: str | timedelta | dict[str, int] | None = None,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        limit_test_batches: int | float | None = None,
        limit_predict_batches: int | float | None = None,
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
        ragged_batches: str = "error",
        process_local_batches: bool = False,
        prefetch: int = 2,
        compile_cache: bool | str | os.PathLike | None = None,
        device_memory: int | str | None = None,
    ) -> None:
        if accelerator not in ("auto", "cpu", "gpu", "cuda", "tpu"):
            raise MisconfigurationError(f"accelerator={accelerator!r}; choose 'auto', 'cpu', 'gpu' or 'tpu'")
        if accelerator not in ("auto",) and jax.default_backend() != {"cuda": "gpu"}.get(accelerator, accelerator):
            raise MisconfigurationError(f"accelerator={accelerator!r} but JAX's backend is {jax.default_backend()!r}")
        self.precision_plugin = resolve_precision(precision)
        self.precision = self.precision_plugin.name
        self.strategy = resolve_strategy(strategy)
        # strategy="auto": the layout is chosen by memory at the start of fit (jaxlight/strategies/auto.py)
        self.auto_strategy = AutoStrategy.for_trainer(strategy, device_memory)
        self._devices = _resolve_devices(devices)
        if num_nodes != 1 and num_nodes != jax.process_count():
            raise MisconfigurationError(
                f"num_nodes={num_nodes} but jax.distributed reports {jax.process_count()} processes"
            )
        self.mesh = self.strategy.build_mesh(self._devices)
        self.engine = Engine(self.strategy, self.mesh, self.precision_plugin)

        if not isinstance(accumulate_grad_batches, int) or accumulate_grad_batches < 1:
            raise MisconfigurationError(f"accumulate_grad_batches must be an int >= 1, got {accumulate_grad_batches!r}")
        if gradient_clip_algorithm not in (None, "norm", "value"):
            raise MisconfigurationError(
                f"gradient_clip_algorithm={gradient_clip_algorithm!r}; choose 'norm' or 'value'"
            )
        if gradient_clip_val is not None and gradient_clip_val < 0:
            raise MisconfigurationError(f"gradient_clip_val must be >= 0, got {gradient_clip_val}")
        if ragged_batches not in ("error", "drop"):
            raise MisconfigurationError(f"ragged_batches={ragged_batches!r}; choose 'error' or 'drop'")
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val = gradient_clip_val
        self.gradient_clip_algorithm = gradient_clip_algorithm or "norm"
        self.ragged_batches = ragged_batches
        self.process_local_batches = process_local_batches
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise MisconfigurationError(
                f"prefetch must be an int >= 0 (batches read ahead on a background thread; 0 reads them inline), "
                f"got {prefetch!r}"
            )
        self.prefetch = prefetch
        self.compile_cache = configure_compile_cache(compile_cache)
        self.deterministic = bool(deterministic)
        sync_rank()  # lightning-utilities' rank_zero_* helpers follow JAX's process index
        if seed is not None:
            from jaxlight.seed import seed_everything

            seed_everything(seed)
        self.seed = seed
        if self.deterministic and jax.default_backend() == "gpu":
            flags = os.environ.get("XLA_FLAGS", "")
            if "xla_gpu_deterministic_ops" not in flags:
                raise MisconfigurationError(
                    "deterministic=True on GPU needs XLA_FLAGS=--xla_gpu_deterministic_ops=true set before JAX starts"
                )

        # fast_dev_run: n batches of each stage, no sanity check, no loggers or checkpoints.
        if fast_dev_run is True:
            fast_dev_run = 1
        if isinstance(fast_dev_run, int) and fast_dev_run < 0:
            raise MisconfigurationError(f"fast_dev_run={fast_dev_run} must be >= 0 or a bool")
        self.fast_dev_run = int(fast_dev_run)
        if self.fast_dev_run:
            n = self.fast_dev_run
            limit_train_batches = limit_val_batches = limit_test_batches = limit_predict_batches = n
            max_steps, max_epochs, num_sanity_val_steps = n, 1, 0
            val_check_interval, check_val_every_n_epoch = 1.0, 1
            logger, enable_checkpointing = False, False

        self.limit_train_batches = _check_limit("limit_train_batches", limit_train_batches)
        self.limit_val_batches = _check_limit("limit_val_batches", limit_val_batches)
        self.limit_test_batches = _check_limit("limit_test_batches", limit_test_batches)
        self.limit_predict_batches = _check_limit("limit_predict_batches", limit_predict_batches)
        if max_epochs is None:
            max_epochs = 1000 if max_steps == -1 and max_time is None else -1
        if max_steps is None or max_steps < -1:
            raise MisconfigurationError(f"max_steps must be -1 (no limit) or >= 0, got {max_steps}")
        self.max_epochs = max_epochs
        self.min_epochs = min_epochs or 0
        self.max_steps = max_steps
        self.min_steps = min_steps or 0
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
        self.val_check_interval = val_check_interval
        if check_val_every_n_epoch is not None and check_val_every_n_epoch < 1:
            raise MisconfigurationError(f"check_val_every_n_epoch must be >= 1 or None, got {check_val_every_n_epoch}")
        self.check_val_every_n_epoch = check_val_every_n_epoch
        self.num_sanity_val_steps = 2 if num_sanity_val_steps is None else num_sanity_val_steps
        self.log_every_n_steps = 50 if log_every_n_steps is None else log_every_n_steps
        if self.log_every_n_steps < 1:
            raise MisconfigurationError(f"log_every_n_steps must be >= 1, got {self.log_every_n_steps}")
        self.enable_model_summary = True if enable_model_summary is None else enable_model_summary
        self.default_root_dir = os.fspath(default_root_dir) if default_root_dir is not None else os.getcwd()

        # callbacks
        if callbacks is None:
            cbs: list[Callback] = []
        elif isinstance(callbacks, Callback):
            cbs = [callbacks]
        else:
            cbs = list(callbacks)
        for cb in cbs:
            if not isinstance(cb, Callback):
                raise MisconfigurationError(f"callbacks must be jaxlight.Callback instances, got {type(cb).__name__}")
        if enable_progress_bar is not False and not any(isinstance(c, TQDMProgressBar) for c in cbs):
            cbs.append(TQDMProgressBar())
        if enable_progress_bar is False:
            cbs = [c for c in cbs if not isinstance(c, TQDMProgressBar)]
        if max_time is not None:
            cbs = [c for c in cbs if not isinstance(c, Timer)] + [Timer(max_time, interval="step")]
        self.enable_checkpointing = enable_checkpointing is not False
        if self.enable_checkpointing:
            cbs = self._add_default_checkpoint(cbs)
        if not self.fast_dev_run:
            cbs = self._add_default_preemption(cbs)
        self.callbacks: list[Callback] = _checkpoint_callbacks_last(cbs)

        # loggers
        if logger is None or logger is True:
            self.loggers: list[Logger] = [CSVLogger(self.default_root_dir)]
        elif logger is False:
            self.loggers = []
        elif isinstance(logger, Logger):
            self.loggers = [logger]
        else:
            self.loggers = list(logger)
            for lg in self.loggers:
                if not isinstance(lg, Logger):
                    raise MisconfigurationError(f"logger must be a jaxlight Logger, got {type(lg).__name__}")

        # run state
        self.position = LoopPosition()
        self.reporter = MetricReporter(self)
        self.should_stop = False
        self.sanity_checking = False
        self.training = self.validating = self.testing = self.predicting = False
        self.num_training_batches: int | float = math.inf
        self.num_val_batches: int | float = 0
        self.num_test_batches: int | float = 0
        self.num_predict_batches: int | float = 0
        self.lightning_module: LightningModule | None = None
        self.datamodule: LightningDataModule | None = None
        self.batch_idx = 0
        self.ckpt_path: str | None = None  # the checkpoint this run restored from (Lightning's name)
        self.train_dataloader: Any = None
        self.val_dataloaders: Any = None
        self.test_dataloaders: Any = None
        self.predict_dataloaders: Any = None
        self._hooks: dict[str, tuple[list[Callback], bool]] = {}
        self._module_readers: set[str] = set()

    # ------------------------------------------------------------------ props
    @property
    def is_global_zero(self) -> bool:
        return jax.process_index() == 0

    @property
    def global_rank(self) -> int:
        return jax.process_index()

    @property
    def world_size(self) -> int:
        return jax.process_count()

    @property
    def num_devices(self) -> int:
        return len(self._devices)

    @property
    def global_step(self) -> int:
        """Optimizer updates applied so far (micro-batches inside accumulation do not count)."""
        return self.position.global_step

    @global_step.setter
    def global_step(self, value: int) -> None:
        self.position.global_step = value

    @property
    def current_epoch(self) -> int:
        """Completed epochs."""
        return self.position.epoch

    @current_epoch.setter
    def current_epoch(self, value: int) -> None:
        self.position.epoch = value

    @property
    def train_state(self) -> TrainState | None:
        """Everything the compiled train step reads and writes (donated each step; None before fit)."""
        return self.engine.train_state

    @train_state.setter
    def train_state(self, value: TrainState | None) -> None:
        self.engine.train_state = value

    @property
    def compiled(self) -> dict[str, Any]:
        """The compiled step of each stage run so far (``jax.stages.Compiled``)."""
        return self.engine.compiled

    @property
    def compile_counts(self) -> collections.Counter:
        """How many times each stage's step was compiled (once per model)."""
        return self.engine.compile_counts

    @property
    def estimated_stepping_batches(self) -> int | float:
        """Optimizer steps ``fit`` will take, computed as Lightning does (available in ``configure_optimizers``).

        ``ceil(num_training_batches / accumulate_grad_batches) * max_epochs``
        (the ceil counts the partial accumulation window that steps at each
        epoch's end), capped by ``max_steps``; ``max_steps`` when the epoch
        length is unknown or ``max_epochs=-1`` (``inf`` if neither is set).
        """
        if self.max_epochs == -1:
            return math.inf if self.max_steps == -1 else self.max_steps
        total = self.num_training_batches
        if total == math.inf:
            if self.lightning_module is None or self.train_dataloader is None:
                raise MisconfigurationError(
                    "estimated_stepping_batches needs the train loader: read it during fit (e.g. in "
                    "configure_optimizers)"
                )
            return self.max_steps
        steps = math.ceil(total / self.accumulate_grad_batches) * max(self.max_epochs, 1)
        return min(steps, self.max_steps) if self.max_steps != -1 else steps

    @property
    def callback_metrics(self) -> dict[str, Any]:
        return self.reporter.callback_metrics

    @property
    def logged_metrics(self) -> dict[str, Any]:
        """What went (or goes, at the next logging step) to the loggers, by logged name; no ``epoch`` entry.
        Values logged in the last step are device arrays (held by reference, no sync) until fetched."""
        return self.reporter.logged_metrics

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        return self.reporter.progress_bar_metrics

    @property
    def logger(self) -> Logger | None:
        return self.loggers[0] if self.loggers else None

    @property
    def log_dir(self) -> str:
        lg = self.logger
        if lg is not None and lg.log_dir is not None:
            return lg.log_dir
        return self.default_root_dir

    @property
    def model(self) -> LightningModule | None:
        return self.lightning_module

    @property
    def lr_scheduler_configs(self) -> list[Any]:
        return list(self.engine.optimizer.schedules) if self.engine.optimizer is not None else []

    @property
    def progress_bar_callback(self) -> TQDMProgressBar | None:
        return next((c for c in self.callbacks if isinstance(c, TQDMProgressBar)), None)

    @property
    def checkpoint_callbacks(self) -> list[Callback]:
        return [c for c in self.callbacks if c.is_checkpoint_callback]

    @property
    def checkpoint_callback(self) -> Callback | None:
        cbs = self.checkpoint_callbacks
        return cbs[0] if cbs else None

    def _add_default_checkpoint(self, cbs: list[Callback]) -> list[Callback]:
        from jaxlight.callbacks.model_checkpoint import ModelCheckpoint

        if not any(isinstance(c, ModelCheckpoint) for c in cbs):
            cbs = [*cbs, ModelCheckpoint()]
        return cbs

    def _add_default_preemption(self, cbs: list[Callback]) -> list[Callback]:
        from jaxlight.callbacks.preemption import Preemption

        return cbs if any(isinstance(c, Preemption) for c in cbs) else [*cbs, Preemption()]

    # ------------------------------------------------------------------ hooks
    def _build_hook_table(self) -> None:
        """Per hook, the callbacks that implement it and whether the module does: the dispatch
        below then never calls a no-op (this runs twice per step on the train path)."""
        self._hooks = {}
        module = self.lightning_module
        for name, fn in vars(Callback).items():
            if name.startswith("_") or not callable(fn):
                continue
            cbs = [c for c in self.callbacks if name in vars(c) or getattr(type(c), name) is not fn]
            impl = getattr(type(module), name, None) if module is not None else None
            mod = module is not None and (name in vars(module) or impl is not getattr(LightningModule, name, None))
            self._hooks[name] = (cbs, mod and hasattr(module, name))
        # Hooks whose user code may read the module's NNX attributes between train steps (the step donates
        # the arrays they point at): the loop re-points them at the new state before calling these only.
        self._module_readers = set()
        saving = any(_user_code(c.on_save_checkpoint) for c in self._hooks["on_save_checkpoint"][0])
        saving |= module is not None and self._hooks["on_save_checkpoint"][1]
        for name in ("on_train_batch_start", "on_train_batch_end"):
            cbs, mod = self._hooks[name]
            user = any(_user_code(getattr(c, name)) for c in cbs) or (mod and _user_code(getattr(module, name)))
            if user or (saving and cbs):
                self._module_readers.add(name)

    def hook_reads_module(self, hook: str) -> bool:
        """Whether a user's implementation of per-batch ``hook`` runs this fit (so the loop points the
        module's attributes at the current train state first; jaxlight's own callbacks never read them)."""
        return hook in self._module_readers

    def call_hook(self, hook: str, *args: Any, module: bool = True, callbacks: Sequence[Callback] | None = None) -> Any:
        """Call ``hook`` on the callbacks (those given, or every one that implements it), then on the
        module; host-side ``self.log`` calls made inside take the hook's defaults. Returns the module's
        result."""
        table = self._hooks.get(hook)
        if table is None:
            cbs, mod = list(self.callbacks), hasattr(self.lightning_module, hook)
        else:
            cbs, mod = table
        if callbacks is not None:
            cbs = [c for c in callbacks if c in cbs or table is None]
        run_module = module and mod and self.lightning_module is not None
        if not cbs and not run_module:
            return None  # nothing implements it: no bookkeeping (the train loop asks twice per step)
        reporter = self.reporter
        result = None
        with reporter.in_hook(hook):
            for cb in cbs:
                getattr(cb, hook)(self, self.lightning_module, *args)
                reporter.flush_host_logs()
            if run_module:
                result = getattr(self.lightning_module, hook)(*args)
                reporter.flush_host_logs()
        return result

    def call_module_hook(self, hook: str, *args: Any) -> Any:
        """Call a module-only hook (``configure_optimizers``, ``on_validation_model_eval`` ...)."""
        with self.reporter.in_hook(hook):
            out = getattr(self.lightning_module, hook)(*args)
            self.reporter.flush_host_logs()
            return out

    # ---------------------------------------------------------------- run wrapper
    def _attach(self, model: LightningModule, datamodule: LightningDataModule | None) -> None:
        if not isinstance(model, LightningModule):
            raise MisconfigurationError(f"model must be a jaxlight.LightningModule, got {type(model).__name__}")
        if datamodule is not None and not isinstance(datamodule, LightningDataModule):
            raise MisconfigurationError(
                f"datamodule must be a jaxlight.LightningDataModule, got {type(datamodule).__name__}"
            )
        self.engine.attach(model)
        self.lightning_module = model
        model.trainer = self
        if datamodule is not None:
            self.datamodule = datamodule
            datamodule.trainer = self
        extra = model.configure_callbacks()
        extra = [extra] if isinstance(extra, Callback) else list(extra or [])
        if extra:
            kinds = {type(c) for c in extra}
            self.callbacks = _checkpoint_callbacks_last([c for c in self.callbacks if type(c) not in kinds] + extra)
        self._build_hook_table()

    @contextlib.contextmanager
    def _run(self, stage: str, model: LightningModule, datamodule: LightningDataModule | None) -> Iterator[None]:
        self._attach(model, datamodule)
        self.reporter.stage = stage
        setup_stage = STAGES[stage].fn
        status = "success"
        try:
            if self.datamodule is not None and self.is_global_zero:
                self.datamodule.prepare_data()
            if self.is_global_zero:
                self.call_module_hook("prepare_data")
            if self.datamodule is not None:
                self.datamodule.setup(setup_stage)
            self.call_hook("setup", setup_stage)
            self.reporter.reset()  # Lightning: every run starts with empty metric views
            yield
        except BaseException as e:
            status = "failed"
            if stage == "train":
                try:  # leave the module usable with the last completed step's weights
                    self.engine.sync_module()
                except Exception:
                    pass  # e.g. the state was donated to the failed step
            for cb in self.callbacks:
                try:
                    cb.on_exception(self, self.lightning_module, e)
                except Exception:
                    pass  # the original error matters more
            if hasattr(self.lightning_module, "on_exception"):
                try:
                    self.lightning_module.on_exception(e)  # type: ignore[union-attr]
                except Exception:
                    pass
            raise
        finally:
            if self.loggers and self.is_global_zero:
                try:
                    LoggerCollection(self.loggers).finalize(status)
                except Exception:
                    if status == "success":
                        raise
            if self.datamodule is not None:
                self.datamodule.teardown(setup_stage)
            self.call_hook("teardown", setup_stage)
            self.reporter.stage = "train"
            self.training = self.validating = self.testing = self.predicting = False

    # ---------------------------------------------------------------- fit
    def fit(
        self,
        model: LightningModule,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: LightningDataModule | None = None,
        ckpt_path: str | None = None,
    ) -> None:
        """Train ``model``; afterwards its NNX attributes hold the trained values.

        ``train_dataloaders`` may also be a LightningDataModule (Lightning's
        positional shortcut). ``ckpt_path`` ("last", "best" or a path)
        resumes from a checkpoint with the optimizer, loop position and
        callback states.
        """
        if isinstance(train_dataloaders, LightningDataModule):
            datamodule, train_dataloaders = train_dataloaders, None
        if datamodule is not None and (train_dataloaders is not None or val_dataloaders is not None):
            raise MisconfigurationError("pass either dataloaders or a datamodule to fit, not both")
        if isinstance(model, LightningModule) and model.frozen:
            raise MisconfigurationError(
                f"{type(model).__name__} is frozen (freeze() was called, for inference): call model.unfreeze() "
                f"before fit. To train part of the model, keep it unfrozen and mask the optimizer instead"
            )
        with self._run("train", model, datamodule):
            self.should_stop = False
            # val before train: Lightning's order (sanity check first); both before any work is done
            val_loaders = split_loaders(loader_for(self, STAGES["validate"], val_dataloaders))
            train_loader = loader_for(self, TRAIN, train_dataloaders)
            if train_loader is None:
                raise MisconfigurationError("fit needs train_dataloaders, a datamodule or model.train_dataloader()")
            if val_loaders and not model._overrides("validation_step"):
                # Lightning: a val loader without validation_step skips validation, with a warning
                warnings.warn(
                    f"{type(model).__name__} has a val dataloader but no validation_step; skipping validation",
                    stacklevel=2,
                )
                val_loaders = []
            self.train_dataloader = train_loader
            self.val_dataloaders = (val_loaders[0] if len(val_loaders) == 1 else val_loaders) or None
            # known before configure_optimizers, so a schedule can be sized (estimated_stepping_batches)
            self.num_training_batches = train_batches(self, train_loader)
            if self.loggers and self.is_global_zero:
                if ckpt_path is not None and (ckpt_path != "last" or find_last_checkpoint(self) is not None):
                    restore_logger_states(self, ckpt_path)  # a resumed run keeps logging into its own runs
                LoggerCollection(self.loggers).setup()  # a misconfigured tracker fails before any compile
            if self.auto_strategy is not None:  # strategy="auto": pick the layout by memory (strategies/auto.py)
                chosen = self.auto_strategy.choose(self, self._devices, train_loader)
                if chosen != self.strategy:
                    self.strategy, self.mesh = chosen, chosen.build_mesh(self._devices)
                    self.engine = Engine(chosen, self.mesh, self.precision_plugin)
                    self.engine.attach(model)
            self.engine.setup_model()
            optimizer = configure_optimizer(
                self.call_module_hook("configure_optimizers"),
                gradient_clip_val=self.gradient_clip_val,
                gradient_clip_algorithm=self.gradient_clip_algorithm,
                accumulate_grad_batches=self.accumulate_grad_batches,
            )
            # -- LP2 (issue 11): plateau and epoch-interval schedulers are stepped on the host by a callback,
            # placed first so LearningRateMonitor reads the rates it sets.
            from jaxlight.callbacks.lr_scheduler import LRSchedulerStepper

            others = [c for c in self.callbacks if not isinstance(c, LRSchedulerStepper)]
            stepper = [LRSchedulerStepper()] if optimizer.host_stepped else []
            if stepper or len(others) != len(self.callbacks):
                self.callbacks = _checkpoint_callbacks_last(stepper + others)
                self._build_hook_table()
            # -- end LP2
            self.engine.setup_training(optimizer, self.callbacks, self, self.global_step)
            if ckpt_path is not None:
                self._restore(ckpt_path, stage="fit")
            if self.checkpoint_callbacks:
                from jaxlight.checkpoint import check_hparams

                check_hparams(model, self.datamodule)  # fail now, not at the first save an epoch later
            if self.loggers and self.is_global_zero and getattr(model, "_log_hyperparams", True):
                hp = dict(model.hparams)
                if self.datamodule is not None and hasattr(self.datamodule, "hparams"):
                    hp.update(dict(self.datamodule.hparams))
                if hp:
                    LoggerCollection(self.loggers).log_hyperparams(hp)
            from jaxlight.callbacks.model_summary import ModelSummary  # a ModelSummary callback prints instead

            if (
                self.enable_model_summary
                and self.is_global_zero
                and not any(isinstance(c, ModelSummary) for c in self.callbacks)
            ):
                assert self.train_state is not None
                print(summarize(self.train_state.params, self.train_state.opt_state, self.mesh))
            before = self.engine.module_leaves()
            self.call_hook("on_fit_start")
            after = self.engine.module_leaves()
            if len(before) != len(after) or any(a is not b for a, b in zip(before, after)):
                # the user loaded weights into the module (Lightning users do it in on_fit_start): train those
                self.engine.adopt_module_edits()
            loop = FitLoop(self)
            if (
                loop.validation_enabled(val_loaders)
                and self.num_sanity_val_steps != 0
                and not self.position.resume_offset
            ):
                loop.sanity_check(val_loaders)  # Lightning: not when resuming inside an epoch
            loop.run(train_loader, val_loaders)
            self.call_hook("on_fit_end")
        for cb in self.callbacks:
            cb.wait_until_finished()

    def _restore(self, ckpt_path: str, stage: str) -> None:
        from jaxlight.checkpoint import no_last_checkpoint_reason, restore_into_trainer

        if ckpt_path == "last" and find_last_checkpoint(self) is None:
            # Lightning: not an error, so a script can always pass ckpt_path="last" (resume if there is one)
            warnings.warn(
                f"{no_last_checkpoint_reason(self)}; {stage}() starts without a checkpoint", UserWarning, stacklevel=3
            )
            return
        restore_into_trainer(self, ckpt_path, stage)

    def save_checkpoint(self, filepath: str | os.PathLike, weights_only: bool = False) -> None:
        """Write the run's state to the new directory ``filepath`` and wait until it is committed.

        Lightning's ``trainer.save_checkpoint``: every process must call it. The
        checkpoint resumes with ``fit(ckpt_path=filepath)`` or loads with
        ``Module.load_from_checkpoint(filepath)`` (see docs/checkpointing.md).
        """
        from jaxlight.checkpoint import save_checkpoint

        save_checkpoint(self, filepath, weights_only=weights_only)

    def eval_params(self) -> dict[str, jax.Array]:
        """Parameters evaluation runs on: the trained ones, or a callback's (e.g. EMA) when it provides them."""
        assert self.train_state is not None
        params = self.train_state.params
        for cb in self.callbacks:
            alt = cb.eval_params(self, params)
            if alt is not None:
                params = alt
        return params

    # ---------------------------------------------------------------- validate / test / predict
    def _run_eval(
        self,
        stage: str,
        model: LightningModule | None,
        dataloaders: Any,
        ckpt_path: str | None,
        datamodule: LightningDataModule | None,
    ) -> Any:
        if model is None:
            model = self.lightning_module
            if model is None:
                raise MisconfigurationError(f"{stage}() needs a model (none was fitted with this trainer)")
        if isinstance(dataloaders, LightningDataModule):
            datamodule, dataloaders = dataloaders, None
        st = STAGES[stage]
        if stage != "predict" and not model._overrides(st.step_method):  # predict_step has a default
            raise MisconfigurationError(f"{stage}() needs {type(model).__name__}.{st.step_method}(batch, batch_idx)")
        with self._run(stage, model, datamodule):
            loaders = split_loaders(loader_for(self, st, dataloaders))
            if not loaders:
                raise MisconfigurationError(f"{stage}() needs dataloaders, a datamodule or the module's loader method")
            setattr(
                self,
                f"{st.hook if stage != 'validate' else 'val'}_dataloaders",
                loaders[0] if len(loaders) == 1 else loaders,
            )
            self.engine.setup_model()
            if ckpt_path is not None:
                self._restore(ckpt_path, stage=stage)
            if self.train_state is not None and self.lightning_module is model:
                # the user may have edited the module since fit: evaluate what it holds now
                params, rest = self.engine.read_module()
                self.train_state = self.train_state._replace(params=params, model_state=rest)
            limits = [batch_limit(self, st, dl) for dl in loaders]
            # Lightning logs a standalone evaluation at the count of optimizer steps taken so far
            out = EvalLoop(self, st).run(loaders, limits, log_step=self.global_step)
        return out

    def _evaluate(
        self, stage: str, model: Any, dataloaders: Any, ckpt_path: Any, verbose: bool, datamodule: Any
    ) -> list[dict[str, float]]:
        results = self._run_eval(stage, model, dataloaders, ckpt_path, datamodule)
        if verbose and self.is_global_zero:
            for i, metrics in enumerate(results):
                _print_results(STAGES[stage].title + (f" (dataloader {i})" if len(results) > 1 else ""), metrics)
        return results

    def validate(
        self,
        model: LightningModule | None = None,
        dataloaders: Any = None,
        ckpt_path: str | None = None,
        verbose: bool = True,
        datamodule: LightningDataModule | None = None,
    ) -> list[dict[str, float]]:
        """Run one validation epoch; returns the epoch-level logged metrics, one dict per loader
        (``[{metric: value}]`` for one loader; ``[]`` when ``limit_val_batches`` leaves no batch)."""
        return self._evaluate("validate", model, dataloaders, ckpt_path, verbose, datamodule)

    def test(
        self,
        model: LightningModule | None = None,
        dataloaders: Any = None,
        ckpt_path: str | None = None,
        verbose: bool = True,
        datamodule: LightningDataModule | None = None,
    ) -> list[dict[str, float]]:
        """Run one test epoch; returns the epoch-level logged metrics, one dict per loader
        (``[{metric: value}]`` for one loader; ``[]`` when ``limit_test_batches`` leaves no batch)."""
        return self._evaluate("test", model, dataloaders, ckpt_path, verbose, datamodule)

    def predict(
        self,
        model: LightningModule | None = None,
        dataloaders: Any = None,
        datamodule: LightningDataModule | None = None,
        return_predictions: bool | None = None,
        ckpt_path: str | None = None,
    ) -> list[Any] | None:
        """Run ``predict_step`` over every batch; returns the per-batch outputs (jax arrays), a list per
        loader when there are several. A padded last batch's outputs are cut to its real rows, so there is
        exactly one output row per sample."""
        preds = self._run_eval("predict", model, dataloaders, ckpt_path, datamodule)
        return preds if return_predictions is not False else None


def _user_code(fn: Any) -> bool:
    """Whether ``fn`` (a bound method or a function) was written outside jaxlight."""
    fn = getattr(fn, "__func__", fn)
    module = getattr(fn, "__module__", None)
    return not (isinstance(module, str) and (module == "jaxlight" or module.startswith("jaxlight.")))


def _checkpoint_callbacks_last(cbs: list[Callback]) -> list[Callback]:
    """Lightning runs checkpoint callbacks after all others at every hook, so a checkpoint holds the
    other callbacks' state as updated by the same hook (e.g. EarlyStopping's wait count)."""
    return [c for c in cbs if not c.is_checkpoint_callback] + [c for c in cbs if c.is_checkpoint_callback]


def _print_results(title: str, metrics: Mapping[str, float]) -> None:
    if not metrics:
        return
    w = max(len(k) for k in metrics)
    print(f"{title} metrics:")
    for k, v in metrics.items():
        print(f"  {k.ljust(w)}  {v:.6g}")
