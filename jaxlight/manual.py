"""Manual optimization: the ``ManualOptimizer`` handles ``self.optimizers()`` returns and the
``ManualContext`` a manually optimized train step threads through ``training_step`` while it is traced.

Gradients are values in JAX, so ``opt.step(grads)`` takes them (from ``self.manual_backward``); the
context carries the parameters, the module's other state and each optimizer's state through the trace,
so a later ``manual_backward`` sees the parameters an earlier ``opt.step`` produced.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax

from jaxlight.loss_scale import all_finite
from jaxlight.state import merge_models, rest_after, written_params
from jaxlight.tracing import check_loss

if TYPE_CHECKING:
    from jaxlight.metrics import Collector
    from jaxlight.step import StepBuilder, TrainState


_MANUAL: contextvars.ContextVar[ManualContext | None] = contextvars.ContextVar("jaxlight_manual", default=None)


@contextlib.contextmanager
def manual_context(ctx: ManualContext) -> Iterator[ManualContext]:
    """Make ``ctx`` the manual-optimization context while a train step is traced."""
    token = _MANUAL.set(ctx)
    try:
        yield ctx
    finally:
        _MANUAL.reset(token)


def current_manual_context() -> ManualContext | None:
    """The manual-optimization context of the train step being traced (None elsewhere)."""
    return _MANUAL.get()


def require_manual(what: str) -> ManualContext:
    ctx = _MANUAL.get()
    if ctx is None:
        raise RuntimeError(
            f"{what} works only inside training_step of a LightningModule with `self.automatic_optimization = "
            f"False` (manual optimization), while the trainer traces it"
        )
    return ctx


class ManualOptimizer:
    """One optimizer of a manually optimized module: what ``self.optimizers()`` returns.

    The JAX form of Lightning's ``LightningOptimizer``: gradients are values,
    not ``.grad`` fields, so ``step`` takes them (from
    ``self.manual_backward``). Inside ``training_step``, ``opt.step(grads)``
    applies the optimizer to the parameters it owns (``param_paths``) and
    makes the module's NNX attributes hold the new values at once, so the
    rest of the step sees them. ``zero_grad()`` exists for familiarity and
    does nothing: nothing accumulates between ``manual_backward`` calls.
    """

    def __init__(self, index: int, tx: optax.GradientTransformation, keys: Sequence[str]) -> None:
        self.index = index
        self.optimizer = tx
        self.param_paths: tuple[str, ...] = tuple(keys)

    def __repr__(self) -> str:
        return f"ManualOptimizer(index={self.index}, params={len(self.param_paths)})"

    def step(self, grads: Mapping[str, Any] | None = None, closure: Any = None, *, when: Any = None) -> None:
        """Apply this optimizer to ``grads`` (a dict keyed by parameter path, from ``manual_backward``).

        ``grads`` may hold more parameters than this optimizer owns (the others
        are ignored) but not fewer. ``when``: a (traced) bool; when False the
        parameters and the optimizer state stay as they were, as if ``step``
        had not been called (an update every other batch: ``when=batch_idx % 2
        == 0``).
        """
        if grads is None or callable(grads) or closure is not None:
            raise TypeError(
                "opt.step(grads) takes the gradients (grads from `loss, grads = self.manual_backward(loss_fn)`); "
                "there is no .grad to read and no closure to call in jaxlight"
            )
        require_manual("opt.step(grads)").apply(self, grads, when)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: gradients are returned by ``manual_backward``, never accumulated."""

    @property
    def params(self) -> dict[str, Any]:
        """The current values of this optimizer's parameters (inside the traced step)."""
        ctx = require_manual("opt.params")
        return {k: ctx.params[k] for k in self.param_paths}


class ManualContext:
    """The state a manually optimized train step threads through ``training_step`` while it is traced."""

    def __init__(self, builder: StepBuilder, state: TrainState, collector: Collector) -> None:
        self.builder = builder
        self.handles = builder.handles
        self.params = dict(state.params)
        self.rest = dict(state.model_state)
        self.opt_states = list(state.opt_state)
        self.loss_scale = state.loss_scale  # "16-mixed": the scaler's state, updated by each opt.step
        self.collector = collector
        self.models: dict[str, Any] = {}
        self.toggled: ManualOptimizer | None = None
        self.grads: list[Any] = []
        self.last_loss: Any = None
        self._rest_dtypes = {k: getattr(v, "dtype", None) for k, v in state.model_state.items()}
        self._bound_params: dict[str, Any] = {}  # the arrays self.models were built from (to tell writes apart)

    # -- the module's view ----------------------------------------------------------------------
    def make_models(self, params: Mapping[str, Any] | None = None, rest: Mapping[str, Any] | None = None) -> Any:
        b = self.builder
        p = self.params if params is None else params
        r = self.rest if rest is None else rest
        computed = b.precision.compute(p)
        if params is None:  # the module's view: what sync_rest compares its parameters against
            self._bound_params = dict(computed)
        return b.precision.bind(merge_models(b.parts, computed, r, train=True))

    def bind(self) -> None:
        """Point the module's NNX attributes at models holding the current parameters and state."""
        self.models = self.make_models()
        self.builder.module._point_at(self.models)

    def sync_rest(self) -> None:
        """Read back what forward passes since the last bind changed (RNG counters, batch statistics), and
        the parameters training_step assigned (a target network synced from the online one): later
        ``manual_backward`` / ``opt.step`` calls and the step's result see the written values."""
        if self.models:
            b = self.builder
            self.rest = self._cast_rest(rest_after(b.parts, self.models))
            owner = type(b.module).__name__
            written = written_params(b.parts, self.models, self._bound_params, self.params, owner)
            if written:
                self.params.update(written)
                self.bind()  # the module's view rebuilt from them, so a write is read back once

    def _cast_rest(self, rest: Mapping[str, Any]) -> dict[str, Any]:
        return {
            k: v.astype(self._rest_dtypes[k]) if self._rest_dtypes.get(k) is not None and hasattr(v, "astype") else v
            for k, v in rest.items()
        }

    # -- manual_backward ------------------------------------------------------------------------
    def value_and_grad(
        self, fn: Callable, args: tuple, kwargs: dict, optimizer: ManualOptimizer | None, has_aux: bool
    ) -> tuple[Any, dict[str, Any]]:
        b = self.builder
        opt = optimizer if optimizer is not None else self.toggled
        keys = opt.param_paths if opt is not None else tuple(self.params)
        self.sync_rest()
        base, rest0, outer = dict(self.params), dict(self.rest), self.collector
        specs: dict[str, Any] = {}

        def f(sub: dict[str, Any]) -> Any:
            models = self.make_models({**base, **sub}, rest0)
            col = copy.copy(outer)  # same stage and defaults; its own records (traced under the gradient)
            col.values, col.specs = {}, {}
            with b.module._bound(models, col):
                out = fn(*args, **kwargs)
            loss, aux = out if has_aux else (out, None)
            check_loss(loss, "the loss manual_backward differentiates")
            specs.update(col.specs)
            # "16-mixed": the scaled loss is differentiated, as Lightning's manual_backward does
            scaled = b.scaler.scale(loss.astype(jnp.float32), self.loss_scale) if b.scaler is not None else loss
            return scaled, (loss, aux, self._cast_rest(rest_after(b.parts, models)), col.values)

        sub = {k: self.params[k] for k in keys}
        (_, (loss, aux, rest, logged)), grads = jax.value_and_grad(f, has_aux=True)(sub)
        if b.scaler is not None:  # handed back unscaled (what a user clips or inspects); opt.step checks them
            grads = b.scaler.unscale(grads, self.loss_scale)
        self.rest = rest
        for name, value in logged.items():  # what the loss function logged joins the step's logs
            outer.values[name] = value
            outer.specs[name] = specs[name]
        self.grads.append(grads)
        self.last_loss = loss
        self.bind()
        return ((loss, aux) if has_aux else loss), grads

    # -- opt.step --------------------------------------------------------------------------------
    def apply(self, opt: ManualOptimizer, grads: Mapping[str, Any], when: Any) -> None:
        if not isinstance(grads, Mapping):
            raise TypeError(f"opt.step(grads): grads must be the dict manual_backward returns, got {type(grads)}")
        missing = [k for k in opt.param_paths if k not in grads]
        if missing:
            raise KeyError(
                f"opt.step(grads) for optimizer {opt.index}: no gradient for {len(missing)} of its parameters "
                f"(e.g. {missing[:3]}); take them with self.manual_backward(loss_fn, optimizer=opt) or "
                f"self.toggle_optimizer(opt) first"
            )
        self.sync_rest()
        i = opt.index
        p = {k: self.params[k] for k in opt.param_paths}
        g = {k: grads[k] for k in opt.param_paths}
        old_state = self.opt_states[i]

        def step(g: Any) -> tuple[Any, Any]:
            updates, new_state = opt.optimizer.update(g, old_state, p)
            new_p = optax.apply_updates(p, updates)
            return {k: v.astype(p[k].dtype) for k, v in new_p.items()}, new_state

        scaler = self.builder.scaler
        ok = None if when is None else jnp.asarray(when, jnp.bool_)
        if scaler is not None:
            # torch's scaler.step + scaler.update, per opt.step as Lightning calls them: a non-finite gradient
            # skips this optimizer's update and backs the scale off (a step not taken, when=False, leaves it)
            finite = all_finite(g)
            adjusted = scaler.update(self.loss_scale, finite)
            if ok is not None:
                adjusted = jax.tree.map(lambda n, o: jnp.where(ok, n, o), adjusted, self.loss_scale)
            self.loss_scale = adjusted
            ok = finite if ok is None else ok & finite
            # a cond: a skipped update costs nothing and the taken one stays in place
            new_p, new_state = jax.lax.cond(ok, step, lambda _: (p, old_state), g)
        else:
            new_p, new_state = step(g)
            if ok is not None:
                new_p = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_p, p)
                new_state = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_state, old_state)
        self.params.update(new_p)
        self.opt_states[i] = new_state
        self.bind()
