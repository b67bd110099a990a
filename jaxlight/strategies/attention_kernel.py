"""The exact blockwise attention kernel, and the switch that routes :func:`jaxlight.nn.attention` calls.

One kernel serves every path of ``jl.nn.attention``: an online softmax over
blocks of keys (running max and sum, as in flash attention) with a custom VJP
that recomputes the probabilities of each block in the backward pass from the
saved log-sum-exp, so neither direction keeps a ``[length, length]``
probability array as a residual, and causal blocks above the diagonal are
skipped. Keys/values come either from memory (the whole array, visited block
by block: :func:`local_attention`) or around a ring of devices (each step
passes the block on with ``ppermute``; the backward pass passes the
key/value gradients along with it and brings them home with one more step).
A call that fits in one block (short sequences) is a plain masked softmax
differentiated by JAX, which is as fast as the einsum it replaces.

It lives in the strategies layer because :class:`~jaxlight.strategies.SequenceParallel`'s
exchanges run it (ring plans) and install themselves with
:func:`attention_context`; ``jaxlight.nn.attention`` (the model-facing call, with
its argument checks) sits above and imports it, never the reverse.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "BLOCK",
    "MIN_BLOCK",
    "AttendFn",
    "BlockPlan",
    "active_attend",
    "attention_context",
    "block_size",
    "blockwise_attention",
    "local_attention",
    "make_plan",
]

_ctx = threading.local()

AttendFn = Callable[..., jax.Array]
"""``attend(q, k, v, *, causal, mask, scale, implementation) -> out``: what a sequence-parallel context runs
instead (``implementation``: the kernel ``jl.nn.attention`` was asked for, None for automatic)."""


@contextlib.contextmanager
def attention_context(attend: AttendFn | None) -> Iterator[None]:
    """Route every :func:`jaxlight.nn.attention` call traced inside to ``attend`` (None: the plain kernel).

    Strategies enter this from their ``trace_context``; model code never needs it.
    """
    prev = getattr(_ctx, "attend", None)
    _ctx.attend = attend
    try:
        yield
    finally:
        _ctx.attend = prev


def active_attend() -> AttendFn | None:
    """What :func:`attention_context` installed for this thread (None outside a sequence-parallel trace)."""
    return getattr(_ctx, "attend", None)


def local_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool,
    mask: jax.Array | None,
    scale: float,
) -> jax.Array:
    """Attention of ``q`` against keys/values held whole in memory, block by block (see :data:`BLOCK`).

    ``mask`` must already be 4-D (see :func:`jaxlight.nn.attention`). Both sequences start at position 0.
    """
    plan = make_plan(causal=causal, scale=scale, q_chunk=q.shape[1], kv_chunk=k.shape[1])
    return blockwise_attention(plan, q, k, v, mask, jnp.zeros((1,), jnp.int32))


# ----------------------------------------------------------------------------- the blockwise kernel
BLOCK = 512
"""Largest query/key block the kernel computes scores for at once (a block's scores are
``[batch, heads, BLOCK, BLOCK]`` float32); lengths that are not a multiple of a block
of at least :data:`MIN_BLOCK` rows run as one block."""
MIN_BLOCK = 64


def block_size(length: int, block: int | None = None) -> int:
    """The largest divisor of ``length`` that is at most ``block`` (default :data:`BLOCK`);
    ``length`` itself when no such divisor reaches :data:`MIN_BLOCK`."""
    block = BLOCK if block is None else block
    if length <= block:
        return length
    for b in range(block, min(MIN_BLOCK, block) - 1, -1):
        if length % b == 0:
            return b
    return length


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """Static description of one blockwise attention call (hashable: a custom_vjp static argument).

    Queries: the local rows are chunks of ``q_chunk`` rows; chunk ``a`` holds
    global positions ``q_ids[a] * q_chunk + [0, q_chunk)``.

    Keys/values are visited in ``n_steps`` steps of ``kv_per_step`` chunks of
    ``kv_chunk`` rows each:

    - ``ring_axis is None``: one step over ``k``/``v`` held whole (one chunk,
      positions from 0);
    - otherwise ``k``/``v`` are this device's block; step ``s`` holds the
      block of device ``(me - s) mod ring_size``, passed on with ``ppermute``
      after each step. Device ``j``'s block holds chunk ``j``
      (``zigzag=False``) or chunks ``j`` and ``2 * ring_size - 1 - j``
      (``zigzag=True``).

    Each (query chunk, key chunk) pair is computed in ``q_block`` x
    ``kv_block`` blocks. A causal block whose every key lies after every
    query is skipped with ``lax.cond``: exact (it contributes nothing), and
    where the layout spreads those blocks evenly (zig-zag) it evens the work.
    """

    causal: bool
    scale: float
    q_chunk: int
    kv_chunk: int
    q_block: int
    kv_block: int
    n_steps: int = 1
    kv_per_step: int = 1
    ring_axis: str | None = None
    ring_size: int = 1
    zigzag: bool = False

    def __post_init__(self) -> None:
        if self.q_chunk % self.q_block or self.kv_chunk % self.kv_block:
            raise ValueError(f"blocks must divide chunks: {self}")


def make_plan(*, causal: bool, scale: float, q_chunk: int, kv_chunk: int, **ring: Any) -> BlockPlan:
    """A :class:`BlockPlan` with blocks of at most :data:`BLOCK` rows."""
    return BlockPlan(
        causal=causal,
        scale=scale,
        q_chunk=q_chunk,
        kv_chunk=kv_chunk,
        q_block=block_size(q_chunk),
        kv_block=block_size(kv_chunk),
        **ring,
    )


def blockwise_attention(
    plan: BlockPlan,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    q_ids: jax.Array,
) -> jax.Array:
    """Run ``plan`` (see :class:`BlockPlan`): ``q`` is ``len(q_ids)`` chunks of local rows.

    ``mask`` (4-D, each dim full or 1) has rows in ``q``'s local order and
    columns by global key position.
    """
    if plan.ring_axis is None and q.shape[1] == plan.q_block and k.shape[1] == plan.kv_block:
        return _one_block(plan, q, k, v, mask, q_ids)
    return _flash(plan, q, k, v, mask, q_ids)


def _one_block(plan: BlockPlan, q, k, v, mask, q_ids):
    """A single block (short sequences): plain autodiff, keeping the probabilities for the backward
    pass (at most ``BLOCK x BLOCK`` per head) instead of recomputing them; same results as the kernel."""
    b, t, h, _ = q.shape
    qg, maskg, _, _ = _group(q, k, mask)
    s = _scores(plan, qg, k, _block_mask(plan, maskg, 0, q_ids[0] * plan.q_chunk, 0))
    mx = lax.stop_gradient(s.max(axis=-1, keepdims=True))  # any finite shift gives the same softmax
    p = jnp.exp(s - jnp.where(mx == -jnp.inf, 0.0, mx))
    total = p.sum(axis=-1)
    o = _dot_f32("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v)
    o = o / jnp.moveaxis(jnp.where(total > 0, total, 1.0), -1, 1)[..., None]  # all-masked rows: 0
    return o.reshape(b, t, h, v.shape[-1]).astype(q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dot_f32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """``einsum(spec, a, b)`` accumulated and returned in float32, whose backward multiplies in the operands'
    dtype: the float32 cotangent is rounded to it first (as the kernel's own backward does), so under bf16
    the single-block path's gradients are bf16 matmuls too, not float32 x bf16 ones."""
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _dot_f32_fwd(spec: str, a: jax.Array, b: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return _dot_f32(spec, a, b), (a, b)


def _dot_f32_bwd(spec: str, res: tuple[jax.Array, jax.Array], ct: jax.Array) -> tuple[jax.Array, jax.Array]:
    a, b = res
    ct = ct.astype(jnp.result_type(a, b))
    # each operand's gradient alone (a vjp would put the unused forward product in the jaxpr too)
    (da,) = jax.linear_transpose(lambda x: jnp.einsum(spec, x, b), a)(ct)
    (db,) = jax.linear_transpose(lambda y: jnp.einsum(spec, a, y), b)(ct)
    return da, db


_dot_f32.defvjp(_dot_f32_fwd, _dot_f32_bwd)


def _vary_like(x: Any, ref: jax.Array) -> Any:
    """Mark ``x`` varying over the manual mesh axes ``ref`` varies over (loop carries inside shard_map)."""
    axes = tuple(sorted(_varying(ref)))
    if not axes:
        return x

    def cast(leaf):
        missing = tuple(a for a in axes if a not in _varying(leaf))
        return lax.pcast(leaf, missing, to="varying") if missing else leaf

    return jax.tree.map(cast, x)


def _varying(x: Any) -> frozenset:
    return frozenset(getattr(getattr(jax.typeof(x), "mat", None), "varying", ()) or ())


def _sum_like(grad: jax.Array, primal: jax.Array) -> jax.Array:
    """Sum a gradient over the manual axes its primal does not vary over (an input every device shares,
    e.g. keys/values that entered a shard_map whole, gets the sum of every device's contribution)."""
    extra = tuple(sorted(_varying(grad) - _varying(primal)))
    return lax.psum(grad, extra) if extra else grad


def _kv_ids(plan: BlockPlan, step: jax.Array | int) -> list[jax.Array | int]:
    """Global chunk ids of the key/value chunks visited at ``step``."""
    if plan.ring_axis is None:
        return [0]
    n = plan.ring_size
    src = (lax.axis_index(plan.ring_axis) - step) % n
    return [src, 2 * n - 1 - src] if plan.zigzag else [src]


def _needed(plan: BlockPlan, q0, nq: int, k0) -> Any:
    """Whether the causal block of ``nq`` queries from position ``q0`` and keys from ``k0`` allows anything."""
    return q0 + nq - 1 >= k0


def _maybe(pred: Any, fn: Callable[[Any], Any], carry: Any) -> Any:
    if pred is None:
        return fn(carry)
    if isinstance(pred, bool):
        return fn(carry) if pred else carry
    return lax.cond(pred, fn, lambda c: c, carry)


def _loop(n: int, body: Callable[[Any, Any], Any], carry: Any) -> Any:
    if n == 1:
        return body(0, carry)
    return lax.fori_loop(0, n, body, carry)


def _sl(x: jax.Array, start: Any, size: int, axis: int) -> jax.Array:
    if x.shape[axis] == size:
        return x
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _put(x: jax.Array, part: jax.Array, start: Any, axis: int) -> jax.Array:
    if x.shape[axis] == part.shape[axis]:
        return part
    return lax.dynamic_update_slice_in_dim(x, part, start, axis=axis)


def _block_mask(plan: BlockPlan, mask: jax.Array | None, qr: Any, q0: Any, k0: Any) -> jax.Array | None:
    """Boolean mask of one block: ``qr`` = the block's first local row in the chunk's mask rows,
    ``q0``/``k0`` = global positions of its first query/key."""
    out = None
    if mask is not None:  # [B|1, Hk|1, G|1, rows|1, S|1]
        m = mask if mask.shape[3] == 1 else _sl(mask, qr, plan.q_block, 3)
        m = m if m.shape[4] == 1 else lax.dynamic_slice_in_dim(m, k0, plan.kv_block, axis=4)
        out = m
    if plan.causal:
        qpos = q0 + jnp.arange(plan.q_block)
        kpos = k0 + jnp.arange(plan.kv_block)
        c = qpos[:, None] >= kpos[None, :]
        out = c if out is None else out & c
    return out


def _scores(plan: BlockPlan, qb: jax.Array, kb: jax.Array, m: jax.Array | None) -> jax.Array:
    s = _dot_f32("bqhgd,bkhd->bhgqk", qb, kb) * plan.scale
    if m is not None:
        s = jnp.where(m, s, -jnp.inf)
    return s


def _fwd_block(plan: BlockPlan, state, qb, kb, vb, m):
    """Fold one key/value block into a query block's running (o, max, sum)."""
    o, mx, total = state
    s = _scores(plan, qb, kb, m)
    mx_new = jnp.maximum(mx, s.max(axis=-1))
    safe = jnp.where(mx_new == -jnp.inf, 0.0, mx_new)
    p = jnp.exp(s - safe[..., None])
    alpha = jnp.exp(mx - safe)
    total = alpha * total + p.sum(axis=-1)
    pv = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
    o = jnp.moveaxis(alpha, -1, 1)[..., None] * o + pv
    return o, mx_new, total


def _bwd_block(plan: BlockPlan, grads, qb, kb, vb, m, dob, lseb, deltab):
    """Gradients of one block from the saved log-sum-exp, added to (dq, dk, dv)."""
    dq, dk, dv = grads
    s = _scores(plan, qb, kb, m)
    p = jnp.exp(s - lseb[..., None])  # masked entries: exp(-inf) = 0; an all-masked row has lse = +inf
    dv = dv + jnp.einsum("bhgqk,bqhgd->bkhd", p.astype(dob.dtype), dob, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bqhgd,bkhd->bhgqk", dob, vb, preferred_element_type=jnp.float32)
    ds = p * (dp - deltab[..., None]) * plan.scale
    dq = dq + jnp.einsum("bhgqk,bkhd->bqhgd", ds.astype(kb.dtype), kb, preferred_element_type=jnp.float32)
    dk = dk + jnp.einsum("bhgqk,bqhgd->bkhd", ds.astype(qb.dtype), qb, preferred_element_type=jnp.float32)
    return dq, dk, dv


def _fwd_pair(plan: BlockPlan, state, qa, ma, q_id, kb, vb, kv_id):
    """One (query chunk, key chunk) pair, block by block: query blocks outside, key blocks inside."""
    nqb, nkb = plan.q_chunk // plan.q_block, plan.kv_chunk // plan.kv_block
    qc0, kc0 = q_id * plan.q_chunk, kv_id * plan.kv_chunk

    def q_body(i, st):
        r = i * plan.q_block
        qi = _sl(qa, r, plan.q_block, 1)
        sub = (_sl(st[0], r, plan.q_block, 1), _sl(st[1], r, plan.q_block, 3), _sl(st[2], r, plan.q_block, 3))
        q0 = qc0 + r

        def k_body(j, sub):
            c = j * plan.kv_block
            k0 = kc0 + c
            kj, vj = _sl(kb, c, plan.kv_block, 1), _sl(vb, c, plan.kv_block, 1)
            fn = lambda x: _fwd_block(plan, x, qi, kj, vj, _block_mask(plan, ma, r, q0, k0))
            return _maybe(_needed(plan, q0, plan.q_block, k0) if plan.causal else None, fn, sub)

        sub = _loop(nkb, k_body, sub)
        return (_put(st[0], sub[0], r, 1), _put(st[1], sub[1], r, 3), _put(st[2], sub[2], r, 3))

    return _loop(nqb, q_body, state)


def _bwd_pair(plan: BlockPlan, grads, qa, ma, q_id, doa, lsea, dela, kb, vb, kv_id):
    """Gradients of one pair, block by block: key blocks outside (their dk/dv stay in registers), query blocks inside."""
    nqb, nkb = plan.q_chunk // plan.q_block, plan.kv_chunk // plan.kv_block
    qc0, kc0 = q_id * plan.q_chunk, kv_id * plan.kv_chunk

    def k_body(j, gr):
        dq, dk, dv = gr
        c = j * plan.kv_block
        k0 = kc0 + c
        kj, vj = _sl(kb, c, plan.kv_block, 1), _sl(vb, c, plan.kv_block, 1)
        dkj, dvj = _sl(dk, c, plan.kv_block, 1), _sl(dv, c, plan.kv_block, 1)

        def q_body(i, inner):
            dq, dkj, dvj = inner
            r = i * plan.q_block
            q0 = qc0 + r
            qi, doi = _sl(qa, r, plan.q_block, 1), _sl(doa, r, plan.q_block, 1)
            lsei, deli = _sl(lsea, r, plan.q_block, 3), _sl(dela, r, plan.q_block, 3)

            def fn(x):
                dqi, dkj, dvj = x
                dqi, dkj, dvj = _bwd_block(
                    plan, (dqi, dkj, dvj), qi, kj, vj, _block_mask(plan, ma, r, q0, k0), doi, lsei, deli
                )
                return dqi, dkj, dvj

            dqi = _sl(dq, r, plan.q_block, 1)
            dqi, dkj, dvj = _maybe(_needed(plan, q0, plan.q_block, k0) if plan.causal else None, fn, (dqi, dkj, dvj))
            return _put(dq, dqi, r, 1), dkj, dvj

        dq, dkj, dvj = _loop(nqb, q_body, (dq, dkj, dvj))
        return dq, _put(dk, dkj, c, 1), _put(dv, dvj, c, 1)

    return _loop(nkb, k_body, grads)


def _group(q: jax.Array, k: jax.Array, mask: jax.Array | None):
    """Queries as ``[B, T, Hk, G, D]`` (G query heads per key/value head); the mask to match."""
    b, t, h, d = q.shape
    hk = k.shape[2]
    g = h // hk
    if mask is not None:
        mb, mh, mt, ms = mask.shape
        mask = mask.reshape(mb, hk, g, mt, ms) if mh > 1 else mask.reshape(mb, 1, 1, mt, ms)
    return q.reshape(b, t, hk, g, d), mask, hk, g


def _ring_next(plan: BlockPlan, x: Any) -> Any:
    n = plan.ring_size
    perm = [(j, (j + 1) % n) for j in range(n)]
    return jax.tree.map(lambda a: lax.ppermute(a, plan.ring_axis, perm), x)


def _chunks(plan: BlockPlan, x: jax.Array, axis: int, size: int, n: int) -> list[jax.Array]:
    return [lax.slice_in_dim(x, a * size, (a + 1) * size, axis=axis) for a in range(n)] if n > 1 else [x]


def _cat(xs: list[jax.Array], axis: int) -> jax.Array:
    return jnp.concatenate(xs, axis=axis) if len(xs) > 1 else xs[0]


def _forward(plan: BlockPlan, q, k, v, mask, q_ids):
    b, t, h, _ = q.shape
    dv_ = v.shape[-1]
    qg, maskg, hk, g = _group(q, k, mask)
    n_q = t // plan.q_chunk
    qa = _chunks(plan, qg, 1, plan.q_chunk, n_q)
    ma = [None] * n_q if maskg is None or maskg.shape[3] == 1 else _chunks(plan, maskg, 3, plan.q_chunk, n_q)
    if maskg is not None and maskg.shape[3] == 1:
        ma = [maskg] * n_q
    init = [
        (
            jnp.zeros((b, plan.q_chunk, hk, g, dv_), jnp.float32),
            jnp.full((b, hk, g, plan.q_chunk), -jnp.inf, jnp.float32),
            jnp.zeros((b, hk, g, plan.q_chunk), jnp.float32),
        )
        for _ in range(n_q)
    ]
    init = _vary_like(init, q)

    def visit(states, step, kblk, vblk):
        out = []
        for a in range(n_q):
            st = states[a]
            for j, kv_id in enumerate(_kv_ids(plan, step)):
                kb = lax.slice_in_dim(kblk, j * plan.kv_chunk, (j + 1) * plan.kv_chunk, axis=1)
                vb = lax.slice_in_dim(vblk, j * plan.kv_chunk, (j + 1) * plan.kv_chunk, axis=1)
                fn = lambda x, a=a, kb=kb, vb=vb, kv_id=kv_id: _fwd_pair(plan, x, qa[a], ma[a], q_ids[a], kb, vb, kv_id)
                pred = (
                    _needed(plan, q_ids[a] * plan.q_chunk, plan.q_chunk, kv_id * plan.kv_chunk) if plan.causal else None
                )
                st = _maybe(pred, fn, st)
            out.append(st)
        return out

    states = visit(init, 0, k, v)
    if plan.ring_axis is not None and plan.n_steps > 1:

        def body(carry, step):
            states, kblk, vblk = carry
            kblk, vblk = _ring_next(plan, (kblk, vblk))
            return (visit(states, step, kblk, vblk), kblk, vblk), None

        (states, _, _), _ = lax.scan(body, (states, k, v), jnp.arange(1, plan.n_steps, dtype=jnp.int32))

    outs, lses = [], []
    for o, mx, total in states:
        has = total > 0
        safe_l = jnp.where(has, total, 1.0)
        outs.append(o / jnp.moveaxis(safe_l, -1, 1)[..., None])
        mx_safe = jnp.where(mx == -jnp.inf, 0.0, mx)
        # an all-masked row gets lse = +inf, so the backward pass's exp(s - lse) is 0 there
        lses.append(jnp.where(has, mx_safe + jnp.log(safe_l), jnp.inf))
    return _cat(outs, 1).reshape(b, t, h, dv_).astype(q.dtype), _cat(lses, 3)


def _backward(plan: BlockPlan, res, dout):
    q, k, v, mask, q_ids, out, lse = res
    b, t, h, d = q.shape
    dv_ = v.shape[-1]
    qg, maskg, hk, g = _group(q, k, mask)
    n_q = t // plan.q_chunk
    dog = dout.astype(jnp.float32).reshape(b, t, hk, g, dv_)
    og = out.astype(jnp.float32).reshape(b, t, hk, g, dv_)
    delta = jnp.moveaxis((dog * og).sum(-1), 1, -1)  # [b, hk, g, t]: rowsum(dO * O)
    dog = dog.astype(v.dtype)
    qa = _chunks(plan, qg, 1, plan.q_chunk, n_q)
    doa = _chunks(plan, dog, 1, plan.q_chunk, n_q)
    lsea = _chunks(plan, lse, 3, plan.q_chunk, n_q)
    dela = _chunks(plan, delta, 3, plan.q_chunk, n_q)
    ma = [None] * n_q if maskg is None or maskg.shape[3] == 1 else _chunks(plan, maskg, 3, plan.q_chunk, n_q)
    if maskg is not None and maskg.shape[3] == 1:
        ma = [maskg] * n_q
    dq0 = _vary_like([jnp.zeros((b, plan.q_chunk, hk, g, d), jnp.float32) for _ in range(n_q)], q)
    kv_rows = plan.kv_per_step * plan.kv_chunk
    dk0 = _vary_like(jnp.zeros((b, kv_rows, hk, d), jnp.float32), k)
    dv0 = _vary_like(jnp.zeros((b, kv_rows, hk, dv_), jnp.float32), v)

    def visit(dqs, step, kblk, vblk, dkblk, dvblk):
        dqs = list(dqs)
        dks, dvs = [], []
        for j, kv_id in enumerate(_kv_ids(plan, step)):
            sl = lambda x, j=j: lax.slice_in_dim(x, j * plan.kv_chunk, (j + 1) * plan.kv_chunk, axis=1)
            kb, vb, dk, dv = sl(kblk), sl(vblk), sl(dkblk), sl(dvblk)
            for a in range(n_q):

                def fn(x, a=a, kb=kb, vb=vb, kv_id=kv_id):
                    return _bwd_pair(plan, x, qa[a], ma[a], q_ids[a], doa[a], lsea[a], dela[a], kb, vb, kv_id)

                pred = (
                    _needed(plan, q_ids[a] * plan.q_chunk, plan.q_chunk, kv_id * plan.kv_chunk) if plan.causal else None
                )
                dqs[a], dk, dv = _maybe(pred, fn, (dqs[a], dk, dv))
            dks.append(dk)
            dvs.append(dv)
        return dqs, _cat(dks, 1), _cat(dvs, 1)

    dqs, dk, dv = visit(dq0, 0, k, v, dk0, dv0)
    if plan.ring_axis is not None and plan.n_steps > 1:

        def body(carry, step):
            dqs, kblk, vblk, dk, dv = carry
            kblk, vblk, dk, dv = _ring_next(plan, (kblk, vblk, dk, dv))
            dqs, dk, dv = visit(dqs, step, kblk, vblk, dk, dv)
            return (dqs, kblk, vblk, dk, dv), None

        (dqs, _, _, dk, dv), _ = lax.scan(body, (dqs, k, v, dk, dv), jnp.arange(1, plan.n_steps, dtype=jnp.int32))
        # the gradients now held belong to the block of the next device: one more step brings them home
        dk, dv = _ring_next(plan, (dk, dv))
    dq = _cat(dqs, 1).reshape(q.shape).astype(q.dtype)
    return _sum_like(dq, q), _sum_like(dk.astype(k.dtype), k), _sum_like(dv.astype(v.dtype), v), None, None


def _flash_fwd(plan: BlockPlan, q, k, v, mask, q_ids):
    out, lse = _forward(plan, q, k, v, mask, q_ids)
    return out, (q, k, v, mask, q_ids, out, lse)


def _flash_bwd(plan: BlockPlan, res, dout):
    return _backward(plan, res, dout)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(plan: BlockPlan, q, k, v, mask, q_ids):
    return _forward(plan, q, k, v, mask, q_ids)[0]


_flash.defvjp(_flash_fwd, _flash_bwd)
