"""What keeping the module's weights readable in per-batch hooks costs (issue 11, "module weights in hooks").

The train step donates its state, so after a step the module's NNX attributes would point at deleted
arrays. The loop re-points them (``ModuleBinding.sync_module``: ``nnx.update`` of the modules in place, no copy)
before a per-batch hook, but only when a user-written ``on_train_batch_start``/``on_train_batch_end`` runs
(a callback or the module itself); jaxlight's own callbacks never read the module, so the default path
pays nothing.

Two measurements, side by side in one run:

1. ``sync_module`` alone, in microseconds per call, for a tiny MLP (4 leaves) and for the reference
   transformer (``benchmarks/common.py``, ~60 leaves): what one step pays when a user hook exists. Each
   call is made after a train step replaced the state (a sync of an already-synced state is free and is
   timed too).
2. ``fit`` on the tiny MLP (one CPU device, defaults otherwise: progress bar off), alternating rounds of
   a module without per-batch hooks and one whose ``on_train_batch_end`` is an empty user method (so the
   loop syncs every step); median ms/step of each and the difference in microseconds per step.

    python benchmarks/module_sync.py               # 7 rounds x 300 steps
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np
import optax
from flax import nnx

import jaxlight as jl


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(16, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


class Tiny(jl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = MLP(nnx.Rngs(0))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = ((self.net(x) - y) ** 2).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return optax.sgd(1e-3)


class TinyWithHook(Tiny):
    def on_train_batch_end(self, outputs, batch, batch_idx):  # a user hook: the loop syncs before it
        pass


class Timed(jl.Callback):
    """Times each epoch from its start to a drained device (no per-step hook of its own)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._t = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        import jax

        jax.block_until_ready(trainer.train_state.params)
        self.times.append(time.perf_counter() - self._t)


def tiny_batches(n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(8, 16)).astype(np.float32), rng.normal(size=(8, 4)).astype(np.float32)) for _ in range(n)]


def sync_cost(module: jl.LightningModule, batches: list, calls: int) -> tuple[float, float, int]:
    """(µs per sync after a step, µs per sync of an already-synced state, arrays synced) for ``module``."""
    trainer = jl.Trainer(
        max_steps=1, devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, batches[:1])
    engine = trainer.engine
    state = engine.train_state
    fresh = []
    for _ in range(calls):
        engine.train_state = state._replace(step=state.step)  # a new state object, as after a step
        t = time.perf_counter()
        engine.binding.sync_module()
        fresh.append(time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(calls):
        engine.binding.sync_module()
    again = (time.perf_counter() - t) / calls
    leaves = len(state.params) + len(state.model_state)
    return statistics.median(fresh) * 1e6, again * 1e6, leaves


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()

    batches = tiny_batches(args.steps)
    rows = []
    tiny_us, tiny_again, n = sync_cost(Tiny(), batches, args.calls)
    rows.append((f"sync_module, tiny MLP ({n} arrays)", f"{tiny_us:.1f} us", f"{tiny_again:.2f} us"))
    try:
        from common import REFERENCE, LMModule, make_batches

        lm_us, lm_again, n = sync_cost(LMModule(REFERENCE), make_batches(1), max(args.calls // 10, 50))
        rows.append((f"sync_module, reference transformer ({n} arrays)", f"{lm_us:.1f} us", f"{lm_again:.2f} us"))
    except Exception as e:  # the reference workload needs the stdlib text; the tiny numbers stand alone
        print(f"(reference transformer skipped: {e})")

    per_step = {"no user hook": [], "user on_train_batch_end": []}
    for _ in range(args.rounds):
        for name, cls in (("no user hook", Tiny), ("user on_train_batch_end", TinyWithHook)):
            timer = Timed()
            trainer = jl.Trainer(
                max_epochs=2, devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                enable_checkpointing=False, num_sanity_val_steps=0, callbacks=[timer],
            )  # fmt: skip
            trainer.fit(cls(), batches)
            assert trainer.hook_reads_module("on_train_batch_end") == (cls is TinyWithHook)
            per_step[name].append(timer.times[-1] / args.steps)  # the second epoch: compiled, warm
    base = statistics.median(per_step["no user hook"]) * 1e3
    hook = statistics.median(per_step["user on_train_batch_end"]) * 1e3
    print()
    print("| measurement | after a step | already synced |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")
    print()
    print(f"| tiny MLP fit, {args.rounds} rounds x {args.steps} steps | ms/step (median) |")
    print("|---|---|")
    print(f"| no user per-batch hook (no sync) | {base:.3f} |")
    print(f"| user on_train_batch_end (sync every step) | {hook:.3f} |")
    print(f"| difference | {1e3 * (hook - base):+.1f} us/step |")


if __name__ == "__main__":
    main()
