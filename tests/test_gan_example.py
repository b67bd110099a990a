"""examples/gan.py: manual optimization with alternating updates learns the 2-D ring, in one compiled step."""

import glob

import numpy as np
import pytest

from examples.gan import RingLoader, main, mode_centers, quality
from tests.core_models import csv_history


def test_ring_loader_is_seeded_and_draws_new_points_each_epoch():
    a, b = RingLoader(64, 3, seed=5), RingLoader(64, 3, seed=5)
    first_a, first_b = list(a), list(b)
    np.testing.assert_array_equal(first_a[0], first_b[0])
    assert not np.array_equal(first_a[0], list(a)[0])
    dist, near, modes = quality(np.concatenate(first_a), mode_centers())
    assert dist < 0.1 and near > 0.95 and modes == 8  # the metric on real data: what "learned" looks like


@pytest.mark.slow
def test_gan_learns_the_ring(tmp_path):
    out = main(
        [
            "--max-steps",
            "600",
            "--batch-size",
            "128",
            "--hidden",
            "64",
            "--lr",
            "2e-3",
            "--devices",
            "1",
            "--log-every-n-steps",
            "100",
            "--out",
            str(tmp_path),
        ]
    )
    trainer = out["trainer"]
    assert out["steps"] == 600 and trainer.compile_counts["train"] == 1
    (dist0, near0, _), (dist1, near1, _) = out["before"], out["after"]
    assert dist1 < 0.7 * dist0, (dist0, dist1)  # generated points moved onto the ring's modes
    assert near1 > max(0.03, 5 * near0), (near0, near1)
    assert np.isfinite(out["d_loss"]) and np.isfinite(out["g_loss"])
    (path,) = glob.glob(str(tmp_path / "lightning_logs" / "version_*" / "metrics.csv"))
    hist = csv_history(path)
    assert [s for s, _ in hist["d_loss"]] == [99, 199, 299, 399, 499, 599]
    assert len(hist["g_loss"]) == 6
