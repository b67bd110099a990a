"""Subprocess side of tests/test_adversary_state.py: a fit of one of its cases, checkpointing every step, that
stops after a given step and waits to be killed (SIGKILL) while the step's asynchronous save may still be written.

Usage: python tests/adversary_state_worker.py OUT_DIR JSON_OPTIONS
Options:
  case        "offload" (HostOffload(stream=4) under ddp, Adam + EMA + accumulation), "moe" (an MoE LM under
              "ep") or "metric" (an nnx.MultiMetric held by the module, updated in every step)
  max_steps   fit's max_steps
  hang_at     after this global step (its save started) prints "HANG n" and sleeps until killed (120 s at most)
Checkpoints go to OUT_DIR/ckpts (every step, last.ckpt a link). The in-process tests import ``CASES``,
``make_trainer`` and ``make_module`` from here, so both sides build the same run.
"""

from __future__ import annotations

import json
import os
import sys
import time

if __name__ == "__main__":  # a subprocess: its own 8 devices (the in-process tests import the builders only)
    out, opts = sys.argv[1], json.loads(sys.argv[2])
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.xla_flags import cpu_xla_flags  # imports no jax

    os.environ["XLA_FLAGS"] = cpu_xla_flags(8)
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["TQDM_DISABLE"] = "1"

import numpy as np
import optax
from flax import nnx

import jaxlight as jl
from jaxlight.callbacks import EMA
from jaxlight.strategies import DataParallel, HostOffload
from tests.core_models import quiet

CASES = ("offload", "moe", "metric")
ACCUMULATE = {"offload": 2, "moe": 1, "metric": 1}  # micro-batches per optimizer step


class MetricNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(4, 16, rngs=rngs)
        self.l2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


class MetricModule(jl.LightningModule):
    """An ``nnx.MultiMetric`` held by the module: updated in every training step and reset at each epoch's end,
    so what it holds mid-epoch is the running totals of the epoch's batches so far (state, not parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"), accuracy=nnx.metrics.Accuracy())
        self.epochs: list[dict[str, float]] = []

    def configure_model(self) -> None:
        self.net = MetricNet(nnx.Rngs(0))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        self.metrics.update(loss=loss, logits=logits, labels=y)
        return loss

    def on_train_epoch_end(self) -> None:
        self.epochs.append({k: float(v) for k, v in self.metrics.compute().items()})
        self.metrics.reset()

    def configure_optimizers(self):
        return optax.adam(1e-2)


def metric_batches() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype(np.float32)
    y = ((x[:, 0] > x[:, 1]).astype(np.int32) + (x[:, 2] > 0.5)).astype(np.int32)
    return [(x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)]  # 4 batches an epoch


def make_module(case: str) -> jl.LightningModule:
    if case == "offload":
        from tests.strategy_models import LM

        return LM(embed=32, mlp=64, vocab=32, heads=2)
    if case == "moe":
        from tests.expert_models import ExpertLM

        return ExpertLM()
    return MetricModule()


def make_data(case: str, max_steps: int):
    if case == "offload":
        from tests.strategy_models import token_batches

        return token_batches(2 * max_steps * ACCUMULATE[case], 16, vocab=32)  # one epoch
    if case == "moe":
        from tests.expert_models import token_batches

        return token_batches(max_steps, 16)
    return metric_batches()


def make_trainer(case: str, max_steps: int, ckpt_dir: str | None = None, callbacks=()) -> jl.Trainer:
    """The run of ``case``; with ``ckpt_dir``, a checkpoint after every step there (last.ckpt a link)."""
    cbs = list(callbacks)
    if case == "offload":
        cbs.insert(0, EMA(decay=0.9))  # its state is offloaded too
    if ckpt_dir is not None:
        cbs.append(jl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_last="link"))
    strategy = {"offload": DataParallel() + HostOffload(stream=4), "moe": "ep", "metric": "auto"}[case]
    return jl.Trainer(
        strategy=strategy,
        devices=1 if case == "metric" else 8,
        max_steps=max_steps,
        max_epochs=-1,
        accumulate_grad_batches=ACCUMULATE[case],
        callbacks=cbs,
        **quiet(enable_checkpointing=ckpt_dir is not None),
    )


class HangAt(jl.Callback):
    """Before the first batch after global step ``at`` (whose save has been started) says so and sleeps: the test
    kills the process there, an asynchronous save possibly half written."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.at and trainer.position.micro_batches % trainer.accumulate_grad_batches == 0:
            print(f"HANG {trainer.global_step}", flush=True)
            time.sleep(120)
            raise RuntimeError("not killed within 120 s")


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    case = opts["case"]
    trainer = make_trainer(case, opts["max_steps"], os.path.join(out, "ckpts"), callbacks=[HangAt(opts["hang_at"])])
    trainer.fit(make_module(case), make_data(case, opts["max_steps"]))
    print(f"DONE {trainer.global_step}", flush=True)
