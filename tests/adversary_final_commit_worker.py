"""Subprocess side of tests/test_adversary_final_commit.py: SIGTERM while fit waits for its last async commit.

Usage: python tests/adversary_final_commit_worker.py OUT_DIR JSON_OPTIONS
Options: max_steps (4), every (checkpoint every n steps, 2), commit_delay (seconds the final save's publication
is held back, 1.5), stop_timeout (Preemption's, 60).

A tiny model is fit with an async ModelCheckpoint saving at the last step. The final save's commit is made slow
(its publication sleeps ``commit_delay`` s in orbax's commit thread), and the first checkpoint wait after
``on_fit_end`` sends this process SIGTERM before it waits: the signal deterministically arrives while fit waits
for its last commit. Prints ``PREEMPTED step=... path=...`` and exits 143 when preempted, ``DONE`` otherwise.
"""

import json
import os
import signal
import sys
import time

out, opts = sys.argv[1], json.loads(sys.argv[2])
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["TQDM_DISABLE"] = "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jaxlight as jl  # noqa: E402
from jaxlight.checkpoint import publish, writer  # noqa: E402
from tests.checkpoint_models import DropoutClassifier, arrays, quiet  # noqa: E402

MAX_STEPS = opts.get("max_steps", 4)
state = {"fit_ended": False, "signalled": False}

_committed = publish.Publisher.committed


def slow_committed(self, orbax_path: str) -> None:
    if f"step={MAX_STEPS}" in os.path.basename(orbax_path):  # the last step's save: staged, published late
        time.sleep(opts.get("commit_delay", 1.5))
    _committed(self, orbax_path)


_wait = writer.CheckpointWriter.wait


def signalling_wait(self) -> None:
    if state["fit_ended"] and not state["signalled"]:
        state["signalled"] = True
        print(f"SIGNAL at={time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
    _wait(self)


publish.Publisher.committed = slow_committed
writer.CheckpointWriter.wait = signalling_wait


class Driver(jl.Callback):
    def on_fit_end(self, trainer, module):
        state["fit_ended"] = True


x, y = arrays(64)
data = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 64, 8)]
ckpt = jl.callbacks.ModelCheckpoint(
    dirpath=os.path.join(out, "ckpts"), every_n_train_steps=opts.get("every", 2), save_top_k=-1
)
pre = jl.callbacks.Preemption(stop_timeout=opts.get("stop_timeout", 60.0))
t = jl.Trainer(
    callbacks=[Driver(), pre, ckpt],
    max_steps=MAX_STEPS,
    **quiet(devices=1, enable_checkpointing=None),
)
try:
    t.fit(DropoutClassifier(), data)
except jl.Preempted as e:
    print(f"PREEMPTED step={e.step} path={e.path}", flush=True)
    raise
print(f"DONE step={t.global_step}", flush=True)
