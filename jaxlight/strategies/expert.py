"""Expert parallelism: the experts of every :class:`jaxlight.nn.MoE` split over the ``expert`` mesh axis.

:class:`ExpertParallel` (``"ep"``) sets the ``expert`` axis and the rule
``("exp", "expert")``, so the leading ``exp`` dimension of every expert weight
is split over it: each of ``n`` devices holds ``E / n`` whole experts (and
their gradients and optimizer state), whatever their size (the ``min_shard``
floor that keeps small parameters replicated does not apply to this axis:
placing experts is what the layer's exchange relies on). ``expert`` is also
a batch axis, so batch rows are split over it as over ``data``: the parameters
that are not experts are replicated over it and their gradients all-reduced,
as under data parallelism.

While a step is traced, each MoE call runs as a ``jax.shard_map`` that is
manual over ``expert`` (and over the other axes splitting its tokens): every
device routes its own tokens, sends them to the devices of their experts with
one ``all_to_all``, computes its own experts only and sends the results back
with a second one (see :mod:`jaxlight.nn.moe`). The expert weights are never
gathered over ``expert``.

Composes with ``fsdp`` (``"fsdp+ep"``: expert weights split over both, the
fsdp part gathered at each call, as FSDP does), ``tp`` (``"ep+tp"``: each
expert's hidden width split over ``tensor``), ``offload``, and ``sp`` with a
dropless MoE (``"ep+sp"``: tokens are independent, so positions split over
``sequence`` are routed where they are). Refused, with the numbers, before
any work: a model without MoE experts (the axis would only split rows),
experts not divisible by the axis size, and pipelining (``"ep+pp"``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from flax import nnx
from jax.sharding import Mesh

from jaxlight.state import logical_axes
from jaxlight.strategies.rules import Rules
from jaxlight.strategies.strategy import FILL, Piece, check_axis_size, register_strategy

EXP = "exp"
"""Logical name of the experts dimension of MoE weights."""
AXIS = "expert"
"""The mesh axis that holds experts."""

__all__ = ["AXIS", "EXP", "ExpertParallel", "expert_params", "has_experts"]


@dataclasses.dataclass(frozen=True)
class ExpertParallel(Piece):
    """Split the experts of every :class:`jaxlight.nn.MoE` over ``size`` devices (the ``expert`` mesh axis).

    - ``size``: devices on the ``expert`` axis; None takes every device the
      other axes leave, or 2 when composed with a piece that takes them
      (``"fsdp+ep"``: fsdp the rest, expert 2; ``"ep+tp"``: tensor 2,
      expert 2, data the rest). Pass ``size=`` for another split.

    Guarantees: every expert weight (logical axes starting with ``exp``) is
    split over ``expert`` on its experts dimension; MoE calls exchange tokens
    with all-to-all over ``expert`` and never gather expert weights over it;
    losses, gradients and parameters equal one device's up to float rounding
    (for a capacity-limited MoE too: capacity is counted per sequence).
    Batch rows are split over ``data x fsdp x expert``.
    """

    name: ClassVar[str] = "ep"
    size: int | None = None

    def __init__(self, size: int | None = None) -> None:
        check_axis_size("ExpertParallel", size)
        object.__setattr__(self, "size", size)

    def mesh_axes(self) -> Mapping[str, int]:
        return {AXIS: FILL if self.size is None else self.size}

    def rules(self) -> Rules:
        return ((EXP, AXIS),)

    def check_model(self, params: Mapping[str, Any], variables: Mapping[str, Any], mesh: Mesh) -> None:
        n = int(mesh.shape[AXIS])
        found = expert_params(params, variables)
        if not found:
            raise ValueError(
                f"strategy 'ep' splits the experts of jaxlight.nn.MoE layers over the expert axis, and this model "
                f"has none: no parameter has the logical axis {EXP!r} (among {len(params)} parameters). The "
                f"expert axis of {n} devices would only split batch rows: use 'ddp' (or 'fsdp') for a dense model"
            )
        stages = int(mesh.shape.get("stage", 1))
        if stages > 1 and n > 1:
            # checked on jax 0.10.2: the MoE's shard_map over expert nested in the pipeline's shard_map over
            # stage runs forward, but its backward pass fails to lower (Shardy verifier: axis already bound)
            raise ValueError(
                f"strategy 'ep' does not compose with pipeline parallelism yet (mesh stage={stages}, expert={n}): "
                "a pipeline runs its stages inside a shard_map over stage, and the MoE's all-to-all shard_map "
                "over expert nested there does not lower in the backward pass on this jax; split the experts "
                "without pp ('fsdp+ep'), or pipeline the model with its experts unsplit ('pp', 'fsdp+pp')"
            )
        for path, (dim, shape) in found.items():
            experts = shape[dim]
            if experts % n:
                raise ValueError(
                    f"MoE parameter {path} {shape} has {experts} experts, not divisible by the expert axis of {n} "
                    f"devices; use an expert axis size that divides {experts} (ExpertParallel(size=...)) or "
                    f"{experts + (-experts) % n} experts"
                )

    def describe(self) -> str:
        return f"ExpertParallel(size={self.size})"


register_strategy("ep", ExpertParallel)


def expert_params(params: Mapping[str, Any], variables: Mapping[str, Any]) -> dict[str, tuple[int, tuple]]:
    """``{path: (experts_dim, shape)}`` for the parameters with the logical axis ``"exp"``."""
    out: dict[str, tuple[int, tuple]] = {}
    for path, arr in params.items():
        var = variables.get(path)
        names = logical_axes(var) if var is not None else None
        if names and EXP in names:
            out[path] = (list(names).index(EXP), tuple(getattr(arr, "shape", ())))
    return out


def has_experts(tree: Any) -> bool:
    """Whether any NNX variable reachable from ``tree`` (a module, or a LightningModule's attributes) has the
    logical axis ``"exp"``: whether ``"ep"`` has experts to split."""
    if isinstance(tree, nnx.Module):
        modules: Any = tree
    else:
        items = tree.items() if isinstance(tree, Mapping) else vars(tree).items()
        modules = {k: v for k, v in items if isinstance(v, nnx.Module)}
    for _, node in nnx.iter_graph(modules):
        if isinstance(node, nnx.Variable) and EXP in (logical_axes(node) or ()):
            return True
    return False
