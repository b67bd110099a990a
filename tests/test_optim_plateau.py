"""optax.contrib.reduce_on_plateau fed with a monitored metric, as Lightning steps ReduceLROnPlateau."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from optax.contrib import ReduceLROnPlateauState

import jaxlight as jl
from jaxlight.callbacks import LearningRateMonitor
from tests.core_models import EagerClassifier, batches, initial_state, make_data, max_diff, quiet, xent
from tests.helpers import Losses

DATA = batches(*make_data(64), 16)  # 4 batches
LR = 0.1


def plateau():
    return optax.contrib.reduce_on_plateau(factor=0.5, patience=1)


class _Monitored(EagerClassifier):
    """Validation logs a constant, so the plateau's decisions are known: improve once, then stall."""

    returned = None  # a function returning configure_optimizers' answer (set per test)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_const", jnp.float32(1.0))  # a training metric that never improves
        return loss

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        self.log("val_const", jnp.float32(1.0))

    def configure_optimizers(self):
        return type(self).returned()


def Monitored(returned):  # a class per form, so the form is not a hyperparameter
    return type("Monitored", (_Monitored,), {"returned": staticmethod(returned)})()


def host_scales(values):
    """Scales optax's own reduce_on_plateau reaches when fed ``values`` one call at a time (1 first)."""
    tx = plateau()
    state = tx.init({})
    scales = [1.0]
    for v in values:
        _, state = tx.update({}, state, value=v)
        scales.append(float(state.scale))
    return scales


def sgd_with_scales(data_per_scale):
    """Plain SGD where the batches in ``data_per_scale[i]`` are stepped with lr * scales[i]."""
    gd, params, rest = initial_state()

    @jax.jit
    def step(params, x, y, lr):
        g = jax.grad(lambda p: xent(nnx.merge(gd, p, rest, copy=True)(x), y))(params)
        return jax.tree.map(lambda p, g: p - lr * g, params, g)

    for scale, data in data_per_scale:
        for x, y in data:
            params = step(params, jnp.asarray(x), jnp.asarray(y), LR * scale)
    return params


def plateau_states(trainer):
    return [
        n
        for n in jax.tree.leaves(trainer.train_state.opt_state, is_leaf=lambda n: isinstance(n, ReduceLROnPlateauState))
        if isinstance(n, ReduceLROnPlateauState)
    ]


FORMS = {
    "scheduler dict": lambda: {
        "optimizer": optax.inject_hyperparams(optax.sgd)(learning_rate=LR),
        "lr_scheduler": {"scheduler": plateau(), "monitor": "val_const"},
    },
    "inside, top-level monitor": lambda: {
        "optimizer": optax.chain(optax.inject_hyperparams(optax.sgd)(learning_rate=LR), plateau()),
        "monitor": "val_const",
    },
}


def _same_object():
    p = plateau()
    return {
        "optimizer": optax.chain(optax.inject_hyperparams(optax.sgd)(learning_rate=LR), p),
        "lr_scheduler": {"scheduler": p, "monitor": "val_const"},
    }


FORMS["inside and named"] = _same_object


@pytest.mark.parametrize("form", list(FORMS))
def test_epoch_plateau_equals_sgd_with_the_scales_optax_computes(form):
    epochs = 4
    mon = LearningRateMonitor()
    model = Monitored(FORMS[form])
    trainer = jl.Trainer(max_epochs=epochs, devices=1, callbacks=[mon], **quiet(logger=jl.loggers.CSVLogger("logs")))
    trainer.fit(model, DATA, val_dataloaders=DATA[:1])
    scales = host_scales([1.0] * epochs)
    assert scales[:4] == [1.0, 1.0, 0.5, 0.25]  # the plateau really acted
    ref = sgd_with_scales([(scales[e], DATA) for e in range(epochs)])
    assert max_diff(nnx.state(model.net, nnx.Param), ref) <= 1e-6
    states = plateau_states(trainer)
    assert len(states) == 1  # the plateau given twice is applied once
    np.testing.assert_allclose(float(states[0].scale), scales[epochs])
    assert trainer.compile_counts["train"] == 1  # the step never takes the metric
    # plateau schedulers are epoch-interval: logged at each epoch start, with the reduced rate
    np.testing.assert_allclose(mon.lrs["lr-SGD"], [LR * s for s in scales[:epochs]], rtol=1e-6)


def test_step_interval_plateau_steps_after_every_second_batch():
    rec = Losses(as_float=True)
    losses = rec.losses

    returned = lambda: {
        "optimizer": optax.sgd(LR),
        "lr_scheduler": {"scheduler": plateau(), "monitor": "train_const", "interval": "step", "frequency": 2},
    }
    model = Monitored(returned)
    trainer = jl.Trainer(max_epochs=2, devices=1, callbacks=[rec], **quiet())
    trainer.fit(model, DATA)
    # the stalled metric is fed after every second batch: the plateau really cuts the rate on the way
    fed = [1.0 for i in range(len(losses)) if (i % len(DATA) + 1) % 2 == 0]
    scales = host_scales(fed)
    assert min(scales) < 1
    # batch i trains with the scale reached after the plateau steps of batches before it
    per_batch = [scales[i // 2] for i in range(len(losses))]
    ref = sgd_with_scales([(s, [DATA[i % len(DATA)]]) for i, s in enumerate(per_batch)])
    assert max_diff(nnx.state(model.net, nnx.Param), ref) <= 1e-6
    np.testing.assert_allclose(float(plateau_states(trainer)[0].scale), scales[-1])


def test_missing_monitor_raises_with_the_available_metrics_unless_not_strict():
    returned = lambda: {"optimizer": optax.sgd(LR), "lr_scheduler": {"scheduler": plateau(), "monitor": "val_loss"}}
    with pytest.raises(jl.MisconfigurationError, match=r"metric val_loss which is not available.*'train_loss'"):
        jl.Trainer(max_epochs=1, devices=1, **quiet()).fit(Monitored(returned), DATA)

    lax = lambda: {
        "optimizer": optax.sgd(LR),
        "lr_scheduler": {"scheduler": plateau(), "monitor": "val_loss", "strict": False},
    }
    trainer = jl.Trainer(max_epochs=2, devices=1, **quiet())
    with pytest.warns(RuntimeWarning, match="strict is set to `False`"):
        trainer.fit(Monitored(lax), DATA)
    assert float(plateau_states(trainer)[0].scale) == 1.0


def test_plateau_state_is_checkpointed_and_resumed(tmp_path):
    straight = Monitored(FORMS["scheduler dict"])
    t = jl.Trainer(max_epochs=4, devices=1, **quiet())
    t.fit(straight, DATA, val_dataloaders=DATA[:1])
    first = Monitored(FORMS["scheduler dict"])
    t1 = jl.Trainer(max_epochs=2, devices=1, **quiet())
    t1.fit(first, DATA, val_dataloaders=DATA[:1])
    t1.save_checkpoint(tmp_path / "ckpt")
    resumed = Monitored(FORMS["scheduler dict"])
    t2 = jl.Trainer(max_epochs=4, devices=1, **quiet())
    t2.fit(resumed, DATA, val_dataloaders=DATA[:1], ckpt_path=str(tmp_path / "ckpt"))
    assert float(plateau_states(t2)[0].scale) == float(plateau_states(t)[0].scale) == host_scales([1.0] * 4)[4]
    assert max_diff(nnx.state(resumed.net, nnx.Param), nnx.state(straight.net, nnx.Param)) <= 1e-6
