"""One process of the two-process no-pickle resume test (tests/test_checkpoint_safety.py), 4 CPU devices each.

Usage: python tests/checkpoint_safety_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR JSON_OPTIONS
Each process reads its own half of the data through its own shuffled StatefulDataLoader
(process_local_batches); Adam, EMA and a callback with state; a checkpoint every 4 steps (all kept).
Option ckpt_path: resume from it with every unpickling entry point disabled for the whole fit.
Process 0 writes OUT_DIR/final.npz (parameters and EMA) when fit returns.
"""

import json
import os
import sys

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
import torch  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from tests.checkpoint_models import DropoutClassifier, arrays  # noqa: E402
from tests.checkpoint_safety_common import RichState, no_pickle, rich_state, same  # noqa: E402

x, y = arrays(64)
share = torch.utils.data.TensorDataset(
    torch.from_numpy(x[pid * 32 : (pid + 1) * 32]), torch.from_numpy(y[pid * 32 : (pid + 1) * 32])
)
gen = torch.Generator()
gen.manual_seed(100 + pid)
data = StatefulDataLoader(share, batch_size=4, shuffle=True, generator=gen)  # 8 batches per epoch
ema, rich = jl.callbacks.EMA(decay=0.9), RichState()
ckpt = jl.callbacks.ModelCheckpoint(dirpath=os.path.join(out, "ckpts"), every_n_train_steps=4, save_top_k=-1)
t = jl.Trainer(
    strategy="ddp",
    devices=4,
    max_steps=12,  # 1.5 epochs: a resume at step 4 crosses into epoch 1 (a new shuffle from the saved generator)
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    callbacks=[rich, ema, ckpt],
    process_local_batches=True,
)
if opts.get("ckpt_path"):
    with no_pickle():
        print("PICKLE DISABLED", flush=True)
        t.fit(DropoutClassifier(), data, ckpt_path=opts["ckpt_path"])
    same(rich.loaded, rich_state(4))  # callback state is process 0's, restored on every process
else:
    t.fit(DropoutClassifier(), data)
final = {f"params/{k}": v for k, v in t.train_state.params.items()}
final.update({f"ema/{k}": v for k, v in ema.ema_params(t).items()})
final = {k: np.asarray(multihost_utils.process_allgather(v, tiled=True)) for k, v in final.items()}
if pid == 0:
    np.savez(os.path.join(out, "final.npz"), **final)
print(f"DONE step={t.global_step} batches={rich.count}", flush=True)
jl.distributed.shutdown()
