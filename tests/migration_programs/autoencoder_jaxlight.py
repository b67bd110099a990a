"""An autoencoder with checkpointing and early stopping: the jaxlight port of autoencoder_lightning.py.

Ported by following docs/migration.md: the layers move to ``configure_model`` as flax NNX modules, the
loss is written with ``jax.numpy``, Adam comes from optax, the torch loaders, ``ModelCheckpoint`` and
``EarlyStopping`` stay as they were. The validation loader's last batch is padded, so the step reduces
with ``jl.batch_mask``. ``init_weights`` starts from the original's torch weights (``load_torch_weights`` in
``on_fit_start``), which makes the two runs comparable number by number.

Run: python tests/migration_programs/autoencoder_jaxlight.py [root_dir]
"""

from __future__ import annotations

import sys

import numpy as np
import optax
import torch
from flax import nnx
from torch.utils.data import DataLoader, TensorDataset

import jaxlight as jl
from jaxlight.callbacks import EarlyStopping, ModelCheckpoint
from jaxlight.migrate import load_torch_weights

FEATURES, LATENT = 32, 4


def make_data(rows: int, seed: int) -> np.ndarray:
    """Points near a 4-dimensional subspace of R^32, plus noise."""
    rng = np.random.default_rng(0)
    basis = rng.normal(size=(LATENT, FEATURES)) / np.sqrt(LATENT)
    codes = np.random.default_rng(seed).normal(size=(rows, LATENT))
    noise = 0.1 * np.random.default_rng(seed + 100).normal(size=(rows, FEATURES))
    return (np.tanh(codes) @ basis + noise).astype(np.float32)


def masked_mse(x_hat, x, mask):
    """The mean squared error over the batch's real rows (a padded last evaluation batch has copies)."""
    per_row = ((x_hat - x) ** 2).mean(-1)
    return (per_row * mask).sum() / mask.sum()


class LitAutoEncoder(jl.LightningModule):
    def __init__(self, lr: float = 1e-2, hidden: int = 16, init_weights: str | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()

    def configure_model(self) -> None:
        rngs, hidden = nnx.Rngs(0), self.hparams.hidden
        self.encoder = nnx.Sequential(
            nnx.Linear(FEATURES, hidden, rngs=rngs), nnx.relu, nnx.Linear(hidden, LATENT, rngs=rngs)
        )
        self.decoder = nnx.Sequential(
            nnx.Linear(LATENT, hidden, rngs=rngs), nnx.relu, nnx.Linear(hidden, FEATURES, rngs=rngs)
        )

    def on_fit_start(self) -> None:
        if self.hparams.init_weights:  # the torch model's initial weights: same names, encoder.0.weight ...
            load_torch_weights(self, self.hparams.init_weights)

    def forward(self, x):
        return self.decoder(self.encoder(x))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = ((self(x) - x) ** 2).mean()
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        (x,) = batch
        self.log("val_loss", masked_mse(self(x), x, jl.batch_mask(batch)), prog_bar=True)

    def test_step(self, batch, batch_idx):
        (x,) = batch
        self.log("test_loss", masked_mse(self(x), x, jl.batch_mask(batch)))

    def configure_optimizers(self):
        return optax.adam(self.hparams.lr)


def loaders(batch_size: int = 16):
    train = TensorDataset(torch.from_numpy(make_data(128, seed=1)))
    val = TensorDataset(torch.from_numpy(make_data(40, seed=2)))  # 40 rows: the last batch has 8
    shuffle = torch.Generator().manual_seed(0)
    return (
        DataLoader(train, batch_size=batch_size, shuffle=True, generator=shuffle),
        DataLoader(val, batch_size=batch_size),
    )


def main(root_dir: str = "ae_runs", max_epochs: int = 40, init_weights: str | None = None) -> dict:
    """Train until early stopping; return what the run leaves behind (plain Python data)."""
    jl.seed_everything(0)
    model = LitAutoEncoder(init_weights=init_weights)
    train, val = loaders()
    checkpoint = ModelCheckpoint(
        monitor="val_loss", mode="min", save_top_k=2, save_last=True, filename="ae-{epoch:02d}-{val_loss:.3f}"
    )
    early = EarlyStopping(monitor="val_loss", patience=3, min_delta=1e-3)
    trainer = jl.Trainer(
        max_epochs=max_epochs,
        callbacks=[checkpoint, early],
        default_root_dir=root_dir,
        accelerator="cpu",
        devices=1,
        log_every_n_steps=4,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, train, val)
    best = LitAutoEncoder.load_from_checkpoint(checkpoint.best_model_path)
    test = trainer.test(best, dataloaders=val, verbose=False)
    return {
        "stopped_epoch": early.stopped_epoch,
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "best_model_path": checkpoint.best_model_path,
        "best_model_score": float(checkpoint.best_model_score),
        "best_k_models": sorted(checkpoint.best_k_models),
        "last_model_path": checkpoint.last_model_path,
        "test_loss": test[0]["test_loss"],
        "log_dir": trainer.log_dir,
    }


if __name__ == "__main__":
    print(main(*sys.argv[1:2]))
