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
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlight.errors import MisconfigurationError
from jaxlight.nn.constrain import axis_rules
from jaxlight.optim import OptimizerConfig
from jaxlight.precision import Precision
from jaxlight.state import ModelParts, merge_models, nnx_attributes, split_models
from jaxlight.step import StepBuilder, StepExtension, TrainState
from jaxlight.strategies.placement import named, param_specs, rest_specs
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

    # -- context ----------------------------------------------------------------------
    def context(self) -> contextlib.ExitStack:
        """The mesh, the logical rules and the pieces' trace contexts (entered to create, trace, compile)."""
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        # Not flax's nnx.logical_axis_rules: flax reads a rules table as a rename
        # (one mesh axis per name, no divisibility fallback, duplicates refused),
        # so placement goes through jaxlight.strategies.resolve_spec only.
        stack.enter_context(nnx.use_eager_sharding(False))
        stack.enter_context(axis_rules(self.mesh, self.strategy.logical_rules))
        stack.enter_context(self.strategy.trace_context(self.mesh))
        return stack

    # -- the model ------------------------------------------------------------------------
    def attach(self, module: LightningModule) -> None:
        """Serve ``module``; a different module than before starts from scratch."""
        if self.module is not None and self.module is not module:
            self.parts = None
            self.train_state = None
            self.state_shardings = None
            self.builder = None
            self.compiled = {}
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
                    models = build()
                    _, p, r = nnx.split(models, nnx.Param, ...)
                    return parts.params.to_flat(p), parts.rest.to_flat(r)

                # Compiled SPMD: each device computes only its shards.
                self.init_compiled = jax.jit(create, out_shardings=(psh, rsh)).lower().compile()
                params, rest = self.init_compiled()
            else:
                parts, params, rest = split_models(existing)
                psh, rsh = self._var_shardings(parts, params, rest)
                params = jax.device_put(params, psh)
                rest = jax.device_put(rest, rsh)
        params = self.precision.store(params)
        self.parts = parts
        self.param_shardings = psh
        self.rest_shardings = rsh
        self.write_back(params, rest)

    @staticmethod
    def _builder_of(module: LightningModule) -> Any:
        def build() -> dict[str, nnx.Module]:
            module.configure_model()
            models = nnx_attributes(module)
            for k in models:
                object.__delattr__(module, k)
            return models

        return build

    def _abstract_model(self, module: LightningModule) -> tuple[ModelParts, dict, dict]:
        """The module's parts and abstract params/rest, from ``configure_model`` or its existing attributes."""
        existing = nnx_attributes(module)
        if existing:
            parts, params, rest = split_models(existing)
            sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
            return parts, jax.tree.map(sds, params), jax.tree.map(sds, rest)
        # Shapes and annotations only: with a mesh in context flax would turn the
        # logical names into mesh axes itself; the placement comes from param_specs.
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())), nnx.use_eager_sharding(False):
            abstract = nnx.eval_shape(self._builder_of(module))
        if not abstract:
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

    def write_back(self, params: Mapping, rest: Mapping) -> None:
        """Point the module's NNX attributes at concrete (sharded) arrays.

        Existing NNX modules are updated in place, as a torch module is, so any
        other reference the user holds to them (``net = model.net``) sees the
        new values too; modules not created yet are built from the state.
        """
        assert self.parts is not None and self.module is not None
        module, parts = self.module, self.parts
        current = {k: module.__dict__.get(k) for k in parts.names}
        if all(isinstance(m, nnx.Module) for m in current.values()):
            nnx.update(current, parts.params.from_flat(params), parts.rest.from_flat(rest))
            return
        for k, m in merge_models(parts, params, rest, train=True).items():
            object.__setattr__(module, k, m)

    def read_module(self) -> tuple[dict, dict]:
        """Current params/rest from the module's NNX attributes (the user may have changed them)."""
        assert self.parts is not None and self.module is not None
        models = {k: getattr(self.module, k) for k in self.parts.names}
        _, p, r = nnx.split(models, nnx.Param, ...)
        params = jax.device_put(self.parts.params.to_flat(p), self.param_shardings)
        rest = jax.device_put(self.parts.rest.to_flat(r), self.rest_shardings)
        return params, rest

    def sync_module(self) -> None:
        """Point the module's attributes at the current train state (host work only, no copy)."""
        if self.train_state is not None:
            self.write_back(self.train_state.params, self.train_state.rest)

    # -- training state -------------------------------------------------------------------------
    def _mirror_shardings(
        self, tree: Any, params: Mapping[str, Any], group: str, psh: Mapping[str, NamedSharding] | None = None
    ) -> Any:
        """Leaves keyed by a parameter path with its shape take its sharding (and the strategy's memory kind)."""
        psh = self.param_shardings if psh is None else psh
        rep = NamedSharding(self.mesh, P())

        def pick(path: tuple, leaf: Any) -> NamedSharding:
            mirrors = None
            for k in reversed(path):
                key = getattr(k, "key", None)
                if isinstance(key, str) and key in psh and tuple(leaf.shape) == tuple(params[key].shape):
                    mirrors = key
                    break
            sh = psh[mirrors] if mirrors is not None else rep
            kind = self.strategy.memory_kind(group, mirrors)
            return sh.with_memory_kind(kind) if kind is not None else sh

        return jax.tree_util.tree_map_with_path(pick, tree)

    def setup_training(
        self, optimizer: OptimizerConfig, callbacks: Sequence[Callback], trainer: Any, global_step: int
    ) -> None:
        """Place the optimizer state, the callbacks' in-step state and the step counter; build the step."""
        module = self.module
        assert module is not None and self.parts is not None
        self.optimizer = optimizer
        tx = optimizer.tx
        params, rest = self.read_module()
        params = self.precision.store(params)
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
        esh = self._mirror_shardings(extra, params, "extra")
        extra = jax.device_put(extra, esh)
        self._check_state_on_device(callbacks, {"opt_state": osh, "extra": esh})
        self.state_shardings = TrainState(
            self.param_shardings, self.rest_shardings, osh, esh, NamedSharding(self.mesh, P())
        )
        self.builder = StepBuilder(
            module,
            self.parts,
            self.precision,
            tx,
            tuple(exts),
            with_grad_norm=any(cb.needs_grad_norm for cb in callbacks),
            skip_nonfinite=any(cb.skip_nonfinite_updates for cb in callbacks),
            wrap_update=lambda update: self.strategy.wrap_update(update, self.state_shardings),
        )
        step = jax.device_put(jnp.int32(global_step), NamedSharding(self.mesh, P()))
        self.train_state = TrainState(params, rest, opt_state, extra, step)
        self.compiled.pop("train", None)

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
                        f"device (e.g. HostOffload({'optimizer_state' if group == 'opt_state' else 'ema'}=False)) "
                        f"or drop the callback"
                    )

    def eval_state(self) -> tuple[dict, dict]:
        """Parameters and other state to evaluate with when nothing was trained (read from the module)."""
        if self.builder is None:
            assert self.parts is not None
            self.builder = StepBuilder(self.module, self.parts, self.precision, None)
        return self.read_module()

    def on_device(self, tree: Any) -> Any:
        """``tree`` with host-resident leaves copied into device memory (evaluating offloaded EMA weights)."""
        if all(_in_device_memory(x) for x in jax.tree.leaves(tree)):
            return tree
        return jax.tree.map(
            lambda x: x if _in_device_memory(x) else jax.device_put(x, x.sharding.with_memory_kind("device")), tree
        )

    def compile_abstract(
        self, module: LightningModule, tx: Any, batch: Any, batch_idx: Any = None
    ) -> tuple[Any, TrainState]:
        """Lower and compile ``module``'s train step on abstract shapes, allocating no state.

        ``batch`` is a pytree of ``jax.ShapeDtypeStruct`` (global shapes,
        shardings optional: rows over the batch axes by default). Returns the
        compiled step (for ``memory_analysis()`` and its HLO) and the abstract
        TrainState with the shardings the real run would use. Does not change
        this engine's model or state.
        """
        from jaxlight.data import BatchPlacer, leaf_path

        with self.context():
            parts, aparams, arest = self._abstract_model(module)
            psh, rsh = self._var_shardings(parts, aparams, arest)
            aparams = self.precision.store(aparams)
            opt_shapes = jax.eval_shape(tx.init, aparams)
            osh = self._mirror_shardings(opt_shapes, aparams, "opt_state", psh)
            rep = NamedSharding(self.mesh, P())
            shardings = TrainState(psh, rsh, osh, {}, rep)
            sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
            state = TrainState(
                jax.tree.map(sds, aparams, psh),
                jax.tree.map(sds, arest, rsh),
                jax.tree.map(sds, opt_shapes, osh),
                {},
                jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
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
                tx,
                wrap_update=lambda update: self.strategy.wrap_update(update, shardings),
            )
            idx = jax.ShapeDtypeStruct((), jnp.int32) if batch_idx is None else batch_idx
            flush = jax.ShapeDtypeStruct((), jnp.bool_)
            fn = jax.jit(builder.train_step, donate_argnums=0, out_shardings=(shardings, None, None))
            compiled = fn.lower(state, batch, idx, flush).compile()
        return compiled, state

    # -- compile ------------------------------------------------------------------------------
    def compile(self, stage: str, *args: Any) -> Any:
        """Lower and compile one stage's step for the given example arguments (once per stage)."""
        b = self.builder
        assert b is not None
        batch = args[1] if stage == "train" else args[2]  # (state, batch, idx, flush) / (params, rest, batch, idx)
        shapes = {
            jax.tree_util.keystr(p, simple=True, separator="/") or "<root>": tuple(x.shape)
            for p, x in jax.tree_util.tree_flatten_with_path(batch)[0]
        }
        self.strategy.check_batch(shapes, dict(self.mesh.shape))
        if jax.process_count() > 1:
            _assert_same_batch_across_processes(stage, batch)
        with self.context():
            if stage == "train":
                fn = jax.jit(b.train_step, donate_argnums=0, out_shardings=(self.state_shardings, None, None))
            else:

                def eval_step(params, rest, batch, batch_idx, _stage=stage):
                    return b.eval_step(_stage, params, rest, batch, batch_idx)

                eval_step.__name__ = f"{stage}_step"
                fn = jax.jit(eval_step)
            compiled = fn.lower(*args).compile()
        self.compile_counts[stage] += 1
        self.compiled[stage] = compiled
        return compiled


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
        raise MisconfigurationError(
            f"{stage} batches have a different structure on process {jax.process_index()}: {desc}; every "
            f"process must yield batches of the same shapes and dtypes"
        ) from e
