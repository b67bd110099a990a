"""LightningModule: the user's model, its steps and its optimizer.

Subclass it, create flax NNX modules as attributes (in ``configure_model`` to
have them created sharded under the trainer's mesh), write
``training_step`` and ``configure_optimizers``. Step methods are *traced*
once into one compiled SPMD program; hooks run on the host.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from flax import nnx

from jaxlight.hparams import AttributeDict, HyperparametersMixin
from jaxlight.metrics import Collector
from jaxlight.state import nnx_attributes
from jaxlight.tracing import traced_counter

if TYPE_CHECKING:  # pragma: no cover
    from jaxlight.trainer import Trainer


def _has_tracer(tree: Any) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))


def _print_at_run_time(args: tuple, kwargs: dict) -> None:
    """``print(*args, **kwargs)`` from inside a traced step, with the arrays' run-time values (process 0)."""
    opts = {k: kwargs.pop(k) for k in ("sep", "end", "file", "flush") if k in kwargs}
    if kwargs:
        raise TypeError(f"self.print got unexpected keyword argument(s) {sorted(kwargs)}")
    leaves, tree = jax.tree.flatten(args)
    dynamic = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, jax.core.Tracer, np.ndarray))]

    def emit(*values: Any) -> None:
        if jax.process_index() != 0:
            return
        full = list(leaves)
        for i, v in zip(dynamic, values):
            full[i] = v
        print(
            *jax.tree.unflatten(tree, full),
            sep=opts.get("sep", " "),
            end=opts.get("end", "\n"),
            file=opts.get("file") or sys.stdout,
            flush=opts.get("flush", False),
        )

    values = [leaves[i] for i in dynamic]
    if not jax.sharding.get_abstract_mesh().empty:
        # gathered by an explicit constraint: XLA warns when a callback's operand is sharded
        values = [jax.lax.with_sharding_constraint(v, jax.sharding.PartitionSpec()) for v in values]
    jax.debug.callback(emit, *values)


class ModelHooks:
    """Host-side hooks of a LightningModule, called in Lightning's order."""

    def on_fit_start(self) -> None: ...
    def on_fit_end(self) -> None: ...
    def on_train_start(self) -> None: ...
    def on_train_end(self) -> None: ...
    def on_validation_start(self) -> None: ...
    def on_validation_end(self) -> None: ...
    def on_test_start(self) -> None: ...
    def on_test_end(self) -> None: ...
    def on_predict_start(self) -> None: ...
    def on_predict_end(self) -> None: ...
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None: ...
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...
    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_predict_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_train_epoch_start(self) -> None: ...
    def on_train_epoch_end(self) -> None: ...
    def on_validation_epoch_start(self) -> None: ...
    def on_validation_epoch_end(self) -> None: ...
    def on_test_epoch_start(self) -> None: ...
    def on_test_epoch_end(self) -> None: ...
    def on_predict_epoch_start(self) -> None: ...
    def on_predict_epoch_end(self) -> None: ...
    def on_validation_model_eval(self) -> None: ...
    def on_validation_model_train(self) -> None: ...
    def on_test_model_eval(self) -> None: ...
    def on_predict_model_eval(self) -> None: ...
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None: ...
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None: ...


class DataHooks:
    """Data hooks shared by LightningModule and LightningDataModule."""

    def prepare_data(self) -> None: ...
    def setup(self, stage: str) -> None: ...
    def teardown(self, stage: str) -> None: ...


class LightningModule(HyperparametersMixin, ModelHooks, DataHooks):
    """A model, its train/eval steps and its optimizer, in Lightning's shape.

    Guarantees: every ``flax.nnx.Module`` attribute is trained state; after
    ``Trainer.fit`` those attributes hold the trained values as (possibly
    sharded) ``jax.Array``s, so ``model.net(x)`` works directly; during fit
    they are refreshed before validation and epoch-level hooks (the train
    step donates its state, so per-batch hooks read ``trainer.train_state``
    instead). Step methods
    (``training_step``, ``validation_step``, ``test_step``,
    ``predict_step``) are traced once each into compiled programs: they must
    be jax-traceable, and ``batch_idx`` arrives as a traced int32 scalar.
    ``self.log`` follows Lightning's defaults and reductions. With
    ``self.automatic_optimization = False`` the training step applies its own
    updates (``self.manual_backward``, ``opt.step(grads)``; see
    docs/optimizers.md), still inside one compiled program.

    As a torch module does, it is callable (``model(x)`` runs ``forward``),
    has ``train()`` / ``eval()`` (switching every NNX attribute between
    dropout/batch-statistics and deterministic/running-average behaviour)
    and ``freeze()`` / ``unfreeze()``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self._trainer: Trainer | None = None
        self._hparams: AttributeDict = AttributeDict()
        self._hparams_initial: AttributeDict = AttributeDict()
        self._collector: Collector | None = None
        self._training: bool = True
        self._frozen: bool = False
        self._automatic_optimization: bool = True

    # -- trainer access ------------------------------------------------------
    @property
    def trainer(self) -> Trainer:
        if self._trainer is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a Trainer")
        return self._trainer

    @trainer.setter
    def trainer(self, trainer: Trainer | None) -> None:
        self._trainer = trainer

    @property
    def global_step(self) -> Any:
        """Optimizer steps done so far: a Python int in host hooks; inside a step method a traced int32
        array (each step of the compiled program sees its own value; docs/trainer.md#counters-inside-a-step)."""
        traced = traced_counter("global_step")
        if traced is not None:
            return traced
        return self._trainer.global_step if self._trainer is not None else 0

    @property
    def current_epoch(self) -> Any:
        """Completed epochs: a Python int in host hooks; inside a step method a traced int32 array."""
        traced = traced_counter("current_epoch")
        if traced is not None:
            return traced
        return self._trainer.current_epoch if self._trainer is not None else 0

    @property
    def device_mesh(self) -> jax.sharding.Mesh | None:
        return self._trainer.mesh if self._trainer is not None else None

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on process 0 only; inside a compiled step, each time the step runs, with the values.

        In a step method the arrays are tracers while the step is traced, so a
        plain ``print`` shows ``Traced<...>`` once; ``self.print`` instead
        prints the arrays' values every time the compiled step runs (through
        ``jax.debug.callback``), with ``print``'s ``sep``/``end``/``file``/
        ``flush``. Other arguments (strings, numbers) print as given.
        """
        if self._collector is None or not _has_tracer((args, kwargs)):
            if jax.process_index() == 0:
                print(*args, **kwargs)
            return
        _print_at_run_time(args, kwargs)

    # -- torch.nn.Module behaviour ---------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """What ``model(x)`` computes; override it as in Lightning.

        The default calls the module's only NNX model (e.g. ``self.net``) with
        the arguments; a module with several NNX models must define it.
        """
        models = nnx_attributes(self)
        if len(models) == 1:
            return next(iter(models.values()))(*args, **kwargs)
        have = f"NNX models {sorted(models)}" if models else "no NNX model yet (configure_model creates them)"
        raise NotImplementedError(
            f"{type(self).__name__} has {have}, so model(...) has no default: define forward(self, ...) "
            f"(or predict_step, whose default calls it)"
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    @property
    def training(self) -> bool:
        """True in ``training_step`` and after ``train()``; False in the eval steps and after ``eval()``."""
        if self._collector is not None:  # inside a traced step: the stage decides, as Lightning's loops do
            return self._collector.stage == "train"
        return self._training

    @training.setter
    def training(self, mode: bool) -> None:  # torch code assigns it directly at times
        self._training = bool(mode)

    def train(self, mode: bool = True) -> LightningModule:
        """Put every NNX attribute in training mode (dropout on, BatchNorm on batch statistics and
        updating its running averages), or in eval mode with ``mode=False``; returns ``self``.

        Nested LightningModule attributes follow, as torch's ``train()`` recurses. The
        trainer compiles its steps in the right mode whatever the mode set here;
        this is for calling the module yourself (``model(x)``).
        """
        if not isinstance(mode, bool):
            raise ValueError(f"train(mode) expects a bool, got {mode!r}")
        for m in nnx_attributes(self).values():
            m.train() if mode else m.eval()
        for child in vars(self).values():
            if isinstance(child, LightningModule) and child is not self:
                child.train(mode)
        self._training = mode
        return self

    def eval(self) -> LightningModule:
        """``train(False)``: dropout off, BatchNorm on its running statistics; returns ``self``."""
        return self.train(False)

    @property
    def frozen(self) -> bool:
        """Whether ``freeze()`` was called (and ``unfreeze()`` not since)."""
        return self._frozen

    def freeze(self) -> None:
        """Freeze for inference, as Lightning's ``freeze()``: eval mode, and ``frozen`` is True.

        A jax parameter has no ``requires_grad``: what the trainer optimizes is
        decided by the optimizer. A frozen module is not meant to be fitted
        (``unfreeze()`` first); to train part of a model with the rest fixed,
        mask the optimizer (``optax.multi_transform`` with ``optax.set_to_zero()``
        for the fixed parameter paths, see docs/porting_torch.md).
        """
        self.eval()
        self._frozen = True

    def unfreeze(self) -> None:
        """Undo ``freeze()``: training mode, ``frozen`` is False."""
        self._frozen = False
        self.train()

    # -- optimization (Lightning's API; see docs/optimizers.md) ---------------------
    @property
    def automatic_optimization(self) -> bool:
        """True (default): the trainer differentiates ``training_step``'s loss and applies the optimizer.
        Set it to False in ``__init__`` for manual optimization: ``training_step`` takes gradients with
        :meth:`manual_backward` and applies them with ``opt.step(grads)`` for ``opt`` in
        :meth:`optimizers` (several optimizers, alternating updates), all inside one compiled step."""
        return getattr(self, "_automatic_optimization", True)

    @automatic_optimization.setter
    def automatic_optimization(self, value: bool) -> None:
        self._automatic_optimization = bool(value)

    def _optimizer_config(self) -> Any:
        engine = getattr(self._trainer, "engine", None) if self._trainer is not None else None
        cfg = getattr(engine, "optimizer", None)
        if cfg is None or not cfg.built:
            raise RuntimeError(
                f"{type(self).__name__}.optimizers() is available once fit has set up the optimizers "
                f"(from on_fit_start on, and in training_step)"
            )
        return cfg

    def optimizers(self, use_pl_optimizer: bool = True) -> Any:
        """The optimizers ``configure_optimizers`` returned, as in Lightning: one, or a list of several.

        With manual optimization these are :class:`~jaxlight.manual.ManualOptimizer` handles
        (``opt.step(grads)``, ``opt.param_paths``, ``opt.optimizer`` is the optax transformation);
        with automatic optimization the optax transformations themselves.
        """
        from jaxlight.manual import current_manual_context

        ctx = current_manual_context()
        if ctx is not None:
            opts = list(ctx.handles)
        else:
            cfg = self._optimizer_config()
            opts = list(cfg.handles) if not cfg.automatic else [o.tx for o in cfg.optimizers]
        return opts[0] if len(opts) == 1 else opts

    def lr_schedulers(self) -> Any:
        """The schedulers ``configure_optimizers`` returned (None, one, or a list), as in Lightning.

        optax schedules need no ``.step()``: they are functions of the optimizer's step count, applied
        inside the update; plateau and epoch-interval schedulers are stepped by the trainer.
        """
        scheds = self._optimizer_config().schedules
        if not scheds:
            return None
        return scheds[0] if len(scheds) == 1 else scheds

    def manual_backward(
        self, loss_fn: Callable[..., Any], *args: Any, optimizer: Any = None, has_aux: bool = False, **kwargs: Any
    ) -> tuple[Any, dict[str, Any]]:
        """``loss, grads = self.manual_backward(loss_fn, *args)``: the loss and its gradients, in training_step.

        JAX differentiates functions, not arrays, so this takes the function
        computing the loss (it reads the models as usual, ``self.disc(x)``;
        ``self.log`` inside works). Gradients are a dict keyed by parameter
        path, for ``optimizer``'s parameters, else the toggled optimizer's
        (:meth:`toggle_optimizer`), else every parameter. ``has_aux``: ``loss_fn``
        returns ``(loss, aux)`` and this returns ``((loss, aux), grads)``, as
        ``jax.value_and_grad``. Forward passes update the models' other state
        (batch statistics, RNG counters) as they do in training_step.
        """
        from jaxlight.manual import require_manual

        ctx = require_manual("self.manual_backward(loss_fn)")
        if not callable(loss_fn) or hasattr(loss_fn, "shape"):
            raise TypeError(
                "manual_backward takes the function that computes the loss, not the loss: JAX differentiates "
                "functions. Write `loss, grads = self.manual_backward(lambda: loss_of(batch))` (or pass arguments "
                "after the function), then `opt.step(grads)`"
            )
        return ctx.value_and_grad(loss_fn, args, kwargs, optimizer, has_aux)

    def toggle_optimizer(self, optimizer: Any) -> None:
        """Make :meth:`manual_backward` differentiate only ``optimizer``'s parameters (Lightning's toggle)."""
        from jaxlight.manual import require_manual

        require_manual("self.toggle_optimizer(opt)").toggled = optimizer

    def untoggle_optimizer(self, optimizer: Any = None) -> None:
        """Undo :meth:`toggle_optimizer`: :meth:`manual_backward` differentiates every parameter again."""
        from jaxlight.manual import require_manual

        require_manual("self.untoggle_optimizer(opt)").toggled = None

    @contextlib.contextmanager
    def toggled_optimizer(self, optimizer: Any) -> Iterator[None]:
        """``with self.toggled_optimizer(opt):`` toggles ``opt`` for the block."""
        self.toggle_optimizer(optimizer)
        try:
            yield
        finally:
            self.untoggle_optimizer(optimizer)

    def clip_gradients(
        self,
        optimizer: Any,
        grads: Mapping[str, Any],
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> dict[str, Any]:
        """``grads`` clipped as ``Trainer(gradient_clip_val=...)`` would clip them (Lightning's
        ``clip_gradients`` for manual optimization); returns the clipped dict (gradients are values).
        ``"norm"`` (default) is ``optax.clip_by_global_norm``, ``"value"`` is ``optax.clip``."""
        import optax

        algorithm = gradient_clip_algorithm or "norm"
        if algorithm not in ("norm", "value"):
            raise ValueError(f"gradient_clip_algorithm={algorithm!r}; choose 'norm' or 'value'")
        if not gradient_clip_val:
            return dict(grads)
        clip = optax.clip_by_global_norm(gradient_clip_val) if algorithm == "norm" else optax.clip(gradient_clip_val)
        return dict(clip.update(dict(grads), clip.init(dict(grads)))[0])

    # -- user-facing definitions -----------------------------------------------
    def configure_model(self) -> None:
        """Create the flax NNX modules. Called by the trainer under its mesh and
        logical rules, so annotated parameters are created sharded."""

    def configure_optimizers(self) -> Any:
        """The optimizer(s), as in Lightning: an optax transformation, ``{"optimizer": tx, "lr_scheduler":
        ...}``, ``([tx], [schedule])``, a list (several optimizers, parameter subsets) or
        ``jl.optim.param_groups(...)``; see docs/optimizers.md."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement configure_optimizers() returning an optax "
            f"GradientTransformation or {{'optimizer': tx, 'lr_scheduler': schedule}} (docs/optimizers.md)"
        )

    def configure_callbacks(self) -> Sequence[Any] | Any:
        return []

    def training_step(self, batch: Any, batch_idx: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement training_step(batch, batch_idx)")

    def validation_step(self, batch: Any, batch_idx: Any) -> Any:
        raise NotImplementedError

    def test_step(self, batch: Any, batch_idx: Any) -> Any:
        raise NotImplementedError

    def predict_step(self, batch: Any, batch_idx: Any = None, dataloader_idx: int = 0) -> Any:
        """Lightning's default: ``self(batch)``, i.e. ``forward`` (by default the module's only NNX model)."""
        return self(batch)

    # -- logging -----------------------------------------------------------
    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: bool = True,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: str = "mean",
        enable_graph: bool = False,
        sync_dist: bool = False,
        sync_dist_group: Any = None,
        add_dataloader_idx: bool = True,
        batch_size: int | None = None,
        metric_attribute: str | None = None,
        rank_zero_only: bool = False,
    ) -> None:
        """Record a scalar, with Lightning's defaults and reductions.

        In ``training_step``: on_step=True, on_epoch=False; in
        validation/test steps and epoch-end hooks: on_step=False,
        on_epoch=True. Epoch values reduce with ``reduce_fx`` ("mean" is
        weighted by ``batch_size``, inferred from the batch). Values are
        global (already reduced over the mesh), so ``sync_dist`` is a no-op.
        """
        col = self._collector
        if col is None:
            if self._trainer is None:
                raise RuntimeError("self.log was called outside a Trainer run")
            col = self._trainer.reporter.host_collector()
        col.add(
            name,
            value,
            prog_bar=prog_bar,
            logger=logger,
            on_step=on_step,
            on_epoch=on_epoch,
            reduce_fx=reduce_fx if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", str(reduce_fx)),
            batch_size=batch_size,
            add_dataloader_idx=add_dataloader_idx,
        )

    def log_dict(
        self,
        dictionary: Mapping[str, Any],
        prog_bar: bool = False,
        logger: bool = True,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: str = "mean",
        enable_graph: bool = False,
        sync_dist: bool = False,
        sync_dist_group: Any = None,
        add_dataloader_idx: bool = True,
        batch_size: int | None = None,
        rank_zero_only: bool = False,
    ) -> None:
        """``self.log`` for each item of ``dictionary``."""
        for k, v in dictionary.items():
            self.log(
                k,
                v,
                prog_bar=prog_bar,
                logger=logger,
                on_step=on_step,
                on_epoch=on_epoch,
                reduce_fx=reduce_fx,
                batch_size=batch_size,
                add_dataloader_idx=add_dataloader_idx,
            )

    # -- tracing support (used by jaxlight.step) ---------------------------------
    @contextlib.contextmanager
    def _bound(self, models: Mapping[str, nnx.Module], collector: Collector | None) -> Iterator[None]:
        """Temporarily point the NNX attributes at ``models`` (traced copies)."""
        saved = {k: self.__dict__.get(k) for k in models}
        saved_col = self._collector
        try:
            self._point_at(models)
            self._collector = collector
            yield
        finally:
            for k, m in saved.items():
                object.__setattr__(self, k, m)
            self._collector = saved_col

    def _point_at(self, models: Mapping[str, nnx.Module]) -> None:
        """Point the NNX attributes at ``models`` (inside :meth:`_bound`, which restores them)."""
        for k, m in models.items():
            object.__setattr__(self, k, m)

    # -- checkpoints (wired by the checkpoint callback) ---------------------------
    @classmethod
    def load_from_checkpoint(
        cls,
        checkpoint_path: str,
        map_location: Any = None,
        hparams_file: str | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> LightningModule:
        """Rebuild the module from a checkpoint's hyperparameters (``kwargs`` override them) and load its weights.

        Lightning's arguments: ``map_location`` is accepted and has nothing to do (arrays land on JAX's
        default device; a trainer places them on its mesh), ``hparams_file`` is a YAML file (read with
        ``yaml.safe_load``) whose values override the checkpoint's hyperparameters, and ``strict`` may only
        be True (every parameter and variable must match by name and shape; the error lists the ones that
        do not).
        """
        from jaxlight.checkpoint import load_module_from_checkpoint

        if strict is False:
            raise ValueError(
                "load_from_checkpoint(strict=False) is not supported: every parameter must match by name and shape "
                "(the error lists the ones that do not); to load part of a model, load the checkpoint into a module "
                "that has exactly those variables, or use jaxlight.migrate.load_torch_weights(strict=False) for "
                "torch weights"
            )
        if hparams_file is not None:
            import yaml

            with open(hparams_file) as f:
                file_hp = yaml.safe_load(f) or {}
            if not isinstance(file_hp, dict):
                raise ValueError(f"hparams_file {hparams_file} holds a {type(file_hp).__name__}, not a mapping")
            kwargs = {**file_hp, **kwargs}
        return load_module_from_checkpoint(cls, checkpoint_path, **kwargs)
