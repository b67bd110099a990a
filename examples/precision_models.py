"""Four small models, one per way of writing a model, and their data: what ``"bf16-mixed"`` is checked on.

The demo GPT (``examples/gpt.py``, NNX, user einsums on its parameters, ``nnx.Embed``, ``jl.nn.attention``),
an NNX CNN (``nnx.Conv``, ``nnx.BatchNorm``, ``nnx.Linear``), a Linen model through ``jl.nn.from_linen``
(``nn.Embed``, ``nn.MultiHeadDotProductAttention``, ``nn.LayerNorm``, ``nn.Dense``) and an Equinox MLP through
``jl.nn.from_equinox``. Every task is learnable in a few dozen steps on a CPU. Used by
``benchmarks/precision.py`` and ``tests/test_precision_compute.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx

import jaxlight as jl


def xent(logits: jax.Array, y: jax.Array) -> jax.Array:
    """Mean cross-entropy, in float32 as autocast computes a loss."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


class Classifier(jl.LightningModule):
    """``self.net(x)`` -> logits, cross-entropy, Adam."""

    lr = 3e-3

    def training_step(self, batch, batch_idx):
        x, y = batch
        return xent(self.net(x), y)

    def configure_optimizers(self):
        return optax.adam(self.lr)


# ------------------------------------------------------------------------------------------- NNX CNN
class CNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, head_dtype: Any = None) -> None:
        self.c1 = nnx.Conv(1, 16, (3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(16, rngs=rngs)
        self.c2 = nnx.Conv(16, 32, (3, 3), rngs=rngs)
        self.bn2 = nnx.BatchNorm(32, rngs=rngs)
        self.head = nnx.Linear(32 * 4 * 4, 4, dtype=head_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.relu(self.bn1(self.c1(x)))
        x = nnx.avg_pool(nnx.relu(self.bn2(self.c2(x))), (2, 2), (2, 2))
        return self.head(x.reshape(x.shape[0], -1))


class NNXCNN(Classifier):
    """``head_dtype``: the output layer's own ``dtype`` (None: the precision's)."""

    def __init__(self, head_dtype: Any = None) -> None:
        super().__init__()
        self.head_dtype = head_dtype

    def configure_model(self) -> None:
        self.net = CNN(nnx.Rngs(0), self.head_dtype)


def image_batches(n_batches: int, rows: int = 32, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """8x8 one-channel noise with a brighter quadrant; the label is which quadrant."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n_batches * rows, 8, 8, 1)).astype(np.float32)
    y = rng.integers(0, 4, n_batches * rows)
    for i, q in enumerate(y):
        r, c = divmod(int(q), 2)
        x[i, 4 * r : 4 * r + 4, 4 * c : 4 * c + 4] += 1.0
    y = y.astype(np.int32)
    return [(x[i * rows : (i + 1) * rows], y[i * rows : (i + 1) * rows]) for i in range(n_batches)]


# ------------------------------------------------------------------------------------------- Linen
def sinusoids(length: int, d: int) -> np.ndarray:
    """The fixed float32 position table of "Attention is all you need" (lm1b's ``sinusoidal_init``)."""
    pos, i = np.arange(length)[:, None], np.arange(d // 2)[None, :]
    angle = pos / 10_000 ** (2 * i / d)
    return np.concatenate([np.sin(angle), np.cos(angle)], 1).astype(np.float32)


class LinenEncoder(nn.Module):
    """Token embedding + a fixed float32 sinusoid position table (as flax's lm1b example adds it, which
    promotes the residual stream to float32), one pre-norm attention block and an MLP, mean-pooled."""

    vocab: int = 16
    d: int = 64

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(self.vocab, self.d)(tokens)
        x = x + sinusoids(tokens.shape[1], self.d)
        x = x + nn.MultiHeadDotProductAttention(num_heads=4)(nn.LayerNorm()(x))
        x = x + nn.Dense(self.d)(nn.gelu(nn.Dense(4 * self.d)(nn.LayerNorm()(x))))
        return nn.Dense(4)(nn.LayerNorm()(x).mean(axis=1))


class LinenNet(Classifier):
    def configure_model(self) -> None:
        self.net = jl.nn.from_linen(LinenEncoder(), jnp.zeros((2, 16), jnp.int32))


def token_batches(n_batches: int, rows: int = 32, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """16 tokens of 16; the label is how often token 0 occurs (0, 1, 2, or 3 and more)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 16, (n_batches * rows, 16)).astype(np.int32)
    y = np.minimum((x == 0).sum(1), 3).astype(np.int32)
    return [(x[i * rows : (i + 1) * rows], y[i * rows : (i + 1) * rows]) for i in range(n_batches)]


# ------------------------------------------------------------------------------------------- Equinox
def equinox_mlp(key: jax.Array) -> Any:
    import equinox as eqx

    class MLP(eqx.Module):
        l1: eqx.nn.Linear
        norm: eqx.nn.LayerNorm
        l2: eqx.nn.Linear
        l3: eqx.nn.Linear

        def __init__(self, key: jax.Array) -> None:
            k1, k2, k3 = jax.random.split(key, 3)
            self.l1, self.norm = eqx.nn.Linear(32, 128, key=k1), eqx.nn.LayerNorm(128)
            self.l2, self.l3 = eqx.nn.Linear(128, 128, key=k2), eqx.nn.Linear(128, 4, key=k3)

        def __call__(self, x: jax.Array) -> jax.Array:
            x = jax.nn.gelu(self.norm(self.l1(x)))
            return self.l3(jax.nn.gelu(self.l2(x)))

    return MLP(key)


class EquinoxNet(Classifier):
    def configure_model(self) -> None:
        self.net = jl.nn.from_equinox(equinox_mlp(jax.random.key(0)))


def feature_batches(n_batches: int, rows: int = 32, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """32 normal features; the label is the largest of the first four."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n_batches * rows, 32)).astype(np.float32)
    y = x[:, :4].argmax(1).astype(np.int32)
    return [(x[i * rows : (i + 1) * rows], y[i * rows : (i + 1) * rows]) for i in range(n_batches)]


# ------------------------------------------------------------------------------------------- the demo GPT
def small_gpt() -> jl.LightningModule:
    from examples.gpt import GPT

    return GPT(d_model=64, layers=2, heads=4, seq_len=32, lr=3e-3, warmup_steps=5, max_steps=100)


def text_batches(n_batches: int, rows: int = 16, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Windows of 32 bytes of the standard library's source, with their next bytes."""
    from examples.models import random_windows, stdlib_bytes

    x, y = random_windows(stdlib_bytes(400_000), 32, n_batches * rows, seed)
    return [(x[i * rows : (i + 1) * rows], y[i * rows : (i + 1) * rows]) for i in range(n_batches)]


#: name -> (a new LightningModule, n -> n training batches)
MODELS: dict[str, tuple[Callable[[], jl.LightningModule], Callable[[int], list]]] = {
    "demo GPT (NNX)": (small_gpt, text_batches),
    "NNX CNN": (NNXCNN, image_batches),
    "Linen encoder": (LinenNet, token_batches),
    "Equinox MLP": (EquinoxNet, feature_batches),
}
