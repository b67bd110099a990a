"""The persistent compilation cache (jaxlight/compile_cache.py, Trainer(compile_cache=...)).

Cache hits are observed in a fresh process through JAX's own log line ("Persistent compilation
cache hit for 'jit_train_step'", logger jax._src.compiler) and through the files in the cache
directory, never through timing. Every run that uses the cache is a subprocess
(tests/compile_cache_worker.py): JAX's cache is set up once per process. Each run gets
JAXLIGHT_COMPILE_CACHE pointed into its tmp dir, so nothing is written to the user's ~/.cache.
The tiny LM trains on 8 simulated CPU devices under "fsdp" (sharded executables).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import jaxlight as jl
from jaxlight import compile_cache as cc
from tests.helpers import free_port

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "compile_cache_worker.py"
STEPS = {"jit_train_step", "jit_validate_step"}


def run_worker(tmp: Path, name: str, *args: str, env: dict | None = None, timeout: float = 300) -> dict:
    out = tmp / f"{name}.json"
    full_env = {**os.environ, cc.ENV_DIR: str(tmp / "default-cache"), **(env or {})}
    p = subprocess.run(
        [sys.executable, str(WORKER), str(out), *args],
        cwd=tmp,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert p.returncode == 0, f"worker {name} failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    result = json.loads(out.read_text())
    npz = out.with_suffix(".npz")
    if npz.exists():
        with np.load(npz) as z:
            result["params"] = {k: z[k] for k in z.files}
    return result


def train(tmp: Path, name: str, cache: str | Path, env: dict | None = None) -> dict:
    return run_worker(tmp, name, "train", str(cache), "8", "fsdp", env=env)


def entries(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.glob("*.xla"))}


def cache_warnings(r: dict) -> list[str]:
    return [w for w in r["warnings"] if "CompileCacheWarning" in w or "compilation cache" in w]


def assert_same_run(a: dict, b: dict) -> None:
    """Bit-identical: every loss, the validation loss and every parameter."""
    assert a["losses"] == b["losses"]
    assert a["val_loss"] == b["val_loss"]
    assert set(a["params"]) == set(b["params"])
    for k in a["params"]:
        np.testing.assert_array_equal(a["params"][k], b["params"][k], err_msg=k)


@pytest.fixture(scope="module")
def cold(tmp_path_factory) -> tuple[dict, Path]:
    """One fit into an empty cache; tests copy the filled directory."""
    tmp = tmp_path_factory.mktemp("cold")
    cache = tmp / "cache"
    r = train(tmp, "cold", cache)
    return r, cache


def copy_cache(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_cold_run_writes_train_and_eval_steps(cold):
    r, cache = cold
    assert r["compile_cache"] == str(cache)
    assert r["jax_hits"] == []
    assert r["compile_counts"] == {"train": 1, "validate": 1}
    # the thresholds let the (fast to compile) train and eval steps in
    assert set(r["stats"]["written_modules"]) >= STEPS
    assert {n.rsplit("-", 1)[0] for n in entries(cache)} >= STEPS
    assert r["stats"]["writes"] == len(entries(cache))
    assert cache_warnings(r) == []
    assert not (Path(cache).parent / "default-cache").exists()  # the explicit path was used, nothing else


def test_fresh_process_reads_cached_steps_bit_identical(cold, tmp_path):
    r0, template = cold
    cache = copy_cache(template, tmp_path / "cache")  # another path: keys do not depend on where the cache is
    before = entries(cache)
    # the default location, moved by the environment variable
    r = train(tmp_path, "warm", "default", env={cc.ENV_DIR: str(cache)})
    assert r["compile_cache"] == str(cache)
    assert set(r["jax_hits"]) >= STEPS, r["jax_hits"]  # JAX's own log: loaded, not compiled
    assert r["stats"]["misses"] == 0 and r["stats"]["writes"] == 0
    assert r["compile_counts"] == {"train": 1, "validate": 1}  # still one per stage, served from the cache
    assert r["hlo_has_train_step"]  # a loaded executable still shows its HLO
    assert entries(cache) == before
    assert cache_warnings(r) == []
    assert_same_run(r0, r)


def test_environment_variable_turns_the_default_off(tmp_path):
    r = run_worker(tmp_path, "off", "probe", "default", env={cc.ENV_DIR: "off"})
    assert r["compile_cache"] is None and r["stats"]["writes"] == 0 and cache_warnings(r) == []
    assert list(tmp_path.glob("*/*.xla")) == []


def test_corrupt_entries_recompile_with_one_warning_and_are_replaced(cold, tmp_path):
    r0, template = cold
    cache = copy_cache(template, tmp_path / "cache")
    files = sorted(cache.glob("*.xla"))
    rng = np.random.default_rng(0)
    for i, f in enumerate(files):
        size = f.stat().st_size
        garbage = rng.integers(0, 256, size=size if i % 2 else size // 2, dtype=np.uint8).tobytes()
        f.write_bytes(garbage)  # garbage of the same length, or a truncated entry
    r = train(tmp_path, "corrupt", cache)
    warned = cache_warnings(r)
    assert len(warned) == 1 and "corrupt" in warned[0], r["warnings"]
    assert r["jax_hits"] == []
    assert r["stats"]["corrupt"] == len(files)
    assert r["stats"]["writes"] == len(files)  # recompiled and rewritten
    assert_same_run(r0, r)
    healed = train(tmp_path, "healed", cache)
    assert set(healed["jax_hits"]) >= STEPS and healed["stats"]["corrupt"] == 0
    assert cache_warnings(healed) == []
    assert_same_run(r0, healed)


def _make_read_only(d: Path) -> list[str]:
    """chmod a-w; as root (which ignores modes) the immutable attribute. Returns what to undo."""
    d.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP)
    undo = ["chmod"]
    if _writable(d) and shutil.which("chattr"):
        if subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode == 0:
            undo.append("chattr")
    return undo


def _undo_read_only(d: Path, undo: list[str]) -> None:
    if "chattr" in undo:
        subprocess.run(["chattr", "-i", str(d)], check=True)
    d.chmod(stat.S_IRWXU)


def _writable(d: Path) -> bool:
    probe = d / ".probe-test"
    try:
        probe.write_bytes(b"")
    except OSError:
        return False
    probe.unlink()
    return True


def test_read_only_cache_is_read_and_still_trains(cold, tmp_path):
    r0, template = cold
    full = copy_cache(template, tmp_path / "full")
    undo = [(d, _make_read_only(d)) for d in (full,)]
    try:
        if _writable(full):
            pytest.skip("cannot make a directory read-only here (root without chattr)")
        before = entries(full)
        r = train(tmp_path, "ro-full", full)
        assert r["compile_cache"] == str(full)
        assert set(r["jax_hits"]) >= STEPS  # entries are served
        warned = cache_warnings(r)
        assert len(warned) == 1 and "not writable" in warned[0], r["warnings"]
        assert entries(full) == before
        assert_same_run(r0, r)
    finally:
        for d, u in undo:
            _undo_read_only(d, u)


def test_unusable_directory_trains_without_cache_and_one_warning(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    r = run_worker(tmp_path, "unusable", "train", str(blocker / "cache"))  # one device: cheaper
    assert r["compile_cache"] is None
    warned = cache_warnings(r)
    assert len(warned) == 1 and "cannot use" in warned[0], r["warnings"]
    assert r["stats"]["writes"] == 0 and r["jax_hits"] == []
    assert r["compile_counts"] == {"train": 1, "validate": 1} and len(r["losses"]) == 3
    assert all(np.isfinite(float.fromhex(x)) for x in r["losses"])


def test_one_cache_per_process_first_wins_and_warns_once(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    r = run_worker(tmp_path, "conflict", "conflict", str(a), str(b))
    assert r["returned"] == [str(a)] * 5
    warned = cache_warnings(r)
    # one for compile_cache=b (asked twice), one for compile_cache=False; none for the default
    assert len(warned) == 2, warned
    assert str(b) in warned[0] and "keeping" in warned[0]
    assert "compile_cache=False" in warned[1]
    assert len(entries(a)) == 1  # the later Trainers' compilation went to the first cache
    assert not b.exists() and not (tmp_path / "default-cache").exists()


def test_a_cache_the_user_configured_in_jax_is_respected(tmp_path):
    user, other = tmp_path / "user", tmp_path / "other"
    r = run_worker(tmp_path, "user", "user_jax", str(user), str(other))
    assert r["returned"] == [str(user), str(user)]
    warned = cache_warnings(r)
    assert len(warned) == 1 and str(other) in warned[0], warned
    assert r["min_compile_time"] == 1.0  # JAX's default, not touched
    assert r["xla_caches"] == "xla_gpu_per_fusion_autotune_cache_dir"
    assert r["stats"]["writes"] == 0  # jaxlight's store is not installed
    assert not other.exists() and not (tmp_path / "default-cache").exists()
    assert user.is_dir() and not list(user.glob("*.xla"))  # JAX's own store, not jaxlight's


@pytest.mark.slow
def test_multi_process_run_writes_from_process_zero_only(tmp_path):
    """Two jax.distributed processes share one cache directory: only process 0 writes (JAX's rule), the next
    run reads, and the losses are the same."""
    cache = tmp_path / "cache"

    def launch(tag: str) -> list[dict]:
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
        env[cc.ENV_DIR] = str(tmp_path / "default-cache")
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(WORKER),
                    str(tmp_path / f"{tag}{i}.json"),
                    "mp",
                    str(i),
                    "2",
                    str(port),
                    str(cache),
                ],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for i in range(2)
        ]
        try:
            outs = [p.communicate(timeout=400)[0] for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail("multi-process workers did not finish within 400 s")
        for p, o in zip(procs, outs):
            assert p.returncode == 0, o[-4000:]
        return [json.loads((tmp_path / f"{tag}{i}.json").read_text()) for i in range(2)]

    first = launch("cold")
    assert first[0]["stats"]["writes"] > 0 and set(first[0]["stats"]["written_modules"]) >= STEPS
    assert first[1]["stats"]["writes"] == 0  # process 1 never writes
    second = launch("warm")
    assert set(second[0]["jax_hits"]) >= STEPS, second[0]["jax_hits"]
    # Process 1 reads only keys process 0 could have written; on CPU JAX's key includes a topology
    # fingerprint that differs per process, so there it compiles again.
    for r in second:
        assert r["stats"]["writes"] == 0
        assert cache_warnings(r) == []
    assert [r["losses"] for r in second] == [first[0]["losses"]] * 2


# ---------------------------------------------------------------- in-process: no JAX cache state touched


def _store(d: Path, **kw) -> cc.DiskCache:
    problems: list[str] = []
    store = cc.DiskCache(d, on_problem=problems.append, **kw)
    store.problems = problems  # type: ignore[attr-defined]
    return store


def test_store_round_trip_and_corruption_detection(tmp_path):
    s = _store(tmp_path)
    key = "jit_train_step-" + "ab" * 32
    assert s.get(key) is None and s.stats.misses == 1
    s.put(key, b"executable bytes")
    assert s.get(key) == b"executable bytes" and s.stats.hits == 1 and s.stats.hit_modules == ["jit_train_step"]
    assert [p.name for p in tmp_path.iterdir()] == [key + ".xla"]  # no temporary file left behind
    f = s.file_for(key)
    blob = bytearray(f.read_bytes())
    blob[-1] ^= 1  # one flipped bit in the payload
    f.write_bytes(bytes(blob))
    assert s.get(key) is None and s.stats.corrupt == 1 and len(s.problems) == 1
    assert not f.exists()  # dropped, so the recompiled program replaces it
    # an entry renamed to another key is not served either (the digest covers the key)
    s.put(key, b"x")
    other = "jit_other-" + "cd" * 32
    os.replace(f, s.file_for(other))
    assert s.get(other) is None and s.stats.corrupt == 2
    # a key that is not a safe file name is hashed
    odd = "jit_<lambda>/../x-" + "0" * 64
    s.put(odd, b"y")
    assert s.get(odd) == b"y" and s.file_for(odd).parent == tmp_path and s.file_for(odd).name.startswith("h-")


def test_store_evicts_least_recently_used_beyond_its_bound(tmp_path):
    head = len(cc.DiskCache._MAGIC) + 32
    s = _store(tmp_path, max_size=5 * (1000 + head))
    keys = [f"jit_f{i}-" + f"{i:064x}" for i in range(5)]
    for i, k in enumerate(keys):
        s.put(k, bytes(1000))
        os.utime(s.file_for(k), ns=(10**18 + i * 10**9,) * 2)  # k0 oldest ... k4 newest
    assert s.stats.evicted == 0
    s.get(keys[0])  # a hit makes k0 the most recently used
    s.put("jit_new-" + "f" * 64, bytes(1000))  # over the bound: evict down to 90%
    left = {p.name.split("-")[0] for p in tmp_path.glob("*.xla")}
    assert left == {"jit_f0", "jit_f3", "jit_f4", "jit_new"}, left
    assert s.stats.evicted == 2
    (tmp_path / "small").mkdir()
    big = _store(tmp_path / "small", max_size=100)
    big.put("jit_big-" + "0" * 64, bytes(1000))  # larger than the whole bound: not stored, one problem
    assert list((tmp_path / "small").iterdir()) == [] and len(big.problems) == 1


def test_store_read_only_never_writes_and_stale_temporaries_are_removed(tmp_path):
    key = "jit_a-" + "1" * 64
    _store(tmp_path).put(key, b"v")
    ro = _store(tmp_path, read_only=True)
    ro.put("jit_b-" + "2" * 64, b"w")
    assert ro.get(key) == b"v" and [p.name for p in tmp_path.glob("*.xla")] == [key + ".xla"]
    stale = tmp_path / ".jit_c.xla.123.abcd.tmp"
    stale.write_bytes(b"half an entry")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    fresh = tmp_path / ".jit_d.xla.124.abcd.tmp"  # a writer that may still be running
    fresh.write_bytes(b"in progress")
    assert [e[1] for e in _store(tmp_path).entries()] == [key + ".xla"]
    assert not stale.exists() and fresh.exists()


_HAMMER = """
import importlib.util, os, random, sys
spec = importlib.util.spec_from_file_location("cc_under_test", sys.argv[1])
cc = importlib.util.module_from_spec(spec); sys.modules["cc_under_test"] = cc; spec.loader.exec_module(cc)
assert "jax" not in sys.modules  # the store itself is plain Python
problems = []
s = cc.DiskCache(sys.argv[2], max_size=int(sys.argv[4]), on_problem=problems.append)
wid, rng = int(sys.argv[3]), random.Random(int(sys.argv[3]))
bad = 0
for i in range(300):
    key = f"jit_k{rng.randrange(4)}-" + "0" * 64
    if rng.random() < 0.5:
        s.put(key, bytes([wid]) * rng.randrange(1, 60_000))
    else:
        v = s.get(key)
        if v is not None and (len(set(v)) != 1 or not v):
            bad += 1
print(bad, len(problems), s.stats.hits, s.stats.writes)
"""


def test_store_is_safe_under_concurrent_processes(tmp_path):
    """Four processes put and get the same keys (eviction included): a reader sees a whole entry or none."""
    src = Path(cc.__file__)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _HAMMER, str(src), str(tmp_path), str(w), str(150_000)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in range(1, 5)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    hits = 0
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, e
        bad, problems, h, w = map(int, o.split())
        assert bad == 0 and problems == 0, o
        hits += h
    assert hits > 0  # the readers did read entries the others wrote
    assert not list(tmp_path.glob(".*.tmp"))
    assert sum(f.stat().st_size for f in tmp_path.glob("*.xla")) <= 150_000


def test_default_cache_dir_and_settings(monkeypatch, tmp_path):
    monkeypatch.delenv(cc.ENV_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cc.default_cache_dir() == tmp_path / "xdg" / "jaxlight" / "compile"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cc.default_cache_dir() == tmp_path / "home" / ".cache" / "jaxlight" / "compile"
    monkeypatch.setenv(cc.ENV_DIR, "~/fast")
    assert cc.default_cache_dir() == tmp_path / "home" / "fast"
    for off in ("0", "false", "OFF", "no"):
        monkeypatch.setenv(cc.ENV_DIR, off)
        assert cc.default_cache_dir() is None
    assert cc._parse_size("8G") == 8 * 1024**3 and cc._parse_size("500MiB") == 500 * 1024**2
    assert cc._parse_size("1234") == 1234
    for bad in ("lots", "0", "-5G"):
        with pytest.raises(jl.MisconfigurationError, match=cc.ENV_MAX_SIZE):
            cc._parse_size(bad)


@pytest.mark.parametrize("bad", [3, "", 1.5, ["dir"]])
def test_bad_compile_cache_argument_raises_before_anything(bad):
    with pytest.raises(jl.MisconfigurationError, match="compile_cache"):
        jl.Trainer(compile_cache=bad)


def test_clear_removes_only_cache_files(tmp_path, capsys):
    d = tmp_path / "cache"
    d.mkdir()
    s = _store(d)
    s.put("jit_a-" + "1" * 64, bytes(2048))
    (d / "xla_gpu_per_fusion_autotune_cache_dir").mkdir()
    (d / "notes.txt").write_text("the user's own file")
    assert cc.main(["info", "--dir", str(d)]) == 0
    assert "1 entries" in capsys.readouterr().out
    assert cc.main(["clear", "--dir", str(d)]) == 0
    assert "removed 1 entries" in capsys.readouterr().out
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt"]
