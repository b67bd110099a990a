"""A gallery program written the way flax's NNX Gemma example writes its layers for JAX's
explicit-sharding mode (written here, not copied): an ``Einsum`` layer whose kernel carries its
PartitionSpec and whose call takes ``out_sharding=``, a sharding config of activation and weight
specs naming the trainer's mesh axes (docs/strategies.md, "Explicit sharding"), a gated MLP block
with a ``jax.sharding.reshard`` back to the residual layout, an embedder and an RMSNorm.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import P

import jaxlight as jl

VOCAB, EMBED, HIDDEN, SEQ = 32, 16, 32, 8


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """The example's per-tensor specs, in the trainer's mesh axis names."""

    emb_vd: P = P("tensor", "fsdp")
    ffw_weight_df: P = P("fsdp", "tensor")
    ffw_weight_fd: P = P("tensor", "fsdp")
    rows: str | tuple[str, ...] | None = None  # the batch axes the rows are split over, read from the input

    @property
    def act_btd(self) -> P:
        return P(self.rows, None, None)

    @property
    def act_btf(self) -> P:
        return P(self.rows, None, "tensor")

    @property
    def act_btv(self) -> P:
        return P(self.rows, None, None)


class Einsum(nnx.Module):
    def __init__(self, einsum_str: str, shape: tuple[int, ...], *, shd: P, rngs: nnx.Rngs):
        self.einsum_str = einsum_str
        self.w = nnx.Param(nnx.with_partitioning(nnx.initializers.normal(0.2), shd)(rngs.params(), shape))

    def __call__(self, x, *, out_sharding=None):
        return jnp.einsum(self.einsum_str, x, self.w[...], out_sharding=out_sharding)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.scale = nnx.Param(jnp.zeros((dim,)))

    def __call__(self, x):
        var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(var + 1e-6) * (1 + self.scale[...])


class FeedForward(nnx.Module):
    def __init__(self, shd: ShardingConfig, *, rngs: nnx.Rngs):
        self.gate = Einsum("btd,df->btf", (EMBED, HIDDEN), shd=shd.ffw_weight_df, rngs=rngs)
        self.up = Einsum("btd,df->btf", (EMBED, HIDDEN), shd=shd.ffw_weight_df, rngs=rngs)
        self.down = Einsum("btf,fd->btd", (HIDDEN, EMBED), shd=shd.ffw_weight_fd, rngs=rngs)

    def __call__(self, x, shd: ShardingConfig):
        h = jax.nn.gelu(self.gate(x, out_sharding=shd.act_btf)) * self.up(x, out_sharding=shd.act_btf)
        return self.down(h, out_sharding=shd.act_btd)


class Transformer(nnx.Module):
    def __init__(self, shd: ShardingConfig = ShardingConfig(), *, rngs: nnx.Rngs):
        self.shd = shd
        self.embedding = nnx.Param(
            nnx.with_partitioning(nnx.initializers.normal(1.0), shd.emb_vd)(rngs.params(), (VOCAB, EMBED))
        )
        self.norm = RMSNorm(EMBED, rngs=rngs)
        self.mlp = FeedForward(shd, rngs=rngs)
        self.final_norm = RMSNorm(EMBED, rngs=rngs)

    def __call__(self, tokens):
        # the rows' mesh axes are part of the input's type (what the trainer's batch axes split)
        shd = dataclasses.replace(self.shd, rows=jax.typeof(tokens).sharding.spec[0])
        x = self.embedding[...].at[tokens].get(out_sharding=shd.act_btd)
        x = x + self.mlp(self.norm(x), shd)
        x = jax.sharding.reshard(self.final_norm(x), shd.act_btd)
        return jnp.einsum("btd,vd->btv", x, self.embedding[...], out_sharding=shd.act_btv)


class ExplicitLM(jl.LightningModule):
    """Next-token loss of :class:`Transformer`, SGD."""

    def __init__(self, shd: ShardingConfig = ShardingConfig()):
        super().__init__()
        self.shd = shd

    def configure_model(self):
        self.net = Transformer(self.shd, rngs=nnx.Rngs(0))

    def training_step(self, batch, batch_idx):
        tokens = batch["tokens"]
        logits = self.net(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def configure_optimizers(self):
        return optax.sgd(0.5)


def token_batches(n: int = 3, rows: int = 16, length: int = SEQ + 1) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"tokens": rng.integers(0, VOCAB, size=(rows, length)).astype(np.int32)} for _ in range(n)]
