"""The Callback base class: Lightning 2.x hooks that make sense without torch."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from jaxlight.module import LightningModule
    from jaxlight.step import StepExtension
    from jaxlight.trainer import Trainer


class Callback:
    """Hooks called by the Trainer on the host, callbacks before the module.

    Hook names and order follow PyTorch Lightning 2.x. Torch-specific hooks
    (``on_before_backward``, ``on_after_backward``, ``on_before_optimizer_step``,
    ``on_before_zero_grad``) do not exist: backward and the optimizer update
    run inside the compiled step. ``on_train_batch_end`` receives the step's
    outputs as device arrays that have not been synced.

    A callback may also own state updated *inside* the compiled train step by
    returning a :class:`jaxlight.step.StepExtension` from ``step_extension``;
    its initial value comes from ``init_step_state`` and is checkpointed with
    the train state. ``state_dict``/``load_state_dict`` hold the host-side
    state a resume needs; ``state_key`` names it in the checkpoint.

    Capabilities are declared here, with their defaults, and read by the
    trainer (a subclass overrides the attribute or method):

    - ``needs_grad_norm``: the train step computes the global gradient norm
      and returns it in the step outputs as ``"grad_norm"``;
    - ``skip_nonfinite_updates``: the train step drops an update whose loss or
      gradient norm is non-finite (parameters, optimizer and model state kept);
    - ``is_checkpoint_callback``: saves checkpoints; runs after every other
      callback at each hook (Lightning orders checkpoint callbacks last), so
      what it saves includes this hook's updates of the other callbacks.
      Such a callback is found by what it declares, never by its type:
      :attr:`checkpoint_dirpath` (where ``ckpt_path="last"`` looks),
      :meth:`best_checkpoint_path` (what ``ckpt_path="best"`` loads) and
      :meth:`save_now` (what :class:`~jaxlight.callbacks.Preemption` writes);
    - ``is_monitoring_callback``: decides from monitored metrics (early
      stopping); its ``on_train_epoch_end`` runs after the module's;
    - ``state_on_device``: the TrainState groups (``"opt_state"``, ``"callback_state"``)
      this callback computes on between steps, so they must stay in device
      memory (a host-offload strategy refuses to move them, naming the
      callback);
    - :meth:`eval_params`: other weights to evaluate with (EMA);
    - ``frozen_parameters``: parameters no optimizer updates (fine-tuning), a method or None;
    - ``prepare_resume``: reshape what a resume restores into before it is read (fine-tuning's added
      parameter groups), a method or None;
    - :meth:`wait_until_finished`: block until background work (async
      checkpoint commits) is done; the trainer calls it after fit and before a
      preemption exit;
    - :meth:`check_state_dict`: refuse a saved state that :meth:`load_state_dict`
      could not take, before a resume loads anything;
    - ``runs_at_execution_end``: with ``steps_per_execution=N`` its per-batch
      train hooks run at an execution's last batch only, where the train state
      is the one single steps would have there (Preemption; checkpoint
      callbacks always do);
    - :attr:`reads_optimizer_state_per_step`: its per-batch hooks read the
      optimizer state as it is before each step, which ``steps_per_execution``
      refuses (LearningRateMonitor logging by step);
    - ``stop_poll``: None, or a method the loops call before each batch is
      taken and while they wait for one, which may end the run there
      (Preemption's ``poll``).

    The loops ask these, never a callback's type, so a user's callback can
    declare any of them.
    """

    needs_grad_norm: bool = False
    skip_nonfinite_updates: bool = False
    is_checkpoint_callback: bool = False
    is_monitoring_callback: bool = False
    state_on_device: tuple[str, ...] = ()
    # Parameters no optimizer may update (torch's requires_grad=False; BaseFinetuning): None, or a method
    # ``frozen_parameters(trainer, pl_module) -> selector`` (jl.optim.select_params: paths, NNX modules or
    # variables of the module, a list of these; an empty list is allowed), called once per fit after
    # configure_model and before the optimizer is built. Those parameters get no update and no optimizer state.
    frozen_parameters: Callable[[Trainer, LightningModule], Any] | None = None
    # None, or a method ``prepare_resume(trainer, pl_module, state_dict)`` called on a fit resume with this
    # callback's saved state (already passed by check_state_dict), after the optimizer is built and before
    # any array of the checkpoint is read: BaseFinetuning re-adds the parameter groups it had added, so the
    # saved optimizer state of those groups has a place to go.
    prepare_resume: Callable[[Trainer, LightningModule, Any], None] | None = None
    # Its per-batch train hooks write or stop from the train state, so with steps_per_execution=N they run at an
    # execution's last batch only (the state inside an execution is not there to see). Checkpoint callbacks always do.
    runs_at_execution_end: bool = False
    # None, or a method ``stop_poll(waiting: bool)``: called by the loops before each batch is taken
    # (waiting=False) and every jaxlight.data.POLL_INTERVAL seconds while they wait for one (waiting=True), at
    # points where the state is a completed step's; it may end the run there by raising. The first callback
    # declaring one is polled.
    stop_poll: Callable[[bool], None] | None = None

    @property
    def state_key(self) -> str:
        return type(self).__qualname__

    def _generate_state_key(self, **kwargs: Any) -> str:
        return f"{type(self).__qualname__}{repr(kwargs)}"

    # setup / teardown
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None: ...
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None: ...

    # fit
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_sanity_check_end(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None: ...
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None: ...

    # validation / test / predict
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None: ...
    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_test_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_test_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_test_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None: ...
    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_predict_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_predict_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_predict_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_predict_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None: ...

    # errors and checkpoints
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None: ...
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None: ...
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass

    def check_state_dict(self, state_dict: Any) -> None:
        """Raise ``ValueError`` or ``TypeError`` naming the key when ``state_dict`` (as read from a checkpoint,
        which may come from anyone) is not one :meth:`load_state_dict` can take. Called on resume before any
        array is read into the trainer; the trainer turns the error into a ``CheckpointError`` naming the file.
        Nothing is checked by default."""

    # in-step state (jaxlight extension)
    def step_extension(self, trainer: Trainer) -> StepExtension | None:
        return None

    def init_step_state(self, trainer: Trainer, params: dict[str, Any]) -> Any:
        return None

    def eval_params(self, trainer: Trainer, params: dict[str, Any]) -> dict[str, Any] | None:
        """Parameters validation/test/predict should use instead of ``params`` (None: use ``params``)."""
        return None

    @property
    def reads_optimizer_state_per_step(self) -> tuple[str, str] | None:
        """None, or ``(what, fix)`` when this callback's per-batch hooks read the optimizer state as it is before
        each step, which ``steps_per_execution=N`` cannot give (the hooks run after the execution): ``what``
        names the callback and what it reads (the start of the refusal), ``fix`` the change that avoids it.
        A property, not a hook: the hook table never calls it."""
        return None

    def wait_until_finished(self) -> None:
        """Block until background work this callback started is complete (nothing by default)."""

    # checkpoint callbacks (is_checkpoint_callback): what finding and writing checkpoints asks of them
    @property
    def checkpoint_dirpath(self) -> str | None:
        """The directory this checkpoint callback writes into, which ``ckpt_path="last"`` searches (with the
        same directory under the other ``version_N`` of a versioned logger); None: none (yet)."""
        return None

    def best_checkpoint_path(self, saved_state: Mapping[str, Any] | None = None) -> str | None:
        """What ``ckpt_path="best"`` loads: the best checkpoint this callback knows of in this run, or, given
        ``saved_state`` (this callback's ``state_dict()`` as a checkpoint of an earlier run holds it), the one
        named there. None: no best checkpoint is known."""
        return None

    def save_now(self, trainer: Trainer, reason: str = "preemption") -> str | None:
        """Write the run's current state now, synchronously, and return the checkpoint's path (what
        :class:`~jaxlight.callbacks.Preemption` calls before the process exits). None: this callback writes
        nothing on demand (the default)."""
        return None
