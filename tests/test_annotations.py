"""flax's annotation conventions, and strategies that would do nothing (issue 22, problems 2-4).

- partial-rank logical annotations (flax's MultiHeadDotProductAttention kernels) leave the trailing dims whole;
- a name that is neither a logical name with a rule nor a mesh axis is refused at setup, naming the parameter,
  the name and the rule to add; a mesh axis named directly is that axis;
- every "cannot place" error names the parameter path and shape;
- a mesh axis meant for parameters that holds none is warned about, with the largest parameters and the fix.
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxlight as jl
from jaxlight.strategies import DEFAULT_RULES, FSDP, Strategy, TensorParallel, resolve_spec
from jaxlight.strategies.placement import LayoutError, PlacementWarning, axis_split_bytes, layout_summary_lines
from tests.core_models import quiet

MESH8 = {"data": 1, "fsdp": 8, "tensor": 1, "sequence": 1, "stage": 1, "expert": 1}


class Net(jl.LightningModule):
    """A LightningModule around whatever ``make()`` builds, trained on x -> sum of squares."""

    def __init__(self, make, width: int = 16) -> None:
        super().__init__()
        self.make, self.width = make, width

    def configure_model(self):
        self.net = self.make()

    def training_step(self, batch, batch_idx):
        return (self.net(batch["x"]) ** 2).mean()

    def configure_optimizers(self):
        return optax.sgd(0.1)


def run(make, strategy="auto", devices=1, width=16, rows=8, record=None):
    trainer = jl.Trainer(max_steps=1, devices=devices, strategy=strategy, **quiet())
    model = Net(make, width)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        trainer.fit(model, [{"x": np.ones((rows, width), np.float32)}])
    if record is not None:
        record.extend(w for w in rec if issubclass(w.category, PlacementWarning))
    return trainer


# ------------------------------------------------------------------------------ problem 2: partial rank
class Attention(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(nn.initializers.xavier_uniform(), ("embed", "kv"))
        return nn.MultiHeadDotProductAttention(num_heads=8, qkv_features=16, kernel_init=init, use_bias=False)(x, x)


def test_partial_rank_annotations_leave_trailing_dims_whole():
    # flax's rule, in the resolver: two names for a 3-d kernel name the first two dims
    assert resolve_spec(("embed", "kv"), (16, 8, 2), DEFAULT_RULES, MESH8) == ("fsdp",)
    assert resolve_spec(("mlp",), (16, 32), DEFAULT_RULES, {**MESH8, "fsdp": 1, "tensor": 8}) == ("tensor",)
    with pytest.raises(ValueError, match=r"name 3 dims but the array has shape \(4, 4\).*fewer names"):
        resolve_spec(("embed", "mlp", "kv"), (4, 4), DEFAULT_RULES, MESH8)

    def make():
        return jl.nn.from_linen(Attention(), jnp.ones((1, 4, 16)))

    # flax's own attention with lm1b's ('embed', 'kv') annotation trains on one device ...
    batch = [{"x": np.ones((8, 4, 16), np.float32)}]
    one = jl.Trainer(max_steps=1, devices=1, **quiet())
    one.fit(Net(make), batch)
    # ... and under FSDP the first named dim takes fsdp, the trailing ones stay whole
    t = jl.Trainer(max_steps=1, devices=8, strategy=FSDP(min_shard=64), **quiet())
    t.fit(Net(make), batch)
    params = t.train_state.params
    q = params["net/MultiHeadDotProductAttention_0/query/kernel"]  # (embed=16, heads=8, head_dim=2)
    assert q.shape == (16, 8, 2) and q.sharding.spec == P("fsdp")
    out = params["net/MultiHeadDotProductAttention_0/out/kernel"]  # (heads=8, head_dim=2, embed=16): 'embed' on 8
    assert out.sharding.spec == P("fsdp")
    lines = layout_summary_lines(params, t.engine.parts.params.variables)
    assert any("Partial-rank annotations (4" in ln and "query/kernel (16, 8, 2) ('embed', 'kv')" in ln for ln in lines)


def test_flax_rules_table_passes_as_it_is():
    # lists of (name, axis) pairs as nn.logical_axis_rules takes them: duplicates are fallbacks, None keeps whole
    table = [["embed", "fsdp"], ("mlp", "tensor"), ("mlp", "fsdp"), ("kv", None), ("vocab", ("tensor", "fsdp"))]
    s = Strategy(rules=table) + FSDP(size=4) + TensorParallel(2)
    shape = s.mesh_shape(8)
    assert resolve_spec(("embed", "mlp"), (16, 32), s.logical_rules, shape) == ("fsdp", "tensor")
    assert resolve_spec(("mlp", "embed"), (32, 16), s.logical_rules, {**shape, "tensor": 1}) == ("fsdp",)
    assert resolve_spec(("vocab", "embed"), (64, 16), s.logical_rules, shape) == (("tensor", "fsdp"),)
    # a table written for a mesh of the user's own says how to map it
    with pytest.raises(ValueError, match=r"names mesh axis 'model'.*\('mlp', 'tensor'\)"):
        Strategy(rules=[("mlp", "model")])


# ------------------------------------------------------------------------------ problem 3: user mesh axes
def model_axis_mlp():
    """flax's nnx_toy_examples style: a kernel annotated with a mesh axis of the user's own ('model')."""
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
    return nnx.Linear(16, 64, kernel_init=init, rngs=nnx.Rngs(0))


def test_an_unknown_axis_name_is_refused_at_setup_with_the_rule_to_add():
    with pytest.raises(LayoutError) as e:
        run(model_axis_mlp)  # one device: the annotation would silently do nothing
    msg = str(e.value)
    assert "'model' is neither a logical name the rules map nor a mesh axis" in msg
    assert "net/kernel (16, 64) annotated (None, 'model')" in msg
    assert "Strategy(rules=[('model', 'tensor')])" in msg
    # with the rule the annotation is honoured
    t = run(model_axis_mlp, Strategy(rules=[("model", "tensor")]) + TensorParallel(8, min_shard=128), devices=8)
    assert t.train_state.params["net/kernel"].sharding.spec == P(None, "tensor")


def test_a_mesh_axis_named_directly_is_that_axis_and_errors_name_path_and_shape():
    def direct():
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "tensor"))
        return nnx.Linear(16, 64, kernel_init=init, rngs=nnx.Rngs(0))

    t = run(direct, TensorParallel(8, min_shard=128), devices=8)
    assert t.train_state.params["net/kernel"].sharding.spec == P(None, "tensor")

    def ragged():
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "tensor"))
        return nnx.Linear(16, 60, kernel_init=init, rngs=nnx.Rngs(0))

    with pytest.raises(LayoutError, match=r"net/kernel \(16, 60\) names mesh axis 'tensor' directly for dim 1 \(60\)"):
        run(ragged, TensorParallel(8, min_shard=128), devices=8)

    def too_many():
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp", "kv"))
        return nnx.Linear(16, 64, kernel_init=init, rngs=nnx.Rngs(0))

    with pytest.raises(LayoutError, match=r"parameter net/kernel \(16, 64\): logical axes .* name 3 dims"):
        run(too_many)

    def on_data():
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("data", None))
        return nnx.Linear(16, 64, kernel_init=init, rngs=nnx.Rngs(0))

    with pytest.raises(LayoutError, match=r"net/kernel \(16, 64\) names mesh axis 'data' directly"):
        run(on_data)


def test_the_tolerance_error_tells_annotated_from_unannotated():
    def annotated_but_whole():
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("kv", "kv"))
        return nnx.Linear(64, 64, kernel_init=init, rngs=nnx.Rngs(0))

    with pytest.raises(LayoutError) as e:
        run(annotated_but_whole, FSDP(min_shard=64), devices=8, width=64)
    msg = str(e.value)
    assert "net/kernel (64, 64) annotated ('kv', 'kv')" in msg
    assert "the rules send their names to no mesh axis" in msg and "Annotate the unannotated" not in msg


# ------------------------------------------------------------------------------ problem 4: strategies doing nothing
def plain_mlp():
    class MLP(nnx.Module):
        def __init__(self):
            r = nnx.Rngs(0)
            self.l1, self.l2 = nnx.Linear(16, 64, rngs=r), nnx.Linear(64, 16, rngs=r)

        def __call__(self, x):
            return self.l2(nnx.relu(self.l1(x)))

    return MLP()


def test_an_axis_that_holds_no_parameters_is_warned_about():
    got: list = []
    # fsdp+tp on an unannotated model: fsdp shards by shape, nothing goes to tensor
    t = run(plain_mlp, FSDP(min_shard=128) + TensorParallel(2), devices=8, record=got)
    assert len(got) == 1
    msg = str(got[0].message)
    assert "mesh axis 'tensor' (size 2) holds no parameter bytes" in msg
    assert "net/l1/kernel (16, 64), net/l2/kernel (64, 16)" in msg and "nnx.with_partitioning" in msg
    split = axis_split_bytes(t.train_state.params)
    assert split == {"fsdp": 2 * 16 * 64 * 4, "tensor": 0}
    lines = layout_summary_lines(t.train_state.params)
    assert lines == ["Param bytes split per mesh axis (of 8.3 KB): fsdp 8.0 KB (96%), tensor 0 B (0%)"]
    # fsdp below min_shard: everything replicated, which the warning says with the min_shard to pass
    got.clear()
    run(plain_mlp, "fsdp", devices=8, record=got)
    assert len(got) == 1
    msg = str(got[0].message)
    assert "mesh axis 'fsdp' (size 8) holds no parameter bytes: every parameter is below min_shard=65536" in msg
    assert "FSDP(min_shard=128)" in msg
    # a layout that uses every axis warns about nothing
    got.clear()
    run(plain_mlp, FSDP(min_shard=128), devices=8, record=got)
    assert got == []
