"""The four stages a Trainer runs, as one table.

Everything that differs between train, validate, test and predict (the step
method, the hook prefix, the loader method, the batch limit, the batch count
attribute, the ``trainer.validating``-style flag and the Trainer attribute
holding the stage's loaders) is read from here, so the
loops, the engine and the step builder never carry per-stage dict literals.
"""

from __future__ import annotations

from typing import NamedTuple


class Stage(NamedTuple):
    """What one stage is called in each place Lightning names it."""

    name: str  # "train" | "validate" | "test" | "predict" (compiled-step and metric-store key)
    fn: str  # "fit" | "validate" | "test" | "predict" (the ``setup``/``teardown`` argument)
    hook: str  # "train" | "validation" | "test" | "predict" (``on_{hook}_batch_start`` ...)
    step_method: str  # ``training_step`` ...
    loader_method: str  # ``train_dataloader`` ...
    limit_attr: str  # ``limit_train_batches`` ...
    count_attr: str  # ``num_training_batches`` ...
    flag_attr: str  # ``training`` / ``validating`` ...
    loaders_attr: str  # ``train_dataloader`` / ``val_dataloaders`` ... (the Trainer attribute holding them)
    title: str  # printed above the results table


TRAIN = Stage(
    "train",
    "fit",
    "train",
    "training_step",
    "train_dataloader",
    "limit_train_batches",
    "num_training_batches",
    "training",
    "train_dataloader",
    "Train",
)
VALIDATE = Stage(
    "validate",
    "validate",
    "validation",
    "validation_step",
    "val_dataloader",
    "limit_val_batches",
    "num_val_batches",
    "validating",
    "val_dataloaders",
    "Validate",
)
TEST = Stage(
    "test",
    "test",
    "test",
    "test_step",
    "test_dataloader",
    "limit_test_batches",
    "num_test_batches",
    "testing",
    "test_dataloaders",
    "Test",
)
PREDICT = Stage(
    "predict",
    "predict",
    "predict",
    "predict_step",
    "predict_dataloader",
    "limit_predict_batches",
    "num_predict_batches",
    "predicting",
    "predict_dataloaders",
    "Predict",
)

STAGES: dict[str, Stage] = {s.name: s for s in (TRAIN, VALIDATE, TEST, PREDICT)}
"""Stages by name."""
