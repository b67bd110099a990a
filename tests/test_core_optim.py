"""Gradient accumulation and clipping equal their optax definitions over the same batches."""

import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from tests.core_models import EagerClassifier as Classifier
from tests.core_models import batches, hand_loop, make_data, max_diff, quiet


def fit_params(data, epochs=1, **trainer_kw):
    model = Classifier(lr=1e-2)
    trainer = jl.Trainer(max_epochs=epochs, **quiet(**trainer_kw))
    trainer.fit(model, data)
    return nnx.state(model.net, nnx.Param), trainer


def test_accumulate_grad_batches_equals_one_big_batch():
    x, y = make_data(128)
    small, big = batches(x, y, 8), batches(x, y, 32)  # 16 micro-batches == 4 batches of 4x the rows
    acc, trainer = fit_params(small, accumulate_grad_batches=4)
    ref, _, _ = hand_loop(optax.adam(1e-2), big)
    assert max_diff(acc, ref) <= 1e-6
    # global_step counts optimizer steps, not micro-batches (Lightning's meaning)
    assert trainer.global_step == 4
    assert int(trainer.train_state.step) == 4
    # and accumulation is not a no-op: one step per micro-batch gives different parameters
    plain, _, _ = hand_loop(optax.adam(1e-2), small)
    assert max_diff(plain, ref) > 1e-3


def test_accumulation_and_max_steps_count_optimizer_steps():
    x, y = make_data(128)
    _, trainer = fit_params(batches(x, y, 8), epochs=5, accumulate_grad_batches=4, max_steps=6)
    assert trainer.global_step == 6
    assert trainer._micro_batches == 24


@pytest.mark.parametrize(
    ("algorithm", "clip_val", "clip"),
    [
        ("norm", 0.05, optax.clip_by_global_norm(0.05)),
        ("value", 0.002, optax.clip(0.002)),
    ],
)
def test_gradient_clipping_equals_optax(algorithm, clip_val, clip):
    x, y = make_data(128)
    data = batches(x, y, 16)
    got, _ = fit_params(data, gradient_clip_val=clip_val, gradient_clip_algorithm=algorithm)
    ref, _, _ = hand_loop(optax.chain(clip, optax.adam(1e-2)), data)
    assert max_diff(got, ref) <= 1e-6
    unclipped, _, _ = hand_loop(optax.adam(1e-2), data)
    assert max_diff(ref, unclipped) > 1e-4  # the clip was active


def test_gradient_clip_val_zero_or_none_means_no_clipping():
    x, y = make_data(64)
    data = batches(x, y, 16)
    ref, _, _ = hand_loop(optax.adam(1e-2), data)
    got, _ = fit_params(data, gradient_clip_val=0.0)  # None (the default) is covered by every other test
    assert max_diff(got, ref) <= 1e-6


def test_lr_scheduler_dict_is_applied():
    """{"optimizer": tx, "lr_scheduler": schedule}: the schedule drives the optimizer's learning rate."""
    x, y = make_data(32)
    data = batches(x, y, 16)
    sched = optax.linear_schedule(1e-2, 1e-3, 2)

    class Sched(Classifier):
        def configure_optimizers(self):
            return {"optimizer": optax.adam(sched), "lr_scheduler": sched}

    model = Sched()
    trainer = jl.Trainer(max_epochs=1, **quiet())
    trainer.fit(model, data)
    ref, _, _ = hand_loop(optax.adam(sched), data)
    assert max_diff(nnx.state(model.net, nnx.Param), ref) <= 1e-6
    assert trainer.lr_scheduler_configs == [sched]
    np.testing.assert_allclose(float(sched(trainer.global_step)), 1e-3)
