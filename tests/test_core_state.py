"""NNX state through the step (BatchNorm statistics, dropout RNG), precision policies, the module after
fit, and the Linen adapter."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import jaxlight as jl
from tests.core_models import (
    Classifier,
    EagerClassifier,
    batches,
    hand_loop,
    initial_state,
    make_data,
    max_diff,
    quiet,
    xent,
)

x, y = make_data(128)
TRAIN = batches(x, y, 16)


@pytest.mark.parametrize("kw", [{"batchnorm": True}, {"dropout": 0.5}], ids=["batchnorm", "dropout"])
def test_non_param_state_equals_hand_loop(kw):
    # SGD: the bias before BatchNorm has an exactly-zero gradient, whose rounding noise Adam would amplify
    model = Classifier(opt="sgd", lr=0.1, **kw)
    jl.Trainer(max_epochs=1, devices=8, **quiet()).fit(model, TRAIN)
    ref_params, ref_rest, _ = hand_loop(optax.sgd(0.1), TRAIN, **kw)
    assert max_diff(nnx.state(model.net, nnx.Param), ref_params) <= 1e-6
    assert max_diff(nnx.state(model.net, nnx.Not(nnx.Param)), ref_rest) <= 1e-6
    _, _, init_rest = initial_state(**kw)
    if kw.get("batchnorm"):
        assert max_diff(nnx.state(model.net, nnx.BatchStat), nnx.state(init_rest, nnx.BatchStat)) > 1e-2  # moved
    else:
        count = nnx.state(model.net, nnx.RngCount)
        assert [int(c[...]) for c in jax.tree.leaves(count)] == [len(TRAIN)]  # one dropout draw per step


def test_dropout_masks_differ_between_steps():
    masks = []

    class Masked(Classifier):
        def training_step(self, batch, batch_idx):
            bx, by = batch
            h = nnx.relu(self.net.l1(bx))
            dropped = self.net.do(h)
            loss = xent(self.net.l2(dropped), by)
            return {"loss": loss, "kept": (dropped != 0) | (h == 0)}

    class Grab(jl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            masks.append(np.asarray(outputs["kept"]))

    same = [TRAIN[0]] * 3  # the same batch three times: only the RNG stream changes
    jl.Trainer(max_epochs=1, callbacks=[Grab()], **quiet()).fit(Masked(dropout=0.5), same)
    assert len(masks) == 3
    assert 0.3 < masks[0].mean() < 0.9
    assert (masks[0] != masks[1]).any() and (masks[1] != masks[2]).any()


def test_eval_uses_eval_mode():
    """Validation runs BatchNorm on running statistics and no dropout: it equals the module in eval mode."""
    model = Classifier(batchnorm=True, dropout=0.5)
    trainer = jl.Trainer(max_epochs=1, **quiet())
    trainer.fit(model, TRAIN)
    preds = trainer.predict(model, [b[0] for b in TRAIN[:2]])
    model.net.eval()
    for p, (bx, _) in zip(preds, TRAIN[:2]):
        np.testing.assert_allclose(np.asarray(p), np.asarray(model.net(jnp.asarray(bx))), atol=1e-5)


class DtypeSpy(Classifier):
    seen: dict = {}

    def training_step(self, batch, batch_idx):
        bx, by = batch
        logits = self.net(bx)
        DtypeSpy.seen = {"x": bx.dtype, "kernel": self.net.l1.kernel[...].dtype, "logits": logits.dtype}
        return xent(logits, by)


def test_bf16_mixed_keeps_fp32_params_and_computes_in_bf16():
    model = DtypeSpy()
    trainer = jl.Trainer(max_epochs=1, precision="bf16-mixed", **quiet())
    trainer.fit(model, TRAIN)
    assert DtypeSpy.seen == {"x": jnp.bfloat16, "kernel": jnp.bfloat16, "logits": jnp.bfloat16}
    assert all(v.dtype == jnp.float32 for v in trainer.train_state.params.values())
    assert all(
        v.dtype == jnp.float32
        for v in jax.tree.leaves(trainer.train_state.opt_state)
        if jnp.issubdtype(v.dtype, jnp.floating)
    )
    assert model.net.l1.kernel[...].dtype == jnp.float32
    # the fp32 masters trained: close to the fp32 run, but not identical (bf16 forward)
    ref, _, _ = hand_loop(optax.adam(1e-2), TRAIN)
    d = max_diff(nnx.state(model.net, nnx.Param), ref)
    assert 0 < d < 5e-2
    assert trainer.train_state.params["net/l1/kernel"].dtype == jnp.float32


def test_bf16_true_stores_bf16_params():
    model = DtypeSpy()
    trainer = jl.Trainer(max_epochs=1, precision="bf16-true", **quiet())
    trainer.fit(model, TRAIN)
    # Lightning's bf16-true casts float inputs too, so the whole forward runs in bf16
    assert DtypeSpy.seen == {"x": jnp.bfloat16, "kernel": jnp.bfloat16, "logits": jnp.bfloat16}
    assert all(v.dtype == jnp.bfloat16 for v in trainer.train_state.params.values())
    assert model.net.l1.kernel[...].dtype == jnp.bfloat16
    mu = trainer.train_state.opt_state[0].mu
    assert all(v.dtype == jnp.bfloat16 for v in jax.tree.leaves(mu))
    # bf16 parameters moved from their initial values
    _, init, _ = initial_state()
    assert max_diff(nnx.state(model.net, nnx.Param), init) > 1e-2


def test_references_to_a_module_created_before_fit_see_the_trained_values():
    """Like a torch module, the NNX module object passed in is updated in place (not replaced)."""
    model = EagerClassifier()
    net = model.net
    jl.Trainer(max_epochs=1, devices=8, **quiet()).fit(model, TRAIN)
    assert model.net is net
    gd, _, rest = initial_state()
    ref_params, _, _ = hand_loop(optax.adam(1e-2), TRAIN)
    np.testing.assert_allclose(
        np.asarray(net(jnp.asarray(x))), np.asarray(nnx.merge(gd, ref_params, rest)(jnp.asarray(x))), atol=1e-5
    )


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.relu(nn.Dense(16)(x)))


class LinenClassifier(jl.LightningModule):
    def configure_model(self):
        self.net = jl.nn.from_linen(LinenMLP(), jnp.ones((1, 8)), rngs=nnx.Rngs(0))

    def training_step(self, batch, batch_idx):
        bx, by = batch
        loss = xent(self.net(bx), by)
        self.log("loss", loss, on_epoch=True)
        return loss

    def configure_optimizers(self):
        return optax.adam(1e-2)


def test_linen_adapter_trains():
    model = LinenClassifier()
    losses = []

    class Epoch(jl.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            losses.append(float(trainer.callback_metrics["loss_epoch"]))

    trainer = jl.Trainer(max_epochs=3, callbacks=[Epoch()], **quiet())
    trainer.fit(model, TRAIN)
    init = LinenClassifier()
    init.configure_model()
    assert max_diff(nnx.state(model.net, nnx.Param), nnx.state(init.net, nnx.Param)) > 1e-2
    assert losses[-1] < 0.8 * losses[0]
    assert set(trainer.train_state.params) == {f"net/Dense_{i}/{p}" for i in (0, 1) for p in ("kernel", "bias")}


def test_a_step_that_creates_a_variable_is_refused_by_name():
    """A forward pass that sows a new variable would shift every later leaf of the flat state."""

    class Sows(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(4, 4, rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs)

        def __call__(self, x):
            h = self.l1(x)
            self.sow(nnx.Intermediate, "hidden", h)
            return self.bn(h)

    class M(jl.LightningModule):
        def configure_model(self):
            self.net = Sows(nnx.Rngs(0))

        def training_step(self, batch, batch_idx):
            return self.net(batch["x"]).mean()

        def configure_optimizers(self):
            return optax.sgd(0.1)

    with pytest.raises(ValueError, match=r"the model's variables changed since it was set up: added \['net/hidden"):
        jl.Trainer(max_steps=1, devices=1, **quiet()).fit(M(), [{"x": np.ones((4, 4), np.float32)}])
