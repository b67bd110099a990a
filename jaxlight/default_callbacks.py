"""The callbacks a Trainer adds by default: its policy, kept beside the Trainer (the facade layer).

The loops and the hook dispatch know callbacks only through the capabilities
:class:`~jaxlight.callbacks.Callback` declares; which concrete callbacks a run
gets without being asked for (the progress bar, ``max_time``'s Timer,
``ModelCheckpoint``, ``Preemption``, the stepper of host-stepped learning-rate
schedules) is decided here, from the Trainer's arguments, and nowhere else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxlight.callbacks.lr_scheduler import LRSchedulerStepper
from jaxlight.callbacks.model_checkpoint import ModelCheckpoint
from jaxlight.callbacks.preemption import Preemption
from jaxlight.callbacks.progress import TQDMProgressBar
from jaxlight.callbacks.timer import Timer
from jaxlight.hooks import checkpoint_callbacks_last

if TYPE_CHECKING:  # pragma: no cover
    from jaxlight.callbacks.callback import Callback
    from jaxlight.config import TrainerConfig


def with_default_callbacks(cbs: list[Callback], config: TrainerConfig) -> list[Callback]:
    """The user's callbacks plus those the arguments ask for (progress bar, ``max_time``'s Timer,
    checkpointing, preemption handling), checkpoint callbacks last."""
    if config.enable_progress_bar is not False and not any(isinstance(c, TQDMProgressBar) for c in cbs):
        cbs = [*cbs, TQDMProgressBar()]
    if config.enable_progress_bar is False:
        cbs = [c for c in cbs if not isinstance(c, TQDMProgressBar)]
    if config.max_time is not None:
        cbs = [c for c in cbs if not isinstance(c, Timer)] + [Timer(config.max_time, interval="step")]
    if config.enable_checkpointing and not any(c.is_checkpoint_callback for c in cbs):
        cbs = [*cbs, ModelCheckpoint()]
    if not config.fast_dev_run and not any(isinstance(c, Preemption) for c in cbs):
        cbs = [*cbs, Preemption()]
    return checkpoint_callbacks_last(cbs)


def with_scheduler_stepper(cbs: list[Callback], host_stepped: bool) -> list[Callback] | None:
    """The callbacks with one :class:`LRSchedulerStepper` first when the optimizer has host-stepped
    schedules (plateau, epoch interval), so LearningRateMonitor reads the rates it sets, and none
    otherwise; None when that is the list as it is."""
    others = [c for c in cbs if not isinstance(c, LRSchedulerStepper)]
    stepper = [LRSchedulerStepper()] if host_stepped else []
    if not stepper and len(others) == len(cbs):
        return None
    return checkpoint_callbacks_last(stepper + others)


__all__ = ["with_default_callbacks", "with_scheduler_stepper"]
