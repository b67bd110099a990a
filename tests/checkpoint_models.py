"""Model, data and trainer shared by the checkpoint tests and their subprocess workers."""

from __future__ import annotations

import numpy as np
import optax
from flax import nnx

import jaxlight as jl
from tests.helpers import host_params, quiet  # noqa: F401 - host_params re-exported: tests import it from here


class Net(nnx.Module):
    def __init__(self, din: int, hidden: int, dout: int, dropout: float, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(din, hidden, rngs=rngs)
        self.do = nnx.Dropout(dropout, rngs=rngs)
        self.l2 = nnx.Linear(hidden, dout, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.do(nnx.relu(self.l1(x))))


class DropoutClassifier(jl.LightningModule):
    """MLP with dropout (an RNG stream in the NNX state) trained with Adam."""

    def __init__(self, din: int = 8, hidden: int = 32, dout: int = 4, dropout: float = 0.2, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()

    def configure_model(self) -> None:
        hp = self.hparams
        self.net = Net(hp.din, hp.hidden, hp.dout, hp.dropout, nnx.Rngs(0, dropout=1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = optax.softmax_cross_entropy_with_integer_labels(self.net(x), y).mean()
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", optax.softmax_cross_entropy_with_integer_labels(self.net(x), y).mean())

    def configure_optimizers(self):
        return optax.adam(self.hparams.lr)


def arrays(n: int = 64, din: int = 8, dout: int = 4, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, din)).astype(np.float32)
    y = (x[:, :dout].argmax(-1)).astype(np.int32)
    return x, y


def stateful_loader(n: int = 64, din: int = 8, batch_size: int = 8, seed: int = 0):
    """Shuffled torchdata StatefulDataLoader with a seeded generator (the resume tests' data)."""
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    x, y = arrays(n, din)
    g = torch.Generator()
    g.manual_seed(seed)
    ds = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    return StatefulDataLoader(ds, batch_size=batch_size, shuffle=True, generator=g, drop_last=True)


def trainer(dirpath: str, callbacks=(), every_n_train_steps: int = 2, **kw) -> jl.Trainer:
    kw.setdefault("max_steps", 10)
    kw.setdefault("accumulate_grad_batches", 2)
    ckpt = jl.callbacks.ModelCheckpoint(dirpath=dirpath, every_n_train_steps=every_n_train_steps, save_last="link")
    return jl.Trainer(callbacks=[*callbacks, ckpt], **quiet(enable_checkpointing=None, num_sanity_val_steps=None, **kw))


class NormNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.do = nnx.Dropout(0.25, rngs=rngs)
        self.l2 = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.do(nnx.relu(self.bn(self.l1(x)))))


class NormRegressor(jl.LightningModule):
    """The module of the on-disk compatibility fixture (tests/fixtures/ckpt_v0): BatchNorm statistics and a
    dropout RNG stream (non-parameter NNX state, RNG keys stored as key data), trained with Adam. Do not change
    it: tests/test_checkpoint_compat.py restores a checkpoint written with it."""

    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()

    def configure_model(self) -> None:
        self.net = NormNet(nnx.Rngs(0, dropout=1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = ((self.net(x) - y) ** 2).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return optax.adam(self.hparams.lr)


def norm_batches(n_batches: int = 4, batch_size: int = 8) -> list[tuple[np.ndarray, np.ndarray]]:
    """The fixture's data: a plain list of (x, y) batches (a resume skips the batches already seen)."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(n_batches * batch_size, 4)).astype(np.float32)
    y = np.stack([x[:, 0] - x[:, 1], x[:, 2] * x[:, 3]], -1).astype(np.float32)
    return [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, len(x), batch_size)]


class SaveAt(jl.Callback):
    """``trainer.save_checkpoint(path)`` after global step ``step`` (a mid-epoch, mid-fit checkpoint)."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def norm_trainer(max_steps: int, callbacks=(), **kw) -> jl.Trainer:
    """The fixture's trainer: no checkpoint callback (checkpoints are written with trainer.save_checkpoint)."""
    return jl.Trainer(
        max_steps=max_steps,
        callbacks=[jl.callbacks.EMA(decay=0.9), *callbacks],
        **quiet(num_sanity_val_steps=None, **kw),
    )
