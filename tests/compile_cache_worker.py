"""One fresh process of the compile-cache tests (tests/test_compile_cache.py).

Usage: python tests/compile_cache_worker.py OUT.json SCENARIO [ARGS...]

Scenarios:
  train CACHE [DEVICES STRATEGY]  fit a tiny LM with validation; CACHE is a directory, "default"
                                  (compile_cache=None) or "off"
  probe CACHE                     a Trainer, then one small jitted function (no fit)
  conflict DIR_A DIR_B            several Trainers in one process asking for different caches
  user_jax DIR_U DIR_OTHER        the user configured JAX's cache before any Trainer
  mp PID NPROC PORT CACHE         one process of a jax.distributed run (2 CPU devices each)

Writes OUT.json: the Trainer's compile_cache, compile counts, JAX's own log of persistent-cache
hits (module names, from the "jax._src.compiler" logger), jaxlight's cache counters, every
warning raised, and for "train" the losses (float.hex, exact) with the parameters in OUT.npz.
The XLA_FLAGS of the parent (8 simulated CPU devices, from tests/conftest.py) are inherited.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import sys
import warnings

out, scenario, args = sys.argv[1], sys.argv[2], sys.argv[3:]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TQDM_DISABLE", "1")
if scenario == "mp":
    from tests.xla_flags import cpu_xla_flags  # imports no jax

    os.environ["XLA_FLAGS"] = cpu_xla_flags(2)
    os.environ["JAX_PLATFORMS"] = "cpu"

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

caught = warnings.catch_warnings(record=True)
warning_list = caught.__enter__()
warnings.simplefilter("always")

import jaxlight as jl  # noqa: E402

if scenario == "mp":
    pid, nproc, port = int(args[0]), int(args[1]), args[2]
    os.environ.update(
        JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES=str(nproc), JAX_PROCESS_ID=str(pid)
    )
    assert jl.distributed.initialize() is True

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jaxlight.compile_cache import cache_stats  # noqa: E402
from tests import helpers  # noqa: E402
from tests.helpers import Losses  # noqa: E402
from tests.strategy_models import LM, token_batches  # noqa: E402


class LMV(LM):
    """The shared tiny LM with a validation step, so an eval stage is compiled too."""

    def validation_step(self, batch, batch_idx):
        tokens = batch["tokens"]
        logits = self.net(tokens[:, :-1])
        self.log("val_loss", optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean())


# the shared quiet Trainer arguments, every fit here one epoch
quiet = functools.partial(helpers.quiet, max_epochs=1)


def cache_arg(text: str):
    return {"default": None, "off": False}.get(text, text)


def fit(trainer: jl.Trainer) -> tuple[LMV, Losses]:
    batches = token_batches(3, 16)
    cb = Losses()
    trainer.callbacks.append(cb)
    model = LMV()
    trainer.fit(model, batches, batches[:2])
    return model, cb


def small() -> None:
    """One compilation, much cheaper than a fit: where does its cache entry go?"""
    jax.block_until_ready(jax.jit(lambda x: x * 2 + 1)(np.arange(4.0, dtype=np.float32)))


result: dict = {}
if scenario == "train":
    devices = int(args[1]) if len(args) > 1 else 1
    strategy = args[2] if len(args) > 2 else "auto"
    trainer = jl.Trainer(strategy=strategy, devices=devices, compile_cache=cache_arg(args[0]), **quiet())
    model, cb = fit(trainer)
    params = helpers.host_params(trainer)
    np.savez(out.replace(".json", ".npz"), **params)
    result.update(
        compile_cache=trainer.compile_cache,
        compile_counts=dict(trainer.compile_counts),
        losses=[float(x).hex() for x in cb.losses],
        val_loss=float(trainer.callback_metrics["val_loss"]).hex(),
        hlo_has_train_step=("train_step" in trainer.compiled["train"].as_text()),
    )
elif scenario == "probe":
    result["compile_cache"] = jl.Trainer(compile_cache=cache_arg(args[0]), **quiet()).compile_cache
    small()
elif scenario == "conflict":
    a, b = args
    result["returned"] = [
        jl.Trainer(compile_cache=a, **quiet()).compile_cache,
        jl.Trainer(compile_cache=b, **quiet()).compile_cache,
        jl.Trainer(compile_cache=b, **quiet()).compile_cache,  # the same request again: no second warning
        jl.Trainer(compile_cache=False, **quiet()).compile_cache,
        jl.Trainer(**quiet()).compile_cache,  # the default accepts the cache in use, silently
    ]
    jl.Trainer(compile_cache=b, **quiet())
    small()
elif scenario == "user_jax":
    user_dir, other = args
    jax.config.update("jax_compilation_cache_dir", user_dir)
    result["returned"] = [
        jl.Trainer(**quiet()).compile_cache,
        jl.Trainer(compile_cache=other, **quiet()).compile_cache,
    ]
    small()
    result["min_compile_time"] = jax.config.jax_persistent_cache_min_compile_time_secs
    result["xla_caches"] = jax.config.jax_persistent_cache_enable_xla_caches
elif scenario == "mp":
    trainer = jl.Trainer(strategy="ddp", devices=2, compile_cache=args[3], **quiet())
    _, cb = fit(trainer)
    result.update(
        process_index=jax.process_index(),
        compile_cache=trainer.compile_cache,
        losses=[float(x.addressable_data(0)).hex() for x in cb.losses],
    )
else:
    raise SystemExit(f"unknown scenario {scenario!r}")

caught.__exit__(None, None, None)
result.update(
    jax_hits=jax_hits,
    stats=dataclasses.asdict(cache_stats()),
    warnings=[f"{w.category.__name__}: {w.message}" for w in warning_list],
)
with open(out, "w") as f:
    json.dump(result, f)
if scenario == "mp":
    jl.distributed.shutdown()
