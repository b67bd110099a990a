"""ThroughputMonitor: the step's matmul FLOPs (a scanned layer stack counted per layer), consistent rates, tokens from
2-D int batches."""

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
    # one device's share of the step's matrix products (2 FLOPs per multiply-add): forward and the weights'
    # gradients of both layers, the inputs' gradient of the second (nothing differentiates the batch)
    per_row = 2 * (2 * (IN * HID + HID * OUT) + HID * OUT)
    assert mon.flops_per_step == per_row * bs / devices
    # XLA's own count of the device's program adds the elementwise work: a little more
    xla = trainer.compiled["train"].cost_analysis()["flops"]
    assert mon.flops_per_step <= xla <= 2 * mon.flops_per_step, (mon.flops_per_step, xla)
    m = mon.metrics
    assert m["train/flops_per_step"] == mon.flops_per_step
    np.testing.assert_allclose(m["train/samples_per_sec"] * m["train/step_time"], bs, rtol=1e-9)
    np.testing.assert_allclose(m["train/device/samples_per_sec"] * devices, m["train/samples_per_sec"], rtol=1e-9)
    np.testing.assert_allclose(m["train/device/flops_per_sec"] * m["train/step_time"], mon.flops_per_step, rtol=1e-9)
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


class Stacked(jl.LightningModule):
    """``layers`` square Linear layers in one scanned ``jl.nn.LayerStack``: XLA's cost analysis counts the
    scan's body once, whatever ``layers`` is."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = layers

    def configure_model(self):
        self.stack = jl.nn.LayerStack(lambda rngs: nnx.Linear(HID, HID, rngs=rngs), self.layers, rngs=nnx.Rngs(0))
        self.inp, self.out = nnx.Linear(IN, HID, rngs=nnx.Rngs(1)), nnx.Linear(HID, OUT, rngs=nnx.Rngs(2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return optax.softmax_cross_entropy_with_integer_labels(self.out(self.stack(self.inp(x))), y).mean()

    def configure_optimizers(self):
        return optax.sgd(0.1)


@pytest.mark.parametrize("spe", [1, 2])
def test_a_scanned_layer_stack_counts_every_layer(spe):
    bs = 16
    data = batches(*make_data(bs * 4), bs)
    counted, xla = {}, {}
    for layers in (2, 4):
        mon = ThroughputMonitor(window=2)
        trainer = jl.Trainer(
            max_epochs=1, devices=1, log_every_n_steps=2, steps_per_execution=spe, callbacks=[mon], **quiet()
        )
        trainer.fit(Stacked(layers), data)
        counted[layers] = mon.flops_per_step
        xla[layers] = trainer.compiled["train"].cost_analysis()["flops"]
    # two more layers: their forward, their weights' and their inputs' gradients, per step (a 2-step
    # execution's program is counted per step)
    assert counted[4] - counted[2] == 2 * 3 * 2 * bs * HID * HID
    assert xla[4] - xla[2] < 0.1 * (counted[4] - counted[2])  # what the monitor used to report: no change


def test_matmul_flops_follows_loops_branches_and_shard_map():
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jaxlight.flops import matmul_flops

    a = jnp.ones((4, 4))
    step = lambda c, _: (c @ c, None)
    assert matmul_flops(jax.make_jaxpr(lambda c: jax.lax.scan(step, c, None, length=3)[0])(a)) == (3 * 128, True)
    branches = lambda p, c: jax.lax.cond(p, lambda c: c @ c @ c, lambda c: c @ c, c)
    assert matmul_flops(jax.make_jaxpr(branches)(True, a)) == (256, True)  # the larger branch
    loop = lambda c: jax.lax.while_loop(lambda c: c[0, 0] < 9, lambda c: c @ c, c)
    assert matmul_flops(jax.make_jaxpr(loop)(a)) == (128, False)  # a run-time trip count: once, said so
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    local = jax.shard_map(lambda x: x @ x.T, mesh=mesh, in_specs=P("a"), out_specs=P("a"), axis_names={"a"})
    # each of the 2 shards multiplies its (4, 4) rows by their transpose
    assert matmul_flops(jax.jit(local).trace(jnp.ones((8, 4))).jaxpr) == (2 * 2 * 4 * 4 * 4, True)
    img, k = jnp.ones((2, 3, 8, 8)), jnp.ones((5, 3, 3, 3))
    conv = lambda i, k: jax.lax.conv_general_dilated(i, k, (1, 1), "SAME")
    assert matmul_flops(jax.make_jaxpr(conv)(img, k)) == (2 * 2 * 5 * 8 * 8 * 3 * 3 * 3, True)
