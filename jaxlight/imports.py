"""Optional integrations and process-0 messages, on lightning-utilities.

Optional integrations (wandb, mlflow, tensorboard, torch, jsonargparse, ...)
are checked with lightning-utilities' ``RequirementCache``, which reads the
installed distribution's version without importing the package, so ``import
jaxlight`` and building a logger stay light. :func:`require` raises one
``ModuleNotFoundError`` naming what is missing or too old and the exact
``pip install "jaxlight[...]"`` to run.

Messages and warnings that every process would otherwise repeat go through
lightning-utilities' ``rank_zero_only`` with JAX's process index as the rank
(:func:`rank_zero_warn`, :func:`rank_zero_info`). The rank is read from JAX
once its backend is up; before that (a logger built before ``Trainer(...)``
initializes ``jax.distributed``) it comes from the launcher's environment, so
nothing here initializes a JAX backend early.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from lightning_utilities.core.imports import RequirementCache
from lightning_utilities.core.rank_zero import rank_zero_only

from jaxlight import compat


@dataclass(frozen=True)
class Integration:
    """An optional dependency: the distributions that provide it (any one is enough) and the extra to install."""

    requirements: tuple[str, ...]
    extra: str

    def cache(self) -> list[RequirementCache]:
        # No ``module=``: with it RequirementCache accepts an importable but too old package.
        return [RequirementCache(r) for r in self.requirements]


# Minimum versions match pyproject.toml's extras.
INTEGRATIONS: dict[str, Integration] = {
    "wandb": Integration(("wandb>=0.17",), "wandb"),
    "mlflow": Integration(("mlflow>=2.12", "mlflow-skinny>=2.12"), "mlflow"),
    "tensorboard": Integration(("tensorboard>=2.15",), "tensorboard"),
    "torch": Integration(("torch>=2.2",), "torch"),
    "torchdata": Integration(("torchdata>=0.9",), "torch"),
    "jsonargparse": Integration(("jsonargparse>=4.46",), "cli"),
    "matplotlib": Integration(("matplotlib>=3.8",), "plot"),
    "pillow": Integration(("pillow>=9.1",), "plot"),  # image artifacts; a dependency of matplotlib
    "equinox": Integration(("equinox>=0.11",), "equinox"),
    "safetensors": Integration(("safetensors>=0.4",), "torch"),
}

_checked: dict[str, bool] = {}


def available(name: str) -> bool:
    """Whether the optional integration ``name`` (a key of :data:`INTEGRATIONS`) is installed at a usable version.

    Reads package metadata only (nothing is imported); the answer is cached.
    """
    if name not in _checked:
        _checked[name] = any(bool(c) for c in _integration(name).cache())
    return _checked[name]


def require(name: str, feature: str) -> None:
    """Raise ``ModuleNotFoundError`` unless the optional integration ``name`` is usable.

    ``feature`` names what needs it (``"WandbLogger"``). The message says
    whether the package is missing or which version is installed, and the
    ``pip install "jaxlight[<extra>]"`` that fixes it.
    """
    if available(name):
        return
    spec = _integration(name)
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement

    found = []
    for r in spec.requirements:
        dist = Requirement(r).name
        try:
            found.append(f"{dist} {version(dist)} is installed")
        except PackageNotFoundError:
            pass
    why = "; ".join(found) if found else f"{Requirement(spec.requirements[0]).name} is not installed"
    need = " or ".join(spec.requirements)
    hint = f'pip install "jaxlight[{spec.extra}]"'
    if name == "torch":  # the unpinned torch extra pulls a multi-GB CUDA build (see README)
        hint = f"pip install torch==2.13.0 && {hint}"
    raise ModuleNotFoundError(f"{feature} needs {need} ({why}). Install it with: {hint}", name=name)


def _integration(name: str) -> Integration:
    try:
        return INTEGRATIONS[name]
    except KeyError:
        raise ValueError(f"unknown optional integration {name!r}; known: {sorted(INTEGRATIONS)}") from None


# ---------------------------------------------------------------------------- process 0
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
    from lightning_utilities.core.rank_zero import rank_zero_warn as _warn

    sync_rank()
    # frames between warnings.warn and our caller: lightning-utilities' _warn, rank_zero_warn, its
    # rank_zero_only wrapper, and this function
    _warn(message, stacklevel=stacklevel + 4, category=category)


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


__all__ = [
    "INTEGRATIONS",
    "Integration",
    "WarnOnce",
    "available",
    "process_rank",
    "rank_zero_info",
    "rank_zero_warn",
    "require",
    "sync_rank",
]
