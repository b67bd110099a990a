"""Lightning's "PyTorch Lightning CIFAR10 ~94% Baseline Tutorial" (lightning.ai tutorials), shrunk to a CPU
and written twice, for pytorch-lightning and for jaxlight (issue item 9).

The tutorial's ``LitResnet`` returns ``F.log_softmax`` and trains with ``F.nll_loss``; ``evaluate`` logs
``{stage}_loss`` and ``{stage}_acc`` (``torchmetrics``' accuracy) with ``prog_bar=True``;
``configure_optimizers`` returns ``SGD(lr, momentum=0.9, weight_decay=5e-4)`` with ``OneCycleLR(optimizer,
0.1, epochs=self.trainer.max_epochs, steps_per_epoch=...)`` under ``"interval": "step"``; the trainer has a
``CSVLogger`` and ``LearningRateMonitor(logging_interval="step")``; ``fit`` then ``test``. Here the
ResNet-18 is a 2-conv CNN, the data random 3x16x16 images in 10 classes (64 train rows, 32 validation,
32 test, batches of 16, shuffled by torch's global generator as the tutorial's datamodule does), 3 epochs,
``log_every_n_steps=1`` (the default 50 would log no rate in 12 steps). The torch program runs
``OneCycleLR`` with its defaults, ``cycle_momentum=True`` included.

What the jaxlight port writes differently (each line marked ``# port:``), and why:

* The network is an ``nnx.Sequential`` with its layers at torch's positions (parameterless ones as
  functions), channels-last: ``forward`` transposes the NCHW batch (the loaders are the tutorial's), and
  the weights come from the torch model through
  ``jaxlight.migrate.load_torch_weights`` (the test's device for equal initial weights).
* ``F.nll_loss`` of the log-probabilities becomes ``-take_along_axis(...).mean()``; ``torchmetrics``'
  multiclass accuracy (micro average) is ``(argmax == y).mean()``.
* ``SGD(weight_decay=5e-4)`` adds ``5e-4 * param`` to the gradient before the momentum:
  ``optax.chain(optax.add_decayed_weights(weight_decay), optax.sgd(learning_rate, momentum))``, built
  inside ``optax.inject_hyperparams`` so the learning rate (and momentum) are in the optimizer state,
  where ``LearningRateMonitor`` reads them (a rate baked into ``optax.sgd(schedule)`` is not logged).
* ``OneCycleLR`` is not ``optax.cosine_onecycle_schedule``: torch's warm-up ends at step
  ``pct_start * total_steps - 1`` (2.6 here, a float) and its annealing at ``total_steps - 1``, optax's at
  ``int(pct_start * total_steps)`` and ``total_steps``; with 12 steps their rates differ at every step
  after the first, the last one 7.5e3 times (torch is at the final rate, 4e-7, at step 11; optax at step
  12) (``test_one_cycle_schedules_are_torchs``). The port writes torch's two cosine phases as schedules,
  :func:`torch_one_cycle` (computed in float64 on the host, looked up by the update count): what a user
  must write for the same rates.
* ``OneCycleLR``'s default ``cycle_momentum=True`` replaces SGD's ``momentum=0.9`` with a cycle from 0.95
  down to 0.85 (at the peak rate) and back, against the rate: the ``momentum=0.9`` the tutorial writes is
  never used. The port passes :func:`torch_one_cycle`'s momentum schedule as the injected ``momentum``.
  (A torch program with ``cycle_momentum=False`` would port with ``momentum=0.9`` instead.)
* No ``scheduler.step()``: the injected schedules follow the optimizer's update count, so the
  ``lr_scheduler`` entry goes; ``self.trainer.max_epochs`` and ``steps_per_epoch`` are read the same way.

The run harness, not the port: both programs build the model before ``seed_everything(7)`` (the tutorial
seeds first), because torch's initialisation draws from the global generator and the port's does not;
seeded after it, both shuffle the same rows (``tests/test_lightning_rng.py``).
"""

from __future__ import annotations

import csv
import glob
import math
import os
from typing import Any

import numpy as np

IMG, CLASSES, BATCH, EPOCHS = 16, 10, 16, 3
TRAIN_ROWS, VAL_ROWS, TEST_ROWS = 64, 32, 32
STEPS_PER_EPOCH = TRAIN_ROWS // BATCH
MAX_LR, LR = 0.1, 0.05  # OneCycleLR(optimizer, 0.1, ...); LitResnet(lr=0.05), overwritten by the schedule


def images(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random 3x16x16 images (NCHW) in 10 classes, a class-dependent bright patch so the loss falls."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, rows)
    x = rng.normal(size=(rows, 3, IMG, IMG)).astype(np.float32)
    for i, label in enumerate(y):
        x[i, label % 3, label : label + 4, label : label + 4] += 1.5
    return x, y.astype(np.int64)


def _loaders() -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    def ds(rows: int, seed: int) -> TensorDataset:
        return TensorDataset(*map(torch.from_numpy, images(rows, seed)))

    return {
        "train": DataLoader(ds(TRAIN_ROWS, 0), batch_size=BATCH, shuffle=True),
        "val": DataLoader(ds(VAL_ROWS, 1), batch_size=BATCH),
        "test": DataLoader(ds(TEST_ROWS, 2), batch_size=BATCH),
    }


def one_cycle_value(step: int, phases: tuple[tuple[float, float, float], ...]) -> float:
    """torch's ``OneCycleLR._anneal_func`` over its phases ``(end_step, start, end)``, at ``step`` (float64)."""
    start_step = 0.0
    for i, (end_step, start, end) in enumerate(phases):
        if step <= end_step or i == len(phases) - 1:
            pct = (step - start_step) / (end_step - start_step)
            return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
        start_step = end_step
    raise AssertionError("unreachable")


def torch_one_cycle(
    max_lr: float,
    total_steps: int,
    pct_start: float = 0.3,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
    base_momentum: float = 0.85,
    max_momentum: float = 0.95,
) -> tuple[Any, Any]:
    """torch's ``OneCycleLR`` (its defaults: ``anneal_strategy="cos"``, ``three_phase=False``,
    ``cycle_momentum=True``) as two optax schedules of the update count: the learning rate and the momentum
    it cycles. Phase one ends at ``pct_start * total_steps - 1`` (a float), phase two at ``total_steps - 1``.

    The values are torch's formula in float64 on the host, looked up by the count: the same cosine
    evaluated in float32 inside the step is a few ulp off (2.5e-7 relative measured), so the logged rates
    would not be torch's to float32 rounding."""
    import jax.numpy as jnp

    initial = max_lr / div_factor
    ends = (float(pct_start * total_steps) - 1, float(total_steps - 1))
    lr_phases = ((ends[0], initial, max_lr), (ends[1], max_lr, initial / final_div_factor))
    momentum_phases = ((ends[0], max_momentum, base_momentum), (ends[1], base_momentum, max_momentum))

    def schedule(phases: tuple[tuple[float, float, float], ...]) -> Any:
        table = jnp.asarray([one_cycle_value(i, phases) for i in range(total_steps)], jnp.float32)
        return lambda count: table[jnp.minimum(count, total_steps - 1)]

    return schedule(lr_phases), schedule(momentum_phases)


def _quiet_lightning() -> None:
    import logging
    import warnings

    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="pytorch_lightning")
    warnings.filterwarnings("ignore", module="lightning_fabric")
    warnings.filterwarnings("ignore", module="torch")
    warnings.filterwarnings("ignore", module="torchmetrics")


# ============================================================================ the tutorial (pytorch-lightning)
def _tutorial_lightning():
    import pytorch_lightning as pl
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.optim.lr_scheduler import OneCycleLR
    from torchmetrics.functional import accuracy

    def create_model():  # the tutorial's ResNet-18, shrunk to two convolutions
        return nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(16, CLASSES),
        )

    class LitResnet(pl.LightningModule):
        def __init__(self, lr=0.05):
            super().__init__()
            self.save_hyperparameters()
            self.model = create_model()

        def forward(self, x):
            out = self.model(x)
            return F.log_softmax(out, dim=1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self(x)
            loss = F.nll_loss(logits, y)
            self.log("train_loss", loss)
            return loss

        def evaluate(self, batch, stage=None):
            x, y = batch
            logits = self(x)
            loss = F.nll_loss(logits, y)
            preds = torch.argmax(logits, dim=1)
            acc = accuracy(preds, y, task="multiclass", num_classes=CLASSES)

            if stage:
                self.log(f"{stage}_loss", loss, prog_bar=True)
                self.log(f"{stage}_acc", acc, prog_bar=True)

        def validation_step(self, batch, batch_idx):
            self.evaluate(batch, "val")

        def test_step(self, batch, batch_idx):
            self.evaluate(batch, "test")

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(
                self.parameters(),
                lr=self.hparams.lr,
                momentum=0.9,
                weight_decay=5e-4,
            )
            steps_per_epoch = STEPS_PER_EPOCH
            scheduler_dict = {
                "scheduler": OneCycleLR(
                    optimizer,
                    MAX_LR,
                    epochs=self.trainer.max_epochs,
                    steps_per_epoch=steps_per_epoch,
                ),
                "interval": "step",
            }
            return {"optimizer": optimizer, "lr_scheduler": scheduler_dict}

    return LitResnet, pl


# ============================================================================ the port (jaxlight)
def _tutorial_jaxlight():
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jaxlight as jl
    from jaxlight.migrate import load_torch_weights

    def max_pool(x):  # port: torch's parameterless layers are functions in nnx.Sequential
        return nnx.max_pool(x, (2, 2), strides=(2, 2))

    def global_avg_pool(x):  # AdaptiveAvgPool2d(1) and Flatten, channels-last
        return x.mean((1, 2))

    def flatten(x):
        return x

    def create_model():  # port: NNX layers at torch's positions, so load_torch_weights needs no mapping
        rngs = nnx.Rngs(0)
        return nnx.Sequential(
            nnx.Conv(3, 8, (3, 3), padding=1, rngs=rngs),
            nnx.relu,
            max_pool,
            nnx.Conv(8, 16, (3, 3), padding=1, rngs=rngs),
            nnx.relu,
            global_avg_pool,
            flatten,
            nnx.Linear(16, CLASSES, rngs=rngs),
        )

    def accuracy(preds, y):  # port: torchmetrics' multiclass accuracy (micro average)
        return (preds == y).mean()

    def nll_loss(logits, y):  # port: F.nll_loss of log-probabilities
        return -jnp.take_along_axis(logits, y[:, None], axis=1).mean()

    class LitResnet(jl.LightningModule):
        def __init__(self, lr=0.05, init_weights: str | None = None):
            super().__init__()
            self.save_hyperparameters()
            self.model = create_model()
            if init_weights is not None:  # port: the torch model's initial weights
                load_torch_weights(self, init_weights)

        def forward(self, x):
            out = self.model(x.transpose(0, 2, 3, 1))  # port: NCHW batches, channels-last convolutions
            return nnx.log_softmax(out, axis=1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self(x)
            loss = nll_loss(logits, y)
            self.log("train_loss", loss)
            return loss

        def evaluate(self, batch, stage=None):
            x, y = batch
            logits = self(x)
            loss = nll_loss(logits, y)
            preds = jnp.argmax(logits, axis=1)
            acc = accuracy(preds, y)

            if stage:
                self.log(f"{stage}_loss", loss, prog_bar=True)
                self.log(f"{stage}_acc", acc, prog_bar=True)

        def validation_step(self, batch, batch_idx):
            self.evaluate(batch, "val")

        def test_step(self, batch, batch_idx):
            self.evaluate(batch, "test")

        def configure_optimizers(self):
            steps_per_epoch = STEPS_PER_EPOCH
            # port: OneCycleLR is torch's two cosine phases of the update count, for the rate and (its default
            # cycle_momentum=True) the momentum, which replaces momentum=0.9; no scheduler is stepped
            learning_rate, momentum = torch_one_cycle(MAX_LR, self.trainer.max_epochs * steps_per_epoch)

            # port: torch's weight_decay adds wd * param to the gradient, before the momentum
            def sgd(learning_rate, momentum, weight_decay):
                return optax.chain(optax.add_decayed_weights(weight_decay), optax.sgd(learning_rate, momentum))

            # port: injected, so LearningRateMonitor reads the rate from the optimizer state
            return optax.inject_hyperparams(sgd)(learning_rate=learning_rate, momentum=momentum, weight_decay=5e-4)

    return LitResnet, jl


# ============================================================================ running either
def _csv_rows(root: str) -> list[dict[str, str]]:
    (path,) = glob.glob(os.path.join(root, "**", "metrics.csv"), recursive=True)
    with open(path) as f:
        return list(csv.DictReader(f))


def _f(x: Any) -> float:
    return float(np.asarray(x.detach() if hasattr(x, "detach") else x))


def run_tutorial(framework: str, root: str, init: str) -> dict[str, Any]:
    """The tutorial's main: fit, then test. Returns per-step rates (the monitor's ``lrs``, the logged
    ``lr-SGD`` and the CSV rows), per-step train losses, per-epoch validation metrics, the test metrics and
    the final weights as a torch ``state_dict`` of numpy arrays."""
    if framework == "pl":
        _quiet_lightning()
        LitResnet, fw = _tutorial_lightning()
        import torch

        torch.manual_seed(0)  # the harness: initial weights that do not depend on what ran before in this process
        model = LitResnet(lr=LR)
        torch.save(model.state_dict(), init)  # the initial weights, for the port
        extra: dict[str, Any] = {"accelerator": "cpu"}
    else:
        LitResnet, fw = _tutorial_jaxlight()
        model = LitResnet(lr=LR, init_weights=init)
        extra = {}
    fw.seed_everything(7)
    loaders = _loaders()  # the datamodule: the training loader shuffles with torch's global generator

    rec: dict[str, Any] = {"losses": [], "lr_metric": [], "val": []}

    class Record(fw.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            rec["losses"].append(_f(outputs["loss"]))
            rec["lr_metric"].append(_f(trainer.callback_metrics["lr-SGD"]))

        def on_validation_end(self, trainer, pl_module):
            if not trainer.sanity_checking:
                m = trainer.callback_metrics
                rec["val"].append({k: _f(m[k]) for k in ("val_loss", "val_acc")})

    monitor = fw.callbacks.LearningRateMonitor(logging_interval="step")
    trainer = fw.Trainer(
        max_epochs=EPOCHS,
        devices=1,
        logger=fw.loggers.CSVLogger(save_dir=root),
        callbacks=[monitor, Record()],
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        default_root_dir=root,
        **extra,
    )
    trainer.fit(model, loaders["train"], loaders["val"])
    rec["lrs"] = {k: list(v) for k, v in monitor.lrs.items()}
    rec["metric_names"] = sorted(trainer.callback_metrics)
    rec["global_step"] = trainer.global_step
    if framework == "pl":
        rec["weights"] = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    else:
        from jaxlight.migrate import export_torch_weights

        rec["weights"] = {k: np.asarray(v) for k, v in export_torch_weights(model).items()}
    (test,) = trainer.test(model, loaders["test"], verbose=False)
    rec["test"] = {k: float(v) for k, v in test.items()}
    rows = _csv_rows(root)
    rec["csv_lr"] = [(int(r["step"]), float(r["lr-SGD"])) for r in rows if r.get("lr-SGD")]
    rec["csv_columns"] = sorted(rows[0])
    return rec
