"""LearningRateMonitor and Preemption driven from hand-made StepInfo streams, with no Trainer at all.

The monitor reads the rates from ``info.optimizer`` (the built optimizer config) and ``info.state.opt_state``;
Preemption decides where to stop from ``info.micro_batches`` and the signal it recorded. The optimizer here is
built and stepped by hand (optax), the multi-process key-value store is a dict.
"""

import signal

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxlight as jl
from jaxlight import distributed
from jaxlight.callbacks import LearningRateMonitor, Preemption
from jaxlight.callbacks.preemption import AGREE_MARGIN
from jaxlight.errors import MisconfigurationError
from jaxlight.optim.configure import configure
from jaxlight.step import TrainState
from jaxlight.step_info import StepInfo

PARAMS = {"base/w": jnp.ones((3,)), "head/w": jnp.ones((2,))}
SCHED = optax.linear_schedule(1e-2, 1e-3, 8)
HEAD_LR = 1e-3
LOGGER = (object(),)  # the monitor only asks whether there is one


def built(out):
    """What configure_optimizers returned, built against PARAMS as fit does, and its initial optax state."""
    config = configure(out).build(None, PARAMS)
    return config, config.tx.init(PARAMS)


def opt_states(config, state, n):
    """The optax state after 0, 1, ..., n - 1 updates (constant gradients)."""
    grads = jax.tree.map(jnp.ones_like, PARAMS)
    out = []
    for _ in range(n):
        out.append(state)
        _, state = config.tx.update(grads, state, PARAMS)
    return out


def grouped_sgd():
    return jl.optim.param_groups(
        optax.sgd,
        [{"params": "base"}, {"params": "head", "lr": HEAD_LR, "name": "head"}],
        learning_rate=SCHED,
        momentum=0.9,
    )


def infos_for(config, states, **kw):
    """One train-batch info per optimizer step g (no accumulation: the batch starting update g)."""
    return [
        StepInfo(
            stage="train", global_step=g, optimizer=config, state=TrainState(PARAMS, {}, s, {}, jnp.int32(g)), **kw
        )
        for g, s in enumerate(states)
    ]


# ---------------------------------------------------------------------------- LearningRateMonitor
def test_monitor_logs_the_rates_the_optax_state_holds_at_the_logging_cadence_per_group():
    config, state = built(grouped_sgd())
    infos = infos_for(config, opt_states(config, state, 8), loggers=LOGGER, log_every_n_steps=3)
    mon = LearningRateMonitor(log_momentum=True)
    mon.start(infos[0])
    assert list(mon.lrs) == ["lr-SGD/pg1", "lr-SGD/head"]
    logged = {g: got for g, info in enumerate(infos) if (got := mon.at_batch_start(info))}
    # the trainer logs update g when (g + 1) % 3 == 0: batches 2 and 5 read the rate their update uses
    assert sorted(logged) == [2, 5]
    for g, got in logged.items():
        assert got["lr-SGD/pg1"] == pytest.approx(float(SCHED(g)), rel=1e-6)
        assert got["lr-SGD/head"] == pytest.approx(HEAD_LR, rel=1e-6)
        assert got["lr-SGD/pg1-momentum"] == pytest.approx(0.9, rel=1e-6)
    assert mon.lrs["lr-SGD/pg1"] == pytest.approx([float(SCHED(2)), float(SCHED(5))], rel=1e-6)
    assert mon.last_momentum_values["lr-SGD/head-momentum"] == pytest.approx(0.9, rel=1e-6)
    # an optimizer without scheduler is logged at each epoch start too
    assert mon.at_epoch_start(infos[4])["lr-SGD/pg1"] == pytest.approx(float(SCHED(4)), rel=1e-6)
    assert len(mon.lrs["lr-SGD/pg1"]) == 3


def test_monitor_logs_off_cadence_when_a_stop_is_requested_and_follows_logging_interval():
    config, state = built(optax.inject_hyperparams(optax.adamw)(learning_rate=SCHED))
    info = infos_for(config, opt_states(config, state, 2), loggers=LOGGER, log_every_n_steps=50)[1]
    mon = LearningRateMonitor()
    mon.start(info)
    assert mon.at_batch_start(info) == {}  # update 1 is not logged with log_every_n_steps=50
    stopping = StepInfo(**{**info.__dict__, "should_stop": True})
    assert mon.at_batch_start(stopping) == {"lr-AdamW": pytest.approx(float(SCHED(1)), rel=1e-6)}
    by_epoch = LearningRateMonitor(logging_interval="epoch")
    by_epoch.start(info)
    assert by_epoch.at_batch_start(stopping) == {}
    assert by_epoch.at_epoch_start(info) == {"lr-AdamW": pytest.approx(float(SCHED(1)), rel=1e-6)}
    by_step = LearningRateMonitor(logging_interval="step")
    by_step.start(info)
    assert by_step.at_epoch_start(info) == {} and by_step.lrs == {"lr-AdamW": []}


def test_monitor_names_a_scheduler_and_logs_a_step_scheduler_at_the_step_cadence_only():
    config, state = built(
        [
            {
                "optimizer": optax.inject_hyperparams(optax.sgd)(learning_rate=SCHED),
                "lr_scheduler": SCHED,
                "params": "base",
            },
            {"optimizer": optax.inject_hyperparams(optax.sgd)(learning_rate=0.5), "params": "head"},
        ]
    )
    infos = infos_for(config, opt_states(config, state, 4), loggers=LOGGER, log_every_n_steps=2)
    mon = LearningRateMonitor()
    mon.start(infos[0])
    assert list(mon.lrs) == ["lr-SGD", "lr-SGD-1"]  # the scheduled optimizer first, then the second SGD
    assert mon.at_epoch_start(infos[0]) == {"lr-SGD-1": pytest.approx(0.5)}  # no epoch read of a step scheduler
    assert mon.at_batch_start(infos[3]) == {
        "lr-SGD": pytest.approx(float(SCHED(3)), rel=1e-6),
        "lr-SGD-1": pytest.approx(0.5),
    }


def test_monitor_refusals_from_infos():
    config, state = built(grouped_sgd())
    info = infos_for(config, [state])[0]
    with pytest.raises(MisconfigurationError, match="Cannot use `LearningRateMonitor` callback with `Trainer` that"):
        LearningRateMonitor().start(info)  # no logger
    LearningRateMonitor().start(StepInfo(**{**info.__dict__, "fast_dev_run": 1}))  # fast_dev_run needs none
    baked, baked_state = built(optax.adam(1e-3))
    with pytest.raises(MisconfigurationError, match=r"cannot find a learning rate in optimizer 0 \(Adam\)"):
        LearningRateMonitor().start(infos_for(baked, [baked_state], loggers=LOGGER)[0])
    with pytest.raises(RuntimeError, match=r"info.optimizer is None"):
        LearningRateMonitor().start(StepInfo(loggers=LOGGER))


def test_of_trainer_gives_the_optimizer_loggers_and_position_the_two_callbacks_read(tmp_path):
    logger = jl.loggers.CSVLogger(tmp_path)
    trainer = jl.Trainer(devices=1, logger=logger, enable_progress_bar=False, steps_per_execution=4)
    config = object()
    trainer.engine.optimizer = config
    trainer.position.micro_batches, trainer.position.batches_in_epoch = 11, 3
    info = StepInfo.of_trainer(trainer)
    assert info.optimizer is config and info.loggers == (logger,)
    assert (info.micro_batches, info.batches_in_epoch, info.steps_per_execution) == (11, 3, 4)
    assert StepInfo().optimizer is None and StepInfo().loggers == () and StepInfo().steps_per_execution == 1


# ---------------------------------------------------------------------------- Preemption
def batch_ends(first, last, **kw):
    return [StepInfo(stage="train", micro_batches=m, **kw) for m in range(first, last + 1)]


def test_preemption_stops_at_the_first_batch_end_after_the_signal():
    p = Preemption(verbose=False)
    p.begin(StepInfo(micro_batches=4))  # a restored run: 4 batches were done before this fit
    decisions = []
    for info in batch_ends(5, 10):
        if info.micro_batches == 7:
            p._handler(signal.SIGTERM, None)  # the handler only records (no watcher here)
        decisions.append(p.stop_due(info))
    assert decisions == [False, False, True, True, True, True]
    assert p.received == signal.SIGTERM
    assert not p.trained_since_fit_start(StepInfo(micro_batches=4))
    assert p.trained_since_fit_start(StepInfo(micro_batches=5))


def test_preemption_stop_message_names_the_infos_position():
    p = Preemption()
    info = StepInfo(global_step=6, epoch=1, batches_in_epoch=2)
    assert p.stop_message(info, signal.SIGTERM, "checkpoint written to /c/last.ckpt", True) == (
        "jaxlight: received SIGTERM; stopped at global step 6 (epoch 1, batch 2); checkpoint written to "
        "/c/last.ckpt. Run again with ckpt_path='last' to resume."
    )
    assert p.stop_message(info, None, "no checkpoint written", False).startswith(
        "jaxlight: received a preemption notice on another process; stopped at global step 6"
    )


@pytest.fixture
def two_processes(monkeypatch):
    """jax.process_count() == 2 and a key-value store that, like the coordination service, refuses a second set."""
    store = {}

    def kv_set(key, value):
        if key in store:
            raise RuntimeError(f"{key} already set")
        store[key] = value

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(distributed, "kv_set", kv_set)
    monkeypatch.setattr(distributed, "kv_try_get", store.get)
    return store


def test_preemption_processes_agree_on_a_stop_point_past_the_signalled_one(two_processes):
    first, second = Preemption(verbose=False), Preemption(verbose=False)  # two processes' callbacks
    first._handler(signal.SIGTERM, None)  # only the first process got the signal, at micro-batch 5
    agreed = 5 + AGREE_MARGIN * 2  # steps_per_execution=2: processes drift by up to 2 batches per execution
    stops = {}
    for m in range(5, agreed + 3):
        for name, p, here in (("first", first, m), ("second", second, m - 1)):  # the second lags one batch
            if p.stop_due(StepInfo(micro_batches=here, steps_per_execution=2)):
                stops.setdefault(name, here)
    assert two_processes == {"/stop_at": str(agreed)}
    assert stops == {"first": agreed, "second": agreed}
    late = Preemption(verbose=False)
    with pytest.raises(RuntimeError, match=rf"at micro-batch {agreed + 1}, past the agreed stop point {agreed}"):
        late.stop_due(StepInfo(micro_batches=agreed + 1))
