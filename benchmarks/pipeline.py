"""Pipeline parallelism, measured side by side in one run (8 simulated CPU devices by default).

Table 1: for S in {2, 4, 8} stages and M in {S, 2S, 4S} microbatches, GPipe and circular (R=2):
ms per SGD(momentum) step of the LayerStack transformer pipelined over S devices, against the
same model unpipelined (data parallel) on the same S devices; the bubble the schedule implies,
(S-1)/(R*M+S-1), beside the one measured, 1 - t_ddp/t_pp (every stage computes every tick in an
SPMD pipeline, idle ticks included, so the extra time over data parallel is the bubble plus the
pipeline's communication); per-device bytes of parameters + optimizer state.

Table 2 (per schedule, S=4 by default): GPipe, circular (R=2), 1F1B and interleaved 1F1B (R=2) at
M in {S, 2S, 4S}: the
bubble read from the schedule's ticks (idle forward slots over all forward slots), the compiled
step's temp bytes per device (``memory_analysis().temp_size_in_bytes``: activations and other
scratch), and ms per step, each beside GPipe's at the same M.

Table 3: the circular schedule's regrouping of natural-order weights into interleaved chunks
(one all-to-all over stage for the weights, one for their gradients): its ms per step.

Table 4: compile time of a LayerStack of 4 and 32 layers on one device (one scanned body), and
of the same blocks unrolled in a Python loop.

    python benchmarks/pipeline.py [--embed 128 --layers 16 --batch 64 --seq 32 --steps 5] [--only-schedules]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxlight as jl
from jaxlight.state import merge_models, split_models
from jaxlight.strategies import DataParallel, Strategy, pipeline_1f1b
from jaxlight.strategies.pipeline import PipelineConfig, PipelineParallel, active_pipeline, bubble, stack_params
from jaxlight.strategies.placement import batch_spec, named, param_specs
from jaxlight.summary import fmt_bytes, per_device_bytes
from tests.pipeline_models import StackLM
from tests.strategy_models import Block


def _build(dims: dict):
    with nnx.use_eager_sharding(False):
        return split_models({"net": StackLM(nnx.Rngs(0), **dims)})


@contextlib.contextmanager
def _traced(strategy: Strategy, mesh):
    with (
        jax.set_mesh(mesh),
        nnx.use_eager_sharding(False),
        jl.nn.axis_rules(mesh, strategy.logical_rules),
        strategy.trace_context(mesh),
    ):
        yield


def _step_fn(parts):
    tx = optax.sgd(0.01, momentum=0.9)

    def loss(params, tokens):
        logits = merge_models(parts, params, {})["net"](tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def forward(params, batch):  # the trainer's loss-function signature, which the 1F1B schedule splits
        value = loss(params, batch["tokens"])
        return value, (value, {}, {}, {}, {})

    def step(params, opt, tokens):
        cfg = active_pipeline()
        if cfg is not None and cfg.schedule == pipeline_1f1b.SCHEDULE:
            keys = frozenset(stack_params(params, parts.params.variables))
            (value, _), grads = pipeline_1f1b.value_and_grad(forward, params, {"tokens": tokens}, {}, keys, cfg)
        else:
            value, grads = jax.value_and_grad(loss)(params, tokens)
        upd, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, upd), opt, value

    return tx, step


def measure(strategy: Strategy, devices, parts, params, tokens, steps: int) -> dict:
    """Compile one SGD step under ``strategy`` on ``devices`` and time it (best of ``steps``: the
    machine may be shared, and the fastest step is the one least disturbed)."""
    mesh = strategy.build_mesh(devices)
    strategy.check_model(params, parts.params.variables, mesh)
    strategy.check_batch({"tokens": tokens.shape}, dict(mesh.shape))
    psh = {k: named(mesh, s) for k, s in param_specs(params, parts.params.variables, strategy, mesh).items()}
    tx, step = _step_fn(parts)
    p = jax.device_put(params, psh)
    shapes = jax.eval_shape(tx.init, p)
    osh = jax.tree_util.tree_map_with_path(lambda path, _: psh.get(path[-1].key, named(mesh, ())), shapes)
    opt = jax.jit(tx.init, out_shardings=osh)(p)
    t = jax.device_put(tokens, NamedSharding(mesh, batch_spec(mesh, 2)))
    t0 = time.perf_counter()
    with _traced(strategy, mesh):
        fn = jax.jit(step, donate_argnums=(0, 1), out_shardings=(psh, osh, named(mesh, ())))
        compiled = fn.lower(p, opt, t).compile()
    compile_s = time.perf_counter() - t0
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        p, opt, loss = compiled(p, opt, t)
        loss.block_until_ready()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return {
        "temp": compiled.memory_analysis().temp_size_in_bytes,
        "ms": 1e3 * min(times),
        "compile_s": compile_s,
        "bytes": per_device_bytes(p) + per_device_bytes(opt),
        "loss": float(loss),
    }


def regroup_ms(stages: int, repeats: int, devices, parts, params, steps: int) -> float:
    """ms per step of the circular schedule's weight regroup, forward (weights) and backward (gradients)."""
    strategy = Strategy(PipelineParallel(stages, schedule="circular", repeats=repeats))
    mesh = strategy.build_mesh(devices)
    psh = {k: named(mesh, s) for k, s in param_specs(params, parts.params.variables, strategy, mesh).items()}
    stack = {k: jax.device_put(v, psh[k]) for k, v in params.items() if "/blocks/" in k}

    def regroup(a):  # [L, ...] -> [S, R, k, ...] with S on stage, as run_pipeline does
        L = a.shape[0]
        b = jnp.swapaxes(a.reshape((repeats, stages, L // (stages * repeats)) + a.shape[1:]), 0, 1)
        return jax.lax.with_sharding_constraint(b, NamedSharding(mesh, P("stage")))

    def back(b):
        a = jnp.swapaxes(b, 0, 1).reshape((-1,) + b.shape[3:])
        return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P("stage")))

    with jax.set_mesh(mesh):
        f = jax.jit(lambda s: jax.tree.map(lambda a: back(regroup(a) * 1.0), s)).lower(stack).compile()
    for _ in range(2):
        jax.block_until_ready(f(stack))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(stack))
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def tick_bubble(stages: int, microbatches: int, schedule: str, repeats: int = 1) -> float:
    """Idle share of a stage's forward slots, counted from the schedule's ticks (the backward's is the same)."""
    if schedule == pipeline_1f1b.SCHEDULE:
        return pipeline_1f1b.bubble(stages, microbatches, repeats)
    cfg = PipelineConfig(stages, microbatches, schedule, repeats, None)  # type: ignore[arg-type]
    return 1 - repeats * microbatches / cfg.ticks


def schedules_table(S: int, repeats: int, parts, params, tokens, layers: int, steps: int) -> None:
    """Table 2: per schedule and M, bubble from the ticks, temp bytes per device and ms per step."""
    devices = jax.devices()[:S]
    hdr = (
        f"{'M':>3} {'schedule':>9} {'R':>2} | {'bubble':>6} | {'temp/dev':>10} {'x gpipe':>7} | "
        f"{'ms/step':>8} {'x gpipe':>7} | {'loss':>7}"
    )
    print(f"\nschedules on S={S} stages ({S} devices):")
    print(hdr)
    print("-" * len(hdr))
    for M in (S, 2 * S, 4 * S):
        if tokens.shape[0] % M:
            continue
        ref = None
        for sched, R in (("gpipe", 1), ("circular", repeats), ("1f1b", 1), ("1f1b", repeats)):
            if layers % (S * R):
                continue
            r = measure(Strategy(PipelineParallel(S, M, sched, R)), devices, parts, params, tokens, steps)
            ref = ref or r
            print(
                f"{M:>3} {sched:>9} {R:>2} | {tick_bubble(S, M, sched, R):6.1%} | {fmt_bytes(r['temp']):>10} "
                f"{r['temp'] / ref['temp']:7.3f} | {r['ms']:8.1f} {r['ms'] / ref['ms']:7.2f} | {r['loss']:7.4f}"
            )


class Unrolled(nnx.Module):
    def __init__(self, n: int, rngs: nnx.Rngs, embed: int, heads: int, mlp: int) -> None:
        self.blocks = nnx.List([Block(embed, heads, mlp, rngs) for _ in range(n)])

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def compile_seconds(make, x) -> float:
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(make())

    def loss(st):
        return jnp.mean(nnx.merge(graphdef, st)(x) ** 2)

    t0 = time.perf_counter()
    jax.jit(jax.grad(loss)).lower(state).compile()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--embed", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--mlp", type=int, default=256)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--repeats", type=int, default=2, help="R of the circular schedule")
    ap.add_argument("--skip-compile-table", action="store_true")
    ap.add_argument("--schedule-stages", type=int, default=4, help="S of the per-schedule table")
    ap.add_argument("--only-schedules", action="store_true", help="print the per-schedule table only")
    a = ap.parse_args()

    dims = dict(vocab=a.vocab, embed=a.embed, heads=a.heads, mlp=a.mlp, layers=a.layers)
    parts, params, _ = _build(dims)
    params = jax.device_get(params)  # host copies: every placement gets its own buffers (the step donates them)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, a.vocab, size=(a.batch, a.seq + 1)).astype(np.int32)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {len(jax.devices())} devices")
    print(f"model: {dims}, batch {a.batch} x seq {a.seq}, SGD(momentum); best of {a.steps} steps\n")

    if a.only_schedules:
        schedules_table(a.schedule_stages, a.repeats, parts, params, tokens, a.layers, a.steps)
        return

    rows = []
    for S in a.stages:
        devices = jax.devices()[:S]
        base = measure(Strategy(DataParallel()), devices, parts, params, tokens, a.steps)
        rows.append((S, "-", "ddp", "-", None, base, None))
        for sched, R in (("gpipe", 1), ("circular", a.repeats)):
            for M in (S, 2 * S, 4 * S):
                if a.layers % (S * R) or a.batch % M:
                    continue
                pp = Strategy(PipelineParallel(S, M, sched, R))
                r = measure(pp, devices, parts, params, tokens, a.steps)
                rows.append((S, M, sched, R, bubble(S, M, R), r, base))

    hdr = (
        f"{'S':>2} {'M':>3} {'schedule':>9} {'R':>2} | {'bubble':>6} {'measured':>8} | "
        f"{'ms/step':>8} {'ddp ms':>7} {'x ddp':>6} | {'bytes/dev':>10} {'x ddp':>6} | {'compile s':>9} {'loss':>7}"
    )
    print(hdr)
    print("-" * len(hdr))
    for S, M, sched, R, b, r, base in rows:
        if base is None:
            print(
                f"{S:>2} {'-':>3} {'ddp':>9} {'-':>2} | {'-':>6} {'-':>8} | {r['ms']:8.1f} {'':>7} {'':>6} | "
                f"{fmt_bytes(r['bytes']):>10} {'':>6} | {r['compile_s']:9.1f} {r['loss']:7.4f}"
            )
            continue
        meas = 1 - base["ms"] / r["ms"]
        print(
            f"{S:>2} {M:>3} {sched:>9} {R:>2} | {b:6.1%} {meas:8.1%} | {r['ms']:8.1f} {base['ms']:7.1f} "
            f"{r['ms'] / base['ms']:6.2f} | {fmt_bytes(r['bytes']):>10} {r['bytes'] / base['bytes']:6.3f} | "
            f"{r['compile_s']:9.1f} {r['loss']:7.4f}"
        )

    schedules_table(a.schedule_stages, a.repeats, parts, params, tokens, a.layers, a.steps)

    print(f"\ncircular (R={a.repeats}) weight regroup, weights + gradients, per step:")
    for S in a.stages:
        if a.layers % (S * a.repeats):
            continue
        ms = regroup_ms(S, a.repeats, jax.devices()[:S], parts, params, a.steps)
        circ = [r for r in rows if r[0] == S and r[2] == "circular"]
        share = f" ({ms / circ[0][5]['ms']:.1%} of the M={circ[0][1]} circular step)" if circ else ""
        print(f"  S={S}: {ms:.2f} ms{share}")

    if a.skip_compile_table:
        return
    print("\ncompile time of value_and_grad, one device (s):")
    x = jnp.asarray(rng.normal(size=(8, a.seq, a.embed)), jnp.float32)
    res = {}
    for n in (4, 32):
        res[("stack", n)] = compile_seconds(
            lambda n=n: jl.nn.LayerStack(lambda r: Block(a.embed, a.heads, a.mlp, r), n, rngs=nnx.Rngs(0)), x
        )
        res[("loop", n)] = compile_seconds(lambda n=n: Unrolled(n, nnx.Rngs(0), a.embed, a.heads, a.mlp), x)
    for kind in ("stack", "loop"):
        print(
            f"  {kind:>5}: 4 layers {res[(kind, 4)]:6.2f}   32 layers {res[(kind, 32)]:6.2f}   "
            f"ratio {res[(kind, 32)] / res[(kind, 4)]:5.2f}"
        )


if __name__ == "__main__":
    main()
