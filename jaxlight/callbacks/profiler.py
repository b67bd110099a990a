"""ProfilerWindow: one jax.profiler trace of a few train steps per fit, after the compile."""

from __future__ import annotations

import os
from typing import Any

import jax

from jaxlight.callbacks.callback import Callback


class ProfilerWindow(Callback):
    """Traces ``steps`` train batches with ``jax.profiler`` once per ``fit``, after ``warmup`` batches.

    The first ``warmup`` batches of the fit (which include the compilation)
    run untraced; the trace then covers exactly ``steps`` train batches, each
    wrapped in a ``jax.profiler.StepTraceAnnotation("train", step_num=...)``
    so TensorBoard's profile plugin, XProf and Perfetto show per-step
    boundaries. Before the trace stops, the device work of the traced steps is
    waited for (one sync per fit) so the trace holds their execution. The
    trace is written by ``jax.profiler`` under
    ``dirpath/plugins/profile/<timestamp>/`` as ``<host>.xplane.pb`` and
    ``<host>.trace.json.gz``; ``self.trace_dir`` names it after the window.
    A fit that ends earlier stops the trace where it is. Every process writes
    its own trace. ``dirpath=None`` uses ``<trainer.log_dir>/profile``.
    """

    def __init__(self, dirpath: str | os.PathLike | None = None, warmup: int = 2, steps: int = 5) -> None:
        if warmup < 0 or steps < 1:
            raise ValueError(f"ProfilerWindow needs warmup >= 0 and steps >= 1, got warmup={warmup}, steps={steps}")
        self.dirpath = os.fspath(dirpath) if dirpath is not None else None
        self.warmup = warmup
        self.steps = steps
        self.trace_dir: str | None = None
        self._seen = 0
        self._traced = 0
        self._active = False
        self._annotation: Any = None
        self._last_outputs: Any = None

    def _root(self, trainer: Any) -> str:
        return self.dirpath if self.dirpath is not None else os.path.join(trainer.log_dir, "profile")

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._seen = self._traced = 0
        self.trace_dir = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self._active and self._seen == self.warmup and self.trace_dir is None:
            root = self._root(trainer)
            os.makedirs(root, exist_ok=True)
            self._before = _runs(root)
            try:
                jax.profiler.start_trace(root)
            except RuntimeError as e:
                raise RuntimeError(
                    f"ProfilerWindow could not start a trace in {root!r} (is another jax.profiler trace running?): {e}"
                ) from e
            self._active = True
        if self._active:
            self._annotation = jax.profiler.StepTraceAnnotation("train", step_num=trainer.global_step)
            self._annotation.__enter__()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._seen += 1
        if not self._active:
            return
        self._close_annotation()
        self._traced += 1
        self._last_outputs = outputs
        if self._traced >= self.steps:
            self._stop(trainer)

    def _close_annotation(self) -> None:
        if self._annotation is not None:
            self._annotation.__exit__(None, None, None)
            self._annotation = None

    def _stop(self, trainer: Any) -> None:
        if not self._active:
            return
        self._close_annotation()
        if self._last_outputs is not None:
            jax.block_until_ready(self._last_outputs)  # the traced steps' device work, inside the trace
        self._last_outputs = None
        jax.profiler.stop_trace()
        self._active = False
        root = self._root(trainer)
        new = sorted(_runs(root) - self._before)
        self.trace_dir = os.path.join(root, "plugins", "profile", new[-1]) if new else root

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._stop(trainer)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        try:
            self._stop(trainer)
        finally:
            self._active = False


def _runs(root: str) -> set[str]:
    d = os.path.join(root, "plugins", "profile")
    return set(os.listdir(d)) if os.path.isdir(d) else set()
