"""Sequence parallelism at long sequences: memory per device, time per step and collectives, per exchange.

One causal transformer (examples/models.py: d_model 256, 8 heads, 2 layers, byte vocabulary),
one sequence per step, loss + gradients + an SGD update compiled as the trainer compiles its
step (``jax.set_mesh`` + the logical rules + the strategy's trace context), on 8 simulated CPU
devices. For each length, every configuration is compiled and timed in the same run:

- ``1 device``: sequence=1, plain (blocked) attention;
- ``no exchange``: sequence=8, activations split by the rules but attention left to GSPMD (no exchange);
- ``ulysses`` / ``allgather`` / ``ring``: SequenceParallel(8, mode), zig-zag balanced;
- ``allgather (no lb)`` / ``ring (no lb)``: the same without load balancing (what the reorder costs or saves).

Temporaries are ``compiled.memory_analysis().temp_size_in_bytes`` (per device). ms/step is the
median of ``--steps`` steps after one warm-up, taken round-robin over the configurations so a
change in the machine's load hits all alike; the 8 simulated devices share the host's cores, so
compare configurations with each other, not with real hardware (and an uneven split of causal
work costs nothing there: idle devices lend their cores). "CPU s/step" is the process's CPU time
per step (median): the work of all 8 simulated devices, unaffected by other load on the host. "causal work max/mean" counts, per
device, the causal blocks the kernel computes under its own skip rule. Collectives are counted
in the compiled HLO (a loop body counts once).

    python benchmarks/sequence.py [--lengths 2048,8192,32768] [--steps 3] [--max-step-seconds 60]
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
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxlight as jl
from examples.models import CausalTransformer, GPTConfig
from jaxlight.strategies import resolve_strategy
from jaxlight.strategies.attention_kernel import block_size
from jaxlight.strategies.sequence import SequenceParallel
from jaxlight.summary import fmt_bytes

COLLECTIVES = ("all-to-all", "all-gather", "collective-permute", "all-reduce", "reduce-scatter")
_OP = re.compile(r"\n\s*%?\S+ = .+? (" + "|".join(COLLECTIVES) + r")(?:-start)?\(")

CONFIGS = {
    "1 device": (SequenceParallel(size=1), 1, True),
    "no exchange": (SequenceParallel(size=8), 8, False),
    "ulysses": (SequenceParallel(size=8, mode="ulysses"), 8, True),
    "allgather": (SequenceParallel(size=8, mode="allgather"), 8, True),
    "allgather (no lb)": (SequenceParallel(size=8, mode="allgather", load_balance=False), 8, True),
    "ring": (SequenceParallel(size=8, mode="ring"), 8, True),
    "ring (no lb)": (SequenceParallel(size=8, mode="ring", load_balance=False), 8, True),
}


def build(cfg: GPTConfig, piece, devices: int, exchange: bool):
    """Compile one SGD step of the transformer on one [1, seq] batch; returns (compiled, state, batch)."""
    st = resolve_strategy(piece)
    mesh = st.build_mesh(jax.devices()[:devices])
    with nnx.use_eager_sharding(False):
        graph, params = nnx.split(CausalTransformer(cfg, nnx.Rngs(0)))
    tx = optax.sgd(1e-2)
    rep = NamedSharding(mesh, P())
    params = jax.device_put(params, rep)
    opt_state = jax.device_put(tx.init(params), rep)
    tok_sharding = NamedSharding(mesh, P(None, "sequence"))
    rng = np.random.default_rng(0)
    x, y = (jax.device_put(rng.integers(0, 256, (1, cfg.seq_len)).astype(np.int32), tok_sharding) for _ in range(2))

    def step(params, opt_state, x, y):
        def loss(p):
            logits = nnx.merge(graph, p)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    ctx = st.trace_context(mesh) if exchange else None
    with jax.set_mesh(mesh), jl.nn.axis_rules(mesh, st.logical_rules):
        if ctx is not None:
            with ctx:
                lowered = jax.jit(step, donate_argnums=(0, 1), out_shardings=rep).lower(params, opt_state, x, y)
        else:
            lowered = jax.jit(step, donate_argnums=(0, 1), out_shardings=rep).lower(params, opt_state, x, y)
    return lowered.compile(), (params, opt_state), (x, y)


def run_step(entry: dict) -> float:
    """Run one step of a built configuration (its state carried on); wall seconds. Also records the
    process's CPU seconds for the step: the work of all simulated devices, whatever else loads the host."""
    params, opt_state = entry["state"]
    t0, c0 = time.perf_counter(), time.process_time()
    params, opt_state, v = entry["compiled"](params, opt_state, *entry["batch"])
    jax.block_until_ready(v)
    entry["state"] = (params, opt_state)
    entry.setdefault("cpu", []).append(time.process_time() - c0)
    return time.perf_counter() - t0


def causal_imbalance(name: str, length: int, n: int = 8) -> float:
    """Max over mean, across devices, of the causal key blocks the kernel computes (its own skip rule).

    Ulysses attends every position of its heads on every device (balanced by construction); the
    all-gather and the ring visit the same (query block, key block) pairs, so one count serves both.
    """
    if name == "1 device" or name.startswith("ulysses") or name == "no exchange":
        return 1.0
    lb = "no lb" not in name
    chunks = 2 * n if lb else n
    c = length // chunks
    qb = kb = block_size(c)
    owned = [[i, 2 * n - 1 - i] if lb else [i] for i in range(n)]
    work = []
    for chunk_ids in owned:
        starts = [cid * c + j * qb for cid in chunk_ids for j in range(c // qb)]
        work.append(sum(1 for q0 in starts for k0 in range(0, length, kb) if q0 + qb - 1 >= k0))
    return max(work) / (sum(work) / n)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="2048,8192,32768")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration (median)")
    p.add_argument(
        "--max-step-seconds",
        type=float,
        default=60.0,
        help="do not run a configuration whose step is expected (from the previous length, x length^2) to take longer",
    )
    p.add_argument(
        "--memory-budget-gb",
        type=float,
        default=8.0,
        help="do not run a configuration whose temporaries over all simulated devices exceed this (host RAM)",
    )
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of: " + ", ".join(CONFIGS))
    args = p.parse_args(argv)
    names = [n.strip() for n in args.configs.split(",")]
    print(f"jax {jax.__version__}, {len(jax.devices())} {jax.devices()[0].platform} devices")
    print(f"model: d_model {args.d_model}, {args.heads} heads, {args.layers} layers; batch 1 sequence; SGD step")
    header = (
        "| seq | config | temporaries/device | vs 1 device | ms/step | CPU s/step | causal work max/mean | "
        + " | ".join(COLLECTIVES)
        + " |"
    )
    print(header)
    print("|" + "---|" * (7 + len(COLLECTIVES)))
    warmup: dict[str, tuple[int, float]] = {}
    for length in (int(x) for x in args.lengths.split(",")):
        cfg = GPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, seq_len=length)
        rows: dict[str, dict] = {}
        for name in names:
            piece, devices, exchange = CONFIGS[name]
            try:
                compiled, state, batch = build(cfg, piece, devices, exchange)
            except Exception as e:  # a refused shape, or out of memory while compiling
                rows[name] = {"error": f"{type(e).__name__}: {str(e)[:80]}"}
                continue
            temp = compiled.memory_analysis().temp_size_in_bytes
            entry = {"compiled": compiled, "state": state, "batch": batch, "temp": temp, "times": []}
            entry["ops"] = Counter(_OP.findall(compiled.as_text()))
            expected = None
            if name in warmup:
                prev_len, prev_s = warmup[name]
                expected = prev_s * (length / prev_len) ** 2
            if temp * devices > args.memory_budget_gb * 2**30:
                entry["skip"] = f"not run: {fmt_bytes(temp * devices)} on the host"
            elif expected is not None and expected > args.max_step_seconds:
                entry["skip"] = f"not run: ~{expected:.0f} s/step expected"
            else:
                warmup[name] = (length, run_step(entry))
            rows[name] = entry
        # timed steps round-robin over the configurations, so a change in the machine's load hits all alike
        for _ in range(args.steps):
            for entry in rows.values():
                if "compiled" in entry and "skip" not in entry:
                    entry["times"].append(run_step(entry))
        base = rows.get("1 device", {}).get("temp")
        for name, entry in rows.items():
            if "error" in entry:
                print(f"| {length} | {name} | — | — | — | — | — | {entry['error']} |", flush=True)
                continue
            ms_s = entry.get("skip") or f"{1e3 * float(np.median(entry['times'])):.0f}"
            cpu_s = "—" if "skip" in entry else f"{float(np.median(entry['cpu'][1:])):.2f}"
            ratio = f"{entry['temp'] / base:.3f}" if base else "—"
            counts = " | ".join(str(entry["ops"].get(c, 0)) for c in COLLECTIVES)
            imb = f"{causal_imbalance(name, length):.2f}"
            print(
                f"| {length} | {name} | {fmt_bytes(entry['temp'])} | {ratio} | {ms_s} | {cpu_s} | {imb} | {counts} |",
                flush=True,
            )
        del rows


if __name__ == "__main__":
    main()
