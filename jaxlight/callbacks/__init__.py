"""Callbacks: small host-side plug-ins called at Lightning's hook points."""

from jaxlight.callbacks.callback import Callback
from jaxlight.callbacks.early_stopping import EarlyStopping
from jaxlight.callbacks.ema import EMA
from jaxlight.callbacks.finetuning import BackboneFinetuning, BaseFinetuning
from jaxlight.callbacks.lambda_function import LambdaCallback
from jaxlight.callbacks.lr_monitor import LearningRateMonitor
from jaxlight.callbacks.model_checkpoint import ModelCheckpoint
from jaxlight.callbacks.model_summary import ModelSummary
from jaxlight.callbacks.nonfinite import NonFiniteError, NonFiniteGuard
from jaxlight.callbacks.preemption import Preemption
from jaxlight.callbacks.profiler import ProfilerWindow
from jaxlight.callbacks.progress import TQDMProgressBar
from jaxlight.callbacks.swa import StochasticWeightAveraging
from jaxlight.callbacks.throughput import ThroughputMonitor
from jaxlight.callbacks.timer import Timer

__all__ = ["Callback", "LambdaCallback", "TQDMProgressBar", "Timer"]
__all__ += [
    "EMA",
    "EarlyStopping",
    "LearningRateMonitor",
    "ModelSummary",
    "NonFiniteError",
    "NonFiniteGuard",
    "ProfilerWindow",
    "ThroughputMonitor",
]
__all__ += ["ModelCheckpoint", "Preemption"]
__all__ += ["BackboneFinetuning", "BaseFinetuning"]
__all__ += ["StochasticWeightAveraging"]
