"""The compiled steps: one SPMD program per stage, traced from the module.

``TrainState`` carries everything the train step updates: parameters, the
other NNX variables, the optax state, and in-step state owned by callbacks
(EMA and the like). The train step is ``new_state, outputs, logs =
step(state, batch, batch_idx)`` with the state donated, so the update runs in
place and the parameters are held once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
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
    opt_state: Any
    extra: dict[str, Any]
    step: jax.Array  # int32: optimizer updates applied so far


class StepError(TypeError):
    """A step method returned something the trainer cannot use."""


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
    if not hasattr(loss, "shape") or not hasattr(loss, "dtype"):
        raise StepError(f"training_step loss must be a jax scalar, got {type(loss).__name__}")
    if loss.shape != ():
        raise StepError(f"training_step loss must be a scalar, got shape {tuple(loss.shape)} (reduce it, e.g. .mean())")
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise StepError(f"training_step loss must be floating point, got dtype {loss.dtype}")
    for k, v in jax.tree_util.tree_flatten_with_path(extras)[0]:
        if not hasattr(v, "dtype"):
            raise StepError(
                f"training_step output {jax.tree_util.keystr(k)} is a {type(v).__name__}; "
                f"outputs of a compiled step must be arrays"
            )
    return loss, extras


class StepBuilder:
    """Builds the pure functions the trainer compiles for each stage.

    The train step is two parts: the forward and backward pass, then the
    update ``update(state, grads, aux) -> (state, outputs)`` (optimizer,
    non-finite guard, step counter, callback extensions). ``wrap_update``
    (the strategy's pieces, e.g. host offload fetching optimizer state into
    device memory) wraps only the update.
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
    ) -> None:
        self.module = module
        self.parts = parts
        self.precision = precision
        self.tx = tx
        self.extensions = extensions
        self.with_grad_norm = with_grad_norm
        self.skip_nonfinite = skip_nonfinite
        self.update = wrap_update(self._update) if wrap_update is not None else self._update
        self.log_specs: dict[str, dict] = {}

    def _rows(self, batch: Any) -> int | None:
        leaves = jax.tree.leaves(batch)
        return int(leaves[0].shape[0]) if leaves and getattr(leaves[0], "ndim", 0) else None

    def train_step(self, state: TrainState, batch: Any, batch_idx: jax.Array, flush: jax.Array):
        """``flush``: a traced bool; under gradient accumulation it makes this micro-batch end its window."""
        prec = self.precision

        def loss_fn(params):
            models = merge_models(self.parts, prec.compute(params), state.rest, train=True)
            col = Collector("train", self._rows(batch), on_step=True, on_epoch=False)
            with self.module._bound(models, col):
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
        step = state.step + updated.astype(jnp.int32)
        info = {"updated": updated, "step": step}
        extra = {e.name: e.update(state.extra[e.name], params, info) for e in self.extensions}
        return TrainState(params, rest, opt_state, extra, step), outputs

    def eval_step(self, stage: str, params: dict, rest: dict, batch: Any, batch_idx: jax.Array):
        prec = self.precision
        models = merge_models(self.parts, prec.compute(params), rest, train=False)
        col = Collector(stage, self._rows(batch), on_step=False, on_epoch=True)
        method = {"validate": "validation_step", "test": "test_step", "predict": "predict_step"}[stage]
        with self.module._bound(models, col):
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
