"""Preemption and crashes in real processes: SIGTERM from outside (exit code 143, resume to the same
parameters), kill -9 while async saves are being written (resume only from complete checkpoints), and
two jax.distributed processes of which only one receives SIGTERM (both stop at the same step, one
checkpoint)."""

from __future__ import annotations

import json
import os
import pathlib
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import jaxlight as jl
from tests.helpers import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TIMEOUT = 240  # seconds for any one subprocess: a hang fails the test instead of blocking the suite


class Proc:
    """A worker subprocess whose stdout lines arrive on a queue (so waits can time out)."""

    def __init__(self, args: list[str]) -> None:
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        self.p = subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        self.lines: list[str] = []
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:  # type: ignore[union-attr]
            self.lines.append(line)
            self.q.put(line)
        self.q.put(None)

    def wait_for(self, pattern: str, timeout: float = TIMEOUT) -> str:
        end = time.time() + timeout
        while time.time() < end:
            try:
                line = self.q.get(timeout=max(0.01, end - time.time()))
            except queue.Empty:
                break
            if line is None:
                break
            if re.search(pattern, line):
                return line
        self.kill()
        raise AssertionError(f"no line matching {pattern!r}; output:\n{''.join(self.lines)[-4000:]}")

    def finish(self, timeout: float = TIMEOUT) -> int:
        try:
            rc = self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"worker hung; output:\n{''.join(self.lines)[-4000:]}") from None
        time.sleep(0.05)
        return rc

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()

    def output(self) -> str:
        return "".join(self.lines)


def _worker(out: str, **opts) -> Proc:
    return Proc([os.path.join(HERE, "checkpoint_worker.py"), out, json.dumps(opts)])


def _params(path: str) -> dict[str, np.ndarray]:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.slow
def test_sigterm_from_outside_exits_143_and_resumes_identically(tmp_path):
    ref_dir, run_dir = str(tmp_path / "ref"), str(tmp_path / "run")
    ref = _worker(ref_dir, max_steps=10)
    run = _worker(run_dir, max_steps=10, wait_signal_at=11)
    run.wait_for("READY")
    run.p.send_signal(signal.SIGTERM)
    assert run.finish() == 143, run.output()
    m = re.search(r"PREEMPTED step=(\d+) micro=(\d+) path=(\S+)", run.output())
    assert m and (int(m.group(1)), int(m.group(2))) == (5, 11), run.output()
    assert jl.checkpoint.is_complete(m.group(3))
    assert ref.finish() == 0, ref.output()
    again = _worker(run_dir, max_steps=10, ckpt_path="last")
    assert again.finish() == 0, again.output()
    assert f"restored fit state from {m.group(3)}" in again.output()
    _assert_same(_params(os.path.join(run_dir, "params.npz")), _params(os.path.join(ref_dir, "params.npz")))


@pytest.mark.slow
def test_kill_9_during_async_saves_resumes_from_last_complete_checkpoint(tmp_path):
    """Three kill -9s, each while a save is being written; every restart loads a complete checkpoint and
    the run ends with the parameters of one that was never killed."""
    big = dict(din=256, hidden=2048, every=1, max_steps=40)  # ~2.1M parameters (+ Adam): saves take a while
    ref_dir, run_dir = str(tmp_path / "ref"), str(tmp_path / "run")
    ref = _worker(ref_dir, **big)
    rng = random.Random(0)
    ckdir = os.path.join(run_dir, "ckpts")
    left_partial = 0
    restored: list[str] = []
    for trial in range(3):
        p = _worker(run_dir, announce_saves=True, ckpt_path="last" if trial else None, **big)
        for _ in range(rng.randint(1, 4)):
            p.wait_for(r"^INFLIGHT")
        p.p.send_signal(signal.SIGKILL)
        p.finish()
        assert p.p.returncode == -signal.SIGKILL
        m = re.search(r"restored fit state from (\S+)", p.output())
        if trial:
            assert m, p.output()
            restored.append(m.group(1))
        names = os.listdir(ckdir)
        left_partial += sum(".orbax-checkpoint-tmp" in n for n in names)
        # every checkpoint with a final name is complete; "last" never names an unfinished save
        for n in names:
            if ".orbax-checkpoint-tmp" not in n and not n.startswith("last.ckpt"):
                assert jl.checkpoint.is_complete(os.path.join(ckdir, n)), n
        found = jl.checkpoint.find_last([pathlib.Path(ckdir)])
        assert found is not None and jl.checkpoint.is_complete(found)
    assert left_partial >= 1  # the kills did land while saves were being written
    final = _worker(run_dir, ckpt_path="last", **big)
    assert final.finish() == 0, final.output()
    for r in restored + [re.search(r"restored fit state from (\S+)", final.output()).group(1)]:
        assert ".orbax-checkpoint-tmp" not in r
    assert ref.finish() == 0, ref.output()
    _assert_same(_params(os.path.join(run_dir, "params.npz")), _params(os.path.join(ref_dir, "params.npz")))


def _pair(out: str, **opts) -> list[Proc]:
    port = str(free_port())
    return [
        Proc([os.path.join(HERE, "checkpoint_mp_worker.py"), str(i), "2", port, out, json.dumps(opts)])
        for i in range(2)
    ]


@pytest.mark.slow
def test_sigterm_to_one_of_two_processes_stops_both_at_one_step(tmp_path):
    out = str(tmp_path)
    procs = _pair(out, max_steps=24, wait_signal_at=6)
    procs[1].wait_for("READY")
    procs[1].p.send_signal(signal.SIGTERM)  # process 0 gets nothing
    rcs = [p.finish() for p in procs]
    assert rcs == [143, 143], [p.output()[-3000:] for p in procs]
    stops = [re.search(r"PREEMPTED step=(\d+) micro=(\d+) path=(\S+)", p.output()).groups() for p in procs]
    assert stops[0] == stops[1]  # same step, same micro-batch, same checkpoint
    step, micro, path = int(stops[0][0]), int(stops[0][1]), stops[0][2]
    assert micro == 6 + jl.callbacks.preemption.AGREE_MARGIN and step == micro
    assert jl.checkpoint.is_complete(path)
    meta = jl.checkpoint.read_meta(path)
    assert (meta["global_step"], meta["micro_batches"], meta["mesh"]["data"]) == (step, micro, 8)
    assert os.path.realpath(os.path.join(out, "ckpts", "last.ckpt")) == os.path.realpath(path)

    # running the same command again resumes there and ends where a run on one process of 8 devices ends
    procs = _pair(out, max_steps=24, ckpt_path="last")
    rcs = [p.finish() for p in procs]
    assert rcs == [0, 0], [p.output()[-3000:] for p in procs]
    assert f"restored fit state from {path}" in procs[0].output()  # printed by process 0 only

    from tests.checkpoint_models import DropoutClassifier, arrays, host_params

    x, y = arrays(64)
    t = jl.Trainer(
        strategy="ddp",
        devices=8,
        max_steps=24,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    t.fit(DropoutClassifier(), [(x[i : i + 8], y[i : i + 8]) for i in range(0, 64, 8)])
    got, want = _params(os.path.join(out, "params.npz")), host_params(t)
    assert got.keys() == want.keys()
    for k in want:  # gloo vs in-process reductions may sum in another order
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.slow
def test_process_local_loaders_each_resume_at_their_own_position(tmp_path):
    # Uninterrupted two-process run with per-process shuffled loaders: the reference.
    ref = _pair(str(tmp_path / "ref"), max_steps=20, process_local=True)
    assert [p.finish() for p in ref] == [0, 0], [p.output()[-3000:] for p in ref]

    out = str(tmp_path / "run")
    procs = _pair(out, max_steps=20, process_local=True, wait_signal_at=6)
    procs[1].wait_for("READY")
    procs[1].p.send_signal(signal.SIGTERM)
    assert [p.finish() for p in procs] == [143, 143], [p.output()[-3000:] for p in procs]
    path = re.search(r"PREEMPTED step=\d+ micro=\d+ path=(\S+)", procs[0].output()).group(1)
    fit_loop = jl.checkpoint.host_checkpoint(jl.checkpoint.read_meta(path))["loops"]["fit_loop"]
    states = fit_loop["loader_states_by_process"]
    import pickle

    # each process's own loader position and generator (they hold tensors: compare serialized)
    assert len(states) == 2 and pickle.dumps(states[0]) != pickle.dumps(states[1])

    procs = _pair(out, max_steps=20, process_local=True, ckpt_path="last")
    assert [p.finish() for p in procs] == [0, 0], [p.output()[-3000:] for p in procs]
    got, want = _params(os.path.join(out, "params.npz")), _params(str(tmp_path / "ref" / "params.npz"))
    assert got.keys() == want.keys()
    for k in want:  # the same two-process program on the same data order: equal up to reduction order
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)


def test_sigint_is_a_preemption_signal_except_inside_a_jupyter_kernel(monkeypatch):
    import types

    from jaxlight.callbacks.preemption import Preemption, default_signals

    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    assert default_signals() == (signal.SIGTERM, signal.SIGINT)
    assert Preemption().signals == (signal.SIGTERM, signal.SIGINT)
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    assert default_signals() == (signal.SIGTERM,)  # Ctrl-C in a notebook keeps raising KeyboardInterrupt
    assert Preemption().signals == (signal.SIGTERM,)
    assert Preemption(signals=[signal.SIGINT]).signals == (signal.SIGINT,)  # the user's own choice is kept
