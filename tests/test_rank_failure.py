"""A rank that raises in a multi-process run ends the job within seconds, its traceback first.

Two processes x 2 CPU devices (tests/rank_failure_worker.py: a tiny data-parallel fit with a checkpoint
every step; one rank raises ``ValueError("boom 123")`` in ``on_train_batch_end`` at step 2). Before
jaxlight.rank_failure the peer waited in its next collective and the failed rank in JAX's shutdown
barrier for 300 s, then both aborted (status 134) with C++ stack dumps. Subprocesses are bounded (90 s)
so a regression fails instead of hanging the suite.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import jaxlight as jl
from jaxlight.checkpoint.discovery import list_checkpoints
from jaxlight.checkpoint.format import is_complete
from tests.checkpoint_models import DropoutClassifier, arrays, quiet
from tests.helpers import free_port
from tests.xla_flags import codegen_flags

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "tests" / "rank_failure_worker.py")
BOUND_S = 30.0  # from the exception to the last process's exit
TIMEOUT_S = 90  # a hang fails the test instead of the suite
CRASH_DUMPS = re.compile(r"Fatal Python error|\*\*\* Check failure|(^|\] )F\d{4} ", re.M)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "SLURM_", "PL_"))}
    env.update(JAX_PLATFORMS="cpu", TQDM_DISABLE="1", XLA_FLAGS=codegen_flags(), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _failed_at(out: Path) -> float:
    return float((out / "failed_at").read_text())


def _published_checkpoints_are_whole(ckpts: Path) -> None:
    # a failure mid-run leaves at most unfinished temporary saves: every checkpoint under a final name is whole
    names = [p for p in ckpts.iterdir() if not p.name.startswith(".")] if ckpts.is_dir() else []
    published = [p for p in names if p.name.endswith(".ckpt")]
    assert published, names
    assert all(is_complete(p) for p in published) and list_checkpoints(ckpts) == sorted(published)


def test_a_failing_rank_ends_the_launch_with_its_traceback_first(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "jaxlight.cli", "launch", "--nprocs", "2", "--devices-per-process", "2", WORKER]
        + [str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=TIMEOUT_S,
    )
    ended = time.time()
    took = ended - _failed_at(tmp_path)
    assert took < BOUND_S, (took, r.stderr[-3000:])
    assert r.returncode == 1, r.stderr[-3000:]  # rank 1's status
    assert not CRASH_DUMPS.search(r.stdout + r.stderr), r.stderr[-3000:]
    # the launcher's own lines: the summary and rank 1's traceback come first, then the rest
    own = [line for line in r.stderr.splitlines() if not line.startswith("[rank ")]
    assert own[0] == "jaxlight launch: rank 1 failed (exit status 1): ValueError: boom 123", r.stderr[-3000:]
    end = own.index("ValueError: boom 123")
    trace = own[1 : end + 1]
    assert trace[0] == "Traceback (most recent call last):"
    assert any('raise ValueError("boom 123")' in line for line in trace) and "rank_failure_worker.py" in trace[-3]
    assert own[end + 1].startswith("jaxlight launch: rank 1 exited with status 1")
    # each rank says what happened, once, in its own words
    assert "[rank 1] jaxlight: rank 1 failed: ValueError: boom 123" in r.stderr
    assert "[rank 0] jaxlight: rank 0 stops: rank 1 failed (ValueError: boom 123)" in r.stderr
    assert not (tmp_path / "done_0").exists()
    _published_checkpoints_are_whole(tmp_path / "ckpts")


def test_without_the_launcher_both_processes_stop_when_the_coordinator_process_fails(tmp_path):
    # rank 0 fails: it hosts the coordination service, so it must outlive rank 1's stop (no C++ abort there);
    # rank 1 sits in a collective that never errors while rank 0 lives: only its watcher can stop it
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, str(tmp_path), '{"fail_rank": 0}'],
            cwd=ROOT,
            env=_env(JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outs, ended = [], []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=TIMEOUT_S)[0])
            ended.append(time.time())
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the processes did not stop within {TIMEOUT_S} s of a rank's failure")
    took = max(ended) - _failed_at(tmp_path)
    assert took < BOUND_S, (took, outs)
    assert [p.returncode for p in procs] == [1, 1], outs
    assert not CRASH_DUMPS.search("".join(outs)), outs
    assert "jaxlight: rank 0 failed: ValueError: boom 123\nTraceback (most recent call last):" in outs[0]
    assert "jaxlight: end of rank 0's traceback" in outs[0]
    assert "jaxlight: rank 1 stops: rank 0 failed (ValueError: boom 123)" in outs[1]
    _published_checkpoints_are_whole(tmp_path / "ckpts")


class _Boom(jl.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == 2:
            raise ValueError("boom 123")


def test_a_single_process_failure_propagates_as_before(capsys):
    from jaxlight import rank_failure  # here: the module is new, the other tests run without it

    x, y = arrays(32)
    data = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)]
    trainer = jl.Trainer(max_steps=4, callbacks=[_Boom()], **quiet())
    with pytest.raises(ValueError, match="boom 123"):
        trainer.fit(DropoutClassifier(), data)
    # this process goes on: nothing was published, no watcher runs, nothing will end it at exit
    assert trainer.global_step == 2 and rank_failure.failure() is None
    assert not any(t.name == "jaxlight-rank-failure" for t in threading.enumerate())
    assert "jaxlight: rank" not in capsys.readouterr().err
    trainer = jl.Trainer(max_steps=2, **quiet())
    trainer.fit(DropoutClassifier(), data)
    assert trainer.global_step == 2
