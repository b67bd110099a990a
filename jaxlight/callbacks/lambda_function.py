"""LambdaCallback: hooks from plain functions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxlight.callbacks.callback import Callback


class LambdaCallback(Callback):
    """Build a callback from keyword functions named after hooks
    (``LambdaCallback(on_train_epoch_end=lambda trainer, module: ...)``)."""

    def __init__(self, **hooks: Callable[..., Any]) -> None:
        for name, fn in hooks.items():
            is_hook = name.startswith("on_") or name in ("setup", "teardown")
            if not (is_hook and callable(getattr(Callback, name, None))):
                raise ValueError(f"LambdaCallback got {name!r}, which is not a Callback hook")
            if not callable(fn):
                raise TypeError(f"LambdaCallback {name} must be callable")
            setattr(self, name, fn)
