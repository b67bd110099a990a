"""Adversary cases for checkpoints (issue 26): faults that lose data, delete files or hang, each shut.

Each test is one case of the adversary trial: a diverging run, a tampered or shared checkpoint, a second run on
the same directory, a bad ``filename``, damaged metadata, a full or read-only disk. Nothing here can hang: the
one live second run is a subprocess with a deadline of its own, waited for with timeouts; a real full disk is a
small tmpfs (skipped where mounting is not allowed), and the same case also runs everywhere with the free space
reported small.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pathlib
import re
import select
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import jaxlight as jl
from jaxlight.checkpoint import run_state
from tests.checkpoint_models import DropoutClassifier, arrays
from tests.helpers import quiet

HERE = pathlib.Path(__file__).resolve().parent
MC = jl.callbacks.ModelCheckpoint


# one device; checkpointing left to the Trainer's default (the tests give their own ModelCheckpoint)
_quiet = functools.partial(quiet, devices=1, enable_checkpointing=None)


def _data(n_batches: int = 4, nan_from: int | None = None) -> list:
    """``n_batches`` batches of 8; from batch ``nan_from`` on the inputs are NaN (the loss diverges there)."""
    x, y = arrays(8 * n_batches)
    out = [(x[i : i + 8].copy(), y[i : i + 8]) for i in range(0, 8 * n_batches, 8)]
    for b in out[nan_from:] if nan_from is not None else []:
        b[0][:] = np.nan
    return out


def _rewrite_meta(ckpt: pathlib.Path, edit) -> None:
    f = ckpt / "meta" / "metadata"
    meta = json.loads(f.read_text())
    edit(meta)
    f.write_text(json.dumps(meta))  # in place: a hard-linked copy (last.ckpt) sees the same edit


def _step(path) -> int:
    return jl.checkpoint.read_meta(path)["global_step"]


def _messages(record) -> str:
    return "\n".join(str(w.message) for w in record)


@contextlib.contextmanager
def _tmpfs(path: pathlib.Path, size: str, ro: bool = False):
    """A small tmpfs at ``path`` (a real disk that fills up or refuses writes); skips where mounting fails."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}" + (",ro" if ro else ""), "tmpfs", str(path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot mount a tmpfs here: {e}")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


# ---------------------------------------------------------------------------- 3: NaN/Inf is not trained on silently
def test_a_diverging_run_warns_and_keeps_its_finite_checkpoints(tmp_path):
    """The loss turns NaN at step 3: the trainer says so at the log cadence, and top-1 and last keep step 2
    (before: no warning, and the step-8 NaN state replaced both)."""
    d = tmp_path / "ck"
    ck = MC(dirpath=str(d), every_n_train_steps=2, save_top_k=1, save_last=True)
    t = jl.Trainer(max_steps=8, log_every_n_steps=1, callbacks=[ck], **_quiet())
    with pytest.warns(UserWarning) as record:
        t.fit(DropoutClassifier(), _data(8, nan_from=2))
    text = _messages(record)
    assert re.search(r"the training loss is nan at step 2 \(checked every log_every_n_steps=1", text), text
    assert "not saving global step 4: the training loss is nan" in text, text
    assert sorted(os.listdir(d)) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert _step(d / "last.ckpt") == 2 and ck.best_model_path.endswith("epoch=0-step=2.ckpt")
    params = jl.checkpoint.host_checkpoint(jl.checkpoint.read_meta(d / "last.ckpt"))
    assert params["global_step"] == 2


def test_save_non_finite_saves_a_diverged_state(tmp_path):
    d = tmp_path / "ck"
    ck = MC(dirpath=str(d), every_n_train_steps=2, save_top_k=1, save_last=True, save_non_finite=True)
    jl.Trainer(max_steps=4, callbacks=[ck], **_quiet()).fit(DropoutClassifier(), _data(4, nan_from=2))
    assert _step(d / "last.ckpt") == 4


# ---------------------------------------------------------------------------- 4: a shared checkpoint deletes nothing
def test_a_tampered_state_cannot_make_a_resume_delete_files(tmp_path):
    """The saved ModelCheckpoint state names a user's files, a folder, an incomplete and a linked directory in
    dirpath and a real checkpoint elsewhere as its own; resuming with ckpt_path="last" deletes none of them
    (before: all but the one outside dirpath were deleted)."""
    d = tmp_path / "ck"
    make = lambda: MC(dirpath=str(d), every_n_train_steps=2, save_top_k=1, save_last=True)
    jl.Trainer(max_steps=4, callbacks=[make()], **_quiet()).fit(DropoutClassifier(), _data())
    notes, sub, half, link = d / "precious_notes.txt", d / "user_subdir", d / "half.ckpt", d / "user_link.ckpt"
    notes.write_text("mine")
    (sub / "inner").mkdir(parents=True)
    (sub / "inner" / "data.txt").write_text("mine too")
    (half / "model").mkdir(parents=True)
    link.symlink_to(sub)
    outside = tmp_path / "elsewhere" / "copy.ckpt"
    shutil.copytree(d / "epoch=0-step=4.ckpt", outside)
    victims = [notes, sub, half, link, outside]

    def edit(meta):
        (key,) = [k for k in meta["host_state"]["callbacks"] if k.startswith("ModelCheckpoint")]
        state = meta["host_state"]["callbacks"][key]
        state["pending_removals"] = [str(p) for p in victims]
        state["best_model_path"] = str(sub)  # the previous top-1 file, removed by the next save
        state["last_model_path"] = str(notes)  # the previous last, replaced by the next save
        state["last_checkpoint_saved"] = str(half)
        state["extra_path"] = str(link)
        state["best_k_models"] = {str(notes): 0.0, str(outside): 0.0}
        state["kth_best_model_path"] = str(notes)

    _rewrite_meta(d / "last.ckpt", edit)
    t = jl.Trainer(max_steps=8, callbacks=[make()], **_quiet())
    with pytest.warns(UserWarning, match="left on disk untouched") as record:
        t.fit(DropoutClassifier(), _data(), ckpt_path="last")
    assert t.global_step == 8
    assert notes.read_text() == "mine" and (sub / "inner" / "data.txt").read_text() == "mine too"
    assert half.is_dir() and link.is_symlink() and jl.checkpoint.is_complete(outside)
    text = _messages(record)
    for p in (notes, sub, half, link):
        assert repr(str(p)) in text, (p, text)
    # the restored last_model_path was refused, so the existing last.ckpt counts as a file not of this run's
    assert _step(jl.checkpoint.find_last([d])) == 8


# ---------------------------------------------------------------------------- 5: a monitor that never arrives
@pytest.mark.parametrize(
    "monitor,kw,match",
    [
        ("trian_loss", {"every_n_train_steps": 2}, r"monitor='trian_loss'.*\['train_loss'\]"),
        ("val_loss", {"every_n_train_steps": 2}, r"monitor='val_loss'.*validation does not run in this fit"),
        ("trian_loss", {}, r"monitor='trian_loss'.*\['train_loss'\]"),
    ],
    ids=["typo-every-n-steps", "val-only-no-validation", "typo-epoch-end"],
)
def test_a_monitor_missing_at_the_first_save_is_an_error(tmp_path, monitor, kw, match):
    """Before: the step trigger waited for a validation that never came (no checkpoint, no word), and the
    epoch trigger only warned."""
    t = jl.Trainer(max_steps=4, callbacks=[MC(dirpath=str(tmp_path / "ck"), monitor=monitor, **kw)], **_quiet())
    with pytest.raises(jl.MisconfigurationError, match=match):
        t.fit(DropoutClassifier(), _data())
    assert t.global_step == (2 if kw else 4)  # the first save, not later


# ---------------------------------------------------------------------------- 6: one live run per directory
def _lock_file(d) -> str:
    from jaxlight.checkpoint import dirlock  # inside: the module is new (issue 26)

    return dirlock.lock_paths(str(d))[0]


def test_a_second_run_on_a_held_directory_is_refused_before_any_compile(tmp_path):
    """A live run (a subprocess) holds the directory: a second run raises naming it, before compiling
    anything (before: it ran, and resumed or removed the other run's checkpoints); once the first is killed
    -9, its lock is taken over with a warning and the run goes ahead."""
    d, release = tmp_path / "ck", tmp_path / "release"
    cmd = [sys.executable, str(HERE / "adversary_checkpoint_worker.py"), str(d), str(release)]
    holder = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, lines = time.monotonic() + 180, []
        while time.monotonic() < deadline:
            if not select.select([holder.stdout], [], [], 1.0)[0]:
                continue
            line = holder.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("HOLDING"):
                break
        assert lines and lines[-1].startswith("HOLDING"), "".join(lines)[-3000:]
        pid = int(lines[-1].split()[1])
        t = jl.Trainer(max_steps=2, callbacks=[MC(dirpath=str(d))], **_quiet())
        with pytest.raises(jl.CheckpointError, match=rf"in use by another run: pid {pid} on host "):
            t.fit(DropoutClassifier(), _data())
        assert not t.compile_counts  # refused before any compile
        holder.kill()
        holder.wait(timeout=60)
    finally:
        release.touch()
        if holder.poll() is None:
            holder.kill()
        holder.wait(timeout=60)
    t = jl.Trainer(max_steps=2, callbacks=[MC(dirpath=str(d))], **_quiet())
    with pytest.warns(UserWarning, match=rf"taking over the lock .* left by pid {pid} .*no longer running"):
        t.fit(DropoutClassifier(), _data())
    assert t.global_step == 2 and not os.path.exists(_lock_file(d))  # released at the end


def test_the_lock_is_released_on_an_exception_and_shared_within_a_process(tmp_path):
    """Two ModelCheckpoints of one run share their directory; a run that raises gives it back."""
    d = str(tmp_path / "ck")
    lock = _lock_file(d)

    class Boom(jl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            assert os.path.exists(lock)
            if trainer.global_step == 2:
                raise RuntimeError("boom")

    cbs = [Boom(), MC(dirpath=d, every_n_train_steps=1), MC(dirpath=d, filename="{step}", every_n_train_steps=2)]
    with pytest.raises(RuntimeError, match="boom"):
        jl.Trainer(max_steps=4, callbacks=cbs, **_quiet()).fit(DropoutClassifier(), _data())
    assert not os.path.exists(lock)


def test_locks_of_other_hosts_and_reused_pids(tmp_path):
    from jaxlight.checkpoint import dirlock

    d = str(tmp_path / "ck")
    os.makedirs(d)
    path = dirlock.lock_paths(d)[0]
    other = {"host": "node-17.example", "pid": 4242, "started": "2026-01-01T00:00:00", "command": "train.py"}
    pathlib.Path(path).write_text(json.dumps(other))
    with pytest.raises(jl.CheckpointError, match=rf"pid 4242 on host node-17.example.*remove {re.escape(path)}"):
        dirlock.acquire(d)
    # a live pid of this host that is not the process that wrote the lock (its start time differs)
    reused = {"host": socket.gethostname(), "pid": os.getppid(), "proc_start": "1", "command": "old run"}
    pathlib.Path(path).write_text(json.dumps(reused))
    with pytest.warns(UserWarning, match="taking over the lock"):
        lock = dirlock.acquire(d)
    assert json.loads(pathlib.Path(path).read_text())["pid"] == os.getpid()
    lock.release()
    assert not os.path.exists(path)


# ---------------------------------------------------------------------------- 7: names stay in dirpath
@pytest.mark.parametrize("filename", ["../escape-{step}", "sub/{epoch}-{step}", "{epoch}/../{step}"])
def test_filenames_leaving_dirpath_are_refused(filename):
    """Before: accepted; top-k and "last" never found such checkpoints and a rerun restarted at step 0."""
    with pytest.raises(jl.MisconfigurationError, match="keep filename a plain name"):
        MC(dirpath="/ck", filename=filename)


class SlashLogged(DropoutClassifier):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train/loss", loss)
        return loss


def test_a_metric_name_with_a_slash_is_refused_at_fit_start_or_used_as_a_plain_name(tmp_path):
    d = str(tmp_path / "ck")
    t = jl.Trainer(max_steps=2, callbacks=[MC(dirpath=d, filename="{epoch}-{train/loss:.2f}")], **_quiet())
    with pytest.raises(jl.MisconfigurationError, match=r"auto_insert_metric_name inserts the metric name 'train/loss'"):
        t.fit(SlashLogged(), _data())
    assert not t.compile_counts
    ck = MC(dirpath=d, filename="{epoch}-loss={train/loss:.2f}", auto_insert_metric_name=False, every_n_train_steps=2)
    jl.Trainer(max_steps=2, callbacks=[ck], **_quiet()).fit(SlashLogged(), _data())
    again = jl.Trainer(max_steps=4, callbacks=[MC(dirpath=d, every_n_train_steps=2)], **_quiet())
    again.fit(SlashLogged(), _data(), ckpt_path="last")
    assert again.ckpt_path.startswith(os.path.join(d, "0-loss=")) and again.global_step == 4


# ---------------------------------------------------------------------------- 9: metadata checked before arrays
@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> pathlib.Path:
    """A mid-epoch checkpoint (step 2 of 4) written by a ModelCheckpoint."""
    d = tmp_path_factory.mktemp("adversary") / "ck"
    jl.Trainer(max_steps=2, callbacks=[MC(dirpath=str(d), every_n_train_steps=2)], **_quiet()).fit(
        DropoutClassifier(), _data()
    )
    return d / "epoch=0-step=2.ckpt"


def _copy(src: pathlib.Path, tmp_path: pathlib.Path, name: str = "x.ckpt") -> pathlib.Path:
    dst = tmp_path / "copies" / name
    shutil.copytree(src, dst)
    return dst


def _host(m):
    return m["host_state"]


def _fit_loop(m):
    return m["host_state"]["loops"]["fit_loop"]


def _mc_state(m):
    (key,) = [k for k in m["host_state"]["callbacks"] if k.startswith("ModelCheckpoint")]
    return m["host_state"]["callbacks"][key]


DAMAGE = {
    # (edit, the key the error names, what it says); "before" is what the code did without the schema
    "time-text": (lambda m: m.update(time="yesterday"), r"\['time'\]", "a finite number"),  # before: loaded
    "time-nan": (lambda m: m.update(time=float("nan")), r"\['time'\]", "a finite number"),  # before: loaded
    "huge-step": (
        lambda m: (m.update(global_step=10**30), _host(m).update(global_step=10**30)),
        r"\['global_step'\]",
        "more than any run",
    ),  # before: accepted
    "step-mismatch": (lambda m: m.update(global_step=999), r"\['global_step'\] is 999", "inconsistent"),
    "window": (lambda m: _fit_loop(m).update(window="abc"), r"\['window'\]", "an int >= 0, got str"),
    "key-impl": (
        lambda m: m["key_impls"].update(dict.fromkeys(m["key_impls"], "os.system")),
        r"\['key_impls'\]",
        "should be one of",
    ),  # before: raw error from jax after the arrays were read
    "mesh": (lambda m: m["mesh"].update(data="eight"), r"\['mesh'\]\['data'\]", "an int >= 1"),
    "callback-state": (
        lambda m: _mc_state(m).update(best_k_models=[1, 2]),
        r"\['callbacks'\]\[.ModelCheckpoint.*best_k_models",
        "a dict of checkpoint path",
    ),  # before: AttributeError in load_state_dict, after the arrays were loaded
    "epoch-metrics": (
        lambda m: _fit_loop(m).update(train_metrics={"specs": {"x": {"on_step": 1}}, "acc": {}}),
        r"\['train_metrics'\]\['specs'\]\['x'\]",
        "a dict with the fields",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_metadata_is_refused_naming_file_and_key_before_any_array_is_read(saved, tmp_path, monkeypatch, damage):
    edit, key, says = DAMAGE[damage]
    path = _copy(saved, tmp_path)
    _rewrite_meta(path, edit)
    read = []
    real = run_state.restore_arrays
    monkeypatch.setattr(run_state, "restore_arrays", lambda *a, **k: read.append(a) or real(*a, **k))
    t = jl.Trainer(max_steps=4, callbacks=[MC(dirpath=str(tmp_path / "new"), every_n_train_steps=2)], **_quiet())
    file = re.escape(str(path / "meta" / "metadata"))
    with pytest.raises(jl.CheckpointError, match=rf"{file}.*{key}.*{says}|{file}.*{says}.*{key}"):
        t.fit(DropoutClassifier(), _data(), ckpt_path=str(path))
    assert not read  # nothing was read into the trainer


def test_last_orders_by_progress_and_commit_not_by_a_claimed_time(tmp_path):
    """A checkpoint claiming the year 3000 is not "last" over a later step; of two saves of one step the later
    commit is (before: the claimed time decided both)."""
    d = tmp_path / "ck"

    class Saves(jl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step in (2, 4):
                trainer.save_checkpoint(str(d / f"s{trainer.global_step}.ckpt"))
            if trainer.global_step == 4:
                trainer.save_checkpoint(str(d / "again.ckpt"))

    jl.Trainer(max_steps=4, enable_checkpointing=False, callbacks=[Saves()], **_quiet()).fit(
        DropoutClassifier(), _data()
    )
    _rewrite_meta(d / "s2.ckpt", lambda m: m.update(time=32503680000.0))  # year 3000
    _rewrite_meta(d / "again.ckpt", lambda m: m.update(time=0.0))  # a clock set to 1970
    assert (
        jl.checkpoint.read_meta(d / "again.ckpt")["commit_seq"] > jl.checkpoint.read_meta(d / "s4.ckpt")["commit_seq"]
    )
    assert jl.checkpoint.find_last([d]) == d / "again.ckpt"


def test_a_torch_dtype_tag_never_imports_the_module_it_names(saved, tmp_path):
    """A tag naming torch._dynamo is refused before torch is touched (before: torch imported torch._dynamo
    through its lazy attribute lookup, then refused)."""
    path = _copy(saved, tmp_path)
    tag = {"__type__": "torch.dtype", "name": "_dynamo"}
    _rewrite_meta(path, lambda m: _host(m)["hyper_parameters"].update(dtype=tag))
    code = (
        "import sys, jaxlight as jl\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        f"meta = jl.checkpoint.read_meta({str(path)!r})\n"
        "try:\n"
        "    jl.checkpoint.host_checkpoint(meta)\n"
        "except jl.CheckpointError as e:\n"
        "    print('REFUSED', e)\n"
        "print('DYNAMO', 'torch._dynamo' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert "REFUSED" in r.stdout and "torch has no dtype '_dynamo'" in r.stdout, r.stdout + r.stderr[-3000:]
    assert "DYNAMO False" in r.stdout, r.stdout


# ---------------------------------------------------------------------------- 10: full and read-only disks
class FillAt(jl.Callback):
    """At step 3, once the step-2 checkpoint has committed, the disk is filled (or reported full)."""

    def __init__(self, fill) -> None:
        self.fill = fill

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == 3:
            trainer.checkpoint_callback.wait_until_finished()
            self.fill()


def _assert_previous_kept(d: pathlib.Path) -> None:
    assert [p.name for p in jl.checkpoint.list_checkpoints(d)] == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert _step(d / "last.ckpt") == 2


def test_a_full_disk_is_a_checkpoint_error_and_keeps_the_previous_checkpoints(tmp_path, monkeypatch):
    d = tmp_path / "ck"
    fill = lambda: monkeypatch.setattr(jl.checkpoint.format, "free_bytes", lambda path: 1000)
    ck = MC(dirpath=str(d), every_n_train_steps=2, save_top_k=1, save_last=True)
    t = jl.Trainer(max_steps=6, callbacks=[FillAt(fill), ck], **_quiet())
    with pytest.raises(
        jl.CheckpointError,
        match=rf"epoch=0-step=4.ckpt: not enough disk space in {re.escape(str(d))} "
        r"\(the save needs about [\d.]+ KiB, 1000 B free\)",
    ):
        t.fit(DropoutClassifier(), _data())
    _assert_previous_kept(d)


@pytest.mark.parametrize("where", ["checked-first", "orbax-write"])
def test_a_real_full_disk(tmp_path, monkeypatch, where):
    """A 4 MiB tmpfs filled after the first save: the next save fails with jaxlight's error, checked before
    anything is written or raised by orbax's write (tensorstore's RESOURCE_EXHAUSTED); before, that raw error."""
    with _tmpfs(tmp_path / "disk", "4m") as disk:
        d = disk / "ck"

        def fill():
            st = os.statvfs(disk)
            with open(disk / "filler", "wb") as f:
                f.write(b"\0" * (st.f_bavail * st.f_frsize - 8192))

        if where == "orbax-write":
            monkeypatch.setattr(run_state, "check_space", lambda *a: None, raising=False)
        ck = MC(dirpath=str(d), every_n_train_steps=2, save_top_k=1, save_last=True)
        t = jl.Trainer(max_steps=6, callbacks=[FillAt(fill), ck], **_quiet())
        says = "not enough disk space" if where == "checked-first" else "the disk is full"
        with pytest.raises(jl.CheckpointError, match=rf"epoch=0-step=4.ckpt: {says} in {re.escape(str(d))} "):
            t.fit(DropoutClassifier(), _data())
        _assert_previous_kept(d)


def test_an_unwritable_checkpoint_directory_is_found_at_fit_start(tmp_path):
    """Before: found at the first save, after compiling and training two steps."""
    (tmp_path / "afile").write_text("")
    t = jl.Trainer(max_steps=4, callbacks=[MC(dirpath=str(tmp_path / "afile" / "ck"))], **_quiet())
    with pytest.raises(jl.CheckpointError, match=r"afile/ck is not writable"):
        t.fit(DropoutClassifier(), _data())
    assert not t.compile_counts


def test_a_read_only_checkpoint_directory_is_found_at_fit_start(tmp_path):
    with _tmpfs(tmp_path / "ro", "1m", ro=True) as ro:
        t = jl.Trainer(max_steps=4, callbacks=[MC(dirpath=str(ro))], **_quiet())
        with pytest.raises(jl.CheckpointError, match=rf"{re.escape(str(ro))} is not writable \(Read-only file system"):
            t.fit(DropoutClassifier(), _data())
        assert not t.compile_counts
