"""Trainer(steps_per_execution=N): N train steps per compiled call, bit-identical to N single steps.

Each fit with N > 1 is compared with the same fit at N = 1: every leaf of the train state (parameters,
optimizer state, EMA, step counter), the logged rows, the per-batch hook calls with their outputs, and the
validation metrics. The data has 10 batches per epoch, so with N = 4 each epoch ends with a partial
execution of 2 steps (one extra compile per fit, counted). A ragged variant has batches of other rows inside
the epoch and at its end (``ragged_batches="keep"``), which end executions early and still run exactly.
"""

from __future__ import annotations

import math
import warnings

import jax
import numpy as np
import optax
import pytest

import jaxlight as jl
from jaxlight.callbacks import EMA, LearningRateMonitor, ModelCheckpoint, NonFiniteGuard
from jaxlight.multistep import ExecutionPlan
from tests.checkpoint_models import DropoutClassifier, host_params
from tests.core_models import IN, OUT, Classifier, quiet
from tests.helpers import Losses, SignalAt
from tests.test_manual_optimization import GAN, gan_data

N = 4
BATCHES, ROWS = 10, 8


def data(n_batches: int = BATCHES, nan_at: int | None = 5, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_batches):
        x = rng.normal(size=(ROWS, IN)).astype(np.float32)
        if i == nan_at:
            x[0, 0] = np.nan  # a non-finite loss: NonFiniteGuard("skip") drops that micro-batch's gradient
        out.append((x, x[:, :OUT].argmax(-1).astype(np.int32)))
    return out


class Model(Classifier):
    """The core MLP with BatchNorm and dropout (model state and an RNG stream), and a schedule."""

    def __init__(self, opt: str = "adam") -> None:
        super().__init__(dropout=0.1, batchnorm=True, opt=opt)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = super().training_step(batch, batch_idx)
        self.log("logit_mean", self.net(x).mean(), on_step=True, on_epoch=True)
        return {"loss": loss, "first": x[0, 1]}

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(-1) == y).mean())

    def configure_optimizers(self):
        if self.hparams.opt == "sgd":  # a schedule inside the optax state
            return optax.sgd(optax.linear_schedule(0.05, 0.01, 8), momentum=0.9)
        # Lightning's scheduler dict: the trainer drives the injected learning rate in the step
        tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
        return {"optimizer": tx, "lr_scheduler": optax.cosine_decay_schedule(1e-2, 12)}


class Memory(jl.loggers.Logger):
    def __init__(self):
        self.rows = []

    @property
    def name(self):
        return "memory"

    @property
    def version(self):
        return 0

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))


class Events(jl.Callback):
    """Every hook call the loop makes, with the position and the batch's outputs on the host."""

    def __init__(self):
        self.calls = []

    def _at(self, trainer):
        return (trainer.current_epoch, trainer.global_step)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.calls.append(("start", batch_idx, *self._at(trainer), np.asarray(batch[0][0, 1]).item()))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        host = {k: np.asarray(v).tolist() for k, v in outputs.items()}
        self.calls.append(("end", batch_idx, *self._at(trainer), trainer.position.last_stepped, host))

    def on_validation_start(self, trainer, module):
        self.calls.append(("validate", *self._at(trainer)))

    def on_train_epoch_end(self, trainer, module):
        self.calls.append(("epoch_end", *self._at(trainer)))


def _fit(n: int, opt: str, devices: int, strategy: str, train=None):
    events, memory, ema = Events(), Memory(), EMA(decay=0.9)
    trainer = jl.Trainer(
        devices=devices,
        strategy=strategy,
        max_epochs=2,
        steps_per_execution=n,
        accumulate_grad_batches=3,  # windows 3, 3, 3 and a flushed 1 per epoch: across execution boundaries
        gradient_clip_val=0.5,
        val_check_interval=4,
        limit_val_batches=2,
        log_every_n_steps=1,
        callbacks=[events, ema, NonFiniteGuard(action="skip", verbose=False)],
        **quiet(logger=memory),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Model(opt), data() if train is None else train, data(2, nan_at=None, seed=1))
    return trainer, events, memory, ema


def _state(trainer) -> list[np.ndarray]:
    leaves = jax.tree.leaves(trainer.train_state)
    return [
        np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x) for x in leaves
    ]


RAGGED = [8, 8, 8, 8, 8, 5, 5, 8, 8, 8, 3]  # rows per batch: ragged batches inside the epoch and at its end


@pytest.mark.default_codegen  # compares two compiled programs bit for bit: see tests/test_default_codegen.py
@pytest.mark.parametrize(
    ("opt", "devices", "strategy", "rows"),
    [("sgd", 1, "auto", RAGGED), ("adam", 8, "fsdp", None)],
    ids=["sgd-1-ragged", "adam-fsdp8"],
)
def test_bit_identical_to_single_steps(opt, devices, strategy, rows):
    """``rows=None``: 10 batches of 8 rows, executions of 4, 4 and 2 steps. ``RAGGED`` (``ragged_batches="keep"``):
    an execution stacks batches of one shape, so a batch of other rows ends the execution before it; the
    executions still end at multiples of N: [0..3] [4] [5, 6] (5 rows) [7] [8, 9] [10] (3 rows)."""
    train = None
    if rows is not None:
        train = [(x[:r], y[:r]) for (x, y), r in zip(data(len(rows)), rows)]
    ref, ref_events, ref_memory, ref_ema = _fit(1, opt, devices, strategy, train)
    got, events, memory, ema = _fit(N, opt, devices, strategy, train)
    a, b = _state(ref), _state(got)
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        np.testing.assert_array_equal(u, v, err_msg=f"train state leaf {i}")
    for k, v in ref_ema.ema_params(ref).items():
        np.testing.assert_array_equal(np.asarray(v), np.asarray(ema.ema_params(got)[k]), err_msg=k)
    batches = BATCHES if rows is None else len(rows)
    assert got.global_step == ref.global_step == 2 * math.ceil(batches / 3)
    assert int(got.train_state.step) == got.global_step
    # the same hook calls, in the same order, with each batch's own outputs and position
    np.testing.assert_equal(events.calls, ref_events.calls)  # (NaN equals NaN here: the skipped batch)
    assert [c[1] for c in events.calls if c[0] == "end"] == list(range(batches)) * 2
    np.testing.assert_equal(memory.rows, ref_memory.rows)
    assert len(memory.rows) > 10
    host = lambda t: {k: float(v) for k, v in t.callback_metrics.items()}
    np.testing.assert_equal(host(got), host(ref))
    # the skipped update really was in there (the NaN batch) and validation ran on the boundaries
    assert any(c[0] == "end" and c[-1]["skipped"] for c in events.calls)
    # validation after batches 4 and 8 of each epoch, at the optimizer step single steps reach there
    assert [c[1:] for c in events.calls if c[0] == "validate"] == [(0, 1), (0, 2), (1, 5), (1, 6)]
    full = [c for (n, _), c in got.engine.multi_steps.items() if n == N]
    assert len(full) == 1 and got.engine.compiled["train"] is full[0]
    if rows is None:
        # executions of 4, 4 and 2 steps: the full program and the partial one, compiled once each
        assert ref.compile_counts["train"] == 1 and got.compile_counts["train"] == 2
        assert sorted(steps for steps, _ in got.engine.multi_steps) == [2, N] and not got.engine.train_steps
        return
    assert ref.compile_counts["train"] == 3  # one step per shape: 8, 5 and 3 rows
    # 4 steps, 2 steps of 5 rows, 2 steps of 8 rows; single steps for the lone batches of 8 and of 3 rows;
    # none compiled again in the second epoch
    assert got.compile_counts["train"] == 5
    assert sorted((n, sig[1][0][0][0]) for n, sig in got.engine.multi_steps) == [(2, 5), (2, 8), (N, 8)]
    assert sorted(sig[1][0][0][0] for sig in got.engine.train_steps) == [3, 8]


class Boundary(jl.Callback):
    """A callback declaring it writes checkpoints: its per-batch hooks run at an execution's last batch only."""

    is_checkpoint_callback = True

    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.seen.append(batch_idx)


class Unsized:
    """A loader without a length (an epoch's end is found when it runs out)."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def test_hooks_run_after_the_execution_and_boundary_callbacks_at_its_end():
    seen = []

    class Probe(jl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            # the position is this batch's, the state the execution's end
            seen.append((batch_idx, trainer.global_step, int(trainer.train_state.step)))

    boundary = Boundary()
    trainer = jl.Trainer(max_epochs=1, steps_per_execution=N, callbacks=[Probe(), boundary], **quiet())
    trainer.fit(Classifier(), Unsized(data(nan_at=None)))
    assert seen == [(i, i, 4 * (i // 4 + 1) if i < 8 else 10) for i in range(BATCHES)]
    assert boundary.seen == [3, 7, 9]
    assert trainer.compile_counts["train"] == 2 and trainer.global_step == BATCHES


def test_manual_optimization_is_supported():
    runs = []
    for n in (1, 3):
        trainer = jl.Trainer(max_epochs=2, steps_per_execution=n, **quiet())
        trainer.fit(GAN(every=2), gan_data(n_batches=3))
        runs.append(trainer)
    for u, v in zip(_state(runs[0]), _state(runs[1])):
        np.testing.assert_array_equal(u, v)
    assert runs[1].global_step == runs[0].global_step == 6 and runs[1].compile_counts["train"] == 1


def _resume_trainer(dirpath, n, callbacks=()):
    ckpt = ModelCheckpoint(dirpath=dirpath, save_last="link")  # epoch ends; the preemption save in between
    return jl.Trainer(
        max_epochs=2,
        steps_per_execution=n,
        callbacks=[*callbacks, EMA(decay=0.9), ckpt],
        **quiet(enable_checkpointing=None, num_sanity_val_steps=None),
    )


@pytest.fixture(scope="module")
def single_step_run(tmp_path_factory):
    """The uninterrupted run with single steps the resumed runs are compared with (two epochs, EMA)."""
    ref = _resume_trainer(str(tmp_path_factory.mktemp("ref")), 1)
    ref.fit(DropoutClassifier(), data(nan_at=None))
    return ref


def test_preempted_mid_execution_stops_at_its_end_and_resumes_bit_identical(tmp_path, single_step_run):
    ref = single_step_run
    run = str(tmp_path / "run")
    t1 = _resume_trainer(run, N, [SignalAt(6)])  # inside the second execution (batches 4..7)
    with pytest.raises(jl.Preempted) as exc:
        t1.fit(DropoutClassifier(), data(nan_at=None))
    assert t1.position.micro_batches == 8 and exc.value.step == 8  # the execution finished, no further
    t2 = _resume_trainer(run, N)
    t2.fit(DropoutClassifier(), data(nan_at=None), ckpt_path="last")
    assert t2.global_step == ref.global_step == 2 * BATCHES
    want, got = host_params(ref), host_params(t2)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    for u, v in zip(_state(ref), _state(t2), strict=True):
        np.testing.assert_array_equal(u, v)


# ------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("bad", [0, True, 2.0, "4"])
def test_steps_per_execution_must_be_a_positive_int(bad):
    with pytest.raises(jl.MisconfigurationError, match="steps_per_execution must be an int >= 1"):
        jl.Trainer(steps_per_execution=bad)


def test_steps_per_execution_is_kept_as_an_int():
    trainer = jl.Trainer(steps_per_execution=np.int64(3), **quiet())
    assert trainer.steps_per_execution == 3 and type(trainer.config.steps_per_execution) is int


class PlateauByStep(Classifier):
    def configure_optimizers(self):
        tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
        plateau = optax.contrib.reduce_on_plateau(patience=1)
        return {"optimizer": tx, "lr_scheduler": {"scheduler": plateau, "monitor": "train_loss", "interval": "step"}}


class StopsEpoch(Classifier):
    def on_train_batch_start(self, batch, batch_idx):
        return -1 if batch_idx == 5 else None


def _refused(match: str, module=None, val=False, **kw):
    kw = {"steps_per_execution": N, "max_epochs": 1, **kw}
    trainer = jl.Trainer(**quiet(**kw))
    with pytest.raises(jl.MisconfigurationError, match=match) as exc:
        trainer.fit(module or Classifier(), data(nan_at=None), data(2, nan_at=None) if val else None)
    assert trainer.compile_counts["train"] == 0 or "returned -1" in str(exc.value)
    return str(exc.value)


def test_misaligned_cadences_are_refused_with_the_numbers():
    msg = _refused("val_check_interval=6 is not a multiple of steps_per_execution=4", val=True, val_check_interval=6)
    assert "after batch 6 of epoch 0" in msg and "batches 4, 8, ..." in msg and "partial execution of 2" in msg
    msg = _refused("val_check_interval=0.5 .5 batches.", val=True, val_check_interval=0.5)
    assert "after batch 5 of epoch 0" in msg
    # counted over the run: batch 12 of the run is batch 2 of epoch 1
    msg = _refused("val_check_interval=4", val=True, val_check_interval=4, check_val_every_n_epoch=None, max_epochs=2)
    assert "after batch 2 of epoch 1 (batch 12 of the run)" in msg
    _refused("max_steps=6 ends the run at optimizer step 6, after batch 6 of epoch 0", max_steps=6)
    # with windows of 2 an epoch takes 5 steps: step 6 is 2 batches into epoch 1
    _refused(
        "max_steps=6 ends the run at optimizer step 6, after batch 2 of epoch 1",
        max_steps=6,
        max_epochs=-1,
        accumulate_grad_batches=2,
    )
    _refused(
        r"ModelCheckpoint\(every_n_train_steps=3\) saves at optimizer step 3, after batch 3",
        callbacks=[ModelCheckpoint(every_n_train_steps=3)],
        enable_checkpointing=True,
    )


def test_state_readers_offload_and_early_exits_are_refused_by_name():
    _refused(r"LearningRateMonitor\(logging_interval=None\)", callbacks=[LearningRateMonitor()])
    _refused("ReduceLROnPlateau scheduler with interval='step'", module=PlateauByStep())
    _refused("pinned_host' memory between steps .host offload.", strategy="ddp+offload", devices=8)
    _refused(r"on_train_batch_start returned -1 .* at batch 5, but .* batches 4..7", module=StopsEpoch())


def test_resume_inside_an_execution_realigns_and_is_bit_identical(tmp_path, single_step_run):
    """A run saved after batch 3 with single steps resumes with N = 4: batch 3 runs alone (a single step), then
    executions of 4 and 2 end where a run with N = 4 from the start ends them."""
    ref = single_step_run
    run = str(tmp_path / "run")
    with pytest.raises(jl.Preempted):  # single steps, stopped after batch 3
        _resume_trainer(run, 1, [SignalAt(3)]).fit(DropoutClassifier(), data(nan_at=None))
    boundary = Boundary()
    t2 = _resume_trainer(run, N, [boundary])
    t2.fit(DropoutClassifier(), data(nan_at=None), ckpt_path="last")
    assert boundary.seen == [3, 7, 9, 3, 7, 9]
    assert t2.global_step == ref.global_step == 2 * BATCHES
    for u, v in zip(_state(ref), _state(t2), strict=True):
        np.testing.assert_array_equal(u, v)
    assert sorted(steps for steps, _ in t2.engine.multi_steps) == [2, N] and len(t2.engine.train_steps) == 1


def test_plan_arithmetic():
    plan = ExecutionPlan(4, 10, accumulate=3, epochs=3)
    assert plan.partial == 2 and [c for c in range(1, 11) if plan.ends_execution(c)] == [4, 8, 10]
    assert plan.steps_per_epoch == 4 and plan.step_batch(4) == 10  # the flushed window
    assert plan.step_miss(4) is None and plan.step_miss(1).count == 3
    assert plan.step_cadence_miss(4) is None  # every epoch's last step
    assert plan.batch_cadence_miss(8, across_epochs=False) is None
    assert plan.batch_cadence_miss(5, across_epochs=True).total == 5
    unbounded = ExecutionPlan(4, math.inf, accumulate=2)
    assert unbounded.step_cadence_miss(2) is None and unbounded.step_cadence_miss(3).step == 3


def test_held_nnx_state_and_epoch_hook_writes_match_single_steps_and_inner_writes_are_refused():
    # an nnx.Rngs drawn for call-time dropout, a MultiMetric reset in on_train_epoch_end, a user Variable:
    # carried through the scan as through single steps; a per-batch hook that writes module state before an
    # execution's last batch would silently miss the batches after it, so it is refused by name
    from tests.test_nnx_state import TRAIN, VAL, Held, Record

    def run(n, cb):
        module = Held()
        trainer = jl.Trainer(max_epochs=2, devices=1, steps_per_execution=n, callbacks=[cb], **quiet())
        trainer.fit(module, TRAIN, VAL)
        return module, trainer, cb

    m1, t1, c1 = run(1, Losses(as_float=True))
    m3, t3, c3 = run(3, Losses(as_float=True))
    assert c3.losses == c1.losses and len(c1.losses) == 6
    assert m3.epochs == m1.epochs and m3.val_epochs == m1.val_epochs  # the epoch-end reset reached epoch 2
    assert int(m3.rngs.dropout.count[...]) == int(m1.rngs.dropout.count[...]) == 6
    assert int(m3.seen.value) == 6
    p1, p3 = host_params(t1), host_params(t3)
    assert p1.keys() == p3.keys() and all(np.array_equal(p1[k], p3[k]) for k in p1)
    with pytest.raises(jl.MisconfigurationError, match=r"on_train_batch_end at batch 1 set module state \(seen\)"):
        run(3, Record())  # sets module.seen after the second batch of a 3-step execution


class StepCounts(jl.Callback):
    """Records the device step counter each per-batch hook sees (the state it runs against)."""

    def __init__(self):
        self.seen = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append(("start", batch_idx, int(trainer.train_state.step)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append(("end", batch_idx, int(trainer.train_state.step)))


def test_one_body_runs_a_lone_batch_in_lightnings_order_and_executions_after_their_call():
    """One per-batch body for every N: an execution of several steps runs its batches' hooks after the call
    (each sees the state after the whole execution); a lone batch (9 batches with N = 4: the last one) is an
    execution of one step, whose start hook runs before its step as with N = 1."""
    runs = {}
    for n in (1, N):
        rec = StepCounts()
        trainer = jl.Trainer(**quiet(steps_per_execution=n, max_epochs=1, callbacks=[rec]))
        trainer.fit(Classifier(), data(9, nan_at=None))
        runs[n] = rec.seen
    assert runs[1] == [(w, i, i + (w == "end")) for i in range(9) for w in ("start", "end")]
    after = {0: 4, 1: 4, 2: 4, 3: 4, 4: 8, 5: 8, 6: 8, 7: 8}
    expected = [(w, i, after[i]) for i in range(8) for w in ("start", "end")]
    assert runs[N] == [*expected, ("start", 8, 8), ("end", 8, 9)]
