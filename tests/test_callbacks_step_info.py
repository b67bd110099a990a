"""jaxlight's value-reading callbacks driven from hand-made StepInfo streams, with no Trainer at all.

EarlyStopping, NonFiniteGuard, EMA, ThroughputMonitor and Timer keep their logic in methods taking a
:class:`jaxlight.step_info.StepInfo`; their Lightning hooks only build one (``StepInfo.of_trainer``) and apply
the decision. Each test here feeds a stream of infos and checks the numbers and decisions that come out.
"""

import dataclasses
import types

import jax.numpy as jnp
import numpy as np
import pytest

import jaxlight as jl
from jaxlight.callbacks import EMA, EarlyStopping, NonFiniteError, NonFiniteGuard, ThroughputMonitor, Timer
from jaxlight.config import RUN_AHEAD
from jaxlight.step import TrainState
from jaxlight.step_info import StepInfo


def state(params, step, callback_state=None):
    return TrainState(params, {}, (), callback_state or {}, jnp.int32(step))


# ---------------------------------------------------------------------------- the value itself
def test_step_info_is_frozen_and_its_mappings_read_only():
    info = StepInfo(stage="train", global_step=3, metrics={"val_loss": 1.0})
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.global_step = 4
    assert (info.epoch, info.batch_idx, info.outputs, info.state, info.fast_dev_run) == (0, 0, None, None, 0)


def test_of_trainer_holds_the_trainers_values_by_reference():
    trainer = jl.Trainer(
        devices=4, logger=False, enable_progress_bar=False, log_every_n_steps=7, precision="bf16-mixed"
    )
    trainer.position.global_step, trainer.position.epoch, trainer.position.last_stepped = 12, 2, True
    loss = jnp.float32(0.5)
    trainer.callback_metrics["val_loss"] = loss
    outputs = {"loss": loss}
    info = StepInfo.of_trainer(trainer, outputs=outputs, batch_idx=5)
    assert (info.stage, info.epoch, info.global_step, info.batch_idx, info.stepped) == ("", 2, 12, 5, True)
    assert (info.num_devices, info.precision, info.log_every_n_steps, info.state) == (4, "bf16-mixed", 7, None)
    assert info.device is trainer.mesh.devices.flat[0]
    # no copy and no host fetch: the very device arrays, behind read-only views of the live mappings
    assert info.outputs["loss"] is loss and info.metrics["val_loss"] is loss
    with pytest.raises(TypeError):
        info.metrics["val_loss"] = 1.0
    trainer.callback_metrics["later"] = 1
    assert "later" in info.metrics
    trainer.sanity_checking = True
    assert StepInfo.of_trainer(trainer).stage == "sanity_check"
    trainer.sanity_checking, trainer.training, trainer.validating = False, True, True
    assert StepInfo.of_trainer(trainer).stage == "train"  # validation inside fit is still the fit's training
    trainer.training = False
    assert StepInfo.of_trainer(trainer).stage == "validate"


# ---------------------------------------------------------------------------- EarlyStopping
def epoch_infos(values, stage="train", **kw):
    return [StepInfo(stage=stage, epoch=e, metrics={"val_loss": jnp.float32(v)}, **kw) for e, v in enumerate(values)]


def test_early_stopping_stops_after_patience_bad_values():
    es = EarlyStopping("val_loss", patience=3)
    es.resolve_check_point(StepInfo())  # validation once per epoch: the check runs at the train epoch's end
    decisions = [es.at_train_epoch_end(info) for info in epoch_infos([1.0, 0.9, 0.95, 0.96, 0.97, 0.5])[:5]]
    assert decisions == [False, False, False, False, True]
    assert (es.best_score, es.wait_count, es.stopped_epoch) == (pytest.approx(0.9), 3, 4)
    assert es.state_dict() == {"wait_count": 3, "stopped_epoch": 4, "best_score": pytest.approx(0.9), "patience": 3}


def test_early_stopping_checks_only_while_fit_trains_and_where_validation_runs():
    es = EarlyStopping("val_loss", patience=1)
    es.resolve_check_point(StepInfo(val_check_interval=0.5))  # twice per epoch: after each validation instead
    bad = epoch_infos([1.0, 2.0])
    assert not es.at_train_epoch_end(bad[0]) and es.best_score == float("inf")  # not its check point
    for skipped in (dataclasses.replace(bad[0], stage="sanity_check"), dataclasses.replace(bad[0], fast_dev_run=1)):
        assert not es.at_validation_end(skipped) and es.best_score == float("inf")
    assert not es.at_validation_end(bad[0]) and es.best_score == pytest.approx(1.0)
    assert es.at_validation_end(bad[1]) and es.stopped_epoch == 1


def test_early_stopping_reports_with_the_infos_rank_and_names_missing_metrics(capsys):
    es = EarlyStopping("val_loss", verbose=True, divergence_threshold=10.0)
    assert es.check(StepInfo(epoch=3, global_rank=2, metrics={"val_loss": 11.0}))
    assert "[rank: 2] Divergence threshold reached: val_loss = 11.0" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match="use any of the following: `acc`, `loss`"):
        es.check(StepInfo(metrics={"acc": 1.0, "loss": 2.0}))


# ---------------------------------------------------------------------------- NonFiniteGuard
def train_infos(losses, grad_norms=None, accumulate=1):
    infos = []
    for i, loss in enumerate(losses):
        outputs = {"loss": jnp.float32(loss)}
        if grad_norms is not None:
            outputs["grad_norm"] = jnp.float32(grad_norms[i])
        stepped = (i + 1) % accumulate == 0
        infos.append(
            StepInfo(stage="train", batch_idx=i, global_step=(i + 1) // accumulate, stepped=stepped, outputs=outputs)
        )
    return infos


def test_nonfinite_guard_raises_naming_the_step_once_its_step_is_waited_for():
    bad = 2
    infos = train_infos([1.0] * bad + [float("nan")] + [1.0] * 10)
    guard = NonFiniteGuard()
    guard.start()
    for info in infos[: bad + RUN_AHEAD]:  # the bad step is still inside the run-ahead window: nothing fetched
        guard.on_step(info)
    with pytest.raises(NonFiniteError, match=rf"loss=nan, grad_norm=0.0 at step {bad} \(epoch 0, batch {bad}\)") as ei:
        guard.on_step(infos[bad + RUN_AHEAD])
    assert (ei.value.step, ei.value.batch_idx) == (bad, bad)


def test_nonfinite_guard_checks_what_is_pending_at_epoch_end():
    guard = NonFiniteGuard()
    for info in train_infos([1.0, 1.0, 1.0], grad_norms=[1.0, 1.0, float("inf")]):
        guard.on_step(info)  # three steps: all still pending
    with pytest.raises(NonFiniteError, match=r"grad_norm=inf at step 2 \(epoch 0, batch 2\)"):
        guard.flush()


def test_nonfinite_guard_skip_warns_naming_the_optimizer_update():
    guard = NonFiniteGuard(action="skip")
    # accumulate 2: micro-batch 5 belongs to optimizer update 2
    with pytest.warns(UserWarning, match=r"at step 2 \(epoch 0, batch 5\); the update was skipped"):
        for info in train_infos([1.0] * 5 + [float("inf")] + [1.0] * 2, accumulate=2):
            guard.on_step(info)
        guard.flush()
    assert guard.skipped == [2]


# ---------------------------------------------------------------------------- EMA
def test_ema_update_from_a_stream_of_state_views():
    ema = EMA(decay=0.5, warmup=False, every_n_steps=2)
    avg = {"w": jnp.zeros(3, jnp.float32)}
    want = np.zeros(3, np.float32)
    # (optimizer step after the update, whether the update was applied); step 4 was skipped by a guard
    stream = [(1, True), (2, True), (3, True), (4, False), (5, True), (6, True)]
    for t, applied in stream:
        params = {"w": jnp.full(3, float(t), jnp.float32)}
        avg = ema.next_average(avg, StepInfo(stepped=applied, state=state(params, t)))
        if applied and t % 2 == 0:
            want = 0.5 * want + 0.5 * t
        np.testing.assert_allclose(np.asarray(avg["w"]), want, rtol=0, atol=0, err_msg=f"step {t}")
    assert want[0] == 3.5  # steps 2 and 6 only: 0.5 * (0.5 * 2) + 0.5 * 6


def test_ema_warmup_decay_and_reading_the_average_from_a_state_view():
    ema = EMA(decay=0.999, warmup=True)
    params = {"w": jnp.ones(2, jnp.float32)}
    first = ema.next_average({"w": jnp.zeros(2, jnp.float32)}, StepInfo(stepped=True, state=state(params, 1)))
    np.testing.assert_allclose(np.asarray(first["w"]), 1 - 2 / 11, rtol=1e-6)  # d = (1 + 1) / (10 + 1)
    info = StepInfo(state=state(params, 1, {"ema": first}))
    assert ema.average(info) is first and ema.ema_params(info) is first
    assert ema.weights_to_evaluate(info) is first
    assert EMA(use_for_validation=False).weights_to_evaluate(info) is None
    with pytest.raises(RuntimeError, match="EMA has no average yet"):
        ema.average(StepInfo(state=state(params, 1)))


# ---------------------------------------------------------------------------- ThroughputMonitor
class FakeCompiled:
    """What ThroughputMonitor reads of a compiled step when it carries no traced program."""

    def cost_analysis(self):
        return {"flops": 2e12}

    def memory_analysis(self):
        return types.SimpleNamespace(temp_size_in_bytes=1024)


def test_throughput_rates_from_timed_infos_with_validation_left_out():
    mon = ThroughputMonitor(window=10)
    h100 = types.SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3")
    mon.start(StepInfo(device=h100, precision="bf16-mixed"))
    tokens = {"ids": np.zeros((8, 16), np.int32)}  # 8 samples, 128 tokens
    run = dict(stage="train", stepped=True, batch=tokens, num_devices=4, log_every_n_steps=2)
    run |= dict(compiled={"train": FakeCompiled()}, state=state({"w": jnp.zeros((4, 4), jnp.float32)}, 0))
    logged = {}
    for step, t in [(1, 10.0), (2, 10.5)]:
        logged[step] = mon.on_step(StepInfo(global_step=step, time=t, **run))
    mon.pause(StepInfo(time=10.6))  # a validation run of 2 s inside fit
    mon.resume(StepInfo(time=12.6))
    for step, t in [(3, 13.0), (4, 13.5)]:
        logged[step] = mon.on_step(StepInfo(global_step=step, time=t, **run))
    assert logged[1] is None and logged[3] is None  # every log_every_n_steps optimizer steps only
    m = logged[4]
    assert m is mon.metrics
    # 3 steps in 1.5 s of training (the 2 s of validation taken out)
    assert m["train/step_time"] == pytest.approx(0.5)
    assert m["train/samples_per_sec"] == pytest.approx(24 / 1.5)
    assert m["train/device/samples_per_sec"] == pytest.approx(24 / 1.5 / 4)
    assert m["train/items_per_sec"] == pytest.approx(3 * 128 / 1.5)
    assert m["train/flops_per_step"] == 2e12 and m["train/device/flops_per_sec"] == pytest.approx(2e12 * 2)
    assert m["train/device/mfu"] == pytest.approx(2e12 * 2 / 989.4e12)  # the H100's bf16 peak
    # the state read from the info: a 4x4 float32 parameter and the int32 step count
    assert (m["train/device/state_bytes"], m["train/device/temp_bytes"]) == (16 * 4 + 4, 1024.0)
    assert logged[2]["train/step_time"] == pytest.approx(0.5)


def test_throughput_logs_nothing_for_micro_batches():
    mon = ThroughputMonitor()
    mon.start(StepInfo())
    batch = np.zeros((4, 3), np.float32)
    got = [
        mon.on_step(StepInfo(global_step=1, stepped=False, time=float(t), batch=batch, log_every_n_steps=1))
        for t in range(3)
    ]
    assert got == [None, None, None] and mon.metrics == {}


# ---------------------------------------------------------------------------- Timer
def test_timer_stops_once_the_budget_is_spent_and_says_so_once(monkeypatch):
    said = []
    monkeypatch.setattr("jaxlight.callbacks.timer.rank_zero_info", said.append)
    timer = Timer(duration=5)
    timer.load_state_dict({"time_elapsed": 4.0})  # restored: the next fit counts the 4 s already spent
    assert not timer.fit_start(StepInfo())
    timer.load_state_dict({"time_elapsed": 6.0})
    assert timer.fit_start(StepInfo()) and len(said) == 1
    assert timer.check(StepInfo(should_stop=True)) and len(said) == 1  # a stop already asked for: no second message
    assert not timer.fit_start(StepInfo())  # a new fit without a restore starts from zero
