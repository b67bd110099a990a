"""One live run per checkpoint directory: a lock file naming the run that holds it.

Two runs writing into one directory would resume each other's state, trip over
each other's unfinished saves and remove each other's checkpoints. A run that
checkpoints therefore takes the directory's lock before it does anything else
(process 0 of a multi-process run, at fit start, before any compile):

- the lock is the file ``.<name>.jaxlight-lock`` beside the directory ``<name>``
  (never inside it, so everything in a checkpoint directory stays a checkpoint
  or one of its intermediate names); where that parent is not writable, the file
  ``.jaxlight-lock`` inside the directory;
- it holds JSON naming the run: host, pid, when it started, its command line;
  while the run lives it also holds an ``flock`` on the file, which the kernel
  drops however the process ends;
- a second run finds it and raises a :class:`CheckpointError` naming the first;
  a lock left by a process that is gone (``kill -9``, a crash) on this host is
  taken over, with a warning naming the dead run. A lock from another host
  cannot be checked from here: it is refused, and the error says which file to
  remove if that run is over;
- it is released when the run ends, by an exception too (the callback's
  ``teardown``), and at interpreter exit at the latest.

Several checkpoint callbacks of one process may share a directory: the process
takes the lock once and holds it until the last of them releases it.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import errno
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from jaxlight.errors import CheckpointError
from jaxlight.rank_zero import rank_zero_warn

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover - Windows: the file's contents alone say who holds it
    fcntl = None  # type: ignore[assignment]

LOCK_SUFFIX = ".jaxlight-lock"
INNER_LOCK = ".jaxlight-lock"  # the lock's name inside the directory, where its parent is not writable


def lock_paths(dirpath: str) -> tuple[str, str]:
    """Where the lock of ``dirpath`` lives: beside it, or (a read-only parent) inside it."""
    d = os.path.realpath(dirpath)
    parent, name = os.path.split(d)
    return os.path.join(parent, f".{name}{LOCK_SUFFIX}"), os.path.join(d, INNER_LOCK)


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or None where there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().decode("ascii", "replace").rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _proc_start(pid: int) -> str | None:
    """The kernel's start time of process ``pid`` (clock ticks since boot), which a reused pid does not share."""
    stat = _proc_stat(pid)
    return stat[19] if stat is not None and len(stat) > 19 else None


def _alive(pid: int, proc_start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        pass
    except OSError:
        return True
    stat = _proc_stat(pid)
    if stat is not None and stat[0] in ("Z", "X"):
        return False  # exited, not yet reaped by its parent
    # a start time other than the one recorded: the pid was reused by a later process
    return proc_start is None or stat is None or len(stat) <= 19 or stat[19] == proc_start


def describe(info: dict[str, Any] | None) -> str:
    """The run a lock names, for a message."""
    if not info:
        return "an unknown run (the lock file is empty or unreadable)"
    cmd = info.get("command") or "?"
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, started {info.get('started', '?')} ({cmd})"


def _read(fd: int) -> dict[str, Any] | None:
    try:
        raw = os.pread(fd, 1 << 16, 0)
        info = json.loads(raw.decode("utf-8")) if raw else None
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _stale(info: dict[str, Any] | None, host: str) -> bool:
    """Whether the run a lock (whose flock is free) names is provably gone."""
    if info is None:
        return True  # a run that died while writing it (a live one writes it under the flock, at once)
    pid = info.get("pid")
    if info.get("host") != host or type(pid) is not int:
        return False  # another host's process cannot be checked from here
    if pid == os.getpid():
        return True  # this process, which does not hold it (an earlier run in it never released it)
    proc_start = info.get("proc_start")
    return not _alive(pid, proc_start if isinstance(proc_start, str) else None)


@dataclass
class DirLock:
    """A held checkpoint-directory lock (see the module docstring); :meth:`release` gives it back."""

    dirpath: str
    path: str
    fd: int
    holders: int = 1

    def release(self) -> None:
        """Give back one hold; the last one removes the lock file and drops the flock."""
        with _registry_lock:
            self.holders -= 1
            if self.holders > 0 or self.fd < 0:
                return
            _held.pop(self.dirpath, None)
            fd, self.fd = self.fd, -1
        try:
            if os.stat(self.path).st_ino == os.fstat(fd).st_ino:  # still ours: never another run's new lock
                os.unlink(self.path)
        except OSError:
            pass
        finally:
            os.close(fd)


_registry_lock = threading.Lock()
_held: dict[str, DirLock] = {}


def _open(path: str) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)


def directory_error(dirpath: str, e: OSError, what: str = "the first checkpoint could not be saved") -> CheckpointError:
    """The :class:`CheckpointError` for a checkpoint directory that cannot be created or written: names the
    path and the problem (something else at that path, or the OS's reason)."""
    if os.path.lexists(dirpath) and not os.path.isdir(dirpath):
        kind = "a link to nowhere" if os.path.islink(dirpath) else "a file"
        return CheckpointError(
            f"checkpoint directory {dirpath} is not a directory ({kind} is at that path): {what}. Move it away "
            f"or pass ModelCheckpoint(dirpath=...) another directory"
        )
    return CheckpointError(
        f"checkpoint directory {dirpath} is not writable ({e.strerror or e}): {what}. Pass "
        f"ModelCheckpoint(dirpath=...) a directory this process may write to"
    )


def acquire(dirpath: str, owner: str = "ModelCheckpoint") -> DirLock:
    """Take the lock of the checkpoint directory ``dirpath`` (created if missing) for this process.

    Raises :class:`CheckpointError` when the directory cannot be written, or when another live run holds it
    (the message names that run). ``owner`` names the taker in messages.
    """
    d = os.path.realpath(dirpath)
    with _registry_lock:
        held = _held.get(d)
        if held is not None:
            held.holders += 1
            return held
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as e:
        raise directory_error(dirpath, e) from None
    beside, inside = lock_paths(d)
    host = socket.gethostname()
    for _ in range(20):  # a holder releasing between our open and our flock: try again on the new file
        try:
            path, fd = beside, _open(beside)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise directory_error(dirpath, e) from None
            try:  # the parent is read-only: the lock goes inside
                path, fd = inside, _open(inside)
            except OSError as e2:
                raise directory_error(dirpath, e2) from None
        if not os.access(d, os.W_OK):
            os.close(fd)
            read_only = bool(os.statvfs(d).f_flag & getattr(os, "ST_RDONLY", 1))
            err = errno.EROFS if read_only else errno.EACCES
            raise directory_error(dirpath, OSError(err, os.strerror(err)))
        locked = True
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                other = _read(fd)
                os.close(fd)
                raise _held_error(dirpath, path, other) from None
            except OSError:  # no flock on this filesystem: the file's contents decide alone
                locked = False
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            continue
        other = _read(fd)
        if other is not None and not (_stale(other, host) if locked else _stale_unlocked(other, host)):
            os.close(fd)
            raise _held_error(dirpath, path, other)
        if other is not None:
            rank_zero_warn(
                f"{owner}: taking over the lock of checkpoint directory {dirpath} left by {describe(other)}, "
                f"which is no longer running ({path})"
            )
        info = {
            "host": host,
            "pid": os.getpid(),
            "proc_start": _proc_start(os.getpid()),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "time": time.time(),
            "command": " ".join(sys.argv)[:300],
            "dirpath": d,
        }
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode("utf-8"), 0)
        except OSError as e:
            os.close(fd)
            raise directory_error(dirpath, e) from None
        lock = DirLock(d, path, fd)
        with _registry_lock:
            _held[d] = lock
        return lock
    raise CheckpointError(f"could not take the lock of checkpoint directory {dirpath}: it keeps changing ({beside})")


def _stale_unlocked(info: dict[str, Any], host: str) -> bool:
    # without flock a lock written moments ago by a live process reads as its own: only a dead pid is stale
    return info.get("host") == host and type(info.get("pid")) is int and _stale(info, host)


def _held_error(dirpath: str, path: str, other: dict[str, Any] | None) -> CheckpointError:
    return CheckpointError(
        f"checkpoint directory {dirpath} is in use by another run: {describe(other)}. Two runs writing one "
        f"directory would resume and remove each other's checkpoints. Give this run its own "
        f"ModelCheckpoint(dirpath=...), or wait for the other run to end; if it is no longer running (e.g. on "
        f"another host), remove {path}"
    )


@atexit.register
def _release_all() -> None:
    for lock in list(_held.values()):
        with contextlib.suppress(Exception):
            lock.holders = 1
            lock.release()


__all__ = ["INNER_LOCK", "LOCK_SUFFIX", "DirLock", "acquire", "describe", "lock_paths"]
