"""The logging path: from ``self.log`` records to callback metrics, the progress bar and the loggers.

Values logged inside compiled steps arrive as device arrays (``MetricStore``,
one per stage); values logged in host hooks arrive through a host-side
``Collector``. The reporter keeps Lightning's three views
(``callback_metrics``, ``logged_metrics``, ``progress_bar_metrics``) and is
the only place that fetches values to the host: every ``log_every_n_steps``
train steps (:meth:`publish_step`) and at each epoch end (:meth:`publish_epoch`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp

from jaxlight.loggers.logger import LoggerCollection
from jaxlight.metrics import Collector, LogSpec, MetricStore, to_host

if TYPE_CHECKING:  # pragma: no cover
    from jaxlight.trainer import Trainer

_STEP_HOOKS = ("on_train_batch_start", "on_train_batch_end")


def _name(spec: LogSpec, name: str, level: str) -> str:
    """Lightning's naming: a value logged both per step and per epoch gets ``_step``/``_epoch``."""
    return f"{name}_{level}" if spec.on_step and spec.on_epoch else name


class MetricReporter:
    """Owns the metric stores and the three metric views of a Trainer.

    Guarantees: nothing here syncs with the device except :meth:`publish_step`,
    :meth:`publish_epoch` and :meth:`refresh_progress_bar`; loggers receive
    values on process 0 only, at step ``global_step - 1`` (the step that
    produced them), with Lightning's ``epoch`` entry outside the sanity check.
    """

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer
        self.stores: dict[str, MetricStore] = {}
        self.callback_metrics: dict[str, Any] = {}
        self.logged_metrics: dict[str, float] = {}
        self.progress_bar_metrics: dict[str, float] = {}
        self.stage = "train"  # the stage whose hooks are running (host self.log goes to its store)
        self.hook: str | None = None  # the hook running now (host self.log picks its defaults from it)
        self._host_col: Collector | None = None

    def store(self, stage: str) -> MetricStore:
        return self.stores.setdefault(stage, MetricStore())

    # -- self.log in host hooks -------------------------------------------------
    @contextlib.contextmanager
    def in_hook(self, hook: str) -> Iterator[None]:
        """Run a hook: host ``self.log`` calls made inside it take the hook's defaults."""
        prev, self.hook = self.hook, hook
        try:
            yield
        finally:
            self.hook = prev

    def host_collector(self) -> Collector:
        """Where ``self.log`` records when called outside a compiled step."""
        if self._host_col is None:
            step_level = self.hook in _STEP_HOOKS
            self._host_col = Collector(self.stage, None, on_step=step_level, on_epoch=not step_level)
        return self._host_col

    def flush_host_logs(self) -> None:
        """Move what host hooks logged into the stage's store and the callback metrics."""
        col, self._host_col = self._host_col, None
        if col is None or not col.values:
            return
        store = self.store(col.stage)
        store.register(col.specs)
        store.update(col.values)
        for k, (v, _) in col.values.items():
            self.callback_metrics[k] = v

    # -- per step (no sync) ---------------------------------------------------------
    def on_train_step(self, logs: Mapping[str, Any]) -> None:
        """Record one train step's logged values (device arrays) as the latest callback metrics."""
        store = self.store("train")
        store.update(logs)
        for k, v in store.step_values.items():
            spec = store.specs[k]
            if spec.on_step:
                self.callback_metrics[k] = v
                if spec.on_epoch:
                    self.callback_metrics[f"{k}_step"] = v

    def on_eval_step(self, stage: str, logs: Mapping[str, Any]) -> None:
        self.store(stage).update(logs)

    # -- host fetches -------------------------------------------------------------
    def publish_step(self) -> None:
        """Fetch the last train step's values: progress bar and loggers (every ``log_every_n_steps``)."""
        store = self.stores.get("train")
        if store is None:
            return
        vals = {k: v for k, v in store.step_values.items() if store.specs[k].on_step}
        if not vals:
            return
        logged = {}
        for k, v in to_host(vals).items():
            spec = store.specs[k]
            name = _name(spec, k, "step")
            if spec.prog_bar:
                self.progress_bar_metrics[k if not spec.on_epoch else name] = v
            if spec.logger:
                logged[name] = v
        self.send(logged)

    def refresh_progress_bar(self) -> None:
        """At epoch end, show the last step's progress-bar values even between logging steps."""
        if self._trainer.global_step % self._trainer.log_every_n_steps == 0:
            return
        store = self.stores.get("train")
        if store is None:
            return
        vals = {k: v for k, v in store.step_values.items() if store.specs[k].on_step and store.specs[k].prog_bar}
        if not vals:
            return
        for k, v in to_host(vals).items():
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
            self.callback_metrics[k] = jnp.float32(v)
            self.callback_metrics[name] = jnp.float32(v)
            if spec.prog_bar:
                self.progress_bar_metrics[name] = v
            if spec.logger:
                out[name] = v
        return out

    def send(self, metrics: Mapping[str, float]) -> None:
        """Hand host values to every logger (process 0) and record them as logged."""
        if not metrics:
            return
        trainer = self._trainer
        metrics = dict(metrics)
        if not trainer.sanity_checking:
            metrics["epoch"] = float(trainer.current_epoch)
        self.logged_metrics.update(metrics)
        if trainer.loggers and trainer.is_global_zero:
            LoggerCollection(trainer.loggers).log_metrics(metrics, step=max(trainer.global_step - 1, 0))

    # -- epochs and the sanity check ----------------------------------------------------
    def reset_epoch(self, stage: str) -> None:
        self.store(stage).reset_epoch()

    @contextlib.contextmanager
    def discarding(self) -> Iterator[None]:
        """Whatever is logged inside (the sanity check) leaves the three views as they were."""
        saved = (dict(self.callback_metrics), dict(self.logged_metrics), dict(self.progress_bar_metrics))
        try:
            yield
        finally:
            self.callback_metrics.clear()
            self.callback_metrics.update(saved[0])
            self.logged_metrics.clear()
            self.logged_metrics.update(saved[1])
            self.progress_bar_metrics.clear()
            self.progress_bar_metrics.update(saved[2])

    # -- checkpoints -------------------------------------------------------------------
    def epoch_state_dict(self, stage: str = "train") -> dict[str, Any] | None:
        """The stage's epoch accumulators as host floats (a mid-epoch resume continues them)."""
        store = self.stores.get(stage)
        return store.state_dict() if store is not None else None

    def load_epoch_state_dict(self, state: Mapping[str, Any], stage: str = "train") -> None:
        store = MetricStore()
        store.load_state_dict(state)
        self.stores[stage] = store
