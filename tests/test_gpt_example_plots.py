"""examples/gpt.py ends by writing its loss and validation curves as PNGs and printing their paths."""

from __future__ import annotations

import csv as _csv
import re
from pathlib import Path

import numpy as np
import pytest

from examples.gpt import main, parse_args
from jaxlight import compile_cache

PNG = b"\x89PNG\r\n\x1a\n"


def test_gpt_example_writes_and_prints_its_curves(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.setenv(compile_cache.ENV_DIR, "off")  # a test never writes to the user's cache
    args = parse_args(
        "--d-model 32 --layers 1 --heads 2 --seq-len 16 --batch-size 8 --batches-per-epoch 6 --max-steps 12 "
        f"--val-batches 2 --data-bytes 100000 --log-every-n-steps 2 --sample-bytes 8 --out {tmp_path / 'out'}".split()
    )
    summary = main(args)
    out = capsys.readouterr().out
    csv = Path(re.search(r"^metrics: (.+)$", out, re.M).group(1))
    plots = [Path(p) for p in re.findall(r"^plot: +(.+)$", out, re.M)]
    assert csv.is_file() and out.index("metrics: ") < out.index("plot: ")
    names = sorted(p.name for p in plots)
    assert names == ["train_loss.png", "val_bpb.png", "val_loss.png"], names
    for p in plots:
        assert p.parent == csv.parent / "plots"
        assert p.read_bytes().startswith(PNG)
    import matplotlib.image

    img = matplotlib.image.imread(csv.parent / "plots" / "train_loss.png")
    assert img.shape[:2] == (400, 600) and np.ptp(img[..., :3]) > 0  # a drawn figure, not a blank image
    # the curves have points: a train loss every 2 steps, a validation loss at each of the 2 epoch ends
    with open(csv, newline="") as f:
        rows = list(_csv.DictReader(f))
    assert sum(1 for r in rows if r.get("train_loss")) == 6
    assert sum(1 for r in rows if r.get("val_loss")) == 2
    assert summary["steps"] == 12
