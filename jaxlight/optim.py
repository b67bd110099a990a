"""From what ``configure_optimizers`` returns to the one optax transformation the step applies.

Clipping and accumulation are optax transforms (``optax.chain(clip, tx)``,
:func:`accumulate_gradients`), so the compiled step only ever calls ``tx.update``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxlight.errors import MisconfigurationError


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


class OptimizerConfig(NamedTuple):
    """The transformation the step applies and the schedules it was given (for LR monitoring)."""

    tx: optax.GradientTransformation
    schedules: list[Any]


_INJECTED = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def _injected_lr(state: Any) -> bool:
    """Whether an optimizer state holds an ``inject_hyperparams`` learning rate."""
    found = []

    def visit(node: Any) -> Any:
        if isinstance(node, _INJECTED) and "learning_rate" in node.hyperparams:
            found.append(node)
        return node

    jax.tree.map(visit, state, is_leaf=lambda n: isinstance(n, _INJECTED))
    return bool(found)


def drive_learning_rate(tx: optax.GradientTransformation, schedule: Any) -> optax.GradientTransformation:
    """``tx`` with every injected ``learning_rate`` set to ``schedule(count)`` before each update.

    ``count`` is the injected state's own update count, i.e. the optimizer
    steps taken (accumulation windows count once).
    """

    def set_lr(state: Any) -> Any:
        def one(node: Any) -> Any:
            if isinstance(node, _INJECTED) and "learning_rate" in node.hyperparams:
                lr = node.hyperparams["learning_rate"]
                value = jnp.asarray(schedule(node.count), dtype=jnp.asarray(lr).dtype)
                return node._replace(hyperparams={**node.hyperparams, "learning_rate": value})
            return node

        return jax.tree.map(one, state, is_leaf=lambda n: isinstance(n, _INJECTED))

    def update(updates: Any, state: Any, params: Any = None) -> Any:
        return tx.update(updates, set_lr(state), params)

    return optax.GradientTransformation(tx.init, update)


def configure(
    out: Any,
    *,
    gradient_clip_val: float | None = None,
    gradient_clip_algorithm: str = "norm",
    accumulate_grad_batches: int = 1,
) -> OptimizerConfig:
    """Parse ``configure_optimizers``' return value and add clipping and accumulation.

    Accepted: an ``optax.GradientTransformation``, or Lightning's dict
    ``{"optimizer": tx, "lr_scheduler": schedule | {"scheduler": schedule}}``
    with an optax schedule (``step -> lr``). As in Lightning, the scheduler
    sets the optimizer's learning rate: when ``tx`` was built with
    ``optax.inject_hyperparams`` (so its ``learning_rate`` can be set), every
    update uses ``schedule(optimizer step)``; otherwise ``tx`` must already use
    the schedule as its learning rate and the entry names it for
    ``LearningRateMonitor``. Anything else raises
    :class:`MisconfigurationError` saying what came back.
    """
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
    if schedules and _injected_lr(tx.init({})):
        tx = drive_learning_rate(tx, schedules[0])
    if gradient_clip_val:
        clip = (
            optax.clip_by_global_norm(gradient_clip_val)
            if gradient_clip_algorithm == "norm"
            else optax.clip(gradient_clip_val)
        )
        tx = optax.chain(clip, tx)
    if accumulate_grad_batches > 1:
        tx = accumulate_gradients(tx, accumulate_grad_batches)
    return OptimizerConfig(tx, schedules)
