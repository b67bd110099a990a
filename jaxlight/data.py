"""Host batches to global device arrays, one step ahead of the compiled step.

A dataloader is anything re-iterable that yields pytrees of numpy arrays,
jax arrays or torch tensors. Each yielded batch is a global batch: its rows
are split over the mesh's batch axes. With ``process_local=True`` each process
yields only its own share of rows and the shares are assembled with
``jax.make_array_from_process_local_data``; otherwise every process reads the
global batch and keeps the rows its devices hold.
"""

from __future__ import annotations

import functools
import math
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlight import compat
from jaxlight.errors import BatchError as BatchError  # its home is jaxlight.errors; this path keeps working
from jaxlight.metrics import current_step_context, row_mask
from jaxlight.strategies.placement import batch_axes_size, batch_spec


def to_numpy(x: Any) -> Any:
    """Convert a leaf to something ``jax.device_put`` takes, without copying when possible."""
    if isinstance(x, (np.ndarray, jax.Array, np.generic)):
        return x
    mod = type(x).__module__
    if mod.startswith("torch"):
        # torch CPU tensors share memory with the numpy view (no copy).
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if str(t.dtype) == "torch.bfloat16":
            import ml_dtypes

            return t.view(dtype=__import__("torch").int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    if isinstance(x, (int, float, bool)):
        return np.asarray(x)
    if isinstance(x, (list, tuple)) and x and all(isinstance(v, (int, float, bool)) for v in x):
        return np.asarray(x)
    return x


def _is_array(x: Any) -> bool:
    return isinstance(x, (np.ndarray, jax.Array))


def host_batch(batch: Any) -> Any:
    """Pytree of numpy/jax arrays from whatever the loader yielded."""
    return jax.tree.map(to_numpy, batch, is_leaf=lambda x: type(x).__module__.startswith("torch"))


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _host_signature(leaves: list[Any], treedef: Any) -> tuple | None:
    """``(treedef, ((shape, dtype), ...))`` of a flattened batch of numpy arrays; None for any other leaf."""
    sig = []
    for x in leaves:
        if type(x) is not np.ndarray:
            return None
        sig.append((x.shape, x.dtype))
    return treedef, tuple(sig)


def flat_host_batch(batch: Any) -> tuple[list[Any], Any, int | None]:
    """``(leaves, treedef, rows)`` of a loader's batch: leaves as numpy/jax arrays, and the rows they share.

    The per-batch fast path of the prefetcher (one flatten, no key paths); ``rows`` is None when the
    leaves are not all arrays with one leading dim, and :func:`batch_rows` then says what is wrong.
    """
    leaves, treedef = jax.tree_util.tree_flatten(batch, is_leaf=_is_torch)
    leaves = [to_numpy(x) for x in leaves]
    rows = None
    for leaf in leaves:
        shape = getattr(leaf, "shape", None)
        if not _is_array(leaf) or not shape:
            return leaves, treedef, None
        if rows is None:
            rows = shape[0]
        elif shape[0] != rows:
            return leaves, treedef, None
    return leaves, treedef, rows


def batch_rows(batch: Any, index: int | None = None) -> int:
    """Number of rows of a batch; raises when leading dims disagree."""
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    rows: dict[int, str] = {}
    for path, leaf in leaves:
        if not _is_array(leaf):
            raise BatchError(
                f"batch leaf {jax.tree_util.keystr(path) or '<root>'} is a {type(leaf).__name__}; "
                f"batches must hold numpy arrays, jax arrays or torch tensors"
            )
        if leaf.ndim == 0:
            raise BatchError(
                f"batch leaf {jax.tree_util.keystr(path)} is a scalar; every leaf needs a leading batch dim"
            )
        rows.setdefault(int(leaf.shape[0]), jax.tree_util.keystr(path))
    if not rows:
        raise BatchError("batch holds no arrays")
    if len(rows) > 1:
        where = f"batch {index}" if index is not None else "batch"
        detail = ", ".join(f"{p or '<root>'}: {n}" for n, p in rows.items())
        raise BatchError(f"{where} has leaves whose leading dims disagree ({detail})")
    return next(iter(rows))


class DataPartition(NamedTuple):
    """The share of every global batch one process reads.

    ``index`` of ``count`` equal, contiguous shares of rows (share i holds rows
    ``[i * rows / count, (i + 1) * rows / count)`` of a global batch);
    ``readers`` processes read the same share (they hold the same rows, e.g.
    when the tensor axis spans processes) and ``reader`` is this process's
    place among them.
    """

    index: int
    count: int
    readers: int
    reader: int


def data_partition(mesh: Mesh, process_index: int | None = None) -> DataPartition:
    """Which share of each global batch ``process_index`` (default: this process) reads on ``mesh``.

    Rows split over the batch axes only, so processes whose devices hold the
    same row shards read the same share. A loader that reads only its share
    (``Trainer(process_local_batches=True)``) should yield rows
    ``index::count`` or the ``index``-th contiguous block of each global
    batch; the trainer assembles the shares in share order. Raises a
    ValueError for a device order whose processes hold overlapping but
    different rows (no whole share to read).
    """
    pid = jax.process_index() if process_index is None else process_index
    n = batch_axes_size(mesh)
    # One row per batch-axes shard: which shards each process's devices hold.
    index_map = NamedSharding(mesh, batch_spec(mesh, 1)).devices_indices_map((n,))
    held: dict[int, set[int]] = {}
    for dev, idx in index_map.items():
        start = idx[0].start or 0
        stop = n if idx[0].stop is None else idx[0].stop
        held.setdefault(dev.process_index, set()).update(range(start, stop))
    groups = sorted({tuple(sorted(v)) for v in held.values()})
    flat = [r for g in groups for r in g]
    if len(flat) != len(set(flat)):
        raise ValueError(
            f"processes hold overlapping but different row shards on mesh {dict(mesh.shape)} "
            f"({ {p: sorted(v) for p, v in sorted(held.items())} }); no process could read a whole share"
        )
    if any(g != tuple(range(g[0], g[0] + len(g))) for g in groups) or len({len(g) for g in groups}) != 1:
        raise ValueError(f"processes hold non-contiguous or unequal row shards on mesh {dict(mesh.shape)}: {groups}")
    mine = tuple(sorted(held[pid]))
    readers = sorted(p for p, v in held.items() if tuple(sorted(v)) == mine)
    return DataPartition(groups.index(mine), len(groups), len(readers), readers.index(pid))


def leaf_path(path: tuple) -> str:
    """A batch leaf's key path as the "/"-joined string strategy pieces see (``"tokens"``, ``"0"``)."""
    return jax.tree_util.keystr(path, simple=True, separator="/") or "<root>"


class BatchPlacer:
    """Puts host batches on the mesh: rows over the batch axes, other dims as the strategy says.

    Dim 0 of every leaf is split over the batch axes (``data*fsdp*expert``);
    a strategy piece may split more dims of a leaf (sequence parallelism
    splits the length dim of token inputs), see ``Piece.batch_dims``. With
    ``process_local`` in a multi-process run, each process's loader yields
    only its :func:`data_partition` share and the global batch is ``count``
    times as many rows; otherwise every process yields the whole global batch
    and keeps the rows its devices hold. Shardings are computed once per leaf
    path and shape.
    """

    def __init__(self, mesh: Mesh, process_local: bool = False, strategy: Any = None) -> None:
        self.mesh = mesh
        self.process_local = process_local
        self.strategy = strategy
        self.divisor = batch_axes_size(mesh)
        self.multiprocess = jax.process_count() > 1
        self.partition = data_partition(mesh) if self.multiprocess else DataPartition(0, 1, 1, 0)
        self._rows_spec = batch_spec(mesh, 1)
        self._shardings: dict[tuple[str, tuple[int, ...]], NamedSharding] = {}
        self._flat: dict[tuple, Callable[[list[Any]], Any]] = {}  # batch signature -> its flat_plan
        # one process, one CPU device: a compiled step given numpy arrays transfers them itself, in jax's C++
        # dispatch (~5 µs a leaf against ~10-30 for a put from Python, and its result is ready at once, so
        # the step runs inline instead of waiting on the put: measured on jax 0.10.2, 2 cores)
        self.host_transfers = not self.multiprocess and mesh.size == 1 and mesh.devices.flat[0].platform == "cpu"

    def sharding(self, ndim: int) -> NamedSharding:
        """Rows over the batch axes, other dims whole (what a leaf gets when no piece splits it)."""
        return NamedSharding(self.mesh, batch_spec(self.mesh, ndim))

    def leaf_sharding(self, path: str, shape: tuple[int, ...]) -> NamedSharding:
        """The sharding of batch leaf ``path`` with *global* shape ``shape`` (checked for divisibility)."""
        key = (path, shape)
        sh = self._shardings.get(key)
        if sh is not None:
            return sh
        spec: list[Any] = [self.rows_entry(shape[0])] if shape else []
        dims = self.strategy.batch_dims(path, shape) if self.strategy is not None else {}
        for dim, axis in sorted(dims.items()):
            if dim >= len(shape):
                raise BatchError(
                    f"strategy {self.strategy.name!r} splits dim {dim} of batch leaf {path}, which has shape "
                    f"{shape} ({len(shape)} dims)"
                )
            size = self.mesh.shape[axis]
            if size == 1:
                continue
            if shape[dim] % size:
                raise BatchError(
                    f"batch leaf {path} has shape {shape}: dim {dim} ({shape[dim]}) is not divisible by mesh axis "
                    f"{axis!r} = {size} that strategy {self.strategy.name!r} splits it over"
                )
            spec += [None] * (dim + 1 - len(spec))
            spec[dim] = axis
        while spec and spec[-1] is None:
            spec.pop()
        sh = self._shardings[key] = NamedSharding(self.mesh, P(*spec))
        return sh

    def rows_entry(self, rows: int) -> Any:
        """The mesh axes dim 0 of a leaf with ``rows`` global rows is split over (a PartitionSpec entry).

        All the batch axes when ``rows`` divides them (every full batch: :meth:`check` held); for a
        shorter batch that does not, the largest set of batch axes whose size divides ``rows`` (ties: the
        earlier axes), so the rows are replicated over the axes they cannot split and every device still
        computes whole real rows (``None``: replicated over all of them).
        """
        full = self._rows_spec[0] if len(self._rows_spec) else None
        if full is None or rows % self.divisor == 0:
            return full
        axes = (full,) if isinstance(full, str) else tuple(full)
        best: tuple[str, ...] = ()
        for mask in range(1, 1 << len(axes)):
            pick = tuple(a for j, a in enumerate(axes) if mask >> j & 1)
            size = math.prod(self.mesh.shape[a] for a in pick)
            if rows % size == 0 and size > math.prod(self.mesh.shape[a] for a in best):
                best = pick
        return None if not best else best[0] if len(best) == 1 else best

    def global_rows(self, local_rows: int) -> int:
        if self.process_local and self.multiprocess:
            return local_rows * self._share_count()
        return local_rows

    def _share_count(self) -> int:
        # Processes holding the same row shards read one share together.
        return self.partition.count

    def check(self, rows: int, index: int | None = None) -> None:
        if rows == 0:
            raise BatchError(f"batch {index} has 0 rows" if index is not None else "batch has 0 rows")
        if rows % self.divisor:
            where = f" (batch {index})" if index is not None else ""
            raise BatchError(
                f"global batch {rows}{where} is not divisible by the batch axes "
                f"data*fsdp*expert = {self.divisor} of mesh {dict(self.mesh.shape)}"
            )

    def check_exact(self, rows: int, index: int | None = None) -> None:
        """What a batch of any row count needs to run in a step compiled for its own shape: rows, and,
        when each process reads only its share (``process_local_batches``), rows the batch axes divide
        (a batch replicated over an axis needs every row on every process)."""
        if rows == 0:
            raise BatchError(f"batch {index} has 0 rows" if index is not None else "batch has 0 rows")
        if self.process_local and self.multiprocess and rows % self.divisor:
            where = f" (batch {index})" if index is not None else ""
            raise BatchError(
                f"global batch {rows}{where} is not divisible by the batch axes data*fsdp*expert = {self.divisor} "
                f"of mesh {dict(self.mesh.shape)}; with process_local_batches=True each process holds only its "
                f"rows, so a batch the devices cannot split cannot be replicated either. Drop it (ragged_batches="
                f"'drop', DataLoader(drop_last=True)) or give every process a share the devices divide"
            )

    def place_flat(self, leaves: list[Any], treedef: Any) -> Any:
        """:meth:`place` for an already flattened host batch: the per-step fast path (see :meth:`flat_plan`)."""
        if self.multiprocess:
            return self.place(jax.tree_util.tree_unflatten(treedef, leaves))
        return self.flat_plan(leaves, treedef)(leaves)

    def flat_plan(self, leaves: list[Any], treedef: Any) -> Callable[[list[Any]], Any]:
        """A function placing flattened host batches of this one signature (structure, shapes, dtypes), made
        once per signature (one process).

        Each leaf is transferred by :func:`jaxlight.compat.host_putter` when it is a numpy array, jax's own
        per-device put with everything but the copy worked out once (``jax.device_put`` spends ~100 µs per
        leaf of host time in its dispatch and ``jax.make_array_from_callback`` ~20, measured on jax 0.10.2
        CPU: on a tiny model more than the step itself); a leaf that is already a jax array (or of a dtype
        jax narrows, such as float64) by ``jax.device_put``.
        """
        key = (treedef, tuple((x.shape, x.dtype) for x in leaves))
        plan = self._flat.get(key)
        if plan is None:
            tree = jax.tree_util.tree_unflatten(treedef, leaves)
            paths = [leaf_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
            shardings = [self.leaf_sharding(path, tuple(x.shape)) for path, x in zip(paths, leaves)]
            putters = [
                compat.host_putter(tuple(x.shape), x.dtype, sh)
                if jax.dtypes.canonicalize_dtype(x.dtype) == x.dtype
                else None
                for x, sh in zip(leaves, shardings)
            ]
            pairs = list(zip(shardings, putters))
            unflatten = treedef.unflatten

            def plan(leaves: list[Any]) -> Any:
                return unflatten(
                    [
                        put(x) if put is not None and type(x) is np.ndarray else jax.device_put(x, sh)
                        for x, (sh, put) in zip(leaves, pairs)
                    ]
                )

            # batches of this signature may go to a compiled step as host arrays (see host_transfers): numpy
            # leaves of the dtypes the step holds (jax would narrow a float64)
            plan.host_ok = self.host_transfers and all(  # type: ignore[attr-defined]
                put is not None and type(x) is np.ndarray for x, put in zip(leaves, putters)
            )
            self._flat[key] = plan
        return plan

    def place(self, batch: Any) -> Any:
        def put(path, x):
            shape = tuple(x.shape)
            gshape = (self.global_rows(shape[0]), *shape[1:]) if shape else shape
            sh = self.leaf_sharding(leaf_path(path), gshape)
            if not self.multiprocess:
                return jax.device_put(x, sh)
            if self.process_local:
                return jax.make_array_from_process_local_data(sh, np.asarray(x), gshape)
            xa = np.asarray(x)
            return jax.make_array_from_callback(xa.shape, sh, lambda idx: xa[idx])

        return jax.tree_util.tree_map_with_path(put, batch)


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


def pad_rows(batch: Any, rows: int) -> Any:
    """``batch`` with every leaf grown to ``rows`` rows by repeating its real rows in order.

    Repeated real rows (not zeros) keep every padded value finite and in
    distribution, so nothing a step computes on them can turn into NaN; the
    step tells them apart with :func:`batch_mask`.
    """

    def grow(x: Any) -> Any:
        n = int(x.shape[0])
        idx = np.arange(rows) % n
        return jnp.take(x, jnp.asarray(idx), axis=0) if isinstance(x, jax.Array) else np.take(x, idx, axis=0)

    return jax.tree.map(grow, batch)


def batch_mask(batch: Any = None) -> jax.Array:
    """``bool[rows]``: which rows of the batch a step is traced for are real samples.

    A batch with fewer rows than the others, such as the usual last one
    (``len(dataset) % batch_size`` rows), runs in a step compiled for its own
    shape, so every row a step sees is real and the mask is all True: a plain
    ``.mean()`` over the batch is exact. Rows are padded (by repeating real
    rows; False here) in one case only: an evaluation batch of a multi-process
    run with ``process_local_batches=True``, whose per-process shares are
    padded to the compiled shape. Code that must also be exact there reduces
    with the mask::

        def validation_step(self, batch, batch_idx):
            x, y = batch
            mask = jl.batch_mask(batch)
            per_row = ((self.net(x) - y) ** 2).mean(-1)
            self.log("val_loss", (per_row * mask).sum() / mask.sum())

    ``self.log`` already weighs each batch's value by its real rows, so the
    epoch value is the mean over exactly the dataset's samples. Outside a
    padded evaluation step every row is True; there the mask's length is read
    from ``batch`` (pass it to use the same code in ``training_step``).
    """
    ctx = current_step_context()
    if ctx is not None and ctx.valid is not None and ctx.rows is not None:
        return row_mask(ctx, ctx.rows)
    if batch is None:
        raise ValueError(
            "batch_mask() outside a padded evaluation step needs the batch (batch_mask(batch)) to know the row count"
        )
    leaves = jax.tree.leaves(batch)
    if not leaves or not getattr(leaves[0], "ndim", 0):
        raise ValueError("batch_mask(batch): the batch holds no array with a leading row dimension")
    return jnp.ones((int(leaves[0].shape[0]),), jnp.bool_)


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
                key = _host_signature(leaves, treedef)
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
        key = _host_signature(leaves, treedef)
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


def _is_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "shape")


def _loader_like(obj: Any) -> bool:
    """A loader object, or a plain list of batches (tuples, lists or dicts of arrays)."""
    if (
        obj is None
        or isinstance(obj, (np.ndarray, jax.Array, np.generic, str, bytes, tuple, Mapping))
        or _is_tensor(obj)
    ):
        return False
    if isinstance(obj, list):
        return bool(obj) and all(isinstance(b, (tuple, list, Mapping)) for b in obj)
    return hasattr(obj, "__iter__")


def is_loader_collection(obj: Any) -> bool:
    """Whether ``obj`` is several loaders given at once (Lightning's list or dict of dataloaders).

    A dict is several loaders when every value is a loader; a list or tuple
    when every item is one. A loader is any iterable object that is not a
    list, tuple, dict or array (a ``DataLoader``, a custom class), or a plain
    ``list`` of batches that are tuples, lists or dicts. So a list of batches
    (``[(x0, y0), (x1, y1)]``) stays one loader, and ``[loader_a, loader_b]``
    is two.
    """
    if isinstance(obj, Mapping):
        return bool(obj) and all(_loader_like(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return bool(obj) and all(_loader_like(v) for v in obj)
    return False


def split_loaders(obj: Any) -> list[Any]:
    """The loaders in ``obj``, in order (dict values in insertion order); ``[obj]`` for a single loader."""
    if obj is None:
        return []
    if is_loader_collection(obj):
        return list(obj.values()) if isinstance(obj, Mapping) else list(obj)
    return [obj]


def tail_rows(loader: Any) -> tuple[int, int, int] | None:
    """``(batches, rows of the first batch, rows of the last batch)`` when the loader says so without
    being iterated (a torch ``DataLoader`` with a ``batch_size``, or a list/tuple of batches); else None."""
    if isinstance(loader, (list, tuple)) and loader and not is_loader_collection(loader):
        try:
            return len(loader), batch_rows(host_batch(loader[0])), batch_rows(host_batch(loader[-1]))
        except BatchError:
            return None
    bs = getattr(loader, "batch_size", None)
    if not type(loader).__module__.startswith(("torch", "torchdata")) or not isinstance(bs, int) or bs < 1:
        return None
    sampler = getattr(loader, "sampler", None)
    try:
        n = len(sampler) if sampler is not None else len(loader.dataset)
    except TypeError:  # an iterable dataset: no length
        return None
    if n == 0:
        return None
    if getattr(loader, "drop_last", False):
        return (n // bs, bs, bs) if n >= bs else None
    last = n % bs or bs
    return -(-n // bs), min(bs, n), last


def num_batches(loader: Any) -> int | None:
    """``len(loader)`` when the loader knows it, else None (iterable datasets)."""
    try:
        return len(loader)
    except TypeError:
        return None
