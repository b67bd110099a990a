"""Gradient accumulation and clipping equal their optax definitions over the same batches."""

import jax
import jax.numpy as jnp
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
    assert trainer.position.micro_batches == 24


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
    """{"optimizer": tx, "lr_scheduler": schedule}: the schedule drives the optimizer's learning rate.

    The optimizer is built with a fixed (injectable) learning rate, so only the lr_scheduler entry can
    make the run follow the schedule: dropping the entry trains at 1e-2 and fails the comparison."""
    x, y = make_data(32)
    data = batches(x, y, 16)
    sched = optax.linear_schedule(1e-2, 1e-3, 2)

    class Sched(Classifier):
        def configure_optimizers(self):
            return {"optimizer": optax.inject_hyperparams(optax.adam)(learning_rate=1e-2), "lr_scheduler": sched}

    model = Sched()
    trainer = jl.Trainer(max_epochs=1, **quiet())
    trainer.fit(model, data)
    ref, _, _ = hand_loop(optax.adam(sched), data)
    fixed, _, _ = hand_loop(optax.adam(1e-2), data)
    assert max_diff(nnx.state(model.net, nnx.Param), ref) <= 1e-6
    assert max_diff(nnx.state(model.net, nnx.Param), fixed) > 1e-4  # the schedule made a difference
    assert trainer.lr_scheduler_configs == [sched]
    np.testing.assert_allclose(float(sched(trainer.global_step)), 1e-3)


def test_lr_scheduler_already_inside_the_optimizer_is_named_not_applied_twice():
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


def test_partial_accumulation_window_steps_at_epoch_end_like_lightning():
    """6 batches per epoch, accumulate 4: each epoch is a full window and a window of 2 that steps at the
    epoch's last batch with Lightning's scaling (sum of the 2 gradients / 4): 6 updates in 3 epochs."""
    from tests.core_models import initial_state, xent

    x, y = make_data(48)
    data = batches(x, y, 8)  # 6 micro-batches
    got, trainer = fit_params(data, epochs=3, accumulate_grad_batches=4)
    assert trainer.global_step == 6 and int(trainer.train_state.step) == 6
    assert trainer.compile_counts["train"] == 1  # the flush is a traced flag, not a second program

    gd, params, rest = initial_state()
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)

    @jax.jit
    def grad(params, xb, yb):
        return jax.grad(lambda p: xent(nnx.merge(gd, p, rest, copy=True)(xb), yb))(params)

    for _ in range(3):
        for window in (data[:4], data[4:]):
            g = [grad(params, jnp.asarray(xb), jnp.asarray(yb)) for xb, yb in window]
            mean = jax.tree.map(lambda *gs: sum(gs) / 4, *g)
            upd, opt_state = tx.update(mean, opt_state, params)
            params = optax.apply_updates(params, upd)
    assert max_diff(got, params) <= 1e-6
