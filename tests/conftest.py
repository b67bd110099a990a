"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere."""

import atexit
import os
import shutil
import tempfile

from tests.xla_flags import cheap_codegen, cpu_xla_flags  # imports no jax

# Our flags last, so they win over the same flags already in the environment (XLA takes the last one).
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {cpu_xla_flags(8)}".strip()
# The persistent compilation cache is on by default: point it at a throwaway directory, never a
# developer's real cache (override, not setdefault).
_COMPILE_CACHE = tempfile.mkdtemp(prefix="jaxlight-test-compile-cache-")
atexit.register(shutil.rmtree, _COMPILE_CACHE, True)
os.environ["JAXLIGHT_COMPILE_CACHE"] = _COMPILE_CACHE
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TQDM_DISABLE", "1")

import jax  # noqa: E402 - XLA_FLAGS must be set first

jax.config.update("jax_platforms", "cpu")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _chdir_tmp(tmp_path, monkeypatch):
    """Every test writes logs/checkpoints under its own tmp dir."""
    monkeypatch.chdir(tmp_path)
    yield


def pytest_collection_modifyitems(config, items):
    """Tests marked ``default_codegen`` compare two different compiled programs bit for bit (multi-step against
    single steps, offloaded against resident state). That holds under XLA's default code generator, not under
    the cheap one this process compiles with (tests/xla_flags.py: measured last-bit differences), so here they
    are skipped and tests/test_default_codegen.py runs them in a process with XLA's defaults."""
    if not cheap_codegen():
        return
    skip = pytest.mark.skip(reason="run under XLA's default code generator by tests/test_default_codegen.py")
    for item in items:
        if item.get_closest_marker("default_codegen"):
            item.add_marker(skip)
