"""validate/test/predict return what a hand computation over the data gives; one compilation per stage;
no host sync per step beyond the bounded run-ahead; the train state is donated."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlight as jl
from tests.core_models import MLP, Classifier, batches, make_data, quiet

x, y = make_data(128)
TRAIN = batches(x, y, 16)
VX, VY = make_data(48, seed=1)
VAL = batches(VX, VY, 16)


def accuracy(net, xs, ys):
    return float((np.asarray(net(jnp.asarray(xs))).argmax(-1) == ys).mean())


def test_validate_test_predict_after_fit():
    model = Classifier()
    trainer = jl.Trainer(max_epochs=2, **quiet())
    trainer.fit(model, TRAIN)
    expected = accuracy(model.net, VX, VY)

    out = trainer.validate(model, VAL, verbose=False)
    assert isinstance(out, list) and len(out) == 1 and set(out[0]) == {"val_acc"}
    assert out[0]["val_acc"] == pytest.approx(expected, abs=1e-6)
    assert isinstance(out[0]["val_acc"], float)
    out = trainer.test(model, VAL, verbose=False)
    assert out == [{"test_acc": pytest.approx(expected, abs=1e-6)}]

    preds = trainer.predict(model, [b[0] for b in VAL])
    assert len(preds) == len(VAL)
    for p, (bx, _) in zip(preds, VAL):
        assert p.shape == (16, 4)
        np.testing.assert_allclose(np.asarray(p), np.asarray(model.net(jnp.asarray(bx))), atol=1e-6)
    assert trainer.predict(model, [b[0] for b in VAL], return_predictions=False) is None


def test_validate_without_fit_uses_configure_model_params():
    model = Classifier()
    out = jl.Trainer(**quiet()).validate(model, VAL, verbose=False)
    assert out[0]["val_acc"] == pytest.approx(accuracy(MLP(nnx.Rngs(0)), VX, VY), abs=1e-6)


def test_validate_sees_user_edits_after_fit():
    model = Classifier()
    trainer = jl.Trainer(max_epochs=1, **quiet())
    trainer.fit(model, TRAIN)
    # make class 3 win everywhere: accuracy becomes the share of label 3
    model.net.l2.bias[...] = jnp.array([0.0, 0.0, 0.0, 1e6])
    out = trainer.validate(model, VAL, verbose=False)
    assert out[0]["val_acc"] == pytest.approx(float((VY == 3).mean()), abs=1e-6)


def test_one_compilation_per_fit_and_per_eval_stage(caplog):
    """Counted from jax's own compile log, independently of trainer.compile_counts."""
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.DEBUG, logger="jax"):
            model = Classifier()
            trainer = jl.Trainer(max_epochs=3, **quiet(num_sanity_val_steps=2))
            trainer.fit(model, TRAIN, VAL)  # sanity check + 3 epochs x (8 train steps + validation)
            trainer.validate(model, VAL, verbose=False)
            trainer.test(model, VAL, verbose=False)
            trainer.test(model, VAL, verbose=False)
            trainer.predict(model, [b[0] for b in VAL])
    finally:
        jax.config.update("jax_log_compiles", False)
    msgs = [r.getMessage() for r in caplog.records]

    def compiles(name):
        return sum(1 for m in msgs if m.startswith(f"Compiling jit({name}) "))

    assert compiles("train_step") == 1
    assert compiles("validate_step") == 1
    assert compiles("test_step") == 1
    assert compiles("predict_step") == 1
    assert dict(trainer.compile_counts) == {"train": 1, "validate": 1, "test": 1, "predict": 1}
    # the device-side epoch accumulators of self.log compile once per stage too (validate, test)
    assert sum(1 for m in msgs if m.startswith("Compiling jit(fold_epoch_metrics) ")) == 2


def test_train_state_is_donated():
    seen = []

    class Spy(jl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(trainer.train_state.params["net/l1/kernel"])

    trainer = jl.Trainer(max_epochs=1, callbacks=[Spy()], **quiet())
    trainer.fit(Classifier(), TRAIN[:3])
    assert all(a.is_deleted() for a in seen)  # every step's input buffers were donated to its output


def test_no_host_sync_per_step(monkeypatch):
    """Between logging points a fit never reads a device array on the host (every fetch goes through
    ArrayImpl._value); the run-ahead only blocks, len(steps) - RUN_AHEAD times. (jax's transfer guard does not
    guard the CPU backend, hence the patch.)"""
    from jax._src.array import ArrayImpl

    from jaxlight.loops import RUN_AHEAD

    fetches, waits, at_batch = [], [], []
    value = ArrayImpl._value
    monkeypatch.setattr(ArrayImpl, "_value", property(lambda self: (fetches.append(self.shape), value.fget(self))[1]))
    orig = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda x: (waits.append(1), orig(x))[1])
    own = ArrayImpl.block_until_ready  # the run-ahead waits on a step's loss with the array's own method
    monkeypatch.setattr(ArrayImpl, "block_until_ready", lambda self: (waits.append(1), own(self))[1])

    class Snap(jl.Callback):
        def on_train_batch_end(self, trainer, *args):
            at_batch.append(len(fetches))

    trainer = jl.Trainer(max_epochs=2, log_every_n_steps=1000, callbacks=[Snap()], **quiet())
    trainer.fit(Classifier(), TRAIN)
    assert trainer.global_step == 16
    # nothing fetched during an epoch; at most the prog-bar value and the step's loss (the non-finite check at
    # each epoch's end, issue 33), in one transfer, once at each epoch end
    assert at_batch == [0] * 8 + [at_batch[8]] * 8 and len(fetches) <= 4
    assert len(waits) == 16 - RUN_AHEAD
    # the counter is real: with a log step due every 2 steps, the logged loss is fetched at those steps
    at_batch.clear()
    fetches.clear()
    trainer = jl.Trainer(max_epochs=1, log_every_n_steps=2, callbacks=[Snap()], **quiet())
    trainer.fit(Classifier(), TRAIN)
    # logging happens right after on_train_batch_end; each log step fetches, in one device_get, the logged
    # loss and the step's own loss (the non-finite warning of issue 26 reads it at the log cadence)
    assert at_batch == [0, 0, 2, 2, 4, 4, 6, 6]
