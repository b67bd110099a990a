"""One fresh process of tests/test_compile_cache_rerun.py.

Usage:
  python tests/compile_cache_rerun_worker.py matrix OUT.json CACHE [NAME ...]
      trains every configuration of MATRIX (or the NAMEs given) for 2 steps, one after another, with
      jaxlight's compile cache in CACHE; OUT.json gets, per configuration, the losses (float.hex),
      a SHA-256 of the final parameters' bytes, the programs JAX read from the cache and those the
      reload guard refused. OUT.json is rewritten after each configuration, so a run that hangs
      still tells how far it got. With $RERUN_DUMP_HLO set to a directory, each configuration's
      compiled train step is written there as NAME.hlo.txt.
  python tests/compile_cache_rerun_worker.py deadlock CACHE REPS
      the smallest plain-JAX program seen to deadlock once reloaded from JAX's persistent cache in
      CACHE (jax 0.10.2, XLA:CPU); prints "rep N" after each of REPS calls, then "done".

The XLA_FLAGS of the parent (8 simulated CPU devices, tests/conftest.py) are inherited by "matrix";
"deadlock" sets its own (8 devices, XLA's default code generator: the one users get).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys

mode = sys.argv[1]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TQDM_DISABLE", "1")


def deadlock(cache: str, reps: int) -> None:
    """A ring of collective-permutes in a loop over mesh axis "b" and an all-gather over axis "a", with
    independent elementwise work around them so that XLA:CPU runs the program's thunks concurrently.
    Compiled, it runs forever; read back from the cache, the all-gather is no longer ordered after the
    loop (see jaxlight.compile_cache.reload_hazard) and devices wait in different collectives."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_compilation_cache_dir", cache)  # JAX's own cache: no jaxlight involved
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    extra, width = 8, 4096

    def body(x, y):
        ring = [(i, (i + 1) % 4) for i in range(4)]

        def step(i, carry):
            x, acc = carry
            x = jax.lax.ppermute(x, "b", ring)
            return x, acc + jnp.tanh(x)

        _, acc = jax.lax.fori_loop(0, 3, step, (x, x))
        gathered = jax.lax.all_gather(y, "a", tiled=True)
        side = [f(v * (k + 1)) for k in range(extra) for f, v in ((jnp.sin, x), (jnp.cos, y))]
        return (acc, gathered, *side)

    specs = (P("a", "b"), P(None, "b")) + (P("a", "b"),) * (2 * extra)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("a", "b"), P("a", "b")), out_specs=specs, check_vma=False))
    x = jnp.arange(8.0 * width).reshape(8, width) / width
    for i in range(reps):
        jax.block_until_ready(f(x, 2 * x))
        print("rep", i, flush=True)
    print("done", flush=True)


if mode == "deadlock":
    deadlock(sys.argv[2], int(sys.argv[3]))
    sys.exit(0)

# ---------------------------------------------------------------------------------------------- matrix
out_path, cache = sys.argv[2], sys.argv[3]
os.environ["JAXLIGHT_COMPILE_CACHE"] = cache

jax_hits: list[str] = []


class _JaxHitLog(logging.Handler):
    """JAX's own record of a persistent-cache hit: "Persistent compilation cache hit for 'jit_x' with key ..."."""

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith("Persistent compilation cache hit for '"):
            jax_hits.append(msg.split("'")[1])


_log = logging.getLogger("jax._src.compiler")
_log.setLevel(logging.DEBUG)
_log.addHandler(_JaxHitLog())
_log.propagate = False

import contextlib  # noqa: E402
import io  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxlight as jl  # noqa: E402
from examples.models import CausalTransformer, GPTConfig  # noqa: E402
from jaxlight.compile_cache import cache_stats  # noqa: E402
from jaxlight.strategies import FSDP  # noqa: E402
from jaxlight.strategies.pipeline import PipelineParallel  # noqa: E402
from jaxlight.strategies.sequence import SequenceParallel  # noqa: E402
from tests.core_models import quiet  # noqa: E402
from tests.expert_models import ExpertLM  # noqa: E402
from tests.expert_models import token_batches as expert_batches  # noqa: E402
from tests.pipeline_models import PipeLM  # noqa: E402
from tests.strategy_models import LM, token_batches  # noqa: E402

warnings.simplefilter("ignore")  # placement advice about tiny parameters is not what this checks
SEQ = 32
SEQ_CFG = GPTConfig(d_model=32, n_layers=2, n_heads=4, seq_len=SEQ, vocab=64)


class SeqLM(jl.LightningModule):
    """The scanned causal transformer of tests/test_sequence_training.py, smaller."""

    def configure_model(self) -> None:
        self.net = CausalTransformer(SEQ_CFG, nnx.Rngs(0))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return optax.softmax_cross_entropy_with_integer_labels(self.net(x), y).mean()

    def configure_optimizers(self):
        return optax.sgd(0.3, momentum=0.9)


def seq_batches() -> list:
    rng = np.random.default_rng(0)
    t = rng.integers(0, 64, size=(2, 8, SEQ + 1)).astype(np.int32)
    return [(b[:, :-1], b[:, 1:]) for b in t]


def lm() -> tuple:
    return LM(embed=32, heads=4, mlp=32, vocab=64), token_batches(2, 8, vocab=64)


def pipe() -> tuple:
    return PipeLM(vocab=32, embed=32, heads=4, mlp=32, layers=4), token_batches(2, 16, vocab=32)


def seq() -> tuple:
    return SeqLM(), seq_batches()


def expert() -> tuple:
    return ExpertLM(vocab=64, embed=32, hidden=64), expert_batches(2, 16)


MATRIX = {
    "ddp": ("ddp", lm),
    "fsdp": (FSDP(min_shard=256), lm),
    "tp": ("tp", lm),
    "fsdp+tp": ("fsdp+tp", lm),
    "fsdp+offload": ("fsdp+offload", lm),
    "sp-ulysses": ("sp", seq),
    "fsdp+sp-ulysses": ("fsdp+sp", seq),
    "fsdp+sp-allgather": (FSDP() + SequenceParallel(mode="allgather"), seq),
    "sp-ring": (SequenceParallel(mode="ring"), seq),
    "sp-ring-unbalanced": (SequenceParallel(mode="ring", load_balance=False), seq),
    "fsdp+sp-ring": (SequenceParallel(4, mode="ring") + FSDP(), seq),
    # issue 37's case: hung on a rerun from a warm cache
    "fsdp+sp-ring-unbalanced": (SequenceParallel(4, mode="ring", load_balance=False) + FSDP(), seq),
    "fsdp+sp+offload": ("fsdp+sp+offload", seq),
    "pp-gpipe": (PipelineParallel(4), pipe),
    "pp-circular": (PipelineParallel(2, 4, "circular", 2), pipe),
    "ep": ("ep", expert),
    "fsdp+ep": ("fsdp+ep", expert),
}


def params_digest(trainer) -> str:
    h = hashlib.sha256()
    for k, v in sorted(trainer.train_state.params.items()):
        h.update(k.encode())
        h.update(np.ascontiguousarray(jax.device_get(v)).tobytes())
    return h.hexdigest()


class Losses(jl.Callback):
    def __init__(self) -> None:
        self.losses: list = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss).hex())


names = sys.argv[4:] or list(MATRIX)
result: dict = {}
for name in names:
    strategy, make = MATRIX[name]
    model, data = make()
    cb = Losses()
    start = time.perf_counter()
    hits_before, refused_before = len(jax_hits), getattr(cache_stats(), "refused_modules", [])
    trainer = jl.Trainer(max_steps=2, devices=8, strategy=strategy, callbacks=[cb], **quiet())
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.fit(model, train_dataloaders=data)
    result[name] = {
        "losses": cb.losses,
        "params": params_digest(trainer),
        "jax_hits": jax_hits[hits_before:],
        "refused": getattr(cache_stats(), "refused_modules", [])[len(refused_before) :],
        "seconds": round(time.perf_counter() - start, 2),
    }
    if os.environ.get("RERUN_DUMP_HLO"):  # the train step's optimised HLO, for the test's own check
        with open(os.path.join(os.environ["RERUN_DUMP_HLO"], name + ".hlo.txt"), "w") as fh:
            fh.write(trainer.compiled["train"].as_text())
    with open(out_path + ".tmp", "w") as fh:
        json.dump(result, fh)
    os.replace(out_path + ".tmp", out_path)
    print("trained", name, flush=True)
