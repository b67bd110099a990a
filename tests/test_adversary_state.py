"""Adversary cases nobody had tried: state that is not plain parameters under kill -9 and SIGTERM, a checkpoint
directory read-only for the (non-root) user running the fit, and an MLflow database locked by another process.

- ``HostOffload(stream=4)`` (optimizer moments, accumulated gradients and EMA in pinned host memory), an MoE model
  under expert parallelism and an ``nnx.MultiMetric`` held by the module: a run killed with SIGKILL (in a
  subprocess, while a save may be half written) is resumed from its last complete checkpoint, stopped again by
  SIGTERM, resumed again and ends bit-identical to a run that never stopped, metric totals included.
- A checkpoint directory a non-root user cannot write is a ``CheckpointError`` naming it before any step is compiled.
- An MLflow sqlite store held by another process's exclusive transaction: the fit completes and every metric
  reaches the store once the lock is released.

Every subprocess runs under a timeout.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxlight as jl
from tests.adversary_state_worker import ACCUMULATE, make_data, make_module, make_trainer
from tests.helpers import SignalAt

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "tests" / "adversary_state_worker.py")
TIMEOUT = 120  # seconds for any one subprocess
MAX_STEPS = 6


def _state(trainer) -> dict[str, np.ndarray]:
    """Every leaf of the train state (parameters, optimizer and callback state, held NNX state, RNG keys as their
    key data) on the host, by path."""
    out = {}
    for p, v in jax.tree_util.tree_flatten_with_path(trainer.train_state)[0]:
        if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key):
            v = jax.random.key_data(v)
        out[jax.tree_util.keystr(p)] = np.asarray(jax.device_get(v))
    return out


class Resumed(jl.Callback):
    """The global step the fit starts from (after any restore)."""

    step: int | None = None

    def on_train_start(self, trainer, module):
        self.step = trainer.global_step


def _killed_run(out: Path, case: str, hang_at: int, seed: int) -> None:
    """The worker's run of ``case``, SIGKILLed once it has finished step ``hang_at`` (its save possibly in flight)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cmd = [sys.executable, WORKER, str(out), json.dumps({"case": case, "max_steps": MAX_STEPS, "hang_at": hang_at})]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + TIMEOUT
        while not any(ln.startswith("HANG") for ln in list(lines)):
            assert p.poll() is None and time.monotonic() < deadline, "".join(lines)[-4000:]
            time.sleep(0.05)
        time.sleep(random.Random(seed).uniform(0.0, 0.2))  # anywhere in the save of step hang_at
        p.send_signal(signal.SIGKILL)
        assert p.wait(timeout=30) == -signal.SIGKILL, "".join(lines)[-4000:]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    reader.join(timeout=10)


@pytest.mark.parametrize("case", ["offload", "moe", "metric"])
def test_kill_9_then_sigterm_then_resume_is_bit_identical(case, tmp_path):
    """Before a resume the run is killed -9 (in a subprocess); the resumed run is stopped by SIGTERM and resumed
    again (in this process): the end state equals an uninterrupted run's, leaf by leaf."""
    ref_module = make_module(case)
    ref = make_trainer(case, MAX_STEPS)
    ref.fit(ref_module, make_data(case, MAX_STEPS))
    want = _state(ref)

    ckpts = str(tmp_path / "ckpts")
    _killed_run(tmp_path, case, hang_at=2, seed=len(case))
    assert jl.checkpoint.list_checkpoints(ckpts), os.listdir(tmp_path)

    # resumed from the last complete checkpoint, then SIGTERM after step 4
    first = Resumed()
    acc = ACCUMULATE[case]
    t1 = make_trainer(case, MAX_STEPS, ckpts, callbacks=[first, SignalAt(4 * acc)])
    with pytest.raises(jl.Preempted) as exc:
        t1.fit(make_module(case), make_data(case, MAX_STEPS), ckpt_path="last")
    assert first.step in (1, 2), first.step  # resumed, not restarted: step 2's save may have been cut short
    assert exc.value.step == 4 and jl.checkpoint.is_complete(exc.value.path)

    second = Resumed()
    module = make_module(case)
    t2 = make_trainer(case, MAX_STEPS, ckpts, callbacks=[second])
    t2.fit(module, make_data(case, MAX_STEPS), ckpt_path="last")
    assert second.step == 4 and t2.global_step == MAX_STEPS
    got = _state(t2)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    if case == "offload":  # the offload really happened on the resumed side too
        kinds = {x.sharding.memory_kind for x in jax.tree.leaves(t2.train_state.callback_state)}
        assert kinds == {"pinned_host"}
    if case == "metric":
        # epoch 0 (its batches spread over three processes' runs, its last one just before the SIGTERM) and epoch
        # 1 (cut by max_steps) averaged by the held metric, reset between them, as in the run that never stopped
        assert len(ref_module.epochs) == 2
        assert module.epochs == ref_module.epochs


# ------------------------------------------------------------------ a checkpoint directory a non-root user cannot write
NOBODY = 65534
# Runs as root up to its imports (the interpreter and its packages may sit under /root, out of nobody's reach),
# then drops to uid/gid nobody for good and fits with the checkpoint directory it cannot write.
_AS_NOBODY = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
from tests.xla_flags import cpu_xla_flags
os.environ["XLA_FLAGS"] = cpu_xla_flags(1)
import jaxlight as jl
from tests.checkpoint_models import DropoutClassifier, arrays
from tests.core_models import quiet
x, y = arrays(32)
mc = jl.callbacks.ModelCheckpoint(dirpath=sys.argv[2], every_n_train_steps=1)
t = jl.Trainer(max_steps=2, callbacks=[mc], **quiet(enable_checkpointing=True))
module = DropoutClassifier()
os.setgroups([])
os.setgid(NOBODY)
os.setuid(NOBODY)
assert (os.getuid(), os.geteuid(), os.getgid()) == (NOBODY, NOBODY, NOBODY)
try:
    t.fit(module, [(x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)])
    print(json.dumps({"error": None, "compiled": dict(t.compile_counts)}))
except jl.CheckpointError as e:
    print(json.dumps({"error": str(e), "compiled": dict(t.compile_counts)}))
""".replace("NOBODY", str(NOBODY))


def test_a_checkpoint_directory_the_non_root_user_cannot_write_is_refused_before_any_compile():
    """A root-owned 0o755 checkpoint directory, a fit run by uid nobody: a CheckpointError naming the directory
    and "not writable" at fit start (no step compiled), not a failure at the first save after training."""
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to uid nobody (65534)")
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="jaxlight-ro-"))  # not under pytest's 0o700 tmp dir: nobody passes through
    try:
        base.chmod(0o755)
        ck = base / "ckpts"
        ck.mkdir(mode=0o755)  # root's, read-only for anyone else
        home = base / "home"
        home.mkdir()
        os.chown(home, NOBODY, NOBODY)
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env.update(
            HOME=str(home),
            XDG_CACHE_HOME=str(home / ".cache"),
            XDG_CONFIG_HOME=str(home / ".config"),
            TMPDIR=str(home),
            JAXLIGHT_COMPILE_CACHE=str(home / "compile-cache"),
            JAX_PLATFORMS="cpu",
        )
        r = subprocess.run(
            [sys.executable, "-c", _AS_NOBODY, str(ROOT), str(ck)],
            cwd=home,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
        got = json.loads(r.stdout.strip().splitlines()[-1])
        assert got["error"] is not None, "the fit ran and saved into a directory it cannot write"
        assert f"checkpoint directory {ck} is not writable" in got["error"], got["error"]
        assert got["compiled"] == {}, got
        assert os.listdir(ck) == []
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)


# ------------------------------------------------------------------------- an MLflow database locked by another process
LOCK_S = 3.0  # how long the other process holds the database
_HOLD_LOCK = r"""
import sqlite3, sys, time
c = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=10.0)
c.execute("BEGIN EXCLUSIVE")
print("LOCKED", flush=True)
time.sleep(float(sys.argv[2]))
c.execute("COMMIT")
c.close()
print("RELEASED", flush=True)
"""


class LockAt(jl.Callback):
    """After global step ``at`` another process takes an exclusive lock of the MLflow database for LOCK_S seconds
    (this waits until it holds it); the fit goes on logging."""

    def __init__(self, db: Path, at: int) -> None:
        self.db, self.at, self.proc = db, at, None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step != self.at:
            return
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _HOLD_LOCK, str(self.db), str(LOCK_S)], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout.readline().strip() == "LOCKED"
        self.locked_at = time.monotonic()


def test_an_mlflow_database_locked_by_another_process_gets_every_metric_once_released(tmp_path, capfd):
    """The fit runs on while another process holds ``BEGIN EXCLUSIVE`` on mlflow.db; once the lock is released
    every logged row reaches the store, in order, and nothing is printed as a traceback."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from tests.core_models import Classifier, batches, make_data, quiet

    db = tmp_path / "mlflow.db"
    ml = jl.loggers.MLFlowLogger(experiment_name="locked", tracking_uri=f"sqlite:///{db}")
    csv_logger = jl.loggers.CSVLogger(str(tmp_path / "csv"))
    lock = LockAt(db, at=2)
    t = jl.Trainer(
        max_steps=12,
        log_every_n_steps=1,
        callbacks=[lock],
        **quiet(logger=[csv_logger, ml], enable_checkpointing=False),
    )
    t0 = time.monotonic()
    try:
        t.fit(Classifier(), batches(*make_data(96), 8))
    finally:
        if lock.proc is not None:
            try:
                lock.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                lock.proc.kill()
                lock.proc.wait()
    took = time.monotonic() - t0
    assert lock.proc is not None and lock.proc.returncode == 0
    assert took < 60, took
    history = MlflowClient(f"sqlite:///{db}").get_metric_history(ml.run_id, "train_loss")
    with open(os.path.join(csv_logger.log_dir, "metrics.csv")) as f:
        import csv

        want = [(int(r["step"]), float(r["train_loss"])) for r in csv.DictReader(f) if r.get("train_loss")]
    assert len(want) == 12
    got = sorted((m.step, m.value) for m in history)
    assert [s for s, _ in got] == [s for s, _ in want]  # every row once, none lost or doubled
    for (_, a), (_, b) in zip(got, want):
        assert a == pytest.approx(b, rel=1e-6)
    assert MlflowClient(f"sqlite:///{db}").get_run(ml.run_id).info.status == "FINISHED"
    err = capfd.readouterr().err
    assert "Traceback" not in err, err[-4000:]
