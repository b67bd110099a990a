"""A CNN classifier with a LightningDataModule, a cosine learning-rate schedule, gradient clipping, gradient
accumulation, bf16 mixed precision and FSDP: the jaxlight port of cnn_lightning.py.

Ported by following docs/migration.md: the DataModule and its torch loaders stay (the images are turned
channels-last once, in ``setup``); the CNN becomes an NNX twin with torch's BatchNorm momentum and epsilon
and conv padding; SGD with weight decay becomes ``optax.chain(add_decayed_weights, sgd)`` and
``CosineAnnealingLR`` an ``optax.cosine_decay_schedule`` sized by ``estimated_stepping_batches``; the loss
is computed from fp32 logits under bf16; the last validation batch is padded, so accuracy and loss reduce
with ``jl.batch_mask``. Clipping, accumulation, precision and strategy are the same Trainer arguments.

Run: python tests/migration_programs/cnn_jaxlight.py --devices 8
(on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count=8 python ...)
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx
from torch.utils.data import DataLoader, TensorDataset

import jaxlight as jl
from jaxlight.migrate import load_torch_weights

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


def channels_last(x: np.ndarray, y: np.ndarray) -> TensorDataset:
    return TensorDataset(torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 3, 1))), torch.from_numpy(y))


class QuadrantData(jl.LightningDataModule):
    def __init__(self, batch_size: int = 32, train_rows: int = 512, val_rows: int = 100) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        self.train_set = channels_last(*make_images(self.hparams.train_rows, seed=1))  # NCHW -> NHWC, once
        self.val_set = channels_last(*make_images(self.hparams.val_rows, seed=2))

    def train_dataloader(self):
        shuffle = torch.Generator().manual_seed(0)
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True, generator=shuffle)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)  # 100 rows: the last batch has 4


def max_pool(x):
    return nnx.max_pool(x, (2, 2), strides=(2, 2))


class CNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.features = nnx.Sequential(  # the same positions as torch's nn.Sequential, so the weights load
            nnx.Conv(3, 16, (3, 3), padding=1, rngs=rngs),
            nnx.BatchNorm(16, momentum=0.9, epsilon=1e-5, rngs=rngs),
            nnx.relu,
            max_pool,
            nnx.Conv(16, 32, (3, 3), padding=1, rngs=rngs),
            nnx.BatchNorm(32, momentum=0.9, epsilon=1e-5, rngs=rngs),
            nnx.relu,
        )
        self.head = nnx.Linear(32, CLASSES, rngs=rngs)

    def __call__(self, x):  # x: (N, H, W, C)
        return self.head(self.features(x).mean((1, 2)))


class LitCNN(jl.LightningModule):
    def __init__(
        self, lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 5e-4, init_weights: str | None = None
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def configure_model(self) -> None:
        self.model = CNN(nnx.Rngs(0))

    def on_fit_start(self) -> None:
        if self.hparams.init_weights:  # the torch model's initial weights (model.features.0.weight, ...)
            load_torch_weights(self, self.hparams.init_weights)

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x).astype(jnp.float32)  # the loss in fp32 under bf16-mixed, as torch's autocast does
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        mask = jl.batch_mask(batch)  # the last batch (4 rows) is padded to 32
        logits = self(x).astype(jnp.float32)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        self.log("val_loss", (loss * mask).sum() / mask.sum(), prog_bar=True)
        self.log("val_acc", ((logits.argmax(-1) == y) * mask).sum() / mask.sum(), prog_bar=True)

    def configure_optimizers(self):
        hp = self.hparams
        schedule = optax.cosine_decay_schedule(hp.lr, decay_steps=self.trainer.estimated_stepping_batches)
        sgd = optax.chain(optax.add_decayed_weights(hp.weight_decay), optax.sgd(schedule, momentum=hp.momentum))
        return {"optimizer": sgd, "lr_scheduler": schedule}


def main(
    root_dir: str = "cnn_runs",
    strategy: str = "fsdp",
    devices: int = 8,
    precision: str = "bf16-mixed",
    max_epochs: int = 3,
    init_weights: str | None = None,
) -> dict:
    jl.seed_everything(0)
    model = LitCNN(init_weights=init_weights)
    losses: list[float] = []

    class LossHistory(jl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = jl.Trainer(
        max_epochs=max_epochs,
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
        "mesh": dict(trainer.mesh.shape),
        "param_dtype": str(trainer.train_state.params["model/head/kernel"].dtype),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--root-dir", default="cnn_runs")
    args = parser.parse_args()
    result = main(args.root_dir, args.strategy, args.devices, args.precision)
    print(
        {k: v for k, v in result.items() if k != "losses"}, "first/last loss", result["losses"][0], result["losses"][-1]
    )
