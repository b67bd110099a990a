"""ModelCheckpoint bookkeeping: Lightning's save_last=True / "link" semantics checked against pytorch-lightning
itself, and last / top-k that never lag behind async saves, checked by freezing and killing a fast run."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import jaxlight as jl
from jaxlight.callbacks import model_checkpoint as mc_mod
from jaxlight.checkpoint import publish
from tests.checkpoint_models import DropoutClassifier

HERE = os.path.dirname(os.path.abspath(__file__))
SCORES = (0.5, 0.3, 0.4, 0.1, 0.35)  # per epoch; the last epoch does not improve on the top 2
EPOCHS, BATCHES = len(SCORES), 6

# (save_last, save_top_k, extra ModelCheckpoint arguments)
EPOCH_CASES = [(sl, k, {}) for sl in (True, "link") for k in (1, 2, -1)]
STEP_CASES = [(sl, k, {"every_n_train_steps": 4}) for sl in (True, "link") for k in (1, 2, -1)]
# no monitor, one file name per epoch: Lightning overwrites it at every save within the epoch
OVERWRITE_CASES = [(sl, 1, {"every_n_train_steps": 2, "filename": "{epoch}", "monitor": None}) for sl in (True, "link")]

LIGHTNING_SCRIPT = textwrap.dedent(
    """
    import json, logging, os, sys, warnings
    warnings.filterwarnings("ignore")
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import torch
    import pytorch_lightning as pl

    SCORES, BATCHES = json.loads(sys.argv[2]), int(sys.argv[3])

    class Scored(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).sum()

        def validation_step(self, batch, batch_idx):
            pass

        def on_validation_epoch_end(self):
            self.log("score", SCORES[self.current_epoch])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(BATCHES, 2)), batch_size=1)
    out = []
    for i, (save_last, k, extra) in enumerate(json.loads(sys.argv[4])):
        d = os.path.join(sys.argv[1], str(i))
        kw = {"monitor": "score", **extra}
        cb = pl.callbacks.ModelCheckpoint(dirpath=d, save_last=save_last, save_top_k=k, **kw)
        trainer = pl.Trainer(
            max_epochs=len(SCORES), logger=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, callbacks=[cb], accelerator="cpu", devices=1,
        )
        trainer.fit(Scored(), data, data)
        last = os.path.join(d, "last.ckpt")
        out.append({
            "files": sorted(os.listdir(d)),
            "last_link": os.readlink(last) if os.path.islink(last) else None,
            "last_step": torch.load(last, weights_only=True)["global_step"],
            "best": os.path.basename(cb.best_model_path),
            "best_k": sorted(os.path.basename(p) for p in cb.best_k_models),
            "last_model_path": os.path.basename(cb.last_model_path),
        })
    print("RESULT " + json.dumps(out))
    """
)


def _lightning(tmp_path, cases):
    if importlib.util.find_spec("pytorch_lightning") is None:  # imported only in the subprocess
        pytest.skip("pytorch-lightning is not installed")
    script = tmp_path / "pl_run.py"
    script.write_text(LIGHTNING_SCRIPT)
    r = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "pl"), json.dumps(SCORES), str(BATCHES), json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(line[0][len("RESULT ") :])


class Scored(DropoutClassifier):
    def on_validation_epoch_end(self):
        self.log("score", SCORES[self.current_epoch])


def _jaxlight(tmp_path, cases):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCHES, 8)).astype(np.float32)
    y = rng.integers(0, 4, BATCHES).astype(np.int32)
    data = [(x[i : i + 1], y[i : i + 1]) for i in range(BATCHES)]
    out = []
    for i, (save_last, k, extra) in enumerate(cases):
        d = str(tmp_path / "jl" / str(i))
        cb = jl.callbacks.ModelCheckpoint(dirpath=d, save_last=save_last, save_top_k=k, **{"monitor": "score", **extra})
        t = jl.Trainer(
            max_epochs=EPOCHS,
            devices=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=[cb],
        )
        t.fit(Scored(hidden=4), data, data[:1])
        last = os.path.join(d, "last.ckpt")
        out.append(
            {
                "files": sorted(os.listdir(d)),
                "last_link": os.readlink(last) if os.path.islink(last) else None,
                "last_step": jl.checkpoint.read_meta(last)["global_step"],
                "best": os.path.basename(cb.best_model_path),
                "best_k": sorted(os.path.basename(p) for p in cb.best_k_models),
                "last_model_path": os.path.basename(cb.last_model_path),
            }
        )
        for name in out[-1]["files"]:  # every name is a complete checkpoint (a link: resolves to one)
            assert jl.checkpoint.is_complete(os.path.realpath(os.path.join(d, name))), name
    return out


def _compare(tmp_path, cases):
    want = _lightning(tmp_path, cases)
    got = _jaxlight(tmp_path, cases)
    for case, w, g in zip(cases, want, got):
        assert g == w, f"save_last={case[0]!r} save_top_k={case[1]} {case[2]}: jaxlight {g} != Lightning {w}"
    return want


def test_save_last_true_and_link_match_lightning(tmp_path):
    """Files kept, what last.ckpt is and the step it holds: pytorch-lightning 2.6 vs jaxlight, same program."""
    want = _compare(tmp_path, EPOCH_CASES)
    # the case: top 2 with a non-improving last epoch keeps epochs 1 and 3, and last holds step 24
    top2 = want[EPOCH_CASES.index((True, 2, {}))]
    assert top2["files"] == ["epoch=1-step=12.ckpt", "epoch=3-step=24.ckpt", "last.ckpt"]
    assert top2["last_step"] == 24 and top2["last_link"] is None
    assert want[EPOCH_CASES.index(("link", 2, {}))]["last_link"] == "epoch=3-step=24.ckpt"


@pytest.mark.slow
def test_step_triggers_and_overwritten_names_match_lightning(tmp_path):
    """every_n_train_steps (last-only saves, deferred monitor) and a file name reused within an epoch."""
    _compare(tmp_path, STEP_CASES + OVERWRITE_CASES)


def test_no_atomic_exchange_still_publishes_the_same_files(tmp_path, monkeypatch):
    """Filesystems without renameat2(RENAME_EXCHANGE) take the two-rename path; the result is the same."""
    monkeypatch.setattr(publish, "_exchange", lambda a, b: False)
    monkeypatch.setattr(publish, "_exchange_ok", {})
    cases = [("link", 2, {}), (True, 1, {"every_n_train_steps": 2, "filename": "{epoch}", "monitor": None})]
    got = _jaxlight(tmp_path, cases)
    assert got[0]["files"] == ["epoch=1-step=12.ckpt", "epoch=3-step=24.ckpt", "last.ckpt"]
    assert got[0]["last_link"] == "epoch=3-step=24.ckpt"
    assert got[1]["files"] == ["epoch=4.ckpt", "last.ckpt"] and got[1]["last_step"] == EPOCHS * BATCHES
    assert got[1]["last_link"] is None  # a checkpoint of its own, sharing the files of epoch=4.ckpt
    a = os.path.join(tmp_path, "jl", "1", "epoch=4.ckpt")
    b = os.path.join(tmp_path, "jl", "1", "last.ckpt")
    shared = [
        f
        for root, _, files in os.walk(a)
        for f in files
        if os.path.samefile(os.path.join(root, f), os.path.join(b, os.path.relpath(root, a), f))
    ]
    assert shared  # hard links: the state was written once


# ---------------------------------------------------------------------------------- kill at every file operation
class _Killed(BaseException):
    pass


_MUTATORS = [(os, n) for n in ("rename", "replace", "symlink", "unlink", "link", "rmdir", "mkdir")]


@contextlib.contextmanager
def _killed_before(n):
    """Every mutating filesystem call after the first ``n`` raises: the process died right there."""
    count = [0]
    saved = [(mod, name, getattr(mod, name)) for mod, name in [*_MUTATORS, (publish, "_exchange")]]

    def wrap(fn):
        def call(*a, **k):
            count[0] += 1
            if count[0] > n:
                raise _Killed
            return fn(*a, **k)

        return call

    for mod, name, fn in saved:
        setattr(mod, name, wrap(fn))
    try:
        yield count
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def _fake_checkpoint(path, step):
    """A directory jaxlight.checkpoint sees as complete, holding ``step``."""
    os.makedirs(os.path.join(path, "model"))
    os.makedirs(os.path.join(path, "meta"))
    with open(os.path.join(path, "model", "data"), "w") as f:
        f.write(str(step))
    meta = {"format": jl.checkpoint.FORMAT, "global_step": step, "time": float(step)}
    with open(os.path.join(path, "meta", getattr(jl.checkpoint, "META_FILE", "metadata")), "w") as f:
        json.dump(meta, f)
    for name in ("_CHECKPOINT_METADATA", "commit_success.txt"):
        with open(os.path.join(path, name), "w") as f:
            f.write("{}")


def _assert_consistent(d, newest_possible):
    complete = [str(p) for p in jl.checkpoint.list_checkpoints(d)]
    for p in complete:  # a complete-looking directory is whole (removals rename it away first)
        with open(os.path.join(p, "model", "data")) as f:
            assert int(f.read()) == _step(p), p
    newest = max(_step(p) for p in complete)
    assert newest in newest_possible
    last = os.path.join(d, "last.ckpt")
    assert _complete_at(last) and _step(os.path.realpath(last)) == newest, (sorted(os.listdir(d)), newest)


def _complete_at(p):
    return os.path.exists(p) and jl.checkpoint.is_complete(os.path.realpath(p))


def _scenario(d, save_last, overwrite=False):
    """A (step 1), B (step 2), last -> B; the save of step 3 is staged as orbax leaves it. Returns its plan."""
    os.makedirs(d)
    A, B, C, last = (os.path.join(d, n) for n in ("A.ckpt", "B.ckpt", "C.ckpt", "last.ckpt"))
    _fake_checkpoint(A, 1)
    _fake_checkpoint(B, 2)
    if save_last == "link":
        os.symlink("B.ckpt", last)
    else:
        publish.hardlink_tree(B, last)
    target = B if overwrite else C
    plan = publish.Plan("1-1", names=[target] + ([last] if save_last is True else []))
    if save_last == "link":
        plan.links = [(last, target)]
    plan.removals = [] if overwrite else [A]
    plan.protect = frozenset([target, last])
    plan.staged = publish.marked(target, "staged", "1-1")
    _fake_checkpoint(plan.staged, 3)
    return plan


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "no-exchange"])
@pytest.mark.parametrize("save_last,overwrite", [(True, False), ("link", False), ("link", True), (True, True)])
def test_kill_at_every_file_operation_of_a_commit(tmp_path, monkeypatch, save_last, overwrite, exchange):
    """The commit's file operations cut short after each one in turn: with an atomic exchange ``last`` resolves to
    the newest complete checkpoint at every point; without one, after the next start's repair. A half-removed
    checkpoint never looks complete."""
    if not exchange:
        monkeypatch.setattr(publish, "_exchange", lambda a, b: False)
    for n in range(200):
        monkeypatch.setattr(publish, "_exchange_ok", {})
        d = str(tmp_path / f"cut{n}")
        plan = _scenario(d, save_last, overwrite)
        with _killed_before(n) as count:
            try:
                plan.apply()
                finished = True
            except _Killed:
                finished = False
        if exchange:
            _assert_consistent(d, {2, 3})
        mc_mod.ModelCheckpoint(dirpath=d, save_last=save_last)._repair(d)  # the next run's start
        _assert_consistent(d, {2, 3})
        names = sorted(os.listdir(d))
        assert not [x for x in names if ".orbax-checkpoint-tmp" in x], names  # nothing half-done is left
        assert not [x for x in names if os.path.islink(os.path.join(d, x)) and x != "last.ckpt"], names
        if finished:
            assert count[0] > 3  # the cut points covered every operation of the commit
            assert names == (["A.ckpt", "B.ckpt", "last.ckpt"] if overwrite else ["B.ckpt", "C.ckpt", "last.ckpt"])
            assert _step(os.path.realpath(os.path.join(d, "last.ckpt"))) == 3
            return
    raise AssertionError("the commit did not finish within 200 file operations")


# ---------------------------------------------------------------------------------------------- kill -9
def _step(path):
    return jl.checkpoint.read_meta(path)["global_step"]


def _check_frozen(ckdir, top_k):
    """Invariants of a directory whose writer is stopped (SIGSTOP) or dead (SIGKILL) at an arbitrary instant."""
    complete = [str(p) for p in jl.checkpoint.list_checkpoints(ckdir)]
    last = os.path.join(ckdir, "last.ckpt")
    if not complete:
        return None
    assert os.path.exists(last), f"complete checkpoints {complete} but no resolvable last.ckpt"
    real = os.path.realpath(last)
    assert jl.checkpoint.is_complete(real), real
    newest = max(_step(p) for p in complete)
    assert _step(real) == newest, f"last.ckpt holds step {_step(real)}, the newest complete is {newest}"
    topk = [p for p in complete if os.path.basename(p) != "last.ckpt"]
    assert len(topk) <= top_k + 1, f"{len(topk)} checkpoints besides last with save_top_k={top_k}: {topk}"
    return newest


class Worker:
    def __init__(self, out, **opts):
        cmd = [sys.executable, os.path.join(HERE, "checkpoint_kill_worker.py"), out, json.dumps(opts)]
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.lines: list[str] = []

    def wait_for(self, pattern, timeout=240.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.p.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            m = re.search(pattern, line)
            if m:
                return m
        raise AssertionError(f"no {pattern!r} in worker output:\n{''.join(self.lines)[-4000:]}")

    def finish(self, timeout=300.0):
        out, _ = self.p.communicate(timeout=timeout)
        self.lines.append(out)
        return self.p.returncode

    def output(self):
        return "".join(self.lines)


def kill_run(out, save_last, monitor, top_k, stops=12, seed=0, max_steps=400):
    """One run saving every step asynchronously (each save takes longer than a step, so one is nearly always being
    written), frozen ``stops`` times at random instants and checked each time, then SIGKILLed, checked, resumed from
    the last.ckpt *path* and finished. Returns the step the kill left as newest (the one resumed from)."""
    rnd = random.Random(seed)
    ckdir = os.path.join(out, "ckpts")
    opts = dict(save_last=save_last, monitor=monitor, top_k=top_k)
    w = Worker(out, max_steps=max_steps, **opts)
    w.wait_for(r"^STEP 3\b")
    for _ in range(stops):
        time.sleep(rnd.uniform(0.0, 0.15))
        w.p.send_signal(signal.SIGSTOP)
        try:
            _check_frozen(ckdir, top_k)
        finally:
            w.p.send_signal(signal.SIGCONT)
    time.sleep(rnd.uniform(0.0, 0.15))
    w.p.send_signal(signal.SIGKILL)
    w.finish()
    assert w.p.returncode == -signal.SIGKILL, w.output()[-3000:]
    newest = _check_frozen(ckdir, top_k)
    assert newest is not None
    # a user passing the last.ckpt path itself resumes at the newest complete step
    r = Worker(out, max_steps=newest + 6, ckpt_path=os.path.join(ckdir, "last.ckpt"), **opts)
    resumed = int(r.wait_for(r"^RESUMED (\d+)").group(1))
    assert r.finish() == 0, r.output()[-3000:]
    assert resumed == newest
    _check_frozen(ckdir, top_k)
    names = os.listdir(ckdir)
    assert not [n for n in names if ".orbax-checkpoint-tmp" in n], names  # nothing half-done is left
    assert len(names) == top_k + 1 and "last.ckpt" in names, names
    return newest


@pytest.mark.parametrize(
    "save_last,monitor,top_k",
    [(True, "train_loss", 2), ("link", None, 1)],  # a copy with top-k by rank; a link with every save replacing
)
def test_kill_during_fast_async_saves(tmp_path, save_last, monitor, top_k):
    newest = kill_run(str(tmp_path), save_last, monitor, top_k, stops=8, seed=top_k)
    assert newest >= 3
