"""Callbacks: small host-side plug-ins called at Lightning's hook points."""

from jaxlight.callbacks.callback import Callback
from jaxlight.callbacks.lambda_function import LambdaCallback
from jaxlight.callbacks.progress import TQDMProgressBar
from jaxlight.callbacks.timer import Timer

__all__ = ["Callback", "LambdaCallback", "TQDMProgressBar", "Timer"]
