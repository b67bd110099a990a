"""The background reader of a stage's loader: batches read, checked and placed one step ahead.

:class:`Prefetcher` reads the next batches of a loader (on a thread, or inline
where a thread would only cost: :func:`reads_inline`), checks each batch's
structure, shapes and dtypes against the compiled step (:func:`check_signature`)
and its rows against the batch axes, places it with the stage's
:class:`~jaxlight.data.BatchPlacer`, and records the loader's own state after
each batch, so a checkpoint resumes at the next batch not yet trained on.
"""

from __future__ import annotations

import functools
import math
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxlight.data import BatchPlacer, batch_rows, flat_host_batch, host_signature, pad_rows
from jaxlight.errors import BatchError

POLL_INTERVAL = 0.1
"""Seconds between two looks at a stop request while the loop waits for the prefetcher's next batch."""

# Extra keys jaxlight adds to a loader's saved state (removed before ``load_state_dict``).
GENERATOR_KEY = "_jaxlight_generator_state"
EPOCH_GENERATOR_KEY = "_jaxlight_epoch_generator_state"  # a plain loader's generator as its epoch began
FRESH_EPOCH_KEY = "_jaxlight_fresh_epoch"


class Prefetched(NamedTuple):
    index: int  # batch_idx within the epoch
    batch: Any  # device arrays; None when the batch was left on the host (``host``)
    rows: int  # global rows
    loader_state: Any  # loader.state_dict() right after this batch, if it has one
    valid: int | None = None  # real rows per share of a padded batch (None: not padded)
    host: Any = None  # the loader's batch of numpy arrays, left unplaced (``Prefetcher(host_batches=True)``)
    place: Callable[[], Any] | None = None  # places ``host`` (what ``placed()`` calls)

    def placed(self) -> Any:
        """The batch on the devices: ``batch``, or ``host`` placed now."""
        if self.batch is not None or self.place is None:
            return self.batch
        return self.place()


def reads_inline(loader: Any, placer: BatchPlacer, depth: int) -> bool:
    """Whether the :class:`Prefetcher` reads each batch in the loop itself rather than on a thread.

    With ``depth=0``, and for a list or tuple of ready batches on CPU devices: reading such a batch is
    an index and placing it a host copy made by the same cores that run the step, so a reader thread has
    nothing to overlap, and its queue hand-offs and its contention for the interpreter cost more per
    step than the step of a small model (measured on 2 cores: issue 25). Loaders that do work per batch
    (a torch ``DataLoader``, a generator), and accelerators, where the transfer of batch i+1 overlaps
    step i, keep the thread.
    """
    if depth <= 0:
        return True
    return isinstance(loader, (list, tuple)) and placer.mesh.devices.flat[0].platform == "cpu"


class Prefetcher:
    """Reads, checks and places the next ``depth`` batches on a background thread (``depth=0``, or an
    in-memory list of batches on CPU devices: inline, each batch when the loop asks for it; see
    :func:`reads_inline`).

    The transfer of batch i+1 runs while step i computes. ``loader_state``
    records the loader's own state after each batch, so a checkpoint saved
    after consuming batch i resumes at i+1 even though i+1 was already read.
    Stops after ``limit`` batches without asking the loader for more (Lightning reads ``len(loader)``
    batches the same way, so a seeded ``RandomSampler`` never draws its last permutation and the next epoch's
    order is Lightning's, not a plain ``for`` loop's). With ``exact`` every batch passes as it
    is, whatever its row count (the loop runs it in a step compiled for its
    shape), placed by :meth:`BatchPlacer.rows_entry` (rows the batch axes
    cannot split are replicated over them); the first batch of a train epoch
    must divide the batch axes, and an evaluation batch may not be longer than
    its loader's first. Otherwise ragged batches (a different row count than
    the first) raise unless ``drop_ragged`` is set, in which case they are
    skipped and counted in ``dropped``. With ``pad`` (evaluation) the step's
    row count is the first batch's rounded up to the mesh's batch axes, and
    any shorter batch is padded to it (:func:`pad_rows`) with its real row
    count in ``Prefetched.valid``; only a batch longer than the compiled
    shape raises. Training batches must keep the first batch's (or the
    compiled step's, ``signature``) structure, non-row dims and dtypes
    (:func:`check_signature`). ``interrupt(waiting)``, when given, is called
    before each batch is taken and every ``POLL_INTERVAL`` seconds while the
    consumer waits for one; it may raise to stop the loop (a preemption).
    With ``host_batches`` (one process, one CPU device: ``BatchPlacer.host_transfers``) a batch of numpy
    arrays is not placed: ``Prefetched.batch`` is None and ``host`` holds it, for a compiled step to
    transfer itself; ``Prefetched.placed()`` places it when the consumer needs device arrays (a compile).
    """

    _END = object()

    def __init__(
        self,
        loader: Iterable,
        placer: BatchPlacer,
        *,
        limit: int | None = None,
        start: int = 0,
        depth: int = 2,
        drop_ragged: bool = False,
        stage: str = "train",
        expected_rows: int | None = None,
        loader_state: Any = None,
        pad: bool = False,
        interrupt: Callable[[bool], None] | None = None,
        signature: BatchSignature | None = None,
        exact: bool = False,
        host_batches: bool = False,
    ) -> None:
        self.loader = loader
        self.pad = pad
        self.interrupt = interrupt
        self.signature = signature
        self.exact = exact and not pad
        self.placer = placer
        self.limit = limit
        self.start = start
        self.loader_state = loader_state
        self.drop_ragged = drop_ragged
        self.stage = stage
        self.expected_rows = expected_rows
        self.dropped = 0
        self._stop = threading.Event()
        self._epoch_generator: Any = None  # see _plain_state
        self._interrupted = False
        self._inline: Iterator[Prefetched] | None = None
        self._thread: threading.Thread | None = None
        self.host_batches = host_batches and placer.host_transfers and not pad
        if reads_inline(loader, placer, depth):  # no thread: each batch is read and placed when the loop asks
            self._inline = self._produce()
            return
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._run, name=f"jaxlight-prefetch-{stage}", daemon=True)
        self._thread.start()

    def _produce(self) -> Iterator[Prefetched]:
        """Read, check and place batches, in order (run on the background thread, or inline)."""
        has_state = hasattr(self.loader, "state_dict") and callable(self.loader.state_dict)
        it = self._open()
        i = self.start
        # Signatures (structure, shapes, dtypes of numpy leaves) whose batch passed every check below, with its
        # global rows and placement: a later batch of the same signature passes them too (the first batch's
        # signature, rows and the compiled shape they compare with are fixed once set), so it is only placed.
        # One process, no padding: the common case, and the per-step cost of a small model.
        seen: dict[tuple, tuple[int, Callable[[list[Any]], Any]]] | None = (
            None if self.pad or self.placer.multiprocess else {}
        )
        stop, limit, flatten = self._stop, self.limit, jax.tree_util.tree_flatten
        while not stop.is_set():
            if limit is not None and i >= limit:
                break
            try:
                raw = next(it)
            except StopIteration:
                break
            state = self._loader_state() if has_state else self._plain_state(i + 1 == limit)
            if seen is not None:
                # no is_leaf here: when every leaf comes out a numpy array the batch held no torch object (a
                # tensor is a leaf either way, a torch.Size would come out as ints), so the tree is as
                # flat_host_batch reads it
                leaves, treedef = flatten(raw)
                key = host_signature(leaves, treedef)
                known = seen.get(key) if key is not None else None
                if known is not None:
                    rows, place = known
                    if self.host_batches and place.host_ok:  # the compiled step transfers it itself
                        yield Prefetched(i, None, rows, state, None, raw, functools.partial(place, leaves))
                    else:
                        yield Prefetched(i, place(leaves), rows, state)
                    i += 1
                    continue
            leaves, treedef, rows = flat_host_batch(raw)
            if rows is None:  # not all arrays with one leading dim: say which leaf is wrong
                rows = batch_rows(jax.tree_util.tree_unflatten(treedef, leaves), i)
            if self.pad:
                hb, valid = self._padded(jax.tree_util.tree_unflatten(treedef, leaves), rows, i)
                pleaves, ptreedef = jax.tree_util.tree_flatten(hb)
                grows = self.placer.global_rows(int(pleaves[0].shape[0]))
                self.placer.check(grows, i)
                yield Prefetched(i, self.placer.place_flat(pleaves, ptreedef), grows, state, valid)
                i += 1
                continue
            check_signature(self, leaves, treedef, i)
            grows = self.placer.global_rows(rows)
            if self.exact:
                self._check_exact(grows, i)
                yield self._item(i, seen, leaves, treedef, grows, state)
                i += 1
                continue
            if self.expected_rows is None:
                self.expected_rows = grows
            if grows != self.expected_rows:
                if self.drop_ragged:
                    self.dropped += 1
                    continue
                raise BatchError(
                    f"{self.stage} batch {i} has {grows} rows but the first had {self.expected_rows}; "
                    f"the step is compiled for one shape. Drop the ragged batch in the loader "
                    f"(DataLoader(drop_last=True)) or pass Trainer(ragged_batches='drop')"
                )
            self.placer.check(grows, i)
            yield self._item(i, seen, leaves, treedef, grows, state)
            i += 1

    def _item(self, i: int, seen: dict | None, leaves: list[Any], treedef: Any, rows: int, state: Any) -> Prefetched:
        """Batch ``i``, which passed every check: placed, or left on the host for the consumer (``host_batches``);
        its signature remembered in ``seen`` when a later batch of it would pass them all too (rows the batch
        axes divide: an epoch's first batch must have such)."""
        if seen is None:
            return Prefetched(i, self.placer.place_flat(leaves, treedef), rows, state)
        place = self.placer.flat_plan(leaves, treedef)
        key = host_signature(leaves, treedef)
        if key is not None and rows and rows % self.placer.divisor == 0:
            seen[key] = (rows, place)
        if key is not None and self.host_batches and place.host_ok:  # type: ignore[attr-defined]
            return Prefetched(i, None, rows, state, None, treedef.unflatten(leaves), functools.partial(place, leaves))
        return Prefetched(i, place(leaves), rows, state)

    def _plain_state(self, last: bool) -> Any:
        """A loader without ``state_dict`` but with a torch generator (a plain ``DataLoader(shuffle=True,
        generator=g)``): the generator as the epoch began (a resume inside the epoch draws the same order and
        skips what was consumed), and after the last batch the generator as the epoch ended (where the next
        epoch's order comes from)."""
        if self._epoch_generator is None:
            return None
        state = {EPOCH_GENERATOR_KEY: self._epoch_generator}
        if last:
            state[GENERATOR_KEY] = self.loader.generator.get_state()
        return state

    def _run(self) -> None:
        try:
            for item in self._produce():
                self._put(item)
        except BaseException as e:  # surfaced on the consumer side
            self._put(e)
            return
        self._put(self._END)

    def _check_exact(self, rows: int, i: int) -> None:
        """An ``exact`` batch: any row count (see the class docstring for the two limits)."""
        self.placer.check_exact(rows, i)
        if self.stage == "train":
            if i == 0:  # an epoch's first batch has the loader's batch size: the one the devices split
                self.placer.check(rows, i)
            return
        if self.expected_rows is None:
            self.expected_rows = rows
        elif rows > self.expected_rows:
            raise BatchError(
                f"{self.stage} batch {i} has {rows} rows but the step is compiled for {self.expected_rows} (from "
                f"the first batch); a shorter batch (the usual last one) runs in a step compiled for its own "
                f"shape, but a batch may not be longer than the loader's first one"
            )

    def _padded(self, hb: Any, rows: int, i: int) -> tuple[Any, int | None]:
        """The batch padded to the compiled row count (fixed by the first batch), and its real rows."""
        shares = self.placer.global_rows(1)
        if self.expected_rows is None:
            # rows over the batch axes: round the first batch up so every device gets whole rows
            unit = self.placer.divisor // math.gcd(self.placer.divisor, shares)
            self.expected_rows = -(-rows // unit) * unit * shares
        local = self.expected_rows // shares
        if rows > local:
            raise BatchError(
                f"{self.stage} batch {i} has {self.placer.global_rows(rows)} rows but the step is compiled for "
                f"{self.expected_rows} (from the first batch); evaluation pads shorter batches, but a batch may not "
                f"be longer than the first one"
            )
        if rows == local:
            return hb, None
        return pad_rows(hb, local), rows

    def _open(self) -> Iterator:
        """Iterate the loader from the resume point: a restored ``state_dict``, or ``start`` batches skipped.

        torchdata restores the position inside an epoch but draws the next
        epoch's shuffle from the loader's generator as a fresh loader would, so
        the generator's state (saved with the loader state) is put back too.
        """
        saved = self.loader_state
        gen = getattr(self.loader, "generator", None)
        can_load = callable(getattr(self.loader, "load_state_dict", None))
        if saved is not None and can_load:
            saved = dict(saved)
            gen_state = saved.pop(GENERATOR_KEY, None)
            fresh_epoch = saved.pop(FRESH_EPOCH_KEY, False)
            if fresh_epoch:  # the saved epoch was finished: start a new one from the saved generator
                if gen_state is not None and gen is not None:
                    gen.set_state(gen_state)
                return iter(self.loader)
            self.loader.load_state_dict(saved)
            it = iter(self.loader)
            if gen_state is not None and gen is not None:
                gen.set_state(gen_state)
            return it
        if _settable(gen):  # a plain torch loader: its order comes from the generator's state at iter()
            saved = saved if isinstance(saved, Mapping) else {}
            start_state = saved.get(EPOCH_GENERATOR_KEY) if self.start else saved.get(GENERATOR_KEY)
            if start_state is not None:
                gen.set_state(start_state)
            self._epoch_generator = gen.get_state()
        it = iter(self.loader)
        for _ in range(self.start):  # a plain re-iterable: skip what the checkpoint had consumed
            try:
                next(it)
            except StopIteration:
                break
        return it

    def _loader_state(self) -> Any:
        state = self.loader.state_dict()
        gen = getattr(self.loader, "generator", None)
        if isinstance(state, dict) and gen is not None and callable(getattr(gen, "get_state", None)):
            state = {**state, GENERATOR_KEY: gen.get_state()}
        return state

    def _put(self, item: Any) -> None:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator[Prefetched]:
        return self

    def __next__(self) -> Prefetched:
        if self.interrupt is not None:
            self._poll(False)  # may raise: a stop was requested between batches
        if self._inline is not None:
            return next(self._inline)
        item = self._q.get() if self.interrupt is None else self._get_polling()
        if item is self._END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def _get_polling(self) -> Any:
        # A stalled loader (a hung network file system) must not make a stop request wait for it.
        while True:
            try:
                return self._q.get(timeout=POLL_INTERVAL)
            except queue.Empty:
                self._poll(True)

    def _poll(self, waiting: bool) -> None:
        try:
            self.interrupt(waiting)  # type: ignore[misc]
        except BaseException:
            self._interrupted = True  # close() then does not wait for a thread that may be stuck in the loader
            raise

    def close(self) -> None:
        self._stop.set()
        if self._thread is None:
            if self._inline is not None:
                self._inline.close()
            return
        try:
            while True:
                self._q.get_nowait()
        except queue.Empty:
            pass
        self._thread.join(timeout=0 if self._interrupted else 5)


def _settable(gen: Any) -> bool:
    return callable(getattr(gen, "get_state", None)) and callable(getattr(gen, "set_state", None))


BatchSignature = tuple[Any, tuple[tuple[tuple[int, ...], Any], ...]]
"""``(treedef, ((shape without the row dim, dtype), ...))``: what a train step is compiled for, rows aside."""


def batch_signature(leaves: Sequence[Any], treedef: Any) -> BatchSignature:
    """The signature of a flattened host batch (dtypes as the device will hold them: int64 -> int32 without x64)."""
    return treedef, tuple((tuple(x.shape[1:]), jax.dtypes.canonicalize_dtype(x.dtype)) for x in leaves)


def compiled_signature(compiled: Any) -> BatchSignature | None:
    """The batch signature a compiled train step ``(state, batch, ...)`` takes (None when it does not say).
    A multi-step program (``steps_per_execution``, its ``batch_idx`` one per step) takes a tuple of batches of
    one signature: its first batch's."""
    try:
        args = compiled.args_info[0]
        infos, treedef = jax.tree.flatten(args[1][0] if args[2].shape else args[1])
        return treedef, tuple((tuple(a.shape[1:]), jax.dtypes.canonicalize_dtype(a.dtype)) for a in infos)
    except (AttributeError, IndexError, TypeError):
        return None


def check_signature(fetcher: Prefetcher, leaves: list[Any], treedef: Any, index: int) -> None:
    """Raise a :class:`BatchError` naming the leaf when a train batch's structure, non-row dims or dtypes
    differ from the first batch's (or the compiled step's); a different row count is left to the row checks."""
    sig = batch_signature(leaves, treedef)
    if fetcher.signature is None:
        fetcher.signature = sig
        return
    if sig == fetcher.signature:
        return
    old_tree, old = fetcher.signature
    where = f"{fetcher.stage} batch {index}"
    if treedef != old_tree:
        raise BatchError(f"{where} has structure {treedef} but the step was compiled for {old_tree}")
    paths = [
        jax.tree_util.keystr(p) or "<root>"
        for p, _ in jax.tree_util.tree_flatten_with_path(jax.tree_util.tree_unflatten(treedef, leaves))[0]
    ]
    for path, leaf, new_leaf, (old_shape, old_dtype) in zip(paths, leaves, sig[1], old):
        if new_leaf != (old_shape, old_dtype):
            rows = leaf.shape[0]
            raise BatchError(
                f"{where}: leaf {path} has shape {tuple(leaf.shape)} {np.dtype(leaf.dtype).name} but the step was "
                f"compiled for {(rows, *old_shape)} {np.dtype(old_dtype).name} (rows aside: only the leading, "
                f"batch dim may change between batches); make the loader yield one shape and dtype per leaf"
            )
