"""Hyperparameters are read and written through ``optax.tree_utils`` on the injected state, with no update run.

Reading a learning rate (``LearningRateMonitor``, ``BaseFinetuning``, a param group's ``"lr"``) must not
run the optimizer: the read is a handful of scalar operations on the state (its jaxpr holds no array of a
parameter's shape), it works on abstract state, and the optimizer's ``update`` is never called. The one
exception is a schedule given to ``inject_hyperparams`` itself, whose next value only optax's update can
compute (the function lives in optax's closure). Writes (``tree_set``) are what the next update uses.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxlight as jl
from jaxlight.optim.finetune import set_learning_rates
from jaxlight.optim.schedules import driven_states, hyperparams_with_path, set_hyperparam

SCHED = optax.linear_schedule(1e-2, 1e-3, 8)
PARAMS = {"net/a/kernel": jnp.ones((3, 2)), "net/b/bias": jnp.ones(2)}
GRADS = jax.tree.map(jnp.ones_like, PARAMS)


class Counted:
    """An optax transformation that counts its ``update`` calls (traced or not)."""

    def __init__(self, tx):
        self.calls = 0
        self.tx = optax.with_extra_args_support(tx)

    def transformation(self):
        def update(updates, state, params=None, **extra):
            self.calls += 1
            return self.tx.update(updates, state, params, **extra)

        return optax.GradientTransformationExtraArgs(self.tx.init, update)


def _plateau():
    return optax.contrib.reduce_on_plateau(factor=0.5, patience=0)


FORMS = {
    "injected number": lambda tx: tx(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.8)),
    "driven by a step schedule": lambda tx: {
        "optimizer": tx(optax.inject_hyperparams(optax.adamw)(learning_rate=0.1)),
        "lr_scheduler": {"scheduler": SCHED, "frequency": 2},
    },
    "schedule named for a baked-in rate": lambda tx: {"optimizer": tx(optax.adam(SCHED)), "lr_scheduler": SCHED},
    "partition of injected groups": lambda tx: tx(
        optax.partition(
            {
                "a": optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.8),
                "b": optax.inject_hyperparams(optax.adam)(learning_rate=0.01),
            },
            lambda tree: {k: "a" if "/a/" in k else "b" for k in tree},
        )
    ),
    "plateau scale": lambda tx: {
        "optimizer": tx(optax.inject_hyperparams(optax.adam)(learning_rate=0.01)),
        "lr_scheduler": {"scheduler": _plateau(), "monitor": "val"},
    },
}
EXPECTED_LR = {  # after 3 updates
    "injected number": [0.1],
    "driven by a step schedule": [float(SCHED(3 // 2))],
    "schedule named for a baked-in rate": [float(SCHED(3))],
    "partition of injected groups": [0.1, 0.01],
    "plateau scale": [0.01],
}


def _scalars_only(jaxpr):
    """Every value a jaxpr (and the jaxprs inside it) computes is a scalar: no optimizer update ran."""
    shapes = []
    for eqn in jaxpr.eqns:
        shapes += [tuple(v.aval.shape) for v in eqn.outvars]
        for p in eqn.params.values():
            inner = getattr(p, "jaxpr", p)
            if hasattr(inner, "eqns"):
                shapes += [s for s in _scalars_only(inner) if s]
    return [s for s in shapes if s]


@pytest.mark.parametrize("form", list(FORMS))
def test_reading_rates_runs_no_update(form):
    counted = []

    def wrap(tx):
        counted.append(Counted(tx))
        return counted[-1].transformation()

    cfg = jl.optim.configure(FORMS[form](wrap)).build(None, PARAMS)
    state = cfg.tx.init(PARAMS)
    for _ in range(3):
        _, state = cfg.tx.update(GRADS, state, PARAMS)
    (c,) = counted
    assert c.calls == 3
    opt = cfg.optimizers[0]
    info = cfg.inspect_one(opt, state, PARAMS)
    got = info.values(opt.state_of(state))
    assert [float(g["lr"]) for g in got] == pytest.approx(EXPECTED_LR[form])
    assert c.calls == 3, f"reading the rates of {form!r} ran the optimizer's update {c.calls - 3} time(s)"
    # the read is scalar arithmetic on the state, and needs no values: it runs on abstract state too
    big = _scalars_only(jax.make_jaxpr(info.values)(opt.state_of(state)).jaxpr)
    assert not big, f"the read of {form!r} computes arrays of shapes {big}"
    shapes = jax.eval_shape(cfg.tx.init, PARAMS)
    abstract = jax.eval_shape(info.values, opt.state_of(shapes))
    assert [a["lr"].shape for a in abstract] == [()] * len(EXPECTED_LR[form])
    assert c.calls == 3


def test_a_schedule_given_to_inject_hyperparams_is_the_one_read_through_an_update():
    """optax keeps that schedule in a closure: its next value comes from optax's own update (jitted, on zero
    updates), and the value is the next update's, not the stored one."""
    c = Counted(optax.inject_hyperparams(optax.adamw)(learning_rate=SCHED))
    cfg = jl.optim.configure(c.transformation()).build(None, PARAMS)
    state = cfg.tx.init(PARAMS)
    for _ in range(3):
        _, state = cfg.tx.update(GRADS, state, PARAMS)
    stored = hyperparams_with_path(state, "learning_rate")
    assert [float(v) for v in stored.values()] == pytest.approx([float(SCHED(2))])  # what the last update used
    info = cfg.inspect_one(cfg.optimizers[0], state, PARAMS)
    assert float(info.values(state)[0]["lr"]) == pytest.approx(float(SCHED(3)))
    assert c.calls == 4  # three steps, one traced read


def test_tree_set_writes_land_in_the_next_update():
    groups = optax.partition(
        {
            "a": optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
            "b": optax.inject_hyperparams(optax.sgd)(learning_rate=0.01),
        },
        lambda tree: {k: "a" if "/a/" in k else "b" for k in tree},
    )
    state = groups.init(PARAMS)
    paths = list(driven_states(state))
    assert len(paths) == 2
    # one group's rate, by its path: the other group keeps its own
    state = set_hyperparam(state, paths[0], "learning_rate", jnp.float32(0.5))
    updates, state = jax.jit(groups.update)(GRADS, state, PARAMS)
    np.testing.assert_allclose(updates["net/a/kernel"], -0.5 * np.ones((3, 2)))
    np.testing.assert_allclose(updates["net/b/bias"], -0.01 * np.ones(2), rtol=1e-6)

    # BaseFinetuning's writer: each target's rate, placed like the old one, dtype kept
    state = set_learning_rates(state, [(lambda s: s.inner_states["b"], 0.25)])
    assert [float(v) for v in hyperparams_with_path(state, "learning_rate").values()] == [0.5, 0.25]
    assert all(v.dtype == jnp.float32 for v in hyperparams_with_path(state, "learning_rate").values())
    updates, _ = groups.update(GRADS, state, PARAMS)
    np.testing.assert_allclose(updates["net/b/bias"], -0.25 * np.ones(2))

    # and the reader reports the written values, as the next update uses them
    cfg = jl.optim.configure(groups).build(None, PARAMS)
    info = cfg.inspect_one(cfg.optimizers[0], state, PARAMS)
    assert [float(g["lr"]) for g in info.values(state)] == [0.5, 0.25]
