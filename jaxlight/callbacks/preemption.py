"""Preemption: turn a scheduler's SIGTERM (or a Ctrl-C) into a clean stop with a resumable checkpoint."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax

from jaxlight import distributed
from jaxlight.callbacks.callback import Callback
from jaxlight.checkpoint.trainer_io import find_last_checkpoint
from jaxlight.errors import Preempted
from jaxlight.rank_zero import rank_zero_info
from jaxlight.step_info import StepInfo

if TYPE_CHECKING:  # pragma: no cover
    from jaxlight.trainer import Trainer

# Micro-batches past the requesting process's position at which all processes stop.
# Processes cannot drift further apart than the trainer's run-ahead (each step's
# collectives tie them together), so this leaves room for the slowest to learn
# of the request before it passes the agreed point.
AGREE_MARGIN = 8
_KV_TIMEOUT_S = 300.0
_WATCH_INTERVAL = 0.25  # seconds between two looks of the watcher at a pending stop


_FIT_COUNTER = itertools.count(1)


class Preemption(Callback):
    """Stops ``fit`` cleanly when a preemption signal arrives (on by default).

    The signal handler only records the signal. The run stops at the next point
    where the trainer's state is the one of a completed step: the end of a train
    step, or, while the loop waits for a batch (a stalled loader), in
    validation, or between epochs, at once. The checkpoint and the data position
    of the last completed step are written synchronously (by the first of the
    trainer's checkpoint callbacks whose
    :meth:`~jaxlight.callbacks.Callback.save_now` writes one, e.g.
    ``ModelCheckpoint``), and ``fit`` raises :class:`jaxlight.Preempted` (a
    ``SystemExit`` with code 143). Nothing is written when no train step has
    completed since ``fit`` started (the checkpoint resumed from is the latest).
    Running the same script with ``ckpt_path="last"`` resumes at that point.

    ``signals`` defaults to SIGTERM and SIGINT (SIGTERM only inside a Jupyter kernel, see
    :func:`default_signals`). A second signal ends the process at once (exit status 128 + the signal).
    When the main thread reaches no stop point within ``stop_timeout`` seconds
    of the signal (it is blocked inside a loader with ``prefetch=0``, or in a
    collective whose peer process died), the process exits with status 143
    without a checkpoint, after saying where the main thread was and which
    processes the coordination service no longer hears from; None waits
    without bound. Both work while the main thread is blocked in native code
    (a background thread reads the signals through ``signal.set_wakeup_fd``).

    In a multi-process run the signal may reach one process only: it publishes
    a stop position (its step + ``AGREE_MARGIN`` micro-batches) in the
    ``jax.distributed`` key-value store, every process polls that key once per
    step (a local RPC, no device sync), and all of them stop at that same
    step and write one consistent checkpoint, after waiting (at most
    ``stop_timeout`` seconds, naming the processes that do not arrive) until
    every process is there. A process that cannot reach a consistent stop
    (its loader stalled, so its peers wait for it in a collective) exits
    without a checkpoint. Single-process runs pay no per-step cost beyond
    reading a Python attribute. Handlers are installed for the duration of
    ``fit`` only (from the main thread) and the previous handlers are put back
    afterwards: at its ``teardown``, once the checkpoint callbacks' last
    (asynchronous) saves have committed. A signal that arrives after the last
    step, while those commits finish, lets them finish (within
    ``stop_timeout`` of the signal, else the process exits with status 143
    without waiting further) and ``fit`` then raises :class:`jaxlight.Preempted`
    naming the final checkpoint, published under its final name.
    """

    # with steps_per_execution its per-batch hooks run at execution ends only (it stops from the train state)
    runs_at_execution_end = True

    def __init__(
        self,
        signals: Sequence[int] | None = None,
        verbose: bool = True,
        stop_timeout: float | None = 120.0,
    ) -> None:
        sigs = default_signals() if signals is None else tuple(signals)
        for s in sigs:
            if not isinstance(s, int):
                raise ValueError(f"signals must be signal numbers (e.g. signal.SIGTERM), got {s!r}")
            if s in (signal.SIGKILL, signal.SIGSTOP):
                raise ValueError(f"signal {signal.Signals(s).name} cannot be caught")
        if stop_timeout is not None and not (isinstance(stop_timeout, (int, float)) and stop_timeout > 0):
            raise ValueError(f"stop_timeout must be a number of seconds > 0 or None, got {stop_timeout!r}")
        self.signals = sigs
        self.verbose = verbose
        self.stop_timeout = stop_timeout
        self.received: int | None = None  # the first signal caught (set by the handler or the watcher)
        self._previous: dict[int, Any] = {}
        self._stop_at: int | None = None  # agreed micro-batch count to stop after
        self._announced = False
        self._ns = ""
        self._trainer: Trainer | None = None
        self._fit_start_micro: int | None = None  # micro-batches done when this fit started (after a restore)
        self._watch: _SignalWatch | None = None
        self._received_at = 0.0  # time.monotonic() of the first signal
        self._progress_at = 0.0  # ... of the last batch the loop took
        self._stopping = False  # the stop (its checkpoint) is being written
        self._heartbeat: distributed.Heartbeat | None = None  # multi-process: which peers are gone
        self._finishing = False  # training is over: teardown waits for the final commits (watcher's message)
        self._failed = False  # fit is ending by an error (on_exception ran): that error is what fit raises
        self._pending: BaseException | None = None  # what teardown raised, re-raised by wait_until_finished

    @property
    def state_key(self) -> str:
        return "Preemption"

    # ------------------------------------------------------------------ handlers
    def _handler(self, signum: int, frame: Any) -> None:
        # With the watcher running, it counts the signals (it sees them even while this handler cannot run).
        if self._watch is None and self.received is not None:
            _exit_at_once(signum)
        self._record(signum)

    def _record(self, signum: int) -> None:
        if self.received is None:
            self._received_at = time.monotonic()
            self.received = signum

    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        self.received, self._stop_at, self._announced = None, None, False
        self._stopping, self._fit_start_micro = False, None
        self._finishing, self._failed, self._pending = False, False, None
        self._trainer = trainer
        # Process-wide fit counter: every process runs the same sequence of fits (SPMD), so the
        # namespace agrees across processes, and a key left by an earlier fit is never reused.
        self._ns = f"jaxlight/preempt/{next(_FIT_COUNTER)}"
        if jax.process_count() > 1:
            self._heartbeat = distributed.Heartbeat(f"{self._ns}/beat").start()
        if threading.current_thread() is not threading.main_thread():
            if self.verbose:
                rank_zero_info("jaxlight: Preemption handler not installed (fit is not running in the main thread)")
            return
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handler)
        self._watch = _SignalWatch.start(self)

    def teardown(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        # The handlers stay until the last asynchronous save has committed: restored earlier, a SIGTERM during
        # that wait killed the process (status -15) and left the final checkpoint staged under a temporary name.
        # Errors (Preempted, a commit's) are held for wait_until_finished, which the trainer calls after every
        # callback's teardown, so the checkpoint callbacks still release their directories.
        try:
            if stage == "fit" and self._previous and trainer is self._trainer:
                self._finish(trainer)
        except BaseException as e:
            self._pending = e
        finally:
            self._restore()

    def _finish(self, trainer: Trainer) -> None:
        """After the last step (fit did not fail and no stop was made yet): wait for the checkpoint callbacks'
        commits with the handlers installed; a signal received meanwhile (or after the last step) stops the run
        as at any stop point, the final checkpoint being the one written."""
        if self._stopping or self._failed:
            return
        self._finishing = True  # the watcher bounds this wait by stop_timeout once a signal came
        for cb in trainer.checkpoint_callbacks:
            cb.wait_until_finished()
        if self.received is None:
            return
        if jax.process_count() == 1:
            self._stop(trainer)  # raises; the final point is saved, so save_now returns that checkpoint
            return
        # Several processes: the signal may have reached this one only, after every collective: no new save
        # (the others would not join it); the newest committed checkpoint is the one to resume from.
        self._stopping = True
        info = StepInfo.of_trainer(trainer)
        path = find_last_checkpoint(trainer)
        where = f"training had finished; its last checkpoint is {path}" if path else "training had finished"
        if self.verbose:
            rank_zero_info(self.stop_message(info, self.received, where, path is not None))
        raise Preempted(info.global_step, str(path) if path else None, self.received)

    def _restore(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        for s, h in self._previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        self._previous = {}
        self._trainer = None

    def on_exception(self, trainer: Trainer, pl_module: Any, exception: BaseException) -> None:
        self._failed = True

    def wait_until_finished(self) -> None:
        """Raise what this callback's ``teardown`` held back: :class:`jaxlight.Preempted` for a signal that came
        after the last step (or an error of the final commits it waited for). The trainer calls it once every
        callback's teardown ran."""
        pending, self._pending = self._pending, None
        if pending is not None:
            raise pending

    def on_fit_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.begin(StepInfo.of_trainer(trainer))

    # ------------------------------------------------------------------ the logic on a StepInfo
    def begin(self, info: StepInfo) -> None:
        """Fit starts at ``info``'s position (after a restore, the restored one): a stop before any further
        train batch writes no checkpoint."""
        self._fit_start_micro = info.micro_batches
        self._progress_at = time.monotonic()

    def stop_due(self, info: StepInfo) -> bool:
        """At the end of the train batch ``info`` describes: whether the run stops here. In a single process,
        when a signal was received; in a multi-process run, at the agreed micro-batch (this process proposes
        ``info.micro_batches + AGREE_MARGIN * info.steps_per_execution`` when it got the signal, and every
        process reads the proposal from the key-value store); raises :class:`RuntimeError` when this process
        is already past the agreed point."""
        self._progress_at = time.monotonic()
        if jax.process_count() == 1:
            return self.received is not None
        return self._should_stop_multi(info)

    def trained_since_fit_start(self, info: StepInfo) -> bool:
        """Whether a train batch completed since fit started (only then is a checkpoint worth writing)."""
        return self._fit_start_micro is None or info.micro_batches > self._fit_start_micro

    def stop_message(self, info: StepInfo, signum: int | None, where: str, saved: bool) -> str:
        """What ``verbose`` reports at the stop: the signal, ``info``'s position and ``where`` the state went."""
        name = signal.Signals(signum).name if signum is not None else "a preemption notice on another process"
        again = " Run again with ckpt_path='last' to resume." if saved else ""
        return (
            f"jaxlight: received {name}; stopped at global step {info.global_step} "
            f"(epoch {info.epoch}, batch {info.batches_in_epoch}); {where}.{again}"
        )

    # ------------------------------------------------------------------ the stop point
    def poll(self, waiting: bool = False) -> None:
        """Called by the loops before each batch is taken (``waiting=False``) and every
        ``jaxlight.prefetch.POLL_INTERVAL`` seconds while they wait for one (``waiting=True``): in a single
        process a pending stop happens here (the state is the last completed step's); in a multi-process
        run only at the agreed step (see the class doc)."""
        if not waiting:
            self._progress_at = time.monotonic()
        if self.received is None or self._stopping or self._trainer is None:
            return
        if jax.process_count() == 1:
            self._stop(self._trainer)

    @property
    def stop_poll(self) -> Callable[[bool], None]:
        """What the loops poll between batches: :meth:`poll` (a subclass's, when it overrides it)."""
        return self.poll

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.received is None and jax.process_count() == 1:
            # nothing pending in a single process (every step but the last): an attribute read, no info built
            self._progress_at = time.monotonic()
            return
        if self.stop_due(
            StepInfo.of_trainer(trainer, batch_idx=batch_idx)
        ):  # not the batch: reading it costs its placement
            self._stop(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        # A signal during the last step(s): training is over, but the scheduler still wants the process gone.
        if jax.process_count() > 1:
            distributed.wait_for_processes(f"{self._ns}/end", _KV_TIMEOUT_S, self._heartbeat)
            requested = self.received is not None or distributed.kv_try_get(f"{self._ns}/stop_at") is not None
        else:
            requested = self.received is not None
        if requested:
            self._stop(trainer)

    def _should_stop_multi(self, info: StepInfo) -> bool:
        here = info.micro_batches
        if self._stop_at is None:
            if self.received is not None and not self._announced:
                self._announced = True
                try:  # the first process to propose wins (the store refuses a second set); the others read it
                    # steps_per_execution=N: processes drift by up to RUN_AHEAD executions, N batches each
                    margin = AGREE_MARGIN * info.steps_per_execution
                    distributed.kv_set(f"{self._ns}/stop_at", str(here + margin))
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
        self._stopping = True
        info = StepInfo.of_trainer(trainer)  # the position of the last completed step (the save keeps it)
        signum = self.received
        path = None
        trained = self.trained_since_fit_start(info)
        where = "no checkpoint written (checkpointing is disabled)"
        if not trained:
            where = "no train step completed since fit started, so no checkpoint was written"
        elif jax.process_count() > 1:
            try:  # the save is collective: enter it only when every process is at the stop point
                distributed.wait_for_processes(f"{self._ns}/stop", self.stop_timeout or _KV_TIMEOUT_S, self._heartbeat)
            except distributed.ProcessesNotResponding as e:
                trained, where = False, f"no checkpoint written: {e}"
        if trained:
            for cb in trainer.checkpoint_callbacks:  # the first one that writes a checkpoint on demand
                path = cb.save_now(trainer, reason="preemption")
                if path:
                    break
            for cb in trainer.checkpoint_callbacks:  # the others finish what they started
                cb.wait_until_finished()
            if path:
                where = f"checkpoint written to {path}"
        if self.verbose:
            rank_zero_info(self.stop_message(info, signum, where, bool(path)))
        raise Preempted(info.global_step, path, signum)

    # ------------------------------------------------------------------ the watcher's side
    def _gone(self) -> list[int] | None:
        """The peer processes that stopped beating ([] in a single process; None: the coordinator is gone)."""
        return self._heartbeat.gone() if self._heartbeat is not None else []

    def _overdue(self) -> bool:
        """A signal is pending and the main thread took no batch for ``stop_timeout`` seconds (while a
        checkpoint is being written, the save is left to finish)."""
        if self.received is None or self.stop_timeout is None or self._stopping:
            return False
        return time.monotonic() - max(self._received_at, self._progress_at) >= self.stop_timeout


def default_signals() -> tuple[int, ...]:
    """SIGTERM and SIGINT; in a Jupyter/IPython kernel SIGTERM only, so interrupting a cell keeps raising
    ``KeyboardInterrupt`` there (and a second interrupt never ends the kernel)."""
    return (signal.SIGTERM,) if "ipykernel" in sys.modules else (signal.SIGTERM, signal.SIGINT)


def _exit_at_once(signum: int) -> None:
    _say(f"jaxlight: received {signal.Signals(signum).name} again; exiting at once without a checkpoint")
    os._exit(128 + signum)


def _say(message: str) -> None:
    # os.write, not print: the main thread may be blocked holding sys.stderr's lock
    try:
        os.write(2, (message + "\n").encode())
    except OSError:
        pass


def _main_thread_at(depth: int = 3) -> str:
    """Where the main thread is: the innermost ``depth`` frames of its stack, innermost first."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    where = []
    while frame is not None and len(where) < depth:
        where.append(f"{frame.f_code.co_name} ({os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})")
        frame = frame.f_back
    return " < ".join(where) or "an unknown place"


class _SignalWatch:
    """Reads the signal numbers Python's C-level handler writes to the wakeup fd, on a daemon thread.

    A Python signal handler runs only when the main thread executes bytecode; blocked in native code (a
    collective waiting for a dead peer, a device wait) it never does. This thread sees every signal as
    it arrives: the first is recorded, a second ends the process at once, and a stop that does not come
    within ``stop_timeout`` ends it with status 143 and a diagnosis.
    """

    def __init__(self, owner: Preemption, r: socket.socket, w: socket.socket) -> None:
        self.owner, self._r, self._w = owner, r, w
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="jaxlight-preemption-watch", daemon=True)

    @classmethod
    def start(cls, owner: Preemption) -> _SignalWatch | None:
        """Install the wakeup fd and start the thread; None when another user (asyncio) already holds it."""
        r, w = socket.socketpair()
        w.setblocking(False)
        r.settimeout(_WATCH_INTERVAL)
        try:
            previous = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        except ValueError:  # not the main thread, or a closed fd
            previous = None
        if previous != -1:  # someone else reads the wakeup fd (asyncio): leave it to them
            if previous is not None:
                signal.set_wakeup_fd(previous)
            r.close()
            w.close()
            return None
        watch = cls(owner, r, w)
        watch._thread.start()
        return watch

    def close(self) -> None:
        self._closed = True
        try:
            signal.set_wakeup_fd(-1)
        except ValueError:
            pass
        try:
            self._w.send(b"\0")  # wake the thread now (0 is no signal)
        except OSError:
            pass
        self._thread.join(timeout=2 * _WATCH_INTERVAL + 1)
        self._r.close()
        self._w.close()

    def _run(self) -> None:
        owner, count, warned = self.owner, 0, False
        while not self._closed:
            try:
                data = self._r.recv(64)
            except TimeoutError:
                data = b""
            except OSError:
                return
            if self._closed:
                return
            for signum in data:
                if signum not in owner.signals:
                    continue
                count += 1
                if count > 1:
                    _exit_at_once(signum)
                owner._record(signum)
            if owner.received is None:
                continue
            if not warned and owner.stop_timeout is not None:
                late = time.monotonic() - max(owner._received_at, owner._progress_at)
                if late >= min(5.0, owner.stop_timeout / 2) and not owner._stopping:
                    warned = True
                    what = "the final checkpoint to commit" if owner._finishing else "a point to stop at"
                    _say(
                        f"jaxlight: process {jax.process_index()} got {signal.Signals(owner.received).name} "
                        f"{late:.0f} s ago and is still waiting for {what} (the main thread is in "
                        f"{_main_thread_at()}); it exits without a checkpoint after stop_timeout="
                        f"{owner.stop_timeout:g} s, or at once on a second signal"
                    )
            gone = owner._gone()
            if gone != []:  # a peer is gone: no collective (a step, the checkpoint) can finish any more
                who = f"process(es) {gone} stopped answering" if gone else "the coordinator (process 0) is gone"
                _say(
                    f"jaxlight: process {jax.process_index()} got {signal.Signals(owner.received).name}, but {who}, "
                    f"so no consistent checkpoint can be written (the main thread is in {_main_thread_at()}); "
                    f"exiting with status 143 without a preemption checkpoint"
                )
                os._exit(143)
            if owner._overdue():
                name, where = signal.Signals(owner.received).name, _main_thread_at()
                if owner._finishing:
                    _say(
                        f"jaxlight: process {jax.process_index()}: the final checkpoint did not commit within "
                        f"stop_timeout={owner.stop_timeout:g} s of {name} (the main thread is in {where}); exiting "
                        f"with status 143 without waiting for it"
                    )
                else:
                    _say(
                        f"jaxlight: process {jax.process_index()} reached no stop point within stop_timeout="
                        f"{owner.stop_timeout:g} s of {name} (the main thread is in {where}); exiting with status "
                        f"143 without a preemption checkpoint"
                    )
                os._exit(143)
