"""Host cost per train step of a tiny MLP fit (1 CPU device, default callbacks): Python calls on the main thread
(deterministic: a count of profiler "call" events) and main-thread CPU microseconds (noisy: the tiny step runs
on the calling thread), over 10 steady-state epochs of 100 steps, from a callback's epoch edges.

    python benchmarks/host_calls.py               # this checkout
    PYTHONPATH=/path/to/other/checkout python benchmarks/host_calls.py   # another one, to compare
"""

import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
import jax
import numpy as np
import optax
from flax import nnx

import jaxlight as jl


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.l2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


class M(jl.LightningModule):
    def configure_model(self):
        self.net = MLP(nnx.Rngs(0))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = optax.softmax_cross_entropy_with_integer_labels(self.net(x), y).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return optax.adam(1e-3)


STEPS = 100
rng = np.random.default_rng(0)
data = [(rng.normal(size=(16, 8)).astype(np.float32), rng.integers(0, 4, 16).astype(np.int32)) for _ in range(STEPS)]


class Probe(jl.Callback):
    def __init__(self, mode):
        self.mode, self.calls, self.cpu = mode, [], []

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch < 2:
            return
        self.n = 0
        if self.mode == "calls":

            def prof(frame, event, arg):
                if event == "call":
                    self.n += 1

            sys.setprofile(prof)
        self.t0 = time.thread_time()

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch < 2:
            return
        jax.block_until_ready(trainer.train_state)
        t = time.thread_time() - self.t0
        if self.mode == "calls":
            sys.setprofile(None)
            self.calls.append(self.n / STEPS)
        else:
            self.cpu.append(t / STEPS * 1e6)


for mode in ("calls", "cpu"):
    p = Probe(mode)
    tr = jl.Trainer(
        devices=1,
        max_epochs=12,
        callbacks=[p],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        num_sanity_val_steps=0,
        default_root_dir="/tmp/hostcalls_run",
    )
    tr.fit(M(), train_dataloaders=data)
    if mode == "calls":
        print(f"python calls/step: median {statistics.median(p.calls):.1f} min {min(p.calls):.1f}")
    else:
        print(f"main-thread cpu µs/step: median {statistics.median(p.cpu):.1f} min {min(p.cpu):.1f}")
