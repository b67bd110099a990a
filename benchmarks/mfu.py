"""Model FLOPs utilisation of the demo GPT scaled up: achieved TFLOP/s per device against the chip's peak.

The model is the demo's (``examples/gpt.py``'s ``GPT``: the byte-level ``CausalTransformer`` of
``examples/models.py``, AdamW with warmup + cosine and global-norm clipping), scaled to about one billion
parameters (``--d-model 2048 --layers 20 --heads 16``, sequence 1024), trained with ``bf16-mixed`` on random
byte windows (the step's cost does not depend on the text). After ``--warmup`` untimed steps it prints:

- parameters, tokens per step, the step time over ``--steps`` steps (the window's mean, from the end of
  the last warm-up step to the drained end of the last step; the per-step intervals' median, min, max);
- TFLOP/s per device and MFU against the device's published dense peak (``peak_flops``: the H200's 989
  TFLOP/s in bf16) for three FLOP counts of one step: the trainer's ``ThroughputMonitor`` (the traced
  step's matrix products, every layer of the scanned stack, recomputation included:
  ``jaxlight.flops.matmul_flops``), the usual analytic count (6 x params x tokens for the matrices plus
  12 x layers x d_model x seq x tokens for causal attention's scores and values, counted in full as most
  reports do: the MFU to quote), and XLA's ``cost_analysis()``, which counts the layer stack's loop body
  once (shown to say why the monitor does not use it).

On a GPU (``benchmarks/gpu_check.sh``):

    python benchmarks/mfu.py                       # ~1.0 B parameters, batch 8 x 1024 tokens
    python benchmarks/mfu.py --batch-size 16 --remat dots_saveable

Anywhere (a CPU has no published peak: MFU is left out), as a quick check that it runs:

    python benchmarks/mfu.py --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

import jaxlight as jl
from examples.gpt import GPT
from jaxlight.callbacks import ThroughputMonitor
from jaxlight.callbacks.throughput import peak_flops


class StepTimes(jl.Callback):
    """Host time between the ends of consecutive train steps (after the trainer's bounded run-ahead wait,
    so over many steps it is the device's step time); the first ``warmup`` are dropped."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.stamps: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.stamps.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module) -> None:
        jax.block_until_ready(trainer.train_state)
        self.stamps.append(time.perf_counter())  # the last step, drained

    def step_times(self) -> list[float]:
        s = self.stamps[self.warmup :]
        return [b - a for a, b in zip(s[:-1], s[1:])]

    def mean_step(self) -> float:
        """Seconds per step from the end of the last warm-up step to the drained end of the last one: the
        throughput (a single interval is off by what runs ahead; the whole window by at most RUN_AHEAD steps)."""
        s = self.stamps[self.warmup :]
        return (s[-1] - s[0]) / (len(s) - 1)


def random_batches(n: int, batch: int, seq: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, 256, size=(n, batch, seq + 1), dtype=np.int32)
    return [(t[:, :-1], t[:, 1:]) for t in toks]


def analytic_flops(params: int, layers: int, d_model: int, seq: int, tokens: int) -> float:
    """Training FLOPs of one step: 6 N T for the parameters' matrices plus the attention's QK^T and AV
    (2 x 2 x seq x d_model per token per layer forward, x3 with the backward pass), counted in full."""
    return 6.0 * params * tokens + 12.0 * layers * d_model * seq * tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the compile")
    p.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "bf16-true", "32-true"])
    p.add_argument("--strategy", default="auto")
    p.add_argument("--quick", action="store_true", help="a tiny model for a few steps (checks the script runs)")
    args = p.parse_args()
    if args.quick:
        args.d_model, args.layers, args.heads, args.seq_len, args.batch_size = 128, 2, 4, 64, 4
        args.steps, args.warmup = 6, 2
    total = args.warmup + args.steps + 1
    data = random_batches(total, args.batch_size, args.seq_len)
    model = GPT(args.d_model, args.layers, args.heads, args.seq_len, max_steps=total)
    times, monitor = StepTimes(args.warmup), ThroughputMonitor(window=max(args.steps, 1))
    trainer = jl.Trainer(
        strategy=args.strategy,
        max_steps=total,
        precision=args.precision,
        callbacks=[times, monitor],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    t0 = time.perf_counter()
    trainer.fit(model, train_dataloaders=data)
    wall = time.perf_counter() - t0
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trainer.train_state.params))
    tokens = args.batch_size * args.seq_len
    steps = times.step_times()
    med = times.mean_step()
    dev = trainer.mesh.devices.flat[0]
    n_dev = trainer.mesh.size
    peak = peak_flops(dev, args.precision)
    counted = monitor.flops_per_step  # per device: the traced step's matrix products (jaxlight.flops)
    try:
        xla = float(trainer.compiled["train"].cost_analysis()["flops"])  # the device's program, a loop body once
    except Exception:
        xla = None
    analytic = analytic_flops(params, args.layers, args.d_model, args.seq_len, tokens) / n_dev
    print(
        f"jax {jax.__version__}, {n_dev} x {dev.device_kind} ({dev.platform}), strategy {trainer.strategy.name!r}, "
        f"{args.precision}; fit {wall:.0f} s incl. compile"
    )
    print(
        f"model: d_model={args.d_model} layers={args.layers} heads={args.heads} seq={args.seq_len}; "
        f"{params / 1e6:,.1f} M parameters; {tokens} tokens/step"
    )
    print(
        f"step time over {len(steps)} steps: {med * 1e3:.2f} ms (window mean; per-step intervals median "
        f"{statistics.median(steps) * 1e3:.2f}, min {min(steps) * 1e3:.2f}, max {max(steps) * 1e3:.2f}); "
        f"{tokens / med:,.0f} tokens/s"
    )
    print(f"{'FLOPs per step, per device':<36}{'FLOPs':>12}{'TFLOP/s/device':>16}{'peak TFLOP/s':>14}{'MFU':>9}")
    rows = (
        ("ThroughputMonitor (traced matmuls)", counted),
        ("analytic 6NT + attention", analytic),
        ("XLA cost_analysis (loop body once)", xla),
    )
    for name, flops in rows:
        if flops is None:
            print(f"{name:<36}{'n/a':>12}")
            continue
        rate = flops / med
        mfu = f"{rate / peak:.3f}" if peak else "n/a"
        print(f"{name:<36}{flops:>12.3e}{rate / 1e12:>16.2f}{(peak or 0) / 1e12:>14.1f}{mfu:>9}")
    if not peak:
        print(f"  note: no published peak for device kind {dev.device_kind!r}: MFU not computed")


if __name__ == "__main__":
    main()
