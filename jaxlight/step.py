"""The compiled steps: one SPMD program per stage, traced from the module.

``TrainState`` carries everything the train step updates: parameters, the
other NNX variables, the optax state, and in-step state owned by callbacks
(EMA and the like). The train step is ``new_state, outputs, logs =
step(state, batch, batch_idx, flush)`` with the state donated, so the update
runs in place and the parameters are held once.

With automatic optimization the step is the forward and backward pass of
``training_step``'s loss, then one optimizer update. With manual optimization
(``module.automatic_optimization = False``) ``training_step`` itself takes
gradients (``self.manual_backward``) and applies them (``opt.step(grads)``),
any number of times, inside the same compiled program: a
:class:`ManualContext` carries the parameters, the module's other state and
each optimizer's state through the trace, so a later ``manual_backward`` sees
the parameters an earlier ``opt.step`` produced.

A step method that needs a concrete value while it is traced (``if x > 0:``,
``float(loss)``, ``range(batch_idx)``, ``np.asarray(x)``) raises
:class:`TracingError`, which says what was traced, where, and what to write
instead, with JAX's error chained.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import os
import re
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxlight.metrics import Collector
from jaxlight.optim import AccumulationState
from jaxlight.precision import Precision
from jaxlight.state import ModelParts, merge_models, rest_after


class TrainState(NamedTuple):
    """Everything the compiled train step reads and writes."""

    params: dict[str, jax.Array]
    rest: dict[str, jax.Array]
    opt_state: Any  # automatic: the optax state; manual: a tuple, one state per optimizer
    extra: dict[str, Any]
    step: jax.Array  # int32: optimizer updates applied so far (manual: train batches that stepped)


class StepError(TypeError):
    """A step method returned something the trainer cannot use."""


# ----------------------------------------------------------------------------------------- tracing errors

DOCS = "docs/optimizers.md#errors-from-tracing"

_TRACING_ERRORS = (
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
    jax.errors.ConcretizationTypeError,
)


class TracingError(StepError):
    """A step method needed a concrete value while it was being traced.

    The raised object is also an instance of the JAX error it explains
    (``jax.errors.TracerBoolConversionError`` and so on), which is chained as
    its ``__cause__``, so code catching JAX's error type still catches it.
    """


@functools.cache
def _tracing_error_type(cls: type) -> type:
    def init(self: Any, message: str) -> None:
        Exception.__init__(self, message)

    return type("TracingError", (TracingError, cls), {"__init__": init, "__module__": __name__})


_PACKAGE_DIRS = tuple(
    os.path.dirname(m.__file__) + os.sep
    for m in (jax, optax, __import__("flax"), __import__("numpy"), __import__("jaxlight"))
    if getattr(m, "__file__", None)
)


def _user_frame(tb: Any) -> traceback.FrameSummary | None:
    """The innermost frame of the traceback outside jax, flax, optax, numpy and jaxlight (the user's line)."""
    frames = [f for f in traceback.extract_tb(tb) if not f.filename.startswith(_PACKAGE_DIRS)]
    return frames[-1] if frames else None


def _traced_what(message: str) -> str:
    m = re.search(r"depends on the value of the arguments? ([^\n]+?)\.?\s*(\n|$)", message)
    arg = m.group(1).strip() if m else ""
    if re.search(r"\bbatch_idx\b", arg):
        return (
            "`batch_idx` is traced: it is an int32 argument of the compiled step, so one program serves every batch "
            "index (host hooks such as on_train_batch_start receive it as a plain int)."
        )
    if re.search(r"\bbatch\b", arg):
        return "The value comes from the batch, which is traced: its numbers exist only when the step runs."
    if re.search(r"\b(params|state|rest)\b", arg):
        return "The value comes from the model's parameters or state, which are traced."
    return "Every array computed inside the step is traced: it has a shape and dtype, but no numbers yet."


def explain_tracing_error(err: Exception, owner: str, method: str) -> TracingError:
    """jaxlight's :class:`TracingError` for a JAX error raised while tracing ``owner.method``."""
    if isinstance(err, jax.errors.TracerBoolConversionError):
        did = "uses a traced array as a Python bool (an `if`, `while`, `and`/`or`/`not` or `assert` on it)"
        fix = (
            "compute both results and pick one with jnp.where(cond, a, b), or branch with jax.lax.cond(cond, "
            "true_fn, false_fn, *operands) / jax.lax.switch; decisions about the run itself belong in host "
            "hooks (return -1 from on_train_batch_start to end the epoch, set trainer.should_stop = True)"
        )
    elif isinstance(err, jax.errors.TracerIntegerConversionError):
        did = "uses a traced array as a Python int (an index into a list or tuple, range(x), a Python slice)"
        fix = (
            "index jax arrays instead (x[i], jnp.take), loop with jax.lax.fori_loop, choose among functions "
            "with jax.lax.switch(i, fns, *operands)"
        )
    elif isinstance(err, jax.errors.TracerArrayConversionError):
        did = "passes a traced array to NumPy (np.asarray, np.mean, a NumPy-based library)"
        fix = "use the jax.numpy function of the same name (jnp.asarray, jnp.mean, ...)"
    else:
        did = "converts a traced array to a Python number (float(x), int(x), x.item(), or a function needing one)"
        fix = (
            "keep it an array: self.log(name, x) records it (the host fetches logged values every "
            "log_every_n_steps), self.print(x) or jax.debug.print('{}', x) prints it each time the step runs, "
            "and host hooks (on_train_batch_end receives the step's outputs) may call float() on it"
        )
    frame = _user_frame(err.__traceback__)
    where = f"at {frame.filename}:{frame.lineno} (`{(frame.line or '').strip()}`) " if frame else ""
    message = (
        f"{owner}.{method} cannot run as written inside jaxlight's compiled step: {where}it {did}. "
        f"{_traced_what(str(err))} Step methods are traced once into one compiled program, with placeholder "
        f"arrays (tracers) that have shapes but no values. Instead: {fix}. "
        f"See {DOCS} (JAX's error is chained below)."
    )
    return _tracing_error_type(type(err))(message)


@contextlib.contextmanager
def explained_tracing_errors(owner: str, method: str) -> Iterator[None]:
    """Re-raise JAX's concretization errors from tracing ``owner.method`` as :class:`TracingError`."""
    try:
        yield
    except TracingError:
        raise
    except _TRACING_ERRORS as e:
        raise explain_tracing_error(e, owner, method) from e


# ----------------------------------------------------------------------------------------- outputs


class StepExtension(NamedTuple):
    """In-step state owned by a callback (e.g. EMA): ``update`` is traced into
    the train step after the optimizer update. ``info`` has ``"updated"``
    (bool scalar: an optimizer step happened, False inside accumulation) and
    ``"step"`` (int32 count of optimizer steps so far, after this one)."""

    name: str
    update: Callable[[Any, dict[str, jax.Array], dict[str, Any]], Any]


def split_training_output(out: Any) -> tuple[jax.Array, dict[str, Any]]:
    """Check and split what training_step returned into (loss, outputs)."""
    if out is None:
        raise StepError(
            "training_step returned None; it must return a scalar loss or a dict with a scalar 'loss' "
            "(skipping a batch by returning None is not possible inside a compiled step)"
        )
    if isinstance(out, Mapping):
        if "loss" not in out:
            raise StepError(f"training_step returned a dict without a 'loss' key (keys: {sorted(out)})")
        loss = out["loss"]
        extras = {k: v for k, v in out.items() if k != "loss"}
    else:
        loss, extras = out, {}
    _check_loss(loss, "training_step loss")
    for k, v in jax.tree_util.tree_flatten_with_path(extras)[0]:
        if not hasattr(v, "dtype"):
            raise StepError(
                f"training_step output {jax.tree_util.keystr(k)} is a {type(v).__name__}; "
                f"outputs of a compiled step must be arrays"
            )
    return loss, extras


def _check_loss(loss: Any, what: str) -> None:
    if not hasattr(loss, "shape") or not hasattr(loss, "dtype"):
        raise StepError(f"{what} must be a jax scalar, got {type(loss).__name__}")
    if loss.shape != ():
        raise StepError(f"{what} must be a scalar, got shape {tuple(loss.shape)} (reduce it, e.g. .mean())")
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise StepError(f"{what} must be floating point, got dtype {loss.dtype}")


# ----------------------------------------------------------------------------------------- manual optimization

_MANUAL: contextvars.ContextVar[ManualContext | None] = contextvars.ContextVar("jaxlight_manual", default=None)


def current_manual_context() -> ManualContext | None:
    """The manual-optimization context of the train step being traced (None elsewhere)."""
    return _MANUAL.get()


def _require_manual(what: str) -> ManualContext:
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
        _require_manual("opt.step(grads)").apply(self, grads, when)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: gradients are returned by ``manual_backward``, never accumulated."""

    @property
    def params(self) -> dict[str, Any]:
        """The current values of this optimizer's parameters (inside the traced step)."""
        ctx = _require_manual("opt.params")
        return {k: ctx.params[k] for k in self.param_paths}


class ManualContext:
    """The state a manually optimized train step threads through ``training_step`` while it is traced."""

    def __init__(self, builder: StepBuilder, state: TrainState, collector: Collector) -> None:
        self.builder = builder
        self.handles = builder.handles
        self.params = dict(state.params)
        self.rest = dict(state.rest)
        self.opt_states = list(state.opt_state)
        self.collector = collector
        self.models: dict[str, Any] = {}
        self.toggled: ManualOptimizer | None = None
        self.grads: list[Any] = []
        self.last_loss: Any = None
        self.steps = 0
        self._rest_dtypes = {k: getattr(v, "dtype", None) for k, v in state.rest.items()}

    # -- the module's view ----------------------------------------------------------------------
    def make_models(self, params: Mapping[str, Any] | None = None, rest: Mapping[str, Any] | None = None) -> Any:
        b = self.builder
        p = self.params if params is None else params
        r = self.rest if rest is None else rest
        return b.precision.bind(merge_models(b.parts, b.precision.compute(p), r, train=True))

    def bind(self) -> None:
        """Point the module's NNX attributes at models holding the current parameters and state."""
        self.models = self.make_models()
        self.builder.module._point_at(self.models)

    def sync_rest(self) -> None:
        """Read back what forward passes since the last bind changed (RNG counters, batch statistics)."""
        if self.models:
            self.rest = self._cast_rest(rest_after(self.builder.parts, self.models))

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
            _check_loss(loss, "the loss manual_backward differentiates")
            specs.update(col.specs)
            return loss, (aux, self._cast_rest(rest_after(b.parts, models)), col.values)

        sub = {k: self.params[k] for k in keys}
        (loss, (aux, rest, logged)), grads = jax.value_and_grad(f, has_aux=True)(sub)
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
        updates, new_state = opt.optimizer.update(g, self.opt_states[i], p)
        new_p = optax.apply_updates(p, updates)
        new_p = {k: v.astype(p[k].dtype) for k, v in new_p.items()}
        if when is not None:
            ok = jnp.asarray(when, jnp.bool_)
            new_p = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_p, p)
            new_state = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_state, self.opt_states[i])
        self.params.update(new_p)
        self.opt_states[i] = new_state
        self.steps += 1
        self.bind()


# ----------------------------------------------------------------------------------------- the builder


class StepBuilder:
    """Builds the pure functions the trainer compiles for each stage.

    The automatic train step is two parts: the forward and backward pass,
    then the update ``update(state, grads, aux) -> (state, outputs)``
    (optimizer, non-finite guard, step counter, callback extensions). The
    manual train step is one part, ``training_step`` with its own updates,
    shaped as an update (``grads`` is None, ``aux`` holds the batch), so the
    same wrappers apply. ``wrap_update`` (the strategy's pieces, e.g. host
    offload fetching optimizer state into device memory) wraps the update.
    """

    def __init__(
        self,
        module: Any,
        parts: ModelParts,
        precision: Precision,
        tx: optax.GradientTransformation | None,
        extensions: tuple[StepExtension, ...] = (),
        with_grad_norm: bool = False,
        skip_nonfinite: bool = False,
        wrap_update: Callable[[Callable], Callable] | None = None,
        manual: bool = False,
        handles: Sequence[ManualOptimizer] = (),
    ) -> None:
        self.module = module
        self.parts = parts
        self.precision = precision
        self.tx = tx
        self.extensions = extensions
        self.with_grad_norm = with_grad_norm
        self.skip_nonfinite = skip_nonfinite
        self.manual = manual
        self.handles = list(handles)  # manual: what self.optimizers() returns while the step is traced
        body = self._manual_update if manual else self._update
        self.update = wrap_update(body) if wrap_update is not None else body
        self.log_specs: dict[str, dict] = {}
        self.optimizer_steps_per_batch: int | None = None  # manual: opt.step calls traced into the step

    def _rows(self, batch: Any) -> int | None:
        leaves = jax.tree.leaves(batch)
        return int(leaves[0].shape[0]) if leaves and getattr(leaves[0], "ndim", 0) else None

    def _models(self, params: Mapping[str, Any], rest: Mapping[str, Any], train: bool) -> dict[str, Any]:
        prec = self.precision
        return prec.bind(merge_models(self.parts, prec.compute(params), rest, train=train))

    def train_step(self, state: TrainState, batch: Any, batch_idx: jax.Array, flush: jax.Array):
        """``flush``: a traced bool; under gradient accumulation it makes this micro-batch end its window."""
        if self.manual:
            state, outputs = self.update(state, None, {"batch": batch, "batch_idx": batch_idx, "flush": flush})
            logs = outputs.pop("_logs")
            return state, outputs, logs
        prec = self.precision
        owner = type(self.module).__name__

        def loss_fn(params):
            models = self._models(params, state.rest, train=True)
            col = Collector("train", self._rows(batch), on_step=True, on_epoch=False)
            with self.module._bound(models, col), explained_tracing_errors(owner, "training_step"):
                out = self.module.training_step(prec.compute(batch), batch_idx)
            loss, extras = split_training_output(out)
            rest = rest_after(self.parts, models)
            rest = {k: v.astype(state.rest[k].dtype) if hasattr(v, "astype") else v for k, v in rest.items()}
            self.log_specs["train"] = col.specs
            return loss.astype(jnp.float32), (extras, col.values, rest)

        (loss, (extras, logs, rest)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        state, more = self.update(state, grads, {"loss": loss, "rest": rest, "flush": flush})
        return state, {"loss": loss, **extras, **more}, logs

    def _update(self, state: TrainState, grads: Any, aux: dict[str, Any]) -> tuple[TrainState, dict[str, Any]]:
        """Apply the optimizer to ``grads``; ``aux`` has the step's ``loss`` and the forward's new ``rest``."""
        assert self.tx is not None
        loss, rest = aux["loss"], aux["rest"]
        outputs: dict[str, Any] = {}
        gnorm = ok = None
        if self.with_grad_norm or self.skip_nonfinite:
            gnorm = optax.global_norm(grads)
            outputs["grad_norm"] = gnorm
        accumulating = isinstance(state.opt_state, AccumulationState)
        if self.skip_nonfinite:
            ok = jnp.isfinite(loss) & jnp.isfinite(gnorm)
            outputs["skipped"] = ~ok
            if accumulating:
                # Under accumulation the bad micro-batch still counts towards its window (so the
                # update boundary stays aligned with global_step) but contributes a zero gradient.
                grads = jax.tree.map(lambda g: jnp.where(ok, g, jnp.zeros_like(g)), grads)
        if accumulating:
            updates, opt_state = self.tx.update(grads, state.opt_state, state.params, flush=aux["flush"])
        else:
            updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        params = {k: v.astype(state.params[k].dtype) for k, v in params.items()}
        if self.skip_nonfinite:
            keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
            if not accumulating:
                params = keep(params, state.params)
                opt_state = keep(opt_state, state.opt_state)
            rest = keep(rest, state.rest)
        updated = _has_updated(opt_state)
        if self.skip_nonfinite and not accumulating:
            updated = updated & ok
        return self._finish(state, params, rest, opt_state, updated, outputs)

    def _finish(
        self, state: TrainState, params: Any, rest: Any, opt_state: Any, updated: Any, outputs: dict[str, Any]
    ) -> tuple[TrainState, dict[str, Any]]:
        step = state.step + updated.astype(jnp.int32)
        info = {"updated": updated, "step": step}
        extra = {e.name: e.update(state.extra[e.name], params, info) for e in self.extensions}
        return TrainState(params, rest, opt_state, extra, step), outputs

    def _manual_update(self, state: TrainState, grads: Any, aux: dict[str, Any]) -> tuple[TrainState, dict[str, Any]]:
        """``training_step`` with its own ``manual_backward`` / ``opt.step`` calls, on ``aux["batch"]``."""
        del grads
        batch, batch_idx = aux["batch"], aux["batch_idx"]
        col = Collector("train", self._rows(batch), on_step=True, on_epoch=False)
        ctx = ManualContext(self, state, col)
        token = _MANUAL.set(ctx)
        try:
            ctx.models = ctx.make_models()
            with (
                self.module._bound(ctx.models, col),
                explained_tracing_errors(type(self.module).__name__, "training_step"),
            ):
                out = self.module.training_step(self.precision.compute(batch), batch_idx)
                ctx.sync_rest()
        finally:
            _MANUAL.reset(token)
        self.log_specs["train"] = col.specs
        self.optimizer_steps_per_batch = ctx.steps
        if out is None:  # Lightning allows it in manual optimization
            loss = ctx.last_loss if ctx.last_loss is not None else jnp.float32(jnp.nan)
            extras: dict[str, Any] = {}
        else:
            loss, extras = split_training_output(out)
        loss = jnp.asarray(loss, jnp.float32)
        outputs: dict[str, Any] = {"loss": loss, **extras}
        params, rest, opt_state = ctx.params, ctx.rest, tuple(ctx.opt_states)
        updated = jnp.bool_(True)
        if self.with_grad_norm or self.skip_nonfinite:
            gnorm = optax.global_norm(ctx.grads) if ctx.grads else jnp.float32(0.0)
            outputs["grad_norm"] = gnorm
            if self.skip_nonfinite:
                ok = jnp.isfinite(loss) & jnp.isfinite(gnorm)
                outputs["skipped"] = ~ok
                keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
                params, rest = keep(params, state.params), keep(rest, state.rest)
                opt_state = keep(opt_state, state.opt_state)
                updated = ok
        state, outputs = self._finish(state, params, rest, opt_state, updated, outputs)
        outputs["_logs"] = col.values
        return state, outputs

    def eval_step(self, stage: str, params: dict, rest: dict, batch: Any, batch_idx: jax.Array):
        prec = self.precision
        models = self._models(params, rest, train=False)
        col = Collector(stage, self._rows(batch), on_step=False, on_epoch=True)
        method = {"validate": "validation_step", "test": "test_step", "predict": "predict_step"}[stage]
        with self.module._bound(models, col), explained_tracing_errors(type(self.module).__name__, method):
            out = getattr(self.module, method)(prec.compute(batch), batch_idx)
        self.log_specs[stage] = col.specs
        for k, v in jax.tree_util.tree_flatten_with_path(out)[0]:
            if not hasattr(v, "dtype"):
                raise StepError(
                    f"{method} output {jax.tree_util.keystr(k) or '<root>'} is a {type(v).__name__}; "
                    f"outputs of a compiled step must be arrays (or None)"
                )
        return out, col.values


def _has_updated(opt_state: Any) -> jax.Array:
    """True when this call applied an update (gradient accumulation holds it otherwise)."""
    if isinstance(opt_state, AccumulationState):
        return opt_state.window == 0
    return jnp.bool_(True)


__all__ = [
    "ManualContext",
    "ManualOptimizer",
    "StepBuilder",
    "StepError",
    "StepExtension",
    "TracingError",
    "TrainState",
    "current_manual_context",
    "explain_tracing_error",
    "explained_tracing_errors",
    "split_training_output",
]
