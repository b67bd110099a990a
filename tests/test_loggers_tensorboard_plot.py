"""TensorBoardLogger event files read back with tensorboard; `jaxlight plot` PNGs from a CSVLogger run."""

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import jaxlight as jl
from jaxlight.cli import main as cli_main
from jaxlight.plot import plot_metrics
from tests.core_models import Classifier, batches, csv_history, make_data, quiet

DATA = batches(*make_data(64), 16)


class InfAtEpoch1(Classifier):
    def on_train_epoch_end(self):
        self.log("odd", float("inf") if self.current_epoch == 1 else 0.5)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One fit logging to CSV and TensorBoard, shared by the tests below."""
    root = tmp_path_factory.mktemp("run")
    csv_logger = jl.loggers.CSVLogger(root / "logs")
    tb = jl.loggers.TensorBoardLogger(root / "tb")
    jl.Trainer(max_epochs=2, devices=1, log_every_n_steps=2, **quiet(logger=[csv_logger, tb])).fit(
        InfAtEpoch1(lr=0.05), DATA, DATA
    )
    return root, csv_logger, tb


def test_tensorboard_scalars_equal_csv(run_dir):
    tb_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    _, csv_logger, tb = run_dir
    assert tb.log_dir.endswith("version_0")
    acc = tb_accumulator.EventAccumulator(tb.log_dir)
    acc.Reload()
    want = csv_history(csv_logger.metrics_file_path)
    assert {"train_loss", "val_acc", "odd"} <= set(acc.Tags()["scalars"])
    for name, hist in want.items():
        got = [(e.step, e.value) for e in acc.Scalars(name)]
        assert [s for s, _ in got] == [s for s, _ in hist], name
        np.testing.assert_allclose([v for _, v in got], [v for _, v in hist], rtol=1e-6)
    assert math.isinf(acc.Scalars("odd")[1].value)
    assert "hparams.yaml" in {p.name for p in Path(tb.log_dir).iterdir()}
    assert tb.state_dict() == {"version": 0}


def test_plot_command_writes_one_png_per_metric(run_dir, tmp_path):
    root, csv_logger, _ = run_dir
    assert cli_main(["plot", str(root / "logs"), "--out", str(tmp_path / "png")]) == 0
    pngs = sorted(p.name for p in (tmp_path / "png").glob("*.png"))
    cols = set(csv_history(csv_logger.metrics_file_path)) - {"epoch"}
    assert pngs == sorted(f"{c}.png" for c in cols)
    for p in (tmp_path / "png").glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1000
    # default location: next to the CSV; only the chosen metrics
    out = plot_metrics(csv_logger.metrics_file_path, metrics=["train_loss"])
    assert [p.name for p in out] == ["train_loss.png"] and out[0].parent.name == "plots"
    # the console script points at jaxlight.cli:main, which exits non-zero with a message on a bad path
    # (run through this interpreter: the test must not depend on an activated venv's PATH)
    from importlib.metadata import entry_points

    assert entry_points(group="console_scripts")["jaxlight"].value == "jaxlight.cli:main"
    r = subprocess.run(
        [sys.executable, "-m", "jaxlight.cli", "plot", str(tmp_path / "missing")], capture_output=True, text=True
    )
    assert r.returncode == 2 and "neither a metrics CSV" in r.stderr
    with pytest.raises(ValueError, match="no column"):
        plot_metrics(csv_logger.metrics_file_path, metrics=["nope"])


def test_loggers_import_nothing_heavy():
    code = (
        "import sys, jaxlight; jaxlight.loggers.WandbLogger(project='x'); "
        "jaxlight.loggers.MLFlowLogger(tracking_uri='sqlite:///x.db'); jaxlight.loggers.TensorBoardLogger(); "
        "import jaxlight.plot, jaxlight.cli; "
        "print(sorted(m for m in ('wandb', 'mlflow', 'tensorboard', 'matplotlib', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
