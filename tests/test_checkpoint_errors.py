"""Loading checkpoints for inference and evaluation, and the errors for checkpoints that cannot be used."""

from __future__ import annotations

import functools
import os
import shutil

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from tests.checkpoint_models import DropoutClassifier, arrays, host_params
from tests.helpers import quiet

# checkpointing and sanity validation left to the Trainer's defaults
_quiet = functools.partial(quiet, enable_checkpointing=None, num_sanity_val_steps=None)


def _data():
    x, y = arrays(32)
    return [(x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One short fit; its checkpoint directory and final parameters."""
    d = tmp_path_factory.mktemp("saved")
    cwd = os.getcwd()
    os.chdir(d)
    try:
        t = jl.Trainer(
            max_epochs=1,
            callbacks=[jl.callbacks.ModelCheckpoint(dirpath=str(d / "ck"), save_last=True)],
            **_quiet(),
        )
        t.fit(DropoutClassifier(hidden=16), _data())
        t.save_checkpoint(str(d / "manual.ckpt"))  # Lightning's trainer.save_checkpoint, after fit
    finally:
        os.chdir(cwd)
    return str(d / "ck" / "last.ckpt"), host_params(t)


def test_load_from_checkpoint_for_inference(saved):
    path, params = saved
    m = DropoutClassifier.load_from_checkpoint(path)
    assert m.hparams.hidden == 16
    np.testing.assert_array_equal(np.asarray(m.net.l1.kernel[...]), params["net/l1/kernel"])
    np.testing.assert_array_equal(np.asarray(m.net.l2.bias[...]), params["net/l2/bias"])
    manual = str(os.path.join(os.path.dirname(path), os.pardir, "manual.ckpt"))
    m_manual = DropoutClassifier.load_from_checkpoint(manual)
    np.testing.assert_array_equal(np.asarray(m_manual.net.l1.kernel[...]), params["net/l1/kernel"])
    meta = jl.checkpoint.read_meta(manual)
    assert (meta["global_step"], meta["resume_epoch"], meta["batches_in_epoch"]) == (4, 1, 0)  # next epoch
    # kwargs override saved hparams that do not change shapes
    m2 = DropoutClassifier.load_from_checkpoint(path, lr=0.5)
    assert m2.hparams.lr == 0.5 and m2.hparams.hidden == 16
    np.testing.assert_array_equal(np.asarray(m2.net.l1.kernel[...]), params["net/l1/kernel"])
    # Lightning's arguments: map_location has nothing to do, hparams_file overrides (safe YAML), strict=False refused
    with open("hp.yaml", "w") as f:
        f.write("lr: 0.25\n")
    m3 = DropoutClassifier.load_from_checkpoint(path, map_location="cpu", hparams_file="hp.yaml", strict=True)
    assert m3.hparams.lr == 0.25 and m3.hparams.hidden == 16
    with pytest.raises(ValueError, match=r"strict=False\) is not supported"):
        DropoutClassifier.load_from_checkpoint(path, strict=False)


def test_validate_with_ckpt_path_uses_checkpoint_weights(saved):
    path, params = saved
    x, y = arrays(32)
    t = jl.Trainer(**_quiet())
    fresh = DropoutClassifier(hidden=16)
    out = t.validate(fresh, [(x[:8], y[:8])], ckpt_path=path, verbose=False)
    ref = DropoutClassifier.load_from_checkpoint(path)
    ref.net.eval()
    want = optax.softmax_cross_entropy_with_integer_labels(ref.net(x[:8]), y[:8]).mean()
    assert out[0]["val_loss"] == pytest.approx(float(want), rel=1e-6)
    np.testing.assert_array_equal(np.asarray(fresh.net.l1.kernel[...]), params["net/l1/kernel"])


def test_mismatched_model_lists_the_paths(saved):
    path, _ = saved
    with pytest.raises(jl.CheckpointError) as e:
        DropoutClassifier.load_from_checkpoint(path, hidden=24)
    msg = str(e.value)
    assert "shapes differ" in msg
    assert "params/net/l1/kernel: checkpoint (8, 16) vs model (8, 24)" in msg
    assert "params/net/l2/kernel: checkpoint (16, 4) vs model (24, 4)" in msg

    class Renamed(DropoutClassifier):
        def configure_model(self):
            super().configure_model()
            self.extra = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    with pytest.raises(jl.CheckpointError) as e:
        Renamed.load_from_checkpoint(path)
    assert "in the model but not in the checkpoint (2): params/extra/bias, params/extra/kernel" in str(e.value)


def test_last_without_checkpoint_says_where_it_looked(tmp_path):
    d = tmp_path / "nothing"
    t = jl.Trainer(
        max_epochs=1,
        callbacks=[jl.callbacks.ModelCheckpoint(dirpath=str(d))],
        **_quiet(),
    )
    # Lightning warns and trains from scratch when ckpt_path="last" finds nothing
    with pytest.warns(UserWarning, match=r"ckpt_path='last': no complete checkpoint found in \['.*nothing'\]"):
        t.fit(DropoutClassifier(), _data(), ckpt_path="last")
    assert t.global_step > 0


def test_partial_and_corrupt_directories(saved, tmp_path):
    path, _ = saved
    real = os.path.realpath(path)
    # an unfinished orbax save (never renamed) is refused, and "last" skips it
    tmp = tmp_path / "ck" / "epoch=0-step=9.ckpt.orbax-checkpoint-tmp-123"
    shutil.copytree(real, tmp)
    with pytest.raises(jl.CheckpointError, match="unfinished save"):
        DropoutClassifier.load_from_checkpoint(str(tmp))
    t = jl.Trainer(
        max_epochs=1,
        callbacks=[jl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ck"))],
        **_quiet(),
    )
    with pytest.warns(UserWarning, match="incomplete \\(never committed\\) saves there"):
        t.fit(DropoutClassifier(), _data(), ckpt_path="last")
    # a directory missing an item
    broken = tmp_path / "broken.ckpt"
    shutil.copytree(real, broken)
    shutil.rmtree(broken / "model")
    with pytest.raises(jl.CheckpointError, match=r"incomplete or corrupt: missing \['model'\]"):
        DropoutClassifier.load_from_checkpoint(str(broken))
    # array files damaged
    damaged = tmp_path / "damaged.ckpt"
    shutil.copytree(real, damaged)
    for root, _, files in os.walk(damaged / "model"):
        for f in files:
            if "ocdbt" in root or f.startswith("d") or "manifest" in f:
                with open(os.path.join(root, f), "wb") as fh:
                    fh.write(b"garbage")
    with pytest.raises(jl.CheckpointError, match="corrupt|could not be read"):
        DropoutClassifier.load_from_checkpoint(str(damaged))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        DropoutClassifier.load_from_checkpoint(str(tmp_path / "nope.ckpt"))


def test_weights_only_checkpoint_cannot_resume_fit(tmp_path):
    t = jl.Trainer(
        max_epochs=1,
        callbacks=[jl.callbacks.ModelCheckpoint(dirpath=str(tmp_path), save_weights_only=True)],
        **_quiet(),
    )
    t.fit(DropoutClassifier(), _data())
    path = t.checkpoint_callback.best_model_path
    assert not os.path.exists(os.path.join(path, "train"))
    m = DropoutClassifier.load_from_checkpoint(path)  # fine for inference
    np.testing.assert_array_equal(
        np.asarray(m.net.l1.kernel[...]), np.asarray(jax.device_get(t.train_state.params["net/l1/kernel"]))
    )
    t2 = jl.Trainer(max_epochs=2, enable_checkpointing=False, **_quiet())
    with pytest.raises(jl.CheckpointError, match="only the model weights"):
        t2.fit(DropoutClassifier(), _data(), ckpt_path=path)
