"""A rank that raises ends a multi-process run within seconds, its traceback first.

Without this, an exception on one process of a ``jax.distributed`` run leaves the others blocked in
their next collective and the failed process blocked in JAX's shutdown barrier (the ``atexit``
``jax.distributed.shutdown``) until it times out (300 s), after which every process aborts with C++
stack dumps that bury the Python error. Here, in multi-process runs only:

- **The failing rank publishes its failure.** An ``Exception`` escaping a Trainer entry point
  (``fit``/``validate``/``test``/``predict``: :func:`jaxlight.loops.stage_run` calls :func:`report`)
  is written, with the rank and the traceback, to the coordination service's key-value store,
  printed to stderr at once under ``jaxlight: rank R failed: Type: message`` (and a closing
  ``jaxlight: end of rank R's traceback`` line, which ``jaxlight launch`` reads), then re-raised.
  ``SystemExit`` (``jl.Preempted``) and ``KeyboardInterrupt`` are not failures: preemption stops every
  process together and a Ctrl-C reaches them all. Errors jaxlight raises on every process together,
  after the processes agreed (:func:`on_every_process`), are not published either: no process is
  left waiting, and a script may catch them and go on.
- **Every peer stops.** A watcher thread, started with the first stage of a multi-process run and
  polling the store every ``POLL_S``, sees the failure; the peer's main thread may be blocked inside
  a device collective, which Python cannot interrupt, so the watcher prints
  ``jaxlight: rank P stops: rank R failed (Type: message)`` and, ``GRACE_S`` later (so that work in
  flight, such as a checkpoint's atomic publication on a background thread, can finish), ends the
  process with ``os._exit(EXIT_STATUS)``. A multi-process checkpoint needs every process, so a
  checkpoint started after the failure cannot complete anyway; published checkpoints are atomic and
  stay intact.
- **No process waits in JAX's shutdown barrier for peers that cannot come.** An ``atexit`` handler
  registered after JAX's own (handlers run last-registered first) ends a process that published or
  saw a failure with ``os._exit(EXIT_STATUS)`` after flushing stdout and stderr. The cost: every
  ``atexit`` handler registered before it (JAX's shutdown, and any a library registered earlier) is
  skipped, and the status is ``EXIT_STATUS`` whatever the script would have returned. That is the
  point for JAX's (its barrier would wait 300 s, then abort); loggers finish their runs in the
  Trainer's teardown, which runs before. Process 0 hosts the coordination service, so it leaves
  last: it waits (at most ``EXIT_WAIT_S``) until every other process has said it is leaving, which
  keeps their JAX clients from aborting on a vanished service.

A single-process run is untouched: the exception propagates as before and nothing exits early.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import NamedTuple

import jax

from jaxlight import compat, distributed

FAILED_KEY = "jaxlight/rank_failure/"  # + rank: the failure's JSON
LEAVING_KEY = "jaxlight/rank_leaving/"  # + rank: this process is about to exit after a failure
POLL_S = 0.5  # how often the watcher reads the store (one small RPC)
GRACE_S = 2.0  # from seeing a peer's failure to stopping this process
TEARDOWN_S = 15.0  # the failing rank's own teardown may take this long before its watcher ends the process
EXIT_WAIT_S = 10.0  # process 0 waits at most this long for the others to leave before it
EXIT_STATUS = 1  # every process of a failed run exits with this (the status of an uncaught exception)
_EVERY_PROCESS = "__jaxlight_on_every_process__"


class Failure(NamedTuple):
    """One rank's published failure."""

    rank: int
    type: str
    message: str
    traceback: str

    @property
    def summary(self) -> str:
        """``Type: first line of the message``."""
        first = self.message.strip().splitlines()[0] if self.message.strip() else ""
        return f"{self.type}: {first}" if first else self.type


def header(rank: int, summary: str) -> str:
    """The line that opens a failing rank's report on its stderr (``jaxlight launch`` looks for it)."""
    return f"jaxlight: rank {rank} failed: {summary}"


def footer(rank: int) -> str:
    """The line that closes it."""
    return f"jaxlight: end of rank {rank}'s traceback"


def on_every_process(exc: BaseException) -> BaseException:
    """Mark ``exc`` as raised by every process together (after they agreed on it), so :func:`report`
    does not treat it as one rank's failure; returns ``exc``."""
    with contextlib.suppress(AttributeError, TypeError):
        setattr(exc, _EVERY_PROCESS, True)
    return exc


def raise_together(error: BaseException | None, others: Callable[[list[int]], BaseException]) -> None:
    """Agree on a failure before a collective step: when any process has an ``error``, every process raises,
    that ``error`` where it happened and ``others(failed ranks)`` on the rest, so none is left waiting in a
    later collective; returns when no process failed."""
    failed = distributed.processes_where(error is not None)
    if error is not None:
        raise on_every_process(error)
    if failed:
        raise on_every_process(others(failed))


def _multiprocess() -> bool:
    return jax.process_count() > 1 and compat.distributed_client() is not None


def _write(text: str) -> None:
    try:
        sys.stderr.write(text if text.endswith("\n") else text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):  # stderr closed: nothing to tell
        pass


class _Watch:
    """This process's side: what it published or saw, the watcher thread, the exit."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.published: Failure | None = None  # this process's own failure
        self.published_at = 0.0
        self.seen: Failure | None = None  # the first other rank's failure this process saw
        self.stages = 0  # Trainer entry points running in this process
        self.thread: threading.Thread | None = None
        self.exiting = False

    # ------------------------------------------------------------------ setup
    def start(self) -> None:
        if self.thread is not None:
            return
        # After JAX's own atexit handlers (registered when jax was imported), so this one runs first.
        atexit.register(self._at_exit)
        self.thread = threading.Thread(target=self._run, name="jaxlight-rank-failure", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ the failing rank
    def report(self, exc: BaseException) -> None:
        if not isinstance(exc, Exception) or getattr(exc, _EVERY_PROCESS, False) or not _multiprocess():
            return
        if self.published is not None or self.seen is not None:
            return  # this run already failed: the first failure is the one to tell
        me = jax.process_index()
        peer = self._read_failure(me)  # a peer's failure the watcher has not seen yet: ours follows from it
        if peer is not None:
            own = Failure(me, type(exc).__name__, str(exc), "").summary
            self._saw(peer, f"; its own error followed: {own[:200]}")
            return
        failure = Failure(me, type(exc).__name__, str(exc), "".join(traceback.format_exception(exc)))
        self.published, self.published_at = failure, time.monotonic()
        _write(f"{header(me, failure.summary)}\n{failure.traceback}{footer(me)}")
        client = compat.distributed_client()
        try:
            client.key_value_set(f"{FAILED_KEY}{me}", json.dumps(failure._asdict()), allow_overwrite=True)
        except Exception as e:  # the service is gone: the peers cannot be told, but this process still stops
            _write(f"jaxlight: rank {me} could not publish its failure ({type(e).__name__}: {e})")

    # ------------------------------------------------------------------ the peers
    def _read_failure(self, me: int) -> Failure | None:
        client = compat.distributed_client()
        if client is None:
            return None
        try:
            entries = client.key_value_dir_get(FAILED_KEY)
        except Exception:  # the coordinator does not answer (it may be the one gone)
            return None
        failures = []
        for _, value in entries:
            try:
                f = Failure(**json.loads(value))
            except (TypeError, ValueError):
                continue
            if f.rank != me:
                failures.append(f)
        return min(failures, key=lambda f: f.rank) if failures else None

    def _saw(self, failure: Failure, extra: str = "") -> bool:
        with self.lock:
            if self.seen is not None or self.published is not None:
                return False
            self.seen = failure
        _write(f"jaxlight: rank {jax.process_index()} stops: rank {failure.rank} failed ({failure.summary}){extra}")
        return True

    def _run(self) -> None:
        me = jax.process_index()
        while not self.exiting:
            if self.published is not None:
                # Our own failure: the main thread is unwinding to the exit (atexit ends the process); a
                # teardown stuck in a collective with the peers gone would never get there.
                if self.stages > 0 and time.monotonic() - self.published_at > TEARDOWN_S:
                    _write(f"jaxlight: rank {me} stops: its teardown did not finish within {TEARDOWN_S:g} s")
                    self.exit_now()
                time.sleep(POLL_S)
                continue
            if self.seen is None and (failure := self._read_failure(me)) is not None:
                self._saw(failure)
            if self.seen is not None:  # seen here, or by the main thread raising after the peer's failure
                # The main thread may be blocked in a collective that will never complete: stop it from here,
                # after a grace for work in flight (a checkpoint being published, a log being flushed).
                deadline = time.monotonic() + GRACE_S
                while time.monotonic() < deadline and not self.exiting:
                    time.sleep(0.05)
                self.exit_now()
                return
            time.sleep(POLL_S)

    # ------------------------------------------------------------------ leaving
    def _at_exit(self) -> None:
        if self.published is not None or self.seen is not None:
            self.exit_now()

    def exit_now(self) -> None:
        """Flush, say we are leaving, and ``os._exit(EXIT_STATUS)``; process 0 waits for the others first."""
        with self.lock:
            if self.exiting and threading.current_thread() is not threading.main_thread():
                return  # the main thread is already leaving (atexit)
            self.exiting = True
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        client, me, n = compat.distributed_client(), jax.process_index(), jax.process_count()
        if client is not None:
            if me != 0:
                with contextlib.suppress(Exception):
                    client.key_value_set(f"{LEAVING_KEY}{me}", "1", allow_overwrite=True)
            else:
                # The coordination service lives in process 0: leaving first would make the others' JAX
                # clients abort (a C++ fatal error) before they are done.
                deadline = time.monotonic() + EXIT_WAIT_S
                while time.monotonic() < deadline:
                    try:
                        if len(client.key_value_dir_get(LEAVING_KEY)) >= n - 1:
                            time.sleep(0.2)  # they exit right after saying so
                            break
                    except Exception:
                        break
                    time.sleep(0.05)
        os._exit(EXIT_STATUS)


_WATCH = _Watch()


@contextlib.contextmanager
def watching() -> Iterator[None]:
    """Around a Trainer entry point: in a multi-process run, start the watcher (once per process)."""
    if not _multiprocess():
        yield
        return
    _WATCH.start()
    _WATCH.stages += 1
    try:
        yield
    finally:
        _WATCH.stages -= 1


def report(exc: BaseException) -> None:
    """An exception is leaving a Trainer entry point: in a multi-process run, publish it (see the module doc).
    Returns normally; the caller re-raises."""
    _WATCH.report(exc)


def failure() -> Failure | None:
    """The failure this process published or saw (None while the run is healthy)."""
    return _WATCH.published or _WATCH.seen


__all__ = ["Failure", "failure", "footer", "header", "on_every_process", "report", "watching"]
