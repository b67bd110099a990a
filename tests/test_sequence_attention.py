"""jaxlight.nn.attention and the SequenceParallel exchanges, at kernel level (8 simulated CPU devices).

Every sequence-parallel result is compared with plain attention on one device
(``jax.nn.dot_product_attention``, XLA implementation): forward within 1e-6 and gradients
(of a random linear function of the output) within 1e-5, absolute, float32. The kernels
run with 8-row blocks (``BLOCK`` patched) so every path folds several key blocks per query
block and skips causal blocks, as long sequences do with the default block.
"""

from __future__ import annotations

import importlib
import logging
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlight.nn import attention
from jaxlight.strategies import FSDP, STRATEGY_REGISTRY, CompositionError, TensorParallel, resolve_strategy
from jaxlight.strategies.sequence import SequenceParallel, attention_plan, traced_attention_calls

attn_mod = importlib.import_module("jaxlight.strategies.attention_kernel")

FWD_TOL, GRAD_TOL = 1e-6, 1e-5
B, T, D = 4, 64, 8
H, HK = 16, 8  # grouped-query: two query heads per key/value head; 8 kv heads divide tensor x sequence = 8


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    monkeypatch.setattr(attn_mod, "BLOCK", 8)


def _inputs(seed=0, b=B, t=T, s=None, h=H, hk=HK, d=D, dv=None, mask="pad"):
    rng = np.random.default_rng(seed)
    s = t if s is None else s
    q = rng.normal(size=(b, t, h, d)).astype(np.float32)
    k = rng.normal(size=(b, s, hk, d)).astype(np.float32)
    v = rng.normal(size=(b, s, hk, dv or d)).astype(np.float32)
    w = rng.normal(size=(b, t, h, dv or d)).astype(np.float32)  # cotangent for the gradient check
    if mask == "pad":  # right padding of different lengths per row: no query row is fully masked
        lengths = rng.integers(s // 2, s + 1, size=b)
        m = (np.arange(s)[None, :] < lengths[:, None])[:, None, None, :]
    elif mask == "full":  # an arbitrary [B, H, T, S] mask; key 0 stays visible to every query
        m = rng.random((b, h, t, s)) > 0.3
        m[..., 0] = True
    else:
        m = None
    return q, k, v, w, m


def _reference(q, k, v, w, mask, causal):
    """Plain attention on one device: jax.nn.dot_product_attention and its autodiff gradients."""

    def f(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation="xla")

    out = f(q, k, v)
    grads = jax.grad(lambda *a: (f(*a) * w).sum(), (0, 1, 2))(q, k, v)
    return np.asarray(out), [np.asarray(g) for g in grads]


def _sharded(strategy, q, k, v, w, mask, causal):
    """Run attention (value and gradients) under ``strategy``'s mesh and trace context."""
    st = resolve_strategy(strategy)
    mesh = st.build_mesh(jax.devices())
    heads = "tensor" if mesh.shape["tensor"] > 1 else None
    act = NamedSharding(mesh, P(("data", "fsdp"), "sequence", heads))
    qs, ws = jax.device_put(q, act), jax.device_put(w, act)
    kv = act if k.shape[1] % mesh.shape["sequence"] == 0 else NamedSharding(mesh, P(("data", "fsdp")))
    ks, vs = jax.device_put(k, kv), jax.device_put(v, kv)
    ms = None if mask is None else jax.device_put(mask, NamedSharding(mesh, P(("data", "fsdp"))))

    def loss(q, k, v, w, m):
        out = attention(q, k, v, causal=causal, mask=m)
        return (out * w).sum(), out

    with jax.set_mesh(mesh), st.trace_context(mesh):
        (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(qs, ks, vs, ws, ms)
    calls = traced_attention_calls()
    return np.asarray(out), [np.asarray(g) for g in grads], calls, qs


def _assert_close(got, ref):
    out, grads = got
    rout, rgrads = ref
    assert np.abs(rout).max() > 0.1 and min(np.abs(g).max() for g in rgrads) > 0.1  # non-trivial values
    assert np.abs(out - rout).max() <= FWD_TOL, np.abs(out - rout).max()
    for name, g, r in zip("qkv", grads, rgrads):
        assert np.abs(g - r).max() <= GRAD_TOL, (name, np.abs(g - r).max())


# ------------------------------------------------------------------------------ plain attention
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask", [None, "pad", "full"])
def test_plain_attention_matches_jax(causal, mask):
    """Outside any strategy: exact attention, several blocks (8-row blocks over 64 positions)."""
    q, k, v, w, m = _inputs(mask=mask)
    out = attention(q, k, v, causal=causal, mask=m)
    grads = jax.grad(lambda *a: (attention(*a, causal=causal, mask=m) * w).sum(), (0, 1, 2))(q, k, v)
    _assert_close((np.asarray(out), [np.asarray(g) for g in grads]), _reference(q, k, v, w, m, causal))


def test_plain_attention_one_block_and_other_shapes(monkeypatch):
    """Default block (one block here), key length != query length, causal from position 0 of both,
    a value head_dim of its own, an explicit scale."""
    monkeypatch.setattr(attn_mod, "BLOCK", 512)
    q, k, v, w, m = _inputs(t=24, s=40, h=6, hk=3, mask="pad")
    v = np.random.default_rng(1).normal(size=k.shape[:3] + (12,)).astype(np.float32)
    w = np.random.default_rng(2).normal(size=q.shape[:3] + (12,)).astype(np.float32)
    for causal in (False, True):
        out = attention(q, k, v, causal=causal, mask=m, scale=0.3)
        grads = jax.grad(lambda *a, c=causal: (attention(*a, causal=c, mask=m, scale=0.3) * w).sum(), (0, 1, 2))(
            q, k, v
        )

        def ref(q, k, v, c=causal):
            kk, vv = np.repeat(k, 2, axis=2), np.repeat(v, 2, axis=2)
            s = jnp.einsum("bqhd,bkhd->bhqk", q, kk) * 0.3
            allow = jnp.broadcast_to(m, s.shape)
            if c:
                allow = allow & jnp.tril(jnp.ones(s.shape[-2:], bool))
            p = jax.nn.softmax(jnp.where(allow, s, -jnp.inf), axis=-1)
            return jnp.einsum("bhqk,bkhd->bqhd", p, vv)

        rgrads = jax.grad(lambda *a: (ref(*a) * w).sum(), (0, 1, 2))(q, k, v)
        _assert_close((np.asarray(out), [np.asarray(g) for g in grads]), (np.asarray(ref(q, k, v)), rgrads))


@pytest.mark.parametrize("block", [8, 512])  # the blockwise kernel, and the one-block path
def test_fully_masked_rows_give_zeros_not_nan(block, monkeypatch):
    monkeypatch.setattr(attn_mod, "BLOCK", block)
    q, k, v, w, _ = _inputs(b=2, t=16)
    valid = np.ones((2, 16), bool)
    valid[1, :5] = False  # left padding: causal queries 0..4 of row 1 see no key at all
    m = valid[:, None, None, :]
    out = attention(q, k, v, causal=True, mask=m)
    grads = jax.grad(lambda *a: (attention(*a, causal=True, mask=m) * w).sum(), (0, 1, 2))(q, k, v)
    assert np.all(np.isfinite(out)) and all(np.all(np.isfinite(g)) for g in grads)
    np.testing.assert_array_equal(np.asarray(out)[1, :5], 0.0)
    np.testing.assert_array_equal(np.asarray(grads[0])[1, :5], 0.0)
    assert np.abs(np.asarray(out)[1, 5:]).max() > 0.1
    # the rows that do see keys are exact
    ref, _ = _reference(q, k, v, w, m, True)
    assert np.abs(np.asarray(out)[:, 5:] - ref[:, 5:]).max() <= FWD_TOL


def test_bad_arguments_are_refused_with_shapes():
    q, k, v, _, _ = _inputs(b=1, t=8)
    with pytest.raises(ValueError, match=r"query heads 16 are not a multiple of key/value heads 5"):
        attention(q, k[:, :, :5], v[:, :, :5])
    with pytest.raises(ValueError, match=r"mask shape \(1, 8\) must be 4-D .*pad\[:, None, None, :\]"):
        attention(q, k, v, mask=np.ones((1, 8), bool))
    with pytest.raises(TypeError, match="mask must be boolean"):
        attention(q, k, v, mask=np.ones((1, 1, 1, 8), np.float32))
    with pytest.raises(ValueError, match=r"q must be \[batch, length, heads, head_dim\], got shape \(8, 16, 8\)"):
        attention(q[0], k, v)


def test_bf16_inputs_keep_dtype_and_stay_close():
    q, k, v, _, m = _inputs(b=2, t=16)
    out = attention(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), causal=True, mask=m)
    ref = jax.nn.dot_product_attention(q, k, v, mask=m, is_causal=True, implementation="xla")
    assert out.dtype == jnp.bfloat16
    assert float(jnp.abs(out.astype(jnp.float32) - ref).max()) < 5e-2  # bf16 inputs, float32 softmax


# ------------------------------------------------------------------------------ the three exchanges
CASES = [
    (mode, causal, lb) for mode in ("ulysses", "allgather", "ring") for causal in (False, True) for lb in (False, True)
]


@pytest.mark.parametrize("mode,causal,lb", CASES)
def test_exchange_matches_one_device(mode, causal, lb):
    """sequence=8, grouped-query heads, a right-padding mask."""
    q, k, v, w, m = _inputs(mask="pad")
    out, grads, calls, qs = _sharded(SequenceParallel(mode=mode, load_balance=lb), q, k, v, w, m, causal)
    assert qs.sharding.spec[1] == "sequence" and qs.addressable_shards[0].data.shape[1] == T // 8
    assert [c[0] for c in calls] == [mode]  # the exchange asked for ran
    _assert_close((out, grads), _reference(q, k, v, w, m, causal))


@pytest.mark.parametrize("mode,causal", [("ulysses", True), ("allgather", False)])
def test_exchange_with_one_block(mode, causal, monkeypatch):
    """The default block holds these lengths whole: Ulysses' local attention and an all-gather call
    without causal skipping run as one block (plain autodiff) inside the shard_map."""
    monkeypatch.setattr(attn_mod, "BLOCK", 512)
    q, k, v, w, m = _inputs(mask="pad")
    out, grads, _, _ = _sharded(SequenceParallel(mode=mode), q, k, v, w, m, causal)
    _assert_close((out, grads), _reference(q, k, v, w, m, causal))


@pytest.mark.parametrize("mode", ["ulysses", "allgather", "ring"])
def test_exchange_with_a_full_mask(mode):
    """A [B, H, T, S] mask: its rows follow the queries (zig-zag reordered), its heads the Ulysses split."""
    q, k, v, w, m = _inputs(mask="full")
    out, grads, _, _ = _sharded(SequenceParallel(mode=mode), q, k, v, w, m, True)
    _assert_close((out, grads), _reference(q, k, v, w, m, True))


@pytest.mark.parametrize("mode", ["ulysses", "allgather", "ring"])
@pytest.mark.parametrize("compose", ["fsdp+sp", "sp+tp"])
def test_exchange_composes_with_fsdp_and_tensor(mode, compose):
    """fsdp=4 x sequence=2 (rows split too), or data=2 x sequence=2 x tensor=2 with heads split over tensor."""
    sp = SequenceParallel(mode=mode)
    strategy = FSDP() + sp if compose == "fsdp+sp" else sp + TensorParallel()
    q, k, v, w, m = _inputs(mask="pad")
    out, grads, calls, qs = _sharded(strategy, q, k, v, w, m, True)
    shape = dict(qs.sharding.mesh.shape)
    assert shape["sequence"] == 2 and (shape["fsdp"] == 4 if compose == "fsdp+sp" else shape["tensor"] == 2)
    assert [c[0] for c in calls] == [mode]
    _assert_close((out, grads), _reference(q, k, v, w, m, True))


def test_allgather_takes_a_key_length_the_axis_does_not_divide():
    """Cross-attention to 12 keys over sequence=8: keys/values enter whole, queries stay split."""
    q, k, v, w, m = _inputs(s=12, mask="pad")  # heads divide: only the key length rules out Ulysses
    out, grads, calls, _ = _sharded(SequenceParallel(), q, k, v, w, m, False)
    assert calls[0][0] == "allgather" and "key/value length 12" in calls[0][1]
    _assert_close((out, grads), _reference(q, k, v, w, m, False))


# ------------------------------------------------------------------------------ choosing and refusing
def test_auto_picks_ulysses_when_heads_divide_else_allgather():
    mesh = {"sequence": 4, "tensor": 2}
    assert attention_plan("auto", True, (2, 64, 8, 64), (2, 64, 8, 64), causal=True, mesh_shape=mesh)[0] == "ulysses"
    ex, why = attention_plan("auto", True, (2, 64, 8, 64), (2, 64, 4, 64), causal=True, mesh_shape=mesh)
    assert ex == "allgather" and "key/value heads 4 over tensor x sequence = 2 x 4 = 8" in why
    ex, why = attention_plan("auto", True, (2, 66, 8, 64), (2, 66, 8, 64), causal=False, mesh_shape=mesh)
    assert ex == "dense" and "query length 66 is not divisible by sequence=4" in why
    sp = SequenceParallel(mode="ring")
    assert sp.plan((2, 64, 6, 8), (2, 64, 6, 8), causal=True, mesh_shape=mesh)[0] == "ring"


def test_refusals_name_the_numbers():
    mesh = {"sequence": 4, "tensor": 2}
    with pytest.raises(
        ValueError, match=r"Ulysses .* query heads 12 and key/value heads 4 over tensor x sequence = 2 x 4 = 8"
    ):
        attention_plan("ulysses", True, (2, 64, 12, 8), (2, 64, 4, 8), causal=True, mesh_shape=mesh)
    with pytest.raises(
        ValueError, match=r"2 x sequence = 8 zig-zag chunks, but it is 36 \(36 % 8 = 4\).*load_balance=False"
    ):
        attention_plan("ring", True, (2, 36, 8, 8), (2, 36, 8, 8), causal=True, mesh_shape=mesh)
    with pytest.raises(ValueError, match=r"2 x sequence = 8 zig-zag chunks, but it is 36"):
        attention_plan("auto", True, (2, 36, 6, 8), (2, 36, 6, 8), causal=True, mesh_shape=mesh)
    # not causal, or not balanced: a multiple of the axis is enough
    assert attention_plan("ring", True, (2, 36, 8, 8), (2, 36, 8, 8), causal=False, mesh_shape=mesh)[0] == "ring"
    assert attention_plan("ring", False, (2, 36, 8, 8), (2, 36, 8, 8), causal=True, mesh_shape=mesh)[0] == "ring"
    with pytest.raises(ValueError, match=r"ring, sequence=4\): key/value length 10 is not divisible by 4"):
        attention_plan("ring", False, (2, 36, 8, 8), (2, 10, 8, 8), causal=False, mesh_shape=mesh)


def test_the_choice_is_announced_once(capsys, caplog, monkeypatch):
    """Printed when logging is not configured, logged to jaxlight.strategies.sequence when it is; once per plan."""
    q, k, v, w, m = _inputs(b=2, t=16, h=4, hk=2, mask=None)
    expected = "SequenceParallel(mode='auto') on sequence=8, tensor=1: 1 attention call(s): 1 x allgather"
    why = "key/value heads 2 over tensor x sequence = 1 x 8 = 8 do not divide"
    seq_mod = importlib.import_module("jaxlight.strategies.sequence")
    monkeypatch.setattr(seq_mod, "_ANNOUNCED", set())
    monkeypatch.setattr(seq_mod.log, "hasHandlers", lambda: False)
    _sharded(SequenceParallel(size=8, mode="auto", load_balance=False), q, k, v, w, m, True)
    printed = capsys.readouterr().out
    assert expected in printed and why in printed
    _sharded(SequenceParallel(size=8, mode="auto", load_balance=False), q, k, v, w, m, True)
    assert "SequenceParallel" not in capsys.readouterr().out  # the same plan is not printed again
    monkeypatch.undo()
    monkeypatch.setattr(seq_mod, "_ANNOUNCED", set())
    caplog.set_level(logging.INFO, logger="jaxlight.strategies.sequence")
    _sharded(SequenceParallel(size=8, mode="auto", load_balance=False), q, k, v, w, m, True)
    assert expected in caplog.text and "SequenceParallel" not in capsys.readouterr().out


def test_piece_settings_and_composition():
    assert STRATEGY_REGISTRY["sp"] is SequenceParallel
    full = dict.fromkeys(("data", "fsdp", "tensor", "sequence", "stage", "expert"), 1)
    assert resolve_strategy("sp").mesh_shape(8) == {**full, "sequence": 8}
    assert resolve_strategy("fsdp+sp").mesh_shape(8) == {**full, "fsdp": 4, "sequence": 2}
    assert resolve_strategy("sp+tp").mesh_shape(8) == {**full, "data": 2, "tensor": 2, "sequence": 2}
    assert resolve_strategy("fsdp+sp+tp").mesh_shape(8) == {**full, "fsdp": 2, "tensor": 2, "sequence": 2}
    assert (FSDP() + SequenceParallel(size=4)).mesh_shape(8) == {**full, "fsdp": 2, "sequence": 4}
    with pytest.raises(CompositionError, match="both set mesh axis 'sequence' \\(2 vs 4\\)"):
        SequenceParallel(2) + SequenceParallel(4)
    with pytest.raises(ValueError, match="mode must be one of"):
        SequenceParallel(mode="ulyses")
    with pytest.raises(ValueError, match="size must be a positive int"):
        SequenceParallel(0)
    with pytest.raises(ValueError, match=r"batch_dims\['tokens'\] = 0"):
        SequenceParallel(batch_dims={"tokens": 0})
    assert "mode='ring'" in repr(resolve_strategy(SequenceParallel(mode="ring")))
    assert SequenceParallel() == SequenceParallel() and hash(SequenceParallel()) == hash(SequenceParallel())
    mesh1 = resolve_strategy(SequenceParallel(size=1)).build_mesh(jax.devices()[:1])
    assert SequenceParallel(size=1).trace_context(mesh1) is None  # nothing to split: plain attention


def test_batch_dims_default_and_declared():
    sp = SequenceParallel()
    assert sp.batch_dims("tokens", (8, 128)) == {1: "sequence"}  # [batch, length]
    assert sp.batch_dims("0", (8, 128)) == {1: "sequence"}  # (x, y) token pairs
    assert sp.batch_dims("image", (8, 32, 32, 3)) == {}  # images are not split
    assert sp.batch_dims("feats", (8, 128, 16)) == {}  # rank 3 only when declared
    assert sp.batch_dims("label", (8,)) == {}
    sp = SequenceParallel(batch_dims={"feats": 1, "inputs/*": 1, "labels": None})
    assert sp.batch_dims("feats", (8, 128, 16)) == {1: "sequence"}
    assert sp.batch_dims("inputs/ids", (8, 128)) == {1: "sequence"}
    assert sp.batch_dims("labels", (8, 128)) == {}  # declared whole
    assert sp.batch_dims("tokens", (8, 128)) == {}  # a declaration is the complete list
    with pytest.raises(ValueError, match=r"matches no batch leaf; the batch has leaves \['feats', 'labels'\]"):
        sp.check_batch({"feats": (8, 128, 16), "labels": (8, 128)}, {"sequence": 2})
    with pytest.raises(ValueError, match=r"declares dim 2 of batch leaf x, which has shape \(8, 128\)"):
        SequenceParallel(batch_dims={"x": 2}).check_batch({"x": (8, 128)}, {"sequence": 2})
    assert resolve_strategy("fsdp+sp").batch_dims("tokens", (8, 128)) == {1: "sequence"}


# ------------------------------------------------------------------------------ what each exchange sends
_OP = re.compile(
    r"^\s*%?\S+ = (.+?) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(", re.M
)


def _compiled_hlo(mode, h=8, hk=8):
    st = resolve_strategy(SequenceParallel(mode=mode))
    mesh = st.build_mesh(jax.devices())
    sds = lambda heads: jax.ShapeDtypeStruct(
        (2, T, heads, D), jnp.float32, sharding=NamedSharding(mesh, P(None, "sequence"))
    )

    def loss(q, k, v):
        return (attention(q, k, v, causal=True) ** 2).sum()

    with jax.set_mesh(mesh), st.trace_context(mesh):
        return jax.jit(jax.value_and_grad(loss, (0, 1, 2))).lower(sds(h), sds(hk), sds(hk)).compile().as_text()


def _whole_length_arrays(hlo: str) -> set[str]:
    """Float arrays with a dimension as long as the whole sequence."""
    return {s for s in re.findall(r"f32\[([\d,]+)\]", hlo) if str(T) in s.split(",")}


@pytest.fixture(scope="module")
def hlos():
    return {mode: _compiled_hlo(mode) for mode in ("ulysses", "allgather", "ring")}


def test_ulysses_trades_positions_for_heads_with_all_to_all(hlos):
    ops = Counter(op for _, op in _OP.findall(hlos["ulysses"]))
    # q, k, v and the output forward; the output's cotangent and dq, dk, dv backward
    assert ops["all-to-all"] >= 4, ops
    assert ops["all-gather"] == 0 and ops["collective-permute"] == 0, ops
    assert _whole_length_arrays(hlos["ulysses"])  # each device attends the whole sequence (on its heads)


def test_allgather_gathers_whole_keys_and_values(hlos):
    ops = _OP.findall(hlos["allgather"])
    whole_kv = f"f32[2,{T},8,{D}]"
    gathered = [shape for shape, op in ops if op == "all-gather" and whole_kv in shape]
    assert len(gathered) >= 2, ops  # keys and values
    assert not any(op == "all-to-all" for _, op in ops)


def test_ring_permutes_and_never_holds_whole_keys_or_values(hlos):
    ops = _OP.findall(hlos["ring"])
    kinds = Counter(op for _, op in ops)
    # in the loop bodies: k, v forward; k, v, dk, dv backward; then dk, dv home once more
    # (the zig-zag reorder adds two per reordered tensor and per cotangent)
    assert kinds["collective-permute"] >= 2 + 4 + 2, kinds
    sent = {s for shape, op in ops if op == "collective-permute" for s in re.findall(r"f32\[([\d,]+)\]", shape)}
    assert sent <= {f"2,{T // 8},8,{D}", f"2,{T // 16},8,{D}"}, sent  # a device's block, or half of it
    assert kinds["all-gather"] == 0 and kinds["all-to-all"] == 0, kinds
    assert not _whole_length_arrays(hlos["ring"])  # in neither direction


# ------------------------------------------------------------------------------ memory at long sequences
def test_activation_memory_falls_with_the_sequence_axis(monkeypatch):
    """One transformer layer (examples/models.py) at 8192 tokens, loss and gradients compiled under
    sequence=8 and sequence=1 (default block size): temporaries per device from memory_analysis()."""
    monkeypatch.setattr(attn_mod, "BLOCK", 512)
    import optax
    from flax import nnx

    import jaxlight as jl
    from examples.models import CausalTransformer, GPTConfig

    seq = 8192
    cfg = GPTConfig(d_model=256, n_layers=1, n_heads=8, seq_len=seq)

    def temp_bytes(strategy, devices):
        st = resolve_strategy(strategy)
        mesh = st.build_mesh(jax.devices()[:devices])
        with nnx.use_eager_sharding(False):
            graph, params = nnx.split(CausalTransformer(cfg, nnx.Rngs(0)))

        def loss(params, x, y):
            logits = nnx.merge(graph, params)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        tok = jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=NamedSharding(mesh, P(None, "sequence")))
        ps = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P())), params)
        with jax.set_mesh(mesh), jl.nn.axis_rules(mesh, st.logical_rules), st.trace_context(mesh):
            compiled = jax.jit(jax.value_and_grad(loss)).lower(ps, tok, tok).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    one = temp_bytes(SequenceParallel(size=1), 1)
    ratio = {m: temp_bytes(SequenceParallel(size=8, mode=m), 8) / one for m in ("ulysses", "allgather", "ring")}
    # Every activation is 1/8 per device; Ulysses and the ring add only per-device blocks. The all-gather
    # also holds the whole keys/values (and their gradients before the reduce-scatter): more than the others.
    assert ratio["ulysses"] < 0.2 and ratio["ring"] < 0.25, ratio
    assert ratio["allgather"] < 0.5 and ratio["allgather"] > max(ratio["ulysses"], ratio["ring"]), ratio


def test_example_model_attention_is_unchanged(monkeypatch):
    """examples/models.py now calls jl.nn.attention: same parameters, same logits and gradients as the
    einsum + tril + softmax it replaced (within float rounding)."""
    import optax
    from flax import nnx

    import examples.models as models

    cfg = models.GPTConfig(d_model=32, n_layers=2, n_heads=4, seq_len=16)
    tokens = np.random.default_rng(0).integers(0, 256, size=(2, 16)).astype(np.int32)

    def loss_and_grads():
        with nnx.use_eager_sharding(False):
            net = models.CausalTransformer(cfg, nnx.Rngs(0))
        graph, params = nnx.split(net)

        def loss(p):
            logits = nnx.merge(graph, p)(tokens)
            return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean(), logits

        (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return np.asarray(logits), {
            jax.tree_util.keystr(k): np.asarray(g) for k, g in jax.tree_util.tree_leaves_with_path(grads)
        }

    def previous(q, k, v, *, causal, implementation=None):  # the model's attention before jl.nn.attention
        t = q.shape[1]
        scores = jnp.einsum("bqhk,bshk->bhqs", q, k) / jnp.sqrt(jnp.float32(q.shape[-1]))
        scores = jnp.where(jnp.tril(jnp.ones((t, t), dtype=bool)), scores, jnp.finfo(scores.dtype).min)
        return jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(scores, axis=-1), v)

    logits, grads = loss_and_grads()
    monkeypatch.setattr(models, "attention", previous)
    ref_logits, ref_grads = loss_and_grads()
    # 12 stacked leaves for the blocks (a LayerStack: one leaf per parameter, all layers); tok, pos, head, ln_f
    assert grads.keys() == ref_grads.keys() and len(grads) == 12 + 5
    assert np.abs(logits - ref_logits).max() <= FWD_TOL * 10  # logits ~ O(1): a few ulps
    assert max(float(np.abs(grads[k] - ref_grads[k]).max()) for k in grads) <= GRAD_TOL
