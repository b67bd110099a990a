"""Reading an optimizer's parameter groups, name and current hyperparameters out of its optax *state*.

optax transformations are closures: their fixed hyperparameters (a float
learning rate, ``b1``, a schedule function) are not reachable through any
public optax API, so jaxlight does not look for them there. What it reads:

* the state's types (public optax state classes): ``PartitionState`` splits
  an optimizer into parameter groups (``optax.partition``/``multi_transform``,
  :func:`~jaxlight.optim.param_groups`, several optimizers with ``"params"``);
  ``ScaleByAdamState``, ``TraceState``, ... name the optimizer as torch would;
* ``optax.inject_hyperparams`` states: their ``hyperparams`` hold the
  learning rate, momentum (``b1``) and weight decay. The value the *next*
  update uses (an injected schedule moves at every update) is what that
  update would store: :class:`TransformInfo` runs the optimizer's own update
  on zero gradients under ``jax.jit``, where everything but those scalars is
  dead code, and reads the injected states it returns;
* ``reduce_on_plateau`` scales, which multiply the learning rate;
* a schedule the user named as the optimizer's ``lr_scheduler``, at the
  count of the optimizer's ``ScaleByScheduleState``;
* what jaxlight built itself (:class:`~jaxlight.optim.params.KnownGroup`).

A group whose learning rate is none of these (``optax.adam(1e-3)``: the rate
lives only in optax's closure) is reported as unreadable; the caller says so
rather than guessing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
import optax.contrib

from jaxlight.optim.params import FROZEN, KnownGroup
from jaxlight.optim.schedules import (
    hold_plateaus,
    is_injected_state,
    plateau_states,
    shardings_of,
    to_device_memory,
    zeros_like_updates,
)

# optax function names -> the class name torch (and so Lightning's LearningRateMonitor) would print
ALIAS_NAMES = {
    "sgd": "SGD",
    "adam": "Adam",
    "adamw": "AdamW",
    "nadam": "NAdam",
    "nadamw": "NAdamW",
    "radam": "RAdam",
    "rmsprop": "RMSprop",
    "adagrad": "Adagrad",
    "adadelta": "Adadelta",
    "adamax": "Adamax",
    "adamaxw": "AdamaxW",
    "amsgrad": "AMSGrad",
    "lamb": "Lamb",
    "lars": "LARS",
    "lion": "Lion",
    "adafactor": "Adafactor",
    "novograd": "Novograd",
    "yogi": "Yogi",
    "sm3": "SM3",
    "adabelief": "AdaBelief",
    "lbfgs": "LBFGS",
    "fromage": "Fromage",
    "noisy_sgd": "NoisySGD",
    "polyak_sgd": "PolyakSGD",
    "sign_sgd": "SignSGD",
    "rprop": "Rprop",
    "muon": "Muon",
    "adan": "Adan",
    "optimistic_gradient_descent": "OptimisticGD",
}

# state types that make an optimizer what it is -> its torch name, checked in this order (names of
# optax's public state classes; classes that are only aliases of optax.EmptyState tell nothing and are left out)
_STATE_NAMES = [
    (optax, "ScaleByLBFGSState", "LBFGS"),
    (optax.contrib, "MuonState", "Muon"),
    (optax, "ScaleByLionState", "Lion"),
    (optax, "FactoredState", "Adafactor"),
    (optax, "ScaleByNovogradState", "Novograd"),
    (optax, "ScaleByBeliefState", "AdaBelief"),
    (optax, "ScaleBySM3State", "SM3"),
    (optax, "ScaleByAdanState", "Adan"),
    (optax, "ScaleByAmsgradState", "AMSGrad"),
    (optax, "ScaleByAdamState", "Adam"),
    (optax, "ScaleByRmsState", "RMSprop"),
    (optax, "ScaleByRStdDevState", "RMSprop"),
    (optax, "ScaleByRssState", "Adagrad"),
    (optax, "ScaleByAdaDeltaState", "Adadelta"),
    (optax, "ScaleByRpropState", "Rprop"),
    (optax, "TraceState", "SGD"),
]
STATE_NAMES: list[tuple[type, str]] = [
    (cls, name)
    for mod, attr, name in _STATE_NAMES
    if isinstance(cls := getattr(mod, attr, None), type) and cls is not optax.EmptyState
]
_NAMED_STATES = tuple(cls for cls, _ in STATE_NAMES)
_DECOUPLED = {"Adam", "NAdam", "Adamax", "AMSGrad", "RAdam"}  # + weight decay -> "...W", as torch names them


def _interesting(node: Any) -> bool:
    return isinstance(
        node,
        (optax.PartitionState, optax.ScaleByScheduleState, optax.contrib.ReduceLROnPlateauState, *_NAMED_STATES),
    ) or is_injected_state(node)


def _nodes(tree: Any) -> list[Any]:
    return [n for n in jax.tree.leaves(tree, is_leaf=_interesting) if _interesting(n)]


def injected_states(state: Any) -> list[Any]:
    """Every ``inject_hyperparams`` state in ``state`` (nested ones too), outer before inner."""
    out = []
    for n in jax.tree.leaves(state, is_leaf=is_injected_state):
        if is_injected_state(n):
            out.append(n)
            out.extend(injected_states(n.inner_state))
    return out


def schedule_states(state: Any) -> list[Any]:
    """The ``ScaleByScheduleState`` nodes of ``state`` (a schedule baked into a transformation)."""
    is_sched = lambda n: isinstance(n, optax.ScaleByScheduleState)
    return [n for n in jax.tree.leaves(state, is_leaf=is_sched) if is_sched(n)]


@dataclasses.dataclass
class _Group:
    nodes: list[Any] = dataclasses.field(default_factory=list)
    label: str | None = None
    top: str | None = None  # the outermost partition label (where KnownGroup facts are filed)
    frozen: bool = False

    def merged(self, other: _Group) -> _Group:
        return _Group(
            self.nodes + other.nodes,
            other.label if other.label is not None else self.label,
            self.top if self.top is not None else other.top,
            self.frozen or other.frozen,
        )


def _groups(tree: Any) -> list[_Group]:
    """The parameter groups of a state: one, or one per label of each ``PartitionState`` in it (several
    partitions in a chain multiply), each with the state nodes that act on it."""
    shared = _Group()
    parts: list[list[_Group]] = []
    for n in _nodes(tree):
        if isinstance(n, optax.PartitionState):
            sub = []
            for label, inner in n.inner_states.items():
                if isinstance(inner, optax.MaskedState):
                    inner = inner.inner_state
                for g in _groups(inner):
                    g.label = str(label) if g.label is None else f"{label}/{g.label}"
                    g.top = str(label)
                    g.frozen = g.frozen or label == FROZEN
                    sub.append(g)
            parts.append(sub)
        else:
            shared.nodes.append(n)
            if is_injected_state(n):
                parts.append(_groups(n.inner_state))
    groups = [shared]
    for sub in parts:
        groups = [a.merged(b) for a in groups for b in sub]
    return groups


@dataclasses.dataclass
class GroupInfo:
    """One parameter group of an optimizer, as far as its state shows.

    ``name`` is the optimizer's name as torch's class would be called
    ("Adam", "AdamW", "SGD"). ``readable``: whether its learning rate is in
    the state (injected, a named schedule, or built by jaxlight);
    ``missing`` lists what :meth:`TransformInfo.values` cannot give for it
    (``"learning rate"``, ``"momentum"``, ``"weight decay"``).
    """

    label: str | None
    explicit: bool  # the label is a name the user gave (torch's param_group["name"])
    frozen: bool
    name: str
    missing: list[str]
    # where its values come from: positions among injected_states / plateau_states / schedule_states
    injected: list[int] = dataclasses.field(default_factory=list, repr=False)
    plateaus: list[int] = dataclasses.field(default_factory=list, repr=False)
    schedule: int | None = dataclasses.field(default=None, repr=False)
    known: Mapping[str, float] = dataclasses.field(default_factory=dict, repr=False)
    injected_lr: bool = dataclasses.field(default=False, repr=False)

    @property
    def readable(self) -> bool:
        return "learning rate" not in self.missing


def _name(nodes: list[Any], known: KnownGroup | None) -> str:
    if known is not None:
        return ALIAS_NAMES.get(known.factory, known.factory.title())
    core = next((name for cls, name in STATE_NAMES if any(isinstance(n, cls) for n in nodes)), "SGD")
    decays = any(is_injected_state(n) and "weight_decay" in n.hyperparams for n in nodes)
    return core + "W" if decays and core in _DECOUPLED else core


def _first(hps: list[Mapping[str, Any]], known: Mapping[str, float], keys: tuple[str, ...]) -> Any | None:
    for key in keys:
        for h in hps:
            if key in h:
                return h[key]
        if key in known:
            return known[key]
    return None


@dataclasses.dataclass
class TransformInfo:
    """One optimizer read from its state: its parameter groups, and :meth:`values` to read their current
    learning rates, momenta and weight decays (jitted; built once, called at every read)."""

    groups: list[GroupInfo]
    _values: Callable[[Any], list[dict[str, Any]]] = dataclasses.field(repr=False)

    @property
    def optimized_groups(self) -> list[GroupInfo]:
        return [g for g in self.groups if not g.frozen]

    def values(self, state: Any) -> list[dict[str, Any]]:
        """For each optimized group: ``{"lr": ..., "momentum": ..., "weight_decay": ...}`` (float32 device
        scalars) for what it can read, the rate being the one the next update uses."""
        return self._values(state)


def inspect_transform(
    tx: optax.GradientTransformation,
    state: Any,
    like: Any,
    *,
    known: Mapping[str, KnownGroup] | None = None,
    schedule: Callable[[Any], Any] | None = None,
) -> TransformInfo:
    """Read the optimizer ``tx`` from its ``state`` (arrays, or shapes): groups, names, and where each group's
    hyperparameters are. ``like``: its updates' shapes (``jax.ShapeDtypeStruct``, ``optax.MaskedNode``
    where masked); ``known``: facts of the groups jaxlight built, by partition label; ``schedule``: the
    step-interval schedule the user named for it (read at its ``ScaleByScheduleState`` count when the
    learning rate is not injected)."""
    known = dict(known or {})
    where_inj = {id(n): i for i, n in enumerate(injected_states(state))}
    where_plat = {id(n): i for i, n in enumerate(plateau_states(state))}
    where_sched = {id(n): i for i, n in enumerate(schedule_states(state))}
    infos = []
    for g in _groups(state):
        fact = known.get(g.top) if g.top is not None else None
        inj = [where_inj[id(n)] for n in g.nodes if id(n) in where_inj]
        hps = [n.hyperparams for n in g.nodes if is_injected_state(n)]
        statics = dict(fact.hparams) if fact is not None else {}
        scheds = [where_sched[id(n)] for n in g.nodes if id(n) in where_sched]
        injected_lr = any("learning_rate" in h for h in hps)
        named = schedule is not None and not injected_lr and len(scheds) == 1
        sees_all = bool(hps) or fact is not None  # every numeric hyperparameter is in view: absent means none
        missing = []
        if not (injected_lr or named or "learning_rate" in statics):
            missing.append("learning rate")
        if not sees_all and _first(hps, statics, ("momentum", "b1")) is None:
            missing.append("momentum")
        if not sees_all and _first(hps, statics, ("weight_decay",)) is None:
            missing.append("weight decay")
        infos.append(
            GroupInfo(
                label=g.label,
                explicit=fact.named if fact is not None else False,
                frozen=g.frozen,
                name=_name(g.nodes, fact),
                missing=missing,
                injected=inj,
                plateaus=[where_plat[id(n)] for n in g.nodes if id(n) in where_plat],
                schedule=scheds[0] if named else None,
                known=statics,
                injected_lr=injected_lr,
            )
        )
    optimized = [g for g in infos if not g.frozen]
    probe = any(g.injected for g in optimized)
    held = hold_plateaus(tx)
    shardings = shardings_of(state)  # HostOffload: read host-resident scalars through device copies

    def values(state: Any) -> list[dict[str, Any]]:
        state = to_device_memory(state, shardings)
        if probe:  # the injected values the next update uses are the ones it stores
            zeros = zeros_like_updates(like)
            inj = injected_states(held.update(zeros, state, zeros)[1])
        else:
            inj = []
        plats, scheds = plateau_states(state), schedule_states(state)
        out = []
        for g in optimized:
            hps = [inj[i].hyperparams for i in g.injected]
            got: dict[str, Any] = {}
            if g.readable:
                if g.injected_lr:
                    factors = [h["learning_rate"] for h in hps if "learning_rate" in h]
                elif g.schedule is not None:
                    factors = [schedule(scheds[g.schedule].count)]  # type: ignore[misc]
                else:
                    factors = [g.known["learning_rate"]]
                factors += [plats[i].scale for i in g.plateaus]
                lr = jnp.float32(1.0)
                for f in factors:
                    lr = lr * jnp.asarray(f, jnp.float32)
                got["lr"] = lr
            for key, names in (("momentum", ("momentum", "b1")), ("weight_decay", ("weight_decay",))):
                v = _first(hps, g.known, names)
                if v is not None or key.replace("_", " ") not in g.missing:
                    got[key] = jnp.asarray(0.0 if v is None else v, jnp.float32)
            out.append(got)
        return out

    return TransformInfo(infos, jax.jit(values))


__all__ = ["ALIAS_NAMES", "GroupInfo", "STATE_NAMES", "TransformInfo", "injected_states", "inspect_transform"]
