"""Placement messages give the true reason per parameter (issue: code written elsewhere, flax's own sharding
annotations, item 3): below ``min_shard`` (its size and the threshold, and the piece call that lowers it),
no rule sends the annotation's names to the axis (the rule to add), or not annotated (the annotation to write).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxlight as jl
from jaxlight.strategies import FSDP, TensorParallel
from jaxlight.strategies.placement import LayoutError, PlacementWarning
from tests.helpers import quiet

INIT = nnx.initializers.lecun_normal()


class Net(jl.LightningModule):
    def __init__(self, make: Callable[[], Any]) -> None:
        super().__init__()
        self.make = make

    def configure_model(self) -> None:
        self.net = self.make()

    def training_step(self, batch, batch_idx):
        return (self.net(batch["x"]) ** 2).mean()

    def configure_optimizers(self):
        return optax.sgd(0.1)


def tensor_warning(make: Callable[[], Any], strategy: Any, width: int) -> str:
    """The text of the one PlacementWarning about the tensor axis when ``make()`` is placed on 8 devices."""
    trainer = jl.Trainer(max_steps=1, devices=8, strategy=strategy, **quiet())
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        trainer.fit(Net(make), [{"x": np.ones((8, width), np.float32)}])
    msgs = [str(w.message) for w in rec if issubclass(w.category, PlacementWarning) and "'tensor'" in str(w.message)]
    assert len(msgs) == 1, msgs
    assert "mesh axis 'tensor' (size 2) holds no parameter bytes" in msgs[0]
    return msgs[0]


class Attention(nnx.Module):
    """Small attention projections annotated for tensor parallelism (4096 elements each, below the
    default min_shard=65536): one names the mesh axis itself, one a logical name the rules send to tensor."""

    def __init__(self) -> None:
        r = nnx.Rngs(0)
        self.q = nnx.Linear(64, 64, use_bias=False, kernel_init=nnx.with_partitioning(INIT, (None, "tensor")), rngs=r)
        self.o = nnx.Linear(64, 64, use_bias=False, kernel_init=nnx.with_partitioning(INIT, ("heads", "embed")), rngs=r)

    def __call__(self, x):
        return self.o(self.q(x))


def test_small_annotated_kernels_are_said_to_be_below_min_shard():
    msg = tensor_warning(Attention, "fsdp+tp", 64)
    assert "net/q/kernel (64, 64): annotated (None, 'tensor'), below min_shard (4096 elements < min_shard=65536" in msg
    assert (
        "net/o/kernel (64, 64): annotated ('heads', 'embed'), below min_shard (4096 elements < min_shard=65536" in msg
    )
    assert "TensorParallel(2, min_shard=4096)" in msg
    # not the old, wrong reasons
    assert "unannotated" not in msg and "not annotated" not in msg and "do not send" not in msg
    assert "no rule sends" not in msg
    # a piece that sets the threshold is the one to change (pieces that set it must agree)
    msg = tensor_warning(Attention, FSDP(min_shard=2**15) + TensorParallel(2), 64)
    assert "(4096 elements < min_shard=32768" in msg and "FSDP(min_shard=4096)" in msg
    # and with that threshold the kernels are placed: nothing to warn about
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlacementWarning)
        t = jl.Trainer(max_steps=1, devices=8, strategy=FSDP(min_shard=4096) + TensorParallel(2), **quiet())
        t.fit(Net(Attention), [{"x": np.ones((8, 64), np.float32)}])
    assert t.train_state.params["net/q/kernel"].sharding.spec == P(None, "tensor")


def test_an_unannotated_kernel_is_said_to_be_unannotated():
    def plain():
        return nnx.Linear(256, 256, use_bias=False, rngs=nnx.Rngs(0))

    msg = tensor_warning(plain, "fsdp+tp", 256)
    assert "net/kernel (256, 256): not annotated (tensor never guesses a split)" in msg
    assert "nnx.with_partitioning(init, ('embed', 'mlp'))" in msg
    assert "min_shard" not in msg and "no rule sends" not in msg


def test_names_no_rule_sends_to_the_axis_are_said_to_be_so():
    def kv():
        init = nnx.with_partitioning(INIT, ("embed", "kv"))  # embed -> fsdp, kv -> whole: nothing for tensor
        return nnx.Linear(256, 256, use_bias=False, kernel_init=init, rngs=nnx.Rngs(0))

    msg = tensor_warning(kv, "fsdp+tp", 256)
    assert "net/kernel (256, 256): annotated ('embed', 'kv'), and no rule sends 'embed', 'kv' to 'tensor'" in msg
    assert "Strategy(rules=[('kv', 'tensor')])" in msg
    assert "not annotated" not in msg and "below min_shard" not in msg


def test_the_tolerance_error_gives_each_parameters_reason():
    def whole():
        init = nnx.with_partitioning(INIT, ("kv", "kv"))
        return nnx.Linear(64, 64, use_bias=False, kernel_init=init, rngs=nnx.Rngs(0))

    with pytest.raises(LayoutError) as e:
        jl.Trainer(max_steps=1, devices=8, strategy=FSDP(min_shard=64), **quiet()).fit(
            Net(whole), [{"x": np.ones((8, 64), np.float32)}]
        )
    msg = str(e.value)
    assert (
        "net/kernel (64, 64) annotated ('kv', 'kv') -- fsdp: annotated ('kv', 'kv'), and no rule sends 'kv' to 'fsdp'"
        in msg
    )

    def ragged():
        return nnx.Linear(60, 60, use_bias=False, rngs=nnx.Rngs(0))

    with pytest.raises(LayoutError) as e:
        jl.Trainer(max_steps=1, devices=8, strategy=FSDP(min_shard=64), **quiet()).fit(
            Net(ragged), [{"x": np.ones((8, 60), np.float32)}]
        )
    assert "net/kernel (60, 60) -- fsdp: not annotated, and fsdp (size 8) divides none of its dims" in str(e.value)
