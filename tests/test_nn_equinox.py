"""Equinox models trained as they are (issue 17): array leaves trained, eqx.nn.State carried, dropout keys
per step, inference mode in evaluation, placement through the same rules; the same numbers as a hand-written
Equinox + optax loop.

Tolerances: 1e-6 against the hand loop on one device; 1e-5 for FSDP on 8 devices against one device
(reductions in another order). SGD with momentum, so rounding differences stay rounding-sized (Adam with
eps=1e-8 would turn them into lr-sized steps on near-zero gradients).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight.strategies.placement import LayoutError
from tests.core_models import quiet, xent
from tests.helpers import Losses

eqx = pytest.importorskip("equinox")

STEPS, BATCH, IN, HID, OUT = 5, 16, 8, 32, 4
SEED = 7  # the wrapper's key stream: call n draws fold_in(key(SEED), n), split into one key per row
TX = lambda: optax.sgd(0.05, momentum=0.9)


class MLP(eqx.Module):
    """An Equinox MLP with a state layer (BatchNorm) and Dropout, written as the Equinox docs do."""

    l1: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    drop: eqx.nn.Dropout
    l2: eqx.nn.Linear
    steps: jax.Array  # an integer leaf: carried, not trained

    def __init__(self, key, hidden: int = HID):
        k1, k2 = jax.random.split(key)
        self.l1 = eqx.nn.Linear(IN, hidden, key=k1)
        self.bn = eqx.nn.BatchNorm(hidden, axis_name="batch", mode="ema", momentum=0.9)
        self.drop = eqx.nn.Dropout(0.3)
        self.l2 = eqx.nn.Linear(hidden, OUT, key=k2)
        self.steps = jnp.arange(3)

    def __call__(self, x, state, *, key=None):
        h, state = self.bn(self.l1(x), state)
        h = self.drop(jax.nn.relu(h), key=key)
        return self.l2(h), state


def make():
    return eqx.nn.make_with_state(MLP)(jax.random.key(0))


def data(n_batches: int = STEPS, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n_batches * BATCH, IN)).astype(np.float32)
    y = x[:, :OUT].argmax(-1).astype(np.int32)
    return [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(x), BATCH)]


class EqxClassifier(jl.LightningModule):
    def __init__(self, **wrap) -> None:
        super().__init__()
        self.wrap = wrap

    def configure_model(self) -> None:
        model, state = make()
        self.net = jl.nn.from_equinox(model, state, rngs=SEED, **self.wrap)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = xent(self.net(x), y)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", xent(self.net(x), y))

    def configure_optimizers(self):
        return TX()


def hand_loop(batches):
    """Equinox + optax as Equinox's own examples write it."""
    model, state = make()
    tx = TX()
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, state, opt_state, x, y, key):
        def loss_fn(model, state):
            keys = jax.random.split(key, x.shape[0])
            batched = jax.vmap(lambda xi, ki: model(xi, state, key=ki), axis_name="batch", out_axes=(0, None))
            logits, state = batched(x, keys)
            return xent(logits, y), state

        (loss, state), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model, state)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), state, opt_state, loss

    losses = []
    for i, (x, y) in enumerate(batches):
        key = jax.random.fold_in(jax.random.key(SEED), i)
        model, state, opt_state, loss = step(model, state, opt_state, jnp.asarray(x), jnp.asarray(y), key)
        losses.append(float(loss))
    return model, state, losses


def fit(strategy="auto", devices=1, **wrap):
    cb = Losses(as_float=True)
    module = EqxClassifier(**wrap)
    trainer = jl.Trainer(max_epochs=1, devices=devices, strategy=strategy, callbacks=[cb], **quiet())
    trainer.fit(module, data())
    return trainer, module, cb.losses


def max_diff(a, b) -> float:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b) and la
    return max(float(np.max(np.abs(np.asarray(u, np.float32) - np.asarray(v, np.float32)))) for u, v in zip(la, lb))


@pytest.fixture(scope="module")
def reference():
    return hand_loop(data())


@pytest.fixture(scope="module")
def single():
    return fit()


def test_equinox_equals_hand_loop(reference, single):
    ref_model, ref_state, ref_losses = reference
    trainer, module, losses = single
    got_model, got_state = module.net.eqx_module(), module.net.eqx_state()
    np.testing.assert_allclose(losses, ref_losses, atol=1e-6, rtol=0)
    assert max_diff(eqx.filter(got_model, eqx.is_array), eqx.filter(ref_model, eqx.is_array)) <= 1e-6
    assert max_diff(got_state, ref_state) <= 1e-6
    # trained: weights and running statistics moved; the integer leaf is carried, not trained
    init_model, init_state = make()
    assert max_diff(eqx.filter(got_model, eqx.is_inexact_array), eqx.filter(init_model, eqx.is_inexact_array)) > 1e-2
    assert max_diff(got_state, init_state) > 1e-2
    params, rest = trainer.train_state.params, trainer.train_state.model_state
    assert set(params) == {f"net/model/{m}/{p}" for m in ("l1", "bn", "l2") for p in ("weight", "bias")}
    assert {"net/model/steps", "net/state/bn/ema_state_index/0", "net/state/bn/ema_first_time_index"} <= set(rest)
    np.testing.assert_array_equal(np.asarray(rest["net/model/steps"]), np.arange(3))
    assert int(rest["net/rngs/default/count"]) == STEPS  # one key per step


def test_equinox_eval_uses_inference_mode_and_keeps_state(single):
    trainer, module, _ = single
    batches = data(2, seed=1)
    model, state = module.net.eqx_module(), module.net.eqx_state()
    preds = trainer.predict(module, [b[0] for b in batches])
    infer = eqx.nn.inference_mode(model)  # running statistics, no dropout
    losses = []
    for p, (x, y) in zip(preds, batches):
        ref, _ = jax.vmap(lambda xi: infer(xi, state), axis_name="batch", out_axes=(0, None))(jnp.asarray(x))
        np.testing.assert_allclose(np.asarray(p), np.asarray(ref), atol=1e-5)
        losses.append(float(xent(ref, jnp.asarray(y))))
    out = trainer.validate(module, batches)
    assert out[0]["val_loss"] == pytest.approx(np.mean(losses), abs=1e-5)
    assert max_diff(module.net.eqx_state(), state) == 0.0


def test_equinox_fsdp_equals_single_device(single):
    _, ref_module, ref_losses = single
    trainer, module, losses = fit(
        jl.strategies.FSDP(min_shard=128), devices=8, logical_axes={"l1/weight": (None, "embed")}
    )
    np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=0)
    got, ref = module.net.eqx_module(), ref_module.net.eqx_module()
    assert max_diff(eqx.filter(got, eqx.is_array), eqx.filter(ref, eqx.is_array)) <= 1e-5
    assert max_diff(module.net.eqx_state(), ref_module.net.eqx_state()) <= 1e-5
    params = trainer.train_state.params
    P = jax.sharding.PartitionSpec
    # annotated: (32, 8) with names (None, "embed") -> fsdp on dim 1, where the heuristic would take dim 0
    assert params["net/model/l1/weight"].sharding.spec == P(None, "fsdp")
    assert params["net/model/l1/weight"].addressable_shards[0].data.shape == (HID, 1)
    # unannotated (4, 32): the shape heuristic (largest dim fsdp divides); small leaves replicated
    assert params["net/model/l2/weight"].sharding.spec == P(None, "fsdp")
    assert params["net/model/bn/weight"].sharding.is_fully_replicated


def test_equinox_bf16_mixed_keeps_fp32_masters_and_state(single):
    """Equinox's BatchNorm does not promote dtypes: the wrapper runs the state in the compute dtype and
    stores it back in its own."""
    _, ref_module, _ = single
    cb = Losses(as_float=True)
    module = EqxClassifier()
    trainer = jl.Trainer(max_epochs=1, precision="bf16-mixed", callbacks=[cb], **quiet())
    trainer.fit(module, data())
    rest = trainer.train_state.model_state
    assert rest["net/state/bn/ema_state_index/0"].dtype == jnp.float32
    assert all(v.dtype == jnp.float32 for v in trainer.train_state.params.values())
    # close to the fp32 run, not equal to it (the forward ran in bf16)
    d = max_diff(module.net.eqx_state(), ref_module.net.eqx_state())
    assert 0 < d < 5e-2 and np.isfinite(cb.losses).all()


def test_equinox_guardrail_names_the_replicated_leaf():
    class Odd(EqxClassifier):
        def configure_model(self):
            self.net = jl.nn.from_equinox(eqx.nn.Linear(10, 30, key=jax.random.key(0)))  # no dim divisible by 8

    with pytest.raises(LayoutError, match=r"net/model/weight \(30, 10\)"):
        jl.Trainer(devices=8, strategy=jl.strategies.FSDP(min_shard=128), **quiet()).fit(Odd(), data(1))


def test_equinox_trainable_filter_freezes_leaves():
    model, state = make()
    spec = jax.tree.map(eqx.is_inexact_array, model)  # an Equinox filter spec: l1 frozen
    spec = eqx.tree_at(lambda m: (m.l1.weight, m.l1.bias), spec, replace=(False, False))
    net = jl.nn.from_equinox(model, state, trainable=spec)
    params = nnx.state(net, nnx.Param)
    assert "l1" not in params["model"] and "l2" in params["model"]
    buffers = nnx.state(net, jl.nn.EquinoxBuffer)
    assert set(buffers["model"]["l1"]) == {"weight", "bias"}
    # and training leaves the frozen leaves exactly where they were while the others move
    module = EqxClassifier(trainable=spec)
    before = {k: np.asarray(getattr(model, k).weight) for k in ("l1", "l2")}
    jl.Trainer(max_steps=3, devices=1, **quiet()).fit(module, data(3))
    after = module.net.eqx_module()
    np.testing.assert_array_equal(np.asarray(after.l1.weight), before["l1"])
    assert np.abs(np.asarray(after.l2.weight) - before["l2"]).max() > 1e-4


def test_equinox_whole_batch_model_and_explicit_key():
    class Batched(eqx.Module):
        lin: eqx.nn.Linear

        def __call__(self, x, *, key=None):
            return jax.vmap(self.lin)(x) + (0.0 if key is None else jax.random.normal(key, (x.shape[0], 1)))

    net = jl.nn.from_equinox(Batched(eqx.nn.Linear(3, 2, key=jax.random.key(0))), batch_axis=None, rngs=1)
    x = jnp.ones((5, 3))
    a, b = net(x), net(x)
    assert a.shape == (5, 2) and bool((a != b).any())  # a new key every call
    np.testing.assert_array_equal(np.asarray(net(x, key=jax.random.key(3))), np.asarray(net(x, key=jax.random.key(3))))


def test_equinox_errors_are_clear():
    model, state = make()
    with pytest.raises(ValueError, match="no state was given"):
        jl.nn.from_equinox(model)
    with pytest.raises(ValueError, match="matches no trained leaf"):
        jl.nn.from_equinox(model, state, logical_axes={"layers/*/weight": ("mlp", "embed")})
    with pytest.raises(ValueError, match="name 1 dims but the leaf has shape"):
        jl.nn.from_equinox(model, state, logical_axes={"l*/weight": ("embed",)})
    with pytest.raises(ValueError, match="'dropout' stream of rngs"):
        jl.nn.from_equinox(model, state, rngs={"params": 0})
    with pytest.raises(TypeError, match="equinox.Module"):
        jl.nn.from_equinox(lambda x: x)
    net = jl.nn.from_equinox(model, state)
    with pytest.raises(ValueError, match="one common number of rows"):
        net(jnp.ones((4, IN)), jnp.ones((3, IN)))
    # a model built directly (initial states still inside) gets them as its state
    direct = MLP(jax.random.key(0))
    net = jl.nn.from_equinox(direct)
    assert max_diff(jax.tree.leaves(net.eqx_state()), jax.tree.leaves(state)) == 0.0  # markers differ: objects
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(nnx.state(net))[0]]
    assert paths and not any("init" in p for p in paths)  # the layers' copies of the initial state are dropped


def test_models_doc_runs():
    """docs/models.md: its ```python blocks run as written (```py blocks are fragments) and the three
    models train to the same task with the parameter paths the page shows."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "models.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 6  # the sixth: pmap-era axis_name (runs on its own; defines no model of this test)
    ns: dict = {"__name__": "docs_models"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"models.md[block {i}]", "exec"), ns)
    results = ns["results"]
    firsts = {name: paths[0] for name, (paths, _) in results.items()}
    assert firsts == {
        "NNXClassifier": "net/bn/bias",
        "LinenClassifier": "net/BatchNorm_0/bias",
        "EqxClassifier": "net/model/bn/bias",
    }
    for name, (_, acc) in results.items():
        assert acc > 0.6, (name, acc)  # chance is 0.25
