"""ModelCheckpoint bookkeeping: save_top_k / monitor / mode keep exactly the right checkpoints, save_last
follows Lightning, filenames follow Lightning's templates, and the state carries over a resume."""

from __future__ import annotations

import os

import pytest

import jaxlight as jl
from tests.checkpoint_models import DropoutClassifier, arrays
from tests.helpers import quiet

SCORES = (0.5, 0.3, 0.4, 0.1, 0.35)
EPOCHS = len(SCORES)
BATCHES = 4  # per epoch


class Scored(DropoutClassifier):
    """Logs a chosen score per epoch (host side), so the expected top-k follows from SCORES."""

    def on_validation_epoch_end(self):
        self.log("score", SCORES[self.current_epoch])


def _data():
    x, y = arrays(32)
    return [(x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)], [(x[:8], y[:8])]


def _fit(callbacks, max_epochs=EPOCHS, ckpt_path=None):
    train, val = _data()
    t = jl.Trainer(max_epochs=max_epochs, callbacks=callbacks, **quiet(enable_checkpointing=None))
    t.fit(Scored(), train, val, ckpt_path=ckpt_path)
    return t


def _files(d):
    return sorted(os.listdir(d))


def _name(epoch, **extra):
    parts = [f"epoch={epoch}", f"step={(epoch + 1) * BATCHES}"] + [f"{k}={v}" for k, v in extra.items()]
    return "-".join(parts) + ".ckpt"


def test_top_k_monitor_mode_and_last(tmp_path):
    d = {k: str(tmp_path / k) for k in ("min2", "max1", "none1", "all3")}
    mc = jl.callbacks.ModelCheckpoint
    cbs = [
        mc(dirpath=d["min2"], monitor="score", mode="min", save_top_k=2, save_last=True),
        mc(dirpath=d["max1"], monitor="score", mode="max", save_top_k=1, filename="{epoch}-{score:.2f}"),
        mc(dirpath=d["none1"]),
        mc(dirpath=d["all3"], save_top_k=-1, every_n_train_steps=3),
    ]
    t = _fit(cbs)
    assert t.checkpoint_callbacks == cbs

    # min, top 2, with last (Lightning's save_last=True): the two lowest scores, and last.ckpt, a checkpoint of
    # its own (not a link) holding the step of the newest top-k save, as pytorch-lightning 2.6 does: the last
    # epoch is not top-2, so nothing is saved for it (checked against Lightning in test_checkpoint_bookkeeping)
    best2 = sorted(range(EPOCHS), key=lambda e: SCORES[e])[:2]
    newest = EPOCHS - 1
    assert _files(d["min2"]) == sorted({_name(e) for e in best2} | {"last.ckpt"})
    last = os.path.join(d["min2"], "last.ckpt")
    assert not os.path.islink(last) and jl.checkpoint.read_meta(last)["global_step"] == (max(best2) + 1) * BATCHES
    assert cbs[0].last_model_path == os.path.join(d["min2"], "last.ckpt")
    assert cbs[0].best_model_path == os.path.join(d["min2"], _name(best2[0]))
    assert cbs[0].best_model_score == pytest.approx(SCORES[best2[0]])
    assert set(cbs[0].best_k_models) == {os.path.join(d["min2"], _name(e)) for e in best2}
    assert cbs[0].kth_best_model_path == os.path.join(d["min2"], _name(best2[1]))

    # max, top 1, metric in the filename, no last: exactly one file
    top = max(range(EPOCHS), key=lambda e: SCORES[e])
    assert _files(d["max1"]) == [f"epoch={top}-score={SCORES[top]:.2f}.ckpt"]
    assert cbs[1].best_model_score == pytest.approx(SCORES[top])

    # no monitor, top 1: only the newest; -1 with every_n_train_steps=3: every 3rd step, no epoch-end saves
    assert _files(d["none1"]) == [_name(newest)]
    total = EPOCHS * BATCHES
    assert _files(d["all3"]) == sorted(f"epoch={(s - 1) // BATCHES}-step={s}.ckpt" for s in range(3, total + 1, 3))
    for name in _files(d["all3"]):
        assert jl.checkpoint.is_complete(os.path.join(d["all3"], name))


def test_bookkeeping_survives_resume(tmp_path):
    """Stopping after 3 epochs and resuming to 5 leaves the same files as one uninterrupted run."""

    def cb(dirpath):
        return jl.callbacks.ModelCheckpoint(dirpath=dirpath, monitor="score", mode="min", save_top_k=2, save_last=True)

    _fit([cb(str(tmp_path / "straight"))])
    _fit([cb(str(tmp_path / "resumed"))], max_epochs=3)
    second = cb(str(tmp_path / "resumed"))
    t = _fit([second], ckpt_path="last")
    assert t.current_epoch == EPOCHS
    assert _files(tmp_path / "resumed") == _files(tmp_path / "straight")
    assert os.path.basename(second.best_model_path) == _name(min(range(EPOCHS), key=lambda e: SCORES[e]))


def test_argument_errors():
    mc = jl.callbacks.ModelCheckpoint
    with pytest.raises(ValueError, match="save_top_k=3, monitor=None"):
        mc(save_top_k=3)
    with pytest.raises(ValueError, match="mode='avg'"):
        mc(monitor="x", mode="avg")
    with pytest.raises(ValueError, match="mutually exclusive"):
        mc(every_n_train_steps=2, every_n_epochs=1)
    with pytest.raises(ValueError, match="save_top_k=-2"):
        mc(save_top_k=-2)


def test_missing_monitor_names_the_logged_metrics(tmp_path):
    train, val = _data()
    t = jl.Trainer(
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[jl.callbacks.ModelCheckpoint(dirpath=str(tmp_path), monitor="val_acc")],
    )
    with pytest.raises(ValueError, match=r"monitor='val_acc'.*'score'"):
        t.fit(Scored(), train, val)


def test_format_checkpoint_name():
    mc = jl.callbacks.ModelCheckpoint(dirpath="/ck", filename="{epoch:02d}-{val/loss:.3f}")
    assert mc.format_checkpoint_name({"epoch": 3, "step": 7, "val/loss": 0.12345}) == "/ck/epoch=03-val/loss=0.123.ckpt"
    plain = jl.callbacks.ModelCheckpoint(dirpath="/ck", filename="{epoch}-{step}", auto_insert_metric_name=False)
    assert plain.format_checkpoint_name({"epoch": 1, "step": 9}) == "/ck/1-9.ckpt"
