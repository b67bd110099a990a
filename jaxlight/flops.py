"""Matrix-product FLOPs of a traced program, loops counted as often as they run.

XLA's ``compiled.cost_analysis()`` counts the body of a loop once (jax 0.10.2, XLA:CPU and XLA:GPU): a
model whose layers are one scanned :class:`jaxlight.nn.LayerStack` (the demo's GPT) reports about one
layer's FLOPs, and its MFU reads ``layers`` times too low. :func:`matmul_flops` counts from the step's
jaxpr instead, as ``torch.utils.flop_counter`` (what Lightning's ``measure_flops`` uses) counts a torch
step: the multiply-adds of every ``dot_general`` and convolution, forward, backward and rematerialised
recomputation alike, a ``scan`` body times its length, the larger branch of a ``cond``, a ``shard_map``
body once per device it runs on. Elementwise work is not counted (a few percent of a transformer's).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from jax.extend.core import ClosedJaxpr, Jaxpr

__all__ = ["MatmulFlops", "matmul_flops"]


class MatmulFlops(NamedTuple):
    """The FLOPs of a program's matrix products (2 per multiply-add), over all its devices, and whether the
    count is exact: False when a ``while`` loop (a trip count known only at run time) was counted once."""

    flops: float
    exact: bool


def matmul_flops(jaxpr: Jaxpr | ClosedJaxpr) -> MatmulFlops:
    """FLOPs of the matrix products of ``jaxpr`` (a traced step: ``jax.jit(f).trace(...).jaxpr``), global shapes."""
    inner = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    return _count(inner)


def _size(aval: Any) -> int:
    return math.prod(getattr(aval, "shape", ()))


def _inner(value: Any) -> Jaxpr | None:
    if isinstance(value, ClosedJaxpr):
        return value.jaxpr
    return value if isinstance(value, Jaxpr) else None


def _count(jaxpr: Jaxpr) -> MatmulFlops:
    total, exact = 0.0, True
    for eqn in jaxpr.eqns:
        name, params = eqn.primitive.name, eqn.params
        if name == "dot_general":
            lhs, rhs = (v.aval for v in eqn.invars)
            (_, rc), (_, rb) = params["dimension_numbers"]
            # 2 x (every lhs element) x (rhs's free dims): batch x M x K x N multiply-adds
            free = _size(rhs) // max(1, math.prod(rhs.shape[d] for d in (*rc, *rb)))
            total += 2.0 * _size(lhs) * free
            continue
        if name == "conv_general_dilated":
            rhs, out = eqn.invars[1].aval, eqn.outvars[0].aval
            spec = params["dimension_numbers"].rhs_spec  # (out features, in features, spatial...)
            total += 2.0 * _size(out) * _size(rhs) / max(1, rhs.shape[spec[0]])
            continue
        if name == "cond":
            counts = [_count(b.jaxpr) for b in params["branches"]]
            total += max(c.flops for c in counts)
            exact &= all(c.exact for c in counts)
            continue
        times = 1.0
        if name == "scan":
            times = float(params["length"])
        elif name == "while":
            exact = False  # the trip count is a run-time value: the body is counted once
        elif name == "shard_map":
            mesh = params["mesh"]
            manual = params.get("newly_manual_axes") or params.get("axis_names") or mesh.axis_names
            times = float(math.prod(dict(zip(mesh.axis_names, mesh.axis_sizes))[a] for a in manual))
        for key in ("jaxpr", "call_jaxpr", "fun_jaxpr", "body_jaxpr"):
            body = _inner(params.get(key))
            if body is not None:
                sub = _count(body)
                total += times * sub.flops
                exact &= sub.exact
                break
    return MatmulFlops(total, exact)
