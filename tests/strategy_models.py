"""A small transformer annotated with the default logical axis names, shared by the strategy tests,
the multi-process worker (tests/mp_worker.py) and benchmarks/strategies.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxlight as jl


def _dense(din: int, dout: int, names: tuple, rngs: nnx.Rngs, bias: bool = True) -> nnx.Linear:
    init = nnx.initializers.lecun_normal()
    return nnx.Linear(
        din,
        dout,
        use_bias=bias,
        rngs=rngs,
        kernel_init=nnx.with_partitioning(init, names),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), (names[1],)),
    )


class Block(nnx.Module):
    """Pre-norm attention + MLP block; q/k/v column-split on heads, o row-split (Megatron)."""

    def __init__(self, embed: int, heads: int, mlp: int, rngs: nnx.Rngs) -> None:
        self.heads = heads
        scale_init = nnx.with_partitioning(nnx.initializers.ones_init(), ("norm",))
        self.ln1 = nnx.LayerNorm(embed, rngs=rngs, scale_init=scale_init, use_bias=False)
        self.ln2 = nnx.LayerNorm(embed, rngs=rngs, scale_init=scale_init, use_bias=False)
        # No biases on attention: a key bias has a zero gradient in exact arithmetic
        # (softmax ignores it), so Adam would amplify rounding noise into lr-sized steps.
        self.q = _dense(embed, embed, ("embed", "heads"), rngs, bias=False)
        self.k = _dense(embed, embed, ("embed", "heads"), rngs, bias=False)
        self.v = _dense(embed, embed, ("embed", "heads"), rngs, bias=False)
        self.o = _dense(embed, embed, ("heads", "embed"), rngs, bias=False)
        self.up = _dense(embed, mlp, ("embed", "mlp"), rngs)
        self.down = _dense(mlp, embed, ("mlp", "embed"), rngs)

    def __call__(self, x):
        b, t, e = x.shape
        h = self.ln1(x)
        split = lambda y: y.reshape(b, t, self.heads, e // self.heads)
        q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
        q, k, v = (jl.nn.constrain(a, ("batch", "length", "heads", "kv")) for a in (q, k, v))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
        mask = jnp.tril(jnp.ones((t, t), bool))
        att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
        y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, e)
        x = jl.nn.constrain(x + self.o(y), ("batch", "length", "embed"))
        hid = jl.nn.constrain(nnx.gelu(self.up(self.ln2(x))), ("batch", "length", "mlp"))
        return jl.nn.constrain(x + self.down(hid), ("batch", "length", "embed"))


class TinyLM(nnx.Module):
    def __init__(
        self, rngs: nnx.Rngs, vocab: int = 256, embed: int = 256, heads: int = 8, mlp: int = 256, layers: int = 1
    ) -> None:
        self.embed = nnx.Embed(
            vocab,
            embed,
            rngs=rngs,
            embedding_init=nnx.with_partitioning(nnx.initializers.normal(0.02), ("vocab", "embed")),
        )
        self.blocks = nnx.List([Block(embed, heads, mlp, rngs) for _ in range(layers)])
        scale_init = nnx.with_partitioning(nnx.initializers.ones_init(), ("norm",))
        self.ln = nnx.LayerNorm(embed, rngs=rngs, scale_init=scale_init, use_bias=False)
        self.head = _dense(embed, vocab, ("embed", "vocab"), rngs, bias=False)

    def __call__(self, tokens):
        x = jl.nn.constrain(self.embed(tokens), ("batch", "length", "embed"))
        for blk in self.blocks:
            x = blk(x)
        return jl.nn.constrain(self.head(self.ln(x)), ("batch", "length", "vocab"))


def keep_first_grad() -> optax.GradientTransformation:
    """Pass updates through and keep a copy of the first step's gradients in the optimizer state.

    Its leaves are keyed by parameter path, so the trainer places them like the parameters;
    the copy is whatever gradient the compiled step fed the optimizer (after any all-reduce)."""

    def init(params):
        return {"count": jnp.zeros([], jnp.int32), "grad": jax.tree.map(jnp.zeros_like, params)}

    def update(updates, state, params=None):
        first = state["count"] == 0
        grad = jax.tree.map(lambda new, old: jnp.where(first, new, old), updates, state["grad"])
        return updates, {"count": state["count"] + 1, "grad": grad}

    return optax.GradientTransformation(init, update)


class LM(jl.LightningModule):
    """Next-token prediction with a configurable optimizer ("adam", "adam+grad" or "sgd")."""

    def __init__(self, lr: float = 1e-3, opt: str = "adam", eps: float = 1e-5, **dims) -> None:
        super().__init__()
        self.save_hyperparameters()

    def configure_model(self) -> None:
        dims = {k: v for k, v in self.hparams.items() if k not in ("lr", "opt", "eps")}
        self.net = TinyLM(nnx.Rngs(0), **dims)

    def training_step(self, batch, batch_idx):
        tokens = batch["tokens"]
        logits = self.net(tokens[:, :-1])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        # eps 1e-6 rather than 1e-8: Adam's g / (|g| + eps) scales the rounding noise of
        # near-zero gradient entries (a different reduction order on 8 devices) by lr / eps.
        if self.hparams.opt == "sgd":
            return optax.sgd(self.hparams.lr)
        adam = optax.adam(self.hparams.lr, eps=self.hparams.eps)
        return optax.chain(keep_first_grad(), adam) if self.hparams.opt == "adam+grad" else adam


def token_batches(n_batches: int, batch: int, seq: int = 9, vocab: int = 256, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"tokens": rng.integers(0, vocab, size=(batch, seq)).astype(np.int32)} for _ in range(n_batches)]


def flat_params(module: jl.LightningModule) -> dict[str, np.ndarray]:
    """The module's trained parameters as host numpy arrays keyed by path."""
    state = nnx.state(module.net, nnx.Param)
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    return {jax.tree_util.keystr(p): np.asarray(jax.device_get(v)) for p, v in leaves}
