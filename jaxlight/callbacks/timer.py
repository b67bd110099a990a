"""Timer: stop training after a wall-clock duration (``Trainer(max_time=...)``)."""

from __future__ import annotations

import re
import time
from datetime import timedelta
from typing import Any

from jaxlight.callbacks.callback import Callback
from jaxlight.rank_zero import rank_zero_info
from jaxlight.step_info import StepInfo


def parse_duration(duration: Any) -> timedelta:
    """Accept "DD:HH:MM:SS", a timedelta, a dict of timedelta kwargs, or seconds."""
    if isinstance(duration, timedelta):
        return duration
    if isinstance(duration, dict):
        return timedelta(**duration)
    if isinstance(duration, (int, float)):
        return timedelta(seconds=duration)
    if isinstance(duration, str) and re.fullmatch(r"\d+:\d{1,2}:\d{1,2}:\d{1,2}", duration):
        d, h, m, s = (int(x) for x in duration.split(":"))
        return timedelta(days=d, hours=h, minutes=m, seconds=s)
    raise ValueError(f"max_time/duration {duration!r} must be 'DD:HH:MM:SS', a timedelta, a dict or seconds")


class Timer(Callback):
    """Stops ``fit`` once ``duration`` of training time has elapsed.

    Checked at fit start (after a checkpoint is restored), then after every
    train batch (``interval="step"``) or epoch; the stop is Lightning's
    graceful one (``trainer.should_stop``), so epoch-end callbacks such as
    checkpointing still run. Elapsed time is saved in the checkpoint, so a
    resumed run counts the time already spent, and a budget already used up
    (or ``max_time`` of zero) trains nothing, as in Lightning.
    """

    def __init__(self, duration: Any = None, interval: str = "step", verbose: bool = True) -> None:
        if interval not in ("step", "epoch"):
            raise ValueError(f"interval must be 'step' or 'epoch', got {interval!r}")
        self.duration = parse_duration(duration) if duration is not None else None
        self.interval = interval
        self.verbose = verbose
        self._start: float | None = None
        self._offset = 0.0
        self._restored = False

    def time_elapsed(self) -> float:
        if self._start is None:
            return self._offset
        return self._offset + time.monotonic() - self._start

    # -- the logic on a StepInfo (no Trainer)
    def check(self, info: StepInfo) -> bool:
        """Whether the time budget is spent (True: stop); says so once, unless ``info.should_stop`` already."""
        if self.duration is not None and self.time_elapsed() >= self.duration.total_seconds():
            if not info.should_stop and self.verbose:
                rank_zero_info(f"Time limit reached ({self.duration}); signaling Trainer to stop.")
            return True
        return False

    def fit_start(self, info: StepInfo) -> bool:
        """A ``fit`` call starts: time carries over from a restored checkpoint only, not from an earlier
        ``fit``; then :meth:`check` (a budget already spent, or zero, stops before the first batch, as
        Lightning)."""
        if not self._restored:
            self._offset = 0.0
        self._restored = False
        return self.check(info)

    # -- Lightning hooks: build the StepInfo, apply what the logic decides
    def on_fit_start(self, trainer, pl_module) -> None:
        if self.fit_start(StepInfo.of_trainer(trainer)):
            trainer.should_stop = True

    def on_train_start(self, trainer, pl_module) -> None:
        self._start = time.monotonic()

    def on_train_end(self, trainer, pl_module) -> None:
        if self._start is not None:
            self._offset += time.monotonic() - self._start
            self._start = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # the interval is read first, so a per-epoch Timer builds no info per batch
        if self.interval == "step" and self.check(
            StepInfo.of_trainer(trainer, batch_idx=batch_idx)  # not the batch: reading it costs its placement
        ):
            trainer.should_stop = True

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self.interval == "epoch" and self.check(StepInfo.of_trainer(trainer)):
            trainer.should_stop = True

    def state_dict(self) -> dict[str, Any]:
        return {"time_elapsed": self.time_elapsed()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._offset = float(state_dict.get("time_elapsed", 0.0))
        self._restored = True
