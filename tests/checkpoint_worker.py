"""Subprocess side of the preemption / kill tests (tests/test_checkpoint_*.py).

Usage: python tests/checkpoint_worker.py OUT_DIR JSON_OPTIONS
Options: max_steps, ckpt_path, wait_signal_at (micro-batch after which it prints
READY and waits for a signal), hidden/din (model size), every (checkpoint every n
steps), announce_saves (print INFLIGHT when a step starts while the previous async
save is still being written).
Writes OUT_DIR/params.npz when fit returns; exits 143 when preempted.
"""

import json
import os
import sys
import time

out, opts = sys.argv[1], json.loads(sys.argv[2])
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["TQDM_DISABLE"] = "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.xla_flags import cpu_xla_flags  # noqa: E402  (imports no jax)

os.environ["XLA_FLAGS"] = cpu_xla_flags(8)

import numpy as np  # noqa: E402

import jaxlight as jl  # noqa: E402
from tests.checkpoint_models import DropoutClassifier, host_params, stateful_loader, trainer  # noqa: E402


class Driver(jl.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if opts.get("announce_saves"):
            ck = trainer.checkpoint_callback._checkpointer
            # runs before ModelCheckpoint's hook: the save of the previous step may still be writing
            if ck is not None and jl.checkpoint.save_in_flight(ck):
                print(f"INFLIGHT {trainer.global_step}", flush=True)
        if trainer.position.micro_batches == opts.get("wait_signal_at"):
            pre = next(c for c in trainer.callbacks if isinstance(c, jl.callbacks.Preemption))
            print("READY", flush=True)
            deadline = time.time() + 60
            while pre.received is None and time.time() < deadline:
                time.sleep(0.01)


din, hidden = opts.get("din", 8), opts.get("hidden", 32)
model = DropoutClassifier(din=din, hidden=hidden)
t = trainer(
    os.path.join(out, "ckpts"),
    callbacks=[Driver()],
    every_n_train_steps=opts.get("every", 2),
    max_steps=opts["max_steps"],
)
try:
    t.fit(model, stateful_loader(din=din), ckpt_path=opts.get("ckpt_path"))
except jl.Preempted as e:
    print(f"PREEMPTED step={e.step} micro={t.position.micro_batches} path={e.path}", flush=True)
    raise
np.savez(os.path.join(out, "params.npz"), **host_params(t))
print(f"DONE step={t.global_step}", flush=True)
