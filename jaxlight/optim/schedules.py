"""Learning-rate schedulers: Lightning's scheduler config, the injected learning rate, plateau schedulers.

An optax schedule applied through the optimizer's own step count needs no
help. What Lightning steps outside the update needs two pieces here:
:func:`drive_learning_rate` sets an ``optax.inject_hyperparams`` learning
rate from a schedule (at every update, or from the host for
``interval="epoch"``), and :func:`hold_plateaus` keeps
``optax.contrib.reduce_on_plateau`` states still inside the compiled step,
so that only the host moves them, with the monitored metric
(:func:`plateau_stepper`). Everything is found in the optimizer *state*
(public optax state types), never inside the transformations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
import optax.tree_utils as otu
from optax.contrib import ReduceLROnPlateauState

from jaxlight.errors import MisconfigurationError

_INJECTED = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
_INJECTED_NAMES = tuple(c.__name__ for c in _INJECTED)

KeyPath = tuple[Any, ...]
"""A node's place in an optimizer state, as ``optax.tree_utils.tree_get_all_with_path`` spells it."""


def is_plateau_state(node: Any) -> bool:
    """Whether ``node`` is the state of an ``optax.contrib.reduce_on_plateau``."""
    return isinstance(node, ReduceLROnPlateauState)


def is_injected_state(node: Any) -> bool:
    """Whether ``node`` is the state of an ``optax.inject_hyperparams`` transformation."""
    return isinstance(node, _INJECTED)


def states_with_path(state: Any, *names: str) -> dict[KeyPath, Any]:
    """The optax state nodes of ``state`` whose class is named one of ``names``, by path
    (``optax.tree_utils.tree_get_all_with_path``; nested ones too)."""
    return {path: n for name in names for path, n in otu.tree_get_all_with_path(state, name)}


def injected_states(state: Any) -> dict[KeyPath, Any]:
    """Every ``inject_hyperparams`` state in ``state`` (nested ones too), by path."""
    return states_with_path(state, *_INJECTED_NAMES)


def hyperparam_at(node: KeyPath | None = None) -> Callable[[KeyPath, Any], bool]:
    """An ``optax.tree_utils`` filter: a value stored in the ``hyperparams`` of an injected state (the one at
    path ``node``, or any). It leaves out ``hyperparams_states`` (a schedule's own state, same key)."""

    def keep(path: KeyPath, value: Any) -> bool:
        del value
        key = path[-2] if len(path) >= 2 else None
        return (
            isinstance(key, otu.NamedTupleKey)
            and key.tuple_name in _INJECTED_NAMES
            and key.name == "hyperparams"
            and (node is None or path[:-2] == node)
        )

    return keep


def hyperparams_with_path(state: Any, name: str) -> dict[KeyPath, Any]:
    """The stored value of injected hyperparameter ``name`` in each injected state of ``state``, by the path
    of that state (``optax.tree_utils.tree_get_all_with_path``)."""
    return {path[:-2]: v for path, v in otu.tree_get_all_with_path(state, name, hyperparam_at())}


def set_hyperparam(state: Any, node: KeyPath, name: str, value: Any) -> Any:
    """``state`` with hyperparameter ``name`` of the injected state at path ``node`` set to ``value``
    (``optax.tree_utils.tree_set``); the next update uses it."""
    return otu.tree_set(state, hyperparam_at(node), **{name: value})


def set_state(state: Any, path: KeyPath, node: Any) -> Any:
    """``state`` with the optax state node at ``path`` replaced by ``node``, of the same class
    (``optax.tree_utils.tree_set``)."""
    return otu.tree_set(state, lambda p, _: p == path, **{type(node).__name__: node})


def is_scheduled(node: Any, name: str) -> bool:
    """Whether injected hyperparameter ``name`` of ``node`` is a schedule given to ``inject_hyperparams``
    (its next value is computed by optax's update, from a function in optax's closure)."""
    return name in getattr(node, "hyperparams_states", {})


def plateau_states(state: Any) -> list[ReduceLROnPlateauState]:
    """The ``reduce_on_plateau`` states in ``state``, in flattening order."""
    return list(states_with_path(state, ReduceLROnPlateauState.__name__).values())


def outer_injected_states(state: Any) -> dict[KeyPath, Any]:
    """The ``inject_hyperparams`` states of ``state`` that are not inside another one, by path."""
    nodes = injected_states(state)
    return {p: n for p, n in nodes.items() if not any(len(q) < len(p) and p[: len(q)] == q for q in nodes)}


def driven_states(state: Any) -> dict[KeyPath, Any]:
    """The outermost ``inject_hyperparams`` states of ``state`` whose ``learning_rate`` is a number (not a
    schedule of their own), by path: the ones :func:`drive_learning_rate` sets."""
    return {
        p: n
        for p, n in outer_injected_states(state).items()
        if "learning_rate" in n.hyperparams and not is_scheduled(n, "learning_rate")
    }


def is_plateau(obj: Any) -> bool:
    """Whether ``obj`` is an ``optax.contrib.reduce_on_plateau`` transformation (its state says so)."""
    if not isinstance(obj, optax.GradientTransformation):
        return False
    try:
        shape = jax.eval_shape(obj.init, {})
    except Exception:  # a transformation that cannot start without parameters is not a plateau
        return False
    return is_plateau_state(shape)


@dataclasses.dataclass
class SchedulerConfig:
    """One learning-rate scheduler, as Lightning's ``LRSchedulerConfig``.

    ``scheduler`` is an optax schedule (``count -> lr``) or an
    ``optax.contrib.reduce_on_plateau`` transformation. ``interval``: what a
    schedule counts, ``"step"`` (optimizer steps; the default, since optax
    schedules count steps; the schedule is traced inside the compiled update)
    or ``"epoch"`` (the learning rate is ``schedule(epoch // frequency)``,
    evaluated on the host with a Python int, so ``math`` works as in a torch
    ``LambdaLR`` lambda, and set at each epoch start; the optimizer must
    inject its learning rate). A plateau scheduler is stepped with
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
    # set by OptimizerConfig.build: which of the optimizer's plateau states (plateau_states order) it steps
    plateau_nodes: tuple[int, ...] = dataclasses.field(default=(), repr=False)


_SCHEDULER_KEYS = {f.name for f in dataclasses.fields(SchedulerConfig)} - {"optimizer_index", "plateau_nodes"}


def scheduler_config(item: Any, index: int, monitor: str | None) -> SchedulerConfig:
    """Parse one scheduler as returned (a schedule, a plateau, or Lightning's scheduler dict) for optimizer
    ``index``; ``monitor`` is the enclosing dict's top-level one."""
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


# what jax raises when a traced value is used as a Python number (math.cos, float(), if, np.asarray)
_UNTRACEABLE = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.NonConcreteBooleanIndexError,
)


def schedule_name(schedule: Any) -> str:
    """How an error names a schedule: its function name and where it is defined, when it has them."""
    name = getattr(schedule, "__name__", None) or type(schedule).__name__
    code = getattr(schedule, "__code__", None)
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else name


def check_traceable(config: SchedulerConfig) -> None:
    """Trace a step-interval schedule once, abstractly (``jax.eval_shape``), with the step count the compiled
    update gives it (an int32 array). A schedule that needs a Python number there (``math.cos``, ``float()``,
    ``if step < n``) raises :class:`MisconfigurationError` naming it, its interval and the two fixes, before
    anything is compiled, instead of JAX's tracer error from inside the train step."""
    if config.reduce_on_plateau or config.interval != "step":
        return
    schedule, frequency = config.scheduler, config.frequency
    try:
        jax.eval_shape(lambda n: schedule(n // frequency), jax.ShapeDtypeStruct((), jnp.int32))
    except _UNTRACEABLE as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        label = f" {config.name!r}" if config.name else ""
        raise MisconfigurationError(
            f'lr_scheduler{label} {schedule_name(schedule)} of optimizer {config.optimizer_index} with "interval": '
            f'"step" cannot be traced ({type(e).__name__}: {first}). A step-interval schedule runs inside the '
            f"compiled update, where the step count is a traced array, not a Python number: write it with "
            f"jax.numpy (jnp.cos instead of math.cos, jnp.where instead of if), or, for a schedule of the epoch "
            f'(a torch LambdaLR stepped per epoch), return {{"scheduler": ..., "interval": "epoch"}}: epoch '
            f"schedules are evaluated on the host with the epoch as a Python int"
        ) from e


def learning_rate_value(stored: Any, value: Any) -> Any:
    """``value`` as the injected learning rate ``stored`` holds it (its dtype: the update uses it as it is)."""
    return jnp.asarray(value, jnp.asarray(stored).dtype)


def drive_learning_rate(
    tx: optax.GradientTransformation, schedule: Any, *, interval: str = "step", frequency: int = 1
) -> optax.GradientTransformationExtraArgs:
    """``tx`` with every injected ``learning_rate`` set to ``schedule(count // frequency)`` before each update.

    ``count`` is the injected state's own update count, i.e. the optimizer
    steps taken (accumulation windows count once); :func:`driven_learning_rate`
    is that value, the one the next update uses. With ``interval="epoch"``
    the update leaves the injected value alone: the host evaluates
    ``schedule(epoch // frequency)`` with the epoch as a Python int and writes
    the value into the state at each epoch start
    (:class:`~jaxlight.callbacks.lr_scheduler.LRSchedulerStepper`).
    """
    inner = optax.with_extra_args_support(tx)

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        if interval == "step":
            for path, node in driven_states(state).items():
                state = set_hyperparam(state, path, "learning_rate", driven_learning_rate(node, schedule, frequency))
        return inner.update(updates, state, params, **extra)

    return optax.GradientTransformationExtraArgs(inner.init, update)


def driven_learning_rate(node: Any, schedule: Callable[[Any], Any], frequency: int = 1) -> Any:
    """The learning rate a step-interval :func:`drive_learning_rate` gives the injected state ``node`` at its
    next update: the schedule at the node's count, in the stored rate's dtype."""
    return learning_rate_value(node.hyperparams["learning_rate"], schedule(node.count // frequency))


def hold_plateaus(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """``tx`` whose ``reduce_on_plateau`` parts only scale the updates by their current scale.

    The compiled step calls this without a metric: each plateau state goes in
    with a count that keeps its ``accumulation_size`` test false and comes
    out unchanged. Its scale moves only when the host steps it with the
    monitored value (:func:`plateau_stepper`).
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

    return optax.GradientTransformationExtraArgs(inner.init, update)


def shardings_of(state: Any) -> Any:
    """The shardings of ``state``'s arrays (None for shapes): what :func:`to_device_memory` needs."""
    return jax.tree.map(lambda x: getattr(x, "sharding", None), state)


def to_device_memory(state: Any, shardings: Any) -> Any:
    """Inside a jitted function: the leaves of ``state`` that live in host memory (``HostOffload``) copied
    into device memory, so optax's update can combine them with device arrays. Under ``jax.jit`` only the
    copies of leaves the function really reads survive."""
    if shardings is None:
        return state

    def move(x: Any, s: Any) -> Any:
        if getattr(s, "memory_kind", None) in (None, "device"):
            return x
        return jax.device_put(x, s.with_memory_kind("device"))

    return jax.tree.map(move, state, shardings)


def zeros_like_updates(like: Any) -> Any:
    """Zero updates shaped as ``like`` (``jax.ShapeDtypeStruct`` leaves; ``optax.MaskedNode`` kept)."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), like)


def plateau_stepper(
    tx: optax.GradientTransformation, like: Any, positions: Sequence[int], shardings: Any = None
) -> Callable[[Any, Any], list[ReduceLROnPlateauState]]:
    """``(state, value) -> the plateau states at positions, stepped with the monitored value``.

    It runs ``tx``'s own update (zero updates shaped as ``like``, with
    ``value=``) and keeps only the plateau states it asked for, so each
    plateau steps as optax steps it, wherever it sits in ``tx`` and whatever
    its arguments; under ``jax.jit`` everything else is dead code, and the
    compiled function reads only the plateau states' scalars. ``shardings``
    (:func:`shardings_of` the state) lets it read a state kept in host memory.
    """
    inner = optax.with_extra_args_support(tx)
    positions = list(positions)

    def step(state: Any, value: Any) -> list[ReduceLROnPlateauState]:
        state = to_device_memory(state, shardings)
        zeros = zeros_like_updates(like)
        _, new = inner.update(zeros, state, zeros, value=jnp.asarray(value, jnp.float32))
        nodes = plateau_states(new)
        return [nodes[p] for p in positions]

    return step


__all__ = [
    "KeyPath",
    "SchedulerConfig",
    "check_traceable",
    "drive_learning_rate",
    "driven_learning_rate",
    "driven_states",
    "hold_plateaus",
    "hyperparam_at",
    "hyperparams_with_path",
    "injected_states",
    "is_injected_state",
    "is_plateau",
    "is_plateau_state",
    "is_scheduled",
    "learning_rate_value",
    "outer_injected_states",
    "plateau_states",
    "plateau_stepper",
    "schedule_name",
    "scheduler_config",
    "set_hyperparam",
    "set_state",
    "shardings_of",
    "states_with_path",
    "to_device_memory",
    "zeros_like_updates",
]
