"""NonFiniteGuard: a NaN/Inf loss or gradient norm stops the run (or skips the update), naming the step."""

from __future__ import annotations

import collections
import math
from typing import Any

import jax
import numpy as np

from jaxlight.callbacks.callback import Callback
from jaxlight.rank_zero import rank_zero_warn
from jaxlight.step_info import StepInfo


class NonFiniteError(FloatingPointError):
    """Training produced a non-finite loss or gradient norm."""

    def __init__(self, message: str, step: int, epoch: int, batch_idx: int) -> None:
        super().__init__(message)
        self.step, self.epoch, self.batch_idx = step, epoch, batch_idx


class NonFiniteGuard(Callback):
    """Checks every train step's loss and global gradient norm for NaN/Inf, without a per-step sync.

    ``action="stop"`` (default) raises :class:`NonFiniteError` naming the
    optimizer step (0-based, the step loggers use), epoch and batch index
    where it first happened. ``action="skip"`` makes the compiled step keep
    parameters, optimizer state and other variables unchanged when the
    step's loss or gradient norm is non-finite (the update is dropped; the
    optimizer's step count does not advance) and prints a warning naming each
    skipped step; under ``accumulate_grad_batches`` the bad micro-batch
    contributes a zero gradient to its window instead, so update boundaries
    stay aligned with ``global_step``; ``self.skipped`` lists them. Either way nothing continues
    silently. The values are read after the trainer's bounded run-ahead wait
    has already synced their step (at most ``jaxlight.config.RUN_AHEAD`` = 4 steps behind the host), and
    the last steps are checked at epoch and train end, so a stop happens at
    most that many steps after the bad one but always reports that exact step.
    The gradient norm is also returned in the step outputs as
    ``"grad_norm"``. Under ``precision="16-mixed"`` the loss scaler owns non-finite gradients (it skips the
    update and lowers the scale, as torch's GradScaler does), so the guard checks the loss only.
    """

    needs_grad_norm = True

    def __init__(self, action: str = "stop", verbose: bool = True) -> None:
        if action not in ("stop", "skip"):
            raise ValueError(f"NonFiniteGuard action={action!r}; choose 'stop' or 'skip'")
        self.action = action
        self.verbose = verbose
        self.skipped: list[int] = []
        self._pending: collections.deque = collections.deque()

    @property
    def skip_nonfinite_updates(self) -> bool:  # type: ignore[override]
        return self.action == "skip"

    # -- the logic on a StepInfo (no Trainer)
    def start(self) -> None:
        """A new training run: nothing pending."""
        self._pending.clear()

    def on_step(self, info: StepInfo) -> None:
        """Queue the train batch of ``info`` (``info.outputs["loss"]`` and ``"grad_norm"``, unsynced) and check
        the batches older than the run-ahead window, which the trainer has already waited for; raises
        :class:`NonFiniteError` (``action="stop"``) naming the first bad step."""
        # the optimizer update this batch contributes to (the position has already counted it)
        step = info.global_step - 1 if info.stepped else info.global_step
        outputs = info.outputs
        # under "16-mixed" (a "loss_scale" output) a non-finite gradient is expected now and then: the loss
        # scaler skips that update and lowers the scale, so only the loss is checked
        scaled = "loss_scale" in outputs
        gnorm = None if scaled else outputs.get("grad_norm")
        self._pending.append((step, info.epoch, info.batch_idx, outputs["loss"], gnorm, scaled))
        # entries older than the run-ahead window belong to steps the trainer has already waited for
        from jaxlight.config import RUN_AHEAD

        ready = []
        while len(self._pending) > RUN_AHEAD:
            ready.append(self._pending.popleft())
        self._check(ready)

    def flush(self) -> None:
        """Check every batch still pending (at epoch and train end)."""
        ready = list(self._pending)
        self._pending.clear()
        self._check(ready)

    # -- Lightning hooks: build the StepInfo and call the logic
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.start()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.on_step(StepInfo.of_trainer(trainer, outputs=outputs, batch_idx=batch_idx))  # not the batch: see Timer

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.flush()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.flush()

    def _check(self, entries: list[tuple]) -> None:
        if not entries:
            return
        values = jax.device_get([(loss, gn) for _, _, _, loss, gn, _ in entries])  # one transfer
        for (step, epoch, idx, _, _, scaled), (loss, gn) in zip(entries, values):
            loss = float(np.asarray(loss))
            gn = float(np.asarray(gn)) if gn is not None else 0.0
            if math.isfinite(loss) and math.isfinite(gn):
                continue
            what = f"loss={loss}" if scaled else f"loss={loss}, grad_norm={gn}"
            if self.action == "skip":
                self.skipped.append(step)
                if self.verbose:
                    rank_zero_warn(
                        f"NonFiniteGuard: non-finite {what} at step {step} (epoch {epoch}, batch {idx}); "
                        f"the update was skipped"
                    )
                continue
            self._pending.clear()
            raise NonFiniteError(
                f"Non-finite {what} at step {step} (epoch {epoch}, batch {idx}); stopping. Use "
                f"NonFiniteGuard(action='skip') to drop such updates instead.",
                step,
                epoch,
                idx,
            )
