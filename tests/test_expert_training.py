"""ExpertParallel ("ep") through the Trainer: the same training as one device, each device holding and
computing only its own experts, tokens moved by all-to-all; refusals before any work; capacity drops
counted by hand.

The model (tests/expert_models.py): embedding, one jl.nn.MoE (8 experts, top-2, 64 -> 128 -> 64) with a
residual connection, a norm and a head; the loss adds 0.01 x load_balance + 1e-3 x router_z. 3 steps of
SGD with momentum (Adam's eps would scale reduction-order rounding into lr-sized moves) on [16, 9]
token batches. Tolerance: 1e-5 absolute on losses, load-balance losses, step-1 gradients and parameters.
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
from jaxlight.strategies import FSDP, ExpertParallel, PipelineParallel, SequenceParallel
from jaxlight.summary import per_device_bytes
from tests.core_models import quiet
from tests.expert_models import ExpertLM, Outputs, token_batches
from tests.helpers import Losses, host_params

TOL = 1e-5
SP = ExpertParallel() + SequenceParallel(batch_dims={"tokens": None})  # positions of the activations split
CONFIGS = {
    "single": ("auto", 1, {}),
    "ep": ("ep", 8, {"expert": 8}),
    "fsdp+ep": ("fsdp+ep", 8, {"fsdp": 4, "expert": 2}),
    "ep+tp": ("ep+tp", 8, {"data": 2, "tensor": 2, "expert": 2}),
    "ep+offload": ("ep+offload", 8, {"expert": 8}),
    "ep+sp": (SP, 8, {"data": 2, "sequence": 2, "expert": 2}),
    "ddp": ("ddp", 8, {"data": 8}),
}
CAPACITY = {"single": ("auto", 1), "ep": ("ep", 8)}


def _fit(strategy, devices, data, **hp):
    cb = Outputs()
    trainer = jl.Trainer(max_epochs=1, devices=devices, strategy=strategy, callbacks=[cb], **quiet())
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.fit(ExpertLM(**hp), data)
    outs = [{k: float(v) for k, v in o.items()} for o in cb.outputs]
    return trainer, outs


@pytest.fixture(scope="module")
def runs():
    data = token_batches(3, 16)
    return {name: _fit(strategy, devices, data) for name, (strategy, devices, _) in CONFIGS.items()}


@pytest.fixture(scope="module")
def capacity_runs():
    data = token_batches(3, 16, seed=1)
    return {name: _fit(strategy, devices, data, capacity_factor=1.0) for name, (strategy, devices) in CAPACITY.items()}


def _first_grads(trainer) -> dict[str, np.ndarray]:
    return {k: np.asarray(jax.device_get(v)) for k, v in trainer.train_state.opt_state[0]["grad"].items()}


def _assert_matches(ref, got) -> None:
    (ref_t, ref_out), (t, out) = ref, got
    assert len(out) == len(ref_out) == 3
    for key in ("loss", "load_balance", "router_z"):
        np.testing.assert_allclose([o[key] for o in out], [o[key] for o in ref_out], atol=TOL, rtol=0, err_msg=key)
    rg, gg = _first_grads(ref_t), _first_grads(t)
    assert rg.keys() == gg.keys()
    assert max(float(np.abs(g).max()) for k, g in rg.items() if "moe" in k) > 1e-3  # the experts do learn
    for k in rg:
        assert float(np.abs(gg[k] - rg[k]).max()) <= TOL, k
    rp, gp = host_params(ref_t), host_params(t)
    for k in rp:
        assert float(np.abs(gp[k] - rp[k]).max()) <= TOL, k


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "single"])
def test_training_matches_one_device(runs, name):
    _, _, axes = CONFIGS[name]
    trainer = runs[name][0]
    assert {a: trainer.mesh.shape[a] for a in axes} == axes
    _assert_matches(runs["single"], runs[name])


def test_capacity_limited_training_matches_one_device(capacity_runs):
    """Capacity is counted per sequence, so where rows are placed never changes which tokens drop."""
    _assert_matches(capacity_runs["single"], capacity_runs["ep"])
    dropped = [float(v) for v in (capacity_runs[n][0].callback_metrics["dropped"] for n in CAPACITY)]
    assert dropped[0] > 0.01 and dropped[0] == pytest.approx(dropped[1], abs=1e-7)


# ---------------------------------------------------------------- placement and memory
EXPERT_KEYS = ("net/moe/w_in", "net/moe/w_out")


def test_each_device_holds_an_eighth_of_every_expert_weight(runs):
    ep, ddp = runs["ep"][0], runs["ddp"][0]
    params = ep.train_state.params
    for k in EXPERT_KEYS:
        v = params[k]
        assert v.shape[0] == 8 and v.sharding.spec[0] == "expert"
        shards = {tuple(s.data.shape) for s in v.addressable_shards}
        assert shards == {(1, *v.shape[1:])}, (k, shards)  # one whole expert per device
        # and the device holding expert e holds exactly that expert's slice
        for s in v.addressable_shards:
            e = s.index[0].start
            np.testing.assert_array_equal(np.asarray(s.data), np.asarray(v)[e : e + 1])
    # other parameters are replicated, as under data parallelism
    assert all(v.sharding.is_fully_replicated for k, v in params.items() if k not in EXPERT_KEYS)
    # the optimizer state of the experts (momentum and the first-gradient copy) follows them
    expert_state = [
        leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(ep.train_state.opt_state)[0]
        if any(getattr(p, "key", None) in EXPERT_KEYS for p in path)
    ]
    assert len(expert_state) == 4
    whole = sum(v.nbytes for v in expert_state) + sum(params[k].nbytes for k in EXPERT_KEYS)
    assert per_device_bytes(expert_state + [params[k] for k in EXPERT_KEYS]) == whole // 8
    # the compiled step's arguments per device: ddp's, less 7/8 of the experts and their state (same rows)
    a_ddp = ddp.compiled["train"].memory_analysis().argument_size_in_bytes
    a_ep = ep.compiled["train"].memory_analysis().argument_size_in_bytes
    assert a_ddp - a_ep == whole * 7 // 8


_OP = re.compile(
    r"\n\s*%?\S+ = (.+?) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)


def _collectives(trainer) -> list[tuple[str, str]]:
    return [(op, shape) for shape, op in _OP.findall(trainer.compiled["train"].as_text())]


def test_tokens_move_by_all_to_all_and_expert_weights_never_do(runs):
    ep = runs["ep"][0]
    ops = _collectives(ep)
    kinds = {op for op, _ in ops}
    assert "all-gather" not in kinds and "reduce-scatter" not in kinds
    # token rows [devices, slots, features] go out and come back, forward and backward: 4 exchanges of
    # float rows (and one of the expert ids); XLA:CPU writes each as a tuple of per-device parts
    rows = [shape for op, shape in ops if op == "all-to-all" and shape.startswith("(f32[1,")]
    assert len(rows) == 4, ops
    for op, shape in ops:
        if op == "all-reduce":
            # the non-expert gradients (and the aux sums) are all-reduced; no expert weight or gradient is
            assert "[8,64,128]" not in shape and "[8,128,64]" not in shape and "[1,64,128]" not in shape, shape
    # ddp, for contrast, all-reduces the whole expert gradients and exchanges no tokens
    ddp_ops = _collectives(runs["ddp"][0])
    assert any(op == "all-reduce" and "f32[8,64,128]" in shape for op, shape in ddp_ops)
    assert not any(op == "all-to-all" for op, _ in ddp_ops)


def test_fsdp_ep_gathers_only_the_fsdp_part_of_the_experts(runs):
    t = runs["fsdp+ep"][0]
    w = t.train_state.params["net/moe/w_in"]
    assert tuple(w.sharding.spec) == ("expert", "fsdp") and w.addressable_shards[0].data.shape == (4, 16, 128)
    gathered = [shape for op, shape in _collectives(t) if op == "all-gather"]
    # gathered over fsdp (4 devices) into the expert slice of its device: [4 experts, 64, 128], never all 8
    assert any("f32[4,64,128]" in s for s in gathered) and not any("f32[8,64,128]" in s for s in gathered)


def test_ep_tp_splits_each_experts_hidden_width(runs):
    t = runs["ep+tp"][0]
    w_in, w_out = (t.train_state.params[k] for k in EXPERT_KEYS)
    assert tuple(w_in.sharding.spec) == ("expert", None, "tensor") and w_in.addressable_shards[0].data.shape == (
        4,
        64,
        64,
    )
    assert tuple(w_out.sharding.spec) == ("expert", "tensor") and w_out.addressable_shards[0].data.shape == (4, 64, 64)


# ---------------------------------------------------------------- refusals, before any work
def _refused(strategy, module, match, data=None):
    trainer = jl.Trainer(max_epochs=1, devices=8, strategy=strategy, **quiet())
    with pytest.raises(ValueError, match=match):
        trainer.fit(module, data or token_batches(1, 16))
    assert trainer.global_step == 0 and "train" not in trainer.compiled


def test_experts_not_divisible_by_the_axis_are_refused():
    _refused(
        "ep",
        ExpertLM(experts=6, top_k=2),
        r"net/moe/w_in \(6, 64, 128\) has 6 experts, not divisible by the "
        r"expert axis of 8 devices",
    )


def test_top_k_above_the_expert_count_is_refused():
    _refused("ep", ExpertLM(experts=2, top_k=3), r"top_k=3 is greater than num_experts=2")


def test_a_model_without_experts_is_refused_under_ep():
    from tests.strategy_models import LM

    _refused(
        "ep", LM(vocab=64, embed=64, heads=4, mlp=64), r"has none.*expert axis of 8 devices would only split batch rows"
    )


def test_ep_with_pipeline_parallelism_is_refused_with_the_reason():
    _refused(
        ExpertParallel() + PipelineParallel(2),
        ExpertLM(),
        r"does not compose with pipeline parallelism.*stage=2, expert=4",
    )


def test_capacity_under_sequence_parallelism_is_refused_with_the_reason():
    _refused(SP, ExpertLM(capacity_factor=1.25), r"counts capacity per sequence.*8 positions over 2 devices")


# ---------------------------------------------------------------- capacity: a routing built by hand
E, K, L = 4, 2, 8  # capacity ceil(1.0 x 8 x 2 / 4) = 4 assignments per expert and sequence
ROW_A = ([0, 0, 0, 0, 0, 1, 1, 2], [1, 1, 1, 2, 2, 0, 0, 0])  # first choices, second choices
ROW_B = ([0, 1, 2, 3, 0, 1, 2, 3], [1, 2, 3, 0, 1, 2, 3, 0])
# Row A, first choices in position order: expert 0 takes positions 0-3 and drops position 4 (1 dropped);
# then second choices: expert 1 has 2, takes positions 0 and 1, drops position 2 (1 dropped); expert 2
# takes 3 and 4; expert 0 is full: positions 5, 6, 7 are dropped (3). 5 of 16 assignments.
# Row B: every expert gets 2 first and 2 second choices: nothing dropped.
DROPPED_A = {(4, 0), (2, 1), (5, 1), (6, 1), (7, 1)}  # (position, choice)


def _routed_batch(rows: int) -> np.ndarray:
    x = np.zeros((rows, L, E), np.float32)
    for r in range(rows):
        first, second = ROW_A if r % 2 == 0 else ROW_B
        for t in range(L):
            x[r, t, first[t]], x[r, t, second[t]] = 10.0, 5.0  # router = identity: logits are x
    return x


def _routed_moe() -> jl.nn.MoE:
    with nnx.use_eager_sharding(False):
        moe = jl.nn.MoE(E, 16, E, top_k=K, capacity_factor=1.0, rngs=nnx.Rngs(0))
    moe.router[...] = jnp.eye(E, dtype=jnp.float32)
    return moe


def _expected(moe, x: np.ndarray) -> np.ndarray:
    """The layer's output from the hand count: each kept assignment's expert output times its gate."""
    h = jax.nn.gelu(jnp.einsum("rtf,efh->rteh", x, moe.w_in[...]))
    every = np.asarray(jnp.einsum("rteh,ehf->rtef", h, moe.w_out[...]))  # [rows, L, experts, features]
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for r in range(x.shape[0]):
        first, second = ROW_A if r % 2 == 0 else ROW_B
        for t in range(L):
            e = (first[t], second[t])
            g = p[r, t, list(e)] / p[r, t, list(e)].sum()
            for j in range(K):
                if not (r % 2 == 0 and (t, j) in DROPPED_A):
                    out[r, t] += g[j] * every[r, t, e[j]]
    return out


@pytest.mark.parametrize("expert_axis", [1, 4], ids=["one-device", "ep-4"])
def test_dropped_fraction_matches_a_hand_count(expert_axis):
    moe = _routed_moe()
    assert moe.capacity(L) == 4
    x = _routed_batch(8)
    if expert_axis == 1:
        y, aux = nnx.jit(lambda m, x: m(x))(moe, jnp.asarray(x))
    else:  # the same call as a trainer step traces it: on a data=2 x expert=4 mesh, experts split
        strategy = ExpertParallel(4)
        mesh = strategy.build_mesh(jax.devices()[:8])
        assert dict(mesh.shape)["data"] == 2
        graphdef, state = nnx.split(moe)
        state, xs = jax.device_put((state, jnp.asarray(x)), NamedSharding(mesh, P()))
        with jax.set_mesh(mesh), jl.nn.axis_rules(mesh, strategy.logical_rules):
            y, aux = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, xs)
    # 4 sequences of pattern A drop 5 of 16 assignments each, the other 4 none: 20 of 128
    assert float(aux["dropped"]) == pytest.approx(20 / 128, abs=1e-7)
    np.testing.assert_allclose(np.asarray(y), _expected(moe, x), atol=1e-5)


# ---------------------------------------------------------------- the example and verify
def test_gpt_example_with_moe_learns_under_ep():
    """examples/gpt.py --moe 8 --strategy ep: its module, on its data, learns with every expert split 8 ways."""
    from examples.gpt import GPT, WindowLoader
    from examples.models import stdlib_bytes

    model = GPT(d_model=32, layers=1, heads=2, seq_len=16, lr=1e-2, warmup_steps=2, max_steps=10, moe=8)
    trainer = jl.Trainer(strategy="ep", devices=8, max_steps=10, callbacks=[cb := Losses()], **quiet())
    trainer.fit(model, WindowLoader(stdlib_bytes(100_000), 16, 16, 10, seed=0))
    assert dict(trainer.mesh.shape)["expert"] == 8
    w_in = model.net.blocks[0].moe.w_in[...]
    assert w_in.shape == (8, 32, 128) and w_in.addressable_shards[0].data.shape == (1, 32, 128)
    losses = np.asarray([float(x) for x in cb.losses])
    assert len(losses) == 10 and losses[-3:].mean() < losses[0] - 0.5, losses  # from ln 256 = 5.55 down
    assert 0.5 < float(trainer.callback_metrics["load_balance"]) < 8  # logged; 8 = every token on one expert


def test_verify_runs_the_expert_strategies_for_an_moe_model(monkeypatch):
    import importlib

    verify_mod = importlib.import_module("jaxlight.verify")
    monkeypatch.setattr(verify_mod, "BUILTIN_STRATEGIES", ())
    monkeypatch.setattr(verify_mod, "EXPERT_STRATEGIES", ("ep",))
    report = jl.verify(ExpertLM, token_batches(3, 16), print_report=False)
    ref, *rows = report.results
    assert [r.name for r in rows] == ["ep"] and rows[0].status == "ok", (rows[0].reason, rows[0].leaves[:3])
    assert rows[0].mesh == "expert=8" and rows[0].collectives.counts.get("all-to-all", 0) >= 4
    assert report.ok


def test_ep_composes_by_string_and_object():
    from jaxlight.strategies import resolve_strategy

    mesh = lambda s: {a: n for a, n in resolve_strategy(s).mesh_shape(8).items() if n > 1}
    assert mesh("ep") == {"expert": 8}
    assert mesh("fsdp+ep") == mesh("ep+fsdp") == {"fsdp": 4, "expert": 2}
    assert mesh("ep+tp") == {"data": 2, "tensor": 2, "expert": 2}
    assert mesh(ExpertParallel(4) + FSDP()) == {"fsdp": 2, "expert": 4}
    assert resolve_strategy("fsdp+ep") == FSDP() + ExpertParallel()
    assert resolve_strategy("ep").rule_owner("exp") == "ep"
    with pytest.raises(ValueError, match="ExpertParallel size must be a positive int, got 0"):
        ExpertParallel(0)
