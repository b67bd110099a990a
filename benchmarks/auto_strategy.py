"""What ``strategy="auto"`` chooses for a model at several device-memory sizes (8 simulated CPU devices).

Every candidate layout's train step is compiled once, ahead of time on abstract shapes (a budget below
every need makes :func:`jaxlight.planner.choose_strategy` compile all of them and report their
needs); the table then applies auto's rule (the fastest estimated step among the layouts that fit,
:class:`jaxlight.planner.StepSpeeds`) at each memory size, and with ``--check`` one real
``choose_strategy`` call per size checks the rule gives the same answer. ``--model gpt`` is the
demo transformer with its blocks in one ``LayerStack`` (remat left unset), so the ``+remat``
variants apply; ``--model lm`` (blocks in a Python list) has none to rematerialise. ``--speeds
h200`` prices the estimate with an H200's bf16 peak and nominal link figures instead of the CPU's.

    python benchmarks/auto_strategy.py [--model gpt --embed 1024 --layers 4 --vocab 8192 --batch 16 --seq 128]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

from jaxlight.planner import HEADROOM, NoStrategyFits, StepSpeeds, choose_strategy
from jaxlight.summary import fmt_bytes
from tests.strategy_models import LM

H200 = StepSpeeds(989.4e12, 3e11, 2.5e10, "H200 bf16 peak, nominal NVLink and PCIe figures")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--embed", type=int, default=1024)
    ap.add_argument("--mlp", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--model", choices=("lm", "gpt"), default="gpt")
    ap.add_argument("--speeds", choices=("cpu", "h200"), default="cpu")
    ap.add_argument("--check", action="store_true", help="also run choose_strategy at each size (recompiles)")
    args = ap.parse_args()
    dims = dict(embed=args.embed, mlp=args.mlp, heads=args.heads, layers=args.layers, vocab=args.vocab)
    if args.model == "lm":
        module = LM(**dims)
        batch = {"tokens": jax.ShapeDtypeStruct((args.batch, args.seq + 1), jnp.int32)}
    else:
        from benchmarks.common import GPTConfig, LMModule

        cfg = GPTConfig(
            d_model=args.embed,
            n_layers=args.layers,
            n_heads=args.heads,
            seq_len=args.seq,
            mlp_ratio=args.mlp // args.embed,
            vocab=args.vocab,
        )
        module = LMModule(cfg)
        tokens = jax.ShapeDtypeStruct((args.batch, args.seq), jnp.int32)
        batch = (tokens, tokens)
    speeds = H200 if args.speeds == "h200" else StepSpeeds.for_devices(jax.devices())
    t0 = time.perf_counter()
    try:
        choose_strategy(module, module.configure_optimizers(), batch, jax.devices(), device_memory=1, speeds=speeds)
        raise SystemExit("a 1-byte budget fitted a candidate")
    except NoStrategyFits as e:
        cands = e.candidates
    secs = time.perf_counter() - t0
    ok = [c for c in cands if c.error is None]
    print(
        f"{args.model} {dims}, Adam, global batch {args.batch} x {args.seq}, 8 CPU devices, jax {jax.__version__}; "
        f"{len(ok)} candidates compiled in {secs:.0f} s; estimate speeds: {speeds.describe()}"
    )
    hdr = (
        "candidate",
        "mesh",
        "step (mem analysis)",
        "batches ahead",
        "device need",
        "host",
        "collectives",
        "matmul GFLOP",
        "estimated step",
    )
    rows = [hdr]
    for c in cands:
        if c.error is not None:
            rows.append((c.name, "-", "n/a: " + c.error[:60], "", "", "", "", "", ""))
            continue
        rows.append(
            (
                c.name,
                c.mesh_text,
                fmt_bytes(c.step_bytes),
                fmt_bytes(c.batch_bytes),
                fmt_bytes(c.device_bytes),
                fmt_bytes(c.host_bytes),
                c.collectives.summary(short=True),
                f"{c.flops / 1e9:.3g}",
                c.estimate_text(),
            )
        )
    _print(rows)
    needs = sorted({c.device_bytes for c in ok})
    sizes = [int(n / (1 - HEADROOM)) + 1 for n in needs] + [int(needs[0] / (1 - HEADROOM)) - 1]
    print(f"\nauto's choice by device_memory ({HEADROOM:.0%} headroom; fastest estimated step among those that fit):")
    rows = [("device_memory", "budget", "chosen", "its need", "estimated step")]
    for mem in sorted(sizes, reverse=True):
        budget = int(mem * (1 - HEADROOM))
        fit = [c for c in ok if c.device_bytes <= budget]
        best = min(fit, key=lambda c: (c.estimate_s, c.device_bytes)) if fit else None
        if args.check:
            try:
                real = choose_strategy(
                    module, module.configure_optimizers(), batch, jax.devices(), device_memory=mem, speeds=speeds
                )
                assert best is not None and real.chosen.name == best.name, (mem, real.chosen.name)
            except NoStrategyFits:
                assert best is None, mem
        rows.append(
            (
                fmt_bytes(mem),
                fmt_bytes(budget),
                best.name if best else "raises NoStrategyFits",
                fmt_bytes(best.device_bytes) if best else "-",
                f"{best.estimate_s * 1e3:.3g} ms" if best else "-",
            )
        )
    _print(rows)
    print(
        "device need = memory_analysis() argument + output + temp - alias (host-memory state removed: XLA:CPU counts "
        "it as an argument) + the prefetched batches; estimated step = matmul FLOPs per device / peak + collective "
        "result bytes in the HLO / link bandwidth + 2 x host bytes / host bandwidth"
    )


def _print(rows: list[tuple]) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for i, r in enumerate(rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


if __name__ == "__main__":
    main()
