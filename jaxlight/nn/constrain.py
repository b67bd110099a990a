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


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Pin activation ``x`` to the mesh axes its logical ``names`` map to.

    Inside a trainer step this is ``jax.lax.with_sharding_constraint`` with
    the rules of the run's strategy (e.g. ``("batch", "length", "embed")``);
    outside one, or on a single device, it returns ``x`` unchanged, so model
    code runs the same everywhere.
    """
    active = getattr(_ctx, "value", None)
    if active is None:
        return x
    mesh, rules = active
    if mesh.size == 1:
        return x
    spec = resolve_spec(tuple(names), tuple(x.shape), rules, dict(mesh.shape))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))
