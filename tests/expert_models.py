"""A small language model with one jl.nn.MoE layer, shared by the expert-parallel tests and benchmarks/experts.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxlight as jl


class MoELM(nnx.Module):
    """Token embedding, an MoE block with a residual connection, a norm and an output head."""

    def __init__(
        self,
        rngs: nnx.Rngs,
        vocab: int = 64,
        embed: int = 64,
        hidden: int = 128,  # 8 x 64 x 128 = 2**16 elements: expert weights reach the default min_shard
        experts: int = 8,
        top_k: int = 2,
        capacity_factor: float | None = None,
    ) -> None:
        self.embed = nnx.Embed(
            vocab,
            embed,
            rngs=rngs,
            embedding_init=nnx.with_partitioning(nnx.initializers.normal(1.0), ("vocab", "embed")),
        )
        self.moe = jl.nn.MoE(embed, hidden, experts, top_k=top_k, capacity_factor=capacity_factor, rngs=rngs)
        scale_init = nnx.with_partitioning(nnx.initializers.ones_init(), ("norm",))
        self.ln = nnx.LayerNorm(embed, rngs=rngs, scale_init=scale_init, use_bias=False)
        self.head = nnx.Linear(
            embed,
            vocab,
            use_bias=False,
            rngs=rngs,
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "vocab")),
        )

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        x = jl.nn.constrain(self.embed(tokens), ("batch", "length", "act_embed"))
        y, aux = self.moe(x)
        x = jl.nn.constrain(x + y, ("batch", "length", "act_embed"))
        return jl.nn.constrain(self.head(self.ln(x)), ("batch", "length", "act_vocab")), aux


def keep_first_grad() -> optax.GradientTransformation:
    """Pass updates through and keep the first step's gradients in the optimizer state (keyed by path)."""

    def init(params):
        return {"count": jnp.zeros([], jnp.int32), "grad": jax.tree.map(jnp.zeros_like, params)}

    def update(updates, state, params=None):
        first = state["count"] == 0
        grad = jax.tree.map(lambda new, old: jnp.where(first, new, old), updates, state["grad"])
        return updates, {"count": state["count"] + 1, "grad": grad}

    return optax.GradientTransformation(init, update)


class ExpertLM(jl.LightningModule):
    """Next-token loss plus the MoE's load-balance and z losses; SGD with momentum (or Adam)."""

    def __init__(self, lr: float = 0.1, opt: str = "sgd", lb_coef: float = 0.01, z_coef: float = 1e-3, **dims) -> None:
        super().__init__()
        self.save_hyperparameters()

    def configure_model(self) -> None:
        dims = {k: v for k, v in self.hparams.items() if k not in ("lr", "opt", "lb_coef", "z_coef")}
        self.net = MoELM(nnx.Rngs(0), **dims)

    def training_step(self, batch, batch_idx):
        tokens = batch["tokens"]
        logits, aux = self.net(tokens[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        loss = ce + self.hparams.lb_coef * aux["load_balance"] + self.hparams.z_coef * aux["router_z"]
        self.log("train_loss", loss)
        self.log("load_balance", aux["load_balance"])
        self.log("dropped", aux["dropped"])
        return {"loss": loss, "load_balance": aux["load_balance"], "router_z": aux["router_z"]}

    def configure_optimizers(self):
        if self.hparams.opt == "adam":
            return optax.adam(self.hparams.lr)
        return optax.chain(keep_first_grad(), optax.sgd(self.hparams.lr, momentum=0.9))


class Outputs(jl.Callback):
    """Every train step's outputs (device scalars, read at the end)."""

    def __init__(self) -> None:
        self.outputs: list[dict] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.outputs.append({k: outputs[k] for k in ("loss", "load_balance", "router_z")})


def token_batches(n_batches: int, batch: int, seq: int = 9, vocab: int = 64, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"tokens": rng.integers(0, vocab, size=(batch, seq)).astype(np.int32)} for _ in range(n_batches)]
