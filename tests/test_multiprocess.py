"""Two processes x 4 CPU devices (jax.distributed on localhost, gloo collectives) train like one process x 8.

The workers (tests/mp_worker.py) each read only their share of every global batch. The
reference run here uses the same global batches on this process's 8 simulated devices.
Tolerance 1e-5 (the same reduction tree over 8 devices; gloo vs in-process collectives).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import jaxlight as jl
from tests.core_models import quiet
from tests.helpers import Losses, free_port
from tests.strategy_models import LM, token_batches

TOL = 1e-5
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(tmp_path, nproc: int = 2, timeout: float = 400.0) -> list[dict]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tests", "mp_worker.py"), str(i), str(nproc), str(port), str(tmp_path)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(nproc)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"multi-process workers did not finish within {timeout}s (hang in jax.distributed?)")
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"worker {i} failed:\n{out[-4000:]}"
    results = []
    for i in range(nproc):
        with open(tmp_path / f"result_{i}.json") as f:
            results.append(json.load(f))
    return results, outs


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path):
    results, outs = _launch(tmp_path)
    for i, r in enumerate(results):
        assert r["process_index"] == i and r["cpu_collectives"] == "gloo"
    batches = token_batches(3, 32)
    refs = {}
    for strategy in ("ddp", "fsdp"):  # one process, 8 devices, the same global batches
        cb = Losses()
        ref = jl.Trainer(strategy=strategy, devices=8, max_epochs=1, callbacks=[cb], **quiet())
        ref.fit(LM(), batches)
        refs[strategy] = ([float(x) for x in cb.losses], {k: np.asarray(v) for k, v in ref.train_state.params.items()})
    for run, strategy, axis in (("ddp", "ddp", "data"), ("fsdp", "fsdp", "fsdp"), ("fsdp_global", "fsdp", "fsdp")):
        ref_losses, ref_params = refs[strategy]
        got = np.load(tmp_path / f"params_{run}.npz")
        assert set(got.files) == set(ref_params)
        worst = max(float(np.abs(got[k] - ref_params[k]).max()) for k in ref_params)
        assert worst <= TOL, (run, worst)
        for r in results:
            res = r[run]
            assert res["mesh"] == {axis: 8}  # one global mesh over both processes' devices
            np.testing.assert_allclose(res["losses"], ref_losses, atol=TOL, rtol=0)
            # each process read half of every global batch of 32 (or all of it when not process-local)
            assert res["local_rows"] == (32 if run.endswith("_global") else 16)
        # process i reads share i of 2 (its devices hold rows [16 i, 16 i + 16))
        assert [r[run]["partition"] for r in results] == [[0, 2, 1, 0], [1, 2, 1, 0]]
        # logs and files on process 0 only
        assert (tmp_path / f"{run}_p0" / "lightning_logs" / "version_0" / "metrics.csv").exists()
        assert not (tmp_path / f"{run}_p1").exists()
    # tensor axis spanning both processes: both hold every row, so they read one share together
    assert [r["tp_partition"] for r in results] == [[0, 1, 2, 0], [0, 1, 2, 1]]
    # the model summary is printed by process 0 only
    assert "Mesh: data=8 (8 devices)" in outs[0] and "Mesh:" not in outs[1]
    # loaders yielding different batch shapes per process raise on every process instead of hanging
    for r in results:
        assert r["mismatch"] is not None and "different structure" in r["mismatch"], r["mismatch"]
