"""The loop parts of issue 11: module weights readable in every hook, ``estimated_stepping_batches`` and
``num_training_batches`` in ``configure_optimizers``, weights loaded in ``on_fit_start`` trained on, and the
smaller fixes (frozen modules, hparams checked at fit start, ``ckpt_path="last"`` without a checkpoint,
``LightningDataModule.save_hyperparameters``, the module's own train/eval mode left alone)."""

from __future__ import annotations

import functools
import math
import os
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight.checkpoint import CheckpointError
from tests import helpers

IN = 4


def data(n=24, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, IN)).astype(np.float32)
    return x, (x @ rng.normal(size=(IN, 1))).astype(np.float32)


def batches(n=24, bs=4, seed=0):
    x, y = data(n, seed)
    return [(x[i : i + bs], y[i : i + bs]) for i in range(0, n, bs)]


class Lin(jl.LightningModule):
    def __init__(self, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = nnx.Linear(IN, 1, rngs=nnx.Rngs(0))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.net(x) - y) ** 2).mean()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", ((self.net(x) - y) ** 2).mean())

    def configure_optimizers(self):
        return optax.sgd(self.hparams.lr)


quiet = functools.partial(helpers.quiet, devices=1)


def kernel(module) -> np.ndarray:
    return np.asarray(module.net.kernel[...]).copy()


# ------------------------------------------------------------------------------- weights in per-batch hooks
def test_module_weights_are_readable_and_current_in_per_batch_hooks():
    seen = []

    class Reader(jl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(("start", batch_idx, kernel(pl_module), np.asarray(trainer.train_state.params["net/kernel"])))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            state = nnx.state(pl_module.net)  # issue 11: this raised "Array has been deleted"
            assert all(not x.is_deleted() for x in jax.tree.leaves(state))
            seen.append(("end", batch_idx, kernel(pl_module), np.asarray(trainer.train_state.params["net/kernel"])))

    class ModuleReads(Lin):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.norms.append(float(jnp.abs(self.net.kernel[...]).sum()))

    model = ModuleReads()
    model.norms = []
    trainer = jl.Trainer(max_epochs=2, callbacks=[Reader()], **quiet())
    trainer.fit(model, batches())
    assert len(seen) == 24 and len(model.norms) == 12
    for _, _, from_module, from_state in seen:
        np.testing.assert_array_equal(from_module, from_state)  # the module shows the current train state
    assert not np.allclose(seen[0][2], seen[1][2])  # and it moves step by step
    np.testing.assert_allclose(model.norms[-1], np.abs(kernel(model)).sum(), rtol=1e-6)


def test_only_user_written_per_batch_hooks_make_the_loop_sync_the_module():
    trainer = jl.Trainer(max_epochs=1, **quiet(enable_progress_bar=True, enable_checkpointing=True))
    trainer.fit(Lin(), batches(8))  # progress bar, checkpoint, preemption: jaxlight's own callbacks
    assert not trainer.hook_reads_module("on_train_batch_end")
    assert not trainer.hook_reads_module("on_train_batch_start")
    lam = jl.callbacks.LambdaCallback(on_train_batch_end=lambda t, m, out, b, i: None)
    trainer = jl.Trainer(max_epochs=1, callbacks=[lam], **quiet())
    trainer.fit(Lin(), batches(8))
    assert trainer.hook_reads_module("on_train_batch_end")
    assert not trainer.hook_reads_module("on_train_batch_start")


# ------------------------------------------------------------------------------- sizing a schedule
@pytest.mark.parametrize(
    ("kw", "rows", "expected_batches", "expected_steps"),
    [
        (dict(max_epochs=3), 24, 6, 18),
        (dict(max_epochs=3, accumulate_grad_batches=4), 24, 6, 6),  # ceil(6 / 4) = 2 per epoch
        (dict(max_epochs=3, accumulate_grad_batches=4, max_steps=5), 24, 6, 5),
        (dict(max_epochs=2, limit_train_batches=0.5), 24, 3, 6),
        (dict(max_epochs=2, limit_train_batches=4, accumulate_grad_batches=3), 24, 4, 4),
        (dict(max_steps=7), 24, 6, 7),  # max_epochs=-1: max_steps
        (dict(max_epochs=2, ragged_batches="drop"), 26, 6, 12),  # the ragged last batch is left out
    ],
)
def test_estimated_stepping_batches_sizes_a_schedule(kw, rows, expected_batches, expected_steps):
    torch = pytest.importorskip("torch")
    seen = {}

    class OneCycle(Lin):
        def configure_optimizers(self):
            t = self.trainer
            seen["batches"], seen["steps"] = t.num_training_batches, t.estimated_stepping_batches
            sched = optax.linear_schedule(0.05, 0.0, seen["steps"])
            return {"optimizer": optax.inject_hyperparams(optax.sgd)(learning_rate=0.05), "lr_scheduler": sched}

    x, y = data(rows)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), 4)
    trainer = jl.Trainer(**quiet(**kw))
    trainer.fit(OneCycle(), loader)
    assert seen == {"batches": expected_batches, "steps": expected_steps}
    assert trainer.global_step == expected_steps  # the schedule was sized for exactly the steps taken


def test_estimated_stepping_batches_without_a_loader_length():
    class Stream:
        def __iter__(self):
            return iter(batches())

    seen = {}

    class Probe(Lin):
        def configure_optimizers(self):
            seen["steps"] = self.trainer.estimated_stepping_batches
            return optax.sgd(0.05)

    jl.Trainer(**quiet(max_epochs=2, max_steps=9)).fit(Probe(), Stream())
    assert seen["steps"] == 9
    jl.Trainer(**quiet(max_epochs=1)).fit(Probe(), Stream())
    assert seen["steps"] == -1  # Lightning: max_steps when the epoch length is unknown
    assert jl.Trainer(**quiet(max_epochs=-1, max_steps=-1)).estimated_stepping_batches == math.inf


# ------------------------------------------------------------------------------- on_fit_start
def test_weights_loaded_in_on_fit_start_are_trained_on():
    pretrained = np.full((IN, 1), 0.5, np.float32)

    class Pretrained(Lin):
        def on_fit_start(self):
            self.net.kernel[...] = jnp.asarray(pretrained)

    first = {}

    class First(jl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            first.setdefault("kernel", np.asarray(trainer.train_state.params["net/kernel"]))

    model = Pretrained()
    jl.Trainer(max_epochs=1, callbacks=[First()], **quiet()).fit(model, batches())
    np.testing.assert_array_equal(first["kernel"], pretrained)
    # the same as a module created with those weights
    ref = Lin()
    ref.net.kernel[...] = jnp.asarray(pretrained)
    jl.Trainer(max_epochs=1, **quiet()).fit(ref, batches())
    np.testing.assert_allclose(kernel(model), kernel(ref), rtol=1e-6)


# ------------------------------------------------------------------------------- smaller fixes
def test_fit_refuses_a_frozen_module():
    model = Lin()
    model.freeze()
    with pytest.raises(jl.MisconfigurationError, match=r"is frozen.*unfreeze\(\)"):
        jl.Trainer(max_epochs=1, **quiet()).fit(model, batches())
    model.unfreeze()
    jl.Trainer(max_epochs=1, **quiet()).fit(model, batches())


def test_hparams_a_checkpoint_cannot_store_fail_at_fit_start():
    class Started(jl.Callback):
        batches = 0

        def on_train_batch_start(self, *args):
            Started.batches += 1

    model = Lin(lr=0.05)
    model.save_hyperparameters({"lr": 0.05, "lock": threading.Lock()})
    with pytest.raises(CheckpointError, match=r"checkpoint\['hyper_parameters'\]\['lock'\].*ignore="):
        jl.Trainer(max_epochs=1, callbacks=[Started()], **quiet(enable_checkpointing=True)).fit(model, batches())
    assert Started.batches == 0  # before any work
    # without checkpointing nothing is saved, so nothing to check
    jl.Trainer(max_epochs=1, **quiet()).fit(model, batches())


def test_ckpt_path_last_without_a_checkpoint_warns_and_starts_fresh(tmp_path):
    trainer = jl.Trainer(max_epochs=1, default_root_dir=str(tmp_path), **quiet(enable_checkpointing=True))
    with pytest.warns(UserWarning, match=r"ckpt_path='last': no complete checkpoint found.*starts without"):
        trainer.fit(Lin(), batches(), ckpt_path="last")
    assert trainer.global_step == 6
    # the second run resumes from the first one's checkpoint
    again = jl.Trainer(max_epochs=2, default_root_dir=str(tmp_path), **quiet(enable_checkpointing=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again.fit(Lin(), batches(), ckpt_path="last")
    assert not [w for w in caught if "ckpt_path='last'" in str(w.message)]
    assert again.global_step == 12 and again.ckpt_path is not None


def test_datamodule_save_hyperparameters(tmp_path):
    class DM(jl.LightningDataModule):
        def __init__(self, rows: int = 24, batch_size: int = 4, noise=None):
            super().__init__()
            self.save_hyperparameters(ignore=["noise"])

        def train_dataloader(self):
            return batches(self.hparams.rows, self.hparams.batch_size)

    dm = DM(batch_size=6, noise=object())
    assert dict(dm.hparams) == {"rows": 24, "batch_size": 6} and dm.hparams.batch_size == 6
    logger = jl.loggers.CSVLogger(str(tmp_path), name="logs")
    trainer = jl.Trainer(max_epochs=1, **quiet(logger=logger, enable_checkpointing=True))
    trainer.fit(Lin(), datamodule=dm)
    import yaml

    with open(os.path.join(logger.log_dir, "hparams.yaml")) as f:
        hp = yaml.safe_load(f)
    assert hp["batch_size"] == 6 and hp["lr"] == 0.05
    ckpt = trainer.checkpoint_callback.last_model_path or trainer.checkpoint_callback.best_model_path
    from jaxlight.checkpoint import host_checkpoint, read_meta

    assert host_checkpoint(read_meta(ckpt), ckpt)["datamodule_hyper_parameters"] == {"rows": 24, "batch_size": 6}


class BN(jl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nnx.Sequential(nnx.Linear(IN, 8, rngs=nnx.Rngs(0)), nnx.BatchNorm(8, rngs=nnx.Rngs(0)))

    def training_step(self, batch, batch_idx):
        return (self.net(batch[0]) ** 2).mean()

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def configure_optimizers(self):
        return optax.sgd(0.01)


def test_eval_mode_and_freeze_survive_the_trainer():
    model = BN()
    jl.Trainer(max_epochs=1, **quiet()).fit(model, batches(16))
    model.eval()
    x = data(8)[0]
    preds = jl.Trainer(**quiet()).predict(model, [(x,)])
    assert model.net.layers[1].use_running_average  # predict left the user's eval mode alone
    np.testing.assert_allclose(np.asarray(preds[0]), np.asarray(model(jnp.asarray(x))), rtol=1e-5)
    model.freeze()
    jl.Trainer(**quiet()).predict(model, [(x,)])
    assert model.frozen and model.net.layers[1].use_running_average
    model.unfreeze()
    jl.Trainer(max_epochs=1, **quiet()).fit(model, batches(16))
    assert not model.net.layers[1].use_running_average  # fit leaves the training mode it found
