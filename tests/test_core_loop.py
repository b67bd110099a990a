"""Loop arithmetic with Lightning's meanings: fast_dev_run, limit_*_batches, max/min epochs and steps,
validation cadence and the sanity check, counted through callbacks."""

import collections

import pytest

import jaxlight as jl
from tests.core_models import EagerClassifier as Classifier
from tests.core_models import batches, make_data, quiet

x, y = make_data(128)
TRAIN = batches(x, y, 16)  # 8 batches
VAL = batches(x[:64], y[:64], 16)  # 4 batches


class Count(jl.Callback):
    """Counts batches per stage, validation runs, sanity batches and epochs."""

    def __init__(self):
        self.n = collections.Counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.n["train"] += 1

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.n["sanity" if trainer.sanity_checking else "val"] += 1

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.n["val_runs"] += 1
            self.n.setdefault("val_at", []).append((trainer.current_epoch, trainer.global_step))

    def on_test_batch_end(self, *args, **kwargs):
        self.n["test"] += 1

    def on_predict_batch_end(self, *args, **kwargs):
        self.n["predict"] += 1

    def on_train_epoch_end(self, trainer, pl_module):
        self.n["epochs"] += 1


def run(**kw):
    cb = Count()
    base = quiet(callbacks=[cb])
    base.update(kw)
    trainer = jl.Trainer(**base)
    trainer.fit(Classifier(), TRAIN, VAL)
    return trainer, cb.n


@pytest.mark.parametrize(("fdr", "n"), [(True, 1), (3, 3)])
def test_fast_dev_run(fdr, n):
    cb = Count()
    trainer = jl.Trainer(
        fast_dev_run=fdr, callbacks=[cb], enable_progress_bar=False, max_epochs=5, num_sanity_val_steps=2
    )
    model = Classifier()
    trainer.fit(model, TRAIN, VAL)
    trainer.test(model, VAL, verbose=False)
    trainer.predict(model, [b[0] for b in VAL])
    assert (cb.n["train"], cb.n["val"], cb.n["sanity"], cb.n["epochs"]) == (n, n, 0, 1)
    assert (cb.n["test"], cb.n["predict"]) == (n, n)
    assert trainer.global_step == n
    assert trainer.loggers == [] and trainer.checkpoint_callbacks == []  # no logs or checkpoints written


@pytest.mark.parametrize(("limit", "n"), [(3, 3), (0.25, 2)])
def test_limit_train_batches(limit, n):
    trainer, c = run(max_epochs=2, limit_train_batches=limit)
    assert c["train"] == 2 * n and trainer.global_step == 2 * n
    assert trainer.num_training_batches == n


@pytest.mark.parametrize(("limit", "n"), [(0.5, 2), (0, 0)])
def test_limit_val_test_predict_batches(limit, n):
    trainer, c = run(
        max_epochs=1,
        limit_val_batches=limit,
        limit_test_batches=limit,
        limit_predict_batches=limit,
        num_sanity_val_steps=-1,
    )
    assert c["val"] == n and c["sanity"] == n
    model = trainer.lightning_module
    trainer.test(model, VAL, verbose=False)
    preds = trainer.predict(model, [b[0] for b in VAL])
    assert (c["test"], c["predict"]) == (n, n) and len(preds) == n


def test_max_steps_stops_mid_epoch():
    trainer, c = run(max_epochs=3, max_steps=11)
    assert trainer.global_step == 11 and c["train"] == 11
    assert c["epochs"] == 2 and trainer.current_epoch == 2  # epoch 1 ended early at step 11


def test_max_epochs():
    trainer, c = run(max_epochs=3)
    assert trainer.current_epoch == 3 and c["epochs"] == 3 and trainer.global_step == 24


class StopAtFirstEpochEnd(jl.Callback):
    def on_train_epoch_end(self, trainer, pl_module):
        trainer.should_stop = True


def test_should_stop_stops_after_the_epoch():
    cb = Count()
    trainer = jl.Trainer(max_epochs=10, callbacks=[cb, StopAtFirstEpochEnd()], **quiet())
    trainer.fit(Classifier(), TRAIN)
    assert cb.n["epochs"] == 1 and trainer.global_step == 8 and trainer.should_stop


@pytest.mark.parametrize("min_epochs", [3])
def test_min_epochs_overrides_should_stop(min_epochs):
    """Lightning: should_stop is honoured only once min_epochs full epochs have run."""
    cb = Count()
    trainer = jl.Trainer(max_epochs=10, min_epochs=min_epochs, callbacks=[cb, StopAtFirstEpochEnd()], **quiet())
    trainer.fit(Classifier(), TRAIN, VAL)
    assert cb.n["epochs"] == min_epochs
    assert trainer.global_step == 8 * min_epochs  # every epoch ran to its end
    assert cb.n["val_runs"] == min_epochs


def test_min_steps_overrides_should_stop():
    class StopEarly(jl.Callback):
        def on_train_batch_end(self, trainer, *args):
            trainer.should_stop = True

    trainer = jl.Trainer(max_epochs=10, min_steps=13, callbacks=[StopEarly()], **quiet())
    trainer.fit(Classifier(), TRAIN)
    assert trainer.global_step == 13


def test_should_stop_mid_epoch_validates_once():
    class StopAt(jl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 2:
                trainer.should_stop = True

    trainer, c = run(max_epochs=3, callbacks=[Count(), StopAt()])
    cb = trainer.callbacks[0]
    assert cb.n["train"] == 3 and cb.n["val_runs"] == 1


@pytest.mark.parametrize(("interval", "runs"), [(0.25, 4), (3, 2)])
def test_val_check_interval(interval, runs):
    _, c = run(max_epochs=2, val_check_interval=interval)
    assert c["val_runs"] == 2 * runs
    assert c["val"] == 2 * runs * len(VAL)


def test_val_check_interval_int_counts_across_epochs_without_check_val_every_n_epoch():
    _, c = run(max_epochs=2, val_check_interval=5, check_val_every_n_epoch=None)
    assert [s for _, s in c["val_at"]] == [5, 10, 15]


def test_val_check_interval_larger_than_epoch_raises():
    with pytest.raises(ValueError, match=r"val_check_interval.*\(9\).*8"):
        run(max_epochs=1, val_check_interval=9)


@pytest.mark.parametrize(("every", "epochs"), [(2, [1, 3])])
def test_check_val_every_n_epoch(every, epochs):
    _, c = run(max_epochs=4, check_val_every_n_epoch=every)
    assert [e for e, _ in c.get("val_at", [])] == epochs


@pytest.mark.parametrize(("steps", "limit", "n"), [(None, None, 2), (0, None, 0), (-1, None, 4), (5, 1, 1)])
def test_num_sanity_val_steps(steps, limit, n):
    _, c = run(max_epochs=1, num_sanity_val_steps=steps, limit_val_batches=limit, limit_train_batches=0)
    assert c["sanity"] == n


def test_sanity_check_does_not_leak_metrics():
    cb = Count()
    trainer = jl.Trainer(max_epochs=1, limit_train_batches=0, callbacks=[cb], **quiet(num_sanity_val_steps=2))
    trainer.fit(Classifier(), TRAIN, VAL)
    assert cb.n["sanity"] == 2 and "val_acc" not in trainer.callback_metrics


def test_max_time_stops_gracefully():
    """Trainer(max_time=...) adds a Timer; a budget already spent at fit start trains nothing (Lightning checks
    it before the first step: no batch, no validation, no epoch)."""
    trainer, c = run(max_epochs=5, max_time={"seconds": 0})
    assert trainer.global_step == 0 and c["train"] == 0
    assert c["val_runs"] == 0 and c["epochs"] == 0
    assert any(type(cb).__name__ == "Timer" for cb in trainer.callbacks)


def test_lambda_callback():
    seen = []
    cb = jl.callbacks.LambdaCallback(on_train_epoch_end=lambda trainer, module: seen.append(trainer.current_epoch))
    trainer = jl.Trainer(max_epochs=3, callbacks=[cb], **quiet())
    trainer.fit(Classifier(), TRAIN[:2])
    assert seen == [0, 1, 2]
    with pytest.raises(ValueError, match="'on_train_epoch_finish'"):
        jl.callbacks.LambdaCallback(on_train_epoch_finish=print)
