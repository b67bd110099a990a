"""Every form in which flax code writes a sharding annotation is read the same way (issue: code written
elsewhere, flax's own sharding annotations, item 2).

The forms: a tuple, a list or a ``jax.P`` (``jax.sharding.PartitionSpec``) given to
``nnx.with_partitioning``; the ``out_sharding`` metadata (``kernel_metadata=``) and flax's deprecated
``sharding`` / ``sharding_names`` keys, which flax 0.12 renames to ``out_sharding``; Linen's
``nn.with_logical_partitioning`` / ``nn.with_partitioning`` and the ``nn.LogicallyPartitioned`` /
``nn.Partitioned`` boxes (through ``jl.nn.from_linen``); partial rank (fewer names than dims: the trailing
dims stay whole) and a dim split over several mesh axes (``P(("fsdp", "tensor"))``).

For each form, a two-layer model (one kernel annotated with mesh axes, one with logical names) under
``"fsdp+tp"`` on 8 devices (fsdp=4 x tensor=2): every placed kernel has the spec of the tuple form, which is
the spec the names say, and 3 SGD steps give the parameters of one device within 1e-5 (absolute; 8
devices reduce in another order than one, float32).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxlight as jl
from jaxlight.state import logical_axes
from tests.helpers import host_params, quiet

TOL = 1e-5
W = 256  # 256 * 256 = 65536 = the default min_shard: both kernels are large enough to shard
STEPS = 3
MESH_NAMES = ("fsdp", "tensor")  # layer 1: mesh axes named directly
LOGICAL_NAMES = ("mlp", "embed")  # layer 2: logical names, through the rules (mlp -> tensor, embed -> fsdp)
EXPECTED = {"l1": P("fsdp", "tensor"), "l2": P("tensor", "fsdp")}


class Net(jl.LightningModule):
    """Whatever ``make()`` builds, trained to map x to 0 with SGD."""

    def __init__(self, make: Callable[[], Any]) -> None:
        super().__init__()
        self.make = make

    def configure_model(self) -> None:
        self.net = self.make()

    def training_step(self, batch, batch_idx):
        return (self.net(batch["x"]) ** 2).mean()

    def configure_optimizers(self):
        return optax.sgd(0.5)


def batches() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal((16, W)).astype(np.float32)} for _ in range(STEPS)]


def fit(make: Callable[[], Any], strategy: Any = "auto", devices: int = 1) -> jl.Trainer:
    trainer = jl.Trainer(max_steps=STEPS, devices=devices, strategy=strategy, **quiet())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # flax's own for the 'sharding' keys
        trainer.fit(Net(make), batches())
    return trainer


def kernel_specs(trainer: jl.Trainer, paths: dict[str, str]) -> dict[str, P]:
    return {k: trainer.train_state.params[p].sharding.spec for k, p in paths.items()}


def assert_same_params(got: jl.Trainer, want: dict[str, np.ndarray]) -> None:
    params = host_params(got)
    assert params.keys() == want.keys()
    for k, v in want.items():
        np.testing.assert_allclose(params[k], v, atol=TOL, rtol=0, err_msg=k)


# ------------------------------------------------------------------------------------------------ NNX
INIT = nnx.initializers.lecun_normal()

NNX_FORMS: dict[str, Callable[[tuple], dict[str, Any]]] = {
    "tuple": lambda names: {"kernel_init": nnx.with_partitioning(INIT, tuple(names))},
    "list": lambda names: {"kernel_init": nnx.with_partitioning(INIT, list(names))},
    "PartitionSpec": lambda names: {"kernel_init": nnx.with_partitioning(INIT, jax.P(*names))},
    "out_sharding": lambda names: {"kernel_init": INIT, "kernel_metadata": {"out_sharding": jax.P(*names)}},
    "sharding": lambda names: {"kernel_init": INIT, "kernel_metadata": {"sharding": jax.P(*names)}},
    "sharding_names": lambda names: {"kernel_init": INIT, "kernel_metadata": {"sharding_names": tuple(names)}},
}


class TwoLayers(nnx.Module):
    def __init__(self, form: Callable[[tuple], dict[str, Any]], names1: Any, names2: Any) -> None:
        rngs = nnx.Rngs(0)
        self.l1 = nnx.Linear(W, W, rngs=rngs, **form(names1))
        self.l2 = nnx.Linear(W, W, rngs=rngs, **form(names2))

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


NNX_PATHS = {"l1": "net/l1/kernel", "l2": "net/l2/kernel"}


@pytest.fixture(scope="module")
def nnx_reference() -> dict[str, np.ndarray]:
    """One device: the parameters every form must reach (annotations change placement, never values)."""
    return host_params(fit(lambda: TwoLayers(NNX_FORMS["tuple"], MESH_NAMES, LOGICAL_NAMES)))


@pytest.mark.parametrize("form", list(NNX_FORMS))
def test_nnx_annotation_forms_place_and_train_alike(form, nnx_reference):
    with warnings.catch_warnings(), nnx.use_eager_sharding(False):  # built outside the trainer: no mesh
        warnings.simplefilter("ignore", DeprecationWarning)
        probe = TwoLayers(NNX_FORMS[form], MESH_NAMES, LOGICAL_NAMES)
    assert logical_axes(probe.l1.kernel) == MESH_NAMES and logical_axes(probe.l2.kernel) == LOGICAL_NAMES
    t = fit(lambda: TwoLayers(NNX_FORMS[form], MESH_NAMES, LOGICAL_NAMES), "fsdp+tp", 8)
    assert kernel_specs(t, NNX_PATHS) == EXPECTED
    assert_same_params(t, nnx_reference)


@pytest.mark.parametrize(
    "names1, names2, expected",
    [
        # partial rank: fewer names than dims name the leading dims, the trailing ones stay whole (as JAX does)
        (("tensor",), ("embed",), {"l1": P("tensor"), "l2": P("fsdp")}),
        # one dim split over two mesh axes, as JAX writes it
        (
            (("fsdp", "tensor"), None),
            (None, ("fsdp", "tensor")),
            {"l1": P(("fsdp", "tensor")), "l2": P(None, ("fsdp", "tensor"))},
        ),
    ],
    ids=["partial-rank", "two-axes-per-dim"],
)
@pytest.mark.parametrize("form", ["tuple", "list", "PartitionSpec", "out_sharding"])
def test_partial_rank_and_multi_axis_dims_read_alike(form, names1, names2, expected, nnx_reference):
    t = fit(lambda: TwoLayers(NNX_FORMS[form], names1, names2), "fsdp+tp", 8)
    assert kernel_specs(t, NNX_PATHS) == expected
    assert_same_params(t, nnx_reference)


# ----------------------------------------------------------------------------------------------- Linen
LINEN_INIT = nn.initializers.lecun_normal()


def _boxed(box: type, names: Any) -> Callable:
    """A kernel initializer returning flax's annotation box itself, as code predating the helpers writes."""

    def init(key, shape, dtype=jnp.float32):
        return box(LINEN_INIT(key, shape, dtype), names)

    return init


# (init for the mesh-axis-annotated kernel, init for the logical-name-annotated kernel)
LINEN_FORMS: dict[str, Callable[[], tuple[Callable, Callable]]] = {
    "tuple": lambda: (
        nn.with_partitioning(LINEN_INIT, MESH_NAMES),
        nn.with_logical_partitioning(LINEN_INIT, LOGICAL_NAMES),
    ),
    "list": lambda: (
        nn.with_partitioning(LINEN_INIT, list(MESH_NAMES)),
        nn.with_logical_partitioning(LINEN_INIT, list(LOGICAL_NAMES)),
    ),
    "PartitionSpec": lambda: (
        nn.with_partitioning(LINEN_INIT, jax.P(*MESH_NAMES)),
        nn.with_logical_partitioning(LINEN_INIT, jax.P(*LOGICAL_NAMES)),
    ),
    "boxes": lambda: (_boxed(nn.Partitioned, jax.P(*MESH_NAMES)), _boxed(nn.LogicallyPartitioned, LOGICAL_NAMES)),
}


class LinenTwoLayers(nn.Module):
    form: str

    @nn.compact
    def __call__(self, x):
        init1, init2 = LINEN_FORMS[self.form]()
        x = nn.relu(nn.Dense(W, kernel_init=init1)(x))
        return nn.Dense(W, kernel_init=init2)(x)


LINEN_PATHS = {"l1": "net/Dense_0/kernel", "l2": "net/Dense_1/kernel"}


def linen_model(form: str) -> jl.nn.LinenModule:
    return jl.nn.from_linen(LinenTwoLayers(form), jnp.ones((1, W)))


@pytest.fixture(scope="module")
def linen_reference() -> dict[str, np.ndarray]:
    return host_params(fit(lambda: linen_model("tuple")))


@pytest.mark.parametrize("form", list(LINEN_FORMS))
def test_linen_annotation_forms_place_and_train_alike(form, linen_reference):
    t = fit(lambda: linen_model(form), "fsdp+tp", 8)
    assert kernel_specs(t, LINEN_PATHS) == EXPECTED
    assert_same_params(t, linen_reference)
