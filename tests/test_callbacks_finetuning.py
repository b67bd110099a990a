"""BaseFinetuning / BackboneFinetuning (issue 23 item 3): frozen parameters get no update and no optimizer
state, frozen BatchNorm statistics stay put, an unfrozen group starts with fresh optimizer state at its
learning rate (a first Adam step moves each weight by it), the train step recompiles once per unfreeze, a
submodule's ``.eval()`` is respected inside the compiled step, and BackboneFinetuning's learning rates and
losses are Lightning's."""

from __future__ import annotations

import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight.callbacks import BackboneFinetuning, BaseFinetuning
from tests.core_models import quiet

ROWS, BATCH = 32, 8


def data(seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [1.5]], np.float32)).astype(np.float32)
    return [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, ROWS, BATCH)]


class Backbone(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List(
            [nnx.Linear(4, 8, rngs=rngs), nnx.BatchNorm(8, momentum=0.9, rngs=rngs), nnx.Dropout(0.5, rngs=rngs)]
        )

    def __call__(self, x):
        return nnx.relu(self.layers[2](self.layers[1](self.layers[0](x))))


class Model(jl.LightningModule):
    def __init__(self, lr: float = 1e-2, eval_backbone: bool = False) -> None:
        super().__init__()
        self.lr, self.eval_backbone = lr, eval_backbone

    def configure_model(self) -> None:
        rngs = nnx.Rngs(0)
        self.backbone = Backbone(rngs)
        self.head = nnx.Linear(8, 1, rngs=rngs)
        if self.eval_backbone:
            self.backbone.eval()  # torch: self.backbone.eval() keeps BatchNorm on its running statistics

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = ((self.head(self.backbone(x)) - y) ** 2).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return optax.inject_hyperparams(optax.adam)(learning_rate=self.lr)


class FreezeBackbone(BaseFinetuning):
    def __init__(self, at: int | None = 1, lr: float | None = None, train_bn: bool = False) -> None:
        super().__init__()
        self.at, self.lr, self.train_bn = at, lr, train_bn

    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.backbone, train_bn=self.train_bn)

    def finetune_function(self, pl_module, epoch, optimizer):
        if epoch == self.at:
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, lr=self.lr, train_bn=self.train_bn)


class Snapshots(jl.Callback):
    """The parameters and model state at each train batch start and epoch end (host copies)."""

    def __init__(self) -> None:
        self.batch_start: list[tuple[dict, dict]] = []
        self.epoch_end: list[tuple[dict, dict]] = []

    @staticmethod
    def _copy(trainer):
        st = trainer.train_state
        rest = {k: np.array(v) for k, v in st.model_state.items() if k.startswith("backbone/layers/1/")}
        return {k: np.array(v) for k, v in st.params.items()}, rest

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batch_start.append(self._copy(trainer))

    def on_train_epoch_end(self, trainer, pl_module):
        self.epoch_end.append(self._copy(trainer))


BACKBONE = ("backbone/layers/0/kernel", "backbone/layers/0/bias", "backbone/layers/1/scale", "backbone/layers/1/bias")
STATS = ("backbone/layers/1/mean", "backbone/layers/1/var")


@pytest.fixture(scope="module")
def unfrozen_run():
    snaps = Snapshots()
    trainer = jl.Trainer(max_epochs=2, callbacks=[FreezeBackbone(at=1, lr=0.01), snaps], **quiet())
    trainer.fit(Model(), data())
    return trainer, snaps


def test_frozen_parameters_get_no_update_no_state_and_fixed_statistics(unfrozen_run):
    trainer, snaps = unfrozen_run
    (p0, r0), (p1, r1) = snaps.batch_start[0], snaps.epoch_end[0]
    for k in BACKBONE:  # epoch 0: frozen (BatchNorm too, train_bn=False)
        np.testing.assert_array_equal(p0[k], p1[k], err_msg=k)
    for k in STATS:  # torch's track_running_stats=False: the running statistics do not move
        np.testing.assert_array_equal(r0[k], r1[k], err_msg=k)
    assert not np.allclose(p0["head/kernel"], p1["head/kernel"])  # the head trained
    # no optimizer state for a frozen parameter (torch: no grad, so Adam never creates its state)
    cfg = trainer.engine.optimizer
    opt0 = cfg.optimizers[0]
    assert set(opt0.keys) == {"head/kernel", "head/bias"}
    mu = opt0.state_of(trainer.train_state.opt_state).inner_state[0].mu
    assert all(isinstance(mu[k], optax.MaskedNode) for k in BACKBONE)


def test_unfrozen_group_starts_fresh_and_moves_each_weight_by_its_lr(unfrozen_run):
    trainer, snaps = unfrozen_run
    (before, _), (after, _) = snaps.batch_start[4], snaps.batch_start[5]  # the first step of epoch 1
    # (the kernel: a bias before a BatchNorm has a gradient near 0, where Adam's eps shortens the step)
    for k in ("backbone/layers/0/kernel",):
        step = np.abs(after[k] - before[k])
        moved = step[step > 0]  # a unit whose ReLU is off for the whole batch has no gradient
        assert moved.size >= 0.75 * step.size, k
        np.testing.assert_allclose(moved, 0.01, rtol=1e-3, err_msg=k)  # Adam's first step: lr * sign(g)
    for k in ("backbone/layers/1/scale", "backbone/layers/1/bias"):  # BatchNorm stays out (train_bn=False)
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)
    # make_trainable tracks BatchNorm statistics again (Lightning's behaviour with train_bn=False, too)
    (_, r_start), (_, r_end) = snaps.batch_start[4], snaps.epoch_end[1]
    assert not np.allclose(r_start["backbone/layers/1/mean"], r_end["backbone/layers/1/mean"])
    cfg = trainer.engine.optimizer
    (group,) = cfg.groups
    assert group.keys == ("backbone/layers/0/bias", "backbone/layers/0/kernel") and group.lr == 0.01
    # the old group kept its Adam count (8 steps), the new one counted from 0 (4 steps)
    st = trainer.train_state.opt_state
    assert int(cfg.optimizers[0].state_of(st).count) == 8 and int(group.state_of(st).count) == 4
    assert trainer.compile_counts["train"] == 2  # one recompile, at the unfreeze


def test_default_lr_is_group_zero_over_initial_denom_and_lr_writes_reach_the_state():
    class Grow(FreezeBackbone):
        def finetune_function(self, pl_module, epoch, optimizer):
            if epoch == 1:
                self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, train_bn=True)
            elif epoch == 2:
                assert optimizer.param_groups[-1]["lr"] == pytest.approx(1e-3)
                optimizer.param_groups[-1]["lr"] = 5e-3

    trainer = jl.Trainer(max_epochs=3, callbacks=[Grow(train_bn=False)], **quiet())
    trainer.fit(Model(lr=1e-2), data())
    cfg, st = trainer.engine.optimizer, trainer.train_state
    (group,) = cfg.groups
    assert "backbone/layers/1/scale" in group.keys  # unfrozen with train_bn=True: BatchNorm joins the group
    lr = group.state_of(st.opt_state).hyperparams["learning_rate"]
    assert float(lr) == pytest.approx(5e-3)
    assert trainer.compile_counts["train"] == 2  # a learning-rate write recompiles nothing


def test_submodule_eval_is_respected_inside_the_compiled_step():
    snaps = Snapshots()
    model = Model(eval_backbone=True)
    trainer = jl.Trainer(max_epochs=1, callbacks=[snaps], **quiet())
    trainer.fit(model, data())
    (_, r0), (_, r1) = snaps.batch_start[0], snaps.epoch_end[0]
    for k in STATS:  # the backbone's BatchNorm ran on its running statistics: nothing to update
        np.testing.assert_array_equal(r0[k], r1[k], err_msg=k)
    assert model.backbone.layers[1].use_running_average and model.backbone.layers[2].deterministic
    assert not model.head.__dict__.get("deterministic", False)
    # the same model trained in training mode updates them (the default, unchanged)
    snaps2 = Snapshots()
    jl.Trainer(max_epochs=1, callbacks=[snaps2], **quiet()).fit(Model(), data())
    assert not np.allclose(snaps2.batch_start[0][1][STATS[0]], snaps2.epoch_end[0][1][STATS[0]])


def test_a_layer_eval_set_in_an_epoch_hook_recompiles_once():
    class EvalAtEpoch1(jl.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch == 1:
                pl_module.backbone.layers[1].eval()

    snaps = Snapshots()
    trainer = jl.Trainer(max_epochs=2, callbacks=[EvalAtEpoch1(), snaps], **quiet())
    trainer.fit(Model(), data())
    assert trainer.compile_counts["train"] == 2
    (_, r0), (_, r1) = snaps.batch_start[4], snaps.epoch_end[1]
    np.testing.assert_array_equal(r0[STATS[0]], r1[STATS[0]])


def test_unfreeze_needs_an_injected_learning_rate():
    class Baked(Model):
        def configure_optimizers(self):
            return optax.adam(1e-2)

    trainer = jl.Trainer(max_epochs=2, callbacks=[FreezeBackbone(at=1, lr=1e-3)], **quiet())
    with pytest.raises(jl.MisconfigurationError, match="inject_hyperparams"):
        trainer.fit(Baked(), data())


def test_manual_optimization_is_refused():
    class Manual(Model):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            loss, grads = self.manual_backward(lambda: ((self.head(self.backbone(batch[0])) - batch[1]) ** 2).mean())
            opt.step(grads)
            return loss

    with pytest.raises(jl.MisconfigurationError, match="automatic optimization"):
        jl.Trainer(max_epochs=1, callbacks=[FreezeBackbone()], **quiet()).fit(Manual(), data())


def test_backbone_finetuning_without_backbone_attribute():
    class NoBackbone(Model):
        def configure_model(self):
            self.net = nnx.Linear(4, 1, rngs=nnx.Rngs(0))

        def training_step(self, batch, batch_idx):
            return ((self.net(batch[0]) - batch[1]) ** 2).mean()

    with pytest.raises(jl.MisconfigurationError, match="`backbone` attribute"):
        jl.Trainer(max_epochs=1, callbacks=[BackboneFinetuning()], **quiet()).fit(NoBackbone(), data())


# ------------------------------------------------------------------------ BackboneFinetuning vs Lightning
def _lightning_backbone_run(init: str, epochs: int, logs: str) -> tuple[list[float], list[float], dict]:
    pl = pytest.importorskip("pytorch_lightning")
    torch = pytest.importorskip("torch")
    from torch import nn

    from tests.gallery_lightning_programs import _quiet_lightning

    _quiet_lightning()

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.backbone = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
            self.head = nn.Linear(8, 1)
            torch.save(self.state_dict(), init)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return ((self.head(self.backbone(x)) - y) ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=1e-2)

    losses, lrs = [], []

    class Rec(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

        def on_train_epoch_end(self, trainer, pl_module):
            lrs.append(trainer.optimizers[0].param_groups[-1]["lr"])

    x = torch.from_numpy(np.concatenate([b[0] for b in data()]))
    y = torch.from_numpy(np.concatenate([b[1] for b in data()]))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    cb = pl.callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda e: 1.5)
    mon = pl.callbacks.LearningRateMonitor()
    t = pl.Trainer(
        max_epochs=epochs, callbacks=[cb, Rec(), mon], accelerator="cpu", enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, logger=pl.loggers.CSVLogger(logs),
        log_every_n_steps=1,
    )  # fmt: skip
    t.fit(Lit(), loader)
    return losses, lrs, mon.lrs


def test_backbone_finetuning_matches_lightning(tmp_path):
    from jaxlight.migrate import load_torch_weights

    init = str(tmp_path / "init.pt")
    epochs = 4
    pl_losses, pl_lrs, pl_monitored = _lightning_backbone_run(init, epochs, str(tmp_path / "pl_logs"))

    class Port(jl.LightningModule):
        def configure_model(self):
            rngs = nnx.Rngs(0)
            self.backbone = nnx.Sequential(nnx.Linear(4, 8, rngs=rngs), nnx.relu)
            self.head = nnx.Linear(8, 1, rngs=rngs)

        def on_fit_start(self):
            load_torch_weights(self, init)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return ((self.head(self.backbone(x)) - y) ** 2).mean()

        def configure_optimizers(self):
            return optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)

    losses, lrs = [], []

    class Rec(jl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

        def on_train_epoch_end(self, trainer, pl_module):
            groups = trainer.engine.optimizer.groups
            lrs.append(groups[-1].lr if groups else 1e-2)

    cb = BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda e: 1.5)
    mon = jl.callbacks.LearningRateMonitor()
    kw = {**quiet(), "logger": jl.loggers.CSVLogger(str(tmp_path / "logs")), "log_every_n_steps": 1}
    trainer = jl.Trainer(max_epochs=epochs, callbacks=[cb, Rec(), mon], **kw)
    trainer.fit(Port(), data())
    # the monitor after the unfreeze: lr-Adam's history moves to lr-Adam/pg1 and lr-Adam/pg2 appears, as in Lightning
    assert sorted(mon.lrs) == sorted(pl_monitored) == ["lr-Adam/pg1", "lr-Adam/pg2"]
    for name, values in pl_monitored.items():
        np.testing.assert_allclose(mon.lrs[name], values, rtol=1e-6, err_msg=name)
    np.testing.assert_allclose(losses, pl_losses, rtol=1e-5)
    np.testing.assert_allclose(lrs, pl_lrs, rtol=1e-6)
    assert cb.previous_backbone_lr == pytest.approx(pl_lrs[-1])
    assert trainer.compile_counts["train"] == 2


def _states(trainer) -> dict[str, np.ndarray]:
    import jax

    st = trainer.train_state
    flat = jax.tree_util.tree_flatten_with_path((st.params, st.model_state, st.opt_state))[0]

    def host(v):
        return np.array(jax.random.key_data(v) if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) else v)

    return {jax.tree_util.keystr(k): host(v) for k, v in flat}


def _assert_bit_identical(a, b) -> None:
    sa, sb = _states(a), _states(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)


@pytest.mark.parametrize("resume_epoch", [0, 1, 2])
def test_resume_before_or_after_an_unfreeze_continues_bit_identically(tmp_path, resume_epoch):
    # frozen BatchNorm statistics (train_bn=False) until epoch 1's unfreeze; the added group's Adam moments,
    # count and rate must come back from the checkpoint into a re-added group, and the statistics held
    # or tracked as saved
    ckpt = jl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), save_top_k=-1)
    kw = {**quiet(), "enable_checkpointing": True}
    full = jl.Trainer(max_epochs=4, callbacks=[FreezeBackbone(at=1, lr=0.01), ckpt], **kw)
    full.fit(Model(), data())
    path = str(tmp_path / "ckpts" / f"epoch={resume_epoch}-step={4 * (resume_epoch + 1)}.ckpt")
    resumed = jl.Trainer(max_epochs=4, callbacks=[FreezeBackbone(at=1, lr=0.01)], **quiet())
    resumed.fit(Model(), data(), ckpt_path=path)
    assert resumed.global_step == full.global_step == 16
    assert [g.label for g in resumed.engine.optimizer.groups] == ["opt0_pg2"]
    assert resumed.engine.optimizer.groups[0].keys == full.engine.optimizer.groups[0].keys
    _assert_bit_identical(resumed, full)


@pytest.mark.parametrize("kind", ["backbone", "scheduled"])
def test_resume_keeps_the_growing_rate_and_the_epoch_scheduler_factor(tmp_path, kind):
    # "backbone": BackboneFinetuning's rate grows every epoch from previous_backbone_lr (saved);
    # "scheduled": an epoch scheduler halves group 0's rate and the added group follows by the factor
    # measured from the last epoch start's rate (saved)
    class Scheduled(Model):
        def configure_optimizers(self):
            tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
            sched = optax.exponential_decay(1e-2, 1, 0.5)
            return {"optimizer": tx, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}

    def run(ckpt_path=None, callbacks=()):
        if kind == "backbone":
            cb = BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda e: 1.5, backbone_initial_lr=1e-3)
        else:
            cb = FreezeBackbone(at=1, lr=1e-3)
        kw = {**quiet(), "enable_checkpointing": bool(callbacks)}
        t = jl.Trainer(max_epochs=5, callbacks=[cb, *callbacks], **kw)
        t.fit(Scheduled() if kind == "scheduled" else Model(), data(), ckpt_path=ckpt_path)
        return t, cb

    ckpt = jl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), save_top_k=-1)
    full, fcb = run(callbacks=[ckpt])
    resumed, rcb = run(ckpt_path=str(tmp_path / "ckpts" / "epoch=2-step=12.ckpt"))
    if kind == "backbone":
        assert rcb.previous_backbone_lr == fcb.previous_backbone_lr == pytest.approx(1e-3 * 1.5**3)
    else:
        assert full.engine.optimizer.groups[0].lr == pytest.approx(1e-3 * 0.5**3)
    assert resumed.engine.optimizer.groups[0].lr == full.engine.optimizer.groups[0].lr
    _assert_bit_identical(resumed, full)


def test_a_tampered_finetuning_state_is_refused_before_anything_is_read(tmp_path):
    cb = FreezeBackbone()
    for bad, key in [
        ({"internal_optimizer_metadata": {"0": [{"params": [1]}]}}, "params"),
        ({"internal_optimizer_metadata": {"0": [{"params": ["a"], "lr": "x"}]}}, "lr"),
        ({"held_batchnorms": "backbone"}, "held_batchnorms"),
        ([], "dict"),
    ]:
        with pytest.raises((TypeError, ValueError), match=key):
            cb.check_state_dict(bad)
    cb.check_state_dict(cb.state_dict())


# ------------------------------------------------------------------------ a plain optax alias vs Lightning
PLAIN = {  # configure_optimizers in both frameworks: (torch factory, optax alias)
    "adam": (lambda torch, params: torch.optim.Adam(params, lr=1e-2), lambda: optax.adam(1e-2)),
    "sgd_momentum": (
        lambda torch, params: torch.optim.SGD(params, lr=2e-2, momentum=0.9),
        lambda: optax.sgd(2e-2, momentum=0.9),
    ),
}
PLAIN_EPOCHS, PLAIN_TOL = 4, 1e-5


def _lightning_plain_run(kind: str, init: str) -> tuple[list[float], list[dict[str, np.ndarray]]]:
    pl = pytest.importorskip("pytorch_lightning")
    torch = pytest.importorskip("torch")
    from torch import nn

    from tests.gallery_lightning_programs import _quiet_lightning

    _quiet_lightning()

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.backbone = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
            self.head = nn.Linear(8, 1)
            torch.save(self.state_dict(), init)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return ((self.head(self.backbone(x)) - y) ** 2).mean()

        def configure_optimizers(self):
            return PLAIN[kind][0](torch, filter(lambda p: p.requires_grad, self.parameters()))

    class Unfreeze(pl.callbacks.BaseFinetuning):
        def freeze_before_training(self, pl_module):
            self.freeze(pl_module.backbone)

        def finetune_function(self, pl_module, epoch, optimizer):
            if epoch == 1:
                self.unfreeze_and_add_param_group(pl_module.backbone, optimizer)  # lr: group 0's / 10

    losses, params = [], []

    class Rec(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

        def on_train_epoch_end(self, trainer, pl_module):
            sd = pl_module.state_dict()
            params.append(
                {
                    "backbone/layers/0/kernel": sd["backbone.0.weight"].numpy().T.copy(),
                    "backbone/layers/0/bias": sd["backbone.0.bias"].numpy().copy(),
                    "head/kernel": sd["head.weight"].numpy().T.copy(),
                    "head/bias": sd["head.bias"].numpy().copy(),
                }
            )

    x = torch.from_numpy(np.concatenate([b[0] for b in data()]))
    y = torch.from_numpy(np.concatenate([b[1] for b in data()]))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    t = pl.Trainer(
        max_epochs=PLAIN_EPOCHS, callbacks=[Unfreeze(), Rec()], accelerator="cpu", enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, logger=False,
    )  # fmt: skip
    t.fit(Lit(), loader)
    return losses, params


@pytest.mark.parametrize("kind", sorted(PLAIN))
def test_unfreeze_with_a_plain_optax_alias_matches_lightning(tmp_path, kind):
    # configure_optimizers returns optax.adam(1e-2) / optax.sgd(2e-2, momentum=0.9), as torch's Adam / SGD is
    # written: the added group runs at group 0's rate / initial_denom_lr, as the alias's update times 1/10
    from jaxlight.migrate import load_torch_weights

    init = str(tmp_path / "init.pt")
    pl_losses, pl_params = _lightning_plain_run(kind, init)

    class Port(jl.LightningModule):
        def configure_model(self):
            rngs = nnx.Rngs(0)
            self.backbone = nnx.Sequential(nnx.Linear(4, 8, rngs=rngs), nnx.relu)
            self.head = nnx.Linear(8, 1, rngs=rngs)

        def on_fit_start(self):
            load_torch_weights(self, init)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return ((self.head(self.backbone(x)) - y) ** 2).mean()

        def configure_optimizers(self):
            return PLAIN[kind][1]()

    class Unfreeze(BaseFinetuning):
        def freeze_before_training(self, pl_module):
            self.freeze(pl_module.backbone)

        def finetune_function(self, pl_module, epoch, optimizer):
            if epoch == 1:
                self.unfreeze_and_add_param_group(pl_module.backbone, optimizer)

    losses, params = [], []

    class Rec(jl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

        def on_train_epoch_end(self, trainer, pl_module):
            params.append({k: np.array(v) for k, v in trainer.train_state.params.items()})

    cb = Unfreeze()
    trainer = jl.Trainer(max_epochs=PLAIN_EPOCHS, callbacks=[cb, Rec()], **quiet())
    trainer.fit(Port(), data())
    (group,) = trainer.engine.optimizer.groups
    assert group.lr is None and group.lr_scale == pytest.approx(0.1)
    assert cb.state_dict()["internal_optimizer_metadata"][0][1]["lr_scale"] == pytest.approx(0.1)
    np.testing.assert_allclose(losses, pl_losses, rtol=PLAIN_TOL, atol=PLAIN_TOL)
    assert len(params) == len(pl_params) == PLAIN_EPOCHS
    for epoch, (got, want) in enumerate(zip(params, pl_params)):
        for k, v in want.items():
            np.testing.assert_allclose(got[k], v, rtol=PLAIN_TOL, atol=PLAIN_TOL, err_msg=f"epoch {epoch} {k}")
    # the backbone moved after the unfreeze (not before)
    assert np.array_equal(params[0]["backbone/layers/0/kernel"], pl_params[0]["backbone/layers/0/kernel"])
    assert not np.allclose(params[1]["backbone/layers/0/kernel"], params[0]["backbone/layers/0/kernel"])
    assert trainer.compile_counts["train"] == 2


@pytest.mark.parametrize(
    "tx, named",
    [
        (lambda: optax.rprop(1e-2), "optax.rprop"),
        (lambda: optax.fromage(1e-2), "optax.fromage"),
        (lambda: optax.adam(optax.linear_schedule(1e-2, 0.0, 8)), "schedule"),
        (lambda: optax.chain(optax.adam(1e-2), optax.clip_by_global_norm(1.0)), "not a known optax alias"),
    ],
    ids=["rprop", "fromage", "scheduled_adam", "clip_after_adam"],
)
def test_a_plain_optimizer_whose_rate_does_not_only_scale_is_refused_by_name(tx, named):
    class Plain(Model):
        def configure_optimizers(self):
            return tx()

    trainer = jl.Trainer(max_epochs=2, callbacks=[FreezeBackbone(at=1)], **quiet())
    with pytest.raises(jl.MisconfigurationError, match=named) as err:
        trainer.fit(Plain(), data())
    assert "inject_hyperparams" in str(err.value)


def test_a_plain_alias_group_rate_cannot_be_set_and_resumes_bit_identically(tmp_path):
    class Plain(Model):
        def configure_optimizers(self):
            return optax.adamw(1e-2, weight_decay=0.1)

    class SetRate(FreezeBackbone):
        def finetune_function(self, pl_module, epoch, optimizer):
            super().finetune_function(pl_module, epoch, optimizer)
            if epoch == 2:
                assert optimizer.param_groups[-1]["lr"] is None  # a multiple of a rate in optax's closure
                optimizer.param_groups[-1]["lr"] = 1e-3

    with pytest.raises(jl.MisconfigurationError, match="0.1 times optimizer 0's"):
        jl.Trainer(max_epochs=3, callbacks=[SetRate(at=1)], **quiet()).fit(Plain(), data())
    # a resume after the unfreeze re-adds the group at its multiple (saved with the callback's state)
    ckpt = jl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), save_top_k=-1)
    full = jl.Trainer(max_epochs=3, callbacks=[FreezeBackbone(at=1), ckpt], **{**quiet(), "enable_checkpointing": True})
    full.fit(Plain(), data())
    resumed = jl.Trainer(max_epochs=3, callbacks=[FreezeBackbone(at=1)], **quiet())
    resumed.fit(Plain(), data(), ckpt_path=str(tmp_path / "ckpts" / "epoch=1-step=8.ckpt"))
    assert resumed.engine.optimizer.groups[0].lr_scale == pytest.approx(0.1)
    _assert_bit_identical(resumed, full)
