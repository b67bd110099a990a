"""LearningRateMonitor: log the learning rate the optax schedule gives at each step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxlight.callbacks.callback import Callback

# optax state classes -> the optimizer name Lightning would print ("lr-Adam")
_STATE_NAMES = {
    "ScaleByAdamState": "Adam",
    "ScaleByAdaDeltaState": "Adadelta",
    "ScaleByRmsState": "RMSprop",
    "ScaleByRStdDevState": "RMSprop",
    "ScaleByLionState": "Lion",
    "ScaleByAdafactorState": "Adafactor",
    "FactoredState": "Adafactor",
    "ScaleByAmsgradState": "AMSGrad",
    "ScaleByBeliefState": "AdaBelief",
    "ScaleByNovogradState": "Novograd",
    "ScaleByLBFGSState": "LBFGS",
    "TraceState": "SGD",
    "ScaleBySM3State": "SM3",
    "ScaleByYogiState": "Yogi",
    "ScaleByMuonState": "Muon",
}


def _walk(state: Any):
    yield state
    if isinstance(state, Mapping):
        for v in state.values():
            yield from _walk(v)
    elif isinstance(state, (tuple, list)):
        for v in state:
            yield from _walk(v)


def optimizer_name(opt_state: Any) -> str:
    """A readable name for an optax optimizer from its state ("Adam", "SGD", ...), "SGD" when stateless."""
    for node in _walk(opt_state):
        name = _STATE_NAMES.get(type(node).__name__)
        if name is not None:
            return name
    return "SGD"


def _injected_lrs(opt_state: Any) -> list[Any]:
    """``learning_rate`` values held by ``optax.inject_hyperparams`` states (device arrays)."""
    found = []
    for node in _walk(opt_state):
        hp = getattr(node, "hyperparams", None)
        if isinstance(hp, Mapping) and "learning_rate" in hp:
            found.append(hp["learning_rate"])
    return found


class LearningRateMonitor(Callback):
    """Logs the learning rate as ``lr-<Optimizer>`` (e.g. ``lr-Adam``), like Lightning.

    Supported sources, in order: the optax schedule returned by
    ``configure_optimizers`` as ``{"optimizer": tx, "lr_scheduler": schedule}``
    (the value logged for optimizer step ``n`` is ``schedule(n)``, the rate that
    update uses; with gradient accumulation ``n`` counts optimizer updates, as
    optax's ``MultiSteps`` does), then a ``learning_rate`` injected with
    ``optax.inject_hyperparams`` (read from the optimizer state: the rate of the
    latest update). A plain float learning rate baked into an optax
    transformation cannot be read; that raises at train start with what to
    change. ``logging_interval``: ``"step"`` logs at the trainer's
    ``log_every_n_steps`` cadence, ``"epoch"`` at each epoch start, ``None``
    (default) at the step cadence, since optax schedules are per step. Values
    go straight to the loggers with the step the trainer's metrics use, and are
    kept in ``self.lrs``. Nothing here syncs with the device per step.
    """

    def __init__(
        self, logging_interval: str | None = None, log_momentum: bool = False, log_weight_decay: bool = False
    ) -> None:
        if logging_interval not in (None, "step", "epoch"):
            raise ValueError(f"logging_interval={logging_interval!r}; choose None, 'step' or 'epoch'")
        if log_momentum or log_weight_decay:
            raise ValueError(
                "LearningRateMonitor: log_momentum/log_weight_decay are not supported for optax "
                "optimizers (their values are not exposed); log them with self.log instead"
            )
        self.logging_interval = logging_interval
        self.lrs: dict[str, list[float]] = {}
        self._names: list[str] = []

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.loggers and not trainer.fast_dev_run:
            raise RuntimeError("Cannot use `LearningRateMonitor` callback with `Trainer` that has no logger.")
        n_sched = len(trainer.lr_scheduler_configs)
        n_inj = len(_injected_lrs(trainer.train_state.opt_state)) if trainer.train_state is not None else 0
        if n_sched == 0 and n_inj == 0:
            raise RuntimeError(
                "LearningRateMonitor cannot read the learning rate: configure_optimizers returned an optax "
                "transformation with a fixed learning rate. Return {'optimizer': tx, 'lr_scheduler': schedule} "
                "(an optax schedule, e.g. optax.constant_schedule(1e-3)) or build the optimizer with "
                "optax.inject_hyperparams(optax.adam)(learning_rate=...)"
            )
        base = "lr-" + optimizer_name(trainer.train_state.opt_state)
        n = max(n_sched, n_inj)
        self._names = [base] if n == 1 else [f"{base}/pg{i + 1}" for i in range(n)]
        self.lrs = {k: [] for k in self._names}

    def _should_log_step(self, trainer: Any) -> bool:
        # the trainer logs metrics of update g (0-based) when (g + 1) % log_every_n_steps == 0
        return (trainer.global_step + 1) % trainer.log_every_n_steps == 0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.logging_interval == "epoch" or not self._should_log_step(trainer):
            return
        if trainer.position.window:  # inside an accumulation window: no new rate yet
            return  # mid-accumulation: logged once per optimizer update, at its first micro-batch
        self._log(trainer)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self.logging_interval == "epoch":
            self._log(trainer)

    def _extract(self, trainer: Any) -> dict[str, float]:
        if trainer.lr_scheduler_configs:
            vals = [float(np.asarray(s(trainer.global_step))) for s in trainer.lr_scheduler_configs]
        else:
            vals = [float(np.asarray(v)) for v in _injected_lrs(trainer.train_state.opt_state)]
        return dict(zip(self._names, vals))

    def _log(self, trainer: Any) -> None:
        stats = self._extract(trainer)
        for k, v in stats.items():
            self.lrs.setdefault(k, []).append(v)
        if trainer.is_global_zero and trainer.loggers:
            from jaxlight.loggers.logger import LoggerCollection

            LoggerCollection(trainer.loggers).log_metrics(stats, step=trainer.global_step)
