"""Host batches to global device arrays, one step ahead of the compiled step.

A dataloader is anything re-iterable that yields pytrees of numpy arrays,
jax arrays or torch tensors. Each yielded batch is a global batch: its rows
are split over the mesh's batch axes. With ``process_local=True`` each process
yields only its own share of rows and the shares are assembled with
``jax.make_array_from_process_local_data``; otherwise every process reads the
global batch and keeps the rows its devices hold.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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


def host_signature(leaves: list[Any], treedef: Any) -> tuple | None:
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
