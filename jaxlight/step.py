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

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxlight.axis_names import AxisNames
from jaxlight.loss_scale import GradScaler, LossScaleState, all_finite
from jaxlight.manual import ManualContext, ManualOptimizer, manual_context
from jaxlight.metrics import Collector
from jaxlight.optim import AccumulationState
from jaxlight.precision import Precision
from jaxlight.stages import STAGES
from jaxlight.state import ModelParts, eval_changes, merge_models, rest_after, written_params
from jaxlight.strategies import pipeline_1f1b
from jaxlight.strategies.pipeline import active_pipeline, stack_params
from jaxlight.tracing import (
    StepError,
    check_loss,
    explained_tracing_errors,
    host_effects_watched,
    traced_counters,
)


class TrainState(NamedTuple):
    """Everything the compiled train step reads and writes (donated to it, so updated in place).

    - ``params``: the module's ``nnx.Param`` arrays by flat path (``"net/linear/kernel"``), in the
      precision's storage dtype, each in its strategy sharding; the only leaves that get gradients.
    - ``model_state``: the module's other NNX variables by flat path (BatchNorm statistics, RNG
      counters, any ``nnx.Variable`` that is not a parameter), updated by the forward pass; also the
      NNX objects the module holds beside its models (an ``nnx.Rngs``, an ``nnx.MultiMetric``), by
      attribute name (``"rngs/default/count"``, ``"metrics/loss/total"``).
    - ``opt_state``: automatic optimization: the optax state of the one transformation
      ``configure_optimizers`` built (an ``AccumulationState`` around it under
      ``accumulate_grad_batches``); manual: a tuple, one optax state per optimizer. Leaves that mirror a
      parameter take its sharding.
    - ``callback_state``: in-step state owned by callbacks (a :class:`StepExtension`, e.g. EMA weights),
      keyed by the extension's name; leaves that mirror a parameter take its sharding.
    - ``step``: int32 scalar, optimizer updates applied so far (``trainer.global_step`` on the device;
      manual optimization: train batches that stepped). Updates skipped for a non-finite gradient
      (``NonFiniteGuard("skip")``, the ``"16-mixed"`` loss scaler) are not counted here; the host's
      ``global_step`` counts them, as Lightning's does.
    - ``loss_scale``: ``"16-mixed"``: the :class:`~jaxlight.loss_scale.LossScaleState` (scale, good steps),
      replicated; None under every other precision.
    """

    params: dict[str, jax.Array]
    model_state: dict[str, jax.Array]
    opt_state: Any
    callback_state: dict[str, Any]
    step: jax.Array
    loss_scale: LossScaleState | None = None


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
    check_loss(loss, "training_step loss")
    for k, v in jax.tree_util.tree_flatten_with_path(extras)[0]:
        if not hasattr(v, "dtype"):
            raise StepError(
                f"training_step output {jax.tree_util.keystr(k)} is a {type(v).__name__}; "
                f"outputs of a compiled step must be arrays"
            )
    return loss, extras


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
        # "16-mixed": loss scaling (jaxlight/loss_scale.py); None for every other precision
        self.scaler: GradScaler | None = precision.scaler if precision.scaler and precision.scaler.enabled else None
        self.manual = manual
        self.handles = list(handles)  # manual: what self.optimizers() returns while the step is traced
        # pmap-era axis names the step methods reduce over (jaxlight/axis_names.py), found while traced
        self.axes = AxisNames()
        body = self._manual_update if manual else self._update
        self.update = wrap_update(body) if wrap_update is not None else body
        self.log_specs: dict[str, dict] = {}
        # model-state keys the train step keeps as they were (layers with track_running_stats = False)
        self.held_rest: frozenset[str] = frozenset()

    def _rows(self, batch: Any) -> int | None:
        leaves = jax.tree.leaves(batch)
        return int(leaves[0].shape[0]) if leaves and getattr(leaves[0], "ndim", 0) else None

    def _models(self, params: Mapping[str, Any], rest: Mapping[str, Any], train: bool) -> dict[str, Any]:
        prec = self.precision
        return prec.bind(merge_models(self.parts, prec.compute(params), rest, train=train))

    def train_step(
        self, state: TrainState, batch: Any, batch_idx: jax.Array, flush: jax.Array, epoch: jax.Array | None = None
    ) -> tuple[TrainState, dict[str, Any], dict[str, Any]]:
        """``flush``: a traced bool; under gradient accumulation it makes this micro-batch end its window.
        ``epoch``: the traced int32 epoch (``self.current_epoch`` inside the step; an argument, so one program
        serves every epoch; None, for callers lowering the step themselves: it reads as on the host).
        ``self.global_step`` inside the step is ``state.step``, the updates done so far."""
        counters = {"global_step": state.step, "current_epoch": epoch}
        if self.manual:
            pipe = active_pipeline()
            if pipe is not None and pipe.stages > 1 and pipe.schedule == pipeline_1f1b.SCHEDULE:
                raise StepError(
                    "schedule='1f1b' computes training_step's gradients inside the pipeline schedule, which needs "
                    "automatic optimization; with manual optimization (automatic_optimization = False) use "
                    "schedule='gpipe' or 'circular'"
                )
            aux = {"batch": batch, "batch_idx": batch_idx, "flush": flush, "counters": counters}
            state, outputs = self.update(state, None, aux)
            logs = outputs.pop("_logs")
            return state, outputs, logs
        prec, scaler, scale_state = self.precision, self.scaler, state.loss_scale
        owner = type(self.module).__name__

        def loss_fn(params, batch):
            bound = prec.compute(params)
            models = prec.bind(merge_models(self.parts, bound, state.model_state, train=True))
            col = Collector("train", self._rows(batch), on_step=True, on_epoch=False)
            with (
                self.module._bound(models, col),
                traced_counters(counters),
                explained_tracing_errors(owner, "training_step"),
                host_effects_watched(self.module, "training_step", self.parts.names),
            ):
                out = self.module.training_step(prec.compute(batch), batch_idx)
            loss, extras = split_training_output(out)
            rest = rest_after(self.parts, models)
            rest = {k: v.astype(state.model_state[k].dtype) if hasattr(v, "astype") else v for k, v in rest.items()}
            rest.update({k: state.model_state[k] for k in self.held_rest})
            # parameters training_step assigned (a target network synced from the online one): they land,
            # the optimizer's update applied on top of the written value (Lightning's order)
            written = written_params(self.parts, models, bound, state.params, owner)
            self.log_specs["train"] = col.specs
            loss = loss.astype(jnp.float32)
            # "16-mixed": the scaled loss is differentiated (fp16 gradients would underflow otherwise)
            scaled = scaler.scale(loss, scale_state) if scaler is not None else loss
            return scaled, (loss, extras, col.values, rest, written)

        traced = lambda params, batch: self.axes.call(loss_fn, owner, "training_step", params, batch)
        pipe = active_pipeline()
        if pipe is not None and pipe.stages > 1 and pipe.schedule == pipeline_1f1b.SCHEDULE:
            # the loss per microbatch inside the pipeline schedule (jaxlight/strategies/pipeline_1f1b.py)
            stack_keys = frozenset(stack_params(state.params, self.parts.params.variables))
            (_, (loss, extras, logs, rest, written)), grads = pipeline_1f1b.value_and_grad(
                traced, state.params, batch, state.model_state, stack_keys, pipe
            )
            logs = pipeline_1f1b.combine_logs(logs, self.log_specs.get("train", {}))
        else:
            grad_fn = jax.value_and_grad(lambda params: traced(params, batch), has_aux=True)
            (_, (loss, extras, logs, rest, written)), grads = grad_fn(state.params)
        if scaler is not None:
            grads = scaler.unscale(grads, scale_state)  # in float32: the masters' dtype
        aux = {"loss": loss, "rest": rest, "flush": flush, "written": written}
        state, more = self.update(state, grads, aux)
        return state, {"loss": loss, **extras, **more}, logs

    def _update(self, state: TrainState, grads: Any, aux: dict[str, Any]) -> tuple[TrainState, dict[str, Any]]:
        """Apply the optimizer to ``grads``; ``aux`` has the step's ``loss`` and the forward's new ``rest``."""
        assert self.tx is not None
        loss, rest = aux["loss"], aux["rest"]
        # parameters training_step wrote start the update from the written value (torch writes p.data, then
        # the optimizer steps p); written parameters the optimizer leaves alone end the step at that value
        base = {**state.params, **aux["written"]} if aux.get("written") else state.params
        outputs: dict[str, Any] = {}
        gnorm = ok = None
        if self.with_grad_norm or self.skip_nonfinite:
            gnorm = optax.global_norm(grads)
            outputs["grad_norm"] = gnorm
        accumulating = isinstance(state.opt_state, AccumulationState)
        scaler = self.scaler
        finite = None
        if scaler is not None:
            # torch's GradScaler checks the gradients the optimizer would apply: under accumulation the
            # window's sum so far (an Inf or NaN of any micro-batch stays in it); the scale holds inside a window
            window = jax.tree.map(jnp.add, state.opt_state.acc_grads, grads) if accumulating else grads
            finite = all_finite(window)
            outputs["loss_scale"] = state.loss_scale.scale
        if self.skip_nonfinite:
            # under "16-mixed" a non-finite gradient is the scaler's to skip (and to back the scale off on)
            ok = jnp.isfinite(loss) & jnp.isfinite(gnorm) if scaler is None else jnp.isfinite(loss)
            outputs["skipped"] = ~ok
            if accumulating:
                # Under accumulation the bad micro-batch still counts towards its window (so the
                # update boundary stays aligned with global_step) but contributes a zero gradient.
                grads = jax.tree.map(lambda g: jnp.where(ok, g, jnp.zeros_like(g)), grads)
        as_stored = lambda tree: {k: v.astype(state.params[k].dtype) for k, v in tree.items()}

        def apply(grads: Any) -> tuple[Any, Any]:
            if accumulating:
                updates, opt_state = self.tx.update(grads, state.opt_state, base, flush=aux["flush"])
            else:
                updates, opt_state = self.tx.update(grads, state.opt_state, base)
            return as_stored(optax.apply_updates(base, updates)), opt_state

        if scaler is not None and not accumulating:
            # a cond, not a select of both results: the skipped branch costs nothing and the update stays
            # in place (selecting between new and old state costs XLA:CPU copies of both)
            params, opt_state = jax.lax.cond(finite, apply, lambda _: (as_stored(base), state.opt_state), grads)
        else:
            params, opt_state = apply(grads)
        if self.skip_nonfinite:
            keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
            if not accumulating:
                params = keep(params, base)  # a skipped update still keeps what training_step wrote
                opt_state = keep(opt_state, state.opt_state)
            rest = keep(rest, state.model_state)
        updated = _has_updated(opt_state)
        if self.skip_nonfinite and not accumulating:
            updated = updated & ok
        loss_scale = state.loss_scale
        if scaler is not None:
            # a skipped step: parameters and the optimizer's state as they were (the model's other state,
            # e.g. BatchNorm statistics, keeps what the forward did, as in torch); at a window's end only
            if accumulating:  # the window is over either way: its sum is dropped with the update
                keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
                params = keep(params, as_stored(base))
                opt_state = opt_state._replace(inner_state=keep(opt_state.inner_state, state.opt_state.inner_state))
            stepped = _has_updated(opt_state)
            loss_scale = jax.tree.map(
                lambda n, o: jnp.where(stepped, n, o), scaler.update(state.loss_scale, finite), state.loss_scale
            )
            updated = updated & finite
        return self._finish(state, params, rest, opt_state, updated, outputs, loss_scale)

    def _finish(
        self,
        state: TrainState,
        params: Any,
        rest: Any,
        opt_state: Any,
        updated: Any,
        outputs: dict[str, Any],
        loss_scale: Any = None,
    ) -> tuple[TrainState, dict[str, Any]]:
        step = state.step + updated.astype(jnp.int32)
        info = {"updated": updated, "step": step}
        extra = {e.name: e.update(state.callback_state[e.name], params, info) for e in self.extensions}
        return TrainState(params, rest, opt_state, extra, step, loss_scale), outputs

    def _manual_update(self, state: TrainState, grads: Any, aux: dict[str, Any]) -> tuple[TrainState, dict[str, Any]]:
        """``training_step`` with its own ``manual_backward`` / ``opt.step`` calls, on ``aux["batch"]``."""
        return self.axes.call(self._manual_body, type(self.module).__name__, "training_step", state, grads, aux)

    def _manual_body(self, state: TrainState, grads: Any, aux: dict[str, Any]) -> tuple[TrainState, dict[str, Any]]:
        del grads
        batch, batch_idx = aux["batch"], aux["batch_idx"]
        col = Collector("train", self._rows(batch), on_step=True, on_epoch=False)
        ctx = ManualContext(self, state, col)
        with manual_context(ctx):
            ctx.models = ctx.make_models()
            with (
                self.module._bound(ctx.models, col),
                traced_counters(aux["counters"]),
                explained_tracing_errors(type(self.module).__name__, "training_step"),
                host_effects_watched(self.module, "training_step", self.parts.names),
            ):
                out = self.module.training_step(self.precision.compute(batch), batch_idx)
                ctx.sync_rest()
        self.log_specs["train"] = col.specs
        if out is None:  # Lightning allows it in manual optimization
            loss = ctx.last_loss if ctx.last_loss is not None else jnp.float32(jnp.nan)
            extras: dict[str, Any] = {}
        else:
            loss, extras = split_training_output(out)
        loss = jnp.asarray(loss, jnp.float32)
        outputs: dict[str, Any] = {"loss": loss, **extras}
        params, rest, opt_state = ctx.params, ctx.rest, tuple(ctx.opt_states)
        if self.scaler is not None:
            outputs["loss_scale"] = state.loss_scale.scale
        updated = jnp.bool_(True)
        if self.with_grad_norm or self.skip_nonfinite:
            gnorm = optax.global_norm(ctx.grads) if ctx.grads else jnp.float32(0.0)
            outputs["grad_norm"] = gnorm
            if self.skip_nonfinite:
                # under "16-mixed" opt.step already skipped a non-finite gradient (and backed the scale off)
                ok = jnp.isfinite(loss) & jnp.isfinite(gnorm) if self.scaler is None else jnp.isfinite(loss)
                outputs["skipped"] = ~ok
                keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
                params, rest = keep(params, state.params), keep(rest, state.model_state)
                opt_state = keep(opt_state, state.opt_state)
                updated = ok
        state, outputs = self._finish(state, params, rest, opt_state, updated, outputs, ctx.loss_scale)
        outputs["_logs"] = col.values
        return state, outputs

    def eval_step(self, stage: str, params: dict, rest: dict, batch: Any, batch_idx: jax.Array, counters: Any = None):
        out, logs, _ = self.eval_step_carrying(stage, params, rest, batch, batch_idx, counters)
        return out, logs

    def eval_step_carrying(
        self, stage: str, params: dict, rest: dict, batch: Any, batch_idx: jax.Array, counters: Any = None
    ):
        """``(out, logs, changed)``: :meth:`eval_step` and the non-parameter variables the step set that
        evaluation carries (:func:`jaxlight.state.eval_changes`), by key. ``counters``: traced int32
        ``[global_step, current_epoch]`` of the run, what the step reads as ``self.global_step`` and
        ``self.current_epoch`` (None: they read as on the host)."""
        method = STAGES[stage].step_method
        body = self._eval_body
        return self.axes.call(body, type(self.module).__name__, method, stage, params, rest, batch, batch_idx, counters)

    def _eval_body(self, stage: str, params: dict, rest: dict, batch: Any, batch_idx: jax.Array, counters: Any):
        prec = self.precision
        models = self._models(params, rest, train=False)
        col = Collector(stage, self._rows(batch), on_step=False, on_epoch=True)
        method = STAGES[stage].step_method
        values = {} if counters is None else {"global_step": counters[0], "current_epoch": counters[1]}
        with (
            self.module._bound(models, col),
            traced_counters(values),
            explained_tracing_errors(type(self.module).__name__, method),
        ):
            out = getattr(self.module, method)(prec.compute(batch), batch_idx)
        self.log_specs[stage] = col.specs
        for k, v in jax.tree_util.tree_flatten_with_path(out)[0]:
            if not hasattr(v, "dtype"):
                raise StepError(
                    f"{method} output {jax.tree_util.keystr(k) or '<root>'} is a {type(v).__name__}; "
                    f"outputs of a compiled step must be arrays (or None)"
                )
        return out, col.values, eval_changes(self.parts, models, rest)


def _has_updated(opt_state: Any) -> jax.Array:
    """True when this call applied an update (gradient accumulation holds it otherwise)."""
    if isinstance(opt_state, AccumulationState):
        return opt_state.window == 0
    return jnp.bool_(True)


__all__ = ["StepBuilder", "StepExtension", "TrainState", "split_training_output"]
