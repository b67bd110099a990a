"""Adversary round fault (item 6 of the issue): a TensorBoard log directory or a local MLflow store deleted
during the run lost every later metric (TensorBoard's writer appended into nothing; MLflow's pooled SQLite
connections failed with "attempt to write a readonly database" on every call, tracebacks included, until after
fit). Now TensorBoard opens a new event file in the recreated directory and MLflow recreates its store and goes
on in a new run tagged with the old one's id; each says so once, naming the directory.

The directory is deleted at the start of step 6 of 12 (every step logged), after the loggers' queues drained,
so no call is in flight while the files go.
"""

from __future__ import annotations

import shutil
import time
import warnings

import pytest

import jaxlight as jl
from jaxlight.loggers import LoggerDeliveryWarning
from jaxlight.loggers.logger import undelivered
from tests.test_adversary_loggers import DATA, At, Recorder, _fit

DELETE_AT = 6
RESUMED_FROM_TAG = "jaxlight.resumed_from_run_id"  # the documented tag on MLflow's new run


def _drained(logger: jl.loggers.Logger, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while undelivered(logger) and time.monotonic() < end:
        time.sleep(0.01)


def _notices(rec) -> list[str]:
    return [str(w.message) for w in rec if issubclass(w.category, LoggerDeliveryWarning)]


def _later_steps(recorder: Recorder, key: str) -> list[int]:
    return sorted({s for s, m in recorder.rows if key in m and s is not None and s >= DELETE_AT})


def test_tensorboard_log_dir_deleted_mid_run_gets_a_new_event_file(tmp_path, capfd):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = jl.loggers.TensorBoardLogger(save_dir=str(tmp_path), name="tb")
    reference = Recorder()

    def delete(trainer):
        _drained(tb)
        shutil.rmtree(tb.log_dir)

    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        trainer = _fit([reference, tb], [At(DELETE_AT, delete)])
    assert trainer.global_step == 3 * len(DATA)
    msgs = [m for m in _notices(rec) if "TensorBoardLogger" in m]
    assert len(msgs) == 1, _notices(rec)
    assert f"the log directory {tb.log_dir} was deleted during the run" in msgs[0]
    assert "hparams.yaml and the hyperparameters are written again" in msgs[0]

    acc = EventAccumulator(tb.log_dir)
    acc.Reload()
    want = _later_steps(reference, "train_loss")
    assert want and want[0] == DELETE_AT
    got = {e.step: e.value for e in acc.Scalars("train_loss")}
    assert sorted(got) == want
    for step, metrics in reference.rows:
        if step in got and "train_loss" in metrics:
            assert got[step] == pytest.approx(float(metrics["train_loss"]), rel=1e-6)
    assert "lr: 0.05" in (tmp_path / "tb" / "version_0" / "hparams.yaml").read_text()
    assert undelivered(tb) == 0
    assert "Traceback" not in capfd.readouterr().err


def test_mlflow_store_deleted_mid_run_goes_on_in_a_new_linked_run(tmp_path, capfd):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    save = tmp_path / "ml"
    ml = jl.loggers.MLFlowLogger(experiment_name="deleted", run_name="r1", save_dir=str(save), tags={"team": "a"})
    reference = Recorder()
    first: dict = {}

    def delete(trainer):
        _drained(ml)
        first["run"] = ml.run_id
        shutil.rmtree(save)

    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        trainer = _fit([reference, ml], [At(DELETE_AT, delete)])
    assert trainer.global_step == 3 * len(DATA)
    old = first["run"]
    msgs = [m for m in _notices(rec) if "MLFlowLogger" in m]
    assert len(msgs) == 1, _notices(rec)
    assert f"the tracking store {save / 'mlflow.db'} was deleted during the run" in msgs[0]
    assert f"{RESUMED_FROM_TAG}={old}" in msgs[0]

    client = MlflowClient(f"sqlite:///{save / 'mlflow.db'}")
    exp = client.get_experiment_by_name("deleted")
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`{RESUMED_FROM_TAG}` = '{old}'")
    assert len(runs) == 1
    new = runs[0]
    assert new.info.run_id == ml.run_id != old
    assert new.info.status == "FINISHED" and new.info.run_name == "r1"
    assert new.data.tags["team"] == "a" and new.data.params["lr"] == "0.05"
    history = {m.step: m.value for m in client.get_metric_history(new.info.run_id, "train_loss")}
    want = _later_steps(reference, "train_loss")
    assert want and sorted(history) == want
    for step, metrics in reference.rows:
        if step in history and "train_loss" in metrics:
            assert history[step] == pytest.approx(float(metrics["train_loss"]), rel=1e-6)
    assert undelivered(ml) == 0
    assert "Traceback" not in capfd.readouterr().err
