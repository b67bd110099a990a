"""The suite compiles with a cheap XLA:CPU code generator (tests/xla_flags.py); users compile with XLA's defaults.

Most claims the tests make hold under either generator, because both sides of each comparison run the same
compiled program (a resume against an uninterrupted run) or are compared at a stated tolerance (a strategy
against one device). Claims that two *different* programs give bit-identical results (N steps scanned in one
execution against N single steps; offloaded or streamed optimizer state against resident state) hold under
XLA's default generator only: under the cheap one the same tests measured last-bit differences. Those tests
are marked ``default_codegen``; the main process skips them (tests/conftest.py) and this test runs them all in
one pytest subprocess under XLA's defaults, so they are never left out.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.xla_flags import CHEAP_CPU_CODEGEN, DEFAULT_CODEGEN_ENV, cheap_codegen

ROOT = Path(__file__).resolve().parent.parent
MARK = "@pytest.mark.default_codegen"


def _marked_files() -> list[str]:
    return sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if MARK in p.read_text(encoding="utf-8")
    )


def _codegen_flags_in_use() -> list[str]:
    flags = os.environ["XLA_FLAGS"].split()
    return [f for f in CHEAP_CPU_CODEGEN if f in flags]


def test_this_process_compiles_with_the_cheap_code_generator_unless_told_otherwise():
    import jax

    assert len(jax.devices()) == 8
    want = list(CHEAP_CPU_CODEGEN) if cheap_codegen() else []
    assert _codegen_flags_in_use() == want, os.environ["XLA_FLAGS"]


@pytest.mark.default_codegen  # checks, in the subprocess below, that it really runs under XLA's defaults
def test_the_default_codegen_process_has_no_cheap_flags():
    assert not cheap_codegen() and _codegen_flags_in_use() == [], os.environ["XLA_FLAGS"]


@pytest.mark.slow
def test_bit_identity_between_programs_holds_under_xla_default_code_generation():
    files = _marked_files()
    assert "tests/test_multistep.py" in files and "tests/test_offload_streaming.py" in files, files
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env[DEFAULT_CODEGEN_ENV] = "1"
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "default_codegen", *files],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    summary = r.stdout.strip().splitlines()[-1]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    # every marked test ran and passed: 2 multi-step + 3 offload + 2 streamed + the flag check above
    assert passed >= 8 and not re.search(r"failed|skipped|error", summary), summary
