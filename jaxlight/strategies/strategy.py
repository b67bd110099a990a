"""Strategies: placement as data.

A strategy says how many devices each mesh axis takes and which logical rules
apply; the trainer builds one mesh from it and compiles one SPMD step. Pieces
compose with ``+`` (``FSDP() + TensorParallel(2)``); the data axis takes
whatever devices the other axes leave.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxlight.strategies.rules import DEFAULT_RULES, MESH_AXES, MeshAxes, Rules, normalize_rules, override_rules

FILL = -1
"""Axis size meaning "every device the explicit axes leave"."""


@dataclasses.dataclass(frozen=True)
class Strategy:
    """How a run is placed on a device mesh.

    ``axes`` maps mesh-axis names to sizes; an axis absent is 1 and at most one
    axis may be :data:`FILL` (take the devices the others leave; by default the
    data axis fills). ``rules`` overrides entries of the default logical-rules
    table. ``min_shard`` and ``tolerance`` drive the replication guardrail:
    parameters below ``min_shard`` elements stay replicated on purpose, and a
    layout that leaves more than ``tolerance`` of the remaining elements
    replicated is refused. Strategies are immutable values; ``a + b`` merges
    their axes and refuses to merge two different sizes for one axis.
    """

    axes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    rules: Rules = ()
    min_shard: int = 2**16
    tolerance: float = 0.02
    name: str = "ddp"
    # Extension slots for later strategies (pipeline microbatches, host offload).
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # Which of min_shard / tolerance the user set; ``+`` keeps a set value over a default.
    explicit: frozenset = frozenset()

    def __post_init__(self) -> None:
        for axis, size in self.axes.items():
            if axis not in MESH_AXES:
                raise ValueError(f"unknown mesh axis {axis!r}; mesh axes are {MESH_AXES}")
            if not (isinstance(size, int) and (size >= 1 or size == FILL)):
                raise ValueError(f"mesh axis {axis!r} size must be a positive int, got {size!r}")
        if sum(1 for s in self.axes.values() if s == FILL) > 1:
            raise ValueError(f"at most one mesh axis may fill the remaining devices, got {dict(self.axes)}")
        if self.min_shard < 0:
            raise ValueError(f"min_shard must be >= 0, got {self.min_shard}")
        if not 0.0 <= self.tolerance <= 1.0:
            raise ValueError(f"tolerance must be within [0, 1], got {self.tolerance}")
        normalize_rules(self.rules)

    # -- algebra -----------------------------------------------------------
    def __add__(self, other: Strategy) -> Strategy:
        if not isinstance(other, Strategy):
            return NotImplemented
        axes = dict(self.axes)
        for axis, size in other.axes.items():
            if axis in axes and axes[axis] != size:
                raise ValueError(
                    f"cannot compose {self.name!r} and {other.name!r}: both set mesh axis "
                    f"{axis!r} ({axes[axis]} vs {size})"
                )
            axes[axis] = size
        if sum(1 for s in axes.values() if s == FILL) > 1:
            # Two pieces each wanting "the rest" (e.g. FSDP + TensorParallel()):
            # the non-fsdp one falls back to its composed default.
            for axis, size in list(axes.items()):
                if size == FILL and axis != "fsdp":
                    axes[axis] = _COMPOSED_DEFAULT.get(axis, 2)
        for key in set(self.options) & set(other.options):
            if self.options[key] != other.options[key]:
                raise ValueError(
                    f"cannot compose {self.name!r} and {other.name!r}: option {key!r} is "
                    f"{self.options[key]!r} vs {other.options[key]!r}"
                )
        opts = {**self.options, **other.options}
        guard = {}
        for field in ("min_shard", "tolerance"):
            a, b = getattr(self, field), getattr(other, field)
            if field in self.explicit and field in other.explicit and a != b:
                raise ValueError(f"cannot compose {self.name!r} and {other.name!r}: {field} {a} vs {b}")
            guard[field] = b if field in other.explicit and field not in self.explicit else a
        return Strategy(
            axes=axes,
            rules=tuple(self.rules) + tuple(other.rules),
            name=_join_names(self.name, other.name),
            options=opts,
            explicit=self.explicit | other.explicit,
            **guard,
        )

    # -- derived -------------------------------------------------------------
    @property
    def logical_rules(self) -> Rules:
        """The defaults with this strategy's overrides in front."""
        return override_rules(DEFAULT_RULES, self.rules) if self.rules else DEFAULT_RULES

    def mesh_shape(self, num_devices: int) -> dict[str, int]:
        """Sizes of all six mesh axes for ``num_devices`` devices.

        Raises a ValueError naming the numbers when the explicit sizes do not
        divide the device count.
        """
        explicit = {a: s for a, s in self.axes.items() if s != FILL}
        prod = math.prod(explicit.values()) if explicit else 1
        if num_devices % prod:
            raise ValueError(
                f"strategy {self.name!r} asks for mesh axes {explicit} whose product {prod} does not "
                f"divide the device count {num_devices}"
            )
        fill_axis = next((a for a, s in self.axes.items() if s == FILL), "data")
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

    def __repr__(self) -> str:
        axes = ", ".join(f"{a}={'rest' if s == FILL else s}" for a, s in self.axes.items())
        return f"Strategy({self.name!r}{', ' + axes if axes else ''})"


_COMPOSED_DEFAULT = {"tensor": 2, "sequence": 2, "stage": 2, "expert": 2}


def _join_names(a: str, b: str) -> str:
    parts = [p for p in (a.split("+") + b.split("+")) if p and p != "ddp"]
    return "+".join(dict.fromkeys(parts)) or "ddp"


class DataParallel(Strategy):
    """Replicate parameters and optimizer state; split batch rows over every device.

    Gradients are all-reduced by the compiled step. Guarantees the same
    losses and parameters as one device on the same global batches (up to
    floating-point reduction order).
    """

    def __init__(self, *, rules: Rules | Mapping[str, MeshAxes] = ()) -> None:
        super().__init__(axes={}, rules=normalize_rules(rules) if rules else (), name="ddp")


class FSDP(Strategy):
    """Fully sharded data parallel: parameters, gradients and optimizer state
    are split over the ``fsdp`` axis (by default every device), batch rows too.

    Parameters with fewer than ``min_shard`` elements stay replicated; a
    layout leaving more than ``tolerance`` of the other parameter elements
    replicated is refused with the offending paths. Compiled steps all-gather
    parameters before use and reduce-scatter gradients.
    """

    def __init__(
        self,
        min_shard: int | None = None,
        tolerance: float | None = None,
        *,
        size: int | None = None,
        rules: Rules | Mapping[str, MeshAxes] = (),
    ) -> None:
        if size is not None and (not isinstance(size, int) or size < 1):
            raise ValueError(f"FSDP size must be a positive int, got {size!r}")
        super().__init__(
            axes={"fsdp": FILL if size is None else size},
            rules=normalize_rules(rules) if rules else (),
            name="fsdp",
            **_guard(min_shard, tolerance),
        )


class TensorParallel(Strategy):
    """Megatron-style tensor parallelism over ``size`` devices.

    The widths the rules give the tensor axis (mlp hidden, heads, vocabulary)
    are split; the residual width stays whole, so a column-split projection
    followed by a row-split one needs one all-reduce and no weight gather.
    ``size=None`` takes every device left by the other axes when used alone
    and 2 when composed with an FSDP that fills the rest.
    """

    def __init__(
        self,
        size: int | None = None,
        *,
        rules: Rules | Mapping[str, MeshAxes] = (),
        min_shard: int | None = None,
        tolerance: float | None = None,
    ) -> None:
        if size is not None and (not isinstance(size, int) or size < 1):
            raise ValueError(f"TensorParallel size must be a positive int, got {size!r}")
        super().__init__(
            axes={"tensor": FILL if size is None else size},
            rules=normalize_rules(rules) if rules else (),
            name="tp",
            **_guard(min_shard, tolerance),
        )


def _guard(min_shard: int | None, tolerance: float | None) -> dict[str, Any]:
    """Strategy kwargs for the guardrail, remembering which ones the user set."""
    out: dict[str, Any] = {
        "explicit": frozenset(k for k, v in (("min_shard", min_shard), ("tolerance", tolerance)) if v is not None)
    }
    if min_shard is not None:
        out["min_shard"] = min_shard
    if tolerance is not None:
        out["tolerance"] = tolerance
    return out


STRATEGY_REGISTRY: dict[str, Any] = {
    "auto": DataParallel,
    "ddp": DataParallel,
    "dp": DataParallel,
    "fsdp": FSDP,
    "tp": TensorParallel,
}
"""String names accepted by ``Trainer(strategy=...)``; ``+`` joins them."""


def register_strategy(name: str, factory: Any) -> None:
    """Make ``name`` usable in strategy strings (``"fsdp+" + name``)."""
    STRATEGY_REGISTRY[name] = factory


def resolve_strategy(strategy: str | Strategy) -> Strategy:
    """Turn a strategy string (``"fsdp+tp"``) or object into a :class:`Strategy`."""
    if isinstance(strategy, Strategy):
        return strategy
    if not isinstance(strategy, str):
        raise TypeError(f"strategy must be a string or a jaxlight.strategies.Strategy, got {type(strategy).__name__}")
    parts = [p.strip().lower() for p in strategy.split("+")]
    out: Strategy | None = None
    for p in parts:
        if p not in STRATEGY_REGISTRY:
            valid = ", ".join(repr(k) for k in STRATEGY_REGISTRY)
            raise ValueError(f"unknown strategy {p!r} in {strategy!r}; valid names: {valid} (joined with '+')")
        piece = STRATEGY_REGISTRY[p]()
        out = piece if out is None else out + piece
    assert out is not None
    return out
