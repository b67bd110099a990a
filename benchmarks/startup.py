"""Time to first step with a cold and a warm persistent compilation cache (issue 14).

Workloads:
  reference  benchmarks/common.py's byte GPT (d_model=256, 4 layers, 4 heads, sequence 128,
             batch 16, AdamW), one CPU device
  fsdp+tp    examples/gpt.py's GPT with its default arguments, strategy "fsdp+tp" on 8
             simulated CPU devices (4-way FSDP x 2-way tensor parallel)

Method. Every run is a fresh Python process (``--child``), so nothing is cached in memory;
only the cache directory carries over. The child builds the data first, then times
``trainer.fit`` from the call to the end of the first train step (its loss ready, via
``block_until_ready`` in ``on_train_batch_end``): "first step". The fit goes on to one
validation batch (a second compiled stage) and returns: "fit". The parent also times the
whole process (interpreter start, imports, data, fit, exit). Per workload, each round runs
three processes: ``compile_cache=False`` ("off"), a new empty cache directory ("cold") and the
same directory again ("warm"); rounds repeat the three in that order, so a drifting load on a
shared machine hits all three alike, and the table shows medians. Each child also reports
``trainer.compile_counts`` (the trainer's compiles per stage: still one per stage on a warm
run) and which compiled programs the cache served (jaxlight's cache counters, by JAX module
name).

    python benchmarks/startup.py                         # both workloads, 3 rounds
    python benchmarks/startup.py --workloads reference --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKLOADS = ("reference", "fsdp+tp")
MODES = ("off", "cold", "warm")


def child(workload: str, cache: str) -> None:
    """One measured process: prints one JSON line."""
    if workload == "fsdp+tp":
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    sys.path.insert(0, HERE)
    sys.path.insert(0, ROOT)
    import jax

    import jaxlight as jl
    from jaxlight.compile_cache import cache_stats

    class FirstStep(jl.Callback):
        def __init__(self) -> None:
            self.t: float | None = None
            self.cpu: float | None = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if self.t is None:
                jax.block_until_ready(outputs["loss"])
                self.t, self.cpu = time.perf_counter(), time.process_time()

    first = FirstStep()
    kw = dict(
        max_steps=1,
        limit_train_batches=1,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        callbacks=[first],
        compile_cache=False if cache == "off" else cache,
    )
    if workload == "reference":
        from common import LMModule, make_batches

        batches = make_batches(2)
        trainer = jl.Trainer(devices=1, **kw)
        model, fit_kw = LMModule(), dict(train_dataloaders=batches[:1], val_dataloaders=batches[1:])
    else:
        from examples.gpt import GPT, StdlibText, parse_args

        a = parse_args(["--max-steps", "1"])
        dm = StdlibText(a.batch_size, a.seq_len, a.batches_per_epoch, a.val_batches, 400_000, a.seed)
        dm.setup("fit")  # the data is read before the clock starts
        trainer = jl.Trainer(strategy="fsdp+tp", devices=8, **kw)
        model = GPT(a.d_model, a.layers, a.heads, a.seq_len, a.dropout, a.lr, a.weight_decay, a.warmup_steps, 1)
        fit_kw = dict(datamodule=dm)
    t0, c0 = time.perf_counter(), time.process_time()
    trainer.fit(model, **fit_kw)
    t_fit = time.perf_counter() - t0
    s = cache_stats()
    print(
        json.dumps(
            {
                "first_step": first.t - t0,
                "first_step_cpu": first.cpu - c0,
                "fit": t_fit,
                "compile_counts": dict(trainer.compile_counts),
                "hits": s.hit_modules,
                "writes": s.writes,
                "mesh": {k: int(v) for k, v in trainer.mesh.shape.items() if v > 1},
            }
        )
    )


def run(workload: str, cache: str) -> dict:
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", workload, cache],
        capture_output=True,
        text=True,
        env={**os.environ, "TQDM_DISABLE": "1"},
    )
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{workload} {cache} failed:\n{p.stderr[-4000:]}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    r["process"] = wall
    return r


def served(r: dict) -> str:
    stages = [s for s in ("train", "validate") if f"jit_{s}_step" in r["hits"]]
    others = len(r["hits"]) - len(stages)
    return f"{'+'.join(stages) or '-'} (+{others} other)" if r["hits"] else "-"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--child", nargs=2, metavar=("WORKLOAD", "CACHE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(*args.child)
        return

    import jax

    print(f"jax {jax.__version__}, {os.cpu_count()} CPU cores; {args.rounds} rounds of off/cold/warm per workload\n")
    summary = []
    for workload in args.workloads:
        results: dict[str, list[dict]] = {m: [] for m in MODES}
        with tempfile.TemporaryDirectory(prefix="jaxlight-startup-") as tmp:
            for i in range(args.rounds):
                cache = os.path.join(tmp, f"round{i}")
                results["off"].append(run(workload, "off"))
                results["cold"].append(run(workload, cache))
                results["warm"].append(run(workload, cache))
        print(f"{workload} (mesh {results['cold'][0]['mesh'] or '1 device'})")
        print(
            f"{'mode':>5} {'first step s':>13} {'(CPU s)':>8} {'fit s':>7} {'process s':>10}  {'compiles':<22} "
            f"{'cache writes':>12}  served from the cache"
        )
        med = {}
        for m in MODES:
            rs = results[m]
            med[m] = {
                k: statistics.median(r[k] for r in rs) for k in ("first_step", "first_step_cpu", "fit", "process")
            }
            counts = ", ".join(f"{k} {v}" for k, v in sorted(rs[-1]["compile_counts"].items()))
            print(
                f"{m:>5} {med[m]['first_step']:>13.2f} {med[m]['first_step_cpu']:>8.2f} {med[m]['fit']:>7.2f} "
                f"{med[m]['process']:>10.2f}  "
                f"{counts:<22} {rs[-1]['writes']:>12}  {served(rs[-1])}"
            )
        per_round = [w["first_step"] / c["first_step"] for c, w in zip(results["cold"], results["warm"])]
        ratio = med["warm"]["first_step"] / med["cold"]["first_step"]
        cpu_ratio = med["warm"]["first_step_cpu"] / med["cold"]["first_step_cpu"]
        summary.append((workload, ratio, statistics.median(per_round), cpu_ratio))
        print(
            f"first step, warm / cold: {ratio:.3f} (median of per-round ratios {statistics.median(per_round):.3f}; "
            f"CPU time {cpu_ratio:.3f}); cold with cache / off: "
            f"{med['cold']['first_step'] / med['off']['first_step']:.3f}\n"
        )
    for workload, ratio, per_round, cpu_ratio in summary:
        print(
            f"{workload:>10}: first step warm / cold {ratio:.3f} (per-round median {per_round:.3f}, CPU time "
            f"{cpu_ratio:.3f}); goal <= 0.5"
        )


if __name__ == "__main__":
    main()
