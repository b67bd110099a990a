"""Model, data and trainer shared by the checkpoint tests and their subprocess workers."""

from __future__ import annotations

import numpy as np
import optax
from flax import nnx

import jaxlight as jl


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
    return jl.Trainer(
        logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[*callbacks, ckpt], **kw
    )


def host_params(trainer: jl.Trainer) -> dict[str, np.ndarray]:
    import jax

    return {k: np.asarray(jax.device_get(v)) for k, v in trainer.train_state.params.items()}
