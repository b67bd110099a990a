"""The Trainer: Lightning's facade over the config, the hooks, the engine and the loops.

Read top to bottom: ``__init__`` checks every argument before any work
(:class:`~jaxlight.config.TrainerConfig`), then resolves the strategy, the
mesh and the callbacks; ``fit`` attaches the module, lets the
:class:`~jaxlight.engine.Engine` create its state on the mesh and place the
optimizer, then runs the :class:`~jaxlight.loops.FitLoop`;
``validate``/``test``/``predict`` run the :class:`~jaxlight.loops.EvalLoop`.
Hooks go through the :class:`~jaxlight.hooks.HookCaller` (``call_hook``) in
Lightning's order: callbacks first, then the module. Logged values travel
through the :class:`~jaxlight.reporting.MetricReporter`; the fit loop's
counters live in :class:`~jaxlight.position.LoopPosition`.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from jaxlight import checkpoint
from jaxlight.callbacks import Callback, ModelSummary, TQDMProgressBar
from jaxlight.compile_cache import configure_compile_cache
from jaxlight.config import ConfigAttributes, TrainerConfig, check_log_dirs, trainer_arguments
from jaxlight.datamodule import LightningDataModule
from jaxlight.default_callbacks import with_default_callbacks, with_scheduler_stepper
from jaxlight.engine import Engine
from jaxlight.errors import MisconfigurationError
from jaxlight.hooks import HookCaller, check_callbacks, overrides
from jaxlight.loaders import split_loaders
from jaxlight.loggers.logger import Logger, LoggerCollection
from jaxlight.loops import EvalLoop, FitLoop, LoopParts, batch_limit, loader_for, stage_run, train_batches
from jaxlight.module import LightningModule
from jaxlight.optim import configure
from jaxlight.planner import AutoStrategy
from jaxlight.position import LoopPosition
from jaxlight.rank_zero import sync_rank
from jaxlight.reporting import MetricReporter, print_results
from jaxlight.stages import STAGES, TRAIN, VALIDATE
from jaxlight.step import TrainState
from jaxlight.strategies.strategy import Piece, Strategy, resolve_strategy
from jaxlight.summary import summarize
from jaxlight.tracing import traced_counter

__all__ = ["MisconfigurationError", "Trainer"]


class Trainer(ConfigAttributes):
    """Runs a LightningModule: fit, validate, test, predict, on a device mesh.

    Arguments keep PyTorch Lightning's names and meanings. Guarantees: one
    compilation of the train step per fit and one per eval stage; the train
    state is donated (updated in place); no host sync per step beyond a
    bounded run-ahead of four steps, with logged values fetched only every
    ``log_every_n_steps`` and at epoch end; bad arguments raise before any
    work starts, with the numbers. Each argument is readable under its name
    (``trainer.max_epochs``), from ``trainer.config``; assigning one runs the
    same check. The arguments are one table, :data:`jaxlight.config.ARGUMENTS`.
    """

    @trainer_arguments  # every other argument: its name, type, default, doc and check are jaxlight.config.ARGUMENTS
    def __init__(
        self,
        *,
        strategy: str | Strategy | Piece = "auto",
        callbacks: Callback | Sequence[Callback] | None = None,
        **arguments: Any,
    ) -> None:
        """Check every argument, then build the mesh and the callbacks (no model is built yet)."""
        self.config: TrainerConfig = TrainerConfig.from_arguments(**arguments)
        parsed = resolve_strategy(strategy)
        # strategy="auto": the layout is chosen by memory at the start of fit (jaxlight/planner.py)
        self.auto_strategy = AutoStrategy.for_trainer(strategy, self.config.device_memory)
        self._devices = list(self.config.devices)
        self.engine = Engine(parsed, parsed.build_mesh(self._devices), self.config.precision)
        self.compile_cache = configure_compile_cache(self.config.compile_cache)
        sync_rank()  # lightning-utilities' rank_zero_* helpers follow JAX's process index
        if self.config.seed is not None:
            from jaxlight.seed import seed_everything

            seed_everything(self.config.seed)

        # run state
        self.position = LoopPosition()
        self.reporter = MetricReporter(self)
        self.hooks = HookCaller(self, self.reporter, with_default_callbacks(check_callbacks(callbacks), self.config))
        self.loggers: list[Logger] = list(self.config.loggers)
        self.should_stop = False
        self.sanity_checking = False
        self.training = self.validating = self.testing = self.predicting = False
        self.num_training_batches: int | float = math.inf
        self.num_val_batches: int | float | list = 0  # a list, one count per loader, with several loaders
        self.num_test_batches: int | float | list = 0
        self.num_predict_batches: int | float | list = 0
        self.datamodule: LightningDataModule | None = None
        self.batch_idx = 0
        self.ckpt_path: str | None = None  # the checkpoint this run restored from (Lightning's name)
        self.train_dataloader: Any = None
        self.val_dataloaders: Any = None
        self.test_dataloaders: Any = None
        self.predict_dataloaders: Any = None

    # ------------------------------------------------------------------ props
    @property
    def strategy(self) -> Strategy:
        """The layout in use (for ``strategy="auto"``, the one fit picked)."""
        return self.engine.strategy

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.engine.mesh

    @property
    def callbacks(self) -> list[Callback]:
        return self.hooks.callbacks

    @callbacks.setter
    def callbacks(self, value: list[Callback]) -> None:
        self.hooks.callbacks = list(value)

    @property
    def lightning_module(self) -> LightningModule | None:
        return self.hooks.module

    @lightning_module.setter
    def lightning_module(self, value: LightningModule | None) -> None:
        self.hooks.module = value

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
    def global_step(self) -> Any:
        """Optimizer updates applied so far (micro-batches inside accumulation do not count); a traced
        int32 array when read inside a step method (docs/trainer.md#counters-inside-a-step)."""
        traced = traced_counter("global_step")
        return self.position.global_step if traced is None else traced

    @global_step.setter
    def global_step(self, value: int) -> None:
        self.position.global_step = value

    @property
    def current_epoch(self) -> Any:
        """Completed epochs; a traced int32 array when read inside a step method."""
        traced = traced_counter("current_epoch")
        return self.position.epoch if traced is None else traced

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
        """Optimizer steps ``fit`` will take, counted as Lightning does (available in ``configure_optimizers``):
        :meth:`TrainerConfig.stepping_batches` of ``num_training_batches``; ``max_steps`` when the epoch
        length is unknown."""
        steps = self.config.stepping_batches(self.num_training_batches)
        if steps is not None:
            return steps
        if self.lightning_module is None or self.train_dataloader is None:
            raise MisconfigurationError(
                "estimated_stepping_batches needs the train loader: read it during fit (e.g. in configure_optimizers)"
            )
        return self.max_steps

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

    # ------------------------------------------------------------------ hooks
    def hook_reads_module(self, hook: str) -> bool:
        """Whether user code implementing per-batch ``hook`` runs this fit (:meth:`HookCaller.reads_module`)."""
        return self.hooks.reads_module(hook)

    def call_hook(self, hook: str, *args: Any, module: bool = True, callbacks: Sequence[Callback] | None = None) -> Any:
        """Call ``hook`` on the callbacks (those given, or every one that implements it), then on the
        module (:meth:`HookCaller.call`); returns the module's result."""
        return self.hooks.call(hook, *args, module=module, callbacks=callbacks)

    def call_module_hook(self, hook: str, *args: Any) -> Any:
        """Call a module-only hook (``configure_optimizers``, ``on_validation_model_eval`` ...)."""
        return self.hooks.call_module(hook, *args)

    def _loop_parts(self) -> LoopParts:
        return LoopParts(self.hooks, self.engine, self.reporter, self.position, self)

    # ---------------------------------------------------------------- run wrapper
    @contextlib.contextmanager
    def _run(self, stage: str, model: LightningModule, datamodule: LightningDataModule | None) -> Iterator[None]:
        if not isinstance(model, LightningModule):
            raise MisconfigurationError(f"model must be a jaxlight.LightningModule, got {type(model).__name__}")
        if datamodule is not None and not isinstance(datamodule, LightningDataModule):
            raise MisconfigurationError(
                f"datamodule must be a jaxlight.LightningDataModule, got {type(datamodule).__name__}"
            )
        self.engine.attach(model)
        model.trainer = self
        if datamodule is not None:
            self.datamodule = datamodule
            datamodule.trainer = self
        self.hooks.attach(model)
        # late-bound: strategy="auto" replaces the engine during fit
        sync = lambda: self.engine.binding.sync_module()
        with stage_run(STAGES[stage], self.hooks, self.reporter, self, self.datamodule, sync):
            yield

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
            val_loaders = split_loaders(loader_for(VALIDATE, val_dataloaders, self.datamodule, model))
            train_loader = loader_for(TRAIN, train_dataloaders, self.datamodule, model)
            if train_loader is None:
                raise MisconfigurationError("fit needs train_dataloaders, a datamodule or model.train_dataloader()")
            if val_loaders and not overrides(model, "validation_step"):
                # Lightning: a val loader without validation_step skips validation, with a warning
                warnings.warn(
                    f"{type(model).__name__} has a val dataloader but no validation_step; skipping validation",
                    stacklevel=2,
                )
                val_loaders = []
            self.train_dataloader = train_loader
            self.val_dataloaders = (val_loaders[0] if len(val_loaders) == 1 else val_loaders) or None
            # known before configure_optimizers, so a schedule can be sized (estimated_stepping_batches)
            self.num_training_batches = train_batches(self.config, train_loader)
            if self.loggers and self.is_global_zero:
                if ckpt_path is not None and (ckpt_path != "last" or checkpoint.find_last_checkpoint(self) is not None):
                    checkpoint.restore_logger_states(self, ckpt_path)  # a resumed run keeps logging into its own runs
                check_log_dirs(self.loggers)  # a read-only log directory is refused now, not at the first flush
                LoggerCollection(self.loggers).setup()  # a misconfigured tracker fails before any compile
            if self.auto_strategy is not None:  # strategy="auto": pick the layout by memory (planner.py)
                chosen = self.auto_strategy.choose(self, self._devices, train_loader)
                if chosen != self.strategy:
                    self.engine = Engine(chosen, chosen.build_mesh(self._devices), self.config.precision)
                    self.engine.attach(model)
            self.engine.setup_model()
            optimizer = configure(
                self.call_module_hook("configure_optimizers"),
                gradient_clip_val=self.gradient_clip_val,
                gradient_clip_algorithm=self.gradient_clip_algorithm,
                accumulate_grad_batches=self.accumulate_grad_batches,
            )
            cbs = with_scheduler_stepper(self.callbacks, optimizer.host_stepped)  # plateau schedules step on the host
            if cbs is not None:
                self.callbacks = cbs
                self.hooks.build()
            self.engine.setup_training(optimizer, self.callbacks, self, self.global_step)
            if ckpt_path is not None:
                self._restore(ckpt_path, stage="fit")
            if self.checkpoint_callbacks:
                checkpoint.check_hparams(model, self.datamodule)  # fail now, not at the first save an epoch later
            self.reporter.log_hyperparams(model, self.datamodule)
            printed = any(isinstance(c, ModelSummary) for c in self.callbacks)  # the callback prints instead
            if self.enable_model_summary and self.is_global_zero and not printed:
                st, variables = self.train_state, self.engine.parts.params.variables
                print(summarize(st.params, st.opt_state, self.mesh, variables=variables))
            with self.engine.binding.adopting_module_edits():  # Lightning users load weights in on_fit_start
                self.call_hook("on_fit_start")
            FitLoop(self._loop_parts()).fit(train_loader, val_loaders)
            self.call_hook("on_fit_end")
        for cb in self.callbacks:
            cb.wait_until_finished()

    def _restore(self, ckpt_path: str, stage: str) -> None:
        if ckpt_path == "last" and checkpoint.find_last_checkpoint(self) is None:
            # Lightning: not an error, so a script can always pass ckpt_path="last" (resume if there is one)
            warnings.warn(
                f"{checkpoint.no_last_checkpoint_reason(self)}; {stage}() starts without a checkpoint",
                UserWarning,
                stacklevel=3,
            )
            return
        checkpoint.restore_into_trainer(self, ckpt_path, stage)

    def save_checkpoint(self, filepath: str | os.PathLike, weights_only: bool = False) -> None:
        """Write the run's state to the new directory ``filepath`` and wait until it is committed.

        Lightning's ``trainer.save_checkpoint``: every process must call it. The
        checkpoint resumes with ``fit(ckpt_path=filepath)`` or loads with
        ``Module.load_from_checkpoint(filepath)`` (see docs/checkpointing.md).
        """
        checkpoint.save_checkpoint(self, filepath, weights_only=weights_only)

    def eval_params(self) -> dict[str, jax.Array]:
        """Parameters evaluation runs on: the trained ones, or a callback's (e.g. EMA) when it provides them."""
        assert self.train_state is not None
        return self.hooks.eval_params(self.train_state.params)

    # ---------------------------------------------------------------- validate / test / predict
    def _run_eval(
        self,
        stage: str,
        model: LightningModule | None,
        dataloaders: Any,
        ckpt_path: str | None,
        datamodule: LightningDataModule | None,
        verbose: bool = False,
    ) -> Any:
        if model is None:
            model = self.lightning_module
            if model is None:
                raise MisconfigurationError(f"{stage}() needs a model (none was fitted with this trainer)")
        if isinstance(dataloaders, LightningDataModule):
            datamodule, dataloaders = dataloaders, None
        st = STAGES[stage]
        if stage != "predict" and not overrides(model, st.step_method):  # predict_step has a default
            raise MisconfigurationError(f"{stage}() needs {type(model).__name__}.{st.step_method}(batch, batch_idx)")
        with self._run(stage, model, datamodule):
            loaders = split_loaders(loader_for(st, dataloaders, self.datamodule, model))
            if not loaders:
                raise MisconfigurationError(f"{stage}() needs dataloaders, a datamodule or the module's loader method")
            setattr(self, st.loaders_attr, loaders[0] if len(loaders) == 1 else loaders)
            self.engine.setup_model()
            if ckpt_path is not None:
                self._restore(ckpt_path, stage=stage)
            if self.train_state is not None and self.lightning_module is model:
                # the user may have edited the module since fit: evaluate what it holds now
                params, rest = self.engine.binding.read_module()
                self.train_state = self.train_state._replace(params=params, model_state=rest)
            limits = [batch_limit(self.config, st, dl) for dl in loaders]
            # Lightning logs a standalone evaluation at the count of optimizer steps taken so far
            out = EvalLoop(self._loop_parts(), st).run(loaders, limits, log_step=self.global_step)
        if verbose and self.is_global_zero:
            for i, metrics in enumerate(out):
                print_results(st.title + (f" (dataloader {i})" if len(out) > 1 else ""), metrics)
        return out

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
        return self._run_eval("validate", model, dataloaders, ckpt_path, datamodule, verbose)

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
        return self._run_eval("test", model, dataloaders, ckpt_path, datamodule, verbose)

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
