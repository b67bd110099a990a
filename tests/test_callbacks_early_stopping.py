"""EarlyStopping stops at the epoch Lightning's rules give for a scripted metric sequence."""

import math

import pytest

import jaxlight as jl
from jaxlight.callbacks import EarlyStopping
from tests.core_models import Classifier, batches, make_data, quiet


class Scripted(Classifier):
    """Logs ``seq[epoch]`` as ``val_loss`` at validation epoch end (and as ``train_metric`` at train epoch end)."""

    def __init__(self, seq, **kw):
        super().__init__(**kw)
        self.seq = seq

    def on_validation_epoch_end(self):
        if not self.trainer.sanity_checking:
            self.log("val_loss", self.seq[self.current_epoch])

    def on_train_epoch_end(self):
        self.log("train_metric", self.seq[self.current_epoch])


def expected_stop(seq, patience, mode="min", min_delta=0.0, stopping_threshold=None, divergence_threshold=None):
    """Lightning's rules written out plainly: the epoch at which training stops (or None)."""
    best = math.inf if mode == "min" else -math.inf
    better = (lambda a, b: a < b) if mode == "min" else (lambda a, b: a > b)
    wait = 0
    for epoch, v in enumerate(seq):
        if not math.isfinite(v):
            return epoch
        if stopping_threshold is not None and better(v, stopping_threshold):
            return epoch
        if divergence_threshold is not None and better(divergence_threshold, v):
            return epoch
        if better(v - min_delta if mode == "max" else v + min_delta, best):
            best, wait = v, 0
        else:
            wait += 1
            if wait >= patience:
                return epoch
    return None


DATA = batches(*make_data(32), 16)


def run(seq, with_val=True, max_epochs=None, **es_kw):
    es = EarlyStopping(**es_kw)
    trainer = jl.Trainer(max_epochs=max_epochs or len(seq), devices=1, callbacks=[es], **quiet())
    trainer.fit(Scripted(seq), DATA, DATA if with_val else None)
    return trainer, es


CASES = [
    ([5.0, 4.0, 3.0, 3.5, 3.2, 3.1, 2.0, 1.0], dict(monitor="val_loss", patience=3)),
    ([5.0, 4.0, 3.0, 3.5, 3.2, 3.1, 2.0, 1.0], dict(monitor="val_loss", patience=2)),
    ([5.0, 4.95, 4.9, 4.85, 4.8, 4.75, 4.7, 4.65], dict(monitor="val_loss", patience=2, min_delta=0.15)),
    ([1.0, 2.0, 3.0, 2.5, 2.9, 2.0, 4.0, 5.0], dict(monitor="val_loss", patience=2, mode="max")),
    ([5.0, 4.0, float("nan"), 1.0, 1.0, 1.0], dict(monitor="val_loss", patience=5)),
    ([5.0, 4.0, 2.5, 1.9, 1.0, 1.0], dict(monitor="val_loss", patience=5, stopping_threshold=2.0)),
    ([5.0, 4.0, 6.0, 11.0, 1.0, 1.0], dict(monitor="val_loss", patience=5, divergence_threshold=10.0)),
]


def replay(seq, **kw):
    """Feed ``seq`` to the callback's own criteria, one value per epoch; the epoch it stops at (or None)."""
    es = EarlyStopping(**kw)
    for epoch, v in enumerate(seq):
        if es._evaluate_stopping_criteria(v)[0]:
            return epoch
    return None


@pytest.mark.parametrize("seq,kw", CASES)
def test_criteria_match_lightning_rules(seq, kw):
    want = expected_stop(
        seq,
        kw["patience"],
        kw.get("mode", "min"),
        kw.get("min_delta", 0.0),
        kw.get("stopping_threshold"),
        kw.get("divergence_threshold"),
    )
    assert want is not None and want < len(seq) - 1  # every case stops before the sequence ends
    assert replay(seq, **kw) == want


@pytest.mark.parametrize("case", [0, 4])  # patience; a NaN
def test_fit_stops_at_the_right_epoch(case):
    seq, kw = CASES[case]
    want = expected_stop(seq, kw["patience"])
    trainer, es = run(seq, **kw)
    assert es.stopped_epoch == want
    assert trainer.current_epoch == want + 1  # epochs 0..want ran
    assert trainer.should_stop


def test_no_validation_checks_at_train_epoch_end():
    seq = [3.0, 2.0, 2.5, 2.4, 2.3, 1.0]
    trainer, es = run(seq, with_val=False, monitor="train_metric", patience=3)
    assert es.stopped_epoch == expected_stop(seq, 3) == 4
    assert trainer.current_epoch == 5


def test_min_epochs_is_honoured():
    seq = [5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    es = EarlyStopping(monitor="train_metric", patience=1)
    trainer = jl.Trainer(max_epochs=6, min_epochs=4, devices=1, callbacks=[es], **quiet())
    trainer.fit(Scripted(seq), DATA)
    assert trainer.current_epoch == 4


def test_state_dict_round_trip_continues_the_count():
    seq = [5.0, 4.0, 3.0, 3.5, 3.2, 3.1, 2.0, 1.0]
    es = EarlyStopping(monitor="val_loss", patience=3)
    for v in seq[:4]:  # epochs 0..3: best 3.0, wait 1
        es._evaluate_stopping_criteria(v)
    state = es.state_dict()
    assert state == {"wait_count": 1, "stopped_epoch": 0, "best_score": 3.0, "patience": 3}
    es2 = EarlyStopping(monitor="val_loss", patience=3)
    es2.load_state_dict(state)
    assert (es2.wait_count, es2.best_score) == (1, 3.0)
    stop, _ = es2._evaluate_stopping_criteria(3.2)
    assert not stop and es2.wait_count == 2
    stop, _ = es2._evaluate_stopping_criteria(3.1)
    assert stop  # epoch 5 of the uninterrupted run, as in CASES[0]


def test_strict_missing_metric_names_available_ones():
    with pytest.raises(RuntimeError, match="val_los.*train_loss"):
        run([1.0, 1.0], with_val=False, monitor="val_los", patience=1)
    trainer, es = run([1.0, 1.0], with_val=False, monitor="val_los", patience=1, strict=False)
    assert trainer.current_epoch == 2 and es.wait_count == 0


def test_bad_mode():
    with pytest.raises(ValueError, match="mode"):
        EarlyStopping(monitor="x", mode="minimum")
