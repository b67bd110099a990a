"""Subprocess side of tests/test_adversary_loop.py: a fit that stalls, for the signal tests.

Usage: python tests/adversary_loop_worker.py OUT_DIR JSON_OPTIONS
Options:
  max_steps         fit's max_steps (default 6)
  stall_at          the train loader blocks before this batch of the first epoch (prints STALLED on stderr)
  val_stall         the validation loader blocks before its first batch (prints STALLED)
  prefetch          Trainer(prefetch=...) (default 2; 0 reads batches on the main thread)
  stop_timeout      Preemption(stop_timeout=...) (default: the callback's)
  ckpt_path         fit's ckpt_path
  mp                [process_id, num_processes, port]: one process of a jax.distributed run (4 devices)
  die_at            (with mp) this process kills itself (SIGKILL) after this train batch
A blocked loader gives up after 90 s with an error, so no worker outlives its test's timeout.
Prints READY once the first train step is done, PREEMPTED step=N path=P when stopped by a signal, and
DONE step=N when fit returns. The in-process tests import ``Loader`` from here.
"""

import json
import os
import signal
import sys
import threading

if __name__ == "__main__":  # a subprocess: its own devices (the in-process tests import Loader only)
    out, opts = sys.argv[1], json.loads(sys.argv[2])
    mp = opts.get("mp")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.xla_flags import cpu_xla_flags  # imports no jax

    os.environ["XLA_FLAGS"] = cpu_xla_flags(4 if mp else 8)
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["TQDM_DISABLE"] = "1"

import jaxlight as jl
from tests.checkpoint_models import arrays


class Loader:
    """A re-iterable of ``n`` (x, y) batches of 8 rows that may block before batch ``stall_at`` of its
    first pass: it sets ``stalled`` (an Event), says so on stderr and waits ``block_s`` seconds, then
    raises, so a stop that never comes fails the run instead of hanging it."""

    def __init__(self, stall_at=None, what="train", n=8, block_s=90.0):
        x, y = arrays(8 * n)
        self.batches = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 8 * n, 8)]
        self.stall_at, self.what, self.block_s, self.passes = stall_at, what, block_s, 0
        self.stalled, self._never = threading.Event(), threading.Event()

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        self.passes += 1
        for i, b in enumerate(self.batches):
            if self.passes == 1 and i == self.stall_at:
                print(f"STALLED {self.what}", file=sys.stderr, flush=True)
                self.stalled.set()
                if not self._never.wait(self.block_s):
                    raise RuntimeError(f"{self.what} loader stalled for {self.block_s} s and nothing stopped the run")
            yield b


def main() -> None:
    if mp:
        pid, nproc, port = mp
        os.environ.update(
            JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES=str(nproc), JAX_PROCESS_ID=str(pid)
        )
        assert jl.distributed.initialize() is True
    from tests.checkpoint_models import DropoutClassifier

    class Driver(jl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 1:
                print("READY", flush=True)
            if mp and trainer.position.micro_batches == opts.get("die_at"):
                print(f"DYING {jl.distributed.process_index()}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    callbacks = [Driver(), jl.callbacks.ModelCheckpoint(dirpath=os.path.join(out, "ckpts"), save_last="link")]
    if "stop_timeout" in opts:
        callbacks.append(jl.callbacks.Preemption(stop_timeout=opts["stop_timeout"]))
    t = jl.Trainer(
        strategy="ddp",
        devices=4 if mp else 8,
        max_steps=opts.get("max_steps", 6),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        prefetch=opts.get("prefetch", 2),
        callbacks=callbacks,
    )
    val = Loader(0, "validation") if opts.get("val_stall") else None
    try:
        t.fit(DropoutClassifier(), Loader(opts.get("stall_at")), val, ckpt_path=opts.get("ckpt_path"))
    except jl.Preempted as e:
        print(f"PREEMPTED step={e.step} path={e.path}", flush=True)
        raise
    print(f"DONE step={t.global_step}", flush=True)


if __name__ == "__main__":
    main()
