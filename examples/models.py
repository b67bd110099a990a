"""A byte-level causal transformer in flax NNX, and real text to train it on.

Shared by ``examples/gpt.py`` and the benchmarks (``benchmarks/common.py``
re-exports it). Every parameter carries logical axis names (the defaults of
``jaxlight.strategies.DEFAULT_RULES``: embed, mlp, heads, kv, vocab, norm) and
the activations are pinned with ``jaxlight.nn.constrain`` (batch, length,
act_embed, act_heads, act_mlp, act_vocab), so one model definition runs under
data parallel, FSDP, tensor or sequence parallel unchanged. Outside a trainer step (or
on one device) ``constrain`` is the identity, so the model is plain NNX.
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlight.nn import LayerStack, attention, constrain

VOCAB = 256  # bytes


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the transformer. ``vocab`` is 256 for byte-level text."""

    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    seq_len: int = 128
    mlp_ratio: int = 4
    vocab: int = VOCAB
    dropout: float = 0.0
    remat: str | None = None  # rematerialisation policy of each block (jl.nn.LayerStack), e.g. "dots_saveable"
    # Blocks as one scanned jl.nn.LayerStack (compile time independent of depth; what "pp" pipelines) or as
    # a Python list (XLA:CPU runs a 4-layer model ~20% faster unrolled)
    scan_layers: bool = True
    # jl.nn.attention's kernel: None chooses ("blockwise", "xla", "cudnn" force one; benchmarks/mfu.py compares them)
    attention: str | None = None


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple, std: float) -> nnx.Param:
    init = nnx.with_partitioning(nnx.initializers.normal(std), names)
    return nnx.Param(init(rngs.params(), shape, jnp.float32))


class Attention(nnx.Module):
    """Multi-head causal self-attention with per-head projections ("embed", "heads", "kv").

    The attention itself is :func:`jaxlight.nn.attention`, so sequence-parallel strategies
    (``"sp"``, ``"fsdp+sp"``) split it over the ``sequence`` axis without model changes.
    """

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs) -> None:
        d, h = cfg.d_model, cfg.n_heads
        if d % h:
            raise ValueError(f"d_model={d} is not divisible by n_heads={h}")
        dh = d // h
        std = 0.02
        self.wq = _param(rngs, (d, h, dh), ("embed", "heads", "kv"), std)
        self.wk = _param(rngs, (d, h, dh), ("embed", "heads", "kv"), std)
        self.wv = _param(rngs, (d, h, dh), ("embed", "heads", "kv"), std)
        # residual projections scaled down with depth (GPT-2)
        self.wo = _param(rngs, (h, dh, d), ("heads", "kv", "embed"), std / (2 * cfg.n_layers) ** 0.5)
        self.implementation = cfg.attention

    def __call__(self, x: jax.Array) -> jax.Array:
        q = jnp.einsum("btd,dhk->bthk", x, self.wq[...])
        k = jnp.einsum("btd,dhk->bthk", x, self.wk[...])
        v = jnp.einsum("btd,dhk->bthk", x, self.wv[...])
        q, k, v = (constrain(a, ("batch", "length", "act_heads", None)) for a in (q, k, v))
        # jl.nn.attention: exact causal attention that a SequenceParallel strategy runs over the sequence axis
        out = attention(q, k, v, causal=True, implementation=self.implementation)
        out = constrain(out, ("batch", "length", "act_heads", None))
        return jnp.einsum("bthk,hkd->btd", out, self.wo[...])


class MLP(nnx.Module):
    """GELU feed-forward block: ("embed", "mlp") then ("mlp", "embed")."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs) -> None:
        d, m = cfg.d_model, cfg.d_model * cfg.mlp_ratio
        self.w1 = _param(rngs, (d, m), ("embed", "mlp"), 0.02)
        self.b1 = nnx.Param(nnx.with_partitioning(nnx.initializers.zeros, ("mlp",))(rngs.params(), (m,)))
        self.w2 = _param(rngs, (m, d), ("mlp", "embed"), 0.02 / (2 * cfg.n_layers) ** 0.5)
        self.b2 = nnx.Param(nnx.with_partitioning(nnx.initializers.zeros, ("norm",))(rngs.params(), (d,)))

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.gelu(x @ self.w1[...] + self.b1[...])
        h = constrain(h, ("batch", "length", "act_mlp"))
        return h @ self.w2[...] + self.b2[...]


def _layernorm(d: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(
        d,
        scale_init=nnx.with_partitioning(nnx.initializers.ones, ("norm",)),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("norm",)),
        rngs=rngs,
    )


class Block(nnx.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs) -> None:
        self.ln1 = _layernorm(cfg.d_model, rngs)
        self.attn = Attention(cfg, rngs)
        self.ln2 = _layernorm(cfg.d_model, rngs)
        self.mlp = MLP(cfg, rngs)
        self.drop = nnx.Dropout(cfg.dropout, rngs=rngs) if cfg.dropout > 0 else None

    def __call__(self, x: jax.Array) -> jax.Array:
        a = self.attn(self.ln1(x))
        if self.drop is not None:
            a = self.drop(a)
        x = constrain(x + a, ("batch", "length", "act_embed"))
        m = self.mlp(self.ln2(x))
        if self.drop is not None:
            m = self.drop(m)
        return constrain(x + m, ("batch", "length", "act_embed"))


class CausalTransformer(nnx.Module):
    """Byte-level GPT: token + learned position embeddings, ``n_layers`` pre-norm
    blocks, a final LayerNorm and an untied output head. ``__call__(tokens)``
    maps int tokens ``(batch, length)`` to logits ``(batch, length, vocab)``."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        self.tok = nnx.Embed(
            cfg.vocab,
            cfg.d_model,
            rngs=rngs,
            embedding_init=nnx.with_partitioning(nnx.initializers.normal(0.02), ("vocab", "embed")),
        )
        self.pos = _param(rngs, (cfg.seq_len, cfg.d_model), (None, "embed"), 0.01)
        # One scanned stack of identical blocks: one compiled block body whatever the depth, and the
        # layers dim a pipeline ("pp") places on its stages.
        if cfg.scan_layers:
            self.blocks = LayerStack(lambda r: Block(cfg, r), cfg.n_layers, rngs=rngs, remat=cfg.remat)
        else:
            self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
        self.ln_f = _layernorm(cfg.d_model, rngs)
        self.head = _param(rngs, (cfg.d_model, cfg.vocab), ("embed", "vocab"), 0.02)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        t = tokens.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than the model's seq_len={self.cfg.seq_len}")
        x = self.tok(tokens) + self.pos[...][:t]
        x = constrain(x, ("batch", "length", "act_embed"))
        if isinstance(self.blocks, LayerStack):
            x = self.blocks(x)
        else:
            for block in self.blocks:
                x = block(x)
        logits = self.ln_f(x) @ self.head[...]
        return constrain(logits, ("batch", "length", "act_vocab"))


def stdlib_bytes(max_bytes: int = 4_000_000) -> np.ndarray:
    """The source of Python's standard library as one uint8 array.

    Reads ``*.py`` under the directory of the ``os`` module (site-packages and
    test suites excluded), in sorted path order, separated by a blank line,
    until ``max_bytes`` are collected. Every Python install has this text, and
    for a given Python version the result is the same on every machine.
    """
    root = pathlib.Path(os.path.dirname(os.__file__))
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
    chunks: list[bytes] = []
    total = 0
    for p in sorted(root.rglob("*.py")):
        if skip.intersection(p.relative_to(root).parts):
            continue
        try:
            data = p.read_bytes()
        except OSError:
            continue
        chunks.append(data + b"\n\n")
        total += len(data) + 2
        if total >= max_bytes:
            break
    if not chunks:
        raise RuntimeError(f"found no Python source under {root}")
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


def random_windows(data: np.ndarray, seq_len: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` windows of ``seq_len + 1`` bytes at random offsets (deterministic in
    ``seed``), returned as (inputs, next-byte targets), both int32 ``(n, seq_len)``."""
    if len(data) <= seq_len + 1:
        raise ValueError(f"text of {len(data)} bytes is too short for windows of {seq_len + 1}")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(data) - seq_len - 1, size=n)
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    win = data[idx].astype(np.int32)
    return win[:, :-1], win[:, 1:]
