"""pmap-era axis names (``nn.BatchNorm(axis_name="batch")``, ``jax.lax.pmean(x, "batch")``) in the compiled steps.

Code written for ``jax.pmap`` names a device axis and reduces over it: each device holds a shard of the
batch, so ``pmean``/``psum`` over that axis turn per-device values into the global batch's. A jaxlight step
is one SPMD program over the global batch, so those values already are global: the collectives have
nothing left to do. Outside ``pmap``/``shard_map`` JAX refuses them (``NameError: Found an unbound axis
name``), so the step methods run with each such name bound to an axis of size 1 (``jax.vmap`` with
``axis_size=1``), where:

- ``pmean(x, name)`` is ``x``, ``pmax``/``pmin`` are ``x`` and ``psum(x, name)`` is ``x``: exact (a
  BatchNorm's mean and mean of squares over the global batch are what pmap's ``pmean`` over equal shards
  gives);
- ``axis_index(name)`` is 0 and ``all_gather(x, name)`` has a leading axis of size 1 (what one pmap device
  sees): code that uses them to pick a device's shard sees the whole batch as shard 0.

A name is bound only when the traced step raises JAX's unbound-name error for it (models without axis
names trace and compile exactly as before); the names found are remembered, so later traces of the same
steps bind them up front. Never bound: a name of the strategy's mesh axes (jaxlight's own ``shard_map``
regions use those; the step is refused by name), and ``axis_index_groups`` (refused by name: there are no
device groups inside one SPMD program).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax

from jaxlight.errors import MisconfigurationError

MAX_NAMES = 4  # more distinct unbound names than this in one step is a bug, not pmap-era code
_UNBOUND = re.compile(r"unbound axis name: (.+?)\. To fix")
_UNBOUND_SHORT = re.compile(r"unbound axis name: (\S+)")


class AxisNameError(MisconfigurationError):
    """A pmap-era axis name the compiled step cannot honour (a mesh axis name, ``axis_index_groups``)."""


def unbound_axis_name(e: BaseException) -> str | None:
    """The name in JAX's ``NameError: Found an unbound axis name: X``, else None."""
    if not isinstance(e, NameError):
        return None
    text = str(e)
    m = _UNBOUND.search(text) or _UNBOUND_SHORT.search(text)
    return m.group(1).rstrip(".") if m else None


def _mesh_axes() -> tuple[str, ...]:
    mesh = jax.sharding.get_abstract_mesh()
    return () if mesh.empty else tuple(str(n) for n in mesh.axis_names)


def _used_groups(e: BaseException) -> bool:
    """Whether a frame of ``e``'s traceback had a non-None ``axis_index_groups`` (a collective's argument)."""
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_locals.get("axis_index_groups") is not None:
            return True
        tb = tb.tb_next
    return False


def bind_axis_names(fn: Callable, names: tuple[str, ...]) -> Callable:
    """``fn`` traced with each of ``names`` bound to an axis of size 1 (its outputs as ``fn``'s)."""
    if not names:
        return fn

    def bound(*args: Any, **kwargs: Any) -> Any:
        call = lambda: fn(*args, **kwargs)  # arguments closed over: unbatched, so is all that derives from them
        for name in names:
            # out_axes=0, not None: axis_index and all_gather give a value "mapped" over the size-1 axis
            call = jax.vmap(call, in_axes=(), out_axes=0, axis_size=1, axis_name=name)
        out = call()
        index = (0,) * len(names)
        return jax.tree.map(lambda x: x[index], out)

    return bound


class AxisNames:
    """The pmap-era axis names a builder's steps bind, found while they are traced."""

    def __init__(self) -> None:
        self.names: tuple[str, ...] = ()

    def call(self, fn: Callable, owner: str, method: str, *args: Any) -> Any:
        """``fn(*args)`` (which traces ``owner.method``); on an unbound axis name, again with it bound.
        Each retry re-runs ``fn`` from the start: ``fn`` must rebuild what the step method mutates."""
        while True:
            try:
                return bind_axis_names(fn, self.names)(*args)
            except NameError as e:
                name = unbound_axis_name(e)
                if name is None or name in self.names or len(self.names) >= MAX_NAMES:
                    raise
                if name in _mesh_axes():
                    raise AxisNameError(
                        f"{owner}.{method} reduces over axis name {name!r} (axis_name={name!r} in a layer, or "
                        f"jax.lax.psum/pmean(x, {name!r})), which is also a mesh axis of the strategy "
                        f"(mesh axes {_mesh_axes()}): outside a shard_map the step is one program over the global "
                        f"batch, so a pmap-style reduction has nothing to do. Rename the axis (e.g. "
                        f"axis_name='batch'), or drop it: BatchNorm without axis_name computes the global "
                        f"batch's statistics here"
                    ) from e
                self.names = (*self.names, name)
            except NotImplementedError as e:
                if self.names and _used_groups(e):
                    raise AxisNameError(
                        f"{owner}.{method} passes axis_index_groups to a collective over axis "
                        f"{'/'.join(map(repr, self.names))} (BatchNorm(axis_index_groups=...), "
                        f"jax.lax.psum(..., axis_index_groups=...)): a jaxlight step is one SPMD program over "
                        f"the global batch, with no per-device groups to reduce within. Drop "
                        f"axis_index_groups (statistics over the whole batch), or compute per-group "
                        f"statistics yourself by reshaping the batch to (groups, rows, ...) and reducing over "
                        f"the rows axis"
                    ) from e
                raise


__all__ = ["AxisNameError", "AxisNames", "bind_axis_names", "unbound_axis_name"]
