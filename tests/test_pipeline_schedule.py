"""Pipeline schedules at kernel level (no Trainer): the transformer of tests/pipeline_models.py with
its blocks in a LayerStack, placed by ``param_specs`` and traced under the strategy's mesh and trace
context as the trainer does, against the same function on one device.

Tolerance 1e-5 absolute on the loss and every gradient (float32; the pipeline sums each layer's
gradient over microbatches in another order than one device does). The HLO checks read the
replica groups of every collective against the mesh's stage coordinates.
"""

from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding

import jaxlight as jl
from jaxlight.state import merge_models, rest_after, split_models
from jaxlight.strategies import FSDP, TensorParallel, resolve_strategy
from jaxlight.strategies.pipeline import PipelineConfig, PipelineParallel, bubble, run_pipeline
from jaxlight.strategies.placement import batch_spec, named, param_specs, rest_specs
from tests.pipeline_models import DIMS, StackLM, collectives, crosses_stage, token_batches

TOL = 1e-5
ROWS = 16

# Shapes beyond tests/test_pipeline_training.py's (which runs 4-stage GPipe/circular with data, fsdp, tp, offload)
CONFIGS = {
    "gpipe-S8": "pp",  # stage 8, M = 8, one layer per stage
    "circular-S4-R2-M8": PipelineParallel(4, 8, "circular", 2),  # M > S: re-entries wait M - S + 1 ticks
    "circular-S2-R4+fsdp": PipelineParallel(2, schedule="circular", repeats=4) + FSDP(min_shard=256),
    "gpipe-S2-M4+tp": PipelineParallel(2, 4) + TensorParallel(2, min_shard=256),  # stage 2 x tensor 2 x data 2
}


@contextlib.contextmanager
def traced(strategy, mesh):
    """What the trainer enters while tracing a step: the mesh, the rules, the pieces' trace contexts."""
    with (
        jax.set_mesh(mesh),
        nnx.use_eager_sharding(False),
        jl.nn.axis_rules(mesh, strategy.logical_rules),
        strategy.trace_context(mesh),
    ):
        yield


def _build(**kw):
    with nnx.use_eager_sharding(False):
        return split_models({"net": StackLM(nnx.Rngs(0), **{**DIMS, **kw})})


def _loss_fn(parts, train=True):
    def loss(params, rest, tokens):
        models = merge_models(parts, params, rest, train=train)
        logits = models["net"](tokens[:, :-1])
        out = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        return out, rest_after(parts, models)

    return loss


def _place(strategy, parts, params, rest, tokens):
    s = resolve_strategy(strategy)
    mesh = s.build_mesh(jax.devices())
    # the refusals run first, as in the trainer
    s.check_model(params, parts.params.variables, mesh)
    s.check_batch({"tokens": tokens.shape}, dict(mesh.shape))
    psh = {k: named(mesh, v) for k, v in param_specs(params, parts.params.variables, s, mesh).items()}
    rsh = {k: named(mesh, v) for k, v in rest_specs(rest, parts.rest.variables, s, mesh).items()}
    tsh = NamedSharding(mesh, batch_spec(mesh, 2))
    placed = (jax.device_put(params, psh), jax.device_put(rest, rsh), jax.device_put(tokens, tsh))
    return s, mesh, psh, rsh, placed


@pytest.fixture(scope="module")
def model():
    parts, params, rest = _build()
    tokens = token_batches(1, ROWS, vocab=DIMS["vocab"])[0]["tokens"]
    grad = jax.jit(jax.value_and_grad(_loss_fn(parts), has_aux=True))
    (loss, _), grads = grad(params, rest, tokens)
    return parts, params, rest, tokens, float(loss), grads


@pytest.fixture(scope="module")
def runs(model):
    parts, params, rest, tokens, _, _ = model
    out = {}
    for name, strategy in CONFIGS.items():
        s, mesh, psh, _, placed = _place(strategy, parts, params, rest, tokens)
        with traced(s, mesh):
            fn = jax.jit(
                jax.value_and_grad(_loss_fn(parts), has_aux=True), out_shardings=((named(mesh, ()), None), psh)
            )
            compiled = fn.lower(*placed).compile()
        (loss, _), grads = compiled(*placed)
        out[name] = (s, mesh, float(loss), grads, compiled.as_text())
    return out


def _stack_keys(params):
    return [k for k in params if "/blocks/" in k]


# ---------------------------------------------------------------- numbers
@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_and_gradients_match_one_device(model, runs, name):
    _, params, _, _, ref_loss, ref_grads = model
    _, _, loss, grads, _ = runs[name]
    assert abs(loss - ref_loss) <= TOL
    assert grads.keys() == ref_grads.keys()
    worst = max(float(jnp.abs(grads[k] - ref_grads[k]).max()) for k in grads)
    assert worst <= TOL, worst
    assert min(float(jnp.abs(ref_grads[k]).max()) for k in _stack_keys(params)) > 1e-4  # every layer learns


@pytest.mark.parametrize("name", list(CONFIGS))
def test_stack_gradients_stay_split_over_stage(model, runs, name):
    _, params, _, _, _, _ = model
    _, mesh, _, grads, _ = runs[name]
    stages = mesh.shape["stage"]
    for k in _stack_keys(params):
        g = grads[k]
        assert g.sharding.spec[0] == "stage", (k, g.sharding.spec)
        assert g.addressable_shards[0].data.shape[0] == DIMS["layers"] // stages


@pytest.mark.parametrize("name", list(CONFIGS))
def test_schedule_runs_RM_plus_S_minus_1_ticks(runs, name):
    s, mesh, _, _, hlo = runs[name]
    pp = s.find(PipelineParallel)
    stages = mesh.shape["stage"]
    ticks = pp.repeats * pp.num_microbatches(stages) + stages - 1
    trips = [int(n) for n in re.findall(r'known_trip_count":\{"n":"(\d+)"', hlo)]
    assert trips.count(ticks) == 2, (ticks, trips)  # the forward schedule and its transpose


@pytest.mark.parametrize("name", list(CONFIGS))
def test_activations_cross_stages_by_permute_and_no_weight_is_gathered_over_stage(runs, name):
    s, mesh, _, _, hlo = runs[name]
    ops = collectives(hlo)
    permutes = [g for op, _, g in ops if op == "collective-permute" and crosses_stage(g, mesh)]
    assert len(permutes) >= 2  # forward ring and its transpose
    crossing = {(op, shape) for op, shape, g in ops if crosses_stage(g, mesh)}
    assert not [c for c in crossing if c[0] == "all-gather"], crossing
    if s.find(PipelineParallel).repeats > 1:
        # natural layer order in the state: the step regroups the chunks with an all-to-all over stage
        assert any(op == "all-to-all" for op, _ in crossing)
    else:
        assert not any(op == "all-to-all" for op, _, _ in ops)


# ---------------------------------------------------------------- arguments and state
class Gated(nnx.Module):
    """A layer with a per-row argument (a gate per example) and a whole one (a bias)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
        self.w = nnx.Param(init(rngs.params(), (8, 8)))

    def __call__(self, x, gate, bias, *, scale: float):
        return x + scale * gate[:, None] * jnp.tanh(x @ self.w[...] + bias)


class Noisy(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(8, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(jnp.tanh(self.bn(self.lin(x))))


def _small(layer, n=4, **rngs):
    with nnx.use_eager_sharding(False):
        return split_models({"s": jl.nn.LayerStack(layer, n, rngs=nnx.Rngs(0, **rngs))})


def test_per_row_arguments_travel_with_their_microbatch():
    parts, params, rest = _small(Gated)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)
    gate = jnp.asarray(rng.uniform(size=(16,)), jnp.float32)  # rows: split with x
    bias = jnp.asarray(rng.normal(size=(8,)), jnp.float32)  # whole: given to every microbatch

    def loss(params, x, gate, bias):
        y = merge_models(parts, params, rest)["s"](x, gate, bias, scale=0.5)
        return jnp.sum(y * jnp.arange(16.0)[:, None])  # row-dependent: a row in the wrong place shows

    ref_l, ref_g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x, gate, bias)
    s, mesh, psh, _, (p, _, _) = _place(PipelineParallel(4, 4), parts, params, rest, np.zeros((16, 2)))
    with traced(s, mesh):
        got_l, g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(p, x, gate, bias)
    assert abs(float(got_l) - float(ref_l)) <= TOL * abs(float(ref_l))
    np.testing.assert_allclose(g[0]["s/layers/w"], ref_g[0]["s/layers/w"], atol=TOL, rtol=1e-5)
    np.testing.assert_allclose(g[1], ref_g[1], atol=TOL, rtol=1e-5)


def test_dropout_and_batch_stats_run_per_microbatch_and_eval_is_exact():
    parts, params, rest = _small(Noisy, dropout=1)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 8)), jnp.float32)

    def fwd(params, rest, x, train):
        models = merge_models(parts, params, rest, train=train)
        return models["s"](x), rest_after(parts, models)

    y_eval, _ = jax.jit(fwd, static_argnums=3)(params, rest, x, False)
    s, mesh, _, rsh, (p, r, _) = _place(PipelineParallel(4, 4), parts, params, rest, np.zeros((16, 2)))
    with traced(s, mesh):
        f = jax.jit(fwd, static_argnums=3, out_shardings=(None, rsh))
        y_pp_eval, _ = f(p, r, x, False)
        y1, r1 = f(p, r, x, True)
        y2, _ = f(p, r1, x, True)
    np.testing.assert_allclose(y_pp_eval, y_eval, atol=1e-6, rtol=0)  # eval: no randomness, same result
    # train: each of the 4 microbatches drew its own mask from every layer's stream
    np.testing.assert_array_equal(np.asarray(r1["s/layers/drop/rngs/count"]), [4, 4, 4, 4])
    assert r1["s/layers/drop/rngs/key"].sharding.spec[0] == "stage"
    assert bool(jnp.all(jnp.isfinite(y1))) and float(jnp.abs(y1 - y2).max()) > 1e-3  # the streams advanced
    # dropout really ran: entries whose residual branch every layer dropped (~1/16) came out unchanged
    untouched = float(jnp.mean(jnp.isclose(y1, x, atol=0, rtol=0)))
    assert 0.0 < untouched < 0.25
    # running statistics moved away from their initial zeros, on every layer
    assert bool(jnp.all(jnp.abs(r1["s/layers/bn/mean"]).max(axis=1) > 1e-4))


# ---------------------------------------------------------------- refusals and composition
def test_refusals_say_the_numbers(model):
    parts, params, _, _, _, _ = model
    mesh8 = resolve_strategy("pp").build_mesh(jax.devices())
    with pytest.raises(ValueError, match="no parameter has the leading logical axis 'layers'"):
        plain = {k: v for k, v in params.items() if "/blocks/" not in k}
        PipelineParallel().check_model(plain, parts.params.variables, mesh8)
    parts6, params6, _ = _build(layers=6)
    with pytest.raises(ValueError, match=r"has 6 layers, not divisible by stages x repeats = 8 x 1 = 8"):
        PipelineParallel().check_model(params6, parts6.params.variables, mesh8)
    mesh4 = resolve_strategy(PipelineParallel(4)).build_mesh(jax.devices())
    with pytest.raises(ValueError, match=r"= 4 x 2 = 8"):
        PipelineParallel(4, schedule="circular", repeats=2).check_model(params6, parts6.params.variables, mesh4)
    with pytest.raises(
        ValueError, match=r"12 rows: 6 per batch shard \(data\*fsdp\*expert = 2\), not divisible by microbatches=4"
    ):
        PipelineParallel(4).check_batch({"tokens": (12, 9)}, dict(mesh4.shape))
    with pytest.raises(
        ValueError, match=r"microbatches=2 is fewer than stages=4: the pipeline would idle 60% of every step"
    ):
        PipelineParallel(4, 2)
    with pytest.raises(ValueError, match=r"microbatches=2 is fewer than stages=8: the pipeline would idle 78%"):
        PipelineParallel(microbatches=2).check_batch({"tokens": (16, 9)}, dict(mesh8.shape))
    # stage x sequence is accepted (tests/test_pipeline_sequence.py trains it); what it cannot run is refused there
    seq = resolve_strategy(PipelineParallel(2) + jl.strategies.Layout(axes={"sequence": 2}))
    assert seq.check_model(params, parts.params.variables, seq.build_mesh(jax.devices())) is None
    with pytest.raises(ValueError, match="repeats=2 needs schedule='circular'"):
        PipelineParallel(4, repeats=2)
    with pytest.raises(
        ValueError, match=r"unknown pipeline schedule 'zb-v'; schedules are \('gpipe', 'circular', '1f1b'\)"
    ):
        PipelineParallel(schedule="zb-v")


def test_a_batch_the_microbatches_do_not_divide_is_refused_while_tracing():
    """Batches the trainer did not check (an eval batch) are refused at trace time, not mis-split."""
    parts, params, rest = _small(Gated)
    s = resolve_strategy(PipelineParallel(4, 4))
    mesh = s.build_mesh(jax.devices())
    x = jnp.zeros((6, 8))
    with traced(s, mesh), pytest.raises(ValueError, match=r"LayerStack input \(6, 8\) has 6 rows"):
        jax.eval_shape(lambda p: merge_models(parts, p, rest)["s"](x, x[:, 0], x[0], scale=1.0), params)
    cfg = PipelineConfig(4, 4, "gpipe", 1, mesh)
    with pytest.raises(ValueError, match="LayerStack of 6 layers is not divisible by stages x repeats = 4 x 1 = 4"):
        run_pipeline(None, {"w": jnp.zeros((6, 2))}, {}, jnp.zeros((8, 2)), (), {}, cfg)


def test_strings_mesh_and_rules():
    assert resolve_strategy("pp").mesh_shape(8)["stage"] == 8
    assert {k: v for k, v in resolve_strategy("pp+fsdp").mesh_shape(8).items() if v > 1} == {"stage": 2, "fsdp": 4}
    assert {k: v for k, v in resolve_strategy("pp+tp").mesh_shape(8).items() if v > 1} == {
        "stage": 2,
        "tensor": 2,
        "data": 2,
    }
    s = PipelineParallel(4) + FSDP()
    assert {k: v for k, v in s.mesh_shape(8).items() if v > 1} == {"stage": 4, "fsdp": 2}
    assert s.logical_rules[0] == ("layers", "stage") and "stage" not in s.param_forbidden_axes
    assert "stage" in resolve_strategy("fsdp").param_forbidden_axes
    assert (
        repr(PipelineParallel(4, 8, "circular", 2)) and "circular" in PipelineParallel(4, 8, "circular", 2).describe()
    )
    assert bubble(4, 4) == pytest.approx(3 / 7) and bubble(4, 8, 2) == pytest.approx(3 / 19) and bubble(1, 4) == 0
    cfg = PipelineConfig(4, 8, "circular", 2, resolve_strategy("pp").build_mesh(jax.devices()))
    assert cfg.ticks == 19 and cfg.bubble == pytest.approx(3 / 19)
    assert PipelineParallel(4).num_microbatches(4) == 4 and PipelineParallel(4, 16).num_microbatches(4) == 16
