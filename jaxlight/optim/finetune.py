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
A plain optax alias (``optax.adam(1e-3)``, its rate in a closure) takes a
group whose rate is a multiple of the optimizer's (``AddedGroup.lr_scale``):
the copy's update times that multiple, which is the alias at that rate
exactly when the rate only scales the update (:func:`scaled_alias`).

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
    lr: float | None  # torch's param_group["lr"], written into its injected learning rate (None: lr_scale)
    # a plain optax alias (no injected rate): the group's rate as a multiple of its optimizer's, applied as
    # a scale of the alias's update (exact for the aliases scaled_alias accepts)
    lr_scale: float | None = None
    state_of: Callable[[Any], Any] | None = dataclasses.field(default=None, repr=False)  # set by build()


_NEEDS_INJECTION = (
    "a parameter group added during training gets its own learning rate, which jaxlight sets in the "
    "optimizer's optax state: build the optimizer with an injected learning rate, "
    "optax.inject_hyperparams(optax.adam)(learning_rate=1e-3) (an lr_scheduler may still drive it)"
)


def group_transform(tx: Any, group: AddedGroup) -> optax.GradientTransformation:
    """The transformation of an added group: its optimizer's own (a fresh copy of its state is made by
    ``init``), its update scaled by ``group.lr_scale`` when it has one; refused for
    :func:`~jaxlight.optim.param_groups` optimizers, whose groups are fixed."""
    if isinstance(tx, ParamGroups) or not isinstance(tx, optax.GradientTransformation):
        raise MisconfigurationError(
            f"parameter group {group.label!r}: optimizer {group.optimizer} is a jl.optim.param_groups(...) "
            f"optimizer; adding a group during training needs a single optax transformation"
        )
    if group.lr_scale is not None:
        return optax.chain(tx, optax.scale(group.lr_scale))
    return tx


# optax aliases whose learning rate only scales the update: it enters through scale_by_learning_rate (or
# scale(-lr)), and what follows is linear in the update (a trace, an EMA, a scale by the parameters' RMS),
# so the alias at rate r is the alias at rate lr times r / lr. They are told by the types of their state
# (each alias is an optax.chain: a tuple with one state per transformation; optax 0.2's definitions,
# constant rates; a schedule adds a ScaleByScheduleState and is not here).
_E = "EmptyState"
SCALED_ALIASES: dict[tuple[str, ...], str] = {
    (_E, _E): "optax.sgd / optax.sign_sgd",
    ("TraceState", _E): "optax.sgd(momentum=...)",  # the trace comes before the rate
    ("ScaleByAdamState", _E): "optax.adam / nadam / adamax / radam / yogi",
    ("ScaleByAdamState", _E, _E): "optax.adamw / nadamw / adamaxw",  # weight decay added before the rate
    ("ScaleByAdamState", _E, _E, _E): "optax.lamb",
    ("ScaleByAmsgradState", _E): "optax.amsgrad",
    ("ScaleByRmsState", _E, _E): "optax.rmsprop",
    ("ScaleByRmsState", _E, "TraceState"): "optax.rmsprop(momentum=...)",  # a trace after the rate: linear
    ("ScaleByRStdDevState", _E, _E): "optax.rmsprop(centered=True)",
    ("ScaleByRStdDevState", _E, "TraceState"): "optax.rmsprop(centered=True, momentum=...)",
    ("ScaleByRssState", _E): "optax.adagrad",
    (_E, "ScaleByAdaDeltaState", _E): "optax.adadelta",
    ("ScaleByBeliefState", _E): "optax.adabelief",
    ("ScaleByLionState", _E, _E): "optax.lion",
    ("ScaleByNovogradState", _E): "optax.novograd",
    ("ScaleBySM3State", _E): "optax.sm3",
    ("ScaleByAdanState", _E, _E): "optax.adan",
    ("EmaState", _E, _E): "optax.signum",
    ("FactoredState", _E, _E, _E, _E): "optax.adafactor",
    ("FactoredState", _E, _E, _E, "EmaState", _E): "optax.adafactor(momentum=...)",
    ("AddNoiseState", _E): "optax.noisy_sgd",
    ("ScaleByOptimisticGradientState", _E): "optax.optimistic_gradient_descent",
}
# aliases whose rate does more than scale the update, so no multiple of it is the alias at another rate
NOT_SCALED_ALIASES: dict[tuple[str, ...], str] = {
    ("ScaleByRpropState", _E): "optax.rprop (its step sizes start at the rate but are clipped to fixed bounds)",
    (_E, _E, _E): "optax.fromage (its rate also sets the weights' shrink factor)",
    ("ScaleByLBFGSState", _E, "ScaleByZoomLinesearchState"): "optax.lbfgs (a line search follows the rate)",
    ("ScaleByAdamState", "ScaleByOptimisticGradientState", _E): (
        "optax.optimistic_adam (its rate is the step of the optimistic update, next to a fixed optimism) or "
        "optimistic_adam_v2 (the same state types)"
    ),
    ("FactoredState", _E, _E, _E, _E, _E): "optax.adafactor(weight_decay_rate=...) (weight decay added after the rate)",
}


def state_types(tx: optax.GradientTransformation, params: Mapping[str, Any]) -> tuple[str, ...]:
    """The type names of ``tx``'s state, one per transformation of a chain (a nested chain is ``"tuple"``)."""
    shapes = jax.eval_shape(tx.init, dict(params))
    parts = shapes if isinstance(shapes, tuple) and not hasattr(shapes, "_fields") else (shapes,)
    return tuple(type(x).__name__ for x in parts)


def scaled_alias(tx: Any, params: Mapping[str, Any], what: str) -> str:
    """The name of the optax alias ``tx`` is when its rate only scales its update (:data:`SCALED_ALIASES`), so
    a group at a multiple of that rate is exact; raise naming what it is and the fix otherwise."""
    if isinstance(tx, ParamGroups) or not isinstance(tx, optax.GradientTransformation):
        raise MisconfigurationError(f"{what}: {_NEEDS_INJECTION}")
    types = state_types(tx, params)
    if types in SCALED_ALIASES:
        return SCALED_ALIASES[types]
    known = NOT_SCALED_ALIASES.get(types)
    if "ScaleByScheduleState" in types:
        known = "an optax alias with a learning-rate schedule (the group would restart the schedule)"
    it = known if known is not None else f"a transformation with state ({', '.join(types)}), not a known optax alias"
    raise MisconfigurationError(
        f"{what}: the optimizer is {it}, whose learning rate lives in optax's closure and does not only scale "
        f"its update, so a group at another rate cannot be made from it. {_NEEDS_INJECTION[0].upper()}"
        f"{_NEEDS_INJECTION[1:]}"
    )


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


def set_learning_rates(opt_state: Any, targets: Sequence[tuple[Callable[[Any], Any], float | None]]) -> Any:
    """``opt_state`` with the injected learning rate of each target set: ``(state_of, lr)`` pairs, where
    ``state_of`` picks a group's (or optimizer's) state from the whole optimizer state. The new scalars
    take the old ones' placement, so the compiled train step takes the state as it is."""
    where = {id(n): p for p, n in injected_states(opt_state).items()}
    writes = []
    for state_of, lr in targets:
        if lr is None:  # a group scaled from a plain alias (lr_scale): no rate in its state
            continue
        for node in driven_states(state_of(opt_state)).values():
            old = node.hyperparams["learning_rate"]
            value = jnp.asarray(lr, jnp.result_type(old))
            sharding = getattr(old, "sharding", None)
            writes.append((where[id(node)], jax.device_put(value, sharding) if sharding is not None else value))
    for path, value in writes:
        opt_state = set_hyperparam(opt_state, path, "learning_rate", value)
    return opt_state


__all__ = [
    "NOT_SCALED_ALIASES",
    "SCALED_ALIASES",
    "AddedGroup",
    "carry_state",
    "check_settable",
    "group_transform",
    "scaled_alias",
    "set_learning_rates",
    "state_types",
    "zero_unoptimized",
]
