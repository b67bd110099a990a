"""seed_everything: one seed for Python, NumPy, torch (if loaded) and jaxlight; isolate_rng: global random
states saved and put back around a block (Lightning's sanity check)."""

from __future__ import annotations

import contextlib
import os
import random
import sys
from collections.abc import Iterator

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


@contextlib.contextmanager
def isolate_rng() -> Iterator[None]:
    """Put Python's, NumPy's and torch's global random states back as they were when the block began.

    Lightning's ``isolate_rng`` around its sanity check: what the block draws (a torch ``DataLoader``'s
    ``iter()`` draws its base seed from torch's global generator, a shuffled sampler without a generator
    its permutation seed) leaves the training's draws as they were, so both frameworks shuffle the same.
    torch is saved only when it is already imported (jaxlight never imports it for this), and its CUDA
    generators only when CUDA is initialized (saving them would start a CUDA context next to JAX's).
    """
    py_state = random.getstate()
    np_state = np.random.get_state()
    torch = sys.modules.get("torch")
    torch_state = torch.random.get_rng_state() if torch is not None else None
    cuda = getattr(torch, "cuda", None)
    cuda_states = cuda.get_rng_state_all() if cuda is not None and cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        if torch_state is not None:
            torch.random.set_rng_state(torch_state)
        if cuda_states is not None:
            cuda.set_rng_state_all(cuda_states)
