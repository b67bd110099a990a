"""Lightning programs run as written (issue 23, items 1 and 2).

A batch with fewer rows than the others (``DataLoader(batch_size=32)`` over 1000 rows) trains, validates,
tests and predicts in a step compiled for its own shape, so a plain ``.mean()`` over the batch gives
Lightning's numbers; rows the batch axes cannot split run replicated over those axes. Step methods take
any of Lightning's signatures: ``(batch)``, ``(batch, batch_idx)``, ``(batch, batch_idx, dataloader_idx)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxlight as jl
from jaxlight.data import BatchPlacer, batch_mask
from jaxlight.errors import BatchError, MisconfigurationError
from tests.core_models import Classifier, batches, hand_loop, make_data, max_diff, quiet

torch = pytest.importorskip("torch")

X, Y = make_data(1004)


def torch_loader(x, y, bs, **kw):
    ds = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    return torch.utils.data.DataLoader(ds, batch_size=bs, **kw)


def params_of(model):
    return nnx.state(model.net, nnx.Param)


# ------------------------------------------------------------------------------------------------ training
def test_1000_rows_in_batches_of_32_train_every_row_like_a_hand_loop():
    """The issue's example: it raised ``train batch 31 has 8 rows but the first had 32`` before training."""
    x, y = X[:1000], Y[:1000]
    model = Classifier()
    trainer = jl.Trainer(max_epochs=2, devices=1, **quiet())
    trainer.fit(model, torch_loader(x, y, 32))
    ref, _, _ = hand_loop(optax.adam(1e-2), batches(x, y, 32) * 2)  # 31 x 32 rows + 8, twice
    assert trainer.num_training_batches == 32 and trainer.global_step == 64
    assert max_diff(params_of(model), ref) <= 1e-6
    # one extra compile for the 8-row shape, reused in the second epoch
    assert trainer.compile_counts["train"] == 2 and len(trainer.engine.train_steps) == 2


class SeeRows(jl.Callback):
    """The placement of every train batch's inputs (which mesh axes split its rows)."""

    def __init__(self):
        self.seen = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append((batch[0].shape[0], batch[0].sharding.spec))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_rows_the_devices_cannot_split_run_replicated(strategy):
    """1004 rows in batches of 32 on 8 devices: the last 12 rows do not divide 8, so that batch runs with its
    rows on every device; the weights are still the one-device hand loop's."""
    model, see = Classifier(), SeeRows()
    trainer = jl.Trainer(max_epochs=1, devices=8, strategy=strategy, callbacks=[see], **quiet())
    trainer.fit(model, batches(X, Y, 32))
    ref, _, _ = hand_loop(optax.adam(1e-2), batches(X, Y, 32))
    assert trainer.global_step == 32
    assert max_diff(params_of(model), ref) <= 1e-6
    axis = "data" if strategy == "ddp" else "fsdp"
    assert see.seen[0] == (32, P(axis)) and see.seen[-1][0] == 12
    assert see.seen[-1][1] in (P(), P(None))  # replicated: no batch axis of size 8 divides 12


def test_the_largest_dividing_set_of_batch_axes_splits_a_short_batch():
    mesh = jax.make_mesh((2, 4, 1, 1, 1, 1), ("data", "fsdp", "tensor", "sequence", "stage", "expert"))
    placer = BatchPlacer(mesh)
    assert placer.rows_entry(16) == ("data", "fsdp")  # a full batch: every batch axis, as before
    assert placer.rows_entry(12) == "fsdp"  # 4 divides 12, 8 does not: replicated over data only
    assert placer.rows_entry(6) == "data"
    assert placer.rows_entry(5) is None
    placed = placer.place({"x": np.arange(12.0).reshape(12, 1)})["x"]
    assert placed.sharding.spec == P("fsdp") and np.asarray(placed)[:, 0].tolist() == list(range(12))


class Reg(jl.LightningModule):
    """Linear regression with SGD and Lightning's usual reductions: ``.mean()`` over the batch, no mask."""

    def __init__(self):
        super().__init__()
        self.net = nnx.Linear(5, 1, rngs=nnx.Rngs(0))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.net(x) - y) ** 2).mean()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_mse", ((self.net(x) - y) ** 2).mean())
        self.log("val_rows", batch_mask(batch).sum().astype(jnp.float32), reduce_fx="sum")

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_mse", ((self.net(x) - y) ** 2).mean())

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def configure_optimizers(self):
        return optax.sgd(0.05)


def reg_data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 5)).astype(np.float32)
    y = (x @ rng.normal(size=(5, 1)) + 0.3 * rng.normal(size=(n, 1))).astype(np.float32)
    return x, y


def test_accumulation_counts_the_ragged_batch_as_one_micro_batch():
    """26 rows in batches of 4: 7 batches, windows of 4 + 3 (the partial one steps at the epoch's end, each
    micro-batch's loss divided by 4 as Lightning does). The pytorch-lightning comparison of the same
    program is ``ragged_train_accumulate_4`` in tests/test_lightning_diff.py."""
    x, y = reg_data(26)
    model = Reg()
    w0 = [np.asarray(model.net.kernel[...]), np.asarray(model.net.bias[...])]
    trainer = jl.Trainer(max_epochs=2, accumulate_grad_batches=4, devices=1, **quiet())
    trainer.fit(model, torch_loader(x, y, 4))
    assert trainer.num_training_batches == 7 and trainer.global_step == 4

    def loss(w, xb, yb):
        return (((xb @ w[0] + w[1]) - yb) ** 2).mean()

    w = [jnp.asarray(v) for v in w0]
    data = batches(x, y, 4)
    for _ in range(2):
        for window in (data[:4], data[4:]):
            g = [sum(gs) / 4 for gs in zip(*(jax.grad(loss)(w, xb, yb) for xb, yb in window))]
            w = [a - 0.05 * b for a, b in zip(w, g)]
    np.testing.assert_allclose(np.asarray(model.net.kernel[...]), np.asarray(w[0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(model.net.bias[...]), np.asarray(w[1]), rtol=1e-5, atol=1e-6)


def test_drop_and_error_stay_options():
    assert jl.Trainer(logger=False).ragged_batches == "keep"
    x, y = reg_data(26)
    dropped = jl.Trainer(max_epochs=1, devices=1, **quiet(ragged_batches="drop"))
    dropped.fit(Reg(), torch_loader(x, y, 4))
    assert dropped.num_training_batches == 6 and dropped.global_step == 6
    with pytest.raises(BatchError, match="train batch 6 has 2 rows but the first had 4"):
        jl.Trainer(max_epochs=1, devices=1, **quiet(ragged_batches="error")).fit(Reg(), torch_loader(x, y, 4))


# ------------------------------------------------------------------------------------------------ evaluation
@pytest.mark.parametrize("devices", [1, 8])
def test_a_short_validation_batch_gives_the_exact_mean_without_a_mask(devices):
    """The issue's case: 21 rows in batches of 8, 8, 5 gave val_mse 2.1649 (repeated padding rows counted by the
    step's own ``.mean()``) where Lightning gives the mean over the 21 rows."""
    x, y = reg_data(21, seed=3)
    model = Reg()
    trainer = jl.Trainer(devices=devices, **quiet())
    out = trainer.validate(model, batches(x, y, 8), verbose=False)[0]
    exact = float(np.mean((np.asarray(model.net(jnp.asarray(x))) - y) ** 2))
    assert out["val_mse"] == pytest.approx(exact, rel=1e-6)
    assert out["val_rows"] == 21.0  # batch_mask still works: every row of every batch is real
    assert trainer.compile_counts["validate"] == 2  # 8 rows, and one extra compile for the 5-row batch
    test_out = trainer.test(model, batches(x, y, 8), verbose=False)[0]
    assert test_out["test_mse"] == pytest.approx(exact, rel=1e-6)
    preds = trainer.predict(model, [(x[i : i + 8],) for i in range(0, 21, 8)])
    assert [p.shape for p in preds] == [(8, 1), (8, 1), (5, 1)]
    np.testing.assert_allclose(np.concatenate(preds), np.asarray(model.net(jnp.asarray(x))), rtol=1e-6)


# ------------------------------------------------------------------------------------------------ signatures
def _step(body):
    """A Classifier whose training_step and validation_step have the signature of ``body``'s def."""
    return type("Signed", (Classifier,), {"training_step": body, "validation_step": body})


def _loss(self, batch):
    x, y = batch
    loss = optax.softmax_cross_entropy_with_integer_labels(self.net(x), y).mean()
    self.log("loss_seen", loss)
    return loss


def batch_only(self, batch):
    return _loss(self, batch)


def with_idx(self, batch, batch_idx):
    return _loss(self, batch)


def with_default_dl(self, batch, batch_idx, dataloader_idx=0):
    return _loss(self, batch)


def with_required_dl(self, batch, batch_idx, dataloader_idx):
    assert dataloader_idx == 0
    return _loss(self, batch)


def with_args(self, *args):
    return _loss(self, args[0])


SMALL = batches(*make_data(64), 16)


@pytest.fixture(scope="module")
def small_ref():
    return hand_loop(optax.adam(1e-2), SMALL)[0]


@pytest.mark.parametrize("body", [batch_only, with_idx, with_default_dl, with_required_dl, with_args])
def test_lightning_step_signatures_train_and_validate(body, small_ref):
    model = _step(body)()
    trainer = jl.Trainer(max_epochs=1, devices=1, **quiet())
    trainer.fit(model, SMALL, SMALL[:1])
    assert max_diff(params_of(model), small_ref) <= 1e-6
    assert "loss_seen" in trainer.callback_metrics


def test_batch_only_steps_for_every_stage_and_manual_optimization():
    class Manual(Classifier):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch):
            opt = self.optimizers()
            loss, grads = self.manual_backward(lambda: _loss(self, batch))
            opt.step(grads)
            return loss

        def test_step(self, batch):
            _loss(self, batch)

        def predict_step(self, batch):
            return self.net(batch[0])

    model = Manual()
    trainer = jl.Trainer(max_epochs=1, devices=1, **quiet())
    trainer.fit(model, SMALL)
    assert max_diff(params_of(model), hand_loop(optax.adam(1e-2), SMALL)[0]) <= 1e-6
    assert "loss_seen" in trainer.test(model, SMALL, verbose=False)[0]
    assert [p.shape for p in trainer.predict(model, SMALL[:2])] == [(16, 4), (16, 4)]


def no_batch(self):
    return 0.0


def too_many(self, batch, batch_idx, dataloader_idx, extra):
    return 0.0


def keyword_only(self, batch, batch_idx, *, scale):
    return 0.0


def optimizer_idx(self, batch, batch_idx, optimizer_idx):
    return 0.0


@pytest.mark.parametrize(
    "body,match",
    [
        (no_batch, r"Signed.training_step\(\) takes no batch; write it as \(self, batch\)"),
        (too_many, r"training_step\(batch, batch_idx, dataloader_idx, extra\) requires 4 arguments"),
        (keyword_only, r"required keyword-only parameters \['scale'\]"),
        (optimizer_idx, r"optimizer_idx, which Lightning 2 no longer passes"),
    ],
)
def test_other_signatures_are_refused_before_training(body, match):
    with pytest.raises(MisconfigurationError, match=match):
        jl.Trainer(max_epochs=1, devices=1, **quiet()).fit(_step(body)(), SMALL)
