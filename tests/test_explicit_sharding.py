"""Models written for JAX's explicit-sharding mode (issue item 1): ``out_sharding=P(...)`` on einsums and
gathers, ``jax.sharding.reshard`` and ``nnx.with_partitioning(init, P('fsdp', 'tensor'))`` kernels
(tests/explicit_models.py, written the way flax's NNX Gemma example writes its layers) train under every
strategy equal to one device within 1e-5 after 3 SGD steps (the trainer traces such a model's steps under
the mesh's Explicit twin, jaxlight/explicit.py); forms it cannot run raise a jaxlight error saying what to
write instead.
"""

from __future__ import annotations

import numpy as np
import pytest
from jax import P

import jaxlight as jl
from jaxlight.explicit import ExplicitShardingError
from jaxlight.strategies import FSDP, TensorParallel
from tests.core_models import quiet
from tests.explicit_models import ExplicitLM, ShardingConfig, token_batches
from tests.strategy_models import flat_params

TOL = 1e-5
CONFIGS = {
    "single": ("auto", 1),
    "ddp": ("ddp", 8),
    "fsdp": (FSDP(min_shard=64), 8),  # min_shard: the toy kernels shard (512 elements each)
    "fsdp+tp": (FSDP(min_shard=64) + TensorParallel(2, min_shard=64), 8),  # fsdp=4 x tensor=2
    "tp": (TensorParallel(min_shard=64), 8),
}


def _fit(strategy, devices, **kw):
    model = ExplicitLM(**kw)
    trainer = jl.Trainer(max_epochs=1, devices=devices, strategy=strategy, **quiet())
    trainer.fit(model, token_batches())
    return trainer, model


@pytest.fixture(scope="module")
def runs():
    return {name: _fit(strategy, devices) for name, (strategy, devices) in CONFIGS.items()}


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "single"])
def test_explicit_sharding_matches_single_device(runs, name):
    ref, got = flat_params(runs["single"][1]), flat_params(runs[name][1])
    assert ref.keys() == got.keys()
    worst = max(float(np.abs(ref[k] - got[k]).max()) for k in ref)
    assert worst <= TOL, worst
    init = flat_params(_initial())
    assert min(float(np.abs(ref[k] - init[k]).max()) for k in ref if "['w']" in k) > 100 * TOL


def _initial():
    trainer = jl.Trainer(max_epochs=1, devices=1, limit_train_batches=0, **quiet())
    model = ExplicitLM()
    trainer.fit(model, token_batches())
    return model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_explicit_steps_traced_on_explicit_axes_and_placed_as_annotated(runs, name):
    trainer, model = runs[name]
    assert trainer.engine.explicit
    # the state keeps the trainer's (Auto) mesh and the annotated layout
    w = model.net.mlp.gate.w[...]
    assert w.sharding.mesh == trainer.mesh
    if name == "fsdp+tp":
        assert w.sharding.spec == P("fsdp", "tensor")


def test_plain_model_stays_on_auto_axes():
    from tests.strategy_models import LM
    from tests.strategy_models import token_batches as lm_batches

    trainer = jl.Trainer(max_epochs=1, devices=8, strategy="fsdp", **quiet())
    trainer.fit(LM(), lm_batches(1, 16))
    assert not trainer.engine.explicit


class _ModelAxisConfig(ShardingConfig):
    """The example's activation spec with its own mesh's axis name ('model'), which jaxlight's mesh lacks."""

    @property
    def act_btf(self) -> P:
        return P(self.rows, None, "model")


def test_axis_name_the_mesh_lacks_is_named():
    with pytest.raises(ExplicitShardingError, match=r"'model'.*data, fsdp, tensor, sequence, stage, expert"):
        _fit("ddp", 8, shd=_ModelAxisConfig())


def test_sequence_parallel_refuses_explicit_axes_naming_the_alternative():
    model = ExplicitLM()
    trainer = jl.Trainer(max_epochs=1, devices=8, strategy="fsdp+sp", **quiet())
    with pytest.raises(ExplicitShardingError, match=r"'fsdp\+sp'.*sp piece.*with_sharding_constraint"):
        trainer.fit(model, token_batches(length=8))
