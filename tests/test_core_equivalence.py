"""A Trainer.fit equals a hand-written jax.jit + optax loop over the same batches (1 and 8 devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from tests.core_models import Classifier, batches, hand_loop, initial_state, make_data, max_diff, quiet


@pytest.mark.parametrize(("devices", "strategy"), [(1, "auto"), (8, "ddp")])
def test_fit_equals_hand_loop(devices, strategy):
    x, y = make_data(128)
    data = batches(x, y, 16)
    epochs = 2
    model = Classifier(lr=1e-2)
    trainer = jl.Trainer(max_epochs=epochs, devices=devices, strategy=strategy, **quiet())
    trainer.fit(model, data)

    ref_params, ref_rest, ref_losses = hand_loop(optax.adam(1e-2), data * epochs)
    assert max_diff(nnx.state(model.net, nnx.Param), ref_params) <= 1e-6
    assert trainer.global_step == len(data) * epochs
    assert int(trainer.train_state.step) == len(data) * epochs
    assert ref_losses[-1] < ref_losses[0]  # the parameters moved: not a comparison of two initial states
    # the last logged loss is the loss of the last batch, as the hand loop computed it
    np.testing.assert_allclose(float(trainer.callback_metrics["train_loss"]), ref_losses[-1], atol=1e-6)

    # after fit the module holds the trained arrays, placed on the trainer's mesh: model.net(x) just works
    kernel = model.net.l1.kernel[...]
    assert isinstance(kernel, jax.Array) and len(kernel.sharding.device_set) == devices
    ref_net = nnx.merge(initial_state()[0], ref_params, ref_rest)
    np.testing.assert_allclose(np.asarray(model.net(jnp.asarray(x))), np.asarray(ref_net(jnp.asarray(x))), atol=1e-5)
