"""Epoch-interval schedules are evaluated on the host with the epoch as a Python int (torch ``LambdaLR``
lambdas written with ``math`` work, as in Lightning); step-interval ones stay traced, and one that cannot be
traced is refused before training starts."""

import math

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import jaxlight as jl
from jaxlight.callbacks import LearningRateMonitor
from jaxlight.errors import MisconfigurationError
from tests.core_models import EagerClassifier, batches, make_data, quiet

DATA = batches(*make_data(64), 16)  # 4 batches
EPOCHS = 5
BASE_LR = 0.1
T = 7  # no epoch of the 5 lands on a zero rate, so the relative check is meaningful


def cosine(e):  # a torch LambdaLR factor, written with math: it needs a Python number
    return 0.5 * (1 + math.cos(math.pi * e / T))


def returning(fn):
    return type("M", (EagerClassifier,), {"configure_optimizers": fn})()


def fit(fn, epochs=EPOCHS, mon=None):
    callbacks = [mon] if mon is not None else []
    logger = jl.loggers.CSVLogger("logs") if mon is not None else False
    trainer = jl.Trainer(max_epochs=epochs, devices=1, callbacks=callbacks, **quiet(logger=logger))
    trainer.fit(returning(fn), DATA)
    return trainer


def torch_lambda_lr_rates(factor, epochs):
    """The learning rate of each epoch under torch's LambdaLR, stepped once per epoch as Lightning steps an
    ``interval="epoch"`` scheduler (after each epoch's batches)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=BASE_LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    rates = []
    for _ in range(epochs):
        rates.append(opt.param_groups[0]["lr"])
        for _ in DATA:
            opt.step()
        sched.step()
    return rates


def test_math_lambda_epoch_schedule_matches_torch_lambda_lr():
    """The issue's case: ``math.cos`` in an epoch schedule raised JAX's ConcretizationTypeError. jaxlight's
    schedule gives the rate itself, so torch's ``LambdaLR(opt(lr=BASE_LR), f)`` is ``lambda e: BASE_LR * f(e)``;
    the rates LearningRateMonitor logs at each epoch start equal torch's, and the train step compiles once."""
    mon = LearningRateMonitor(logging_interval="epoch")

    def configure(self):
        opt = optax.inject_hyperparams(optax.sgd)(learning_rate=BASE_LR)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": lambda e: BASE_LR * cosine(e), "interval": "epoch"}}

    trainer = fit(configure, mon=mon)
    want = torch_lambda_lr_rates(cosine, EPOCHS)
    assert len(mon.lrs["lr-SGD"]) == EPOCHS
    np.testing.assert_allclose(mon.lrs["lr-SGD"], want, rtol=1e-7, atol=0)
    assert trainer.compile_counts["train"] == 1  # the rate is a state value: no recompile per epoch


def test_epoch_schedule_with_frequency_sees_python_ints():
    seen = []

    def sched(e):
        seen.append(e)
        return BASE_LR * cosine(e)

    def configure(self):
        opt = optax.inject_hyperparams(optax.sgd)(learning_rate=BASE_LR)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch", "frequency": 2}}

    trainer = fit(configure, epochs=4)
    assert seen and all(type(e) is int for e in seen)
    assert sorted(set(seen)) == [0, 1]
    assert trainer.compile_counts["train"] == 1


def test_untraceable_step_schedule_is_refused_before_training():
    calls = []

    class Spy(jl.Callback):
        def on_train_start(self, trainer, pl_module):
            calls.append("train_start")

    def configure(self):
        opt = optax.inject_hyperparams(optax.sgd)(learning_rate=BASE_LR)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": lambda s: BASE_LR * cosine(s), "interval": "step"}}

    trainer = jl.Trainer(max_epochs=1, devices=1, callbacks=[Spy()], **quiet(logger=False))
    with pytest.raises(MisconfigurationError) as err:
        trainer.fit(returning(configure), DATA)
    msg = str(err.value)
    assert "<lambda>" in msg and "test_optim_epoch_schedules.py" in msg  # the schedule, by name and place
    assert '"interval": "step"' in msg  # its interval
    assert "jnp.cos" in msg and '"interval": "epoch"' in msg  # the two fixes
    assert calls == []


def test_traceable_step_schedule_still_traced():
    def configure(self):
        opt = optax.inject_hyperparams(optax.sgd)(learning_rate=BASE_LR)
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": lambda s: BASE_LR * 0.5 * (1 + jnp.cos(jnp.pi * s / 8)), "interval": "step"},
        }

    trainer = fit(configure, epochs=2)
    assert trainer.compile_counts["train"] == 1
