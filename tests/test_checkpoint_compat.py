"""Checkpoints written before the checkpoint package was split (issue 21) still load, exactly.

tests/fixtures/ckpt_v0 was written by tests/fixtures/make_ckpt_v0.py with the code of that time: a module
with BatchNorm statistics and a dropout RNG stream, Adam, an EMA callback, saved mid-epoch after 2 of 3 steps,
with every array of its train state in expected.npz. The orbax items keep their names ("rest", "extra") though
the TrainState fields are now ``model_state`` and ``callback_state``.
"""

from __future__ import annotations

import os
import shutil

import jax
import numpy as np
import pytest

import jaxlight as jl
from tests.checkpoint_models import NormRegressor, norm_batches, norm_trainer

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "ckpt_v0")


@pytest.fixture
def ckpt(tmp_path) -> str:
    """A copy of the fixture checkpoint (nothing is ever written into the repository's copy)."""
    dst = tmp_path / "step2.ckpt"
    shutil.copytree(os.path.join(FIXTURE, "step2.ckpt"), dst)
    return str(dst)


def _values(state) -> dict[str, np.ndarray]:
    out = {}
    for path, v in jax.tree_util.tree_flatten_with_path(state)[0]:
        if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key):
            v = jax.random.key_data(v)
        out[jax.tree_util.keystr(path)] = np.asarray(jax.device_get(v))
    return out


def _assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_the_old_checkpoint_restores_every_array_exactly(ckpt):
    expected = dict(np.load(os.path.join(FIXTURE, "expected.npz")))
    assert any(k.startswith(".model_state") for k in expected) and any(".callback_state['ema']" in k for k in expected)
    t = norm_trainer(max_steps=2)  # the checkpoint is at step 2: fit restores it and has nothing left to train
    t.fit(NormRegressor(), norm_batches(), ckpt_path=ckpt)
    assert (t.global_step, t.current_epoch, t.position.batches_in_epoch) == (2, 0, 2)
    _assert_same(_values(t.train_state), expected)


def test_the_old_checkpoint_resumes_like_an_uninterrupted_run(ckpt, tmp_path):
    """The old checkpoint resumes exactly as a current checkpoint of the same state does, and that state is where
    this code's own uninterrupted run stands at step 2.

    Exact comparisons stay on one machine and one XLA code generator: the fixture was written elsewhere, so steps
    1-2 recomputed here may differ from it in the last bits. So (1) the fixture's step-2 state is compared with
    this machine's step 2 at rounding tolerance (rtol 1e-5, atol 1e-6; counters and RNG keys exactly), except
    what descends from ``net/l1/bias``: BatchNorm subtracts that bias again, so its true gradient is zero and
    Adam (eps=1e-8) steps it by about lr on rounding noise alone (measured here: up to 3e-2 apart), which BatchNorm's
    running mean then carries. (2) The old checkpoint's resume is compared bit for bit with the resume of a
    current-format checkpoint holding the same arrays, which test_checkpoint_resume shows resumes
    bit-identically to an uninterrupted run.
    """
    expected = dict(np.load(os.path.join(FIXTURE, "expected.npz")))
    here = norm_trainer(max_steps=2)
    here.fit(NormRegressor(), norm_batches())
    fresh = _values(here.train_state)
    assert sorted(fresh) == sorted(expected)
    noise = ("['net/l1/bias']", "['net/bn/mean']")
    for k, want in expected.items():
        if want.dtype.kind in "iu":  # step counters, RNG key data
            np.testing.assert_array_equal(fresh[k], want, err_msg=k)
        elif not (k.endswith(noise) and not k.startswith(".opt_state")):  # Adam's moments of it stay ~1e-8
            np.testing.assert_allclose(fresh[k], want, rtol=1e-5, atol=1e-6, err_msg=k)

    current = str(tmp_path / "current.ckpt")
    restored = norm_trainer(max_steps=2)  # at step 2 already: fit restores and trains nothing
    restored.fit(NormRegressor(), norm_batches(), ckpt_path=ckpt)
    restored.save_checkpoint(current)

    def resume(path: str) -> tuple[jl.Trainer, list[int]]:
        seen: list[int] = []
        count = jl.callbacks.LambdaCallback(on_train_batch_end=lambda tr, m, out, b, i: seen.append(i))
        t = norm_trainer(max_steps=4, callbacks=[count])
        t.fit(NormRegressor(), norm_batches(), ckpt_path=path)
        return t, seen

    old, old_seen = resume(ckpt)
    new, new_seen = resume(current)
    assert old_seen == new_seen == [2, 3] and old.global_step == new.global_step == 4  # resumed inside epoch 0
    _assert_same(_values(old.train_state), _values(new.train_state))
    assert not all(np.array_equal(v, expected[k]) for k, v in _values(old.train_state).items())  # it trained


def test_the_old_checkpoint_loads_into_a_module_and_reads_its_host_state(ckpt):
    expected = np.load(os.path.join(FIXTURE, "expected.npz"))
    m = NormRegressor.load_from_checkpoint(ckpt)
    assert m.hparams["lr"] == 0.01
    for name in ("l1", "bn", "l2"):
        layer = getattr(m.net, name)
        for field in ("kernel", "bias", "scale", "mean", "var"):
            if hasattr(layer, field):
                group = ".params" if field in ("kernel", "bias", "scale") else ".model_state"
                want = expected[f"{group}['net/{name}/{field}']"]
                np.testing.assert_array_equal(np.asarray(getattr(layer, field)[...]), want, err_msg=f"{name}.{field}")
    meta = jl.checkpoint.read_meta(ckpt)
    assert meta["format_version"] == 2 and meta["key_impls"] == {"rest/net/do/rngs/key": "threefry2x32"}
    host = jl.checkpoint.host_checkpoint(meta)
    assert host["hyper_parameters"] == {"lr": 0.01} and host["global_step"] == 2
    assert host["callbacks"]["EMA{'name': 'ema'}"]["decay"] == 0.9
    assert jl.checkpoint.is_complete(ckpt)
    assert [str(p) for p in jl.checkpoint.list_checkpoints(os.path.dirname(ckpt))] == [ckpt]
