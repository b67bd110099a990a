"""Strategy pieces: composition keeps every piece and its behaviour, conflicts name both pieces,
and each hook (rules, param axes, batch dims, checks, update wrapper, trace context) reaches the step."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import ClassVar

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight.data import BatchError, BatchPlacer
from jaxlight.strategies import (
    FSDP,
    CompositionError,
    DataParallel,
    HostOffload,
    Layout,
    Piece,
    Strategy,
    TensorParallel,
    resolve_spec,
    resolve_strategy,
)
from jaxlight.strategies.placement import LayoutError
from tests.core_models import quiet
from tests.strategy_models import LM, token_batches

MESH8 = {"data": 1, "fsdp": 8, "tensor": 1, "sequence": 1, "stage": 1, "expert": 1}


# ---------------------------------------------------------------- algebra
def test_rules_mapping_composes_with_fsdp_in_either_order():
    """The issue's example: Strategy(rules={...}) + FSDP() used to raise."""
    a = Strategy(rules={"mlp": "tensor"}) + FSDP()
    b = FSDP() + Strategy(rules={"mlp": "tensor"})
    assert a.logical_rules == b.logical_rules
    assert a.logical_rules[0] == ("mlp", "tensor")
    assert a.mesh_shape(8)["fsdp"] == 8
    mesh = {**MESH8, "fsdp": 4, "tensor": 2}
    # the user's rule takes mlp (only its candidate); embed keeps its default (fsdp)
    assert resolve_spec(("embed", "mlp"), (64, 64), a.logical_rules, mesh) == ("fsdp", "tensor")


def test_host_offload_old_ema_keyword_still_works_with_a_warning():
    with pytest.warns(DeprecationWarning, match="callback_state"):
        old = HostOffload(ema=False)
    assert old == HostOffload(callback_state=False) and old.callback_state is False


def test_composition_keeps_pieces_and_their_types():
    s = FSDP(min_shard=128) + TensorParallel(2) + HostOffload(callback_state=False)
    assert [type(p) for p in s.pieces] == [FSDP, TensorParallel, HostOffload]
    assert s.find(HostOffload).callback_state is False and s.find(FSDP).min_shard == 128
    assert s.name == "fsdp+tp+offload"
    # the repr lists each piece with the settings that differ from its defaults
    assert repr(s) == "Strategy(FSDP(min_shard=128), TensorParallel(size=2), HostOffload(callback_state=False))"
    # strings give the same pieces
    assert resolve_strategy("fsdp+tp+offload").pieces == (FSDP(), TensorParallel(), HostOffload())
    # a strategy plus a strategy flattens; identical pieces appear once
    assert (s + (TensorParallel(2) + DataParallel())).pieces == (*s.pieces, DataParallel())


def test_mesh_axes_of_two_filling_pieces_do_not_depend_on_order():
    for s in (FSDP() + TensorParallel(), TensorParallel() + FSDP()):
        assert {k: v for k, v in s.mesh_shape(8).items() if v > 1} == {"fsdp": 4, "tensor": 2}


def test_conflicts_name_both_pieces():
    with pytest.raises(
        CompositionError,
        match=r"cannot compose 'fsdp' and 'tp': both give rules for logical name "
        r"'mlp' \('tensor' vs 'fsdp'\)",
    ):
        FSDP(rules={"mlp": "tensor"}) + TensorParallel(2, rules={"mlp": "fsdp"})
    # the same candidates from two pieces agree, in either order
    same = FSDP(rules={"mlp": "tensor"}) + TensorParallel(2, rules={"mlp": "tensor"})
    assert same.rule_owner("mlp") == "tp"
    with pytest.raises(CompositionError, match=r"both set mesh axis 'fsdp' \(2 vs 4\)"):
        FSDP(size=2) + Layout(axes={"fsdp": 4}, label="mine")

    @dataclasses.dataclass(frozen=True)
    class Elsewhere(Piece):
        name: ClassVar[str] = "elsewhere"

        def memory_kind(self, group, mirrors):
            return "unpinned_host" if mirrors is not None else None

    with pytest.raises(
        CompositionError,
        match=r"pieces 'offload' and 'elsewhere' give opt_state leaf net/w two "
        r"memory kinds \('pinned_host' vs 'unpinned_host'\)",
    ):
        (HostOffload() + Elsewhere()).memory_kind("opt_state", "net/w")


def test_pieces_are_values():
    assert FSDP(min_shard=16) == FSDP(min_shard=16) and hash(FSDP()) == hash(FSDP())
    s = FSDP() + TensorParallel(2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.extra = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        FSDP().size = 4


# ---------------------------------------------------------------- a new piece, end to end
_SEEN = threading.local()


@dataclasses.dataclass(frozen=True)
class SplitWidth(Piece):
    """The docs' example piece: splits dim 1 of batch leaf ``x`` over ``tensor``, marks what it traced,
    and freezes the parameters by wrapping the update (so its effect on the step is observable)."""

    name: ClassVar[str] = "splitwidth"
    freeze: bool = False

    def mesh_axes(self):
        return {"tensor": 2}

    def batch_dims(self, path, shape):
        return {1: "tensor"} if path == "x" else {}

    def check_batch(self, shapes, mesh_shape):
        if shapes["x"][1] % 4:
            raise ValueError(f"splitwidth wants widths divisible by 4, got {shapes['x']}")

    @contextlib.contextmanager
    def _ctx(self):
        _SEEN.value = True
        try:
            yield
        finally:
            _SEEN.value = False

    def trace_context(self, mesh):
        return self._ctx()

    def wrap_update(self, update, shardings):
        if not self.freeze:
            return update

        def frozen(state, grads, aux):
            return update(state, jax.tree.map(lambda g: g * 0, grads), aux)

        return frozen


class Linear(jl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.seen_context: list[bool] = []

    def configure_model(self):
        self.net = nnx.Linear(8, 1, rngs=nnx.Rngs(0))

    def training_step(self, batch, batch_idx):
        self.seen_context.append(getattr(_SEEN, "value", False))
        return ((self.net(batch["x"]) - batch["y"]) ** 2).mean()

    def configure_optimizers(self):
        return optax.sgd(0.1)


def _xy(n: int = 3, width: int = 8):
    rng = np.random.default_rng(0)
    return [
        {"x": rng.normal(size=(8, width)).astype(np.float32), "y": rng.normal(size=(8, 1)).astype(np.float32)}
        for _ in range(n)
    ]


def test_a_new_piece_splits_batches_enters_its_context_and_wraps_the_update():
    model = Linear()
    t = jl.Trainer(strategy=FSDP(size=4) + SplitWidth(freeze=True), devices=8, max_steps=3, **quiet())
    before = np.asarray(model.configure_model() or model.net.kernel[...])
    del model.net
    t.fit(model, _xy())
    assert model.seen_context == [True]  # traced once, inside the piece's context
    placed = BatchPlacer(t.mesh, strategy=t.strategy).place(_xy(1)[0])
    assert tuple(placed["x"].sharding.spec) == ("fsdp", "tensor") and tuple(placed["y"].sharding.spec) == ("fsdp",)
    # the wrapped update zeroed every gradient: SGD left the parameters where they started
    np.testing.assert_array_equal(np.asarray(model.net.kernel[...]), before)
    # without the wrapper the same run moves them
    model2 = Linear()
    jl.Trainer(strategy=FSDP(size=4) + SplitWidth(), devices=8, max_steps=3, **quiet()).fit(model2, _xy())
    assert np.abs(np.asarray(model2.net.kernel[...]) - before).max() > 1e-4


def test_a_piece_refuses_a_batch_before_compiling():
    t = jl.Trainer(strategy=FSDP(size=4) + SplitWidth(), devices=8, max_steps=3, **quiet())
    with pytest.raises(ValueError, match=r"splitwidth wants widths divisible by 4, got \(8, 6\)"):
        t.fit(Linear(), _xy(width=6))
    assert t.compile_counts["train"] == 0
    # a claimed dim the axis does not divide: the leaf, its shape and the axis size, before any step
    t = jl.Trainer(strategy=FSDP(size=4) + SplitWidth(), devices=8, max_steps=3, **quiet())
    with pytest.raises(
        BatchError,
        match=r"batch leaf x has shape \(8, 5\): dim 1 \(5\) is not divisible by mesh "
        r"axis 'tensor' = 2",
    ):
        t.fit(Linear(), _xy(width=5))
    assert t.compile_counts["train"] == 0


def test_param_axes_let_a_piece_place_parameters_on_stage():
    @dataclasses.dataclass(frozen=True)
    class Stages(Piece):
        name: ClassVar[str] = "stages"

        def mesh_axes(self):
            return {"stage": 2}

        def rules(self):
            return (("embed", "stage"),)

        def param_axes(self):
            return ("stage",)

    lm = dict(embed=32, mlp=32, vocab=32, heads=2)
    t = jl.Trainer(strategy=FSDP() + Stages(), devices=8, max_steps=1, **quiet())
    t.fit(LM(**lm), token_batches(1, 8, vocab=32))
    assert "stage" in str(t.train_state.params["net/embed/embedding"].sharding.spec)
    # the same rule without the piece's permission is refused, naming the axis
    bad = FSDP() + Layout(axes={"stage": 2}, rules={"embed": "stage"}, label="nostage")
    with pytest.raises(LayoutError, match=r"rule 'embed' -> 'stage' would place parameter"):
        jl.Trainer(strategy=bad, devices=8, max_steps=1, **quiet()).fit(LM(**lm), token_batches(1, 8, vocab=32))


def test_the_docs_piece_example_runs():
    import re
    from pathlib import Path

    from jaxlight.strategies.strategy import STRATEGY_REGISTRY

    text = (Path(__file__).resolve().parent.parent / "docs" / "strategies.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "class WidthSplit" in b)
    ns: dict = {"__name__": __name__}  # dataclasses look the defining module up in sys.modules
    try:
        exec(compile(block, "docs/strategies.md[WidthSplit]", "exec"), ns)
    finally:
        STRATEGY_REGISTRY.pop("widthsplit", None)
    assert ns["strategy"].name == "fsdp+widthsplit"
