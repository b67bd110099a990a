"""What ``"bf16-mixed"`` computes in, read from the traced train step's jaxpr.

Every matrix product and convolution of NNX, Linen (``from_linen``) and Equinox (``from_equinox``) models
runs on bf16 operands whatever the layers' ``dtype`` defaults; parameters and optimizer state stay float32;
the loss stays close to fp32's; a layer with an explicit float32 ``dtype`` keeps it and is named by
``Float32MatmulWarning``; the FLOPs by operand dtype reach ``ThroughputMonitor`` and ``ModelSummary``.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import jaxlight as jl
from examples.precision_models import MODELS, Classifier, feature_batches
from jaxlight.errors import Float32MatmulWarning
from jaxlight.flops import matmul_dtypes
from tests.helpers import Losses, quiet

STEPS = 20


def _fit(make, data, precision: str, steps: int, callbacks=()) -> tuple[jl.Trainer, list[float]]:
    losses = Losses()
    trainer = jl.Trainer(max_steps=steps, devices=1, precision=precision, callbacks=[losses, *callbacks], **quiet())
    trainer.fit(make(), data)
    return trainer, [float(x) for x in losses.losses]


def _float_leaves(tree) -> list[jax.Array]:
    return [x for x in jax.tree.leaves(tree) if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)]


@pytest.mark.parametrize("name", list(MODELS))
def test_bf16_mixed_multiplies_in_bf16_and_learns_as_fp32(name):
    make, batches = MODELS[name]
    data = batches(STEPS)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Float32MatmulWarning)  # a step that computes in bf16 is not warned about
        trainer, bf16 = _fit(make, data, "bf16-mixed", STEPS)
    counts = matmul_dtypes(trainer.compiled["train"].jaxpr)
    assert counts.flops > 0
    assert counts.half_fraction >= 0.95, counts.by_dtype
    assert trainer.engine.matmul_dtypes.by_dtype == counts.by_dtype  # what the trainer checked at compile time
    # master parameters and optimizer state in float32
    state = trainer.train_state
    assert {str(x.dtype) for x in _float_leaves(state.params)} == {"float32"}
    assert {str(x.dtype) for x in _float_leaves(state.opt_state)} == {"float32"}

    _, fp32 = _fit(make, data, "32-true", STEPS)
    tail = lambda losses: float(np.mean(losses[-5:]))
    head = float(np.mean(fp32[:5]))
    assert tail(fp32) < 0.9 * head, fp32  # it learned: the comparison below is not of two initial losses
    assert abs(tail(bf16) - tail(fp32)) <= 0.05 * tail(fp32), (tail(bf16), tail(fp32))


class Wide(nnx.Module):
    """An MLP whose wide middle layer sets ``dtype=float32`` itself."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.inp = nnx.Linear(32, 256, rngs=rngs)
        self.hidden = nnx.Linear(256, 256, dtype=jnp.float32, rngs=rngs)
        self.out = nnx.Linear(256, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(nnx.relu(self.inp(x)))))


class WideNet(Classifier):
    def configure_model(self):
        self.net = Wide(nnx.Rngs(0))


def test_an_explicit_float32_layer_is_kept_and_named_once():
    mon, summary = jl.callbacks.ThroughputMonitor(window=2), jl.callbacks.ModelSummary()
    module = WideNet()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer = jl.Trainer(
            max_steps=4,
            devices=1,
            precision="bf16-mixed",
            log_every_n_steps=2,
            callbacks=[mon, summary],
            **quiet(enable_model_summary=True),
        )
        trainer.fit(module, feature_batches(4))
    named = [w for w in seen if issubclass(w.category, Float32MatmulWarning)]
    assert len(named) == 1, [str(w.message) for w in named]  # once, when the step was first compiled
    msg = str(named[0].message)
    assert "net/hidden (Linear, dtype=float32)" in msg and "net/inp" not in msg and "net/out" not in msg
    assert "test_precision_compute.py" in msg  # where the float32 products are called from

    counts = matmul_dtypes(trainer.compiled["train"].jaxpr)
    rows = 32  # feature_batches; hidden: forward, input gradient and weight gradient
    assert counts.by_dtype[("float32", "float32")] == 3 * 2 * rows * 256 * 256
    assert counts.float32_fraction > 0.05
    # the user's layers are as they were built: the policy set dtypes on the step's own copies only
    assert module.net.hidden.dtype == jnp.float32 and module.net.inp.dtype is None and module.net.out.dtype is None

    # reported: the monitor's per-dtype FLOPs add up to its FLOPs per step; the summary prints the split
    dtypes = {k: v for k, v in mon.metrics.items() if k.startswith("train/matmul_flops/")}
    assert sum(dtypes.values()) == pytest.approx(mon.metrics["train/flops_per_step"])
    assert dtypes["train/matmul_flops/fp32_fp32"] == pytest.approx(counts.by_dtype[("float32", "float32")])
    assert mon.metrics["train/matmul_half_fraction"] == pytest.approx(counts.half_fraction)
    assert summary.matmul_dtypes == counts
    assert f"float32 x float32 {counts.float32_fraction:.1%}" in summary.summary


class LinenHead(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(256)(x))
        x = nn.relu(nn.Dense(256, dtype=jnp.float32, name="kept")(x))
        return nn.Dense(4)(x)


class LinenHeadNet(Classifier):
    def configure_model(self):
        self.net = jl.nn.from_linen(LinenHead(), jnp.zeros((2, 32)))


def test_linen_layers_follow_the_policy_unless_set_and_are_named_by_path():
    with pytest.warns(Float32MatmulWarning, match=r"LinenHead/kept at .*test_precision_compute\.py"):
        trainer, _ = _fit(LinenHeadNet, feature_batches(2), "bf16-mixed", 2)
    counts = matmul_dtypes(trainer.compiled["train"].jaxpr)
    rows = 32
    assert counts.by_dtype[("float32", "float32")] == 3 * 2 * rows * 256 * 256  # the explicit layer only
    # Dense_0 has no input gradient (its input is the batch): forward and weight gradient
    assert counts.by_dtype[("bfloat16", "bfloat16")] == 2 * 2 * rows * 32 * 256 + 3 * 2 * rows * 256 * 4


def test_a_linen_layer_wrapped_whole_is_not_changed():
    dense = nn.Dense(8)

    class Net(Classifier):
        def configure_model(self):
            self.net = jl.nn.from_linen(dense, jnp.zeros((2, 32)))

    trainer, _ = _fit(Net, feature_batches(2), "bf16-mixed", 2)
    assert matmul_dtypes(trainer.compiled["train"].jaxpr).half_fraction == 1.0
    assert dense.dtype is None  # the bound clone computed in bf16; the user's module is untouched


def test_matmul_dtypes_counts_by_operand_dtype_through_loops():
    def f(a, b):
        def step(c, _):
            return c + jax.lax.dot(a, a).astype(jnp.float32), None

        c, _ = jax.lax.scan(step, jnp.zeros((4, 4)), None, length=3)
        return c @ b  # the line named below

    counts = matmul_dtypes(jax.make_jaxpr(f)(jnp.ones((4, 4), jnp.bfloat16), jnp.ones((4, 4))))
    assert counts.by_dtype == {("bfloat16", "bfloat16"): 3 * 128.0, ("float32", "float32"): 128.0}
    assert counts.flops == 4 * 128 and counts.exact
    assert counts.half_fraction == 0.75 and counts.float32_fraction == 0.25
    ((where, flops),) = counts.float32_sites.items()
    line = f.__code__.co_firstlineno + 5
    assert f"test_precision_compute.py:{line}:" in where and flops == 128.0


def test_single_block_attention_gradients_multiply_in_bf16():
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 32, 4, 16)) for i in range(3))
    w = jax.random.normal(jax.random.key(3), (2, 32, 4, 16))

    def loss(q, k, v):
        return (jl.nn.attention(q, k, v, causal=True).astype(jnp.float32) * w).sum()

    half = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    grad = jax.grad(loss, argnums=(0, 1, 2))
    assert matmul_dtypes(jax.make_jaxpr(grad)(*half)).half_fraction == 1.0
    want = grad(*(x.astype(jnp.float32) for x in half))  # the same inputs, every product in float32
    for got, ref in zip(grad(*half), want):
        scale = float(jnp.abs(ref).max())
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref), atol=2e-2 * scale)


def test_fp32_steps_are_reported_but_not_checked():
    trainer, _ = _fit(WideNet, feature_batches(2), "32-true", 2)
    assert trainer.engine.matmul_dtypes is None
    counts = matmul_dtypes(trainer.compiled["train"].jaxpr)
    assert set(counts.by_dtype) == {("float32", "float32")} and counts.half_fraction == 0.0
