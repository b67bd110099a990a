"""The mechanics of a checkpoint callback's saves, apart from its policy.

A checkpoint callback decides when to save, under which names, and what a
save replaces (a :class:`~jaxlight.checkpoint.publish.Plan`). A
:class:`CheckpointWriter` does the rest: it holds the callback's directory
lock (:mod:`jaxlight.checkpoint.dirlock`), its orbax checkpointer committing
through a :class:`~jaxlight.checkpoint.publish.Publisher`, the commit
sequence numbers that order saves for ``"last"``, and turns a background
save's failure into an error naming the save's path and size.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from jaxlight import rank_failure
from jaxlight.checkpoint import dirlock, publish
from jaxlight.checkpoint.discovery import next_commit_seq
from jaxlight.checkpoint.format import disk_full_error
from jaxlight.checkpoint.run_state import RunSnapshot, prepare
from jaxlight.errors import CheckpointError


class CheckpointWriter:
    """Writes one callback's checkpoints and publishes each as it commits (see the module docstring).

    ``async_save``: saves return once the arrays are copied off the devices and
    commit in the background. ``primary`` (process 0) publishes, creates
    directories and holds the lock; every process writes its part of each save.
    """

    def __init__(self, async_save: bool = True) -> None:
        self.async_save = async_save
        self.publisher = publish.Publisher()
        self.checkpointer: Any = None  # created at the first save
        self.lock: dirlock.DirLock | None = None
        self._commit_seq: int | None = None  # the next save's commit sequence number (set at the first save)
        self._inflight: tuple[str, int] = ("", 0)  # the newest save's path and size, for a disk-full message

    @property
    def primary(self) -> bool:
        """Whether this process publishes (process 0)."""
        return self.publisher.active

    @primary.setter
    def primary(self, value: bool) -> None:
        self.publisher.active = value

    # ------------------------------------------------------------------ the directory
    def take(self, dirpath: str, owner: str) -> None:
        """The primary process locks ``dirpath`` for this run (which also proves it writable); if it cannot,
        every process raises, so none is left waiting in a later collective. Holding it already is a no-op."""
        error: CheckpointError | None = None
        if self.primary and self.lock is None:
            try:
                self.lock = dirlock.acquire(dirpath, owner)
            except CheckpointError as e:
                error = e
        rank_failure.raise_together(
            error,
            lambda _: CheckpointError(
                f"checkpoint directory {dirpath} could not be taken by process 0 (its error says why)"
            ),
        )

    def release(self) -> None:
        """Give the directory lock back (if held)."""
        lock, self.lock = self.lock, None
        if lock is not None:
            lock.release()

    # ------------------------------------------------------------------ saving and publishing
    def submit(self, plan: publish.Plan) -> None:
        """Publish a plan with no save of its own (links and removals), in order after the saves before it."""
        self.publisher.submit(plan)

    def write(
        self,
        contents: RunSnapshot | Callable[[], RunSnapshot],
        plan: publish.Plan,
        *,
        fresh: bool,
        sync: bool = False,
        reason: str = "periodic",
    ) -> None:
        """Save ``contents`` for ``plan`` (whose first name is the checkpoint's), published when it commits.

        ``fresh``: the first name is free (never used by this run, not on disk), so orbax writes to it
        directly; otherwise to a stand-in that the commit exchanges with it. ``sync`` (or a synchronous
        writer) waits for the commit. ``contents`` may be a function building the snapshot (see
        :func:`jaxlight.checkpoint.run_state.prepare`).
        """
        primary = plan.names[0]
        plan.staged = publish.marked(primary, "staged", plan.token)
        orbax_path = primary if fresh else publish.marked(primary, "next", plan.token)
        self.publisher.expect(orbax_path, plan)
        try:
            self._save(contents, orbax_path, sync=sync, reason=reason)
        except BaseException:
            self.publisher.forget(orbax_path)
            raise

    def _save(self, contents: Any, filepath: str, *, sync: bool, reason: str) -> None:
        if self.checkpointer is None:  # jaxlight's checkpointer, committing through this writer's publisher
            self.checkpointer = publish.publishing_checkpointer(self.async_save, self.publisher)
        if self.primary:
            parent = os.path.dirname(filepath)
            try:  # the directory may have been deleted or replaced since the run took it
                os.makedirs(parent, exist_ok=True)
            except OSError as e:
                raise dirlock.directory_error(
                    parent, e, f"checkpoint {os.path.basename(filepath)} was not saved"
                ) from e
        # orbax waits for the previous save before it starts this one; waiting here first lets a failure of
        # that save (a full disk) be reported with its own path and size
        self.wait()
        if self._commit_seq is None:
            self._commit_seq = next_commit_seq(os.path.dirname(filepath))
        seq, self._commit_seq = self._commit_seq, self._commit_seq + 1
        prepared = prepare(contents, filepath, reason=reason, commit_seq=seq)
        self._inflight = (filepath, prepared.needed)
        prepared.write(self.checkpointer)
        if sync or not self.async_save:
            self.wait()

    def wait(self) -> None:
        """Block until every save has committed and its publication ran; raise a background save's error."""
        ck = self.checkpointer
        if ck is not None and hasattr(ck, "wait_until_finished"):
            try:
                ck.wait_until_finished()
                ck.check_for_errors()
            except BaseException as e:
                self.publisher.abandon()
                full = disk_full_error(e, *self._inflight) if isinstance(e, Exception) else None
                if full is not None:  # orbax's RESOURCE_EXHAUSTED, said with the directory and the size
                    raise full from e
                raise


__all__ = ["CheckpointWriter"]
