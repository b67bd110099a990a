"""Per-device memory and collectives of one train step under each strategy (8 simulated CPU devices).

The step is lowered and compiled ahead of time on abstract inputs (shapes + shardings), so
the few-hundred-MB model is never materialised 8 times: every number comes from the
shardings the trainer derives and from ``compiled.memory_analysis()`` / ``compiled.as_text()``.

    python benchmarks/strategies.py [--embed 1024 --mlp 4096 --layers 4 --vocab 8192 --batch 16 --seq 128]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections import Counter

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

import jaxlight as jl
from jaxlight.summary import fmt_bytes
from tests.strategy_models import LM

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"\n\s*%?\S+ = .+? (" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def shard_bytes(tree, shardings) -> int:
    """Bytes one device holds (the largest shard of each leaf, summed)."""
    total = 0
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
        total += int(np.prod(s.shard_shape(x.shape))) * x.dtype.itemsize
    return total


def print_table(table: list[tuple[str, ...]]) -> None:
    """Left-aligned columns, a rule under the header row."""
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for i, r in enumerate(table):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def compile_step(strategy, dims: dict, batch: int, seq: int):
    """The trainer's placement of the LM's state and its train step, compiled on abstract inputs."""
    trainer = jl.Trainer(
        strategy=strategy, devices=8, enable_progress_bar=False, logger=False, enable_checkpointing=False
    )
    module = LM(**dims)
    module.trainer = trainer
    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
    t0 = time.perf_counter()
    compiled, state = trainer.engine.compile_abstract(module, module.configure_optimizers(), {"tokens": tokens})
    secs = time.perf_counter() - t0
    pbytes = shard_bytes(state.params, [x.sharding for x in jax.tree.leaves(state.params)])
    obytes = shard_bytes(state.opt_state, [x.sharding for x in jax.tree.leaves(state.opt_state)])
    return trainer, compiled, pbytes, obytes, secs, state.params


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--embed", type=int, default=1024)
    ap.add_argument("--mlp", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--offload-steps", type=int, default=5, help="timed steps per round for the offload rows (0: skip)")
    ap.add_argument("--offload-rounds", type=int, default=5)
    ap.add_argument("--offload-embed", type=int, default=256)
    args = ap.parse_args()
    dims = dict(embed=args.embed, mlp=args.mlp, heads=args.heads, layers=args.layers, vocab=args.vocab)
    strategies = {
        "ddp": "ddp",
        "fsdp": "fsdp",
        "tp": "tp",
        "fsdp+tp": "fsdp+tp",
        "FSDP(size=2)+TensorParallel(4)": jl.strategies.FSDP(size=2) + jl.strategies.TensorParallel(4),
    }
    rows = []
    for name, strategy in strategies.items():
        trainer, compiled, pbytes, obytes, secs, aparams = compile_step(strategy, dims, args.batch, args.seq)
        mem = compiled.memory_analysis()
        ops = Counter(_OP.findall(compiled.as_text()))
        mesh = ",".join(f"{a}={s}" for a, s in trainer.mesh.shape.items() if s > 1)
        rows.append((name, mesh, pbytes, obytes, mem.argument_size_in_bytes, mem.temp_size_in_bytes, ops, secs))
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(aparams))
    total = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(aparams))
    print(
        f"model: {n_params / 1e6:.1f} M params ({fmt_bytes(total)} float32; Adam state 2x), dims {dims}, "
        f"global batch {args.batch} x {args.seq} tokens, 8 CPU devices, jax {jax.__version__}"
    )
    hdr = (
        "strategy",
        "mesh",
        "params/dev",
        "opt/dev",
        "args/dev",
        "temp/dev",
        "vs ddp (p+o)",
        "all-reduce",
        "all-gather",
        "reduce-scatter",
        "all-to-all",
        "coll-permute",
        "compile s",
    )
    table = [hdr]
    base = rows[0][2] + rows[0][3]
    for name, mesh, pb, ob, arg, tmp, ops, secs in rows:
        table.append(
            (
                name,
                mesh,
                fmt_bytes(pb),
                fmt_bytes(ob),
                fmt_bytes(arg),
                fmt_bytes(tmp),
                f"{(pb + ob) / base:.3f}",
                *(str(ops.get(c, 0)) for c in COLLECTIVES),
                f"{secs:.1f}",
            )
        )
    print_table(table)
    print(
        "collective counts are ops in the compiled HLO (a tuple all-reduce of many gradients counts once); "
        "XLA:CPU emits FSDP's gradient reduce-scatter as all-reduce + dynamic-slice"
    )
    if args.offload_steps:
        offload_table(args)


def offload_table(args) -> None:
    """Host offload: per-device device and host bytes of params, Adam state and EMA, and ms/step with and
    without offload, measured side by side (alternating rounds) on real steps of a smaller model."""
    from benchmarks.common import time_compiled_steps
    from jaxlight.callbacks import EMA
    from jaxlight.summary import per_device_bytes
    from tests.strategy_models import token_batches

    dims = dict(embed=args.offload_embed, mlp=4 * args.offload_embed, heads=8, layers=2, vocab=1024)
    steps, rounds = args.offload_steps, args.offload_rounds
    pairs = [("ddp", "ddp+offload"), ("fsdp", "fsdp+offload"), ("fsdp+tp", "fsdp+tp+offload")]
    data = token_batches(steps + 1, args.batch, seq=65, vocab=dims["vocab"])
    results: dict[str, dict] = {}
    names = [n for p in pairs for n in p]
    trainers = {}
    for name in names:
        t = jl.Trainer(
            strategy=name,
            devices=8,
            max_epochs=1,
            callbacks=[EMA(decay=0.99)],
            enable_progress_bar=False,
            logger=False,
            enable_checkpointing=False,
            enable_model_summary=False,
        )
        t.fit(LM(**dims), data[:1])  # compile once; the timed runs reuse the trainer's compiled step
        trainers[name] = t
        st = t.train_state
        results[name] = {
            "params": (per_device_bytes(st.params, "device"), per_device_bytes(st.params, "host")),
            "opt": (per_device_bytes(st.opt_state, "device"), per_device_bytes(st.opt_state, "host")),
            "ema": (per_device_bytes(st.callback_state, "device"), per_device_bytes(st.callback_state, "host")),
        }
    times = time_compiled_steps(trainers, data[1], steps, rounds)
    n_params = sum(int(np.prod(x.shape)) for x in trainers["ddp"].train_state.params.values())
    print(
        f"\nhost offload: {n_params / 1e6:.1f} M params, EMA, Adam, global batch {args.batch} x 64, "
        f"median of {rounds} alternating rounds x {steps} steps"
    )
    hdr = ("strategy", "params dev/host", "Adam dev/host", "EMA dev/host", "ms/step", "vs no offload")
    table = [hdr]
    for base, off in pairs:
        for name in (base, off):
            r = results[name]
            ms = float(np.median(times[name]))
            ref = float(np.median(times[base]))
            table.append(
                (
                    name,
                    *(f"{fmt_bytes(r[k][0])} / {fmt_bytes(r[k][1])}" for k in ("params", "opt", "ema")),
                    f"{ms:.1f}",
                    f"{ms / ref:.2f}x",
                )
            )
    print_table(table)
    print(
        "bytes per device counted from the arrays' shards by memory kind (XLA:CPU's memory_analysis() reports "
        "no host bytes); on CPU 'host' and 'device' memory are the same RAM, so the ms/step ratio is the cost "
        "of the extra copies, not of a PCIe transfer"
    )


if __name__ == "__main__":
    main()
