"""Parameter groups added during training (fine-tuning), as torch's ``optimizer.add_param_group`` adds them.

:class:`~jaxlight.callbacks.BaseFinetuning` freezes parameters before the
optimizer is built (:meth:`OptimizerConfig.build` leaves them out of every
optimizer: no update, no optimizer state) and later unfreezes some into a new
group. Each group is one more label of the optimizer's ``optax.partition``,
updated by a fresh copy of its optimizer's transformation: its state starts
empty (an Adam step count of 0, zero moments), so its first Adam step moves
each weight by the group's learning rate, exactly as torch's new param group.
Its learning rate is torch's ``param_group["lr"]``: the injected
``learning_rate`` of that copy, set from the host (:func:`set_learning_rates`).

The pieces here are pure: the state a rebuilt optimizer keeps from the old
one (:func:`carry_state`, by path, so the existing groups' moments and counts
stay), the zeroing of gradients no optimizer owns before clipping
(:func:`zero_unoptimized`), and reading/writing the groups' learning rates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxlight.errors import MisconfigurationError
from jaxlight.optim.params import FROZEN, ParamGroups
from jaxlight.optim.schedules import driven_states, injected_states, set_hyperparam


@dataclasses.dataclass
class AddedGroup:
    """One parameter group added to an optimizer after it was built (torch's ``add_param_group``)."""

    optimizer: int  # index of the optimizer (in configure_optimizers' order) it belongs to
    label: str  # its label in the optimizer's optax.partition ("opt0_pg2")
    keys: tuple[str, ...]  # the parameter paths it updates
    lr: float  # torch's param_group["lr"], written into its injected learning rate
    state_of: Callable[[Any], Any] | None = dataclasses.field(default=None, repr=False)  # set by build()


_NEEDS_INJECTION = (
    "a parameter group added during training gets its own learning rate, which jaxlight sets in the "
    "optimizer's optax state: build the optimizer with an injected learning rate, "
    "optax.inject_hyperparams(optax.adam)(learning_rate=1e-3) (an lr_scheduler may still drive it)"
)


def group_transform(tx: Any, group: AddedGroup) -> optax.GradientTransformation:
    """The transformation of an added group: its optimizer's own (a fresh copy of its state is made by
    ``init``); refused for :func:`~jaxlight.optim.param_groups` optimizers, whose groups are fixed."""
    if isinstance(tx, ParamGroups) or not isinstance(tx, optax.GradientTransformation):
        raise MisconfigurationError(
            f"parameter group {group.label!r}: optimizer {group.optimizer} is a jl.optim.param_groups(...) "
            f"optimizer; adding a group during training needs a single optax transformation"
        )
    return tx


def check_settable(tx: Any, params: Mapping[str, Any], what: str) -> None:
    """Raise unless ``tx``'s state holds a learning rate the host can set (an injected number)."""
    if isinstance(tx, ParamGroups) or not isinstance(tx, optax.GradientTransformation):
        raise MisconfigurationError(f"{what}: {_NEEDS_INJECTION}")
    shapes = jax.eval_shape(tx.init, dict(params))
    if not driven_states(shapes):
        raise MisconfigurationError(f"{what}: {_NEEDS_INJECTION}")


def zero_unoptimized(labels: Mapping[str, str]) -> optax.GradientTransformation:
    """Zero the gradients of parameters no optimizer updates (label :data:`~jaxlight.optim.FROZEN`), so
    gradient clipping measures only the optimizers' parameters, as Lightning clips (a frozen torch
    parameter has no gradient)."""

    def init(params: Any) -> optax.EmptyState:
        del params
        return optax.EmptyState()

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        del params
        out = {k: jnp.zeros_like(u) if labels.get(k) == FROZEN else u for k, u in updates.items()}
        return out, state

    return optax.GradientTransformation(init, update)


def carry_state(old: Any, fresh: Any) -> Any:
    """``fresh`` (the rebuilt optimizer's initial state) with every leaf that exists in ``old`` at the same
    path, shape and dtype taken from ``old``: the groups that were there keep their state; new groups
    start from their initial state."""
    before = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(old)[0]}

    def pick(path: Any, x: Any) -> Any:
        o = before.get(jax.tree_util.keystr(path))
        same = o is not None and jnp.shape(o) == jnp.shape(x) and jnp.result_type(o) == jnp.result_type(x)
        return o if same else x

    return jax.tree_util.tree_map_with_path(pick, fresh)


def set_learning_rates(opt_state: Any, targets: Sequence[tuple[Callable[[Any], Any], float]]) -> Any:
    """``opt_state`` with the injected learning rate of each target set: ``(state_of, lr)`` pairs, where
    ``state_of`` picks a group's (or optimizer's) state from the whole optimizer state. The new scalars
    take the old ones' placement, so the compiled train step takes the state as it is."""
    where = {id(n): p for p, n in injected_states(opt_state).items()}
    writes = []
    for state_of, lr in targets:
        for node in driven_states(state_of(opt_state)).values():
            old = node.hyperparams["learning_rate"]
            value = jnp.asarray(lr, jnp.result_type(old))
            sharding = getattr(old, "sharding", None)
            writes.append((where[id(node)], jax.device_put(value, sharding) if sharding is not None else value))
    for path, value in writes:
        opt_state = set_hyperparam(opt_state, path, "learning_rate", value)
    return opt_state


__all__ = [
    "AddedGroup",
    "carry_state",
    "check_settable",
    "group_transform",
    "set_learning_rates",
    "zero_unoptimized",
]
