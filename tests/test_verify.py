"""jaxlight.verify / `jaxlight verify`: every built-in strategy trains a correct module as one device does,
and a layer that forgets its psum is caught, with the leaves named.

The model (tests/verify_models.py) centers its activations over the batch rows inside a ``shard_map``;
with the psum it is right under every strategy, without it only where rows are not split (one device,
tensor parallelism).
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxlight.errors import MisconfigurationError
from jaxlight.hlo import hlo_collectives
from jaxlight.verify import BUILTIN_STRATEGIES, verify
from tests.verify_models import CenteredLM, ForgetfulLM, batches

VERIFY = importlib.import_module("jaxlight.verify")  # the module (jaxlight.verify may name the function)
MODELS = Path(__file__).resolve().parent / "verify_models.py"
ROOT = MODELS.parent.parent


@pytest.fixture(scope="module")
def correct():
    return verify(CenteredLM, batches(), print_report=False)


def test_every_builtin_strategy_matches_one_device(correct):
    report = correct
    ref, *rows = report.results
    assert ref.status == "ref" and ref.mesh == "1 device"
    expected = list(BUILTIN_STRATEGIES)  # sp and pp included: their pieces ship with jaxlight
    assert {"ddp", "fsdp", "tp", "fsdp+tp", "fsdp+offload", "sp", "pp"} <= set(expected)
    assert [r.name for r in rows] == expected  # every built-in strategy ran: none was skipped
    for r in rows:
        assert r.status == "ok", (r.name, r.reason, r.leaves[:3])
        assert 0 <= r.worst_ratio < 1
        assert r.mesh != "1 device" and math.prod(int(a.split("=")[1]) for a in r.mesh.split(",")) == 8
    assert report.ok


def test_report_numbers_come_from_the_runs(correct):
    rows = {r.name: r for r in correct.results}
    ddp, fsdp = rows["ddp"], rows["fsdp"]
    # FSDP splits the 8 x 128 x 128 stacked kernels (most of the bytes) 8 ways; DDP replicates everything
    assert fsdp.param_bytes < 0.35 * ddp.param_bytes
    # the module's own optimizer is Adam: two moments per parameter (plus a count) wherever they live
    assert 2 * ddp.param_bytes <= ddp.opt_bytes[0] <= 2 * ddp.param_bytes + 64 and ddp.opt_bytes[1] == 0
    off = rows["fsdp+offload"]
    assert off.opt_bytes[1] >= 2 * fsdp.param_bytes and off.opt_bytes[0] < 64  # moments in host memory
    # collectives: DDP all-reduces gradients and gathers nothing; FSDP gathers its weights
    assert ddp.collectives.counts.get("all-reduce", 0) >= 1 and not ddp.collectives.counts.get("all-gather")
    assert fsdp.collectives.counts.get("all-gather", 0) >= 1
    assert all(r.compile_s is not None and r.compile_s > 0 for r in correct.results if r.status == "ok")


def test_report_prints_the_table_and_explains_the_tolerances(correct):
    text = correct.render()
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("strategy"))
    for col in ("max|dloss|", "max|dgrad@1|", "max|dparam|", "params/dev", "optimizer/dev", "collectives", "compile"):
        assert col in lines[header]
    assert any(re.match(r"fsdp\s+fsdp=8\s+ok\s", line) for line in lines)
    # n: the largest reduction of the step, every (row, position) of the 16 x 8 token batches
    tol = correct.tolerances
    assert tol.n == 16 * 8 and tol.eps == pytest.approx(2.0**-23)
    assert tol.rtol == pytest.approx(VERIFY.SAFETY * tol.eps * tol.n)
    assert f"n = {tol.n}" in text and "SGD" in text and "Adam" in text
    assert tol.momentum_sum == pytest.approx(1 + (1 + 0.9) + (1 + 0.9 + 0.81))
    assert lines[-1].startswith(f"{len(correct.results) - 1 - _skipped(correct)} of ")


def _skipped(report) -> int:
    return sum(r.status == "skipped" for r in report.results)


def test_forgotten_psum_fails_and_names_the_leaves(capsys):
    report = verify(ForgetfulLM, batches(), strategies=["ddp", "tp"])
    out = capsys.readouterr().out
    rows = {r.name: r for r in report.results}
    assert not report.ok and [r.name for r in report.failed] == ["ddp"]
    assert rows["tp"].status == "ok"  # tensor parallelism keeps every row on every device: the bug is invisible
    bad = rows["ddp"]
    assert bad.status == "FAIL" and bad.worst_ratio > 100
    paths = _param_paths(ForgetfulLM())
    assert bad.leaves and all(d.path in paths for d in bad.leaves if d.kind != "loss")
    assert {d.kind for d in bad.leaves} >= {"grad", "param"}
    assert bad.leaves[0].ratio == max(d.ratio for d in bad.leaves)
    # the printed report names the worst leaves with their numbers
    assert "ddp: FAILED" in out and bad.leaves[0].path in out and "FAILED: ddp" in out.splitlines()[-1]


def _param_paths(module) -> set[str]:
    from flax import nnx

    from jaxlight.state import split_models

    with nnx.use_eager_sharding(False):
        module.configure_model()
    _, params, _ = split_models({"net": module.net})
    return set(params)


def test_strategies_that_do_not_apply_are_skipped_or_errors(monkeypatch):
    flat = functools.partial(CenteredLM, stack=False)  # no LayerStack: "pp" has nothing to pipeline
    monkeypatch.setattr(VERIFY, "BUILTIN_STRATEGIES", ("ddp", "pp"))
    report = verify(flat, batches(), steps=1, print_report=False)
    rows = {r.name: r for r in report.results}
    assert rows["ddp"].status == "ok" and report.ok
    assert rows["pp"].status == "skipped" and "LayerStack" in rows["pp"].reason
    # asked for by name, a strategy that refuses the batch is an error: 9 positions do not split 8 ways
    report = verify(CenteredLM, batches(length=9), strategies="ddp,sp", steps=1, print_report=False)
    rows = {r.name: r for r in report.results}
    assert rows["sp"].status == "error" and "9" in rows["sp"].reason and not report.ok


def test_bad_input_is_refused_with_the_numbers():
    with pytest.raises(MisconfigurationError, match=r"2 <= devices <= 8.*xla_force_host_platform_device_count"):
        verify(CenteredLM, batches(), devices=1, print_report=False)
    with pytest.raises(ValueError, match="unknown strategy 'fdsp'"):
        verify(CenteredLM, batches(), strategies="fdsp", print_report=False)
    with pytest.raises(MisconfigurationError, match="runs 3 steps but the loader yielded only 2"):
        verify(CenteredLM, batches(2), print_report=False)
    with pytest.raises(MisconfigurationError, match="may not set 'strategy'"):
        verify(CenteredLM, batches(), trainer_kwargs={"strategy": "ddp"}, print_report=False)


def test_hlo_collectives_counts_and_sizes():
    hlo = "\n".join(
        [
            "  %all-reduce.1 = (f32[128,128]{1,0}, f32[128]{0}) all-reduce(%a, %b), replica_groups=[1,8]<=[8]",
            "  all-gather.2 = bf16[64,32]{1,0} all-gather(%c), dimensions={0}, replica_groups=[2,4]<=[8]",
            "  %ags = (f32[8,16]{1,0}, f32[64,16]{1,0}) all-gather-start(%d), replica_groups={{0,1,2,3,4,5,6,7}}",
            "  %agd = f32[64,16]{1,0} all-gather-done(%ags)",
            "  %rs = f32[16]{0} reduce-scatter(%e), replica_groups=[2,4]<=[8], dimensions={0}",
            "  %cp = (f32[4]{0}, f32[4]{0}, u32[], u32[]) collective-permute-start(%f), source_target_pairs={{0,1}}",
            '  %fusion.3 = f32[4]{0} fusion(%g), kind=kLoop, metadata={op_name="all-reduce"}',
            "  ROOT %a2a = s32[8,8]{1,0} all-to-all(%h), dimensions={0}",
        ]
    )
    c = hlo_collectives(hlo)
    assert c.counts == {"all-reduce": 1, "all-gather": 2, "reduce-scatter": 1, "collective-permute": 1, "all-to-all": 1}
    assert c.bytes["all-reduce"] == (128 * 128 + 128) * 4
    assert c.bytes["all-gather"] == 64 * 32 * 2 + 64 * 16 * 4  # an async start counts its output buffer
    assert c.bytes["reduce-scatter"] == 16 * 4 * 4  # the input: result x group size 4
    assert c.bytes["collective-permute"] == 4 * 4 and c.bytes["all-to-all"] == 8 * 8 * 4
    assert c.total_bytes == sum(c.bytes.values()) and hlo_collectives("").summary() == "none"


def _cli(*args, env=None):
    env = {**os.environ, **(env or {}), "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-m", "jaxlight.cli", "verify", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_cli_exits_nonzero_and_names_leaves_for_a_wrong_strategy():
    r = _cli(f"{MODELS}:ForgetfulLM", "--datamodule", f"{MODELS}:TokenData", "--strategies", "ddp", "--steps", "2")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "ddp: FAILED" in r.stdout and "net/" in r.stdout.split("ddp: FAILED")[1]


def test_cli_passes_a_correct_module_and_creates_cpu_devices():
    env = {"XLA_FLAGS": ""}  # the command's --devices creates the simulated CPU devices itself
    r = _cli(
        f"{MODELS}:CenteredLM",
        "--datamodule",
        f"{MODELS}:TokenData",
        "--strategies",
        "fsdp",
        "--devices",
        "8",
        "--steps",
        "2",
        env=env,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert re.search(r"^fsdp\s+fsdp=8\s+ok", r.stdout, flags=re.M)
    bad = _cli(f"{MODELS}:NoSuchModule", env=env)
    assert bad.returncode == 2 and "defines no 'NoSuchModule'" in bad.stderr


def test_bf16_compute_widens_the_tolerance_by_its_rounding():
    report = verify(
        CenteredLM, batches(), strategies="ddp", steps=1, trainer_kwargs={"precision": "bf16-mixed"}, print_report=False
    )
    tol = report.tolerances
    # float32 sums, plus one bf16 rounding of every value (2^-7), whatever the order
    assert tol.rtol == pytest.approx(VERIFY.SAFETY * (2.0**-23 * tol.n + 2.0**-7))
    assert "bfloat16 rounding" in tol.lines[0]
    assert report.ok and report.results[1].worst_ratio < 1
