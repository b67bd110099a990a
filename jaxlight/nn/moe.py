"""``MoE``: a mixture-of-experts feed-forward layer that a strategy can run expert-parallel.

``y, aux = moe(x)`` routes every token of ``x`` (``[batch, length, features]``)
to its ``top_k`` experts (each a two-matrix feed-forward block), and returns
their gate-weighted sum and the router's auxiliary losses. Where the tokens
go is decided per token; how they get there depends on where the layer runs:

- Outside a trainer step, or on one device: every expert is local.
- Inside a trainer step on a mesh: the call is one ``jax.shard_map`` that is
  manual over the mesh axes splitting its tokens (batch rows and positions),
  over ``expert`` when the rules put the ``exp`` dimension of the expert
  weights there (:class:`jaxlight.strategies.ExpertParallel`, ``"ep"``), and
  over ``tensor`` when they split the hidden width. Each device routes only
  its own tokens (no global sort), sends them to the devices that hold their
  experts with one ``all_to_all`` over ``expert``, runs its own experts only,
  and sends the results back with a second one. Weights split over ``fsdp``
  are gathered at the boundary (FSDP's gather before use); a hidden width
  split over ``tensor`` is summed with one ``psum`` after the combine (in float32
  under half precision: see ``jaxlight.strategies.pipeline.mark_varying``).

Dispatch:

- ``capacity_factor=None`` (dropless, the default): every token reaches all
  of its experts. Tokens are sorted by expert and each expert's run is padded
  to a multiple of a block of rows; every block is one matmul against its
  expert's weights (a grouped matmul built from plain gathers and batched
  dots). Measured on XLA:CPU (``benchmarks/experts.py``), this is several
  times faster than ``jax.lax.ragged_dot`` (which XLA:CPU expands to one
  dense matmul per expert) and than computing every expert on every token;
  ``matmul="ragged"`` selects ``ragged_dot`` for backends with a grouped
  matmul kernel. Under expert parallelism the exchange cannot know the
  routing when it is compiled, so each device reserves room for the worst
  case: ``tokens x min(top_k, experts per device)`` rows for every other
  device (``n x min(top_k, E/n) / top_k`` times the bytes the tokens
  themselves need on an expert axis of ``n``).
- ``capacity_factor=c``: each expert takes at most
  ``ceil(c x length x top_k / num_experts)`` assignments from each sequence
  (a row of the batch is the capacity group, so where rows are placed never
  changes which tokens are dropped). Within a sequence the first choices of
  all positions come first, in position order, then the second choices, and
  so on; an assignment past its expert's capacity is dropped (it contributes
  nothing; with a residual connection around the layer the token passes
  through). ``aux["dropped"]`` is the fraction of the ``tokens x top_k``
  assignments dropped. The exchange moves ``capacity x num_experts`` rows per
  sequence, about ``c`` times the tokens' own bytes.

Gates: with ``top_k = 1`` a token's output is its expert's output times the
router probability (as in Switch); with ``top_k > 1`` the ``top_k``
probabilities are renormalized to sum to 1 (as in Mixtral). The router runs
in float32 whatever the input dtype.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxlight.nn.constrain import active_axis_rules
from jaxlight.strategies.pipeline import mark_varying, stage_sum
from jaxlight.strategies.rules import resolve_spec

__all__ = ["MATMULS", "MoE", "block_rows", "grouped_ffn"]

MATMULS = ("blocks", "ragged")
"""How the dropless path multiplies tokens sorted by expert: padded blocks (default) or ``lax.ragged_dot``."""

EXPERT_NAMES = ("exp", "embed", "mlp")
"""Logical axes of the input projection ``w_in [experts, features, hidden]``."""
EXPERT_OUT_NAMES = ("exp", "mlp", "embed")
"""Logical axes of the output projection ``w_out [experts, hidden, features]``."""
ROUTER_NAMES = ("embed", None)
"""Logical axes of the router ``[features, experts]``."""
EXPERT_AXIS = "expert"
TENSOR_AXIS = "tensor"
MANUAL = jax.sharding.AxisType.Manual


def _positive_int(name: str, v: Any) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"MoE {name} must be a positive int, got {v!r}")


class MoE(nnx.Module):
    """Mixture of ``num_experts`` feed-forward experts, ``top_k`` per token.

    Args:
        features: width of the input and output (the ``embed`` axis).
        hidden: hidden width of each expert (the ``mlp`` axis).
        num_experts: experts ``E`` (the ``exp`` axis).
        top_k: experts per token, ``1 <= top_k <= num_experts``.
        capacity_factor: None for dropless routing, or ``c > 0`` for a fixed
            capacity of ``ceil(c x length x top_k / E)`` assignments per
            expert and sequence (overflow dropped; see the module docstring).
        activation: elementwise function between the two projections.
        matmul: the dropless grouped matmul, ``"blocks"`` or ``"ragged"``.
        param_dtype: dtype of the parameters.
        rngs: the ``params`` stream initialises the weights.

    Parameters: ``router [features, E]`` (logical axes ``("embed", None)``),
    ``w_in [E, features, hidden]`` (``("exp", "embed", "mlp")``) and
    ``w_out [E, hidden, features]`` (``("exp", "mlp", "embed")``).

    Returns ``(y, aux)`` from a call on ``x [batch, length, features]``:
    ``y`` of ``x``'s shape and dtype, and ``aux`` a dict of float32 scalars,
    the same on every device:

    - ``"load_balance"``: the Switch/GShard loss
      ``E x sum_e f_e x p_e`` with ``f_e`` the fraction of the
      ``tokens x top_k`` assignments that chose expert ``e`` and ``p_e`` the
      mean router probability of ``e``; 1 when routing is uniform, ``>= 0``,
      differentiable through ``p_e``;
    - ``"router_z"``: the router z-loss, the mean over tokens of
      ``logsumexp(logits)^2`` (ST-MoE);
    - ``"dropped"``: the fraction of assignments dropped (0 when dropless).

    Add the losses you want to your loss, e.g.
    ``loss + 0.01 * aux["load_balance"] + 1e-3 * aux["router_z"]``; each is
    computed over every token of the call, so it equals the one-device value
    under any strategy.
    """

    def __init__(
        self,
        features: int,
        hidden: int,
        num_experts: int,
        *,
        top_k: int = 2,
        capacity_factor: float | None = None,
        activation: Callable[[jax.Array], jax.Array] = nnx.gelu,
        matmul: str = "blocks",
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        _positive_int("features", features)
        _positive_int("hidden", hidden)
        _positive_int("num_experts", num_experts)
        _positive_int("top_k", top_k)
        if top_k > num_experts:
            raise ValueError(
                f"MoE top_k={top_k} is greater than num_experts={num_experts}: each token picks top_k distinct "
                f"experts; use top_k <= {num_experts}"
            )
        if capacity_factor is not None:
            if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)):
                raise TypeError(f"MoE capacity_factor must be a number or None, got {capacity_factor!r}")
            if not capacity_factor > 0 or not math.isfinite(capacity_factor):
                raise ValueError(f"MoE capacity_factor must be > 0 (or None for dropless), got {capacity_factor!r}")
            capacity_factor = float(capacity_factor)
        if not callable(activation):
            raise TypeError(f"MoE activation must be callable, got {type(activation).__name__}")
        if matmul not in MATMULS:
            raise ValueError(f"MoE matmul must be one of {MATMULS}, got {matmul!r}")
        self.features = features
        self.hidden = hidden
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.activation = activation
        self.matmul = matmul
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.router = nnx.Param(
            nnx.with_partitioning(nnx.initializers.lecun_normal(), ROUTER_NAMES)(
                rngs.params(), (features, num_experts), param_dtype
            )
        )
        self.w_in = nnx.Param(
            nnx.with_partitioning(init, EXPERT_NAMES)(rngs.params(), (num_experts, features, hidden), param_dtype)
        )
        self.w_out = nnx.Param(
            nnx.with_partitioning(init, EXPERT_OUT_NAMES)(rngs.params(), (num_experts, hidden, features), param_dtype)
        )

    def capacity(self, length: int) -> int | None:
        """Assignments each expert takes from one sequence of ``length`` positions (None: dropless)."""
        if self.capacity_factor is None:
            return None
        return max(1, math.ceil(self.capacity_factor * length * self.top_k / self.num_experts))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        if getattr(x, "ndim", None) != 3 or x.shape[-1] != self.features:
            raise ValueError(
                f"MoE takes x [batch, length, features={self.features}], got shape {getattr(x, 'shape', None)}"
            )
        cfg = _Config(self.num_experts, self.top_k, self.capacity(int(x.shape[1])), self.activation, self.matmul)
        return moe_forward(cfg, x, self.router[...], self.w_in[...], self.w_out[...])


@dataclasses.dataclass(frozen=True)
class _Config:
    num_experts: int
    top_k: int
    capacity: int | None  # per expert and sequence; None: dropless
    activation: Callable[[jax.Array], jax.Array]
    matmul: str


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where one call's tokens and experts live, as its ``shard_map`` body sees them."""

    token_axes: tuple[str, ...] = ()  # manual axes splitting the tokens (the aux sums run over them)
    manual: tuple[str, ...] = ()  # every manual axis of the shard_map
    ep: str | None = None  # the axis the experts are split over
    n_ep: int = 1
    tp: str | None = None  # the axis the hidden width is split over
    tokens: int = 0  # tokens of the whole call


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _pad(spec: tuple, n: int) -> tuple:
    return tuple(spec) + (None,) * (n - len(spec))


def moe_forward(
    cfg: _Config, x: jax.Array, router: jax.Array, w_in: jax.Array, w_out: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Route ``x`` through the experts: directly, or as a ``shard_map`` on the trainer's mesh (module docstring)."""
    tokens = int(x.shape[0]) * int(x.shape[1])
    active = active_axis_rules()
    context = jax.sharding.get_abstract_mesh()
    manual_now = [] if context.empty else [a for a, t in zip(context.axis_names, context.axis_types) if t == MANUAL]
    if active is None or active[0].size == 1:
        return _moe_body(cfg, _Layout(tokens=tokens), x, router, w_in, w_out)
    mesh, rules = active
    shape = dict(mesh.shape)
    xspec = _pad(resolve_spec(("batch", "length", None), tuple(x.shape), rules, shape), 3)
    wspec = _pad(resolve_spec(EXPERT_NAMES, tuple(w_in.shape), rules, shape), 3)
    rows, seq = _axes(xspec[0]), _axes(xspec[1])
    ep = EXPERT_AXIS if _axes(wspec[0]) == (EXPERT_AXIS,) else None
    tp = TENSOR_AXIS if _axes(wspec[2]) == (TENSOR_AXIS,) else None
    if manual_now:  # inside another shard_map (a pipeline stage): its manual axes are already local
        if ep is not None:
            raise ValueError(
                f"MoE under expert parallelism (expert={shape[EXPERT_AXIS]}) was called inside another shard_map "
                f"(manual axes {manual_now}); "
                "its all-to-all shard_map over expert does not lower nested in another one on this jax (backward "
                "pass): call it outside, or leave its experts unsplit"
            )
        return _moe_body(cfg, _Layout(tokens=tokens), x, router, w_in, w_out)
    if ep is not None and EXPERT_AXIS not in rows:
        raise ValueError(
            f"expert parallelism splits the rows of the MoE input over the expert axis ({shape[EXPERT_AXIS]} "
            f"devices), but the input {tuple(x.shape)} has rows placed on {rows or 'no axis'} (its {x.shape[0]} "
            f"rows must be divisible by data x fsdp x expert = "
            f"{shape['data'] * shape['fsdp'] * shape[EXPERT_AXIS]})"
        )
    if seq and cfg.capacity is not None:
        raise ValueError(
            f"MoE(capacity_factor=...) counts capacity per sequence, and this call's positions are split over "
            f"{seq} ({x.shape[1]} positions over {math.prod(shape[a] for a in seq)} devices); use the dropless "
            "MoE (capacity_factor=None) with sequence parallelism"
        )
    token_axes = rows + seq
    manual = set(token_axes) | {a for a in (ep, tp) if a is not None}
    lay = _Layout(token_axes, tuple(sorted(manual)), ep, int(shape[ep]) if ep else 1, tp, tokens)
    if not manual:
        return _moe_body(cfg, lay, x, router, w_in, w_out)
    body = lambda *a: _moe_body(cfg, lay, *a)
    xs = P(*xspec)
    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(xs, P(), P(ep, None, tp), P(ep, tp, None)),
        out_specs=(xs, P()),
        axis_names=frozenset(manual),
    )
    return fn(x, router, w_in, w_out)


# ----------------------------------------------------------------------------- the per-device program
def _moe_body(
    cfg: _Config, lay: _Layout, x: jax.Array, router: jax.Array, w_in: jax.Array, w_out: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One device's share: route its tokens, exchange, run its experts, exchange back, combine."""
    b, length, f = x.shape
    t = b * length
    e_all, k = cfg.num_experts, cfg.top_k
    xt = x.reshape(t, f)
    logits = jnp.dot(xt.astype(jnp.float32), router.astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    top_p, idx = lax.top_k(probs, k)
    gates = top_p if k == 1 else top_p / jnp.sum(top_p, axis=-1, keepdims=True)

    def total(v: jax.Array) -> jax.Array:
        return lax.psum(v, lay.token_axes) if lay.token_axes else v

    n_tok = float(lay.tokens)
    chosen = lax.stop_gradient(jnp.sum(jax.nn.one_hot(idx, e_all, dtype=jnp.float32), axis=(0, 1)))
    frac = total(chosen) / (n_tok * k)
    mean_p = total(jnp.sum(probs, axis=0)) / n_tok
    aux = {
        "load_balance": e_all * jnp.sum(frac * mean_p),
        "router_z": total(jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1)))) / n_tok,
    }
    # values invariant over a manual axis that meet varying ones (the expert weights over the token axes, the
    # tokens and gates over tensor): their gradients are summed over it in float32 (see mark_varying)
    w_in, w_out = mark_varying(w_in, lay.manual), mark_varying(w_out, lay.manual)
    if lay.tp is not None:
        x, xt, gates = mark_varying(x, (lay.tp,)), mark_varying(xt, (lay.tp,)), mark_varying(gates, (lay.tp,))
    if cfg.capacity is None:
        out = _dropless(cfg, lay, xt, idx, w_in, w_out)
        aux["dropped"] = jnp.zeros((), jnp.float32)
    else:
        out, kept = _with_capacity(cfg, lay, x, idx, w_in, w_out)
        aux["dropped"] = total(jnp.sum(~kept).astype(jnp.float32)) / (n_tok * k)
    y = jnp.einsum("tkf,tk->tf", out, gates.astype(out.dtype))
    if lay.tp is not None:
        y = stage_sum(y, lay.tp)  # each tensor shard holds a slice of every expert's hidden width (float32 sum)
    return y.reshape(b, length, f).astype(x.dtype), aux


def _dropless(
    cfg: _Config, lay: _Layout, xt: jax.Array, idx: jax.Array, w_in: jax.Array, w_out: jax.Array
) -> jax.Array:
    """Every assignment computed: ``[tokens, top_k, features]`` expert outputs."""
    t, f = xt.shape
    k = cfg.top_k
    a = t * k
    expert = idx.reshape(a)
    tok = jnp.arange(a) // k
    if lay.ep is None:
        rows = grouped_ffn(xt[tok], expert, cfg.num_experts, w_in, w_out, cfg.activation, cfg.matmul)
        return rows.reshape(t, k, f)
    n = lay.n_ep
    local = cfg.num_experts // n
    dest = expert // local
    # room for the worst case: all of a device's tokens may pick min(top_k, local) experts on one device
    slots = t * min(k, local)
    hot = jax.nn.one_hot(dest, n, dtype=jnp.int32)
    rank = jnp.sum((jnp.cumsum(hot, axis=0) - 1) * hot, axis=1)  # order among assignments to one device
    send = jnp.zeros((n, slots, f), xt.dtype).at[dest, rank].set(xt[tok])
    ids = jnp.full((n, slots), local, jnp.int32).at[dest, rank].set(expert % local)  # local: an empty slot
    recv = lax.all_to_all(send, lay.ep, 0, 0, tiled=True)
    recv_ids = lax.all_to_all(ids, lay.ep, 0, 0, tiled=True)
    done = grouped_ffn(
        recv.reshape(n * slots, f), recv_ids.reshape(n * slots), local, w_in, w_out, cfg.activation, cfg.matmul
    )
    back = lax.all_to_all(done.reshape(n, slots, f), lay.ep, 0, 0, tiled=True)
    return back[dest, rank].reshape(t, k, f)


def _with_capacity(
    cfg: _Config, lay: _Layout, x: jax.Array, idx: jax.Array, w_in: jax.Array, w_out: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Fixed capacity per (sequence, expert): expert outputs ``[tokens, top_k, features]`` and which were kept."""
    b, length, f = x.shape
    k, e_all, cap = cfg.top_k, cfg.num_experts, cfg.capacity
    assert cap is not None
    # choice-major order within each sequence: all first choices (by position), then the second ones, ...
    order = idx.reshape(b, length, k).transpose(0, 2, 1).reshape(b, k * length)
    hot = jax.nn.one_hot(order, e_all, dtype=jnp.int32)
    pos = jnp.sum((jnp.cumsum(hot, axis=1) - 1) * hot, axis=-1)  # [b, k*length]: slot in its expert
    kept = pos < cap
    rows = jnp.arange(b)[:, None]
    xa = jnp.tile(x, (1, k, 1))  # [b, k*length, f]: the token of each assignment, in the same order
    buf = jnp.zeros((b, e_all, cap, f), x.dtype).at[rows, order, pos].set(xa, mode="drop")
    if lay.ep is None:
        grouped = buf.transpose(1, 0, 2, 3).reshape(e_all, b * cap, f)
    else:
        n, local = lay.n_ep, e_all // lay.n_ep
        buf = lax.all_to_all(buf.reshape(b, n, local, cap, f), lay.ep, 1, 1, tiled=True)  # [b, source, local, ..]
        grouped = buf.transpose(2, 0, 1, 3, 4).reshape(local, b * n * cap, f)
    h = cfg.activation(jnp.einsum("erf,efh->erh", grouped, w_in))
    done = jnp.einsum("erh,ehf->erf", h, w_out)
    if lay.ep is None:
        done = done.reshape(e_all, b, cap, f).transpose(1, 0, 2, 3)
    else:
        done = done.reshape(local, b, n, cap, f).transpose(1, 2, 0, 3, 4)
        done = lax.all_to_all(done, lay.ep, 1, 1, tiled=True).reshape(b, e_all, cap, f)
    got = done.at[rows, order, pos].get(mode="fill", fill_value=0)  # dropped assignments read 0
    out = got.reshape(b, k, length, f).transpose(0, 2, 1, 3).reshape(b * length, k, f)
    kept = kept.reshape(b, k, length).transpose(0, 2, 1).reshape(b * length, k)
    return out, kept


# ----------------------------------------------------------------------------- the grouped matmul
def block_rows(rows: int, groups: int) -> int:
    """Rows per block of :func:`grouped_ffn`: a power of two near ``rows / (2 x groups)`` (at least 8).

    With ``nb <= rows / block + groups`` blocks, the gathered per-block weights
    are at most about 3x the experts' own, and padding adds at most
    ``groups x block`` rows (half of ``rows``; a quarter on average).
    """
    want = max(1, -(-rows // (2 * groups)))
    return max(8, 1 << (want - 1).bit_length())


def grouped_ffn(
    rows: jax.Array,
    ids: jax.Array,
    groups: int,
    w_in: jax.Array,
    w_out: jax.Array,
    activation: Callable[[jax.Array], jax.Array],
    matmul: str = "blocks",
) -> jax.Array:
    """``activation(rows[i] @ w_in[ids[i]]) @ w_out[ids[i]]`` for every row; rows with ``ids == groups`` get 0.

    ``rows [R, F]``, ``ids [R]`` in ``[0, groups]``, ``w_in [groups, F, H]``,
    ``w_out [groups, H, F]``. ``"blocks"``: rows are sorted by group, each
    group's run padded to a multiple of :func:`block_rows`, and each block is
    one matmul with its group's weights (work ~ R, not R x groups).
    ``"ragged"``: :func:`jax.lax.ragged_dot` on the sorted rows.
    """
    r, f = rows.shape
    order = jnp.argsort(ids, stable=True)
    counts = jnp.bincount(ids, length=groups)  # ids == groups (empty rows) are not counted
    if matmul == "ragged":
        sizes = counts.astype(jnp.int32)
        h = activation(lax.ragged_dot(rows[order], w_in, sizes))
        done = lax.ragged_dot(h, w_out, sizes)
        done = jnp.where((jnp.arange(r) < jnp.sum(sizes))[:, None], done, 0)
        return jnp.zeros_like(done).at[order].set(done)
    bk = block_rows(r, groups)
    nb = -(-r // bk) + groups
    padded = (counts + bk - 1) // bk * bk
    ends = jnp.cumsum(padded)
    first = jnp.cumsum(counts) - counts  # where each group starts among the sorted rows
    sid = ids[order]
    g = jnp.minimum(sid, groups - 1)
    slot = jnp.where(sid < groups, ends[g] - padded[g] + jnp.arange(r) - first[g], nb * bk)
    dest = jnp.zeros((r,), jnp.int32).at[order].set(slot.astype(jnp.int32))
    blocks = jnp.zeros((nb * bk, f), rows.dtype).at[dest].set(rows, mode="drop").reshape(nb, bk, f)
    # the group of each block: how many groups end at or before its first row (searchsorted, written as a
    # comparison: jnp.searchsorted fails inside shard_map on varying operands in jax 0.10.2)
    block_group = jnp.minimum(jnp.sum(jnp.arange(nb)[:, None] * bk >= ends[None, :], axis=1), groups - 1)
    h = activation(jnp.einsum("nbf,nfh->nbh", blocks, w_in[block_group]))
    done = jnp.einsum("nbh,nhf->nbf", h, w_out[block_group]).reshape(nb * bk, f)
    return done.at[dest].get(mode="fill", fill_value=0)
