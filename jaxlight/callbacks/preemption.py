"""Preemption: turn a scheduler's SIGTERM into a clean stop with a resumable checkpoint."""

from __future__ import annotations

import itertools
import signal
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax

from jaxlight import distributed
from jaxlight.callbacks.callback import Callback
from jaxlight.errors import Preempted
from jaxlight.rank_zero import rank_zero_info

if TYPE_CHECKING:  # pragma: no cover
    from jaxlight.trainer import Trainer

# Micro-batches past the requesting process's position at which all processes stop.
# Processes cannot drift further apart than the trainer's run-ahead (each step's
# collectives tie them together), so this leaves room for the slowest to learn
# of the request before it passes the agreed point.
AGREE_MARGIN = 8
_KV_TIMEOUT_MS = 300_000


_FIT_COUNTER = itertools.count(1)


class Preemption(Callback):
    """Stops ``fit`` cleanly when a preemption signal arrives (on by default).

    The signal handler only records the signal. At the end of the current
    train step the run stops, the checkpoint and the data position are written
    synchronously (by the first of the trainer's checkpoint callbacks whose
    :meth:`~jaxlight.callbacks.Callback.save_now` writes one, e.g.
    ``ModelCheckpoint``), and ``fit`` raises :class:`jaxlight.Preempted` (a
    ``SystemExit`` with code 143).
    Running the same script with ``ckpt_path="last"`` resumes at that point.

    In a multi-process run the signal may reach one process only: it publishes
    a stop position (its step + ``AGREE_MARGIN`` micro-batches) in the
    ``jax.distributed`` key-value store, every process polls that key once per
    step (a local RPC, no device sync), and all of them stop at that same
    step and write one consistent checkpoint. Single-process runs pay no
    per-step cost beyond reading a Python attribute. Handlers are installed
    for the duration of ``fit`` only (from the main thread) and the previous
    handlers are put back afterwards.
    """

    def __init__(self, signals: Sequence[int] = (signal.SIGTERM,), verbose: bool = True) -> None:
        sigs = tuple(signals)
        for s in sigs:
            if not isinstance(s, int):
                raise ValueError(f"signals must be signal numbers (e.g. signal.SIGTERM), got {s!r}")
            if s in (signal.SIGKILL, signal.SIGSTOP):
                raise ValueError(f"signal {signal.Signals(s).name} cannot be caught")
        self.signals = sigs
        self.verbose = verbose
        self.received: int | None = None  # the first signal caught (set by the handler, nothing else)
        self._previous: dict[int, Any] = {}
        self._stop_at: int | None = None  # agreed micro-batch count to stop after
        self._announced = False
        self._ns = ""

    @property
    def state_key(self) -> str:
        return "Preemption"

    # ------------------------------------------------------------------ handlers
    def _handler(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum

    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        self.received, self._stop_at, self._announced = None, None, False
        # Process-wide fit counter: every process runs the same sequence of fits (SPMD), so the
        # namespace agrees across processes, and a key left by an earlier fit is never reused.
        self._ns = f"jaxlight/preempt/{next(_FIT_COUNTER)}"
        if threading.current_thread() is not threading.main_thread():
            if self.verbose:
                rank_zero_info("jaxlight: Preemption handler not installed (fit is not running in the main thread)")
            return
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handler)

    def teardown(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        self._previous = {}

    # ------------------------------------------------------------------ the stop point
    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if jax.process_count() == 1:
            if self.received is not None:
                self._stop(trainer)
            return
        if self._should_stop_multi(trainer):
            self._stop(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        # A signal during the last step(s): training is over, but the scheduler still wants the process gone.
        if jax.process_count() > 1:
            distributed.barrier(f"{self._ns}/end", _KV_TIMEOUT_MS / 1000)
            requested = self.received is not None or distributed.kv_try_get(f"{self._ns}/stop_at") is not None
        else:
            requested = self.received is not None
        if requested:
            self._stop(trainer)

    def _should_stop_multi(self, trainer: Trainer) -> bool:
        here = trainer.position.micro_batches
        if self._stop_at is None:
            if self.received is not None and not self._announced:
                self._announced = True
                try:  # the first process to propose wins (the store refuses a second set); the others read it
                    distributed.kv_set(f"{self._ns}/stop_at", str(here + AGREE_MARGIN))
                except Exception:
                    pass
            value = distributed.kv_try_get(f"{self._ns}/stop_at")
            if value is None:
                return False
            self._stop_at = int(value)
            if here > self._stop_at:
                raise RuntimeError(
                    f"preemption: process {jax.process_index()} is at micro-batch {here}, past the agreed stop "
                    f"point {self._stop_at}; processes drifted more than AGREE_MARGIN={AGREE_MARGIN} apart"
                )
        return here >= self._stop_at

    def _stop(self, trainer: Trainer) -> None:
        signum = self.received
        path = None
        for cb in trainer.checkpoint_callbacks:  # the first one that writes a checkpoint on demand
            path = cb.save_now(trainer, reason="preemption")
            if path:
                break
        for cb in trainer.checkpoint_callbacks:  # the others finish what they started
            cb.wait_until_finished()
        if self.verbose:
            name = signal.Signals(signum).name if signum is not None else "a preemption notice on another process"
            where = f"checkpoint written to {path}" if path else "no checkpoint written (checkpointing is disabled)"
            rank_zero_info(
                f"jaxlight: received {name}; stopped at global step {trainer.global_step} "
                f"(epoch {trainer.current_epoch}, batch {trainer.position.batches_in_epoch}); {where}. "
                f"Run again with ckpt_path='last' to resume."
            )
        raise Preempted(trainer.global_step, path, signum)
