"""Lightning's CIFAR-10 baseline tutorial (``tests/gallery_tutorial_programs.py``: ``OneCycleLR`` stepped
per step, ``LearningRateMonitor(logging_interval="step")``, a validation loader, ``val_loss``/``val_acc`` on
the progress bar) run through pytorch-lightning and through its jaxlight port from the same initial torch
weights, on the same shuffled batches (torch's global generator). Tolerances: the logged learning rates
equal Lightning's to 1e-7 relative (float32 rounding of torch's float64 rates: the port's rates are
torch's formula rounded once); the 12 train losses within 1e-4 relative; validation and test metrics within
1e-4; the final weights within 1e-6 absolute (fp32 rounding, 3e-7 measured).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("pytorch_lightning")
pytest.importorskip("torch")
pytest.importorskip("torchmetrics")

from tests import gallery_tutorial_programs as tutorial

RTOL_LR, RTOL_LOSS, RTOL_METRIC, ATOL_WEIGHTS = 1e-7, 1e-4, 1e-4, 1e-6
TOTAL = tutorial.EPOCHS * tutorial.STEPS_PER_EPOCH


def _torch_one_cycle_trace() -> tuple[np.ndarray, np.ndarray]:
    """torch's SGD under ``OneCycleLR(optimizer, 0.1, epochs, steps_per_epoch)``, as the tutorial builds it:
    the learning rate and momentum each of the TOTAL updates uses."""
    import torch

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=tutorial.LR, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt,
        tutorial.MAX_LR,
        epochs=tutorial.EPOCHS,
        steps_per_epoch=tutorial.STEPS_PER_EPOCH,
    )
    lrs, momenta = [], []
    for _ in range(TOTAL):
        lrs.append(opt.param_groups[0]["lr"])
        momenta.append(opt.param_groups[0]["momentum"])
        opt.step()
        sched.step()
    return np.array(lrs), np.array(momenta)


def test_one_cycle_schedules_are_torchs():
    """The port's schedules give torch's rates and momenta; optax's own one-cycle schedule does not."""
    import optax

    lrs, momenta = _torch_one_cycle_trace()
    learning_rate, momentum = tutorial.torch_one_cycle(tutorial.MAX_LR, TOTAL)
    got_lr = np.array([float(learning_rate(i)) for i in range(TOTAL)])
    got_momentum = np.array([float(momentum(i)) for i in range(TOTAL)])
    np.testing.assert_allclose(got_lr, lrs, rtol=RTOL_LR)
    np.testing.assert_allclose(got_momentum, momenta, rtol=RTOL_LR)
    # cycle_momentum=True (the default) overrides SGD's momentum=0.9: 0.95 at the start, 0.85 at the peak
    assert momenta[0] == 0.95 and math.isclose(momenta.min(), 0.85, rel_tol=0.01) and 0.9 not in momenta
    # optax.cosine_onecycle_schedule ends its phases a step later than torch (pct_start * 12 = 3.6 here)
    onecycle = optax.cosine_onecycle_schedule(TOTAL, tutorial.MAX_LR)
    optax_lr = np.array([float(onecycle(i)) for i in range(TOTAL)])
    assert np.abs(optax_lr / lrs - 1).max() > 0.3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tutorial")
    init = str(root / "init.pt")
    ref = tutorial.run_tutorial("pl", str(root / "pl"), init)  # writes the initial torch weights
    got = tutorial.run_tutorial("jl", str(root / "jl"), init)
    return ref, got


def test_tutorial_against_lightning(runs):
    ref, got = runs
    assert got["global_step"] == ref["global_step"] == TOTAL
    assert got["metric_names"] == ref["metric_names"] == ["lr-SGD", "train_loss", "val_acc", "val_loss"]
    assert got["csv_columns"] == ref["csv_columns"]

    # LearningRateMonitor(logging_interval="step"): one "lr-SGD" per step, in its lrs, in callback_metrics
    # and in the CSV rows at the same steps; Lightning's are torch's float64 rates, the port's float32
    assert sorted(got["lrs"]) == sorted(ref["lrs"]) == ["lr-SGD"]
    assert len(ref["lrs"]["lr-SGD"]) == TOTAL
    np.testing.assert_allclose(got["lrs"]["lr-SGD"], ref["lrs"]["lr-SGD"], rtol=RTOL_LR)
    np.testing.assert_allclose(got["lr_metric"], ref["lr_metric"], rtol=RTOL_LR)
    assert [s for s, _ in got["csv_lr"]] == [s for s, _ in ref["csv_lr"]] == list(range(TOTAL))
    np.testing.assert_allclose([v for _, v in got["csv_lr"]], [v for _, v in ref["csv_lr"]], rtol=RTOL_LR)
    torch_lrs, _ = _torch_one_cycle_trace()
    np.testing.assert_allclose(ref["lrs"]["lr-SGD"], torch_lrs, rtol=1e-12)  # the rates each step used

    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=RTOL_LOSS)
    assert len(ref["losses"]) == TOTAL and ref["losses"][-1] < ref["losses"][0]  # it trains

    assert len(got["val"]) == len(ref["val"]) == tutorial.EPOCHS
    for a, b in zip(ref["val"], got["val"]):
        assert sorted(a) == sorted(b)
        assert all(math.isclose(a[k], b[k], rel_tol=RTOL_METRIC) for k in a), (a, b)
    assert sorted(got["test"]) == sorted(ref["test"])
    assert all(math.isclose(ref["test"][k], got["test"][k], rel_tol=RTOL_METRIC) for k in ref["test"])

    assert sorted(got["weights"]) == sorted(ref["weights"])
    for k, w in ref["weights"].items():
        np.testing.assert_allclose(got["weights"][k], w, rtol=0, atol=ATOL_WEIGHTS, err_msg=k)
