"""MLFlowLogger against a real SQLite store: the run's metric history equals what CSVLogger wrote."""

import math

import pytest

import jaxlight as jl
from tests.core_models import Classifier, batches, csv_history, make_data, quiet

mlflow = pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402

DATA = batches(*make_data(64), 16)


@pytest.fixture(scope="module")
def uri(tmp_path_factory):
    """One SQLite store for the module (creating its tables takes seconds); each test uses its own experiment."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


class NaNAtEpoch1(Classifier):
    def on_train_epoch_end(self):
        self.log("odd", float("nan") if self.current_epoch == 1 else 1.0 * self.current_epoch)


def same(a, b):
    return len(a) == len(b) and all(
        s1 == s2 and (v1 == v2 or (math.isnan(v1) and math.isnan(v2))) for (s1, v1), (s2, v2) in zip(a, b)
    )


def test_mlflow_history_equals_csv_and_resume_keeps_the_run(tmp_path, uri):
    csv_logger = jl.loggers.CSVLogger("logs")
    ml = jl.loggers.MLFlowLogger(
        experiment_name="exp", run_name="first", tracking_uri=uri, artifact_location=str(tmp_path / "artifacts")
    )
    ckpt = jl.callbacks.ModelCheckpoint(dirpath="ckpt", save_last=True)
    trainer = jl.Trainer(
        max_epochs=2,
        devices=1,
        log_every_n_steps=2,
        callbacks=[ckpt],
        **quiet(logger=[csv_logger, ml], enable_checkpointing=True),
    )
    model = NaNAtEpoch1(lr=0.02)
    trainer.fit(model, DATA, DATA)

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(ml.run_id)
    assert run.info.run_name == "first" and run.info.status == "FINISHED"
    assert run.data.params == {k: str(v) for k, v in model.hparams.items()} and run.data.params["lr"] == "0.02"
    want = csv_history(csv_logger.metrics_file_path)
    assert {"train_loss", "val_acc", "odd", "epoch"} <= set(want)
    for name, hist in want.items():
        got = [(m.step, m.value) for m in client.get_metric_history(ml.run_id, name)]
        assert same(sorted(got), sorted(hist)), name
    assert any(math.isnan(v) for _, v in want["odd"])  # the NaN reached MLflow as NaN

    # resume from the checkpoint with fresh loggers: the MLflow one continues the same run
    ml2 = jl.loggers.MLFlowLogger(experiment_name="exp", tracking_uri=uri)
    trainer2 = jl.Trainer(
        max_epochs=3,
        devices=1,
        log_every_n_steps=2,
        callbacks=[jl.callbacks.ModelCheckpoint(dirpath="ckpt", save_last=True)],
        **quiet(logger=[jl.loggers.CSVLogger("logs"), ml2], enable_checkpointing=True),
    )
    trainer2.fit(NaNAtEpoch1(lr=0.02), DATA, DATA, ckpt_path="last")
    assert ml2.run_id == ml.run_id
    runs = client.search_runs([ml.experiment_id])
    assert len(runs) == 1
    steps = [m.step for m in client.get_metric_history(ml.run_id, "val_acc")]
    assert steps == sorted(steps) and len(steps) == 3  # epochs 0, 1 then 2 after the resume


def test_changed_hyperparameter_is_refused(uri):
    ml = jl.loggers.MLFlowLogger(experiment_name="hp", tracking_uri=uri)
    ml.log_hyperparams({"lr": 0.1, "nested": {"depth": 2}})
    ml.log_hyperparams({"lr": 0.1})  # same value again: logged once, no error
    assert MlflowClient(tracking_uri=uri).get_run(ml.run_id).data.params == {"lr": "0.1", "nested/depth": "2"}
    with pytest.raises(ValueError, match="lr"):
        ml.log_hyperparams({"lr": 0.2})
