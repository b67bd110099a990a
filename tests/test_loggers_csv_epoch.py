"""CSVLogger writes Lightning's ``epoch`` column as an integer (issue 23: it was ``0.0``)."""

from __future__ import annotations

import csv

import jaxlight as jl
from tests.core_models import Classifier, batches, make_data, quiet


def test_epoch_column_is_an_integer():
    logger = jl.loggers.CSVLogger("logs")
    trainer = jl.Trainer(max_epochs=2, devices=1, log_every_n_steps=2, **quiet(logger=logger))
    trainer.fit(Classifier(), batches(*make_data(64), 16))
    with open(logger.metrics_file_path, newline="") as f:
        epochs = [r["epoch"] for r in csv.DictReader(f) if r["epoch"]]
    assert epochs and set(epochs) == {"0", "1"}, epochs


def test_only_a_whole_epoch_value_is_rewritten(tmp_path):
    logger = jl.loggers.CSVLogger(str(tmp_path), name="x")
    logger.log_metrics({"epoch": 3.0, "loss": 1.0}, step=0)
    logger.log_metrics({"epoch": 2.5, "loss": 2.0}, step=1)  # a user's own fractional value stays as it is
    logger.save()
    with open(logger.metrics_file_path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["epoch"], r["loss"]) for r in rows] == [("3", "1.0"), ("2.5", "2.0")]
