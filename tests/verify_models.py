"""Modules for tests/test_verify.py, tests/test_auto_strategy.py and ``jaxlight verify`` examples.

``CenteredLM``: token embedding, a batch-centering layer written with ``jax.shard_map`` over the batch
axes, a ``jaxlight.nn.LayerStack`` of residual MLP blocks (so ``"pp"`` applies), norm and head, all
annotated with the default logical names. With ``psum=True`` the centering layer all-reduces its
column sums over the devices holding batch rows (right under every strategy); ``ForgetfulLM`` is the
same model with ``psum=False``: it centers each device's rows by their own mean, which is right on
one device and wrong on any mesh that splits rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxlight as jl
from jaxlight.strategies import BATCH_AXES

DIMS = dict(vocab=128, embed=128, mlp=128, layers=8)
"""Every stacked kernel is 8 x 128 x 128 = 2**17 elements (at or above FSDP's default min_shard), 8 layers
divide 8 pipeline stages; embedding and head (2**14 elements each) stay replicated."""


def _dense(din: int, dout: int, names: tuple, rngs: nnx.Rngs, bias: bool = True) -> nnx.Linear:
    return nnx.Linear(
        din,
        dout,
        use_bias=bias,
        rngs=rngs,
        kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), names),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), (names[1],)),
    )


class MLPBlock(nnx.Module):
    def __init__(self, embed: int, mlp: int, rngs: nnx.Rngs) -> None:
        scale_init = nnx.with_partitioning(nnx.initializers.ones_init(), ("norm",))
        self.ln = nnx.LayerNorm(embed, rngs=rngs, scale_init=scale_init, use_bias=False)
        self.up = _dense(embed, mlp, ("embed", "mlp"), rngs)
        self.down = _dense(mlp, embed, ("mlp", "embed"), rngs)

    def __call__(self, x):
        h = jl.nn.constrain(nnx.gelu(self.up(self.ln(x))), ("batch", "length", "mlp"))
        return jl.nn.constrain(x + self.down(h), ("batch", "length", "embed"))


class BatchCenter(nnx.Module):
    """``x - mean(x over the batch rows)``, computed per device inside ``shard_map``.

    Each device sums its own rows; the global sum needs ``psum`` over the mesh axes that split rows.
    ``psum=False`` is the classic bug: right on one device (the local rows are all the rows), wrong on
    several.
    """

    def __init__(self, psum: bool = True) -> None:
        self.psum = psum

    def __call__(self, x):
        rows = x.shape[0]
        psum = self.psum

        def local(xs):
            total = jnp.sum(xs, axis=0, keepdims=True)
            if psum:
                total = jax.lax.psum(total, BATCH_AXES)
            return xs - total / rows

        return jax.shard_map(local, in_specs=P(BATCH_AXES), out_specs=P(BATCH_AXES))(x)


class CenteredNet(nnx.Module):
    def __init__(
        self,
        rngs: nnx.Rngs,
        vocab: int = 128,
        embed: int = 128,
        mlp: int = 128,
        layers: int = 8,
        psum: bool = True,
        stack: bool = True,
    ) -> None:
        self.embed = nnx.Embed(
            vocab,
            embed,
            rngs=rngs,
            embedding_init=nnx.with_partitioning(nnx.initializers.normal(0.5), ("vocab", "embed")),
        )
        self.center = BatchCenter(psum)
        # stack=False: one plain block, a model "pp" cannot pipeline (it has no LayerStack)
        make = lambda r: MLPBlock(embed, mlp, r)
        self.blocks = jl.nn.LayerStack(make, layers, rngs=rngs) if stack else make(rngs)
        scale_init = nnx.with_partitioning(nnx.initializers.ones_init(), ("norm",))
        self.ln = nnx.LayerNorm(embed, rngs=rngs, scale_init=scale_init, use_bias=False)
        self.head = _dense(embed, vocab, ("embed", "vocab"), rngs, bias=False)

    def __call__(self, tokens):
        x = jl.nn.constrain(self.embed(tokens), ("batch", "length", "embed"))
        x = self.center(x)
        x = self.blocks(x)
        return jl.nn.constrain(self.head(self.ln(x)), ("batch", "length", "vocab"))


class CenteredLM(jl.LightningModule):
    """Predicts ``y`` from ``x`` (token ids ``[batch, length]``); Adam with the default eps 1e-8 (the
    optimizer verify replaces with SGD)."""

    psum = True

    def __init__(self, **dims) -> None:
        super().__init__()
        self.dims = {**DIMS, **dims}

    def configure_model(self) -> None:
        self.net = CenteredNet(nnx.Rngs(0), psum=self.psum, **self.dims)

    def training_step(self, batch, batch_idx):
        logits = self.net(batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return optax.adam(1e-3)


class ForgetfulLM(CenteredLM):
    """CenteredLM whose centering layer forgets its psum."""

    psum = False


def batches(n: int = 3, rows: int = 16, length: int = 8, vocab: int = 128, seed: int = 0) -> list[dict]:
    """``n`` batches of ``{"x": ids, "y": next ids}``, int32 ``[rows, length]``."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = rng.integers(0, vocab, size=(rows, length + 1)).astype(np.int32)
        out.append({"x": t[:, :-1], "y": t[:, 1:]})
    return out


class TokenData(jl.LightningDataModule):
    """The same batches as :func:`batches`, as a datamodule (for ``jaxlight verify --datamodule``)."""

    def __init__(self, n: int = 3, rows: int = 16, length: int = 8) -> None:
        super().__init__()
        self.n, self.rows, self.length = n, rows, length

    def train_dataloader(self):
        return batches(self.n, self.rows, self.length)
