"""pmap-era axis names inside the compiled step (issue item 4): ``nn.BatchNorm(axis_name="batch")`` as flax's
imagenet example writes it, ``nnx.BatchNorm(axis_name=...)`` and ``jax.lax.pmean(loss, "batch")`` train as the
pmap original does; what cannot be honoured is refused by name."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import jaxlight as jl
from jaxlight.axis_names import AxisNameError
from tests.helpers import quiet

LR = 0.1
STEPS = 3
ROWS = 16  # 8 pmap devices x 2 rows


class Block(nn.Module):
    """A ResNet-ish block written as flax's imagenet example writes it (for pmap, axis_name="batch")."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        norm = functools.partial(
            nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5, axis_name="batch"
        )
        x = nn.Conv(8, (3, 3), use_bias=False)(x)
        x = norm()(x)
        x = nn.relu(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(4)(x)


def batches():
    rng = np.random.default_rng(0)
    return [
        (rng.normal(size=(ROWS, 6, 6, 3)).astype(np.float32), rng.normal(size=(ROWS, 4)).astype(np.float32))
        for _ in range(STEPS)
    ]


def pmap_reference(data):
    """The original: jax.pmap over 8 devices, axis_name="batch", each a 1/8 shard, grads pmean'd."""
    block = Block()
    variables = block.init(jax.random.key(0), data[0][0], train=False)
    params, stats = variables["params"], variables["batch_stats"]

    def step(params, stats, x, y):
        def loss_fn(p):
            out, upd = block.apply({"params": p, "batch_stats": stats}, x, train=True, mutable=["batch_stats"])
            return jnp.mean((out - y) ** 2), upd["batch_stats"]

        (_, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        grads = jax.lax.pmean(grads, "batch")
        return jax.tree.map(lambda p, g: p - LR * g, params, grads), stats

    p_step = jax.pmap(step, axis_name="batch", devices=jax.devices()[:8])
    rep = lambda t: jax.tree.map(lambda a: jnp.stack([a] * 8), t)
    params, stats = rep(params), rep(stats)
    for x, y in data:
        params, stats = p_step(params, stats, x.reshape(8, -1, *x.shape[1:]), y.reshape(8, -1, *y.shape[1:]))
    first = lambda t: jax.tree.map(lambda a: np.asarray(a[0]), t)
    return first(params), first(stats)


class LinenModel(jl.LightningModule):
    def configure_model(self):
        self.net = jl.nn.from_linen(Block(), jnp.zeros((ROWS, 6, 6, 3)), init_key=jax.random.key(0))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return jnp.mean((self.net(x) - y) ** 2)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", jnp.mean((self.net(x) - y) ** 2))

    def configure_optimizers(self):
        return optax.sgd(LR)


def max_diff(a, b) -> float:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) for u, v in zip(la, lb))


@pytest.mark.parametrize(
    ("devices", "strategy"), [(1, "auto"), (8, "ddp"), (8, "fsdp"), (8, jl.strategies.FSDP(min_shard=1))]
)
def test_linen_batchnorm_axis_name_trains_as_pmap(devices, strategy):
    data = batches()
    want_params, want_stats = pmap_reference(data)
    model = LinenModel()
    trainer = jl.Trainer(max_epochs=1, devices=devices, strategy=strategy, **quiet())
    trainer.fit(model, data)
    got = model.net.linen_variables()
    print(
        "max diff vs pmap: batch_stats",
        max_diff(got["batch_stats"], want_stats),
        "params",
        max_diff(got["params"], want_params),
    )
    assert max_diff(got["batch_stats"], want_stats) < 1e-5
    assert max_diff(got["params"], want_params) < 1e-5
    assert max_diff(got["batch_stats"], jax.tree.map(np.zeros_like, want_stats)) > 1e-3  # they did move

    # (5) evaluation: BatchNorm(axis_name) in eval mode uses the running statistics; the eval step traces
    x, y = data[0]
    logged = trainer.validate(model, [(x, y)])[0]["val_loss"]
    out = Block().apply({"params": want_params, "batch_stats": want_stats}, x, train=False)
    assert logged == pytest.approx(float(jnp.mean((out - y) ** 2)), abs=1e-5)


class NnxNet(nnx.Module):
    def __init__(self, axis_name, rngs):
        self.lin = nnx.Linear(5, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, axis_name=axis_name, momentum=0.9, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.bn(self.lin(x))))


class NnxModel(jl.LightningModule):
    def __init__(self, axis_name=None, pmean_loss=False):
        super().__init__()
        self.net = NnxNet(axis_name, nnx.Rngs(0))
        self.pmean_loss = pmean_loss

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = jnp.mean((self.net(x) - y) ** 2)
        if self.pmean_loss:
            loss = jax.lax.pmean(loss, "batch")  # pmap-era: average the per-device losses
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", jnp.mean((self.net(x) - y) ** 2))

    def configure_optimizers(self):
        return optax.sgd(LR)


def nnx_data():
    rng = np.random.default_rng(1)
    return [
        (rng.normal(size=(ROWS, 5)).astype(np.float32), rng.normal(size=(ROWS, 1)).astype(np.float32))
        for _ in range(STEPS)
    ]


def fit_state(model, devices=1, strategy="auto"):
    trainer = jl.Trainer(max_epochs=1, devices=devices, strategy=strategy, **quiet())
    trainer.fit(model, nnx_data())
    return trainer, nnx.state(model.net)


@pytest.mark.parametrize(("devices", "strategy"), [(1, "auto"), (8, "ddp")])
def test_nnx_batchnorm_axis_name_trains_as_without(devices, strategy):
    _, want = fit_state(NnxModel(axis_name=None))
    trainer, got = fit_state(NnxModel(axis_name="batch"), devices, strategy)
    print("max diff nnx", max_diff(got, want))
    assert max_diff(got, want) < 1e-5
    x, y = nnx_data()[0]
    a = trainer.validate(trainer.lightning_module, [(x, y)])
    assert np.isfinite(a[0]["val_loss"])


def test_pmean_in_the_loss_trains_as_without():
    _, want = fit_state(NnxModel())
    _, got = fit_state(NnxModel(pmean_loss=True), 8, "ddp")
    assert max_diff(got, want) < 1e-6


def test_psum_axis_index_and_all_gather_on_the_size_one_axis():
    seen = {}

    class M(NnxModel):
        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = jnp.mean((self.net(x) - y) ** 2)
            seen["index"] = jax.lax.axis_index("batch")
            seen["gathered"] = jax.lax.all_gather(x, "batch").shape
            return jax.lax.psum(loss, "batch")  # one program: the sum over one "device"

    _, want = fit_state(NnxModel())
    _, got = fit_state(M())
    assert max_diff(got, want) < 1e-6
    assert seen["gathered"] == (1, ROWS, 5)


def test_axis_index_groups_refused_by_name():
    class M(NnxModel):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return jax.lax.psum(loss, "batch", axis_index_groups=[[0]])

    with pytest.raises(AxisNameError, match="axis_index_groups"):
        fit_state(M())


def test_a_mesh_axis_name_is_refused_by_name():
    class M(NnxModel):
        def training_step(self, batch, batch_idx):
            return jax.lax.pmean(super().training_step(batch, batch_idx), "data")

    with pytest.raises(AxisNameError, match="'data'.*mesh axis"):
        fit_state(M(), 8, "ddp")


def test_manual_optimization_binds_the_names_too():
    class Manual(NnxModel):
        def __init__(self, axis_name=None):
            super().__init__(axis_name)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss, grads = self.manual_backward(lambda: jnp.mean((self.net(x) - y) ** 2))
            self.optimizers().step(grads)
            return loss

    _, want = fit_state(Manual())
    _, got = fit_state(Manual(axis_name="batch"), 8, "ddp")
    assert max_diff(got, want) < 1e-5
