"""The 1F1B pipeline schedule (``PipelineParallel(schedule="1f1b")``) through the Trainer: 3 SGD(momentum) steps
of the LayerStack transformer (tests/pipeline_models.py) against one device, alone and composed with data
parallel, FSDP, tensor parallel, gradient accumulation and ``steps_per_execution``; dropout in the stack
against GPipe (both draw per microbatch); the schedule's ticks and ring of stage inputs in the compiled
HLO; its compiled temp bytes against GPipe's (``memory_analysis()``); the refusals; at kernel level (the
schedule's ``value_and_grad`` on a traced loss function), the stack's per-row and whole extra arguments.

Tolerance 1e-5 absolute on losses, parameters, step-1 gradients and logged values (float32, other
reduction order; SGD with momentum, so rounding differences are not amplified).
"""

from __future__ import annotations

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight.state import merge_models, split_models
from jaxlight.strategies import FSDP, TensorParallel, pipeline_1f1b, resolve_strategy
from jaxlight.strategies.pipeline import PipelineParallel, active_pipeline, bubble
from jaxlight.strategies.pipeline_1f1b import bubble as bubble_1f1b
from jaxlight.strategies.pipeline_1f1b import in_flight, slots, ticks
from jaxlight.strategies.placement import named, param_specs
from jaxlight.tracing import StepError
from tests.helpers import Record, host_params, quiet
from tests.pipeline_models import DIMS, PipeLM, StackLM, collectives, crosses_stage, token_batches

TOL = 1e-5
ROWS = 16


class AccLM(PipeLM):
    """PipeLM that also returns and logs the next-token accuracy (a scalar output combined over microbatches)."""

    def training_step(self, batch, batch_idx):
        tokens = batch["tokens"]
        logits = self.net(tokens[:, :-1])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        acc = (logits.argmax(-1) == tokens[:, 1:]).mean()
        self.log("train_loss", loss)
        self.log("train_max_logit", logits.max(), reduce_fx="max")
        return {"loss": loss, "acc": acc}


CONFIGS = {
    "single": ("auto", 1, {}),
    "1f1b": (PipelineParallel(4, schedule="1f1b"), 8, {}),  # stage 4 x data 2, M = 4
    "1f1b-M8": (PipelineParallel(4, 8, "1f1b"), 8, {}),  # M = 8 > 2S-1: the ring of 7 inputs wraps
    "1f1b+fsdp": (PipelineParallel(2, 4, "1f1b") + FSDP(min_shard=1024), 8, {}),  # stage 2 x fsdp 4
    "1f1b+tp": (PipelineParallel(4, schedule="1f1b") + TensorParallel(2, min_shard=1024), 8, {}),
    "1f1b-spe": (PipelineParallel(4, schedule="1f1b"), 8, {"steps_per_execution": 3}),
    # interleaved: 2 passes over 4 stages, 2 groups of 4 microbatches; 4 passes over 2 stages x fsdp 4
    "1f1b-R2-M8": (PipelineParallel(4, 8, "1f1b", 2), 8, {}),
    "1f1b-R4+fsdp": (PipelineParallel(2, 4, "1f1b", 4) + FSDP(min_shard=1024), 8, {}),
}


def _trainer(strategy, devices, callbacks=(), **kw):
    return jl.Trainer(
        strategy=strategy, devices=devices, callbacks=list(callbacks), **quiet(num_sanity_val_steps=None, **kw)
    )


@pytest.fixture(scope="module")
def runs():
    data = token_batches(3, ROWS, vocab=DIMS["vocab"])
    out = {}
    for name, (strategy, devices, kw) in CONFIGS.items():
        rec = Record(("loss", "acc"))
        t = _trainer(strategy, devices, [rec], max_epochs=1, **kw)
        t.fit(AccLM(**DIMS), data)
        out[name] = (t, [(float(a), float(b)) for a, b in rec.losses])
    return out


def _stack(params) -> list[str]:
    return [k for k in params if "/blocks/" in k]


# ---------------------------------------------------------------- numbers
@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "single"])
def test_losses_outputs_and_parameters_match_one_device(runs, name):
    ref_t, ref = runs["single"]
    t, got = runs[name]
    assert len(got) == len(ref) == 3
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)  # the loss and the scalar output "acc"
    a, b = host_params(ref_t), host_params(t)
    assert a.keys() == b.keys()
    worst = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    assert worst <= TOL, worst
    assert abs(ref[-1][0] - ref[0][0]) > 1e-3  # the steps moved the loss


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "single"])
def test_gradients_at_step_one_match_one_device(runs, name):
    ref = {k: np.asarray(v) for k, v in runs["single"][0].train_state.opt_state[0]["grad"].items()}
    got = {k: np.asarray(v) for k, v in runs[name][0].train_state.opt_state[0]["grad"].items()}
    assert ref.keys() == got.keys()
    worst = max(float(np.abs(got[k] - ref[k]).max()) for k in ref)
    assert worst <= TOL, worst
    # every group of parameters learns: before the stack (embedding), the stack, after it (norm, head)
    for k in ("net/embed/embedding", "net/ln/scale", "net/head/kernel", *_stack(ref)):
        assert float(np.abs(ref[k]).max()) > 1e-4, k


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "single"])
def test_logged_values_combine_over_microbatches_like_one_device(runs, name):
    ref = runs["single"][0].callback_metrics
    got = runs[name][0].callback_metrics
    for key in ("train_loss", "train_max_logit"):  # reduce_fx mean and max
        assert abs(float(got[key]) - float(ref[key])) <= TOL, key


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "single"])
def test_stack_state_is_split_over_stage(runs, name):
    t, _ = runs[name]
    stages = t.mesh.shape["stage"]
    for k in _stack(t.train_state.params):
        p = t.train_state.params[k]
        assert p.sharding.spec[0] == "stage", (k, p.sharding)
        assert p.addressable_shards[0].data.shape[0] == DIMS["layers"] // stages


def test_gradient_accumulation_around_1f1b_matches_one_device():
    data = token_batches(6, ROWS, vocab=DIMS["vocab"], seed=1)
    out = {}
    for name, strategy, devices in (("single", "auto", 1), ("1f1b", PipelineParallel(4, schedule="1f1b"), 8)):
        rec = Record()
        t = _trainer(strategy, devices, [rec], max_epochs=1, accumulate_grad_batches=2)
        t.fit(PipeLM(**DIMS), data)
        out[name] = (host_params(t), [float(x) for x in rec.losses], t.global_step)
    assert out["single"][2] == out["1f1b"][2] == 3
    np.testing.assert_allclose(out["1f1b"][1], out["single"][1], atol=TOL, rtol=0)
    a, b = out["single"][0], out["1f1b"][0]
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) <= TOL


@pytest.mark.parametrize("other,repeats", [("gpipe", 1), ("circular", 2)])
def test_dropout_in_the_stack_matches_the_forward_scan_schedules(other, repeats):
    """Every schedule runs each layer chunk over the microbatches in microbatch order, so each microbatch draws
    the same masks from the stacked layers' streams; 1F1B's backward recomputes a chunk with the stream state
    its forward used (kept in the ring with the input)."""
    data = token_batches(3, ROWS, vocab=DIMS["vocab"], seed=2)
    out = {}
    for sched in (other, "1f1b"):
        rec = Record()
        t = _trainer(PipelineParallel(4, 8, sched, repeats), 8, [rec], max_epochs=1)
        t.fit(PipeLM(**DIMS, dropout=0.2), data)
        out[sched] = (host_params(t), [float(x) for x in rec.losses], t.train_state.model_state)
    np.testing.assert_allclose(out["1f1b"][1], out[other][1], atol=TOL, rtol=0)
    a, b = out[other][0], out["1f1b"][0]
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) <= TOL
    counts = [k for k in out[other][2] if k.endswith("count") and "/blocks/" in k]
    assert counts
    for k in counts:  # the streams advanced alike (and did advance)
        np.testing.assert_array_equal(np.asarray(out[other][2][k]), np.asarray(out["1f1b"][2][k]))
        assert int(np.asarray(out["1f1b"][2][k]).min()) > 0


def test_bf16_mixed_precision_compiles_and_its_losses_match_one_device():
    """bf16-mixed compiles under 1F1B (its stage-0 cotangents are all-reduced in float32: a bfloat16
    all-reduce there aborts XLA:CPU) and the losses of 3 steps are within 2 bf16 eps of one device's."""
    data = token_batches(3, ROWS, vocab=DIMS["vocab"])
    out = {}
    for name, strategy, devices in (("single", "auto", 1), ("1f1b", PipelineParallel(4, schedule="1f1b"), 8)):
        rec = Record()
        t = _trainer(strategy, devices, [rec], max_epochs=1, precision="bf16-mixed")
        t.fit(PipeLM(**DIMS), data)
        out[name] = (host_params(t), [float(x) for x in rec.losses])
    np.testing.assert_allclose(out["1f1b"][1], out["single"][1], rtol=2**-6, atol=0)
    assert all(v.dtype == np.float32 for v in out["1f1b"][0].values())


def test_validation_runs_the_forward_schedule_and_equals_one_device(runs):
    data = token_batches(2, ROWS, vocab=DIMS["vocab"], seed=3)
    got = {}
    for name in ("single", "1f1b"):
        t, _ = runs[name]
        with contextlib.redirect_stdout(io.StringIO()):
            got[name] = t.validate(t.lightning_module, data)[0]["val_loss"]
    assert abs(got["1f1b"] - got["single"]) <= TOL


# ---------------------------------------------------------------- the schedule in the compiled step
def test_schedule_functions():
    assert ticks(4, 16) == (3, 16, 3)
    assert slots(4, 16) == 7 and slots(4, 4) == 4
    assert in_flight(4, 16) == [7, 5, 3, 1]
    assert ticks(4, 8, 2) == (7, 12, 7) and slots(4, 8, 2) == 15 and in_flight(4, 8, 2) == [15, 13, 11, 9]
    # a stage's forward slots idle (S-1)/(R*M+S-1): GPipe's bubble for R = 1, circular's for R > 1
    for S, M, R in ((4, 16, 1), (4, 8, 2), (2, 4, 4), (8, 8, 1)):
        assert bubble_1f1b(S, M, R) == pytest.approx(bubble(S, M, R))


@pytest.mark.parametrize("name,R", [("1f1b-M8", 1), ("1f1b-R2-M8", 2)])
def test_compiled_step_runs_warmup_steady_cooldown_ticks_and_keeps_a_ring_of_2RS_minus_1_inputs(runs, name, R):
    t, _ = runs[name]
    hlo = t.compiled["train"].as_text()
    S, M = 4, 8
    # the loops that carry the ring of stage inputs (2RS-1 slots of one microbatch: 2 rows over data 2 -> 1 row,
    # 8 tokens, embed 64) are the schedule's: warm-up, steady and cool-down
    ring = f"f32[{2 * R * S - 1},1,8,64]"
    loops = [ln for ln in hlo.splitlines() if " while(" in ln and ring in ln.split(" while(")[0]]
    trips = sorted(int(n) for ln in loops for n in re.findall(r'known_trip_count":\{"n":"(\d+)"', ln))
    assert trips == sorted([R * S - 1, R * (M - S) + S, R * S - 1]), trips
    every = [int(n) for n in re.findall(r'known_trip_count":\{"n":"(\d+)"', hlo)]
    assert R * M + S - 1 not in every  # no forward-scan schedule (and no autodiff of one)
    ops = collectives(hlo)
    permutes = [g for op, _, g in ops if op == "collective-permute" and crosses_stage(g, t.mesh)]
    assert len(permutes) >= 2  # activations down, cotangents up
    gathers = [shape for op, shape, g in ops if op == "all-gather" and crosses_stage(g, t.mesh)]
    assert not gathers, gathers


def test_1f1b_temp_bytes_are_at_most_0_6_of_gpipe_at_16_microbatches_on_4_stages():
    data = token_batches(1, 32, vocab=DIMS["vocab"])  # 32 rows: data 2 x 16 microbatches
    temp = {}
    for sched in ("gpipe", "1f1b"):
        t = _trainer(PipelineParallel(4, 16, sched), 8, max_steps=1)
        t.fit(PipeLM(**DIMS), data)
        temp[sched] = t.compiled["train"].memory_analysis().temp_size_in_bytes
    assert temp["1f1b"] <= 0.6 * temp["gpipe"], temp


# ---------------------------------------------------------------- refusals
class TwoStacks(PipeLM):
    def configure_model(self) -> None:
        super().configure_model()
        self.more = jl.nn.LayerStack(lambda r: nnx.Linear(64, 64, rngs=r), 4, rngs=nnx.Rngs(1))

    def training_step(self, batch, batch_idx):
        net = self.net
        x = self.more(net.blocks(net.embed(batch["tokens"][:, :-1])))
        logits = net.head(net.ln(x))
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()


class DropoutBeforeStack(PipeLM):
    def configure_model(self) -> None:
        super().configure_model()
        self.drop = nnx.Dropout(0.1, rngs=nnx.Rngs(dropout=3))

    def training_step(self, batch, batch_idx):
        net = self.net
        logits = net.head(net.ln(net.blocks(self.drop(net.embed(batch["tokens"][:, :-1])))))
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()


class HalfBatch(PipeLM):
    def training_step(self, batch, batch_idx):
        tokens = batch["tokens"][: batch["tokens"].shape[0] // 2]
        logits = self.net(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


class NoStack(PipeLM):
    def training_step(self, batch, batch_idx):
        net = self.net
        logits = net.head(net.ln(net.embed(batch["tokens"][:, :-1])))
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()


class Manual(PipeLM):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        opt.step(self.manual_backward(loss))
        return loss


@pytest.mark.parametrize(
    "module,message",
    [
        (TwoStacks, r"one LayerStack per training_step, and this training_step called 2"),
        (DropoutBeforeStack, r"may not change non-parameter state; these changed: \['drop/rngs/"),
        (HalfBatch, r"batch leaf \['tokens'\] \(16, 9\) has 16 rows, not 8"),
        (NoStack, r"this training_step called none"),
        (Manual, r"needs automatic optimization"),
    ],
    ids=["two-stacks", "dropout-outside", "rows", "no-stack-call", "manual"],
)
def test_what_cannot_be_split_is_refused_by_name_before_any_step(module, message):
    t = _trainer(PipelineParallel(4, schedule="1f1b"), 8, max_steps=1)
    with pytest.raises((ValueError, StepError), match=message):
        t.fit(module(**DIMS), token_batches(1, ROWS, vocab=DIMS["vocab"]))
    assert t.global_step == 0


def test_interleaved_1f1b_needs_groups_of_stages_microbatches():
    with pytest.raises(ValueError, match=r"groups of stages=4, and microbatches=6 is not a multiple of 4"):
        PipelineParallel(4, 6, "1f1b", repeats=2)
    t = _trainer(PipelineParallel(microbatches=3, schedule="1f1b", repeats=2), 2, max_steps=1)  # 2 stages
    with pytest.raises(ValueError, match=r"groups of stages=2, and microbatches=3 is not a multiple of 2"):
        t.fit(PipeLM(**DIMS), token_batches(1, 12, vocab=DIMS["vocab"]))
    assert t.global_step == 0


def test_same_model_without_a_pipeline_is_a_plain_stack():
    """The refusals are the schedule's: the two-stack module trains under GPipe."""
    t = _trainer(PipelineParallel(4), 8, max_steps=1)
    t.fit(TwoStacks(**DIMS), token_batches(1, ROWS, vocab=DIMS["vocab"]))
    assert t.global_step == 1
    assert isinstance(t.lightning_module.net, StackLM)


# ---------------------------------------------------------------- kernel level: the stack's extra arguments
class Masked(nnx.Module):
    """A layer with a per-row argument (a bool mask per example), a whole one (an int shift) and a static one."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.w = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (8, 8)))

    def __call__(self, x, mask, shift, *, scale: float):
        return x + scale * mask[:, None] * jnp.tanh(x @ self.w[...] + shift)


def _kernel_step(arg):
    """``value_and_grad`` of a stack of Masked layers under 1F1B (4 stages x data 2, M = 4) and on one device."""
    with nnx.use_eager_sharding(False):
        parts, params, rest = split_models({"s": jl.nn.LayerStack(Masked, 4, rngs=nnx.Rngs(0))})
    rng = np.random.default_rng(0)
    batch = {
        "x": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32),
        "mask": jnp.asarray(rng.uniform(size=(16,)) > 0.3),  # rows: split with x
        "w": jnp.asarray(rng.uniform(size=(16,)), jnp.float32),  # a per-row weight of the loss
    }
    shift = arg  # whole: given to every microbatch

    def forward(params, batch):
        y = merge_models(parts, params, rest)["s"](batch["x"], batch["mask"], shift, scale=0.5)
        value = jnp.mean(jnp.sum(y, -1) * batch["w"])
        return value, (value, {}, {}, {}, {})

    ref = jax.jit(jax.value_and_grad(lambda p: forward(p, batch)[0]))(params)
    s = resolve_strategy(PipelineParallel(4, 4, "1f1b"))
    mesh = s.build_mesh(jax.devices())
    psh = {k: named(mesh, v) for k, v in param_specs(params, parts.params.variables, s, mesh).items()}
    placed = jax.device_put(params, psh)
    with (
        jax.set_mesh(mesh),
        nnx.use_eager_sharding(False),
        jl.nn.axis_rules(mesh, s.logical_rules),
        s.trace_context(mesh),
    ):
        step = lambda p, b: pipeline_1f1b.value_and_grad(forward, p, b, {}, frozenset(p), active_pipeline())
        (loss, _), grads = jax.jit(step)(placed, batch)
    return ref, (loss, grads)


def test_stack_arguments_travel_with_their_microbatch():
    (ref_loss, ref_grads), (loss, grads) = _kernel_step(jnp.arange(8, dtype=jnp.int32) % 3)
    assert abs(float(loss) - float(ref_loss)) <= TOL
    worst = max(float(jnp.abs(grads[k] - ref_grads[k]).max()) for k in ref_grads)
    assert worst <= TOL, worst
    assert min(float(jnp.abs(g).max()) for g in ref_grads.values()) > 1e-3


def test_a_floating_point_stack_argument_is_refused():
    with pytest.raises(ValueError, match=r"has a floating-point one \(8,\) float32, which would get no gradient"):
        _kernel_step(jnp.linspace(0.0, 1.0, 8))
