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
  once (shown to say why the monitor does not use it);
- the hand loop beside it (``--hand-loop``, on by default): the same model, optimizer, precision cast
  and attention kernel in a plain ``jax.jit`` + optax step, timed the same way after the trainer's run,
  and the ratio trainer / hand loop; then the hand loop with each other attention kernel that runs here
  (``blockwise``, XLA's, cuDNN's fused one), so fused against blockwise attention is measured in the same
  run. A kernel that cannot run (cuDNN's off an NVIDIA GPU, or in float32) gets a line saying why.

On a GPU (``benchmarks/gpu_check.sh``):

    python benchmarks/mfu.py                       # ~1.0 B parameters, batch 8 x 1024 tokens
    python benchmarks/mfu.py --batch-size 16 --remat dots_saveable

Anywhere (a CPU has no published peak: MFU is left out), as a quick check that it runs:

    python benchmarks/mfu.py --tiny      # (or --quick)
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxlight as jl
from benchmarks.common import time_compiled_steps
from examples.gpt import GPT
from examples.models import CausalTransformer, GPTConfig
from jaxlight.callbacks import ThroughputMonitor
from jaxlight.callbacks.throughput import peak_flops
from jaxlight.precision import resolve_precision
from jaxlight.strategies.attention_backends import IMPLEMENTATIONS, AttentionImplementationError, choose


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


def attention_kernel(args: argparse.Namespace, forced: str | None) -> str:
    """The kernel jl.nn.attention runs for the model's calls (q/k/v ``[batch, seq, heads, head_dim]`` in the
    compute dtype), or AttentionImplementationError saying why ``forced`` cannot run them."""
    dtype = resolve_precision(args.precision).compute_dtype or jnp.float32
    q = jax.ShapeDtypeStruct((args.batch_size, args.seq_len, args.heads, args.d_model // args.heads), dtype)
    return choose(q, q, q, causal=True, mask=None, implementation=forced)


def hand_loop(args: argparse.Namespace, kernel: str, data: list, steps: int, warmup: int) -> float:
    """Seconds per step of the model in a plain ``jax.jit`` + optax loop: the demo's optimizer (GPT's
    ``configure_optimizers``), the parameters cast as the trainer's precision casts them, ``kernel`` for
    attention; the window's mean after ``warmup`` steps, as the trainer's row."""
    cfg = GPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, seq_len=args.seq_len)
    cfg = GPTConfig(**{**cfg.__dict__, "attention": kernel})
    with nnx.use_eager_sharding(False):
        net = CausalTransformer(cfg, nnx.Rngs(params=0, dropout=1))
    prec = resolve_precision(args.precision)
    prec.bind(net)
    graphdef, params, rest = nnx.split(net, nnx.Param, ...)
    params = prec.store(params)
    tx = GPT(max_steps=len(data)).configure_optimizers()["optimizer"]
    opt_state = tx.init(params)

    def loss_fn(p, rest, x, y):
        logits = nnx.merge(graphdef, prec.compute(p), rest)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()

    @jax.jit
    def step(params, opt_state, rest, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, rest, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(step.__wrapped__, donate_argnums=(0, 1))
    batches = [tuple(jax.device_put(a) for a in b) for b in data[: warmup + steps + 1]]
    for x, y in batches[:warmup]:
        params, opt_state, loss = step(params, opt_state, rest, x, y)
    jax.block_until_ready((params, opt_state, loss))
    t0 = time.perf_counter()
    for x, y in batches[warmup : warmup + steps]:
        params, opt_state, loss = step(params, opt_state, rest, x, y)
    jax.block_until_ready((params, opt_state, loss))
    return (time.perf_counter() - t0) / steps


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
    p.add_argument(
        "--attention",
        default="auto",
        choices=["auto", *IMPLEMENTATIONS],
        help="jl.nn.attention's kernel (auto: its rule)",
    )
    p.add_argument(
        "--hand-loop",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the plain jax.jit + optax loop with the same kernels, and with every other attention kernel",
    )
    p.add_argument("--hand-steps", type=int, default=None, help="timed steps of each hand loop (default: --steps)")
    p.add_argument(
        "--quick", "--tiny", action="store_true", help="a tiny model for a few steps (checks the script runs)"
    )
    args = p.parse_args()
    if args.quick:
        args.d_model, args.layers, args.heads, args.seq_len, args.batch_size = 128, 2, 4, 64, 4
        args.steps, args.warmup = 6, 2
    total = args.warmup + args.steps + 1
    data = random_batches(total, args.batch_size, args.seq_len)
    forced = None if args.attention == "auto" else args.attention
    kernel = attention_kernel(args, forced)  # a forced kernel that cannot run is refused here, before any work
    model = GPT(args.d_model, args.layers, args.heads, args.seq_len, max_steps=total, attention=kernel)
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
        f"{params / 1e6:,.1f} M parameters; {tokens} tokens/step; attention {args.attention} -> {kernel}"
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
    if args.hand_loop and n_dev == 1:
        # the trainer's compiled step alone, called in a plain loop: what the fit loop adds is the difference
        program = statistics.median(time_compiled_steps({"t": trainer}, data[-1], args.steps, 1)["t"]) / 1e3
        del trainer, model, monitor  # free the trainer's state before the hand loops build theirs
        gc.collect()
        compare_hand_loops(args, kernel, data, med, program, analytic, peak)
    elif args.hand_loop:
        print(f"  note: the hand loop runs on one device; this trainer ran on {n_dev}: hand loop not timed")


def compare_hand_loops(args, kernel: str, data: list, trainer_step: float, program: float, flops: float, peak) -> None:
    """Rows: the trainer, the hand loop with its kernel (and the ratio), the hand loop with each other kernel."""
    steps = args.hand_steps or args.steps
    warmup = max(1, args.warmup)
    print(f"{'step time, analytic MFU':<50}{'ms/step':>10}{'MFU':>9}{'vs hand loop':>14}")
    mfu = lambda sec: f"{flops / sec / peak:.3f}" if peak else "n/a"
    hand = hand_loop(args, kernel, data, steps, warmup)
    print(
        f"{'trainer, attention ' + kernel:<50}{trainer_step * 1e3:>10.2f}{mfu(trainer_step):>9}"
        f"{trainer_step / hand:>14.3f}"
    )
    print(f"{'trainer compiled step, plain loop':<50}{program * 1e3:>10.2f}{mfu(program):>9}{program / hand:>14.3f}")
    print(f"{'hand loop (jax.jit + optax), attention ' + kernel:<50}{hand * 1e3:>10.2f}{mfu(hand):>9}{1.0:>14.3f}")
    for other in IMPLEMENTATIONS:
        if other == kernel:
            continue
        name = f"hand loop, attention {other}"
        try:
            attention_kernel(args, other)
        except AttentionImplementationError as e:
            print(f"{name:<50}{'n/a':>10}   ({str(e).split(': ', 2)[-1].split('. Pass')[0]})")
            continue
        sec = hand_loop(args, other, data, steps, warmup)
        print(f"{name:<50}{sec * 1e3:>10.2f}{mfu(sec):>9}{sec / hand:>14.3f}")


if __name__ == "__main__":
    main()
