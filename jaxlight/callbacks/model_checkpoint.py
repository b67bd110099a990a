"""ModelCheckpoint: Lightning's checkpoint callback on orbax-checkpoint, saving asynchronously.

Lightning's *policy*, decided on every process in the loop (when to save, the
file names, the top-k set and ``last``), is
:class:`~jaxlight.callbacks.checkpoint_policy.CheckpointPolicy`: it takes a
:class:`~jaxlight.step_info.StepInfo` and returns a
:class:`~jaxlight.callbacks.checkpoint_policy.Decision`. This module holds the
hooks, which build the info and carry the decision out, and the callback's
saved state. A trigger makes at most one save (a :class:`~jaxlight.checkpoint.RunSnapshot` of the
run) and a :class:`~jaxlight.checkpoint.publish.Plan` of file operations: the
names the saved data is published under, the ``last`` link to switch, the files
to remove. Writing the save, publishing it crash-safely and in save order the
moment it commits, and holding the directory's lock are the mechanics of
:class:`jaxlight.checkpoint.writer.CheckpointWriter` (process 0 publishes, in
orbax's commit thread); the loop never waits for them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from jaxlight import distributed
from jaxlight.callbacks.callback import Callback
from jaxlight.callbacks.checkpoint_policy import CheckpointPolicy, Decision
from jaxlight.checkpoint import dirlock, publish
from jaxlight.checkpoint.discovery import check_filename, not_own_checkpoint
from jaxlight.checkpoint.schema import check_checkpoint_callback_state
from jaxlight.checkpoint.trainer_io import snapshot_of, view_of
from jaxlight.checkpoint.writer import CheckpointWriter
from jaxlight.rank_zero import WarnOnce, rank_zero_warn
from jaxlight.step_info import StepInfo

if TYPE_CHECKING:  # pragma: no cover
    from jaxlight.trainer import Trainer


class ModelCheckpoint(CheckpointPolicy, Callback):
    """Saves the run periodically; keeps the ``save_top_k`` best by ``monitor`` and, with ``save_last``, a ``last``.

    Arguments, triggers, file names and the files kept follow PyTorch
    Lightning's ``ModelCheckpoint`` (2.6): by default one checkpoint per epoch
    (at train-epoch end, or after validation when validation runs more often
    than once per epoch), ``every_n_train_steps`` / ``every_n_epochs`` /
    ``train_time_interval`` change the cadence, and ``filename`` is a template
    such as ``"{epoch}-{val_loss:.2f}"``.

    ``save_last`` (default ``None``: no ``last`` file, as in Lightning;
    ``ckpt_path="last"`` still finds the newest checkpoint by scanning):

    - ``True``: ``last.ckpt`` is a checkpoint of its own, written whenever a
      checkpoint is saved (and, with step or time triggers, at every trigger),
      so it survives top-k eviction. When the same step is also a top-k
      checkpoint the two share their files (hard links), so the state is
      written to disk once.
    - ``"link"``: ``last.ckpt`` is a symlink to the most recently saved
      checkpoint (a real save only while there is none, or with
      ``save_top_k=0``).

    Each checkpoint is an orbax directory ``<dirpath>/<name>.ckpt``. Saves are
    asynchronous (``async_save=True``): the call returns once the arrays are
    copied off the devices and training continues while they are written.
    When a save commits, its bookkeeping (names, ``last``, top-k removals)
    happens at once in the commit thread, so it never lags behind fast steps
    and never blocks the loop; at any instant, even under ``kill -9``, ``last``
    resolves to the newest complete checkpoint. ``best_model_path``,
    ``best_model_score``, ``best_k_models``, ``kth_best_model_path`` and
    ``last_model_path`` are kept as in Lightning and restored on resume.

    Beyond Lightning (docs/checkpointing.md, "ModelCheckpoint" and "What a shared checkpoint can and cannot do"):

    - ``save_non_finite=False`` (default): a state whose training loss (the loss
      ``training_step`` returned at the step being saved) or monitored value is
      NaN or infinite is not saved, into the top k or ``last``, so a run that
      diverges keeps its finite checkpoints; a warning says so once. ``True``
      saves such states like any other (a NaN score ranks worst).
    - At fit start the directory must be writable, and it is locked for this
      run (:mod:`jaxlight.checkpoint.dirlock`): a second live run on the same
      directory is refused, naming the first.
    - A resume removes only checkpoints it can prove are this callback's: the
      paths a checkpoint's saved state names are kept and forgotten (with a
      warning) unless each is a complete jaxlight checkpoint ``*.ckpt`` directly
      in ``dirpath``.
    - ``filename`` may not contain ``/`` or ``..`` (checkpoints live directly in
      ``dirpath``, where top-k and ``ckpt_path="last"`` look); nor may a metric
      name that ``auto_insert_metric_name`` inserts (``{val/loss}``): that is
      refused at fit start.

    The policy is :class:`~jaxlight.callbacks.checkpoint_policy.CheckpointPolicy` (``at_train_batch_end(info)``
    and the other ``at_*`` methods take a :class:`~jaxlight.step_info.StepInfo` and return a ``Decision``);
    the hooks here build the info and carry the decision out.
    """

    is_checkpoint_callback = True
    _dirpath_exchanges: ClassVar[int] = 0  # a fresh key-value key for each dirpath broadcast of the process

    def __init__(
        self,
        dirpath: str | os.PathLike | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        verbose: bool = False,
        save_last: bool | Literal["link"] | None = None,
        save_top_k: int = 1,
        save_weights_only: bool = False,
        mode: str = "min",
        auto_insert_metric_name: bool = True,
        every_n_train_steps: int | None = None,
        train_time_interval: timedelta | None = None,
        every_n_epochs: int | None = None,
        save_on_train_epoch_end: bool | None = None,
        enable_version_counter: bool = True,
        async_save: bool = True,
        save_non_finite: bool = False,
    ) -> None:
        if save_last not in (None, True, False, "link"):
            raise ValueError(f"save_last={save_last!r}; choose None, False, True (a copy) or 'link' (a symlink)")
        if save_top_k < -1:
            raise ValueError(f"save_top_k={save_top_k} must be >= -1 (-1 keeps every checkpoint)")
        if mode not in ("min", "max"):
            raise ValueError(f"mode={mode!r}; choose 'min' or 'max'")
        if monitor is None and save_top_k not in (-1, 0, 1):
            raise ValueError(
                f"ModelCheckpoint(save_top_k={save_top_k}, monitor=None) is not valid: without a "
                f"monitored quantity there is no order to keep the top {save_top_k} by"
            )
        for name, v in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
            if v is not None and (not isinstance(v, int) or v < 0):
                raise ValueError(f"{name}={v!r} must be an int >= 0")
        if sum(bool(v) for v in (every_n_train_steps, every_n_epochs)) + (train_time_interval is not None) > 1:
            raise ValueError(
                f"every_n_train_steps={every_n_train_steps}, every_n_epochs={every_n_epochs} and "
                f"train_time_interval={train_time_interval} are mutually exclusive; set one of them"
            )
        if train_time_interval is not None and not isinstance(train_time_interval, timedelta):
            raise ValueError(f"train_time_interval must be a datetime.timedelta, got {train_time_interval!r}")
        check_filename(filename)
        self.dirpath: str | None = os.path.abspath(os.fspath(dirpath)) if dirpath is not None else None
        self.filename = filename
        self.monitor = monitor
        self.verbose = verbose
        self.save_last = save_last
        self.save_top_k = save_top_k
        self.save_weights_only = save_weights_only
        self.mode = mode
        self.auto_insert_metric_name = auto_insert_metric_name
        if every_n_train_steps is None and every_n_epochs is None and train_time_interval is None:
            every_n_epochs = 1
        self._every_n_train_steps = every_n_train_steps or 0
        self._every_n_epochs = every_n_epochs or 0
        self._train_time_interval = train_time_interval
        self._save_on_train_epoch_end = save_on_train_epoch_end
        self._enable_version_counter = enable_version_counter
        self.async_save = async_save
        self.save_non_finite = save_non_finite

        self.best_k_models: dict[str, float] = {}
        self.kth_best_model_path = ""
        self.kth_value = math.inf if mode == "min" else -math.inf
        self.best_model_score: float | None = None
        self.best_model_path = ""
        self.last_model_path = ""
        self.current_score: float | None = None
        self._last_checkpoint_saved = ""  # Lightning's: the newest file written (what a "link" last points at)
        self._last_global_step_saved = 0  # Lightning: nothing to save before the first step
        self._last_progress_saved: tuple[int, int] | None = None
        self._last_time_checked: float | None = None
        self._defer_save_until_validation = False
        self._newest_path = ""  # the data path of the newest save (what save_now reports)
        self._extra_path = ""  # a forced (preemption) save outside the top k, kept until a newer save
        self._writer = CheckpointWriter(async_save)  # the lock, the checkpointer, publication, commit order
        self._txn = None  # the trigger being decided (CheckpointPolicy)
        self._committing: list[str] = []  # removals of the save being written (recorded in its state)
        self._restored_removals: list[str] = []
        # names this run's decisions publish (True) or remove (False): the version counter's view of the directory,
        # identical on every process whatever the commit timing
        self._virtual: dict[str, bool] = {}
        self._token_base = f"{os.getpid()}-"
        self._token_count = 0
        self._warn = WarnOnce()
        self._owned: set[str] = set()  # paths a restored state named, checked to be this callback's checkpoints
        self._step_loss: Any = None  # the loss of the latest train step (a device array, fetched only to save)

    @property
    def _checkpointer(self) -> Any:
        """The orbax checkpointer of this callback's saves (None before the first)."""
        return self._writer.checkpointer

    # ------------------------------------------------------------------ identity
    @property
    def state_key(self) -> str:
        return self._generate_state_key(
            monitor=self.monitor,
            mode=self.mode,
            every_n_train_steps=self._every_n_train_steps,
            every_n_epochs=self._every_n_epochs,
            train_time_interval=self._train_time_interval,
        )

    # ------------------------------------------------------------------ what a checkpoint callback declares
    @property
    def checkpoint_dirpath(self) -> str | None:
        return self.dirpath

    def best_checkpoint_path(self, saved_state: Mapping[str, Any] | None = None) -> str | None:
        best = self.best_model_path if saved_state is None else saved_state.get("best_model_path")
        return best or None

    @property
    def every_n_train_steps(self) -> int:
        return self._every_n_train_steps

    @property
    def every_n_epochs(self) -> int:
        return self._every_n_epochs

    @property
    def train_time_interval(self) -> timedelta | None:
        return self._train_time_interval

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        info = StepInfo.of_trainer(trainer)
        if self.dirpath is None:
            # process 0's choice everywhere: a versioned log dir may differ per process
            ModelCheckpoint._dirpath_exchanges += 1
            key = f"jaxlight/ckpt_dirpath/{ModelCheckpoint._dirpath_exchanges}"
            self.dirpath = distributed.broadcast_str(self._default_dirpath(info), key)
        primary = info.global_rank == 0  # the Trainer's is_global_zero
        self._writer.primary = primary
        if stage != "fit":
            return
        self._check_names()
        # locked for this run (which proves it writable) before anything is read or repaired there, and
        # before any compile; a failure on process 0 makes every process raise
        self._writer.take(self.dirpath, type(self).__name__)
        if primary:
            self._repair(self.dirpath)
            entries = [n for n in os.listdir(self.dirpath) if n != dirlock.INNER_LOCK]
            if self.save_top_k != 0 and entries:
                rank_zero_warn(f"Checkpoint directory {self.dirpath} exists and is not empty.")

    def _repair(self, dirpath: str) -> None:
        """Finish or undo what a killed run left mid-operation in this callback's directory (process 0, at fit
        start, before any save): :func:`jaxlight.checkpoint.publish.repair` with this callback's names."""
        publish.repair(
            dirpath,
            self._token(),
            last_prefix=self.CHECKPOINT_NAME_LAST,
            extension=self.FILE_EXTENSION,
            link_last=self.save_last == "link",
        )

    # ------------------------------------------------------------------ hooks: build the info, carry the decision out
    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self._carry_out(trainer, self.at_train_start(StepInfo.of_trainer(trainer)))

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._every_n_train_steps < 1 and self._train_time_interval is None:
            # no trigger of this callback fires at a batch end: the usual step builds no info (runs every step)
            self.record_step_loss(outputs)
            return
        # not the batch: a hook that reads it makes the loop place every batch in Python
        info = StepInfo.of_trainer(trainer, outputs=outputs, batch_idx=batch_idx)
        self._carry_out(trainer, self.at_train_batch_end(info))

    def on_train_epoch_end(self, trainer: Trainer, pl_module: Any) -> None:
        self._carry_out(trainer, self.at_train_epoch_end(StepInfo.of_trainer(trainer)))

    def on_validation_end(self, trainer: Trainer, pl_module: Any) -> None:
        self._carry_out(trainer, self.at_validation_end(StepInfo.of_trainer(trainer)))

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        """Lightning: with ``save_last`` and nothing saved in the whole fit, ``last`` is written at the end."""
        self._carry_out(trainer, self.at_train_end(StepInfo.of_trainer(trainer)))

    def on_exception(self, trainer: Trainer, pl_module: Any, exception: BaseException) -> None:
        # let an in-flight save commit: it is the run's newest complete state
        self.wait_until_finished()

    def teardown(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        try:
            self.wait_until_finished()
        finally:
            self._writer.release()

    # ------------------------------------------------------------------ carrying a decision out
    def _token(self) -> str:
        self._token_count += 1
        return f"{self._token_base}{self._token_count}"

    def _carry_out(self, trainer: Trainer, decision: Decision, *, sync: bool = False, reason: str = "periodic") -> None:
        """Write the decision's checkpoint (one orbax save) and hand its plan to the publisher."""
        if decision.empty:
            return
        plan = publish.Plan(
            self._token(),
            names=list(decision.names),
            links=list(decision.links),
            removals=list(decision.removals),
            protect=decision.protect,
        )
        if not plan.names:
            self._writer.submit(plan)
            return
        self._committing = plan.removals  # recorded in the save's own state (state_dict), for a resume after a kill
        view, weights_only = view_of(trainer), self.save_weights_only
        self._writer.async_save = self.async_save  # read at the save, as the attribute may be set after __init__
        try:  # the snapshot is built inside the save, after the previous save committed
            self._writer.write(
                lambda: snapshot_of(view, weights_only), plan, fresh=decision.fresh, sync=sync, reason=reason
            )
        finally:
            self._committing = []
        self._newest_path = plan.names[0]
        self._last_progress_saved = (decision.global_step, decision.micro_batches)
        if decision.extra:
            self._extra_path = decision.extra

    def wait_until_finished(self) -> None:
        """Block until every save has committed and its bookkeeping ran; raise a background save's error."""
        self._writer.wait()

    def save_now(self, trainer: Trainer, reason: str = "preemption") -> str | None:
        """Write the current state synchronously (unless this exact point is already saved) and wait.

        Used by :class:`jaxlight.callbacks.Preemption`; returns the checkpoint path. The state is saved as a
        top-k checkpoint when it qualifies, else as an extra one kept until the next save; ``last`` follows.
        """
        if self.dirpath is None:
            self.setup(trainer, trainer.lightning_module, "fit")
        decision = self.at_forced_save(StepInfo.of_trainer(trainer), reason)
        if decision.empty:  # already saved, or non-finite: the newest finite checkpoint stands for this point
            self.wait_until_finished()
            return self._newest_path or None
        self._carry_out(trainer, decision, sync=True, reason=reason)
        return self._newest_path

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "monitor": self.monitor,
            "best_model_score": self.best_model_score,
            "best_model_path": self.best_model_path,
            "current_score": self.current_score,
            "dirpath": self.dirpath,
            "best_k_models": dict(self.best_k_models),
            "kth_best_model_path": self.kth_best_model_path,
            "kth_value": self.kth_value,
            "last_model_path": self.last_model_path,
            "last_checkpoint_saved": self._last_checkpoint_saved,
            "last_global_step_saved": self._last_global_step_saved,
            "extra_path": self._extra_path,
            # what this save replaces: a resume from it removes them if a kill came before the removal
            "pending_removals": list(self._committing),
        }

    def check_state_dict(self, state_dict: Any) -> None:
        """The saved state has the types :meth:`load_state_dict` reads (it may come from anyone)."""
        check_checkpoint_callback_state(state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_global_step_saved = state_dict.get("last_global_step_saved", self._last_global_step_saved)
        dirpath_from_ckpt = state_dict.get("dirpath", self.dirpath)
        self.best_model_path = state_dict.get("best_model_path", "")
        if dirpath_from_ckpt != self.dirpath:
            rank_zero_warn(
                f"The dirpath has changed from {dirpath_from_ckpt!r} to {self.dirpath!r}, therefore "
                f"`best_model_score`, `kth_best_model_path`, `kth_value`, `last_model_path` and `best_k_models` "
                f"won't be reloaded. Only `best_model_path` will be reloaded."
            )
            return

        # A checkpoint may come from anyone: a path it names is this callback's to replace or remove only when
        # it is one of its complete checkpoints in dirpath; anything else stays on disk and is forgotten.
        self._owned = set()

        def own(p: str, key: str) -> bool:
            why = not_own_checkpoint(p, self.dirpath or "", self.FILE_EXTENSION)
            if why is None:
                self._owned.add(os.path.normpath(p))
                return True
            if why != "missing":  # gone: a kill between a commit and its clean-up can leave either state
                rank_zero_warn(
                    f"ModelCheckpoint: the checkpoint resumed from names {p!r} in {key}, which is {why}; it is "
                    f"not a checkpoint of this callback, so it is left on disk untouched and forgotten"
                )
            return False

        def present(p: str, key: str) -> str:
            return p if p and own(p, key) else ""

        self.best_model_score = state_dict.get("best_model_score")
        self.current_score = state_dict.get("current_score")
        self.best_k_models = {p: v for p, v in state_dict.get("best_k_models", {}).items() if own(p, "best_k_models")}
        self.kth_best_model_path = state_dict.get("kth_best_model_path", "")
        self.kth_value = state_dict.get("kth_value", self.kth_value)
        last = state_dict.get("last_model_path", "")
        self.last_model_path = last if not last or own(last, "last_model_path") or not os.path.lexists(last) else ""
        self._last_checkpoint_saved = present(state_dict.get("last_checkpoint_saved", ""), "last_checkpoint_saved")
        self._extra_path = present(state_dict.get("extra_path", ""), "extra_path")
        self._restored_removals = [p for p in state_dict.get("pending_removals", []) if own(p, "pending_removals")]
        best = self.best_model_path
        if best and self._in_dirpath(best) and best not in self.best_k_models and os.path.lexists(best):
            if not own(best, "best_model_path"):
                self.best_model_path = ""
        if self.monitor is not None and self.best_k_models and self.best_model_path not in self.best_k_models:
            pick = min if self.mode == "min" else max
            self.best_model_path = pick(self.best_k_models, key=self.best_k_models.get)  # type: ignore[arg-type]
            self.best_model_score = self.best_k_models[self.best_model_path]
        if self.kth_best_model_path and self.kth_best_model_path not in self.best_k_models:
            pick = max if self.mode == "min" else min
            if self.best_k_models:
                self.kth_best_model_path = pick(self.best_k_models, key=self.best_k_models.get)  # type: ignore[arg-type]
                self.kth_value = self.best_k_models[self.kth_best_model_path]
            else:
                self.kth_best_model_path = ""


__all__ = ["ModelCheckpoint"]
