"""Strategies: placement as data, built from small immutable pieces.

A :class:`Piece` contributes one part of a placement: mesh axis sizes, logical
rules, the mesh axes parameters may use, how batch leaves are split, the
memory kind of state leaves, a wrapper around the in-step optimizer update,
or a context that model code reads while it is traced. A :class:`Strategy`
is an ordered tuple of pieces; ``a + b`` concatenates them the way
``optax.chain`` concatenates transforms, and every piece keeps its behaviour.
Two pieces that disagree (two sizes for one axis, two candidate lists for one
logical name, two memory kinds for one leaf) refuse to compose and name both,
so the result never depends silently on operand order.

The trainer asks the composed :class:`Strategy` (never a piece directly) for
the mesh, the rules and the hooks. Strings (``"fsdp+tp"``) resolve through
:data:`STRATEGY_REGISTRY`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxlight.strategies.rules import (
    DEFAULT_RULES,
    MESH_AXES,
    PARAM_FORBIDDEN_AXES,
    MeshAxes,
    Rules,
    normalize_rules,
    override_rules,
)

FILL = -1
"""Axis size meaning "every device the explicit axes leave"."""

DEFAULT_MIN_SHARD = 2**16
"""Parameters with fewer elements stay replicated unless a piece sets ``min_shard``."""
DEFAULT_TOLERANCE = 0.02
"""Largest fraction of shardable parameter elements a layout may leave replicated by default."""

_COMPOSED_DEFAULT = {"tensor": 2, "sequence": 2, "stage": 2, "expert": 2}
"""Size an axis takes when it asked to fill but another piece fills (FSDP + TensorParallel())."""

UpdateFn = Callable[..., Any]
"""The in-step update ``update(state, grads, aux) -> (state, outputs)`` that pieces may wrap."""

STATE_GROUPS = ("opt_state", "callback_state")
"""The groups of :class:`jaxlight.step.TrainState` a piece may give a memory kind (parameters and model
state stay in device memory: the forward pass reads them)."""


class CompositionError(ValueError):
    """Two pieces of a strategy ask for incompatible things."""


@dataclasses.dataclass(frozen=True)
class Piece:
    """One part of a strategy: an immutable value whose hooks default to "nothing".

    Subclasses are frozen dataclasses that override only what they
    contribute. ``name`` is the piece's word in strategy strings and reprs.
    Hooks are pure: they read the piece's fields and their arguments, and are
    called by the trainer at setup and while tracing, never per step.
    """

    name: ClassVar[str] = "piece"

    # -- mesh, rules, guardrail ------------------------------------------------
    def mesh_axes(self) -> Mapping[str, int]:
        """Sizes of the mesh axes this piece sets (:data:`FILL` = the devices left)."""
        return {}

    def rules(self) -> Rules:
        """Logical rules this piece puts in front of the defaults (several entries for a name are fallbacks)."""
        return ()

    def guardrail(self) -> Mapping[str, float]:
        """``min_shard`` / ``tolerance`` values this piece sets explicitly."""
        return {}

    def param_axes(self) -> tuple[str, ...]:
        """Mesh axes this piece allows parameters on, beyond fsdp/tensor/expert (pipeline: ``stage``)."""
        return ()

    # -- batches -----------------------------------------------------------
    def batch_dims(self, path: str, shape: tuple[int, ...]) -> Mapping[int, str]:
        """Non-row dimensions of the batch leaf ``path`` this piece splits, as ``{dim: mesh_axis}``.

        Row (dim 0) placement belongs to the batch axes; the trainer checks
        divisibility of every claimed dim before compiling and names the
        leaf, its shape and the axis size when it fails.
        """
        return {}

    def check_batch(self, shapes: Mapping[str, tuple[int, ...]], mesh_shape: Mapping[str, int]) -> None:
        """Raise a ValueError with the numbers for a global batch this piece cannot run."""

    # -- model and state ----------------------------------------------------
    def check_model(self, params: Mapping[str, Any], variables: Mapping[str, Any], mesh: Mesh) -> None:
        """Raise for a model this piece cannot place (``params``: abstract arrays by path)."""

    def memory_kind(self, group: str, mirrors: str | None) -> str | None:
        """Memory kind for the leaves of TrainState ``group`` (one of :data:`STATE_GROUPS`).

        ``mirrors`` is the parameter path a leaf mirrors (an Adam moment or
        an EMA copy of that parameter), or None for leaves that mirror none
        (step counters, accumulation bookkeeping). None leaves the default
        (device) memory.
        """
        return None

    # -- the compiled step ----------------------------------------------------
    def wrap_update(self, update: UpdateFn, shardings: Any) -> UpdateFn:
        """Wrap the in-step update ``(state, grads, aux) -> (state, outputs)``.

        ``shardings`` is the TrainState of shardings the step's state has
        between steps (with memory kinds). The default returns ``update``.
        """
        return update

    def trace_context(self, mesh: Mesh) -> contextlib.AbstractContextManager | None:
        """A context entered while the steps are traced (model code reads it, e.g. attention)."""
        return None

    def describe(self) -> str:
        """One line for the repr and the model summary."""
        fields = ", ".join(
            f"{f.name.rstrip('_')}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if f.default is dataclasses.MISSING or getattr(self, f.name) != f.default
        )
        return f"{type(self).__name__}({fields})"

    # -- composition -----------------------------------------------------------
    def __add__(self, other: Piece | Strategy) -> Strategy:
        if not isinstance(other, (Piece, Strategy)):
            return NotImplemented
        return Strategy(self, *_pieces_of(other))

    # A lone piece reads like the one-piece strategy it becomes in a trainer.
    def as_strategy(self) -> Strategy:
        """This piece alone, as a :class:`Strategy`."""
        return Strategy(self)

    @property
    def logical_rules(self) -> Rules:
        """The defaults with this piece's rules in front (as :attr:`Strategy.logical_rules`)."""
        return self.as_strategy().logical_rules

    @property
    def min_shard(self) -> int:
        """The guardrail's ``min_shard`` this piece alone gives (its own value or the default)."""
        return self.as_strategy().min_shard

    @property
    def tolerance(self) -> float:
        """The guardrail's ``tolerance`` this piece alone gives (its own value or the default)."""
        return self.as_strategy().tolerance

    def mesh_shape(self, num_devices: int) -> dict[str, int]:
        """As :meth:`Strategy.mesh_shape` for this piece alone."""
        return self.as_strategy().mesh_shape(num_devices)

    def build_mesh(self, devices: Sequence[Any]) -> Mesh:
        """As :meth:`Strategy.build_mesh` for this piece alone."""
        return self.as_strategy().build_mesh(devices)


def _pieces_of(x: Piece | Strategy) -> tuple[Piece, ...]:
    return (x,) if isinstance(x, Piece) else x.pieces


class Strategy:
    """An ordered, immutable collection of :class:`Piece` values.

    ``Strategy(FSDP(), TensorParallel(2))`` equals ``FSDP() + TensorParallel(2)``.
    The keyword form ``Strategy(axes=..., rules=..., min_shard=..., tolerance=...)``
    adds a :class:`Layout` piece, so ``Strategy(rules={"mlp": "tensor"}) + FSDP()``
    works. Composition is checked when the strategy is built:

    - mesh axes: two pieces setting one axis to different sizes raise; when two
      pieces each ask to fill the remaining devices, fsdp fills and the other
      takes its composed default (2);
    - rules: each logical name may be given candidates by one piece, or by
      several that give the same candidates; the composed rules go in front of
      :data:`DEFAULT_RULES` (a name they mention takes only their candidates);
    - guardrail: ``min_shard``/``tolerance`` set by two pieces must agree; a set
      value wins over the defaults;
    - batch dims and memory kinds: two pieces claiming one dim, or giving one
      state leaf two memory kinds, raise naming both.

    Identical pieces appear once. ``repr`` lists the pieces.
    """

    __slots__ = ("_pieces", "_axes", "_rules", "_guard", "_rule_owner")

    def __init__(
        self,
        *pieces: Piece | Strategy,
        axes: Mapping[str, int] | None = None,
        rules: Rules | Mapping[str, MeshAxes] | None = None,
        min_shard: int | None = None,
        tolerance: float | None = None,
        name: str | None = None,
    ) -> None:
        flat: list[Piece] = []
        for p in pieces:
            if not isinstance(p, (Piece, Strategy)):
                raise TypeError(f"Strategy takes pieces (e.g. FSDP(), TensorParallel(2)), got {type(p).__name__}")
            for q in _pieces_of(p):
                if q not in flat:
                    flat.append(q)
        if axes is not None or rules is not None or min_shard is not None or tolerance is not None or name:
            layout = Layout(
                axes=dict(axes or {}),
                rules=rules or (),
                min_shard=min_shard,
                tolerance=tolerance,
                label=name or "layout",
            )
            if layout not in flat:
                flat.append(layout)
        object.__setattr__(self, "_pieces", tuple(flat))
        object.__setattr__(self, "_axes", _merge_axes(flat))
        merged, owner = _merge_rules(flat)
        object.__setattr__(self, "_rules", merged)
        object.__setattr__(self, "_rule_owner", owner)
        object.__setattr__(self, "_guard", _merge_guard(flat))

    def __setattr__(self, key: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"Strategy is immutable; compose a new one with + (set {key!r})")

    def __add__(self, other: Piece | Strategy) -> Strategy:
        if not isinstance(other, (Piece, Strategy)):
            return NotImplemented
        return Strategy(*self._pieces, *_pieces_of(other))

    def __radd__(self, other: Piece | Strategy) -> Strategy:
        if not isinstance(other, (Piece, Strategy)):
            return NotImplemented
        return Strategy(*_pieces_of(other), *self._pieces)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Strategy) and other._pieces == self._pieces

    def __hash__(self) -> int:
        return hash(self._pieces)

    def __repr__(self) -> str:
        return f"Strategy({', '.join(p.describe() for p in self._pieces)})"

    def __str__(self) -> str:
        return self.name

    # -- what the pieces say, composed --------------------------------------------
    @property
    def pieces(self) -> tuple[Piece, ...]:
        """The pieces, in composition order."""
        return self._pieces

    @property
    def name(self) -> str:
        """Piece names joined with ``+`` (``"ddp"`` only when nothing else is there)."""
        names = [p.name for p in self._pieces if p.name != "ddp"]
        return "+".join(dict.fromkeys(names)) or "ddp"

    def find(self, kind: type) -> Any:
        """The piece of type ``kind`` (first one), or None."""
        return next((p for p in self._pieces if isinstance(p, kind)), None)

    @property
    def axes(self) -> Mapping[str, int]:
        """Composed mesh axis sizes (:data:`FILL` for the one axis that takes the rest)."""
        return dict(self._axes)

    @property
    def rules(self) -> Rules:
        """The pieces' rules, composed (without the defaults)."""
        return self._rules

    @property
    def logical_rules(self) -> Rules:
        """The defaults with the composed rules in front."""
        return override_rules(DEFAULT_RULES, self._rules) if self._rules else DEFAULT_RULES

    @property
    def min_shard(self) -> int:
        return int(self._guard.get("min_shard", DEFAULT_MIN_SHARD))

    @property
    def tolerance(self) -> float:
        return float(self._guard.get("tolerance", DEFAULT_TOLERANCE))

    @property
    def param_forbidden_axes(self) -> tuple[str, ...]:
        """Mesh axes parameters may not use: :data:`PARAM_FORBIDDEN_AXES` less what pieces allow."""
        allowed = {a for p in self._pieces for a in p.param_axes()}
        return tuple(a for a in PARAM_FORBIDDEN_AXES if a not in allowed)

    def rule_owner(self, logical_name: str) -> str | None:
        """Name of the piece whose rules decide ``logical_name`` (None: the defaults)."""
        return self._rule_owner.get(logical_name)

    # -- mesh ------------------------------------------------------------------
    def mesh_shape(self, num_devices: int) -> dict[str, int]:
        """Sizes of all six mesh axes for ``num_devices`` devices.

        Raises a ValueError naming the numbers when the explicit sizes do not
        divide the device count.
        """
        explicit = {a: s for a, s in self._axes.items() if s != FILL}
        prod = math.prod(explicit.values()) if explicit else 1
        if num_devices % prod:
            raise ValueError(
                f"strategy {self.name!r} asks for mesh axes {explicit} whose product {prod} does not "
                f"divide the device count {num_devices}"
            )
        fill_axis = next((a for a, s in self._axes.items() if s == FILL), "data")
        shape = dict.fromkeys(MESH_AXES, 1)
        shape.update(explicit)
        if fill_axis in explicit:
            if prod != num_devices:
                raise ValueError(
                    f"strategy {self.name!r} uses {prod} devices ({explicit}) but {num_devices} are requested"
                )
        else:
            shape[fill_axis] = num_devices // prod
        return shape

    def build_mesh(self, devices: Sequence[Any]) -> Mesh:
        """The six-axis mesh over ``devices`` (Auto axes: GSPMD inserts collectives)."""
        shape = self.mesh_shape(len(devices))
        sizes = tuple(shape[a] for a in MESH_AXES)
        try:
            return jax.make_mesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)
        except Exception:  # make_mesh's topology-aware ordering may refuse a subset
            arr = np.asarray(devices, dtype=object).reshape(sizes)
            return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))

    # -- hooks, composed ---------------------------------------------------------
    def batch_dims(self, path: str, shape: tuple[int, ...]) -> dict[int, str]:
        """``{dim: mesh_axis}`` for the non-row dims of a batch leaf the pieces split."""
        out: dict[int, str] = {}
        owner: dict[int, str] = {}
        for p in self._pieces:
            for dim, axis in p.batch_dims(path, shape).items():
                if dim == 0:
                    raise CompositionError(
                        f"piece {p.name!r} claims dim 0 of batch leaf {path}; rows belong to the batch axes"
                    )
                if dim in out and out[dim] != axis:
                    raise CompositionError(
                        f"pieces {owner[dim]!r} and {p.name!r} both split dim {dim} of batch leaf {path} "
                        f"{shape} ({out[dim]!r} vs {axis!r})"
                    )
                out[dim], owner[dim] = axis, p.name
        return out

    def check_batch(self, shapes: Mapping[str, tuple[int, ...]], mesh_shape: Mapping[str, int]) -> None:
        for p in self._pieces:
            p.check_batch(shapes, mesh_shape)

    def check_model(self, params: Mapping[str, Any], variables: Mapping[str, Any], mesh: Mesh) -> None:
        for p in self._pieces:
            p.check_model(params, variables, mesh)

    def memory_kind(self, group: str, mirrors: str | None) -> str | None:
        """The memory kind the pieces give leaves of ``group`` (None: device memory)."""
        if group not in STATE_GROUPS:
            raise ValueError(f"unknown state group {group!r}; groups are {STATE_GROUPS}")
        kind, owner = None, None
        for p in self._pieces:
            k = p.memory_kind(group, mirrors)
            if k is None:
                continue
            if kind is not None and k != kind:
                raise CompositionError(
                    f"pieces {owner!r} and {p.name!r} give {group} leaf {mirrors or '<not a parameter mirror>'} "
                    f"two memory kinds ({kind!r} vs {k!r})"
                )
            kind, owner = k, p.name
        return kind

    def wrap_update(self, update: UpdateFn, shardings: Any) -> UpdateFn:
        """``update`` wrapped by every piece, the first piece outermost."""
        for p in reversed(self._pieces):
            update = p.wrap_update(update, shardings)
        return update

    @contextlib.contextmanager
    def trace_context(self, mesh: Mesh) -> Iterator[None]:
        """Every piece's trace context, entered in piece order."""
        with contextlib.ExitStack() as stack:
            for p in self._pieces:
                ctx = p.trace_context(mesh)
                if ctx is not None:
                    stack.enter_context(ctx)
            yield


# ---------------------------------------------------------------------------- composition rules
def _merge_axes(pieces: Sequence[Piece]) -> dict[str, int]:
    axes: dict[str, int] = {}
    owner: dict[str, str] = {}
    for p in pieces:
        for axis, size in p.mesh_axes().items():
            if axis in axes and axes[axis] != size:
                a = "rest" if axes[axis] == FILL else axes[axis]
                b = "rest" if size == FILL else size
                raise CompositionError(
                    f"cannot compose {owner[axis]!r} and {p.name!r}: both set mesh axis {axis!r} ({a} vs {b})"
                )
            axes[axis], owner[axis] = size, p.name
    if sum(1 for s in axes.values() if s == FILL) > 1:
        # Two pieces each asking for "the rest": fsdp keeps it, the others take their composed default
        # (whatever the operand order), and with no fsdp the data axis takes the rest.
        for axis, size in list(axes.items()):
            if size == FILL and axis != "fsdp":
                axes[axis] = _COMPOSED_DEFAULT.get(axis, 2)
    return axes


def _merge_rules(pieces: Sequence[Piece]) -> tuple[Rules, dict[str, str]]:
    by_name: dict[str, tuple] = {}
    owner: dict[str, str] = {}
    order: list[str] = []
    for p in pieces:
        mine: dict[str, list] = {}
        for n, a in normalize_rules(p.rules()):
            mine.setdefault(n, []).append(a)
        for n, cands in mine.items():
            cands_t = tuple(cands)
            if n in by_name and by_name[n] != cands_t:
                raise CompositionError(
                    f"cannot compose {owner[n]!r} and {p.name!r}: both give rules for logical name {n!r} "
                    f"({_fmt_cands(by_name[n])} vs {_fmt_cands(cands_t)}); give it in one piece"
                )
            if n not in by_name:
                order.append(n)
            by_name[n], owner[n] = cands_t, p.name
    merged = tuple((n, a) for n in order for a in by_name[n])
    return merged, owner


def _fmt_cands(cands: tuple) -> str:
    return " then ".join(repr(c) for c in cands)


def _merge_guard(pieces: Sequence[Piece]) -> dict[str, float]:
    out: dict[str, float] = {}
    owner: dict[str, str] = {}
    for p in pieces:
        for k, v in p.guardrail().items():
            if k in out and out[k] != v:
                raise CompositionError(f"cannot compose {owner[k]!r} and {p.name!r}: {k} {out[k]} vs {v}")
            out[k], owner[k] = v, p.name
    return out


def _guard(min_shard: int | None, tolerance: float | None) -> dict[str, float]:
    if min_shard is not None and (not isinstance(min_shard, int) or min_shard < 0):
        raise ValueError(f"min_shard must be an int >= 0, got {min_shard!r}")
    if tolerance is not None and not 0.0 <= tolerance <= 1.0:
        raise ValueError(f"tolerance must be within [0, 1], got {tolerance}")
    out: dict[str, float] = {}
    if min_shard is not None:
        out["min_shard"] = min_shard
    if tolerance is not None:
        out["tolerance"] = tolerance
    return out


def check_axis_size(kind: str, size: int | None) -> None:
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        raise ValueError(f"{kind} size must be a positive int, got {size!r}")


# ---------------------------------------------------------------------------- built-in pieces
@dataclasses.dataclass(frozen=True)
class Layout(Piece):
    """Mesh sizes, rules and guardrail values given directly (``Strategy(axes=..., rules=...)``).

    ``axes`` maps mesh-axis names to sizes (:data:`FILL` takes the devices
    left; at most one). ``rules`` override entries of the default rules table
    (a mapping's order is its precedence). ``label`` names the piece in
    strategy names.
    """

    axes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    rules_: Rules = ()
    min_shard_: int | None = None
    tolerance_: float | None = None
    label: str = "layout"

    def __init__(
        self,
        axes: Mapping[str, int] | None = None,
        rules: Rules | Mapping[str, MeshAxes] = (),
        min_shard: int | None = None,
        tolerance: float | None = None,
        label: str = "layout",
    ) -> None:
        axes = dict(axes or {})
        for axis, size in axes.items():
            if axis not in MESH_AXES:
                raise ValueError(f"unknown mesh axis {axis!r}; mesh axes are {MESH_AXES}")
            if not (isinstance(size, int) and (size >= 1 or size == FILL)):
                raise ValueError(f"mesh axis {axis!r} size must be a positive int, got {size!r}")
        if sum(1 for s in axes.values() if s == FILL) > 1:
            raise ValueError(f"at most one mesh axis may fill the remaining devices, got {axes}")
        _guard(min_shard, tolerance)
        object.__setattr__(self, "axes", FrozenDict(axes))
        object.__setattr__(self, "rules_", normalize_rules(rules) if rules else ())
        object.__setattr__(self, "min_shard_", min_shard)
        object.__setattr__(self, "tolerance_", tolerance)
        object.__setattr__(self, "label", label)

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.label

    def mesh_axes(self) -> Mapping[str, int]:
        return self.axes

    def rules(self) -> Rules:
        return self.rules_

    def guardrail(self) -> Mapping[str, float]:
        return _guard(self.min_shard_, self.tolerance_)


class FrozenDict(dict):
    """A hashable dict for piece fields (pieces are values: equal fields, equal pieces)."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))


@dataclasses.dataclass(frozen=True)
class DataParallel(Piece):
    """Replicate parameters and optimizer state; split batch rows over every device.

    Gradients are all-reduced by the compiled step. Guarantees the same
    losses and parameters as one device on the same global batches (up to
    floating-point reduction order). ``rules`` override default rules.
    """

    name: ClassVar[str] = "ddp"
    rules_: Rules = ()

    def __init__(self, *, rules: Rules | Mapping[str, MeshAxes] = ()) -> None:
        object.__setattr__(self, "rules_", normalize_rules(rules) if rules else ())

    def rules(self) -> Rules:
        return self.rules_


@dataclasses.dataclass(frozen=True)
class FSDP(Piece):
    """Fully sharded data parallel: parameters, gradients and optimizer state
    are split over the ``fsdp`` axis (by default every device), batch rows too.

    Parameters with fewer than ``min_shard`` elements stay replicated; a
    layout leaving more than ``tolerance`` of the other parameter elements
    replicated is refused with the offending paths. Compiled steps all-gather
    parameters before use and reduce-scatter gradients.
    """

    name: ClassVar[str] = "fsdp"
    min_shard_: int | None = None
    tolerance_: float | None = None
    size: int | None = None
    rules_: Rules = ()

    def __init__(
        self,
        min_shard: int | None = None,
        tolerance: float | None = None,
        *,
        size: int | None = None,
        rules: Rules | Mapping[str, MeshAxes] = (),
    ) -> None:
        check_axis_size("FSDP", size)
        _guard(min_shard, tolerance)
        object.__setattr__(self, "min_shard_", min_shard)
        object.__setattr__(self, "tolerance_", tolerance)
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "rules_", normalize_rules(rules) if rules else ())

    def mesh_axes(self) -> Mapping[str, int]:
        return {"fsdp": FILL if self.size is None else self.size}

    def rules(self) -> Rules:
        return self.rules_

    def guardrail(self) -> Mapping[str, float]:
        return _guard(self.min_shard_, self.tolerance_)


@dataclasses.dataclass(frozen=True)
class TensorParallel(Piece):
    """Megatron-style tensor parallelism over ``size`` devices.

    The widths the rules give the tensor axis (mlp hidden, heads, vocabulary)
    are split; the residual width stays whole, so a column-split projection
    followed by a row-split one needs one all-reduce and no weight gather.
    ``size=None`` takes every device left by the other axes when used alone
    and 2 when composed with an FSDP that fills the rest.
    """

    name: ClassVar[str] = "tp"
    size: int | None = None
    rules_: Rules = ()
    min_shard_: int | None = None
    tolerance_: float | None = None

    def __init__(
        self,
        size: int | None = None,
        *,
        rules: Rules | Mapping[str, MeshAxes] = (),
        min_shard: int | None = None,
        tolerance: float | None = None,
    ) -> None:
        check_axis_size("TensorParallel", size)
        _guard(min_shard, tolerance)
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "rules_", normalize_rules(rules) if rules else ())
        object.__setattr__(self, "min_shard_", min_shard)
        object.__setattr__(self, "tolerance_", tolerance)

    def mesh_axes(self) -> Mapping[str, int]:
        return {"tensor": FILL if self.size is None else self.size}

    def rules(self) -> Rules:
        return self.rules_

    def guardrail(self) -> Mapping[str, float]:
        return _guard(self.min_shard_, self.tolerance_)


# ---------------------------------------------------------------------------- strings
STRATEGY_REGISTRY: dict[str, Callable[[], Piece | Strategy]] = {
    "auto": DataParallel,
    "ddp": DataParallel,
    "dp": DataParallel,
    "fsdp": FSDP,
    "tp": TensorParallel,
}
"""String names accepted by ``Trainer(strategy=...)``; ``+`` joins them. Each maps to a
factory called with no arguments that returns a piece or a strategy."""


def register_strategy(name: str, factory: Callable[[], Piece | Strategy]) -> None:
    """Make ``name`` usable in strategy strings (``"fsdp+" + name``)."""
    if not isinstance(name, str) or not name or "+" in name:
        raise ValueError(f"strategy name must be a non-empty string without '+', got {name!r}")
    STRATEGY_REGISTRY[name.lower()] = factory


def resolve_strategy(strategy: str | Piece | Strategy) -> Strategy:
    """Turn a strategy string (``"fsdp+tp"``), a piece or a strategy into a :class:`Strategy`."""
    if isinstance(strategy, Strategy):
        return strategy
    if isinstance(strategy, Piece):
        return Strategy(strategy)
    if not isinstance(strategy, str):
        raise TypeError(
            f"strategy must be a string, a jaxlight.strategies piece or Strategy, got {type(strategy).__name__}"
        )
    pieces: list[Piece | Strategy] = []
    names = [p.strip().lower() for p in strategy.split("+")]
    for p in names:
        if names.count(p) > 1:  # "ddp+ddp": a repeated piece is a typo, never a bigger layout
            raise ValueError(f"strategy {strategy!r} names {p!r} {names.count(p)} times; name each piece once")
        if p not in STRATEGY_REGISTRY:
            valid = ", ".join(repr(k) for k in STRATEGY_REGISTRY)
            raise ValueError(f"unknown strategy {p!r} in {strategy!r}; valid names: {valid} (joined with '+')")
        made = STRATEGY_REGISTRY[p]()
        if not isinstance(made, (Piece, Strategy)):
            raise TypeError(f"strategy factory for {p!r} returned {type(made).__name__}, not a piece or Strategy")
        twin = next((q for q, m in zip(names, pieces) if isinstance(made, Piece) and type(m) is type(made)), None)
        if twin is not None:  # two names of one piece ("ddp+dp")
            raise ValueError(f"strategy {strategy!r}: {twin!r} and {p!r} are the same piece ({type(made).__name__})")
        pieces.append(made)
    return Strategy(*pieces)
