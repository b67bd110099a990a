"""jaxlight.distributed: where the setup is read from, and the refusals (no real cluster is joined here;
tests/test_multiprocess.py runs two real processes)."""

from __future__ import annotations

import pytest

import jaxlight as jl
from jaxlight.distributed import detect

_VARS = (
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "NODE_RANK",
    "TORCHELASTIC_RUN_ID",
    "SLURM_JOB_ID",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_STEP_NODELIST",
    "OMPI_MCA_orte_hnp_uri",
    "OMPI_COMM_WORLD_SIZE",
    "PMIX_SERVER_URI",
)


@pytest.fixture
def clean_env(monkeypatch):
    for v in _VARS:
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


def test_single_process_is_a_no_op(clean_env):
    assert detect() is None
    assert jl.distributed.initialize() is False


def test_reads_jax_env(clean_env):
    clean_env.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    clean_env.setenv("JAX_NUM_PROCESSES", "4")
    clean_env.setenv("JAX_PROCESS_ID", "3")
    assert tuple(detect())[:3] == ("10.0.0.1:1234", 4, 3)


def test_reads_torchrun_env(clean_env):
    clean_env.setenv("MASTER_ADDR", "node0")
    clean_env.setenv("MASTER_PORT", "29400")
    clean_env.setenv("WORLD_SIZE", "2")
    clean_env.setenv("RANK", "1")
    spec = detect()
    assert tuple(spec)[:3] == ("node0:29400", 2, 1) and spec.source == "torchrun env"
    # under torchrun itself its agent serves MASTER_PORT: JAX's coordinator takes the next one
    clean_env.setenv("TORCHELASTIC_RUN_ID", "none")
    assert detect().coordinator_address == "node0:29401"


def test_arguments_win_over_env(clean_env):
    clean_env.setenv("MASTER_ADDR", "node0")
    clean_env.setenv("WORLD_SIZE", "2")
    assert tuple(detect("h:1", 8, 5))[:3] == ("h:1", 8, 5)


def test_slurm_multi_task_is_left_to_jax(clean_env):
    clean_env.setenv("SLURM_JOB_ID", "7")
    clean_env.setenv("SLURM_NTASKS", "4")
    clean_env.setenv("SLURM_PROCID", "0")
    clean_env.setenv("SLURM_LOCALID", "0")
    clean_env.setenv("SLURM_STEP_NODELIST", "node[1-2]")
    spec = detect()
    assert spec is not None and spec.coordinator_address is None and "SLURM" in spec.source
    clean_env.setenv("SLURM_NTASKS", "1")  # one task: a single-process run
    assert detect() is None


def test_too_late_after_jax_started(clean_env):
    import jax

    jax.devices()  # the backends are up in this test process
    with pytest.raises(RuntimeError, match="before any JAX computation"):
        jl.distributed.initialize("localhost:1", 2, 0)


def test_incomplete_setup_is_refused(clean_env, monkeypatch):
    monkeypatch.setattr("jaxlight.distributed._backends_started", lambda: False)
    clean_env.setenv("JAX_COORDINATOR_ADDRESS", "h:1")
    with pytest.raises(ValueError, match="missing num_processes, process_id"):
        jl.distributed.initialize()
    with pytest.raises(ValueError, match=r"process_id=2 is outside \[0, num_processes=2\)"):
        jl.distributed.initialize("h:1", 2, 2)
