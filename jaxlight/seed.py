"""seed_everything: one seed for Python, NumPy, torch (if loaded) and jaxlight."""

from __future__ import annotations

import os
import random
import sys

import numpy as np

_MAX = 2**32 - 1


def seed_everything(seed: int | None = None, workers: bool = False) -> int:
    """Seed Python's ``random``, NumPy, and torch when it is imported; return the seed.

    JAX has no global RNG: models take explicit keys (``nnx.Rngs(seed)``).
    The seed is also stored in ``PL_GLOBAL_SEED`` (and ``PL_SEED_WORKERS``
    when ``workers``) so DataLoader workers and subprocesses can derive theirs,
    as Lightning does. ``None`` reads ``PL_GLOBAL_SEED`` or uses 0.
    """
    if seed is None:
        env = os.environ.get("PL_GLOBAL_SEED")
        seed = int(env) if env is not None else 0
    if not isinstance(seed, int) or not (0 <= seed <= _MAX):
        raise ValueError(f"seed must be an int in [0, {_MAX}], got {seed!r}")
    os.environ["PL_GLOBAL_SEED"] = str(seed)
    os.environ["PL_SEED_WORKERS"] = str(int(workers))
    random.seed(seed)
    np.random.seed(seed)
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(seed)
    return seed
