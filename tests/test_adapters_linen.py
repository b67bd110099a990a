"""from_linen: mode switches the call cannot see, the example's own init key, and existing parameters
(issue 22, problems 5 and 6)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import linen as nn
from flax import serialization, struct
from jax.sharding import PartitionSpec as P

import jaxlight as jl
from tests.core_models import quiet


@struct.dataclass
class Config:
    features: int = 16
    rate: float = 0.5
    deterministic: bool = False


class ConfigDropout(nn.Module):
    """lm1b's convention: the mode switch lives in a config dataclass, not in the call."""

    config: Config

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.config.features)(x)
        return nn.Dropout(self.config.rate)(x, deterministic=self.config.deterministic)


class FieldDropout(nn.Module):
    train: bool = True

    @nn.compact
    def __call__(self, x):
        return nn.Dropout(0.5, deterministic=not self.train)(nn.Dense(16)(x))


class OtherName(nn.Module):
    @nn.compact
    def __call__(self, x, is_train: bool = True):
        return nn.Dropout(0.5, deterministic=not is_train)(nn.Dense(16)(x))


X = jnp.ones((4, 8))


def test_eval_runs_the_eval_value_of_a_config_or_module_field():
    net = jl.nn.from_linen(ConfigDropout(Config()), X, rngs={"params": 0, "dropout": 1})
    variables = net.linen_variables()
    assert net.linen_module(False).config.deterministic is True  # the eval clone
    assert net.linen_module(True).config.deterministic is False  # training as written
    train_out = net(X)
    assert float((train_out == 0).mean()) > 0.2  # dropout in training
    net.eval()
    want = ConfigDropout(Config(deterministic=True)).apply(variables, X)
    np.testing.assert_array_equal(np.asarray(net(X)), np.asarray(want))  # no dropout in evaluation

    field = jl.nn.from_linen(FieldDropout(), X, rngs={"params": 0, "dropout": 1})
    field.eval()
    np.testing.assert_array_equal(
        np.asarray(field(X)), np.asarray(FieldDropout(train=False).apply(field.linen_variables(), X))
    )


def test_validate_turns_config_held_dropout_off():
    class M(jl.LightningModule):
        def configure_model(self):
            self.net = jl.nn.from_linen(ConfigDropout(Config()), X, rngs={"params": 0, "dropout": 1})

        def training_step(self, batch, batch_idx):
            return (self.net(batch[0]) ** 2).mean()

        def validation_step(self, batch, batch_idx):
            self.log("val", (self.net(batch[0]) ** 2).mean())

        def configure_optimizers(self):
            return optax.sgd(0.01)

    model = M()
    trainer = jl.Trainer(max_epochs=1, devices=1, **quiet())
    x = np.random.default_rng(0).normal(size=(8, 8)).astype(np.float32)
    trainer.fit(model, [(x,)])
    got = trainer.validate(model, [(x,)])[0]["val"]
    variables = model.net.linen_variables()
    want = float((ConfigDropout(Config(deterministic=True)).apply(variables, x) ** 2).mean())
    assert got == pytest.approx(want, abs=1e-6)


def test_explicit_overrides():
    # a flag with another name: per-mode call keywords
    net = jl.nn.from_linen(OtherName(), X, rngs={"params": 0, "dropout": 1}, eval_kwargs={"is_train": False})
    net.eval()
    np.testing.assert_array_equal(
        np.asarray(net(X)), np.asarray(OtherName().apply(net.linen_variables(), X, is_train=False))
    )
    # eval_module: a module of your choice, or the training module itself to keep dropout on in evaluation
    keep = jl.nn.from_linen(FieldDropout(), X, rngs={"params": 0, "dropout": 1}, eval_module=lambda m: m)
    keep.eval()
    assert float((keep(X) == 0).mean()) > 0.2
    with pytest.raises(TypeError, match="eval_module must be a Linen module or a callable"):
        jl.nn.from_linen(FieldDropout(), X, eval_module=3)


def test_init_key_reproduces_the_examples_own_init():
    key = jax.random.split(jax.random.key(0))[1]
    net = jl.nn.from_linen(FieldDropout(), X, init_key=key)
    want = FieldDropout(train=False).init(key, X)  # init runs the eval module, as lm1b inits its eval config
    for a, b in zip(jax.tree.leaves(net.linen_variables()), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    old_style = jax.random.PRNGKey(3)  # raw uint32 keys too
    net = jl.nn.from_linen(nn.Dense(4), X, init_key=old_style)
    np.testing.assert_array_equal(
        np.asarray(net.linen_variables()["params"]["kernel"]),
        np.asarray(nn.Dense(4).init(old_style, X)["params"]["kernel"]),
    )


class BN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        x = nn.Dense(64, kernel_init=init)(x)
        return nn.BatchNorm(use_running_average=not train)(x)


X16 = jnp.ones((8, 16))


def trained_variables():
    v = BN().init(jax.random.key(7), X16)
    return jax.tree.map(lambda a: np.asarray(a) + 0.5, nn.unbox(v))  # values no init would make


@pytest.mark.parametrize("kind", ["pytree", "params_only", "msgpack", "orbax"])
def test_variables_from_every_source(kind, tmp_path):
    v = trained_variables()
    if kind == "pytree":
        source = v
    elif kind == "params_only":
        source = {"params": v["params"]}
    elif kind == "msgpack":
        source = tmp_path / "vars.msgpack"
        source.write_bytes(serialization.to_bytes(v))
    else:
        source = str(tmp_path / "ckpt")
        with ocp.StandardCheckpointer() as ck:
            ck.save(source, {"params": v["params"], "batch_stats": v["batch_stats"], "step": 3})
    net = jl.nn.from_linen(BN(), X16, variables=source, strict=kind not in ("params_only", "orbax"))
    got = net.linen_variables()
    np.testing.assert_array_equal(np.asarray(got["params"]["Dense_0"]["kernel"]), v["params"]["Dense_0"]["kernel"])
    if kind == "params_only":  # strict=False: batch statistics keep their init values
        np.testing.assert_array_equal(np.asarray(got["batch_stats"]["BatchNorm_0"]["mean"]), np.zeros(64))
    else:
        np.testing.assert_array_equal(
            np.asarray(got["batch_stats"]["BatchNorm_0"]["var"]), v["batch_stats"]["BatchNorm_0"]["var"]
        )
    # annotations survive the load
    assert net.Dense_0["kernel"].get_metadata().get("out_sharding") == ("embed", "mlp")


def test_variables_mismatch_lists_every_problem():
    v = trained_variables()
    v["params"]["Dense_0"]["kernel"] = np.zeros((16, 32), np.float32)
    del v["batch_stats"]["BatchNorm_0"]["var"]
    v["params"]["Extra"] = {"w": np.zeros(3, np.float32)}
    with pytest.raises(jl.nn.VariablesMismatchError) as e:
        jl.nn.from_linen(BN(), X16, variables=v)
    err = e.value
    assert err.mismatched == ["params/Dense_0/kernel: source (16, 32), target (16, 64)"]
    assert err.missing == ["batch_stats/BatchNorm_0/var"] and err.unexpected == ["params/Extra/w"]
    for line in (*err.mismatched, *err.missing, *err.unexpected):
        assert line in str(err)


class Loaded(jl.LightningModule):
    """Two ways to bring parameters: built in __init__ with variables=, or loaded in on_fit_start."""

    def __init__(self, source, eager: bool) -> None:
        super().__init__()
        self.source, self.eager = source, eager
        if eager:
            self.net = jl.nn.from_linen(BN(), X16, variables=source)

    def configure_model(self):
        if not self.eager:
            self.net = jl.nn.from_linen(BN(), X16)

    def on_fit_start(self):
        if not self.eager:
            jl.nn.load_variables(self.net, self.source)

    def training_step(self, batch, batch_idx):
        return (self.net(batch[0]) ** 2).mean()

    def configure_optimizers(self):
        return optax.sgd(0.0)  # lr 0: the trained values are the loaded ones


@pytest.mark.parametrize("eager", [True, False])
def test_loaded_variables_are_placed_on_their_shardings(eager):
    v = trained_variables()
    model = Loaded(v, eager)
    trainer = jl.Trainer(max_steps=1, devices=8, strategy=jl.strategies.FSDP(min_shard=64), **quiet())
    trainer.fit(model, [(np.ones((8, 16), np.float32),)])
    kernel = trainer.train_state.params["net/Dense_0/kernel"]
    assert kernel.sharding.spec == P("fsdp")  # embed -> fsdp, placed where its annotation says
    assert kernel.addressable_shards[0].data.shape == (2, 64)
    np.testing.assert_array_equal(np.asarray(kernel), v["params"]["Dense_0"]["kernel"])


def test_variables_in_configure_model_say_where_to_load():
    v = trained_variables()

    class InTrace(jl.LightningModule):
        def configure_model(self):
            self.net = jl.nn.from_linen(BN(), X16, variables=v)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).mean()

        def configure_optimizers(self):
            return optax.sgd(0.1)

    with pytest.raises(RuntimeError, match=r"inside a jax trace.*__init__.*load_variables\(self.net, source\)"):
        jl.Trainer(max_steps=1, devices=1, **quiet()).fit(InTrace(), [(np.ones((8, 16), np.float32),)])
