"""Finding checkpoints: complete ones in a directory, the newest of a run (``"last"``), the best (``"best"``).

Checkpoint callbacks are asked through what every callback declares
(:attr:`Callback.checkpoint_dirpath`, :meth:`Callback.best_checkpoint_path`),
never by their type, so a checkpoint callback written by a user is found like
``ModelCheckpoint``. Nothing here knows the Trainer: the trainer-level entry
points (``resolve_ckpt_path(trainer, ...)``) are in
:mod:`jaxlight.checkpoint.run_state`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxlight.checkpoint.format import (
    TMP_MARK,
    is_complete,
    is_whole,
    missing_parts,
    order_key,
    read_meta,
    resolves_complete,
)
from jaxlight.checkpoint.host_state import host_checkpoint
from jaxlight.errors import CheckpointError, MisconfigurationError
from jaxlight.rank_zero import WarnOnce

if TYPE_CHECKING:  # pragma: no cover
    from jaxlight.callbacks.callback import Callback


def list_checkpoints(dirpath: str | os.PathLike) -> list[Path]:
    """Complete checkpoint directories directly under ``dirpath`` (symlinks not followed twice)."""
    d = Path(dirpath)
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if not p.is_symlink() and is_complete(p))


def unfinished_saves(dirpath: str | os.PathLike) -> list[Path]:
    """Orbax's temporary directories under ``dirpath``: saves that never committed."""
    d = Path(dirpath)
    return sorted(p for p in d.iterdir() if TMP_MARK in p.name) if d.is_dir() else []


_warn_skipped = WarnOnce()


def find_last(dirs: list[Path]) -> Path | None:
    """The newest complete checkpoint in ``dirs``: the furthest progress, then the latest commit
    (:func:`jaxlight.checkpoint.format.order_key`; the ``time`` a file claims is not trusted), then a ``last``
    name (a ``last.ckpt`` sharing its files with a top-k checkpoint is what Lightning's "last" resumes from).
    A checkpoint whose metadata fails its checks is passed over, with a warning naming it and why."""
    best, best_key = None, None
    for d in dirs:
        for p in list_checkpoints(d):
            try:
                m = read_meta(p)
            except CheckpointError as e:
                _warn_skipped(("last", str(p)), f"ckpt_path='last' passes over {p}: {e}")
                continue
            key = (*order_key(m), p.name.startswith("last"))
            if best_key is None or key > best_key:
                best, best_key = p, key
    return best


def next_commit_seq(dirpath: str | os.PathLike) -> int:
    """The commit sequence number of the next checkpoint saved into ``dirpath``: one more than any complete
    checkpoint there holds (0 for the first)."""
    seq = -1
    for p in list_checkpoints(dirpath):
        try:
            seq = max(seq, read_meta(p).get("commit_seq", 0))
        except CheckpointError:
            continue
    return seq + 1


def not_own_checkpoint(path: Any, dirpath: str | os.PathLike, extension: str) -> str | None:
    """Why ``path`` (named in a checkpoint callback's saved state) is not a checkpoint a resuming run may
    remove: it must be directly inside ``dirpath``, carry ``extension``, and be a complete checkpoint directory
    of jaxlight's format, or a link to one (only the link is ever removed). None: it is one; ``"missing"``:
    nothing is there any more."""
    if not isinstance(path, str) or not path:
        return f"not a path ({type(path).__name__})"
    if not os.path.isabs(path):  # a run records absolute paths; a relative one would mean the cwd's
        return "not an absolute path"
    p = os.path.normpath(path)
    if os.path.realpath(os.path.dirname(p)) != os.path.realpath(dirpath):
        return f"not directly inside {dirpath}"
    name = os.path.basename(p)
    if not name.endswith(extension) or TMP_MARK in name:
        return f"not a checkpoint name (it does not end with {extension!r})"
    if not os.path.lexists(p):
        return "missing"
    if os.path.islink(p):
        return None if resolves_complete(p) else "a link that does not resolve to a complete checkpoint"
    if not is_whole(p):
        return "not a complete checkpoint directory"
    try:
        read_meta(p)
    except CheckpointError as e:
        return f"not a jaxlight checkpoint ({e})"
    return None


def check_filename(filename: str | None) -> None:
    """A checkpoint callback's ``filename`` template names a file directly in its directory: no "/" and no
    ".." in its own text (top-k, ``last`` and ``ckpt_path="last"`` look there only); raises
    :class:`MisconfigurationError`. The metric names inside ``{...}`` are the callback's to check."""
    if not filename:
        return
    text = re.sub(r"\{[^}]*\}", "", filename)
    seps = [c for c in ("/", os.sep, os.altsep) if c and c in text]
    if seps or ".." in text:
        what = f"a {seps[0]!r}" if seps else "'..'"
        raise MisconfigurationError(
            f"ModelCheckpoint(filename={filename!r}) contains {what}: checkpoints are written directly in dirpath, "
            f"where top-k, save_last and ckpt_path='last' look for them (a name in a subdirectory or outside would "
            f"make a rerun start from step 0). Put the directory in dirpath= and keep filename a plain name"
        )


def search_dirs(callbacks: Sequence[Callback], default_dir: str | os.PathLike) -> list[Path]:
    """Where ``ckpt_path="last"`` looks: each checkpoint callback's directory (and the same directory under
    every ``version_N`` of a versioned logger), else ``<default_dir>/checkpoints``."""
    dirs: list[Path] = []
    for cb in callbacks:
        dp = cb.checkpoint_dirpath if cb.is_checkpoint_callback else None
        if dp:
            dirs.append(Path(dp))
            # With a versioned logger each run writes to a new version_N directory;
            # "last" should still find the previous run's checkpoints.
            parts = Path(dp).parts
            if len(parts) >= 2 and parts[-2].startswith("version_"):
                dirs.extend(sorted(Path(*parts[:-2]).glob(f"version_*/{parts[-1]}")))
    if not dirs:
        dirs.append(Path(default_dir) / "checkpoints")
    seen, out = set(), []
    for d in dirs:
        r = d.resolve()
        if r not in seen:
            seen.add(r)
            out.append(d)
    return out


def no_last_reason(dirs: Sequence[Path]) -> str:
    """Where ``ckpt_path="last"`` looked and found no complete checkpoint (with any unfinished saves)."""
    partial = [str(p) for d in dirs for p in unfinished_saves(d)]
    extra = f"; incomplete (never committed) saves there: {partial}" if partial else ""
    return f"ckpt_path='last': no complete checkpoint found in {[str(d) for d in dirs]}{extra}"


def find_best(callbacks: Sequence[Callback], dirs: Sequence[Path]) -> Path:
    """What ``ckpt_path="best"`` loads: the best checkpoint a checkpoint callback knows of in this run, else the
    one its saved state names in the newest checkpoint of ``dirs`` (a new run after an earlier one)."""
    ckpt_cbs = [cb for cb in callbacks if cb.is_checkpoint_callback]
    for cb in ckpt_cbs:
        best = cb.best_checkpoint_path()
        if best:
            return check_path(best)
    last = find_last(list(dirs))
    if last is not None:
        states = host_checkpoint(read_meta(last), last).get("callbacks", {})
        for cb in ckpt_cbs:
            if cb.state_key in states:
                best = cb.best_checkpoint_path(states[cb.state_key])
                if best:
                    return check_path(best)
    raise FileNotFoundError(
        "ckpt_path='best': no best checkpoint is known (no checkpoint callback has saved one in this run, and "
        f"no checkpoint in {[str(d) for d in dirs]} names one); pass monitor= to ModelCheckpoint or a "
        "checkpoint path"
    )


def resolve(ckpt_path: str | os.PathLike, callbacks: Sequence[Callback], default_dir: str | os.PathLike) -> Path:
    """Turn ``"last"``, ``"best"`` or a path into a complete checkpoint directory, or raise saying why."""
    if ckpt_path in ("last", "best"):
        dirs = search_dirs(callbacks, default_dir)
        if ckpt_path == "best":
            return find_best(callbacks, dirs)
        found = find_last(dirs)
        if found is None:
            raise FileNotFoundError(f"{no_last_reason(dirs)}. Start without ckpt_path, or pass a checkpoint path")
        return found
    return check_path(ckpt_path)


def check_path(path: str | os.PathLike) -> Path:
    """``path`` made absolute (a link resolved) if it is a complete checkpoint directory; else raise saying why."""
    p = Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
    if not p.exists():
        raise FileNotFoundError(f"checkpoint {p} does not exist")
    if p.is_symlink():
        p = p.resolve()
    if not p.is_dir():
        raise CheckpointError(f"checkpoint {p} is a file; jaxlight checkpoints are orbax directories")
    if TMP_MARK in p.name:
        raise CheckpointError(
            f"checkpoint {p} is an unfinished save (orbax temporary directory); it was never "
            f"committed and cannot be loaded"
        )
    missing = missing_parts(p)
    if missing:
        raise CheckpointError(f"checkpoint {p} is incomplete or corrupt: missing {missing}")
    return p


def as_given(ckpt_path: str | os.PathLike, resolved: Path) -> str:
    """Lightning's ``trainer.ckpt_path``: the path as the user gave it, so a ``last`` link stays ``last``
    (checkpoint callbacks protect the checkpoint a run resumed from, but never a ``last`` one)."""
    given = os.fspath(ckpt_path)
    if given not in ("last", "best"):
        return os.path.abspath(given)
    if given == "last":  # found by scanning: name it by the last link that points at it, when there is one
        for link in sorted(resolved.parent.glob("last*.ckpt")):
            if link.is_symlink() and link.resolve() == resolved.resolve():
                return str(link)
    return str(resolved)


__all__ = [
    "as_given",
    "check_filename",
    "check_path",
    "find_best",
    "find_last",
    "list_checkpoints",
    "next_commit_seq",
    "no_last_reason",
    "not_own_checkpoint",
    "resolve",
    "search_dirs",
    "unfinished_saves",
]
