"""Exact resume: a run stopped by SIGTERM and resumed with ckpt_path="last" ends bit-identical to one
that never stopped (CPU), including mid-epoch, mid-accumulation and at an epoch boundary."""

from __future__ import annotations

import os
import signal

import jax
import numpy as np
import pytest

import jaxlight as jl
from tests.checkpoint_models import DropoutClassifier, arrays, host_params, stateful_loader, trainer
from tests.helpers import SignalAt

MAX_STEPS = 10  # with accumulate_grad_batches=2 and 8 batches per epoch: 20 batches, 2.5 epochs


def _loader(kind: str):
    if kind == "stateful":
        return stateful_loader()
    x, y = arrays()
    return [(x[i : i + 8], y[i : i + 8]) for i in range(0, 64, 8)]  # a plain re-iterable: resumed by skipping


class Count(jl.Callback):
    def __init__(self) -> None:
        self.batches: list[tuple[int, int]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.batches.append((trainer.current_epoch, batch_idx))


_refs: dict[str, dict[str, np.ndarray]] = {}


def _reference(kind: str, tmp_path) -> dict[str, np.ndarray]:
    if kind not in _refs:
        t = trainer(str(tmp_path / "ref"), max_steps=MAX_STEPS)
        t.fit(DropoutClassifier(), _loader(kind))
        _refs[kind] = host_params(t)
    return _refs[kind]


@pytest.mark.parametrize(
    "kind,at",
    [
        ("stateful", 11),  # epoch 1, batch 2 done; odd micro-batch: the accumulated gradient is in the checkpoint
        # the last batch of epoch 0: resumes with a fresh epoch 1 from the saved shuffle state
        pytest.param("stateful", 8, marks=pytest.mark.slow),
        # plain re-iterable: resumes by skipping 5 batches of epoch 0
        pytest.param("list", 5, marks=pytest.mark.slow),
    ],
)
def test_sigterm_then_resume_is_bit_identical(kind, at, tmp_path):
    ref = _reference(kind, tmp_path)
    run = str(tmp_path / "run")
    t1 = trainer(run, callbacks=[SignalAt(at)], max_steps=MAX_STEPS)
    handler_before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(jl.Preempted) as exc:
        t1.fit(DropoutClassifier(), _loader(kind))
    assert signal.getsignal(signal.SIGTERM) == handler_before  # put back after fit
    assert isinstance(exc.value, SystemExit) and exc.value.code == 143
    assert exc.value.step == at // 2 and exc.value.signum == signal.SIGTERM
    assert t1.position.micro_batches == at  # finished the step it was in, no further
    assert exc.value.path is not None and jl.checkpoint.is_complete(exc.value.path)
    assert os.path.realpath(os.path.join(run, "last.ckpt")) == os.path.realpath(exc.value.path)

    count = Count()
    t2 = trainer(run, callbacks=[count], max_steps=MAX_STEPS)
    t2.fit(DropoutClassifier(), _loader(kind), ckpt_path="last")
    assert len(count.batches) == 2 * MAX_STEPS - at  # resumed, not restarted
    assert count.batches[0] == (at // 8, at % 8)  # first batch after the stop point
    got = host_params(t2)
    assert got.keys() == ref.keys()
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)


def test_checkpoint_holds_rng_optimizer_and_loop_state(tmp_path):
    """What a checkpoint holds, read back field by field against the live trainer."""
    t = trainer(str(tmp_path / "c"), max_steps=3, every_n_train_steps=3)
    t.fit(DropoutClassifier(), stateful_loader())
    t.checkpoint_callback.wait_until_finished()
    path = t.checkpoint_callback.best_model_path
    meta = jl.checkpoint.read_meta(path)
    host = jl.checkpoint.host_checkpoint(meta)
    assert meta["global_step"] == 3 and meta["micro_batches"] == 6
    assert host["loops"]["fit_loop"]["batches_in_epoch"] == 6
    assert host["hyper_parameters"]["dropout"] == 0.2
    assert any(k.startswith("rest/") for k in meta["key_impls"])  # dropout/default RNG keys as raw key data
    # the loader state is the torchdata state after the 6th batch
    assert host["loops"]["fit_loop"]["loader_state"]["_num_yielded"] == 6
    # restoring into a fresh trainer gives the same arrays, RNG keys included
    t2 = trainer(str(tmp_path / "c2"), max_steps=3)
    m2 = DropoutClassifier()
    t2.lightning_module, m2.trainer = m2, t2  # set up as fit would, without running the loop
    t2.engine.attach(m2)
    t2.engine.setup_model()
    tx = jl.optim.configure(m2.configure_optimizers(), accumulate_grad_batches=t2.accumulate_grad_batches)
    t2.engine.setup_training(tx, t2.callbacks, t2, 0)
    jl.checkpoint.restore_into_trainer(t2, path, "fit")
    for a, b in zip(jax.tree.leaves(t.train_state), jax.tree.leaves(t2.train_state)):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert (t2.global_step, t2.current_epoch, t2.position.resume_offset) == (3, 0, 6)


def test_configured_signal_without_checkpointing(tmp_path):
    """SIGUSR1 when configured; with checkpointing off the run still stops cleanly, saving nothing."""
    assert any(isinstance(c, jl.callbacks.Preemption) for c in jl.Trainer(logger=False).callbacks)  # on by default
    pre = jl.callbacks.Preemption(signals=(signal.SIGTERM, signal.SIGUSR1))
    t = jl.Trainer(
        max_steps=MAX_STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[SignalAt(3, signal.SIGUSR1), pre],
    )
    with pytest.raises(jl.Preempted) as exc:
        t.fit(DropoutClassifier(), _loader("list"))
    assert (exc.value.code, exc.value.signum, exc.value.path, exc.value.step) == (143, signal.SIGUSR1, None, 3)
    assert [c for c in t.callbacks if isinstance(c, jl.callbacks.Preemption)] == [pre]
    assert not os.path.exists(tmp_path / "checkpoints")
    with pytest.raises(ValueError, match="SIGKILL cannot be caught"):
        jl.callbacks.Preemption(signals=(signal.SIGKILL,))


class EpochMeanClassifier(DropoutClassifier):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("loss_mean", loss, on_step=False, on_epoch=True)  # an epoch-level reduction
        return loss


class EpochValues(jl.Callback):
    def __init__(self) -> None:
        self.values: dict[int, float] = {}

    def on_train_epoch_end(self, trainer, module):
        self.values[trainer.current_epoch] = float(trainer.callback_metrics["loss_mean"])


def test_mid_epoch_resume_continues_epoch_level_metrics(tmp_path):
    ref_vals = EpochValues()
    trainer(str(tmp_path / "ref"), callbacks=[ref_vals], max_steps=MAX_STEPS).fit(
        EpochMeanClassifier(), _loader("stateful")
    )
    run = str(tmp_path / "run")
    with pytest.raises(jl.Preempted):
        trainer(run, callbacks=[SignalAt(11)], max_steps=MAX_STEPS).fit(EpochMeanClassifier(), _loader("stateful"))
    vals = EpochValues()
    trainer(run, callbacks=[vals], max_steps=MAX_STEPS).fit(
        EpochMeanClassifier(), _loader("stateful"), ckpt_path="last"
    )
    # epoch 1 was interrupted after 3 of its 8 batches: its mean still covers all 8 batches
    assert 1 in vals.values and vals.values[1] == pytest.approx(ref_vals.values[1], rel=1e-6, abs=1e-7)
