"""What a loader says about itself without being read: one loader or several, its length, its last batch's rows."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxlight.data import batch_rows, host_batch
from jaxlight.errors import BatchError


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
