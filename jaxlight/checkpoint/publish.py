"""Crash-safe publication: giving committed saves their names, switching ``last``, removing what they replace.

A checkpoint callback decides *what* to publish (its policy: names, links, the
files a save replaces) and hands each save's decisions over as a :class:`Plan`.
A :class:`Publisher` runs the plans on process 0, in save order, the moment
each save commits: orbax's commit thread calls it through the temporary-path
class of :func:`publishing_checkpointer`, so the training loop never waits for
it and nothing lags behind fast steps.

Every file operation keeps one invariant, even under ``kill -9`` at any
instant: whenever a complete checkpoint exists, a ``last`` link resolves to the
newest one. Directories get their final name by an atomic rename or an atomic
exchange (Linux ``renameat2(RENAME_EXCHANGE)``); removed checkpoints first lose
their final name, so a half-deleted directory never looks complete. Every
intermediate name carries orbax's temporary mark, so the completeness rule of
:mod:`jaxlight.checkpoint.format` never takes one for a checkpoint, and
:func:`repair` finishes or undoes what a killed run left half done.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxlight.checkpoint.discovery import find_last
from jaxlight.checkpoint.format import (
    COMMIT_FILES,
    TMP_MARK,
    checkpoint_order,
    is_whole,
    new_checkpointer,
    resolves_complete,
)
from jaxlight.rank_zero import WarnOnce, rank_zero_info

# The kinds of intermediate name: "{final}{TMP_MARK}-{kind}{token}"
_KINDS = ("staged", "copy", "evicted", "link", "old", "next", "placeholder")
_LEFTOVER = re.compile(
    r"^(?P<base>.+?)"
    + re.escape(TMP_MARK)
    + r"-(?P<kind>"
    + "|".join(_KINDS)
    + r")\d+-\d+(?:"
    + re.escape(TMP_MARK)
    + r")?$"
)


def marked(path: str, kind: str, token: str) -> str:
    """The intermediate name of kind ``kind`` for ``path`` (never complete: it carries the temporary mark)."""
    return f"{path}{TMP_MARK}-{kind}{token}"


def _is_dir(p: str) -> bool:
    return os.path.isdir(p) and not os.path.islink(p)


_renameat2: Any = None
_exchange_ok: dict[str, bool] = {}


def _exchange(a: str, b: str) -> bool:
    """Atomically swap the entries ``a`` and ``b`` (Linux ``renameat2(RENAME_EXCHANGE)``); False if unsupported."""
    global _renameat2
    if _renameat2 is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _renameat2 = fn
        except (AttributeError, OSError):
            _renameat2 = False
    if _renameat2 is False:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if _renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) of {a} and {b}: {os.strerror(err)}")


def _can_exchange(directory: str, token: str) -> bool:
    """Whether the filesystem holding ``directory`` swaps entries atomically (probed once per directory)."""
    if directory not in _exchange_ok:
        a, b = (marked(os.path.join(directory, "probe"), "link", f"{token}{s}") for s in "01")
        try:
            os.symlink("a", a)
            os.symlink("b", b)
            _exchange_ok[directory] = _exchange(a, b)
        except OSError:
            _exchange_ok[directory] = False
        finally:
            for p in (a, b):
                if os.path.lexists(p):
                    os.unlink(p)
    return _exchange_ok[directory]


_warn_cleanup = WarnOnce()


def dispose(path: str, token: str) -> None:
    """Remove a file, link or checkpoint directory; a directory first loses its final name."""
    try:
        if os.path.islink(path) or os.path.isfile(path):
            os.unlink(path)
        elif os.path.isdir(path):
            if TMP_MARK not in os.path.basename(path):
                gone = marked(path, "evicted", token)
                os.rename(path, gone)
                path = gone
            shutil.rmtree(path)
    except OSError as e:  # the run goes on; the file stays and the user is told once
        _warn_cleanup(
            ("dispose", os.path.dirname(path)),
            f"ModelCheckpoint could not remove {path} ({e}); it stays on disk (further failures in this "
            f"directory are not reported)",
        )


def _put(src: str, dst: str, token: str) -> None:
    """Make ``dst`` name what ``src`` names, atomically where the filesystem allows; the old ``dst`` is removed."""
    if not os.path.lexists(dst):
        os.rename(src, dst)
        return
    if not _is_dir(src) and not _is_dir(dst):
        os.replace(src, dst)  # a link or file over a link or file: atomic everywhere
        return
    if _exchange(src, dst):
        dispose(src, token)  # src now names the old dst
        return
    old = marked(dst, "old", token)  # no exchange here: a moment without dst
    os.rename(dst, old)
    os.rename(src, dst)
    dispose(old, token)


def link(path: str, target: str, token: str) -> None:
    """Point the symlink ``path`` at ``target`` (relative), replacing whatever ``path`` was, atomically."""
    rel = os.path.relpath(target, os.path.dirname(path))
    if os.path.islink(path) and os.readlink(path) == rel:
        return
    tmp = marked(path, "link", token)
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(rel, tmp)
    _put(tmp, path, token)


def hardlink_tree(src: str, dst: str) -> None:
    """A copy of the directory ``src`` at ``dst`` sharing its files (hard links; a real copy where links fail).

    Orbax never modifies a committed checkpoint's files, so the two stay independent: removing one keeps the other.
    """
    if os.path.lexists(dst):
        shutil.rmtree(dst)

    def put(s: str, t: str) -> None:
        try:
            os.link(s, t)
        except OSError:
            shutil.copy2(s, t)

    # the files that make a directory count as complete go last, so a copy cut short never looks complete
    last = [f for f in COMMIT_FILES if os.path.exists(os.path.join(src, f))]
    for root, _, files in os.walk(src):
        out = os.path.join(dst, os.path.relpath(root, src))
        os.makedirs(out, exist_ok=True)
        for f in files:
            if root != src or f not in last:
                put(os.path.join(root, f), os.path.join(out, f))
    for f in last:
        put(os.path.join(src, f), os.path.join(dst, f))


# ---------------------------------------------------------------------------- plans and their order
@dataclass
class Plan:
    """The file operations of one save (or of a trigger that saved nothing new), applied in this order:
    hard-linked copies (``names[1:]``, e.g. ``last.ckpt`` with ``save_last=True``), the data itself under
    ``names[0]`` (links pointing at it switched together with it), the other links, then the removals."""

    token: str
    names: list[str] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)  # (link, target)
    removals: list[str] = field(default_factory=list)
    protect: frozenset[str] = frozenset()
    staged: str = ""  # where orbax's commit leaves the data before it is published

    def apply(self) -> None:
        links = list(self.links)
        if self.names:
            primary = self.names[0]
            for copy in self.names[1:]:
                tmp = marked(copy, "copy", self.token)
                hardlink_tree(self.staged, tmp)
                _put(tmp, copy, self.token)
            along = [lk for lk, t in links if t == primary]
            links = [(lk, t) for lk, t in links if t != primary]
            self._publish(primary, along)
        for lk, t in links:
            link(lk, t, self.token)
        for p in self.removals:
            if p not in self.protect:
                dispose(p, self.token)

    def _publish(self, primary: str, links: list[str]) -> None:
        """Give the staged data its name; links to it switch in the same instant where possible."""
        if not links:
            _put(self.staged, primary, self.token)
            return
        now = [lk for lk in links if resolves_complete(lk)]
        directory = os.path.dirname(primary)
        if not now:  # nothing to keep resolvable yet: point the links first, then name the data
            for lk in links:
                link(lk, primary, self.token)
            _put(self.staged, primary, self.token)
        elif not os.path.lexists(primary) and _can_exchange(directory, self.token):
            # A placeholder link at the new name, resolving where the link resolves now; the link moves to it
            # (still resolving to the old checkpoint); then the data is exchanged with the placeholder, so the
            # link resolves to the new checkpoint the instant that checkpoint exists.
            mark = marked(primary, "placeholder", self.token)  # tells a repair that `primary` may be a placeholder
            with open(mark, "w"):
                pass
            link(primary, os.path.realpath(now[0]), self.token)
            link(now[0], primary, self.token)
            _put(self.staged, primary, self.token)
            for lk in links:
                link(lk, primary, self.token)
            os.unlink(mark)
        else:  # no atomic exchange on this filesystem: the link follows a moment later
            _put(self.staged, primary, self.token)
            for lk in links:
                link(lk, primary, self.token)


@dataclass
class _Job:
    plan: Plan
    committed: bool = False


class Publisher:
    """Runs the plans on process 0 in save order: a save's plan when orbax commits it, other plans at once
    unless a save before them has not committed yet."""

    def __init__(self) -> None:
        self.active = True  # False on processes other than 0: they decide, process 0 touches the files
        self._lock = threading.Lock()
        self._jobs: deque[_Job] = deque()
        self._by_path: dict[str, _Job] = {}

    def expect(self, orbax_path: str, plan: Plan) -> None:
        """``plan`` runs when the save orbax writes to ``orbax_path`` commits (and every earlier plan ran)."""
        if not self.active:
            return
        with self._lock:
            job = _Job(plan)
            self._jobs.append(job)
            self._by_path[os.path.abspath(orbax_path)] = job

    def forget(self, orbax_path: str) -> None:
        """The save never started (it raised before handing over to orbax)."""
        with self._lock:
            job = self._by_path.pop(os.path.abspath(orbax_path), None)
            if job is not None:
                self._jobs.remove(job)
                self._drain()

    def submit(self, plan: Plan) -> None:
        """A plan with no save of its own: it runs once every save before it has committed."""
        if not self.active:
            return
        with self._lock:
            self._jobs.append(_Job(plan, committed=True))
            self._drain()

    def lookup(self, orbax_path: str) -> Plan | None:
        """The plan waiting for the save at ``orbax_path`` (None: a save no plan was made for)."""
        with self._lock:
            job = self._by_path.get(os.path.abspath(orbax_path))
            return None if job is None else job.plan

    def committed(self, orbax_path: str) -> None:
        """Orbax moved the save to ``plan.staged``: run every plan that is now due (in orbax's commit thread)."""
        with self._lock:
            job = self._by_path.pop(os.path.abspath(orbax_path), None)
            if job is None:  # abandoned meanwhile (an earlier save failed): its data stays marked, never named
                return
            job.committed = True
            self._drain()

    def abandon(self) -> None:
        """A save failed in the background: its plan (and no later one) will never be committed."""
        with self._lock:
            self._jobs = deque(j for j in self._jobs if j.committed)
            self._by_path.clear()
            self._drain()

    def _drain(self) -> None:
        while self._jobs and self._jobs[0].committed:
            self._jobs.popleft().plan.apply()


def _temporary_path_class(publisher: Publisher) -> type:
    """Orbax's rename-on-commit temporary path, publishing through ``publisher`` instead of renaming to the final
    name (built on first use: orbax is imported lazily)."""
    from orbax.checkpoint.path import atomicity

    class PublishingTemporaryPath(atomicity.AtomicRenameTemporaryPath):
        async def finalize(self) -> None:
            final = str(self._final_path)
            plan = publisher.lookup(final)
            if plan is None:  # a save this publisher did not plan: orbax's own commit
                await super().finalize()
                return
            # orbax's commit (metadata, commit_success.txt, rename) into a name marked as unfinished ...
            self._final_path = type(self._final_path)(plan.staged)
            await super().finalize()
            # ... then the plan gives it its names, switches last, removes what it replaces
            publisher.committed(final)

    return PublishingTemporaryPath


def publishing_checkpointer(async_: bool, publisher: Publisher) -> Any:
    """jaxlight's checkpointer (:func:`jaxlight.checkpoint.format.new_checkpointer`), committing through
    ``publisher``: a save with a plan (:meth:`Publisher.expect`) is committed under its staged name, then
    published by the plan."""
    return new_checkpointer(async_, temporary_path_class=_temporary_path_class(publisher))


# ---------------------------------------------------------------------------- after a kill
def repair(dirpath: str, token: str, *, last_prefix: str, extension: str, link_last: bool) -> None:
    """Finish or undo what a killed run left mid-operation in ``dirpath`` (process 0, before any save).

    - a ``last`` copy caught between its two renames (filesystems without an atomic exchange): the complete
      copy gets its name back;
    - marked intermediate names (staged data never published, half-removed checkpoints, temporary links)
      and orbax's unfinished saves of names ending in ``extension`` are removed;
    - ``last -> F -> E`` (F a placeholder whose exchange never happened) becomes ``last -> E`` and the
      placeholder goes;
    - with ``link_last`` (``save_last="link"``), a link left one save behind (no atomic exchange) moves to
      the newest complete checkpoint, which is what Lightning's link names.

    ``last_prefix`` starts the names of the ``last`` links; ``token`` makes the intermediate names unique.
    """
    if not os.path.isdir(dirpath):
        return
    lasts = [
        os.path.join(dirpath, n)
        for n in os.listdir(dirpath)
        if n.startswith(last_prefix) and os.path.islink(os.path.join(dirpath, n))
    ]
    for name in os.listdir(dirpath):
        m = _LEFTOVER.match(name)
        placeholder = os.path.join(dirpath, m["base"]) if m and m["kind"] == "placeholder" else None
        if placeholder is None or not os.path.islink(placeholder):
            continue
        # a switch cut short: links through the placeholder go straight to what it stands for; it goes
        target = os.path.realpath(placeholder)
        for lk in lasts:
            if os.path.join(dirpath, os.readlink(lk)) == placeholder and resolves_complete(target):
                link(lk, target, token)
        os.unlink(placeholder)
    restore: dict[str, str] = {}
    for name in sorted(os.listdir(dirpath), key=lambda n: "old" in n):  # copies (newer) before olds
        m = _LEFTOVER.match(name)
        path = os.path.join(dirpath, name)
        if m and m["kind"] in ("copy", "old") and not os.path.lexists(os.path.join(dirpath, m["base"])):
            if is_whole(path) and m["base"] not in restore:
                restore[m["base"]] = path
    for base, path in restore.items():
        os.rename(path, os.path.join(dirpath, base))
    partial = []
    for name in os.listdir(dirpath):
        if _LEFTOVER.match(name):
            dispose(os.path.join(dirpath, name), token)
        elif name.endswith(extension + TMP_MARK):  # orbax's own unfinished save of one of our names
            partial.append(name)
            dispose(os.path.join(dirpath, name), token)
    if partial:
        rank_zero_info(f"jaxlight: removed unfinished checkpoint saves of an earlier run in {dirpath}: {partial}")
    for head in lasts:
        if link_last and resolves_complete(head):
            newest = find_last([Path(dirpath)])
            if newest is not None and os.path.realpath(newest) != os.path.realpath(head):
                if checkpoint_order(newest) > checkpoint_order(os.path.realpath(head)):
                    link(head, str(newest), token)


__all__ = [
    "Plan",
    "Publisher",
    "dispose",
    "hardlink_tree",
    "link",
    "marked",
    "publishing_checkpointer",
    "repair",
]
