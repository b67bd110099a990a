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
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxlight as jl
from jaxlight.state import split_models
from jaxlight.step import StepBuilder, TrainState
from jaxlight.strategies.placement import batch_spec
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


def compile_step(strategy, dims: dict, batch: int, seq: int):
    """The trainer's placement of the LM's state and its train step, compiled on abstract inputs."""
    trainer = jl.Trainer(
        strategy=strategy, devices=8, enable_progress_bar=False, logger=False, enable_checkpointing=False
    )
    module = LM(**dims)
    module.trainer = trainer
    trainer.lightning_module = module

    def build():
        module.configure_model()
        models = {"net": module.net}
        object.__delattr__(module, "net")
        return models

    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())), nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(build)
    parts, aparams, arest = split_models(abstract)
    psh, rsh = trainer._var_shardings(parts, aparams, arest)  # the trainer's own placement (guardrail included)
    trainer._param_shardings = psh
    tx = module.configure_optimizers()
    opt_shapes = jax.eval_shape(tx.init, aparams)
    osh = trainer._opt_shardings(opt_shapes, aparams)
    rep = NamedSharding(trainer.mesh, P())
    builder = StepBuilder(module, parts, trainer.precision_plugin, tx)
    state_sh = TrainState(psh, rsh, osh, {}, rep)
    sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
    state = TrainState(
        jax.tree.map(sds, aparams, psh),
        jax.tree.map(sds, arest, rsh),
        jax.tree.map(sds, opt_shapes, osh),
        {},
        jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
    )
    tokens = jax.ShapeDtypeStruct(
        (batch, seq + 1), jnp.int32, sharding=NamedSharding(trainer.mesh, batch_spec(trainer.mesh, 2))
    )
    t0 = time.perf_counter()
    with trainer._mesh_ctx():
        compiled = (
            jax.jit(builder.train_step, donate_argnums=0, out_shardings=(state_sh, None, None))
            .lower(state, {"tokens": tokens}, jax.ShapeDtypeStruct((), jnp.int32))
            .compile()
        )
    secs = time.perf_counter() - t0
    return trainer, compiled, shard_bytes(aparams, psh), shard_bytes(opt_shapes, osh), secs, aparams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--embed", type=int, default=1024)
    ap.add_argument("--mlp", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
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
    widths = [max(len(r[i]) for r in table) for i in range(len(hdr))]
    for i, r in enumerate(table):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print(
        "collective counts are ops in the compiled HLO (a tuple all-reduce of many gradients counts once); "
        "XLA:CPU emits FSDP's gradient reduce-scatter as all-reduce + dynamic-slice"
    )


if __name__ == "__main__":
    main()
