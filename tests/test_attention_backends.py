"""jl.nn.attention's kernels: XLA's fused kernel equals the blockwise one, the choice and its refusals,
the FLOPs of cuDNN's fused primitive. cuDNN's numbers need a GPU: benchmarks/attention_check.py.

Tolerances (absolute, of values about 1): float32 forward 1e-5 and gradients 1e-4 (the same function
summed in another order); bfloat16 forward 4e-2 and gradients 1e-1 (a few bf16 ulps of 2**-8: the two
kernels round the probabilities and the value products at different points).
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlight.flops import matmul_flops
from jaxlight.nn import attention
from jaxlight.strategies import resolve_strategy
from jaxlight.strategies.attention_backends import XLA_SCORES_BYTES, AttentionImplementationError, choose
from jaxlight.strategies.sequence import SequenceParallel, traced_attention_calls

kernel_mod = importlib.import_module("jaxlight.strategies.attention_kernel")
backends_mod = importlib.import_module("jaxlight.strategies.attention_backends")

TOL = {jnp.float32: (1e-5, 1e-4), jnp.bfloat16: (4e-2, 1e-1)}
B, T, H, HK, D = 2, 32, 4, 2, 16  # grouped-query: two query heads per key/value head


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    monkeypatch.setattr(kernel_mod, "BLOCK", 8)  # the blockwise kernel folds several blocks and skips causal ones


def _inputs(mask: str, dtype, t=T, h=H, hk=HK):
    rng = np.random.default_rng(0)
    q = rng.normal(size=(B, t, h, D))
    k, v = rng.normal(size=(2, B, t, hk, D))
    w = rng.normal(size=(B, t, h, D))
    m = None
    if mask == "pad":  # right padding of different lengths
        m = (np.arange(t)[None, :] < np.array([t, t // 2])[:, None])[:, None, None, :]
    elif mask == "full":  # an arbitrary [B, H, T, S] mask
        m = rng.random((B, h, t, t)) > 0.3
    elif mask == "empty_rows":  # left padding: with causal, the first 5 queries of row 1 see no key
        m = np.ones((B, t), bool)
        m[1, :5] = False
        m = m[:, None, None, :]
    cast = lambda x: jnp.asarray(x, dtype)
    return cast(q), cast(k), cast(v), jnp.asarray(w, jnp.float32), m


def _run(impl, q, k, v, w, m, causal):
    f = lambda q, k, v: attention(q, k, v, causal=causal, mask=m, implementation=impl)
    out = f(q, k, v)
    grads = jax.grad(lambda *a: (f(*a).astype(jnp.float32) * w).sum(), (0, 1, 2))(q, k, v)
    return np.asarray(out.astype(jnp.float32)), [np.asarray(g.astype(jnp.float32)) for g in grads], out.dtype


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "causal,mask", [(False, None), (True, None), (False, "pad"), (True, "full"), (True, "empty_rows")]
)
def test_xla_equals_blockwise(dtype, causal, mask):
    q, k, v, w, m = _inputs(mask, dtype)
    out, grads, out_dtype = _run("xla", q, k, v, w, m, causal)
    rout, rgrads, _ = _run("blockwise", q, k, v, w, m, causal)
    fwd_tol, grad_tol = TOL[dtype]
    assert out_dtype == dtype
    assert np.abs(rout).max() > 0.1 and min(np.abs(g).max() for g in rgrads) > 0.1
    assert np.abs(out - rout).max() <= fwd_tol, np.abs(out - rout).max()
    for name, g, r in zip("qkv", grads, rgrads):
        assert np.all(np.isfinite(g)) and np.abs(g - r).max() <= grad_tol, (name, np.abs(g - r).max())
    if mask == "empty_rows":  # rows that see no key: zeros and zero gradients, as the blockwise kernel gives
        np.testing.assert_array_equal(out[1, :5], 0.0)
        np.testing.assert_array_equal(grads[0][1, :5], 0.0)


def test_forced_kernels_that_cannot_run_say_why():
    q, k, v, _, _ = _inputs(None, jnp.bfloat16)
    with pytest.raises(AttentionImplementationError, match=r"'cudnn' cannot run .*needs an NVIDIA GPU.* cpu"):
        attention(q, k, v, implementation="cudnn")
    with pytest.raises(AttentionImplementationError, match=r"one dtype, got float32, bfloat16, bfloat16"):
        attention(q.astype(jnp.float32), k, v, implementation="xla")
    with pytest.raises(AttentionImplementationError, match=r"k \(2, 32, 2, 16\) and v \(2, 32, 2, 8\)"):
        attention(q, k, v[..., :8], implementation="xla")
    with pytest.raises(AttentionImplementationError, match=r"'flash' is not one of \('blockwise', 'xla', 'cudnn'\)"):
        attention(q, k, v, implementation="flash")


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_the_automatic_choice_follows_the_rule(monkeypatch):
    """CPU: the blockwise kernel for every dtype and length. An NVIDIA GPU (its capability faked): cuDNN's
    for half inputs it takes, XLA's while the float32 scores fit XLA_SCORES_BYTES, else the blockwise kernel."""
    small = _sds((2, 128, 8, 64), jnp.bfloat16)
    for dtype in (jnp.float32, jnp.bfloat16):
        q = _sds((2, 128, 8, 64), dtype)
        assert choose(q, q, q, causal=True, mask=None) == "blockwise"
    monkeypatch.setattr(backends_mod, "_cuda_capability", lambda: (9, 0))
    assert choose(small, small, small, causal=True, mask=None) == "cudnn"
    odd = _sds((2, 128, 8, 72 + 4), jnp.bfloat16)  # head_dim 76: not a multiple of 8
    assert choose(odd, odd, odd, causal=True, mask=None) == "xla"
    f32 = _sds((2, 128, 8, 64), jnp.float32)
    assert choose(f32, f32, f32, causal=False, mask=None) == "xla"
    t = int((XLA_SCORES_BYTES / (2 * 8 * 4)) ** 0.5) + 1  # scores just over the limit
    long = _sds((2, t, 8, 64), jnp.float32)
    assert choose(long, long, long, causal=False, mask=None) == "blockwise"
    monkeypatch.setattr(backends_mod, "_cuda_capability", lambda: (8, 0))  # before Hopper: head_dim <= 128
    wide = _sds((2, 128, 8, 256), jnp.bfloat16)
    assert choose(wide, wide, wide, causal=False, mask=None) == "xla"
    with pytest.raises(AttentionImplementationError, match=r"multiple of 8 and at most 128, got 256"):
        choose(wide, wide, wide, causal=False, mask=None, implementation="cudnn")


# ------------------------------------------------------------------------------ sequence parallelism
def _sharded(mode, impl, q, k, v, w, m, causal, lb=False):
    st = resolve_strategy(SequenceParallel(mode=mode, load_balance=lb))
    mesh = st.build_mesh(jax.devices())
    act = NamedSharding(mesh, P(("data", "fsdp"), "sequence"))
    q, k, v, w = (jax.device_put(x, act) for x in (q, k, v, w))

    def loss(q, k, v, w):
        out = attention(q, k, v, causal=causal, mask=m, implementation=impl)
        return (out * w).sum(), out

    with jax.set_mesh(mesh), st.trace_context(mesh):
        (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v, w)
    assert [c[0] for c in traced_attention_calls()] == [mode]
    return np.asarray(out), [np.asarray(g) for g in grads]


@pytest.mark.parametrize("mode,lb", [("ulysses", False), ("allgather", False), ("allgather", True)])
def test_sequence_parallel_local_part_on_xla_equals_one_device(mode, lb):
    """sequence=8 over 64 positions, 8 heads (Ulysses gives each device one), causal with a padding mask:
    the all-gather's fused call takes the causal condition as a mask of its queries' global positions."""
    q, k, v, w, m = _inputs("pad", jnp.float32, t=64, h=8, hk=8)
    out, grads = _sharded(mode, "xla", q, k, v, w, m, True, lb)
    rout, rgrads, _ = _run("blockwise", q, k, v, w, m, True)
    assert np.abs(out - rout).max() <= 1e-5, np.abs(out - rout).max()
    for name, g, r in zip("qkv", grads, rgrads):
        assert np.abs(g - r).max() <= 1e-4, (name, np.abs(g - r).max())


def test_ring_refuses_a_fused_kernel():
    q, k, v, w, m = _inputs(None, jnp.float32, t=64, h=8, hk=8)
    with pytest.raises(AttentionImplementationError, match=r"'xla' cannot run the sequence-parallel ring"):
        _sharded("ring", "xla", q, k, v, w, m, True)


# ------------------------------------------------------------------------------ FLOPs of the fused primitive
@pytest.mark.parametrize("causal", [False, True])
def test_cudnn_fused_attention_flops_equal_the_xla_matmuls(causal, monkeypatch):
    """Traced (never run) with cuDNN's version check faked: the fused primitive's count equals the
    dot_generals of XLA's kernel on the same shapes, forward and forward + backward."""
    fused = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
    if not hasattr(fused, "check_cudnn_version"):  # jax 0.10.2's name; tracing needs cuDNN's version
        pytest.skip("this jax has no fused_attention_stablehlo.check_cudnn_version to fake")
    monkeypatch.setattr(fused, "check_cudnn_version", lambda: 90800)
    q, k = _sds((2, 128, 8, 64), jnp.bfloat16), _sds((2, 128, 4, 64), jnp.bfloat16)

    def fwd(impl):
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)

    def step(impl):
        return jax.grad(lambda *a: fwd(impl)(*a).astype(jnp.float32).sum(), (0, 1, 2))

    for make in (fwd, step):
        jaxpr = jax.make_jaxpr(make("cudnn"))(q, k, k)
        text = str(jaxpr)
        assert "dot_general" not in text and "dot_product_attention_fwd" in text, text
        got, want = matmul_flops(jaxpr), matmul_flops(jax.make_jaxpr(make("xla"))(q, k, k))
        assert got.exact and got.flops == want.flops > 0, (got, want)
    assert want.flops == 3 * 4 * 2 * 8 * 128 * 128 * 64  # forward 4 B H T S D, backward twice it
