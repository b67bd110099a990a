"""EarlyStopping: stop fit when a monitored metric stops improving (Lightning's semantics)."""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np

from jaxlight.callbacks.callback import Callback
from jaxlight.rank_zero import rank_zero_info, rank_zero_warn
from jaxlight.step_info import StepInfo


class EarlyStopping(Callback):
    """Stops training when ``monitor`` has not improved by more than ``min_delta`` for ``patience`` checks.

    Same arguments and behaviour as PyTorch Lightning's ``EarlyStopping``. The
    check runs at the end of the training epoch when validation runs once per
    epoch (``val_check_interval=1.0``, ``check_val_every_n_epoch=1``) or when
    ``check_on_train_epoch_end=True``; otherwise at the end of each validation
    run inside ``fit`` (never during the sanity check, ``fast_dev_run`` or a
    standalone ``validate``). It also stops, without waiting for
    ``patience``, when the value is non-finite (``check_finite``), beats
    ``stopping_threshold`` or is worse than ``divergence_threshold``. The stop
    is graceful (``trainer.should_stop``; ``min_epochs``/``min_steps`` are
    honoured by the trainer). ``wait_count``, ``best_score`` and
    ``stopped_epoch`` are saved in checkpoints. With ``strict`` a missing
    metric raises and names the metrics that exist.
    """

    is_monitoring_callback = True
    mode_dict = {"min": operator.lt, "max": operator.gt}
    order_dict = {"min": "<", "max": ">"}

    def __init__(
        self,
        monitor: str,
        min_delta: float = 0.0,
        patience: int = 3,
        verbose: bool = False,
        mode: str = "min",
        strict: bool = True,
        check_finite: bool = True,
        stopping_threshold: float | None = None,
        divergence_threshold: float | None = None,
        check_on_train_epoch_end: bool | None = None,
        log_rank_zero_only: bool = False,
    ) -> None:
        if mode not in self.mode_dict:
            raise ValueError(f"EarlyStopping mode={mode!r}; choose one of {list(self.mode_dict)}")
        if patience < 0:
            raise ValueError(f"EarlyStopping patience must be >= 0, got {patience}")
        self.monitor = monitor
        self.min_delta = abs(float(min_delta)) * (1 if mode == "max" else -1)
        self.patience = patience
        self.verbose = verbose
        self.mode = mode
        self.strict = strict
        self.check_finite = check_finite
        self.stopping_threshold = stopping_threshold
        self.divergence_threshold = divergence_threshold
        self._check_on_train_epoch_end = check_on_train_epoch_end
        self.log_rank_zero_only = log_rank_zero_only
        self.wait_count = 0
        self.stopped_epoch = 0
        self.best_score = math.inf if mode == "min" else -math.inf

    @property
    def monitor_op(self):
        return self.mode_dict[self.mode]

    @property
    def state_key(self) -> str:
        return self._generate_state_key(monitor=self.monitor, mode=self.mode)

    def state_dict(self) -> dict[str, Any]:
        return {
            "wait_count": self.wait_count,
            "stopped_epoch": self.stopped_epoch,
            "best_score": float(self.best_score),
            "patience": self.patience,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wait_count = int(state_dict["wait_count"])
        self.stopped_epoch = int(state_dict["stopped_epoch"])
        self.best_score = float(state_dict["best_score"])
        self.patience = int(state_dict.get("patience", self.patience))

    # -- the logic on a StepInfo (no Trainer)
    def resolve_check_point(self, info: StepInfo) -> None:
        """Unless ``check_on_train_epoch_end`` was given: check at the train epoch's end when validation runs
        once per epoch (``info.val_check_interval == 1.0`` and ``info.check_val_every_n_epoch == 1``), else
        after each validation."""
        if self._check_on_train_epoch_end is None:
            # validation more than once per epoch, or not every epoch: check after each validation instead
            self._check_on_train_epoch_end = info.val_check_interval == 1.0 and info.check_val_every_n_epoch == 1

    def _should_skip_check(self, info: StepInfo) -> bool:
        # only while fit trains: not in the sanity check, a standalone validate or fast_dev_run
        return info.stage != "train" or bool(info.fast_dev_run)

    def at_train_epoch_end(self, info: StepInfo) -> bool:
        """The check at a train epoch's end, when that is where this callback checks; True: stop."""
        if not self._check_on_train_epoch_end or self._should_skip_check(info):
            return False
        return self.check(info)

    def at_validation_end(self, info: StepInfo) -> bool:
        """The check after a validation run inside ``fit``, when that is where this callback checks; True: stop."""
        if self._check_on_train_epoch_end or self._should_skip_check(info):
            return False
        return self.check(info)

    def check(self, info: StepInfo) -> bool:
        """Judge ``info.metrics[monitor]`` (fetched here): update ``best_score`` / ``wait_count``, record
        ``stopped_epoch = info.epoch`` on a stop, print the reason when ``verbose``; True: stop. A missing
        metric raises (``strict``) or is skipped."""
        logs = info.metrics
        if not self._validate_condition_metric(logs):
            return False
        current = float(np.asarray(logs[self.monitor]).reshape(()))
        should_stop, reason = self._evaluate_stopping_criteria(current)
        if should_stop:
            self.stopped_epoch = info.epoch
        if reason and self.verbose:
            if self.log_rank_zero_only:
                rank_zero_info(reason)
            else:  # Lightning prefixes every process's message with its rank
                print(f"[rank: {info.global_rank}] {reason}", flush=True)
        return should_stop

    # -- Lightning hooks: build the StepInfo, apply what the logic decides
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.resolve_check_point(StepInfo.of_trainer(trainer))

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self.at_train_epoch_end(StepInfo.of_trainer(trainer)):
            trainer.should_stop = True

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.at_validation_end(StepInfo.of_trainer(trainer)):
            trainer.should_stop = True

    def _run_early_stopping_check(self, trainer: Any) -> None:
        # Lightning's name for one unconditional check, kept for code that calls it directly
        if self.check(StepInfo.of_trainer(trainer)):
            trainer.should_stop = True

    def _validate_condition_metric(self, logs: dict[str, Any]) -> bool:
        if logs.get(self.monitor) is None:
            msg = (
                f"Early stopping conditioned on metric `{self.monitor}` which is not available. Pass in or modify "
                f"your `EarlyStopping` callback to use any of the following: `{'`, `'.join(logs)}`"
            )
            if self.strict:
                raise RuntimeError(msg)
            if self.verbose:
                rank_zero_warn(msg)
            return False
        return True

    def _evaluate_stopping_criteria(self, current: float) -> tuple[bool, str | None]:
        should_stop, reason = False, None
        if self.check_finite and not math.isfinite(current):
            should_stop = True
            reason = (
                f"Monitored metric {self.monitor} = {current} is not finite. Previous best value was "
                f"{self.best_score:.3f}. Signaling Trainer to stop."
            )
        elif self.stopping_threshold is not None and self.monitor_op(current, self.stopping_threshold):
            should_stop = True
            reason = (
                f"Stopping threshold reached: {self.monitor} = {current} {self.order_dict[self.mode]} "
                f"{self.stopping_threshold}. Signaling Trainer to stop."
            )
        elif self.divergence_threshold is not None and self.monitor_op(-current, -self.divergence_threshold):
            should_stop = True
            reason = (
                f"Divergence threshold reached: {self.monitor} = {current} {self.order_dict[self.mode]} "
                f"{self.divergence_threshold}. Signaling Trainer to stop."
            )
        elif self.monitor_op(current - self.min_delta, self.best_score):
            reason = self._improvement_message(current)
            self.best_score = current
            self.wait_count = 0
        else:
            self.wait_count += 1
            if self.wait_count >= self.patience:
                should_stop = True
                reason = (
                    f"Monitored metric {self.monitor} did not improve in the last {self.wait_count} records. "
                    f"Best score: {self.best_score:.3f}. Signaling Trainer to stop."
                )
        return should_stop, reason

    def _improvement_message(self, current: float) -> str:
        if math.isfinite(self.best_score):
            return (
                f"Metric {self.monitor} improved by {abs(self.best_score - current):.3f} >= "
                f"min_delta = {abs(self.min_delta)}. New best score: {current:.3f}"
            )
        return f"Metric {self.monitor} improved. New best score: {current:.3f}"
