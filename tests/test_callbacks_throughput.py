"""ThroughputMonitor: FLOPs from the compiled step's cost analysis, consistent rates, tokens from 2-D int batches."""

import csv
import time

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight.callbacks import ThroughputMonitor
from tests.core_models import HID, IN, OUT, Classifier, batches, make_data, quiet


def test_flops_match_cost_analysis_and_rates_agree():
    bs, devices = 32, 8
    data = batches(*make_data(bs * 8), bs)
    mon = ThroughputMonitor(window=4, peak_flops=1e12)
    csv_logger = jl.loggers.CSVLogger("logs")

    class Clock(jl.Callback):  # an independent clock: wall time between finished steps
        def __init__(self):
            self.t = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            jax.block_until_ready(outputs["loss"])
            self.t.append(time.perf_counter())

    clock = Clock()
    trainer = jl.Trainer(
        max_epochs=1, devices=devices, log_every_n_steps=4, callbacks=[mon, clock], **quiet(logger=csv_logger)
    )
    trainer.fit(Classifier(), data)
    cost = trainer.compiled["train"].cost_analysis()
    assert mon.flops_per_step == cost["flops"] > 0
    # XLA's count is for one device's share of the step: at least the matmuls of forward + backward
    # (2 FLOPs per multiply-add; forward, grad wrt inputs and grad wrt weights), and not wildly more
    matmul = 2 * 3 * (bs // devices) * (IN * HID + HID * OUT)
    assert matmul <= mon.flops_per_step <= 4 * matmul, (mon.flops_per_step, matmul)
    m = mon.metrics
    assert m["train/flops_per_step"] == cost["flops"]
    np.testing.assert_allclose(m["train/samples_per_sec"] * m["train/step_time"], bs, rtol=1e-9)
    np.testing.assert_allclose(m["train/device/samples_per_sec"] * devices, m["train/samples_per_sec"], rtol=1e-9)
    np.testing.assert_allclose(m["train/device/flops_per_sec"] * m["train/step_time"], cost["flops"], rtol=1e-9)
    np.testing.assert_allclose(m["train/device/mfu"], m["train/device/flops_per_sec"] / 1e12, rtol=1e-9)
    assert "train/items_per_sec" not in m  # float features: no token count
    # the step time is a real duration: the clock's mean interval over the same last 4 steps, within a loose
    # factor (a consistency check on a shared machine, not a speed target)
    measured = (clock.t[-1] - clock.t[-5]) / 4
    assert 0.25 <= m["train/step_time"] / measured <= 4, (m["train/step_time"], measured)
    with open(csv_logger.metrics_file_path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/samples_per_sec")]
    assert [int(r["step"]) for r in rows] == [3, 7]


class TokenModel(jl.LightningModule):
    def configure_model(self):
        self.emb = nnx.Embed(32, 8, rngs=nnx.Rngs(0))
        self.head = nnx.Linear(8, OUT, rngs=nnx.Rngs(1))

    def training_step(self, batch, batch_idx):
        tokens, y = batch
        logits = self.head(self.emb(tokens).mean(axis=1))
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def configure_optimizers(self):
        return optax.sgd(0.1)


def test_tokens_from_a_2d_int_batch_and_length_fn():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32, size=(64, 12)).astype(np.int32)
    y = rng.integers(0, OUT, size=64).astype(np.int32)
    data = batches(tokens, y, 16)
    auto = ThroughputMonitor(window=2)
    given = ThroughputMonitor(window=2, length_fn=lambda b: (b[0] > 15).sum())  # a device scalar, fetched at log
    jl.Trainer(
        max_epochs=1,
        devices=1,
        log_every_n_steps=4,
        callbacks=[auto, given],
        **quiet(logger=jl.loggers.CSVLogger("logs")),
    ).fit(TokenModel(), data)
    np.testing.assert_allclose(
        auto.metrics["train/items_per_sec"], auto.metrics["train/samples_per_sec"] * 12, rtol=1e-6
    )
    # length_fn: tokens > 15 in the last two batches (the window) over the window's time
    n = int((tokens[32:] > 15).sum())
    dt = given.metrics["train/step_time"] * 2
    np.testing.assert_allclose(given.metrics["train/items_per_sec"], n / dt, rtol=1e-6)


def test_bad_arguments():
    with pytest.raises(ValueError, match="window"):
        ThroughputMonitor(window=0)
    with pytest.raises(ValueError, match="peak_flops"):
        ThroughputMonitor(peak_flops=-1)


class SlowValidation(Classifier):
    def on_validation_epoch_end(self):
        import time

        time.sleep(1.0)


def test_validation_time_is_not_training_time():
    data = batches(*make_data(16 * 8), 16)
    mon = ThroughputMonitor(window=8)
    trainer = jl.Trainer(
        max_epochs=1,
        devices=1,
        log_every_n_steps=8,
        val_check_interval=4,
        callbacks=[mon],
        **quiet(logger=jl.loggers.CSVLogger("logs")),
    )
    trainer.fit(SlowValidation(), data, data[:1])
    # the window (steps 1..8) spans the validation after step 4; its 1 s sleep is not in the step time
    assert mon.metrics["train/step_time"] * 7 < 1.0, mon.metrics
