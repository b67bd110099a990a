"""`jaxlight launch` and the cluster recipes in examples/clusters/.

Fast tests drive the launcher with tests/launch_child.py (no JAX): the environment each process gets,
rank-prefixed output, signal forwarding, the exit status and stopping the others after a failure.

Slow tests run the GPT of examples/gpt_cli.py (tiny sizes, 3 steps) with hybrid sharding
(FSDP over the 4 devices of a process, data parallel across 2 processes) three ways: through
`jaxlight launch --nprocs 2 --devices-per-process 4`, through the Slurm batch script with a stand-in
srun (tests/fake_srun.py), and as the two pods of the Kubernetes Indexed Job. Each must train like one
process with 8 devices running the same command in-process: losses and parameters within 1e-5 (the
same compiled program on the same mesh; only the collectives differ, gloo across processes).
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from jaxlight import distributed
from jaxlight.cli import main as cli_main
from jaxlight.launch import LaunchError, child_env, device_assignment, visible_gpus
from tests.helpers import free_port, wait_for_files
from tests.xla_flags import codegen_flags, cpu_xla_flags

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = [sys.executable, "-m", "jaxlight.cli", "launch"]
CHILD = str(ROOT / "tests" / "launch_child.py")
CLUSTERS = ROOT / "examples" / "clusters"
TOL = 1e-5


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "SLURM_", "PL_"))}
    # no device count (the launcher sets it), only the tests' code generator flags
    env.update(JAX_PLATFORMS="cpu", TQDM_DISABLE="1", XLA_FLAGS=codegen_flags())
    env.update(extra)
    return env


# ============================================================================ environment (no processes)
def test_device_assignment_cpu_and_gpu():
    # CPU: K simulated devices per process, other XLA flags kept, an inherited device count replaced
    env = {"XLA_FLAGS": "--xla_cpu_foo=1 --xla_force_host_platform_device_count=8", "CUDA_VISIBLE_DEVICES": ""}
    assert visible_gpus(env) == []
    cpu = device_assignment(2, 4, "auto", env)
    assert cpu == [{"XLA_FLAGS": "--xla_cpu_foo=1 --xla_force_host_platform_device_count=4"}] * 2
    assert device_assignment(2, None, "auto", env) == [{}, {}]  # inherits XLA_FLAGS as they are
    assert device_assignment(1, 2, "cpu", {"CUDA_VISIBLE_DEVICES": "0"})[0]["JAX_PLATFORMS"] == "cpu"
    # GPU: disjoint slices of the visible GPUs
    gpus = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert [d["CUDA_VISIBLE_DEVICES"] for d in device_assignment(2, None, "auto", gpus)] == ["4,5", "6,7"]
    assert [d["CUDA_VISIBLE_DEVICES"] for d in device_assignment(4, 1, "auto", gpus)] == ["4", "5", "6", "7"]
    assert device_assignment(2, 2, "auto", {**gpus, "JAX_PLATFORMS": "cpu"})[0].keys() == {"XLA_FLAGS"}
    with pytest.raises(LaunchError, match=r"--nprocs 2 x --devices-per-process 3 = 6 GPUs requested but 4 are"):
        device_assignment(2, 3, "auto", gpus)
    with pytest.raises(LaunchError, match="--nprocs must be >= 1, got 0"):
        device_assignment(0, 1, "cpu", {})
    with pytest.raises(LaunchError, match="--devices-per-process must be >= 1"):
        device_assignment(2, 0, "cpu", {})


def test_child_env_is_what_distributed_initialize_reads(monkeypatch):
    base = {"PATH": "/bin", "MASTER_ADDR": "elsewhere", "MASTER_PORT": "1", "JAX_LOCAL_DEVICE_IDS": "0"}
    for rank in range(3):
        env = child_env(rank, 3, "localhost:4321", {"XLA_FLAGS": "--x"}, base)
        assert env["PATH"] == "/bin" and env["XLA_FLAGS"] == "--x"
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (str(rank), str(rank), "3")
        assert "MASTER_ADDR" not in env and "JAX_LOCAL_DEVICE_IDS" not in env  # another run's settings
        for k in [k for k in os.environ if k.startswith(("JAX_", "MASTER_", "WORLD_SIZE", "RANK", "SLURM_"))]:
            monkeypatch.delenv(k)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert distributed.detect() == distributed.ClusterSpec("localhost:4321", 3, rank, "JAX_* env")


# ============================================================================ the launcher, with plain processes
def test_launch_prefixes_output_and_gives_each_process_its_environment(tmp_path):
    r = subprocess.run(
        [*LAUNCH, "--nprocs", "3", "--devices-per-process", "2", CHILD, "ok", str(tmp_path)],
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    for i in range(3):
        assert f"[rank {i}] ready {i} on stdout\n" in r.stdout
        assert f"[rank {i}] note {i} on stderr\n" in r.stderr
    infos = [json.loads((tmp_path / f"rank_{i}.json").read_text()) for i in range(3)]
    coordinators = {x["JAX_COORDINATOR_ADDRESS"] for x in infos}
    assert len(coordinators) == 1 and re.fullmatch(r"localhost:\d+", coordinators.pop())
    assert [x["JAX_PROCESS_ID"] for x in infos] == ["0", "1", "2"] and {x["JAX_NUM_PROCESSES"] for x in infos} == {"3"}
    assert {x["XLA_FLAGS"] for x in infos} == {f"{codegen_flags()} --xla_force_host_platform_device_count=2".strip()}
    # every process leads its own process group and session (signals are forwarded, not broadcast by the tty)
    assert all(x["pgid"] == x["pid"] == x["sid"] for x in infos)
    assert os.getpgid(0) not in {x["pgid"] for x in infos}


def test_first_failure_sets_the_status_and_stops_the_others(tmp_path):
    t0 = time.monotonic()
    r = subprocess.run(
        [*LAUNCH, "--nprocs", "3", "--grace-period", "1", CHILD, "fail", str(tmp_path)],
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=120,
    )
    assert r.returncode == 3, r.stderr  # rank 1's status, not the 143 of the processes stopped after it
    assert "rank 1 exited with status 3" in r.stderr
    # the others were waiting (up to 120 s); the launcher sent them SIGTERM after the 1 s grace period
    assert [(tmp_path / f"signal_{i}").read_text() for i in (0, 2)] == [str(int(signal.SIGTERM))] * 2
    assert time.monotonic() - t0 < 60


def test_a_failed_process_is_reported_first_with_its_traceback(tmp_path):
    # no jaxlight report of its own (a plain uncaught exception): the launcher shows its last traceback
    r = subprocess.run(
        [*LAUNCH, "--nprocs", "2", "--grace-period", "0.5", CHILD, "raise", str(tmp_path)],
        cwd=ROOT,  # this checkout's jaxlight (the tests run in a temporary directory)
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=90,
    )
    assert r.returncode == 1, r.stderr
    own = [line for line in r.stderr.splitlines() if not line.startswith("[rank ")]
    assert own[0] == "jaxlight launch: rank 1 failed (exit status 1): RuntimeError: plain 7", r.stderr
    assert own[1] == "Traceback (most recent call last):" and own.index("RuntimeError: plain 7") > 1
    assert any(line.startswith("jaxlight launch: rank 1 exited with status 1") for line in own)


def test_a_process_ignoring_sigterm_is_killed(tmp_path):
    r = subprocess.run(
        [*LAUNCH, "--nprocs", "2", "--grace-period", "0.5", CHILD, "stubborn", str(tmp_path)],
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=120,
    )
    assert r.returncode == 5, r.stderr
    info = json.loads((tmp_path / "rank_0.json").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(info["pid"], 0)  # gone (SIGKILL after SIGTERM was ignored)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signals_to_the_launcher_reach_every_process(tmp_path, sig):
    p = subprocess.Popen(
        [*LAUNCH, "--nprocs", "2", CHILD, "wait", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_clean_env(),
    )
    try:
        wait_for_files([tmp_path / f"rank_{i}.json" for i in range(2)])
        p.send_signal(sig)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 143, err  # the processes' own status after handling the signal
    assert [(tmp_path / f"signal_{i}").read_text() for i in range(2)] == [str(int(sig))] * 2
    assert "[rank 0] rank 0 got signal" in out and "[rank 1] rank 1 got signal" in out
    assert "stopping the other" not in err  # a forwarded signal is no failure to clean up after


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_processes_die_with_a_killed_launcher(tmp_path):
    p = subprocess.Popen([*LAUNCH, "--nprocs", "2", CHILD, "wait", str(tmp_path)], env=_clean_env())
    try:
        wait_for_files([tmp_path / f"rank_{i}.json" for i in range(2)])
    finally:
        p.kill()  # SIGKILL: no chance to forward anything
        p.wait()
    pids = [json.loads((tmp_path / f"rank_{i}.json").read_text())["pid"] for i in range(2)]
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids)  # no orphan left holding devices


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_launch_refuses_bad_arguments(capsys, tmp_path):
    assert cli_main(["launch", "--nprocs", "2", str(tmp_path / "missing.py")]) == 2
    assert "missing.py' does not exist" in capsys.readouterr().err
    assert cli_main(["launch", "--nprocs", "0", CHILD, "ok", str(tmp_path)]) == 2
    assert "--nprocs must be >= 1, got 0" in capsys.readouterr().err
    assert not list(tmp_path.glob("rank_*.json"))  # nothing was started


# ============================================================================ recipes: static checks
def _sbatch() -> tuple[dict[str, str], str]:
    text = (CLUSTERS / "slurm.sbatch").read_text()
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, flags=re.M))
    srun = re.search(r"^srun .*?(?<!\\)$", text, flags=re.M | re.S).group(0)
    return directives, srun


def _k8s() -> tuple[dict, dict]:
    docs = list(yaml.safe_load_all((CLUSTERS / "k8s-indexed-job.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"Service", "Job"}
    return kinds["Service"], kinds["Job"]


def _referenced_files(command: str) -> list[str]:
    words = shlex.split(command.replace("\\\n", " "))
    return [w for w in words if w.endswith((".py", ".yaml"))]


def test_recipes_are_consistent_and_name_files_that_exist():
    directives, srun = _sbatch()
    assert directives["nodes"] == "2" and directives["ntasks-per-node"] == "1" and directives["gpus-per-node"] == "8"
    assert "TERM@" in directives["signal"] and "requeue" in (CLUSTERS / "slurm.sbatch").read_text()
    service, job = _k8s()
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"] == {
        "job-name": job["metadata"]["name"]
    }
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    assert int(env["JAX_NUM_PROCESSES"]["value"]) == spec["completions"]
    assert pod["subdomain"] == service["metadata"]["name"]
    host, port = env["JAX_COORDINATOR_ADDRESS"]["value"].rsplit(":", 1)
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"  # pod 0 through the Service
    assert int(port) in [p["port"] for p in service["spec"]["ports"]]
    index = env["JAX_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert index == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert int(env["GPUS_PER_POD"]["value"]) == container["resources"]["limits"]["nvidia.com/gpu"]
    for command in (srun, container["args"][0]):
        files = _referenced_files(command)
        assert "examples/gpt_cli.py" in files and "examples/clusters/hybrid.yaml" in files, files
        for f in files:
            assert (ROOT / f).is_file(), f


def test_recipe_configs_parse(capsys):
    """The configs the recipes run are valid for the CLI: the merged config has the hybrid strategy."""
    from examples.gpt_cli import main as gpt_main

    args = ["fit", "--config", str(ROOT / "examples/gpt_cli.yaml"), "--config", str(CLUSTERS / "hybrid.yaml")]
    with pytest.raises(SystemExit) as e:
        gpt_main([*args, "--trainer.strategy.size", "8", "--trainer.num_nodes", "2", "--print_config"])
    assert e.value.code == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["trainer"]["strategy"] == {
        "class_path": "jaxlight.strategies.FSDP",
        "init_args": {"min_shard": None, "tolerance": None, "size": 8, "rules": []},
    }
    assert cfg["trainer"]["num_nodes"] == 2 and cfg["model"]["d_model"] == 128


# ============================================================================ two processes = one process x 8 devices
BASE = ["fit", "--config", str(ROOT / "examples/gpt_cli.yaml"), "--config", str(CLUSTERS / "hybrid.yaml")]


def _tiny(out: Path) -> list[str]:
    """Shrink the recipe's run to seconds; the recorder writes losses, the mesh and the parameters to ``out``."""
    return [
        "--trainer.max_steps=3",
        "--model.d_model=32",
        "--model.layers=1",
        "--model.heads=2",
        "--data.seq_len=16",
        "--data.batch_size=16",
        "--data.data_bytes=50000",
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.strategy.min_shard=256",  # shard the tiny matrices over fsdp
        f"--trainer.default_root_dir={out / 'root'}",
        "--trainer.callbacks+=tests.cli_models.RunRecorder",
        f"--trainer.callbacks.out={out / 'rec'}",
    ]


@pytest.fixture(scope="module")
def one_process_8_devices(tmp_path_factory):
    """The reference: the same command in this process, with its 8 devices (fsdp=4 x data=2)."""
    from examples.gpt_cli import main as gpt_main

    out = tmp_path_factory.mktemp("ref")
    seed_env = {k: os.environ.get(k) for k in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")}
    try:
        cli = gpt_main([*BASE, "--trainer.strategy.size=4", *_tiny(out)])
    finally:  # seed_everything writes these; keep them from leaking into other tests
        for k, v in seed_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert cli.trainer.num_devices == 8
    hlo = cli.trainer.compiled["train"].as_text()
    rows = [{d.id for d in row} for row in np.asarray(cli.trainer.mesh.devices).reshape(2, 4)]  # fsdp groups
    return json.loads((out / "rec" / "run_0.json").read_text()), dict(np.load(out / "rec" / "params.npz")), hlo, rows


def _check_like_reference(rec: Path, reference, seed: str | None = "0") -> None:
    ref, ref_params = reference[:2]
    # parameters are split over fsdp only (so their all-gathers stay among one process's devices)
    assert ref["mesh"] == {"data": 2, "fsdp": 4} and ref["sharded"] > 0 and ref["param_axes"] == ["fsdp"]
    runs = [json.loads((rec / f"run_{i}.json").read_text()) for i in range(2)]
    for i, r in enumerate(runs):
        assert (r["process_index"], r["process_count"], r["local_devices"]) == (i, 2, 4)
        assert (r["mesh"], r["sharded"], r["param_axes"]) == (ref["mesh"], ref["sharded"], ref["param_axes"])
        # hybrid: each fsdp group is one process's devices; the data axis runs across the processes
        assert r["mesh_processes"] == [[0, 0, 0, 0], [1, 1, 1, 1]]
        assert r["global_step"] == 3 and r["seed"] == (seed or runs[0]["seed"]) and r["seed"] is not None
        np.testing.assert_allclose(r["losses"], ref["losses"], rtol=0, atol=TOL)
    got = np.load(rec / "params.npz")
    assert set(got.files) == set(ref_params)
    worst = max(float(np.abs(got[k] - ref_params[k]).max()) for k in ref_params)
    assert worst <= TOL, worst


def _replica_groups(op: str) -> list[set[int]]:
    """The device groups of one collective in HLO text: explicit ``{{0,1},{2,3}}``, iota ``[2,2]<=[4]``, or
    the mesh form ``mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}``."""
    if m := re.search(r"replica_groups=\{((?:\{[\d,]*\},?)+)\}", op):
        return [set(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}", m.group(1))]
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", op):
        ids = np.arange(int(np.prod([int(x) for x in m.group(3).split(",")]))).reshape(
            [int(x) for x in m.group(3).split(",")]
        )
        if m.group(4):
            ids = ids.transpose([int(x) for x in m.group(4).split(",")])
        return [set(r.tolist()) for r in ids.reshape(int(m.group(1)), int(m.group(2)))]
    m = re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? \{([^}]*)\}", op
    )
    assert m, op
    axes = [(name, int(size)) for name, size in re.findall(r"'(\w+)'=(\d+)", m.group(1))]
    dims = [int(x) for x in m.group(2).split(",")] if m.group(2) else [int(np.prod([s for _, s in axes]))]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    ids = ids.reshape([size for _, size in axes])
    grouped = [i for i, (name, _) in enumerate(axes) if f"'{name}'" in m.group(4)]
    rest = [i for i in range(len(axes)) if i not in grouped]
    group_size = int(np.prod([axes[i][1] for i in grouped]))
    return [set(r.tolist()) for r in ids.transpose(rest + grouped).reshape(-1, group_size)]


@pytest.mark.slow
def test_hybrid_sharding_gathers_parameters_inside_a_process(one_process_8_devices):
    """Every all-gather of the compiled hybrid step runs among the devices of one fsdp group, i.e. of one
    process (one node); the 8-device reference has the same mesh and program as the 2-process runs."""
    _, _, hlo, rows = one_process_8_devices
    assert rows == [{0, 1, 2, 3}, {4, 5, 6, 7}]
    gathers = [line for line in hlo.splitlines() if re.search(r" all-gather(-start)?\(", line)]
    assert len(gathers) >= 5, "expected the sharded weights to be gathered"
    for op in gathers:
        assert sorted(map(sorted, _replica_groups(op))) == [[0, 1, 2, 3], [4, 5, 6, 7]], op[:300]


def _config_saved_once(root: Path) -> dict:
    saved = list(root.glob("lightning_logs/version_*/config.yaml"))
    assert len(saved) == 1, saved  # process 0 wrote it; process 1 did not start a version of its own
    return yaml.safe_load(saved[0].read_text())


def _python_shim(tmp_path: Path) -> Path:
    """A bin directory whose ``python`` is this interpreter (the recipes call ``python``)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # a script, not a symlink: a venv's interpreter finds its packages from the path it is started as
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python").chmod(0o755)
    return bin_dir


@pytest.mark.slow
def test_two_processes_through_the_launcher_train_like_one_process_with_8_devices(tmp_path, one_process_8_devices):
    r = subprocess.run(
        [*LAUNCH, "--nprocs", "2", "--devices-per-process", "4", "examples/gpt_cli.py", *BASE]
        + ["--trainer.strategy.size=4", *_tiny(tmp_path), "--seed_everything=true"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # seed_everything: true draws one seed on process 0 for every process (results do not depend on it: the
    # model and the data take their own seeds)
    _check_like_reference(tmp_path / "rec", one_process_8_devices, seed=None)
    cfg = _config_saved_once(tmp_path / "root")
    assert cfg["trainer"]["strategy"]["init_args"]["size"] == 4
    assert str(cfg["seed_everything"]) == json.loads((tmp_path / "rec" / "run_0.json").read_text())["seed"]


def _free_slurm_job_id() -> int:
    """A job id whose coordinator port (JAX's Slurm rule: 61440 + id % 4096) is free here."""
    for _ in range(200):
        port = random.randint(61440, 65535)
        with socket.socket() as s:
            try:
                s.bind(("localhost", port))
            except OSError:
                continue
        return port - 61440 + 4096 * random.randint(1, 1000)
    pytest.skip("no free port in 61440-65535")


@pytest.mark.slow
def test_slurm_recipe_runs_with_a_stand_in_srun(tmp_path, one_process_8_devices):
    directives, _ = _sbatch()
    nodes, per_node = int(directives["nodes"]), int(directives["ntasks-per-node"])
    bin_dir = _python_shim(tmp_path)
    (bin_dir / "srun").write_text(f'#!/bin/sh\nexec "{sys.executable}" "{ROOT}/tests/fake_srun.py" "$@"\n')
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> "{tmp_path}/scontrol.log"\n')
    for f in ("srun", "scontrol"):
        (bin_dir / f).chmod(0o755)
    env = _clean_env(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        # what sbatch gives the batch script for the directives (2 "nodes" x 4 CPU devices here)
        SLURM_JOB_ID=str(_free_slurm_job_id()),
        SLURM_NNODES=str(nodes),
        SLURM_NTASKS=str(nodes * per_node),
        SLURM_JOB_NODELIST="localhost",
        SLURM_GPUS_ON_NODE="4",
        SLURM_SUBMIT_DIR=str(ROOT),
        XLA_FLAGS=cpu_xla_flags(4),
        RUN_DIR=str(tmp_path / "root"),
    )
    r = subprocess.run(
        ["bash", str(CLUSTERS / "slurm.sbatch"), *_tiny(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    _check_like_reference(tmp_path / "rec", one_process_8_devices)
    cfg = _config_saved_once(tmp_path / "root")
    assert cfg["trainer"]["num_nodes"] == 2 and cfg["trainer"]["strategy"]["init_args"]["size"] == 4
    assert not (tmp_path / "scontrol.log").exists()  # finished: no requeue


@pytest.mark.slow
def test_kubernetes_indexed_job_pods_run_as_local_processes(tmp_path, one_process_8_devices):
    service, job = _k8s()
    n = job["spec"]["completions"]
    container = job["spec"]["template"]["spec"]["containers"][0]
    bin_dir = _python_shim(tmp_path)
    port = free_port()
    procs = []
    for index in range(n):
        # what Kubernetes gives pod `index`: the container's env (the fieldRef resolved to the completion
        # index) and JOB_COMPLETION_INDEX; pod 0's DNS name becomes localhost, GPUs become 4 CPU devices
        env = _clean_env(
            PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            JOB_COMPLETION_INDEX=str(index),
            XLA_FLAGS=cpu_xla_flags(4),
        )
        for e in container["env"]:
            if "value" in e:
                env[e["name"]] = str(e["value"])
            else:
                assert "job-completion-index" in e["valueFrom"]["fieldRef"]["fieldPath"]
                env[e["name"]] = str(index)
        env["JAX_COORDINATOR_ADDRESS"] = f"localhost:{port}"
        env.update(GPUS_PER_POD="4", RUN_DIR=str(tmp_path / "root"))
        cmd = [*container["command"], *container["args"], *_tiny(tmp_path)]
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=600)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    _check_like_reference(tmp_path / "rec", one_process_8_devices)
    assert _config_saved_once(tmp_path / "root")["trainer"]["num_nodes"] == 2
