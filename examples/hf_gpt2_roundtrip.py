"""Round trip a Hugging Face GPT-2 through jaxlight: load it into an NNX twin, fine-tune, write it back.

    python examples/hf_gpt2_roundtrip.py                       # a tiny random GPT-2, FSDP on 8 CPU devices
    python examples/hf_gpt2_roundtrip.py --hf-dir ./gpt2 --devices 1 --seq-len 64   # a downloaded checkpoint

Without ``--hf-dir`` it builds a tiny GPT-2 with random weights and ``save_pretrained``s it (nothing is
downloaded); with it, any directory ``GPT2LMHeadModel.save_pretrained`` wrote (or the Hub's ``gpt2``
snapshot). The twin below names its layers as transformers does, so ``load_torch_weights`` maps every
tensor by name; GPT-2's projections are transformers' ``Conv1D`` (weight stored ``(in, out)``), declared
with ``jaxlight.migrate.Conv1D``; the head reuses the token embedding (tied weights). Then:

1. the twin's logits are compared with transformers' on the same tokens;
2. a jaxlight ``Trainer`` fine-tunes it (next-token cross entropy, SGD, FSDP) for a few steps;
3. ``export_torch_weights`` writes ``model.safetensors`` and the original ``config.json`` to
   ``<out>/fine_tuned``, ``GPT2LMHeadModel.from_pretrained`` loads it, and its logits are compared with
   the fine-tuned twin's.

The twin has no dropout: the fine-tuning is deterministic (transformers' ``eval()`` computes the same).
Needs ``transformers`` (and torch) besides jaxlight.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.devices import force_host_devices, parse_devices


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--hf-dir", default=None, help="a GPT-2 save_pretrained directory; default: a tiny random one")
    p.add_argument("--out", default="logs/hf_gpt2", help="where the fine-tuned model is written")
    p.add_argument("--strategy", default="fsdp", help="the Trainer's strategy")
    p.add_argument("--devices", default="8", help="number of devices, or 'auto' (all local devices)")
    p.add_argument("--min-shard", type=int, default=256, help="FSDP shards parameters of at least this size")
    p.add_argument("--steps", type=int, default=3, help="SGD steps of fine-tuning")
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.devices = parse_devices(p, args.devices)
    return args


if __name__ == "__main__":
    _ARGS = parse_args()
    force_host_devices(_ARGS.devices)

# Everything below may import JAX.
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxlight as jl  # noqa: E402
from jaxlight.migrate import Conv1D, export_torch_weights, load_torch_weights  # noqa: E402


class GPT2Attention(nnx.Module):
    """Causal self-attention with fused q/k/v (``c_attn``: (d, 3d)) and scale 1/sqrt(head_dim)."""

    def __init__(self, d: int, n_head: int, *, rngs: nnx.Rngs) -> None:
        self.c_attn = Conv1D(d, 3 * d, rngs=rngs)
        self.c_proj = Conv1D(d, d, rngs=rngs)
        self.n_head = n_head

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        q, k, v = (a.reshape(b, t, self.n_head, d // self.n_head) for a in jnp.split(self.c_attn(x), 3, -1))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // self.n_head)
        causal = jnp.tril(jnp.ones((t, t), bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return self.c_proj(out.reshape(b, t, d))


class GPT2MLP(nnx.Module):
    """``c_fc`` -> gelu_new (the tanh approximation) -> ``c_proj``."""

    def __init__(self, d: int, *, rngs: nnx.Rngs) -> None:
        self.c_fc = Conv1D(d, 4 * d, rngs=rngs)
        self.c_proj = Conv1D(4 * d, d, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.c_proj(jax.nn.gelu(self.c_fc(x), approximate=True))


class GPT2Block(nnx.Module):
    """Pre-norm residual block."""

    def __init__(self, d: int, n_head: int, eps: float, *, rngs: nnx.Rngs) -> None:
        self.ln_1 = nnx.LayerNorm(d, epsilon=eps, rngs=rngs)  # flax's default epsilon is 1e-6
        self.attn = GPT2Attention(d, n_head, rngs=rngs)
        self.ln_2 = nnx.LayerNorm(d, epsilon=eps, rngs=rngs)
        self.mlp = GPT2MLP(d, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nnx.Module):
    """Token and learned position embeddings, the blocks, the final LayerNorm."""

    def __init__(
        self, vocab_size: int, n_positions: int, n_embd: int, n_layer: int, n_head: int, eps: float, rngs: nnx.Rngs
    ) -> None:
        self.wte = nnx.Embed(vocab_size, n_embd, rngs=rngs)
        self.wpe = nnx.Embed(n_positions, n_embd, rngs=rngs)
        self.h = nnx.List([GPT2Block(n_embd, n_head, eps, rngs=rngs) for _ in range(n_layer)])
        self.ln_f = nnx.LayerNorm(n_embd, epsilon=eps, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = self.wte(ids) + self.wpe(jnp.arange(ids.shape[-1]))
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT2LMHeadModel(nnx.Module):
    """transformers' ``GPT2LMHeadModel`` (no dropout: fine-tuning here is deterministic), logits (B, T, V)."""

    def __init__(
        self,
        vocab_size: int,
        n_positions: int,
        n_embd: int,
        n_layer: int,
        n_head: int,
        layer_norm_epsilon: float = 1e-5,
        *,
        rngs: nnx.Rngs,
    ) -> None:
        self.transformer = GPT2Model(vocab_size, n_positions, n_embd, n_layer, n_head, layer_norm_epsilon, rngs)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], rngs: nnx.Rngs | None = None) -> GPT2LMHeadModel:
        """The twin of a ``config.json`` (as a dict); its weights are random until loaded."""
        keys = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "layer_norm_epsilon")
        assert config.get("activation_function", "gelu_new") == "gelu_new", config["activation_function"]
        return cls(**{k: config[k] for k in keys}, rngs=rngs or nnx.Rngs(0))

    def __call__(self, ids: jax.Array) -> jax.Array:
        h = self.transformer(ids)
        return h @ self.transformer.wte.embedding[...].T  # tied: the head is the token embedding


def tiny_hf_gpt2(directory: str, seed: int = 0, **overrides: Any) -> Any:
    """A tiny transformers GPT-2 with random weights (every tensor, LayerNorms included, perturbed so
    none is trivially 1 or 0), saved with ``save_pretrained(directory)``; returns the torch model (eval)."""
    import torch
    from transformers import GPT2Config
    from transformers import GPT2LMHeadModel as HFGPT2

    kw = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=101, n_positions=64, bos_token_id=0, eos_token_id=0)
    kw.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(seed)
    model = HFGPT2(GPT2Config(**{**kw, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".weight") and p.ndim == 1:  # LayerNorm scales around 1
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model


def hf_logits(model: Any, ids: np.ndarray) -> np.ndarray:
    """transformers' logits for token ids (B, T) as numpy."""
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(np.asarray(ids, np.int64))).logits.numpy()


def hf_key(key: str) -> str | None:
    """A checkpoint's key as the twin names it, for ``load_torch_weights(mapping=hf_key)``.

    Older checkpoints (the Hub's ``gpt2``) hold ``GPT2Model`` keys without the ``transformer.`` prefix and
    the causal-mask buffers ``attn.bias`` / ``attn.masked_bias``: buffers, not weights, which the twin
    computes instead (``jnp.tril``), so they are dropped. ``lm_head.weight``, present when the source is the
    torch module itself, is the tied token embedding."""
    if key.endswith((".attn.bias", ".attn.masked_bias")) or key == "lm_head.weight":
        return None
    return key if key.startswith("transformer.") else f"transformer.{key}"


class FineTune(jl.LightningModule):
    """Next-token cross entropy on the twin, loaded from ``directory`` in ``on_fit_start``, as Lightning
    users load pretrained weights: the parameters are the trainer's, already on their FSDP shards."""

    def __init__(self, directory: str, lr: float = 0.5) -> None:
        super().__init__()
        self.directory, self.lr = directory, lr

    def configure_model(self) -> None:
        with open(os.path.join(self.directory, "config.json")) as f:
            self.net = GPT2LMHeadModel.from_config(json.load(f))

    def on_fit_start(self) -> None:
        if self.trainer.ckpt_path is None:  # a resumed run has its checkpoint's weights already
            load_torch_weights(
                self, self.directory, mapping=lambda k: None if hf_key(k) is None else f"net.{hf_key(k)}"
            )

    def training_step(self, batch, batch_idx):
        logits = self.net(batch[:, :-1])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return optax.sgd(self.lr)


def token_batches(vocab: int, batch_size: int, seq_len: int, steps: int, seed: int) -> list[np.ndarray]:
    """Sequences counting up modulo the vocabulary from random starts: a pattern the model can learn."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, vocab, (steps, batch_size, 1))
    return [((s + np.arange(seq_len + 1)) % vocab).astype(np.int32) for s in starts]


class Losses(jl.Callback):
    """Every step's training loss."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(float(outputs["loss"]))


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Load, compare, fine-tune, export, reload; returns the differences and losses it prints."""
    from transformers import GPT2LMHeadModel as HFGPT2

    t0 = time.perf_counter()
    directory = args.hf_dir
    if directory is None:
        directory = os.path.join(args.out, "original")
        tiny_hf_gpt2(directory, seed=args.seed)
    hf = HFGPT2.from_pretrained(directory).eval()
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    ids = np.random.default_rng(args.seed).integers(0, config["vocab_size"], (2, args.seq_len))

    twin = GPT2LMHeadModel.from_config(config)
    load_torch_weights(twin, directory, mapping=hf_key)
    load_diff = float(np.abs(np.asarray(twin(ids)) - hf_logits(hf, ids)).max())
    print(f"loaded: max |twin - transformers| logits {load_diff:.2e}")

    strategy = jl.strategies.FSDP(min_shard=args.min_shard) if args.strategy == "fsdp" else args.strategy
    losses = Losses()
    trainer = jl.Trainer(
        strategy=strategy,
        devices=args.devices,
        max_steps=args.steps,
        callbacks=[losses],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = FineTune(directory, args.lr)
    trainer.fit(module, token_batches(config["vocab_size"], args.batch_size, args.seq_len, args.steps, args.seed))
    print(f"fine-tuned {args.steps} steps ({args.strategy}, {trainer.num_devices} devices): losses {losses.values}")

    out = os.path.join(args.out, "fine_tuned")
    export_torch_weights(module, out, mapping={"net": ""}, config=directory)  # net.transformer.* -> transformer.*
    tuned = HFGPT2.from_pretrained(out).eval()
    export_diff = float(np.abs(hf_logits(tuned, ids) - np.asarray(module.net(ids))).max())
    print(f"exported to {out}: max |transformers - twin| logits {export_diff:.2e}")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return {"load_diff": load_diff, "export_diff": export_diff, "losses": losses.values, "out": out}


if __name__ == "__main__":
    main(_ARGS)
