"""WandbLogger in offline mode (no account): the values read back from the run's .wandb file are the logged ones."""

import csv
import glob
import json
import math
import os
import struct
import time

import pytest

import jaxlight as jl
from tests.core_models import Classifier, batches, make_data, quiet

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # noqa: E402

DATA = batches(*make_data(64), 16)


def wandb_records(path):
    """Protobuf records of a .wandb file (LevelDB log format: 32 KiB blocks of checksum, length, type, data)."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", data[:7]
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:  # FULL
            yield chunk
        elif kind == 2:  # FIRST
            pending = chunk
        elif kind == 3:  # MIDDLE
            pending += chunk
        elif kind == 4:  # LAST
            yield pending + chunk
            pending = b""


def complete_records(path, timeout=60.0):
    """The file's records once wandb-core has written the run's exit record (finish() can return before)."""
    deadline = time.monotonic() + timeout
    while True:
        recs = []
        for raw in wandb_records(path):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(raw)
            recs.append(rec)
        if any(r.WhichOneof("record_type") == "exit" for r in recs) or time.monotonic() > deadline:
            return recs
        time.sleep(0.2)


def read_run(path):
    """(history rows as {key: value}, config {key: value}, run id) from a .wandb file."""
    rows, config, run_id = [], {}, None
    for rec in complete_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item})
        elif kind == "config":
            for i in rec.config.update:
                config["/".join(i.nested_key) or i.key] = json.loads(i.value_json)
        elif kind == "run":
            run_id = rec.run.run_id
    return rows, config, run_id


class NaNAtEpoch1(Classifier):
    def on_train_epoch_end(self):
        self.log("odd", float("nan") if self.current_epoch == 1 else float("inf"))


def test_offline_run_holds_what_csv_holds(tmp_path):
    csv_logger = jl.loggers.CSVLogger("logs")
    wb = jl.loggers.WandbLogger(
        project="jaxlight-test", name="offline-run", save_dir=str(tmp_path / "wb"), offline=True
    )
    trainer = jl.Trainer(max_epochs=2, devices=1, log_every_n_steps=2, **quiet(logger=[csv_logger, wb]))
    trainer.fit(NaNAtEpoch1(lr=0.03), DATA, DATA)
    run_id = wb.version
    assert wb.state_dict()["id"] == run_id
    wb.experiment.finish()

    files = glob.glob(str(tmp_path / "wb" / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb"))
    assert len(files) == 1
    rows, config, rid = read_run(files[0])
    assert rid == run_id
    assert config["lr"] == 0.03 and config["dropout"] == 0.0
    # every CSV row (a log_metrics call) appears as one W&B history row with the same step and values
    with open(csv_logger.metrics_file_path, newline="") as f:
        csv_rows = [{k: float(v) for k, v in r.items() if v not in ("", None)} for r in csv.DictReader(f)]
    assert len(rows) == len(csv_rows) > 4
    for got, want in zip(rows, csv_rows):
        assert got["trainer/global_step"] == want.pop("step")
        for k, v in want.items():
            g = float(got[k]) if not isinstance(got[k], str) else float(got[k].replace("Infinity", "inf"))
            assert (math.isnan(v) and math.isnan(g)) or g == pytest.approx(v, rel=1e-6), k
    odd = [r["odd"] for r in rows if "odd" in r]
    assert odd[0] in ("Infinity", float("inf")) and (odd[1] == "NaN" or math.isnan(odd[1]))


def test_resume_continues_the_same_run_id(tmp_path):
    save = str(tmp_path / "wb")
    wb = jl.loggers.WandbLogger(project="jaxlight-test", save_dir=save, offline=True)
    wb.log_metrics({"a": 1.0}, step=0)
    state = wb.state_dict()
    wb.experiment.finish()
    time.sleep(1.1)  # offline run directories are named by the second they start in; keep the two apart
    wb2 = jl.loggers.WandbLogger(project="jaxlight-test", save_dir=save, offline=True)
    wb2.load_state_dict(state)
    wb2.log_metrics({"a": 2.0}, step=1)
    assert wb2.version == state["id"]
    wb2.experiment.finish()
    runs = glob.glob(os.path.join(save, "wandb", f"offline-run-*-{state['id']}", "*.wandb"))
    assert len(runs) == 2  # two sessions of one run id (wandb sync merges them into one run)
    values = sorted(r["a"] for f in runs for r in read_run(f)[0] if "a" in r)
    assert values == [1.0, 2.0]
    with pytest.raises(ValueError, match="cannot switch"):
        wb2.load_state_dict({"id": "someotherid"})
