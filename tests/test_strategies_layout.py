"""Strategy algebra, rules, the shape heuristic, the guardrail and the errors they raise (with numbers)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight.data import BatchError, data_partition
from jaxlight.strategies import (
    DEFAULT_RULES,
    FSDP,
    DataParallel,
    Piece,
    Strategy,
    TensorParallel,
    register_strategy,
    resolve_spec,
    resolve_strategy,
)
from jaxlight.strategies.placement import LayoutError, heuristic_spec
from jaxlight.strategies.strategy import STRATEGY_REGISTRY
from tests.core_models import quiet
from tests.strategy_models import LM, token_batches

MESH8 = {"data": 1, "fsdp": 8, "tensor": 1, "sequence": 1, "stage": 1, "expert": 1}


# ---------------------------------------------------------------- rules
def test_default_rules_cover_the_issue_names():
    names = {n for n, _ in DEFAULT_RULES}
    assert {"batch", "length", "embed", "mlp", "heads", "kv", "vocab", "exp"} <= names


def test_resolve_spec_falls_back_and_never_reuses_an_axis():
    fsdp_tp = {**MESH8, "fsdp": 4, "tensor": 2}
    # Megatron widths on tensor, the other dim on fsdp
    assert resolve_spec(("embed", "mlp"), (256, 512), DEFAULT_RULES, fsdp_tp) == ("fsdp", "tensor")
    assert resolve_spec(("mlp", "embed"), (512, 256), DEFAULT_RULES, fsdp_tp) == ("tensor", "fsdp")
    # pure fsdp: mlp's tensor candidate is size 1, so it falls back to fsdp when embed didn't take it
    assert resolve_spec(("mlp", "embed"), (512, 256), DEFAULT_RULES, MESH8) == ("fsdp",)
    assert resolve_spec(("embed", "mlp"), (256, 512), DEFAULT_RULES, MESH8) == ("fsdp",)
    # a dim the axis doesn't divide stays whole (then the next name gets the axis)
    assert resolve_spec(("embed", "mlp"), (12, 512), DEFAULT_RULES, MESH8) == (None, "fsdp")
    # batch rows: data and fsdp together, never tensor
    assert resolve_spec(
        ("batch", "length", "embed"), (64, 8, 256), DEFAULT_RULES, {**MESH8, "data": 2, "fsdp": 2, "tensor": 2}
    ) == (("data", "fsdp"),)
    # "kv" is explicitly whole
    assert resolve_spec(("kv",), (64,), DEFAULT_RULES, {**MESH8, "tensor": 8}) == ()


def test_user_rules_override_defaults():
    s = FSDP(rules={"embed": None})
    assert resolve_spec(("embed", "mlp"), (256, 512), s.logical_rules, MESH8) == (None, "fsdp")
    s = TensorParallel(rules=[("embed", "tensor")])
    assert resolve_spec(("embed", "mlp"), (256, 512), s.logical_rules, {**MESH8, "fsdp": 1, "tensor": 8}) == ("tensor",)
    with pytest.raises(ValueError, match="mesh axis 'model'.*mesh axes are"):
        FSDP(rules={"embed": "model"})


def test_heuristic_shards_largest_divisible_dim():
    assert heuristic_spec((300, 256), MESH8, 2**10) == (None, "fsdp")
    assert heuristic_spec((512, 256), MESH8, 2**10) == ("fsdp",)
    assert heuristic_spec((300, 300), MESH8, 2**10) == ()  # nothing divisible
    assert heuristic_spec((64, 8), MESH8, 2**10) == ()  # below min_shard


# ---------------------------------------------------------------- algebra and registry
def test_composition_and_registry():
    s = FSDP() + TensorParallel(2)
    assert s.name == "fsdp+tp"
    assert s.mesh_shape(8)["fsdp"] == 4 and s.mesh_shape(8)["tensor"] == 2 and s.mesh_shape(8)["data"] == 1
    assert (FSDP(size=2) + TensorParallel(2)).mesh_shape(8)["data"] == 2  # data fills the rest
    # a user's min_shard/tolerance survives composition with a default one, either order
    assert (FSDP(min_shard=2**20) + TensorParallel(2)).min_shard == 2**20
    assert (TensorParallel(2) + FSDP(tolerance=0.5)).tolerance == 0.5
    with pytest.raises(ValueError, match="min_shard 16 vs 32"):
        FSDP(min_shard=16) + TensorParallel(2, min_shard=32)
    with pytest.raises(ValueError, match="both set mesh axis 'tensor' \\(2 vs 4\\)"):
        TensorParallel(2) + TensorParallel(4)


@dataclasses.dataclass(frozen=True)
class _SpTest(Piece):
    name: ClassVar[str] = "sp_test"
    attention: str = "ring"

    def mesh_axes(self):
        return {"sequence": 2}


def test_later_strategies_slot_into_strings(monkeypatch):
    """A later issue's "sp" registers a factory and composes in strings like "fsdp+tp+sp"; the piece and
    its settings survive composition (the old ``options`` field became the piece's own fields)."""
    monkeypatch.setitem(STRATEGY_REGISTRY, "sp_test", _SpTest)
    s = resolve_strategy("fsdp+tp+sp_test")
    assert s.name == "fsdp+tp+sp_test" and s.find(_SpTest).attention == "ring"
    assert {k: v for k, v in s.mesh_shape(8).items() if v > 1} == {"fsdp": 2, "tensor": 2, "sequence": 2}
    register_strategy("sp_test2", lambda: Strategy(axes={"sequence": 2}, name="sp_test2"))
    try:
        assert resolve_strategy("ddp+sp_test2").mesh_shape(8)["data"] == 4
    finally:
        STRATEGY_REGISTRY.pop("sp_test2")


def test_unknown_strategy_string_lists_valid_names():
    with pytest.raises(ValueError) as e:
        jl.Trainer(strategy="fsdp+zero3", **quiet())
    msg = str(e.value)
    assert "'zero3'" in msg and all(repr(n) in msg for n in ("auto", "ddp", "fsdp", "tp"))


# ---------------------------------------------------------------- mesh / device errors
def test_axis_sizes_must_divide_device_count():
    with pytest.raises(ValueError, match=r"product 3 does not divide the device count 8"):
        jl.Trainer(strategy=TensorParallel(3), devices=8, **quiet())
    with pytest.raises(ValueError, match=r"product 16 does not divide the device count 8"):
        jl.Trainer(strategy=FSDP(size=4) + TensorParallel(4), devices=8, **quiet())


def test_more_devices_than_exist():
    with pytest.raises(jl.MisconfigurationError, match=r"devices=16 requested but only 8"):
        jl.Trainer(strategy="ddp", devices=16, **quiet())


def test_mesh_has_six_named_auto_axes():
    t = jl.Trainer(strategy="fsdp+tp", devices=8, **quiet())
    assert t.mesh.axis_names == ("data", "fsdp", "tensor", "sequence", "stage", "expert")
    assert dict(t.mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 2, "sequence": 1, "stage": 1, "expert": 1}
    assert all(str(a).endswith("Auto") for a in t.mesh.axis_types)
    t = jl.Trainer(strategy=DataParallel(), devices=4, **quiet())
    assert t.mesh.shape["data"] == 4 and t.mesh.size == 4


# ---------------------------------------------------------------- batch errors
def test_global_batch_not_divisible_by_batch_axes():
    trainer = jl.Trainer(strategy=FSDP(size=4) + TensorParallel(2), devices=8, max_steps=1, **quiet())
    with pytest.raises(BatchError, match=r"global batch 6 .*not divisible by the batch axes data\*fsdp\*expert = 4"):
        trainer.fit(LM(embed=32, mlp=32, vocab=32, heads=2), token_batches(1, 6, vocab=32))


def test_batch_rows_split_over_batch_axes_never_tensor():
    from jaxlight.data import BatchPlacer

    t = jl.Trainer(strategy=FSDP(size=2) + TensorParallel(2), devices=8, **quiet())  # data=2 fsdp=2 tensor=2
    placed = BatchPlacer(t.mesh).place({"tokens": np.arange(8 * 3).reshape(8, 3)})["tokens"]
    assert placed.sharding.spec[0] == ("data", "fsdp")
    rows = {d: s.data.shape[0] for d, s in zip(range(8), placed.addressable_shards)}
    assert set(rows.values()) == {2}  # 8 rows over data*fsdp = 4, replicated over tensor
    assert data_partition(t.mesh) == (0, 1, 1, 0)


# ---------------------------------------------------------------- forbidden axes, guardrail
@pytest.mark.parametrize("axis", ["data", "sequence"])
def test_rule_putting_a_parameter_on_a_batch_axis_is_refused(axis):
    trainer = jl.Trainer(strategy=FSDP(rules={"mlp": axis}), devices=8, max_steps=1, **quiet())
    with pytest.raises(
        LayoutError,
        match=rf"rule 'mlp' -> '{axis}' would place parameter net/blocks/0/\S+ "
        rf"\(32, 32\) \(logical axes \('mlp', 'embed'\)\).*may not use",
    ):
        trainer.fit(LM(embed=32, mlp=32, vocab=32, heads=2), token_batches(1, 8, vocab=32))


class Unannotated(jl.LightningModule):
    def __init__(self, width: int, n: int = 3) -> None:
        super().__init__()
        self.width, self.n = width, n

    def configure_model(self):
        rngs = nnx.Rngs(0)
        self.layers = nnx.List([nnx.Linear(self.width, self.width, rngs=rngs) for _ in range(self.n)])

    def training_step(self, batch, batch_idx):
        x = batch["x"]
        for layer in self.layers:
            x = layer(x)
        return (x**2).mean()

    def configure_optimizers(self):
        return optax.sgd(0.1)


def test_tolerance_check_lists_replicated_parameters():
    # 300 is not divisible by 8: the heuristic can shard none of the kernels
    trainer = jl.Trainer(strategy=FSDP(min_shard=1000), devices=8, max_steps=1, **quiet())
    with pytest.raises(LayoutError) as e:
        trainer.fit(Unannotated(300), [{"x": np.ones((8, 300), np.float32)}])
    msg = str(e.value)
    assert "leaves 100.0% of the shardable parameter elements replicated (tolerance 2.0%, min_shard 1000)" in msg
    for i in range(3):
        assert f"layers/{i}/kernel (300, 300)" in msg
    assert "bias" not in msg  # 300 elements: below min_shard, replicated on purpose


def test_heuristic_places_unannotated_params_and_small_ones_stay_replicated():
    trainer = jl.Trainer(strategy=FSDP(min_shard=1000), devices=8, max_steps=1, **quiet())
    model = Unannotated(64)
    trainer.fit(model, [{"x": np.ones((8, 64), np.float32)}])
    p = trainer.train_state.params
    assert tuple(p["layers/0/kernel"].sharding.spec) == (None, "fsdp")  # ties: the later dim
    assert p["layers/0/kernel"].addressable_shards[0].data.shape == (64, 8)
    assert p["layers/0/bias"].sharding.is_fully_replicated  # 64 < min_shard


def test_tolerance_is_the_threshold_and_tp_does_not_guess():
    data64 = [{"x": np.ones((8, 64), np.float32)}]
    # tensor parallelism never guesses a split: unannotated weights stay whole, and the guardrail says so
    with pytest.raises(LayoutError, match=r"'tp' on mesh \{tensor=8\} leaves 100.0%"):
        jl.Trainer(strategy=TensorParallel(8, min_shard=1000), devices=8, max_steps=1, **quiet()).fit(
            Unannotated(64), data64
        )
    # raising the tolerance accepts the same unshardable layout (replicated, as the user asked)
    ok = jl.Trainer(strategy=FSDP(min_shard=1000, tolerance=1.0), devices=8, max_steps=1, **quiet())
    ok.fit(Unannotated(300), [{"x": np.ones((8, 300), np.float32)}])
    assert ok.train_state.params["layers/0/kernel"].sharding.is_fully_replicated


def test_constrain_pins_activations_inside_the_rules_context():
    import jax
    import jax.numpy as jnp

    t = jl.Trainer(strategy=FSDP(size=4) + TensorParallel(2), devices=8, **quiet())
    x = jnp.ones((8, 4, 6))
    f = jax.jit(lambda a: jl.nn.constrain(a * 2, ("batch", "length", "mlp")))
    assert len(f(x).sharding.device_set) == 1  # outside a trainer's context: left as it is
    with jax.set_mesh(t.mesh), jl.nn.axis_rules(t.mesh, t.strategy.logical_rules):
        y = jax.jit(lambda a: jl.nn.constrain(a * 2, ("batch", "length", "mlp")))(x)
    assert tuple(y.sharding.spec) == ("fsdp", None, "tensor")
    assert y.addressable_shards[0].data.shape == (2, 4, 3)
