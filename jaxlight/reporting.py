"""The logging path: from ``self.log`` records to callback metrics, the progress bar and the loggers.

Values logged inside compiled steps arrive as device arrays (``MetricStore``,
one per stage); values logged in host hooks arrive through a host-side
``Collector``. The reporter keeps Lightning's three views
(``callback_metrics``, ``logged_metrics``, ``progress_bar_metrics``) and is
the only place that fetches logged values to the host: every ``log_every_n_steps``
train steps (:meth:`publish_step`) and at each epoch end (:meth:`epoch_values`).
Callbacks that compute host values themselves log them through
:meth:`log_metrics`, so every value reaches the loggers by one path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlight.errors import NonFiniteLossWarning
from jaxlight.loggers.logger import LoggerCollection
from jaxlight.metrics import DATALOADER_SUFFIX, Collector, LogSpec, MetricStore, to_host
from jaxlight.rank_zero import rank_zero_warn

if TYPE_CHECKING:  # pragma: no cover
    from jaxlight.trainer import Trainer

_STEP_HOOKS = ("on_train_batch_start", "on_train_batch_end")
_LOSS = "\x00loss"  # the train step's loss among the values publish_step fetches (no logged name has a NUL)
_SUFFIX_MARK = DATALOADER_SUFFIX.split("{")[0]


def _name(spec: LogSpec, name: str, level: str) -> str:
    """Lightning's naming: a value logged both per step and per epoch gets ``_step``/``_epoch``, before a
    ``/dataloader_idx_N`` suffix (``vs_step/dataloader_idx_1``)."""
    if not (spec.on_step and spec.on_epoch):
        return name
    base, sep, idx = name.partition(_SUFFIX_MARK)
    return f"{base}_{level}{sep}{idx}"


class _HookScope:
    """``with reporter.in_hook(hook):``: sets ``reporter.hook`` and puts the previous one back."""

    __slots__ = ("hook", "prev", "reporter")

    def __init__(self, reporter: MetricReporter, hook: str) -> None:
        self.reporter, self.hook = reporter, hook

    def __enter__(self) -> None:
        self.prev, self.reporter.hook = self.reporter.hook, self.hook

    def __exit__(self, *exc: Any) -> None:
        self.reporter.hook = self.prev


class MetricReporter:
    """Owns the metric stores and the three metric views of a Trainer.

    Guarantees: nothing here syncs with the device except :meth:`publish_step`,
    :meth:`epoch_values`, :meth:`check_epoch_loss`, :meth:`flush_eval_steps` and :meth:`refresh_progress_bar`;
    loggers receive values on process 0 only, at Lightning's steps (the train
    step that produced them, ``global_step - 1``; per-batch evaluation values
    at the count of that loader's batches run so far), with Lightning's
    ``epoch`` entry added to what loggers get (not to ``logged_metrics``)
    except for per-batch evaluation values.
    """

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer
        self.stores: dict[str, MetricStore] = {}
        self.callback_metrics: dict[str, Any] = {}
        self.logged_metrics: dict[str, Any] = {}  # floats, and device arrays of the latest step until fetched
        self.progress_bar_metrics: dict[str, float] = {}
        self.stage = "train"  # the stage whose hooks are running (host self.log goes to its store)
        self.hook: str | None = None  # the hook running now (host self.log picks its defaults from it)
        self.dataloader_idx: int | None = None  # the evaluation loader running, when there are several
        self._host_col: Collector | None = None
        self._eval_seen: dict[tuple[str, int], int] = {}  # Lightning's per-loader count of logged eval batches
        self._eval_rows: list[tuple[int, dict[str, Any], dict[str, Any]]] = []  # (step, logger row, bar values)
        self._loader_of: dict[str, int] = {}  # store key -> the evaluation loader it was logged under
        self._logged_loader: dict[str, int | None] = {}  # logged epoch name -> that loader (None: outside any)
        self._step_loss: Any = None  # the latest train step's loss (by reference), checked at the log cadence
        self._checked_loss: Any = None  # the loss last fetched for the check: a later fetch of it is spared
        self._step_views: dict[tuple[str, ...], tuple[MetricStore, tuple]] = {}  # see on_train_step
        self._loss_warned = False
        self._pbar_current = True  # progress_bar_metrics hold the latest train step's values (fetched)
        self._fetched_loss: tuple[Any, float] | None = None  # (step loss, its value) fetched with the prog bar
        self._loss_ok_at: int | None = None  # the last step whose loss was checked and finite

    def store(self, stage: str) -> MetricStore:
        store = self.stores.get(stage)  # not setdefault: that would build a MetricStore on every call
        if store is None:
            store = self.stores[stage] = MetricStore()
        return store

    # -- self.log in host hooks -------------------------------------------------
    def in_hook(self, hook: str) -> _HookScope:
        """Run a hook: host ``self.log`` calls made inside it take the hook's defaults. A plain class, not a
        generator context manager: the train loop enters it twice per step."""
        return _HookScope(self, hook)

    def host_collector(self) -> Collector:
        """Where ``self.log`` records when called outside a compiled step."""
        if self._host_col is None:
            step_level = self.hook in _STEP_HOOKS
            self._host_col = Collector(
                self.stage, None, on_step=step_level, on_epoch=not step_level, dataloader_idx=self.dataloader_idx
            )
        return self._host_col

    def flush_host_logs(self) -> None:
        """Move what host hooks logged into the stage's store and the callback metrics."""
        col, self._host_col = self._host_col, None
        if col is None or not col.values:
            return
        store = self.store(col.stage)
        store.register(col.specs)
        store.update(col.values)
        if col.dataloader_idx is not None:
            for k in col.values:
                self._loader_of.setdefault(k, col.dataloader_idx)
        for k, (v, _) in col.values.items():
            self.callback_metrics[k] = v

    # -- per step (no sync) ---------------------------------------------------------
    def on_train_step(self, logs: Mapping[str, Any], loss: Any = None) -> None:
        """Record one train step's logged values (device arrays, by reference) as the latest callback and
        logged metrics, and its ``loss`` (checked for NaN/Inf by :meth:`publish_step`)."""
        self._step_loss = loss
        self._pbar_current = False
        store = self.store("train")
        store.update(logs)
        values = store.step_values
        names = tuple(values)
        views = self._step_views.get(names)  # where each name shows: the same every step
        if views is None or views[0] is not store:
            rows = []
            for k in names:
                spec = store.specs[k]
                if spec.on_step:
                    name = _name(spec, k, "step")
                    rows.append((k, (k, name) if spec.on_epoch else (k,), (name,) if spec.logger else ()))
            views = self._step_views[names] = (store, tuple(rows))
        callback, logged = self.callback_metrics, self.logged_metrics
        for k, to_callback, to_logged in views[1]:
            v = values[k]
            for name in to_callback:
                callback[name] = v
            for name in to_logged:
                logged[name] = v

    def on_eval_step(self, stage: str, logs: Mapping[str, Any], dataloader_idx: int = 0) -> None:
        """Record one evaluation step's values. Values logged ``on_step`` become ``logged_metrics`` now (by
        reference) and a logger row at Lightning's step (the loader's batch count), sent by
        :meth:`flush_eval_steps`; never sent during the sanity check."""
        store = self.store(stage)
        store.update(logs)
        for k in logs:
            self._loader_of.setdefault(k, dataloader_idx)
        row = {}
        for k in logs:
            spec = store.specs[k]
            if spec.on_step and spec.logger:
                name = _name(spec, k, "step")
                self.logged_metrics[name] = logs[k][0]
                row[name] = logs[k][0]
        if self._trainer.sanity_checking:  # seen by the sanity check's hooks (cleared after it), never sent
            return
        pbar = {k: logs[k][0] for k in logs if store.specs[k].on_step and store.specs[k].prog_bar}
        if row or pbar:
            key = (stage, dataloader_idx)
            seen = self._eval_seen.get(key, 0)
            self._eval_seen[key] = seen + 1
            self._eval_rows.append((seen, row, {_name(store.specs[k], k, "step"): v for k, v in pbar.items()}))

    def flush_eval_steps(self) -> None:
        """Send the buffered per-batch evaluation rows to the loggers (one fetch for all of them)."""
        rows, self._eval_rows = self._eval_rows, []
        if not rows:
            return
        fetched = jax.device_get([(r, p) for _, r, p in rows])
        for (step, _, _), (row, pbar) in zip(rows, fetched):
            self.progress_bar_metrics.update({k: float(np.asarray(v)) for k, v in pbar.items()})
            if row:
                self.send({k: float(np.asarray(v)) for k, v in row.items()}, step=step, add_epoch=False)

    def reset_eval_counts(self) -> None:
        """A new fit or evaluation run: per-batch evaluation values are logged from step 0 again."""
        self._eval_seen = {}
        self._eval_rows = []
        self._loader_of = {}
        self._logged_loader = {}

    def by_loader(self, metrics: Mapping[str, float], loaders: int) -> list[dict[str, float]]:
        """Lightning's per-loader results of an evaluation run: each loader's dict holds what was logged
        while it ran, plus what was logged outside any loader (the epoch-end hooks)."""
        if loaders == 1:
            return [dict(metrics)]
        return [{k: v for k, v in metrics.items() if self._logged_loader.get(k) in (None, i)} for i in range(loaders)]

    # -- host fetches -------------------------------------------------------------
    def publish_step(self) -> None:
        """Fetch the last train step's values: progress bar and loggers (every ``log_every_n_steps``)."""
        store = self.stores.get("train")
        vals = {k: v for k, v in store.step_values.items() if store.specs[k].on_step} if store is not None else {}
        if self._loss_due():  # fetched with the values: no extra sync
            vals[_LOSS] = self._checked_loss = self._step_loss
        if not vals:
            return
        fetched = to_host(vals)
        self._pbar_current = True
        if _LOSS in fetched:
            self._check_loss(fetched.pop(_LOSS))
        logged = {}
        for k, v in fetched.items():
            spec = store.specs[k]
            name = _name(spec, k, "step")
            if spec.prog_bar:
                self.progress_bar_metrics[k if not spec.on_epoch else name] = v
            if spec.logger:
                logged[name] = v
        self.send(logged)

    def _loss_due(self) -> bool:
        """Whether the latest train step's loss still needs a look: not yet warned this run, and not the
        loss already fetched (an epoch that ends on a logging step)."""
        return self._step_loss is not None and not self._loss_warned and self._step_loss is not self._checked_loss

    def _check_loss(self, loss: float, epoch_end: bool = False) -> None:
        """Warn once per run at the first non-finite training loss the host sees: at the log cadence, or the
        last step's at an epoch's end (unless a callback already skips such updates, and says so itself)."""
        trainer = self._trainer
        if np.isfinite(loss) or any(cb.skip_nonfinite_updates for cb in trainer.callbacks):
            self._loss_ok_at = trainer.global_step - 1
            return
        self._loss_warned = True
        every, step = trainer.log_every_n_steps, trainer.global_step - 1
        fix = (
            "training goes on with it. ModelCheckpoint keeps its finite checkpoints (save_non_finite=False); "
            "NonFiniteGuard(action='stop' or 'skip') stops the run or skips such updates"
        )
        if not epoch_end:
            rank_zero_warn(
                f"jaxlight: the training loss is {loss} at step {step} (checked every "
                f"log_every_n_steps={every} steps, so it may have turned non-finite up to {every - 1} steps "
                f"earlier); {fix}",
                category=NonFiniteLossWarning,
            )
            return
        ok = self._loss_ok_at
        since = (
            f"the last check, at step {ok}, saw a finite loss, so it turned non-finite in steps {ok + 1}..{step}"
            if ok is not None and ok < step
            else "no earlier check saw the loss this run"
        )
        rank_zero_warn(
            f"jaxlight: the training loss is {loss} at step {step} (the last step of epoch {trainer.current_epoch}, "
            f"checked at the epoch's end and every log_every_n_steps={every} steps; {since}); {fix}",
            category=NonFiniteLossWarning,
        )

    def check_epoch_loss(self) -> None:
        """At an epoch's end: the epoch's last train loss, unless its logging step fetched it already.

        One scalar per epoch, never per step, fetched with the progress-bar values of that step when
        :meth:`refresh_progress_bar` ran for it (one transfer), else here: a run shorter than
        ``log_every_n_steps`` is not silent about a NaN. Judged after the epoch-end hooks, so a
        ``NonFiniteGuard`` raising there speaks first.
        """
        held, self._fetched_loss = self._fetched_loss, None
        if held is not None and held[0] is self._step_loss:
            self._check_loss(held[1], epoch_end=True)
            return
        if not self._loss_due():
            return
        self._checked_loss = self._step_loss
        self._check_loss(float(np.asarray(jax.device_get(self._step_loss))), epoch_end=True)

    def refresh_progress_bar(self) -> None:
        """Show the last train step's progress-bar values even between logging steps (epoch ends, and
        validation inside fit, read them as Lightning's do); no fetch when they are already there. The
        step's loss, when still unchecked, comes in the same transfer for :meth:`check_epoch_loss`."""
        if self._pbar_current:
            return
        self._pbar_current = True
        store = self.stores.get("train")
        if store is None:
            return
        vals = {k: v for k, v in store.step_values.items() if store.specs[k].on_step and store.specs[k].prog_bar}
        if self._loss_due():
            vals[_LOSS] = self._checked_loss = self._step_loss
        if not vals:
            return
        fetched = to_host(vals)
        if _LOSS in fetched:
            self._fetched_loss = (self._step_loss, fetched.pop(_LOSS))
        for k, v in fetched.items():
            spec = store.specs[k]
            self.progress_bar_metrics[_name(spec, k, "step") if spec.on_epoch else k] = v

    def epoch_values(self, stage: str) -> dict[str, float]:
        """Fetch a stage's epoch reductions into callback/progress metrics; returns ``{logged name: value}``."""
        store = self.stores.get(stage)
        if store is None:
            return {}
        vals = store.epoch_values()
        out = {}
        for k, v in (to_host(vals) if vals else {}).items():
            spec = store.specs[k]
            name = _name(spec, k, "epoch")
            self._logged_loader[name] = self._loader_of.get(k)
            self.callback_metrics[k] = jnp.float32(v)
            self.callback_metrics[name] = jnp.float32(v)
            if spec.prog_bar:
                self.progress_bar_metrics[name] = v
            if spec.logger:
                out[name] = v
        return out

    def send(
        self, metrics: Mapping[str, float], step: int | None = None, add_epoch: bool = True, record: bool = True
    ) -> None:
        """Record host values as logged and hand them to every logger (process 0) at ``step`` (default:
        ``global_step - 1``, the train step that produced them). Loggers also get Lightning's ``epoch``
        entry (``add_epoch``); ``logged_metrics`` does not."""
        if not metrics:
            return
        trainer = self._trainer
        if record:
            self.logged_metrics.update(metrics)
        if trainer.loggers and trainer.is_global_zero:
            out = dict(metrics)
            if add_epoch and not trainer.sanity_checking:
                out.setdefault("epoch", float(trainer.current_epoch))
            step = max(trainer.global_step - 1, 0) if step is None else step
            LoggerCollection(trainer.loggers).log_metrics(out, step=step)

    def open_loggers(self) -> None:
        """A stage starts: background trackers (W&B, MLflow) get this stage's calls from their worker
        threads until :meth:`finalize_loggers`, so a slow tracker never stalls a step."""
        trainer = self._trainer
        if trainer.loggers and trainer.is_global_zero:
            LoggerCollection(trainer.loggers).open()

    def finalize_loggers(self, status: str) -> None:
        """The end of a run: every logger's ``finalize(status)`` on process 0. A logger failing there
        raises after a successful run and is dropped after a failed one (the original error matters more)."""
        trainer = self._trainer
        if not (trainer.loggers and trainer.is_global_zero):
            return
        try:
            LoggerCollection(trainer.loggers).finalize(status)
        except Exception:
            if status == "success":
                raise

    def log_hyperparams(self, module: Any, datamodule: Any = None) -> None:
        """Send the module's ``hparams`` (and the datamodule's) to every logger on process 0, unless the
        module turned it off (``save_hyperparameters(logger=False)``)."""
        trainer = self._trainer
        if not (trainer.loggers and trainer.is_global_zero and getattr(module, "_log_hyperparams", True)):
            return
        hp = dict(module.hparams)
        if datamodule is not None and hasattr(datamodule, "hparams"):
            hp.update(dict(datamodule.hparams))
        if hp:
            LoggerCollection(trainer.loggers).log_hyperparams(hp)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """The one logging path for host values a callback computed itself (throughput, learning rates).

        ``metrics`` are host numbers handed to every logger on process 0 only,
        at ``step`` (default: ``global_step - 1``, the train step that produced
        them), without Lightning's ``epoch`` entry. As in Lightning, where such
        callbacks call the loggers themselves, they are not added to
        ``logged_metrics``. Nothing is fetched from the device here.
        """
        self.send(metrics, step=step, add_epoch=False, record=False)

    # -- epochs and the sanity check ----------------------------------------------------
    def reset_epoch(self, stage: str) -> None:
        self.store(stage).reset_epoch()

    def reset(self) -> None:
        """A new fit/validate/test/predict call: Lightning starts every run with empty metric views."""
        self.clear_views()
        for store in self.stores.values():  # values go, the flags registered by compiled steps stay
            store.reset_epoch()
        self._host_col = None
        self._step_loss, self._loss_warned, self._checked_loss, self._loss_ok_at = None, False, None, None
        self._fetched_loss, self._pbar_current = None, True
        self.reset_eval_counts()

    def clear_views(self) -> None:
        """Empty the three metric views (Lightning resets them around the sanity check)."""
        self.callback_metrics.clear()
        self.logged_metrics.clear()
        self.progress_bar_metrics.clear()

    @contextlib.contextmanager
    def discarding(self) -> Iterator[None]:
        """The sanity check: the three views start empty and are emptied again afterwards, as Lightning
        does, so nothing logged inside is seen or sent."""
        self.clear_views()
        try:
            yield
        finally:
            self.clear_views()
            self._eval_rows = []

    # -- checkpoints -------------------------------------------------------------------
    def epoch_state_dict(self, stage: str = "train") -> dict[str, Any] | None:
        """The stage's epoch accumulators as host floats (a mid-epoch resume continues them)."""
        store = self.stores.get(stage)
        return store.state_dict() if store is not None else None

    def load_epoch_state_dict(self, state: Mapping[str, Any], stage: str = "train") -> None:
        store = MetricStore()
        store.load_state_dict(state)
        self.stores[stage] = store


def print_results(title: str, metrics: Mapping[str, float]) -> None:
    """The table ``validate``/``test`` print (``verbose=True``): one line per metric under ``title``."""
    if not metrics:
        return
    w = max(len(k) for k in metrics)
    print(f"{title} metrics:")
    for k, v in metrics.items():
        print(f"  {k.ljust(w)}  {v:.6g}")
