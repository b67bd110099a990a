"""precision="16-mixed": a float16 forward with dynamic loss scaling (torch's GradScaler arithmetic), its state
in the train state: skipped steps, back-off and growth, checkpoints, and every way a train step runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight.precision import resolve_precision
from tests.core_models import MLP, batches, make_data, quiet, xent

BAD = 2  # the batch whose loss is multiplied by BOOST: its gradient overflows float16 at any scale >= 2**4
BOOST = 3e4


class Boosted(jl.LightningModule):
    """An MLP classifier whose batches carry a loss factor (1, or BOOST on the batch meant to overflow)."""

    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.lr = lr

    def configure_model(self) -> None:
        self.net = MLP(nnx.Rngs(0))

    def loss(self, batch):
        x, y, boost = batch
        return xent(self.net(x), y) * boost[0].astype(jnp.float32)

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def configure_optimizers(self):
        return optax.adam(self.lr)


class ManualBoosted(Boosted):
    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__(lr)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss, grads = self.manual_backward(lambda: self.loss(batch))
        opt.step(grads)
        return loss


def data(n_batches: int = 8, bad: tuple[int, ...] = (BAD,), bs: int = 16):
    x, y = make_data(n_batches * bs)
    return [
        (a, b, np.full((bs,), BOOST if i in bad else 1.0, np.float32)) for i, (a, b) in enumerate(batches(x, y, bs))
    ]


def host(tree):
    return jax.tree.map(lambda v: np.asarray(jax.device_get(v)), tree)


class Trace(jl.Callback):
    """After every batch: the loss, the scale the step used, the scaler state, the params and optimizer state."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        st = trainer.train_state
        self.rows.append(
            {
                "loss": float(outputs["loss"]),
                "used": float(outputs.get("loss_scale", 1.0)),
                "scale": float(st.loss_scale.scale) if st.loss_scale is not None else 1.0,
                "good": int(st.loss_scale.good_steps) if st.loss_scale is not None else 0,
                "step": int(st.step),
                "global_step": trainer.global_step,
                "params": host(st.params),
                "opt": host(st.opt_state),
                "callback_state": host(st.callback_state),
            }
        )


def fit(module=None, batches_=None, scaler=None, callbacks=(), **kw):
    module = Boosted() if module is None else module
    trace = Trace()
    precision = jl.MixedPrecision("16-mixed", scaler=scaler or jl.GradScaler(init_scale=2.0**4))
    trainer = jl.Trainer(precision=precision, callbacks=[trace, *callbacks], **quiet(**{"max_epochs": 1, **kw}))
    trainer.fit(module, data() if batches_ is None else batches_)
    return trainer, trace.rows


def same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# ---------------------------------------------------------------------------- the policy
@pytest.mark.parametrize("given", ["16-mixed", "16", 16])
def test_16_mixed_resolves_with_torch_scaler_defaults(given):
    prec = resolve_precision(given)
    assert (prec.name, prec.param_dtype, prec.compute_dtype) == ("16-mixed", None, jnp.float16)
    s = prec.scaler
    assert (s.init_scale, s.growth_factor, s.backoff_factor, s.growth_interval) == (2.0**16, 2.0, 0.5, 2000)
    assert resolve_precision("bf16-mixed").scaler is None


def test_mixed_precision_plugin_settings_and_refusals():
    prec = jl.MixedPrecision("16-mixed", "cuda", scaler=jl.GradScaler(init_scale=8.0, growth_interval=3))
    assert (prec.scaler.init_scale, prec.scaler.growth_interval) == (8.0, 3)
    assert resolve_precision(prec) is prec
    with pytest.raises(ValueError, match="does not use a scaler"):
        jl.MixedPrecision("bf16-mixed", scaler=jl.GradScaler())
    with pytest.raises(ValueError, match="'16-mixed' or 'bf16-mixed'"):
        jl.MixedPrecision("16-true")
    with pytest.raises(ValueError, match=r"growth_interval=0 must be >= 1"):
        jl.GradScaler(growth_interval=0)
    with pytest.raises(ValueError, match=r"backoff_factor=2.0 must be in \(0, 1\)"):
        jl.GradScaler(backoff_factor=2.0)


def test_plugins_spelling_as_in_lightning():
    scaler = jl.GradScaler(growth_interval=7)
    trainer = jl.Trainer(plugins=[jl.MixedPrecision("16-mixed", "cuda", scaler=scaler)], **quiet())
    assert trainer.precision == "16-mixed" and trainer.precision_plugin.scaler is scaler
    with pytest.raises(jl.MisconfigurationError, match=r"Received both precision='bf16-mixed' and plugins="):
        jl.Trainer(precision="bf16-mixed", plugins=[jl.MixedPrecision("16-mixed")])
    with pytest.raises(jl.MisconfigurationError, match=r"plugins: object is not a plugin jaxlight has"):
        jl.Trainer(plugins=[object()])
    with pytest.raises(jl.MisconfigurationError, match=r"plugins holds 2 precision plugins"):
        jl.Trainer(plugins=[jl.MixedPrecision(), jl.MixedPrecision()])


def test_traced_step_multiplies_in_float16_with_float32_masters():
    trainer, _ = fit(max_steps=1)
    jaxpr = trainer.engine.compiled["train"].jaxpr
    dots = []

    def walk(j):
        for eqn in j.eqns:
            if eqn.primitive.name == "dot_general":
                dots.append(tuple(v.aval.dtype for v in eqn.invars))
            for p in eqn.params.values():
                for sub in p if isinstance(p, (list, tuple)) else (p,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jaxpr)
    assert len(dots) == 5  # two layers forward; backward: both kernels' gradients, the hidden activation's
    assert set(dots) == {(jnp.dtype(jnp.float16), jnp.dtype(jnp.float16))}
    assert all(v.dtype == jnp.float32 for v in trainer.train_state.params.values())
    moments = [v for v in jax.tree.leaves(trainer.train_state.opt_state) if jnp.issubdtype(v.dtype, jnp.floating)]
    assert moments and all(v.dtype == jnp.float32 for v in moments)


# ---------------------------------------------------------------------------- skip, back-off, growth
def test_overflow_skips_on_every_device_and_halves_the_scale():
    scaler = jl.GradScaler(init_scale=2.0**4, growth_interval=100)
    trainer, rows = fit(devices=8, strategy="ddp", scaler=scaler, callbacks=[jl.callbacks.EMA(decay=0.9)])
    before, bad = rows[BAD - 1], rows[BAD]
    assert np.isfinite(bad["loss"]) and bad["used"] == 2.0**4
    assert (bad["scale"], bad["good"]) == (2.0**3, 0)
    assert same(bad["params"], before["params"]) and same(bad["opt"], before["opt"])  # bit-exact
    assert bad["callback_state"] and same(bad["callback_state"], before["callback_state"])  # the EMA too
    assert not same(rows[BAD + 1]["callback_state"], bad["callback_state"])
    for v in trainer.train_state.params.values():  # every device's copy took the same decision
        shards = [np.asarray(s.data) for s in v.addressable_shards]
        assert len(shards) == 8 and all(np.array_equal(shards[0], s) for s in shards)
    # the device counts applied updates; the host's global_step counts the skipped one too, as Lightning's does
    assert [r["step"] for r in rows] == [1, 2, 2, 3, 4, 5, 6, 7]
    assert [r["global_step"] for r in rows] == list(range(1, 9))
    assert rows[-1]["scale"] == 2.0**3 and rows[-1]["good"] == 5
    assert not same(rows[BAD + 1]["params"], bad["params"])  # the next batch trains again


def test_growth_after_growth_interval_good_steps():
    _, rows = fit(batches_=data(bad=()), scaler=jl.GradScaler(init_scale=2.0, growth_interval=3))
    assert [r["scale"] for r in rows] == [2.0, 2.0, 4.0, 4.0, 4.0, 8.0, 8.0, 8.0]
    assert [r["good"] for r in rows] == [1, 2, 0, 1, 2, 0, 1, 2]
    assert [r["used"] for r in rows] == [2.0, 2.0, 2.0, 4.0, 4.0, 4.0, 8.0, 8.0]


def test_default_scaler_backs_off_until_the_gradients_fit():
    # 2**16 overflows this model's float16 backward: each overflowing step is skipped and halves the scale
    _, rows = fit(batches_=data(bad=()), scaler=jl.GradScaler())
    skipped = [r["used"] != r["scale"] for r in rows]
    assert skipped[0] and rows[-1]["scale"] < 2.0**16
    assert all(r["scale"] == r["used"] / 2 for r, s in zip(rows, skipped) if s)
    assert rows[-1]["step"] == len(rows) - sum(skipped)


def test_tracks_float32_training():
    batches_ = data(n_batches=16, bad=())
    _, mixed = fit(batches_=batches_, max_epochs=3)
    ref = Trace()
    jl.Trainer(max_epochs=3, callbacks=[ref], **quiet()).fit(Boosted(), batches_)
    got, want = np.array([r["loss"] for r in mixed]), np.array([r["loss"] for r in ref.rows])
    assert want[-8:].mean() < 0.7 * want[:8].mean()  # it learns
    np.testing.assert_allclose(got, want, rtol=0.05, atol=0.02)


# ---------------------------------------------------------------------------- how a step runs
def test_accumulation_scales_micro_batches_and_skips_the_window():
    # windows of two: batches (2, 3) form window 1, whose sum overflows at its end
    _, rows = fit(accumulate_grad_batches=2, scaler=jl.GradScaler(init_scale=2.0**4, growth_interval=100))
    assert rows[BAD]["scale"] == 2.0**4  # inside the window: the scale holds
    assert rows[BAD + 1]["scale"] == 2.0**3 and rows[BAD + 1]["good"] == 0
    assert same(rows[BAD + 1]["params"], rows[BAD - 1]["params"])
    assert same(rows[BAD + 1]["opt"].inner_state, rows[BAD - 1]["opt"].inner_state)
    assert int(rows[BAD + 1]["opt"].window) == 0  # the window is over, its sum dropped
    assert all(np.all(a == 0) for a in jax.tree.leaves(rows[BAD + 1]["opt"].acc_grads))
    assert [r["step"] for r in rows] == [0, 1, 1, 1, 1, 2, 2, 3]
    assert not same(rows[-1]["params"], rows[BAD + 1]["params"])


def test_steps_per_execution_equals_single_steps():
    t1, rows1 = fit(scaler=jl.GradScaler(init_scale=2.0**4, growth_interval=2))
    t4, rows4 = fit(scaler=jl.GradScaler(init_scale=2.0**4, growth_interval=2), steps_per_execution=4)
    assert same(host(t1.train_state.params), host(t4.train_state.params))
    assert same(host(t1.train_state.loss_scale), host(t4.train_state.loss_scale))
    assert [r["used"] for r in rows1] == [r["used"] for r in rows4]


def test_manual_optimization_scales_backward_and_skips_in_opt_step():
    scaler = jl.GradScaler(init_scale=2.0**4, growth_interval=100)
    trainer, rows = fit(ManualBoosted(), scaler=scaler)
    bad, before = rows[BAD], rows[BAD - 1]
    assert (bad["used"], bad["scale"]) == (2.0**4, 2.0**3)
    assert same(bad["params"], before["params"]) and same(bad["opt"], before["opt"])
    # the same arithmetic as automatic optimization
    auto, _ = fit(scaler=scaler)
    for k, v in trainer.train_state.params.items():
        np.testing.assert_allclose(np.asarray(v), np.asarray(auto.train_state.params[k]), rtol=1e-6, atol=1e-7)
    assert same(host(trainer.train_state.loss_scale), host(auto.train_state.loss_scale))


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_sharded_strategy_equals_one_device(strategy):
    scaler = jl.GradScaler(init_scale=2.0**4, growth_interval=2)
    one, rows1 = fit(scaler=scaler, devices=1)
    piece = jl.strategies.FSDP(min_shard=16) if strategy == "fsdp" else strategy  # the tiny kernels sharded too
    many, rows8 = fit(scaler=scaler, devices=8, strategy=piece)
    kernel = many.train_state.params["net/l1/kernel"]
    assert kernel.sharding.is_fully_replicated == (strategy == "ddp")
    assert [r["used"] for r in rows1] == [r["used"] for r in rows8]  # the same steps skipped everywhere
    assert [r["step"] for r in rows1] == [r["step"] for r in rows8]
    for k, v in one.train_state.params.items():  # float16 sums in another order: a float16 rounding apart
        np.testing.assert_allclose(np.asarray(many.train_state.params[k]), np.asarray(v), rtol=2e-3, atol=2e-3)


# ---------------------------------------------------------------------------- checkpoints
def test_resume_mid_run_is_bit_identical(tmp_path):
    scaler = jl.GradScaler(init_scale=2.0**4, growth_interval=2)
    batches_ = data(bad=(BAD, 6))
    ckpt = tmp_path / "mid.ckpt"

    class SaveAt(jl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == 3:  # the overflow at batch 2 is behind it
                trainer.save_checkpoint(ckpt)

    full, rows = fit(scaler=scaler, batches_=batches_, callbacks=[SaveAt()])
    # grown at batch 1, halved at 2, one good step since: a state the checkpoint must carry
    assert [r["scale"] for r in rows[:4]] == [2.0**4, 2.0**5, 2.0**4, 2.0**4] and rows[3]["good"] == 1

    resumed = jl.Trainer(precision=jl.MixedPrecision("16-mixed", scaler=scaler), **quiet(max_epochs=1))
    resumed.fit(Boosted(), batches_, ckpt_path=ckpt)
    assert resumed.global_step == full.global_step == 8
    assert same(host(resumed.train_state.params), host(full.train_state.params))
    assert same(host(resumed.train_state.opt_state), host(full.train_state.opt_state))
    assert same(host(resumed.train_state.loss_scale), host(full.train_state.loss_scale))
    assert int(resumed.train_state.step) == int(full.train_state.step) == 6  # two skipped updates


def test_nonfinite_guard_leaves_overflows_to_the_scaler():
    # an overflowing gradient is the scaler's to skip: NonFiniteGuard("stop") lets the run go on...
    guard = jl.callbacks.NonFiniteGuard(action="skip", verbose=False)
    trainer, rows = fit(callbacks=[guard, jl.callbacks.NonFiniteGuard()])
    assert guard.skipped == [] and rows[BAD]["scale"] == rows[BAD]["used"] / 2
    assert [r["step"] for r in rows] == [1, 2, 2, 3, 4, 5, 6, 7]
    # ...but a non-finite loss still stops it, naming the step
    poisoned = data(bad=())
    poisoned[5][0][3, 0] = np.nan
    with pytest.raises(jl.callbacks.NonFiniteError, match=r"Non-finite loss=nan at step 5 \(epoch 0, batch 5\)"):
        fit(batches_=poisoned, callbacks=[jl.callbacks.NonFiniteGuard()])
