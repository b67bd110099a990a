"""Checkpoints of an expert-parallel run: saved under "ep", restored under "fsdp", on one device and under
"ep" again, every array exact and in the new trainer's placement; a run stopped by SIGTERM under "ep" and
resumed ends bit-identical to one that never stopped."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxlight as jl
from tests.core_models import quiet
from tests.expert_models import ExpertLM, token_batches
from tests.helpers import SignalAt

STEPS = 4


def _state(trainer) -> dict[str, np.ndarray]:
    """Parameters and optimizer state (momentum, first-gradient copy, counters) by path, on the host."""
    st = trainer.train_state
    leaves = jax.tree_util.tree_flatten_with_path((st.params, st.opt_state))[0]
    return {jax.tree_util.keystr(p): np.asarray(jax.device_get(v)) for p, v in leaves}


def _assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def _fit(strategy, devices, max_steps, ckpt_path=None, callbacks=(), **kw):
    t = jl.Trainer(
        strategy=strategy, devices=devices, max_steps=max_steps, max_epochs=1, callbacks=list(callbacks), **quiet(**kw)
    )
    t.fit(ExpertLM(), token_batches(STEPS, 16), ckpt_path=ckpt_path)
    return t


def test_checkpoint_moves_between_ep_fsdp_and_one_device_exactly(tmp_path):
    t = _fit("ep", 8, 2)
    saved = _state(t)
    path = str(tmp_path / "ep.ckpt")
    t.save_checkpoint(path)
    for i, (strategy, devices) in enumerate([("fsdp", 8), ("auto", 1), ("ep", 8)]):
        r = _fit(strategy, devices, 2, ckpt_path=path)  # restored at step 2 = max_steps: no step runs
        assert r.global_step == 2
        _assert_equal(_state(r), saved)
        w = r.train_state.params["net/moe/w_in"]
        shard = w.addressable_shards[0].data.shape
        if strategy == "fsdp":
            assert tuple(w.sharding.spec) == (None, "fsdp") and shard == (8, 8, 128)
        elif devices == 1:
            assert len(w.sharding.device_set) == 1 and shard == (8, 64, 128)
        else:
            assert tuple(w.sharding.spec) == ("expert",) and shard == (1, 64, 128)
        path = str(tmp_path / f"{i}-{strategy}.ckpt")
        r.save_checkpoint(path)


def test_preemption_and_resume_under_ep_are_bit_identical(tmp_path):
    ref = _state(_fit("ep", 8, STEPS))
    run = str(tmp_path / "run")
    ckpt = lambda: jl.callbacks.ModelCheckpoint(dirpath=run, every_n_train_steps=STEPS, save_last="link")
    with pytest.raises(jl.Preempted) as exc:
        _fit("ep", 8, STEPS, callbacks=[SignalAt(2), ckpt()], enable_checkpointing=True)
    assert exc.value.step == 2 and jl.checkpoint.is_complete(exc.value.path)
    resumed = _fit("ep", 8, STEPS, ckpt_path="last", callbacks=[ckpt()], enable_checkpointing=True)
    assert resumed.global_step == STEPS
    _assert_equal(_state(resumed), ref)
