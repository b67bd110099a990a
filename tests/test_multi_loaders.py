"""Several validation/test/predict loaders (issue 11, item 4): run one after the other with ``dataloader_idx``
passed to the step and the batch hooks, Lightning's metric names (``val_loss/dataloader_idx_0``), one result
dict (or prediction list) per loader, one compiled step per loader."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight.data import batch_mask
from tests import helpers

IN = 4


def data(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, IN)).astype(np.float32)
    return x, (x.sum(-1, keepdims=True) * (seed + 1)).astype(np.float32)


def batches(x, y, bs):
    return [(x[i : i + bs], y[i : i + bs]) for i in range(0, len(x), bs)]


A = data(12, 1)  # batches of 4
B = data(10, 2)  # batches of 6: another compiled shape, and a padded last batch


class Multi(jl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nnx.Linear(IN, 1, rngs=nnx.Rngs(0))
        self.calls = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.net(x) - y) ** 2).mean()

    def _loss(self, batch):
        x, y = batch
        mask = batch_mask(batch)
        return (((self.net(x) - y) ** 2)[:, 0] * mask).sum() / mask.sum()

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        loss = self._loss(batch)
        self.log("val_loss", loss)
        # a Python int: branching on it is fine (one compiled step per loader)
        self.log("scaled", loss * (10.0 if dataloader_idx == 1 else 1.0))
        if dataloader_idx == 1:
            self.log("b_only", loss, add_dataloader_idx=False)  # Lightning: the name as given
        return loss

    def test_step(self, batch, batch_idx, dataloader_idx=0):
        self.log("test_loss", self._loss(batch))

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return self.net(batch[0]) + 100.0 * dataloader_idx

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self.calls.append((dataloader_idx, batch_idx, batch[0].shape[0]))

    def on_validation_epoch_end(self):
        self.log("epoch_end_value", 1.0)

    def configure_optimizers(self):
        return optax.sgd(0.01)


# one device; sanity validation left to the Trainer's default (some tests count those batches)
quiet = functools.partial(helpers.quiet, devices=1, num_sanity_val_steps=None)


def loss_of(model, xy):
    x, y = xy
    return float(np.mean((np.asarray(model.net(jnp.asarray(x))) - y) ** 2))


@pytest.mark.parametrize("container", ["list", "dict"])
def test_fit_validates_every_loader_with_its_index(container):
    model = Multi()
    loaders = [batches(*A, 4), batches(*B, 6)]
    val = loaders if container == "list" else {"a": loaders[0], "b": loaders[1]}
    trainer = jl.Trainer(max_epochs=1, num_sanity_val_steps=0, **quiet())
    trainer.fit(model, batches(*A, 4), val)
    cm = trainer.callback_metrics
    assert float(cm["val_loss/dataloader_idx_0"]) == pytest.approx(loss_of(model, A), rel=1e-5)
    assert float(cm["val_loss/dataloader_idx_1"]) == pytest.approx(loss_of(model, B), rel=1e-5)
    assert float(cm["scaled/dataloader_idx_1"]) == pytest.approx(10 * loss_of(model, B), rel=1e-5)
    assert float(cm["epoch_end_value"]) == 1.0  # logged outside any loader: no suffix
    assert float(cm["b_only"]) == pytest.approx(loss_of(model, B), rel=1e-5)  # add_dataloader_idx=False
    assert "val_loss" not in cm
    # hooks got each loader's index; the short last batch of B shows its 4 rows
    assert model.calls == [(0, 0, 4), (0, 1, 4), (0, 2, 4), (1, 0, 6), (1, 1, 4)]
    # one compiled step per loader and batch shape: A's 4 rows, B's 6, B's short last batch of 4 (issue 23)
    assert trainer.compile_counts["validate"] == 3
    assert trainer.num_val_batches == [3, 2]


def test_validate_and_test_return_one_dict_per_loader():
    model = Multi()
    trainer = jl.Trainer(**quiet())
    out = trainer.validate(model, [batches(*A, 4), batches(*B, 6)], verbose=False)
    assert len(out) == 2
    # each loader's dict: what was logged while it ran, plus what was logged outside any loader (Lightning's)
    assert set(out[0]) == {"val_loss/dataloader_idx_0", "scaled/dataloader_idx_0", "epoch_end_value"}
    assert set(out[1]) == {"val_loss/dataloader_idx_1", "scaled/dataloader_idx_1", "b_only", "epoch_end_value"}
    assert out[1]["val_loss/dataloader_idx_1"] == pytest.approx(loss_of(model, B), rel=1e-5)
    out = trainer.test(model, {"x": batches(*A, 4), "y": batches(*B, 6)}, verbose=False)
    assert [set(d) for d in out] == [{"test_loss/dataloader_idx_0"}, {"test_loss/dataloader_idx_1"}]
    assert out[0]["test_loss/dataloader_idx_0"] == pytest.approx(loss_of(model, A), rel=1e-5)


def test_predict_returns_a_list_per_loader():
    model = Multi()
    trainer = jl.Trainer(**quiet())
    preds = trainer.predict(model, [[(A[0][:4],), (A[0][4:8],)], [(B[0][:6],), (B[0][6:],)]])
    assert [[p.shape[0] for p in dl] for dl in preds] == [[4, 4], [6, 4]]
    want_b = np.asarray(model.net(jnp.asarray(B[0]))) + 100.0
    np.testing.assert_allclose(np.concatenate(preds[1]), want_b, rtol=1e-5)


def test_a_step_without_dataloader_idx_still_runs_every_loader():
    class NoIdx(Multi):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self._loss(batch))

        def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
            pass

    trainer = jl.Trainer(**quiet())
    out = trainer.validate(NoIdx(), [batches(*A, 4), batches(*B, 6)], verbose=False)
    assert [set(d) - {"epoch_end_value"} for d in out] == [{"val_loss/dataloader_idx_0"}, {"val_loss/dataloader_idx_1"}]


def test_a_batch_hook_without_dataloader_idx_is_refused_with_several_loaders():
    class OldHook(Multi):
        def on_validation_batch_end(self, outputs, batch, batch_idx):
            pass

    trainer = jl.Trainer(**quiet())
    with pytest.raises(jl.MisconfigurationError, match="on_validation_batch_end does not accept a dataloader_idx"):
        trainer.validate(OldHook(), [batches(*A, 4), batches(*B, 6)], verbose=False)
    # one loader: the hook is called as before
    assert trainer.validate(OldHook(), batches(*A, 4), verbose=False)[0]["val_loss"] > 0


def test_several_train_loaders_are_refused():
    trainer = jl.Trainer(max_epochs=1, **quiet())
    with pytest.raises(jl.MisconfigurationError, match="2 train loaders"):
        trainer.fit(Multi(), [batches(*A, 4), batches(*A, 4)])


def test_datamodule_with_several_val_loaders():
    class DM(jl.LightningDataModule):
        def train_dataloader(self):
            return batches(*A, 4)

        def val_dataloader(self):
            return [batches(*A, 4), batches(*B, 6)]

    trainer = jl.Trainer(max_epochs=1, num_sanity_val_steps=1, **quiet())
    model = Multi()
    trainer.fit(model, datamodule=DM())
    assert model.calls[:2] == [(0, 0, 4), (1, 0, 6)]  # the sanity check: one batch of each loader
    assert {"val_loss/dataloader_idx_0", "val_loss/dataloader_idx_1"} <= set(trainer.callback_metrics)


def test_add_dataloader_idx_false_keeps_the_name():
    """``self.log(..., add_dataloader_idx=False)``: the name as given (the collector's side of the flag)."""
    from jaxlight.metrics import Collector

    col = Collector("validate", 4, on_step=False, on_epoch=True, dataloader_idx=1)
    kw = dict(prog_bar=False, logger=True, on_step=None, on_epoch=None, reduce_fx="mean", batch_size=None)
    col.add("a", 1.0, **kw)
    col.add("b", 2.0, add_dataloader_idx=False, **kw)
    assert set(col.values) == {"a/dataloader_idx_1", "b"}
