"""Mixture of experts under ddp (experts replicated), fsdp and ep on the same 8 simulated CPU devices.

One table, every configuration side by side: E in {8, 16} experts, top-k in {1, 2}, dropless and
capacity factor 1.25, under "ddp", "fsdp" and "ep". Per configuration: tokens/s of the compiled
train step (Adam; median of alternating rounds), the bytes one device holds (parameters + Adam
state, from the arrays' shards; the expert weights alone; XLA's temporaries from
``memory_analysis()``), and the bytes the step's all-to-alls move per device (summed from the
compiled HLO, forward and backward) against the formula
``tokens x top_k x features x 2 x dtype size`` (a device's tokens, dispatched and returned once;
the backward pass repeats both, so the ratio column divides by twice the formula).

A second, short table is the measurement behind the dropless default (``jl.nn.MoE(matmul=...)``):
one MoE layer's forward + backward on one device with tokens sorted by expert and multiplied in
padded blocks, with ``jax.lax.ragged_dot``, and with every expert computed on every token.

    python benchmarks/experts.py            # --quick (the default): a few minutes on 2 CPU cores
    python benchmarks/experts.py --full     # larger model and batch
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np

import jaxlight as jl
from benchmarks.common import time_compiled_steps
from jaxlight.nn.moe import grouped_ffn
from jaxlight.summary import fmt_bytes, per_device_bytes
from tests.expert_models import ExpertLM, token_batches

_A2A = re.compile(r"=\s*(.+?)\s+all-to-all(?:-start)?\(")
_SHAPE = re.compile(r"\b(f32|bf16|f16|s32)\[([\d,]*)\]")
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4}


def a2a_bytes(hlo: str) -> tuple[int, int]:
    """(float bytes, int bytes) the all-to-alls of a compiled program exchange per device (their results)."""
    fl = it = 0
    for typ in _A2A.findall(hlo):
        for d, dims in _SHAPE.findall(typ):
            n = int(np.prod([int(x) for x in dims.split(",") if x])) * _BYTES[d]
            if d == "s32":
                it += n
            else:
                fl += n
    return fl, it


def print_table(table: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for i, r in enumerate(table):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def strategies_table(args) -> None:
    dims = dict(vocab=256, embed=args.embed, hidden=args.hidden)
    data = token_batches(2, args.batch, seq=args.seq + 1, vocab=256)
    tokens = args.batch * args.seq
    configs = [(s, e, k, c) for e in (8, 16) for k in (1, 2) for c in (None, 1.25) for s in ("ddp", "fsdp", "ep")]
    trainers, rows = {}, {}
    t_start = time.perf_counter()
    for s, e, k, c in configs:
        name = f"{s}/E{e}/k{k}/{'dropless' if c is None else f'cap{c}'}"
        t = jl.Trainer(
            strategy=s,
            devices=8,
            max_epochs=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        with contextlib.redirect_stdout(io.StringIO()):
            t.fit(ExpertLM(lr=1e-3, opt="adam", experts=e, top_k=k, capacity_factor=c, **dims), data[:1])
        trainers[name] = t
        st = t.train_state
        experts = [v for p, v in st.params.items() if "/moe/w_" in p]
        mem = t.compiled["train"].memory_analysis()
        fl, it = a2a_bytes(t.compiled["train"].as_text())
        rows[name] = dict(
            strategy=s,
            e=e,
            k=k,
            c=c,
            mesh=",".join(f"{a}={n}" for a, n in t.mesh.shape.items() if n > 1),
            state=per_device_bytes(st.params) + per_device_bytes(st.opt_state),
            experts=per_device_bytes(experts),
            temp=mem.temp_size_in_bytes,
            a2a=fl,
            a2a_ids=it,
            dropped=float(t.callback_metrics["dropped"]),
        )
    compile_s = time.perf_counter() - t_start
    times = time_compiled_steps(trainers, data[1], args.steps, args.rounds)
    print(
        f"MoE LM: vocab 256, features {args.embed}, expert hidden {args.hidden}, one MoE layer; global batch "
        f"{args.batch} x {args.seq} = {tokens} tokens ({tokens // 8} per device), Adam, 8 CPU devices, "
        f"jax {jax.__version__}; {len(configs)} configurations compiled in {compile_s:.0f}s, median of "
        f"{args.rounds} alternating rounds x {args.steps} steps"
    )
    hdr = (
        "strategy",
        "E",
        "top-k",
        "dispatch",
        "mesh",
        "tokens/s",
        "params+Adam/dev",
        "experts/dev",
        "temp/dev",
        "dropped",
        "all-to-all/dev/step",
        "formula",
        "ratio",
    )
    table = [hdr]
    for name, r in rows.items():
        ms = float(np.median(times[name]))
        formula = (tokens // 8) * r["k"] * args.embed * 2 * 4
        ratio = f"{r['a2a'] / (2 * formula):.2f}" if r["a2a"] else "-"
        a2a = fmt_bytes(r["a2a"]) + (f" (+{fmt_bytes(r['a2a_ids'])} ids)" if r["a2a_ids"] else "") if r["a2a"] else "0"
        table.append(
            (
                r["strategy"],
                str(r["e"]),
                str(r["k"]),
                "dropless" if r["c"] is None else f"capacity {r['c']}",
                r["mesh"],
                f"{tokens / ms * 1e3:,.0f}",
                fmt_bytes(r["state"]),
                fmt_bytes(r["experts"]),
                fmt_bytes(r["temp"]),
                f"{r['dropped']:.3f}",
                a2a,
                fmt_bytes(formula),
                ratio,
            )
        )
    print_table(table)
    print(
        "formula: a device's tokens x top_k x features x 2 (dispatch + return) x 4 bytes, forward only; ratio = "
        "measured (forward + backward) / (2 x formula). Dropless ep reserves room for the worst case (every token "
        "of a device may choose experts of one other device): n x min(top_k, E/n) / top_k times the formula; "
        "capacity 1.25 moves ceil(1.25 x length x top_k / E) rows per expert and sequence. 'dropped': fraction "
        "of assignments dropped at the first step. On CPU every device is the same 2 cores: tokens/s compares "
        "the work each layout does, not interconnects."
    )


def _dense(x, w_in, w_out, idx, gates):
    """Every expert on every token, then each token's top-k outputs picked and weighted."""
    h = jax.nn.gelu(jnp.einsum("tf,efh->teh", x, w_in))
    y = jnp.einsum("teh,ehf->tef", h, w_out)
    return jnp.einsum("tkf,tk->tf", jnp.take_along_axis(y, idx[:, :, None], 1), gates)


def _sorted(matmul):
    def run(x, w_in, w_out, idx, gates):
        t, k = idx.shape
        rows = grouped_ffn(x[jnp.arange(t * k) // k], idx.reshape(-1), w_in.shape[0], w_in, w_out, jax.nn.gelu, matmul)
        return jnp.einsum("tkf,tk->tf", rows.reshape(t, k, -1), gates)

    return run


def dispatch_table(args) -> None:
    t, f, h = args.kernel_tokens, args.embed, args.hidden
    table = [("experts", "top-k", "blocks (default) ms", "ragged_dot ms", "every expert ms")]
    for e in (8, 16):
        for k in (1, 2):
            key = jax.random.key(0)
            x = jax.random.normal(key, (t, f))
            w_in = jax.random.normal(key, (e, f, h)) * f**-0.5
            w_out = jax.random.normal(key, (e, h, f)) * h**-0.5
            p = jax.nn.softmax(x @ jax.random.normal(jax.random.key(1), (f, e)))
            gates, idx = jax.lax.top_k(p, k)
            out = []
            for fn in (_sorted("blocks"), _sorted("ragged"), _dense):
                loss = lambda x, a, b, fn=fn, idx=idx, gates=gates: jnp.sum(fn(x, a, b, idx, gates) ** 2)
                step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
                jax.block_until_ready(step(x, w_in, w_out))
                best = np.inf
                for _ in range(args.rounds):
                    t0 = time.perf_counter()
                    jax.block_until_ready(step(x, w_in, w_out))
                    best = min(best, time.perf_counter() - t0)
                out.append(f"{best * 1e3:.1f}")
            table.append((str(e), str(k), *out))
    print(
        f"\ndropless grouped matmul, one device: forward + backward of one MoE layer, {t} tokens, features {f}, "
        f"hidden {h} (best of {args.rounds})"
    )
    print_table(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", default=True, help="small sizes (the default)")
    size.add_argument("--full", action="store_true", help="a larger model and batch")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.full:
        args.embed, args.hidden, args.batch, args.seq, args.kernel_tokens = 256, 1024, 64, 128, 8192
        args.steps = args.steps or 5
    else:
        args.embed, args.hidden, args.batch, args.seq, args.kernel_tokens = 64, 256, 32, 64, 4096
        args.steps = args.steps or 3
    strategies_table(args)
    dispatch_table(args)


if __name__ == "__main__":
    main()
