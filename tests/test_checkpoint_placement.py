"""Restore across placements: a checkpoint written under "ddp" on 8 devices restores under "fsdp+tp" on 8
and under "ddp" on 4 with every array read into the new shardings, and training continues to the same
losses as the run that never stopped."""

from __future__ import annotations

import numpy as np
import pytest

import jaxlight as jl
from tests.helpers import Record, quiet
from tests.strategy_models import LM, token_batches

DIMS = dict(vocab=64, embed=64, heads=4, mlp=64, layers=1)
STEPS, SPLIT = 6, 3


def _fit(strategy, devices, max_steps, dirpath=None, ckpt_path=None):
    rec = Record()
    cbs = [rec]
    if dirpath is not None:
        cbs.append(jl.callbacks.ModelCheckpoint(dirpath=dirpath, every_n_train_steps=SPLIT, save_top_k=-1))
    t = jl.Trainer(
        strategy=strategy,
        devices=devices,
        max_steps=max_steps,
        callbacks=cbs,
        **quiet(enable_checkpointing=dirpath is not None, num_sanity_val_steps=None),
    )
    t.fit(LM(**DIMS), token_batches(STEPS, 16, vocab=DIMS["vocab"]), ckpt_path=ckpt_path)
    return t, rec


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    d = tmp_path_factory.mktemp("ddp8")
    t, rec = _fit("ddp", 8, STEPS, dirpath=str(d))
    path = str(d / f"epoch=0-step={SPLIT}.ckpt")
    saved = jl.checkpoint.read_meta(path)
    assert saved["mesh"]["data"] == 8 and saved["global_step"] == SPLIT
    return path, [float(x) for x in rec.losses]


# fsdp x tensor with a small min_shard so that these small parameters really are split
FSDP_TP = jl.strategies.FSDP(min_shard=256) + jl.strategies.TensorParallel(2)


@pytest.mark.parametrize(
    "strategy,devices", [(FSDP_TP, 8), pytest.param("ddp", 4, marks=pytest.mark.slow)], ids=["fsdp+tp-8", "ddp-4"]
)
def test_restore_on_other_placement_continues_identically(straight, strategy, devices):
    path, ref_losses = straight
    t, rec = _fit(strategy, devices, STEPS, ckpt_path=path)
    # every array landed in the new trainer's own shardings ...
    for k, sh in rec.start_shardings.items():
        assert sh == t.engine.state_shardings.params[k], k
        assert len(sh.device_set) == devices
    if devices == 8:
        axes = {a for sh in rec.start_shardings.values() for a in sh.spec if a is not None}
        assert {"fsdp", "tensor"} <= axes  # really split over both axes
    # ... with the saved values, exactly (checked against an independent inference load)
    ref = LM.load_from_checkpoint(path)
    ref_params = {k: np.asarray(v) for k, v in jl.state.split_models({"net": ref.net})[1].items()}
    assert rec.start_params.keys() == ref_params.keys()
    for k in ref_params:
        np.testing.assert_array_equal(rec.start_params[k], ref_params[k], err_msg=k)
    # and training continues to the losses of the run that never stopped (other reduction order: 1e-5)
    got = [float(x) for x in rec.losses]
    assert len(got) == STEPS - SPLIT
    np.testing.assert_allclose(got, ref_losses[SPLIT:], rtol=1e-5, atol=1e-6)
