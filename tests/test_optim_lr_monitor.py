"""LearningRateMonitor finds injected learning rates anywhere in an optax optimizer and names them as Lightning does."""

import os

import numpy as np
import optax
import pytest

import jaxlight as jl
from jaxlight.callbacks import LearningRateMonitor, ModelCheckpoint
from tests.core_models import EagerClassifier, batches, make_data, quiet

X, Y = make_data(64)
DATA = batches(X, Y, 16)  # 4 batches
SCHED = optax.linear_schedule(1e-2, 1e-3, 8)


def returning(fn):
    return type("M", (EagerClassifier,), {"configure_optimizers": fn})


def run(fn, epochs=2, log_every=2, mon=None, **kw):
    mon = mon or LearningRateMonitor(**kw)
    trainer = jl.Trainer(
        max_epochs=epochs,
        devices=1,
        log_every_n_steps=log_every,
        callbacks=[mon],
        **quiet(logger=jl.loggers.CSVLogger("logs")),
    )
    trainer.fit(returning(fn)(), DATA)
    return mon, trainer


def lightning_events(epochs, n, log_every, epoch_start=True, step=True):
    """The global steps at which Lightning's monitor reads an optimizer: each epoch start (optimizers without a
    step-interval scheduler) and each batch start whose update is logged."""
    out = []
    for e in range(epochs):
        if epoch_start:
            out.append(e * n)
        for g in range(e * n, (e + 1) * n):
            if step and (g + 1) % log_every == 0:
                out.append(g)
    return out


def test_schedule_inside_chain_and_adamw_is_found():
    """The issue's case: a schedule behind clipping is not "a fixed learning rate" (injected, so the optimizer
    state holds it; a baked-in one is refused, tests/test_optim_inspect.py)."""
    mon, trainer = run(
        lambda self: optax.chain(
            optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adamw)(learning_rate=SCHED)
        )
    )
    assert list(mon.lrs) == ["lr-AdamW"]
    want = [float(SCHED(g)) for g in lightning_events(2, len(DATA), 2)]
    np.testing.assert_allclose(mon.lrs["lr-AdamW"], want, rtol=1e-6)
    # Lightning puts the values in callback_metrics too
    np.testing.assert_allclose(float(trainer.callback_metrics["lr-AdamW"]), want[-1], rtol=1e-6)


def test_injected_schedule_is_the_rate_of_the_next_update():
    mon, _ = run(lambda self: optax.inject_hyperparams(optax.adamw)(learning_rate=SCHED))
    want = [float(SCHED(g)) for g in lightning_events(2, len(DATA), 2)]
    np.testing.assert_allclose(mon.lrs["lr-AdamW"], want, rtol=1e-6)


def test_step_interval_scheduler_is_logged_at_the_step_cadence_only():
    mon, _ = run(
        lambda self: {
            "optimizer": optax.inject_hyperparams(optax.sgd)(learning_rate=SCHED),
            "lr_scheduler": {"scheduler": SCHED, "name": "my-lr"},
        }
    )
    want = [float(SCHED(g)) for g in lightning_events(2, len(DATA), 2, epoch_start=False)]
    assert list(mon.lrs) == ["my-lr"]
    np.testing.assert_allclose(mon.lrs["my-lr"], want, rtol=1e-6)


def test_names_of_groups_and_of_several_optimizers():
    groups = lambda self: jl.optim.param_groups(
        optax.sgd, [{"params": self.net.l1}, {"params": self.net.l2, "lr": 1e-3}], learning_rate=0.1
    )
    mon, _ = run(groups, epochs=1, logging_interval="epoch")
    assert mon.lrs == {"lr-SGD/pg1": [pytest.approx(0.1)], "lr-SGD/pg2": [pytest.approx(1e-3)]}

    named = lambda self: jl.optim.param_groups(optax.adam, [{"params": self.net, "name": "all"}], learning_rate=0.1)
    mon, _ = run(named, epochs=1, logging_interval="epoch")
    assert list(mon.lrs) == ["lr-Adam/all"]

    two = lambda self: [
        {"optimizer": optax.inject_hyperparams(optax.adam)(learning_rate=1e-2), "params": self.net.l1},
        {"optimizer": optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), "params": self.net.l2},
    ]
    mon, _ = run(two, epochs=1, logging_interval="epoch")
    assert mon.lrs == {"lr-Adam": [pytest.approx(1e-2)], "lr-Adam-1": [pytest.approx(1e-3)]}


def test_momentum_and_weight_decay():
    mon, trainer = run(
        lambda self: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3, b1=0.8, weight_decay=0.05),
        epochs=1,
        logging_interval="epoch",
        log_momentum=True,
        log_weight_decay=True,
    )
    assert mon.last_momentum_values == {"lr-AdamW-momentum": pytest.approx(0.8)}
    assert mon.last_weight_decay_values == {"lr-AdamW-weight_decay": pytest.approx(0.05)}
    assert float(trainer.callback_metrics["lr-AdamW-momentum"]) == pytest.approx(0.8)


def test_lr_in_callback_metrics_serves_checkpoint_monitor_and_file_names(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="lr-SGD", mode="min", filename="{epoch}-{lr-SGD:.4f}")
    mon = LearningRateMonitor()
    trainer = jl.Trainer(
        max_epochs=2,
        devices=1,
        log_every_n_steps=2,
        callbacks=[mon, ckpt],
        **quiet(logger=jl.loggers.CSVLogger("logs"), enable_checkpointing=True),
    )
    trainer.fit(returning(lambda self: optax.inject_hyperparams(optax.sgd)(learning_rate=SCHED))(), DATA)
    last = mon.lrs["lr-SGD"][-1]
    assert float(ckpt.best_model_score) == pytest.approx(last, rel=1e-6)
    assert f"lr-SGD={last:.4f}" in os.path.basename(ckpt.best_model_path)


def test_a_transformation_without_a_learning_rate_is_refused():
    with pytest.raises(jl.MisconfigurationError, match="cannot find a learning rate"):
        run(lambda self: optax.scale_by_adam())
    with pytest.raises(jl.MisconfigurationError, match="no logger"):
        jl.Trainer(max_epochs=1, devices=1, callbacks=[LearningRateMonitor()], **quiet()).fit(
            returning(lambda self: optax.sgd(0.1))(), DATA
        )


# ------------------------------------------------------------------------------- the same program through Lightning
LIGHTNING_CASES = ["sgd", "adam_sched", "adamw", "groups", "named_groups", "manual"]


def _lightning_run(kind, tmp_path):
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F

    class PLModel(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.l1 = torch.nn.Linear(8, 16)
            self.l2 = torch.nn.Linear(16, 4)
            self.automatic_optimization = kind != "manual"

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.l2(F.relu(self.l1(x))), y.long())
            if kind != "manual":
                return loss
            o1, o2 = self.optimizers()
            o1.zero_grad()
            o2.zero_grad()
            self.manual_backward(loss)
            o1.step()
            o2.step()
            return None

        def configure_optimizers(self):
            if kind == "sgd":
                return torch.optim.SGD(self.parameters(), lr=0.1)
            if kind == "adam_sched":
                opt = torch.optim.Adam(self.parameters(), lr=1e-2)
                sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: float(SCHED(s)) / 1e-2)
                return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
            if kind == "adamw":
                return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)
            if kind in ("groups", "named_groups"):
                g1, g2 = {"params": self.l1.parameters()}, {"params": self.l2.parameters(), "lr": 1e-3}
                if kind == "named_groups":
                    g1["name"], g2["name"] = "body", "head"
                return torch.optim.SGD([g1, g2], lr=0.1, momentum=0.9)
            return [torch.optim.SGD(self.l1.parameters(), lr=0.1), torch.optim.SGD(self.l2.parameters(), lr=0.01)]

    ds = torch.utils.data.TensorDataset(torch.tensor(X), torch.tensor(Y))
    mon = pl.callbacks.LearningRateMonitor(log_momentum=True, log_weight_decay=True)
    trainer = pl.Trainer(
        max_epochs=2,
        log_every_n_steps=2,
        callbacks=[mon],
        logger=pl.loggers.CSVLogger(str(tmp_path / "pl")),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(PLModel(), torch.utils.data.DataLoader(ds, batch_size=16))
    return mon, {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("lr-")}


class _Manual(EagerClassifier):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        o1, o2 = self.optimizers()
        from tests.core_models import xent

        loss, grads = self.manual_backward(lambda: xent(self.net(x), y))
        o1.step(grads)
        o2.step(grads)
        return loss

    def configure_optimizers(self):
        return [
            {"optimizer": optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), "params": self.net.l1},
            {"optimizer": optax.inject_hyperparams(optax.sgd)(learning_rate=0.01), "params": self.net.l2},
        ]


def _jaxlight_run(kind):
    def groups(self, named):
        g1, g2 = {"params": self.net.l1}, {"params": self.net.l2, "lr": 1e-3}
        if named:
            g1["name"], g2["name"] = "body", "head"
        return jl.optim.param_groups(optax.sgd, [g1, g2], learning_rate=0.1, momentum=0.9)

    returned = {
        "sgd": lambda self: optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
        "adam_sched": lambda self: {
            "optimizer": optax.inject_hyperparams(optax.adam)(learning_rate=SCHED),
            "lr_scheduler": SCHED,
        },
        "adamw": lambda self: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3, weight_decay=0.01),
        "groups": lambda self: groups(self, False),
        "named_groups": lambda self: groups(self, True),
    }
    mon = LearningRateMonitor(log_momentum=True, log_weight_decay=True)
    trainer = jl.Trainer(
        max_epochs=2, devices=1, log_every_n_steps=2, callbacks=[mon], **quiet(logger=jl.loggers.CSVLogger("logs"))
    )
    model = _Manual() if kind == "manual" else returning(returned[kind])()
    trainer.fit(model, DATA)
    return mon, {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("lr-")}


@pytest.mark.slow
@pytest.mark.parametrize("kind", LIGHTNING_CASES)
def test_same_names_values_and_callback_metrics_as_lightning(kind, tmp_path):
    pl_mon, pl_metrics = _lightning_run(kind, tmp_path)
    jl_mon, jl_metrics = _jaxlight_run(kind)
    assert list(jl_mon.lrs) == list(pl_mon.lrs)
    for name in pl_mon.lrs:
        np.testing.assert_allclose(jl_mon.lrs[name], pl_mon.lrs[name], rtol=1e-6, err_msg=name)
    assert sorted(jl_metrics) == sorted(pl_metrics)
    for name, v in pl_metrics.items():
        assert jl_metrics[name] == pytest.approx(v, rel=1e-6), name
