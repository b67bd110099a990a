"""Adversary cases of the training loop (issue 26, items 1, 2 and 10): each failed on the main branch before
the fix by hanging, looping, losing the preemption checkpoint or raising a raw error.

- SIGTERM is honoured at any point of fit: while the loop waits on a stalled loader, in validation, in
  epochs that never reach a step, with the main thread blocked in a loader (``prefetch=0``) or in a
  collective whose peer process died; a second signal exits at once; ``jaxlight launch`` escalates once.
- An epoch that yields no batch raises, naming the loader; a loader of length 0 warns.
- Arguments are checked with the numbers (types, ranges, duplicates, repeated pieces); a log directory
  that cannot be written is refused before any step is compiled; a batch whose non-row dims or dtypes
  change gets jaxlight's ``BatchError`` naming the leaf.

Nothing here can hang CI: a stalled loader gives up after a bounded wait and raises, an endless loop is
cut by a counter that raises, and every subprocess runs under a timeout.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import jaxlight as jl
from jaxlight.data import BatchError
from tests.adversary_loop_worker import Loader
from tests.checkpoint_models import DropoutClassifier, arrays
from tests.core_models import EagerClassifier, quiet
from tests.helpers import free_port, wait_for_files

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "tests" / "adversary_loop_worker.py")
LAUNCH_WORKER = str(ROOT / "tests" / "adversary_launch_worker.py")
TIMEOUT = 120  # seconds for any one subprocess


def _trainer(dirpath=None, **kw) -> jl.Trainer:
    callbacks = kw.pop("callbacks", [])
    if dirpath is not None:
        callbacks = [*callbacks, jl.callbacks.ModelCheckpoint(dirpath=str(dirpath), save_last="link")]
    kw.setdefault("strategy", "ddp")
    return jl.Trainer(callbacks=callbacks, **quiet(enable_checkpointing=dirpath is not None, **kw))


def _sigterm_when(event: threading.Event, ready=lambda: True, delay: float = 0.3) -> threading.Thread:
    """SIGTERM to this process once ``event`` is set (the loader has stalled) and ``ready()`` (the loop has
    consumed every batch before the stall, so it waits on the loader), from a helper thread."""

    def send() -> None:
        if event.wait(60):
            deadline = time.monotonic() + 60
            while not ready() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(delay)
            os.kill(os.getpid(), signal.SIGTERM)

    t = threading.Thread(target=send, daemon=True)
    t.start()
    return t


# ============================================================================ item 1: SIGTERM at any point
def test_sigterm_while_the_train_loader_stalls_saves_the_last_step_and_resumes(tmp_path, capsys):
    """Before: the loop waited on the prefetch queue for ever; the signal was only read after a train batch."""
    loader = Loader(stall_at=3, block_s=30)
    t = _trainer(tmp_path / "ckpts", max_steps=6)
    _sigterm_when(loader.stalled, lambda: t.global_step == 3)
    with pytest.raises(jl.Preempted) as e:
        t.fit(DropoutClassifier(), loader)
    assert e.value.code == 143 and e.value.step == 3  # the three batches the loader gave
    assert jl.checkpoint.is_complete(e.value.path)
    again = _trainer(tmp_path / "ckpts", max_steps=6)
    again.fit(DropoutClassifier(), Loader(), ckpt_path="last")
    assert f"restored fit state from {e.value.path}" in capsys.readouterr().out and again.global_step == 6


def test_sigterm_while_the_validation_loader_stalls_saves_the_last_train_step(tmp_path):
    val = Loader(stall_at=0, what="validation", block_s=30)
    t = _trainer(tmp_path / "ckpts", max_steps=20)
    _sigterm_when(val.stalled, lambda: t.validating)
    with pytest.raises(jl.Preempted) as e:
        t.fit(DropoutClassifier(), Loader(), val)  # validation runs after the 8 batches of epoch 0
    assert e.value.step == 8 and jl.checkpoint.is_complete(e.value.path)
    assert jl.checkpoint.read_meta(e.value.path)["global_step"] == 8


def test_sigterm_in_epochs_that_never_reach_a_step():
    """``on_train_batch_start`` returning -1 skips every epoch: before, no train batch ever ended, so the
    signal was never read and the loop ran for ever under ``max_steps``."""

    class SkipsEverything(EagerClassifier):
        calls = 0

        def on_train_batch_start(self, batch, batch_idx):
            SkipsEverything.calls += 1
            if SkipsEverything.calls == 20:
                os.kill(os.getpid(), signal.SIGTERM)
            if SkipsEverything.calls > 2000:
                raise AssertionError("SIGTERM was not honoured: still looping over skipped epochs")
            return -1

    x, y = arrays(16)
    t = _trainer(max_steps=5)
    with pytest.raises(jl.Preempted) as e:
        t.fit(SkipsEverything(), [(x[:8], y[:8]), (x[8:], y[8:])])
    assert SkipsEverything.calls < 40 and e.value.step == 0
    assert e.value.path is None  # no step completed: nothing to save


class Proc:
    """A worker subprocess whose stdout and stderr lines are collected on threads (so waits can time out)."""

    def __init__(self, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        self.p = subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._readers = [threading.Thread(target=self._read, args=(s,), daemon=True) for s in self.lines]
        for t in self._readers:
            t.start()

    def _read(self, stream: str) -> None:
        for line in getattr(self.p, stream):
            self.lines[stream].append(line)

    @property
    def out(self) -> str:
        return "".join(self.lines["stdout"])

    @property
    def err(self) -> str:
        return "".join(self.lines["stderr"])

    def wait_for(self, pattern: str, stream: str = "stdout", timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not any(re.search(pattern, ln) for ln in list(self.lines[stream])):
            if time.monotonic() > deadline or (self.p.poll() is not None and not self._readers[0].is_alive()):
                self.p.kill()
                pytest.fail(f"no line matching {pattern!r} within {timeout} s:\n{self.out[-2000:]}\n{self.err[-3000:]}")
            time.sleep(0.05)

    def finish(self, timeout: float = TIMEOUT) -> int:
        try:
            rc = self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
            pytest.fail(f"worker hung:\n{self.out[-2000:]}\n{self.err[-3000:]}")
        for t in self._readers:
            t.join(timeout=10)
        return rc


@pytest.mark.slow
def test_sigterm_to_a_process_whose_loader_stalls_exits_143_with_a_checkpoint(tmp_path, capsys):
    p = Proc(WORKER, str(tmp_path), json.dumps({"stall_at": 3, "max_steps": 6}))
    p.wait_for(r"STALLED train", "stderr")
    time.sleep(0.5)
    t0 = time.monotonic()
    p.p.send_signal(signal.SIGTERM)
    rc = p.finish(timeout=60)
    assert rc == 143, p.out + p.err[-3000:]
    assert time.monotonic() - t0 < 40
    m = re.search(r"PREEMPTED step=(\d+) path=(\S+)", p.out)
    assert m and 1 <= int(m.group(1)) <= 3, p.out
    assert jl.checkpoint.is_complete(m.group(2))
    again = _trainer(tmp_path / "ckpts", max_steps=6)  # resumes in this process (8 devices, like the worker)
    again.fit(DropoutClassifier(), Loader(), ckpt_path="last")
    assert f"restored fit state from {m.group(2)}" in capsys.readouterr().out and again.global_step == 6


@pytest.mark.slow
def test_main_thread_blocked_in_the_loader_exits_at_stop_timeout_or_at_a_second_signal(tmp_path):
    """With ``prefetch=0`` the main thread itself is inside the blocked loader: no stop point comes. Before,
    the process ignored every SIGTERM; now it exits 143 after ``stop_timeout``, saying where it was stuck,
    and a second signal ends it at once."""
    timed = Proc(WORKER, str(tmp_path / "a"), json.dumps({"stall_at": 3, "prefetch": 0, "stop_timeout": 3}))
    twice = Proc(WORKER, str(tmp_path / "b"), json.dumps({"stall_at": 3, "prefetch": 0}))  # stop_timeout 120 s
    timed.wait_for(r"STALLED train", "stderr")
    twice.wait_for(r"STALLED train", "stderr")
    t0 = time.monotonic()
    timed.p.send_signal(signal.SIGTERM)
    twice.p.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    twice.p.send_signal(signal.SIGTERM)
    rc_b = twice.finish(timeout=30)
    t_b = time.monotonic() - t0
    rc_a = timed.finish(timeout=60)
    t_a = time.monotonic() - t0
    assert rc_b == 128 + signal.SIGTERM and t_b < 15, twice.err[-3000:]
    assert "received SIGTERM again; exiting at once" in twice.err
    assert rc_a == 143 and 3 <= t_a < 30, timed.err[-3000:]
    assert "reached no stop point within stop_timeout=3 s of SIGTERM" in timed.err
    assert "adversary_loop_worker.py" in timed.err  # where the main thread was stuck
    assert "PREEMPTED" not in timed.out  # no checkpoint: the state was not at a stop point


@pytest.mark.slow
def test_sigterm_while_a_collective_waits_on_a_dead_peer_names_the_dead_process(tmp_path):
    """Process 1 is killed (-9) after batch 3; process 0 blocks in the next step's collective. Before, its
    SIGTERM was never handled (the main thread never returns to Python); now it exits 143, naming process 1."""
    port = free_port()
    procs = [
        Proc(WORKER, str(tmp_path), json.dumps({"mp": [i, 2, port], "max_steps": 40, "die_at": 3 if i else None}))
        for i in range(2)
    ]
    try:
        procs[1].wait_for(r"DYING 1")
        assert procs[1].finish(timeout=30) == -signal.SIGKILL
        time.sleep(1.0)
        t0 = time.monotonic()
        procs[0].p.send_signal(signal.SIGTERM)
        rc = procs[0].finish(timeout=60)
    finally:
        for p in procs:
            if p.p.poll() is None:
                p.p.kill()
    assert rc == 143, procs[0].out[-2000:] + procs[0].err[-3000:]
    assert time.monotonic() - t0 < 30
    assert "process(es) [1] stopped answering" in procs[0].err, procs[0].err[-3000:]


# ---------------------------------------------------------------------------- jaxlight launch escalates once
LAUNCH = [sys.executable, "-m", "jaxlight.cli", "launch"]


def _launch_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "SLURM_"))}
    return {**env, "JAX_PLATFORMS": "cpu"}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_launch_kills_processes_ignoring_a_forwarded_sigterm_after_one_grace_period(tmp_path):
    """Before: after forwarding SIGTERM the launcher waited for the processes without bound."""
    p = subprocess.Popen(
        [*LAUNCH, "--nprocs", "2", "--grace-period", "1", LAUNCH_WORKER, "stubborn", str(tmp_path)],
        stderr=subprocess.PIPE,
        text=True,
        env=_launch_env(),
    )
    try:
        wait_for_files([tmp_path / f"rank_{i}.json" for i in range(2)])
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
        elapsed = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGKILL, err
    assert 1.0 <= elapsed < 10, elapsed
    assert "rank(s) [0, 1] still running: SIGKILL" in err
    assert all(_gone(json.loads((tmp_path / f"rank_{i}.json").read_text())["pid"]) for i in range(2))


def test_launch_after_a_failure_escalates_after_one_grace_period(tmp_path):
    """Before: the grace period, SIGTERM, the grace period again, SIGKILL (8 s here); now the grace period,
    SIGTERM, and SIGKILL 2 s later (a failed peer leaves no checkpoint worth waiting for)."""
    r = subprocess.run(
        [*LAUNCH, "--nprocs", "3", "--grace-period", "4", LAUNCH_WORKER, "fail", str(tmp_path)],
        capture_output=True,
        text=True,
        env=_launch_env(),
        timeout=60,
    )
    elapsed = time.time() - float((tmp_path / "failed_at").read_text())  # since rank 1 failed
    assert r.returncode == 3, r.stderr
    assert "rank 1 exited with status 3; stopping the other 2 process(es) if they have not exited within 4 s" in (
        r.stderr
    )
    assert "rank(s) [0, 2] still running: SIGKILL" in r.stderr
    assert 5.5 <= elapsed < 7.5, elapsed
    assert all(_gone(json.loads((tmp_path / f"rank_{i}.json").read_text())["pid"]) for i in (0, 2))


# ============================================================================ item 2: epochs without a batch
class Empty:
    """An iterable without a length that yields nothing; counts its passes and refuses to be looped over."""

    def __init__(self) -> None:
        self.passes = 0

    def __iter__(self):
        self.passes += 1
        if self.passes > 50:
            raise AssertionError("fit kept starting epochs over an empty loader")
        return iter(())


def test_a_loader_without_length_that_yields_nothing_raises_naming_it():
    """Before: 100,000 empty epochs in 43 s, for ever, under max_steps."""
    loader = Empty()
    with pytest.raises(jl.MisconfigurationError, match=r"train loader \(Empty .*\) yielded no batch in epoch 0"):
        _trainer(max_steps=10).fit(EagerClassifier(), loader)
    assert loader.passes == 1


class OneShot:
    """A one-shot iterator (``iter()`` returns itself, exhausted after one pass) that refuses to be looped over."""

    def __init__(self, batches) -> None:
        self.it, self.passes = iter(batches), 0

    def __iter__(self):
        self.passes += 1
        if self.passes > 50:
            raise AssertionError("fit kept starting epochs over an exhausted iterator")
        return self

    def __next__(self):
        return next(self.it)


def test_a_one_shot_iterator_raises_at_its_second_epoch():
    x, y = arrays(32)
    gen = OneShot([(x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)])
    t = _trainer(max_steps=10)
    with pytest.raises(jl.MisconfigurationError, match=r"yielded no batch in epoch 1: a one-shot iterator"):
        t.fit(EagerClassifier(), gen)
    assert t.global_step == 4  # the first epoch trained


def test_an_empty_list_loader_warns_once_and_trains_nothing(recwarn):
    t = _trainer(max_epochs=3)
    t.fit(EagerClassifier(), [])
    said = [w for w in recwarn if "has length 0: fit trains nothing" in str(w.message)]
    assert len(said) == 1 and "list" in str(said[0].message)
    assert t.global_step == 0


# ============================================================================ item 10: arguments, dirs, batches
@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"max_steps": "10"}, r"max_steps must be an int \(-1: no limit\), got '10' \(str\)"),
        ({"max_epochs": 2.5}, r"max_epochs must be an int \(-1: no limit\) or None, got 2.5 \(float\)"),
        ({"max_epochs": -5}, r"max_epochs must be -1 \(no limit\) or >= 0, got -5"),
        ({"min_epochs": -1}, r"min_epochs must be >= 0 \(or None: no minimum\), got -1"),
        ({"min_steps": -1}, r"min_steps must be >= 0 \(or None: no minimum\), got -1"),
        ({"num_sanity_val_steps": -3}, r"num_sanity_val_steps must be -1 \(every validation batch\) or >= 0, got -3"),
        ({"log_every_n_steps": "5"}, r"log_every_n_steps must be an int >= 1 or None, got '5' \(str\)"),
        ({"check_val_every_n_epoch": 1.0}, r"check_val_every_n_epoch must be an int >= 1 or None, got 1.0"),
        ({"accumulate_grad_batches": True}, r"accumulate_grad_batches must be an int >= 1, got True \(bool\)"),
        ({"val_check_interval": "0.5"}, r"val_check_interval must be an int \(batches\) or a float"),
        ({"gradient_clip_val": "1.0"}, r"gradient_clip_val must be a finite number >= 0 or None, got '1.0'"),
        ({"gradient_clip_val": float("nan")}, r"gradient_clip_val must be a finite number >= 0 or None, got nan"),
        ({"fast_dev_run": "yes"}, r"fast_dev_run must be a bool or an int >= 0, got 'yes'"),
        ({"enable_checkpointing": "no"}, r"enable_checkpointing must be True, False or None, got 'no'"),
        ({"devices": [0, 0]}, r"devices=\[0, 0\] names device\(s\) \[0\] more than once"),
        ({"devices": []}, r"devices=\[\] names no device"),
    ],
)
def test_bad_arguments_are_refused_with_the_numbers(kw, message):
    """Before: TypeError (max_steps="10"), a bare AssertionError (devices=[0, 0]) or silent acceptance."""
    with pytest.raises(jl.MisconfigurationError, match=message):
        jl.Trainer(**kw)


def test_lightning_meanings_of_minus_one_are_kept():
    t = jl.Trainer(max_epochs=-1, max_steps=-1, **quiet(num_sanity_val_steps=-1))
    assert (t.max_epochs, t.max_steps, t.num_sanity_val_steps) == (-1, -1, -1)
    assert jl.Trainer(max_steps=np.int64(3), logger=False).max_steps == 3  # numpy ints are ints


@pytest.mark.parametrize(
    ("strategy", "message"),
    [
        ("ddp+ddp", r"strategy 'ddp\+ddp' names 'ddp' 2 times; name each piece once"),
        ("fsdp+tp+FSDP", r"names 'fsdp' 2 times"),
        ("ddp+dp", r"'ddp' and 'dp' are the same piece \(DataParallel\)"),
    ],
)
def test_repeated_strategy_pieces_are_refused(strategy, message):
    with pytest.raises(ValueError, match=message):
        jl.Trainer(strategy=strategy)


class Traced(EagerClassifier):
    traced = 0

    def training_step(self, batch, batch_idx):
        Traced.traced += 1
        return super().training_step(batch, batch_idx)


def test_an_unwritable_log_directory_is_refused_before_any_step_is_compiled(tmp_path):
    """Before: the CSV logger found out when it first flushed metrics, after compiling and training."""
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the log directory should be")
    x, y = arrays(16)
    t = jl.Trainer(max_steps=2, **quiet(logger=jl.loggers.CSVLogger(str(blocker / "logs"))))
    Traced.traced = 0
    with pytest.raises(jl.MisconfigurationError, match=r"CSVLogger writes its logs to .*not_a_dir.* is not a dir"):
        t.fit(Traced(), [(x[:8], y[:8])])
    assert Traced.traced == 0
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:
        probe = read_only / "probe"
        try:
            probe.write_text("")
            probe.unlink()
            pytest.skip("this user writes into a 0o500 directory (root)")
        except OSError:
            pass
        t = jl.Trainer(max_steps=2, **quiet(logger=jl.loggers.CSVLogger(str(read_only))))
        with pytest.raises(jl.MisconfigurationError, match=r"does not take new files"):
            t.fit(Traced(), [(x[:8], y[:8])])
        assert Traced.traced == 0
    finally:
        read_only.chmod(0o700)


def test_a_read_only_filesystem_is_refused_even_for_root():
    if not os.path.isdir("/proc/self"):
        pytest.skip("needs /proc")
    x, y = arrays(16)
    t = jl.Trainer(max_steps=2, **quiet(logger=jl.loggers.CSVLogger("/proc/self/jaxlight-logs")))
    with pytest.raises(jl.MisconfigurationError, match=r"writes its logs to '/proc/self/jaxlight-logs/.*does not take"):
        t.fit(EagerClassifier(), [(x[:8], y[:8])])


def _fit_batches(batches, **kw):
    t = _trainer(max_epochs=kw.pop("max_epochs", 1), **kw)
    t.fit(EagerClassifier(), batches)
    return t


def test_a_feature_dim_change_mid_epoch_names_the_leaf_and_both_shapes():
    """Before: JAX's "Argument types differ from the types for which this computation was compiled"."""
    x, y = arrays(32, din=12)
    data = [(x[:8, :8], y[:8]), (x[8:16, :8], y[8:16]), (x[16:24], y[16:24])]
    with pytest.raises(BatchError, match=r"train batch 2: leaf \[0\] has shape \(8, 12\) float32 but the step was "):
        _fit_batches(data)
    with pytest.raises(BatchError, match=r"compiled for \(8, 8\) float32"):
        _fit_batches(data)


def test_a_dtype_change_mid_epoch_and_a_change_in_a_later_epoch_are_named():
    x, y = arrays(16)
    with pytest.raises(BatchError, match=r"leaf \[1\] has shape \(8,\) float32 but .* \(8,\) int32"):
        _fit_batches([(x[:8], y[:8]), (x[8:], y[8:].astype(np.float32))])

    class Grows:  # the same shapes within an epoch, a wider feature dim in the second one
        passes = 0

        def __iter__(self):
            Grows.passes += 1
            xs, ys = arrays(16, din=8 if Grows.passes == 1 else 16)
            return iter([(xs[:8], ys[:8]), (xs[8:], ys[8:])])

    with pytest.raises(BatchError, match=r"train batch 0: leaf \[0\] has shape \(8, 16\) .* compiled for \(8, 8\)"):
        _fit_batches(Grows(), max_epochs=2)


def test_a_shorter_last_batch_is_not_a_shape_change():
    """Only the row count differs: that is the ragged-batch rule's business, not a signature error."""
    x, y = arrays(20)
    t = _fit_batches([(x[:8], y[:8]), (x[8:16], y[8:16]), (x[16:], y[16:])], ragged_batches="drop")
    assert t.global_step == 2
