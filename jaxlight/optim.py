"""From what ``configure_optimizers`` returns to the optax transformations the step applies.

:func:`configure` reads every return form Lightning accepts (an optimizer, a
list of them, ``([optimizers], [schedulers])``, a dict or a list of dicts,
with lr-scheduler dicts carrying ``interval``/``frequency``/``monitor``/
``strict``/``name``), plus jaxlight's parameter selectors (``"params"``) and
:func:`param_groups`. :meth:`OptimizerConfig.build` then resolves the
selectors against the module's parameters and makes the transformations:
one for automatic optimization (parameter groups as an ``optax.partition``,
clipping via ``chain``, accumulation via :func:`accumulate_gradients`), or one
per optimizer for manual optimization. Schedulers that Lightning steps
outside the update (``ReduceLROnPlateau`` fed with a monitored metric, epoch
intervals) keep their state in the optimizer state and are stepped by
:class:`jaxlight.callbacks.lr_scheduler.LRSchedulerStepper` with small
jitted functions; the compiled step never needs a ``value=`` argument.

:func:`inspect_transform` reads an optax transformation and its state (the
optimizer's name as Lightning prints it, each group's learning rate,
momentum and weight decay, where schedules and plateau scales sit) for
``LearningRateMonitor``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from optax.contrib import ReduceLROnPlateauState

from jaxlight.errors import MisconfigurationError

# ----------------------------------------------------------------------------------------- accumulation


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

    update._jaxlight = ("accumulate", inner)  # type: ignore[attr-defined]
    return optax.GradientTransformationExtraArgs(init, update)


# ----------------------------------------------------------------------------------------- parameter selection

FROZEN = "_jaxlight_not_optimized"
"""Partition label of parameters no optimizer (or parameter group) selected: they get a zero update."""


def _describe(selector: Any) -> str:
    if isinstance(selector, str):
        return repr(selector)
    if isinstance(selector, (nnx.Module, nnx.Variable)):
        return f"<{type(selector).__name__} object>"
    return getattr(selector, "__name__", type(selector).__name__)


def _graph_path(module: Any, obj: Any) -> str | None:
    """The "/"-joined path of an NNX module or variable inside ``module``'s NNX attributes."""
    from jaxlight.state import nnx_attributes

    for name, root in nnx_attributes(module).items():
        if root is obj:
            return name
        for path, node in nnx.iter_graph(root):
            if node is obj:
                return "/".join([name, *(str(p) for p in path)])
    return None


def select_params(selector: Any, paths: Sequence[str], module: Any = None, what: str = "params") -> list[str]:
    """The parameter paths ``selector`` picks, in ``paths`` order.

    A selector is ``None`` (every parameter), a path (``"net/l1/kernel"``), a
    path prefix ending at a ``/`` boundary (``"net/encoder"``), a glob
    (``"net/*/bias"``), an NNX module or variable held by ``module``
    (``self.net.encoder``, as torch's ``self.net.encoder.parameters()``), a
    callable ``path -> bool``, or a list of these (their union). A selector
    matching nothing raises, naming the parameter paths' prefixes.
    """
    if selector is None:
        return list(paths)
    if isinstance(selector, (list, tuple, set, frozenset)):
        picked = set()
        for s in selector:
            picked.update(select_params(s, paths, module, what))
        return [p for p in paths if p in picked]
    if isinstance(selector, str):
        if any(c in selector for c in "*?["):
            hit = [p for p in paths if fnmatch.fnmatchcase(p, selector)]
        else:
            prefix = selector.rstrip("/")
            hit = [p for p in paths if p == prefix or p.startswith(prefix + "/")]
    elif isinstance(selector, (nnx.Module, nnx.Variable)):
        found = _graph_path(module, selector) if module is not None else None
        if found is None:
            raise MisconfigurationError(
                f"{what}: the {type(selector).__name__} given is not part of the module's NNX attributes "
                f"(select parameters with an attribute of the module, e.g. self.net.encoder, or a path string)"
            )
        hit = [p for p in paths if p == found or p.startswith(found + "/")]
    elif callable(selector):
        hit = [p for p in paths if selector(p)]
    else:
        raise MisconfigurationError(
            f"{what} must be a path, a prefix, a glob, an NNX module/variable of the module, a callable "
            f"path -> bool or a list of these; got {type(selector).__name__}"
        )
    if not hit:
        tops = sorted({"/".join(p.split("/")[:2]) for p in paths})
        raise MisconfigurationError(
            f"{what} selector {_describe(selector)} matches no parameter; parameter paths start with {tops}"
        )
    return hit


def _labels(groups: Sequence[tuple[str, list[str]]], paths: Sequence[str], what: str) -> dict[str, str]:
    """``{path: group label}``; overlapping groups raise (as torch refuses a parameter in two groups)."""
    owner: dict[str, str] = {}
    for label, keys in groups:
        for k in keys:
            if k in owner:
                raise MisconfigurationError(
                    f"{what}: parameter {k!r} is selected by both {owner[k]!r} and {label!r}; each parameter may "
                    f"belong to one optimizer or parameter group"
                )
            owner[k] = label
    return {p: owner.get(p, FROZEN) for p in paths}


def _partition(
    transforms: Mapping[str, optax.GradientTransformation], labels: Mapping[str, str], explicit: Mapping[str, bool]
) -> optax.GradientTransformationExtraArgs:
    used = set(labels.values())
    transforms = {k: v for k, v in transforms.items() if k in used}
    if FROZEN in used:
        transforms[FROZEN] = optax.set_to_zero()
    tx = optax.partition(transforms, lambda tree: {k: labels[k] for k in tree})
    tx.update._jaxlight_named = dict(explicit)  # type: ignore[attr-defined]  # read by inspect_transform
    return tx


class ParamGroups:
    """torch-style parameter groups: one optimizer family, per-group hyperparameters.

    Built by :func:`param_groups`; return it from ``configure_optimizers``
    (alone, as a dict's ``"optimizer"``, or in a list). Each group's
    transformation is ``optax.inject_hyperparams(factory)`` with its
    ``learning_rate`` injected (so schedulers and ``LearningRateMonitor``
    reach it) and every other argument static; parameters no group selects
    get no update, as parameters left out of a torch optimizer.
    """

    def __init__(
        self, factory: Callable[..., optax.GradientTransformation], groups: Sequence[Mapping[str, Any]], **defaults: Any
    ) -> None:
        if not callable(factory) or isinstance(factory, optax.GradientTransformation):
            raise MisconfigurationError(
                "param_groups(factory, groups, **defaults) takes an optax optimizer *function* (optax.sgd, "
                f"optax.adamw, ...), as torch takes the optimizer class; got {type(factory).__name__}"
            )
        if isinstance(groups, Mapping) or not groups:
            raise MisconfigurationError(
                "param_groups needs a non-empty list of group dicts, e.g. [{'params': self.net.encoder}, "
                "{'params': self.net.head, 'learning_rate': 1e-3}]"
            )
        accepted = inspect.signature(factory).parameters
        self.factory = factory
        self.groups: list[tuple[str, bool, Any, optax.GradientTransformation]] = []
        names = [g.get("name") for g in groups if isinstance(g, Mapping)]
        dup = {n for n in names if n is not None and names.count(n) > 1}
        if dup:
            raise MisconfigurationError(f"param_groups: several groups are named {sorted(dup)}; names must be unique")
        for i, g in enumerate(groups):
            if not isinstance(g, Mapping) or "params" not in g:
                raise MisconfigurationError(
                    f"param_groups: group {i} must be a dict with a 'params' selector, got {g!r}"
                )
            kw = {**_lr_alias(defaults), **_lr_alias({k: v for k, v in g.items() if k not in ("params", "name")})}
            unknown = sorted(set(kw) - set(accepted))
            if unknown:
                raise MisconfigurationError(
                    f"param_groups: {getattr(factory, '__name__', factory)} has no argument(s) {unknown} "
                    f"(group {i}); it takes {sorted(accepted)}"
                )
            if "learning_rate" in kw:
                static = tuple(k for k in kw if k != "learning_rate")
                tx = optax.inject_hyperparams(factory, static_args=static)(**kw)
            else:
                tx = factory(**kw)
            name = g.get("name")
            self.groups.append((str(name) if name is not None else f"pg{i + 1}", name is not None, g["params"], tx))

    def resolve(self, paths: Sequence[str], module: Any) -> optax.GradientTransformationExtraArgs:
        """An ``optax.partition`` over ``paths`` (the parameters the owning optimizer updates)."""
        sel = [(label, select_params(s, paths, module, f"param group {label!r}")) for label, _, s, _ in self.groups]
        labels = _labels(sel, paths, "param_groups")
        return _partition(
            {label: tx for label, _, _, tx in self.groups},
            labels,
            {label: explicit for label, explicit, _, _ in self.groups},
        )

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise MisconfigurationError(
            "param_groups(...) is resolved by the trainer: return it from configure_optimizers (alone, as "
            "{'optimizer': groups, ...} or in a list), not inside optax.chain; clipping is "
            "Trainer(gradient_clip_val=...)"
        )

    init = update = _refuse


def _lr_alias(kw: Mapping[str, Any]) -> dict[str, Any]:
    """torch's ``lr`` spelled as optax's ``learning_rate``."""
    kw = dict(kw)
    if "lr" in kw:
        if "learning_rate" in kw:
            raise MisconfigurationError("param_groups: give 'lr' or 'learning_rate', not both")
        kw["learning_rate"] = kw.pop("lr")
    return kw


def param_groups(
    factory: Callable[..., optax.GradientTransformation], groups: Sequence[Mapping[str, Any]], **defaults: Any
) -> ParamGroups:
    """Parameter groups as torch writes them: ``torch.optim.SGD([{"params": ...}, {"params": ..., "lr": 1e-3}],
    lr=1e-2, momentum=0.9)`` is ``param_groups(optax.sgd, [{"params": self.net.base}, {"params":
    self.net.head, "learning_rate": 1e-3}], learning_rate=1e-2, momentum=0.9)``.

    Each group dict has ``"params"`` (a selector, see :func:`select_params`),
    optionally ``"name"`` (``LearningRateMonitor`` logs ``lr-SGD/<name>``,
    else ``lr-SGD/pg<i>``) and any argument of ``factory`` overriding
    ``defaults`` (``"lr"`` is accepted for ``learning_rate``).
    """
    return ParamGroups(factory, groups, **defaults)


# ----------------------------------------------------------------------------------------- schedulers

_INJECTED = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def is_plateau_state(node: Any) -> bool:
    return isinstance(node, ReduceLROnPlateauState)


def is_injected_state(node: Any) -> bool:
    return isinstance(node, _INJECTED)


def is_plateau(obj: Any) -> bool:
    """Whether ``obj`` is an ``optax.contrib.reduce_on_plateau`` transformation."""
    fn = getattr(obj, "update", None)
    return isinstance(obj, optax.GradientTransformation) and getattr(fn, "__qualname__", "").startswith(
        "reduce_on_plateau."
    )


@dataclasses.dataclass
class SchedulerConfig:
    """One learning-rate scheduler, as Lightning's ``LRSchedulerConfig``.

    ``scheduler`` is an optax schedule (``count -> lr``) or an
    ``optax.contrib.reduce_on_plateau`` transformation. ``interval``: what a
    schedule counts, ``"step"`` (optimizer steps; the default, since optax
    schedules count steps) or ``"epoch"`` (the learning rate is
    ``schedule(epoch // frequency)``, set at each epoch start; the optimizer
    must inject its learning rate). A plateau scheduler is stepped with
    ``trainer.callback_metrics[monitor]`` every ``frequency`` epochs (or
    steps), after validation, as Lightning steps ``ReduceLROnPlateau``; its
    default interval is ``"epoch"``. ``strict``: a missing monitored metric
    raises (else warns and skips). ``optimizer_index``: the optimizer it
    belongs to (position in what ``configure_optimizers`` returned).
    """

    scheduler: Any
    name: str | None = None
    interval: str = "step"
    frequency: int = 1
    reduce_on_plateau: bool = False
    monitor: str | None = None
    strict: bool = True
    optimizer_index: int = 0
    plateau_update: Any = dataclasses.field(default=None, repr=False)  # the plateau's update fn, set by build


_SCHEDULER_KEYS = {f.name for f in dataclasses.fields(SchedulerConfig)} - {"optimizer_index", "plateau_update"}


def _scheduler_config(item: Any, index: int, monitor: str | None) -> SchedulerConfig:
    if isinstance(item, Mapping):
        extra = set(item) - _SCHEDULER_KEYS
        if extra:
            raise MisconfigurationError(
                f"lr scheduler dict has unknown key(s) {sorted(extra)}; supported: {sorted(_SCHEDULER_KEYS)}"
            )
        if "scheduler" not in item:
            raise MisconfigurationError(
                'The lr scheduler dict must have the key "scheduler" with an optax schedule or '
                "optax.contrib.reduce_on_plateau(...) as its value"
            )
        kw = dict(item)
    else:
        kw = {"scheduler": item}
    sched = kw["scheduler"]
    plateau = kw.get("reduce_on_plateau", is_plateau(sched))
    if plateau and not is_plateau(sched):
        raise MisconfigurationError(
            "reduce_on_plateau=True needs an optax.contrib.reduce_on_plateau(...) transformation as the scheduler"
        )
    if not plateau and (not callable(sched) or isinstance(sched, optax.GradientTransformation)):
        raise MisconfigurationError(
            f"lr_scheduler must be an optax schedule (step -> lr, e.g. optax.cosine_decay_schedule(...)) or "
            f"optax.contrib.reduce_on_plateau(...), got {type(sched).__name__}"
        )
    kw.setdefault("interval", "epoch" if plateau else "step")
    if kw["interval"] not in ("step", "epoch"):
        raise MisconfigurationError(
            f'The "interval" key in lr scheduler dict must be "step" or "epoch" but is "{kw["interval"]}"'
        )
    freq = kw.get("frequency", 1)
    if isinstance(freq, bool) or not isinstance(freq, int) or freq < 1:
        raise MisconfigurationError(f'The "frequency" key in lr scheduler dict must be an int >= 1, got {freq!r}')
    if plateau:
        kw["monitor"] = kw.get("monitor") or monitor
        if kw["monitor"] is None:
            raise MisconfigurationError(
                "The lr scheduler dict must include a monitor when reduce_on_plateau is used. For example: "
                '{"optimizer": tx, "lr_scheduler": {"scheduler": optax.contrib.reduce_on_plateau(...), '
                '"monitor": "val_loss"}}'
            )
    kw["reduce_on_plateau"] = plateau
    return SchedulerConfig(**kw, optimizer_index=index)


def drive_learning_rate(
    tx: optax.GradientTransformation, schedule: Any, *, interval: str = "step", frequency: int = 1
) -> optax.GradientTransformationExtraArgs:
    """``tx`` with every injected ``learning_rate`` set to ``schedule(count // frequency)`` before each update.

    ``count`` is the injected state's own update count, i.e. the optimizer
    steps taken (accumulation windows count once). With ``interval="epoch"``
    the update leaves the injected value alone: the host sets it to
    ``schedule(epoch // frequency)`` at each epoch start
    (:class:`~jaxlight.callbacks.lr_scheduler.LRSchedulerStepper`).
    """
    inner = optax.with_extra_args_support(tx)

    def set_lr(state: Any) -> Any:
        def one(node: Any) -> Any:
            if is_injected_state(node) and "learning_rate" in node.hyperparams:
                lr = node.hyperparams["learning_rate"]
                value = jnp.asarray(schedule(node.count // frequency), dtype=jnp.asarray(lr).dtype)
                return node._replace(hyperparams={**node.hyperparams, "learning_rate": value})
            return node

        return jax.tree.map(one, state, is_leaf=is_injected_state)

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        if interval == "step":
            state = set_lr(state)
        return inner.update(updates, state, params, **extra)

    update._jaxlight = ("drive", inner, schedule, interval, frequency)  # type: ignore[attr-defined]
    return optax.GradientTransformationExtraArgs(inner.init, update)


def hold_plateaus(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """``tx`` whose ``reduce_on_plateau`` parts only scale the updates by their current scale.

    The compiled step calls this without a metric: each plateau state goes in
    with a count that keeps its ``accumulation_size`` test false and comes
    out unchanged. Its scale moves only when the host steps it with the
    monitored value (:func:`step_plateau`).
    """
    inner = optax.with_extra_args_support(tx)

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        held = jax.tree.map(
            lambda n: n._replace(count=jnp.full_like(n.count, -1)) if is_plateau_state(n) else n,
            state,
            is_leaf=is_plateau_state,
        )
        extra.setdefault("value", jnp.zeros([], jnp.float32))
        out, new = inner.update(updates, held, params, **extra)
        new = jax.tree.map(lambda n, o: o if is_plateau_state(o) else n, new, state, is_leaf=is_plateau_state)
        return out, new

    update._jaxlight = ("hold", inner)  # type: ignore[attr-defined]
    return optax.GradientTransformationExtraArgs(inner.init, update)


def step_plateau(update_fn: Callable, node: ReduceLROnPlateauState, value: Any) -> ReduceLROnPlateauState:
    """One ``reduce_on_plateau`` step of ``node`` with the monitored ``value`` (what optax does per call)."""
    return update_fn((), node, None, value=jnp.asarray(value, jnp.float32))[1]


# ----------------------------------------------------------------------------------------- inspection

# optax aliases -> the class name torch (and so Lightning's LearningRateMonitor) would print
_ALIAS_NAMES = {
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

# transformations that make an optimizer what it is -> its name (checked in order)
_CORE_NAMES = [
    ("scale_by_lbfgs", "LBFGS"),
    ("scale_by_muon", "Muon"),
    ("scale_by_lion", "Lion"),
    ("scale_by_factored_rms", "Adafactor"),
    ("scale_by_novograd", "Novograd"),
    ("scale_by_yogi", "Yogi"),
    ("scale_by_belief", "AdaBelief"),
    ("scale_by_sm3", "SM3"),
    ("scale_by_adan", "Adan"),
    ("scale_by_radam", "RAdam"),
    ("scale_by_amsgrad", "AMSGrad"),
    ("scale_by_adamax", "Adamax"),
    ("scale_by_adam:nesterov", "NAdam"),
    ("scale_by_adam", "Adam"),
    ("scale_by_rms", "RMSprop"),
    ("scale_by_stddev", "RMSprop"),
    ("scale_by_rss", "Adagrad"),
    ("scale_by_adadelta", "Adadelta"),
    ("scale_by_polyak", "PolyakSGD"),
    ("scale_by_rprop", "Rprop"),
    ("scale_by_sign", "SignSGD"),
]


@dataclasses.dataclass
class GroupInfo:
    """What :func:`inspect_transform` found for one parameter group of an optimizer.

    ``lr()``, ``momentum()`` and ``weight_decay()`` return scalars (device
    arrays, or tracers when inspected inside a trace), or None when the
    transformation has no such quantity. The learning rate is the size of the
    product of every scale in the group's chain (the learning rate or
    schedule, plateau scales), read at the state's current count: the rate
    the *next* update uses.
    """

    label: str | None = None
    explicit: bool = False  # the label is a name the user gave (torch's param_group["name"])
    tokens: list[str] = dataclasses.field(default_factory=list)
    factors: list[Callable[[], Any]] = dataclasses.field(default_factory=list)
    lr_sources: int = 0
    momentum_fn: Callable[[], Any] | None = None
    weight_decay_fn: Callable[[], Any] | None = None
    frozen: bool = False
    alias: str | None = None

    def merged(self, other: GroupInfo) -> GroupInfo:
        return GroupInfo(
            label=other.label if other.label is not None else self.label,
            explicit=other.explicit or self.explicit,
            tokens=self.tokens + other.tokens,
            factors=self.factors + other.factors,
            lr_sources=self.lr_sources + other.lr_sources,
            momentum_fn=other.momentum_fn or self.momentum_fn,
            weight_decay_fn=other.weight_decay_fn or self.weight_decay_fn,
            frozen=self.frozen or other.frozen,
            alias=self.alias or other.alias,
        )

    @property
    def name(self) -> str:
        """The optimizer's name as torch's class would be called ("Adam", "AdamW", "SGD", ...)."""
        if self.alias is not None:
            return _ALIAS_NAMES.get(self.alias, self.alias.title())
        tokens = set(self.tokens)
        core = next((n for t, n in _CORE_NAMES if t in tokens), "SGD")
        if core in ("Adam", "NAdam") and "scale_by_trust_ratio" in tokens:
            return "Lamb"
        if core == "SGD" and "scale_by_trust_ratio" in tokens:
            return "LARS"
        if "add_decayed_weights" in tokens and core in ("Adam", "NAdam", "Adamax", "AMSGrad", "RAdam"):
            return core + "W"
        return core

    def lr(self) -> Any | None:
        if not self.lr_sources:
            return None
        value = jnp.float32(1.0)
        for f in self.factors:
            value = value * jnp.asarray(f(), jnp.float32)
        return jnp.abs(value)

    def momentum(self) -> Any | None:
        return None if self.momentum_fn is None else jnp.asarray(self.momentum_fn(), jnp.float32)

    def weight_decay(self) -> Any | None:
        return None if self.weight_decay_fn is None else jnp.asarray(self.weight_decay_fn(), jnp.float32)


@dataclasses.dataclass
class TransformInfo:
    """The result of :func:`inspect_transform`: groups, plateau states and driven injected learning rates."""

    groups: list[GroupInfo]
    plateaus: list[tuple[Callable, Any]]  # (the plateau's update fn, its state node)
    driven: list[tuple[tuple, Any]]  # (the drive_learning_rate marker, an injected state node it sets)

    @property
    def optimized_groups(self) -> list[GroupInfo]:
        return [g for g in self.groups if not g.frozen]


def _cells(fn: Any) -> dict[str, Any]:
    code = getattr(fn, "__code__", None)
    if code is None or not fn.__closure__:
        return {}
    out = {}
    for name, cell in zip(code.co_freevars, fn.__closure__):
        try:
            out[name] = cell.cell_contents
        except ValueError:  # an empty cell
            pass
    return out


def _combine(a: list[GroupInfo], b: list[GroupInfo]) -> list[GroupInfo]:
    if len(a) == 1:
        return [a[0].merged(g) for g in b]
    if len(b) == 1:
        return [g.merged(b[0]) for g in a]
    return [ga.merged(gb) for ga in a for gb in b]


def _walk(fn: Any, state: Any, info: TransformInfo, drive: tuple | None) -> list[GroupInfo]:
    try:
        return _walk_known(fn, state, info, drive)
    except (AttributeError, KeyError, IndexError, TypeError, ValueError):
        # a transformation whose closure does not look like optax's: it contributes its name only
        qual = getattr(fn, "__qualname__", type(fn).__name__)
        return [GroupInfo(tokens=[qual.split(".<locals>", 1)[0]])]


def _walk_known(fn: Any, state: Any, info: TransformInfo, drive: tuple | None) -> list[GroupInfo]:
    marker = getattr(fn, "_jaxlight", None)
    if marker is not None:
        kind = marker[0]
        if kind == "accumulate":
            return _walk(marker[1].update, state.inner_state, info, drive)
        if kind == "hold":
            return _walk(marker[1].update, state, info, drive)
        if kind == "drive":
            return _walk(marker[1].update, state, info, marker)
    if inspect.ismethod(fn) and hasattr(fn.__self__, "inner_opt") and hasattr(state, "inner_opt_state"):
        return _walk(fn.__self__.inner_opt.update, state.inner_opt_state, info, drive)  # optax.MultiSteps
    qual = getattr(fn, "__qualname__", type(fn).__name__)
    owner = qual.split(".<locals>", 1)[0]
    cells = _cells(fn)
    g = GroupInfo()
    if owner == "chain":
        groups = [g]
        for f, s in zip(cells["update_fns"], state):
            groups = _combine(groups, _walk(f, s, info, drive))
        return groups
    if owner == "named_chain":
        groups = [g]
        for name, t in cells["transforms"]:
            groups = _combine(groups, _walk(t.update, state[name], info, drive))
        return groups
    if owner == "with_extra_args_support":
        return _walk(cells["tx"].update, state, info, drive)
    if owner == "partition":
        named = getattr(fn, "_jaxlight_named", {})
        groups = []
        for label, t in cells["transforms"].items():
            inner = state.inner_states[label]
            inner = getattr(inner, "inner_state", inner)  # each group's transform is masked
            for sub in _walk(t.update, inner, info, drive):
                sub.label = str(label) if sub.label is None else f"{label}/{sub.label}"
                sub.explicit = bool(named.get(label, False)) if named else False
                sub.frozen = sub.frozen or label == FROZEN
                groups.append(sub)
        return groups
    if owner in ("masked", "apply_if_finite") and "inner" in cells and hasattr(state, "inner_state"):
        return _walk(cells["inner"].update, state.inner_state, info, drive)
    if owner == "inject_hyperparams" and is_injected_state(state):
        factory, other, sched = cells["inner_factory"], cells.get("other_hps", {}), cells.get("sched_hps", {})
        hps = dict(state.hyperparams)
        for k, f in sched.items():
            hps[k] = f(state.hyperparams_states[k])
        if drive is not None and "learning_rate" in state.hyperparams and "learning_rate" not in sched:
            info.driven.append((drive, state))
            _, _, schedule, interval, frequency = drive
            if interval == "step":
                hps["learning_rate"] = schedule(state.count // frequency)
        inner = factory(**other, **hps)
        groups = _walk(inner.update, state.inner_state, info, None)
        for sub in groups:
            sub.alias = sub.alias or getattr(factory, "__name__", None)
        return groups
    if owner == "scale_by_schedule":
        sfn = cells["step_size_fn"]
        g.factors.append(lambda: sfn(state.count))
        g.lr_sources = 1
    elif owner == "scale":
        step_size = cells["step_size"]
        g.factors.append(lambda: step_size)
        g.lr_sources = 1
    elif owner == "reduce_on_plateau":
        info.plateaus.append((fn, state))
        g.factors.append(lambda: state.scale)
    elif owner == "set_to_zero":
        g.frozen = True
    elif owner == "scale_by_adam":
        g.tokens.append("scale_by_adam:nesterov" if cells.get("nesterov") else "scale_by_adam")
        b1 = cells.get("b1")
        g.momentum_fn = None if b1 is None else (lambda: b1)
    elif owner == "trace":
        g.tokens.append("trace")
        decay = cells.get("decay")
        g.momentum_fn = None if decay is None else (lambda: decay)
    elif owner == "add_decayed_weights":
        g.tokens.append(owner)
        wd = cells.get("weight_decay")
        g.weight_decay_fn = None if wd is None or callable(wd) else (lambda: wd)
    elif owner != "identity":
        g.tokens.append(owner)
        if "b1" in cells and not callable(cells["b1"]):  # Lion, Adamax, ...: the first moment's decay
            b1 = cells["b1"]
            g.momentum_fn = lambda: b1
        if hasattr(state, "inner_state"):  # an unknown wrapper: look for its inner transformation
            inner = [v for v in cells.values() if isinstance(v, optax.GradientTransformation)]
            if len(inner) == 1:
                return _combine([g], _walk(inner[0].update, state.inner_state, info, drive))
    return [g]


def inspect_transform(tx: optax.GradientTransformation, state: Any) -> TransformInfo:
    """Read ``tx`` (and its ``state``) into groups with names, learning rates, plateau and injected states.

    Understands optax's combinators (``chain``, ``named_chain``,
    ``partition``/``multi_transform``, ``masked``, ``inject_hyperparams``,
    ``MultiSteps``, ``apply_if_finite``) and jaxlight's wrappers; a
    transformation it does not know contributes its factory's name only.
    Reads the closures optax builds, so it never calls ``tx.update``.
    """
    info = TransformInfo([], [], [])
    info.groups = _walk(tx.update, state, info, None)
    return info


def _injected_lr(tx: optax.GradientTransformation, params: Any) -> bool:
    """Whether ``tx``'s state holds an ``inject_hyperparams`` learning rate (a numeric one, which can be set)."""
    found = []

    def visit(params: Any) -> Any:
        state = tx.init(params)
        jax.tree.map(
            lambda n: found.append(n) if is_injected_state(n) and "learning_rate" in n.hyperparams else None,
            state,
            is_leaf=is_injected_state,
        )
        return state

    jax.eval_shape(visit, params)
    return bool(found)


def _structure(tx: optax.GradientTransformation, params: Any) -> TransformInfo:
    """``inspect_transform`` on the state ``tx.init(params)`` would have, without allocating it.

    Only the static parts of the result (names, update functions, counts of
    things) may be used: its values are tracers of a finished trace.
    """
    out: list[TransformInfo] = []

    def visit(params: Any) -> Any:
        state = tx.init(params)
        out.append(inspect_transform(tx, state))
        return state

    jax.eval_shape(visit, params)
    return out[0]


# ----------------------------------------------------------------------------------------- configure


@dataclasses.dataclass
class OptimizerEntry:
    """One optimizer as ``configure_optimizers`` returned it (before its selector is resolved)."""

    tx: Any  # optax.GradientTransformation or ParamGroups
    params: Any = None  # a selector (see select_params); None: every parameter
    monitor: str | None = None  # a dict's top-level "monitor" (Lightning), for a plateau inside tx


@dataclasses.dataclass
class BuiltOptimizer:
    """One optimizer after :meth:`OptimizerConfig.build`: its transformation and the parameters it updates."""

    index: int
    tx: optax.GradientTransformation  # with its schedulers attached; without clipping/accumulation
    keys: tuple[str, ...]  # parameter paths it updates
    state_of: Callable[[Any], Any]  # full TrainState.opt_state -> this optimizer's state


_FORMS = (
    "configure_optimizers must return one of:\n"
    " * an optax.GradientTransformation (or jl.optim.param_groups(...))\n"
    " * [tx, ...]\n"
    " * ([tx, ...], [schedule, ...])\n"
    ' * {"optimizer": tx, "lr_scheduler": schedule | {"scheduler": ..., "interval": ..., "monitor": ...}, '
    '"monitor": ..., "params": selector}\n'
    " * [{...}, {...}] (one dict per optimizer)\n"
    " * None (no optimizer)\n"
    "where a schedule is an optax schedule or optax.contrib.reduce_on_plateau(...)"
)


def _optimizable(x: Any) -> bool:
    return isinstance(x, (optax.GradientTransformation, ParamGroups))


def _entry_dict(d: Mapping[str, Any], index: int, schedulers: list[SchedulerConfig]) -> OptimizerEntry:
    extra = set(d) - {"optimizer", "lr_scheduler", "monitor", "params"}
    if extra:
        raise MisconfigurationError(
            f"configure_optimizers returned a dict with unknown key(s) {sorted(extra)}; supported: "
            f"'optimizer', 'lr_scheduler', 'monitor', 'params'"
        )
    if "optimizer" not in d:
        raise MisconfigurationError(f"configure_optimizers returned a dict without 'optimizer' (keys: {sorted(d)})")
    if not _optimizable(d["optimizer"]):
        raise MisconfigurationError(
            f"the dict's 'optimizer' must be an optax.GradientTransformation or jl.optim.param_groups(...), got "
            f"{type(d['optimizer']).__name__}\n{_FORMS}"
        )
    monitor = d.get("monitor")
    if d.get("lr_scheduler") is not None:
        schedulers.append(_scheduler_config(d["lr_scheduler"], index, monitor))
    return OptimizerEntry(d["optimizer"], d.get("params"), monitor)


def _parse(out: Any) -> tuple[list[OptimizerEntry], list[SchedulerConfig]]:
    schedulers: list[SchedulerConfig] = []
    if out is None:
        warnings.warn("configure_optimizers returned None: this fit runs with no optimizer", stacklevel=3)
        return [], []
    if _optimizable(out):
        return [OptimizerEntry(out)], []
    if isinstance(out, Mapping):
        return [_entry_dict(out, 0, schedulers)], schedulers
    if isinstance(out, (list, tuple)):
        if (
            len(out) == 2
            and isinstance(out[0], (list, tuple))
            and out[0]
            and all(_optimizable(o) for o in out[0])
            and not _optimizable(out[1])
        ):
            opts, scheds = list(out[0]), out[1]
            scheds = list(scheds) if isinstance(scheds, (list, tuple)) else [scheds]
            if len(scheds) > len(opts):
                raise MisconfigurationError(
                    f"configure_optimizers returned {len(opts)} optimizer(s) and {len(scheds)} schedulers; the i-th "
                    f"scheduler belongs to the i-th optimizer, so there can be at most one per optimizer (return "
                    f"dicts to give one optimizer several)"
                )
            schedulers = [_scheduler_config(s, i, None) for i, s in enumerate(scheds)]
            return [OptimizerEntry(o) for o in opts], schedulers
        if out and all(isinstance(d, Mapping) for d in out):
            return [_entry_dict(d, i, schedulers) for i, d in enumerate(out)], schedulers
        if out and all(_optimizable(o) for o in out):
            return [OptimizerEntry(o) for o in out], []
    hint = ""
    if callable(out) and getattr(out, "__module__", "").startswith("optax"):
        hint = f" (the optimizer function itself: call it, e.g. optax.{out.__name__}(learning_rate))"
    elif type(out).__module__.startswith("torch"):
        hint = " (a torch optimizer: use the optax one, e.g. optax.sgd(0.1, momentum=0.9) for torch.optim.SGD)"
    raise MisconfigurationError(
        f"configure_optimizers must return an optax.GradientTransformation or one of Lightning's forms; got "
        f"{type(out).__name__}{hint}.\n{_FORMS}"
    )


@dataclasses.dataclass
class OptimizerConfig:
    """What ``configure_optimizers`` returned, parsed; after :meth:`build`, the transformations to apply.

    Before ``build``: ``entries`` and ``schedulers``. After: ``automatic``;
    ``optimizers`` (one :class:`BuiltOptimizer` per optimizer returned);
    ``tx``, the transformation whose ``init`` makes ``TrainState.opt_state``
    (automatic: the one update the step applies, with parameter partitions,
    clipping and accumulation; manual: a tuple of each optimizer's state, and
    no ``update``).
    """

    entries: list[OptimizerEntry]
    schedulers: list[SchedulerConfig]
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str = "norm"
    accumulate_grad_batches: int = 1
    automatic: bool = True
    optimizers: list[BuiltOptimizer] = dataclasses.field(default_factory=list)
    tx: optax.GradientTransformation | None = None
    handles: list[Any] = dataclasses.field(default_factory=list)  # ManualOptimizer handles (self.optimizers())

    @property
    def schedules(self) -> list[Any]:
        """The schedulers as returned (schedules and plateau transformations), in order."""
        return [c.scheduler for c in self.schedulers]

    @property
    def host_stepped(self) -> bool:
        """Whether some scheduler is stepped on the host (plateau, epoch interval): the trainer then adds
        :class:`~jaxlight.callbacks.lr_scheduler.LRSchedulerStepper`."""
        return any(c.reduce_on_plateau or c.interval == "epoch" for c in self.schedulers) or any(
            e.monitor is not None for e in self.entries
        )

    @property
    def built(self) -> bool:
        return self.tx is not None

    # -- build -----------------------------------------------------------------------------------
    def build(self, module: Any, params: Mapping[str, Any]) -> OptimizerConfig:
        """Resolve the parameter selectors against ``params`` (flat, path-keyed; arrays or shapes) and make
        the transformations; returns a new, built config. Raises :class:`MisconfigurationError` for forms
        the module's optimization mode cannot use, before any work is done."""
        automatic = bool(getattr(module, "automatic_optimization", True))
        paths = list(params)
        schedulers = [dataclasses.replace(c) for c in self.schedulers]
        cfg = dataclasses.replace(self, schedulers=schedulers, automatic=automatic, optimizers=[], handles=[])
        if not automatic:
            if self.gradient_clip_val:
                raise MisconfigurationError(
                    "Automatic gradient clipping is not supported for manual optimization: remove "
                    f"Trainer(gradient_clip_val={self.gradient_clip_val}) and clip in training_step with "
                    f"grads = self.clip_gradients(opt, grads, gradient_clip_val=...), or use automatic optimization"
                )
            if self.accumulate_grad_batches > 1:
                raise MisconfigurationError(
                    "Automatic gradient accumulation is not supported for manual optimization: remove "
                    f"Trainer(accumulate_grad_batches={self.accumulate_grad_batches}), or use automatic optimization"
                )
        n = len(self.entries)
        if automatic and n > 1 and any(e.params is None for e in self.entries):
            raise MisconfigurationError(
                f"configure_optimizers returned {n} optimizers. Training with multiple optimizers is only supported "
                f"with manual optimization: set `self.automatic_optimization = False` and use `opt1, opt2 = "
                f"self.optimizers()` in training_step; or give each optimizer the parameters it updates "
                f'([{{"optimizer": tx1, "params": self.encoder}}, {{"optimizer": tx2, "params": self.head}}]) to '
                f"apply them together in one update"
            )
        txs: list[optax.GradientTransformation] = []
        keys: list[tuple[str, ...]] = []
        for i, entry in enumerate(self.entries):
            sel = select_params(entry.params, paths, module, f"optimizer {i} 'params'")
            base = entry.tx.resolve(sel, module) if isinstance(entry.tx, ParamGroups) else entry.tx
            sub = {k: params[k] for k in sel}
            tx, added = _attach_schedulers(base, [c for c in schedulers if c.optimizer_index == i], entry, i, sub)
            txs.append(tx)
            schedulers.extend(added)
            keys.append(tuple(sel))
        if len({c.optimizer_index for c in schedulers} - set(range(n))):
            raise MisconfigurationError("a scheduler belongs to an optimizer that configure_optimizers did not return")

        if automatic:
            if n == 0:
                base = optax.set_to_zero()
                cfg.optimizers = []
            elif n == 1 and len(keys[0]) == len(paths):
                base = txs[0]
                cfg.optimizers = [BuiltOptimizer(0, txs[0], keys[0], lambda s: s)]
            else:
                labels = _labels([(f"opt{i}", list(k)) for i, k in enumerate(keys)], paths, "configure_optimizers")
                base = _partition({f"opt{i}": t for i, t in enumerate(txs)}, labels, {})
                cfg.optimizers = [
                    BuiltOptimizer(i, t, k, lambda s, i=i: s.inner_states[f"opt{i}"].inner_state)
                    for i, (t, k) in enumerate(zip(txs, keys))
                ]
            tx = hold_plateaus(base) if _has_plateau(base, params) else base
            outer: list[Callable[[Any], Any]] = []
            if self.gradient_clip_val:
                clip = (
                    optax.clip_by_global_norm(self.gradient_clip_val)
                    if self.gradient_clip_algorithm == "norm"
                    else optax.clip(self.gradient_clip_val)
                )
                tx = optax.chain(clip, tx)
                outer.append(lambda s: s[1])
            if self.accumulate_grad_batches > 1:
                tx = accumulate_gradients(tx, self.accumulate_grad_batches)
                outer.append(lambda s: s.inner_state)
            for opt in cfg.optimizers:
                opt.state_of = _compose(list(reversed(outer)), opt.state_of)
            cfg.tx = tx
        else:
            held = [hold_plateaus(t) if _has_plateau(t, {k: params[k] for k in ks}) else t for t, ks in zip(txs, keys)]
            cfg.optimizers = [BuiltOptimizer(i, t, k, lambda s, i=i: s[i]) for i, (t, k) in enumerate(zip(held, keys))]
            cfg.tx = _tuple_of_states(cfg.optimizers)
            from jaxlight.manual import ManualOptimizer  # the handles self.optimizers() returns

            cfg.handles = [ManualOptimizer(o.index, o.tx, o.keys) for o in cfg.optimizers]
        return cfg

    # -- reading (LearningRateMonitor, the scheduler stepper) -----------------------------------
    def inspect(self, opt_state: Any) -> list[TransformInfo]:
        """:func:`inspect_transform` of each optimizer on its part of ``opt_state``."""
        return [self.inspect_one(o, opt_state) for o in self.optimizers]

    def inspect_one(self, optimizer: BuiltOptimizer, opt_state: Any) -> TransformInfo:
        """:func:`inspect_transform` of one optimizer on its part of ``opt_state`` (the whole TrainState's)."""
        return inspect_transform(optimizer.tx, optimizer.state_of(opt_state))


def _compose(getters: list[Callable[[Any], Any]], last: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def get(state: Any) -> Any:
        for g in getters:
            state = g(state)
        return last(state)

    return get


def _tuple_of_states(optimizers: list[BuiltOptimizer]) -> optax.GradientTransformation:
    """Manual optimization's ``TrainState.opt_state``: a tuple with each optimizer's state on its parameters."""

    def init(params: Mapping[str, Any]) -> tuple:
        return tuple(o.tx.init({k: params[k] for k in o.keys}) for o in optimizers)

    def update(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("manual optimization: each optimizer is stepped in training_step with opt.step(grads)")

    return optax.GradientTransformation(init, update)


def _has_plateau(tx: optax.GradientTransformation, params: Mapping[str, Any]) -> bool:
    return bool(_structure(tx, dict(params)).plateaus)


def _attach_schedulers(
    tx: optax.GradientTransformation,
    configs: list[SchedulerConfig],
    entry: OptimizerEntry,
    index: int,
    params: Mapping[str, Any],
) -> tuple[optax.GradientTransformation, list[SchedulerConfig]]:
    """``tx`` with its schedulers applied: a plateau chained after it (unless already inside), a schedule
    driving an injected learning rate. Each plateau config learns its update function; a plateau found
    inside ``tx`` that no scheduler names gets a config from the dict's top-level ``monitor`` (returned)."""
    params = dict(params)
    inside = {id(fn): fn for fn, _ in _structure(tx, params).plateaus}
    for c in configs:
        if not c.reduce_on_plateau:
            continue
        fn = c.scheduler.update
        if id(fn) not in inside:
            tx = optax.chain(tx, c.scheduler)
        c.plateau_update = fn
    claimed = {id(c.plateau_update) for c in configs if c.reduce_on_plateau}
    unclaimed = [fn for i, fn in inside.items() if i not in claimed]
    if unclaimed:
        if entry.monitor is None:
            raise MisconfigurationError(
                "the optimizer contains optax.contrib.reduce_on_plateau, which needs a monitored metric: return "
                '{"optimizer": tx, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}} (the plateau may '
                'stay inside tx) or {"optimizer": tx, "monitor": "val_loss"}'
            )
        added = [
            SchedulerConfig(
                scheduler=fn,
                interval="epoch",
                reduce_on_plateau=True,
                monitor=entry.monitor,
                optimizer_index=index,
                plateau_update=fn,
            )
            for fn in unclaimed
        ]
    else:
        added = []
    schedules = [c for c in configs if not c.reduce_on_plateau]
    if len(schedules) > 1:
        raise MisconfigurationError(
            f"optimizer {schedules[0].optimizer_index} has {len(schedules)} lr schedules; combine them into one "
            f"optax schedule (optax.join_schedules) "
        )
    if schedules:
        c = schedules[0]
        if _injected_lr(tx, params):
            tx = drive_learning_rate(tx, c.scheduler, interval=c.interval, frequency=c.frequency)
        elif c.interval != "step" or c.frequency != 1:
            raise MisconfigurationError(
                f"lr_scheduler with interval={c.interval!r}, frequency={c.frequency} must set the optimizer's "
                f"learning rate, so the optimizer must inject it: optax.inject_hyperparams(optax.adamw)"
                f"(learning_rate=...) (a schedule baked into the optimizer counts optimizer steps)"
            )
    return tx, added


def configure(
    out: Any,
    *,
    gradient_clip_val: float | None = None,
    gradient_clip_algorithm: str = "norm",
    accumulate_grad_batches: int = 1,
) -> OptimizerConfig:
    """Parse ``configure_optimizers``' return value (every form Lightning accepts, for optax).

    Forms: a transformation (or :func:`param_groups`); a list of them;
    ``([tx, ...], [scheduler, ...])`` (the i-th scheduler belongs to the i-th
    optimizer); ``{"optimizer": tx, "lr_scheduler": ..., "monitor": ...,
    "params": selector}``; a list of such dicts; ``None``. A scheduler is an
    optax schedule, ``optax.contrib.reduce_on_plateau(...)`` or Lightning's
    scheduler dict (see :class:`SchedulerConfig`). As in Lightning, a
    schedule sets the optimizer's learning rate: when ``tx`` was built with
    ``optax.inject_hyperparams`` every update uses ``schedule(optimizer
    step)``; otherwise ``tx`` must already use the schedule as its learning
    rate and the entry names it for ``LearningRateMonitor``. Anything else
    raises :class:`MisconfigurationError` saying what came back and listing
    the forms. Call :meth:`OptimizerConfig.build` to get the transformations.
    """
    entries, schedulers = _parse(out)
    return OptimizerConfig(
        entries,
        schedulers,
        gradient_clip_val=gradient_clip_val,
        gradient_clip_algorithm=gradient_clip_algorithm,
        accumulate_grad_batches=accumulate_grad_batches,
    )


__all__ = [
    "AccumulationState",
    "BuiltOptimizer",
    "GroupInfo",
    "OptimizerConfig",
    "ParamGroups",
    "SchedulerConfig",
    "TransformInfo",
    "accumulate_gradients",
    "configure",
    "drive_learning_rate",
    "hold_plateaus",
    "inspect_transform",
    "is_plateau",
    "param_groups",
    "select_params",
    "step_plateau",
]
