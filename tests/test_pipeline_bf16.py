"""The pipeline under half precision: every schedule trains under ``"bf16-mixed"`` (and GPipe under ``"16-mixed"``).

Under bf16-mixed the stack's activations are bfloat16, so they cross the pipeline's collectives in bfloat16:
the psum that broadcasts the last stage's outputs over ``stage`` and the psums that sum the gradients of
stage-invariant inputs. In jax 0.10.2 a bfloat16 psum inside a ``shard_map`` that leaves some mesh axes
automatic aborts XLA:CPU's compiler (first test); the pipeline sums over stages in float32 instead
(``pipeline.stage_sum``). Checked here: no bfloat16 all-reduce in the lowered step; the pipelined stack's
output is bfloat16 and bit-equal to a scan over the layers, its gradients within 2 bf16 eps of the scan's;
through the Trainer (3 SGD(momentum) steps, tests/pipeline_models.py, stage 4 x data 2), each schedule's
losses within 2 bf16 eps (2^-6 relative) of one device under bf16-mixed, its parameter updates within 2^-4
relative (global norm; measured 0.024-0.027, while one device's bf16-mixed and 32-true updates differ by
0.020), every traced matmul in bfloat16; ``"pp+sp"`` likewise.
"""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxlight as jl
from jaxlight.flops import matmul_dtypes
from jaxlight.strategies import SequenceParallel, resolve_strategy
from jaxlight.strategies.pipeline import (
    SCHEDULES,
    PipelineConfig,
    PipelineParallel,
    run_pipeline,
    scan_layers,
    stage_sum,
)
from tests.helpers import Record, host_params, quiet
from tests.pipeline_models import DIMS, PipeLM, token_batches
from tests.test_pipeline_sequence import SeqLM, _batches, _pipeline

ROWS = 16
BF16_EPS = 2.0**-7
STRATEGIES = {
    "gpipe": PipelineParallel(4),  # stage 4 x data 2, M = 4
    "circular": PipelineParallel(4, 8, "circular", 2),
    "1f1b": PipelineParallel(4, schedule="1f1b"),
}

_XLA_BUG = textwrap.dedent(
    """
    import jax, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    mesh = jax.make_mesh((2, 4), ("data", "stage"))
    f = jax.shard_map(lambda x: jax.lax.psum(x, "stage"), mesh=mesh, in_specs=P(), out_specs=P(),
                      axis_names={"stage"})
    jax.jit(f)(jnp.ones((8, 4), jnp.bfloat16))
    """
)


def _partly_manual_sum(sum_fn):
    mesh = jax.make_mesh((2, 4), ("data", "stage"), devices=jax.devices()[:8])
    return jax.jit(jax.shard_map(sum_fn, mesh=mesh, in_specs=P(), out_specs=P(), axis_names={"stage"}))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="an XLA:CPU compiler bug")
def test_a_bfloat16_psum_in_a_partly_manual_shard_map_aborts_xla_cpu_and_stage_sum_does_not():
    """The XLA bug the pipeline works around. When this starts failing, jax fixed it: drop the float32 casts in
    pipeline.stage_sum / pipeline.mark_varying and pipeline_1f1b's gx sum."""
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", _XLA_BUG], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode != 0 and "Invalid binary instruction opcode copy" in proc.stderr, proc.stderr[-2000:]
    # the workaround: summed in float32, returned in bfloat16 (exact here: small integers)
    x = jnp.arange(32, dtype=jnp.bfloat16).reshape(8, 4)
    y = _partly_manual_sum(lambda a: stage_sum(a, "stage"))(x)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y, np.float32), 4 * np.asarray(x, np.float32))


# ---------------------------------------------------------------- the schedule on a traced stack
def _layer(p, r, h, args, kwargs):
    scale, bias = args  # a per-row and a whole argument, both bfloat16: their gradients are summed over stages
    y = jnp.tanh(h @ p["w"].astype(h.dtype)) * scale[:, None] + bias
    return y.astype(h.dtype), r


@pytest.mark.parametrize("schedule,repeats", [("gpipe", 1), ("circular", 2)])
def test_pipelined_bf16_stack_sums_over_stages_in_float32_and_matches_a_scan(schedule, repeats):
    mesh = resolve_strategy(PipelineParallel(4)).build_mesh(jax.devices())
    cfg = PipelineConfig(4, 4, schedule, repeats, mesh)
    k = jax.random.split(jax.random.key(0), 4)
    params = {"w": jax.random.normal(k[0], (8, 16, 16)) / 4}
    x = jax.random.normal(k[1], (8, 16)).astype(jnp.bfloat16)
    scale = (1 + jax.random.normal(k[2], (8,)) / 10).astype(jnp.bfloat16)
    bias = (jax.random.normal(k[3], (16,)) / 10).astype(jnp.bfloat16)

    def grads(stack):
        def loss(p, x, scale, bias):
            y, _ = stack(p, x, (scale, bias))
            return jnp.sum(y.astype(jnp.float32) ** 2), y

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))

    pipe = grads(lambda p, x, a: run_pipeline(_layer, p, {}, x, a, {}, cfg))
    scan = grads(lambda p, x, a: scan_layers(_layer, p, {}, x, a, {}, None))
    lowered = pipe.lower(params, x, scale, bias).as_text()
    reduced = re.findall(r"stablehlo\.all_reduce.*?\^bb0\(%\w+: tensor<(\w+)>", lowered, re.S)
    assert reduced and set(reduced) == {"f32"}, reduced  # outputs' broadcast, the argument gradients' sums
    (_, y), g = pipe(params, x, scale, bias)
    (_, y0), g0 = scan(params, x, scale, bias)
    assert y.dtype == x.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y0, np.float32))  # same products per row
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0)):
        assert a.dtype == b.dtype
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(a - b).max() <= 2 * BF16_EPS * np.abs(b).max()  # other summation order over microbatches


# ---------------------------------------------------------------- through the Trainer
def _fit(strategy, devices: int, precision: str, model=None, data=None):
    rec = Record()
    t = jl.Trainer(
        strategy=strategy,
        devices=devices,
        callbacks=[rec],
        **quiet(num_sanity_val_steps=None, max_epochs=1, precision=precision),
    )
    with contextlib.redirect_stdout(io.StringIO()):
        t.fit(
            PipeLM(**DIMS) if model is None else model,
            token_batches(3, ROWS, vocab=DIMS["vocab"]) if data is None else data,
        )
    return t, [float(x) for x in rec.losses], rec.start_params


def _update_gap(params: dict, ref: dict, init: dict) -> float:
    """``|params - ref| / |ref - init|`` over all parameters (global norms): the update's relative difference."""
    num = sum(float(np.sum((params[k] - ref[k]) ** 2)) for k in ref)
    den = sum(float(np.sum((ref[k] - init[k]) ** 2)) for k in ref)
    return (num / den) ** 0.5


@pytest.fixture(scope="module")
def single():
    return {p: _fit("auto", 1, p) for p in ("bf16-mixed", "16-mixed")}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_trains_under_bf16_mixed_like_one_device(single, schedule):
    ref_t, ref_losses, init = single["bf16-mixed"]
    t, losses, _ = _fit(STRATEGIES[schedule], 8, "bf16-mixed")
    assert len(losses) == len(ref_losses) == 3
    np.testing.assert_allclose(losses, ref_losses, rtol=2 * BF16_EPS, atol=0)
    params = host_params(t)
    assert {str(v.dtype) for v in params.values()} == {"float32"}  # master weights
    assert _update_gap(params, host_params(ref_t), init) <= 2.0**-4
    counts = matmul_dtypes(t.compiled["train"].jaxpr)
    assert counts.flops > 0 and set(counts.by_dtype) == {("bfloat16", "bfloat16")}, counts.by_dtype


def test_gpipe_trains_under_16_mixed_like_one_device(single):
    """float16 with loss scaling: the scaled loss's gradients cross the stages (summed in float32 too)."""
    ref_t, ref_losses, init = single["16-mixed"]
    t, losses, _ = _fit(STRATEGIES["gpipe"], 8, "16-mixed")
    np.testing.assert_allclose(losses, ref_losses, rtol=2.0**-9, atol=0)  # 2 float16 eps
    assert _update_gap(host_params(t), host_params(ref_t), init) <= 2.0**-6
    counts = matmul_dtypes(t.compiled["train"].jaxpr)
    assert counts.flops > 0 and set(counts.by_dtype) == {("float16", "float16")}, counts.by_dtype


@pytest.fixture(scope="module")
def seq_single() -> list[float]:
    return _fit("auto", 1, "bf16-mixed", SeqLM(), _batches())[1]


@pytest.mark.parametrize(
    "schedule,mode,sp",
    [(s, "ulysses", 2) for s in SCHEDULES] + [("gpipe", "allgather", 4), ("1f1b", "allgather", 4)],
)
def test_pp_sp_trains_under_bf16_mixed_like_one_device(seq_single, schedule, mode, sp):
    """Under "pp+sp" the stage is manual over sequence too: the stack's parameters are invariant over it, and
    their gradients are summed over the sequence pieces once, in float32 (not per tick and layer in bf16);
    under "allgather" the keys'/values' gradients are reduce-scattered in float32 too."""
    ref_losses = seq_single
    t, losses, _ = _fit(_pipeline(schedule) + SequenceParallel(sp, mode=mode), 8, "bf16-mixed", SeqLM(), _batches())
    assert dict(t.mesh.shape)["sequence"] == sp and dict(t.mesh.shape)["stage"] == 2
    np.testing.assert_allclose(losses, ref_losses, rtol=2 * BF16_EPS, atol=0)
    counts = matmul_dtypes(t.compiled["train"].jaxpr)
    assert counts.half_fraction >= 0.95, counts.by_dtype
