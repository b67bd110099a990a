"""Helpers shared by the tests and their worker scripts: a free TCP port, waiting for other processes' files,
quiet Trainer arguments, and callbacks that record what training produced or send a signal mid-fit.

Worker scripts run as plain programs (``python tests/some_worker.py``) put the repository root on
``sys.path`` before importing this module, so ``from tests.helpers import ...`` works there too.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

import jaxlight as jl

__all__ = ["Losses", "Record", "SignalAt", "free_port", "host_params", "quiet", "wait_for_files"]


def free_port() -> int:
    """A TCP port on localhost that is free now (the OS picks it), for a ``jax.distributed`` coordinator."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def wait_for_files(paths: Iterable[Path], timeout: float = 60.0) -> None:
    """Waits until every one of ``paths`` exists (files other processes write); fails the test, naming the
    missing ones, after ``timeout`` seconds."""
    import pytest  # here, not at the top: worker scripts import this module and need no pytest

    paths = list(paths)
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {[str(p) for p in paths if not p.exists()]}")
        time.sleep(0.05)


# What quiet() turns off; each of these Trainer arguments defaults to None (the Trainer's own choice).
_QUIET: dict[str, Any] = dict(
    enable_progress_bar=False,
    enable_model_summary=False,
    logger=False,
    enable_checkpointing=False,
    num_sanity_val_steps=0,
)


def quiet(**overrides: Any) -> dict[str, Any]:
    """Trainer kwargs without progress bar, model summary, loggers, checkpoints or sanity validation.

    ``overrides`` replace or extend them. ``None`` for one of those five leaves it out of the result, so the
    Trainer's own default applies and the caller may still pass it to the Trainer itself: e.g.
    ``jl.Trainer(enable_checkpointing=flag, **quiet(enable_checkpointing=None))``.
    """
    out = {**_QUIET, **overrides}
    return {k: v for k, v in out.items() if not (k in _QUIET and v is None)}


def host_params(trainer: jl.Trainer) -> dict[str, np.ndarray]:
    """Host copies of the trainer's parameters, keyed as its train state keys them (``"net/l1/kernel"``)."""
    return {k: np.asarray(jax.device_get(v)) for k, v in trainer.train_state.params.items()}


class Losses(jl.Callback):
    """Records ``outputs[key]`` after every training batch in ``self.losses``.

    Args:
        key: the output to record; a sequence of keys records a tuple of those outputs per step.
        as_float: convert each value with ``float`` (a host sync per step); otherwise the value is kept
            as returned (a device scalar), without syncing.
    """

    def __init__(self, key: str | Sequence[str] = "loss", as_float: bool = False) -> None:
        self.key = key
        self.as_float = as_float
        self.losses: list = []

    def _value(self, outputs: Any, key: str) -> Any:
        return float(outputs[key]) if self.as_float else outputs[key]

    def record(self, outputs: Any) -> None:
        """Appends this step's value(s) from ``outputs``: for subclasses that add to the hook below (they
        call this instead of ``super().on_train_batch_end``, whose passing ``batch`` on would count as
        reading it: jaxlight places the batch on the devices only for hooks that read it)."""
        if isinstance(self.key, str):
            self.losses.append(self._value(outputs, self.key))
        else:
            self.losses.append(tuple(self._value(outputs, k) for k in self.key))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.record(outputs)


class Record(Losses):
    """:class:`Losses`, plus the parameters the run starts from: at ``on_fit_start`` (after placement and
    any checkpoint restore) ``start_params`` holds host copies of ``trainer.train_state.params`` and
    ``start_shardings`` their shardings, keyed as the train state keys them."""

    def __init__(self, key: str | Sequence[str] = "loss", as_float: bool = False) -> None:
        super().__init__(key, as_float)
        self.start_params: dict[str, np.ndarray] | None = None
        self.start_shardings: dict[str, Any] | None = None

    def on_fit_start(self, trainer, pl_module) -> None:
        self.start_params = host_params(trainer)
        self.start_shardings = {k: v.sharding for k, v in trainer.train_state.params.items()}


class SignalAt(jl.Callback):
    """Sends signal ``sig`` to this process after micro-batch ``at`` of the run (``trainer.position.micro_batches``
    at ``on_train_batch_end``): a preemption arriving mid-fit (jaxlight's handler only sets a flag)."""

    def __init__(self, at: int, sig: int = signal.SIGTERM) -> None:
        self.at, self.sig = at, sig

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.position.micro_batches == self.at:
            os.kill(os.getpid(), self.sig)
