"""jl.nn.attention's kernels side by side: each against the blockwise kernel, and their speed.

For each case (causal; causal with a right-padding mask that leaves some query rows with no key;
grouped-query) and each kernel (``blockwise``, ``xla``, ``cudnn``) it prints the max abs difference
of the output and of the gradients of q, k, v (of a fixed random linear function of the output)
against the blockwise kernel in the same dtype, the same against a float32 blockwise reference (what
bf16 rounding alone gives), and the forward + backward time (median of ``--reps``, jitted, after one
warm call). A kernel that cannot run here (cuDNN's off an NVIDIA GPU) gets a line saying why, and the
other rows still print. The last line says which kernel ``implementation=None`` picks for each case.

    python benchmarks/attention_check.py              # on a GPU: batch 4 x 1024, 16 heads of 128 (the 1 B demo's)
    python benchmarks/attention_check.py --tiny       # anywhere: a small case
    python benchmarks/attention_check.py --sweep 128,256,512,1024,2048 --batch 1 --heads 4 --head-dim 64
        # the timings behind the automatic rule: causal forward + backward per length, each kernel that runs
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from jaxlight.nn import attention
from jaxlight.strategies.attention_backends import IMPLEMENTATIONS, AttentionImplementationError, choose


def case_inputs(name: str, b: int, t: int, h: int, d: int, dtype) -> tuple:
    rng = np.random.default_rng(0)
    hk = h // 4 if name == "gqa" else h
    q = rng.normal(size=(b, t, h, d))
    k, v = rng.normal(size=(2, b, t, hk, d))
    w = rng.normal(size=(b, t, h, d))
    mask = None
    if name == "causal+pad":  # left padding of a quarter in row 0: its first queries see no key
        keep = np.ones((b, t), bool)
        keep[0, : t // 4] = False
        mask = jnp.asarray(keep[:, None, None, :])
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v)) + (jnp.asarray(w, jnp.float32), mask)


def run(impl: str, q, k, v, w, mask):
    def loss(q, k, v):
        out = attention(q, k, v, causal=True, mask=mask, implementation=impl)
        return (out.astype(jnp.float32) * w).sum(), out

    return jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))


def timed(fn, args, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def maxdiff(a, b) -> float:
    return float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="batch 2 x 256, 4 heads of 64, 3 reps (checks it runs)")
    p.add_argument("--sweep", default="", help="comma-separated lengths: only time each kernel at each length")
    args = p.parse_args()
    if args.sweep:
        return sweep(args, [int(x) for x in args.sweep.split(",")])
    if args.tiny:
        args.batch, args.seq, args.heads, args.head_dim, args.reps = 2, 256, 4, 64, 3
    dtype = jnp.dtype(args.dtype)
    dev = jax.devices()[0]
    print(
        f"jax {jax.__version__}, {dev.device_kind} ({dev.platform}); {args.dtype}, batch {args.batch}, "
        f"seq {args.seq}, heads {args.heads}, head_dim {args.head_dim}"
    )
    hdr = f"{'case':<12}{'kernel':<11}{'ms f+b':>9}{'|out-bw|':>11}{'|dq-bw|':>10}{'|dk-bw|':>10}{'|dv-bw|':>10}"
    print(hdr + f"{'|out-f32|':>11}{'|dq-f32|':>10}")
    picks = []
    for name in ("causal", "causal+pad", "gqa"):
        q, k, v, w, mask = case_inputs(name, args.batch, args.seq, args.heads, args.head_dim, dtype)
        f32 = tuple(x.astype(jnp.float32) for x in (q, k, v))
        (_, ref_out), ref_g = run("blockwise", *f32, w, mask)(*f32)
        (_, bw_out), bw_g = run("blockwise", q, k, v, w, mask)(q, k, v)
        picks.append(f"{name}: {choose(q, k, v, causal=True, mask=mask)}")
        for impl in IMPLEMENTATIONS:
            try:
                choose(q, k, v, causal=True, mask=mask, implementation=impl)
            except AttentionImplementationError as e:
                print(f"{name:<12}{impl:<11}{'n/a':>9}   ({str(e).split(': ', 2)[-1].split('. Pass')[0]})")
                continue
            fn = run(impl, q, k, v, w, mask)
            (_, out), g = fn(q, k, v)
            sec = timed(fn, (q, k, v), args.reps)
            diffs = [maxdiff(out, bw_out)] + [maxdiff(a, b) for a, b in zip(g, bw_g)]
            finite = all(bool(jnp.isfinite(x.astype(jnp.float32)).all()) for x in (out, *g))
            row = f"{name:<12}{impl:<11}{sec * 1e3:>9.2f}{diffs[0]:>11.2e}" + "".join(f"{x:>10.2e}" for x in diffs[1:])
            row += f"{maxdiff(out, ref_out):>11.2e}{maxdiff(g[0], ref_g[0]):>10.2e}"
            print(row + ("" if finite else "   NON-FINITE"))
    print("implementation=None picks: " + "; ".join(picks))


def sweep(args: argparse.Namespace, lengths: list[int]) -> None:
    """ms of a causal forward + backward per length and kernel (the numbers behind the automatic rule)."""
    dev = jax.devices()[0]
    print(f"jax {jax.__version__}, {dev.device_kind}; batch {args.batch}, heads {args.heads}, head_dim {args.head_dim}")
    print(f"{'dtype':<10}{'length':>8}" + "".join(f"{i:>12}" for i in IMPLEMENTATIONS) + f"{'auto':>12}")
    for dtype in sorted({args.dtype, "float32"}):
        for t in lengths:
            q, k, v, w, mask = case_inputs("causal", args.batch, t, args.heads, args.head_dim, jnp.dtype(dtype))
            cells = []
            for impl in IMPLEMENTATIONS:
                try:
                    choose(q, k, v, causal=True, mask=None, implementation=impl)
                except AttentionImplementationError:
                    cells.append("n/a")
                    continue
                cells.append(f"{timed(run(impl, q, k, v, w, None), (q, k, v), args.reps) * 1e3:.1f} ms")
            auto = choose(q, k, v, causal=True, mask=None)
            print(f"{dtype:<10}{t:>8}" + "".join(f"{c:>12}" for c in cells) + f"{auto:>12}")


if __name__ == "__main__":
    main()
