"""grain pipelines as loaders, and the per-epoch call Lightning makes on samplers.

The trainer wraps every ``grain.MapDataset``, ``grain.IterDataset`` and
``grain.DataLoader`` it is given (directly, from a datamodule or from a
``*_dataloader()`` method) in a :class:`GrainLoader`, which gives grain's own
checkpointing (``get_state`` / ``set_state`` of its iterators) the
``state_dict`` / ``load_state_dict`` protocol the loop saves and restores: a
mid-epoch resume continues from the saved iterator position and reads no
record twice.

Epochs (``set_epoch`` is called by the fit loop before every train epoch):

- ``MapDataset`` with a finite length ``L``: epoch ``e`` delivers elements
  ``e*L ... (e+1)*L - 1`` of ``ds.repeat()``, which is exactly the ``e``-th pass
  a hand-written ``for x in ds.repeat(num_epochs)`` makes. grain gives every
  such pass its own permutation (``shuffle(seed)`` uses ``seed + epoch``), so
  the data is reshuffled every epoch, as grain users expect. ``len`` is ``L``.
  An infinite one (``ds.repeat()``) is one endless epoch: train by ``max_steps``.
- ``IterDataset`` and ``DataLoader``: every epoch is a fresh pass over
  ``iter(source)`` (what ``for epoch in ...: for x in source`` does), in the
  same order unless the pipeline varies it itself (a ``DataLoader``'s
  ``IndexSampler(num_epochs=N, shuffle=True, seed=s)`` reshuffles each of its
  ``N`` passes inside one iteration). To reshuffle per trainer epoch, pass a
  factory ``GrainLoader(lambda epoch: build(seed=s + epoch))``. Their length
  is unknown unless given (``GrainLoader(source, length=n)``).

Multi-process runs: with ``Trainer(process_local_batches=True)`` every
process must read its own share of each global batch; :func:`shard_options`
turns the trainer's data partition into grain's ``ShardOptions`` for
``grain.DataLoader(shard_options=...)``, ``IndexSampler(shard_options=...)`` or
``ds[o.shard_index::o.shard_count]`` before batching. Processes that hold the
same rows (a tensor axis across processes) get the same shard, which
``grain.sharding.ShardByJaxProcess`` would not give them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["GrainLoader", "adapt_loaders", "is_grain", "set_loader_epoch", "shard_options"]


def is_grain(obj: Any) -> bool:
    """Whether ``obj`` is a grain ``MapDataset``, ``IterDataset`` or ``DataLoader`` (grain is imported only
    when the object comes from it)."""
    if not type(obj).__module__.startswith("grain"):
        return False
    import grain

    return isinstance(obj, (grain.MapDataset, grain.IterDataset, grain.DataLoader))


class GrainLoader:
    """A grain pipeline read as a resumable, epoch-aware loader (see the module docstring for the rules).

    ``source``: a ``grain.MapDataset``, ``grain.IterDataset``, ``grain.DataLoader``, or a callable
    ``epoch -> one of those`` (built afresh for every epoch, read as it is). ``length``: batches per
    epoch when grain cannot tell (an ``IterDataset``, a ``DataLoader``). ``read_options``: how a
    ``MapDataset`` is read (``grain.ReadOptions``; default grain's own: 16 threads, 500 elements ahead;
    ``ReadOptions(num_threads=0)`` reads in the loop's thread, one element at a time).

    ``state_dict()`` is ``{"epoch": e, "iterator": <grain iterator state>}`` after the last element
    delivered; ``load_state_dict`` makes the next ``iter()`` continue from it.
    """

    def __init__(
        self,
        source: Any,
        *,
        length: int | None = None,
        read_options: Any = None,
    ) -> None:
        if not (is_grain(source) or callable(source)):
            raise TypeError(
                f"GrainLoader takes a grain MapDataset, IterDataset or DataLoader, or a callable epoch -> one of "
                f"those; got {type(source).__name__}"
            )
        if length is not None and (not isinstance(length, int) or length < 0):
            raise ValueError(f"length must be a non-negative int (batches per epoch), got {length!r}")
        self.source = source
        self.length = length
        self.read_options = read_options
        self.epoch = 0
        self._iterator: Any = None
        self._pending: Mapping[str, Any] | None = None

    # -- epochs -----------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """The epoch the next ``iter()`` reads (the fit loop calls this before every train epoch)."""
        self.epoch = int(epoch)

    def _source_for(self, epoch: int) -> Any:
        src = self.source if is_grain(self.source) else self.source(epoch)
        if not is_grain(src):
            raise TypeError(f"the GrainLoader factory returned {type(src).__name__} for epoch {epoch}, not grain's")
        return src

    def _epoch_length(self, src: Any) -> int | None:
        import grain

        if isinstance(src, grain.MapDataset):
            n = len(src)
            return None if n >= sys.maxsize else n
        return None

    def _dataset_for(self, epoch: int) -> Any:
        """What ``iter()`` is called on for ``epoch``."""
        import grain

        src = self._source_for(epoch)
        if isinstance(src, grain.MapDataset):
            n = self._epoch_length(src)
            if n is not None and n > 0 and is_grain(self.source):
                # the epoch-th pass of ds.repeat(): grain reseeds its shuffles per pass
                src = src.repeat()[epoch * n : (epoch + 1) * n]
            return src.to_iter_dataset(self.read_options)
        return src

    def __len__(self) -> int:
        if self.length is not None:
            return self.length
        n = self._epoch_length(self._source_for(self.epoch))
        if n is None:
            raise TypeError(f"{type(self.source).__name__} has no length; pass GrainLoader(source, length=batches)")
        return n

    # -- iteration and state ------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        pending, self._pending = self._pending, None
        epoch = int(pending["epoch"]) if pending is not None else self.epoch
        self.epoch = epoch
        it = iter(self._dataset_for(epoch))
        if pending is not None and pending.get("iterator") is not None:
            it.set_state(pending["iterator"])
        self._iterator = it
        return it  # a given length is enforced by the loop, which reads len(loader) batches

    def state_dict(self) -> dict[str, Any]:
        """The position after the last element delivered: this epoch and grain's iterator state."""
        it = self._iterator
        return {"epoch": self.epoch, "iterator": None if it is None else it.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (a :meth:`state_dict`) at the next ``iter()``."""
        if not isinstance(state, Mapping) or "epoch" not in state:
            raise ValueError(f"not a GrainLoader state (expected {{'epoch': ..., 'iterator': ...}}): {state!r}")
        self._pending = dict(state)

    def __repr__(self) -> str:
        return f"GrainLoader({self.source!r}, epoch={self.epoch})"


def adapt_loaders(obj: Any) -> Any:
    """``obj`` with every grain pipeline in it wrapped in a :class:`GrainLoader` (a single loader, or a list,
    tuple or dict of loaders); anything else is returned as it is."""
    if is_grain(obj):
        return GrainLoader(obj)
    if isinstance(obj, Mapping) and any(is_grain(v) for v in obj.values()):
        return {k: adapt_loaders(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and any(is_grain(v) for v in obj):
        return type(obj)(adapt_loaders(v) for v in obj)
    return obj


def set_loader_epoch(loader: Any, epoch: int) -> None:
    """Tell a loader which epoch starts (Lightning's rule for samplers): ``set_epoch(epoch)`` on the loader
    itself when it has one (a :class:`GrainLoader`), else on its ``sampler`` and ``batch_sampler`` (and the
    batch sampler's sampler), so a ``DistributedSampler`` reshuffles every epoch."""
    if callable(getattr(loader, "set_epoch", None)):
        loader.set_epoch(epoch)
        return
    seen: list[Any] = []
    for name in ("sampler", "batch_sampler"):
        sampler = getattr(loader, name, None)
        for s in (sampler, getattr(sampler, "sampler", None)):
            if s is not None and callable(getattr(s, "set_epoch", None)) and not any(s is t for t in seen):
                s.set_epoch(epoch)
                seen.append(s)


def shard_options(trainer_or_mesh: Any = None, *, process_local: bool | None = None) -> Any:
    """grain ``ShardOptions`` for this process's share of each global batch on the trainer's mesh.

    ``trainer_or_mesh``: a ``Trainer`` (its mesh and ``process_local_batches``), or a mesh. With
    process-local batches the options name this process's :func:`jaxlight.data.data_partition` share
    (``shard_index`` of ``shard_count``, ``drop_remainder=True`` so every shard has as many records);
    otherwise every process reads the whole global batch and the result is ``grain.sharding.NoSharding()``.
    """
    import grain

    from jaxlight.data import data_partition

    mesh = getattr(trainer_or_mesh, "mesh", trainer_or_mesh)
    if process_local is None:
        process_local = bool(getattr(trainer_or_mesh, "process_local_batches", True))
    if mesh is None:
        raise ValueError("shard_options needs the trainer (self.trainer in a *_dataloader method) or its mesh")
    part = data_partition(mesh)
    if not process_local or part.count == 1:
        return grain.sharding.NoSharding()
    return grain.sharding.ShardOptions(shard_index=part.index, shard_count=part.count, drop_remainder=True)
