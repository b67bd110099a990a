"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere."""

import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    + " --xla_force_host_platform_device_count=8"
).strip()
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
