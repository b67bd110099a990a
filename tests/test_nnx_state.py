"""Every NNX object a LightningModule holds is state (issue 22 item 1).

An ``nnx.Rngs`` for call-time dropout, an ``nnx.MultiMetric`` updated in a step, a bare ``nnx.Variable`` of
the user's own type: carried through the compiled steps in ``TrainState.model_state``, readable and
resettable in host hooks, checkpointed; whatever a host hook writes into the module reaches the next step.
On the code before this change every test here fails: the held objects raise ``TraceContextError`` inside the
step, and a hook's write (``metrics.reset()`` in a holder module, a parameter set in ``on_train_epoch_end``)
is silently overwritten by the train state.
"""

from __future__ import annotations

import os
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight.errors import MisconfigurationError
from tests.checkpoint_models import NormRegressor, norm_batches, norm_trainer
from tests.core_models import quiet
from tests.helpers import Losses

EPOCHS = 2
rng = np.random.default_rng(0)
X = rng.normal(size=(40, 4)).astype(np.float32)
Y = (X[:, 0] > X[:, 1]).astype(np.int32) + (X[:, 2] > 0.5).astype(np.int32)
TRAIN = [(X[i : i + 8], Y[i : i + 8]) for i in range(0, 24, 8)]  # 3 batches
VAL = [(X[i : i + 8], Y[i : i + 8]) for i in range(24, 40, 8)]  # 2 batches


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(4, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.do = nnx.Dropout(0.3)  # no rngs of its own: they come with the call (flax's NNX MNIST example)
        self.l2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        return self.l2(self.do(nnx.relu(self.bn(self.l1(x))), rngs=rngs))


class StepCount(nnx.Variable):
    """A variable type of the user's own."""


def xent(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


class MetricsHolder(nnx.Module):
    """The metrics inside a module of their own (the case that ran before, but lost host-side resets)."""

    def __init__(self):
        self.metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"), accuracy=nnx.metrics.Accuracy())


class Held(jl.LightningModule):
    """NNX objects held beside the model: created in ``__init__``, the model in ``configure_model`` from
    the held ``self.rngs`` (so its initialisation advances them, inside the creation trace)."""

    def __init__(self):
        super().__init__()
        self.rngs = nnx.Rngs(0, dropout=1)
        self.metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"), accuracy=nnx.metrics.Accuracy())
        self.seen = StepCount(jnp.zeros((), jnp.int32))
        self.val_loss = nnx.metrics.Average()
        self.epochs: list[dict[str, float]] = []
        self.val_epochs: list[float] = []

    def configure_model(self):
        self.net = Net(self.rngs)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x, rngs=self.rngs)
        loss = xent(logits, y)
        self.metrics.update(loss=loss, logits=logits, labels=y)
        self.seen.value = self.seen.value + 1
        return loss

    def on_train_epoch_end(self):
        self.epochs.append({k: float(v) for k, v in self.metrics.compute().items()})
        self.metrics.reset()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = xent(self.net(x), y)
        self.val_loss.update(values=loss)
        self.log("val_logged", loss)

    def on_validation_epoch_end(self):
        self.val_epochs.append(float(self.val_loss.compute()))
        self.val_loss.reset()

    def configure_optimizers(self):
        return optax.adam(1e-2)


class Record(Losses):
    """Each step's loss (a float) and the dropout stream's count the module shows after it; sets ``seen`` to 100
    after the second batch (a host write in a per-batch hook)."""

    def __init__(self):
        super().__init__(as_float=True)
        self.counts: list[int] = []
        self.val_logged: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.record(outputs)
        if isinstance(module, Held):
            self.counts.append(int(module.rngs.dropout.count[...]))
            if trainer.global_step == 2:
                module.seen.value = jnp.int32(100)

    def on_validation_end(self, trainer, module):
        self.val_logged.append(float(trainer.callback_metrics["val_logged"]))


class InModule(jl.LightningModule):
    """The metrics inside an nnx.Module (which ran before this change), reset in a host hook."""

    def __init__(self):
        super().__init__()
        self.epochs: list[dict[str, float]] = []

    def configure_model(self):
        self.net = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        self.holder = MetricsHolder()

    def training_step(self, batch, batch_idx):
        logits = self.net(batch[0])
        loss = xent(logits, batch[1])
        self.holder.metrics.update(loss=loss, logits=logits, labels=batch[1])
        return loss

    on_train_epoch_end = Held.on_train_epoch_end
    configure_optimizers = Held.configure_optimizers

    @property
    def metrics(self):
        return self.holder.metrics


_fits: dict[str, tuple] = {}


def fitted(kind: str = "held"):
    if kind not in _fits:
        rec = Record()
        module = Held() if kind == "held" else InModule()
        trainer = jl.Trainer(max_epochs=EPOCHS, devices=1, callbacks=[rec], **quiet())
        trainer.fit(module, TRAIN, VAL if kind == "held" else None)
        _fits[kind] = (trainer, module, rec)
    return _fits[kind]


def test_held_rngs_initialise_the_model_and_drive_call_time_dropout():
    trainer, module, rec = fitted()
    # one dropout key per step, drawn from the held stream, carried from step to step and shown to hooks
    assert rec.counts == list(range(1, EPOCHS * len(TRAIN) + 1))
    assert int(trainer.train_state.model_state["rngs/dropout/count"]) == EPOCHS * len(TRAIN)
    # configure_model initialised Net from the held stream, which moved as in an eager Net(rngs)
    assert int(module.rngs.params.count[...]) == ref_params_draws() > 0
    assert len(set(np.round(rec.losses, 6))) == len(rec.losses)  # it trained


def ref_params_draws() -> int:
    r = nnx.Rngs(0, dropout=1)
    Net(r)
    return int(r.params.count[...])


@pytest.mark.parametrize("kind", ["held", "in_module"], ids=["held_by_the_module", "inside_an_nnx_module"])
def test_metrics_update_in_the_step_and_reset_in_a_host_hook(kind):
    _, module, rec = fitted(kind)
    n = len(TRAIN)
    # each epoch's average is over its own batches: the reset in on_train_epoch_end reached the next step
    for epoch, got in enumerate(module.epochs):
        assert got["loss"] == pytest.approx(np.mean(rec.losses[epoch * n : (epoch + 1) * n]), abs=1e-6)
    assert len(module.epochs) == EPOCHS
    # and the reset values are what the module and the train state hold at the end
    assert float(module.metrics.loss.count[...]) == 0


def test_metrics_update_in_validation_steps():
    _, module, rec = fitted()
    assert len(module.val_epochs) == EPOCHS
    np.testing.assert_allclose(module.val_epochs, rec.val_logged, atol=1e-6, rtol=0)


def test_user_variable_carried_and_a_per_batch_hook_write_reaches_the_next_step():
    trainer, module, _ = fitted()
    steps = EPOCHS * len(TRAIN)
    assert int(module.seen.value) == 100 + steps - 2  # set to 100 after step 2, then counted on
    assert int(trainer.train_state.model_state["seen"]) == int(module.seen.value)


def test_held_state_is_checkpointed_and_resumes_mid_epoch(tmp_path):
    ref_trainer, ref, ref_rec = fitted()
    stop = len(TRAIN) + 1
    ckpt = jl.callbacks.ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=stop, save_last="link")
    first = jl.Trainer(max_steps=stop, devices=1, callbacks=[ckpt, Record()], **quiet(enable_checkpointing=True))
    first.fit(Held(), TRAIN, VAL)
    ckpt.wait_until_finished()
    rec = Record()
    module = Held()
    second = jl.Trainer(max_epochs=EPOCHS, devices=1, callbacks=[rec], **quiet())
    second.fit(module, TRAIN, VAL, ckpt_path=str(tmp_path / "last.ckpt"))
    assert rec.losses == ref_rec.losses[stop:]
    assert module.epochs[-1] == ref.epochs[-1]  # the metrics' totals of the epoch's first batch came back
    got, want = second.train_state.model_state, ref_trainer.train_state.model_state
    assert sorted(got) == sorted(want)
    for k in want:
        a, b = got[k], want[k]
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=k)


class Frozen(jl.LightningModule):
    """Trained with a zero learning rate, so what a hook writes into a parameter is what it ends with."""

    def configure_model(self):
        self.net = nnx.Linear(4, 3, rngs=nnx.Rngs(0))

    def training_step(self, batch, batch_idx):
        return xent(self.net(batch[0]), batch[1])

    def on_train_epoch_end(self):
        if self.current_epoch == 0:
            self.net.bias.value = jnp.full((3,), 0.5)

    def configure_optimizers(self):
        return optax.sgd(0.0)


def test_a_parameter_set_in_an_epoch_end_hook_is_trained_from(monkeypatch):
    placed = []
    original = jl.binding.ModuleBinding._placed
    monkeypatch.setattr(jl.binding.ModuleBinding, "_placed", lambda self, *a: placed.append(a[1]) or original(self, *a))
    module = Frozen()
    trainer = jl.Trainer(max_epochs=EPOCHS, devices=1, **quiet())
    trainer.fit(module, TRAIN)
    np.testing.assert_array_equal(np.asarray(trainer.train_state.params["net/bias"]), np.full(3, 0.5, np.float32))
    np.testing.assert_array_equal(np.asarray(module.net.bias[...]), np.full(3, 0.5, np.float32))
    assert placed == ["net/bias"]  # adopted once; the steps without a hook's write placed nothing


class Replacing(Held):
    def __init__(self, replacement):
        super().__init__()
        self.replacement = replacement

    def on_train_epoch_end(self):
        super().on_train_epoch_end()
        self.metrics = self.replacement()


@pytest.mark.parametrize(
    "replacement, says",
    [
        (lambda: "gone", "replaced or removed Replacing.metrics"),
        (lambda: nnx.MultiMetric(loss=nnx.metrics.Average("loss")), "other NNX variables"),
    ],
    ids=["not_nnx", "other_variables"],
)
def test_a_hook_that_replaces_held_state_is_refused_by_name(replacement, says):
    trainer = jl.Trainer(max_epochs=EPOCHS, devices=1, **quiet())
    with pytest.raises(MisconfigurationError, match=says) as e:
        trainer.fit(Replacing(replacement), TRAIN)
    assert "metrics" in str(e.value) and "hook on_train_epoch_end" in str(e.value)


def test_a_hook_may_replace_held_state_by_an_object_of_the_same_variables():
    rec = Record()
    module = Replacing(lambda: nnx.MultiMetric(loss=nnx.metrics.Average("loss"), accuracy=nnx.metrics.Accuracy()))
    jl.Trainer(max_epochs=EPOCHS, devices=1, callbacks=[rec], **quiet()).fit(module, TRAIN)
    n = len(TRAIN)
    assert module.epochs[1]["loss"] == pytest.approx(np.mean(rec.losses[n:]), abs=1e-6)


class HeldWithModes(Held):
    """Held, with its dropout left in eval mode (set in ``configure_model``) and its BatchNorm's running
    statistics frozen in a host hook (``track_running_stats = False``, what ``BaseFinetuning.freeze`` sets):
    the per-layer modes of the train step with NNX objects held beside the model."""

    def configure_model(self):
        super().configure_model()
        self.net.do.eval()

    def on_train_start(self):
        self.net.bn.track_running_stats = False

    def on_train_epoch_end(self):
        self.rows_seen.append(int(self.metrics.accuracy.count[...]))
        super().on_train_epoch_end()


def test_per_layer_modes_and_ragged_steps_with_held_state():
    ragged = [*TRAIN[:2], (X[16:21], Y[16:21])]  # a last batch of 5 rows: a step compiled for its shape
    module = HeldWithModes()
    module.rows_seen = []
    trainer = jl.Trainer(max_epochs=EPOCHS, devices=1, **quiet())
    trainer.fit(module, ragged)
    assert trainer.engine.compile_counts["train"] == 2  # the 8-row step and the 5-row one
    assert module.rows_seen == [21] * EPOCHS  # the metrics carried through both steps, reset between epochs
    assert int(module.seen.value) == EPOCHS * len(ragged)
    # the dropout left in eval mode drew nothing from the held stream; the frozen statistics stayed
    assert int(module.rngs.dropout.count[...]) == 0
    np.testing.assert_array_equal(np.asarray(module.net.bn.mean[...]), np.zeros(16, np.float32))
    np.testing.assert_array_equal(np.asarray(module.net.bn.var[...]), np.ones(16, np.float32))


class Sampler(jl.LightningModule):
    """Noise from a held stream in predict_step (a diffusion sampler's recipe)."""

    def __init__(self):
        super().__init__()
        self.rngs = nnx.Rngs(noise=3)

    def configure_model(self):
        self.net = nnx.Linear(4, 4, rngs=nnx.Rngs(0))

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0]) + jax.random.normal(self.rngs.noise(), batch[0].shape)

    def training_step(self, batch, batch_idx):  # draws nothing
        return jnp.mean(self.net(batch[0]) ** 2)

    def configure_optimizers(self):
        return optax.sgd(0.0)


@pytest.mark.parametrize("after_fit", [False, True], ids=["standalone", "after_fit"])
def test_predict_draws_new_noise_per_batch_from_a_held_stream(after_fit):
    module = Sampler()
    trainer = jl.Trainer(max_epochs=1, devices=1, **quiet())
    if after_fit:
        trainer.fit(module, TRAIN)
    out = trainer.predict(module, VAL)
    base = module.net(VAL[0][0])
    for i, (got, (x, _)) in enumerate(zip(out, VAL)):
        want = module.net(x) + jax.random.normal(jax.random.fold_in(jax.random.key(3), i), x.shape)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
    assert not np.allclose(
        np.asarray(out[0]) - np.asarray(base), np.asarray(out[1]) - np.asarray(module.net(VAL[1][0]))
    )
    assert int(module.rngs.noise.count[...]) == len(VAL)


class NoisyGAN(jl.LightningModule):
    """Manual optimization with the noise drawn from a held stream, once in training_step and once inside
    the loss function manual_backward differentiates."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.rngs = nnx.Rngs(noise=5)
        self.zs: list = []

    def configure_model(self):
        self.gen = nnx.Linear(2, 4, rngs=nnx.Rngs(0))
        self.disc = nnx.Linear(4, 1, rngs=nnx.Rngs(1))

    def training_step(self, batch, batch_idx):
        opt_g, opt_d = self.optimizers()
        real = batch[0]
        z = jax.random.normal(self.rngs.noise(), (real.shape[0], 2))

        def d_loss():
            return jnp.mean(self.disc(self.gen(z)) ** 2) + jnp.mean((self.disc(real) - 1) ** 2)

        def g_loss():
            z2 = jax.random.normal(self.rngs.noise(), (real.shape[0], 2))  # drawn inside the differentiated fn
            return jnp.mean((self.disc(self.gen(z2)) - 1) ** 2)

        loss_d, grads = self.manual_backward(d_loss, optimizer=opt_d)
        opt_d.step(grads)
        loss_g, grads = self.manual_backward(g_loss, optimizer=opt_g)
        opt_g.step(grads)
        return {"loss": loss_g, "z": z}

    def configure_optimizers(self):
        return [
            {"optimizer": optax.adam(1e-2), "params": self.gen},
            {"optimizer": optax.adam(1e-2), "params": self.disc},
        ]


def test_manual_optimization_draws_from_a_held_stream_inside_and_outside_manual_backward():
    seen = []
    grab = jl.callbacks.LambdaCallback(on_train_batch_end=lambda tr, m, out, b, i: seen.append(np.asarray(out["z"])))
    module = NoisyGAN()
    jl.Trainer(max_epochs=1, devices=1, callbacks=[grab], **quiet()).fit(module, TRAIN)
    assert int(module.rngs.noise.count[...]) == 2 * len(TRAIN)  # both draws of every step carried
    key = jax.random.key(5)
    for i, z in enumerate(seen):  # the step's first draw is the stream's (2 i)-th
        want = jax.random.normal(jax.random.fold_in(key, 2 * i), z.shape)
        np.testing.assert_array_equal(z, np.asarray(want))


class NormWithMetrics(NormRegressor):
    """The compatibility fixture's module, now also holding a metric its checkpoint knows nothing of."""

    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__(lr)
        self.metrics = nnx.metrics.Average()


def test_an_old_checkpoint_without_held_state_still_loads(tmp_path):
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "ckpt_v0", "step2.ckpt")
    ckpt = str(tmp_path / "step2.ckpt")
    shutil.copytree(src, ckpt)
    expected = np.load(os.path.join(os.path.dirname(src), "expected.npz"))
    t = norm_trainer(max_steps=2)
    with pytest.warns(UserWarning, match="metrics/count"):
        t.fit(NormWithMetrics(), norm_batches(), ckpt_path=ckpt)
    rest = t.train_state.model_state
    assert float(rest["metrics/total"]) == 0 and int(rest["metrics/count"]) == 0  # kept as built
    np.testing.assert_array_equal(np.asarray(rest["net/bn/mean"]), expected[".model_state['net/bn/mean']"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        m = NormWithMetrics.load_from_checkpoint(ckpt)
    np.testing.assert_array_equal(np.asarray(m.net.bn.mean[...]), expected[".model_state['net/bn/mean']"])
    assert int(m.metrics.count[...]) == 0
