"""Pipeline parallelism through the Trainer: 3 SGD(momentum) steps of the LayerStack transformer
(tests/pipeline_models.py) under "pp" (4 stages), pp+fsdp and pp+tp, GPipe and circular, against
one device; per-device memory of the stack from the arrays and from ``memory_analysis()``; the
collectives of the compiled step; checkpoints across strategies; preemption; refusals.

Tolerance 1e-5 absolute on losses, parameters and step-1 gradients (float32, other reduction order;
SGD with momentum, so rounding differences are not amplified as Adam with a small eps would).
"""

from __future__ import annotations

import contextlib
import io
import math

import jax
import numpy as np
import pytest

import jaxlight as jl
from jaxlight.strategies import FSDP, HostOffload, TensorParallel
from jaxlight.strategies.pipeline import PipelineParallel
from jaxlight.summary import per_device_bytes
from tests.helpers import Record, SignalAt, host_params, quiet
from tests.pipeline_models import DIMS, PipeLM, collectives, crosses_stage, token_batches
from tests.strategy_models import LM

TOL = 1e-5
ROWS = 16
CONFIGS = {
    "single": ("auto", 1),
    "pp": (PipelineParallel(4), 8),  # 4 stages x data 2, GPipe, M = 4
    "pp-circular": (PipelineParallel(4, 8, "circular", 2), 8),  # 2 passes, M = 8
    # 2 stages x fsdp 4, optimizer state in pinned host memory between steps
    "pp+fsdp+offload": (PipelineParallel(2) + FSDP(min_shard=1024) + HostOffload(), 8),
    "pp+tp-circular": (PipelineParallel(4, schedule="circular", repeats=2) + TensorParallel(2, min_shard=1024), 8),
}


def _trainer(strategy, devices, callbacks=(), **kw):
    return jl.Trainer(
        strategy=strategy, devices=devices, callbacks=list(callbacks), **quiet(num_sanity_val_steps=None, **kw)
    )


@pytest.fixture(scope="module")
def runs():
    data = token_batches(3, ROWS, vocab=DIMS["vocab"])
    out = {}
    for name, (strategy, devices) in CONFIGS.items():
        rec = Record()
        t = _trainer(strategy, devices, [rec], max_epochs=1)
        t.fit(PipeLM(**DIMS), data)
        out[name] = (t, [float(x) for x in rec.losses])
    return out


def _stack(params) -> list[str]:
    return [k for k in params if "/blocks/" in k]


# ---------------------------------------------------------------- numbers
@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "single"])
def test_losses_and_parameters_match_one_device(runs, name):
    ref_t, ref_losses = runs["single"]
    t, losses = runs[name]
    assert len(losses) == len(ref_losses) == 3
    np.testing.assert_allclose(losses, ref_losses, atol=TOL, rtol=0)
    ref, got = host_params(ref_t), host_params(t)
    assert ref.keys() == got.keys()
    worst = max(float(np.abs(ref[k] - got[k]).max()) for k in ref)
    assert worst <= TOL, worst
    init = {k: np.asarray(v) for k, v in ref_t.train_state.opt_state[0]["grad"].items()}
    assert max(float(np.abs(g).max()) for g in init.values()) > 1e-3  # non-trivial steps


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "single"])
def test_gradients_at_step_one_match_one_device(runs, name):
    ref = {k: np.asarray(v) for k, v in runs["single"][0].train_state.opt_state[0]["grad"].items()}
    got = {k: np.asarray(v) for k, v in runs[name][0].train_state.opt_state[0]["grad"].items()}
    assert ref.keys() == got.keys()
    worst = max(float(np.abs(got[k] - ref[k]).max()) for k in ref)
    assert worst <= TOL, worst
    assert min(float(np.abs(ref[k]).max()) for k in _stack(ref)) > 1e-4


# ---------------------------------------------------------------- placement and memory
def _stack_state(trainer) -> list[jax.Array]:
    """The stack's parameters and every optimizer-state leaf that mirrors one (gradient copy, momentum)."""
    params = trainer.train_state.params
    keys = set(_stack(params))
    leaves = [params[k] for k in keys]
    for path, leaf in jax.tree_util.tree_flatten_with_path(trainer.train_state.opt_state)[0]:
        if any(getattr(p, "key", None) in keys for p in path):
            leaves.append(leaf)
    return leaves


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "single"])
def test_stack_state_is_split_over_stage(runs, name):
    t, _ = runs[name]
    single, _ = runs["single"]
    stages = t.mesh.shape["stage"]
    leaves = _stack_state(t)
    assert len(leaves) == 3 * len(_stack(t.train_state.params))  # params, step-1 gradient copy, momentum
    for leaf in leaves:
        assert leaf.sharding.spec[0] == "stage", leaf.sharding
    whole = sum(x.nbytes for x in _stack_state(single))
    others = math.prod(t.mesh.shape[a] for a in ("fsdp", "tensor"))
    if others == 1:
        assert per_device_bytes(leaves) == whole // stages
    else:  # 1/S, and fsdp/tensor split the large leaves further
        assert whole / (stages * others) <= per_device_bytes(leaves) < whole / stages


def test_other_pieces_still_place_the_rest(runs):
    fsdp, _ = runs["pp+fsdp+offload"]
    tp, _ = runs["pp+tp-circular"]
    assert tuple(fsdp.train_state.params["net/blocks/layers/up/kernel"].sharding.spec) == ("stage", "fsdp")
    assert "fsdp" in tuple(fsdp.train_state.params["net/embed/embedding"].sharding.spec)
    assert tuple(tp.train_state.params["net/blocks/layers/up/kernel"].sharding.spec) == ("stage", None, "tensor")
    assert "tensor" in tuple(tp.train_state.params["net/head/kernel"].sharding.spec)


def test_offloaded_optimizer_state_keeps_the_stage_split(runs):
    t, _ = runs["pp+fsdp+offload"]
    stack = set(_stack(t.train_state.params))
    momentum = [
        leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(t.train_state.opt_state)[0]
        if any(getattr(p, "key", None) in stack for p in path)
    ]
    assert len(momentum) == 2 * len(stack)  # step-1 gradient copy and momentum
    for leaf in momentum:
        assert leaf.sharding.memory_kind == "pinned_host" and leaf.sharding.spec[0] == "stage", leaf.sharding
    for k in stack:
        assert t.train_state.params[k].sharding.memory_kind == "device"


def test_memory_analysis_shows_one_stage_share(runs):
    single, _ = runs["single"]
    pp, _ = runs["pp"]
    stages, data = pp.mesh.shape["stage"], pp.mesh.shape["data"]
    stack = sum(x.nbytes for x in _stack_state(single))
    a_one = single.compiled["train"].memory_analysis().argument_size_in_bytes
    a_pp = pp.compiled["train"].memory_analysis().argument_size_in_bytes
    batch = ROWS * 9 * 4  # int32 tokens: split over data under pp
    assert stack > 0.9 * a_one
    assert a_pp == pytest.approx(a_one - stack + stack / stages - batch + batch / data, rel=0.01)
    assert a_pp / a_one == pytest.approx(1 / stages, abs=0.05)


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "single"])
def test_step_permutes_activations_and_gathers_no_stack_weight_over_stage(runs, name):
    t, _ = runs[name]
    ops = collectives(t.compiled["train"].as_text())
    assert sum(op == "collective-permute" and crosses_stage(g, t.mesh) for op, _, g in ops) >= 2
    gathers = [(op, shape) for op, shape, g in ops if op == "all-gather" and crosses_stage(g, t.mesh)]
    assert not gathers, gathers


# ---------------------------------------------------------------- evaluation
def test_validation_under_the_pipeline_equals_one_device(runs):
    """The eval step is traced in the pipeline too (the trained models agree to 1e-5, so do their losses)."""
    data = token_batches(2, ROWS, vocab=DIMS["vocab"], seed=3)
    got = {}
    for name in ("single", "pp-circular"):
        t, _ = runs[name]
        with contextlib.redirect_stdout(io.StringIO()):
            got[name] = t.validate(t.lightning_module, data)[0]["val_loss"]
    assert "validate" in runs["pp-circular"][0].compiled
    assert abs(got["pp-circular"] - got["single"]) <= TOL


# ---------------------------------------------------------------- checkpoints
STEPS, SPLIT = 4, 2


def _fit_ckpt(strategy, devices, dirpath=None, ckpt_path=None):
    rec = Record()
    cbs = [rec]
    if dirpath is not None:
        cbs.append(jl.callbacks.ModelCheckpoint(dirpath=dirpath, every_n_train_steps=SPLIT, save_top_k=-1))
    t = _trainer(strategy, devices, cbs, max_steps=STEPS, enable_checkpointing=dirpath is not None)
    t.fit(PipeLM(**DIMS), token_batches(STEPS, ROWS, vocab=DIMS["vocab"]), ckpt_path=ckpt_path)
    return t, rec


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Runs that saved at step SPLIT: under "pp" (the string: 4 stages on 4 devices) and under fsdp."""
    out = {}
    for name, (strategy, devices) in {"pp": ("pp", 4), "fsdp": (FSDP(min_shard=1024), 8)}.items():
        d = tmp_path_factory.mktemp(name)
        t, rec = _fit_ckpt(strategy, devices, dirpath=str(d))
        if name == "pp":
            assert t.mesh.shape["stage"] == 4
        out[name] = (str(d / f"epoch=0-step={SPLIT}.ckpt"), [float(x) for x in rec.losses])
    return out


@pytest.mark.parametrize(
    "source,strategy,devices",
    [
        ("pp", FSDP(min_shard=1024), 8),
        ("pp", "auto", 1),
        ("fsdp", PipelineParallel(2, schedule="circular", repeats=2), 8),
    ],
    ids=["pp->fsdp", "pp->single", "fsdp->pp-circular"],
)
def test_checkpoint_restores_across_strategies_exactly(saved, source, strategy, devices):
    path, ref_losses = saved[source]
    t, rec = _fit_ckpt(strategy, devices, ckpt_path=path)
    # every array landed in the new run's placement with the saved values, exactly
    ref = PipeLM.load_from_checkpoint(path)
    want = {k: np.asarray(v) for k, v in jl.state.split_models({"net": ref.net})[1].items()}
    assert rec.start_params.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(rec.start_params[k], want[k], err_msg=k)
    stages = t.mesh.shape["stage"]
    for k, sh in rec.start_shardings.items():
        assert (tuple(sh.spec)[:1] == ("stage",)) == ("/blocks/" in k and stages > 1), (k, sh.spec)
    # and training continues to the losses of the run that never stopped
    np.testing.assert_allclose([float(x) for x in rec.losses], ref_losses[SPLIT:], atol=TOL, rtol=0)


@pytest.mark.slow
def test_preemption_and_resume_under_pp_are_bit_identical(tmp_path):
    data = token_batches(STEPS, ROWS, vocab=DIMS["vocab"])
    strategy = PipelineParallel(4)

    def trainer(run, cbs=()):
        ckpt = jl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / run), every_n_train_steps=2, save_last=True)
        return _trainer(strategy, 8, [*cbs, ckpt], max_steps=STEPS, enable_checkpointing=True)

    ref = trainer("ref")
    ref.fit(PipeLM(**DIMS), data)
    t1 = trainer("run", [SignalAt(3)])
    with pytest.raises(jl.Preempted) as exc:
        t1.fit(PipeLM(**DIMS), data)
    assert exc.value.code == 143 and exc.value.step == 3
    rec = Record()
    t2 = trainer("run", [rec])
    t2.fit(PipeLM(**DIMS), data, ckpt_path="last")
    assert len(rec.losses) == STEPS - 3  # resumed, not restarted
    a, b = host_params(t2), host_params(ref)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


# ---------------------------------------------------------------- refusals
def test_refusals_come_before_any_work():
    data = token_batches(1, ROWS, vocab=DIMS["vocab"])
    cases = [
        (PipelineParallel(4), LM(opt="sgd", vocab=64, embed=64, heads=4, mlp=64), data, "this model has none"),
        (PipelineParallel(4), PipeLM(**{**DIMS, "layers": 6}), data, r"6 layers, not divisible by stages x repeats"),
        (
            PipelineParallel(4, 8),
            PipeLM(**DIMS),
            token_batches(1, 8, vocab=DIMS["vocab"]),
            r"4 per batch shard .* not divisible by microbatches=8",
        ),
        (PipelineParallel(microbatches=2), PipeLM(**DIMS), data, r"microbatches=2 is fewer than stages=8"),
    ]
    for strategy, module, batches, message in cases:
        t = _trainer(strategy, 8, max_steps=1)
        with pytest.raises(ValueError, match=message):
            t.fit(module, batches)
        assert t.global_step == 0 and "train" not in t.compiled
