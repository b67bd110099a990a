"""LightningModule behaves like Lightning's (a torch module): model(x) runs forward, predict_step defaults to
self(batch), train()/eval() switch dropout and BatchNorm, freeze()/unfreeze(), self.training in steps."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from tests.core_models import IN, MLP, OUT, Classifier, batches, make_data, quiet

X, Y = make_data(64)
TRAIN = batches(X, Y, 16)


class Probs(jl.LightningModule):
    """Lightning's usual shape: forward for inference, training_step for the loss, no predict_step."""

    def __init__(self):
        super().__init__()
        self.net = MLP(nnx.Rngs(0), dropout=0.5, batchnorm=True)

    def forward(self, x, temperature=1.0):
        return jax.nn.softmax(self.net(x) / temperature)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return optax.softmax_cross_entropy_with_integer_labels(self.net(x), y).mean()

    def configure_optimizers(self):
        return optax.sgd(0.1)


def test_call_runs_forward():
    model = Probs().eval()
    x = jnp.asarray(X[:4])
    np.testing.assert_allclose(np.asarray(model(x)), np.asarray(jax.nn.softmax(model.net(x))), rtol=1e-6)
    np.testing.assert_allclose(
        np.asarray(model(x, temperature=2.0)), np.asarray(jax.nn.softmax(model.net(x) / 2)), rtol=1e-6
    )

    class Single(jl.LightningModule):  # no forward: the only NNX model is the default
        def __init__(self):
            super().__init__()
            self.net = MLP(nnx.Rngs(0))

    single = Single()
    np.testing.assert_array_equal(np.asarray(single(x)), np.asarray(single.net(x)))

    class Two(Single):
        def __init__(self):
            super().__init__()
            self.head = nnx.Linear(OUT, 2, rngs=nnx.Rngs(1))

    with pytest.raises(NotImplementedError, match=r"Two has NNX models \['head', 'net'\], so model\(...\) has no"):
        Two()(x)
    with pytest.raises(NotImplementedError, match=r"no NNX model yet \(configure_model creates them\)"):
        jl.LightningModule()(x)


def test_default_predict_step_is_self_of_batch():
    model = Probs()
    trainer = jl.Trainer(max_epochs=1, **quiet())
    trainer.fit(model, TRAIN)
    preds = trainer.predict(model, [X[:16], X[16:32]])
    model.eval()  # predict runs in eval mode: dropout off, BatchNorm on its running statistics
    for p, x in zip(preds, (X[:16], X[16:32])):
        np.testing.assert_allclose(np.asarray(p), np.asarray(model(jnp.asarray(x))), atol=1e-6)
        np.testing.assert_allclose(np.asarray(p).sum(-1), 1.0, atol=1e-5)  # forward's softmax, not raw logits


def test_train_and_eval_switch_every_nnx_attribute():
    class Outer(jl.LightningModule):
        def __init__(self):
            super().__init__()
            self.inner = Probs()  # nested LightningModule: follows, as torch's train() recurses
            self.net = MLP(nnx.Rngs(1), dropout=0.5, batchnorm=True)

        def forward(self, x):
            return self.net(x)

    model = Outer()
    x = jnp.asarray(X[:16])
    assert model.training and model.eval() is model and not model.training
    for net in (model.net, model.inner.net):
        assert net.do.deterministic and net.bn.use_running_average
    assert not model.inner.training
    stats = np.asarray(model.net.bn.mean[...])
    np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(model(x)))  # dropout off
    np.testing.assert_array_equal(np.asarray(model.net.bn.mean[...]), stats)  # running stats untouched

    assert model.train() is model and model.training and model.inner.training
    for net in (model.net, model.inner.net):
        assert not net.do.deterministic and not net.bn.use_running_average
    a, b = np.asarray(model(x)), np.asarray(model(x))
    assert not np.array_equal(a, b)  # a new dropout mask per call
    assert np.abs(np.asarray(model.net.bn.mean[...]) - stats).max() > 1e-3  # batch statistics folded in
    assert model.train(False) is model and not model.training and model.net.bn.use_running_average
    with pytest.raises(ValueError, match="train\\(mode\\) expects a bool, got 'no'"):
        model.train("no")


def test_training_flag_inside_steps():
    seen = {}

    class Flags(Classifier):
        def training_step(self, batch, batch_idx):
            seen["train"] = self.training
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch, batch_idx):
            seen["val"] = self.training
            return super().validation_step(batch, batch_idx)

    model = Flags()
    model.eval()  # the loops decide inside the steps, as Lightning's loops call train()/eval()
    jl.Trainer(max_epochs=1, **quiet()).fit(model, TRAIN, TRAIN[:1])
    assert seen == {"train": True, "val": False}
    assert not model.training  # outside the steps: what the user set


def test_freeze_and_unfreeze():
    model = Probs()
    assert not model.frozen
    assert model.freeze() is None and model.frozen and not model.training
    assert model.net.do.deterministic and model.net.bn.use_running_average
    model.unfreeze()
    assert not model.frozen and model.training and not model.net.bn.use_running_average


def test_partial_freeze_with_an_optimizer_mask():
    """What requires_grad=False on a backbone becomes in jaxlight (the recipe in docs/porting_torch.md)."""

    class Finetune(Classifier):
        def configure_optimizers(self):
            labels = lambda params: {k: "frozen" if k.startswith("net/l1/") else "train" for k in params}
            return optax.multi_transform({"train": optax.adam(1e-2), "frozen": optax.set_to_zero()}, labels)

    model = Finetune()
    model.configure_model()
    l1, l2 = np.asarray(model.net.l1.kernel[...]), np.asarray(model.net.l2.kernel[...])
    jl.Trainer(max_epochs=1, **quiet()).fit(model, TRAIN)
    np.testing.assert_array_equal(np.asarray(model.net.l1.kernel[...]), l1)
    assert np.abs(np.asarray(model.net.l2.kernel[...]) - l2).max() > 1e-3
    assert model.net.l1.kernel[...].shape == (IN, 16)
