"""jaxlight: a PyTorch-Lightning-style trainer over JAX.

Subclass :class:`LightningModule`, pick a strategy, call
``Trainer(...).fit(model, datamodule)``. The trainer compiles one SPMD step
and places it on a device mesh.
"""

from jaxlight import callbacks, distributed, loggers, nn, optim, planner, strategies
from jaxlight.callbacks import Callback
from jaxlight.checkpoint import CheckpointError, Preempted
from jaxlight.data import batch_mask
from jaxlight.datamodule import LightningDataModule
from jaxlight.errors import NonFiniteLossWarning
from jaxlight.loss_scale import GradScaler
from jaxlight.module import LightningModule
from jaxlight.precision import MixedPrecision
from jaxlight.seed import seed_everything
from jaxlight.step import TrainState
from jaxlight.tracing import StepError
from jaxlight.trainer import MisconfigurationError, Trainer
from jaxlight.verify import verify

__version__ = "0.1.0"

__all__ = [
    "Callback",
    "CheckpointError",
    "GradScaler",
    "Preempted",
    "LightningDataModule",
    "LightningModule",
    "MisconfigurationError",
    "MixedPrecision",
    "NonFiniteLossWarning",
    "StepError",
    "Trainer",
    "TrainState",
    "batch_mask",
    "callbacks",
    "distributed",
    "loggers",
    "nn",
    "optim",
    "planner",
    "seed_everything",
    "strategies",
    "verify",
]
