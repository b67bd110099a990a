"""Adversary round faults (items 3, 4 and 7 of the issue), each shut.

3: a run whose loss turns non-finite before the first ``log_every_n_steps`` fetch warned nowhere; it now warns at
the epoch's end, naming the step. 4: a checkpoint whose metadata claims another global step (or another position
in the epoch) than its arrays (the train state's step counter) and its loader state say was resumed blindly; it is
now refused before any training. 7: a metadata file of any size was read whole; one over the documented bound is
now refused before it is read. 5: a checkpoint directory replaced by a regular file mid-run ended the run with a
raw ``FileExistsError``; it is now a ``CheckpointError`` naming the path and what is there.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import shutil
import warnings

import numpy as np
import pytest

import jaxlight as jl
from jaxlight.checkpoint import format as ckfmt
from tests.checkpoint_models import DropoutClassifier, arrays, stateful_loader
from tests.helpers import quiet

MC = jl.callbacks.ModelCheckpoint
_quiet = functools.partial(quiet, devices=1, enable_checkpointing=None)


def _data(n_batches: int = 4, nan_from: int | None = None) -> list:
    """``n_batches`` batches of 8; from batch ``nan_from`` on the inputs are NaN (the loss diverges there)."""
    x, y = arrays(8 * n_batches)
    out = [(x[i : i + 8].copy(), y[i : i + 8]) for i in range(0, 8 * n_batches, 8)]
    for b in out[nan_from:] if nan_from is not None else []:
        b[0][:] = np.nan
    return out


def _loss_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "training loss is" in str(w.message)]


# ---------------------------------------------------------------------------- 3: a non-finite loss is never silent
def test_a_short_diverging_run_warns_at_the_epoch_end():
    """3 steps, log_every_n_steps=50 (never reached), no checkpointing; the loss is NaN from step 1 on: the
    epoch's end sees the last step's loss (step 2) and warns, once, with a jaxlight warning class."""
    t = jl.Trainer(max_steps=3, log_every_n_steps=50, **quiet(devices=1))
    with pytest.warns(jl.NonFiniteLossWarning, match=r"the training loss is nan at step 2 \(the last step of epoch 0"):
        t.fit(DropoutClassifier(), _data(4, nan_from=1))
    assert t.global_step == 3


def test_a_diverging_run_warns_once_per_fit_not_every_epoch():
    t = jl.Trainer(max_epochs=3, log_every_n_steps=50, **quiet(devices=1))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        t.fit(DropoutClassifier(), _data(4, nan_from=1))
    found = _loss_warnings(record)
    assert len(found) == 1 and "at step 3 (the last step of epoch 0" in found[0], found
    # a second fit is a new run: it warns again
    with pytest.warns(jl.NonFiniteLossWarning, match=r"the training loss is nan at step"):
        jl.Trainer(max_epochs=1, **quiet(devices=1)).fit(DropoutClassifier(), _data(4, nan_from=1))


def test_a_finite_run_does_not_warn():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        jl.Trainer(max_epochs=2, log_every_n_steps=50, **quiet(devices=1)).fit(DropoutClassifier(), _data(4))
    assert not _loss_warnings(record)


# ---------------------------------------------------------------------------- 4: metadata cross-checked with arrays
def _rewrite_meta(ckpt: pathlib.Path, edit) -> None:
    f = ckpt / "meta" / "metadata"
    meta = json.loads(f.read_text())
    edit(meta)
    f.write_text(json.dumps(meta))


def _set_everywhere(meta: dict, key: str, value: int) -> None:
    """``key`` in the readable facts, the host dict and its fit_loop entry (what check_host compares)."""
    meta[key] = value
    host = meta["host_state"]
    if key in host:
        host[key] = value
    host["loops"]["fit_loop"][key] = value


def test_a_checkpoint_claiming_another_global_step_is_refused(tmp_path):
    """The metadata says global step 10**9, the stored step counter 4: refused, naming both and the path,
    before any batch runs (before: the run went on at step 1,000,000,001)."""
    d = tmp_path / "ck"
    jl.Trainer(max_steps=4, callbacks=[MC(dirpath=str(d), every_n_train_steps=4)], **_quiet()).fit(
        DropoutClassifier(), _data()
    )
    (ckpt,) = list(d.iterdir())
    _rewrite_meta(ckpt, lambda m: _set_everywhere(m, "global_step", 10**9))
    seen = []

    class Count(jl.Callback):
        def on_train_batch_start(self, *a):
            seen.append(1)

    t = jl.Trainer(max_steps=10**9 + 2, callbacks=[Count()], **quiet(devices=1))
    with pytest.raises(jl.CheckpointError, match=r"global step 1000000000.*step counter.* 4\b") as e:
        t.fit(DropoutClassifier(), _data(), ckpt_path=str(ckpt))
    assert str(ckpt) in str(e.value)
    assert not seen and t.global_step == 0


def test_a_checkpoint_claiming_another_batch_position_is_refused(tmp_path):
    """Saved after 2 of 8 batches of a StatefulDataLoader; the metadata is made to say 5: refused, naming both."""
    d = tmp_path / "ck"
    jl.Trainer(max_steps=2, callbacks=[MC(dirpath=str(d), every_n_train_steps=2)], **_quiet()).fit(
        DropoutClassifier(), stateful_loader()
    )
    (ckpt,) = list(d.iterdir())
    _rewrite_meta(ckpt, lambda m: _set_everywhere(m, "batches_in_epoch", 5))
    t = jl.Trainer(max_steps=6, **quiet(devices=1))
    with pytest.raises(jl.CheckpointError, match=r"batch 5 of epoch 0.*loader state.* 2 batches") as e:
        t.fit(DropoutClassifier(), stateful_loader(), ckpt_path=str(ckpt))
    assert str(ckpt) in str(e.value) and t.global_step == 0


def test_an_honest_resume_with_accumulation_and_a_loader_state_passes(tmp_path):
    """The checks accept what jaxlight writes: accumulate_grad_batches=2 (the step counter counts updates, as
    global_step does), saved mid-epoch with a loader state."""
    d = tmp_path / "ck"
    jl.Trainer(
        max_steps=2, accumulate_grad_batches=2, callbacks=[MC(dirpath=str(d), every_n_train_steps=2)], **_quiet()
    ).fit(DropoutClassifier(), stateful_loader())
    (ckpt,) = list(d.iterdir())
    t = jl.Trainer(max_steps=3, accumulate_grad_batches=2, **quiet(devices=1))
    t.fit(DropoutClassifier(), stateful_loader(), ckpt_path=str(ckpt))
    assert t.global_step == 3


def test_a_resume_after_skipped_updates_passes(tmp_path):
    """NonFiniteGuard("skip") drops 2 of 4 updates: the step counter says 2, global_step 4; the checkpoint
    records the 2 skipped ones, so the resume accepts it (and the tampered variant is still refused)."""
    d = tmp_path / "ck"
    guard = jl.callbacks.NonFiniteGuard("skip", verbose=False)
    jl.Trainer(
        max_steps=4, callbacks=[guard, MC(dirpath=str(d), every_n_train_steps=4, save_non_finite=True)], **_quiet()
    ).fit(DropoutClassifier(), _data(4, nan_from=2))
    (ckpt,) = list(d.iterdir())
    assert (
        json.loads((ckpt / "meta" / "metadata").read_text())["host_state"]["loops"]["fit_loop"]["skipped_updates"] == 2
    )
    t = jl.Trainer(max_steps=6, **quiet(devices=1))
    t.fit(DropoutClassifier(), _data(4), ckpt_path=str(ckpt))
    assert t.global_step == 6
    _rewrite_meta(ckpt, lambda m: _set_everywhere(m, "global_step", 5))
    with pytest.raises(jl.CheckpointError, match=r"global step 5, but .* counter .* is 2 plus the 2 updates"):
        jl.Trainer(max_steps=8, **quiet(devices=1)).fit(DropoutClassifier(), _data(4), ckpt_path=str(ckpt))


# ---------------------------------------------------------------------------- 7: metadata size bound
def test_metadata_over_the_bound_is_refused_before_it_is_read(tmp_path, monkeypatch):
    """A meta file one byte over the bound (sparse: nothing is written) is refused naming the file, its size and
    the bound, without being opened (before: read whole)."""
    ckpt = tmp_path / "big.ckpt"
    (ckpt / "meta").mkdir(parents=True)
    f = ckpt / "meta" / "metadata"
    with open(f, "wb") as fh:
        fh.truncate(ckfmt.MAX_META_BYTES + 1)
    opened = []
    real = pathlib.Path.read_bytes
    monkeypatch.setattr(pathlib.Path, "read_bytes", lambda self: opened.append(self) or real(self))
    with pytest.raises(jl.CheckpointError) as e:
        jl.checkpoint.read_meta(ckpt)
    msg = str(e.value)
    assert str(f) in msg and str(ckfmt.MAX_META_BYTES + 1) in msg and str(ckfmt.MAX_META_BYTES) in msg, msg
    assert not opened
    assert ckfmt.MAX_META_BYTES == 32 * 2**20


def test_metadata_bound_can_be_raised_by_the_environment(tmp_path, monkeypatch):
    ckpt = tmp_path / "c.ckpt"
    (ckpt / "meta").mkdir(parents=True)
    (ckpt / "meta" / "metadata").write_text(json.dumps({"format": ckfmt.FORMAT, "pad": "x" * 2000}))
    monkeypatch.setenv("JAXLIGHT_MAX_CHECKPOINT_META_BYTES", "1000")
    with pytest.raises(jl.CheckpointError, match=r"over the bound of 1000 bytes"):
        jl.checkpoint.read_meta(ckpt)
    monkeypatch.setenv("JAXLIGHT_MAX_CHECKPOINT_META_BYTES", "100000")
    assert jl.checkpoint.read_meta(ckpt)["pad"] == "x" * 2000


def test_an_oversized_meta_file_makes_last_skip_that_checkpoint(tmp_path):
    """``"last"`` orders by reading each candidate's metadata: an oversized one is never preferred (never read)."""
    d = tmp_path / "ck"
    jl.Trainer(max_steps=4, callbacks=[MC(dirpath=str(d), every_n_train_steps=2, save_top_k=-1)], **_quiet()).fit(
        DropoutClassifier(), _data()
    )
    newest = d / "epoch=0-step=4.ckpt"
    f = newest / "meta" / "metadata"
    with open(f, "ab") as fh:  # still valid JSON (trailing blanks), just over the bound
        fh.write(b" " * (ckfmt.MAX_META_BYTES + 1 - f.stat().st_size))
    assert ckfmt.checkpoint_order(newest) == (-1, -1, -1)
    assert os.path.basename(jl.checkpoint.find_last([d])) == "epoch=0-step=2.ckpt"


def test_a_save_over_the_metadata_bound_warns(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXLIGHT_MAX_CHECKPOINT_META_BYTES", "100")  # this run's metadata is ~1 KB
    t = jl.Trainer(max_steps=1, **quiet(devices=1))
    t.fit(DropoutClassifier(), _data(1))
    with pytest.warns(UserWarning, match=r"over the 100 bytes a resume reads; set JAXLIGHT_MAX_CHECKPOINT_META"):
        t.save_checkpoint(tmp_path / "c.ckpt")


# ---------------------------------------------------------------------------- 5: directory faults are named
class _ReplaceDir(jl.Callback):
    """At the end of epoch 0 (before ModelCheckpoint's save: checkpoint callbacks run last, as in Lightning):
    delete the checkpoint directory, and put a file there."""

    def __init__(self, path: pathlib.Path, with_file: bool) -> None:
        self.path, self.with_file = path, with_file

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 0:
            shutil.rmtree(self.path)
            if self.with_file:
                self.path.write_text("not a directory")


def test_a_checkpoint_directory_replaced_by_a_file_mid_run_is_a_named_checkpoint_error(tmp_path):
    """Before: a raw ``FileExistsError`` from ``os.makedirs`` at the next save."""
    d = tmp_path / "ck"
    ck = MC(dirpath=str(d), save_top_k=-1)
    t = jl.Trainer(max_epochs=2, callbacks=[_ReplaceDir(d, with_file=True), ck], **_quiet())
    says = rf"{d} is not a directory \(a file is at that path\): checkpoint epoch=0-step=4.ckpt was not saved"
    with pytest.raises(jl.CheckpointError, match=says):
        t.fit(DropoutClassifier(), _data())
    assert t.global_step == 4 and d.read_text() == "not a directory"  # the stranger's file is left alone
    # at the next fit's start, the same message (not "not writable (File exists)")
    t2 = jl.Trainer(max_epochs=1, callbacks=[MC(dirpath=str(d))], **_quiet())
    with pytest.raises(jl.CheckpointError, match=rf"{d} is not a directory \(a file is at that path\): the first"):
        t2.fit(DropoutClassifier(), _data())


def test_a_checkpoint_directory_deleted_mid_run_is_made_again_and_the_run_checkpoints_on(tmp_path):
    d = tmp_path / "ck"
    t = jl.Trainer(max_epochs=2, callbacks=[_ReplaceDir(d, with_file=False), MC(dirpath=str(d))], **_quiet())
    t.fit(DropoutClassifier(), _data())
    assert sorted(p.name for p in d.glob("*.ckpt")) == ["epoch=1-step=8.ckpt"]
