"""Matrix-product FLOPs of a traced program, loops counted as often as they run.

XLA's ``compiled.cost_analysis()`` counts the body of a loop once (jax 0.10.2, XLA:CPU and XLA:GPU): a
model whose layers are one scanned :class:`jaxlight.nn.LayerStack` (the demo's GPT) reports about one
layer's FLOPs, and its MFU reads ``layers`` times too low. :func:`matmul_flops` counts from the step's
jaxpr instead, as ``torch.utils.flop_counter`` (what Lightning's ``measure_flops`` uses) counts a torch
step: the multiply-adds of every ``dot_general`` and convolution, forward, backward and rematerialised
recomputation alike, a ``scan`` body times its length, the larger branch of a ``cond``, a ``shard_map``
body once per device it runs on. Elementwise work is not counted (a few percent of a transformer's).

:func:`matmul_dtypes` counts the same FLOPs by the dtypes of each product's operands, and names where the
products with a float32 operand come from (the Linen module path of the jaxpr's name stack, and the
user's source line JAX records for every equation, backward ones included): what a half-precision
policy is checked against.

cuDNN's fused attention (``jax.nn.dot_product_attention(implementation="cudnn")``) is one primitive, not
``dot_general`` products: :func:`_fused_attention_flops` counts its matrix products as torch's counter counts
``scaled_dot_product_attention``: ``Q K^T`` and ``P V`` forward (``2 B H T S (D + Dv)``), four products
backward (twice that), the full ``T x S`` square even for a causal call (as torch counts it; the kernel
skips about half of a causal square), no recomputation counted inside the backward kernel.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, NamedTuple

import numpy as np
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, Jaxpr

__all__ = ["MatmulDtypes", "MatmulFlops", "matmul_dtypes", "matmul_flops"]


class MatmulFlops(NamedTuple):
    """The FLOPs of a program's matrix products (2 per multiply-add), over all its devices, and whether the
    count is exact: False when a ``while`` loop (a trip count known only at run time) was counted once."""

    flops: float
    exact: bool


class MatmulDtypes(NamedTuple):
    """:class:`MatmulFlops` split by operand dtypes.

    ``by_dtype``: ``{(lhs dtype, rhs dtype): FLOPs}`` by dtype name (``("bfloat16", "bfloat16")``), summing to
    ``flops``. ``float32_sites``: ``{where: FLOPs}`` of the products with an operand of 32 or more bits of
    float, where ``where`` is ``"Linen/module/path at file:line:col (function)"`` or just the source line
    (NNX and Equinox push no module names), largest first."""

    flops: float
    exact: bool
    by_dtype: dict[tuple[str, str], float]
    float32_sites: dict[str, float]

    @property
    def half_fraction(self) -> float:
        """The share of the FLOPs whose two operands are 16-bit floats (bf16 or fp16); 0 for no FLOPs."""
        half = sum(f for (a, b), f in self.by_dtype.items() if _half(a) and _half(b))
        return half / self.flops if self.flops else 0.0

    @property
    def float32_fraction(self) -> float:
        """The share of the FLOPs with an operand of 32 or more bits of float; 0 for no FLOPs."""
        return sum(self.float32_sites.values()) / self.flops if self.flops else 0.0


def matmul_flops(jaxpr: Jaxpr | ClosedJaxpr) -> MatmulFlops:
    """FLOPs of the matrix products of ``jaxpr`` (a traced step: ``jax.jit(f).trace(...).jaxpr``), global shapes."""
    inner = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    return _count(inner)


def matmul_dtypes(jaxpr: Jaxpr | ClosedJaxpr) -> MatmulDtypes:
    """:func:`matmul_flops` of ``jaxpr`` by operand dtypes, with the sources of the float32 products."""
    inner = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    tally = _Tally({}, {})
    count = _count(inner, tally)
    sites = dict(sorted(tally.sites.items(), key=lambda kv: -kv[1]))
    return MatmulDtypes(count.flops, count.exact, tally.by_dtype, sites)


class _Tally(NamedTuple):
    by_dtype: dict[tuple[str, str], float]
    sites: dict[str, float]

    def add(self, eqn: Any, flops: float, times: float) -> None:
        lhs, rhs = (np.dtype(v.aval.dtype).name for v in eqn.invars[:2])
        self.by_dtype[(lhs, rhs)] = self.by_dtype.get((lhs, rhs), 0.0) + flops * times
        if _wide(lhs) or _wide(rhs):
            where = _where(eqn)
            self.sites[where] = self.sites.get(where, 0.0) + flops * times


def _half(name: str) -> bool:
    return name in ("bfloat16", "float16")


def _wide(name: str) -> bool:
    dt = np.dtype(name)
    return dt.kind in "fc" and dt.itemsize >= 4


#: jaxlight's own frames (adapters, kernels) are skipped when naming where a product comes from
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _where(eqn: Any) -> str:
    # the innermost frame of the user's code: JAX skips its own and flax's frames, this jaxlight's
    frames = source_info_util.summarize(eqn.source_info, num_frames=20).splitlines()[::-1]
    line = next((f for f in frames if not f.startswith(_PACKAGE)), frames[0] if frames else "unknown")
    # the name stack without JAX's transformations: "transpose(jvp(Net))/Dense_0" -> "Net/Dense_0"
    scope = re.sub(r"\w+\(|\)", "", str(eqn.source_info.name_stack))
    return f"{scope} at {line}" if scope else line


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


def _count(jaxpr: Jaxpr, tally: _Tally | None = None, times_outer: float = 1.0) -> MatmulFlops:
    """``tally`` (with ``times_outer``, how often this jaxpr runs): also count each product by dtype there."""
    total, exact = 0.0, True
    for eqn in jaxpr.eqns:
        name, params = eqn.primitive.name, eqn.params
        if _FUSED_ATTENTION.search(name):
            flops = _fused_attention_flops(eqn)
            total += flops
            if tally is not None:  # q and k are its first operands, as a product's lhs and rhs
                tally.add(eqn, flops, times_outer)
            continue
        if name == "dot_general":
            lhs, rhs = (v.aval for v in eqn.invars)
            (_, rc), (_, rb) = params["dimension_numbers"]
            # 2 x (every lhs element) x (rhs's free dims): batch x M x K x N multiply-adds
            free = _size(rhs) // max(1, math.prod(rhs.shape[d] for d in (*rc, *rb)))
            flops = 2.0 * _size(lhs) * free
            total += flops
            if tally is not None:
                tally.add(eqn, flops, times_outer)
            continue
        if name == "conv_general_dilated":
            rhs, out = eqn.invars[1].aval, eqn.outvars[0].aval
            spec = params["dimension_numbers"].rhs_spec  # (out features, in features, spatial...)
            flops = 2.0 * _size(out) * _size(rhs) / max(1, rhs.shape[spec[0]])
            total += flops
            if tally is not None:
                tally.add(eqn, flops, times_outer)
            continue
        if name == "cond":
            counts = [_count(b.jaxpr) for b in params["branches"]]
            if tally is not None:  # the dtypes of the larger branch, whose FLOPs are counted
                larger = max(range(len(counts)), key=lambda i: counts[i].flops)
                _count(params["branches"][larger].jaxpr, tally, times_outer)
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
                sub = _count(body, tally, times_outer * times)
                total += times * sub.flops
                exact &= sub.exact
                break
    return MatmulFlops(total, exact)
