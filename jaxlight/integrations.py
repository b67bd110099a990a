"""Optional integrations (on lightning-utilities): is one installed, and what to install if not.

Optional integrations (wandb, mlflow, tensorboard, torch, jsonargparse, ...)
are checked with lightning-utilities' ``RequirementCache``, which reads the
installed distribution's version without importing the package, so ``import
jaxlight`` and building a logger stay light. :func:`require` raises one
``ModuleNotFoundError`` naming what is missing or too old and the exact
``pip install "jaxlight[...]"`` to run. Messages printed once per run live
in :mod:`jaxlight.rank_zero`.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_utilities.core.imports import RequirementCache


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


__all__ = ["INTEGRATIONS", "Integration", "available", "require"]
