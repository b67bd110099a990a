"""Subprocess side of tests/test_adversary_checkpoint.py: a run that holds a checkpoint directory.

Usage: python tests/adversary_checkpoint_worker.py DIRPATH RELEASE_FILE
A fit with a ModelCheckpoint on DIRPATH that pauses after its first step, prints "HOLDING <pid>", and goes on
once RELEASE_FILE exists (or after 120 s, so that a test that dies cannot leave it running), then finishes.
"""

import os
import sys
import time

dirpath, release = sys.argv[1], sys.argv[2]
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["TQDM_DISABLE"] = "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.xla_flags import cpu_xla_flags  # noqa: E402  (imports no jax)

os.environ["XLA_FLAGS"] = cpu_xla_flags(1)

import warnings  # noqa: E402

import jaxlight as jl  # noqa: E402
from tests.checkpoint_models import DropoutClassifier, arrays  # noqa: E402

warnings.filterwarnings("ignore")


class Pause(jl.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == 1:
            print(f"HOLDING {os.getpid()}", flush=True)
            deadline = time.monotonic() + 120
            while not os.path.exists(release) and time.monotonic() < deadline:
                time.sleep(0.05)


x, y = arrays(32)
data = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)]
ckpt = jl.callbacks.ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2)
trainer = jl.Trainer(
    devices=1,
    max_steps=4,
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    callbacks=[Pause(), ckpt],
)
trainer.fit(DropoutClassifier(), data)
print(f"DONE {trainer.global_step}", flush=True)
