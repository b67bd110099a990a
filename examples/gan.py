"""Train a GAN on synthetic 2-D data with manual optimization: alternating updates in one compiled step.

The data is a ring of 8 Gaussians (radius 2, std 0.05), the classic toy GAN
target. Each training step updates the discriminator on real and generated
points, then the generator against the *updated* discriminator, as in
Lightning's GAN example, but both updates run inside one compiled program:

    python examples/gan.py                                   # ~20 s on 2 CPU cores
    python examples/gan.py --strategy fsdp --devices 8       # 8 simulated CPU devices

The module sets ``self.automatic_optimization = False``; ``training_step``
takes gradients with ``self.manual_backward(loss_fn, optimizer=opt)`` and
applies them with ``opt.step(grads)`` (docs/optimizers.md). At the end the
script prints the losses and sample-quality numbers before and after
training: the mean distance from a generated point to the nearest mode, the
share of points within 4 standard deviations of a mode, and how many of the 8
modes hold at least 2% of the points that way (a collapsed generator covers
few).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.devices import force_host_devices, parse_devices

MODES, RADIUS, STD = 8, 2.0, 0.05


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--strategy", default="auto", help="auto/ddp or fsdp")
    p.add_argument("--devices", default="auto", help="number of devices, or 'auto' (all local devices)")
    p.add_argument("--max-steps", type=int, default=2000, help="train steps (each a D update then a G update)")
    p.add_argument("--batch-size", type=int, default=256, help="global batch of real points per step")
    p.add_argument("--batches-per-epoch", type=int, default=200)
    p.add_argument("--noise-dim", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate of both networks")
    p.add_argument("--log-every-n-steps", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="logs/gan", help="root directory for metrics")
    args = p.parse_args(argv)
    args.devices = parse_devices(p, args.devices)
    return args


def mode_centers():
    import numpy as np

    angles = 2 * np.pi * np.arange(MODES) / MODES
    return (RADIUS * np.stack([np.cos(angles), np.sin(angles)], -1)).astype(np.float32)


class RingLoader:
    """Batches of points from the ring of Gaussians; each epoch draws new points (re-iterable, seeded)."""

    def __init__(self, batch_size: int, batches: int, seed: int = 0) -> None:
        self.batch_size, self.batches, self.seed, self.epoch = batch_size, batches, seed, 0

    def __len__(self) -> int:
        return self.batches

    def __iter__(self):
        import numpy as np

        rng = np.random.default_rng([self.seed, self.epoch])
        self.epoch += 1
        centers = mode_centers()
        for _ in range(self.batches):
            idx = rng.integers(0, MODES, self.batch_size)
            yield (centers[idx] + STD * rng.normal(size=(self.batch_size, 2))).astype(np.float32)


def quality(points, centers) -> tuple[float, float, int]:
    """(mean distance to the nearest mode, fraction of points within 4 std of a mode, modes that hold at
    least 2% of the points within 4 std)."""
    import numpy as np

    d = np.linalg.norm(points[:, None, :] - centers[None], axis=-1)
    near = d.min(-1) <= 4 * STD
    counts = np.bincount(d.argmin(-1)[near], minlength=len(centers))
    return float(d.min(-1).mean()), float(near.mean()), int((counts >= 0.02 * len(points)).sum())


def build(args: argparse.Namespace):
    """The LightningModule class (defined here so jax is imported after the device flag is set)."""
    import jax
    import optax
    from flax import nnx

    import jaxlight as jl

    class Generator(nnx.Module):
        def __init__(self, noise_dim: int, hidden: int, rngs: nnx.Rngs) -> None:
            self.noise_dim = noise_dim
            self.l1 = nnx.Linear(noise_dim, hidden, rngs=rngs)
            self.l2 = nnx.Linear(hidden, hidden, rngs=rngs)
            self.out = nnx.Linear(hidden, 2, rngs=rngs)
            self.rngs = nnx.Rngs(noise=rngs.params())  # its own stream: the step carries its state

        def sample(self, n: int) -> jax.Array:
            z = jax.random.normal(self.rngs.noise(), (n, self.noise_dim))
            return self.out(nnx.relu(self.l2(nnx.relu(self.l1(z)))))

    class Discriminator(nnx.Module):
        def __init__(self, hidden: int, rngs: nnx.Rngs) -> None:
            self.l1 = nnx.Linear(2, hidden, rngs=rngs)
            self.l2 = nnx.Linear(hidden, hidden, rngs=rngs)
            self.out = nnx.Linear(hidden, 1, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.out(nnx.relu(self.l2(nnx.relu(self.l1(x)))))[:, 0]

    def bce(logits: jax.Array, target: float) -> jax.Array:
        return optax.sigmoid_binary_cross_entropy(logits, jax.numpy.full_like(logits, target)).mean()

    class GAN(jl.LightningModule):
        def __init__(self, noise_dim: int = 8, hidden: int = 128, lr: float = 1e-3, seed: int = 0) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.automatic_optimization = False  # training_step applies the updates itself

        def configure_model(self) -> None:
            hp = self.hparams
            self.generator = Generator(hp.noise_dim, hp.hidden, nnx.Rngs(hp.seed))
            self.discriminator = Discriminator(hp.hidden, nnx.Rngs(hp.seed + 1))

        def training_step(self, real: jax.Array, batch_idx: jax.Array) -> jax.Array:
            opt_g, opt_d = self.optimizers()
            n = real.shape[0]

            # 1) discriminator: real points -> 1, generated points -> 0 (the generator is not differentiated)
            def d_loss_fn():
                fake = jax.lax.stop_gradient(self.generator.sample(n))
                return bce(self.discriminator(real), 1.0) + bce(self.discriminator(fake), 0.0)

            d_loss, grads = self.manual_backward(d_loss_fn, optimizer=opt_d)
            opt_d.step(grads)  # from here on self.discriminator holds the updated weights

            # 2) generator: fool the updated discriminator (non-saturating loss)
            g_loss, grads = self.manual_backward(
                lambda: bce(self.discriminator(self.generator.sample(n)), 1.0), optimizer=opt_g
            )
            opt_g.step(grads)

            self.log_dict({"d_loss": d_loss, "g_loss": g_loss}, prog_bar=True)
            return g_loss

        def configure_optimizers(self):
            adam = lambda: optax.adam(self.hparams.lr, b1=0.5)
            return [
                {"optimizer": adam(), "params": self.generator},
                {"optimizer": adam(), "params": self.discriminator},
            ]

    return GAN


def train(args: argparse.Namespace) -> dict:
    """Train and return the run's numbers (losses, sample quality before and after)."""
    import numpy as np
    from flax import nnx

    import jaxlight as jl

    GAN = build(args)
    model = GAN(noise_dim=args.noise_dim, hidden=args.hidden, lr=args.lr, seed=args.seed)
    centers = mode_centers()

    def samples(n: int = 2000) -> np.ndarray:
        return np.asarray(nnx.jit(lambda g: g.sample(n))(model.generator))

    losses: list[tuple[int, object]] = []

    class Record(jl.Callback):  # the generator loss every log_every_n_steps (device arrays: no sync per step)
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if (trainer.global_step - 1) % args.log_every_n_steps == 0:
                losses.append((trainer.global_step, outputs["loss"]))

    trainer = jl.Trainer(
        max_steps=args.max_steps,
        devices=args.devices,
        strategy=args.strategy,
        log_every_n_steps=args.log_every_n_steps,
        callbacks=[Record()],
        logger=jl.loggers.CSVLogger(args.out),
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        seed=args.seed,
    )
    model.configure_model()  # to measure the untrained generator; fit adopts these modules
    before = quality(samples(), centers)
    trainer.fit(model, RingLoader(args.batch_size, args.batches_per_epoch, args.seed))
    after = quality(samples(), centers)
    return {
        "before": before,
        "after": after,
        "d_loss": float(trainer.callback_metrics["d_loss"]),
        "g_loss": float(trainer.callback_metrics["g_loss"]),
        "g_losses": [(s, float(v)) for s, v in losses],
        "steps": trainer.global_step,
        "trainer": trainer,
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    force_host_devices(args.devices)
    out = train(args)
    print(f"steps: {out['steps']}  final d_loss {out['d_loss']:.3f}  g_loss {out['g_loss']:.3f}")
    print(f"{'':8} {'mean distance to nearest mode':>30} {'points on a mode':>17} {'modes covered (of 8)':>21}")
    for name in ("before", "after"):
        dist, near, modes = out[name]
        print(f"{name:8} {dist:30.3f} {near:17.1%} {modes:21d}")
    return out


if __name__ == "__main__":
    main()
