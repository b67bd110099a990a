"""Pipeline with sequence parallelism ("pp+sp"): the stage shard_map is manual over stage and sequence.

The sequence-parallel tests' transformer (examples/models.CausalTransformer, attention through
jl.nn.attention), 4 blocks in a LayerStack (so circular's 2 stages x 2 repeats divide), (x, y)
batches of [8, 32] byte tokens, 3 SGD(momentum) steps against one device: losses and parameters
within 1e-5 absolute (float32), for every schedule in pipeline.SCHEDULES (1F1B: its per-microbatch
loss runs on rows gathered over the sequence group) and every exchange, and for interleaved 1F1B.
Each stage holds 1/stages of the stack; the compiled step exchanges positions over the sequence
groups and hands activations T/sequence long between stages.
"""

from __future__ import annotations

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from examples.models import Block, CausalTransformer, GPTConfig, random_windows, stdlib_bytes
from jaxlight.strategies import Layout, SequenceParallel, TensorParallel, resolve_strategy
from jaxlight.strategies.attention_kernel import attention_context
from jaxlight.strategies.pipeline import SCHEDULES, PipelineConfig, PipelineParallel, run_pipeline
from jaxlight.strategies.pipeline_sequence import position_mixing
from jaxlight.strategies.sequence import _SequenceAttention, traced_attention_calls
from jaxlight.summary import per_device_bytes
from tests.helpers import Record, host_params, quiet
from tests.pipeline_models import collectives, crosses_stage, unordered_collectives
from tests.strategy_models import Block as HandWrittenBlock

TOL = 1e-5
BATCH, SEQ = 8, 32
CFG = GPTConfig(d_model=64, n_layers=4, n_heads=8, seq_len=SEQ)


class SeqLM(jl.LightningModule):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()

    def configure_model(self) -> None:
        cfg = GPTConfig(**{**CFG.__dict__, "dropout": self.hparams.dropout})
        self.net = CausalTransformer(cfg, nnx.Rngs(0, dropout=1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = optax.softmax_cross_entropy_with_integer_labels(self.net(x), y).mean()
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", optax.softmax_cross_entropy_with_integer_labels(self.net(x), y).mean())

    def configure_optimizers(self):
        return optax.sgd(0.3, momentum=0.9)


def _batches(n: int = 3) -> list[tuple[np.ndarray, np.ndarray]]:
    x, y = random_windows(stdlib_bytes(100_000), SEQ, n * BATCH, 0)
    return [(x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]) for i in range(n)]


def _fit(strategy, devices: int, model=None):
    cb = Record()
    trainer = jl.Trainer(max_epochs=1, devices=devices, strategy=strategy, callbacks=[cb], **quiet())
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.fit(SeqLM() if model is None else model, train_dataloaders=_batches())
    return trainer, [float(x) for x in cb.losses], cb.start_params


def _pipeline(schedule: str) -> PipelineParallel:
    return PipelineParallel(2, 2, schedule, repeats=2 if schedule == "circular" else 1)


# mode -> (sequence size, the collective that exchanges positions); stage 2 everywhere, data fills the rest
MODES = {"ulysses": (2, "all-to-all"), "allgather": (4, "all-gather"), "ring": (2, "collective-permute")}


@pytest.fixture(scope="module")
def single():
    return _fit("auto", 1)


def _rank(shape: str) -> int:
    return shape.split("[", 1)[1].split("]", 1)[0].count(",") + 1


def _sequence_groups(groups: list[list[int]], mesh) -> bool:
    """Every group is a full set of devices that differ only in their sequence coordinate."""
    names = mesh.axis_names
    coords = {i: np.unravel_index(i, mesh.devices.shape) for i in range(mesh.devices.size)}
    seq = names.index("sequence")
    return all(
        len(g) == mesh.shape["sequence"]
        and len({tuple(c for a, c in enumerate(coords[d]) if a != seq) for d in g}) == 1
        for g in groups
    )


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp_sp_trains_like_one_device(single, schedule, mode):
    sp, collective = MODES[mode]
    trainer, losses, _ = _fit(_pipeline(schedule) + SequenceParallel(sp, mode=mode), 8)
    ref_t, ref_losses, init = single
    shape = dict(trainer.mesh.shape)
    assert (shape["stage"], shape["sequence"], shape["data"]) == (2, sp, 8 // (2 * sp))
    # the stack's layer's attention, the requested exchange, on the global shapes: traced once (GPipe, circular),
    # or in each of 1F1B's scans and recomputing backwards
    calls = traced_attention_calls()
    assert calls and {c[0] for c in calls} == {mode} and {c[3][1] for c in calls} == {SEQ}
    assert len(calls) == 1 or schedule == "1f1b"
    assert len(losses) == len(ref_losses) == 3
    np.testing.assert_allclose(losses, ref_losses, atol=TOL, rtol=0)
    ref, got = host_params(ref_t), host_params(trainer)
    assert ref.keys() == got.keys()
    worst = max(float(np.abs(ref[k] - got[k]).max()) for k in ref)
    assert worst <= TOL, worst
    assert min(float(np.abs(ref[k] - init[k]).max()) for k in ref) > 1e-5  # the steps moved

    # each stage holds 1/stages of the stack, replicated over sequence
    params = trainer.train_state.params
    stack = [k for k in params if "/blocks/" in k]
    assert stack
    for k in stack:
        assert params[k].sharding.spec[0] == "stage" and "sequence" not in jax.tree.leaves(
            tuple(params[k].sharding.spec)
        ), (k, params[k].sharding)
    whole = sum(ref_t.train_state.params[k].nbytes for k in stack)
    assert per_device_bytes([params[k] for k in stack]) == whole // 2

    # the compiled step: positions exchanged within sequence groups, T/sequence-long activations between stages
    hlo = trainer.compiled["train"].as_text()
    ops = collectives(hlo)
    exch = [(s, g) for op, s, g in ops if op == collective and not crosses_stage(g, trainer.mesh)]
    # attention's: on [rows, length, heads, head_dim] (1F1B's loss also gathers [rows, length, d_model] rows)
    assert any(_sequence_groups(g, trainer.mesh) and _rank(s) >= 4 for s, g in exch), (collective, exch)
    rows = BATCH // shape["data"] // 2  # rows of one microbatch on one data shard
    local = f"f32[{rows},{SEQ // sp},{CFG.d_model}]"
    handed = [s for op, s, g in ops if op == "collective-permute" and crosses_stage(g, trainer.mesh)]
    assert handed and all(s.startswith(local) for s in handed), (local, handed)
    assert f"f32[{rows},{SEQ},{CFG.d_model}]" not in " ".join(handed)
    # no loop holding the exchange can run at once with another collective (XLA:CPU would deadlock)
    assert unordered_collectives(hlo) == []

    if (schedule, mode) == ("gpipe", "ulysses"):  # the eval step is pipelined and split the same way
        val = _batches(1)
        with contextlib.redirect_stdout(io.StringIO()):
            got_val = trainer.validate(trainer.lightning_module, val)[0]["val_loss"]
            ref_val = ref_t.validate(ref_t.lightning_module, val)[0]["val_loss"]
        assert "validate" in trainer.compiled and abs(got_val - ref_val) <= TOL


def test_interleaved_1f1b_with_sequence_parallelism_trains_like_one_device(single):
    """repeats=2: two layer chunks per stage, passes handed from the last stage back to the first, ring exchange."""
    trainer, losses, _ = _fit(PipelineParallel(2, 2, "1f1b", repeats=2) + SequenceParallel(2, mode="ring"), 8)
    assert (trainer.mesh.shape["stage"], trainer.mesh.shape["sequence"]) == (2, 2)
    assert {c[0] for c in traced_attention_calls()} == {"ring"}
    np.testing.assert_allclose(losses, single[1], atol=TOL, rtol=0)
    ref, got = host_params(single[0]), host_params(trainer)
    assert max(float(np.abs(ref[k] - got[k]).max()) for k in ref) <= TOL
    stack = [v for k, v in trainer.train_state.params.items() if "/blocks/" in k]
    assert per_device_bytes(stack) == sum(v.nbytes for v in stack) // 2
    assert unordered_collectives(trainer.compiled["train"].as_text()) == []


def test_the_string_pp_sp():
    s = resolve_strategy("pp+sp")
    assert {k: v for k, v in s.mesh_shape(8).items() if v > 1} == {"stage": 2, "sequence": 2, "data": 2}
    assert s.find(PipelineParallel) is not None and s.find(SequenceParallel).mode == "auto"


def test_pp_sp_composes_with_tensor_parallel(single):
    """Ulysses inside a stage with heads split over tensor by GSPMD: stage 2 x sequence 2 x tensor 2."""
    strategy = _pipeline("gpipe") + SequenceParallel(2, mode="ulysses") + TensorParallel(2, min_shard=1024)
    trainer, losses, _ = _fit(strategy, 8)
    assert {a: trainer.mesh.shape[a] for a in ("stage", "sequence", "tensor")} == {
        "stage": 2,
        "sequence": 2,
        "tensor": 2,
    }
    assert "tensor" in tuple(trainer.train_state.params["net/blocks/layers/attn/wq"].sharding.spec)
    np.testing.assert_allclose(losses, single[1], atol=TOL, rtol=0)
    ref, got = host_params(single[0]), host_params(trainer)
    assert max(float(np.abs(ref[k] - got[k]).max()) for k in ref) <= TOL


def test_a_sequence_axis_without_the_sequence_piece_stays_with_gspmd(single):
    """No sequence-parallel attention installed: the stage is manual over stage only, GSPMD splits positions."""
    trainer, losses, _ = _fit(_pipeline("gpipe") + Layout(axes={"sequence": 2}), 8)
    assert trainer.mesh.shape["sequence"] == 2 and trainer.mesh.shape["stage"] == 2
    np.testing.assert_allclose(losses, single[1], atol=TOL, rtol=0)


# ---------------------------------------------------------------- refusals
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_dropout_streams_in_the_stack_are_refused_by_name(schedule):
    trainer = jl.Trainer(max_epochs=1, devices=8, strategy=_pipeline(schedule) + SequenceParallel(2), **quiet())
    with pytest.raises(ValueError, match=r"carry \d+ RNG stream\(s\) \(e\.g\. dropout\).*same random bits"):
        trainer.fit(SeqLM(dropout=0.1), train_dataloaders=_batches(1))
    assert trainer.global_step == 0


def _mesh(sp: int = 2):
    return (_pipeline("gpipe") + SequenceParallel(sp)).build_mesh(jax.devices())


def test_stack_inputs_the_split_cannot_place_are_refused():
    mesh = _mesh()
    cfg = PipelineConfig(2, 2, "gpipe", 1, mesh)
    layer = lambda p, r, h, a, kw: (h * p["w"], r)
    params = {"w": jnp.ones((2,))}
    with attention_context(_SequenceAttention(mesh, "auto", True)):
        with pytest.raises(ValueError, match=r"length divisible by 2.*|input has shape \(8, 5\)"):
            run_pipeline(layer, params, {}, jnp.ones((8, 5)), (), {}, cfg)
        with pytest.raises(ValueError, match=r"no per-row array arguments besides its input \(got 1\)"):
            run_pipeline(layer, params, {}, jnp.ones((8, 4)), (jnp.ones((8, 4)),), {}, cfg)


def test_layers_that_mix_positions_outside_attention_are_found():
    x = jax.ShapeDtypeStruct((2, 32, 64), jnp.float32)
    with nnx.use_eager_sharding(False):
        clean = Block(CFG, nnx.Rngs(0))
        hand = HandWrittenBlock(64, 4, 64, nnx.Rngs(0))  # einsum attention and a tril mask
    assert position_mixing(clean, x) == []  # jl.nn.attention, norms, MLP: per position
    found = " ".join(position_mixing(hand, x))
    assert "[2, 4, length, length] array" in found and "iota" in found
    assert "cumsum" in " ".join(position_mixing(lambda h: jnp.cumsum(h, axis=1), x))
    assert "shifts or cuts the length" in " ".join(position_mixing(lambda h: jnp.roll(h, 1, axis=1), x))
    assert "reduces over the length" in " ".join(position_mixing(lambda h: h - h.mean(axis=1, keepdims=True), x))
    assert position_mixing(lambda h: h - h.mean(axis=2, keepdims=True), x) == []  # over features: fine


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_hand_written_attention_is_refused_under_pp_sp(schedule):
    class HandLM(SeqLM):
        def configure_model(self) -> None:
            self.net = _HandNet()

    trainer = jl.Trainer(max_epochs=1, devices=8, strategy=_pipeline(schedule) + SequenceParallel(2), **quiet())
    with pytest.raises(ValueError, match=r"mixes positions by itself: .*length, length\] array"):
        trainer.fit(HandLM(), train_dataloaders=_batches(1))
    assert trainer.global_step == 0


class _HandNet(nnx.Module):
    def __init__(self) -> None:
        self.embed = nnx.Embed(256, 64, rngs=nnx.Rngs(0))
        self.blocks = jl.nn.LayerStack(lambda r: HandWrittenBlock(64, 4, 64, r), 2, rngs=nnx.Rngs(0))
        self.head = nnx.Linear(64, 256, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.head(self.blocks(self.embed(x)))


def test_masks_with_length_dims_are_refused_inside_a_stage():
    mesh = _mesh()
    sp = _SequenceAttention(mesh, "allgather", True)
    q = jnp.ones((2, 32, 8, 8))

    def body(q, mask):
        return sp(q, q, q, causal=True, mask=mask, scale=1.0)

    f = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(jax.P(None, "sequence"), jax.P()),
        out_specs=jax.P(None, "sequence"),
        axis_names={"sequence"},
    )
    with pytest.raises(ValueError, match=r"masks without length dims.*got mask \(2, 1, 1, 32\)"):
        jax.eval_shape(f, q, jnp.ones((2, 1, 1, 32), bool))
    out = jax.eval_shape(f, q, jnp.ones((2, 1, 1, 1), bool))  # a per-row mask without length dims runs
    assert out.shape == q.shape

    def cross(q, kv):  # keys/values given whole to every sequence device
        return sp(q, kv, kv, causal=False, mask=None, scale=1.0)

    g = jax.shard_map(
        cross,
        mesh=mesh,
        in_specs=(jax.P(None, "sequence"), jax.P()),
        out_specs=jax.P(None, "sequence"),
        axis_names={"sequence"},
    )
    with pytest.raises(ValueError, match=r"but k, v are the same on every sequence device"):
        jax.eval_shape(g, q, q)
