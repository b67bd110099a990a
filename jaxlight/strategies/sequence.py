"""Sequence parallelism: token positions split over the ``sequence`` mesh axis.

:class:`SequenceParallel` sets the ``sequence`` axis, splits the length
dimension of batch leaves over it (the default rules already map activations
named ``length`` there), and while the trainer traces a step it routes every
:func:`jaxlight.nn.attention` call to one of three exact exchanges, each a
``jax.shard_map`` that is manual over ``sequence`` only (batch rows, heads
and widths stay with GSPMD):

- ``"ulysses"``: all-to-all trading each device's positions for a slice of
  the heads, whole-sequence attention on those heads, all-to-all back;
- ``"allgather"``: keys/values all-gathered beside the device's own queries;
- ``"ring"``: keys/values passed around the devices with ``ppermute`` and
  merged with an online softmax; no device holds the whole keys/values, in
  either direction of the step.

With ``load_balance=True`` a causal all-gather or ring call first moves the
positions into zig-zag order (device ``i`` holds chunks ``i`` and
``2N - 1 - i`` of ``2N``) with two ``ppermute`` s per tensor, so skipping the
fully masked blocks saves the same work on every device, and moves the output
back. The reorder happens inside each attention call, so model code (learned
position embeddings, losses, logged values) sees positions in their order.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import logging
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxlight.rank_zero import rank_zero_info
from jaxlight.strategies.attention_backends import AttentionImplementationError, choose, run_local
from jaxlight.strategies.attention_kernel import attention_context, blockwise_attention, make_plan
from jaxlight.strategies.strategy import FILL, FrozenDict, Piece, check_axis_size, register_strategy

log = logging.getLogger(__name__)

MODES = ("auto", "ulysses", "allgather", "ring")
AXIS = "sequence"

__all__ = ["MODES", "SequenceParallel", "attention_plan", "in_manual_sequence"]


@dataclasses.dataclass(frozen=True)
class SequenceParallel(Piece):
    """Split every sequence's positions over ``size`` devices (the ``sequence`` mesh axis).

    - ``size``: devices on the ``sequence`` axis; None takes every device the
      other axes leave, or 2 when composed with an FSDP that takes them
      (``"fsdp+sp"``); pass ``size=`` for more.
    - ``mode``: the exchange each :func:`jaxlight.nn.attention` call runs:
      ``"ulysses"`` (needs query and key/value heads divisible by
      tensor x sequence), ``"allgather"`` (any head count, any key length),
      ``"ring"`` (any head count; no device holds the whole keys/values), or
      ``"auto"``: Ulysses where the heads allow it, otherwise all-gather. The
      choices are printed when a step is traced, once per distinct plan (or
      logged to ``jaxlight.strategies.sequence`` when logging is configured).
    - ``load_balance``: causal all-gather and ring calls reorder positions
      zig-zag so every device does the same work (length must divide by
      2 x sequence; the error gives the numbers). Ulysses needs no balancing.
    - ``batch_dims``: which batch leaves carry a length dimension, as
      ``{path_pattern: dim}`` (fnmatch patterns over "/"-joined key paths such
      as ``"tokens"``, ``"0"``, ``"inputs/ids"``; ``dim=None`` keeps a leaf
      whole). Given, it is the complete list: other leaves stay whole.
      Default (None): every rank-2 leaf ``[batch, length]`` (token ids,
      labels, masks) is split on dim 1; leaves of any other rank (images
      ``[B, H, W, C]``, features ``[B, T, F]``) stay whole unless declared.

    Guarantees: losses, gradients and logged values equal a one-device run
    up to float rounding. Every attention call is exact on every path.
    """

    name: ClassVar[str] = "sp"
    size: int | None = None
    mode: str = "auto"
    load_balance: bool = True
    batch_dims_: Mapping[str, int | None] | None = None

    def __init__(
        self,
        size: int | None = None,
        mode: str = "auto",
        load_balance: bool = True,
        *,
        batch_dims: Mapping[str, int | None] | None = None,
    ) -> None:
        check_axis_size("SequenceParallel", size)
        if mode not in MODES:
            raise ValueError(f"SequenceParallel mode must be one of {MODES}, got {mode!r}")
        if not isinstance(load_balance, bool):
            raise TypeError(f"SequenceParallel load_balance must be a bool, got {load_balance!r}")
        dims = None
        if batch_dims is not None:
            if not isinstance(batch_dims, Mapping):
                raise TypeError(
                    f"SequenceParallel batch_dims must map leaf paths to a dim (or None), got {type(batch_dims).__name__}"
                )
            for k, d in batch_dims.items():
                if not isinstance(k, str) or not k:
                    raise ValueError(f"SequenceParallel batch_dims keys must be non-empty strings, got {k!r}")
                if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
                    raise ValueError(
                        f"SequenceParallel batch_dims[{k!r}] = {d!r}: give the length dim as an int >= 1 "
                        "(dim 0 holds the rows) or None to keep the leaf whole"
                    )
            dims = FrozenDict(batch_dims)
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "load_balance", load_balance)
        object.__setattr__(self, "batch_dims_", dims)

    # -- mesh -----------------------------------------------------------------
    def mesh_axes(self) -> Mapping[str, int]:
        return {AXIS: FILL if self.size is None else self.size}

    # -- batches ----------------------------------------------------------------
    def _declared_dim(self, path: str) -> tuple[bool, int | None]:
        assert self.batch_dims_ is not None
        for pattern, dim in self.batch_dims_.items():
            if fnmatch.fnmatchcase(path, pattern):
                return True, dim
        return False, None

    def batch_dims(self, path: str, shape: tuple[int, ...]) -> Mapping[int, str]:
        """The length dim of a batch leaf: declared in ``batch_dims``, else dim 1 of a rank-2 leaf."""
        if self.batch_dims_ is None:
            return {1: AXIS} if len(shape) == 2 else {}
        found, dim = self._declared_dim(path)
        if not found or dim is None:
            return {}
        if dim >= len(shape):
            raise ValueError(
                f"SequenceParallel batch_dims declares dim {dim} of batch leaf {path}, which has shape {tuple(shape)}"
            )
        return {dim: AXIS}

    def check_batch(self, shapes: Mapping[str, tuple[int, ...]], mesh_shape: Mapping[str, int]) -> None:
        """Refuse declared patterns that match no leaf and declared dims a leaf does not have."""
        if self.batch_dims_ is None:
            return
        for pattern in self.batch_dims_:
            if not any(fnmatch.fnmatchcase(p, pattern) for p in shapes):
                raise ValueError(
                    f"SequenceParallel batch_dims names {pattern!r}, which matches no batch leaf; "
                    f"the batch has leaves {sorted(shapes)}"
                )
        for path, shape in shapes.items():
            self.batch_dims(path, tuple(shape))

    # -- tracing ------------------------------------------------------------------
    def trace_context(self, mesh: Mesh):
        """Route :func:`jaxlight.nn.attention` to this piece's exchanges while a step is traced."""
        if dict(mesh.shape).get(AXIS, 1) == 1:
            return None
        return _traced(_SequenceAttention(mesh, self.mode, self.load_balance))

    def describe(self) -> str:
        parts = [f"size={self.size}", f"mode={self.mode!r}", f"load_balance={self.load_balance}"]
        if self.batch_dims_ is not None:
            parts.append(f"batch_dims={dict(self.batch_dims_)!r}")
        return f"SequenceParallel({', '.join(parts)})"

    def plan(
        self,
        q_shape: tuple[int, ...],
        kv_shape: tuple[int, ...],
        *,
        causal: bool,
        mesh_shape: Mapping[str, int],
    ) -> tuple[str, str]:
        """The exchange (and why) an attention call of these shapes runs on a mesh of ``mesh_shape``."""
        return attention_plan(self.mode, self.load_balance, q_shape, kv_shape, causal=causal, mesh_shape=mesh_shape)


register_strategy("sp", SequenceParallel)


# ----------------------------------------------------------------------------- choosing an exchange
def attention_plan(
    mode: str,
    load_balance: bool,
    q_shape: tuple[int, ...],
    kv_shape: tuple[int, ...],
    *,
    causal: bool,
    mesh_shape: Mapping[str, int],
) -> tuple[str, str]:
    """``(exchange, reason)`` for one call: exchange is ulysses, allgather, ring or dense.

    Raises a ValueError with the numbers when the requested ``mode`` cannot run
    these shapes. ``"dense"`` (attention left to GSPMD, unsplit) is only ever
    chosen by ``"auto"``, for a query length the sequence axis does not divide.
    """
    n = int(mesh_shape.get(AXIS, 1))
    tp = int(mesh_shape.get("tensor", 1))
    _, t, h, _ = q_shape
    _, s, hk, _ = kv_shape
    lb = load_balance and causal
    heads_ok = h % (tp * n) == 0 and hk % (tp * n) == 0
    heads_msg = f"query heads {h} and key/value heads {hk} over tensor x sequence = {tp} x {n} = {tp * n}"

    def need_len(what: str, length: int, div: int, why: str) -> None:
        if length % div:
            raise ValueError(f"sequence-parallel attention ({why}): {what} length {length} is not divisible by {div}")

    def balanced(what: str, length: int) -> None:
        if length % (2 * n):
            raise ValueError(
                f"sequence-parallel causal attention with load_balance=True splits the {what} length into "
                f"2 x sequence = {2 * n} zig-zag chunks, but it is {length} ({length} % {2 * n} = {length % (2 * n)}); "
                "make the length a multiple of it or use SequenceParallel(load_balance=False)"
            )

    if mode == "ulysses":
        if not heads_ok:
            raise ValueError(
                f"Ulysses sequence parallelism needs {heads_msg} to divide both; use mode='allgather' or 'ring'"
            )
        need_len("query", t, n, f"ulysses, sequence={n}")
        need_len("key/value", s, n, f"ulysses, sequence={n}")
        return "ulysses", f"{heads_msg} divide"
    if mode == "ring":
        need_len("query", t, n, f"ring, sequence={n}")
        need_len("key/value", s, n, f"ring, sequence={n}")
        if lb:
            balanced("query", t)
            balanced("key/value", s)
        return "ring", "requested" + (", zig-zag balanced" if lb else "")
    if mode == "allgather":
        need_len("query", t, n, f"allgather, sequence={n}")
        if lb:
            balanced("query", t)
        return "allgather", "requested" + (", zig-zag balanced" if lb else "")
    # auto
    if heads_ok and t % n == 0 and s % n == 0:
        return "ulysses", f"{heads_msg} divide"
    if t % n:
        return "dense", f"query length {t} is not divisible by sequence={n}: attention runs unsplit"
    if lb:
        balanced("query", t)
    why = f"{heads_msg} do not divide" if not heads_ok else f"key/value length {s} is not divisible by sequence={n}"
    return "allgather", why + (", zig-zag balanced" if lb else "")


# ----------------------------------------------------------------------------- the trace context
_ANNOUNCED: set[str] = set()


class _SequenceAttention:
    """What :func:`jaxlight.nn.attention` runs inside a traced step of a sequence-parallel strategy."""

    def __init__(self, mesh: Mesh, mode: str, load_balance: bool) -> None:
        self.mesh = mesh
        self.mode = mode
        self.load_balance = load_balance
        self.calls: list[tuple[str, str, bool, tuple, tuple]] = []

    axis: ClassVar[str] = AXIS
    """The mesh axis this exchange runs over: a pipeline stage that is already manual over it calls
    :meth:`__call__` there, and the exchange runs its collectives in place (:func:`in_manual_sequence`)."""

    def __call__(self, q, k, v, *, causal: bool, mask, scale: float, implementation: str | None = None):
        if in_manual_sequence():
            return _attend_in_place(self, q, k, v, causal=causal, mask=mask, scale=scale, impl=implementation)
        shape = dict(self.mesh.shape)
        exchange, why = attention_plan(self.mode, self.load_balance, q.shape, k.shape, causal=causal, mesh_shape=shape)
        self.calls.append((exchange, why, causal, tuple(q.shape), tuple(k.shape)))
        if exchange == "dense":
            return run_local(q, k, v, causal=causal, mask=mask, scale=scale, implementation=implementation)
        _refuse_fused_ring(exchange, implementation)
        n, tp = shape[AXIS], shape.get("tensor", 1)
        lb = self.load_balance and causal
        seq = P(None, AXIS)
        kv_spec = seq
        if exchange == "allgather" and k.shape[1] % n:
            kv_spec = P()  # GSPMD gathers a key length the axis does not divide at the boundary
        if mask is None:
            mspec = None
        elif exchange == "ulysses" or mask.shape[2] == 1:
            mspec = P()
        else:
            mspec = P(None, None, AXIS)
        if exchange == "ulysses":
            body = functools.partial(_ulysses, n=n, tp=tp, causal=causal, scale=scale, impl=implementation)
        elif exchange == "allgather":
            gather = kv_spec == seq
            body = functools.partial(
                _allgather, n=n, causal=causal, scale=scale, lb=lb, gather=gather, impl=implementation
            )
        else:
            body = functools.partial(_ring, n=n, causal=causal, scale=scale, lb=lb)
        args = (q, k, v) if mask is None else (q, k, v, mask)
        specs = (seq, kv_spec, kv_spec) if mask is None else (seq, kv_spec, kv_spec, mspec)
        fn = jax.shard_map(body, mesh=self.mesh, in_specs=specs, out_specs=seq, axis_names=frozenset({AXIS}))
        return fn(*args)

    def summary(self) -> str:
        if not self.calls:
            return ""
        shape = dict(self.mesh.shape)
        groups: dict[tuple[str, str], int] = {}
        for exchange, why, *_ in self.calls:
            groups[(exchange, why)] = groups.get((exchange, why), 0) + 1
        parts = [f"{c} x {ex} ({why})" for (ex, why), c in groups.items()]
        return (
            f"SequenceParallel(mode={self.mode!r}) on sequence={shape[AXIS]}, tensor={shape.get('tensor', 1)}: "
            f"{len(self.calls)} attention call(s): " + "; ".join(parts)
        )


def in_manual_sequence() -> bool:
    """Whether the code traced now runs inside a ``shard_map`` already manual over ``sequence`` (a pipeline
    stage under ``"pp+sp"``): arrays there hold this device's positions only."""
    ctx = jax.sharding.get_abstract_mesh()
    return not ctx.empty and AXIS in ctx.manual_axes


def _refuse_fused_ring(exchange: str, implementation: str | None) -> None:
    if exchange == "ring" and implementation not in (None, "blockwise"):
        raise AttentionImplementationError(
            f"attention: implementation={implementation!r} cannot run the sequence-parallel ring exchange "
            "(keys arrive block by block: only the blockwise kernel folds them); pass implementation=None "
            "or 'blockwise', or SequenceParallel(mode='ulysses' or 'allgather')"
        )


def _attend_in_place(sp: _SequenceAttention, q, k, v, *, causal: bool, mask, scale: float, impl=None):
    """One attention call where ``q``/``k``/``v`` are already this device's positions (manual over
    ``sequence``): the exchange's collectives run here, without a shard_map of their own."""
    shape = dict(sp.mesh.shape)
    n, tp = shape[AXIS], shape.get("tensor", 1)
    if mask is not None and (mask.shape[2] > 1 or mask.shape[3] > 1):
        # a mask built inside the stage from local arrays has local rows/columns, one from outside global
        # ones: neither can be told apart by shape, so only masks without length dims are taken
        raise ValueError(
            f'sequence-parallel attention inside a pipeline stage ("pp+sp") takes masks without length '
            f"dims ([batch|1, heads|1, 1, 1]); got mask {tuple(mask.shape)} for local queries {tuple(q.shape)}. "
            "Use causal=True, or run the model without the pipeline"
        )
    whole = [name for name, x in (("q", q), ("k", k), ("v", v)) if AXIS not in _varying_axes(x)]
    if whole:
        # e.g. keys/values from a stack argument given whole: not this device's positions, so the exchange
        # would attend to n copies of them
        raise ValueError(
            f'sequence-parallel attention inside a pipeline stage ("pp+sp") needs q, k and v computed from the '
            f"stack's split input, but {', '.join(whole)} {'is' if len(whole) == 1 else 'are'} the same on every "
            f"{AXIS} device (from an argument given whole?); cross-attention on whole arrays is not supported there"
        )
    q_global = (q.shape[0], q.shape[1] * n, *q.shape[2:])
    kv_global = (k.shape[0], k.shape[1] * n, *k.shape[2:])
    exchange, why = attention_plan(sp.mode, sp.load_balance, q_global, kv_global, causal=causal, mesh_shape=shape)
    sp.calls.append((exchange, why, causal, q_global, kv_global))
    lb = sp.load_balance and causal
    _refuse_fused_ring(exchange, impl)
    if exchange == "ulysses":
        return _ulysses(q, k, v, mask, n=n, tp=tp, causal=causal, scale=scale, impl=impl)
    if exchange == "allgather":
        return _allgather(q, k, v, mask, n=n, causal=causal, scale=scale, lb=lb, gather=True, impl=impl)
    return _ring(q, k, v, mask, n=n, causal=causal, scale=scale, lb=lb)


def _varying_axes(x: Any) -> frozenset:
    return frozenset(getattr(getattr(jax.typeof(x), "mat", None), "varying", ()) or ())


_LAST: list[list[tuple[str, str, bool, tuple, tuple]]] = [[]]


def traced_attention_calls() -> list[tuple[str, str, bool, tuple, tuple]]:
    """``(exchange, reason, causal, q_shape, kv_shape)`` of each attention call of the step traced last
    (the most recent trace, under a sequence-parallel strategy, that called :func:`jaxlight.nn.attention`)."""
    return list(_LAST[0])


class _traced:
    """Context manager: install the exchange, and announce its choices once when the trace ends."""

    def __init__(self, sp: _SequenceAttention) -> None:
        self.sp = sp
        self._inner = attention_context(sp)

    def __enter__(self) -> _SequenceAttention:
        self._inner.__enter__()
        return self.sp

    def __exit__(self, *exc: Any) -> None:
        self._inner.__exit__(*exc)
        if exc[0] is not None:
            return
        if self.sp.calls:
            _LAST[0] = list(self.sp.calls)
        msg = self.sp.summary()
        if msg and msg not in _ANNOUNCED and jax.process_index() == 0:
            _ANNOUNCED.add(msg)
            if log.hasHandlers():
                log.info(msg)
            else:
                rank_zero_info(msg)


# ----------------------------------------------------------------------------- zig-zag reorder
def _zigzag_perms(n: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Where each device's first and second half go: chunk c -> device c (c < n) or 2n - 1 - c."""
    dest = lambda c: c if c < n else 2 * n - 1 - c
    return [(j, dest(2 * j)) for j in range(n)], [(j, dest(2 * j + 1)) for j in range(n)]


def _to_zigzag(x: jax.Array, n: int, axis: int) -> jax.Array:
    """Device i's contiguous chunks (2i, 2i+1) of 2n -> chunks (i, 2n-1-i), along ``axis``."""
    first, second = jnp.split(x, 2, axis=axis)
    pa, pb = _zigzag_perms(n)
    ra, rb = lax.ppermute(first, AXIS, pa), lax.ppermute(second, AXIS, pb)
    even = lax.axis_index(AXIS) % 2 == 0
    # chunk i is a first half (from device i // 2) when i is even; chunk 2n-1-i then is a second half
    return jnp.concatenate([jnp.where(even, ra, rb), jnp.where(even, rb, ra)], axis=axis)


def _from_zigzag(x: jax.Array, n: int, axis: int) -> jax.Array:
    """Inverse of :func:`_to_zigzag`."""
    slot0, slot1 = jnp.split(x, 2, axis=axis)
    even = lax.axis_index(AXIS) % 2 == 0
    ra, rb = jnp.where(even, slot0, slot1), jnp.where(even, slot1, slot0)
    pa, pb = _zigzag_perms(n)
    inv = lambda perm: [(d, s) for s, d in perm]
    return jnp.concatenate([lax.ppermute(ra, AXIS, inv(pa)), lax.ppermute(rb, AXIS, inv(pb))], axis=axis)


def _q_ids(n: int, lb: bool) -> jax.Array:
    i = lax.axis_index(AXIS)
    return jnp.stack([i, 2 * n - 1 - i]).astype(jnp.int32) if lb else i.reshape(1).astype(jnp.int32)


# ----------------------------------------------------------------------------- the exchanges (shard_map bodies)
def _ulysses(q, k, v, mask=None, *, n: int, tp: int, causal: bool, scale: float, impl: str | None = None):
    """All-to-all: positions for heads, whole-sequence attention on H / n heads, and back.

    Heads are grouped ``(tensor, sequence, rest)`` so the heads a device
    receives are among those its tensor shard already holds: with heads split
    over ``tensor`` by GSPMD, the exchange never crosses the tensor axis.
    """

    def to_heads(x):
        b, t, h, d = x.shape
        x = x.reshape(b, t, tp, n, h // (tp * n), d)
        x = lax.all_to_all(x, AXIS, split_axis=3, concat_axis=1, tiled=True)
        return x.reshape(b, t * n, h // n, d)

    def to_seq(x):
        b, t, h, d = x.shape
        x = x.reshape(b, t, tp, 1, h // tp, d)
        x = lax.all_to_all(x, AXIS, split_axis=1, concat_axis=3, tiled=True)
        return x.reshape(b, t // n, h * n, d)

    qh, kh, vh = to_heads(q), to_heads(k), to_heads(v)
    if mask is not None and mask.shape[1] > 1:
        mb, mh, mt, ms = mask.shape
        m = mask.reshape(mb, tp, n, mh // (tp * n), mt, ms)
        m = lax.dynamic_index_in_dim(m, lax.axis_index(AXIS), axis=2, keepdims=False)
        mask = m.reshape(mb, mh // n, mt, ms)
    out = run_local(qh, kh, vh, causal=causal, mask=mask, scale=scale, implementation=impl)
    return to_seq(out)


@jax.custom_vjp
def _gather_positions(x: jax.Array) -> jax.Array:
    """``x`` all-gathered over ``sequence`` on its positions (axis 1); its gradient reduce-scattered in float32.

    Why float32: the transpose of a bfloat16 all-gather is a bfloat16 reduce-scatter, which XLA:CPU
    decomposes into an all-reduce; inside a shard_map that leaves some mesh axes automatic, its reducer's
    root is a sharding annotation (a ``copy``), and XLA:CPU's AllReducePromotion aborts rebuilding it
    ("Invalid binary instruction opcode copy", jax 0.10.2). The forward gather keeps ``x``'s dtype.
    """
    return lax.all_gather(x, AXIS, axis=1, tiled=True)


def _gather_positions_fwd(x: jax.Array) -> tuple[jax.Array, None]:
    return _gather_positions(x), None


def _gather_positions_bwd(_: None, g: jax.Array) -> tuple[jax.Array]:
    wide = jnp.promote_types(g.dtype, jnp.float32) if jnp.issubdtype(g.dtype, jnp.floating) else g.dtype
    return (lax.psum_scatter(g.astype(wide), AXIS, scatter_dimension=1, tiled=True).astype(g.dtype),)


_gather_positions.defvjp(_gather_positions_fwd, _gather_positions_bwd)


def _allgather(q, k, v, mask=None, *, n: int, causal: bool, scale: float, lb: bool, gather: bool, impl=None):
    """Keys/values all-gathered (natural order) beside this device's queries (zig-zag chunks when balanced).

    A fused kernel (see :func:`~jaxlight.strategies.attention_backends.choose`) gets the causal
    condition as a mask of these queries' global positions: its own causal mask starts both at 0."""
    if lb:
        q = _to_zigzag(q, n, axis=1)
        if mask is not None and mask.shape[2] > 1:
            mask = _to_zigzag(mask, n, axis=2)
    if gather:
        k, v = _gather_positions(k), _gather_positions(v)
    # Keys in natural order, one chunk; its blocks of at most length / 2n let a causal call skip
    # the blocks after each query chunk, which zig-zag spreads evenly.
    s = k.shape[1]
    fused_mask = mask
    if causal:
        pos = _q_ids(n, lb)[:, None] * (q.shape[1] // (2 if lb else 1)) + jnp.arange(q.shape[1] // (2 if lb else 1))
        allow = (pos.reshape(-1)[:, None] >= jnp.arange(s)[None, :])[None, None]
        fused_mask = allow if mask is None else mask & allow
    kernel = choose(q, k, v, causal=False, mask=fused_mask, implementation=impl)
    if kernel != "blockwise":
        out = run_local(q, k, v, causal=False, mask=fused_mask, scale=scale, implementation=kernel)
        return _from_zigzag(out, n, axis=1) if lb else out
    plan = make_plan(causal=causal, scale=scale, q_chunk=q.shape[1] // (2 if lb else 1), kv_chunk=s)
    if causal and s % (2 * n) == 0 and plan.kv_block > s // (2 * n):
        plan = dataclasses.replace(plan, kv_block=s // (2 * n))
    out = blockwise_attention(plan, q, k, v, mask, _q_ids(n, lb))
    return _from_zigzag(out, n, axis=1) if lb else out


def _ring(q, k, v, mask=None, *, n: int, causal: bool, scale: float, lb: bool):
    """Keys/values passed around the ring; gradients of keys/values travel back with them."""
    if lb:
        q, k, v = (_to_zigzag(x, n, axis=1) for x in (q, k, v))
        if mask is not None and mask.shape[2] > 1:
            mask = _to_zigzag(mask, n, axis=2)
    per = 2 if lb else 1
    plan = make_plan(
        causal=causal,
        scale=scale,
        q_chunk=q.shape[1] // per,
        kv_chunk=k.shape[1] // per,
        n_steps=n,
        kv_per_step=per,
        ring_axis=AXIS,
        ring_size=n,
        zigzag=lb,
    )
    out = blockwise_attention(plan, q, k, v, mask, _q_ids(n, lb))
    return _from_zigzag(out, n, axis=1) if lb else out
