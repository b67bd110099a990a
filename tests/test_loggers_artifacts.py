"""Text and image artifacts through the logger fan-out, read back from every backend's own storage."""

from __future__ import annotations

import csv
import glob
import io
import json
import os

import numpy as np
import pytest

import jaxlight as jl
from jaxlight.loggers import LoggerCollection
from tests.core_models import Classifier, batches, make_data, quiet

PIL = pytest.importorskip("PIL.Image")

TEXT = "def f(x):\n    return x  # a | pipe, ünïcode"
COLUMNS = ["prompt", "completion"]
ROWS = [["a", "b|c"], ["d\ne", "f"]]
STEP = 7


def _images():
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, size=(5, 6, 3), dtype=np.uint8)
    gray = rng.random(size=(4, 3)).astype(np.float32)  # floats in [0, 1]
    return [rgb, gray], [rgb, np.round(gray * 255).astype(np.uint8)[:, :, None]]


def _read(path, mode="r"):
    with open(path, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
        return f.read()


def _decode(png: bytes) -> np.ndarray:
    arr = np.asarray(PIL.open(io.BytesIO(png)))
    return arr[:, :, None] if arr.ndim == 2 else arr


def _log_all(loggers):
    images, want = _images()
    fan = LoggerCollection(loggers)
    fan.log_text("samples/gen", TEXT, step=STEP)
    fan.log_text("table", columns=COLUMNS, data=ROWS, step=STEP)
    fan.log_image("inputs", images, step=STEP, caption=["rgb", "gray"])
    return want


def test_csv_and_tensorboard_store_text_and_images(tmp_path):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    csv_logger = jl.loggers.CSVLogger(tmp_path / "csv")
    tb = jl.loggers.TensorBoardLogger(tmp_path / "tb")
    want = _log_all([csv_logger, tb])
    tb.finalize("success")

    # CSV: files beside metrics.csv, indexed by artifacts.csv
    d = csv_logger.log_dir
    assert _read(os.path.join(d, "text", "samples", "gen", f"step={STEP}.txt")) == TEXT
    with open(os.path.join(d, "text", "table", f"step={STEP}.csv"), newline="", encoding="utf-8") as f:
        assert list(csv.reader(f)) == [COLUMNS, *ROWS]
    for i, arr in enumerate(want):
        with open(os.path.join(d, "images", "inputs", f"step={STEP}-{i}.png"), "rb") as f:
            np.testing.assert_array_equal(_decode(f.read()), arr)
    with open(csv_logger.artifacts_file_path, newline="", encoding="utf-8") as f:
        index = list(csv.DictReader(f))
    assert [(r["step"], r["key"], r["kind"], r["caption"]) for r in index] == [
        (str(STEP), "samples/gen", "text", ""),
        (str(STEP), "table", "text", ""),
        (str(STEP), "inputs", "image", "rgb"),
        (str(STEP), "inputs", "image", "gray"),
    ]
    assert all(os.path.exists(os.path.join(d, r["path"])) for r in index)

    # TensorBoard: the Text and Images tabs' own records
    acc = accumulator.EventAccumulator(tb.log_dir, size_guidance={"tensors": 0, "images": 0})
    acc.Reload()
    texts = {t: acc.Tensors(t)[0] for t in ("samples/gen", "table")}
    assert texts["samples/gen"].step == STEP
    assert texts["samples/gen"].tensor_proto.string_val[0].decode("utf-8") == TEXT
    table = texts["table"].tensor_proto.string_val[0].decode("utf-8").splitlines()
    assert table == ["| prompt | completion |", "|---|---|", "| a | b\\|c |", "| d e | f |"]
    for i, arr in enumerate(want):
        (ev,) = acc.Images(f"inputs/{i}")
        assert ev.step == STEP and (ev.height, ev.width) == arr.shape[:2]
        np.testing.assert_array_equal(_decode(ev.encoded_image_string), arr)


def test_wandb_offline_stores_tables_and_images(tmp_path):
    pytest.importorskip("wandb")
    from tests.test_loggers_wandb import read_run

    wb = jl.loggers.WandbLogger(project="jaxlight-test", save_dir=str(tmp_path), offline=True)
    want = _log_all([wb])
    files = wb.experiment.dir  # .../wandb/offline-run-*/files
    run_id = wb.version
    wb.experiment.finish()
    (record,) = glob.glob(os.path.join(os.path.dirname(files), f"run-{run_id}.wandb"))
    rows, _, _ = read_run(record)
    # each call is one history row at the trainer's step, pointing at the media files wandb wrote
    # (read_run joins nested keys with "/": "table/path" is the "path" of the value logged as "table")
    row = {k: next(r for r in rows if f"{k}/_type" in r) for k in ("samples/gen", "table", "inputs")}
    assert {k: r["trainer/global_step"] for k, r in row.items()} == dict.fromkeys(row, STEP)
    with open(os.path.join(files, row["samples/gen"]["samples/gen/path"])) as f:
        assert json.load(f) == {"columns": ["text"], "data": [[TEXT]]}
    with open(os.path.join(files, row["table"]["table/path"])) as f:
        assert json.load(f) == {"columns": COLUMNS, "data": ROWS}
    images = row["inputs"]
    assert images["inputs/captions"] == ["rgb", "gray"]
    for name, arr in zip(images["inputs/filenames"], want, strict=True):
        got = _decode(_read(os.path.join(files, name), "rb"))
        np.testing.assert_array_equal(got[:, :, :1] if arr.shape[-1] == 1 and got.ndim == 3 else got, arr)


def test_mlflow_stores_text_tables_and_stepped_images(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    ml = jl.loggers.MLFlowLogger(experiment_name="artifacts", save_dir=str(tmp_path / "mlruns"))
    want = _log_all([ml])
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlruns'}/mlflow.db")  # the default store under save_dir
    out = tmp_path / "download"
    text = client.download_artifacts(ml.run_id, f"text/samples/gen/step={STEP}.txt", str(out))
    assert _read(text) == TEXT
    table = client.download_artifacts(ml.run_id, f"text/table/step={STEP}.csv", str(out))
    with open(table, newline="", encoding="utf-8") as f:
        assert list(csv.reader(f)) == [COLUMNS, *ROWS]
    # the artifacts live under save_dir (the default store's artifact location)
    stored = glob.glob(str(tmp_path / "mlruns" / "artifacts" / "**" / f"step={STEP}.txt"), recursive=True)
    assert [_read(p) for p in stored] == [TEXT]
    names = [a.path for a in client.list_artifacts(ml.run_id, "images")]
    for i, arr in enumerate(want):
        (name,) = [n for n in names if n.startswith(f"images/inputs_{i}+step+{STEP}+") and n.endswith(".png")]
        with open(client.download_artifacts(ml.run_id, name, str(out)), "rb") as f:
            got = _decode(f.read())
        np.testing.assert_array_equal(got[:, :, 0] if arr.shape[-1] == 1 and got.shape[-1] != 1 else got, arr)


def test_bad_artifacts_are_refused_before_any_logger_gets_them(tmp_path):
    csv_logger = jl.loggers.CSVLogger(tmp_path)
    fan = LoggerCollection([csv_logger])
    with pytest.raises(ValueError, match="either text= or columns= with data="):
        fan.log_text("k", "x", columns=["a"], data=[["b"]])
    with pytest.raises(ValueError, match=r"rows \[1\] do not have 2 cells"):
        fan.log_text("k", columns=["a", "b"], data=[["1", "2"], ["3"]])
    with pytest.raises(ValueError, match=r"got shape \(2, 3, 5\)"):
        fan.log_image("k", [np.zeros((2, 3, 5))])
    with pytest.raises(ValueError, match=r"values in \[0, 255\], got \[0, 300\]"):
        fan.log_image("k", [np.array([[0, 300]])])
    with pytest.raises(TypeError, match="list of images"):
        fan.log_image("k", np.zeros((2, 2)))
    with pytest.raises(ValueError, match="one entry per image"):
        fan.log_image("k", [np.zeros((2, 2))], caption=["a", "b"])
    with pytest.raises(ValueError, match="'..' parts"):
        fan.log_text("../escape", "x")
    assert not os.path.exists(csv_logger.log_dir)  # nothing was written
    from jaxlight.loggers.logger import undelivered

    assert undelivered(csv_logger) == 0  # argument errors are not kept for a retry


class Plain(jl.loggers.Logger):
    def __init__(self):
        self.rows = []

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))


class SampleEachValidation(jl.Callback):
    """What examples/gpt.py does: a text sample and an image per validation, through the trainer's loggers."""

    def on_validation_epoch_end(self, trainer, module):
        fan = LoggerCollection(trainer.loggers)
        fan.log_text("sample", f"epoch {trainer.current_epoch}", step=trainer.global_step)
        fan.log_image("weights", [np.asarray(module.net.l1.kernel[...]) * 0 + 0.5], step=trainer.global_step)


def test_artifacts_from_a_hook_during_fit_and_loggers_without_artifacts(tmp_path):
    csv_logger = jl.loggers.CSVLogger(tmp_path)
    plain = Plain()
    trainer = jl.Trainer(
        max_epochs=2, devices=1, callbacks=[SampleEachValidation()], **quiet(logger=[csv_logger, plain])
    )
    with pytest.warns(UserWarning, match="Plain does not implement log_") as rec:
        trainer.fit(Classifier(), batches(*make_data(32), 16), batches(*make_data(16), 16))
    for method in ("log_text", "log_image"):  # once each, not per call
        assert sum(f"does not implement {method}" in str(w.message) for w in rec) == 1
    texts = sorted(glob.glob(os.path.join(csv_logger.log_dir, "text", "sample", "step=*.txt")))
    assert [_read(p) for p in texts] == ["epoch 0", "epoch 1"]
    steps = sorted(int(os.path.basename(p)[5:-4]) for p in texts)
    assert steps == [2, 4]  # global step at each validation
    pngs = glob.glob(os.path.join(csv_logger.log_dir, "images", "weights", "*.png"))
    assert len(pngs) == 2 and np.all(_decode(_read(pngs[0], "rb")) == 128)
    assert plain.rows  # the metrics still reached the logger without artifact support
