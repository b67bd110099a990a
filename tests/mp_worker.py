"""One process of the multi-process test (tests/test_multiprocess.py): 4 simulated CPU devices per process.

Usage: python tests/mp_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR
Trains the shared tiny transformer under "ddp" and "fsdp" on the global mesh of
every process's devices, each process reading only its share of every global
batch (and once more under "fsdp" with every process reading whole global
batches), and writes losses and gathered parameters (process 0) to OUT_DIR.
"""

import json
import os
import sys

pid, nproc, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["TQDM_DISABLE"] = "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.xla_flags import cpu_xla_flags  # noqa: E402  (imports no jax)

os.environ["XLA_FLAGS"] = cpu_xla_flags(4)

import jaxlight as jl  # noqa: E402  (importing jaxlight starts no JAX backend)

# Before any JAX computation; the same variables a launcher would set.
os.environ.update(JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES=str(nproc), JAX_PROCESS_ID=str(pid))
assert jl.distributed.initialize() is True

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from jaxlight.data import data_partition  # noqa: E402
from tests.helpers import Losses  # noqa: E402
from tests.strategy_models import LM, token_batches  # noqa: E402

assert jax.process_count() == nproc and jax.device_count() == 4 * nproc and jax.local_device_count() == 4


result = {"process_index": jax.process_index(), "cpu_collectives": jax.config.jax_cpu_collectives_implementation}
global_batches = token_batches(3, 32)
# "fsdp_global": every process's loader yields the whole global batch (process_local_batches=False)
for run in ("ddp", "fsdp", "fsdp_global"):
    strategy, process_local = run.split("_")[0], not run.endswith("_global")
    trainer = jl.Trainer(
        strategy=strategy,
        devices=4,
        max_epochs=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        process_local_batches=process_local,
        log_every_n_steps=1,
        default_root_dir=os.path.join(out, f"{run}_p{pid}"),
    )
    part = data_partition(trainer.mesh)
    rows = 32 // part.count if process_local else 32
    # With process_local_batches this process's loader holds only its share of each global batch.
    local = (
        [{"tokens": b["tokens"][part.index * rows : (part.index + 1) * rows]} for b in global_batches]
        if process_local
        else global_batches
    )
    cb = Losses()
    trainer.callbacks.append(cb)
    model = LM()
    trainer.fit(model, local)
    params = {
        k: np.asarray(multihost_utils.process_allgather(v, tiled=True)) for k, v in trainer.train_state.params.items()
    }
    result[run] = {
        "mesh": {k: int(v) for k, v in trainer.mesh.shape.items() if v > 1},
        "partition": list(part),
        "losses": [float(x.addressable_data(0)) for x in cb.losses],  # replicated scalars
        "local_rows": rows,
        "param_shard_devices": sorted({len(v.sharding.device_set) for v in trainer.train_state.params.values()}),
    }
    if pid == 0:
        np.savez(os.path.join(out, f"params_{run}.npz"), **params)

# tensor axis across both processes: the two processes hold the same rows and read one share together.
result["tp_partition"] = list(data_partition(jl.strategies.resolve_strategy("tp").build_mesh(jax.devices())))
# Processes whose loaders disagree on batch shapes would compile different steps and wait on each other
# forever; the trainer compares the batch structure once and raises instead.
trainer = jl.Trainer(
    strategy="ddp",
    devices=4,
    max_epochs=1,
    enable_progress_bar=False,
    logger=False,
    enable_checkpointing=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
    process_local_batches=True,
)
uneven = [{"tokens": b["tokens"][:16, : 9 - pid]} for b in global_batches]
try:
    trainer.fit(LM(), uneven)
    result["mismatch"] = None
except jl.MisconfigurationError as e:
    result["mismatch"] = str(e)
with open(os.path.join(out, f"result_{pid}.json"), "w") as f:
    json.dump(result, f)
jl.distributed.shutdown()
