"""Manual optimization: alternating updates inside one compiled step equal a hand-written JAX loop."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from tests.core_models import max_diff, quiet
from tests.helpers import Losses

Z, HID = 4, 32


class Gen(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(Z, HID, rngs=rngs)
        self.l2 = nnx.Linear(HID, 2, rngs=rngs)

    def __call__(self, z):
        return self.l2(nnx.relu(self.l1(z)))


class Disc(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(2, HID, rngs=rngs)
        self.l2 = nnx.Linear(HID, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))[:, 0]


def bce(logits, target):
    return optax.sigmoid_binary_cross_entropy(logits, jnp.full_like(logits, target)).mean()


def d_loss_of(disc, gen, real, z):
    fake = jax.lax.stop_gradient(gen(z))
    return bce(disc(real), 1.0) + bce(disc(fake), 0.0)


def g_loss_of(disc, gen, z):
    return bce(disc(gen(z)), 1.0)


def make_tx(opt):
    return optax.adam(2e-3, b1=0.5) if opt == "adam" else optax.sgd(5e-2, momentum=0.9)


class GAN(jl.LightningModule):
    def __init__(self, opt="adam", every=1):
        super().__init__()
        self.automatic_optimization = False
        self.opt, self.every = opt, every

    def configure_model(self):
        self.gen = Gen(nnx.Rngs(0))
        self.disc = Disc(nnx.Rngs(1))

    def training_step(self, batch, batch_idx):
        real, z = batch
        opt_g, opt_d = self.optimizers()

        def d_loss_fn():
            loss = d_loss_of(self.disc, self.gen, real, z)
            self.log("d_loss", loss)  # logged inside the differentiated function
            return loss

        d_loss, grads = self.manual_backward(d_loss_fn, optimizer=opt_d)
        opt_d.step(grads)
        with self.toggled_optimizer(opt_g):
            g_loss, grads = self.manual_backward(lambda: g_loss_of(self.disc, self.gen, z))
        opt_g.step(grads, when=None if self.every == 1 else batch_idx % self.every == 0)
        self.log("g_loss", g_loss)
        return {"loss": g_loss, "d_loss": d_loss}

    def configure_optimizers(self):
        return [
            {"optimizer": make_tx(self.opt), "params": self.gen},
            {"optimizer": make_tx(self.opt), "params": self.disc},
        ]


def gan_data(n_batches=6, bs=16, seed=0):
    rng = np.random.default_rng(seed)
    return [
        (
            (rng.normal(size=(bs, 2)) * 0.5 + np.array([2.0, -1.0])).astype(np.float32),
            rng.normal(size=(bs, Z)).astype(np.float32),
        )
        for _ in range(n_batches)
    ]


def hand_gan(data, opt="adam", every=1, epochs=1):
    """The same alternating updates, written with jax.value_and_grad and optax."""
    gd_g, pg, rg = nnx.split(Gen(nnx.Rngs(0)), nnx.Param, ...)
    gd_d, pd, rd = nnx.split(Disc(nnx.Rngs(1)), nnx.Param, ...)
    tx_g, tx_d = make_tx(opt), make_tx(opt)
    sg, sd = tx_g.init(pg), tx_d.init(pd)
    gen = lambda p: nnx.merge(gd_g, p, rg, copy=True)
    disc = lambda p: nnx.merge(gd_d, p, rd, copy=True)

    @jax.jit
    def step(pg, pd, sg, sd, real, z, i):
        d_loss, g = jax.value_and_grad(lambda p: d_loss_of(disc(p), gen(pg), real, z))(pd)
        u, sd = tx_d.update(g, sd, pd)
        pd = optax.apply_updates(pd, u)
        g_loss, g = jax.value_and_grad(lambda p: g_loss_of(disc(pd), gen(p), z))(pg)
        u, new_sg = tx_g.update(g, sg, pg)
        new_pg = optax.apply_updates(pg, u)
        ok = i % every == 0
        pg = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_pg, pg)
        sg = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_sg, sg)
        return pg, pd, sg, sd, d_loss, g_loss

    losses = []
    for _ in range(epochs):
        for i, (real, z) in enumerate(data):
            pg, pd, sg, sd, dl, gl = step(pg, pd, sg, sd, jnp.asarray(real), jnp.asarray(z), i)
            losses.append((float(dl), float(gl)))
    return pg, pd, losses


def params_of(model):
    return nnx.state(model.gen, nnx.Param), nnx.state(model.disc, nnx.Param)


@pytest.mark.parametrize("every", [1, 2])
def test_alternating_updates_equal_a_hand_written_loop(every):
    data = gan_data()
    rec = Losses(("d_loss", "loss"), as_float=True)
    model = GAN(every=every)
    trainer = jl.Trainer(max_epochs=1, devices=1, callbacks=[rec], **quiet())
    trainer.fit(model, data)
    pg, pd, losses = hand_gan(data, every=every)
    gen, disc = params_of(model)
    assert max_diff(disc, pd) <= 1e-6
    assert max_diff(gen, pg) <= 1e-6
    np.testing.assert_allclose(rec.losses, losses, rtol=1e-5, atol=1e-6)
    assert trainer.compile_counts["train"] == 1
    assert trainer.global_step == len(data) and int(trainer.train_state.step) == len(data)
    assert isinstance(trainer.train_state.opt_state, tuple) and len(trainer.train_state.opt_state) == 2
    # each optimizer's state covers only its own parameters
    mu_d = trainer.train_state.opt_state[1][0].mu
    assert set(mu_d) == {k for k in trainer.train_state.params if k.startswith("disc/")}
    # what the loss function logged arrives like any step value
    np.testing.assert_allclose(float(trainer.callback_metrics["d_loss"]), losses[-1][0], rtol=1e-5)
    np.testing.assert_allclose(float(trainer.callback_metrics["g_loss"]), losses[-1][1], rtol=1e-5)


def test_generator_sees_the_updated_discriminator():
    """A loop that computes both gradients before either update (simultaneous updates) ends elsewhere: the
    equality above is not an accident of a discriminator step that changes nothing."""
    data = gan_data()
    model = GAN()
    jl.Trainer(max_epochs=1, devices=1, **quiet()).fit(model, data)
    gd_g, pg, rg = nnx.split(Gen(nnx.Rngs(0)), nnx.Param, ...)
    gd_d, pd, rd = nnx.split(Disc(nnx.Rngs(1)), nnx.Param, ...)
    tx_g, tx_d = make_tx("adam"), make_tx("adam")
    sg, sd = tx_g.init(pg), tx_d.init(pd)

    def grads(pg, pd, real, z):  # both gradients at the same (old) parameters
        g_d = jax.grad(lambda p: d_loss_of(nnx.merge(gd_d, p, rd), nnx.merge(gd_g, pg, rg), real, z))(pd)
        g_g = jax.grad(lambda p: g_loss_of(nnx.merge(gd_d, pd, rd), nnx.merge(gd_g, p, rg), z))(pg)
        return g_d, g_g

    for real, z in data:
        g_d, g_g = grads(pg, pd, real, z)
        u, sd = tx_d.update(g_d, sd, pd)
        pd = optax.apply_updates(pd, u)
        u, sg = tx_g.update(g_g, sg, pg)
        pg = optax.apply_updates(pg, u)
    assert max_diff(nnx.state(model.gen, nnx.Param), pg) > 1e-5


@pytest.mark.parametrize("offload", [False, True])
def test_fsdp_on_8_devices_matches_one_device(offload):
    """SGD with momentum (Adam's eps=1e-8 would turn reduction-order rounding into lr-sized differences)."""
    data = gan_data(n_batches=4, bs=16)
    one = GAN(opt="sgd")
    jl.Trainer(max_epochs=1, devices=1, **quiet()).fit(one, data)
    many = GAN(opt="sgd")
    strategy = jl.strategies.FSDP(min_shard=32)
    if offload:  # the optimizer states live in host memory; the manual step fetches them like the automatic one
        strategy = strategy + jl.strategies.HostOffload()
    trainer = jl.Trainer(max_epochs=1, devices=8, strategy=strategy, **quiet())
    trainer.fit(many, data)
    spec = trainer.train_state.params["disc/l1/kernel"].sharding.spec
    assert "fsdp" in jax.tree.leaves(tuple(spec)), spec  # really sharded
    mom = trainer.train_state.opt_state[1][0].trace["disc/l1/kernel"]
    assert mom.sharding.spec == spec  # optimizer state mirrors its parameter
    assert mom.sharding.memory_kind == ("pinned_host" if offload else "device")
    assert max_diff(params_of(many), params_of(one)) <= 1e-5


def test_nonfinite_guard_drops_the_whole_manual_step():
    data = gan_data(n_batches=3)
    data[1] = (np.full_like(data[1][0], np.nan), data[1][1])  # batch 1 poisons the discriminator's gradient
    model = GAN()
    guard = jl.callbacks.NonFiniteGuard(action="skip", verbose=False)
    trainer = jl.Trainer(max_epochs=1, devices=1, callbacks=[guard], **quiet())
    trainer.fit(model, data)
    assert guard.skipped == [1]
    pg, pd, _ = hand_gan(data[:1] + data[2:])  # as if batch 1 never happened, for both optimizers
    assert max_diff(params_of(model), (pg, pd)) <= 1e-6


def test_manual_backward_over_every_parameter_and_clip_gradients():
    seen = {}

    class Probe(GAN):
        def training_step(self, batch, batch_idx):
            real, z = batch
            opt_g, opt_d = self.optimizers()
            loss, grads = self.manual_backward(lambda: g_loss_of(self.disc, self.gen, z))
            seen["keys"] = sorted(grads)
            clipped = self.clip_gradients(opt_g, grads, gradient_clip_val=1e-3)
            opt_g.step(clipped)  # takes its own parameters out of a dict over every parameter
            return {"loss": loss, "raw": optax.global_norm(grads), "clipped": optax.global_norm(clipped)}

    class Norms(jl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen["raw"], seen["clipped"] = float(outputs["raw"]), float(outputs["clipped"])

    model = Probe()
    disc0 = jax.tree.map(np.asarray, nnx.state(Disc(nnx.Rngs(1)), nnx.Param))  # configure_model's disc
    gen0 = jax.tree.map(np.asarray, nnx.state(Gen(nnx.Rngs(0)), nnx.Param))
    trainer = jl.Trainer(max_epochs=1, devices=1, limit_train_batches=1, callbacks=[Norms()], **quiet())
    trainer.fit(model, gan_data())
    assert seen["keys"] == sorted(trainer.train_state.params)
    # clip_gradients really clipped (by global norm, to 1e-3) a gradient that was larger
    assert seen["raw"] > 1e-3 and seen["clipped"] == pytest.approx(1e-3, rel=1e-4)
    # opt_g stepped the generator only, though the gradients covered every parameter
    assert max_diff(nnx.state(model.disc, nnx.Param), disc0) == 0.0
    assert max_diff(nnx.state(model.gen, nnx.Param), gen0) > 0.0


def test_resume_continues_both_optimizer_states(tmp_path):
    data = gan_data(n_batches=4)
    straight = GAN()
    jl.Trainer(max_epochs=2, devices=1, **quiet()).fit(straight, data)
    first = GAN()
    t1 = jl.Trainer(max_epochs=1, devices=1, **quiet())
    t1.fit(first, data)
    t1.save_checkpoint(tmp_path / "ckpt")
    resumed = GAN()
    jl.Trainer(max_epochs=2, devices=1, **quiet()).fit(resumed, data, ckpt_path=str(tmp_path / "ckpt"))
    assert max_diff(params_of(resumed), params_of(straight)) <= 1e-6


def test_errors_say_what_to_do():
    data = gan_data(n_batches=2)

    class Auto(GAN):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = True

        def configure_optimizers(self):
            return [optax.adam(1e-3), optax.adam(1e-3)]

    with pytest.raises(jl.MisconfigurationError, match="only supported with manual optimization"):
        jl.Trainer(max_epochs=1, devices=1, **quiet()).fit(Auto(), data)
    with pytest.raises(jl.MisconfigurationError, match="gradient clipping is not supported for manual"):
        jl.Trainer(max_epochs=1, devices=1, gradient_clip_val=1.0, **quiet()).fit(GAN(), data)
    with pytest.raises(jl.MisconfigurationError, match="accumulation is not supported for manual"):
        jl.Trainer(max_epochs=1, devices=1, accumulate_grad_batches=2, **quiet()).fit(GAN(), data)

    class ArrayLoss(GAN):
        def training_step(self, batch, batch_idx):
            real, z = batch
            self.manual_backward(g_loss_of(self.disc, self.gen, z))  # torch habit: the loss, not its function

    with pytest.raises(TypeError, match="takes the function that computes the loss"):
        jl.Trainer(max_epochs=1, devices=1, **quiet()).fit(ArrayLoss(), data)

    class NoGrads(GAN):
        def training_step(self, batch, batch_idx):
            opt_g, _ = self.optimizers()
            opt_g.step()

    with pytest.raises(TypeError, match=r"opt.step\(grads\) takes the gradients"):
        jl.Trainer(max_epochs=1, devices=1, **quiet()).fit(NoGrads(), data)

    class WrongGrads(GAN):
        def training_step(self, batch, batch_idx):
            real, z = batch
            opt_g, opt_d = self.optimizers()
            loss, grads = self.manual_backward(lambda: d_loss_of(self.disc, self.gen, real, z), optimizer=opt_d)
            opt_g.step(grads)
            return loss

    with pytest.raises(KeyError, match="no gradient for"):
        jl.Trainer(max_epochs=1, devices=1, **quiet()).fit(WrongGrads(), data)

    with pytest.raises(RuntimeError, match="only inside training_step"):
        GAN().manual_backward(lambda: 0.0)
