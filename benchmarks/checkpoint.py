"""Checkpoint cost: how long the training loop is blocked by an async save vs a synchronous one, and restore.

A ~200M-parameter-byte MLP (3 x 4096^2 fp32 layers, ~200 MB of parameters, ~600 MB of train state with
Adam) is trained for a few steps with ``ModelCheckpoint(every_n_train_steps=...)``; the time spent inside
the checkpoint callback's hook on saving steps is the time the loop is blocked. The same run is repeated
with ``async_save=False``. Then the checkpoint is restored into a fresh trainer. Target: the async save
blocks the loop for at most 10% of the synchronous save.

Run: python benchmarks/checkpoint.py [--width 4096] [--layers 3] [--saves 3] [--every 20]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
os.environ.setdefault("TQDM_DISABLE", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxlight as jl  # noqa: E402
from jaxlight.checkpoint import restore_into_trainer, save_in_flight  # noqa: E402


class Stack(nnx.Module):
    def __init__(self, width: int, layers: int, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(layers)])

    def __call__(self, x):
        for layer in self.layers:
            x = nnx.relu(layer(x))
        return x


class Big(jl.LightningModule):
    def __init__(self, width: int = 4096, layers: int = 3) -> None:
        super().__init__()
        self.save_hyperparameters()

    def configure_model(self) -> None:
        self.net = Stack(self.hparams.width, self.hparams.layers, nnx.Rngs(0))

    def training_step(self, batch, batch_idx):
        return ((self.net(batch) - batch) ** 2).mean()

    def configure_optimizers(self):
        return optax.adam(1e-4)


class TimedCheckpoint(jl.callbacks.ModelCheckpoint):
    """Records the wall time of the hook on steps where it saved: the time the loop could not go on."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.blocked: list[float] = []
        self.waited: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        before = self._last_global_step_saved
        jax.block_until_ready(trainer.train_state)  # the step's own compute is not the save's cost
        # a save still writing makes the next one wait for its commit: counted, and reported apart
        waiting = self._checkpointer is not None and save_in_flight(self._checkpointer)
        t = time.perf_counter()
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._last_global_step_saved != before:
            self.blocked.append(time.perf_counter() - t)
            self.waited.append(waiting)


def run(width: int, layers: int, saves: int, every: int, async_save: bool, root: str):
    d = os.path.join(root, "async" if async_save else "sync")
    cb = TimedCheckpoint(dirpath=d, every_n_train_steps=every, save_top_k=-1, async_save=async_save)
    data = [np.random.default_rng(i).normal(size=(8, width)).astype(np.float32) for i in range(saves * every)]
    t = jl.Trainer(
        devices=1,
        max_steps=saves * every,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cb],
    )
    start = time.perf_counter()
    t.fit(Big(width, layers), data)
    total = time.perf_counter() - start
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(t.train_state))
    return cb, total, state_bytes, t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--every", type=int, default=20)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="jaxlight-ckpt-bench-")
    try:
        # sync first: one-time costs (orbax/tensorstore start-up, page cache) land on the baseline
        scb, stotal, _, trainer = run(args.width, args.layers, args.saves, args.every, False, root)
        acb, atotal, nbytes, _ = run(args.width, args.layers, args.saves, args.every, True, root)
        # restore the newest async checkpoint into a fresh trainer (arrays into its shardings, host state)
        fresh = jl.Trainer(
            devices=1,
            max_steps=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        fresh._attach(Big(args.width, args.layers), None)
        fresh._setup_model()
        fresh._setup_training()
        t = time.perf_counter()
        restore_into_trainer(fresh, acb.best_model_path, "fit")
        jax.block_until_ready(fresh.train_state)
        restore_s = time.perf_counter() - t
        # the first save also waits for nothing; later async saves may wait for the previous one's commit
        a, s = np.array(acb.blocked), np.array(scb.blocked)
        params = sum(x.size for x in jax.tree.leaves(trainer.train_state.params))
        print(
            f"model: {params / 1e6:.1f}M parameters, train state {nbytes / 2**20:.0f} MiB "
            f"(params + Adam), {args.saves} saves every {args.every} steps, backend {jax.default_backend()}"
        )
        print(f"{'':28s}{'mean s':>10s}{'median s':>10s}{'max s':>10s}")
        print(f"{'loop blocked, async save':28s}{a.mean():10.3f}{np.median(a):10.3f}{a.max():10.3f}")
        print(f"{'loop blocked, sync save':28s}{s.mean():10.3f}{np.median(s):10.3f}{s.max():10.3f}")
        print(f"{'restore (fit state)':28s}{restore_s:10.3f}")
        print(f"fit wall time: async {atotal:.2f} s, sync {stotal:.2f} s")
        waits = sum(acb.waited)
        if waits:
            print(
                f"{waits} of {len(a)} async saves started while the previous one was still being written and "
                f"waited for its commit (checkpointing more often than the disk can take); raise --every"
            )
        ratio = a.mean() / s.mean()
        print(f"ratio blocked async / sync = {ratio:.3f}  (target <= 0.10: {'met' if ratio <= 0.10 else 'NOT met'})")
        print(
            f"sync write throughput {nbytes / s.mean() / 2**20:.0f} MiB/s, "
            f"restore throughput {nbytes / restore_s / 2**20:.0f} MiB/s"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
