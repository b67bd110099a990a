"""Exact scaled dot-product attention that a strategy can run sequence-parallel.

``attention(q, k, v, causal=..., mask=..., scale=...)`` is the one call a model
makes for attention. Outside a trainer step, or when the strategy does not
split positions, it is ordinary exact attention on whatever devices GSPMD
places it. Under :class:`jaxlight.strategies.SequenceParallel` the trainer
enters a context while it traces the step, and the same call runs one of the
strategy's exchanges instead (Ulysses all-to-all, all-gather of keys/values,
or a ring), with the same result up to float rounding.

The kernel is the blockwise one, :mod:`jaxlight.strategies.attention_kernel`
(online softmax over blocks of keys with a recomputing custom VJP; its block
size is ``attention_kernel.BLOCK``), or a fused one where it is faster
(XLA's or cuDNN's :func:`jax.nn.dot_product_attention`), as
:mod:`jaxlight.strategies.attention_backends` chooses; the ring exchange
always runs the blockwise kernel. This module holds only the model-facing
call and its argument checks.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp

from jaxlight.strategies.attention_backends import Implementation, run_local
from jaxlight.strategies.attention_kernel import active_attend

__all__ = ["attention"]


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    mask: jax.Array | None = None,
    scale: float | None = None,
    implementation: Implementation | None = None,
) -> jax.Array:
    """Exact multi-head attention, ``softmax(scale * q k^T + masking) v``.

    Shapes follow :func:`jax.nn.dot_product_attention`: ``q`` is
    ``[batch, length, heads, head_dim]``, ``k`` and ``v`` are
    ``[batch, kv_length, kv_heads, head_dim]`` (``v`` may have its own
    head_dim). ``kv_heads`` must divide ``heads`` (grouped-query attention:
    query head ``h`` reads key/value head ``h // (heads // kv_heads)``).

    - ``causal``: query ``i`` sees keys ``j <= i`` (positions counted from the
      start of both sequences, as in :func:`jax.nn.dot_product_attention`).
    - ``mask``: boolean, True where a query may attend a key, broadcastable to
      ``[batch, heads, length, kv_length]`` with each dimension either full or
      1 (a key padding mask is ``pad[:, None, None, :]``). Combined with
      ``causal`` by AND.
    - ``scale``: multiplies the scores; default ``1 / sqrt(head_dim)``.
    - ``implementation``: the kernel. ``"blockwise"`` (jaxlight's, any
      dtype and head_dim, what the sequence-parallel ring runs), ``"xla"``
      (:func:`jax.nn.dot_product_attention`'s XLA kernel: q, k, v of one
      dtype and one head_dim), ``"cudnn"`` (cuDNN's fused kernel: an NVIDIA
      GPU, bfloat16/float16, head_dim a multiple of 8 up to 128, 256 from
      Hopper on) or None: cuDNN's where it runs, XLA's on other GPU calls
      whose float32 scores fit 1 GiB, else the blockwise kernel (docs/models.md
      has the rule and its measurements). A named kernel that cannot run the
      call raises :class:`~jaxlight.strategies.attention_backends.AttentionImplementationError`
      saying why, with the numbers; it is never replaced silently.

    Guarantees: scores and the softmax are computed in float32 whatever the
    input dtype, the output has ``q``'s dtype, and a query row whose keys are
    all masked out gets zeros (and zero gradients), never NaN. Under a
    sequence-parallel strategy the result equals this one up to float
    rounding, on every path. These hold on every kernel (the fused ones compute
    the same function; their results differ from the blockwise kernel's by
    float rounding only).
    """
    _check_args(q, k, v, mask, scale)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    mask = _normalize_mask(mask, q, k)
    attend = active_attend()
    args = dict(causal=bool(causal), mask=mask, scale=float(scale), implementation=implementation)
    if attend is not None:
        return attend(q, k, v, **args)
    return run_local(q, k, v, **args)


# ----------------------------------------------------------------------------- argument checks
def _check_args(q: Any, k: Any, v: Any, mask: Any, scale: Any) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(
                f"attention: {name} must be [batch, length, heads, head_dim], got shape {getattr(x, 'shape', None)}"
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"attention: {name} must be floating point, got {x.dtype}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"attention: k {k.shape} and v {v.shape} differ in batch, kv_length or kv_heads")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"attention: q batch {q.shape[0]} differs from k/v batch {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"attention: q head_dim {q.shape[3]} differs from k head_dim {k.shape[3]}")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(
            f"attention: query heads {q.shape[2]} are not a multiple of key/value heads {k.shape[2]} "
            "(grouped-query attention needs heads % kv_heads == 0)"
        )
    if scale is not None and (not isinstance(scale, numbers.Real) or isinstance(scale, bool)):
        raise TypeError(f"attention: scale must be a number (static), got {type(scale).__name__}")
    if mask is not None:
        if getattr(mask, "dtype", None) != jnp.bool_:
            raise TypeError(
                f"attention: mask must be boolean (True = attend), got dtype {getattr(mask, 'dtype', type(mask))}"
            )


def _normalize_mask(mask: jax.Array | None, q: jax.Array, k: jax.Array) -> jax.Array | None:
    """The mask as 4-D ``[B|1, H|1, T|1, S|1]`` (each dim full or 1)."""
    if mask is None:
        return None
    full = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    if mask.ndim != 4 or any(m not in (1, f) for m, f in zip(mask.shape, full)):
        raise ValueError(
            f"attention: mask shape {tuple(mask.shape)} must be 4-D and broadcastable to "
            f"[batch, heads, length, kv_length] = {list(full)} with each dim full or 1 "
            "(a key padding mask [batch, kv_length] is pad[:, None, None, :])"
        )
    return mask
