"""Train a byte-level GPT on the source code of Python's standard library.

The text is the ``*.py`` files next to the ``os`` module (every Python
install has them); 90% of the bytes train, the last 10% validate. The model
(``examples/models.py``) annotates every parameter with logical axis names,
so the same script runs data parallel, FSDP or tensor parallel:

    python examples/gpt.py                                  # defaults: a few minutes on 2 CPU cores
    python examples/gpt.py --strategy fsdp --devices 8      # 8 simulated CPU devices
    python examples/gpt.py --strategy fsdp+tp --devices 8 --max-steps 50
    python examples/gpt.py --moe 8 --strategy ep --devices 8 --max-steps 50   # 8 experts per block

On CPU, ``--devices N`` > 1 makes XLA simulate N host devices (it sets
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before JAX starts).
Metrics go to ``<out>/lightning_logs/version_*/metrics.csv``; at the end the
script prints a text sample and writes the training-loss and validation curves
as PNG files beside the CSV (``plots/train_loss.png``, ``plots/val_loss.png``,
...; what ``jaxlight plot`` writes) and prints their paths.

A rerun starts faster: the compiled programs are kept in jaxlight's
persistent compilation cache (``~/.cache/jaxlight/compile``; see
docs/trainer.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.devices import force_host_devices, parse_devices


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--strategy",
        default="auto",
        help="auto, ddp, fsdp, tp, sp (sequence), pp (pipeline), offload, or joined with '+' (fsdp+tp, fsdp+sp)",
    )
    p.add_argument("--devices", default="auto", help="number of devices, or 'auto' (all local devices)")
    p.add_argument("--max-steps", type=int, default=600, help="optimizer steps to train")
    p.add_argument("--batch-size", type=int, default=32, help="global batch (sequences per step)")
    p.add_argument("--seq-len", type=int, default=64, help="bytes per training sequence (context length)")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--moe", type=int, default=0, metavar="E", help="E experts (top-2 jl.nn.MoE) per block; 0: dense")
    p.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate (warmup + cosine decay)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed", "bf16-true"])
    p.add_argument(
        "--batches-per-epoch",
        type=int,
        default=200,
        help="training batches per epoch; validation runs at the end of each epoch",
    )
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--data-bytes", type=int, default=4_000_000, help="bytes of stdlib source to read")
    p.add_argument("--log-every-n-steps", type=int, default=25)
    p.add_argument("--sample-bytes", type=int, default=300, help="length of the text sample printed at the end")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="logs/gpt", help="root directory for metrics and checkpoints")
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
from examples.models import CausalTransformer, GPTConfig, random_windows, stdlib_bytes  # noqa: E402
from examples.moe_models import MoETransformer  # noqa: E402


class WindowLoader:
    """``num_batches`` batches of random byte windows per pass.

    Pass ``e`` draws its windows from ``seed + e``, so a run is reproducible
    and each epoch sees new windows. With ``fixed=True`` every pass yields the
    same batches (validation)."""

    def __init__(
        self, data: np.ndarray, batch_size: int, seq_len: int, num_batches: int, seed: int, fixed: bool = False
    ) -> None:
        self.data, self.batch_size, self.seq_len = data, batch_size, seq_len
        self.num_batches, self.seed, self.fixed = num_batches, seed, fixed
        self.epoch = 0

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self):
        seed = self.seed if self.fixed else self.seed + self.epoch
        self.epoch += 1
        x, y = random_windows(self.data, self.seq_len, self.num_batches * self.batch_size, seed)
        for i in range(self.num_batches):
            s = slice(i * self.batch_size, (i + 1) * self.batch_size)
            yield x[s], y[s]


class StdlibText(jl.LightningDataModule):
    """Python's standard library source as bytes: the first 90% trains, the rest validates."""

    def __init__(
        self,
        batch_size: int = 32,
        seq_len: int = 64,
        batches_per_epoch: int = 200,
        val_batches: int = 8,
        data_bytes: int = 4_000_000,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.batch_size, self.seq_len = batch_size, seq_len
        self.batches_per_epoch, self.val_batches = batches_per_epoch, val_batches
        self.data_bytes, self.seed = data_bytes, seed
        self.train_data: np.ndarray | None = None
        self.val_data: np.ndarray | None = None

    def setup(self, stage: str) -> None:
        if self.train_data is None:
            data = stdlib_bytes(self.data_bytes)
            cut = int(len(data) * 0.9)
            self.train_data, self.val_data = data[:cut], data[cut:]

    def train_dataloader(self) -> WindowLoader:
        return WindowLoader(self.train_data, self.batch_size, self.seq_len, self.batches_per_epoch, self.seed)

    def val_dataloader(self) -> WindowLoader:
        return WindowLoader(
            self.val_data, self.batch_size, self.seq_len, self.val_batches, self.seed + 10_000, fixed=True
        )


class GPT(jl.LightningModule):
    """Next-byte prediction with a causal transformer and AdamW (warmup + cosine)."""

    def __init__(
        self,
        d_model: int = 128,
        layers: int = 4,
        heads: int = 4,
        seq_len: int = 64,
        dropout: float = 0.0,
        lr: float = 2e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 50,
        max_steps: int = 600,
        seed: int = 0,
        moe: int = 0,
        attention: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def configure_model(self) -> None:
        hp = self.hparams
        cfg = GPTConfig(
            d_model=hp.d_model,
            n_layers=hp.layers,
            n_heads=hp.heads,
            seq_len=hp.seq_len,
            dropout=hp.dropout,
            attention=hp.get("attention"),
        )
        rngs = nnx.Rngs(params=hp.seed, dropout=hp.seed + 1)
        self.net = MoETransformer(cfg, hp.moe, rngs) if hp.moe else CausalTransformer(cfg, rngs)

    def _loss(self, batch, aux_losses: bool = False):
        x, y = batch
        logits, aux = self.net(x, return_aux=True) if self.hparams.moe else (self.net(x), None)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()
        if aux is None or not aux_losses:
            return loss
        self.log("load_balance", aux["load_balance"])
        return loss + 0.01 * aux["load_balance"] + 1e-3 * aux["router_z"]  # Switch / ST-MoE coefficients

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch, aux_losses=True)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True)
        # bits per byte: the cross-entropy in base 2
        self.log("val_bpb", loss / jnp.log(2.0))

    def configure_optimizers(self):
        hp = self.hparams
        schedule = optax.warmup_cosine_decay_schedule(
            0.0,
            hp.lr,
            warmup_steps=min(hp.warmup_steps, max(hp.max_steps - 1, 1)),
            decay_steps=max(hp.max_steps, 2),
            end_value=hp.lr * 0.1,
        )
        # weight decay on matrices only (ndim >= 2), not on biases and LayerNorm scales
        mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
        tx = optax.chain(
            optax.clip_by_global_norm(1.0),
            optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=hp.weight_decay, mask=mask),
        )
        return {"optimizer": tx, "lr_scheduler": schedule}


class LossHistory(jl.Callback):
    """Keeps every step's loss as a device array (no sync in the loop); read at the end."""

    def __init__(self) -> None:
        self.losses: list = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"])

    def values(self) -> np.ndarray:
        return np.asarray(jax.device_get(self.losses), dtype=np.float64)


def generate(net: CausalTransformer, prompt: bytes, n: int, temperature: float = 0.8, seed: int = 0) -> bytes:
    """Sample ``n`` bytes after ``prompt`` (the last ``seq_len`` bytes are the context)."""
    t_max = net.cfg.seq_len

    @nnx.jit
    def next_byte(net, window, pos, key):
        logits = net(window)[0, pos] / temperature
        return jax.random.categorical(key, logits)

    out = list(prompt)
    key = jax.random.key(seed)
    for _ in range(n):
        ctx = out[-t_max:]
        window = np.zeros((1, t_max), np.int32)
        window[0, : len(ctx)] = ctx
        key, sub = jax.random.split(key)
        out.append(int(next_byte(net, window, np.int32(len(ctx) - 1), sub)))
    return bytes(out[len(prompt) :])


class TextSample(jl.Callback):
    """Logs a text sample after each validation to every logger (CSV: ``text/sample/step=N.txt``)."""

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or not trainer.loggers:
            return
        text = (b"def " + generate(pl_module.net, b"def ", 120, seed=0)).decode("utf-8", errors="replace")
        jl.loggers.LoggerCollection(trainer.loggers).log_text("sample", text, step=trainer.global_step)


def train(args: argparse.Namespace) -> tuple[jl.Trainer, GPT, np.ndarray]:
    """Fit the GPT as ``args`` say; returns the trainer, the trained module and every step's loss."""
    jl.seed_everything(args.seed)
    dm = StdlibText(args.batch_size, args.seq_len, args.batches_per_epoch, args.val_batches, args.data_bytes, args.seed)
    model = GPT(
        args.d_model,
        args.layers,
        args.heads,
        args.seq_len,
        args.dropout,
        args.lr,
        args.weight_decay,
        args.warmup_steps,
        args.max_steps,
        args.seed,
        moe=args.moe,
    )
    history = LossHistory()
    trainer = jl.Trainer(
        strategy=args.strategy,
        devices=args.devices,
        max_steps=args.max_steps,
        precision=args.precision,
        callbacks=[history, TextSample()],
        logger=jl.loggers.CSVLogger(args.out),
        log_every_n_steps=args.log_every_n_steps,
        default_root_dir=args.out,
    )
    print(
        f"jax {jax.__version__} on {trainer.num_devices} {jax.devices()[0].platform} device(s), "
        f"mesh {dict(trainer.mesh.shape)}, strategy {args.strategy!r}"
    )
    trainer.fit(model, datamodule=dm)
    if "val_loss" not in trainer.callback_metrics:  # max_steps ended before the first epoch's validation
        trainer.validate(model, datamodule=dm, verbose=False)
    return trainer, model, history.values()


def write_plots(csv_path: str) -> list[str]:
    """PNG curves of every metric in ``csv_path`` (train loss, validation loss, ...), as ``jaxlight plot`` draws
    them, in ``plots/`` beside it; returns their paths. Empty when matplotlib is not installed."""
    try:
        from jaxlight.plot import plot_metrics

        return sorted(str(p) for p in plot_metrics(csv_path))
    except ImportError as e:  # matplotlib is the optional "plot" extra
        print(f"plots: not written ({e}; pip install matplotlib)")
        return []


def main(args: argparse.Namespace) -> dict[str, float]:
    t0 = time.perf_counter()
    trainer, model, losses = train(args)
    k = min(10, len(losses))
    val = trainer.callback_metrics.get("val_loss")
    summary = {
        "first_loss": float(losses[0]),
        "last_loss": float(losses[-1]),
        "first_10_mean": float(losses[:k].mean()),
        "last_10_mean": float(losses[-k:].mean()),
        "val_loss": float(val) if val is not None else float("nan"),
        "steps": int(trainer.global_step),
        "seconds": time.perf_counter() - t0,
    }
    print(f"\ntrained {summary['steps']} steps in {summary['seconds']:.0f}s")
    print(
        f"train loss: first {summary['first_loss']:.3f} -> last {summary['last_loss']:.3f} "
        f"(mean of first {k}: {summary['first_10_mean']:.3f}, last {k}: {summary['last_10_mean']:.3f}; "
        f"uniform guess = ln 256 = {np.log(256):.3f})"
    )
    print(f"val loss: {summary['val_loss']:.3f} ({summary['val_loss'] / np.log(2):.2f} bits/byte)")

    prompt = b"def "
    sample = generate(model.net, prompt, args.sample_bytes, seed=args.seed)
    print("\n--- sample ---")
    print((prompt + sample).decode("utf-8", errors="replace"))
    print("--------------")

    csv_path = os.path.join(trainer.log_dir, "metrics.csv")
    print(f"\nmetrics: {csv_path}")
    if trainer.is_global_zero:  # the CSV logger writes on process 0 only
        for path in write_plots(csv_path):
            print(f"plot:    {path}")
    return summary


if __name__ == "__main__":
    main(_ARGS)
