"""Loggers: where metrics and hyperparameters go (process 0 only).

Optional backends (wandb, mlflow, tensorboard) are imported only when their
logger is constructed.
"""

from jaxlight.loggers.csv_logs import CSVLogger
from jaxlight.loggers.logger import Logger, LoggerCollection

__all__ = ["CSVLogger", "Logger", "LoggerCollection"]
