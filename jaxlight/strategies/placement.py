"""Where each array of the train state lives on the mesh.

Parameters follow their logical annotations through the rules table; the
ones nobody annotated take a shape heuristic (the largest dimension the fsdp
axis divides). Small parameters stay replicated on purpose, and a layout that
leaves too much of the rest replicated is refused (MaxText's sharding
tolerance guardrail), listing the paths so the user can annotate them.

Optimizer and callback state follow the parameters they mirror
(:func:`mirror_shardings`): the engine places the train state with it and
``jaxlight verify`` sizes the optimizer state with it, so the two agree.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlight.state import logical_axes
from jaxlight.strategies.rules import (
    BATCH_AXES,
    MESH_AXES,
    PARAM_FORBIDDEN_AXES,
    Rules,
    pad_names,
    resolve_spec,
    rule_names,
)
from jaxlight.strategies.strategy import Strategy

PARAM_AXES: tuple[str, ...] = ("fsdp", "tensor", "expert", "stage")
"""Mesh axes meant to hold parameters; one of size > 1 that ends up holding none is warned about at setup."""


class LayoutError(ValueError):
    """A placement that would silently replicate, or put a parameter on a batch axis."""


class PlacementWarning(UserWarning):
    """A mesh axis meant for parameters that holds none of them (the strategy piece does nothing)."""


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
    annotations = checked_annotations(abstract, variables, rules, mesh_shape, forbidden)
    for path, arr in abstract.items():
        shape = tuple(arr.shape)
        names = annotations.get(path)
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
    check_tolerance(abstract, specs, strategy, mesh, annotations)
    for message in idle_axis_messages(abstract, specs, strategy, mesh, annotations):
        warnings.warn(message, PlacementWarning, stacklevel=3)
    return specs


def checked_annotations(
    abstract: Mapping[str, Any],
    variables: Mapping[str, Any],
    rules: Rules,
    mesh_shape: Mapping[str, int],
    forbidden: tuple[str, ...] = PARAM_FORBIDDEN_AXES,
    kind: str = "parameter",
) -> dict[str, tuple]:
    """``{path: names}`` for the annotated arrays, one name per dimension, after flax's conventions are checked.

    - fewer names than dimensions: the trailing dimensions stay whole (flax's partial-rank rule);
    - a name is either a logical name the rules give candidates for, or one of the six mesh axes
      (used as that axis, as in ``nnx.with_partitioning(init, (None, "tensor"))``);
    - a mesh axis named directly must divide its dimension and may not be a batch axis.

    Raises one :class:`LayoutError` listing every array that breaks a rule (path, shape, annotation,
    what is wrong and the rule to add), so a table written for another mesh is never silently ignored.
    """
    known = rule_names(rules)
    out: dict[str, tuple] = {}
    problems: list[str] = []
    unknown: dict[str, list[str]] = {}
    for path, arr in abstract.items():
        names = logical_axes(variables[path]) if path in variables else None
        if names is None:
            continue
        shape = tuple(getattr(arr, "shape", ()))
        try:
            padded = pad_names(names, shape)
        except ValueError as e:
            problems.append(f"  {kind} {path} {shape}: {e}")
            continue
        for dim, (name, size) in enumerate(zip(padded, shape)):
            if name is None or name in known:
                continue
            if isinstance(name, tuple):
                # one dim split over several mesh axes together (P(("fsdp", "tensor"))): mesh axes only,
                # as in JAX; a logical name stands for a list of fallbacks, which cannot be combined
                not_axes = [a for a in name if a not in MESH_AXES]
                if not_axes:
                    problems.append(
                        f"  {kind} {path} {shape} splits dim {dim} over {name} (annotation {tuple(names)}); a dim "
                        f"split over several axes names mesh axes {MESH_AXES} only, and {not_axes[0]!r} is not one: "
                        f"name one logical name for the dim instead (its rules may list several axes)"
                    )
                    continue
                direct = name
            elif name not in MESH_AXES:
                unknown.setdefault(name, []).append(f"{path} {shape} annotated {tuple(names)}")
                continue
            else:
                direct = (name,)
            label = f"mesh axis {name!r}" if isinstance(name, str) else f"mesh axes {name}"
            bad = [a for a in direct if a in forbidden]
            n = math.prod(mesh_shape.get(a, 1) for a in direct)
            if bad:
                problems.append(
                    f"  {kind} {path} {shape} names {label} directly (annotation {tuple(names)}); "
                    f"parameters may not use {forbidden}: those axes split the batch or hold pipeline stages"
                )
            elif size % n:
                problems.append(
                    f"  {kind} {path} {shape} names {label} directly for dim {dim} ({size}), which "
                    f"{name!r} (size {n}) does not divide; use a logical name with fallbacks "
                    f"(e.g. 'mlp') or a size that divides it"
                )
        out[path] = padded
    for name, where in unknown.items():
        listing = "\n".join(f"    {w}" for w in where[:20])
        more = f"\n    ... and {len(where) - 20} more" if len(where) > 20 else ""
        problems.append(
            f"  {name!r} is neither a logical name the rules map nor a mesh axis {MESH_AXES}; used by:\n"
            f"{listing}{more}\n"
            f"    add a rule for it, e.g. Strategy(rules=[({name!r}, 'tensor')]) to split that dim like tensor "
            f"parallelism, ({name!r}, 'fsdp') to shard it with FSDP, or ({name!r}, None) to keep it whole "
            f"(composes: strategy=jl.strategies.FSDP() + Strategy(rules=...))"
        )
    if problems:
        raise LayoutError(f"cannot place the model's {kind}s as annotated:\n" + "\n".join(problems))
    return out


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


def _sends_to(name: Any, axis: str, rules: Rules) -> bool:
    """Whether an annotation entry can place its dim on mesh ``axis``: a rule candidate of the logical
    name uses it, or the entry names it directly (a mesh axis no rule mentions, or a tuple of mesh axes)."""
    if name is None:
        return False
    if isinstance(name, tuple):
        return axis in name
    candidates = [a for n, a in rules if n == name]
    if not candidates:
        return name == axis
    return any(axis in ((a,) if isinstance(a, str) else tuple(a)) for a in candidates if a is not None)


_PIECE_OF_AXIS: dict[str, str] = {"fsdp": "FSDP", "tensor": "TensorParallel"}


def min_shard_fix(strategy: Strategy, axis: str, size: int, mesh_shape: Mapping[str, int]) -> str:
    """The piece call that lowers ``min_shard`` to ``size``. The threshold is one for the whole strategy
    and pieces that set it must agree, so a piece that already sets it is the one to change."""
    setters = [p for p in strategy.pieces if "min_shard" in p.guardrail()]
    if setters:
        return " + ".join(re.sub(r"min_shard=\d+", f"min_shard={size}", p.describe()) for p in setters)
    piece = _PIECE_OF_AXIS.get(axis)
    if piece == "TensorParallel":
        return f"TensorParallel({mesh_shape.get(axis, 1)}, min_shard={size})"
    if piece == "FSDP":
        return f"FSDP(min_shard={size})"
    return f"Strategy(min_shard={size})"


def off_axis_reason(
    path: str,
    shape: tuple[int, ...],
    names: tuple | None,
    axis: str,
    strategy: Strategy,
    mesh_shape: Mapping[str, int],
) -> tuple[str, str]:
    """``(kind, text)``: why the parameter ``path`` of ``shape`` (annotated ``names``, or None) holds no
    part of mesh ``axis``, and what would place it there.

    ``kind`` is one of ``"min_shard"`` (the rules send it there but it is below ``min_shard``: the text
    gives its size, the threshold and the piece call that lowers it), ``"no_rule"`` (annotated, but no
    name goes to ``axis``: the rule to add), ``"unannotated"`` (the annotation to write; for ``fsdp``
    also why the shape heuristic placed nothing) or ``"fit"`` (a name goes there, but ``axis`` does
    not divide the dim, or the dim took an earlier candidate).
    """
    rules = strategy.logical_rules
    n = mesh_shape.get(axis, 1)
    size = math.prod(shape)
    below = size < strategy.min_shard
    small = (
        f"below min_shard ({size} elements < min_shard={strategy.min_shard}; small parameters stay whole on purpose)"
    )
    lower = f"{min_shard_fix(strategy, axis, size, mesh_shape)} would place it"
    if names is None:
        if axis == "fsdp":
            if below:
                return "min_shard", f"not annotated and {small}: {lower} (the shape heuristic)"
            return "unannotated", (
                f"not annotated, and fsdp (size {n}) divides none of its dims (the shape heuristic's pick): "
                f"annotate it with a name the rules send to a dim that fits, or pick an fsdp size that divides one"
            )
        return "unannotated", (
            f"not annotated ({axis} never guesses a split): annotate it, e.g. nnx.with_partitioning(init, "
            f"('embed', 'mlp'))"
        )
    names = pad_names(names, shape)
    sending = [(d, nm) for d, nm in enumerate(names) if _sends_to(nm, axis, rules)]
    if not sending:
        named = [nm for nm in names if isinstance(nm, str)]
        goes = sorted({nm for nm, a in rules if a is not None and _sends_to(nm, axis, rules)})
        if named:
            return "no_rule", (
                f"annotated {names}, and no rule sends {', '.join(repr(nm) for nm in dict.fromkeys(named))} to "
                f"{axis!r}: add one, e.g. Strategy(rules=[({named[-1]!r}, {axis!r})]), or name the dim "
                f"{', '.join(repr(g) for g in goes) or repr(axis)}"
            )
        return (
            "no_rule",
            f"annotated {names} (every dim whole): name a dim {axis!r} or a logical name the rules send there",
        )
    full = resolve_spec(names, shape, rules, mesh_shape)
    if axis in _spec_axes(full):  # placed there at full size: only the min_shard floor kept it whole
        return "min_shard", f"annotated {names}, {small}: {lower}"
    d, nm = sending[0]
    took = full[d] if d < len(full) else None
    if took is not None:
        return (
            "fit",
            f"annotated {names}: dim {d} ({nm!r}, {shape[d]}) took {took!r}, an earlier candidate of its rules",
        )
    return "fit", (
        f"annotated {names}: {nm!r} goes to {axis!r}, but no candidate with {axis!r} (size {n}) divides dim "
        f"{d} ({shape[d]}) on this mesh: pick an axis size that divides it, or add a fallback rule"
    )


def _shards_params(mesh_shape: Mapping[str, int]) -> bool:
    # not expert: it splits experts only, and replicates every other parameter by design (as data does)
    return any(mesh_shape.get(a, 1) > 1 for a in ("fsdp", "tensor"))


def check_tolerance(
    abstract: Mapping[str, Any],
    specs: Mapping[str, tuple],
    strategy: Strategy,
    mesh: Mesh,
    annotations: Mapping[str, tuple] | None = None,
) -> None:
    """Refuse a layout leaving more than ``strategy.tolerance`` of the shardable
    parameter elements (those of at least ``min_shard`` elements) replicated.

    ``annotations`` (``{path: logical names}``) lets the error tell annotated
    parameters (whose names the rules send to no axis that divides them) from
    unannotated ones."""
    annotations = annotations or {}
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
        ordered = sorted(replicated, key=lambda r: -r[2])
        # per parameter, why each parameter axis left it whole (a rule missing, a size that does not divide)
        axes = [a for a in ("fsdp", "tensor") if mesh_shape.get(a, 1) > 1 and a not in strategy.param_forbidden_axes]

        def why(p: str, shape: tuple) -> str:
            names = annotations.get(p)
            reasons = [f"{a}: {off_axis_reason(p, shape, names, a, strategy, mesh_shape)[1]}" for a in axes]
            return f"  {p} {shape}" + (f" annotated {names}" if names is not None else "") + " -- " + "; ".join(reasons)

        listing = "\n".join(why(p, shape) for p, shape, _ in ordered[:20])
        more = f"\n  ... and {len(replicated) - 20} more" if len(replicated) > 20 else ""
        advice = []
        if any(p not in annotations for p, _, _ in replicated):
            advice.append(
                "annotate the unannotated ones (nnx.with_partitioning / nn.with_logical_partitioning), or pick "
                "axis sizes that divide their dimensions"
            )
        if any(p in annotations for p, _, _ in replicated):
            advice.append(
                "the annotated ones are annotated, but the rules send their names to no mesh axis of size > 1 "
                "that divides their dimensions: change the rules (e.g. Strategy(rules=[('mlp', 'fsdp')])) or the "
                "axis sizes"
            )
        raise LayoutError(
            f"strategy {strategy.name!r} on mesh {_fmt_mesh(mesh_shape)} leaves {frac:.1%} of the "
            f"shardable parameter elements replicated (tolerance {strategy.tolerance:.1%}, min_shard "
            f"{strategy.min_shard}). Replicated parameters:\n{listing}{more}\n"
            + "; ".join(a[0].upper() + a[1:] for a in advice)
            + "."
        )


def _fmt_bytes(n: float) -> str:
    # summary.fmt_bytes's format; not imported so that summary.py may import this module
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def _nbytes(arr: Any) -> int:
    dtype = getattr(arr, "dtype", None)
    itemsize = np.dtype(dtype).itemsize if dtype is not None else 4
    return int(math.prod(getattr(arr, "shape", ()))) * itemsize


def idle_axis_messages(
    abstract: Mapping[str, Any],
    specs: Mapping[str, tuple],
    strategy: Strategy,
    mesh: Mesh,
    annotations: Mapping[str, tuple] | None = None,
) -> list[str]:
    """One message per mesh axis meant for parameters (:data:`PARAM_AXES`) of size > 1 that holds none.

    Each names the axis, the largest parameters left off it and the fix (annotations for
    ``tensor``/``expert``/``stage``, ``min_shard=`` for ``fsdp`` below the threshold). For ``fsdp`` and
    ``tensor`` it gives the true reason per parameter (:func:`off_axis_reason`: below ``min_shard``,
    no rule sends its names there, not annotated, or a size that does not divide) with the change that
    would place it. The trainer warns with them (:class:`PlacementWarning`) when it places a model.
    """
    annotations = annotations or {}
    mesh_shape = dict(mesh.shape)
    used = {a for spec in specs.values() for a in _spec_axes(spec)}
    allowed = set(PARAM_AXES) - set(strategy.param_forbidden_axes)
    rules = strategy.logical_rules
    biggest = sorted(abstract.items(), key=lambda kv: -_nbytes(kv[1]))
    out: list[str] = []

    def listing(n: int = 3) -> str:
        return ", ".join(f"{p} {tuple(a.shape)}" for p, a in biggest[:n])

    for axis in PARAM_AXES:
        size = mesh_shape.get(axis, 1)
        if size <= 1 or axis in used or axis not in allowed or not abstract:
            continue
        head = f"mesh axis {axis!r} (size {size}) holds no parameter bytes"
        names = sorted({n for n, a in rules if a is not None and axis in ((a,) if isinstance(a, str) else a)})
        if axis == "fsdp" and max(math.prod(a.shape) for a in abstract.values()) < strategy.min_shard:
            largest = max(math.prod(a.shape) for a in abstract.values())
            fix = (
                f"every parameter is below min_shard={strategy.min_shard} elements (the largest: {listing()}), "
                f"so all stay replicated and the fsdp axis only splits the batch (data parallelism). To shard "
                f"them pass a lower threshold, e.g. FSDP(min_shard={max(1, largest // size)})"
            )
        elif axis in ("fsdp", "tensor"):
            fix = _off_axis_fix(axis, names, biggest, annotations, strategy, mesh_shape, listing())
        elif axis == "expert":
            fix = (
                f"expert parallelism splits only dims annotated with {', '.join(repr(n) for n in names) or 'exp'}; "
                f"the largest parameters are {listing()}. Annotate the experts' leading dim, e.g. ('exp', 'embed', "
                f"'mlp')"
            )
        else:
            fix = (
                f"pipeline stages hold only parameters whose leading logical axis is 'layers' (jl.nn.LayerStack); "
                f"the largest parameters are {listing()}"
            )
        out.append(f"strategy {strategy.name!r}: {head}: {fix}.")
    return out


def _off_axis_fix(
    axis: str,
    names: list[str],
    biggest: list[tuple[str, Any]],
    annotations: Mapping[str, tuple],
    strategy: Strategy,
    mesh_shape: Mapping[str, int],
    largest: str,
) -> str:
    """The body of the idle-axis message for ``fsdp`` / ``tensor``: the true reason per parameter (the
    largest three, and up to five whose annotation sends a dim to ``axis``) and the change that places it."""
    rules = strategy.logical_rules
    sent = [(p, a) for p, a in biggest if any(_sends_to(n, axis, rules) for n in annotations.get(p) or ())][:5]
    shown = dict(sent + biggest[:3])  # by bytes, largest first
    shown = dict(sorted(shown.items(), key=lambda kv: -_nbytes(kv[1])))
    reasons = {
        p: off_axis_reason(p, tuple(a.shape), annotations.get(p), axis, strategy, mesh_shape) for p, a in shown.items()
    }
    kinds = {kind for kind, _ in reasons.values()}
    per = "; ".join(f"{p} {tuple(shown[p].shape)}: {text}" for p, (_, text) in reasons.items())
    if axis == "tensor":
        intro = (
            f"tensor parallelism splits only the dims annotations name 'tensor' or with a logical name the rules "
            f"send to tensor ({', '.join(names) or 'none'}); the largest parameters are {largest}. Why each "
            f"parameter stays off tensor: {per}"
        )
    else:
        intro = f"the largest parameters are {largest}. Why each stays off fsdp: {per}"
    todo = []
    if "min_shard" in kinds:
        small = min(math.prod(shown[p].shape) for p, (k, _) in reasons.items() if k == "min_shard")
        todo.append(
            f"lower min_shard (one threshold for the whole strategy) to place the small ones, e.g. "
            f"{min_shard_fix(strategy, axis, small, mesh_shape)}"
        )
    if "no_rule" in kinds:
        todo.append(f"add a rule sending their names to {axis!r} or annotate the dims with one the rules send there")
    if "unannotated" in kinds:
        todo.append(
            "annotate the unannotated ones, e.g. nnx.with_partitioning(init, ('embed', 'mlp')) or "
            "nn.with_logical_partitioning(init, ('embed', 'mlp'))"
        )
    if "fit" in kinds:
        todo.append(f"pick a {axis} size that divides the dims named for it")
    tail = ", or leave the tensor piece out" if axis == "tensor" else ""
    return f"{intro}. To fix: " + "; ".join(todo) + tail


def axis_split_bytes(params: Mapping[str, Any]) -> dict[str, int]:
    """``{mesh axis: bytes of the parameters it splits}`` for placed parameters (arrays with a
    ``NamedSharding``), every mesh axis of size > 1 included (0 for one that splits none).

    The model summary's "bytes per axis" line; a parameter split over two axes counts for both.
    """
    out: dict[str, int] = {}
    for arr in params.values():
        sharding = getattr(arr, "sharding", None)
        spec = getattr(sharding, "spec", None)
        mesh = getattr(sharding, "mesh", None)
        if spec is None or mesh is None:
            continue
        for axis, size in dict(mesh.shape).items():
            if size > 1:
                out.setdefault(axis, 0)
        for axis in set(_spec_axes(tuple(spec))):
            if dict(mesh.shape).get(axis, 1) > 1:
                out[axis] = out.get(axis, 0) + _nbytes(arr)
    return out


def layout_summary_lines(params: Mapping[str, Any], variables: Mapping[str, Any] | None = None) -> list[str]:
    """Lines for the model summary: the parameter bytes each mesh axis of size > 1 splits, and the
    parameters annotated with fewer logical names than dimensions (trailing dims whole, as in flax).

    ``params``: placed parameters by path; ``variables``: the NNX variables by the same paths (for their
    annotations; ``Engine.parts.params.variables``), or None to leave the annotation line out.
    """
    lines: list[str] = []
    split = axis_split_bytes(params)
    total = sum(_nbytes(a) for a in params.values())
    if split:
        parts = [
            f"{axis} {_fmt_bytes(n)} ({n / total:.0%})" if total else f"{axis} {_fmt_bytes(n)}"
            for axis, n in split.items()
        ]
        lines.append(f"Param bytes split per mesh axis (of {_fmt_bytes(total)}): " + ", ".join(parts))
    if variables:
        partial = []
        for path, arr in params.items():
            var = variables.get(path)
            names = logical_axes(var) if var is not None else None
            shape = tuple(getattr(arr, "shape", ()))
            if names is not None and len(names) < len(shape):
                partial.append(f"{path} {shape} {tuple(names)}")
        if partial:
            more = f" ... and {len(partial) - 5} more" if len(partial) > 5 else ""
            lines.append(
                f"Partial-rank annotations ({len(partial)}; trailing dims whole, as flax does): "
                + ", ".join(partial[:5])
                + more
            )
    return lines


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
    mesh_shape = dict(mesh.shape)
    annotations = checked_annotations(
        abstract, variables, rules, mesh_shape, strategy.param_forbidden_axes, kind="non-parameter variable"
    )
    out: dict[str, tuple] = {}
    for path, arr in abstract.items():
        names = annotations.get(path)
        shape = tuple(getattr(arr, "shape", ()))
        out[path] = resolve_spec(names, shape, rules, mesh_shape) if names and shape else ()
    return out


# ---------------------------------------------------------------------------- state mirroring parameters
def mirrored_param(path: tuple, shape: tuple[int, ...], params: Mapping[str, Any]) -> str | None:
    """The parameter a leaf of optimizer or callback state mirrors, or None.

    ``path`` is the leaf's key path (``jax.tree_util`` keys) and ``params`` maps
    parameter paths to arrays or shape structs. The leaf mirrors the innermost
    dict key on its path that names a parameter of the leaf's own shape: Adam's
    ``mu["net/l1/kernel"]`` mirrors ``"net/l1/kernel"``; a scalar count, or a
    leaf keyed by a parameter but of another shape (a factored second moment),
    mirrors nothing.
    """
    for k in reversed(path):
        key = getattr(k, "key", None)
        if isinstance(key, str) and key in params and tuple(shape) == tuple(params[key].shape):
            return key
    return None


def mirror_shardings(
    tree: Any,
    params: Mapping[str, Any],
    param_shardings: Mapping[str, NamedSharding],
    mesh: Mesh,
    strategy: Strategy,
    group: str,
) -> Any:
    """A sharding for every leaf of ``tree`` (the ``group`` of state: ``"opt_state"``, ``"callback_state"``).

    A leaf that mirrors a parameter (:func:`mirrored_param`) takes that
    parameter's sharding from ``param_shardings``; any other leaf is replicated
    over ``mesh``. Either way in the memory kind
    ``strategy.memory_kind(group, mirrored path or None)`` names, when it names one.
    """
    replicated = NamedSharding(mesh, P())

    def pick(path: tuple, leaf: Any) -> NamedSharding:
        mirrors = mirrored_param(path, tuple(leaf.shape), params)
        sharding = param_shardings[mirrors] if mirrors is not None else replicated
        kind = strategy.memory_kind(group, mirrors)
        return sharding.with_memory_kind(kind) if kind is not None else sharding

    return jax.tree_util.tree_map_with_path(pick, tree)
