"""Messages and warnings given once per run, by process 0 (on lightning-utilities).

Messages and warnings that every process would otherwise repeat go through
lightning-utilities' ``rank_zero_only`` with JAX's process index as the rank
(:func:`rank_zero_warn`, :func:`rank_zero_info`). The rank is read from JAX
once its backend is up; before that (a logger built before ``Trainer(...)``
initializes ``jax.distributed``) it comes from the launcher's environment, so
nothing here initializes a JAX backend early.
"""

from __future__ import annotations

import os
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_warn as _lu_rank_zero_warn

from jaxlight import compat

_RANK_ENV = ("JAX_PROCESS_ID", "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def process_rank() -> int:
    """This process's index: JAX's once its backend is initialized, else the launcher's environment (or 0)."""
    if compat.backends_initialized():
        import jax

        return jax.process_index()
    for var in _RANK_ENV:
        v = os.environ.get(var)
        if v is not None and v.strip().isdigit():
            return int(v)
    return 0


def sync_rank() -> int:
    """Set lightning-utilities' ``rank_zero_only.rank`` to this process's index and return it."""
    rank_zero_only.rank = process_rank()
    return rank_zero_only.rank


def rank_zero_warn(message: str | Warning, category: type[Warning] = UserWarning, stacklevel: int = 1) -> None:
    """``warnings.warn`` on process 0 only (lightning-utilities' ``rank_zero_warn`` with JAX's process index).

    ``stacklevel`` counts as for ``warnings.warn`` from the caller.
    """
    sync_rank()
    # frames between warnings.warn and our caller: lightning-utilities' _warn, rank_zero_warn, its
    # rank_zero_only wrapper, and this function
    _lu_rank_zero_warn(message, stacklevel=stacklevel + 4, category=category)


def _print(*args: Any, **kwargs: Any) -> None:
    print(*args, **kwargs)


_print_rank_zero = rank_zero_only(_print)


def rank_zero_info(message: str) -> None:
    """Print ``message`` on process 0 only (jaxlight's informational messages go to stdout, as ``print``)."""
    sync_rank()
    _print_rank_zero(message, flush=True)


class WarnOnce:
    """Remembers keys already warned about, so a recurring failure is reported once per key (process 0)."""

    def __init__(self) -> None:
        self._seen: set[Any] = set()

    def __call__(self, key: Any, message: str, category: type[Warning] = UserWarning, stacklevel: int = 1) -> bool:
        if key in self._seen:
            return False
        self._seen.add(key)
        rank_zero_warn(message, category=category, stacklevel=stacklevel + 1)
        return True


__all__ = ["WarnOnce", "process_rank", "rank_zero_info", "rank_zero_warn", "sync_rank"]
