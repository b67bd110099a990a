"""ModelCheckpoint: Lightning's checkpoint callback on orbax-checkpoint, saving asynchronously."""

from __future__ import annotations

import math
import os
import re
import shutil
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import jax

from jaxlight.callbacks.callback import Callback

if TYPE_CHECKING:  # pragma: no cover
    from jaxlight.trainer import Trainer


class ModelCheckpoint(Callback):
    """Saves the run periodically; keeps the ``save_top_k`` best by ``monitor`` and a ``last`` link.

    Arguments and triggers follow PyTorch Lightning: by default one checkpoint
    per epoch (at train-epoch end, or after validation when validation runs
    more often than once per epoch), ``every_n_train_steps`` /
    ``every_n_epochs`` / ``train_time_interval`` change the cadence, and
    ``filename`` is a template such as ``"{epoch}-{val_loss:.2f}"`` (names are
    inserted as ``name=value`` unless ``auto_insert_metric_name=False``).

    Each checkpoint is an orbax directory ``<dirpath>/<filename>.ckpt``. Saves
    are asynchronous (``async_save=True``): the call returns once the arrays
    are copied off the devices and training continues while they are written;
    orbax writes into a temporary directory and renames it on commit, so only
    complete checkpoints ever carry a final name. Files are removed (top-k
    eviction) and the ``last.ckpt`` symlink is moved only after the newer
    checkpoint has committed, so an interrupted save never leaves the run
    without its previous checkpoint. ``best_model_path``, ``best_model_score``,
    ``best_k_models``, ``kth_best_model_path`` and ``last_model_path`` are kept
    as in Lightning and restored on resume.
    """

    CHECKPOINT_JOIN_CHAR = "-"
    CHECKPOINT_EQUALS_CHAR = "="
    CHECKPOINT_NAME_LAST = "last"
    FILE_EXTENSION = ".ckpt"
    STARTING_VERSION = 1
    _is_checkpoint_callback = True

    def __init__(
        self,
        dirpath: str | os.PathLike | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        verbose: bool = False,
        save_last: bool | None = None,
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
    ) -> None:
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
        if sum(bool(v) for v in (every_n_train_steps, every_n_epochs, train_time_interval)) > 1:
            raise ValueError(
                f"every_n_train_steps={every_n_train_steps}, every_n_epochs={every_n_epochs} and "
                f"train_time_interval={train_time_interval} are mutually exclusive; set one of them"
            )
        if train_time_interval is not None and not isinstance(train_time_interval, timedelta):
            raise ValueError(f"train_time_interval must be a datetime.timedelta, got {train_time_interval!r}")
        self.dirpath: str | None = os.path.abspath(os.fspath(dirpath)) if dirpath is not None else None
        self.filename = filename
        self.monitor = monitor
        self.verbose = verbose
        self.save_last = save_last
        self.save_top_k = save_top_k
        self.save_weights_only = save_weights_only
        self.mode = mode
        self.auto_insert_metric_name = auto_insert_metric_name
        if not every_n_train_steps and not every_n_epochs and train_time_interval is None:
            every_n_epochs = 1
        self._every_n_train_steps = every_n_train_steps or 0
        self._every_n_epochs = every_n_epochs or 0
        self._train_time_interval = train_time_interval
        self._save_on_train_epoch_end = save_on_train_epoch_end
        self._enable_version_counter = enable_version_counter
        self.async_save = async_save

        self.best_k_models: dict[str, float] = {}
        self.kth_best_model_path = ""
        self.kth_value = math.inf if mode == "min" else -math.inf
        self.best_model_score: float | None = None
        self.best_model_path = ""
        self.last_model_path = ""
        self.current_score: float | None = None
        self._newest_path = ""  # the most recent checkpoint written (what last.ckpt points at)
        self._last_global_step_saved = 0  # Lightning: nothing to save before the first step
        self._last_progress_saved: tuple[int, int] | None = None
        self._last_time_check: float | None = None
        self._checkpointer: Any = None
        self._pending: list[Callable[[], None]] = []  # run once the in-flight save has committed
        self._dirpath_from_user = dirpath is not None

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
            self.dirpath = self._broadcast(trainer, self._default_dirpath(trainer))

    def _default_dirpath(self, trainer: Trainer) -> str:
        if trainer.loggers:
            return os.path.abspath(os.path.join(trainer.log_dir, "checkpoints"))
        return os.path.abspath(os.path.join(trainer.default_root_dir, "checkpoints"))

    @staticmethod
    def _broadcast(trainer: Trainer, value: str) -> str:
        """Process 0's value on every process (a versioned log dir may differ per process)."""
        if jax.process_count() == 1:
            return value
        from jax._src import distributed

        client = distributed.global_state.client
        ModelCheckpoint._bcast_count = getattr(ModelCheckpoint, "_bcast_count", 0) + 1
        key = f"jaxlight/ckpt_dirpath/{ModelCheckpoint._bcast_count}"
        if jax.process_index() == 0:
            client.key_value_set(key, value)
            return value
        return client.blocking_key_value_get(key, 300_000)

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

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._run_pending()
        if self._should_skip_saving_checkpoint(trainer):
            return
        skip_batch = self._every_n_train_steps < 1 or trainer.global_step % self._every_n_train_steps != 0
        skip_time = True
        now = time.monotonic()
        if self._train_time_interval is not None:
            if self._last_time_check is None:
                self._last_time_check = now
            due = now - self._last_time_check >= self._train_time_interval.total_seconds()
            skip_time = not self._agree(trainer, due)
            if not skip_time:
                self._last_time_check = now
        if skip_batch and skip_time:
            return
        self._save(trainer)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: Any) -> None:
        if not self._should_skip_saving_checkpoint(trainer) and self._should_save_on_train_epoch_end(trainer):
            if self._every_n_epochs >= 1 and (trainer.current_epoch + 1) % self._every_n_epochs == 0:
                self._save(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: Any) -> None:
        if not self._should_skip_saving_checkpoint(trainer) and not self._should_save_on_train_epoch_end(trainer):
            if self._every_n_epochs >= 1 and (trainer.current_epoch + 1) % self._every_n_epochs == 0:
                self._save(trainer)

    def on_exception(self, trainer: Trainer, pl_module: Any, exception: BaseException) -> None:
        # let an in-flight save commit: it is the run's newest complete state
        self.wait_until_finished()

    def teardown(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        self.wait_until_finished()

    @staticmethod
    def _agree(trainer: Trainer, flag: bool) -> bool:
        """Process 0's decision (clocks differ between processes; every process must save together)."""
        if jax.process_count() == 1:
            return flag
        import numpy as np
        from jax.experimental import multihost_utils

        return bool(multihost_utils.broadcast_one_to_all(np.bool_(flag)))

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
        """Host values of what the filename and monitor need (fetched only those: no full sync)."""
        names = {n[1:] for n in re.findall(r"(\{.*?)[:\}]", self.filename or "")}
        if self.monitor is not None:
            names.add(self.monitor)
        out: dict[str, Any] = {}
        for n in names:
            v = trainer.callback_metrics.get(n)
            if v is not None:
                out[n] = float(v)
        out.setdefault("epoch", trainer.current_epoch)
        out["step"] = trainer.global_step
        return out

    def _unique_path(self, path: str) -> str:
        if not self._enable_version_counter:
            return path
        base = path[: -len(self.FILE_EXTENSION)]
        ver = self.STARTING_VERSION
        while os.path.lexists(path) or path in self.best_k_models or self._tmp_exists(path):
            path = f"{base}{self.CHECKPOINT_JOIN_CHAR}v{ver}{self.FILE_EXTENSION}"
            ver += 1
        return path

    @staticmethod
    def _tmp_exists(path: str) -> bool:
        d = os.path.dirname(path)
        if not os.path.isdir(d):
            return False
        name = os.path.basename(path)
        return any(f.startswith(name + ".orbax-checkpoint-tmp") for f in os.listdir(d))

    # ------------------------------------------------------------------ top-k bookkeeping
    def check_monitor_top_k(self, trainer: Trainer, current: float | None = None) -> bool:
        if current is None:
            return False
        if self.save_top_k == -1:
            return True
        if len(self.best_k_models) < self.save_top_k:
            return True
        kth = self.best_k_models[self.kth_best_model_path]
        return current < kth if self.mode == "min" else current > kth

    def _update_best(self, filepath: str, current: float) -> str | None:
        k = len(self.best_k_models) + 1 if self.save_top_k == -1 else self.save_top_k
        evicted = None
        if len(self.best_k_models) == k and k > 0:
            evicted = self.kth_best_model_path
            self.best_k_models.pop(evicted)
        self.best_k_models[filepath] = current
        if len(self.best_k_models) == k:
            pick = max if self.mode == "min" else min
            self.kth_best_model_path = pick(self.best_k_models, key=self.best_k_models.get)  # type: ignore[arg-type]
            self.kth_value = self.best_k_models[self.kth_best_model_path]
        pick = min if self.mode == "min" else max
        self.best_model_path = pick(self.best_k_models, key=self.best_k_models.get)  # type: ignore[arg-type]
        self.best_model_score = self.best_k_models[self.best_model_path]
        return evicted

    def _keep(self) -> set[str]:
        keep = set(self.best_k_models) | {self._newest_path}
        if self.monitor is None and self.best_model_path:
            keep.add(self.best_model_path)
        keep.discard("")
        return keep

    # ------------------------------------------------------------------ saving
    def _save(
        self, trainer: Trainer, *, force: bool = False, sync: bool = False, reason: str = "periodic"
    ) -> str | None:
        """One trigger: decide which files this save is, write it, schedule the clean-up after commit."""
        self._run_pending()
        candidates = self._monitor_candidates(trainer)
        current = None
        keep_top = False
        if self.save_top_k != 0:
            if self.monitor is None:
                keep_top = True
            else:
                current = candidates.get(self.monitor)
                if current is None:
                    msg = (
                        f"ModelCheckpoint(monitor={self.monitor!r}) could not find the monitored key in the "
                        f"logged metrics: {sorted(trainer.callback_metrics)}. HINT: did you call "
                        f"self.log({self.monitor!r}, value) in the LightningModule?"
                    )
                    if trainer.num_val_batches and not force:
                        raise ValueError(msg)
                    if trainer.is_global_zero and not force:
                        print(f"jaxlight: {msg}")
                else:
                    if math.isnan(current):
                        current = math.inf if self.mode == "min" else -math.inf
                    self.current_score = current
                    keep_top = self.check_monitor_top_k(trainer, current)
        if not (keep_top or self.save_last or force):
            self._last_global_step_saved = trainer.global_step
            if self.verbose and trainer.is_global_zero and current is not None:
                print(
                    f"Epoch {trainer.current_epoch:d}, global step {trainer.global_step:d}: {self.monitor!r} "
                    f"was not in top {self.save_top_k}"
                )
            return None
        filepath = self._unique_path(self.format_checkpoint_name(candidates))
        drop: set[str] = set()
        if keep_top and self.monitor is not None:
            assert current is not None
            prev_best = self.best_model_score
            evicted = self._update_best(filepath, current)
            if evicted:
                drop.add(evicted)
            if self.verbose and trainer.is_global_zero:
                print(
                    f"Epoch {trainer.current_epoch:d}, global step {trainer.global_step:d}: {self.monitor!r} "
                    f"reached {current:.5f} (best {self.best_model_score:.5f}, was {prev_best}), saving model "
                    f"to {filepath!r} as top {self.save_top_k}"
                )
        elif keep_top:  # no monitor: the newest is the "best"; top_k=1 keeps only it, -1 keeps all
            if self.save_top_k == 1 and self.best_model_path:
                drop.add(self.best_model_path)
            self.best_model_path = filepath
            if self.save_top_k == -1:
                self.best_k_models[filepath] = float(trainer.global_step)
        if self._newest_path:
            drop.add(self._newest_path)
        self._newest_path = filepath
        if self.save_last:
            self.last_model_path = os.path.join(self.dirpath or "", self.CHECKPOINT_NAME_LAST + self.FILE_EXTENSION)
        self._write(trainer, filepath, sync=sync, reason=reason)
        self._last_global_step_saved = trainer.global_step
        self._last_progress_saved = (trainer.global_step, trainer._micro_batches)
        keep = self._keep()
        drop = {p for p in drop if p not in keep}
        link_to = filepath if self.save_last else None
        self._pending.append(lambda: self._after_commit(trainer, drop, link_to))
        if sync:
            self.wait_until_finished()
        else:
            self._run_pending()
        return filepath

    def _write(self, trainer: Trainer, filepath: str, *, sync: bool, reason: str) -> None:
        from jaxlight.checkpoint import _new_checkpointer, save_checkpoint

        if self._checkpointer is None:
            self._checkpointer = _new_checkpointer(async_=self.async_save)
        if trainer.is_global_zero:
            os.makedirs(os.path.dirname(filepath), exist_ok=True)
        save_checkpoint(
            trainer, filepath, weights_only=self.save_weights_only, checkpointer=self._checkpointer, reason=reason
        )
        if sync and hasattr(self._checkpointer, "wait_until_finished"):
            self._checkpointer.wait_until_finished()

    def _after_commit(self, trainer: Trainer, drop: set[str], link_to: str | None) -> None:
        if not trainer.is_global_zero:
            return
        if link_to is not None:
            link = os.path.join(os.path.dirname(link_to), self.CHECKPOINT_NAME_LAST + self.FILE_EXTENSION)
            tmp = f"{link}.tmp-{os.getpid()}"
            if os.path.lexists(tmp):
                os.remove(tmp)
            os.symlink(os.path.basename(link_to), tmp)
            os.replace(tmp, link)  # atomic switch: "last" always names a complete checkpoint
        for p in drop:
            if p in self._keep():
                continue
            if os.path.islink(p):
                os.remove(p)
            elif os.path.isdir(p):
                shutil.rmtree(p, ignore_errors=True)

    def _run_pending(self) -> None:
        """Finish bookkeeping of saves that have committed (never waits)."""
        from jaxlight.checkpoint import save_in_flight

        if not self._pending or (self._checkpointer is not None and save_in_flight(self._checkpointer)):
            return
        if self._checkpointer is not None and hasattr(self._checkpointer, "check_for_errors"):
            self._checkpointer.check_for_errors()
        pending, self._pending = self._pending, []
        for fn in pending:
            fn()

    def wait_until_finished(self) -> None:
        """Block until every save has committed and its clean-up ran."""
        ck = self._checkpointer
        if ck is not None and hasattr(ck, "wait_until_finished"):  # a synchronous Checkpointer has nothing pending
            ck.wait_until_finished()
            ck.check_for_errors()
        self._run_pending()

    def save_now(self, trainer: Trainer, reason: str = "preemption") -> str | None:
        """Write the current state synchronously (unless this exact point is already saved) and wait.

        Used by :class:`jaxlight.callbacks.Preemption`; returns the checkpoint path.
        """
        if self.dirpath is None:
            self.setup(trainer, trainer.lightning_module, "fit")
        if self._last_progress_saved == (trainer.global_step, trainer._micro_batches) and self._newest_path:
            self.wait_until_finished()
            return self._newest_path
        path = self._save(trainer, force=True, sync=True, reason=reason)
        return path

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
            "newest_path": self._newest_path,
            "last_global_step_saved": self._last_global_step_saved,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_global_step_saved = state_dict.get("last_global_step_saved", self._last_global_step_saved)
        if state_dict.get("dirpath") != self.dirpath:
            if self.verbose:
                print(
                    f"jaxlight: ModelCheckpoint dirpath changed from {state_dict.get('dirpath')} to "
                    f"{self.dirpath}; only best_model_path is restored"
                )
            self.best_model_path = state_dict.get("best_model_path", "")
            return
        self.best_model_score = state_dict.get("best_model_score")
        self.best_model_path = state_dict.get("best_model_path", "")
        self.current_score = state_dict.get("current_score")
        # only checkpoints that still exist (a kill between commit and clean-up can leave either state)
        self.best_k_models = {p: v for p, v in state_dict.get("best_k_models", {}).items() if os.path.exists(p)}
        self.kth_best_model_path = state_dict.get("kth_best_model_path", "")
        self.kth_value = state_dict.get("kth_value", self.kth_value)
        self.last_model_path = state_dict.get("last_model_path", "")
        self._newest_path = state_dict.get("newest_path", "")
