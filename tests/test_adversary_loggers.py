"""Adversary cases for the trackers (issue 26, item 8): files deleted under a running logger, a tracker that
stalls, a locked MLflow database. Every wait is bounded, so none of them can hang CI; a case that failed on the
code before the fix fails here on an assertion, not on a hang."""

from __future__ import annotations

import csv
import os
import re
import shutil
import sqlite3
import threading
import time
import warnings

import pytest

import jaxlight as jl
from jaxlight.loggers import LoggerCollection, LoggerDeliveryWarning
from jaxlight.loggers.logger import undelivered
from tests.core_models import Classifier, batches, make_data, quiet

DATA = batches(*make_data(64), 16)  # 4 steps per epoch
STALL_S = 15.0  # the longest a stalled test tracker blocks (then it lets go, so nothing can hang)


class Recorder(jl.loggers.Logger):
    """Every row as the trainer sent it (called on the training thread): the reference the others must match."""

    def __init__(self):
        self.rows: list[tuple[int | None, dict]] = []

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))


class Stalled(Recorder):
    """A tracker whose writes hang until ``release`` is set (at most STALL_S, then it lets go for good)."""

    background_delivery = True  # as WandbLogger and MLFlowLogger: called from the fan-out's worker thread

    def __init__(self):
        super().__init__()
        self.release = threading.Event()
        self.entered = threading.Event()
        self.timed_out = False
        self.hparams: list[dict] = []

    def log_metrics(self, metrics, step=None):
        self.entered.set()
        if not self.release.wait(STALL_S):
            self.timed_out = True  # the caller waited STALL_S for this call: the stall reached it
            self.release.set()
        super().log_metrics(metrics, step)

    def log_hyperparams(self, params):
        self.hparams.append(dict(params))


class At(jl.Callback):
    """Runs ``fn(trainer)`` once, at the start of train step ``step``."""

    def __init__(self, step, fn):
        self.step, self.fn, self.done = step, fn, False

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.step and not self.done:
            self.done = True
            self.fn(trainer)


def _fit(loggers, callbacks=(), epochs=3):
    trainer = jl.Trainer(
        max_epochs=epochs, devices=1, log_every_n_steps=1, callbacks=list(callbacks), **quiet(logger=loggers)
    )
    trainer.fit(Classifier(lr=0.05), DATA, DATA)
    return trainer


def _delivery_warnings(rec):
    return [str(w.message) for w in rec if issubclass(w.category, LoggerDeliveryWarning)]


def _as_csv(rows):
    """Recorder rows as CSVLogger writes them: {column: float}, with the step."""
    return [{**{k: float(v) for k, v in m.items()}, "step": float(s)} for s, m in rows]


def _csv_rows(path):
    with open(path, newline="") as f:
        return [{k: float(v) for k, v in r.items() if v not in ("", None)} for r in csv.DictReader(f)]


def _same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for k in g:
            assert g[k] == pytest.approx(w[k], rel=1e-6, nan_ok=True), k


# ---------------------------------------------------------------------------------------------- CSV
@pytest.mark.parametrize("what", ["file", "directory"])
def test_csv_deleted_mid_run_is_recreated_with_header_and_later_rows(tmp_path, what):
    """metrics.csv (or its whole version directory) deleted at step 6: the next write creates it again with
    the header, hparams.yaml and every row not yet written, and one warning says how many rows went with it.
    (Before: every later write failed on the missing file and the rest of the run was lost.)"""
    csv_logger = jl.loggers.CSVLogger(tmp_path, flush_logs_every_n_steps=2)
    rec_logger = Recorder()

    def delete(trainer):
        assert os.path.isfile(csv_logger.metrics_file_path)  # rows were written before
        if what == "file":
            os.remove(csv_logger.metrics_file_path)
        else:
            shutil.rmtree(csv_logger.log_dir)

    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        trainer = _fit([csv_logger, rec_logger], [At(6, delete)])
    assert trainer.global_step == 3 * len(DATA)
    msgs = _delivery_warnings(rec)
    assert len(msgs) == 1, msgs
    assert f"CSVLogger: {csv_logger.metrics_file_path} was deleted during the run" in msgs[0]
    written_before = int(re.search(r"The (\d+) row\(s\) written before", msgs[0]).group(1))
    assert 0 < written_before < len(rec_logger.rows)
    want = _as_csv(rec_logger.rows)
    with open(csv_logger.metrics_file_path, newline="") as f:
        header = next(csv.reader(f))
    assert set(header) == {k for r in want for k in r}  # the whole header, not only the later rows' keys
    got = _csv_rows(csv_logger.metrics_file_path)
    _same(got, want[written_before:])  # every row not yet written when the file went, in order
    assert got[-1]["step"] == want[-1]["step"] and min(r["step"] for r in got) <= 6
    assert os.path.isfile(os.path.join(csv_logger.log_dir, "hparams.yaml"))
    assert undelivered(csv_logger) == 0


# ---------------------------------------------------------------------------------------------- W&B
def test_wandb_offline_run_dir_deleted_mid_run_continues_in_a_new_session(tmp_path):
    """The offline run's directory deleted at step 6: wandb itself goes on writing into the deleted file, so
    everything after was lost without a word. Now the logger notices at its next call, warns once, and
    continues the same run id in a new offline session that holds every later row and the config."""
    pytest.importorskip("wandb")
    from tests.test_loggers_wandb import read_run

    save = tmp_path / "wb"
    wb = jl.loggers.WandbLogger(project="jaxlight-test", save_dir=str(save), offline=True)
    rec_logger = Recorder()
    first: dict = {}

    def delete(trainer):
        first["file"] = wb.experiment.settings.sync_file
        shutil.rmtree(save / "wandb")

    try:
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            trainer = _fit([rec_logger, wb], [At(6, delete)])
        assert trainer.global_step == 3 * len(DATA)
        msgs = _delivery_warnings(rec)
        assert len(msgs) == 1, msgs
        assert f"the offline run file {first['file']} was deleted during the run" in msgs[0]
        lost = int(re.search(r"with it the (\d+) logging call", msgs[0]).group(1))
        run_id = wb.version
        new_file = wb.experiment.settings.sync_file
    finally:
        if wb._experiment is not None:
            wb.experiment.finish()
    # wandb names an offline run's directory by the second it opened and the run id: a session reopened within
    # the same second as the deleted one is made at the same path again (a flake before this was allowed)
    assert os.path.isfile(new_file) and (new_file == first["file"] or not os.path.exists(first["file"]))
    rows, config, rid = read_run(new_file)
    assert rid == run_id and config["lr"] == 0.05  # the same run, the config logged again
    want = rec_logger.rows[lost:]
    assert 0 < lost < len(rec_logger.rows) and len(rows) == len(want)
    for got, (step, metrics) in zip(rows, want):
        assert got["trainer/global_step"] == step
        assert all(float(got[k]) == pytest.approx(v, rel=1e-6) for k, v in metrics.items())
    assert undelivered(wb) == 0


# ---------------------------------------------------------------------------------------------- stalls
def test_a_stalled_tracker_never_holds_up_a_training_step(tmp_path):
    """A tracker that hangs from its first call on: training runs to its end while the call is blocked (the
    trainer never waited for it), then finalize delivers every row in order. (Before: each call waited for
    the tracker on the training thread.)"""
    stalled, ref = Stalled(), Recorder()
    seen = {}

    class Release(jl.Callback):
        def on_train_end(self, trainer, module):
            seen.update(rows=len(stalled.rows), entered=stalled.entered.is_set(), timed_out=stalled.timed_out)
            stalled.release.set()

    try:
        trainer = _fit([ref, stalled], [Release()], epochs=2)
    finally:
        stalled.release.set()
    assert trainer.global_step == 2 * len(DATA)
    # at the end of training the tracker was inside its first call, none had returned, none had timed out
    assert seen == {"rows": 0, "entered": True, "timed_out": False}
    assert not stalled.timed_out and stalled.rows == ref.rows and len(ref.rows) > 8
    assert stalled.hparams == [{"lr": 0.05, "dropout": 0.0, "batchnorm": False, "opt": "adam"}]
    assert undelivered(stalled) == 0


def test_full_queue_drops_oldest_metrics_and_finalize_reports_after_its_timeout(monkeypatch):
    """A tracker stuck in a call: calls queue (at most max_pending), the oldest metrics rows are dropped with
    one warning, finalize gives up after finalize_timeout_s and reports every call not delivered; once the
    tracker answers, the queued calls arrive in order and only the dropped ones stay missing."""
    monkeypatch.setattr(LoggerCollection, "max_pending", 5)
    monkeypatch.setattr(LoggerCollection, "finalize_timeout_s", 0.2, raising=False)
    stalled = Stalled()
    fan = LoggerCollection([stalled])
    fan.setup()  # what the trainer does at fit start
    try:
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            t0 = time.monotonic()
            fan.log_hyperparams({"lr": 0.1})
            fan.log_metrics({"x": 0.0}, step=0)
            assert stalled.entered.wait(STALL_S)  # the tracker is now stuck in the step-0 call
            for i in range(1, 20):
                fan.log_metrics({"x": float(i)}, step=i)
            calls_s = time.monotonic() - t0
            lost = fan.finalize("success")
            total_s = time.monotonic() - t0
        assert not stalled.timed_out  # no call waited for the stalled tracker
        assert calls_s < STALL_S / 2 and total_s < STALL_S / 2
        msgs = _delivery_warnings(rec)
        assert len(msgs) == 2, msgs
        assert "Stalled has 5 logging calls waiting" in msgs[0] and "dropping the oldest" in msgs[0]
        assert msgs[1].startswith("Stalled: 20 logging call(s) not delivered: the logger did not finish within ")
        assert "finalize_timeout_s=0.2 s (busy in log_metrics" in msgs[1]
        assert "6 log_metrics, 14 dropped past the limit of 5" in msgs[1]
        assert lost == {"Stalled": 20} and undelivered(stalled) == 20
    finally:
        stalled.release.set()
    monkeypatch.setattr(LoggerCollection, "finalize_timeout_s", STALL_S, raising=False)
    with pytest.warns(LoggerDeliveryWarning, match=r"could not be delivered \(none kept, 14 dropped"):
        assert fan.finalize("success") == {"Stalled": 14}
    # the call in flight, then the newest five: the oldest metrics rows were the ones dropped
    assert [s for s, _ in stalled.rows] == [0, 15, 16, 17, 18, 19]
    assert stalled.hparams == [{"lr": 0.1}]


# ---------------------------------------------------------------------------------------------- MLflow
def test_mlflow_database_locked_does_not_hold_up_steps(tmp_path, monkeypatch):
    """Another process holds the MLflow SQLite database (BEGIN EXCLUSIVE); MLflow waits up to 20 s for it in
    each call. The steps go on (the calls wait on the logger's worker), a warning says the tracker is stuck,
    finalize gives up after its timeout with a report; once the lock is gone every row lands, in order."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setattr(LoggerCollection, "finalize_timeout_s", 0.5, raising=False)
    monkeypatch.setattr(LoggerCollection, "stall_warn_s", 0.2, raising=False)
    db = tmp_path / "mlflow.db"
    ml = jl.loggers.MLFlowLogger(experiment_name="locked", tracking_uri=f"sqlite:///{db}")
    fan = LoggerCollection([ml])
    fan.setup()  # creates the store and the run, as at fit start
    lock = sqlite3.connect(str(db), isolation_level=None, timeout=5.0)
    lock.execute("BEGIN EXCLUSIVE")
    try:
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            t0 = time.monotonic()
            for step in range(25):
                fan.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
                time.sleep(0.02)  # the training step
            loop_s = time.monotonic() - t0
            t1 = time.monotonic()
            lost = fan.finalize("success")
            finalize_s = time.monotonic() - t1
        # one blocked MLflow call takes 20 s: the loop (0.5 s of steps) and finalize (0.5 s) did not wait for it
        assert loop_s < 10.0 and finalize_s < 10.0, (loop_s, finalize_s)
        msgs = _delivery_warnings(rec)
        assert any("MLFlowLogger has been busy in log_metrics" in m for m in msgs), msgs
        report = [m for m in msgs if m.startswith("MLFlowLogger: 25 logging call(s) not delivered")]
        assert len(report) == 1 and "finalize_timeout_s=0.5 s" in report[0], msgs
        assert lost == {"MLFlowLogger": 25}
    finally:
        lock.execute("COMMIT")
        lock.close()
    monkeypatch.setattr(LoggerCollection, "finalize_timeout_s", 60.0, raising=False)
    assert fan.finalize("success") == {}  # the lock is gone: everything queued is delivered
    reader = MlflowClient(f"sqlite:///{db}")
    history = reader.get_metric_history(ml.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(25))
    assert all(m.value == pytest.approx(1.0 / (m.step + 1)) for m in history)
    assert reader.get_run(ml.run_id).info.status == "FINISHED"
