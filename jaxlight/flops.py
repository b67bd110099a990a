"""Matrix-product FLOPs of a traced program, loops counted as often as they run.

XLA's ``compiled.cost_analysis()`` counts the body of a loop once (jax 0.10.2, XLA:CPU and XLA:GPU): a
model whose layers are one scanned :class:`jaxlight.nn.LayerStack` (the demo's GPT) reports about one
layer's FLOPs, and its MFU reads ``layers`` times too low. :func:`matmul_flops` counts from the step's
jaxpr instead, as ``torch.utils.flop_counter`` (what Lightning's ``measure_flops`` uses) counts a torch
step: the multiply-adds of every ``dot_general`` and convolution, forward, backward and rematerialised
recomputation alike, a ``scan`` body times its length, the larger branch of a ``cond``, a ``shard_map``
body once per device it runs on. Elementwise work is not counted (a few percent of a transformer's).

cuDNN's fused attention (``jax.nn.dot_product_attention(implementation="cudnn")``) is one primitive, not
``dot_general`` products: :func:`_fused_attention_flops` counts its matrix products as torch's counter counts
``scaled_dot_product_attention``: ``Q K^T`` and ``P V`` forward (``2 B H T S (D + Dv)``), four products
backward (twice that), the full ``T x S`` square even for a causal call (as torch counts it; the kernel
skips about half of a causal square), no recomputation counted inside the backward kernel.
"""

from __future__ import annotations

import math
import re
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


# jax 0.10/0.11: dot_product_attention_{fwd,bwd}[_wrapper] and the fp8 twins (jax/_src/cudnn/fused_attention_stablehlo.py)
_FUSED_ATTENTION = re.compile(r"dot_product_attention.*_(fwd|bwd)")


def _fused_attention_flops(eqn: Any) -> float:
    """Matmul FLOPs of one cuDNN fused-attention primitive (q, k, v are its first three operands)."""
    q, k, v = (x.aval for x in eqn.invars[:3])
    layout = eqn.params.get("layout", 0)
    bnth = getattr(layout, "value", layout) == 1  # AttentionLayout.BNTH; 0 is BTNH
    b, h, t, d = q.shape if bnth else (q.shape[0], q.shape[2], q.shape[1], q.shape[3])
    s, dv = (k.shape[2], v.shape[3]) if bnth else (k.shape[1], v.shape[3])
    forward = 2.0 * b * h * t * s * (d + dv)
    return forward if "fwd" in eqn.primitive.name else 2.0 * forward


def _count(jaxpr: Jaxpr) -> MatmulFlops:
    total, exact = 0.0, True
    for eqn in jaxpr.eqns:
        name, params = eqn.primitive.name, eqn.params
        if _FUSED_ATTENTION.search(name):
            total += _fused_attention_flops(eqn)
            continue
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
