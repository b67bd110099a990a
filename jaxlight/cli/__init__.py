"""Command lines: the ``jaxlight`` console script and :class:`LightningCLI` for training scripts.

- :mod:`jaxlight.cli.main`: :func:`main`, the ``jaxlight`` console script
  (``plot``, ``launch``, ``verify``; the subcommands are :data:`COMMANDS`), also
  run by ``python -m jaxlight.cli``.
- :mod:`jaxlight.cli.lightning_cli`: :class:`LightningCLI` and
  :class:`SaveConfigCallback` (jsonargparse is imported only when a LightningCLI
  is built, ``pip install "jaxlight[cli]"``).

``jaxlight.cli.main`` names the function (the console script's entry point,
``jaxlight.cli:main``); the module is ``sys.modules["jaxlight.cli.main"]``.
"""

from __future__ import annotations

from typing import Any

from jaxlight.cli import lightning_cli
from jaxlight.cli.lightning_cli import LightningCLI, SaveConfigCallback
from jaxlight.cli.main import COMMANDS, main


def __getattr__(name: str) -> Any:  # PEP 562: `from jaxlight.cli import LightningArgumentParser`
    if name == "LightningArgumentParser":  # built on first use, so jsonargparse is imported only then
        return lightning_cli.LightningArgumentParser
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["COMMANDS", "LightningArgumentParser", "LightningCLI", "SaveConfigCallback", "main"]
