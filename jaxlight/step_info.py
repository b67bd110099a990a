"""StepInfo: what a callback sees at a hook, as one value (position, step values, state, run settings).

jaxlight's own host-side callbacks (``EMA``, ``ThroughputMonitor``,
``NonFiniteGuard``, ``EarlyStopping``, ``Timer``, ``LearningRateMonitor``,
``Preemption``, ``ModelCheckpoint``) keep their logic in methods
that take a :class:`StepInfo`; their Lightning hooks ``(trainer, pl_module,
...)`` only build one with :meth:`StepInfo.of_trainer` and apply what the
logic decides (set ``trainer.should_stop``, log metrics, write the checkpoint
a :class:`~jaxlight.callbacks.checkpoint_policy.Decision` names). So the logic
runs, and is tested, from a stream of hand-made infos with no Trainer.

Nothing here imports above layer 0: the Trainer and the train state are
named only for type checkers.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping
from time import perf_counter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from jaxlight.optim import OptimizerConfig
    from jaxlight.step import TrainState
    from jaxlight.trainer import Trainer

__all__ = ["StepInfo"]

_EMPTY: Mapping[str, Any] = types.MappingProxyType({})


def _view(mapping: Any) -> Any:
    # A read-only view of a dict (no copy: it shows the live mapping); anything else (None, a user's own
    # outputs type) is passed as it is, so a hook that indexes it fails as it would without the info.
    return types.MappingProxyType(mapping) if type(mapping) is dict else mapping


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """One hook's view of the run: position, the step's values, the train state and the run's settings.

    Guarantees: building one fetches nothing to the host and copies no array: ``outputs``, ``metrics``,
    ``state`` and ``batch`` are the trainer's own device arrays, held by reference (reading a value,
    ``float(x)``, waits for its step, as in any hook). It is only valid during the hook that built it: the
    next train step donates the state's arrays. Every field has a default, so a test builds one by hand with
    only the fields the callback under test reads.

    Position:

    - ``stage``: ``"train"`` while ``fit`` trains (validation inside ``fit`` included), ``"sanity_check"``
      during fit's sanity check, ``"validate"`` / ``"test"`` / ``"predict"`` in those standalone runs,
      ``""`` outside any of them (setup, ``on_fit_start``, after a run);
    - ``epoch``: completed epochs (Lightning's ``current_epoch``);
    - ``global_step``: optimizer updates applied so far, this batch's included when it stepped;
    - ``batch_idx``: the batch's index in its epoch (batch hooks; 0 elsewhere);
    - ``stepped``: this train batch completed an optimizer update (False for a micro-batch inside
      gradient accumulation);
    - ``should_stop``: whether a stop has already been requested (``trainer.should_stop``).

    Values:

    - ``batch``: the step's input batch as global device arrays (batch hooks; None elsewhere);
    - ``outputs``: the step's outputs (``{"loss", ...}``, plus ``"grad_norm"`` when a callback asked for it;
      None outside batch hooks);
    - ``metrics``: the logged values callbacks read (``trainer.callback_metrics``), a read-only view;
    - ``state``: the :class:`~jaxlight.step.TrainState` (``params``, ``model_state``, ``opt_state``,
      ``callback_state``, ``step``), None before ``fit`` creates it; not to be modified;
    - ``time``: ``time.perf_counter()`` when the info was built (the host clock the rates use);
    - ``compiled``: the compiled step of each stage run so far (``{"train": ...}``), a read-only view.

    Run settings (constant over a run):

    - ``global_rank``: this process's index; ``num_devices``: devices in the mesh; ``device``: its first
      device (its ``device_kind`` names the hardware); ``precision``: the precision's name (``"32-true"``);
    - ``log_every_n_steps``, ``fast_dev_run`` (0: off), ``val_check_interval``, ``check_val_every_n_epoch``:
      the Trainer's arguments of those names, resolved.

    Read by ``LearningRateMonitor`` and ``Preemption`` (appended, defaulted like the rest):

    - ``optimizer``: the run's built optimizer configuration (:class:`~jaxlight.optim.OptimizerConfig`,
      ``trainer.engine.optimizer``), by reference: its ``inspect(state.opt_state, state.params)`` finds the
      learning rates in the optax state; None before ``fit`` builds it. A new object when fine-tuning adds
      parameter groups;
    - ``loggers``: the trainer's loggers (a tuple; empty with ``logger=False``);
    - ``micro_batches``: train batches consumed over the whole run (each micro-batch of an accumulated
      update counts); ``batches_in_epoch``: train batches of the current epoch consumed;
    - ``steps_per_execution``: train batches one compiled execution runs (the Trainer's argument).

    Read by ``ModelCheckpoint``'s policy (:mod:`jaxlight.callbacks.checkpoint_policy`; appended, defaulted
    like the rest):

    - ``num_training_batches``: train batches per epoch (``math.inf``: the loader's length is unknown);
    - ``num_val_batches``: validation batches per run, known once validation has run (a tuple, one count per
      loader, with several loaders; 0 before); ``limit_val_batches``: the Trainer's argument;
      ``has_val_dataloaders``: this fit has validation loaders;
    - ``ckpt_path``: the checkpoint this run restored from, as given (None: a fresh run);
    - ``default_root_dir``: the Trainer's argument, resolved (where checkpoints go without a logger).
    """

    stage: str = ""
    epoch: int = 0
    global_step: int = 0
    batch_idx: int = 0
    stepped: bool = False
    should_stop: bool = False
    batch: Any = None
    outputs: Mapping[str, Any] | None = None
    metrics: Mapping[str, Any] = dataclasses.field(default_factory=lambda: _EMPTY)
    state: TrainState | None = None
    time: float = dataclasses.field(default_factory=perf_counter)
    compiled: Mapping[str, Any] = dataclasses.field(default_factory=lambda: _EMPTY)
    global_rank: int = 0
    num_devices: int = 1
    device: Any = None
    precision: str = "32-true"
    log_every_n_steps: int = 50
    fast_dev_run: int = 0
    val_check_interval: int | float = 1.0
    check_val_every_n_epoch: int | None = 1
    optimizer: OptimizerConfig | None = None
    loggers: tuple[Any, ...] = ()
    micro_batches: int = 0
    batches_in_epoch: int = 0
    steps_per_execution: int = 1
    num_training_batches: int | float = math.inf
    num_val_batches: int | float | tuple[int | float, ...] = 0
    limit_val_batches: int | float = 1.0
    has_val_dataloaders: bool = False
    ckpt_path: str | None = None
    default_root_dir: str = ""

    @classmethod
    def of_trainer(
        cls, trainer: Trainer, *, batch: Any = None, outputs: Any = None, batch_idx: int | None = None
    ) -> StepInfo:
        """The info a hook of ``trainer`` sees now; ``batch``, ``outputs`` and ``batch_idx`` are the hook's
        own arguments (batch hooks).

        The one place that reads the Trainer for a :class:`StepInfo`: attribute reads and references only,
        no device sync and no copy (a few microseconds), so a callback builds one per hook call it acts on.
        """
        if trainer.sanity_checking:
            stage = "sanity_check"
        elif trainer.training:
            stage = "train"
        elif trainer.validating:
            stage = "validate"
        elif trainer.testing:
            stage = "test"
        elif trainer.predicting:
            stage = "predict"
        else:
            stage = ""
        position, config, mesh = trainer.position, trainer.config, trainer.mesh
        return cls(
            stage=stage,
            epoch=position.epoch,
            global_step=position.global_step,
            batch_idx=trainer.batch_idx if batch_idx is None else batch_idx,
            stepped=position.last_stepped,
            should_stop=trainer.should_stop,
            batch=batch,
            outputs=_view(outputs),
            metrics=_view(trainer.callback_metrics),
            state=trainer.train_state,
            compiled=_view(trainer.compiled),
            global_rank=trainer.global_rank,
            num_devices=mesh.size,
            device=mesh.devices.flat[0],
            precision=config.precision.name,
            log_every_n_steps=config.log_every_n_steps,
            fast_dev_run=config.fast_dev_run,
            val_check_interval=config.val_check_interval,
            check_val_every_n_epoch=config.check_val_every_n_epoch,
            optimizer=trainer.engine.optimizer,
            loggers=tuple(trainer.loggers),
            micro_batches=position.micro_batches,
            batches_in_epoch=position.batches_in_epoch,
            steps_per_execution=config.steps_per_execution,
            num_training_batches=trainer.num_training_batches,
            num_val_batches=tuple(nvb) if isinstance(nvb := trainer.num_val_batches, list) else nvb,
            limit_val_batches=config.limit_val_batches,
            has_val_dataloaders=trainer.val_dataloaders is not None,
            ckpt_path=trainer.ckpt_path,
            default_root_dir=config.default_root_dir,
        )
