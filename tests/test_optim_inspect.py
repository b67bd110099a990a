"""Learning rates are read from the optax *state* (public optax API), never from optax's closures.

The forms a closure reader used to cover are read here through the state: an injected rate behind
clipping, parameter groups of ``optax.partition``, an ``inject_hyperparams`` schedule built by the user
(the rate of the *next* update), a schedule named as ``lr_scheduler``, plateau scales. A rate that lives
only in a closure is reported as unreadable rather than guessed.
"""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxlight as jl
from jaxlight.callbacks import LearningRateMonitor
from jaxlight.optim.schedules import plateau_states, plateau_stepper
from tests.core_models import EagerClassifier, batches, make_data, quiet

SCHED = optax.linear_schedule(1e-2, 1e-3, 8)
PARAMS = {"net/a/kernel": jnp.ones((3, 2)), "net/b/bias": jnp.ones(2)}
ROOT = Path(__file__).resolve().parent.parent / "jaxlight"


def built(returned, **kw):
    return jl.optim.configure(returned, **kw).build(None, PARAMS)


def stepped(cfg, n):
    """The optimizer state after ``n`` updates of ``cfg.tx``."""
    state = cfg.tx.init(PARAMS)
    grads = jax.tree.map(jnp.ones_like, PARAMS)
    for _ in range(n):
        _, state = cfg.tx.update(grads, state, PARAMS)
    return state


def read(cfg, state, i=0):
    info = cfg.inspect_one(cfg.optimizers[i], state, PARAMS)
    got = info.values(cfg.optimizers[i].state_of(state))
    return info, [{k: float(v) for k, v in g.items()} for g in got]


def test_no_closure_or_private_optax_reads_in_the_optimizer_code():
    files = [
        *sorted((ROOT / "optim").glob("*.py")),
        ROOT / "callbacks/lr_monitor.py",
        ROOT / "callbacks/lr_scheduler.py",
    ]
    assert not (ROOT / "optim.py").exists()
    for f in files:
        text = f.read_text()
        for banned in ("__closure__", "cell_contents", "co_freevars", "__qualname__", "optax._src", "_src."):
            assert banned not in text, f"{f.name} uses {banned}"
    for f in ROOT.rglob("*.py"):  # nowhere in the package
        assert not re.search(r"__closure__|cell_contents|optax\._src", f.read_text()), f


def test_injected_rate_behind_clipping_is_the_next_updates():
    cfg = built(optax.chain(optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adamw)(learning_rate=SCHED)))
    for n in (0, 1, 5):
        info, got = read(cfg, stepped(cfg, n))
        assert [g.name for g in info.optimized_groups] == ["AdamW"]
        assert got[0]["lr"] == pytest.approx(float(SCHED(n)))  # the stored one is SCHED(n - 1)
        assert got[0]["momentum"] == pytest.approx(0.9) and got[0]["weight_decay"] == pytest.approx(1e-4)


def test_schedule_baked_into_the_optimizer_is_read_when_named_and_refused_when_not():
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(SCHED))
    cfg = built({"optimizer": tx, "lr_scheduler": SCHED})
    info, got = read(cfg, stepped(cfg, 3))
    assert info.optimized_groups[0].name == "Adam" and got[0]["lr"] == pytest.approx(float(SCHED(3)))
    assert "momentum" not in got[0]  # b1 is in optax's closure: not logged, not guessed
    cfg = built(tx)
    info, got = read(cfg, stepped(cfg, 3))
    assert not info.optimized_groups[0].readable and "lr" not in got[0]


def test_partition_groups_and_param_groups():
    user = optax.partition(
        {
            "a": optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.8),
            "b": optax.inject_hyperparams(optax.adam)(learning_rate=0.01),
        },
        lambda tree: {k: "a" if "/a/" in k else "b" for k in tree},
    )
    info, got = read(built(user), stepped(built(user), 2))
    assert [(g.label, g.name) for g in info.optimized_groups] == [("a", "SGD"), ("b", "Adam")]
    assert [g["lr"] for g in got] == pytest.approx([0.1, 0.01])
    assert [g["momentum"] for g in got] == pytest.approx([0.8, 0.9])

    groups = jl.optim.param_groups(
        optax.sgd,
        [{"params": "net/a", "name": "body"}, {"params": "net/b", "lr": 1e-3}],
        learning_rate=0.1,
        momentum=0.9,
    )
    cfg = built(groups)
    info, got = read(cfg, stepped(cfg, 1))
    assert [(g.label, g.explicit, g.name) for g in info.optimized_groups] == [
        ("body", True, "SGD"),
        ("pg2", False, "SGD"),
    ]
    assert [g["lr"] for g in got] == pytest.approx([0.1, 1e-3])
    assert [g["momentum"] for g in got] == pytest.approx([0.9, 0.9])  # static arguments jaxlight passed itself
    assert [g["weight_decay"] for g in got] == [0.0, 0.0]


def test_several_optimizers_with_params_and_a_plateau_scale():
    plateau = optax.contrib.reduce_on_plateau(factor=0.5, patience=0)
    cfg = built(
        [
            {"optimizer": optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), "params": "net/a"},
            {
                "optimizer": optax.inject_hyperparams(optax.adam)(learning_rate=0.01),
                "params": "net/b",
                "lr_scheduler": {"scheduler": plateau, "monitor": "val"},
            },
        ],
        gradient_clip_val=1.0,
        accumulate_grad_batches=2,
    )
    state = stepped(cfg, 4)
    # the plateau, stepped as optax steps it, through the optimizer's own update
    opt = cfg.optimizers[1]
    step = jax.jit(plateau_stepper(opt.tx, opt.updates_like(PARAMS), cfg.schedulers[0].plateau_nodes))
    want = plateau_states(opt.state_of(state))[0]
    for v in (1.0, 2.0, 3.0):
        state = _with_plateaus(state, step(opt.state_of(state), v))
        want = plateau.update({}, want, value=jnp.float32(v))[1]
    (node,) = plateau_states(state)
    np.testing.assert_allclose(float(node.scale), float(want.scale))
    assert float(node.scale) < 1
    _, got = read(cfg, state, 1)
    assert got[0]["lr"] == pytest.approx(0.01 * float(want.scale))
    _, got = read(cfg, state, 0)
    assert got[0]["lr"] == pytest.approx(0.1)


def _with_plateaus(state, nodes):
    """``state`` with its plateau states replaced by ``nodes``, in order."""
    new = iter(nodes)
    is_p = lambda n: isinstance(n, optax.contrib.ReduceLROnPlateauState)
    return jax.tree.map(lambda n: next(new) if is_p(n) else n, state, is_leaf=is_p)


def test_monitor_logs_what_it_can_and_warns_once_naming_the_rest():
    class Two(EagerClassifier):
        def configure_optimizers(self):
            return [
                {"optimizer": optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), "params": self.net.l1},
                {"optimizer": optax.adam(1e-3), "params": self.net.l2},  # its rate is in optax's closure
            ]

    mon = LearningRateMonitor(logging_interval="epoch")
    trainer = jl.Trainer(max_epochs=2, devices=1, callbacks=[mon], **quiet(logger=jl.loggers.CSVLogger("logs")))
    with pytest.warns(UserWarning, match=r"does not log the learning rate of optimizer 1 \(Adam\).*inject_hyperparams"):
        trainer.fit(Two(), batches(*make_data(32), 16))
    assert mon.lrs == {"lr-SGD": [pytest.approx(0.1)] * 2}


def test_reads_and_plateau_steps_work_on_offloaded_optimizer_state():
    """HostOffload keeps the optimizer state in host memory: the reads and the plateau step copy only the
    scalars they need to the device, and give what they give without offloading."""

    class Plateau(EagerClassifier):
        def validation_step(self, batch, batch_idx):
            self.log("val_const", jnp.float32(1.0))

        def configure_optimizers(self):
            adam = optax.inject_hyperparams(optax.adam)(learning_rate=SCHED)
            plateau = optax.contrib.reduce_on_plateau(factor=0.5, patience=0)
            return {"optimizer": adam, "lr_scheduler": {"scheduler": plateau, "monitor": "val_const"}}

    data = batches(*make_data(64), 16)
    got = []
    for strategy in (jl.strategies.FSDP(), jl.strategies.FSDP() + jl.strategies.HostOffload()):
        mon = LearningRateMonitor(log_momentum=True)
        trainer = jl.Trainer(
            max_epochs=3, strategy=strategy, callbacks=[mon], **quiet(logger=jl.loggers.CSVLogger("logs"))
        )
        trainer.fit(Plateau(), data, val_dataloaders=data[:1])
        got.append((mon.lrs, mon.last_momentum_values, float(plateau_states(trainer.train_state.opt_state)[0].scale)))
    assert got[1] == got[0]
    assert got[0][2] < 1 and len(got[0][0]["lr-Adam"]) == 3  # the plateau acted
