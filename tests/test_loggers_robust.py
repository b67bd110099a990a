"""Trackers that never lose a run: a tracker failing mid-run is warned about once, its calls are kept and retried,
training and the other loggers go on, finalize reports what could not be delivered; a misconfigured tracker
fails at fit start, before anything is compiled; MLflow defaults to an SQLite store under save_dir."""

from __future__ import annotations

import csv
import errno
import math
import os
import warnings

import pytest

import jaxlight as jl
from jaxlight.loggers import LoggerCollection, LoggerDeliveryWarning
from jaxlight.loggers.logger import undelivered
from tests.core_models import Classifier, batches, csv_history, make_data, quiet

DATA = batches(*make_data(64), 16)  # 4 steps per epoch
EPOCHS = 3


class Flaky(jl.loggers.Logger):
    """A tracker whose server is gone while ``down`` says so: every call raises ConnectionError then."""

    def __init__(self, down=lambda step: False):
        self.down = down
        self.rows: list[tuple[int | None, dict]] = []
        self.hparams: list[dict] = []
        self.attempts = 0
        self.step = 0

    def log_metrics(self, metrics, step=None):
        self.attempts += 1
        if self.down(self.step):
            raise ConnectionError("tracking server unreachable")
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, params):
        self.hparams.append(dict(params))


class Clock(jl.Callback):
    """Tells the flaky tracker the trainer's current step (its outage is scripted by step)."""

    def __init__(self, flaky):
        self.flaky = flaky

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.flaky.step = trainer.global_step


def _fit(loggers, callbacks=()):
    trainer = jl.Trainer(
        max_epochs=EPOCHS, devices=1, log_every_n_steps=1, callbacks=list(callbacks), **quiet(logger=loggers)
    )
    trainer.fit(Classifier(lr=0.05), DATA, DATA)
    return trainer


def _csv_rows(path):
    with open(path, newline="") as f:
        return [{k: float(v) for k, v in r.items() if v not in ("", None)} for r in csv.DictReader(f)]


def _same_rows(flaky_rows, csv_rows):
    got = [{**m, "step": float(s)} for s, m in flaky_rows]
    assert len(got) == len(csv_rows)
    for g, w in zip(got, csv_rows):
        assert g.keys() == w.keys()
        for k in g:
            assert g[k] == pytest.approx(w[k], rel=1e-6, nan_ok=True), k


def test_outage_mid_run_is_warned_once_and_every_row_arrives_later(tmp_path, monkeypatch):
    monkeypatch.setattr(LoggerCollection, "retry_min_s", 0.0)  # retry at the next call (no back-off wait)
    flaky = Flaky(down=lambda step: 3 <= step < 7)  # the server is gone for steps 3..6
    csv_logger = jl.loggers.CSVLogger(tmp_path)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        trainer = _fit([csv_logger, flaky], [Clock(flaky)])
    assert trainer.global_step == EPOCHS * len(DATA)  # training went on
    outage = [w for w in rec if issubclass(w.category, LoggerDeliveryWarning)]
    assert len(outage) == 1 and "Flaky failed in log_metrics (ConnectionError" in str(outage[0].message)
    # the CSV logger got every row as it came; the flaky one got the same rows, in order, once it was back
    want = _csv_rows(csv_logger.metrics_file_path)
    assert len(want) > 10
    _same_rows(flaky.rows, want)
    assert undelivered(flaky) == 0 and flaky.hparams == [
        {"lr": 0.05, "dropout": 0.0, "batchnorm": False, "opt": "adam"}
    ]


def test_tracker_that_never_comes_back_is_reported_at_finalize(tmp_path, monkeypatch):
    monkeypatch.setattr(LoggerCollection, "retry_min_s", 3600.0)  # a dead server is tried once per hour
    monkeypatch.setattr(LoggerCollection, "max_pending", 5)
    flaky = Flaky(down=lambda step: step >= 2)
    csv_logger = jl.loggers.CSVLogger(tmp_path)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _fit([csv_logger, flaky], [Clock(flaky)])
    msgs = [str(w.message) for w in rec if issubclass(w.category, LoggerDeliveryWarning)]
    want = _csv_rows(csv_logger.metrics_file_path)
    delivered = len(flaky.rows)
    lost = len(want) - delivered
    assert lost > 5
    # one warning at the failure, one when the kept calls hit the limit, one report at the end
    assert len(msgs) == 3, msgs
    assert msgs[0].startswith("Flaky failed in log_metrics (ConnectionError: tracking server unreachable)")
    assert "dropping the oldest" in msgs[1]
    assert msgs[2].startswith(f"Flaky: {lost} logging call(s) could not be delivered (5 log_metrics, ")
    assert f"{lost - 5} dropped past the limit of 5" in msgs[2] and "tracking server unreachable" in msgs[2]
    assert undelivered(flaky) == lost
    # back-off: the dead server was tried at the first failure and once more at finalize, not at every step
    assert flaky.attempts == delivered + 2
    _same_rows(flaky.rows, want[:delivered])


def test_finalize_returns_what_was_not_delivered(monkeypatch):
    monkeypatch.setattr(LoggerCollection, "retry_min_s", 0.0)
    good, bad = Flaky(), Flaky(down=lambda step: True)
    fan = LoggerCollection([good, bad])
    with pytest.warns(LoggerDeliveryWarning):
        for i in range(3):
            fan.log_metrics({"x": float(i)}, step=i)
        assert fan.finalize("success") == {"Flaky": 3}
    assert [s for s, _ in good.rows] == [0, 1, 2]


def test_csv_disk_full_writes_every_row_once(tmp_path, monkeypatch):
    """A failing write (ENOSPC mid-append) leaves no half row; the rows are written once the disk has room."""
    monkeypatch.setattr(LoggerCollection, "retry_min_s", 0.0)
    csv_logger = jl.loggers.CSVLogger(tmp_path, flush_logs_every_n_steps=1)
    full = {"on": False}
    real = csv.DictWriter

    class FillsUp(real):
        def writerows(self, rows):
            if full["on"]:
                self.writerow(rows[0])
                self.writer.writerow(["partial"])  # bytes reach the file before the disk fills up
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().writerows(rows)

    monkeypatch.setattr(jl.loggers.csv_logs.csv, "DictWriter", FillsUp)
    fan = LoggerCollection([csv_logger])
    with pytest.warns(LoggerDeliveryWarning, match="No space left on device"):
        for step in range(8):
            full["on"] = step in (3, 4, 5)
            fan.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
    fan.finalize("success")
    rows = _csv_rows(csv_logger.metrics_file_path)
    assert [r["step"] for r in rows] == list(range(8))
    assert [r["loss"] for r in rows] == pytest.approx([1.0 / (s + 1) for s in range(8)])
    with open(csv_logger.metrics_file_path) as f:
        assert "partial" not in f.read()


class NeverRuns(Classifier):
    def configure_model(self):
        raise AssertionError("the model was set up although a logger is misconfigured")


def test_misconfigured_trackers_fail_at_fit_start(tmp_path, monkeypatch):
    """The trainer creates every logger's run when fit starts: a misconfigured tracker fails before the model
    is set up or anything compiles (NeverRuns would raise if configure_model ran)."""
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    t = jl.Trainer(max_epochs=1, devices=1, **quiet(logger=[jl.loggers.CSVLogger(not_a_dir)]))
    with pytest.raises(NotADirectoryError):
        t.fit(NeverRuns(), DATA)
    assert t.train_state is None and not t.compile_counts
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    bad = jl.loggers.MLFlowLogger(tracking_uri=f"file:{tmp_path / 'mlruns'}")  # MLflow 3 refuses file stores
    t = jl.Trainer(max_epochs=1, devices=1, **quiet(logger=[bad]))
    with pytest.raises(mlflow.exceptions.MlflowException, match="sqlite"):
        t.fit(NeverRuns(), DATA)
    assert t.train_state is None


def test_mlflow_defaults_to_sqlite_under_save_dir_and_survives_an_outage(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(LoggerCollection, "retry_min_s", 0.0)
    save_dir = tmp_path / "mlruns"
    ml = jl.loggers.MLFlowLogger(experiment_name="robust", save_dir=str(save_dir))
    assert ml.save_dir == str(save_dir)
    csv_logger = jl.loggers.CSVLogger(tmp_path / "csv")
    ml.setup()
    client = ml.experiment
    real = client.log_batch
    clock = {"step": 0}

    def log_batch(run_id, metrics=(), params=(), tags=()):
        if 2 <= clock["step"] < 5 and metrics:
            raise ConnectionError("MLflow server gone")
        return real(run_id, metrics=metrics, params=params, tags=tags)

    monkeypatch.setattr(client, "log_batch", log_batch)

    class Tick(jl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            clock["step"] = trainer.global_step

    with pytest.warns(LoggerDeliveryWarning, match="MLFlowLogger failed in log_metrics"):
        _fit([csv_logger, ml], [Tick()])
    assert os.path.isfile(save_dir / "mlflow.db")
    reader = MlflowClient(f"sqlite:///{save_dir}/mlflow.db")
    assert reader.get_run(ml.run_id).info.status == "FINISHED"
    for name, hist in csv_history(csv_logger.metrics_file_path).items():
        got = sorted((m.step, m.value) for m in reader.get_metric_history(ml.run_id, name))
        assert [s for s, _ in got] == [s for s, _ in sorted(hist)], name
        for (_, a), (_, b) in zip(got, sorted(hist)):
            assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6), name
    assert undelivered(ml) == 0
