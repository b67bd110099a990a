"""One process of the rank-failure tests (tests/test_rank_failure.py), 2 CPU devices each.

Usage: python tests/rank_failure_worker.py OUT_DIR [JSON_OPTIONS]
The coordinator comes from the environment (``jaxlight launch`` sets it, or the test does). A tiny
data-parallel fit with a checkpoint every step; rank ``fail_rank`` (default 1) raises
``ValueError("boom 123")`` in ``on_train_batch_end`` at step ``fail_step`` (default 2), after writing
OUT_DIR/failed_at (wall-clock time). The others keep training (their next step's collective waits for
the failed rank). A process that gets to the end of fit writes OUT_DIR/done_<rank>.
"""

import json
import os
import sys
import time

out = sys.argv[1]
opts = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["TQDM_DISABLE"] = "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.xla_flags import cpu_xla_flags  # noqa: E402  (imports no jax)

os.environ["XLA_FLAGS"] = cpu_xla_flags(2)

import jaxlight as jl  # noqa: E402

assert jl.distributed.initialize() is True

import jax  # noqa: E402

from tests.checkpoint_models import DropoutClassifier, arrays  # noqa: E402

rank = jax.process_index()
fail_rank, fail_step = opts.get("fail_rank", 1), opts.get("fail_step", 2)


class Boom(jl.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if rank == fail_rank and trainer.global_step == fail_step:
            with open(os.path.join(out, "failed_at"), "w") as f:
                f.write(str(time.time()))
            raise ValueError("boom 123")


x, y = arrays(64)
data = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 64, 8)]
ckpt = jl.callbacks.ModelCheckpoint(dirpath=os.path.join(out, "ckpts"), every_n_train_steps=1, save_top_k=-1)
trainer = jl.Trainer(
    strategy="ddp",
    devices=2,
    max_steps=opts.get("max_steps", 200),
    max_epochs=None,
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
    callbacks=[Boom(), ckpt],
)
trainer.fit(DropoutClassifier(), data)
with open(os.path.join(out, f"done_{rank}"), "w") as f:
    f.write(str(time.time()))
print(f"DONE rank={rank} step={trainer.global_step}", flush=True)
