"""Host offload on one accelerator: where the bytes live, what it costs, and that values do not change.

``strategies.py --offload`` measures offload on 8 simulated CPU devices, where "host" and "device"
are the same RAM and XLA:CPU's ``memory_analysis()`` reports no host bytes. This script is for a
real accelerator (one GPU): it trains the same LM with ``"ddp"`` and ``"ddp+offload"`` (Adam + EMA)
from the same initialisation on the same batches and prints

- the compiled step's ``memory_analysis()``: device and host argument bytes, temporaries;
- bytes of params / Adam state / EMA by memory kind, counted from the arrays' shardings;
- device memory the trained state holds: the allocator's bytes in use after the fit minus before
  (``Device.memory_stats()``, where the backend has one);
- ms/step, median of alternating rounds on the trainer's compiled step;
- max |delta| of every parameter and EMA leaf after the same steps (offload moves bytes, it must
  not change a value: expected 0);
- the same for ``HostOffload(stream=N)`` (``--stream``, default 8; 0 leaves the row out): the
  offloaded state fetched, updated and written back in N groups inside the step as a software
  pipeline (groups 0 and 1 fetched while the forward and backward pass run, group g+1 fetched while
  group g updates and group g-1 is written back);
- the measured host<->device bandwidth each way (median time of a ``device_put`` of ``--bw-mb`` MB
  into pinned host memory and back) and, per offload row, the bound
  ``max(resident step, bytes each way / bandwidth)`` (the copies in and out overlapping each other
  and the compute) and ``offloaded / bound`` (issue 31: target <= 1.15 on a GPU; on CPU "host" and
  "device" are the same RAM and the ratio is only printed);
- a smaller run with async checkpoints every 2 steps, stopped half way and resumed from ``last``,
  against the same steps straight through (expected 0), with and without offload.

    python benchmarks/offload.py                       # 1024-wide, 4 layers (~70 M params)
    python benchmarks/offload.py --embed 256 --layers 2 --steps 3 --rounds 2   # quick, any backend
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Trainer(deterministic=True): exact comparisons on a GPU need XLA's deterministic reductions (the
# embedding gradient's scatter-add is atomic otherwise); read when JAX starts, ignored by XLA:CPU
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true").strip()

import jax
import numpy as np

import jaxlight as jl
from benchmarks.common import time_compiled_steps
from jaxlight.callbacks import EMA, ModelCheckpoint
from jaxlight.summary import fmt_bytes, per_device_bytes
from tests.strategy_models import LM, token_batches


def _flat(tree) -> dict[str, np.ndarray]:
    # copies through jax.device_get: np.asarray of a pinned_host array can be a zero-copy view that
    # the array caches, and a buffer with such an external reference cannot be donated (XLA:GPU)
    return {
        jax.tree_util.keystr(p): np.array(x) for p, x in jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]
    }


def _in_use() -> int | None:
    stats = jax.devices()[0].memory_stats()
    return None if not stats else stats.get("bytes_in_use")


def fit(strategy: Any, dims: dict, data: list, steps: int, ckpt_dir: str | None = None, resume: bool = False):
    callbacks = [EMA(decay=0.99)]
    if ckpt_dir:  # async saves every 2 steps while the next steps run
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1, save_last=True))
    trainer = jl.Trainer(
        strategy=strategy,
        devices=1,
        max_steps=steps,
        callbacks=callbacks,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=bool(ckpt_dir),
        enable_model_summary=False,
        deterministic=True,
    )
    trainer.fit(LM(**dims), data[: len(data) - 1], ckpt_path="last" if resume else None)
    return trainer


def resume_check(strategy: Any, data: list, steps: int) -> float:
    """Train ``steps // 2`` steps with async checkpoints every 2 steps, then resume from ``last`` (the
    newest of those, mid-epoch) to ``steps``; returns max |delta| of params, Adam state and EMA against
    the same steps run straight through."""
    dims = dict(embed=256, mlp=1024, heads=8, layers=2, vocab=1024)
    data = [{"tokens": b["tokens"] % dims["vocab"]} for b in data]
    straight = _flat(fit(strategy, dims, data, steps).train_state)
    with tempfile.TemporaryDirectory() as d:
        fit(strategy, dims, data, steps // 2, ckpt_dir=d)
        resumed = fit(strategy, dims, data, steps, ckpt_dir=d, resume=True)
        if resumed.global_step != steps:
            raise RuntimeError(f"resumed run ended at step {resumed.global_step}, expected {steps}")
        got = _flat(resumed.train_state)
    assert got.keys() == straight.keys()
    return max(float(np.max(np.abs(got[k].astype(np.float64) - straight[k]))) for k in got)


def host_bandwidth(mbytes: int, reps: int = 5) -> tuple[float, float]:
    """(host->device, device->host) bytes per second of one device: the median time of ``reps`` transfers
    of an ``mbytes`` MB float32 array between its device memory and its pinned host memory."""
    from jax.sharding import SingleDeviceSharding

    dev = jax.devices()[0]
    on_dev, on_host = SingleDeviceSharding(dev), SingleDeviceSharding(dev, memory_kind="pinned_host")
    n = mbytes * 10**6 // 4
    x = jax.device_put(np.ones(n, np.float32), on_dev).block_until_ready()
    h = jax.device_put(x, on_host).block_until_ready()

    def timed(src, sharding):
        out = []
        for _ in range(reps + 1):  # the first transfer warms up (allocation, pinning)
            t0 = time.perf_counter()
            jax.device_put(src, sharding).block_until_ready()
            out.append(time.perf_counter() - t0)
        return 4 * n / statistics.median(out[1:])

    return timed(h, on_dev), timed(x, on_host)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--embed", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10, help="trained steps compared, and steps per timed round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--stream", type=int, default=8, help="groups of HostOffload(stream=N) for its row; 0: no row")
    ap.add_argument("--bw-mb", type=int, default=256, help="MB per transfer when measuring host<->device bandwidth")
    args = ap.parse_args()
    if args.steps < 4:  # the resume check stops at steps // 2 and needs a step checkpoint (every 2) by then
        ap.error(f"--steps must be at least 4, got {args.steps}")

    dims = dict(embed=args.embed, mlp=4 * args.embed, heads=8, layers=args.layers, vocab=args.vocab)
    data = token_batches(args.steps + 1, args.batch, seq=args.seq + 1, vocab=args.vocab)
    dev = jax.devices()[0]
    print(
        f"jax {jax.__version__}, {dev.platform} {dev.device_kind}; memories: {[m.kind for m in dev.addressable_memories()]}"
    )

    strategies: dict[str, Any] = {"ddp": "ddp", "ddp+offload": "ddp+offload"}
    if args.stream:
        S = jl.strategies
        strategies[f"ddp+offload(stream={args.stream})"] = S.DataParallel() + S.HostOffload(stream=args.stream)
    names = tuple(strategies)
    trainers, held = {}, {}
    for name in names:
        t0 = time.perf_counter()
        before = _in_use()
        trainers[name] = fit(strategies[name], dims, data, args.steps)
        after = _in_use()
        held[name] = None if before is None or after is None else after - before
        print(f"{name}: {args.steps} steps trained in {time.perf_counter() - t0:.1f} s (compile included)")
    ref = trainers["ddp"]

    times = time_compiled_steps(trainers, data[-1], args.steps, args.rounds)
    # values: the same steps from the same initialisation (and the same timed steps since) must give the
    # same parameters and EMA; read after timing, as a host read of a pinned_host leaf pins its buffer
    deltas: dict[str, dict[str, float]] = {}
    for name in names[1:]:
        deltas[name] = {}
        for group in ("params", "callback_state"):
            a, b = _flat(getattr(ref.train_state, group)), _flat(getattr(trainers[name].train_state, group))
            assert a.keys() == b.keys(), (group, sorted(set(a) ^ set(b)))
            deltas[name][group] = max(float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) for k in a)

    n_params = sum(int(np.prod(x.shape)) for x in ref.train_state.params.values())
    print(
        f"\nLM {n_params / 1e6:.1f} M params, Adam + EMA, batch {args.batch} x {args.seq}; "
        f"median of {args.rounds} alternating rounds x {args.steps} steps"
    )
    hdr = (
        "strategy",
        "args dev / host (memory_analysis)",
        "temp dev",
        "Adam dev / host",
        "EMA dev / host",
        "held dev",
        "ms/step",
        "ratio",
    )
    rows = [hdr]
    base_ms = statistics.median(times["ddp"])
    for name in names:
        t = trainers[name]
        mem = t.compiled["train"].memory_analysis()
        st = t.train_state
        host_args = getattr(mem, "host_argument_size_in_bytes", 0)
        ms = statistics.median(times[name])
        rows.append(
            (
                name,
                f"{fmt_bytes(mem.argument_size_in_bytes)} / {fmt_bytes(host_args)}",
                fmt_bytes(mem.temp_size_in_bytes),
                f"{fmt_bytes(per_device_bytes(st.opt_state, 'device'))} / {fmt_bytes(per_device_bytes(st.opt_state, 'host'))}",
                f"{fmt_bytes(per_device_bytes(st.callback_state, 'device'))} / {fmt_bytes(per_device_bytes(st.callback_state, 'host'))}",
                "n/a" if held[name] is None else fmt_bytes(held[name]),
                f"{ms:.2f}",
                f"{ms / base_ms:.2f}x",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(hdr))]
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    h2d, d2h = host_bandwidth(args.bw_mb)
    print(
        f"\nhost<->device bandwidth ({args.bw_mb} MB device_put, median of 5): host->device {h2d / 1e9:.2f} GB/s, "
        f"device->host {d2h / 1e9:.2f} GB/s"
    )
    rows = [("strategy", "bytes each way", "copy in", "copy out", "bound", "ms/step", "offloaded / bound")]
    for name in names[1:]:
        st = trainers[name].train_state
        moved = per_device_bytes((st.opt_state, st.callback_state), "host")
        t_in, t_out = moved / h2d * 1e3, moved / d2h * 1e3
        bound = max(base_ms, t_in, t_out)  # copies in and out run at once, and under the compute
        ms = statistics.median(times[name])
        rows.append(
            (
                name,
                fmt_bytes(moved),
                f"{t_in:.2f} ms",
                f"{t_out:.2f} ms",
                f"{bound:.2f} ms",
                f"{ms:.2f}",
                f"{ms / bound:.2f}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    print(
        "bound = max(resident step, bytes each way / bandwidth); target offloaded / bound <= 1.15 on a GPU "
        "(on CPU host and device memory are the same RAM: printed only)"
    )
    for name, d in deltas.items():
        print(
            f"\nmax |delta| after {args.steps + args.rounds * (args.steps + 1)} identical steps, {name} vs none: "
            f"params {d['params']:.3g}, EMA {d['callback_state']:.3g} (expected 0: offload only moves bytes)"
        )
    print("held dev: the allocator's bytes in use after that strategy's fit minus before it (its live state)")
    for name in names:
        delta = resume_check(strategies[name], data, args.steps)
        print(
            f"{name}: {args.steps} steps with async checkpoints every 2, stopped at {args.steps // 2} and resumed "
            f"from 'last': max |delta| of params, Adam and EMA vs straight through = {delta:.3g} (expected 0)"
        )


if __name__ == "__main__":
    main()
