"""Logical axis names and the default table that maps them onto mesh axes.

Models name the dimensions of their parameters and activations with logical
names ("embed", "mlp", "heads", ...). A rules table says, in precedence order,
which mesh axes each logical name may take. The same table serves every
topology: an axis of size 1 shards nothing, and a name whose candidate axes do
not divide the dimension falls back to its next candidate or stays whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Union

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor", "sequence", "stage", "expert")
"""Every mesh the trainer builds has these six named axes, in this order."""

BATCH_AXES: tuple[str, ...] = ("data", "fsdp", "expert")
"""Mesh axes that split the rows of a batch. Never tensor: every tensor shard
reads the rows whose widths it computes a part of (Megatron)."""

PARAM_FORBIDDEN_AXES: tuple[str, ...] = ("data", "sequence", "stage")
"""Mesh axes a parameter may not be placed on: data and sequence split the
batch, so a parameter placed there would be gathered on every use; stage holds
pipeline stages, which the pipeline places itself."""

MeshAxes = Union[str, Sequence[str], None]  # noqa: UP007 - a runtime alias (py3.10 cannot | a generic alias with None here)
Rules = tuple[tuple[str, MeshAxes], ...]

DEFAULT_RULES: Rules = (
    # activations
    ("batch", ("data", "fsdp", "expert")),
    ("length", "sequence"),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    # parameters: the Megatron widths take tensor, everything large takes fsdp
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("mlp", "fsdp"),
    ("heads", "tensor"),
    ("heads", "fsdp"),
    ("kv", None),
    ("vocab", "tensor"),
    ("vocab", "fsdp"),
    ("exp", "expert"),
    ("layers", None),
    ("norm", None),
)
"""Default logical-to-mesh rules, in precedence order (several entries for one
name are fallbacks tried in turn)."""


def normalize_rules(rules: Rules | Mapping[str, MeshAxes] | None) -> Rules:
    """Return ``rules`` as a tuple of ``(logical_name, mesh_axes)`` pairs.

    A mapping is accepted for convenience; its insertion order is the
    precedence order. ``None`` gives :data:`DEFAULT_RULES`.
    """
    if rules is None:
        return DEFAULT_RULES
    items = rules.items() if isinstance(rules, Mapping) else rules
    out = []
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError(f"a rule must be a (logical_name, mesh_axes) pair, got {item!r}")
        name, axes = item
        axes_t = _as_tuple(axes)
        for a in axes_t:
            if a not in MESH_AXES:
                raise ValueError(
                    f"rule {name!r} -> {axes!r} names mesh axis {a!r}; mesh axes are {MESH_AXES}. A table "
                    f"written for a mesh of your own (flax's nn.logical_axis_rules with axes like 'model') "
                    f"maps onto these six: e.g. ({name!r}, 'tensor') or ({name!r}, 'fsdp')"
                )
        out.append((name, axes if axes is None or isinstance(axes, str) else tuple(axes)))
    return tuple(out)


def rule_names(rules: Rules) -> frozenset[str]:
    """The logical names a rules table gives candidates for (the names an annotation may use besides the
    mesh axes themselves)."""
    return frozenset(n for n, _ in rules)


def pad_names(names: Sequence[str | None], shape: Sequence[int]) -> tuple[str | None, ...]:
    """``names`` with one entry per dimension of ``shape``.

    flax's rule for partial-rank annotations: fewer names than dimensions
    name the leading dimensions and leave the trailing ones whole (flax's
    ``MultiHeadDotProductAttention`` gives its 3-d kernels 2-name
    annotations). More names than dimensions are an error.
    """
    names = tuple(names)
    if len(names) > len(shape):
        raise ValueError(
            f"logical axes {names} name {len(names)} dims but the array has shape {tuple(shape)} "
            f"({len(shape)} dims); fewer names than dims are fine (the trailing dims stay whole, as flax does), "
            f"more are not"
        )
    return names + (None,) * (len(shape) - len(names))


def override_rules(base: Rules, overrides: Rules | Mapping[str, MeshAxes]) -> Rules:
    """Put ``overrides`` in front of ``base``: a name they mention takes only
    the overriding candidates; other names keep the base table's."""
    over = normalize_rules(overrides)
    names = {n for n, _ in over}
    return over + tuple((n, a) for n, a in base if n not in names)


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    if isinstance(axes, str):
        return (axes,)
    return tuple(axes)


def resolve_spec(
    names: Sequence[str | None],
    shape: Sequence[int],
    rules: Rules,
    mesh_shape: Mapping[str, int],
) -> tuple:
    """Map logical ``names`` of an array of ``shape`` to a PartitionSpec tuple.

    For each dimension the candidates of its name are tried in precedence
    order; a candidate is taken when none of its mesh axes is already used by
    another dimension and the product of their sizes divides the dimension.
    A candidate whose axes are all size 1 on this mesh is skipped (it would
    shard nothing); an explicit ``None`` candidate keeps the dimension whole.
    Size-1 mesh axes are dropped from the result (they shard nothing), so the
    spec is the same for every topology where it matters.

    As in flax, fewer ``names`` than dimensions leave the trailing dimensions
    whole (:func:`pad_names`), and a name no rule mentions that is one of
    the six mesh axes (``"fsdp"``, ``"tensor"``...) stands for that axis; a tuple of mesh axes
    (``("fsdp", "tensor")``, as in ``P(("fsdp", "tensor"))``) splits the dimension over all of them.
    A name that is neither resolves to whole here; the trainer refuses such
    parameter annotations at setup (``placement.check_annotation``).
    """
    names = pad_names(names, shape)
    used: set[str] = set()
    spec: list = []
    for name, dim in zip(names, shape):
        chosen = None
        if name is not None:
            candidates = [axes for rule_name, axes in rules if rule_name == name]
            if not candidates and name in MESH_AXES:
                candidates = [name]  # a mesh axis named directly (flax's nnx.with_partitioning convention)
            elif isinstance(name, tuple) and all(a in MESH_AXES for a in name):
                candidates = [name]  # one dim split over several mesh axes together, as JAX's P(("fsdp", "tensor"))
            for axes in candidates:
                named_axes = _as_tuple(axes)
                cand = tuple(a for a in named_axes if mesh_shape.get(a, 1) > 1)
                if named_axes and not cand:
                    continue  # its axes are size 1 on this mesh: try the next candidate
                if any(a in used for a in cand):
                    continue
                size = 1
                for a in cand:
                    size *= mesh_shape[a]
                if dim % size:
                    continue
                chosen = cand
                break
        if chosen:
            used.update(chosen)
            spec.append(chosen[0] if len(chosen) == 1 else chosen)
        else:
            spec.append(None)
    while spec and spec[-1] is None:
        spec.pop()
    return tuple(spec)
