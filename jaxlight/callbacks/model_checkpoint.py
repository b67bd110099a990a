"""ModelCheckpoint: Lightning's checkpoint callback on orbax-checkpoint, saving asynchronously.

This module holds Lightning's *policy* only, decided on every process in the
loop: when to save, the file names, the top-k set and ``last``. A trigger
makes at most one save (a :class:`~jaxlight.checkpoint.RunSnapshot` of the
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
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from jaxlight import distributed
from jaxlight.callbacks.callback import Callback
from jaxlight.checkpoint import dirlock, publish
from jaxlight.checkpoint.discovery import check_filename, not_own_checkpoint
from jaxlight.checkpoint.schema import check_checkpoint_callback_state
from jaxlight.checkpoint.trainer_io import snapshot_of, view_of
from jaxlight.checkpoint.writer import CheckpointWriter
from jaxlight.errors import MisconfigurationError
from jaxlight.rank_zero import WarnOnce, rank_zero_info, rank_zero_warn

if TYPE_CHECKING:  # pragma: no cover
    from jaxlight.trainer import Trainer


@dataclass
class _Txn:
    """What one trigger decided (Lightning's _save_checkpoint / _link_checkpoint / _remove_checkpoint calls)."""

    names: list[str] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)
    removals: list[str] = field(default_factory=list)


class ModelCheckpoint(Callback):
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
    """

    CHECKPOINT_JOIN_CHAR = "-"
    CHECKPOINT_EQUALS_CHAR = "="
    CHECKPOINT_NAME_LAST = "last"
    FILE_EXTENSION = ".ckpt"
    STARTING_VERSION = 1
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
        self._txn: _Txn | None = None
        self._committing: list[str] = []  # removals of the save being written (recorded in its state)
        self._restored_removals: list[str] = []
        # names this run published (True) or removed (False): the version counter's view of the directory,
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
        if self.dirpath is None:
            # process 0's choice everywhere: a versioned log dir may differ per process
            ModelCheckpoint._dirpath_exchanges += 1
            key = f"jaxlight/ckpt_dirpath/{ModelCheckpoint._dirpath_exchanges}"
            self.dirpath = distributed.broadcast_str(self._default_dirpath(trainer), key)
        self._writer.primary = trainer.is_global_zero
        if stage != "fit":
            return
        self._check_names()
        # locked for this run (which proves it writable) before anything is read or repaired there, and
        # before any compile; a failure on process 0 makes every process raise
        self._writer.take(self.dirpath, type(self).__name__)
        if trainer.is_global_zero:
            self._repair(self.dirpath)
            entries = [n for n in os.listdir(self.dirpath) if n != dirlock.INNER_LOCK]
            if self.save_top_k != 0 and entries:
                rank_zero_warn(f"Checkpoint directory {self.dirpath} exists and is not empty.")

    def _check_names(self) -> None:
        """The names this callback will write lie directly in ``dirpath`` (a metric name inserted by
        ``auto_insert_metric_name`` may carry a "/")."""
        names = {n[1:] for n in re.findall(r"(\{.*?)[:\}]", self.filename or "")}
        try:
            sample = self.format_checkpoint_name(dict.fromkeys(names, 0) | {"epoch": 0, "step": 0})
        except (ValueError, KeyError, IndexError):  # a format spec a number does not take: found at the save
            return
        if os.path.dirname(sample) != self.dirpath:
            slashed = sorted(n for n in names if "/" in n)
            raise MisconfigurationError(
                f"ModelCheckpoint(filename={self.filename!r}) would write checkpoints such as "
                f"{os.path.relpath(sample, self.dirpath)!r}, in a subdirectory of {self.dirpath} where top-k and "
                f"ckpt_path='last' do not look: auto_insert_metric_name inserts the metric name{'s' if len(slashed) > 1 else ''} "
                f"{', '.join(map(repr, slashed))} with its '/'. Pass auto_insert_metric_name=False with a filename "
                f"such as '{{epoch}}-val_loss={{val/loss:.3f}}', or log the metric under a name without '/'"
            )

    def _default_dirpath(self, trainer: Trainer) -> str:
        if trainer.loggers:
            return os.path.abspath(os.path.join(trainer.log_dir, "checkpoints"))
        return os.path.abspath(os.path.join(trainer.default_root_dir, "checkpoints"))

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

    # ------------------------------------------------------------------ triggers (Lightning's)
    def _should_skip_saving_checkpoint(self, trainer: Trainer) -> bool:
        return bool(
            trainer.fast_dev_run
            or not trainer.training
            or trainer.sanity_checking
            or self._last_global_step_saved == trainer.global_step
        )

    def _should_save_on_train_epoch_end(self, trainer: Trainer) -> bool:
        if self._save_on_train_epoch_end is not None:
            return self._save_on_train_epoch_end
        if trainer.check_val_every_n_epoch != 1:
            return False
        if not trainer.num_val_batches or trainer.limit_val_batches == 0:
            return True
        return trainer.val_check_interval == 1.0

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self._last_time_checked = time.monotonic()
        if self._restored_removals:  # a kill between a commit and its removals: finish them
            removals, self._restored_removals = self._restored_removals, []
            keep = set(self.best_k_models) | {self.best_model_path, self._last_checkpoint_saved, self._extra_path}
            keep |= {self.last_model_path, self._resume_path(trainer)}
            gone = [p for p in removals if p not in keep and self._in_dirpath(p) and self._may_remove(p)]
            if gone:
                self._writer.submit(publish.Plan(self._token(), removals=gone))

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # kept by reference (no sync): fetched only when a save is decided, which syncs anyway
        self._step_loss = outputs.get("loss") if type(outputs) is dict or isinstance(outputs, Mapping) else None
        skip_batch = self._every_n_train_steps < 1 or trainer.global_step % self._every_n_train_steps != 0
        if skip_batch and self._train_time_interval is None:
            return  # the usual step: nothing is due (checked first, it runs after every train step)
        skip_due_to_state = self._should_skip_saving_checkpoint(trainer)
        skip_time = True
        now = time.monotonic()
        if self._train_time_interval is not None:
            prev = self._last_time_checked
            due = prev is not None and now - prev >= self._train_time_interval.total_seconds()
            skip_time = not distributed.broadcast_bool(due)  # clocks differ between processes: process 0 decides
        if skip_batch and skip_time:
            return
        if not skip_time:
            self._last_time_checked = now
        candidates = self._monitor_candidates(trainer)
        if self.monitor is not None and self.monitor not in candidates:
            if self.save_top_k != 0 and not self._validation_runs(trainer):
                # the earliest point this can be known: the train step's logged keys exist once it has run
                raise self._missing_monitor(
                    trainer,
                    "; validation does not run in this fit (no val dataloader, or limit_val_batches=0), so a value "
                    "logged only in validation never arrives and every_n_train_steps would save nothing",
                )
            # a validation-only metric: save once validation has produced it
            self._defer_save_until_validation = True
            return
        if self.monitor is not None and not self._should_save_on_train_epoch_end(trainer):
            last_batch = trainer.num_training_batches != math.inf and batch_idx + 1 >= trainer.num_training_batches
            cve = trainer.check_val_every_n_epoch
            will_validate = bool(trainer.num_val_batches) and trainer.limit_val_batches != 0
            will_validate = will_validate and (cve is None or (trainer.current_epoch + 1) % cve == 0)
            if last_batch and will_validate:  # the monitored value is about to be refreshed
                self._defer_save_until_validation = True
                return
        if skip_due_to_state or self._skip_non_finite(trainer, candidates):
            return
        self._begin()
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)
        self._commit(trainer)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: Any) -> None:
        if not self._should_skip_saving_checkpoint(trainer) and self._should_save_on_train_epoch_end(trainer):
            self._epoch_trigger(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: Any) -> None:
        if self._should_skip_saving_checkpoint(trainer) or self._should_save_on_train_epoch_end(trainer):
            return
        if self._defer_save_until_validation:
            candidates = self._monitor_candidates(trainer)
            if self.monitor is not None and self.monitor not in candidates and self.save_top_k != 0:
                raise self._missing_monitor(trainer)
            if self._skip_non_finite(trainer, candidates):
                return
            self._begin()
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
            self._commit(trainer)
            self._defer_save_until_validation = False
            return
        self._epoch_trigger(trainer)

    def _epoch_trigger(self, trainer: Trainer) -> None:
        candidates = self._monitor_candidates(trainer)
        if self._skip_non_finite(trainer, candidates):
            return
        self._begin()
        if self._every_n_epochs >= 1 and (trainer.current_epoch + 1) % self._every_n_epochs == 0:
            self._save_topk_checkpoint(trainer, candidates)
        # last follows only an actual save at this step, or (a link) the newest file
        if self._last_global_step_saved == trainer.global_step or (
            self.save_last == "link" and self._last_checkpoint_saved
        ):
            self._save_last_checkpoint(trainer, candidates)
        self._commit(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        """Lightning: with ``save_last`` and nothing saved in the whole fit, ``last`` is written at the end."""
        if self.save_last and not self._last_checkpoint_saved and not trainer.fast_dev_run:
            candidates = self._monitor_candidates(trainer)
            if self._skip_non_finite(trainer, candidates):
                return
            self._begin()
            self._save_last_checkpoint(trainer, candidates)
            self._commit(trainer)

    def on_exception(self, trainer: Trainer, pl_module: Any, exception: BaseException) -> None:
        # let an in-flight save commit: it is the run's newest complete state
        self.wait_until_finished()

    def teardown(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        try:
            self.wait_until_finished()
        finally:
            self._writer.release()

    # ------------------------------------------------------------------ what is not saved
    def _validation_runs(self, trainer: Trainer) -> bool:
        """Whether this fit validates at all (``num_val_batches`` is known only once validation ran)."""
        return trainer.val_dataloaders is not None and trainer.limit_val_batches != 0

    def _missing_monitor(self, trainer: Trainer, why: str = "") -> MisconfigurationError:
        """Lightning's error for a monitored key that was not logged, naming the keys that were."""
        return MisconfigurationError(
            f"ModelCheckpoint(monitor={self.monitor!r}) could not find the monitored key in the logged "
            f"metrics: {sorted(trainer.callback_metrics)}{why}. HINT: did you call self.log({self.monitor!r}, "
            f"value) in the LightningModule?"
        )

    def _loss_value(self) -> float | None:
        loss, self._step_loss = self._step_loss, None
        if loss is None:
            return None
        try:
            return float(loss)
        except (TypeError, ValueError, RuntimeError):  # not a scalar this process can read: not judged
            return None

    def _skip_non_finite(self, trainer: Trainer, candidates: Mapping[str, Any]) -> bool:
        """Whether the state about to be saved is not saved because it is non-finite (``save_non_finite``): its
        step's training loss or its monitored value is NaN or infinite. The decision is the same on every
        process (the loss and the metrics are the same everywhere)."""
        loss = self._loss_value()
        if self.save_non_finite:
            return False
        bad = []
        if loss is not None and not math.isfinite(loss):
            bad.append(f"the training loss is {loss}")
        score = candidates.get(self.monitor) if self.monitor is not None else None
        if score is not None and not math.isfinite(score):
            bad.append(f"{self.monitor}={score}")
        if not bad:
            return False
        self._warn(
            ("non-finite",),
            f"ModelCheckpoint: not saving global step {trainer.global_step}: {' and '.join(bad)}. The finite "
            f"checkpoints saved so far are kept (top-k and last); later non-finite states are not saved either "
            f"(not reported again). Pass ModelCheckpoint(save_non_finite=True) to save them, or use "
            f"NonFiniteGuard to stop or skip such steps",
        )
        return True

    # ------------------------------------------------------------------ names
    @classmethod
    def _format_checkpoint_name(
        cls, filename: str | None, metrics: dict[str, Any], prefix: str = "", auto_insert_metric_name: bool = True
    ) -> str:
        if not filename:
            filename = "{epoch}" + cls.CHECKPOINT_JOIN_CHAR + "{step}"
        groups = re.findall(r"(\{.*?)[:\}]", filename)
        metrics = dict(metrics)
        for group in sorted(set(groups), key=len, reverse=True):
            name = group[1:]
            if auto_insert_metric_name:
                filename = filename.replace(group, name + cls.CHECKPOINT_EQUALS_CHAR + "{" + name)
            # format() cannot take names with "/" or "." as fields
            safe = re.sub(r"[^0-9a-zA-Z_]", "_", name)
            filename = filename.replace("{" + name, "{" + safe)
            if name not in metrics:
                metrics[name] = 0
            metrics[safe] = metrics[name]
        filename = filename.format(**metrics)
        if prefix:
            filename = cls.CHECKPOINT_JOIN_CHAR.join([prefix, filename])
        return filename

    def format_checkpoint_name(
        self, metrics: dict[str, Any], filename: str | None = None, ver: int | None = None
    ) -> str:
        """The path a checkpoint with these metric values is written to."""
        filename = filename or self.filename
        name = self._format_checkpoint_name(filename, metrics, auto_insert_metric_name=self.auto_insert_metric_name)
        if ver is not None:
            name = self.CHECKPOINT_JOIN_CHAR.join((name, f"v{ver}"))
        assert self.dirpath is not None
        return os.path.join(self.dirpath, name + self.FILE_EXTENSION)

    def _monitor_candidates(self, trainer: Trainer) -> dict[str, Any]:
        """Host values of what the filename and monitor need (only those are fetched: no full sync)."""
        names = {n[1:] for n in re.findall(r"(\{.*?)[:\}]", self.filename or "")}
        if self.monitor is not None:
            names.add(self.monitor)
        out: dict[str, Any] = {}
        for n in names:
            v = trainer.callback_metrics.get(n)
            if v is not None:
                out[n] = float(v)
        out["epoch"] = int(out["epoch"]) if "epoch" in out else trainer.current_epoch
        out["step"] = int(out["step"]) if "step" in out else trainer.global_step
        return out

    def file_exists(self, filepath: str, trainer: Trainer | None = None) -> bool:
        """Whether ``filepath`` exists, counting this run's saves and removals still being committed."""
        if filepath in self._virtual:
            return self._virtual[filepath]
        return os.path.lexists(filepath)

    def _get_metric_interpolated_filepath_name(
        self, candidates: dict[str, Any], trainer: Trainer, del_filepath: str | None = None
    ) -> str:
        filepath = self.format_checkpoint_name(candidates)
        if self._enable_version_counter:
            ver = self.STARTING_VERSION
            while self.file_exists(filepath, trainer) and filepath != del_filepath:
                filepath = self.format_checkpoint_name(candidates, ver=ver)
                ver += 1
        return filepath

    # ------------------------------------------------------------------ Lightning's top-k and last logic
    def check_monitor_top_k(self, trainer: Trainer, current: float | None = None) -> bool:
        if current is None:
            return False
        if self.save_top_k == -1:
            return True
        if len(self.best_k_models) < self.save_top_k:
            return True
        kth = self.best_k_models[self.kth_best_model_path]
        return current < kth if self.mode == "min" else current > kth

    def _save_topk_checkpoint(self, trainer: Trainer, candidates: dict[str, Any]) -> None:
        if self.save_top_k == 0:
            return
        if self.monitor is not None:
            if self.monitor not in candidates:  # the first save without it: say so now, not never
                raise self._missing_monitor(trainer)
            self._save_monitor_checkpoint(trainer, candidates)
        else:
            self._save_none_monitor_checkpoint(trainer, candidates)

    def _save_monitor_checkpoint(self, trainer: Trainer, candidates: dict[str, Any]) -> None:
        assert self.monitor is not None
        current = candidates.get(self.monitor)
        if self.check_monitor_top_k(trainer, current):
            assert current is not None
            self._update_best_and_save(current, trainer, candidates)
        elif self.verbose:
            rank_zero_info(
                f"Epoch {candidates['epoch']:d}, global step {candidates['step']:d}: {self.monitor!r} was not in "
                f"top {self.save_top_k}"
            )

    def _save_none_monitor_checkpoint(self, trainer: Trainer, candidates: dict[str, Any]) -> None:
        filepath = self._get_metric_interpolated_filepath_name(candidates, trainer, self.best_model_path)
        previous, self.best_model_path = self.best_model_path, filepath
        self._save_checkpoint(trainer, filepath)
        if self.save_top_k == 1 and previous and self._should_remove_checkpoint(trainer, previous, filepath):
            self._remove_checkpoint(trainer, previous)

    def _update_best_and_save(self, current: float, trainer: Trainer, candidates: dict[str, Any]) -> None:
        k = len(self.best_k_models) + 1 if self.save_top_k == -1 else self.save_top_k
        del_filepath = None
        if len(self.best_k_models) == k and k > 0:
            del_filepath = self.kth_best_model_path
            self.best_k_models.pop(del_filepath)
        if math.isnan(current):  # a NaN score ranks last
            current = math.inf if self.mode == "min" else -math.inf
        filepath = self._get_metric_interpolated_filepath_name(candidates, trainer, del_filepath)
        self.current_score = current
        self.best_k_models[filepath] = current
        if len(self.best_k_models) == k:
            pick = max if self.mode == "min" else min
            self.kth_best_model_path = pick(self.best_k_models, key=self.best_k_models.get)  # type: ignore[arg-type]
            self.kth_value = self.best_k_models[self.kth_best_model_path]
        pick = min if self.mode == "min" else max
        self.best_model_path = pick(self.best_k_models, key=self.best_k_models.get)  # type: ignore[arg-type]
        self.best_model_score = self.best_k_models[self.best_model_path]
        if self.verbose:
            rank_zero_info(
                f"Epoch {candidates['epoch']:d}, global step {candidates['step']:d}: {self.monitor!r} reached "
                f"{current:0.5f} (best {self.best_model_score:0.5f}), saving model to {filepath!r} as top {k}"
            )
        self._save_checkpoint(trainer, filepath)
        if del_filepath and self._should_remove_checkpoint(trainer, del_filepath, filepath):
            self._remove_checkpoint(trainer, del_filepath)

    def _save_last_checkpoint(self, trainer: Trainer, candidates: dict[str, Any]) -> None:
        if not self.save_last:
            return
        filepath = self.format_checkpoint_name(candidates, self.CHECKPOINT_NAME_LAST)
        if self._enable_version_counter:
            ver = self.STARTING_VERSION
            while self.file_exists(filepath, trainer) and filepath != self.last_model_path:
                filepath = self.format_checkpoint_name(candidates, self.CHECKPOINT_NAME_LAST, ver=ver)
                ver += 1
        previous, self.last_model_path = self.last_model_path, filepath
        if self.save_last == "link" and self._last_checkpoint_saved and self.save_top_k != 0:
            self._link_checkpoint(trainer, self._last_checkpoint_saved, filepath)
        else:
            self._save_checkpoint(trainer, filepath)
        if previous and self._should_remove_checkpoint(trainer, previous, filepath):
            self._remove_checkpoint(trainer, previous)

    def _resume_path(self, trainer: Trainer) -> str:
        """The checkpoint the run resumed from, as given (a ``last`` link is not followed, as in Lightning)."""
        p = trainer.ckpt_path
        return os.path.abspath(p) if isinstance(p, (str, os.PathLike)) else ""

    def _in_dirpath(self, path: str) -> bool:
        return self.dirpath is not None and os.path.dirname(os.path.abspath(path)) == self.dirpath

    def _may_remove(self, path: str) -> bool:
        """Only what this run published, or a restored path checked to be this callback's checkpoint."""
        return self._virtual.get(path, False) or os.path.normpath(path) in self._owned

    def _should_remove_checkpoint(self, trainer: Trainer, previous: str, current: str) -> bool:
        """Lightning's rule: never the file just written, one outside ``dirpath``, or the one resumed from
        (unless that was a ``last`` checkpoint, which later saves replace)."""
        if previous == current or not self._in_dirpath(previous) or not self._may_remove(previous):
            return False
        resume = self._resume_path(trainer)
        if not resume or os.path.basename(resume).startswith(self.CHECKPOINT_NAME_LAST):
            return True
        return os.path.abspath(previous) != resume

    # ------------------------------------------------------------------ recording a trigger's decisions
    def _begin(self) -> None:
        self._txn = _Txn()

    def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        assert self._txn is not None
        self._txn.names.append(filepath)
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath

    def _link_checkpoint(self, trainer: Trainer, filepath: str, linkpath: str) -> None:
        assert self._txn is not None
        if os.path.abspath(filepath) != os.path.abspath(linkpath):
            self._txn.links.append((linkpath, filepath))

    def _remove_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        assert self._txn is not None
        self._txn.removals.append(filepath)

    def _token(self) -> str:
        self._token_count += 1
        return f"{self._token_base}{self._token_count}"

    def _commit(self, trainer: Trainer, *, sync: bool = False, reason: str = "periodic") -> None:
        """Write the trigger's checkpoint (one orbax save) and hand its plan to the publisher."""
        txn, self._txn = self._txn, None
        if txn is None or not (txn.names or txn.links or txn.removals):
            return
        if txn.names and self._extra_path and self._extra_path not in txn.names:
            kept = set(self.best_k_models) | {self.best_model_path, self._last_checkpoint_saved}
            if self._extra_path not in kept and self._should_remove_checkpoint(trainer, self._extra_path, ""):
                txn.removals.append(self._extra_path)
            self._extra_path = ""
        token = self._token()
        protect = set(txn.names) | {t for _, t in txn.links} | {lk for lk, _ in txn.links}
        resume = self._resume_path(trainer)
        plan = publish.Plan(
            token,
            names=list(dict.fromkeys(txn.names)),
            links=txn.links,
            removals=[p for p in dict.fromkeys(txn.removals) if p not in protect],
            protect=frozenset(protect | ({resume} if resume else set())),
        )
        # orbax writes to a path that does not exist: the final name, or a stand-in when this run used the name
        # before or it is on disk (Lightning overwrites such a file; here the commit exchanges it)
        primary = plan.names[0] if plan.names else ""
        fresh = bool(primary) and primary not in self._virtual and not os.path.lexists(primary)
        for p in plan.removals:
            self._virtual[p] = False
        for p in protect:
            self._virtual[p] = True
        if not plan.names:
            self._writer.submit(plan)
            return
        self._committing = plan.removals
        view, weights_only = view_of(trainer), self.save_weights_only
        self._writer.async_save = self.async_save  # read at the save, as the attribute may be set after __init__
        try:  # the snapshot is built inside the save, after the previous save committed
            self._writer.write(lambda: snapshot_of(view, weights_only), plan, fresh=fresh, sync=sync, reason=reason)
        finally:
            self._committing = []
        self._newest_path = primary
        self._last_progress_saved = (trainer.global_step, trainer.position.micro_batches)

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
        if self._last_progress_saved == (trainer.global_step, trainer.position.micro_batches) and self._newest_path:
            self.wait_until_finished()
            return self._newest_path
        candidates = self._monitor_candidates(trainer)
        if self._skip_non_finite(trainer, candidates):  # the newest finite checkpoint stands for this point
            self.wait_until_finished()
            return self._newest_path or None
        self._begin()
        assert self._txn is not None
        if self.save_top_k != 0 and (self.monitor is None or self.monitor in candidates):
            self._save_topk_checkpoint(trainer, candidates)
        if not self._txn.names:
            filepath = self._get_metric_interpolated_filepath_name(candidates, trainer)
            self._save_checkpoint(trainer, filepath)
            extra = filepath
        else:
            extra = ""
        self._save_last_checkpoint(trainer, candidates)
        self._commit(trainer, sync=True, reason=reason)
        if extra:
            self._extra_path = extra
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
