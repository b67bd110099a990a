"""ModelCheckpoint's policy on StepInfo values: whether a hook saves, under which names, the top k and ``last``.

Each ``at_*`` method of :class:`CheckpointPolicy` takes the
:class:`~jaxlight.step_info.StepInfo` of one Lightning hook and returns a
:class:`Decision`: the one save to write and the names it is published under,
the ``last`` link to switch, the files to remove, and why. It reads no Trainer
and writes nothing: :class:`~jaxlight.callbacks.ModelCheckpoint`'s hooks build
the info (``StepInfo.of_trainer``) and carry the decision out through
:class:`~jaxlight.checkpoint.writer.CheckpointWriter`. So the policy is tested
from streams of hand-made infos (``tests/test_checkpoint_policy_step_info.py``).

The policy keeps Lightning's bookkeeping (``best_k_models``, ``best_model_path``,
``last_model_path`` ...) and this run's view of the directory (``_virtual``:
what it decided to publish or remove), which the version counter reads, so a
decision is the same on every process whatever the commit timing.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

from jaxlight import distributed
from jaxlight.errors import MisconfigurationError
from jaxlight.rank_zero import WarnOnce, rank_zero_info
from jaxlight.step_info import StepInfo


@dataclass(frozen=True)
class Decision:
    """What one trigger decided: the save to write (if any), its names, links and removals, and why.

    ``names``: the paths the one save is published under (``names[0]`` is written, the others, a ``last``
    with ``save_last=True``, are hard-linked copies); ``links``: ``(link, target)`` symlinks to switch
    (``save_last="link"``); ``removals``: files the save replaces (top-k eviction, the previous ``last``);
    ``protect``: paths this plan never removes (its own files, the checkpoint resumed from); ``fresh``:
    ``names[0]`` is free, so the save is written there directly rather than beside it; ``global_step`` /
    ``micro_batches``: the point saved; ``extra``: a forced save outside the top k, kept until the next save;
    ``why``: the trigger (``"every_n_train_steps"``, ``"train_time_interval"``, ``"train_epoch_end"``,
    ``"validation_end"``, ``"train_end"``, ``"resume_cleanup"``, a forced save's reason), or why nothing is
    written (``"nothing due"``, ``"sanity check"``, ``"fast_dev_run"``, ``"saved at this step"``,
    ``"non-finite"``, ``"deferred to validation"`` ...).
    """

    why: str = ""
    names: tuple[str, ...] = ()
    links: tuple[tuple[str, str], ...] = ()
    removals: tuple[str, ...] = ()
    protect: frozenset[str] = frozenset()
    fresh: bool = False
    global_step: int = 0
    micro_batches: int = 0
    extra: str = ""

    @property
    def empty(self) -> bool:
        """Nothing to write, link or remove."""
        return not (self.names or self.links or self.removals)


@dataclass
class _Txn:
    """What one trigger records (Lightning's _save_checkpoint / _link_checkpoint / _remove_checkpoint calls)."""

    names: list[str] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)
    removals: list[str] = field(default_factory=list)


class CheckpointPolicy:
    """Lightning's ``ModelCheckpoint`` policy on :class:`StepInfo` values; :class:`ModelCheckpoint` sets the
    attributes it reads (its arguments and bookkeeping) and carries its :class:`Decision` values out."""

    CHECKPOINT_JOIN_CHAR = "-"
    CHECKPOINT_EQUALS_CHAR = "="
    CHECKPOINT_NAME_LAST = "last"
    FILE_EXTENSION = ".ckpt"
    STARTING_VERSION = 1

    # the arguments and bookkeeping, set by ModelCheckpoint.__init__ / load_state_dict
    dirpath: str | None
    filename: str | None
    monitor: str | None
    verbose: bool
    save_last: bool | Literal["link"] | None
    save_top_k: int
    mode: str
    auto_insert_metric_name: bool
    save_non_finite: bool
    best_k_models: dict[str, float]
    kth_best_model_path: str
    kth_value: float
    best_model_score: float | None
    best_model_path: str
    last_model_path: str
    current_score: float | None
    _every_n_train_steps: int
    _every_n_epochs: int
    _train_time_interval: timedelta | None
    _save_on_train_epoch_end: bool | None
    _enable_version_counter: bool
    _last_checkpoint_saved: str
    _last_global_step_saved: int
    _last_progress_saved: tuple[int, int] | None
    _last_time_checked: float | None
    _defer_save_until_validation: bool
    _newest_path: str
    _extra_path: str
    _txn: _Txn | None
    _restored_removals: list[str]
    _virtual: dict[str, bool]
    _warn: WarnOnce
    _owned: set[str]
    _step_loss: Any

    # ------------------------------------------------------------------ the triggers
    def at_train_start(self, info: StepInfo) -> Decision:
        """Training starts: the time trigger's clock starts; removals a kill interrupted after the resumed
        checkpoint committed are finished (only files this callback owns, none it still keeps)."""
        self._last_time_checked = info.time
        if not self._restored_removals:
            return Decision(why="train_start")
        removals, self._restored_removals = self._restored_removals, []
        keep = set(self.best_k_models) | {self.best_model_path, self._last_checkpoint_saved, self._extra_path}
        keep |= {self.last_model_path, self._resume_path(info)}
        gone = tuple(p for p in removals if p not in keep and self._in_dirpath(p) and self._may_remove(p))
        return Decision(why="resume_cleanup", removals=gone)

    def record_step_loss(self, outputs: Mapping[str, Any] | None) -> None:
        """Keep the train step's loss by reference (no sync): fetched only when a save is decided, to judge
        ``save_non_finite``."""
        # a dict first: this runs every step, and the Mapping check goes through abc
        self._step_loss = outputs.get("loss") if type(outputs) is dict or isinstance(outputs, Mapping) else None

    def at_train_batch_end(self, info: StepInfo) -> Decision:
        """After a train batch: ``every_n_train_steps`` / ``train_time_interval`` (process 0's clock decides).
        A monitored value that only validation logs, or that validation is about to refresh (the epoch's last
        batch), defers the save to :meth:`at_validation_end`."""
        self.record_step_loss(info.outputs)
        n = self._every_n_train_steps
        skip_batch = n < 1 or info.global_step % n != 0
        if skip_batch and self._train_time_interval is None:
            return Decision(why="nothing due")
        skip_time = True
        if self._train_time_interval is not None:
            prev = self._last_time_checked
            due = prev is not None and info.time - prev >= self._train_time_interval.total_seconds()
            skip_time = not distributed.broadcast_bool(due)  # clocks differ between processes: process 0 decides
        if skip_batch and skip_time:
            return Decision(why="nothing due")
        if not skip_time:
            self._last_time_checked = info.time
        skipped = self._skip_reason(info)
        candidates = self._monitor_candidates(info)
        if self.monitor is not None and self.monitor not in candidates:
            if self.save_top_k != 0 and not self._validation_runs(info):
                # the earliest point this can be known: the train step's logged keys exist once it has run
                raise self._missing_monitor(
                    info,
                    "; validation does not run in this fit (no val dataloader, or limit_val_batches=0), so a value "
                    "logged only in validation never arrives and every_n_train_steps would save nothing",
                )
            # a validation-only metric: save once validation has produced it
            self._defer_save_until_validation = True
            return Decision(why="deferred to validation")
        if self.monitor is not None and not self._should_save_on_train_epoch_end(info):
            last_batch = info.num_training_batches != math.inf and info.batch_idx + 1 >= info.num_training_batches
            cve = info.check_val_every_n_epoch
            will_validate = bool(info.num_val_batches) and info.limit_val_batches != 0
            will_validate = will_validate and (cve is None or (info.epoch + 1) % cve == 0)
            if last_batch and will_validate:  # the monitored value is about to be refreshed
                self._defer_save_until_validation = True
                return Decision(why="deferred to validation")
        if skipped:
            return Decision(why=skipped)
        if self._skip_non_finite(info, candidates):
            return Decision(why="non-finite")
        self._begin()
        self._save_topk_checkpoint(info, candidates)
        self._save_last_checkpoint(info, candidates)
        return self._decide(info, "every_n_train_steps" if not skip_batch else "train_time_interval")

    def at_train_epoch_end(self, info: StepInfo) -> Decision:
        """At a train epoch's end, when that is where this callback saves: ``every_n_epochs``."""
        if not self._should_save_on_train_epoch_end(info):
            return Decision(why="saves after validation")
        skipped = self._skip_reason(info)
        return Decision(why=skipped) if skipped else self._epoch_trigger(info, "train_epoch_end")

    def at_validation_end(self, info: StepInfo) -> Decision:
        """After a validation run inside ``fit``, when that is where this callback saves: a save deferred from
        a train batch, else ``every_n_epochs``."""
        skipped = self._skip_reason(info)
        if skipped:
            return Decision(why=skipped)
        if self._should_save_on_train_epoch_end(info):
            return Decision(why="saves at train epoch end")
        if not self._defer_save_until_validation:
            return self._epoch_trigger(info, "validation_end")
        candidates = self._monitor_candidates(info)
        if self.monitor is not None and self.monitor not in candidates and self.save_top_k != 0:
            raise self._missing_monitor(info)
        if self._skip_non_finite(info, candidates):
            return Decision(why="non-finite")
        self._begin()
        self._save_topk_checkpoint(info, candidates)
        self._save_last_checkpoint(info, candidates)
        self._defer_save_until_validation = False
        return self._decide(info, "validation_end")

    def _epoch_trigger(self, info: StepInfo, why: str) -> Decision:
        candidates = self._monitor_candidates(info)
        if self._skip_non_finite(info, candidates):
            return Decision(why="non-finite")
        self._begin()
        if self._every_n_epochs >= 1 and (info.epoch + 1) % self._every_n_epochs == 0:
            self._save_topk_checkpoint(info, candidates)
        # last follows only an actual save at this step, or (a link) the newest file
        if self._last_global_step_saved == info.global_step or (
            self.save_last == "link" and self._last_checkpoint_saved
        ):
            self._save_last_checkpoint(info, candidates)
        return self._decide(info, why)

    def at_train_end(self, info: StepInfo) -> Decision:
        """Lightning: with ``save_last`` and nothing saved in the whole fit, ``last`` is written at the end."""
        if not self.save_last or self._last_checkpoint_saved or info.fast_dev_run:
            return Decision(why="nothing due")
        candidates = self._monitor_candidates(info)
        if self._skip_non_finite(info, candidates):
            return Decision(why="non-finite")
        self._begin()
        self._save_last_checkpoint(info, candidates)
        return self._decide(info, "train_end")

    def at_forced_save(self, info: StepInfo, reason: str) -> Decision:
        """A save asked for now (``save_now``: preemption): the state as a top-k checkpoint when it qualifies,
        else as an extra one kept until the next save; ``last`` follows. Empty when this exact point is
        already saved, or the state is non-finite (the newest finite checkpoint stands for it)."""
        if self._last_progress_saved == (info.global_step, info.micro_batches) and self._newest_path:
            return Decision(why="saved at this step")
        candidates = self._monitor_candidates(info)
        if self._skip_non_finite(info, candidates):
            return Decision(why="non-finite")
        self._begin()
        assert self._txn is not None
        if self.save_top_k != 0 and (self.monitor is None or self.monitor in candidates):
            self._save_topk_checkpoint(info, candidates)
        extra = ""
        if not self._txn.names:
            extra = self._get_metric_interpolated_filepath_name(candidates, info)
            self._save_checkpoint(info, extra)
        self._save_last_checkpoint(info, candidates)
        return self._decide(info, reason, extra=extra)

    # ------------------------------------------------------------------ when not to save
    def _skip_reason(self, info: StepInfo) -> str:
        """Why no trigger saves at this hook ("" when one may): Lightning's ``_should_skip_saving_checkpoint``."""
        if info.fast_dev_run:
            return "fast_dev_run"
        if info.stage != "train":  # the sanity check, a standalone validate, outside fit
            return "sanity check" if info.stage == "sanity_check" else "not training"
        if self._last_global_step_saved == info.global_step:
            return "saved at this step"
        return ""

    def _should_skip_saving_checkpoint(self, info: StepInfo) -> bool:
        return bool(self._skip_reason(info))

    def _should_save_on_train_epoch_end(self, info: StepInfo) -> bool:
        """``save_on_train_epoch_end``, or Lightning's choice: at the train epoch's end unless validation runs
        more often than once per epoch or not every epoch (then after validation)."""
        if self._save_on_train_epoch_end is not None:
            return self._save_on_train_epoch_end
        if info.check_val_every_n_epoch != 1:
            return False
        if not info.num_val_batches or info.limit_val_batches == 0:
            return True
        return info.val_check_interval == 1.0

    def _validation_runs(self, info: StepInfo) -> bool:
        """Whether this fit validates at all (``num_val_batches`` is known only once validation ran)."""
        return info.has_val_dataloaders and info.limit_val_batches != 0

    def _missing_monitor(self, info: StepInfo, why: str = "") -> MisconfigurationError:
        """Lightning's error for a monitored key that was not logged, naming the keys that were."""
        return MisconfigurationError(
            f"ModelCheckpoint(monitor={self.monitor!r}) could not find the monitored key in the logged "
            f"metrics: {sorted(info.metrics)}{why}. HINT: did you call self.log({self.monitor!r}, "
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

    def _skip_non_finite(self, info: StepInfo, candidates: Mapping[str, Any]) -> bool:
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
            f"ModelCheckpoint: not saving global step {info.global_step}: {' and '.join(bad)}. The finite "
            f"checkpoints saved so far are kept (top-k and last); later non-finite states are not saved either "
            f"(not reported again). Pass ModelCheckpoint(save_non_finite=True) to save them, or use "
            f"NonFiniteGuard to stop or skip such steps",
        )
        return True

    # ------------------------------------------------------------------ names
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

    def _default_dirpath(self, info: StepInfo) -> str:
        """``checkpoints`` in the first logger's ``log_dir`` (the Trainer's ``log_dir``), else in
        ``default_root_dir``."""
        log_dir = info.loggers[0].log_dir if info.loggers else None  # read once: a logger may version it
        root = log_dir if log_dir is not None else info.default_root_dir
        return os.path.abspath(os.path.join(root, "checkpoints"))

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

    def _monitor_candidates(self, info: StepInfo) -> dict[str, Any]:
        """Host values of what the filename and monitor need (only those are fetched: no full sync)."""
        names = {n[1:] for n in re.findall(r"(\{.*?)[:\}]", self.filename or "")}
        if self.monitor is not None:
            names.add(self.monitor)
        out: dict[str, Any] = {}
        for n in names:
            v = info.metrics.get(n)
            if v is not None:
                out[n] = float(v)
        out["epoch"] = int(out["epoch"]) if "epoch" in out else info.epoch
        out["step"] = int(out["step"]) if "step" in out else info.global_step
        return out

    def file_exists(self, filepath: str, info: StepInfo | None = None) -> bool:
        """Whether ``filepath`` exists, counting this run's saves and removals still being committed."""
        if filepath in self._virtual:
            return self._virtual[filepath]
        return os.path.lexists(filepath)

    def _get_metric_interpolated_filepath_name(
        self, candidates: dict[str, Any], info: StepInfo, del_filepath: str | None = None
    ) -> str:
        filepath = self.format_checkpoint_name(candidates)
        if self._enable_version_counter:
            ver = self.STARTING_VERSION
            while self.file_exists(filepath, info) and filepath != del_filepath:
                filepath = self.format_checkpoint_name(candidates, ver=ver)
                ver += 1
        return filepath

    # ------------------------------------------------------------------ Lightning's top-k and last logic
    def check_monitor_top_k(self, info: StepInfo | None, current: float | None = None) -> bool:
        """Whether a monitored value ``current`` enters the top k."""
        if current is None:
            return False
        if self.save_top_k == -1:
            return True
        if len(self.best_k_models) < self.save_top_k:
            return True
        kth = self.best_k_models[self.kth_best_model_path]
        return current < kth if self.mode == "min" else current > kth

    def _save_topk_checkpoint(self, info: StepInfo, candidates: dict[str, Any]) -> None:
        if self.save_top_k == 0:
            return
        if self.monitor is not None:
            if self.monitor not in candidates:  # the first save without it: say so now, not never
                raise self._missing_monitor(info)
            self._save_monitor_checkpoint(info, candidates)
        else:
            self._save_none_monitor_checkpoint(info, candidates)

    def _save_monitor_checkpoint(self, info: StepInfo, candidates: dict[str, Any]) -> None:
        assert self.monitor is not None
        current = candidates.get(self.monitor)
        if self.check_monitor_top_k(info, current):
            assert current is not None
            self._update_best_and_save(current, info, candidates)
        elif self.verbose:
            rank_zero_info(
                f"Epoch {candidates['epoch']:d}, global step {candidates['step']:d}: {self.monitor!r} was not in "
                f"top {self.save_top_k}"
            )

    def _save_none_monitor_checkpoint(self, info: StepInfo, candidates: dict[str, Any]) -> None:
        filepath = self._get_metric_interpolated_filepath_name(candidates, info, self.best_model_path)
        previous, self.best_model_path = self.best_model_path, filepath
        self._save_checkpoint(info, filepath)
        if self.save_top_k == 1 and previous and self._should_remove_checkpoint(info, previous, filepath):
            self._remove_checkpoint(info, previous)

    def _update_best_and_save(self, current: float, info: StepInfo, candidates: dict[str, Any]) -> None:
        k = len(self.best_k_models) + 1 if self.save_top_k == -1 else self.save_top_k
        del_filepath = None
        if len(self.best_k_models) == k and k > 0:
            del_filepath = self.kth_best_model_path
            self.best_k_models.pop(del_filepath)
        if math.isnan(current):  # a NaN score ranks last
            current = math.inf if self.mode == "min" else -math.inf
        filepath = self._get_metric_interpolated_filepath_name(candidates, info, del_filepath)
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
        self._save_checkpoint(info, filepath)
        if del_filepath and self._should_remove_checkpoint(info, del_filepath, filepath):
            self._remove_checkpoint(info, del_filepath)

    def _save_last_checkpoint(self, info: StepInfo, candidates: dict[str, Any]) -> None:
        if not self.save_last:
            return
        filepath = self.format_checkpoint_name(candidates, self.CHECKPOINT_NAME_LAST)
        if self._enable_version_counter:
            ver = self.STARTING_VERSION
            while self.file_exists(filepath, info) and filepath != self.last_model_path:
                filepath = self.format_checkpoint_name(candidates, self.CHECKPOINT_NAME_LAST, ver=ver)
                ver += 1
        previous, self.last_model_path = self.last_model_path, filepath
        if self.save_last == "link" and self._last_checkpoint_saved and self.save_top_k != 0:
            self._link_checkpoint(info, self._last_checkpoint_saved, filepath)
        else:
            self._save_checkpoint(info, filepath)
        if previous and self._should_remove_checkpoint(info, previous, filepath):
            self._remove_checkpoint(info, previous)

    # ------------------------------------------------------------------ which files may go
    def _resume_path(self, info: StepInfo) -> str:
        """The checkpoint the run resumed from, as given (a ``last`` link is not followed, as in Lightning)."""
        p = info.ckpt_path
        return os.path.abspath(p) if isinstance(p, (str, os.PathLike)) else ""

    def _in_dirpath(self, path: str) -> bool:
        return self.dirpath is not None and os.path.dirname(os.path.abspath(path)) == self.dirpath

    def _may_remove(self, path: str) -> bool:
        """Only what this run published, or a restored path checked to be this callback's checkpoint."""
        return self._virtual.get(path, False) or os.path.normpath(path) in self._owned

    def _should_remove_checkpoint(self, info: StepInfo, previous: str, current: str) -> bool:
        """Lightning's rule: never the file just written, one outside ``dirpath``, or the one resumed from
        (unless that was a ``last`` checkpoint, which later saves replace)."""
        if previous == current or not self._in_dirpath(previous) or not self._may_remove(previous):
            return False
        resume = self._resume_path(info)
        if not resume or os.path.basename(resume).startswith(self.CHECKPOINT_NAME_LAST):
            return True
        return os.path.abspath(previous) != resume

    # ------------------------------------------------------------------ recording a trigger's decisions
    def _begin(self) -> None:
        self._txn = _Txn()

    def _save_checkpoint(self, info: StepInfo, filepath: str) -> None:
        assert self._txn is not None
        self._txn.names.append(filepath)
        self._last_global_step_saved = info.global_step
        self._last_checkpoint_saved = filepath

    def _link_checkpoint(self, info: StepInfo, filepath: str, linkpath: str) -> None:
        assert self._txn is not None
        if os.path.abspath(filepath) != os.path.abspath(linkpath):
            self._txn.links.append((linkpath, filepath))

    def _remove_checkpoint(self, info: StepInfo, filepath: str) -> None:
        assert self._txn is not None
        self._txn.removals.append(filepath)

    def _decide(self, info: StepInfo, why: str, extra: str = "") -> Decision:
        """The recorded trigger as a :class:`Decision`; the directory view (``_virtual``) takes it in now, so
        the next trigger's version counter sees it whenever its commit lands."""
        txn, self._txn = self._txn, None
        if txn is None or not (txn.names or txn.links or txn.removals):
            return Decision(why="nothing due")
        if txn.names and self._extra_path and self._extra_path not in txn.names:
            # a newer save replaces a forced one outside the top k
            kept = set(self.best_k_models) | {self.best_model_path, self._last_checkpoint_saved}
            if self._extra_path not in kept and self._should_remove_checkpoint(info, self._extra_path, ""):
                txn.removals.append(self._extra_path)
            self._extra_path = ""
        protect = set(txn.names) | {t for _, t in txn.links} | {lk for lk, _ in txn.links}
        resume = self._resume_path(info)
        names = tuple(dict.fromkeys(txn.names))
        removals = tuple(p for p in dict.fromkeys(txn.removals) if p not in protect)
        # orbax writes to a path that does not exist: the final name, or a stand-in when this run used the name
        # before or it is on disk (Lightning overwrites such a file; here the commit exchanges it)
        primary = names[0] if names else ""
        fresh = bool(primary) and primary not in self._virtual and not os.path.lexists(primary)
        for p in removals:
            self._virtual[p] = False
        for p in protect:
            self._virtual[p] = True
        return Decision(
            why=why,
            names=names,
            links=tuple(txn.links),
            removals=removals,
            protect=frozenset(protect | ({resume} if resume else set())),
            fresh=fresh,
            global_step=info.global_step,
            micro_batches=info.micro_batches,
            extra=extra,
        )


__all__ = ["CheckpointPolicy", "Decision"]
