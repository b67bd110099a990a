"""An autoencoder with checkpointing and early stopping: the PyTorch Lightning original.

Run: python tests/migration_programs/autoencoder_lightning.py [root_dir]
"""

from __future__ import annotations

import sys

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

FEATURES, LATENT = 32, 4


def make_data(rows: int, seed: int) -> np.ndarray:
    """Points near a 4-dimensional subspace of R^32, plus noise."""
    rng = np.random.default_rng(0)
    basis = rng.normal(size=(LATENT, FEATURES)) / np.sqrt(LATENT)
    codes = np.random.default_rng(seed).normal(size=(rows, LATENT))
    noise = 0.1 * np.random.default_rng(seed + 100).normal(size=(rows, FEATURES))
    return (np.tanh(codes) @ basis + noise).astype(np.float32)


class LitAutoEncoder(pl.LightningModule):
    def __init__(self, lr: float = 1e-2, hidden: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, LATENT))
        self.decoder = nn.Sequential(nn.Linear(LATENT, hidden), nn.ReLU(), nn.Linear(hidden, FEATURES))

    def forward(self, x):
        return self.decoder(self.encoder(x))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = F.mse_loss(self(x), x)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        (x,) = batch
        self.log("val_loss", F.mse_loss(self(x), x), prog_bar=True)

    def test_step(self, batch, batch_idx):
        (x,) = batch
        self.log("test_loss", F.mse_loss(self(x), x))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


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
    pl.seed_everything(0)
    model = LitAutoEncoder()
    if init_weights is not None:
        torch.save(model.state_dict(), init_weights)  # the initial weights, for the port to start from
    train, val = loaders()
    checkpoint = ModelCheckpoint(
        monitor="val_loss", mode="min", save_top_k=2, save_last=True, filename="ae-{epoch:02d}-{val_loss:.3f}"
    )
    early = EarlyStopping(monitor="val_loss", patience=3, min_delta=1e-3)
    trainer = pl.Trainer(
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
