"""Precision settings: Lightning's strings and aliases, honest refusals, and bf16 activations staying bf16
through normalisation layers while the running statistics stay float32."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight.precision import PRECISIONS, resolve_precision
from tests.core_models import Classifier, batches, make_data, quiet

VALID = r"choose one of \('32-true', 'bf16-mixed', '16-mixed', 'bf16-true', '16-true', '64-true'\)"


@pytest.mark.parametrize(
    ("given", "name"),
    [("bf16", "bf16-mixed"), ("32", "32-true"), (32, "32-true"), ("bf16-true", "bf16-true"), ("16-true", "16-true")],
)
def test_lightning_aliases(given, name):
    assert resolve_precision(given).name == name
    assert jl.Trainer(precision=given, **quiet()).precision == name  # as Lightning reports it


@pytest.mark.parametrize("given", ["16-mixed", "16", 16])
def test_fp16_mixed_is_accepted_with_loss_scaling(given):
    # tests/test_loss_scaling.py trains with it; here: Lightning's spellings reach the policy and its scaler
    trainer = jl.Trainer(precision=given, **quiet())
    assert trainer.precision == "16-mixed" and trainer.precision_plugin.scaler == jl.GradScaler()


@pytest.mark.parametrize("given", ["fp8", True, "transformer-engine", 8])
def test_unknown_precision_lists_the_valid_values(given):
    with pytest.raises(ValueError, match=rf"precision={given!r} is not supported; " + VALID + r" or an alias"):
        resolve_precision(given)


def test_double_precision_needs_x64():
    assert not jax.config.jax_enable_x64
    for given in ("64-true", "64", 64):
        with pytest.raises(ValueError, match=r"needs 64-bit JAX types: call jax.config.update\('jax_enable_x64'"):
            resolve_precision(given)
    jax.config.update("jax_enable_x64", True)
    try:
        prec = resolve_precision(64)
        assert prec.name == "64-true" and prec.store({"w": jnp.ones(2, jnp.float32)})["w"].dtype == jnp.float64
    finally:
        jax.config.update("jax_enable_x64", False)
    assert set(PRECISIONS) == {"32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true"}


class ConvNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
        self.fc = nnx.Linear(8, 16, rngs=rngs)
        self.ln = nnx.LayerNorm(16, rngs=rngs)
        self.out = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x, seen: dict):
        h = self.bn(self.conv(x))
        seen["bn"] = h.dtype
        h = self.ln(self.fc(nnx.relu(h).mean((1, 2))))
        seen["ln"] = h.dtype
        logits = self.out(h)
        seen["logits"] = logits.dtype
        return logits


class LitConv(jl.LightningModule):
    seen: dict = {}

    def configure_model(self):
        self.net = ConvNet(nnx.Rngs(0))

    def training_step(self, batch, batch_idx):
        x, y = batch
        seen = LitConv.seen.setdefault("train", {})
        return optax.softmax_cross_entropy_with_integer_labels(self.net(x, seen), y).mean()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        seen = LitConv.seen.setdefault("validate", {})
        self.log("acc", (self.net(x, seen).argmax(-1) == y).mean())

    def configure_optimizers(self):
        return optax.sgd(0.1)


rng = np.random.default_rng(0)
IMAGES = [(rng.normal(2.0, 3.0, (8, 6, 6, 3)).astype(np.float32), rng.integers(0, 4, 8)) for _ in range(3)]


def fit_conv(precision: str):
    LitConv.seen = {}
    model = LitConv()
    trainer = jl.Trainer(max_epochs=1, precision=precision, **quiet())
    trainer.fit(model, IMAGES, IMAGES[:1])
    return model, trainer


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_activations_stay_bf16_through_norms(precision):
    model, trainer = fit_conv(precision)
    bf16 = {"bn": jnp.bfloat16, "ln": jnp.bfloat16, "logits": jnp.bfloat16}
    assert LitConv.seen == {"train": bf16, "validate": bf16}
    rest = trainer.train_state.model_state
    assert rest["net/bn/mean"].dtype == jnp.float32 and rest["net/bn/var"].dtype == jnp.float32
    param_dtype = jnp.float32 if precision == "bf16-mixed" else jnp.bfloat16
    assert all(v.dtype == param_dtype for v in trainer.train_state.params.values())
    # the running statistics are accumulated in float32: they follow the fp32 run to bf16-activation accuracy
    ref_model, _ = fit_conv("32-true")
    assert LitConv.seen["train"] == {"bn": jnp.float32, "ln": jnp.float32, "logits": jnp.float32}
    for stat in ("mean", "var"):
        got, ref = np.asarray(getattr(model.net.bn, stat)[...]), np.asarray(getattr(ref_model.net.bn, stat)[...])
        assert np.abs(ref - (1.0 if stat == "var" else 0.0)).max() > 0.1  # they moved from their init
        np.testing.assert_allclose(got, ref, rtol=3e-2, atol=3e-2)


def test_bind_keeps_statistics_float32_exactly():
    """Under bind a BatchNorm returns the input's dtype, but its statistics are the float32 statistics of the
    (bf16) input: casting them to bf16 instead would make a 0.9-momentum update round back to the old value."""
    prec = resolve_precision("bf16-mixed")
    bn = nnx.BatchNorm(4, momentum=0.9, rngs=nnx.Rngs(0))
    ref = nnx.BatchNorm(4, momentum=0.9, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).normal(5.0, 2.0, (64, 4)), jnp.bfloat16)
    assert prec.bind({"bn": bn}) == {"bn": bn}
    prec.bind(bn)  # idempotent
    bn.scale.set_value(bn.scale[...].astype(jnp.bfloat16))  # what Precision.compute does to parameters
    bn.bias.set_value(bn.bias[...].astype(jnp.bfloat16))
    y, y_ref = bn(x), ref(x.astype(jnp.float32))
    assert y.dtype == jnp.bfloat16 and bn.mean[...].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(bn.mean[...]), np.asarray(ref.mean[...]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(bn.var[...]), np.asarray(ref.var[...]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref), atol=2e-2)  # one bf16 rounding
    # left alone: policies without a compute dtype, and BatchNorms with an explicit dtype
    plain = nnx.BatchNorm(4, rngs=nnx.Rngs(0))
    explicit = nnx.BatchNorm(4, dtype=jnp.float32, rngs=nnx.Rngs(0))
    resolve_precision("32-true").bind(plain)
    prec.bind(explicit)
    assert plain.promote_dtype is explicit.promote_dtype is nnx.BatchNorm(4, rngs=nnx.Rngs(0)).promote_dtype


def test_16_true_stores_fp16_parameters():
    class Spy(Classifier):
        dtypes: dict = {}

        def training_step(self, batch, batch_idx):
            x, y = batch
            Spy.dtypes = {"x": x.dtype, "kernel": self.net.l1.kernel[...].dtype}
            return super().training_step(batch, batch_idx)

    trainer = jl.Trainer(max_epochs=1, precision="16-true", **quiet())
    model = Spy(opt="sgd", lr=0.1)
    trainer.fit(model, batches(*make_data(64), 16))
    assert Spy.dtypes == {"x": jnp.float16, "kernel": jnp.float16}
    assert all(v.dtype == jnp.float16 for v in trainer.train_state.params.values())
    assert np.isfinite(float(trainer.callback_metrics["train_loss"]))
