"""Shared pieces of the benchmarks: the reference workload and its batches.

The reference workload (issue 2) is a byte-level causal transformer with
d_model=256, 4 layers, 4 heads, sequence 128, batch 16, AdamW 3e-4, fp32.
The model itself is ``examples.models.CausalTransformer`` (re-exported here),
annotated with logical axis names so every strategy can place it.

Import from a benchmark script run as ``python benchmarks/<name>.py``:
``from common import ...`` (the script's directory is on ``sys.path``), or
``from benchmarks.common import ...`` from the repository root.
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxlight as jl  # noqa: E402
from examples.models import CausalTransformer, GPTConfig, random_windows, stdlib_bytes  # noqa: E402

REFERENCE = GPTConfig(d_model=256, n_layers=4, n_heads=4, seq_len=128, scan_layers=False)
"""The reference transformer shape (blocks unrolled, as the workload was first defined; ``overhead.py --scan``
measures the scanned LayerStack variant)."""
BATCH_SIZE = 16
LEARNING_RATE = 3e-4

__all__ = [
    "BATCH_SIZE",
    "LEARNING_RATE",
    "REFERENCE",
    "CausalTransformer",
    "GPTConfig",
    "LMModule",
    "build_model",
    "lm_loss",
    "make_batches",
    "random_windows",
    "stdlib_bytes",
]


def make_batches(
    n: int,
    batch_size: int = BATCH_SIZE,
    seq_len: int = REFERENCE.seq_len,
    seed: int = 0,
    data: np.ndarray | None = None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``n`` host batches ``(tokens, next_tokens)`` of int32 ``(batch_size, seq_len)`` from the stdlib text."""
    data = stdlib_bytes(2_000_000) if data is None else data
    x, y = random_windows(data, seq_len, n * batch_size, seed)
    return [(x[i * batch_size : (i + 1) * batch_size], y[i * batch_size : (i + 1) * batch_size]) for i in range(n)]


def build_model(cfg: GPTConfig = REFERENCE, seed: int = 0) -> CausalTransformer:
    """The transformer outside a trainer (logical annotations kept as metadata only)."""
    with nnx.use_eager_sharding(False):
        return CausalTransformer(cfg, nnx.Rngs(params=seed, dropout=seed + 1))


def lm_loss(net: CausalTransformer, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean next-byte cross-entropy (fp32 logits)."""
    logits = net(x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


class LMModule(jl.LightningModule):
    """The reference workload as a LightningModule: AdamW, next-byte cross-entropy."""

    def __init__(
        self, cfg: GPTConfig = REFERENCE, lr: float = LEARNING_RATE, seed: int = 0, log_loss: bool = True
    ) -> None:
        super().__init__()
        self.cfg, self.lr, self.seed, self.log_loss = cfg, lr, seed, log_loss

    def configure_model(self) -> None:
        self.net = CausalTransformer(self.cfg, nnx.Rngs(params=self.seed, dropout=self.seed + 1))

    def training_step(self, batch, batch_idx):
        loss = lm_loss(self.net, *batch)
        if self.log_loss:
            self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", lm_loss(self.net, *batch))

    def configure_optimizers(self):
        return optax.adamw(self.lr)


def time_compiled_steps(trainers: dict[str, jl.Trainer], batch: dict, steps: int, rounds: int) -> dict[str, list]:
    """ms/step of each fitted trainer's compiled train step on ``batch`` (placed as the trainer places
    it), one warm step then ``steps`` timed ones per round; rounds alternate between the trainers so
    machine drift hits all alike. Each trainer's ``train_state`` advances."""
    import time

    from jaxlight.data import BatchPlacer

    times: dict[str, list[float]] = {n: [] for n in trainers}
    for _ in range(rounds):
        for name, t in trainers.items():
            step, state = t.compiled["train"], t.train_state
            placed = BatchPlacer(t.mesh, strategy=t.strategy).place(batch)
            state, out, _ = step(state, placed, np.int32(0), np.bool_(False), np.int32(0))
            jax.block_until_ready(out["loss"])
            t0 = time.perf_counter()
            for i in range(steps):
                state, out, _ = step(state, placed, np.int32(i), np.bool_(False), np.int32(0))
            jax.block_until_ready(state)
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
            t.train_state = state
    return times
