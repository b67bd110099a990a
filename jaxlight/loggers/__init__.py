"""Loggers: where metrics, hyperparameters and artifacts go (process 0 only).

Optional backends (wandb, mlflow, tensorboard) are checked when their logger
is constructed (a missing or too old package raises one ``ModuleNotFoundError``
with the ``pip install`` to run) and imported only when first used.
``LoggerCollection`` is the fan-out the trainer uses: a tracker that fails
during training is warned about once and retried, never stopping the run;
W&B and MLflow are called from a worker thread per logger (``delivery.py``),
so a stalled tracker never stalls a step.
"""

from jaxlight.loggers.csv_logs import CSVLogger
from jaxlight.loggers.logger import Logger, LoggerCollection, LoggerDeliveryWarning
from jaxlight.loggers.mlflow import MLFlowLogger
from jaxlight.loggers.tensorboard import TensorBoardLogger
from jaxlight.loggers.wandb import WandbLogger

__all__ = ["CSVLogger", "Logger", "LoggerCollection", "LoggerDeliveryWarning"]
__all__ += ["MLFlowLogger", "TensorBoardLogger", "WandbLogger"]
