"""A CNN classifier with a LightningDataModule, a cosine learning-rate schedule, gradient clipping, gradient
accumulation, bf16 mixed precision and FSDP: the PyTorch Lightning original.

Run on a GPU machine: python tests/migration_programs/cnn_lightning.py --devices 2
(Lightning's FSDP needs CUDA; on a CPU: --accelerator cpu --strategy auto)
"""

from __future__ import annotations

import argparse

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

CLASSES = 4


def make_images(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """3x16x16 noise images with a bright 6x6 square in the quadrant given by the label (NCHW, as torch wants)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(scale=0.5, size=(rows, 3, 16, 16)).astype(np.float32)
    y = rng.integers(0, CLASSES, rows)
    for i, label in enumerate(y):
        r, c = 8 * (label // 2) + 1, 8 * (label % 2) + 1
        x[i, :, r : r + 6, c : c + 6] += 1.5
    return x, y.astype(np.int64)


class QuadrantData(pl.LightningDataModule):
    def __init__(self, batch_size: int = 32, train_rows: int = 512, val_rows: int = 100) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        self.train_set = TensorDataset(*map(torch.from_numpy, make_images(self.hparams.train_rows, seed=1)))
        self.val_set = TensorDataset(*map(torch.from_numpy, make_images(self.hparams.val_rows, seed=2)))

    def train_dataloader(self):
        shuffle = torch.Generator().manual_seed(0)
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True, generator=shuffle)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)  # 100 rows: the last batch has 4


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
        )
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x):  # x: (N, C, H, W)
        return self.head(self.features(x).mean((2, 3)))


class LitCNN(pl.LightningModule):
    def __init__(self, lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 5e-4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = CNN()

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self):
        opt = torch.optim.SGD(
            self.parameters(),
            lr=self.hparams.lr,
            momentum=self.hparams.momentum,
            weight_decay=self.hparams.weight_decay,
        )
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.trainer.estimated_stepping_batches)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main(
    root_dir: str = "cnn_runs",
    accelerator: str = "gpu",
    strategy: str = "fsdp",
    devices: int = 1,
    precision: str = "bf16-mixed",
    max_epochs: int = 3,
    init_weights: str | None = None,
) -> dict:
    pl.seed_everything(0)
    model = LitCNN()
    if init_weights is not None:
        torch.save(model.state_dict(), init_weights)  # the initial weights, for the port to start from
    losses: list[float] = []

    class LossHistory(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = pl.Trainer(
        max_epochs=max_epochs,
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        precision=precision,
        gradient_clip_val=1.0,
        accumulate_grad_batches=2,
        callbacks=[LossHistory()],
        default_root_dir=root_dir,
        log_every_n_steps=4,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, datamodule=QuadrantData())
    return {
        "losses": losses,
        "global_step": trainer.global_step,
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "val_acc": float(trainer.callback_metrics["val_acc"]),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--accelerator", default="gpu")
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--root-dir", default="cnn_runs")
    args = parser.parse_args()
    result = main(args.root_dir, args.accelerator, args.strategy, args.devices, args.precision)
    print(
        {k: v for k, v in result.items() if k != "losses"}, "first/last loss", result["losses"][0], result["losses"][-1]
    )
