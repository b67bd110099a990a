"""Pin activations to logical axes: the rules context the trainer enters while tracing, and ``constrain``."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlight.strategies.rules import Rules, resolve_spec

_ctx = threading.local()


@contextlib.contextmanager
def axis_rules(mesh: Mesh, rules: Rules) -> Iterator[None]:
    """Make ``mesh`` and ``rules`` the ones :func:`constrain` resolves against
    (the trainer enters this while tracing its steps)."""
    prev = getattr(_ctx, "value", None)
    _ctx.value = (mesh, rules)
    try:
        yield
    finally:
        _ctx.value = prev


def active_axis_rules() -> tuple[Mesh, Rules] | None:
    """The ``(mesh, rules)`` a trainer step is traced under (see :func:`axis_rules`), or None outside one."""
    return getattr(_ctx, "value", None)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Pin activation ``x`` to the mesh axes its logical ``names`` map to.

    Inside a trainer step this is ``jax.lax.with_sharding_constraint`` with
    the rules of the run's strategy (e.g. ``("batch", "length", "embed")``);
    outside one, or on a single device, it returns ``x`` unchanged, so model
    code runs the same everywhere. Inside a ``shard_map`` that makes some mesh
    axes manual (a pipeline stage, a sequence-parallel attention block), the
    constraint is built on that context's mesh and leaves the manual axes
    out: ``x`` is already the local block along them.
    """
    active = getattr(_ctx, "value", None)
    if active is None:
        return x
    mesh, rules = active
    if mesh.size == 1:
        return x
    spec = resolve_spec(tuple(names), tuple(x.shape), rules, dict(mesh.shape))
    context = jax.sharding.get_abstract_mesh()
    manual = (
        set()
        if context.empty
        else {a for a, t in zip(context.axis_names, context.axis_types) if t == jax.sharding.AxisType.Manual}
    )
    if manual:
        spec = tuple(_without(entry, manual) for entry in spec)
        return jax.lax.with_sharding_constraint(x, NamedSharding(context, P(*spec)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))


def _without(entry: str | tuple | None, axes: set[str]) -> str | tuple | None:
    """A spec entry with the mesh axes ``axes`` removed."""
    if entry is None:
        return None
    kept = tuple(a for a in ((entry,) if isinstance(entry, str) else entry) if a not in axes)
    return None if not kept else kept[0] if len(kept) == 1 else kept
