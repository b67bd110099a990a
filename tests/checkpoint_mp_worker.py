"""One process of the two-process preemption test (tests/test_checkpoint_preemption.py), 4 CPU devices each.

Usage: python tests/checkpoint_mp_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR JSON_OPTIONS
Options: max_steps, ckpt_path, wait_signal_at (process 1 only: after that micro-batch print READY and wait
for a signal), process_local (each process reads its own shuffled StatefulDataLoader share). Prints PREEMPTED/DONE lines; process 0 writes OUT_DIR/params.npz when fit returns.
"""

import json
import os
import sys
import time

pid, nproc, port, out, opts = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], json.loads(sys.argv[5]))
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["TQDM_DISABLE"] = "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.xla_flags import cpu_xla_flags  # noqa: E402  (imports no jax)

os.environ["XLA_FLAGS"] = cpu_xla_flags(4)

import jaxlight as jl  # noqa: E402

os.environ.update(JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES=str(nproc), JAX_PROCESS_ID=str(pid))
assert jl.distributed.initialize() is True

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from tests.checkpoint_models import DropoutClassifier, arrays  # noqa: E402


class Driver(jl.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if pid == 1 and trainer.position.micro_batches == opts.get("wait_signal_at"):
            pre = next(c for c in trainer.callbacks if isinstance(c, jl.callbacks.Preemption))
            print("READY", flush=True)
            deadline = time.time() + 60
            while pre.received is None and time.time() < deadline:
                time.sleep(0.01)


x, y = arrays(64)
data = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 64, 8)]
if opts.get("process_local"):
    # Each process reads its own half through its own shuffled loader, so the loaders' positions and
    # generator states differ between processes and each must resume from its own.
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    share = torch.utils.data.TensorDataset(
        torch.from_numpy(x[pid * 32 : (pid + 1) * 32]), torch.from_numpy(y[pid * 32 : (pid + 1) * 32])
    )
    gen = torch.Generator()
    gen.manual_seed(100 + pid)
    data = StatefulDataLoader(share, batch_size=4, shuffle=True, generator=gen)
ckpt = jl.callbacks.ModelCheckpoint(dirpath=os.path.join(out, "ckpts"), every_n_train_steps=5, save_last="link")
t = jl.Trainer(
    strategy="ddp",
    devices=4,
    max_steps=opts["max_steps"],
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    callbacks=[Driver(), ckpt],
    process_local_batches=bool(opts.get("process_local")),
)
try:
    t.fit(DropoutClassifier(), data, ckpt_path=opts.get("ckpt_path"))
except jl.Preempted as e:
    print(f"PREEMPTED step={e.step} micro={t.position.micro_batches} path={e.path}", flush=True)
    raise
params = {k: np.asarray(multihost_utils.process_allgather(v, tiled=True)) for k, v in t.train_state.params.items()}
if pid == 0:
    np.savez(os.path.join(out, "params.npz"), **params)
print(f"DONE step={t.global_step}", flush=True)
jl.distributed.shutdown()
