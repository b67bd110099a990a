"""jl.nn.MoE under half precision: expert parallelism trains under ``"bf16-mixed"`` like one device.

Under bf16-mixed the MoE's tokens and weights are bfloat16 inside its ``shard_map``, which leaves the mesh axes
it does not split automatic. In jax 0.10.2 a bfloat16 psum there aborts XLA:CPU's compiler ("Invalid binary
instruction opcode copy"; tests/test_pipeline_bf16.py shows it alone), and ``"ep+tp"``, ``"ep+sp"``,
``"fsdp+ep"``, ``"ddp"`` and ``"tp"`` had some: the forward sum of the tensor shards' outputs, and the gradient
sums jax inserts for values invariant over a manual axis that meet varying ones (the expert weights over the
data/fsdp/sequence axes, the tokens and gates over tensor). The layer sums in float32 instead. Checked here: no
bfloat16 all-reduce or reduce-scatter in the lowered forward and backward of the layer, whose output keeps its
dtype; through the Trainer (tests/expert_models.py, 3 SGD(momentum) steps on [16, 9] batches) losses within
2 bf16 eps (2^-6 relative) of one device under bf16-mixed, parameter updates within 2^-6 relative (global
norm), every traced matmul but the router's (float32 by design) in bfloat16.
"""

from __future__ import annotations

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxlight as jl
from jaxlight.flops import matmul_dtypes
from jaxlight.strategies import ExpertParallel, SequenceParallel, resolve_strategy
from tests.expert_models import ExpertLM, Outputs, token_batches
from tests.helpers import Record, host_params, quiet

BF16_EPS = 2.0**-7
SP = ExpertParallel() + SequenceParallel(batch_dims={"tokens": None})
STRATEGIES = {
    "ep": ("ep", {"expert": 8}),
    "ep+tp": ("ep+tp", {"data": 2, "tensor": 2, "expert": 2}),
    "ep+sp": (SP, {"data": 2, "sequence": 2, "expert": 2}),
    # the layer's shard_map without the exchange: aborted too (bf16 weight gradients summed over data/fsdp/tensor)
    "fsdp+ep": ("fsdp+ep", {"fsdp": 4, "expert": 2}),
    "ddp": ("ddp", {"data": 8}),
    "tp": ("tp", {"tensor": 8}),
}
_REDUCER = re.compile(r"stablehlo\.(all_reduce|reduce_scatter).*?\^bb0\(%\w+: tensor<(\w+)>", re.S)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_the_layers_sums_are_float32_under_bf16(name):
    """The layer's forward and backward as a bf16-mixed step traces them: bf16 tokens and weights, no bf16 sum."""
    strategy = resolve_strategy(STRATEGIES[name][0])
    mesh = strategy.build_mesh(jax.devices()[:8])
    with nnx.use_eager_sharding(False):
        moe = jl.nn.MoE(64, 128, 8, top_k=2, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(moe, nnx.Param, ...)
    params = jax.tree.map(lambda v: v.astype(jnp.bfloat16), params)  # as bf16-mixed casts them
    x = jax.random.normal(jax.random.key(1), (16, 8, 64), jnp.bfloat16)
    params, x = jax.device_put((params, x), NamedSharding(mesh, P()))

    def loss(p, x):
        y, aux = nnx.merge(graphdef, p, rest)(x)
        return jnp.sum(y.astype(jnp.float32) ** 2) + aux["load_balance"], y

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    with jax.set_mesh(mesh), jl.nn.axis_rules(mesh, strategy.logical_rules):
        lowered = step.lower(params, x)
    sums = _REDUCER.findall(lowered.as_text())  # read before compiling: a bf16 sum would abort the process
    assert ("all_reduce", "f32") in sums, sums  # the aux losses' sums over the token axes at least
    assert {t for _, t in sums} == {"f32"}, sums
    with jax.set_mesh(mesh), jl.nn.axis_rules(mesh, strategy.logical_rules):
        (_, y), grads = step(params, x)
    assert y.dtype == jnp.bfloat16 and {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.bfloat16)}
    ref_loss = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (_, y0), _ = ref_loss(jax.device_get(params), jax.device_get(x))  # no rules: every expert local
    y, y0 = np.asarray(y, np.float32), np.asarray(y0, np.float32)
    assert np.abs(y - y0).max() <= 2 * BF16_EPS * np.abs(y0).max()


def _fit(strategy, devices: int):
    cb, rec = Outputs(), Record()
    t = jl.Trainer(
        max_epochs=1, devices=devices, strategy=strategy, callbacks=[cb, rec], **quiet(precision="bf16-mixed")
    )
    with contextlib.redirect_stdout(io.StringIO()):
        t.fit(ExpertLM(), token_batches(3, 16))
    return t, [float(o["loss"]) for o in cb.outputs], rec.start_params


def _update_gap(params: dict, ref: dict, init: dict) -> float:
    """``|params - ref| / |ref - init|`` over all parameters (global norms): the update's relative difference."""
    num = sum(float(np.sum((params[k] - ref[k]) ** 2)) for k in ref)
    den = sum(float(np.sum((ref[k] - init[k]) ** 2)) for k in ref)
    return (num / den) ** 0.5


@pytest.fixture(scope="module")
def single():
    return _fit("auto", 1)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_expert_parallel_trains_under_bf16_mixed_like_one_device(single, name):
    ref_t, ref_losses, init = single
    strategy, axes = STRATEGIES[name]
    t, losses, _ = _fit(strategy, 8)
    assert {a: t.mesh.shape[a] for a in axes} == axes
    assert len(losses) == len(ref_losses) == 3
    np.testing.assert_allclose(losses, ref_losses, rtol=2 * BF16_EPS, atol=0)
    params = host_params(t)
    assert {str(v.dtype) for v in params.values()} == {"float32"}  # master weights
    assert _update_gap(params, host_params(ref_t), init) <= 2.0**-6  # measured 0.004-0.005
    counts = matmul_dtypes(t.compiled["train"].jaxpr)
    # bfloat16 but the router, which runs in float32 by design
    assert counts.half_fraction >= 0.9 and set(counts.by_dtype) <= {("bfloat16",) * 2, ("float32",) * 2}
    assert all("(_moe_body)" in site for site in counts.float32_sites), counts.float32_sites
