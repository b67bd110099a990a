"""Loggers: where metrics and hyperparameters go (process 0 only).

Optional backends (wandb, mlflow, tensorboard) are imported only when their
logger is constructed.
"""

from jaxlight.loggers.csv_logs import CSVLogger
from jaxlight.loggers.logger import Logger, LoggerCollection
from jaxlight.loggers.mlflow import MLFlowLogger
from jaxlight.loggers.tensorboard import TensorBoardLogger
from jaxlight.loggers.wandb import WandbLogger

__all__ = ["CSVLogger", "Logger", "LoggerCollection"]
__all__ += ["MLFlowLogger", "TensorBoardLogger", "WandbLogger"]
