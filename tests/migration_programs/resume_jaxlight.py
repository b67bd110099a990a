"""A training run that crashes and is resumed from its last checkpoint, with a custom callback whose state is
checkpointed: the jaxlight port of resume_lightning.py.

Ported by following docs/migration.md: the callback keeps its hooks, ``state_dict`` and ``load_state_dict``;
``pl_module.parameters()`` becomes ``nnx.state(pl_module.net, nnx.Param)``; torch's ``AdamW`` (weight decay
0.01) with a ``StepLR`` that Lightning steps every epoch becomes an injected ``optax.adamw`` with an
epoch-interval schedule; ``fit(ckpt_path="last")`` resumes. ``init_weights`` starts a fresh run from the
original's torch weights (not a resumed one: the checkpoint's weights are restored before ``on_fit_start``).

Run: python tests/migration_programs/resume_jaxlight.py [root_dir]   (crashes at step 16, then resumes)
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import optax
import torch
from flax import nnx
from torch.utils.data import DataLoader, TensorDataset

import jaxlight as jl
from jaxlight.callbacks import ModelCheckpoint
from jaxlight.migrate import load_torch_weights

IN = 6


class Crash(RuntimeError):
    """Stands for a node failure in the middle of training."""


class TrainingJournal(jl.Callback):
    """Counts the samples trained on, records where every batch ran, logs the weight norm after each epoch.
    Its state goes into every checkpoint, so a resumed run carries on counting."""

    def __init__(self, crash_at_step: int | None = None) -> None:
        self.crash_at_step = crash_at_step
        self.samples = 0
        self.batches: list[tuple[int, int, int]] = []  # (epoch, batch_idx, global_step after the batch)
        self.epoch_losses: list[float] = []
        self._loss_sum = 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.samples += len(batch[0])
        self._loss_sum += float(outputs["loss"])
        self.batches.append((trainer.current_epoch, batch_idx, trainer.global_step))
        if trainer.global_step == self.crash_at_step:
            raise Crash(f"simulated failure at step {trainer.global_step}")

    def on_train_epoch_end(self, trainer, pl_module):
        self.epoch_losses.append(self._loss_sum / trainer.num_training_batches)
        self._loss_sum = 0.0
        norm = optax.global_norm(nnx.state(pl_module.net, nnx.Param))
        pl_module.log("weight_norm", norm)
        pl_module.log("samples_seen", float(self.samples))

    def state_dict(self):
        # the running sum too: a checkpoint taken inside an epoch resumes the epoch's mean
        return {
            "samples": self.samples,
            "batches": self.batches,
            "epoch_losses": self.epoch_losses,
            "loss_sum": self._loss_sum,
        }

    def load_state_dict(self, state_dict):
        self.samples = state_dict["samples"]
        self.batches = list(state_dict["batches"])
        self.epoch_losses = list(state_dict["epoch_losses"])
        self._loss_sum = state_dict["loss_sum"]


class LitRegressor(jl.LightningModule):
    def __init__(self, hidden: int = 32, lr: float = 0.02, init_weights: str | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()

    def configure_model(self) -> None:
        rngs = nnx.Rngs(0)
        self.net = nnx.Sequential(
            nnx.Linear(IN, self.hparams.hidden, rngs=rngs), nnx.tanh, nnx.Linear(self.hparams.hidden, 1, rngs=rngs)
        )

    def on_fit_start(self) -> None:
        if self.hparams.init_weights and self.trainer.ckpt_path is None:  # a fresh run, not a resumed one
            load_torch_weights(self, self.hparams.init_weights)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = ((self.net(x) - y) ** 2).mean()
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", ((self.net(x) - y) ** 2).mean())

    def configure_optimizers(self):
        lr = self.hparams.lr
        adamw = optax.inject_hyperparams(optax.adamw)(learning_rate=lr, eps=1e-6, weight_decay=0.01)
        step_lr = lambda epoch: lr * 0.7 ** (epoch // 2)  # torch's StepLR(step_size=2, gamma=0.7), per epoch
        return {"optimizer": adamw, "lr_scheduler": {"scheduler": step_lr, "interval": "epoch"}}


def make_data(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, IN)).astype(np.float32)
    y = np.sin(x[:, :1] * 2.0) + 0.5 * x[:, 1:2] * x[:, 2:3]
    return x, y.astype(np.float32)


def main(
    root_dir: str = "resume_runs",
    crash_at_step: int | None = None,
    resume: bool = False,
    max_epochs: int = 5,
    init_weights: str | None = None,
    every_n_train_steps: int | None = None,
) -> dict:
    """One run: ``crash_at_step`` makes it fail there; ``resume`` continues from the last checkpoint."""
    model = LitRegressor(init_weights=init_weights)
    train = DataLoader(TensorDataset(*map(torch.from_numpy, make_data(96, seed=1))), batch_size=16)
    val = DataLoader(TensorDataset(*map(torch.from_numpy, make_data(32, seed=2))), batch_size=16)
    journal = TrainingJournal(crash_at_step)
    checkpoint = ModelCheckpoint(
        dirpath=f"{root_dir}/checkpoints", save_last=True, every_n_train_steps=every_n_train_steps
    )
    trainer = jl.Trainer(
        max_epochs=max_epochs,
        callbacks=[journal, checkpoint],
        default_root_dir=root_dir,
        accelerator="cpu",
        devices=1,
        log_every_n_steps=3,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(model, train, val, ckpt_path="last" if resume else None)
    except Crash:
        pass
    return {
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "samples": journal.samples,
        "batches": [tuple(b) for b in journal.batches],
        "epoch_losses": journal.epoch_losses,
        "weight_norm": float(trainer.callback_metrics.get("weight_norm", float("nan"))),
        "val_loss": float(trainer.callback_metrics.get("val_loss", float("nan"))),
        "checkpoints": sorted(p.name for p in Path(checkpoint.dirpath).glob("*.ckpt")),
        "weights": {k: np.asarray(v) for k, v in trainer.train_state.params.items()},
    }


if __name__ == "__main__":
    root = sys.argv[1] if len(sys.argv) > 1 else "resume_runs"
    print("crashed:", {k: v for k, v in main(root, crash_at_step=16).items() if k != "weights"})
    print("resumed:", {k: v for k, v in main(root, resume=True).items() if k != "weights"})
