"""Which attention kernel runs a call: the blockwise kernel, XLA's or cuDNN's fused one.

:func:`jaxlight.nn.attention` and the local part of the Ulysses and all-gather
exchanges call :func:`run_local`; the ring exchange needs the blockwise kernel
(its keys arrive block by block) and keeps it.

The fused kernels are :func:`jax.nn.dot_product_attention` with
``implementation="xla"`` or ``"cudnn"``. They keep ``jl.nn.attention``'s
guarantees: both take scores and the softmax in float32 and return ``q``'s
dtype; where they differ, this module makes up for it. A query row whose keys
are all masked out gets a uniform average of the values from XLA's kernel
(a large finite negative, not ``-inf``) and from cuDNN's (the mask becomes a
bias of the same kind): such rows are given every key before the call (so
the softmax stays finite) and their output is set to zero after it, which
also zeroes their gradients.

The automatic choice (``implementation=None``), :func:`choose`:

1. cuDNN's on an NVIDIA GPU when the inputs are bfloat16/float16 and within
   its limits (:func:`unsupported` says which);
2. XLA's on a GPU otherwise, while its float32 ``[batch, heads, T, S]``
   scores take at most :data:`XLA_SCORES_BYTES` (it keeps them whole);
3. the blockwise kernel everywhere else. On CPU it is as fast as XLA's up to
   512 positions (one block: the same computation) and faster beyond, where
   it skips causal blocks and XLA's kernel materializes every score
   (``benchmarks/attention_check.py``; docs/models.md has the table).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from jaxlight.strategies.attention_kernel import local_attention

__all__ = [
    "IMPLEMENTATIONS",
    "XLA_SCORES_BYTES",
    "AttentionImplementationError",
    "Implementation",
    "choose",
    "run_local",
    "unsupported",
]

Implementation = Literal["blockwise", "xla", "cudnn"]
IMPLEMENTATIONS: tuple[str, ...] = ("blockwise", "xla", "cudnn")
XLA_SCORES_BYTES = 1 << 30
"""GPU auto choice: XLA's kernel while its float32 scores ``B * H * T * S * 4`` bytes stay at most this."""
_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class AttentionImplementationError(ValueError):
    """``implementation=`` named a kernel that cannot run these inputs on this backend."""


def _cuda_capability() -> tuple[int, int] | None:
    """The first device's compute capability when the default backend is an NVIDIA GPU, else None."""
    dev = jax.devices()[0]
    cap = getattr(dev, "compute_capability", None)
    if dev.platform != "gpu" or not cap:
        return None
    try:  # NVIDIA: "9.0"; ROCm reports e.g. "gfx90a" (no cuDNN there)
        major, minor, *_ = (int(x) for x in str(cap).split("."))
    except ValueError:
        return None
    return major, minor


def unsupported(
    implementation: str, q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, mask: jax.Array | None
) -> str | None:
    """Why ``implementation`` cannot run this call (a sentence with the numbers), or None when it can."""
    if implementation == "blockwise":
        return None
    if not (q.dtype == k.dtype == v.dtype):
        return f"it takes q, k and v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if v.shape != k.shape:
        return f"it takes v of k's shape (one head_dim), got k {tuple(k.shape)} and v {tuple(v.shape)}"
    if implementation == "xla":
        return None
    cap = _cuda_capability()
    if cap is None:
        return f"cuDNN's fused attention needs an NVIDIA GPU; the default device is {jax.devices()[0].platform}"
    if q.dtype not in _HALF:
        return f"cuDNN's fused attention takes bfloat16 or float16 inputs, got {q.dtype}"
    d = q.shape[-1]
    d_max = 256 if cap >= (9, 0) else 128
    if d > d_max or d % 8:
        return f"cuDNN's fused attention takes a head_dim that is a multiple of 8 and at most {d_max}, got {d}"
    t, s = q.shape[1], k.shape[1]
    if causal and t != s:
        return f"a causal call with query length {t} != key length {s} (cuDNN aligns the diagonal differently)"
    if mask is not None and (t % 2 or s % 2):
        return f"with a mask (a bias to cuDNN) its lengths must be even, got query {t} and key {s}"
    return None


def choose(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool,
    mask: jax.Array | None,
    implementation: str | None = None,
) -> str:
    """The kernel that runs this call: ``implementation`` when it can (else :class:`AttentionImplementationError`
    naming why), or the module's automatic rule when it is None."""
    if implementation is not None:
        if implementation not in IMPLEMENTATIONS:
            raise AttentionImplementationError(
                f"attention: implementation={implementation!r} is not one of {IMPLEMENTATIONS} or None (automatic)"
            )
        why = unsupported(implementation, q, k, v, causal=causal, mask=mask)
        if why is not None:
            raise AttentionImplementationError(
                f"attention: implementation={implementation!r} cannot run q {tuple(q.shape)} {q.dtype}, "
                f"k {tuple(k.shape)}, v {tuple(v.shape)}: {why}. Pass implementation=None to let jaxlight choose"
            )
        return implementation
    if _cuda_capability() is not None:
        if unsupported("cudnn", q, k, v, causal=causal, mask=mask) is None:
            return "cudnn"
        scores = q.shape[0] * q.shape[2] * q.shape[1] * k.shape[1] * 4
        if scores <= XLA_SCORES_BYTES and unsupported("xla", q, k, v, causal=causal, mask=mask) is None:
            return "xla"
    return "blockwise"


def run_local(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool,
    mask: jax.Array | None,
    scale: float,
    implementation: str | None = None,
) -> jax.Array:
    """Attention of ``q`` against ``k``/``v`` held whole, on the kernel :func:`choose` picks.

    ``mask`` is 4-D (each dim full or 1); both sequences start at position 0.
    """
    impl = choose(q, k, v, causal=causal, mask=mask, implementation=implementation)
    if impl == "blockwise":
        return local_attention(q, k, v, causal=causal, mask=mask, scale=scale)
    return _fused(impl, q, k, v, causal=causal, mask=mask, scale=scale)


def _fused(impl: str, q, k, v, *, causal: bool, mask, scale: float) -> jax.Array:
    t, s = q.shape[1], k.shape[1]
    keep = None
    if mask is not None:
        allowed = mask
        if causal:
            allowed = allowed & jnp.tril(jnp.ones((t, s), bool))
        keep = allowed.any(axis=-1, keepdims=True)  # [B|1, H|1, T|1, 1]: the row sees some key
        mask = mask | ~keep  # an empty row attends everything (finite softmax); zeroed below
        if impl == "cudnn":  # cuDNN's bias needs the query and key lengths whole
            mask = jnp.broadcast_to(mask, mask.shape[:2] + (t, s))
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=causal, implementation=impl)
    if keep is not None:
        out = jnp.where(jnp.moveaxis(keep, 1, 2), out, jnp.zeros((), out.dtype))  # [B|1, T|1, H|1, 1]
    return out.astype(q.dtype)
