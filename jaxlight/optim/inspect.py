"""Reading an optimizer's parameter groups, name and current hyperparameters out of its optax *state*.

optax transformations are closures: their fixed hyperparameters (a float
learning rate, ``b1``, a schedule function) are not reachable through any
public optax API, so jaxlight does not look for them there. What it reads:

* the state's types (public optax state classes): ``PartitionState`` splits
  an optimizer into parameter groups (``optax.partition``/``multi_transform``,
  :func:`~jaxlight.optim.param_groups`, several optimizers with ``"params"``);
  ``ScaleByAdamState``, ``TraceState``, ... name the optimizer as torch would;
* ``optax.inject_hyperparams`` states: their ``hyperparams`` hold the
  learning rate, momentum (``b1``) and weight decay, read with
  ``optax.tree_utils.tree_get_all_with_path``. The value reported is the
  one the *next* update uses: a number is that value as stored; a rate a
  step-interval ``lr_scheduler`` drives (:func:`drive_learning_rate`) is
  that schedule at the injected count, evaluated directly. Only a schedule
  the user gave ``inject_hyperparams`` itself lives in optax's closure,
  where no public API reaches it: for that case alone the optimizer's own
  update, under ``jax.jit`` on zero gradients, computes it (everything but
  the scalars is dead code);
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
import optax.tree_utils as otu

from jaxlight.optim.params import FROZEN, KnownGroup
from jaxlight.optim.schedules import (
    KeyPath,
    driven_learning_rate,
    driven_states,
    hold_plateaus,
    hyperparams_with_path,
    injected_states,
    is_injected_state,
    shardings_of,
    states_with_path,
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


def _fields_with_path(state: Any, cls: type, field: str) -> dict[KeyPath, Any]:
    """``field`` of every ``cls`` state in ``state``, by the path of that state (optax.tree_utils)."""
    keep = lambda path, _: isinstance(path[-1], otu.NamedTupleKey) and path[-1].tuple_name == cls.__name__
    return {path[:-1]: v for path, v in otu.tree_get_all_with_path(state, field, keep)}


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
    # where its values come from: paths of its injected / plateau states and of the ScaleByScheduleState
    # a named schedule is read at
    injected: list[KeyPath] = dataclasses.field(default_factory=list, repr=False)
    plateaus: list[KeyPath] = dataclasses.field(default_factory=list, repr=False)
    schedule: KeyPath | None = dataclasses.field(default=None, repr=False)
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


def _first(
    injected: list[tuple[KeyPath, frozenset[str]]], known: Mapping[str, float], keys: tuple[str, ...]
) -> tuple[KeyPath | None, Any]:
    """Where the first of ``keys`` is, trying each key in the injected states (``(path, hyperparameter
    names)``, outer first) and then in what jaxlight knows: ``(path, key)``, or ``(None, value)`` for a
    known value; ``(None, None)``: nowhere."""
    for key in keys:
        for path, names in injected:
            if key in names:
                return path, key
        if key in known:
            return None, known[key]
    return None, None


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


_MOMENTUM, _DECAY = ("momentum", "b1"), ("weight_decay",)


def inspect_transform(
    tx: optax.GradientTransformation,
    state: Any,
    like: Any,
    *,
    known: Mapping[str, KnownGroup] | None = None,
    schedule: Callable[[Any], Any] | None = None,
    frequency: int = 1,
) -> TransformInfo:
    """Read the optimizer ``tx`` from its ``state`` (arrays, or shapes): groups, names, and where each group's
    hyperparameters are. ``like``: its updates' shapes (``jax.ShapeDtypeStruct``, ``optax.MaskedNode``
    where masked); ``known``: facts of the groups jaxlight built, by partition label; ``schedule``: the
    step-interval schedule the user named for it, with its ``frequency`` (it drives an injected learning
    rate; else it is read at the ``ScaleByScheduleState`` count)."""
    known = dict(known or {})
    nodes = injected_states(state)
    # only names (no arrays) are kept for the reader: it must not hold on to this state's buffers
    names = {p: frozenset(n.hyperparams) for p, n in nodes.items()}
    scheduled = {p: frozenset(getattr(n, "hyperparams_states", {})) for p, n in nodes.items()}
    found = (
        nodes,
        states_with_path(state, optax.contrib.ReduceLROnPlateauState.__name__),
        states_with_path(state, optax.ScaleByScheduleState.__name__),
    )
    where = {id(n): p for d in found for p, n in d.items()}
    driven = set(driven_states(state)) if schedule is not None else set()
    infos, uses = [], []  # uses: per group, the (injected path, key) its values come from
    for g in _groups(state):
        fact = known.get(g.top) if g.top is not None else None
        inj = [(where[id(n)], names[where[id(n)]]) for n in g.nodes if is_injected_state(n)]
        statics = dict(fact.hparams) if fact is not None else {}
        scheds = [where[id(n)] for n in g.nodes if isinstance(n, optax.ScaleByScheduleState)]
        injected_lr = any("learning_rate" in h for _, h in inj)
        named = schedule is not None and not injected_lr and len(scheds) == 1
        sees_all = bool(inj) or fact is not None  # every numeric hyperparameter is in view: absent means none
        missing = []
        if not (injected_lr or named or "learning_rate" in statics):
            missing.append("learning rate")
        if not sees_all and _first(inj, statics, _MOMENTUM) == (None, None):
            missing.append("momentum")
        if not sees_all and _first(inj, statics, _DECAY) == (None, None):
            missing.append("weight decay")
        infos.append(
            GroupInfo(
                label=g.label,
                explicit=fact.named if fact is not None else False,
                frozen=g.frozen,
                name=_name(g.nodes, fact),
                missing=missing,
                injected=[p for p, _ in inj],
                plateaus=[where[id(n)] for n in g.nodes if isinstance(n, optax.contrib.ReduceLROnPlateauState)],
                schedule=scheds[0] if named else None,
                known=statics,
                injected_lr=injected_lr,
            )
        )
        used = [(p, "learning_rate") for p, h in inj if "learning_rate" in h]
        used += [at for at in (_first(inj, statics, _MOMENTUM), _first(inj, statics, _DECAY)) if at[0] is not None]
        uses.append(used)
    optimized = [(g, u) for g, u in zip(infos, uses) if not g.frozen]
    # a schedule given to inject_hyperparams itself: its next value exists only inside optax's update
    in_closure = any(key in scheduled[p] for _, used in optimized for p, key in used)
    held = hold_plateaus(tx) if in_closure else None
    shardings = shardings_of(state)  # HostOffload: read host-resident scalars through device copies

    def values(state: Any) -> list[dict[str, Any]]:
        state = to_device_memory(state, shardings)
        now = injected_states(state)
        nxt = {}
        if held is not None:
            zeros = zeros_like_updates(like)
            nxt = injected_states(held.update(zeros, state, zeros)[1])
        stored = {key: hyperparams_with_path(state, key) for key in ("learning_rate", *_MOMENTUM, *_DECAY)}

        def value(path: KeyPath, key: str) -> Any:
            """Injected ``key`` of the state at ``path`` as the next update uses it."""
            if key in scheduled[path]:
                return nxt[path].hyperparams[key]
            if key == "learning_rate" and path in driven:
                return driven_learning_rate(now[path], schedule, frequency)  # type: ignore[arg-type]
            return stored[key][path]

        plats = _fields_with_path(state, optax.contrib.ReduceLROnPlateauState, "scale")
        counts = _fields_with_path(state, optax.ScaleByScheduleState, "count")
        out = []
        for g, _ in optimized:
            got: dict[str, Any] = {}
            if g.readable:
                if g.injected_lr:
                    factors = [value(p, "learning_rate") for p in g.injected if "learning_rate" in names[p]]
                elif g.schedule is not None:
                    factors = [schedule(counts[g.schedule])]  # type: ignore[misc]
                else:
                    factors = [g.known["learning_rate"]]
                factors += [plats[p] for p in g.plateaus]
                lr = jnp.float32(1.0)
                for f in factors:
                    lr = lr * jnp.asarray(f, jnp.float32)
                got["lr"] = lr
            inj = [(p, names[p]) for p in g.injected]
            for key, keys in (("momentum", _MOMENTUM), ("weight_decay", _DECAY)):
                path, at = _first(inj, g.known, keys)
                v = value(path, at) if path is not None else at
                if v is not None or key.replace("_", " ") not in g.missing:
                    got[key] = jnp.asarray(0.0 if v is None else v, jnp.float32)
            out.append(got)
        return out

    return TransformInfo(infos, jax.jit(values))


__all__ = ["ALIAS_NAMES", "GroupInfo", "STATE_NAMES", "TransformInfo", "inspect_transform"]
