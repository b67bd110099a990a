"""from_equinox: mode switches in evaluation beyond ``inference``, and trained arrays loaded with strict checks
(issue 22, problems 5 and 6)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlight as jl

eqx = pytest.importorskip("equinox")


class Flagged(eqx.Module):
    """A model with its own training flag and a call-time ``deterministic`` switch."""

    lin: eqx.nn.Linear
    drop: eqx.nn.Dropout
    training: bool

    def __init__(self, key):
        self.lin = eqx.nn.Linear(8, 16, key=key)
        self.drop = eqx.nn.Dropout(0.5)
        self.training = True

    def __call__(self, x, deterministic: bool = False, *, key=None):
        h = self.lin(x) * (2.0 if self.training else 1.0)
        return self.drop(h, key=key, inference=deterministic)


X = jnp.ones((4, 8))


def test_eval_sets_every_mode_switch():
    model = Flagged(jax.random.key(0))
    net = jl.nn.from_equinox(model)
    assert float((net(X) == 0).mean()) > 0.2  # training: dropout on, training=True
    net.eval()
    want = jax.vmap(lambda x: eqx.tree_at(lambda m: m.training, model, False).lin(x))(X)
    np.testing.assert_allclose(np.asarray(net(X)), np.asarray(want), atol=1e-6)  # both switches at eval values
    assert net.eqx_module().training is False and net.eqx_module().drop.inference is True
    # explicit overrides: an eval model of your own, per-mode call keywords
    own = jl.nn.from_equinox(model, eval_model=lambda m: m, eval_kwargs={"deterministic": True})
    own.eval()
    np.testing.assert_allclose(np.asarray(own(X)), np.asarray(jax.vmap(model.lin)(X) * 2.0), atol=1e-6)


def test_trained_arrays_load_with_strict_checks(tmp_path):
    model = Flagged(jax.random.key(0))
    trained = Flagged(jax.random.key(1))
    net = jl.nn.from_equinox(model, variables=trained)
    np.testing.assert_array_equal(np.asarray(net.model.lin.weight.get_value()), np.asarray(trained.lin.weight))
    # a file saved from a wrapper's own naming (model/lin/weight ...) loads back
    from flax import serialization

    path = tmp_path / "eqx.msgpack"
    state = {"model": {"lin": {"weight": np.asarray(trained.lin.weight) + 1, "bias": np.asarray(trained.lin.bias)}}}
    path.write_bytes(serialization.msgpack_serialize(state))
    jl.nn.load_variables(net, path)
    np.testing.assert_array_equal(np.asarray(net.model.lin.weight.get_value()), np.asarray(trained.lin.weight) + 1)
    # mismatches are listed, nothing loaded
    with pytest.raises(jl.nn.VariablesMismatchError) as e:
        jl.nn.load_variables(net, {"model": {"lin": {"weight": np.zeros((3, 8), np.float32)}}})
    assert e.value.mismatched == ["model/lin/weight: source (3, 8), target (16, 8)"]
    assert e.value.missing == ["model/lin/bias"]
    np.testing.assert_array_equal(np.asarray(net.model.lin.weight.get_value()), np.asarray(trained.lin.weight) + 1)
