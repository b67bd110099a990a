"""The second differential gallery (issue 23 item 6): five Lightning-style programs (``tests/
gallery_lightning_programs.py``) run through pytorch-lightning and through their jaxlight ports from the same
initial torch weights, on the same batches. Each must leave the same things behind: the same metric names
and checkpoint names, the first 10 steps' losses within 1e-5 relative (fp32), the same stopping epoch,
validation and test metrics within 1e-4, and what each program makes besides (predictions, images, frozen
BatchNorm statistics).

Documented differences are normalised, each named where it is: with manual optimization (the GAN)
Lightning's ``global_step`` counts both optimizers' steps, jaxlight's the batches (docs/migration.md), so
the GAN's checkpoint names carry half Lightning's step.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

pytest.importorskip("pytorch_lightning")
pytest.importorskip("torch")
pytest.importorskip("jsonargparse")

from tests import gallery_lightning_programs as gallery

RTOL_LOSS, RTOL_METRIC = 1e-5, 1e-4

_RUNS: dict[str, tuple[dict, dict]] = {}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("gallery")


def runs(name: str, workdir) -> tuple[dict, dict]:
    """Both frameworks' runs of one program, once per test session (inside the test, so an xfail holds)."""
    if name not in _RUNS:
        run = getattr(gallery, f"run_{name}")
        init = str(workdir / f"{name}_init.pt")
        ref = run("pl", str(workdir / f"{name}_pl"), init)  # writes the initial torch weights
        got = run("jl", str(workdir / f"{name}_jl"), init)
        _RUNS[name] = (ref, got)
    return _RUNS[name]


def _close(a: float, b: float, rtol: float) -> bool:
    return math.isclose(a, b, rel_tol=rtol, abs_tol=1e-7)


def check_common(ref: dict, got: dict, halve_step: bool = False) -> None:
    assert got["metric_names"] == ref["metric_names"]
    names = ref["checkpoints"]
    if halve_step:  # manual optimization: Lightning counts every optimizer's steps (documented)
        names = [re.sub(r"step=(\d+)", lambda m: f"step={int(m.group(1)) // 2}", n) for n in names]
    assert names and got["checkpoints"] == names
    assert got["current_epoch"] == ref["current_epoch"]  # the same stopping epoch
    losses_ref = np.asarray(ref["losses"], np.float64)[: gallery.STEPS]
    losses = np.asarray(got["losses"], np.float64)[: gallery.STEPS]
    assert len(losses_ref) == gallery.STEPS and losses.shape == losses_ref.shape
    np.testing.assert_allclose(losses, losses_ref, rtol=RTOL_LOSS)
    assert len(got["val"]) == len(ref["val"])
    for a, b in zip(ref["val"], got["val"]):
        assert sorted(a) == sorted(b)
        assert all(_close(a[k], b[k], RTOL_METRIC) for k in a), (a, b)
    if "test" in ref:
        assert sorted(got["test"]) == sorted(ref["test"])
        assert all(_close(ref["test"][k], got["test"][k], RTOL_METRIC) for k in ref["test"])


# 100 training rows in batches of 32: the last one has 4
def test_image_classifier_through_lightning_cli(workdir):
    ref, got = runs("classifier", workdir)
    check_common(ref, got)
    assert ref["checkpoints"] == ["epoch=2-step=12.ckpt"]  # the ragged batch is a step, as in Lightning
    assert len(got["predictions"]) == len(ref["predictions"])
    for a, b in zip(ref["predictions"], got["predictions"]):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)
    assert got["compile_counts"]["train"] <= 2  # one more for the ragged batch's shape


def test_autoencoder_through_lightning_cli_with_its_image_callback(workdir):
    ref, got = runs("autoencoder", workdir)
    check_common(ref, got)
    assert sorted(got["images"]) == sorted(ref["images"]) == [
        "grid_generated_0.png", "grid_generated_1.png", "grid_generated_2.png", "grid_generated_3.png",
        "grid_ori_0.png",
    ]  # fmt: skip
    for k, img in ref["images"].items():
        assert np.abs(got["images"][k] - img).max() <= 1, k  # 8-bit pixels, float32 rounding
    for a, b in zip(ref["predictions"], got["predictions"]):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
    assert got["compile_counts"] == {"train": 1, "validate": 1, "test": 1, "predict": 1}


# training_step(self, batch): no batch_idx, which Lightning accepts
def test_gan_with_manual_optimization(workdir):
    ref, got = runs("gan", workdir)
    check_common(ref, got, halve_step=True)
    assert got["global_step"] * 2 == ref["global_step"]
    for a, b in zip(ref["samples"], got["samples"]):  # generated images at each epoch end
        np.testing.assert_allclose(b, a, atol=1e-4)
    assert got["compile_counts"]["train"] == 1


def test_gan_noise_from_self_rngs(workdir):
    """The original's noise recipe ported as written: ``self.rngs = nnx.Rngs(noise=0)`` drawn in the step
    (failed with flax's TraceContextError before NNX objects held beside the models were carried)."""
    runs("gan", workdir)  # writes the initial torch weights (cached: no extra run after the test above)
    got = gallery.run_gan("jl", str(workdir / "gan_rngs"), str(workdir / "gan_init.pt"), shared=False)
    g = np.asarray(got["losses"])
    assert np.isfinite(g).all() and got["compile_counts"]["train"] == 1
    assert len({round(float(x), 6) for x in g[:, 0]}) == len(g)  # new noise at every step


def test_transformer_lm_with_gradient_clipping(workdir):
    ref, got = runs("transformer", workdir)
    check_common(ref, got)
    assert got["compile_counts"]["train"] == 1


def test_fine_tuning_program_through_lightning_cli(workdir):
    ref, got = runs("finetune", workdir)
    check_common(ref, got)
    # the first BatchNorm is frozen (train_bn=False) until milestone 2: its statistics stay the initial ones
    for (mean_a, var_a), (mean_b, var_b) in zip(ref["stats"][:2], got["stats"][:2]):
        np.testing.assert_array_equal(mean_b, mean_a)
        np.testing.assert_array_equal(var_b, var_a)
        assert (mean_a == 0).all() and (var_a == 1).all()
    # unfrozen, both track them; torch updates the variance with n/(n-1) (documented), a 1e-4 effect here
    for (mean_a, var_a), (mean_b, var_b) in zip(ref["stats"][2:], got["stats"][2:]):
        np.testing.assert_allclose(mean_b, mean_a, atol=1e-4)
        np.testing.assert_allclose(var_b, var_a, rtol=1e-3)
    assert got["compile_counts"]["train"] == 3  # compiled once, then once per unfreeze (2 milestones)
