"""How logging calls reach one logger: in order, kept and retried after a failure, bounded, and, for trackers
that talk to a server or a database, sent by a worker thread so a stalled tracker never stalls a step.

One :class:`Outbox` per logger object (it lives on the logger, because the trainer builds a short-lived
``LoggerCollection`` per call). The training thread only appends to it; delivery runs either inline, right
after the append (``Logger.background_delivery = False``: the CSV and TensorBoard loggers, user loggers),
or on the outbox's worker thread (``True``: W&B and MLflow). Both paths run the same code, so the retry,
drop and report rules are the same; only the thread differs.

Messages (failures, recoveries, drops, a logger's own notices such as a recreated file) are collected here
and issued on the training thread at its next logging call or at finalize: warning filters, ``pytest.warns``
and the rank-0 printing then behave as for any other jaxlight warning.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import warnings
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

from jaxlight.rank_zero import rank_zero_info, rank_zero_warn


class LoggerDeliveryWarning(UserWarning):
    """A logger failed to take a call (it is kept and retried), or calls were finally not delivered."""


class Policy(Protocol):
    """The limits an outbox works with (``LoggerCollection``'s class attributes, read at each use)."""

    max_pending: int
    retry_min_s: float
    retry_max_s: float
    finalize_timeout_s: float
    stall_warn_s: float


@dataclass
class Call:
    seq: int
    method: str
    args: tuple
    kwargs: dict
    keep: bool = True  # kept for a retry when it fails; a save() is not (the next save writes the same rows)


_local = threading.local()  # .outbox: the outbox whose logger is being called on this thread


def path_identity(path: str) -> tuple[int, int] | None:
    """``path``'s (device, inode), or None when it does not exist: a logger compares it with the one it
    opened to tell its directory or store deleted or replaced mid-run (one ``stat``)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def logger_notice(message: str) -> None:
    """Warn (``LoggerDeliveryWarning``) about something a logger did on its own, e.g. recreated a deleted file.

    Called while an outbox delivers a call (on its worker or inline), the warning is issued on the
    training thread with the fan-out's other messages; called directly, it is issued now.
    """
    ob = getattr(_local, "outbox", None)
    if ob is None:
        rank_zero_warn(message, category=LoggerDeliveryWarning, stacklevel=2)
    else:
        with ob.cond:
            ob.notices.append(("warn", message))


class Outbox:
    """One logger's calls not delivered yet (in order), the failure state, and the worker that sends them."""

    IDLE_EXIT_S = 5.0  # an empty outbox's worker ends after this long without a call (a later call starts one)

    def __init__(self, target: Any, label: str, background: bool, policy: Policy) -> None:
        self.target = target
        self.label = label
        self.background = background
        self.policy = policy
        self.cond = threading.Condition()  # guards every field below
        self.active = False  # a trainer stage runs: a background logger's calls go to its worker
        self.pumping = False  # one thread at a time sends calls (the worker, or a caller inline)
        self.pending: deque[Call] = deque()
        self.inflight: Call | None = None
        self.inflight_since = 0.0
        self.seq = 0
        self.dropped = 0
        self.failures = 0
        self.last_error = ""
        self.failing = False  # the head call failed: wait for the back-off and a new call (or finalize)
        self.trigger = False  # a call arrived since the last failure
        self.retry_at = 0.0
        self.backoff = 0.0
        self.warned = self.warned_drop = self.warned_stall = False
        self.notices: deque[tuple[str, str]] = deque()
        self.final_gen = self.final_done = 0
        self.final_status: str | None = None
        self.final_upto = 0
        self.worker: threading.Thread | None = None

    # ------------------------------------------------------------------ the training thread's side
    def put(self, method: str, args: tuple, kwargs: dict, keep: bool = True) -> None:
        """Queue a call, then wake the worker (a background logger during a stage: never waits for the
        tracker) or send it now, on this thread (behind any calls still waiting, so the order holds)."""
        with self.cond:
            self.seq += 1
            self.pending.append(Call(self.seq, method, args, kwargs, keep))
            self.trigger = True
            self._bound()
            threaded = self.background and self.active
            if threaded:
                stalled = time.monotonic() - self.inflight_since
                if self.inflight is not None and stalled > self.policy.stall_warn_s and not self.warned_stall:
                    self.warned_stall = True
                    self._warn(
                        f"{self.label} has been busy in {self.inflight.method} for {stalled:.0f} s (its tracker "
                        f"does not answer). Training goes on; its calls wait in a queue of at most "
                        f"{self.policy.max_pending} ({len(self.pending)} now), and the end of the run reports "
                        f"any that could not be delivered."
                    )
                self._wake()
        if not threaded:
            self.pump()  # returns at once if the worker is sending: it sends this call too

    def request_final(self, status: str | None) -> int:
        """Ask for everything queued so far to be tried once more (back-off ignored), then ``finalize(status)``
        (``None``: no finalize). Returns the request's number for :meth:`finish`."""
        with self.cond:
            self.final_gen += 1
            self.final_status = status
            self.final_upto = self.seq
            if self.background:
                self._wake()
            return self.final_gen

    def finish(self, gen: int, deadline: float) -> bool:
        """Run (inline) or wait for (worker, until ``deadline``) final request ``gen``; True once it is done."""
        if not self.background:
            self._final()
            return True
        with self.cond:
            return self.cond.wait_for(lambda: self.final_done >= gen, timeout=max(deadline - time.monotonic(), 0))

    def emit(self) -> None:
        """Issue the collected messages (on the calling thread, meant to be the training thread)."""
        with self.cond:
            notes, self.notices = list(self.notices), deque()
        for kind, message in notes:
            if kind == "info":
                rank_zero_info(message)
            else:
                rank_zero_warn(message, category=LoggerDeliveryWarning, stacklevel=3)

    def undelivered(self) -> int:
        """Calls not delivered: queued or kept, in flight, and dropped past the limit (since the logger's start)."""
        with self.cond:
            return len(self.pending) + (self.inflight is not None) + self.dropped

    def waiting(self) -> dict[str, int]:
        """``{method: count}`` of the calls queued or in flight."""
        with self.cond:
            calls = list(self.pending) + ([self.inflight] if self.inflight is not None else [])
        kinds: dict[str, int] = {}
        for c in calls:
            kinds[c.method] = kinds.get(c.method, 0) + 1
        return kinds

    # ------------------------------------------------------------------ delivery (worker or inline)
    def pump(self, upto: int | None = None, wait: bool = False) -> None:
        """Send queued calls in order until the queue is empty or one fails.

        ``upto``: a final attempt at the calls numbered up to it, back-off ignored; otherwise a failing
        logger waits for its back-off to end and for a new call (a dead tracker costs one failed call per
        back-off interval). Only one thread sends at a time: another caller returns at once (``wait``:
        waits its turn), and the thread sending delivers what it queued.
        """
        with self.cond:
            if self.pumping:
                if not wait:
                    return
                self.cond.wait_for(lambda: not self.pumping)
            self.pumping = True
        head: Call | None = None
        try:
            while True:
                with self.cond:
                    if not self.pending:
                        return
                    if upto is not None:
                        if self.pending[0].seq > upto:
                            return
                    elif self.failing and (not self.trigger or time.monotonic() < self.retry_at):
                        return
                    head = self.pending.popleft()
                    self.inflight, self.inflight_since = head, time.monotonic()
                previous = getattr(_local, "outbox", None)
                _local.outbox = self
                try:
                    getattr(self.target, head.method)(*head.args, **head.kwargs)
                except Exception as e:
                    with self.cond:
                        self.inflight = None
                        self._failed(head.method, e, retry=head.keep)
                        if head.keep:
                            self.pending.appendleft(head)
                            self._bound()
                        head = None
                    return
                finally:
                    _local.outbox = previous
                with self.cond:
                    self.inflight, head = None, None
                    self.warned_stall = False
                    if self.failing:
                        self.failing, self.backoff = False, 0.0
                        n = len(self.pending) + 1
                        self.notices.append(
                            (
                                "info",
                                f"jaxlight: {self.label} works again; sent the first of the {n} logging "
                                f"call(s) kept since it failed, the rest follow in order",
                            )
                        )
        finally:
            with self.cond:
                if head is not None:  # interrupted inside the call (KeyboardInterrupt): keep it, first in line
                    self.inflight = None
                    if head.keep:
                        self.pending.appendleft(head)
                self.pumping = False
                self.cond.notify_all()

    def _final(self) -> None:
        with self.cond:
            gen, status, upto = self.final_gen, self.final_status, self.final_upto
        self.pump(upto, wait=True)
        if status is not None:
            previous = getattr(_local, "outbox", None)
            _local.outbox = self
            try:
                self.target.finalize(status)
            except Exception as e:
                with self.cond:
                    self._failed("finalize", e, retry=False)
            finally:
                _local.outbox = previous
        with self.cond:
            self.final_done = max(self.final_done, gen)
            self.cond.notify_all()

    def _work(self) -> None:
        idle_since = time.monotonic()
        while True:
            with self.cond:
                while True:
                    now = time.monotonic()
                    if self.final_gen > self.final_done:
                        job = self._final
                        break
                    due = not self.failing or (self.trigger and now >= self.retry_at)
                    if self.pending and due and not self.pumping:
                        job = self.pump
                        break
                    if self.pending or self.inflight is not None or self.pumping:
                        # a kept call waits for its back-off (once a newer call asked for a retry) or for a call
                        wait: float | None = (
                            max(self.retry_at - now, 0.001) if self.trigger and not self.pumping else None
                        )
                    else:
                        wait = self.IDLE_EXIT_S - (now - idle_since)
                        if wait <= 0:
                            self.worker = None
                            return
                    self.cond.wait(wait)
            job()
            idle_since = time.monotonic()

    # ------------------------------------------------------------------ helpers (the caller holds self.cond)
    def _wake(self) -> None:
        if self.worker is None or not self.worker.is_alive():
            self.worker = threading.Thread(target=self._work, name=f"jaxlight-{self.label}", daemon=True)
            try:
                self.worker.start()
            except RuntimeError:  # interpreter shutdown: no new threads; what is queued is reported instead
                self.worker = None
                return
            _LIVE.add(self)
            _register_exit_drain()
        self.cond.notify_all()

    def _bound(self) -> None:
        """Keep at most ``max_pending`` calls queued: drop the oldest metrics row first (a series keeps its
        newer points), another kind of call only when no metrics row is queued; count it, warn once."""
        limit = max(int(self.policy.max_pending), 1)
        while len(self.pending) > limit:
            i = next((i for i, c in enumerate(self.pending) if c.method == "log_metrics"), 0)
            del self.pending[i]
            self.dropped += 1
            if not self.warned_drop:
                self.warned_drop = True
                why = "its tracker is failing" if self.failing else "its tracker is slower than the logging"
                self._warn(
                    f"{self.label} has {limit} logging calls waiting ({why}); dropping the oldest metrics rows "
                    f"from now on (they are counted and reported at the end of the run)"
                )

    def _failed(self, method: str, e: Exception, retry: bool) -> None:
        self.failures += 1
        self.last_error = f"{method}: {type(e).__name__}: {e}"
        if retry:
            self.failing, self.trigger = True, False
            self.backoff = min(max(self.policy.retry_min_s, self.backoff * 2), self.policy.retry_max_s)
            self.retry_at = time.monotonic() + self.backoff
        if not self.warned:
            self.warned = True
            self._warn(
                f"{self.label} failed in {method} ({type(e).__name__}: {e}). Training goes on and the other "
                f"loggers are not affected; this logger's calls are kept (up to {self.policy.max_pending}) and "
                f"retried, and the end of the run reports any that could not be delivered."
            )

    def _warn(self, message: str) -> None:
        self.notices.append(("warn", message))


# ---------------------------------------------------------------------- the process's end
_LIVE: weakref.WeakSet[Outbox] = weakref.WeakSet()  # outboxes that started a worker


def _register_exit_drain() -> None:
    # Registered again at every worker start: atexit runs last-registered first, so this drain runs before
    # the exit hooks of trackers set up earlier (wandb finishes its run in one).
    atexit.unregister(_drain_at_exit)
    atexit.register(_drain_at_exit)


def _drain_at_exit() -> None:
    """Calls still queued when the interpreter exits (made after the last finalize, or kept for a retry):
    give the workers up to ``finalize_timeout_s`` to send them, then warn about what is left."""
    boxes = [ob for ob in list(_LIVE) if ob.background and (ob.pending or ob.inflight is not None)]
    if not boxes:
        return
    deadline = time.monotonic() + max(float(b.policy.finalize_timeout_s) for b in boxes)
    gens = [ob.request_final(None) for ob in boxes]
    for ob, gen in zip(boxes, gens):
        ob.finish(gen, deadline)
    for ob in boxes:
        with ob.cond:
            left = len(ob.pending) + (ob.inflight is not None)
        if left:
            warnings.warn(
                f"{ob.label}: {left} logging call(s) were not delivered before the process exited "
                f"(last error: {ob.last_error or 'none; the tracker did not answer in time'})",
                LoggerDeliveryWarning,
                stacklevel=1,
            )
