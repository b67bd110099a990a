"""A byte-level GPT whose feed-forward blocks are ``jaxlight.nn.MoE`` layers (``examples/gpt.py --moe E``).

The same attention, norms and embeddings as ``examples/models.py``; each block's MLP is a mixture of
``experts`` experts with ``top_k`` per token. The blocks are a Python list (not a ``LayerStack``): every MoE
call returns its auxiliary losses, which the model sums over the blocks. Under ``"ep"`` (``"fsdp+ep"``,
``"ep+tp"``) the experts are split over the ``expert`` mesh axis and tokens travel to them by all-to-all.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from examples.models import Attention, GPTConfig, _layernorm, _param
from jaxlight.nn import MoE, constrain


class MoEBlock(nnx.Module):
    """Pre-norm block: attention, then a mixture of experts."""

    def __init__(self, cfg: GPTConfig, experts: int, top_k: int, capacity_factor: float | None, rngs: nnx.Rngs) -> None:
        self.ln1 = _layernorm(cfg.d_model, rngs)
        self.attn = Attention(cfg, rngs)
        self.ln2 = _layernorm(cfg.d_model, rngs)
        hidden = cfg.d_model * cfg.mlp_ratio
        self.moe = MoE(cfg.d_model, hidden, experts, top_k=top_k, capacity_factor=capacity_factor, rngs=rngs)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        x = constrain(x + self.attn(self.ln1(x)), ("batch", "length", "act_embed"))
        y, aux = self.moe(self.ln2(x))
        return constrain(x + y, ("batch", "length", "act_embed")), aux


class MoETransformer(nnx.Module):
    """Byte-level GPT with MoE blocks. ``net(tokens)`` gives logits; ``net(tokens, return_aux=True)`` gives
    ``(logits, aux)`` with each MoE auxiliary value averaged over the blocks."""

    def __init__(
        self,
        cfg: GPTConfig,
        experts: int,
        rngs: nnx.Rngs,
        top_k: int = 2,
        capacity_factor: float | None = None,
    ) -> None:
        self.cfg = cfg
        self.tok = nnx.Embed(
            cfg.vocab,
            cfg.d_model,
            rngs=rngs,
            embedding_init=nnx.with_partitioning(nnx.initializers.normal(0.02), ("vocab", "embed")),
        )
        self.pos = _param(rngs, (cfg.seq_len, cfg.d_model), (None, "embed"), 0.01)
        self.blocks = nnx.List([MoEBlock(cfg, experts, top_k, capacity_factor, rngs) for _ in range(cfg.n_layers)])
        self.ln_f = _layernorm(cfg.d_model, rngs)
        self.head = _param(rngs, (cfg.d_model, cfg.vocab), ("embed", "vocab"), 0.02)

    def __call__(self, tokens: jax.Array, return_aux: bool = False):
        t = tokens.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than the model's seq_len={self.cfg.seq_len}")
        x = constrain(self.tok(tokens) + self.pos[...][:t], ("batch", "length", "act_embed"))
        auxes = []
        for block in self.blocks:
            x, aux = block(x)
            auxes.append(aux)
        logits = constrain(self.ln_f(x) @ self.head[...], ("batch", "length", "act_vocab"))
        if not return_aux:
            return logits
        return logits, {k: jnp.mean(jnp.stack([a[k] for a in auxes])) for k in auxes[0]}
