"""Every evaluation sample counts (issue 11, item 3): a last validation/test/predict batch with fewer rows
runs in a step compiled for its own shape (issue 23; it was padded and masked before), so epoch metrics equal
the full-dataset value and predict returns one row per sample; training's ragged_batches="error" and "drop"
are settled before the first step."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight.data import BatchError, batch_mask
from jaxlight.loaders import is_loader_collection
from tests import helpers

IN = 5


class Reg(jl.LightningModule):
    """Linear regression whose eval steps reduce over real rows only (the documented pattern)."""

    def __init__(self):
        super().__init__()
        self.net = nnx.Linear(IN, 1, rngs=nnx.Rngs(0))

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.log("train_rows", batch_mask(batch).sum().astype(jnp.float32), reduce_fx="sum", on_epoch=True)
        return ((self.net(x) - y) ** 2).mean()

    def _eval(self, batch, batch_idx, prefix):
        x, y = batch
        mask = batch_mask(batch)
        per_row = ((self.net(x) - y) ** 2)[:, 0]
        self.log(f"{prefix}_loss", (per_row * mask).sum() / mask.sum())
        self.log(f"{prefix}_rows", mask.sum().astype(jnp.float32), reduce_fx="sum")
        # a value that is the same for every row of a batch: its epoch mean is weighted by real rows
        self.log(f"{prefix}_batch_idx", batch_idx.astype(jnp.float32))
        return per_row

    def validation_step(self, batch, batch_idx):
        return self._eval(batch, batch_idx, "val")

    def test_step(self, batch, batch_idx):
        return self._eval(batch, batch_idx, "test")

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def configure_optimizers(self):
        return optax.sgd(0.05)


def data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, IN)).astype(np.float32)
    y = (x @ rng.normal(size=(IN, 1)) + 0.1 * rng.normal(size=(n, 1))).astype(np.float32)
    return x, y


def batches(x, y, bs):
    return [(x[i : i + bs], y[i : i + bs]) for i in range(0, len(x), bs)]


# one device; sanity validation left to the Trainer's default
quiet = functools.partial(helpers.quiet, devices=1, num_sanity_val_steps=None)


def full_loss(model, x, y):
    return float(np.mean((np.asarray(model.net(jnp.asarray(x))) - y) ** 2))


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_padded_last_batch_counts_every_sample(stage):
    x, y = data(10)
    model = Reg()
    trainer = jl.Trainer(**quiet())
    out = getattr(trainer, stage)(model, batches(x, y, 4), verbose=False)[0]  # 4 + 4 + 2 rows
    p = "val" if stage == "validate" else "test"
    assert out[f"{p}_rows"] == 10.0  # the two padding rows are not counted
    assert out[f"{p}_loss"] == pytest.approx(full_loss(model, x, y), rel=1e-5)
    assert out[f"{p}_batch_idx"] == pytest.approx((0 * 4 + 1 * 4 + 2 * 2) / 10)  # weights are real rows
    assert trainer.compile_counts[stage] == 2  # the short batch ran in a step compiled for its 2 rows (issue 23)


def test_hooks_and_outputs_see_real_rows_only():
    x, y = data(10)
    seen = []

    class Spy(jl.Callback):
        def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
            seen.append((batch_idx, batch[0].shape[0], outputs.shape[0], np.asarray(batch[0])))

    trainer = jl.Trainer(callbacks=[Spy()], **quiet())
    trainer.validate(Reg(), batches(x, y, 4), verbose=False)
    assert [(i, b, o) for i, b, o, _ in seen] == [(0, 4, 4), (1, 4, 4), (2, 2, 2)]
    np.testing.assert_array_equal(seen[-1][3], x[8:])


def test_predict_returns_one_row_per_sample():
    x, _ = data(10)
    model = Reg()
    trainer = jl.Trainer(**quiet())
    preds = trainer.predict(model, [(x[i : i + 4],) for i in range(0, 10, 4)])
    assert [p.shape for p in preds] == [(4, 1), (4, 1), (2, 1)]
    np.testing.assert_allclose(np.concatenate(preds), np.asarray(model.net(jnp.asarray(x))), rtol=1e-6)


def test_rows_not_dividing_the_devices_run_replicated():
    """On 8 devices a 6-row batch cannot be split evenly: it runs replicated (every device computes the 6 rows),
    and so does the 4-row last one, each in its own step (issue 23; both were padded to 8 rows before)."""
    x, y = data(10)
    model = Reg()
    trainer = jl.Trainer(**quiet(devices=8, strategy="ddp"))
    out = trainer.validate(model, batches(x, y, 6), verbose=False)[0]  # 6 + 4 rows
    assert out["val_rows"] == 10.0
    assert out["val_loss"] == pytest.approx(full_loss(model, x, y), rel=1e-5)
    assert trainer.engine.batch_rows["validate"] == 6
    preds = trainer.predict(model, [(x[:6],), (x[6:],)])
    assert [p.shape[0] for p in preds] == [6, 4]
    np.testing.assert_allclose(np.concatenate(preds), np.asarray(model.net(jnp.asarray(x))), rtol=1e-5)


def test_drop_setting_no_longer_drops_evaluation_samples():
    x, y = data(10)
    model = Reg()
    trainer = jl.Trainer(**quiet(ragged_batches="drop"))
    out = trainer.validate(model, batches(x, y, 4), verbose=False)[0]
    assert out["val_rows"] == 10.0


def test_validation_inside_fit_pads_too():
    x, y = data(16)
    vx, vy = data(10, seed=1)
    model = Reg()
    trainer = jl.Trainer(max_epochs=1, num_sanity_val_steps=0, **quiet())
    trainer.fit(model, batches(x, y, 4), batches(vx, vy, 4))
    assert float(trainer.callback_metrics["val_rows"]) == 10.0
    assert float(trainer.callback_metrics["val_loss"]) == pytest.approx(full_loss(model, vx, vy), rel=1e-5)
    assert float(trainer.callback_metrics["train_rows"]) == 16.0  # batch_mask(batch) in training: all rows


def test_a_batch_longer_than_the_first_raises():
    x, y = data(12)
    trainer = jl.Trainer(**quiet())
    with pytest.raises(BatchError, match=r"validate batch 1 has 8 rows but the step is compiled for 4"):
        trainer.validate(Reg(), [(x[:4], y[:4]), (x[4:], y[4:])], verbose=False)


def test_batch_mask_outside_a_step_needs_the_batch():
    with pytest.raises(ValueError, match="needs the batch"):
        batch_mask()
    assert batch_mask((np.zeros((3, 2)),)).tolist() == [True, True, True]


class Count(jl.Callback):
    def __init__(self):
        self.train_batches = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.train_batches += 1


def torch_loader(n, bs):
    torch = pytest.importorskip("torch")
    x, y = data(n)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), bs)


@pytest.mark.parametrize("kind", ["torch", "list"])
def test_ragged_train_loader_fails_before_the_first_step(kind):
    loader = torch_loader(26, 4) if kind == "torch" else batches(*data(26), 4)  # 6 x 4 rows + 2
    count = Count()
    trainer = jl.Trainer(max_epochs=1, callbacks=[count], **quiet(ragged_batches="error"))
    with pytest.raises(BatchError, match=r"train batch 6 has 2 rows but the first had 4.*ragged_batches='drop'"):
        trainer.fit(Reg(), loader)
    assert count.train_batches == 0 and "train" not in trainer.compile_counts


def test_ragged_train_loader_with_drop_has_a_known_epoch_length():
    count = Count()
    trainer = jl.Trainer(max_epochs=2, accumulate_grad_batches=4, callbacks=[count], **quiet(ragged_batches="drop"))
    trainer.fit(Reg(), torch_loader(26, 4))
    assert trainer.num_training_batches == 6 and count.train_batches == 12
    assert trainer.global_step == 4  # 4 + a partial window of 2 stepping at each epoch's (known) last batch


def test_limit_before_the_ragged_batch_is_fine():
    count = Count()
    trainer = jl.Trainer(max_epochs=1, limit_train_batches=3, callbacks=[count], **quiet())
    trainer.fit(Reg(), torch_loader(26, 4))
    assert count.train_batches == 3


def test_a_list_of_batches_is_one_loader():
    x, y = data(8)
    assert not is_loader_collection(batches(x, y, 4))
    assert is_loader_collection([batches(x, y, 4), batches(x, y, 2)])
    assert is_loader_collection({"a": batches(x, y, 4)})
    assert not is_loader_collection([(x[:4],), (x[4:],)])


def test_a_later_run_with_another_batch_size_compiles_its_own_step():
    x, y = data(12)
    model = Reg()
    trainer = jl.Trainer(**quiet())
    small = trainer.validate(model, batches(x, y, 4), verbose=False)[0]
    large = trainer.validate(model, batches(x, y, 8), verbose=False)[0]  # 8 + 4 (padded)
    again = trainer.validate(model, batches(x, y, 4), verbose=False)[0]
    assert small["val_rows"] == large["val_rows"] == again["val_rows"] == 12.0
    assert large["val_loss"] == pytest.approx(full_loss(model, x, y), rel=1e-5)
    assert trainer.compile_counts["validate"] == 2  # one per batch shape, reused when it comes back
