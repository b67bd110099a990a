"""Subprocess side of the kill-during-save test and benchmark (tests/test_checkpoint_bookkeeping.py,
benchmarks/kill_during_save.py): a fit whose steps are faster than an async save commits.

Usage: python tests/checkpoint_kill_worker.py OUT_DIR JSON_OPTIONS
Options: save_last (true or "link"), top_k, monitor ("score": pseudo-random per step, kept by rank; "train_loss":
decreasing with noise; null: every save replaces the previous), max_steps, ckpt_path, hidden (model width).
Saves every step into OUT_DIR/ckpts; prints "STEP n" after each step and "RESUMED n" with the global step the fit
starts from.
"""

import json
import os
import sys

out, opts = sys.argv[1], json.loads(sys.argv[2])
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["TQDM_DISABLE"] = "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.xla_flags import cpu_xla_flags  # noqa: E402  (imports no jax)

os.environ["XLA_FLAGS"] = cpu_xla_flags(1)

import warnings  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxlight as jl  # noqa: E402
from tests.checkpoint_models import DropoutClassifier  # noqa: E402

warnings.filterwarnings("ignore")


class Scored(DropoutClassifier):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        # a score with no trend (the loss changes every step): each step is kept or evicted by its own rank
        self.log("score", jnp.sin(loss * 1000.0))
        return loss


class Report(jl.Callback):
    def on_train_start(self, trainer, module):
        print(f"RESUMED {trainer.global_step}", flush=True)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        print(f"STEP {trainer.global_step}", flush=True)


rng = np.random.default_rng(0)
hidden = opts.get("hidden", 512)
x = rng.normal(size=(64, 8)).astype(np.float32)
y = x[:, :4].argmax(-1).astype(np.int32)
data = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 64, 8)]
monitor = opts.get("monitor", "score")
ckpt = jl.callbacks.ModelCheckpoint(
    dirpath=os.path.join(out, "ckpts"),
    monitor=monitor,
    mode="max" if monitor == "score" else "min",
    save_top_k=opts.get("top_k", 2),
    save_last=opts["save_last"],
    every_n_train_steps=1,
)
trainer = jl.Trainer(
    devices=1,
    max_steps=opts["max_steps"],
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
    callbacks=[Report(), ckpt],
)
trainer.fit(Scored(hidden=hidden), data, ckpt_path=opts.get("ckpt_path"))
print(f"DONE {trainer.global_step}", flush=True)
