"""Where each array of the train state lives on the mesh.

Parameters follow their logical annotations through the rules table; the
ones nobody annotated take a shape heuristic (the largest dimension the fsdp
axis divides). Small parameters stay replicated on purpose, and a layout that
leaves too much of the rest replicated is refused (MaxText's sharding
tolerance guardrail), listing the paths so the user can annotate them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlight.state import logical_axes
from jaxlight.strategies.rules import BATCH_AXES, PARAM_FORBIDDEN_AXES, Rules, resolve_spec
from jaxlight.strategies.strategy import Strategy


class LayoutError(ValueError):
    """A placement that would silently replicate, or put a parameter on a batch axis."""


def _spec_axes(spec: tuple) -> list[str]:
    out: list[str] = []
    for s in spec:
        if s is None:
            continue
        out.extend([s] if isinstance(s, str) else list(s))
    return out


def heuristic_spec(shape: tuple[int, ...], mesh_shape: Mapping[str, int], min_shard: int) -> tuple:
    """Shard the largest dimension the fsdp axis divides (ties: the later dim)."""
    n = mesh_shape.get("fsdp", 1)
    if n <= 1 or math.prod(shape) < min_shard:
        return ()
    order = sorted(range(len(shape)), key=lambda i: (shape[i], i), reverse=True)
    for i in order:
        if shape[i] % n == 0:
            return tuple("fsdp" if j == i else None for j in range(i + 1))
    return ()


def param_specs(
    abstract: Mapping[str, Any],
    variables: Mapping[str, Any],
    strategy: Strategy,
    mesh: Mesh,
) -> dict[str, tuple]:
    """PartitionSpec tuples for flat parameters, with the guardrail applied."""
    rules = strategy.logical_rules
    mesh_shape = dict(mesh.shape)
    forbidden = strategy.param_forbidden_axes
    # Axes a piece requires parameters on (pipeline stages) apply whatever the size: they are
    # placement, not a memory optimisation the min_shard floor may skip. So do experts: an MoE
    # call computes only the experts of its device (expert parallelism).
    required = tuple(a for a in PARAM_FORBIDDEN_AXES if a not in forbidden) + ("expert",)
    specs: dict[str, tuple] = {}
    for path, arr in abstract.items():
        shape = tuple(arr.shape)
        names = logical_axes(variables[path]) if path in variables else None
        size = math.prod(shape)
        if names is not None:
            _check_forbidden(path, shape, names, strategy.rules, forbidden)
            spec = resolve_spec(names, shape, rules, mesh_shape)
            bad = [a for a in _spec_axes(spec) if a in forbidden]
            if bad:
                raise LayoutError(
                    f"parameter {path} {shape} with logical axes {names} is placed on mesh axis "
                    f"{bad[0]!r} (size {mesh_shape[bad[0]]}) by the rules; parameters may not use "
                    f"{forbidden}: those axes split the batch or hold pipeline stages"
                )
            if size < strategy.min_shard:
                # small: replicated on purpose (a gather would cost more than it saves)
                spec = _keep_axes(spec, required)
        else:
            spec = heuristic_spec(shape, mesh_shape, strategy.min_shard)
        specs[path] = spec
    check_tolerance(abstract, specs, strategy, mesh)
    return specs


def _keep_axes(spec: tuple, axes: tuple[str, ...]) -> tuple:
    """``spec`` with only the entries that use ``axes`` (the rest replicated)."""
    out = [s if s is not None and set(_spec_axes((s,))) <= set(axes) else None for s in spec]
    while out and out[-1] is None:
        out.pop()
    return tuple(out)


def _check_forbidden(path: str, shape: tuple, names: tuple, rules: Rules, forbidden: tuple[str, ...]) -> None:
    # A rule from a piece sending a parameter's name to data/sequence/stage is refused on
    # every mesh, not only where that axis happens to be larger than 1.
    for name in names:
        for rule_name, axes in rules:
            if rule_name != name or axes is None:
                continue
            bad = [a for a in ((axes,) if isinstance(axes, str) else axes) if a in forbidden]
            if bad:
                raise LayoutError(
                    f"rule {rule_name!r} -> {axes!r} would place parameter {path} {shape} (logical axes "
                    f"{names}) on mesh axis {bad[0]!r}; parameters may not use {forbidden}: "
                    f"data and sequence split the batch (the parameter would be gathered on every use) "
                    f"and stage holds pipeline stages"
                )


def _shards_params(mesh_shape: Mapping[str, int]) -> bool:
    # not expert: it splits experts only, and replicates every other parameter by design (as data does)
    return any(mesh_shape.get(a, 1) > 1 for a in ("fsdp", "tensor"))


def check_tolerance(abstract: Mapping[str, Any], specs: Mapping[str, tuple], strategy: Strategy, mesh: Mesh) -> None:
    """Refuse a layout leaving more than ``strategy.tolerance`` of the shardable
    parameter elements (those of at least ``min_shard`` elements) replicated."""
    mesh_shape = dict(mesh.shape)
    if not _shards_params(mesh_shape):
        return  # data parallel replicates by design
    total = 0
    replicated: list[tuple[str, tuple, int]] = []
    for path, arr in abstract.items():
        size = math.prod(arr.shape)
        if size < strategy.min_shard:
            continue
        total += size
        if not _spec_axes(specs[path]):
            replicated.append((path, tuple(arr.shape), size))
    if not total:
        return
    frac = sum(s for _, _, s in replicated) / total
    if frac > strategy.tolerance:
        listing = "\n".join(f"  {p} {shape}" for p, shape, _ in sorted(replicated, key=lambda r: -r[2])[:20])
        more = f"\n  ... and {len(replicated) - 20} more" if len(replicated) > 20 else ""
        raise LayoutError(
            f"strategy {strategy.name!r} on mesh {_fmt_mesh(mesh_shape)} leaves {frac:.1%} of the "
            f"shardable parameter elements replicated (tolerance {strategy.tolerance:.1%}, min_shard "
            f"{strategy.min_shard}). Replicated parameters:\n{listing}{more}\n"
            f"Annotate them with nnx.with_partitioning, change the rules, or pick axis sizes that "
            f"divide their dimensions."
        )


def _fmt_mesh(mesh_shape: Mapping[str, int]) -> str:
    return (
        "{" + ", ".join(f"{a}={s}" for a, s in mesh_shape.items() if s > 1) + "}"
        if any(s > 1 for s in mesh_shape.values())
        else "{single device}"
    )


def named(mesh: Mesh, spec: tuple) -> NamedSharding:
    return NamedSharding(mesh, P(*spec))


def batch_spec(mesh: Mesh, ndim: int) -> P:
    """Rows on the batch axes (those of size > 1), other dims whole."""
    axes = tuple(a for a in BATCH_AXES if mesh.shape[a] > 1)
    if ndim == 0 or not axes:
        return P()
    return P(axes if len(axes) > 1 else axes[0])


def batch_axes_size(mesh: Mesh) -> int:
    return int(np.prod([mesh.shape[a] for a in BATCH_AXES]))


def rest_specs(
    abstract: Mapping[str, Any], variables: Mapping[str, Any], strategy: Strategy, mesh: Mesh
) -> dict[str, tuple]:
    """Non-parameter variables (RNG keys, counters, batch statistics) follow
    their annotations when present and are otherwise replicated: they are
    small, and every device needs the same RNG stream to agree on dropout."""
    rules = strategy.logical_rules
    out: dict[str, tuple] = {}
    for path, arr in abstract.items():
        names = logical_axes(variables[path]) if path in variables else None
        shape = tuple(getattr(arr, "shape", ()))
        out[path] = resolve_spec(names, shape, rules, dict(mesh.shape)) if names and shape else ()
    return out
