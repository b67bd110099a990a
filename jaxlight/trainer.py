"""The Trainer: Lightning's loop around one compiled SPMD step.

Read top to bottom: arguments are checked in ``__init__``; ``fit`` sets the
model up on the mesh (``_setup``), then runs ``_fit_loop`` (epochs of
batches, validation inside the epoch, epoch-end hooks); ``validate``,
``test`` and ``predict`` share ``_eval_loop``. Hooks are called through
``_call`` in Lightning's order: callbacks first, then the module.
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
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlight import nn as jl_nn
from jaxlight.callbacks.callback import Callback
from jaxlight.callbacks.progress import TQDMProgressBar
from jaxlight.callbacks.timer import Timer
from jaxlight.data import BatchPlacer, Prefetcher, num_batches
from jaxlight.datamodule import LightningDataModule
from jaxlight.loggers.csv_logs import CSVLogger
from jaxlight.loggers.logger import Logger, LoggerCollection
from jaxlight.metrics import Collector, MetricStore, to_host
from jaxlight.module import LightningModule
from jaxlight.precision import resolve_precision
from jaxlight.state import ModelParts, merge_models, nnx_attributes, split_models
from jaxlight.step import StepBuilder, StepExtension, TrainState
from jaxlight.strategies.placement import named, param_specs, rest_specs
from jaxlight.strategies.strategy import Strategy, resolve_strategy
from jaxlight.summary import summarize

_RUN_AHEAD = 2  # steps the host may dispatch ahead of the device before waiting


class MisconfigurationError(ValueError):
    """A Trainer argument or a module definition that cannot work, said before any work is done."""


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
    bounded run-ahead of two steps, with logged values fetched only every
    ``log_every_n_steps`` and at epoch end; bad arguments raise before any
    work starts, with the numbers.
    """

    def __init__(
        self,
        *,
        accelerator: str = "auto",
        strategy: str | Strategy = "auto",
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
    ) -> None:
        if accelerator not in ("auto", "cpu", "gpu", "cuda", "tpu"):
            raise MisconfigurationError(f"accelerator={accelerator!r}; choose 'auto', 'cpu', 'gpu' or 'tpu'")
        if accelerator not in ("auto",) and jax.default_backend() != {"cuda": "gpu"}.get(accelerator, accelerator):
            raise MisconfigurationError(f"accelerator={accelerator!r} but JAX's backend is {jax.default_backend()!r}")
        self.precision_plugin = resolve_precision(precision)
        self.precision = self.precision_plugin.name
        self.strategy = resolve_strategy(strategy)
        self._devices = _resolve_devices(devices)
        if num_nodes != 1 and num_nodes != jax.process_count():
            raise MisconfigurationError(
                f"num_nodes={num_nodes} but jax.distributed reports {jax.process_count()} processes"
            )
        self.mesh = self.strategy.build_mesh(self._devices)

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
        self.prefetch = prefetch
        self.deterministic = bool(deterministic)
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
        self.callbacks: list[Callback] = cbs

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
        self.global_step = 0
        self.current_epoch = 0
        self.should_stop = False
        self.sanity_checking = False
        self.training = self.validating = self.testing = self.predicting = False
        self.callback_metrics: dict[str, Any] = {}
        self.logged_metrics: dict[str, float] = {}
        self.progress_bar_metrics: dict[str, float] = {}
        self.num_training_batches: int | float = math.inf
        self.num_val_batches: int | float = 0
        self.num_test_batches: int | float = 0
        self.num_predict_batches: int | float = 0
        self.compile_counts: dict[str, int] = collections.Counter()
        self.compiled: dict[str, Any] = {}
        self.lightning_module: LightningModule | None = None
        self.datamodule: LightningDataModule | None = None
        self.train_state: TrainState | None = None
        self.batch_idx = 0
        self._parts: ModelParts | None = None
        self._builder: StepBuilder | None = None
        self._state_shardings: TrainState | None = None
        self._lr_schedulers: list[Any] = []
        self._current_hook: str | None = None
        self._host_col: Collector | None = None
        self._stores: dict[str, MetricStore] = {}
        self._micro_batches = 0
        self._batches_in_epoch = 0
        self._expected_rows: dict[str, int] = {}
        self._inflight: collections.deque = collections.deque()
        self._stage: str | None = None
        self._resume_batch_offset = 0
        self._resume_loader_state: Any = None  # a restored train loader state, loaded before the next epoch
        self._loader_states: dict[str, Any] = {}

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
        return self._lr_schedulers

    @property
    def progress_bar_callback(self) -> TQDMProgressBar | None:
        return next((c for c in self.callbacks if isinstance(c, TQDMProgressBar)), None)

    @property
    def checkpoint_callbacks(self) -> list[Callback]:
        return [c for c in self.callbacks if getattr(c, "_is_checkpoint_callback", False)]

    @property
    def checkpoint_callback(self) -> Callback | None:
        cbs = self.checkpoint_callbacks
        return cbs[0] if cbs else None

    def _add_default_checkpoint(self, cbs: list[Callback]) -> list[Callback]:
        try:
            from jaxlight.callbacks import ModelCheckpoint  # type: ignore[attr-defined]
        except ImportError:
            return cbs
        if not any(isinstance(c, ModelCheckpoint) for c in cbs):
            cbs = cbs + [ModelCheckpoint()]
        return cbs

    def _add_default_preemption(self, cbs: list[Callback]) -> list[Callback]:
        from jaxlight.callbacks.preemption import Preemption

        return cbs if any(isinstance(c, Preemption) for c in cbs) else cbs + [Preemption()]

    # ------------------------------------------------------------------ hooks
    def _call(self, hook: str, *args: Any, module_too: bool = True, callbacks: Sequence[Callback] | None = None) -> Any:
        """Call ``hook`` on callbacks (then the module), collecting host-side ``self.log``."""
        prev = self._current_hook
        self._current_hook = hook
        result = None
        try:
            for cb in self.callbacks if callbacks is None else callbacks:
                getattr(cb, hook)(self, self.lightning_module, *args)
                self._flush_host_logs()
            if module_too and self.lightning_module is not None and hasattr(self.lightning_module, hook):
                result = getattr(self.lightning_module, hook)(*args)
                self._flush_host_logs()
        finally:
            self._current_hook = prev
        return result

    def _call_module(self, hook: str, *args: Any) -> Any:
        prev = self._current_hook
        self._current_hook = hook
        try:
            out = getattr(self.lightning_module, hook)(*args)
            self._flush_host_logs()
            return out
        finally:
            self._current_hook = prev

    def _call_train_epoch_end(self) -> None:
        # Lightning: other callbacks, then the module, then monitoring callbacks
        # (checkpointing, early stopping) so they see what the module logged.
        monitoring = [
            c
            for c in self.callbacks
            if getattr(c, "_is_monitoring_callback", False) or getattr(c, "_is_checkpoint_callback", False)
        ]
        others = [c for c in self.callbacks if c not in monitoring]
        self._call("on_train_epoch_end", callbacks=others)
        self._call("on_train_epoch_end", module_too=False, callbacks=monitoring)

    # ---------------------------------------------------------------- logging
    def _host_collector(self) -> Collector:
        if self._host_col is None:
            hook = self._current_hook or ""
            stage = self._stage or "train"
            step_level = hook in ("on_train_batch_start", "on_train_batch_end")
            self._host_col = Collector(stage, None, on_step=step_level, on_epoch=not step_level)
        return self._host_col

    def _flush_host_logs(self) -> None:
        col, self._host_col = self._host_col, None
        if col is None or not col.values:
            return
        stage = "train" if col.stage in ("train", "fit") else col.stage
        store = self._stores.setdefault(stage, MetricStore())
        store.register(col.specs)
        store.update(col.values)
        for k, (v, _) in col.values.items():
            self.callback_metrics[k] = v

    def _metric_names(self, spec: Any, name: str, level: str) -> str:
        return f"{name}_{level}" if spec.on_step and spec.on_epoch else name

    def _record_step_metrics(self, store: MetricStore) -> None:
        for k, v in store.step_values.items():
            spec = store.specs[k]
            if spec.on_step:
                self.callback_metrics[k] = v
                if spec.on_epoch:
                    self.callback_metrics[f"{k}_step"] = v

    def _log_step_metrics(self) -> None:
        store = self._stores.get("train")
        if store is None:
            return
        vals = {k: v for k, v in store.step_values.items() if store.specs[k].on_step}
        if not vals:
            return
        host = to_host(vals)
        logged = {}
        for k, v in host.items():
            spec = store.specs[k]
            name = self._metric_names(spec, k, "step")
            if spec.prog_bar:
                self.progress_bar_metrics[k if not spec.on_epoch else name] = v
            if spec.logger:
                logged[name] = v
        self._send(logged)

    def _send(self, metrics: dict[str, float]) -> None:
        if not metrics:
            return
        metrics = {**metrics, "epoch": float(self.current_epoch)} if not self.sanity_checking else metrics
        self.logged_metrics.update(metrics)
        if self.loggers and self.is_global_zero:
            LoggerCollection(self.loggers).log_metrics(metrics, step=max(self.global_step - 1, 0))

    def _epoch_metrics(self, stage: str) -> dict[str, float]:
        """Fetch a stage's epoch values, update callback/progress metrics; return {logged name: value}."""
        store = self._stores.get(stage)
        if store is None:
            return {}
        vals = store.epoch_values()
        host = to_host(vals) if vals else {}
        out = {}
        for k, v in host.items():
            spec = store.specs[k]
            name = self._metric_names(spec, k, "epoch")
            self.callback_metrics[k] = jnp.float32(v)
            self.callback_metrics[name] = jnp.float32(v)
            if spec.prog_bar:
                self.progress_bar_metrics[name] = v
            if spec.logger:
                out[name] = v
        return out

    # ---------------------------------------------------------------- setup
    def _mesh_ctx(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        # Not flax's nnx.logical_axis_rules: flax reads a rules table as a rename
        # (one mesh axis per name, no divisibility fallback, duplicates refused),
        # so placement goes through jaxlight.strategies.resolve_spec only.
        stack.enter_context(nnx.use_eager_sharding(False))
        stack.enter_context(jl_nn.axis_rules(self.mesh, self.strategy.logical_rules))
        return stack

    def _attach(self, model: LightningModule, datamodule: LightningDataModule | None) -> None:
        if not isinstance(model, LightningModule):
            raise MisconfigurationError(f"model must be a jaxlight.LightningModule, got {type(model).__name__}")
        if datamodule is not None and not isinstance(datamodule, LightningDataModule):
            raise MisconfigurationError(
                f"datamodule must be a jaxlight.LightningDataModule, got {type(datamodule).__name__}"
            )
        if self.lightning_module is not None and self.lightning_module is not model:
            self._parts = None  # a new model: set it up afresh
            self.train_state = None
            self.compiled = {}
        self.lightning_module = model
        model.trainer = self
        if datamodule is not None:
            self.datamodule = datamodule
            datamodule.trainer = self
        extra = model.configure_callbacks()
        extra = [extra] if isinstance(extra, Callback) else list(extra or [])
        if extra:
            kinds = {type(c) for c in extra}
            self.callbacks = [c for c in self.callbacks if type(c) not in kinds] + extra

    def _setup_model(self) -> None:
        """Create (or adopt) the module's NNX state, placed on the mesh."""
        module = self.lightning_module
        assert module is not None
        if self._parts is not None:
            return
        with self._mesh_ctx():
            existing = nnx_attributes(module)
            if not existing:

                def build() -> dict[str, nnx.Module]:
                    module.configure_model()
                    models = nnx_attributes(module)
                    for k in models:
                        object.__delattr__(module, k)
                    return models

                # Shapes and annotations only: with a mesh in context flax would turn the
                # logical names into mesh axes itself; the placement comes from param_specs.
                with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
                    abstract = nnx.eval_shape(build)
                if not abstract:
                    raise MisconfigurationError(
                        f"{type(module).__name__} holds no flax.nnx.Module attribute: create the model in "
                        f"__init__ or configure_model (e.g. self.net = MLP(nnx.Rngs(0)))"
                    )
                parts, aparams, arest = split_models(abstract)
                psh, rsh = self._var_shardings(parts, aparams, arest)

                def create():
                    models = build()
                    _, p, r = nnx.split(models, nnx.Param, ...)
                    return parts.params.to_flat(p), parts.rest.to_flat(r)

                # Compiled SPMD: each device computes only its shards (kept for inspection).
                self._init_compiled = jax.jit(create, out_shardings=(psh, rsh)).lower().compile()
                params, rest = self._init_compiled()
            else:
                parts, params, rest = split_models(existing)
                psh, rsh = self._var_shardings(parts, params, rest)
                params = jax.device_put(params, psh)
                rest = jax.device_put(rest, rsh)
        params = self.precision_plugin.store(params)
        self._parts = parts
        self._param_shardings = psh
        self._rest_shardings = rsh
        self._write_back(params, rest)

    def _var_shardings(self, parts: ModelParts, params: Mapping, rest: Mapping) -> tuple[dict, dict]:
        pspecs = param_specs(params, parts.params.variables, self.strategy, self.mesh)
        rspecs = rest_specs(rest, parts.rest.variables, self.strategy, self.mesh)
        return (
            {k: named(self.mesh, s) for k, s in pspecs.items()},
            {k: named(self.mesh, s) for k, s in rspecs.items()},
        )

    def _write_back(self, params: Mapping, rest: Mapping) -> None:
        """Point the module's NNX attributes at concrete (sharded) arrays.

        Existing NNX modules are updated in place, as a torch module is, so any
        other reference the user holds to them (``net = model.net``) sees the
        trained values too; modules not created yet are built from the state.
        """
        assert self._parts is not None and self.lightning_module is not None
        module, parts = self.lightning_module, self._parts
        current = {k: module.__dict__.get(k) for k in parts.names}
        if all(isinstance(m, nnx.Module) for m in current.values()):
            nnx.update(current, parts.params.from_flat(params), parts.rest.from_flat(rest))
            return
        for k, m in merge_models(parts, params, rest, train=True).items():
            object.__setattr__(module, k, m)

    def _read_module(self) -> tuple[dict, dict]:
        """Current params/rest from the module's NNX attributes (user may have changed them)."""
        assert self._parts is not None and self.lightning_module is not None
        models = {k: getattr(self.lightning_module, k) for k in self._parts.names}
        _, p, r = nnx.split(models, nnx.Param, ...)
        params = jax.device_put(self._parts.params.to_flat(p), self._param_shardings)
        rest = jax.device_put(self._parts.rest.to_flat(r), self._rest_shardings)
        return params, rest

    def _configure_optimizers(self) -> optax.GradientTransformation:
        out = self._call_module("configure_optimizers")
        schedules: list[Any] = []
        if isinstance(out, Mapping):
            if "optimizer" not in out:
                raise MisconfigurationError(
                    f"configure_optimizers returned a dict without 'optimizer' (keys: {sorted(out)})"
                )
            tx = out["optimizer"]
            sched = out.get("lr_scheduler")
            if isinstance(sched, Mapping):
                sched = sched.get("scheduler")
            if sched is not None:
                if not callable(sched):
                    raise MisconfigurationError(
                        f"lr_scheduler must be an optax schedule (step -> lr), got {type(sched).__name__}"
                    )
                schedules.append(sched)
        else:
            tx = out
        if not isinstance(tx, optax.GradientTransformation):
            raise MisconfigurationError(
                f"configure_optimizers must return an optax.GradientTransformation or "
                f"{{'optimizer': tx, 'lr_scheduler': schedule}}, got {type(tx).__name__}"
            )
        self._lr_schedulers = schedules
        if self.gradient_clip_val:
            clip = (
                optax.clip_by_global_norm(self.gradient_clip_val)
                if self.gradient_clip_algorithm == "norm"
                else optax.clip(self.gradient_clip_val)
            )
            tx = optax.chain(clip, tx)
        if self.accumulate_grad_batches > 1:
            tx = optax.MultiSteps(tx, every_k_schedule=self.accumulate_grad_batches)
        return tx

    def _opt_shardings(self, opt_shapes: Any, params: Mapping[str, Any]) -> Any:
        """Optimizer state leaves keyed by a parameter path take that parameter's sharding."""
        psh = self._param_shardings
        rep = NamedSharding(self.mesh, P())

        def pick(path, leaf):
            for k in reversed(path):
                key = getattr(k, "key", None)
                if isinstance(key, str) and key in psh:
                    if tuple(leaf.shape) == tuple(params[key].shape):
                        return psh[key]
            return rep

        return jax.tree_util.tree_map_with_path(pick, opt_shapes)

    def _setup_training(self) -> None:
        """Optimizer, in-step extensions and the placed TrainState."""
        module = self.lightning_module
        assert module is not None and self._parts is not None
        tx = self._configure_optimizers()
        params, rest = self._read_module()
        params = self.precision_plugin.store(params)
        exts: list[StepExtension] = []
        extra: dict[str, Any] = {}
        for cb in self.callbacks:
            ext = cb.step_extension(self)
            if ext is not None:
                exts.append(ext)
                extra[ext.name] = cb.init_step_state(self, params)
                for path, leaf in jax.tree_util.tree_flatten_with_path(extra[ext.name])[0]:
                    sh = getattr(leaf, "sharding", None)
                    if not (isinstance(sh, NamedSharding) and sh.mesh == self.mesh):
                        raise MisconfigurationError(
                            f"{type(cb).__name__}.init_step_state returned leaf "
                            f"{jax.tree_util.keystr(path) or '<root>'} that is not a jax.Array placed on "
                            f"trainer.mesh (got {type(leaf).__name__} with sharding {sh}); place it with "
                            f"jax.device_put(x, NamedSharding(trainer.mesh, spec))"
                        )
        needs_gnorm = any(getattr(cb, "needs_grad_norm", False) for cb in self.callbacks)
        skip = any(getattr(cb, "skip_nonfinite_updates", False) for cb in self.callbacks)
        self._builder = StepBuilder(
            module, self._parts, self.precision_plugin, tx, tuple(exts), with_grad_norm=needs_gnorm, skip_nonfinite=skip
        )
        with self._mesh_ctx():
            opt_shapes = jax.eval_shape(tx.init, params)
            osh = self._opt_shardings(opt_shapes, params)
            opt_state = jax.jit(tx.init, out_shardings=osh)(params)
        self._state_shardings = TrainState(
            self._param_shardings,
            self._rest_shardings,
            osh,
            jax.tree.map(lambda x: x.sharding, extra),
            NamedSharding(self.mesh, P()),
        )
        step = jax.device_put(jnp.int32(self.global_step), NamedSharding(self.mesh, P()))
        self.train_state = TrainState(params, rest, opt_state, extra, step)
        self.compiled.pop("train", None)

    def _compile(self, stage: str, *args: Any) -> Any:
        """Lower and compile one stage's step for the given example arguments (once)."""
        b = self._builder
        assert b is not None
        if jax.process_count() > 1:
            _assert_same_batch_across_processes(stage, args[-2])
        with self._mesh_ctx():
            if stage == "train":
                fn = jax.jit(b.train_step, donate_argnums=0, out_shardings=(self._state_shardings, None, None))
            else:

                def eval_step(params, rest, batch, batch_idx, _stage=stage):
                    return b.eval_step(_stage, params, rest, batch, batch_idx)

                eval_step.__name__ = f"{stage}_step"
                fn = jax.jit(eval_step)
            compiled = fn.lower(*args).compile()
        self.compile_counts[stage] += 1
        self.compiled[stage] = compiled
        store = self._stores.setdefault(stage if stage != "train" else "train", MetricStore())
        store.register(b.log_specs.get(stage, {}))
        return compiled

    # ---------------------------------------------------------------- data
    def _loader(self, stage: str, given: Any) -> Any:
        if given is not None:
            return given
        dm = self.datamodule
        name = {
            "train": "train_dataloader",
            "validate": "val_dataloader",
            "test": "test_dataloader",
            "predict": "predict_dataloader",
        }[stage]
        if dm is not None:
            return getattr(dm, name)()
        fn = getattr(self.lightning_module, name, None)
        return fn() if callable(fn) else None

    def _limit(self, stage: str, loader: Any) -> int | float:
        limit = {
            "train": self.limit_train_batches,
            "validate": self.limit_val_batches,
            "test": self.limit_test_batches,
            "predict": self.limit_predict_batches,
        }[stage]
        n = num_batches(loader)
        if limit is None or (isinstance(limit, float) and limit == 1.0):  # int 1 means one batch
            return n if n is not None else math.inf
        if isinstance(limit, float):
            if n is None:
                raise MisconfigurationError(
                    f"limit_{stage}_batches={limit} is a fraction but the {stage} loader has no length; pass an int"
                )
            return int(n * limit)
        return min(limit, n) if n is not None else limit

    def _prefetcher(self, stage: str, loader: Any, limit: int | float, start: int = 0) -> Prefetcher:
        placer = BatchPlacer(self.mesh, self.process_local_batches)
        resume = None
        if stage == "train":
            resume, self._resume_loader_state = self._resume_loader_state, None
        return Prefetcher(
            loader,
            placer,
            limit=None if limit == math.inf else int(limit),
            start=start,
            depth=self.prefetch,
            drop_ragged=self.ragged_batches == "drop",
            stage=stage,
            expected_rows=self._expected_rows.get(stage),
            loader_state=resume,
        )

    def _wait_run_ahead(self, token: Any) -> None:
        self._inflight.append(token)
        if len(self._inflight) > _RUN_AHEAD:
            jax.block_until_ready(self._inflight.popleft())

    # ---------------------------------------------------------------- run wrapper
    @contextlib.contextmanager
    def _run(self, stage: str, model: LightningModule, datamodule: LightningDataModule | None) -> Iterator[None]:
        self._attach(model, datamodule)
        self._stage = stage
        setup_stage = {"train": "fit"}.get(stage, stage)
        status = "success"
        try:
            if self.datamodule is not None:
                if self.is_global_zero:
                    self.datamodule.prepare_data()
            if self.is_global_zero:
                self._call_module("prepare_data")
            if self.datamodule is not None:
                self.datamodule.setup(setup_stage)
            self._call("setup", setup_stage)
            yield
        except BaseException as e:
            status = "failed"
            self._inflight.clear()
            if stage == "train":
                try:  # leave the module usable with the last completed step's weights
                    self._sync_module()
                except Exception:
                    pass
            for cb in self.callbacks:
                try:
                    cb.on_exception(self, self.lightning_module, e)
                except Exception:
                    pass
            if hasattr(self.lightning_module, "on_exception"):
                try:
                    self.lightning_module.on_exception(e)  # type: ignore[union-attr]
                except Exception:
                    pass
            raise
        finally:
            self._inflight.clear()
            if self.loggers and self.is_global_zero:
                try:
                    LoggerCollection(self.loggers).finalize(status)
                except Exception:
                    if status == "success":
                        raise
            if self.datamodule is not None:
                self.datamodule.teardown(setup_stage)
            self._call("teardown", setup_stage)
            self._stage = None
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
        with self._run("train", model, datamodule):
            self.should_stop = False
            # val before train: Lightning's order (sanity check first); both before any work is done
            val_loader = self._loader("validate", val_dataloaders)
            train_loader = self._loader("train", train_dataloaders)
            if train_loader is None:
                raise MisconfigurationError("fit needs train_dataloaders, a datamodule or model.train_dataloader()")
            if val_loader is not None and not model._overrides("validation_step"):
                # Lightning: a val loader without validation_step skips validation, with a warning
                warnings.warn(
                    f"{type(model).__name__} has a val dataloader but no validation_step; skipping validation",
                    stacklevel=2,
                )
                val_loader = None
            self._setup_model()
            self._setup_training()
            if ckpt_path is not None:
                self._restore(ckpt_path, stage="fit")
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
            self._call("on_fit_start")
            if val_loader is not None and self.num_sanity_val_steps != 0 and not self._restored_mid_run():
                self._sanity_check(val_loader)
            self._fit_loop(train_loader, val_loader)
            self._call("on_fit_end")
        self._finish_fit()

    def _restored_mid_run(self) -> bool:
        return self.global_step > 0

    def _finish_fit(self) -> None:
        for cb in self.callbacks:
            wait = getattr(cb, "wait_until_finished", None)
            if callable(wait):
                wait()

    def _restore(self, ckpt_path: str, stage: str) -> None:
        try:
            from jaxlight.checkpoint import restore_into_trainer
        except ImportError as e:  # pragma: no cover - arrives with the checkpoint module
            raise MisconfigurationError(f"ckpt_path={ckpt_path!r}: checkpoint support is not available ({e})") from e
        restore_into_trainer(self, ckpt_path, stage)

    def save_checkpoint(self, filepath: str | os.PathLike, weights_only: bool = False) -> None:
        """Write the run's state to the new directory ``filepath`` and wait until it is committed.

        Lightning's ``trainer.save_checkpoint``: every process must call it. The
        checkpoint resumes with ``fit(ckpt_path=filepath)`` or loads with
        ``Module.load_from_checkpoint(filepath)`` (see docs/checkpointing.md).
        """
        from jaxlight.checkpoint import save_checkpoint

        save_checkpoint(self, filepath, weights_only=weights_only)

    def _sanity_check(self, val_loader: Any) -> None:
        self.sanity_checking = True
        saved = (dict(self.callback_metrics), dict(self.logged_metrics), dict(self.progress_bar_metrics))
        self._call("on_sanity_check_start", module_too=False)
        limit = self._limit("validate", val_loader)
        n = limit if self.num_sanity_val_steps == -1 else min(self.num_sanity_val_steps, limit)
        self._eval_loop("validate", val_loader, limit=n, in_fit=True, log=False)
        self._call("on_sanity_check_end", module_too=False)
        self.callback_metrics, self.logged_metrics, self.progress_bar_metrics = saved
        self._stores.setdefault("validate", MetricStore()).reset_epoch()
        self.sanity_checking = False

    def _val_check_batch(self) -> int | float:
        if isinstance(self.val_check_interval, float):
            if self.num_training_batches == math.inf:
                if self.val_check_interval != 1.0:
                    raise MisconfigurationError(
                        f"val_check_interval={self.val_check_interval} needs a train loader with a length; "
                        f"pass an int number of batches"
                    )
                return math.inf
            return max(1, int(self.num_training_batches * self.val_check_interval))
        if self.check_val_every_n_epoch is not None and self.val_check_interval > self.num_training_batches:
            raise MisconfigurationError(
                f"val_check_interval ({self.val_check_interval}) must be <= the number of training batches "
                f"({self.num_training_batches}); set check_val_every_n_epoch=None to count batches across epochs"
            )
        return self.val_check_interval

    def _can_stop_early(self) -> bool:
        # Lightning: should_stop is honoured once min_epochs *completed* epochs and min_steps are reached
        # (current_epoch counts completed epochs at the epoch boundary and during an epoch alike).
        return self.current_epoch >= self.min_epochs and self.global_step >= self.min_steps

    def _training_done(self) -> bool:
        if self.max_steps != -1 and self.global_step >= self.max_steps:
            return True
        return self.should_stop and self._can_stop_early()

    def _fit_loop(self, train_loader: Any, val_loader: Any) -> None:
        self.training = True
        self.num_training_batches = self._limit("train", train_loader)
        if self.num_training_batches == 0:
            return
        k = self.accumulate_grad_batches
        if self.num_training_batches != math.inf and self.num_training_batches % k and self.is_global_zero:
            print(
                f"jaxlight: accumulate_grad_batches={k} does not divide the {self.num_training_batches} batches "
                f"of an epoch; the last {int(self.num_training_batches % k)} batches' gradients carry into the "
                f"next epoch's first update"
            )
        val_every = self._val_check_batch()
        self._call("on_train_start")
        total_batches = self._micro_batches
        while not self._training_done() and (self.max_epochs == -1 or self.current_epoch < self.max_epochs):
            start = self._resume_batch_offset
            if not start:  # a mid-epoch resume continues the restored epoch accumulators
                self._stores.setdefault("train", MetricStore()).reset_epoch()
            self._call("on_train_epoch_start")
            self._resume_batch_offset = 0
            fetcher = self._prefetcher("train", train_loader, self.num_training_batches, start=start)
            self._batches_in_epoch = start
            ran_val_at_end = False  # validation ran after the last batch this epoch processed
            try:
                for item in fetcher:
                    ran_val_at_end = False
                    batch, idx = item.batch, item.index
                    self.batch_idx = idx
                    if self._call("on_train_batch_start", batch, idx) == -1:
                        break
                    compiled = self.compiled.get("train")
                    if compiled is None:
                        self._expected_rows["train"] = item.rows
                        compiled = self._compile("train", self.train_state, batch, np.int32(idx))
                    self.train_state, outputs, logs = compiled(self.train_state, batch, np.int32(idx))
                    self._wait_run_ahead(outputs["loss"])
                    self._loader_states["train"] = item.loader_state
                    self._micro_batches += 1
                    total_batches += 1
                    self._batches_in_epoch = idx + 1
                    stepped = self._micro_batches % k == 0
                    if stepped:
                        self.global_step += 1
                    store = self._stores.setdefault("train", MetricStore())
                    store.update(logs)
                    self._record_step_metrics(store)
                    self._call("on_train_batch_end", outputs, batch, idx)
                    if stepped and self.global_step % self.log_every_n_steps == 0:
                        self._log_step_metrics()
                    is_last = self.num_training_batches != math.inf and idx + 1 >= self.num_training_batches
                    if self._should_validate(val_loader, idx, total_batches, val_every, is_last):
                        self._eval_loop("validate", val_loader, limit=self._limit("validate", val_loader), in_fit=True)
                        ran_val_at_end = True
                    if self._training_done():
                        break
            finally:
                fetcher.close()
            if val_loader is not None and not ran_val_at_end and val_every == math.inf and self._val_epoch_due():
                self._eval_loop("validate", val_loader, limit=self._limit("validate", val_loader), in_fit=True)
            # epoch end: epoch-level train metrics first, so epoch-end hooks see them
            epoch_logged = self._epoch_metrics("train")
            self._stage = "train"
            self._sync_module()
            self._call_train_epoch_end()
            epoch_logged.update(self._epoch_metrics("train"))
            self._log_step_metrics_if_pending()
            self._send(epoch_logged)
            self.current_epoch += 1
            self._batches_in_epoch = 0
        self._sync_module()
        self._call("on_train_end")

    def _log_step_metrics_if_pending(self) -> None:
        # make the progress bar/logged values reflect the last step of the epoch
        if self.global_step % self.log_every_n_steps:
            store = self._stores.get("train")
            if store is not None and any(s.on_step and s.prog_bar for s in store.specs.values()):
                vals = {
                    k: v for k, v in store.step_values.items() if store.specs[k].on_step and store.specs[k].prog_bar
                }
                for k, v in to_host(vals).items():
                    spec = store.specs[k]
                    self.progress_bar_metrics[self._metric_names(spec, k, "step") if spec.on_epoch else k] = v

    def _val_epoch_due(self) -> bool:
        n = self.check_val_every_n_epoch
        return n is not None and (self.current_epoch + 1) % n == 0

    def _should_validate(self, val_loader: Any, idx: int, total: int, every: int | float, is_last: bool) -> bool:
        if val_loader is None or self.limit_val_batches == 0:
            return False
        if self.check_val_every_n_epoch is not None and not self._val_epoch_due():
            return False
        if self.should_stop and self._can_stop_early():
            return True
        if every == math.inf:
            return False
        current = total if self.check_val_every_n_epoch is None else idx + 1
        return current % every == 0 or (is_last and every >= self.num_training_batches)

    def _sync_module(self) -> None:
        """Point the module's NNX attributes at the current train state.

        Each train step donates the state, so the arrays the module held are
        gone after the next step; the module is re-pointed (host work only, no
        copy) before validation, before epoch-end hooks and at the end of fit,
        not per batch. Per-batch hooks read ``trainer.train_state``.
        """
        if self.train_state is not None:
            self._write_back(self.train_state.params, self.train_state.rest)

    def eval_params(self) -> dict[str, jax.Array]:
        """Parameters evaluation runs on: the trained ones, or a callback's (e.g. EMA) when it provides them."""
        assert self.train_state is not None
        params = self.train_state.params
        for cb in self.callbacks:
            fn = getattr(cb, "eval_params", None)
            if callable(fn):
                alt = fn(self, params)
                if alt is not None:
                    params = alt
        return params

    # ---------------------------------------------------------------- eval
    def _eval_loop(self, stage: str, loader: Any, limit: int | float, in_fit: bool = False, log: bool = True) -> Any:
        """Run validation/test/predict over ``loader``; returns epoch metrics or predictions."""
        names = {"validate": "validation", "test": "test", "predict": "predict"}
        hook = names[stage]
        setattr(self, {"validate": "validating", "test": "testing", "predict": "predicting"}[stage], True)
        prev_stage = self._stage
        self._stage = stage
        count_attr = {"validate": "num_val_batches", "test": "num_test_batches", "predict": "num_predict_batches"}[
            stage
        ]
        setattr(self, count_attr, limit)
        if in_fit:
            params, rest = self.eval_params(), self.train_state.rest  # type: ignore[union-attr]
            self._write_back(params, rest)  # hooks see the weights being evaluated (not donated arrays)
        else:
            params, rest = self._eval_state()
        self._call_module(f"on_{hook}_model_eval")
        self._call(f"on_{hook}_start")
        self._stores.setdefault(stage, MetricStore()).reset_epoch()
        self._call(f"on_{hook}_epoch_start")
        predictions: list[Any] = []
        fetcher = self._prefetcher(stage, loader, limit)
        try:
            for item in fetcher:
                batch, idx = item.batch, item.index
                self._call(f"on_{hook}_batch_start", batch, idx)
                compiled = self.compiled.get(stage)
                if compiled is None:
                    self._expected_rows[stage] = item.rows
                    compiled = self._compile(stage, params, rest, batch, np.int32(idx))
                out, logs = compiled(params, rest, batch, np.int32(idx))
                self._wait_run_ahead(out if out is not None else logs)
                store = self._stores.setdefault(stage, MetricStore())
                store.update(logs)
                if stage == "predict":
                    predictions.append(out)
                self._call(f"on_{hook}_batch_end", out, batch, idx)
        finally:
            fetcher.close()
        self._call(f"on_{hook}_epoch_end")
        metrics = self._epoch_metrics(stage) if stage != "predict" else {}
        if log and not self.sanity_checking and stage != "predict":
            self._send(metrics)
        self._call(f"on_{hook}_end")
        if in_fit:
            self._call_module("on_validation_model_train")
        setattr(self, {"validate": "validating", "test": "testing", "predict": "predicting"}[stage], False)
        self._stage = prev_stage
        return predictions if stage == "predict" else metrics

    def _eval_state(self) -> tuple[dict, dict]:
        if self._builder is None:
            assert self._parts is not None
            self._builder = StepBuilder(self.lightning_module, self._parts, self.precision_plugin, None)
        if self.train_state is not None:
            return self.eval_params(), self.train_state.rest
        return self._read_module()

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
        method = {"validate": "validation_step", "test": "test_step", "predict": "predict_step"}[stage]
        if stage != "predict" and not model._overrides(method):  # predict_step has a default
            raise MisconfigurationError(f"{stage}() needs {type(model).__name__}.{method}(batch, batch_idx)")
        with self._run(stage, model, datamodule):
            loader = self._loader(stage, dataloaders)
            if loader is None:
                raise MisconfigurationError(f"{stage}() needs dataloaders, a datamodule or the module's loader method")
            self._setup_model()
            if ckpt_path is not None:
                self._restore(ckpt_path, stage=stage)
            if self.train_state is not None and self.lightning_module is model:
                # the user may have edited the module since fit: evaluate what it holds now
                params, rest = self._read_module()
                self.train_state = self.train_state._replace(params=params, rest=rest)
            out = self._eval_loop(stage, loader, self._limit(stage, loader))
        return out

    def validate(
        self,
        model: LightningModule | None = None,
        dataloaders: Any = None,
        ckpt_path: str | None = None,
        verbose: bool = True,
        datamodule: LightningDataModule | None = None,
    ) -> list[dict[str, float]]:
        """Run one validation epoch; returns ``[{metric: value}]`` of the epoch-level logged metrics."""
        metrics = self._run_eval("validate", model, dataloaders, ckpt_path, datamodule)
        if verbose and self.is_global_zero:
            _print_results("Validate", metrics)
        return [metrics]

    def test(
        self,
        model: LightningModule | None = None,
        dataloaders: Any = None,
        ckpt_path: str | None = None,
        verbose: bool = True,
        datamodule: LightningDataModule | None = None,
    ) -> list[dict[str, float]]:
        """Run one test epoch; returns ``[{metric: value}]`` of the epoch-level logged metrics."""
        metrics = self._run_eval("test", model, dataloaders, ckpt_path, datamodule)
        if verbose and self.is_global_zero:
            _print_results("Test", metrics)
        return [metrics]

    def predict(
        self,
        model: LightningModule | None = None,
        dataloaders: Any = None,
        datamodule: LightningDataModule | None = None,
        return_predictions: bool | None = None,
        ckpt_path: str | None = None,
    ) -> list[Any] | None:
        """Run ``predict_step`` over every batch; returns the per-batch outputs (jax arrays)."""
        preds = self._run_eval("predict", model, dataloaders, ckpt_path, datamodule)
        return preds if return_predictions is not False else None


def _assert_same_batch_across_processes(stage: str, batch: Any) -> None:
    """Processes that compile different steps would wait on each other forever: compare the
    batch structure once per stage (a CRC of shapes and dtypes) and fail with the shapes instead."""
    import zlib

    from jax.experimental import multihost_utils

    desc = repr(
        [
            (jax.tree_util.keystr(p), tuple(x.shape), str(x.dtype))
            for p, x in jax.tree_util.tree_flatten_with_path(batch)[0]
        ]
    )
    digest = np.int32(zlib.crc32(desc.encode()) & 0x7FFFFFFF)  # int32: jax runs without x64
    try:
        multihost_utils.assert_equal(digest, f"{stage} batches differ across processes")
    except AssertionError as e:
        raise MisconfigurationError(
            f"{stage} batches have a different structure on process {jax.process_index()}: {desc}; every "
            f"process must yield batches of the same shapes and dtypes"
        ) from e


def _print_results(title: str, metrics: Mapping[str, float]) -> None:
    if not metrics:
        return
    w = max(len(k) for k in metrics)
    print(f"{title} metrics:")
    for k, v in metrics.items():
        print(f"  {k.ljust(w)}  {v:.6g}")
