"""The loops know callbacks by what the ``Callback`` base declares, never by class (docs/ARCHITECTURE.md, Layers).

A user's callback declaring a capability gets what jaxlight's own do: ``runs_at_execution_end`` (per-batch
hooks at execution ends only under ``steps_per_execution``), ``reads_optimizer_state_per_step`` (refused
under ``steps_per_execution``), ``stop_poll`` (polled by the loops between batches). The Trainer's default
callbacks come from the facade's ``jaxlight.default_callbacks``.
"""

from __future__ import annotations

import numpy as np
import pytest

import jaxlight as jl
from jaxlight.callbacks import LearningRateMonitor, ModelCheckpoint, Preemption, Timer, TQDMProgressBar
from jaxlight.callbacks.lr_scheduler import LRSchedulerStepper
from jaxlight.default_callbacks import with_default_callbacks, with_scheduler_stepper
from jaxlight.hooks import stop_poll
from tests.core_models import IN, OUT, Classifier, quiet

N, BATCHES = 4, 8


def data(n: int = BATCHES):
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(8, IN)).astype(np.float32) for _ in range(n)]
    return [(x, x[:, :OUT].argmax(-1).astype(np.int32)) for x in xs]


class BatchEnds(jl.Callback):
    def __init__(self) -> None:
        self.ends: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.ends.append(batch_idx)


class AtExecutionEnds(BatchEnds):
    runs_at_execution_end = True


class ReadsStatePerStep(jl.Callback):
    @property
    def reads_optimizer_state_per_step(self):
        return "MyMonitor reads the momentum before each step", "use MyMonitor(by='epoch')"


class Polls(jl.Callback):
    def __init__(self) -> None:
        self.calls: list[bool] = []

    def stop_poll(self, waiting: bool = False) -> None:
        self.calls.append(waiting)


def test_a_declared_execution_end_callback_runs_at_execution_ends_only():
    every, ends = BatchEnds(), AtExecutionEnds()
    trainer = jl.Trainer(**quiet(steps_per_execution=N, max_epochs=1, callbacks=[every, ends]))
    trainer.fit(Classifier(), data())
    assert every.ends == list(range(BATCHES)), every.ends
    assert ends.ends == [N - 1, 2 * N - 1], ends.ends


def test_readers_of_the_optimizer_state_per_step_are_refused_with_the_same_text():
    trainer = jl.Trainer(**quiet(steps_per_execution=N, max_epochs=1, callbacks=[LearningRateMonitor("step")]))
    with pytest.raises(jl.MisconfigurationError) as exc:
        trainer.fit(Classifier(), data())
    assert str(exc.value) == (
        "LearningRateMonitor(logging_interval='step') reads the learning rate from the optimizer state before each "
        "logged step, but with steps_per_execution=4 the per-batch hooks run after the execution, when the state "
        "is 4 steps on; use LearningRateMonitor(logging_interval='epoch') or steps_per_execution=1"
    )
    assert LearningRateMonitor("epoch").reads_optimizer_state_per_step is None
    # a user's callback declaring it is refused in its own words
    trainer = jl.Trainer(**quiet(steps_per_execution=N, max_epochs=1, callbacks=[ReadsStatePerStep()]))
    with pytest.raises(jl.MisconfigurationError, match=r"^MyMonitor reads the momentum before each step, but with "):
        trainer.fit(Classifier(), data())
    assert trainer.compile_counts["train"] == 0


def test_the_loops_poll_the_first_declared_stop_poll():
    plain, polls, preemption = jl.Callback(), Polls(), Preemption()
    assert stop_poll([plain]) is None
    assert stop_poll([plain, preemption, polls]) == preemption.poll
    trainer = jl.Trainer(**quiet(max_epochs=1, callbacks=[polls]))  # fast_dev_run off: Preemption is added after
    trainer.fit(Classifier(), data())
    # the prefetcher polls before it hands out each batch (and while it waits for a slow loader: True)
    assert polls.calls.count(False) >= BATCHES, polls.calls


def test_default_callbacks_come_from_the_facade():
    cbs = jl.Trainer(**quiet(enable_progress_bar=True, enable_checkpointing=True, max_time="00:00:10:00")).callbacks
    kinds = [type(c) for c in cbs]
    assert kinds == [TQDMProgressBar, Timer, Preemption, ModelCheckpoint], kinds  # checkpoint callbacks last
    assert [type(c) for c in jl.Trainer(**quiet(fast_dev_run=True)).callbacks] == []
    config = jl.Trainer(**quiet()).config
    mine = ModelCheckpoint()
    assert with_default_callbacks([mine], config)[-1] is mine
    stepped = with_scheduler_stepper([mine], host_stepped=True)
    assert stepped is not None and [type(c) for c in stepped] == [LRSchedulerStepper, ModelCheckpoint]
    assert with_scheduler_stepper([mine], host_stepped=False) is None
