"""Gradient accumulation over micro-batches, with Lightning's arithmetic (``Trainer(accumulate_grad_batches=n)``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class AccumulationState(NamedTuple):
    """State of :func:`accumulate_gradients`."""

    window: jax.Array  # int32: micro-batches summed into ``acc_grads`` since the last update
    acc_grads: Any  # the sum of their gradients (parameter-shaped)
    inner_state: Any  # the wrapped optimizer's state


def accumulate_gradients(tx: optax.GradientTransformation, every: int) -> optax.GradientTransformationExtraArgs:
    """Sum micro-batch gradients and apply ``tx`` to ``sum / every`` once per window, as Lightning does.

    A call applies the update when it completes a window of ``every``
    micro-batches, or when called with ``flush=True`` (the trainer flushes at
    an epoch's last batch, so a partial window of ``n < every`` micro-batches
    steps with ``sum / every``: Lightning divides each loss by
    ``accumulate_grad_batches`` whatever the window's length). Other calls
    return zero updates and leave ``tx``'s state untouched. ``flush`` may be
    traced: one compiled step serves both cases.
    """
    inner = optax.with_extra_args_support(tx)

    def init(params: Any) -> AccumulationState:
        return AccumulationState(jnp.zeros([], jnp.int32), jax.tree.map(jnp.zeros_like, params), inner.init(params))

    def update(grads: Any, state: AccumulationState, params: Any = None, *, flush: Any = False, **extra: Any):
        acc = jax.tree.map(jnp.add, state.acc_grads, grads)
        window = state.window + 1

        def apply(_: Any) -> tuple[Any, AccumulationState]:
            mean = jax.tree.map(lambda a: a / every, acc)
            updates, inner_state = inner.update(mean, state.inner_state, params, **extra)
            updates = jax.tree.map(lambda u, g: u.astype(g.dtype), updates, grads)
            zero = AccumulationState(jnp.zeros([], jnp.int32), jax.tree.map(jnp.zeros_like, acc), inner_state)
            return updates, zero

        def hold(_: Any) -> tuple[Any, AccumulationState]:
            return jax.tree.map(jnp.zeros_like, grads), AccumulationState(window, acc, state.inner_state)

        return jax.lax.cond((window >= every) | flush, apply, hold, None)

    return optax.GradientTransformationExtraArgs(init, update)


__all__ = ["AccumulationState", "accumulate_gradients"]
