"""Existing parameters into NNX modules: an in-memory state, a flax msgpack file or an orbax checkpoint, each
leaf placed onto the sharding the trainer gave it (issue 22, problem 6)."""

from __future__ import annotations

import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx, serialization
from jax.sharding import PartitionSpec as P

import jaxlight as jl
from tests.core_models import quiet


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(16, 64, rngs=rngs), nnx.Linear(64, 16, rngs=rngs)])
        self.rngs = rngs  # RNG state is never loaded

    def __call__(self, x):
        return self.layers[1](nnx.relu(self.layers[0](x)))


def trained() -> dict:
    return nnx.state(MLP(nnx.Rngs(5)), nnx.Param).to_pure_dict()


def test_nnx_sources_in_memory_and_msgpack(tmp_path):
    want = trained()
    m = MLP(nnx.Rngs(0))
    jl.nn.load_variables(m, MLP(nnx.Rngs(5)))  # another module of the same structure
    np.testing.assert_array_equal(np.asarray(m.layers[0].kernel.get_value()), want["layers"][0]["kernel"])
    path = tmp_path / "state.msgpack"
    blob = serialization.to_state_dict({"model": want, "step": 7})
    path.write_bytes(serialization.msgpack_serialize(blob))
    m = MLP(nnx.Rngs(0))
    with pytest.raises(jl.nn.VariablesMismatchError, match="select='params'"):
        jl.nn.load_variables(m, path)  # the file holds more than the model: say how to pick the sub-tree
    jl.nn.load_variables(m, path, select="model")
    np.testing.assert_array_equal(np.asarray(m.layers[1].bias.get_value()), want["layers"][1]["bias"])
    # a LightningModule: its NNX attributes by name
    holder = jl.LightningModule()
    holder.net = MLP(nnx.Rngs(0))
    assert jl.nn.load_variables(holder, {"net": path}, select="model") == ([], [])
    np.testing.assert_array_equal(np.asarray(holder.net.layers[0].kernel.get_value()), want["layers"][0]["kernel"])


class Loading(jl.LightningModule):
    def __init__(self, source) -> None:
        super().__init__()
        self.source = source

    def configure_model(self):
        self.net = MLP(nnx.Rngs(0))

    def on_fit_start(self):
        jl.nn.load_variables(self.net, self.source)  # after placement: each leaf straight onto its sharding

    def training_step(self, batch, batch_idx):
        return (self.net(batch[0]) ** 2).mean()

    def configure_optimizers(self):
        return optax.sgd(0.0)


def test_orbax_checkpoint_restored_onto_the_trainers_shardings(tmp_path):
    want = trained()
    path = str(tmp_path / "ckpt")
    with ocp.StandardCheckpointer() as ck:
        ck.save(path, want)
    trainer = jl.Trainer(max_steps=1, devices=8, strategy=jl.strategies.FSDP(min_shard=128), **quiet())
    trainer.fit(Loading(path), [(np.ones((8, 16), np.float32),)])
    k = trainer.train_state.params["net/layers/0/kernel"]
    assert k.sharding.spec == P(None, "fsdp") and k.addressable_shards[0].data.shape == (16, 8)
    np.testing.assert_array_equal(np.asarray(k), want["layers"][0]["kernel"])
    np.testing.assert_array_equal(
        np.asarray(trainer.train_state.params["net/layers/1/bias"]), want["layers"][1]["bias"]
    )
