"""The ``--devices`` option of the example scripts. Imports no JAX: it must run before JAX starts."""

from __future__ import annotations

import argparse
import os
import sys


def parse_devices(parser: argparse.ArgumentParser, value: str) -> int | str:
    """``--devices``: an int, or ``"auto"`` (all local devices); anything else is a parser error."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        parser.error(f"--devices must be an int or 'auto', got {value!r}")
        raise  # parser.error exits; this line only satisfies type checkers


def force_host_devices(devices: object) -> None:
    """Ask XLA for ``devices`` simulated CPU devices. Only possible before JAX
    is imported; on GPU/TPU machines the flag is ignored."""
    if not isinstance(devices, int) or devices <= 1 or "jax" in sys.modules:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
