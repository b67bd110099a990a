"""The module's state on the mesh, and the compiled steps.

The engine creates the module's NNX state sharded (``configure_model`` runs
once for shapes and once inside ``jax.jit`` with the strategy's
out-shardings), keeps the module's attributes pointing at the current arrays,
places the optimizer state and callback-owned state next to the parameters
they mirror (in the memory kind the strategy asks for), and lowers and
compiles one program per stage inside the strategy's contexts.
"""

from __future__ import annotations

import collections
import contextlib
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlight import rank_failure
from jaxlight.binding import ModuleBinding
from jaxlight.data import BatchPlacer, leaf_path
from jaxlight.errors import MisconfigurationError
from jaxlight.explicit import explicit_twin, name_missing_axis, needs_explicit, refuse_pieces, typed
from jaxlight.flops import MatmulDtypes
from jaxlight.metrics import StepContext, step_context
from jaxlight.multistep import MultiStep
from jaxlight.nn.constrain import axis_rules
from jaxlight.optim import OptimizerConfig, configure, select_params
from jaxlight.precision import Precision, check_matmul_dtypes
from jaxlight.rank_zero import rank_zero_info
from jaxlight.signatures import step_call
from jaxlight.stages import STAGES
from jaxlight.state import (
    ModelParts,
    configured_objects,
    graph_root,
    held_statistics,
    in_eval_mode,
    is_nnx_object,
    nnx_attributes,
    nnx_objects,
    path_str,
    split_models,
    split_state,
    train_graphdef,
)
from jaxlight.step import StepBuilder, StepExtension, TrainState
from jaxlight.strategies.placement import mirror_shardings, named, param_specs, rest_specs
from jaxlight.strategies.strategy import Strategy

if TYPE_CHECKING:  # pragma: no cover
    from jaxlight.callbacks.callback import Callback
    from jaxlight.module import LightningModule


def _in_device_memory(leaf: Any) -> bool:
    kind = getattr(getattr(leaf, "sharding", None), "memory_kind", None)
    return kind in (None, "device")


class Engine:
    """Owns the placed state (``train_state``, its shardings) and the compiled steps of one trainer.

    Guarantees: parameters are created directly in their shardings (no
    device ever holds a whole FSDP-sharded parameter); every optimizer-state
    and callback-state leaf that mirrors a parameter takes that parameter's
    sharding, in the memory kind the strategy gives it; each stage compiles
    once per model (``compile_counts``), under the mesh, the logical rules
    and every strategy piece's trace context.
    """

    def __init__(self, strategy: Strategy, mesh: jax.sharding.Mesh, precision: Precision) -> None:
        self.strategy = strategy
        self.mesh = mesh
        self.precision = precision
        self.module: LightningModule | None = None
        self.parts: ModelParts | None = None
        self.param_shardings: dict[str, NamedSharding] = {}
        self.rest_shardings: dict[str, NamedSharding] = {}
        self.state_shardings: TrainState | None = None
        self.train_state: TrainState | None = None
        self.builder: StepBuilder | None = None
        self.optimizer: OptimizerConfig | None = None
        self.compiled: dict[str, Any] = {}
        self.compile_counts: collections.Counter = collections.Counter()
        self.batch_rows: dict[str, int] = {}  # global rows each stage's step was compiled for
        self.init_compiled: Any = None  # the compiled parameter creation (kept for inspection)
        self.matmul_dtypes: MatmulDtypes | None = None  # half precisions: the train step's matmul FLOPs by dtype
        self.binding = ModuleBinding(self)  # the module's attributes <-> the train state (jaxlight/binding.py)
        self.eval_steps: dict[tuple[str, Any], Any] = {}  # compiled evaluation steps by (key, batch signature)
        self.train_steps: dict[Any, Any] = {}  # compiled train steps by batch signature (a ragged batch: its own)
        # steps_per_execution > 1: the compiled multi-step programs by (steps, batch signature)
        self.multi_steps: dict[tuple[int, Any], Any] = {}
        # the module's steps name mesh axes in out_sharding=/reshard: traced under the mesh's
        # Explicit twin (jaxlight/explicit.py), set by the first trace that needs it
        self.explicit = False

    # -- context ----------------------------------------------------------------------
    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """The mesh, the logical rules and the pieces' trace contexts (entered to create, trace, compile).

        Everything is entered on ``with`` and left on exit, also when entering one of them fails
        (a global mesh left set would place every later computation of the process on it).
        """
        with contextlib.ExitStack() as stack:
            stack.enter_context(jax.set_mesh(explicit_twin(self.mesh) if self.explicit else self.mesh))
            # Not flax's nnx.logical_axis_rules: flax reads a rules table as a rename
            # (one mesh axis per name, no divisibility fallback, duplicates refused),
            # so placement goes through jaxlight.strategies.resolve_spec only.
            stack.enter_context(nnx.use_eager_sharding(False))
            stack.enter_context(axis_rules(self.mesh, self.strategy.logical_rules))
            stack.enter_context(self.strategy.trace_context(self.mesh))
            yield

    # -- the model ------------------------------------------------------------------------
    def attach(self, module: LightningModule) -> None:
        """Serve ``module``; a different module than before starts from scratch."""
        if self.module is not None and self.module is not module:
            self.parts = None
            self.train_state = None
            self.state_shardings = None
            self.builder = None
            self.compiled = {}
            self.eval_steps = {}
            self.train_steps = {}
            self.multi_steps = {}
            self.explicit = False
        self.binding.reset(synced=self.module is not None and self.module is not module)
        self.module = module

    def setup_model(self) -> None:
        """Create (or adopt) the module's NNX state, placed on the mesh (once per module)."""
        module = self.module
        assert module is not None
        if self.parts is not None:
            return
        with self.context():
            existing = nnx_attributes(module)
            if not existing:
                build = self._builder_of(module)
                parts, aparams, arest = self._abstract_model(module)
                psh, rsh = self._var_shardings(parts, aparams, arest)

                def create():
                    return split_state(parts, build())

                # Compiled SPMD: each device computes only its shards.
                self.init_compiled = jax.jit(create, out_shardings=(psh, rsh)).lower().compile()
                params, rest = self.init_compiled()
            else:
                parts, params, rest = split_models(nnx_objects(module))
                psh, rsh = self._var_shardings(parts, params, rest)
                params = jax.device_put(params, psh)
                rest = jax.device_put(rest, rsh)
        params = self.precision.store(params)
        self.parts = parts
        self.binding.reset(synced=False)
        self.param_shardings = psh
        self.rest_shardings = rsh
        self.binding.write_back(params, rest)

    @staticmethod
    def _builder_of(module: LightningModule) -> Any:
        def build() -> dict[str, Any]:
            return configured_objects(module)

        return build

    def _abstract_model(self, module: LightningModule) -> tuple[ModelParts, dict, dict]:
        """The module's parts and abstract params/rest, from ``configure_model`` or its existing attributes."""
        if nnx_attributes(module):
            parts, params, rest = split_models(nnx_objects(module))
            sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
            return parts, jax.tree.map(sds, params), jax.tree.map(sds, rest)
        # Shapes and annotations only: with a mesh in context flax would turn the
        # logical names into mesh axes itself; the placement comes from param_specs.
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())), nnx.use_eager_sharding(False):
            abstract = nnx.eval_shape(self._builder_of(module))
        if not any(isinstance(v, nnx.Module) for v in abstract.values()):
            raise MisconfigurationError(
                f"{type(module).__name__} holds no flax.nnx.Module attribute: create the model in "
                f"__init__ or configure_model (e.g. self.net = MLP(nnx.Rngs(0)))"
            )
        return split_models(abstract)

    def _var_shardings(self, parts: ModelParts, params: Mapping, rest: Mapping) -> tuple[dict, dict]:
        self.strategy.check_model(params, parts.params.variables, self.mesh)
        pspecs = param_specs(params, parts.params.variables, self.strategy, self.mesh)
        rspecs = rest_specs(rest, parts.rest.variables, self.strategy, self.mesh)
        return (
            {k: named(self.mesh, s) for k, s in pspecs.items()},
            {k: named(self.mesh, s) for k, s in rspecs.items()},
        )

    # -- training state -------------------------------------------------------------------------
    def _mirror_shardings(
        self, tree: Any, params: Mapping[str, Any], group: str, psh: Mapping[str, NamedSharding] | None = None
    ) -> Any:
        """Leaves mirroring a parameter take its sharding and the strategy's memory kind (placement's one rule)."""
        psh = self.param_shardings if psh is None else psh
        return mirror_shardings(tree, params, psh, self.mesh, self.strategy, group)

    def setup_training(
        self, optimizer: OptimizerConfig, callbacks: Sequence[Callback], trainer: Any, global_step: int
    ) -> None:
        """Place the optimizer state, the callbacks' in-step state and the step counter; build the step."""
        module = self.module
        assert module is not None and self.parts is not None
        params, rest = self.binding.read_module()
        params = self.precision.store(params)
        # configure_optimizers' answer resolved against the parameters: selectors, schedulers, manual mode,
        # and the parameters a callback froze (BaseFinetuning), which no optimizer updates
        frozen = _frozen_parameters(callbacks, trainer, module, list(params))
        self.optimizer = optimizer = _as_config(optimizer).build(module, params, frozen=frozen)
        tx = optimizer.tx
        exts: list[StepExtension] = []
        extra: dict[str, Any] = {}
        for cb in callbacks:
            ext = cb.step_extension(trainer)
            if ext is None:
                continue
            exts.append(ext)
            extra[ext.name] = cb.init_step_state(trainer, params)
            for path, leaf in jax.tree_util.tree_flatten_with_path(extra[ext.name])[0]:
                sh = getattr(leaf, "sharding", None)
                if not (isinstance(sh, NamedSharding) and sh.mesh == self.mesh):
                    raise MisconfigurationError(
                        f"{type(cb).__name__}.init_step_state returned leaf "
                        f"{jax.tree_util.keystr(path) or '<root>'} that is not a jax.Array placed on "
                        f"trainer.mesh (got {type(leaf).__name__} with sharding {sh}); place it with "
                        f"jax.device_put(x, NamedSharding(trainer.mesh, spec))"
                    )
        with self.context():
            osh = self._mirror_shardings(jax.eval_shape(tx.init, params), params, "opt_state")
            opt_state = jax.jit(tx.init, out_shardings=osh)(params)
        esh = self._mirror_shardings(extra, params, "callback_state")
        extra = jax.device_put(extra, esh)
        self._check_state_on_device(callbacks, {"opt_state": osh, "callback_state": esh})
        rep = NamedSharding(self.mesh, P())
        scaling = self._loss_scale_init()
        lsh = jax.tree.map(lambda _: rep, scaling)
        self.state_shardings = TrainState(self.param_shardings, self.rest_shardings, osh, esh, rep, lsh)
        self.builder = StepBuilder(
            module,
            self.parts,
            self.precision,
            tx,
            tuple(exts),
            with_grad_norm=any(cb.needs_grad_norm for cb in callbacks),
            skip_nonfinite=any(cb.skip_nonfinite_updates for cb in callbacks),
            wrap_update=lambda update: self.strategy.wrap_update(update, self.state_shardings),
            manual=not optimizer.automatic,
            handles=optimizer.handles,
        )
        step = jax.device_put(jnp.int32(global_step), rep)
        self.train_state = TrainState(params, rest, opt_state, extra, step, jax.device_put(scaling, lsh))
        self._drop_train_programs()
        self.refresh_train_modes()

    def _loss_scale_init(self) -> Any:
        """The loss scaler's first state (``"16-mixed"``), unplaced; None when the precision scales no loss."""
        scaler = self.precision.scaler
        return scaler.init() if scaler is not None and scaler.enabled else None

    def refresh_train_modes(self) -> bool:
        """Make the train step follow the modes the user set on the module's layers (a submodule's
        ``.eval()``, ``track_running_stats = False`` on a BatchNorm); when they changed since it was compiled,
        drop it, so the next batch compiles it again (counted in ``compile_counts``). Returns whether it
        changed. After ``module.eval()`` of the whole module every layer trains in training mode, as before.
        """
        module, parts, builder = self.module, self.parts, self.builder
        if module is None or parts is None or builder is None:
            return False
        models = {k: module.__dict__.get(k) for k in parts.names}
        if not all(is_nnx_object(m) for m in models.values()):
            return False
        graphdef = train_graphdef(parts, models, bool(module.training))
        held = held_statistics(parts, models)
        if graphdef == parts.train_graphdef and held == builder.held_rest:
            return False
        self.binding._read_replaced(models)  # a hook gave an attribute other variables: refused by name
        self.parts = builder.parts = parts._replace(train_graphdef=graphdef)
        builder.held_rest = held
        self._drop_train_programs()
        kept = [
            p
            for p, n in nnx.iter_graph(graph_root(parts, models))
            if module.training and isinstance(n, nnx.Module) and in_eval_mode(n)
        ]
        if kept:  # Lightning warns about modules in eval mode at the start of training
            where = ", ".join(path_str(p[1:]) for p in kept[:5]) + (" ..." if len(kept) > 5 else "")
            rank_zero_info(
                f"jaxlight: {len(kept)} layer(s) are in eval mode ({where}); the train step runs them so, as torch "
                f"does; call .train() on them to train them in training mode"
            )
        return True

    def replace_optimizer(self, optimizer: OptimizerConfig, carry: Callable[[Any, Any], Any]) -> None:
        """Train on with a rebuilt optimizer (``BaseFinetuning`` added a parameter group): its state is placed
        as :meth:`setup_training` places it, ``carry(old_state, fresh_state)`` keeps what stays (the
        existing groups' moments and counts), and the train step is compiled again at the next batch."""
        st, old = self.train_state, self.builder
        assert st is not None and old is not None and self.state_shardings is not None
        with self.context():
            osh = self._mirror_shardings(jax.eval_shape(optimizer.tx.init, st.params), st.params, "opt_state")
            fresh = jax.jit(optimizer.tx.init, out_shardings=osh)(st.params)
        self.optimizer = optimizer
        self.state_shardings = self.state_shardings._replace(opt_state=osh)
        self.train_state = st._replace(opt_state=jax.device_put(carry(st.opt_state, fresh), osh))
        self.builder = StepBuilder(
            old.module,
            self.parts,
            self.precision,
            optimizer.tx,
            old.extensions,
            with_grad_norm=old.with_grad_norm,
            skip_nonfinite=old.skip_nonfinite,
            wrap_update=lambda update: self.strategy.wrap_update(update, self.state_shardings),
            manual=old.manual,
            handles=optimizer.handles,
        )
        self.builder.held_rest = old.held_rest
        self._drop_train_programs()

    def _check_state_on_device(self, callbacks: Sequence[Callback], shardings: Mapping[str, Any]) -> None:
        for cb in callbacks:
            for group in cb.state_on_device:
                if group not in shardings:
                    raise MisconfigurationError(
                        f"{type(cb).__name__}.state_on_device names {group!r}; TrainState groups that can leave "
                        f"device memory are {sorted(shardings)}"
                    )
                moved = [s for s in jax.tree.leaves(shardings[group]) if s.memory_kind not in (None, "device")]
                if moved:
                    raise MisconfigurationError(
                        f"{type(cb).__name__} reads TrainState.{group} on the device between steps "
                        f"(state_on_device={cb.state_on_device!r}), but strategy {self.strategy.name!r} keeps "
                        f"{len(moved)} of its leaves in {moved[0].memory_kind!r} memory; leave {group} on the "
                        f"device (e.g. HostOffload({'optimizer_state' if group == 'opt_state' else group}=False)) "
                        f"or drop the callback"
                    )

    def eval_state(self) -> tuple[dict, dict]:
        """Parameters and other state to evaluate with when nothing was trained (read from the module)."""
        if self.builder is None:
            assert self.parts is not None
            self.builder = StepBuilder(self.module, self.parts, self.precision, None)
        if self.train_state is not None:  # not read again: the module shows it, and its edits go into it
            return self.train_state.params, self.train_state.model_state
        return self.binding.read_module()

    def on_device(self, tree: Any) -> Any:
        """``tree`` with host-resident leaves copied into device memory (evaluating offloaded EMA weights)."""
        if all(_in_device_memory(x) for x in jax.tree.leaves(tree)):
            return tree
        return jax.tree.map(
            lambda x: x if _in_device_memory(x) else jax.device_put(x, x.sharding.with_memory_kind("device")), tree
        )

    def compile_abstract(
        self, module: LightningModule, tx: Any, batch: Any, batch_idx: Any = None, *, with_jaxpr: bool = False
    ) -> tuple[Any, ...]:
        """Lower and compile ``module``'s train step on abstract shapes, allocating no state.

        ``tx``: what ``configure_optimizers`` returns (any of its forms) or an
        :class:`~jaxlight.optim.OptimizerConfig`.

        ``batch`` is a pytree of ``jax.ShapeDtypeStruct`` (global shapes,
        shardings optional: rows over the batch axes by default). Returns the
        compiled step (for ``memory_analysis()`` and its HLO) and the abstract
        TrainState with the shardings the real run would use. Does not change
        this engine's model or state. ``with_jaxpr=True`` adds the traced step's jaxpr as a third item
        (what :func:`jaxlight.flops.matmul_flops` counts).
        """
        with self.context():
            parts, aparams, arest = self._abstract_model(module)
            psh, rsh = self._var_shardings(parts, aparams, arest)
            aparams = self.precision.store(aparams)
            optimizer = _as_config(tx).build(module, aparams)
            opt_shapes = jax.eval_shape(optimizer.tx.init, aparams)
            osh = self._mirror_shardings(opt_shapes, aparams, "opt_state", psh)
            rep = NamedSharding(self.mesh, P())
            scaling = self._loss_scale_init()
            lsh = jax.tree.map(lambda _: rep, scaling)
            shardings = TrainState(psh, rsh, osh, {}, rep, lsh)
            sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
            state = TrainState(
                jax.tree.map(sds, aparams, psh),
                jax.tree.map(sds, arest, rsh),
                jax.tree.map(sds, opt_shapes, osh),
                {},
                jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
                jax.tree.map(sds, scaling, lsh),
            )
            placer = BatchPlacer(self.mesh, strategy=self.strategy)
            batch = jax.tree_util.tree_map_with_path(
                lambda p, x: (
                    x
                    if getattr(x, "sharding", None) is not None
                    else jax.ShapeDtypeStruct(
                        x.shape, x.dtype, sharding=placer.leaf_sharding(leaf_path(p), tuple(x.shape))
                    )
                ),
                batch,
            )
            builder = StepBuilder(
                module,
                parts,
                self.precision,
                optimizer.tx,
                wrap_update=lambda update: self.strategy.wrap_update(update, shardings),
                manual=not optimizer.automatic,
                handles=optimizer.handles,
            )
            idx = jax.ShapeDtypeStruct((), jnp.int32) if batch_idx is None else batch_idx
            flush = jax.ShapeDtypeStruct((), jnp.bool_)
            epoch = jax.ShapeDtypeStruct((), jnp.int32)
            fn = jax.jit(builder.train_step, donate_argnums=0, out_shardings=(shardings, None, None))
            with lightning_step_call(module, "training_step"):
                traced = fn.trace(state, batch, idx, flush, epoch)
                compiled = traced.lower().compile()
        return (compiled, state, traced.jaxpr) if with_jaxpr else (compiled, state)

    # -- compile ------------------------------------------------------------------------------
    def _traced(self, trace: Callable[[Callable[[Any], Any]], Any]) -> Any:
        """``trace(typed)`` under :meth:`context`: ``typed`` maps the arguments to what the step is traced
        with. A step refused for naming Auto axes in ``out_sharding=``/``reshard`` switches this module to
        the explicit trace (the mesh's Explicit twin, arguments typed by their shardings) and runs again."""
        if not self.explicit:
            try:
                with self.context():
                    return trace(lambda tree: tree)
            except ValueError as e:
                if not needs_explicit(e):
                    named_err = name_missing_axis(e, self.mesh)
                    if named_err is e:
                        raise
                    raise named_err from e
                refuse_pieces(self.strategy, e)
                self.explicit = True
        twin = explicit_twin(self.mesh)
        try:
            with self.context():
                return trace(lambda tree: typed(tree, self.mesh, twin))
        except ValueError as e:
            named_err = name_missing_axis(e, self.mesh)
            if named_err is e:
                raise
            raise named_err from e

    def compile_eval(
        self,
        stage: str,
        key: str,
        params: Any,
        rest: Any,
        batch: Any,
        batch_idx: Any,
        valid: Any,
        counters: Any,
        *,
        shares: int = 1,
        dataloader_idx: int | None = None,
    ) -> Any:
        """Lower and compile an evaluation step ``(params, rest, batch, batch_idx, valid, counters) -> (out, logs)``.

        ``counters`` (int32[2]): the run's ``[global_step, current_epoch]``, an argument so the step reads
        them as traced values (one program for every validation run) rather than the numbers of the first.

        ``valid`` (int32) is the number of real rows per share of a padded
        batch (the full share for an unpadded one): the step is traced inside a
        :class:`~jaxlight.metrics.StepContext`, so ``self.log`` weighs values
        by real rows and :func:`jaxlight.data.batch_mask` marks them.
        ``dataloader_idx`` (several loaders) is passed to the step method as its
        third argument when it takes one, and suffixes logged names. Stored
        under ``compiled[key]``; counted in ``compile_counts[stage]``.
        """
        b = self.builder
        assert b is not None
        self._check_batch(stage, batch)
        rows = int(jax.tree.leaves(batch)[0].shape[0])
        method = STAGES[stage].step_method

        def eval_step(params, rest, batch, batch_idx, valid, counters):
            ctx = StepContext(valid=valid, shares=shares, rows=rows, dataloader_idx=dataloader_idx)
            with step_context(ctx), lightning_step_call(b.module, method, dataloader_idx):
                return b.eval_step_carrying(stage, params, rest, batch, batch_idx, counters)

        eval_step.__name__ = f"{stage}_step"
        args = (params, rest, batch, batch_idx, valid, counters)
        compiled = _CarryingEvalStep(self._traced(lambda ty: jax.jit(eval_step).lower(*ty(args)).compile()), self)
        self.compile_counts[stage] += 1
        self.compiled[key] = compiled
        self.eval_steps[(key, _signature(batch))] = compiled
        return compiled

    def eval_step_for(self, key: str, batch: Any) -> Any:
        """The evaluation step compiled under ``key`` for this batch's shapes and dtypes, or None."""
        return self.eval_steps.get((key, _signature(batch)))

    def compile_train(self, state: TrainState, batch: Any, batch_idx: Any, flush: Any, epoch: Any) -> Any:
        """Lower and compile the train step ``(state, batch, batch_idx, flush, epoch) -> (state, outputs, logs)``
        for these example arguments, the state donated. Stored by the batch's shapes
        (:meth:`train_step_for`); the first one of a training setup also under ``compiled["train"]``."""
        b = self.builder
        assert b is not None
        self._check_batch("train", batch)

        def trace(ty: Callable[[Any], Any]) -> _AdoptingTrainStep:
            fn = jax.jit(b.train_step, donate_argnums=0, out_shardings=(self.state_shardings, None, None))
            with lightning_step_call(b.module, "training_step"):
                traced = fn.trace(*ty((state, batch, batch_idx, flush, epoch)))
                return _AdoptingTrainStep(traced.lower().compile(), self, traced.jaxpr.jaxpr, 1)

        compiled = self._traced(trace)
        self._check_matmul_dtypes(compiled)
        self.compile_counts["train"] += 1
        self.train_steps[_signature(batch)] = compiled
        self.compiled.setdefault("train", compiled)
        return compiled

    def train_step_for(self, batch: Any) -> Any:
        """The train step compiled for this batch's shapes and dtypes, or None (a ragged batch not seen yet)."""
        return self.train_steps.get(_signature(batch))

    def compile_train_steps(
        self, state: TrainState, batches: Sequence[Any], batch_idx: Any, flush: Any, epoch: Any, full: bool
    ) -> Any:
        """Lower and compile ``len(batches)`` train steps as one program (``Trainer(steps_per_execution=N)``):
        ``(state, batches, batch_idx[N], flush[N], epoch) -> (state, outputs per step, logs per step)``, the state
        donated once (:class:`~jaxlight.multistep.MultiStep`). Stored in ``multi_steps`` by (step count,
        batch shapes) (:meth:`train_steps_for`); the full execution (``full``) also under ``compiled["train"]``;
        counted in ``compile_counts["train"]``."""
        b = self.builder
        assert b is not None
        self._check_batch("train", batches[0])
        program = MultiStep(b.train_step, self.state_shardings)

        def trace(ty: Callable[[Any], Any]) -> _AdoptingTrainStep:
            fn = jax.jit(program, donate_argnums=0, out_shardings=(self.state_shardings, None, None))
            with lightning_step_call(b.module, "training_step"):
                # host hooks' writes (metrics.reset() at epoch end) reach the execution, as a single step's
                traced = fn.trace(*ty((state, tuple(batches), batch_idx, flush, epoch)))
                return _AdoptingTrainStep(traced.lower().compile(), self, traced.jaxpr.jaxpr, len(batches))

        compiled = self._traced(trace)
        self._check_matmul_dtypes(compiled)
        self.compile_counts["train"] += 1
        self.multi_steps[(len(batches), _signature(batches[0]))] = compiled
        if full or "train" not in self.compiled:
            self.compiled["train"] = compiled
        return compiled

    def _check_matmul_dtypes(self, compiled: Any) -> None:
        """On the first train program of a training setup: under a half precision, its matmul FLOPs by operand
        dtype (``self.matmul_dtypes``), warned about when too many stay float32 (:func:`check_matmul_dtypes`)."""
        if "train" in self.compiled or self.builder is None or self.parts is None:
            return
        models = {k: getattr(self.builder.module, k) for k in self.parts.names}
        self.matmul_dtypes = check_matmul_dtypes(self.precision, compiled.jaxpr, models)

    def train_steps_for(self, batches: Sequence[Any]) -> Any:
        """The program compiled for ``len(batches)`` steps on batches of these shapes, or None."""
        return self.multi_steps.get((len(batches), _signature(batches[0])))

    def _drop_train_programs(self) -> None:
        """Forget every compiled train program (single steps and executions): the next batch compiles again."""
        self.compiled.pop("train", None)
        self.train_steps = {}
        self.multi_steps = {}

    def _check_batch(self, stage: str, batch: Any) -> None:
        """The strategy's checks of the batch's global shapes; across processes, the same structure."""
        shapes = {leaf_path(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(batch)[0]}
        self.strategy.check_batch(shapes, dict(self.mesh.shape))
        if jax.process_count() > 1:
            _assert_same_batch_across_processes(stage, batch)


class _AdoptingTrainStep:
    """The compiled train step, called with host hooks' writes into the module adopted first
    (:meth:`~jaxlight.binding.ModuleBinding.adopt_host_edits`); ``as_text``, ``memory_analysis`` and the rest are the compiled
    step's own. ``jaxpr`` is the traced program (without its constants; what
    :func:`jaxlight.flops.matmul_flops` counts) and ``steps`` the train steps one call runs
    (``steps_per_execution``, or fewer in an epoch's last execution)."""

    def __init__(self, compiled: Any, engine: Engine, jaxpr: Any = None, steps: int = 1) -> None:
        self.compiled, self._engine, self.jaxpr, self.steps = compiled, engine, jaxpr, steps

    def __call__(self, state: TrainState, *args: Any) -> Any:
        return self.compiled(self._engine.binding.adopt_host_edits(state), *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["compiled"], name)


class _CarryingEvalStep:
    """A compiled evaluation step ``(params, rest, ...) -> (out, logs)`` that carries the non-parameter
    state it sets (and host hooks' writes before it) in the ``rest`` dict it is passed
    (:meth:`~jaxlight.binding.ModuleBinding.carry_into_eval`, :meth:`~jaxlight.binding.ModuleBinding.carry_from_eval`)."""

    def __init__(self, compiled: Any, engine: Engine) -> None:
        self.compiled, self._engine = compiled, engine

    def __call__(self, params: Any, rest: Any, *args: Any) -> tuple[Any, Any]:
        if isinstance(rest, dict):
            self._engine.binding.carry_into_eval(rest)
        out, logs, changed = self.compiled(params, rest, *args)
        if changed and isinstance(rest, dict):
            self._engine.binding.carry_from_eval(rest, changed)
        return out, logs

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["compiled"], name)


def _signature(batch: Any) -> tuple:
    """A batch's structure, shapes and dtypes: what a compiled step is specialised to."""
    leaves, treedef = jax.tree.flatten(batch)
    return treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves)


@contextlib.contextmanager
def lightning_step_call(module: Any, method: str, dataloader_idx: int | None = None):
    """While tracing, let the steps call ``module.<method>(batch, batch_idx)`` whatever Lightning signature
    the user wrote: ``(batch)``, ``(batch, batch_idx)`` or ``(batch, batch_idx, dataloader_idx)``
    (:func:`jaxlight.signatures.step_call`, which refuses any other with the signature in the message).
    ``dataloader_idx`` (several loaders) is a static Python int: one compiled step per loader."""
    bound = getattr(module, method)
    call = step_call(bound, f"{type(module).__name__}.{method}", dataloader_idx)
    if call is None:  # called as the steps call it
        yield
        return
    had = method in vars(module)
    saved = vars(module).get(method)
    object.__setattr__(module, method, call)
    try:
        yield
    finally:
        if had:
            object.__setattr__(module, method, saved)
        else:
            object.__delattr__(module, method)


def _frozen_parameters(callbacks: Sequence[Callback], trainer: Any, module: Any, paths: list[str]) -> tuple | None:
    """The parameter paths the callbacks froze (:meth:`Callback.frozen_parameters`); None when none asks."""
    asked = [cb.frozen_parameters(trainer, module) for cb in callbacks if callable(cb.frozen_parameters)]
    asked = [a for a in asked if a is not None]
    if not asked:
        return None
    return tuple(select_params(list(asked), paths, module, "frozen_parameters"))


def _as_config(optimizer: Any) -> OptimizerConfig:
    """An :class:`OptimizerConfig` from a parsed config or any ``configure_optimizers`` return form."""
    return optimizer if isinstance(optimizer, OptimizerConfig) else configure(optimizer)


def _assert_same_batch_across_processes(stage: str, batch: Any) -> None:
    """Processes that compile different steps would wait on each other forever: compare the
    batch structure once per stage (a CRC of shapes and dtypes) and fail with the shapes instead."""
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
        # every process raises here together: not one rank's failure that must stop the others
        raise rank_failure.on_every_process(
            MisconfigurationError(
                f"{stage} batches have a different structure on process {jax.process_index()}: {desc}; every "
                f"process must yield batches of the same shapes and dtypes"
            )
        ) from e
