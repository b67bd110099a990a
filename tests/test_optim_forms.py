"""configure_optimizers' return forms: each trains exactly as the optax program it stands for."""

import jax
import optax
import pytest
from flax import nnx

import jaxlight as jl
from tests.core_models import EagerClassifier, batches, hand_loop, make_data, max_diff, quiet

DATA = batches(*make_data(64), 16)  # 4 batches
SCHED = optax.linear_schedule(1e-2, 1e-3, 4)


def fit(returned, epochs=1, **kw):
    class M(EagerClassifier):
        def configure_optimizers(self):
            return (
                returned(self)
                if callable(returned) and not isinstance(returned, optax.GradientTransformation)
                else returned
            )

    model = M()
    trainer = jl.Trainer(max_epochs=epochs, devices=kw.pop("devices", 1), **quiet(**kw))
    trainer.fit(model, DATA)
    return nnx.state(model.net, nnx.Param), trainer


def by_layer(enc, head):
    """A hand-written optax.partition over the MLP's nnx.State: l1 -> ``enc``, l2 -> ``head``."""
    label = lambda p: jax.tree_util.tree_map_with_path(lambda path, _: "enc" if "'l1'" in str(path) else "head", p)
    return optax.multi_transform({"enc": enc, "head": head}, label)


@pytest.mark.parametrize("inject", [True, False])
def test_lightning_list_form_with_a_scheduler(inject):
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2) if inject else optax.adam(SCHED)
    got, trainer = fit(([tx], [SCHED]))
    ref, _, _ = hand_loop(optax.adam(SCHED), DATA)
    assert max_diff(got, ref) <= 1e-6
    assert trainer.lr_scheduler_configs == [SCHED]
    if inject:  # only the scheduler entry can make the injected 1e-2 follow the schedule
        fixed, _, _ = hand_loop(optax.adam(1e-2), DATA)
        assert max_diff(got, fixed) > 1e-4


def test_scheduler_dict_with_frequency_counts_every_nth_step():
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=1.0)
    got, _ = fit({"optimizer": tx, "lr_scheduler": {"scheduler": SCHED, "frequency": 2}})
    ref, _, _ = hand_loop(optax.sgd(lambda n: SCHED(n // 2)), DATA)
    assert max_diff(got, ref) <= 1e-6


def test_epoch_interval_sets_the_rate_once_per_epoch():
    per_epoch = lambda e: 0.1 * 0.5**e
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=123.0)  # overwritten before the first update
    got, trainer = fit({"optimizer": tx, "lr_scheduler": {"scheduler": per_epoch, "interval": "epoch"}}, epochs=3)
    ref, _, _ = hand_loop(optax.sgd(lambda n: 0.1 * 0.5 ** (n // len(DATA))), DATA * 3)
    assert max_diff(got, ref) <= 1e-6
    assert trainer.compile_counts["train"] == 1


def test_optimizers_per_parameter_subset_apply_together():
    """[{"optimizer": tx, "params": selector}, ...] with automatic optimization: one update, each optimizer on
    its own parameters (an NNX module selector as torch's ``self.net.l1.parameters()``, a path prefix)."""
    got, trainer = fit(
        lambda self: [
            {"optimizer": optax.adam(1e-2), "params": self.net.l1},
            {"optimizer": optax.sgd(0.1, momentum=0.9), "params": "net/l2"},
        ]
    )
    ref, _, _ = hand_loop(by_layer(optax.adam(1e-2), optax.sgd(0.1, momentum=0.9)), DATA)
    assert max_diff(got, ref) <= 1e-6
    both_adam, _, _ = hand_loop(optax.adam(1e-2), DATA)
    assert max_diff(got, both_adam) > 1e-4


def test_param_groups_as_torch_writes_them():
    got, _ = fit(
        lambda self: jl.optim.param_groups(
            optax.sgd,
            [{"params": self.net.l1}, {"params": "net/l2/*", "lr": 1e-3, "name": "head"}],
            learning_rate=0.1,
            momentum=0.9,
        )
    )
    ref, _, _ = hand_loop(by_layer(optax.sgd(0.1, momentum=0.9), optax.sgd(1e-3, momentum=0.9)), DATA)
    assert max_diff(got, ref) <= 1e-6


def test_parameters_no_group_selects_stay_fixed():
    before = nnx.state(EagerClassifier().net, nnx.Param)
    got, _ = fit(lambda self: jl.optim.param_groups(optax.adam, [{"params": self.net.l1}], learning_rate=1e-2))
    assert max_diff(got["l2"], before["l2"]) == 0.0
    assert max_diff(got["l1"], before["l1"]) > 1e-3


def test_optimizer_state_mirrors_parameters_under_fsdp():
    _, trainer = fit(
        lambda self: jl.optim.param_groups(
            optax.adam, [{"params": self.net.l1}, {"params": self.net.l2, "lr": 1e-3}], learning_rate=1e-2
        ),
        devices=8,
        strategy=jl.strategies.FSDP(min_shard=16),
    )
    state, params = trainer.train_state.opt_state, trainer.train_state.params
    mu = state.inner_states["pg1"].inner_state.inner_state[0].mu["net/l1/kernel"]
    assert "fsdp" in jax.tree.leaves(tuple(params["net/l1/kernel"].sharding.spec))
    assert mu.sharding == params["net/l1/kernel"].sharding


def test_none_trains_nothing_with_a_warning():
    before = nnx.state(EagerClassifier().net, nnx.Param)
    with pytest.warns(UserWarning, match="no optimizer"):
        got, _ = fit(lambda self: None)
    assert max_diff(got, before) == 0.0


@pytest.mark.parametrize(
    ("returned", "match"),
    [
        ("adam", "optax.GradientTransformation or one of Lightning.s forms; got str"),
        ({"optimizer": optax.adam(1e-3), "lr_schedular": SCHED}, r"unknown key\(s\) \['lr_schedular'\]"),
        ({"optimizer": optax.adam(1e-3), "lr_scheduler": {"scheduler": SCHED, "interval": "batch"}}, "interval"),
        ({"optimizer": optax.adam(1e-3), "lr_scheduler": {"scheduler": SCHED, "interval": "epoch"}}, "inject"),
        ({"optimizer": optax.adam(1e-3), "lr_scheduler": optax.contrib.reduce_on_plateau()}, "include a monitor"),
        (optax.chain(optax.adam(1e-3), optax.contrib.reduce_on_plateau()), "needs a monitored metric"),
        (([optax.adam(1e-3)], [SCHED, SCHED]), "at most one per optimizer"),
        ([{"optimizer": optax.adam(1e-3), "params": "net/l3"}], r"matches no parameter; .*'net/l1'"),
        (
            [{"optimizer": optax.adam(1e-3), "params": "net"}, {"optimizer": optax.sgd(1e-3), "params": "net/l2"}],
            "selected by both",
        ),
        (lambda self: jl.optim.param_groups(optax.sgd, [{"params": "net", "momentun": 0.9}]), "has no argument"),
    ],
)
def test_bad_returns_are_refused_with_the_reason(returned, match):
    with pytest.raises(jl.MisconfigurationError, match=match):
        fit(returned)
