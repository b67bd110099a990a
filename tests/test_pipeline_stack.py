"""jaxlight.nn.LayerStack on its own (no pipeline): stacked variables with a "layers" logical axis,
a forward pass and gradients equal to applying the layers one by one (with every remat policy),
one traced layer body whatever the depth, RNG streams and batch statistics carried per layer,
placement by the rules, and the errors. Tolerance: 1e-6 (same ops, one device)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight.state import split_models
from jaxlight.strategies import FSDP, TensorParallel, resolve_strategy
from jaxlight.strategies.placement import param_specs
from tests.strategy_models import Block

TOL = 1e-6


class Plain(nnx.Module):
    """One annotated kernel, one unannotated parameter."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
        self.w = nnx.Param(init(rngs.params(), (8, 8)))
        self.scale = nnx.Param(jax.random.uniform(rngs.params(), (8,)) + 0.5)

    def __call__(self, x):
        return x + jnp.tanh(x @ self.w[...]) * self.scale[...]


class Noisy(nnx.Module):
    """Dropout and batch statistics: non-parameter state in every layer."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(8, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(jnp.tanh(self.bn(self.lin(x))))


def _stack(make, n, remat=None, **rngs):
    with nnx.use_eager_sharding(False):
        return jl.nn.LayerStack(make, n, rngs=nnx.Rngs(0, **rngs), remat=remat)


def _layers_one_by_one(stack: jl.nn.LayerStack):
    """The stack's layers as separate modules (slices of its state), to apply in a Python loop."""
    graphdef, state = nnx.split(stack.layers)
    return [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state)) for i in range(stack.num_layers)]


def _x(shape=(6, 8), seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


# ---------------------------------------------------------------- variables
def test_variables_are_stacked_with_a_layers_axis():
    stack = _stack(Plain, 3)
    parts, params, _ = split_models({"s": stack})
    assert params.keys() == {"s/layers/w", "s/layers/scale"}
    assert params["s/layers/w"].shape == (3, 8, 8) and params["s/layers/scale"].shape == (3, 8)
    names = {k: jl.state.logical_axes(v) for k, v in parts.params.variables.items()}
    assert names == {"s/layers/w": ("layers", "embed", "mlp"), "s/layers/scale": ("layers", None)}
    w = np.asarray(params["s/layers/w"])
    assert not np.allclose(w[0], w[1]) and not np.allclose(w[1], w[2])  # per-layer RNG streams


def test_rng_streams_and_batch_stats_are_stacked_too():
    stack = _stack(Noisy, 4, dropout=1)
    parts, _, rest = split_models({"s": stack})
    assert {k: v.shape for k, v in rest.items()} == {
        "s/layers/bn/mean": (4, 8),
        "s/layers/bn/var": (4, 8),
        "s/layers/drop/rngs/count": (4,),
        "s/layers/drop/rngs/key": (4,),
    }
    for k, v in parts.rest.variables.items():
        assert jl.state.logical_axes(v)[0] == "layers", k
    keys = np.asarray(jax.random.key_data(rest["s/layers/drop/rngs/key"]))
    assert len({tuple(k) for k in keys}) == 4  # each layer its own dropout stream


# ---------------------------------------------------------------- forward and gradients
@pytest.mark.parametrize(
    "remat", [None, "full", "dots_saveable", jax.checkpoint_policies.save_anything_except_these_names("x")]
)
def test_forward_and_gradients_equal_the_layers_one_by_one(remat):
    stack = _stack(Plain, 3, remat=remat)
    gd_stack, st_stack = nnx.split(stack)
    gd_loop, st_loop = nnx.split(nnx.List(_layers_one_by_one(stack)))
    x = _x()

    def run_stack(st, x):
        return nnx.merge(gd_stack, st)(x)

    def run_loop(st, x):
        for layer in nnx.merge(gd_loop, st):
            x = layer(x)
        return x

    def grads(run, st):
        return jax.jit(jax.grad(lambda st: jnp.mean(run(st, x) ** 2)))(st)

    np.testing.assert_allclose(jax.jit(run_stack)(st_stack, x), jax.jit(run_loop)(st_loop, x), atol=TOL, rtol=0)
    flat_s = dict(nnx.to_flat_state(grads(run_stack, st_stack)))
    flat_l = dict(nnx.to_flat_state(grads(run_loop, st_loop)))
    assert len(flat_s) == 2
    for path, g in flat_s.items():
        per_layer = np.stack([np.asarray(flat_l[(i, *path[1:])][...]) for i in range(3)])
        np.testing.assert_allclose(np.asarray(g[...]), per_layer, atol=TOL, rtol=0, err_msg=str(path))
    assert max(float(jnp.abs(g[...]).max()) for g in flat_s.values()) > 1e-3
    # the policy is really applied: the backward pass holds a rematerialised body only when asked
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda st: jnp.mean(run_stack(st, x) ** 2)))(st_stack))
    assert ("checkpoint" in jaxpr or "remat" in jaxpr) == (remat is not None)


def test_one_traced_layer_body_whatever_the_depth():
    """The program is a scan over the layers: its size does not grow with depth."""

    def eqns(n):
        stack = _stack(Plain, n)
        graphdef, state = nnx.split(stack)
        jaxpr = jax.make_jaxpr(lambda st, x: nnx.merge(graphdef, st)(x))(state, _x())
        scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
        assert len(scans) == 1 and scans[0].params["length"] == n
        return len(str(jaxpr).splitlines())

    assert eqns(2) == eqns(16)


def test_dropout_and_batch_stats_advance_per_layer_as_one_by_one():
    stack = _stack(Noisy, 3, dropout=1)
    layers = _layers_one_by_one(stack)
    x = _x()
    y_ref = x
    for layer in layers:
        y_ref = layer(y_ref)
    y = stack(x)
    np.testing.assert_allclose(y, y_ref, atol=TOL, rtol=0)
    _, _, rest = split_models({"s": stack})
    np.testing.assert_array_equal(np.asarray(rest["s/layers/drop/rngs/count"]), [1, 1, 1])
    for name in ("mean", "var"):
        want = np.stack([np.asarray(getattr(layer.bn, name)[...]) for layer in layers])
        np.testing.assert_allclose(np.asarray(rest[f"s/layers/bn/{name}"]), want, atol=TOL, rtol=0)
    # a second call draws new masks (the stream advanced) ...
    assert float(jnp.abs(stack(x) - y).max()) > 1e-3
    # ... and eval mode is deterministic
    stack.eval()
    np.testing.assert_array_equal(stack(x), stack(x))


# ---------------------------------------------------------------- placement
def test_rules_place_the_layers_dim_and_the_rest_as_before():
    stack = _stack(lambda r: Block(64, 4, 128, r), 8)
    parts, params, _ = split_models({"s": stack})
    kernel = "s/layers/up/kernel"  # ("layers", "embed", "mlp"): 8 x 64 x 128
    for strategy, want in [
        (FSDP(), (None, "fsdp")),  # layers dim whole, embed on fsdp
        (TensorParallel(), (None, None, "tensor")),
        ("pp", ("stage",)),
        ("pp+tp", ("stage", None, "tensor")),
        (resolve_strategy("pp") + FSDP(min_shard=2**17), ("stage",)),  # small: only the axis the pipeline requires
    ]:
        s = resolve_strategy(strategy)
        mesh = s.build_mesh(jax.devices())
        specs = param_specs(params, parts.params.variables, s, mesh)
        assert specs[kernel] == want, (strategy, specs[kernel])


# ---------------------------------------------------------------- errors
def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="num_layers must be a positive int, got 0"):
        _stack(Plain, 0)
    with pytest.raises(ValueError, match="unknown remat policy 'everything'"):
        _stack(Plain, 2, remat="everything")
    with pytest.raises(TypeError, match="make_layer must return an nnx.Module, got int"):
        _stack(lambda r: 3, 2)
    with pytest.raises(TypeError, match="rngs must be an nnx.Rngs"):
        jl.nn.LayerStack(Plain, 2, rngs=0)


def test_a_layer_that_changes_the_shape_is_refused():
    class Wide(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(8, 4, rngs=rngs)

        def __call__(self, x):
            return self.lin(x)

    stack = _stack(Wide, 2)
    with pytest.raises(TypeError, match=r"must return an array of its input's shape and dtype \(6, 8\) float32"):
        stack(_x())
