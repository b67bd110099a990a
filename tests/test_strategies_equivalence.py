"""Every strategy trains the same model as one device, and places/communicates what it claims.

One module-scoped set of runs (3 Adam steps of a one-block transformer annotated with the
default logical names, global batch 64) feeds the numerical, memory and HLO checks.
Tolerances: 1e-5 absolute on losses, parameters and step-1 gradients (8 devices reduce in
a different order than one; float32).
"""

from __future__ import annotations

import contextlib
import io
import math
import re
from collections import Counter

import jax
import numpy as np
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight.strategies import FSDP, DataParallel, TensorParallel, resolve_strategy
from jaxlight.summary import fmt_bytes, per_device_bytes
from tests.core_models import quiet
from tests.helpers import Losses
from tests.strategy_models import LM, flat_params, token_batches

TOL = 1e-5
MIN_SHARD = 2**16  # the default: every 256x256 kernel and the 256x256 tables shard, biases and norms don't
CONFIGS = {
    "single": ("auto", 1),
    "ddp": ("ddp", 8),
    "fsdp": ("fsdp", 8),
    "tp": ("tp", 8),
    "fsdp+tp": ("fsdp+tp", 8),
    # an object form with a different split than any string: fsdp=2 x tensor=4, smaller min_shard
    "obj": (FSDP(min_shard=2**12) + TensorParallel(4), 8),
}


def _fit(strategy, devices, data, summary=False, ema=False, **lm):
    cb = Losses()
    model = LM(**lm)
    cbs = [cb, jl.callbacks.EMA(decay=0.9)] if ema else [cb]
    trainer = jl.Trainer(
        max_epochs=1, devices=devices, strategy=strategy, callbacks=cbs, **quiet(enable_model_summary=summary)
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer.fit(model, data)
    return trainer, model, [float(x) for x in cb.losses], out.getvalue()


@pytest.fixture(scope="module")
def runs():
    data = token_batches(3, 64)
    res = {}
    for name, (strategy, devices) in CONFIGS.items():
        res[name] = _fit(strategy, devices, data, summary=(name == "fsdp"), ema=(name == "fsdp+tp"), opt="adam+grad")
    return res


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "single"])
def test_adam_losses_and_params_match_single_device(runs, name):
    _, ref_model, ref_losses, _ = runs["single"]
    trainer, model, losses, _ = runs[name]
    assert len(losses) == len(ref_losses) == 3
    np.testing.assert_allclose(losses, ref_losses, atol=TOL, rtol=0)
    ref, got = flat_params(ref_model), flat_params(model)
    assert ref.keys() == got.keys()
    worst = max(float(np.abs(ref[k] - got[k]).max()) for k in ref)
    assert worst <= TOL, worst
    # the comparison is not between two untrained models: Adam moved every kernel by ~lr per step
    init = flat_params(_initial_model())
    moved = min(float(np.abs(ref[k] - init[k]).max()) for k in ref if "kernel" in k)
    assert moved > 100 * TOL


def _initial_model():
    """The parameters configure_model creates, built eagerly on one device (no mesh: no eager sharding)."""
    m = LM()
    with nnx.use_eager_sharding(False):
        m.configure_model()
    return m


@pytest.mark.parametrize("name", ["ddp", "fsdp", "tp", "fsdp+tp", "obj"])
def test_params_actually_placed(runs, name):
    """The runs above are not trivially equal because nothing was sharded."""
    trainer, *_ = runs[name]
    mesh = dict(trainer.mesh.shape)
    params = trainer.train_state.params
    big = {k: v for k, v in params.items() if v.size >= trainer.strategy.min_shard}
    small = {k: v for k, v in params.items() if v.size < trainer.strategy.min_shard}
    assert big
    for k, v in small.items():
        assert v.sharding.is_fully_replicated, (k, v.sharding)
    if name == "ddp":
        assert all(v.sharding.is_fully_replicated for v in params.values())
        return
    for k, v in big.items():
        shard = v.addressable_shards[0].data.shape
        # every large parameter is split (by the product of the axes its spec names)
        axes = [a for s in v.sharding.spec if s for a in ((s,) if isinstance(s, str) else s)]
        assert axes, (k, v.sharding.spec)
        assert math.prod(shard) * math.prod(mesh[a] for a in axes) == v.size, (k, shard, v.shape)
        assert set(axes) <= {"fsdp", "tensor"}


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "single"])
def test_gradients_at_step_one_match_single_device(runs, name):
    """The gradients each compiled step handed the optimizer at step 1 (after its all-reduce or
    reduce-scatter), recorded in the optimizer state by keep_first_grad (tests/strategy_models.py)."""
    ref = _first_grads(runs["single"][0])
    got = _first_grads(runs[name][0])
    assert ref.keys() == got.keys() and len(ref) == len(runs[name][0].train_state.params)
    assert max(float(np.abs(g).max()) for g in ref.values()) > 1e-3  # non-trivial gradients
    worst = max(float(np.abs(got[k] - ref[k]).max()) for k in ref)
    assert worst <= TOL, worst


def _first_grads(trainer) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in trainer.train_state.opt_state[0]["grad"].items()}


def test_object_forms_equal_string_forms():
    pairs = [
        ("ddp", DataParallel()),
        ("auto", DataParallel()),
        ("fsdp", FSDP()),
        ("tp", TensorParallel()),
        ("fsdp+tp", FSDP() + TensorParallel(2)),
    ]
    for s, obj in pairs:
        a, b = resolve_strategy(s), obj
        assert a.mesh_shape(8) == b.mesh_shape(8), s
        assert (a.logical_rules, a.min_shard, a.tolerance) == (b.logical_rules, b.min_shard, b.tolerance)
    assert resolve_strategy("fsdp+tp").mesh_shape(8) == {
        **dict.fromkeys(jl.strategies.MESH_AXES, 1),
        "fsdp": 4,
        "tensor": 2,
    }


# ---------------------------------------------------------------- optimizer state placement
@pytest.mark.parametrize("name", ["fsdp", "fsdp+tp", "obj"])
def test_optimizer_state_follows_parameters(runs, name):
    trainer, *_ = runs[name]
    params = trainer.train_state.params
    seen = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(trainer.train_state.opt_state)[0]:
        keys = [getattr(k, "key", None) for k in path]
        pk = next((k for k in keys if isinstance(k, str) and k in params), None)
        if pk is None:
            assert leaf.sharding.is_fully_replicated  # the step count
            continue
        seen += 1
        assert leaf.sharding.is_equivalent_to(params[pk].sharding, leaf.ndim), (path, leaf.sharding)
    assert seen == 3 * len(params)  # the first-gradient copy, adam's mu and nu


def test_ema_follows_parameters(runs):
    trainer, *_ = runs["fsdp+tp"]
    ema = next(iter(trainer.train_state.callback_state.values()))
    params = trainer.train_state.params
    assert ema.keys() == params.keys()
    for k, v in params.items():
        assert ema[k].sharding.is_equivalent_to(v.sharding, v.ndim), k
    assert any(not v.sharding.is_fully_replicated for v in ema.values())


# ---------------------------------------------------------------- memory
def _big_bytes(trainer) -> int:
    """Bytes (whole arrays) of the parameters at or above min_shard and of their optimizer-state leaves."""
    p = trainer.train_state.params
    keep = {k for k, v in p.items() if v.size >= trainer.strategy.min_shard}
    n = sum(p[k].nbytes for k in keep)
    for path, leaf in jax.tree_util.tree_flatten_with_path(trainer.train_state.opt_state)[0]:
        if any(getattr(k, "key", None) in keep for k in path):
            n += leaf.nbytes
    return n


def _state_shard_bytes(trainer, big: bool) -> int:
    p = trainer.train_state.params
    keep = {k for k, v in p.items() if (v.size >= trainer.strategy.min_shard) == big}
    leaves = [v for k, v in p.items() if k in keep]
    for path, leaf in jax.tree_util.tree_flatten_with_path(trainer.train_state.opt_state)[0]:
        if any(getattr(k, "key", None) in keep for k in path):
            leaves.append(leaf)
    return per_device_bytes(leaves)


def test_fsdp_holds_an_eighth_of_ddp(runs):
    ddp, fsdp = runs["ddp"][0], runs["fsdp"][0]
    big = _big_bytes(ddp)
    # from the arrays' shards
    assert _state_shard_bytes(ddp, big=True) == big
    assert _state_shard_bytes(fsdp, big=True) == pytest.approx(big / 8, rel=0.05)
    # from the compiled step: the arguments differ only by the sharded part (same batch rows per device)
    a_ddp = ddp.compiled["train"].memory_analysis().argument_size_in_bytes
    a_fsdp = fsdp.compiled["train"].memory_analysis().argument_size_in_bytes
    replicated_rest = a_ddp - big
    assert replicated_rest < 0.02 * a_ddp  # the model is almost all large parameters
    assert (a_fsdp - replicated_rest) / big == pytest.approx(1 / 8, rel=0.05)
    assert a_fsdp / a_ddp == pytest.approx(1 / 8, rel=0.05)


def test_tensor_parallel_halves_the_widths_it_splits(runs):
    data = token_batches(1, 64)
    tp, _, _, _ = _fit(TensorParallel(2), 2, data, opt="adam+grad")
    single = runs["single"][0]
    split = 0
    for k, v in tp.train_state.params.items():
        spec = tuple(v.sharding.spec) + (None,) * (v.ndim - len(v.sharding.spec))
        shard = v.addressable_shards[0].data.shape
        for _dim, (axis, n, full) in enumerate(zip(spec, shard, v.shape)):
            assert n == (full // 2 if axis == "tensor" else full), (k, spec, shard)
        split += "tensor" in spec
    assert split == _n_weights(tp) == 8  # 6 kernels per block, embedding table and head
    big = _big_bytes(single)
    a_single = single.compiled["train"].memory_analysis().argument_size_in_bytes
    a_tp = tp.compiled["train"].memory_analysis().argument_size_in_bytes
    # tensor does not split rows: both steps take the whole batch, so only the split widths differ
    assert (a_tp - (a_single - big)) / big == pytest.approx(1 / 2, rel=0.05)


def test_parameters_are_created_sharded(runs):
    """configure_model runs inside one SPMD program whose per-device output and scratch are a shard's worth."""
    fsdp, ddp = runs["fsdp"][0], runs["ddp"][0]
    whole = sum(v.nbytes for v in ddp.train_state.params.values())
    m = fsdp.engine.init_compiled.memory_analysis()
    assert m.output_size_in_bytes < 0.15 * whole
    assert m.output_size_in_bytes + m.temp_size_in_bytes < 0.5 * whole
    hlo = fsdp.engine.init_compiled.as_text()
    assert not re.search(r"all-gather|all-reduce", hlo)  # nothing built whole then scattered


def test_fit_prints_mesh_and_per_device_bytes(runs):
    trainer, _, _, printed = runs["fsdp"]
    assert "Mesh: fsdp=8 (8 devices)" in printed
    p = fmt_bytes(per_device_bytes(trainer.train_state.params))
    o = fmt_bytes(per_device_bytes(trainer.train_state.opt_state))
    assert f"Per device: params {p}, optimizer state {o}" in printed


# ---------------------------------------------------------------- communication
_OP = re.compile(
    r"\n\s*%?\S+ = (.+?) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?:-start)?\("
)


def _collectives(trainer) -> list[tuple[str, str]]:
    return [(op, shape) for shape, op in _OP.findall(trainer.compiled["train"].as_text())]


WEIGHT = "f32[256,256]"


def _n_weights(trainer) -> int:
    """The 256x256 matrices: q, k, v, o, up, down per block, the embedding table and the head."""
    return sum(v.shape == (256, 256) for v in trainer.train_state.params.values())


def test_ddp_all_reduces_gradients_and_gathers_nothing(runs):
    ops = _collectives(runs["ddp"][0])
    kinds = Counter(op for op, _ in ops)
    assert kinds["all-reduce"] >= 1 and kinds["all-gather"] == 0 and kinds["reduce-scatter"] == 0
    reduced = sum(shape.count(WEIGHT) for op, shape in ops if op == "all-reduce")
    assert reduced == _n_weights(runs["ddp"][0]) == 8  # every full-size gradient is all-reduced


def test_fsdp_gathers_parameters_and_reduce_scatters_gradients(runs):
    trainer = runs["fsdp"][0]
    ops = _collectives(trainer)
    gathered = [shape for op, shape in ops if op == "all-gather" and shape.startswith(WEIGHT)]
    assert len(gathered) >= _n_weights(trainer)  # each sharded weight is gathered before use (some again in backward)
    if any(op == "reduce-scatter" for op, _ in ops):
        return  # backends with a reduce-scatter op (GPU/TPU)
    # XLA:CPU has no reduce-scatter pass: it emits the same collective as an all-reduce
    # of the full gradients followed by each device slicing out its own shard.
    assert jax.default_backend() == "cpu"
    reduced = sum(shape.count(WEIGHT) for op, shape in ops if op == "all-reduce")
    assert reduced == _n_weights(trainer)
    hlo = trainer.compiled["train"].as_text()
    shard = {"f32[32,256]", "f32[256,32]"}
    slices = re.findall(r"= (f32\[\d+,\d+\])\{[^}]*\} dynamic-slice\(", hlo)
    assert shard & set(slices)


def test_tensor_parallel_gathers_no_whole_weight(runs):
    trainer = runs["tp"][0]
    ops = _collectives(trainer)
    split_shapes = {
        f"f32[{','.join(map(str, v.shape))}]"
        for v in trainer.train_state.params.values()
        if not v.sharding.is_fully_replicated
    }
    assert split_shapes == {WEIGHT}
    for op, shape in ops:
        if op in ("all-gather", "all-reduce"):
            # neither the weights nor their gradients cross devices: only activations do
            assert WEIGHT not in shape, (op, shape)
    assert any(op == "all-reduce" and "f32[64,8,256]" in shape for op, shape in ops)  # row-split outputs summed
