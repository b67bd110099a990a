"""LRSchedulerStepper: the schedulers Lightning steps outside the optimizer update.

Added by the trainer when ``configure_optimizers`` returns a plateau
scheduler (``optax.contrib.reduce_on_plateau`` with a ``monitor``) or a
schedule with ``"interval": "epoch"``. Their state lives in the optimizer
state (checkpointed with it); this callback changes only those few scalars,
with small jitted functions whose outputs keep the train state's shardings,
so the compiled train step never takes a metric argument and is never
recompiled. A plateau is stepped by its optimizer's own update, run on zero
updates with ``value=`` (:func:`jaxlight.optim.plateau_stepper`): the plateau
steps exactly as optax steps it, and the jitted function keeps only its
scalars.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from optax.contrib import ReduceLROnPlateauState

from jaxlight.callbacks.callback import Callback
from jaxlight.errors import MisconfigurationError
from jaxlight.optim.schedules import (
    KeyPath,
    SchedulerConfig,
    driven_states,
    hyperparams_with_path,
    injected_states,
    learning_rate_value,
    plateau_stepper,
    schedule_name,
    set_hyperparam,
    set_state,
    shardings_of,
    states_with_path,
)

_PLATEAU = ReduceLROnPlateauState.__name__


class _Target(NamedTuple):
    config: SchedulerConfig
    state_of: Callable[[Any], Any]  # TrainState.opt_state -> the scheduler's optimizer's state
    paths: list[KeyPath]  # in TrainState.opt_state: the plateau states it steps / injected states it sets
    fn: Any  # jitted (optimizer state, value) -> one new plateau state / learning rate per path


def _epoch_rate(config: SchedulerConfig, epoch: int) -> np.ndarray:
    """``schedule(epoch // frequency)`` evaluated on the host, with a Python int (as torch's ``LambdaLR`` calls
    its lambda, so ``math`` works), as a float64 host scalar: one argument type for the jitted write whatever
    the schedule returns (a float, an int, a jax scalar)."""
    value = config.scheduler(epoch // config.frequency)
    try:
        return np.asarray(value, np.float64).reshape(())
    except (TypeError, ValueError) as e:
        raise MisconfigurationError(
            f'lr_scheduler {schedule_name(config.scheduler)} with "interval": "epoch" returned {value!r} for '
            f"epoch {epoch // config.frequency}; it must return one number, the learning rate"
        ) from e


class LRSchedulerStepper(Callback):
    """Steps plateau schedulers with their monitored metric and sets epoch-interval learning rates.

    Lightning's timing: a plateau scheduler with ``interval="epoch"`` is
    stepped at the end of every ``frequency``-th epoch, after
    ``on_train_epoch_end`` of the module (and after validation), with
    ``trainer.callback_metrics[monitor]``; with ``interval="step"`` after
    every ``frequency``-th batch, once that batch's validation (if any) has
    run. A schedule with ``interval="epoch"`` sets the injected learning rate
    to ``schedule(epoch // frequency)`` at each epoch start, evaluated here on
    the host with the epoch as a Python int (a ``math`` lambda works). A missing
    monitored metric raises, listing the available ones (``strict=False``:
    warns and skips). The trainer puts this callback first, so
    ``LearningRateMonitor`` sees the new rates.
    """

    is_monitoring_callback = True  # on_train_epoch_end after the module's: metrics it logs there count

    def __init__(self) -> None:
        self._targets: list[_Target] = []
        self._pending: list[_Target] = []

    # -- plan -----------------------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        config = trainer.engine.optimizer
        state = trainer.train_state.opt_state
        shardings = trainer.engine.state_shardings.opt_state
        self._targets, self._pending = [], []
        injected = {id(n): p for p, n in injected_states(state).items()}
        plateaus = states_with_path(state, _PLATEAU)
        for c in config.schedulers:
            opt = config.optimizers[c.optimizer_index]
            sub = opt.state_of(state)
            if c.reduce_on_plateau:
                where = {id(n): p for p, n in plateaus.items()}
                found = list(states_with_path(sub, _PLATEAU).values())
                paths = [where[id(found[p])] for p in c.plateau_nodes]
                like = opt.updates_like(trainer.train_state.params)
                step = plateau_stepper(opt.tx, like, c.plateau_nodes, shardings_of(sub))
                out = [states_with_path(shardings, _PLATEAU)[p] for p in paths]
            elif c.interval == "epoch":
                paths = [injected[id(n)] for n in driven_states(sub).values()]

                # only the write is jitted: the schedule was evaluated on the host (_epoch_rate), and its value
                # comes in as an argument, cast to each stored rate's dtype (a state value, so no recompile)
                def step(sub: Any, rate: Any) -> list:
                    return [
                        learning_rate_value(n.hyperparams["learning_rate"], rate) for n in driven_states(sub).values()
                    ]

                rates = hyperparams_with_path(shardings, "learning_rate")
                out = [rates[p] for p in paths]
            else:
                continue
            if not paths:  # pragma: no cover - build() guarantees them
                raise RuntimeError(f"jaxlight: no optimizer state found for scheduler {c}")
            self._targets.append(_Target(c, opt.state_of, paths, jax.jit(step, out_shardings=out)))
        self._set_epoch_rates(trainer)

    def _apply(self, trainer: Any, target: _Target, value: Any) -> None:
        st = trainer.train_state
        opt_state = st.opt_state
        for path, new in zip(target.paths, target.fn(target.state_of(opt_state), value)):
            if target.config.reduce_on_plateau:
                opt_state = set_state(opt_state, path, new)
            else:
                opt_state = set_hyperparam(opt_state, path, "learning_rate", new)
        trainer.train_state = st._replace(opt_state=opt_state)

    # -- epoch-interval schedules ---------------------------------------------------------------
    def _set_epoch_rates(self, trainer: Any) -> None:
        for t in self._targets:
            if not t.config.reduce_on_plateau:
                self._apply(trainer, t, _epoch_rate(t.config, int(trainer.current_epoch)))

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._set_epoch_rates(trainer)

    # -- plateaus -------------------------------------------------------------------------------
    def _plateau_step(self, trainer: Any, target: _Target) -> None:
        c = target.config
        value = trainer.callback_metrics.get(c.monitor)
        if value is None:
            if c.strict:
                raise MisconfigurationError(
                    f"ReduceLROnPlateau conditioned on metric {c.monitor} which is not available. Available metrics "
                    f"are: {list(trainer.callback_metrics)}. Condition can be set using `monitor` key in lr "
                    f"scheduler dict"
                )
            warnings.warn(
                f"ReduceLROnPlateau conditioned on metric {c.monitor} which is not available but strict is set to "
                f"`False`. Skipping learning rate update.",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        self._apply(trainer, target, value)

    def _flush(self, trainer: Any) -> None:
        pending, self._pending = self._pending, []
        for t in pending:
            self._plateau_step(trainer, t)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._flush(trainer)  # the previous batch's steps, after its validation (Lightning's order)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.position.window:  # inside an accumulation window: no optimizer step yet
            return
        for t in self._targets:
            c = t.config
            if c.reduce_on_plateau and c.interval == "step" and (batch_idx + 1) % c.frequency == 0:
                self._pending.append(t)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._flush(trainer)
        for t in self._targets:
            c = t.config
            if c.reduce_on_plateau and c.interval == "epoch" and (trainer.current_epoch + 1) % c.frequency == 0:
                self._plateau_step(trainer, t)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._flush(trainer)
