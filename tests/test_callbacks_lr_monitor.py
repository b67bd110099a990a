"""LearningRateMonitor logs the schedule's value for each logged optimizer step, under Lightning's name."""

import csv

import numpy as np
import optax
import pytest

import jaxlight as jl
from jaxlight.callbacks import LearningRateMonitor
from tests.core_models import Classifier, batches, make_data, quiet

SCHED = optax.linear_schedule(1.0, 0.0, transition_steps=16)
DATA = batches(*make_data(128), 16)  # 8 batches


class Scheduled(Classifier):
    def __init__(self, kind="schedule", **kw):
        super().__init__(**kw)
        self.kind = kind

    def configure_optimizers(self):
        if self.kind == "schedule":
            return {"optimizer": optax.adam(SCHED), "lr_scheduler": SCHED}
        if self.kind == "sgd":
            return {"optimizer": optax.sgd(SCHED), "lr_scheduler": {"scheduler": SCHED}}
        if self.kind == "inject":
            return optax.inject_hyperparams(optax.adam)(learning_rate=SCHED)
        return optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)


def read_column(path, name):
    with open(path, newline="") as f:
        return [(int(r["step"]), float(r[name])) for r in csv.DictReader(f) if r.get(name)]


@pytest.mark.parametrize("kind,accum", [("schedule", 1), ("schedule", 2)])
def test_logs_schedule_at_the_metric_steps(kind, accum):
    csv_logger = jl.loggers.CSVLogger("logs")
    mon = LearningRateMonitor()
    trainer = jl.Trainer(
        max_epochs=2,
        devices=1,
        log_every_n_steps=2,
        accumulate_grad_batches=accum,
        callbacks=[mon],
        **quiet(logger=csv_logger),
    )
    trainer.fit(Scheduled(kind), DATA)
    n_updates = 2 * len(DATA) // accum
    # Lightning logs at every micro-batch of a logged update (issue 23: it was once per update here)
    steps = [g for g in range(n_updates) if (g + 1) % 2 == 0 for _ in range(accum)]
    want = [float(SCHED(g)) for g in steps]
    assert list(mon.lrs) == ["lr-Adam"]
    np.testing.assert_allclose(mon.lrs["lr-Adam"], want, rtol=1e-6)
    got = read_column(csv_logger.metrics_file_path, "lr-Adam")
    assert [s for s, _ in got] == steps
    np.testing.assert_allclose([v for _, v in got], want, rtol=1e-6)
    # the same steps carry the train loss rows: one step numbering for both
    assert {s for s, _ in read_column(csv_logger.metrics_file_path, "train_loss")} == set(steps)


def test_epoch_interval_and_sgd_name():
    mon = LearningRateMonitor(logging_interval="epoch")
    trainer = jl.Trainer(max_epochs=3, devices=1, callbacks=[mon], **quiet(logger=jl.loggers.CSVLogger("logs")))
    trainer.fit(Scheduled("sgd"), DATA)
    np.testing.assert_allclose(mon.lrs["lr-SGD"], [float(SCHED(e * len(DATA))) for e in range(3)], rtol=1e-6)


def test_inject_hyperparams_reads_the_optimizer_state():
    mon = LearningRateMonitor()
    trainer = jl.Trainer(
        max_epochs=1, devices=1, log_every_n_steps=4, callbacks=[mon], **quiet(logger=jl.loggers.CSVLogger("logs"))
    )
    trainer.fit(Scheduled("inject"), DATA)
    # Lightning's timing and value: logged at the epoch start (before update 0) and at each log_every_n_steps
    # cadence (before updates 3 and 7), the rate the *next* update uses, read from the optimizer's structure
    np.testing.assert_allclose(mon.lrs["lr-Adam"], [float(SCHED(0)), float(SCHED(3)), float(SCHED(7))], rtol=1e-6)


def test_fixed_float_lr_is_read_like_lightning():
    """A fixed float learning rate is logged at each epoch start, as Lightning logs an optimizer without a
    scheduler. It is injected: a rate baked into an optax transform is not in its state and is not read
    (tests/test_optim_inspect.py)."""
    mon = LearningRateMonitor()
    trainer = jl.Trainer(max_epochs=1, devices=1, callbacks=[mon], **quiet(logger=jl.loggers.CSVLogger("logs")))
    trainer.fit(Scheduled("fixed"), DATA)
    assert mon.lrs["lr-Adam"]
    np.testing.assert_allclose(mon.lrs["lr-Adam"], [1e-3] * len(mon.lrs["lr-Adam"]), rtol=1e-7)
