"""Models written for JAX's explicit-sharding mode (``jnp.einsum(..., out_sharding=P(...))``,
``jax.sharding.reshard``) under the trainer's Auto mesh.

JAX accepts those calls only for mesh axes of type ``Explicit``; the trainer's mesh is all
``Auto`` (GSPMD places what the model leaves open). The engine traces a step under the Auto
mesh first; when the trace fails with JAX's "cannot contain axis names that are of type Auto"
error, it traces that model's steps from then on under :func:`explicit_twin` of the mesh (the
same devices and names, every axis ``Explicit``) with the arguments typed by the shardings
they already have (:func:`typed`). The compiled programs take the same placed arrays and give
back the same shardings, so nothing outside the step changes. Models that never name a mesh
axis in an ``out_sharding`` keep the Auto trace (the same programs as before).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding

_AUTO_MARK = "cannot contain axis names that are of type Auto or Manual"
_MISSING_MARK = "is not found in mesh"


class ExplicitShardingError(ValueError):
    """A step's explicit-sharding call (``out_sharding=``, ``reshard``) the run cannot honour;
    the message says what to write instead."""


def needs_explicit(err: BaseException) -> bool:
    """Whether ``err`` (or an error it chains) is JAX refusing an ``out_sharding``/``reshard`` on Auto axes."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ValueError) and _AUTO_MARK in str(e) and "AxisType.Auto" in str(e).split("of type:")[-1]:
            return True
        e = e.__cause__ or e.__context__
    return False


def explicit_twin(mesh: Mesh) -> Mesh:
    """``mesh`` with every axis ``Explicit`` (the same devices, names and order)."""
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Explicit,) * len(mesh.axis_names))


def typed(tree: Any, mesh: Mesh, twin: Mesh) -> Any:
    """Arrays (and shape structs) placed on ``mesh`` as shape structs whose sharding is the same spec
    on ``twin``: under explicit axes a jitted step's argument shardings are their types."""

    def one(x: Any) -> Any:
        sh = getattr(x, "sharding", None)
        if not isinstance(sh, NamedSharding) or sh.mesh != mesh or not hasattr(x, "shape"):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(twin, sh.spec, memory_kind=sh.memory_kind))

    return jax.tree.map(one, tree)


def refuse_pieces(strategy: Any, err: BaseException) -> None:
    """Raise :class:`ExplicitShardingError` when ``strategy`` runs parts of the step in ``shard_map``
    regions (sequence parallel, pipeline), where explicit axes cannot be typed."""
    pieces = [p.name for p in getattr(strategy, "_pieces", ()) if p.name in ("sp", "pp")]
    if pieces:
        raise ExplicitShardingError(
            f"the step uses JAX's explicit sharding (out_sharding= / jax.sharding.reshard naming mesh axes), "
            f"which strategy {strategy.name!r} cannot run: its {' and '.join(pieces)} piece(s) trace parts of "
            f"the step inside shard_map regions with manual axes. Write "
            f"jax.lax.with_sharding_constraint(x, jax.P(...)) (or jaxlight.nn.constrain(x, logical names)) "
            f"instead, or use a ddp/fsdp/tp strategy (docs/strategies.md, 'Explicit sharding'). JAX said: {err}"
        ) from err


def name_missing_axis(err: BaseException, mesh: Mesh) -> BaseException:
    """JAX's "axis not found in mesh" as an :class:`ExplicitShardingError` listing the mesh's axes; other errors unchanged."""
    if not (isinstance(err, ValueError) and _MISSING_MARK in str(err)) or isinstance(err, ExplicitShardingError):
        return err
    split = ", ".join(f"{a}={n}" for a, n in mesh.shape.items() if n > 1) or "none (one device)"
    out = ExplicitShardingError(
        f"{err} jaxlight's mesh has the axes {', '.join(mesh.axis_names)} (this run splits {split}); "
        f"name those in out_sharding= / reshard / with_sharding_constraint specs "
        f"(batch rows: ('data', 'fsdp', 'expert'); docs/strategies.md, 'Explicit sharding')"
    )
    out.__cause__ = err
    return out
