"""ModelCheckpoint's policy driven from streams of hand-made StepInfo values, with no Trainer at all.

:class:`jaxlight.callbacks.checkpoint_policy.CheckpointPolicy` (ModelCheckpoint's ``at_*`` methods) takes the
info of one hook and returns a :class:`Decision`: the names one save is published under, the links and the
removals, and why. Here the decisions of whole simulated fits are applied to a set of names (what the directory
would hold) and compared with what Lightning's rules give for the same numbers; the policy itself writes nothing.
The last test runs a real Trainer and checks that the files it wrote are the ones its decisions named, and that
the same infos fed to a fresh callback give the same decisions.
"""

from __future__ import annotations

import dataclasses
import math
import os
from datetime import timedelta

import numpy as np
import pytest

import jaxlight as jl
from jaxlight.callbacks import ModelCheckpoint
from jaxlight.callbacks.checkpoint_policy import Decision
from jaxlight.errors import MisconfigurationError
from jaxlight.step_info import StepInfo
from tests.checkpoint_models import DropoutClassifier, arrays
from tests.helpers import quiet

SCORES = (0.5, 0.3, 0.4, 0.1, 0.35)  # one monitored value per epoch
BATCHES = 4  # train batches per epoch


class Dir:
    """The directory a stream of decisions leaves: names added, removals taken away (basenames)."""

    def __init__(self) -> None:
        self.files: set[str] = set()
        self.decisions: list[Decision] = []

    def take(self, decision: Decision) -> Decision:
        self.decisions.append(decision)
        self.files |= {os.path.basename(p) for p in decision.names}
        self.files |= {os.path.basename(link) for link, _ in decision.links}
        self.files -= {os.path.basename(p) for p in decision.removals}
        return decision

    def saves(self) -> list[Decision]:
        return [d for d in self.decisions if d.names]


def fit(mc: ModelCheckpoint, epochs: int, scores=SCORES, validate: bool = True, times=None, **settings) -> Dir:
    """Feed ``mc`` the hooks of a fit of ``epochs`` epochs of BATCHES batches, in the Trainer's order: train
    start, each batch's end, validation at the epoch's end (logging ``scores[epoch]`` as ``score``), the train
    epoch's end, train end. ``times``: the host clock of each batch end (``info.time``), 0 at train start."""
    d, step = Dir(), 0
    run = dict(stage="train", num_training_batches=BATCHES, has_val_dataloaders=validate, **settings)
    d.take(mc.at_train_start(StepInfo(time=0.0, **run)))
    metrics: dict[str, float] = {}
    for epoch in range(epochs):
        for b in range(BATCHES):
            step += 1
            clock = times[step - 1] if times is not None else float(step)
            info = StepInfo(epoch=epoch, global_step=step, batch_idx=b, micro_batches=step, time=clock, **run)
            d.take(mc.at_train_batch_end(dataclasses.replace(info, outputs={"loss": 1.0}, metrics=dict(metrics))))
        end = StepInfo(epoch=epoch, global_step=step, micro_batches=step, time=float(step), **run)
        if validate:
            metrics = {"score": scores[epoch]}
            end = dataclasses.replace(end, metrics=dict(metrics), num_val_batches=1)
            d.take(mc.at_validation_end(end))
        d.take(mc.at_train_epoch_end(end))
    d.take(mc.at_train_end(dataclasses.replace(end, epoch=epochs)))
    return d


def name(epoch: int, step: int | None = None, **extra) -> str:
    step = (epoch + 1) * BATCHES if step is None else step
    return "-".join([f"epoch={epoch}", f"step={step}"] + [f"{k}={v}" for k, v in extra.items()]) + ".ckpt"


def test_of_trainer_fills_the_fields_the_policy_reads(tmp_path):
    trainer = jl.Trainer(default_root_dir=str(tmp_path), limit_val_batches=0.5, **quiet())
    info = StepInfo.of_trainer(trainer)
    assert (info.num_training_batches, info.num_val_batches, info.limit_val_batches) == (math.inf, 0, 0.5)
    assert (info.has_val_dataloaders, info.ckpt_path, info.default_root_dir) == (False, None, str(tmp_path))
    trainer.num_training_batches, trainer.num_val_batches, trainer.ckpt_path = 4, [2, 3], "x/last.ckpt"
    trainer.val_dataloaders = [(np.zeros(2), np.zeros(2))]
    info = StepInfo.of_trainer(trainer)
    assert (info.num_training_batches, info.num_val_batches, info.has_val_dataloaders) == (4, (2, 3), True)
    assert ModelCheckpoint(dirpath=str(tmp_path))._resume_path(info) == os.path.abspath("x/last.ckpt")
    # without a logger, checkpoints go under default_root_dir, as the Trainer's log_dir says
    assert ModelCheckpoint()._default_dirpath(info) == os.path.join(trainer.log_dir, "checkpoints")


def test_every_n_train_steps_saves_every_nth_optimizer_step_and_writes_nothing_itself(tmp_path):
    mc = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=3, save_top_k=-1)
    d = fit(mc, epochs=3, validate=False)
    steps = range(3, 3 * BATCHES + 1, 3)
    assert [(s.why, s.global_step) for s in d.saves()] == [("every_n_train_steps", s) for s in steps]
    assert d.files == {name((s - 1) // BATCHES, s) for s in steps}
    assert not [s for s in d.saves() if s.removals]  # -1 keeps them all
    assert os.listdir(tmp_path) == []  # deciding writes nothing: that is ModelCheckpoint's carrying out


def test_every_n_epochs_saves_at_the_train_epoch_end_of_every_nth_epoch(tmp_path):
    mc = ModelCheckpoint(dirpath=str(tmp_path), every_n_epochs=2, save_top_k=-1)
    d = fit(mc, epochs=5, validate=False)
    due = [e for e in range(5) if (e + 1) % 2 == 0]
    assert [(s.why, s.global_step) for s in d.saves()] == [("train_epoch_end", (e + 1) * BATCHES) for e in due]
    assert d.files == {name(e) for e in due}
    # save_top_k=1 without a monitor keeps only the newest: each save drops the one before
    one = fit(ModelCheckpoint(dirpath=str(tmp_path / "one")), epochs=3, validate=False)
    assert one.files == {name(2)}
    assert [tuple(map(os.path.basename, s.removals)) for s in one.saves()] == [(), (name(0),), (name(1),)]


def test_train_time_interval_reads_the_info_clock(tmp_path):
    mc = ModelCheckpoint(dirpath=str(tmp_path), train_time_interval=timedelta(seconds=10), save_top_k=-1)
    clock = [3.0, 7.0, 11.0, 14.0, 20.0, 21.5, 30.0, 31.0]  # batch ends; the clock starts at 0 at train start
    d = fit(mc, epochs=2, validate=False, times=clock)
    due, last = [], 0.0  # a save once 10 s have passed since the last one (or the start)
    for step, t in enumerate(clock, 1):
        if t - last >= 10:
            due.append(step)
            last = t
    assert due and [(s.why, s.global_step) for s in d.saves()] == [("train_time_interval", s) for s in due]
    # no epoch cadence with a time interval: the epoch ends save nothing
    assert all(not x.names for x in d.decisions if x.why not in ("train_time_interval",))


@pytest.mark.parametrize("mode,k", [("min", 2), ("max", 1), ("min", 3)])
def test_monitor_keeps_the_top_k_and_drops_the_kth(tmp_path, mode, k):
    mc = ModelCheckpoint(dirpath=str(tmp_path), monitor="score", mode=mode, save_top_k=k)
    d = fit(mc, epochs=len(SCORES))
    better = (lambda a, b: a < b) if mode == "min" else (lambda a, b: a > b)
    kept: list[int] = []  # Lightning's rule, written out: a value enters when the top k is not full or it beats
    expected = []  # the k-th (the worst kept), which is then dropped
    for e, v in enumerate(SCORES):
        if len(kept) < k:
            kept.append(e)
            expected.append((name(e), ()))
        else:
            worst = max(kept, key=lambda i: SCORES[i] if mode == "min" else -SCORES[i])
            if better(v, SCORES[worst]):
                kept[kept.index(worst)] = e
                expected.append((name(e), (name(worst),)))
    got = [(os.path.basename(s.names[0]), tuple(map(os.path.basename, s.removals))) for s in d.saves()]
    assert got == expected
    assert d.files == {name(e) for e in kept}
    best = (min if mode == "min" else max)(range(len(SCORES)), key=lambda e: SCORES[e])
    assert os.path.basename(mc.best_model_path) == name(best) and mc.best_model_score == SCORES[best]
    # validation once per epoch: saved at the train epoch's end (Lightning's automatic choice), after validation
    assert {s.why for s in d.saves()} == {"train_epoch_end"}


def test_save_last_copy_link_and_at_train_end(tmp_path):
    copy = fit(ModelCheckpoint(dirpath=str(tmp_path / "copy"), save_last=True), epochs=2, validate=False)
    for s in copy.saves():  # the top-k name and last.ckpt, one save published under both
        assert [os.path.basename(p) for p in s.names] == [name(s.global_step // BATCHES - 1), "last.ckpt"]
    assert copy.files == {name(1), "last.ckpt"}

    link = fit(ModelCheckpoint(dirpath=str(tmp_path / "link"), save_last="link"), epochs=2, validate=False)
    for s in link.saves():  # last.ckpt a symlink switched to the save just written
        assert len(s.names) == 1 and s.links == ((os.path.join(tmp_path, "link", "last.ckpt"), s.names[0]),)
    assert link.files == {name(1), "last.ckpt"}

    # nothing saved in the whole fit (save_top_k=0): last is written at train end, as Lightning does
    end = fit(ModelCheckpoint(dirpath=str(tmp_path / "end"), save_top_k=0, save_last=True), epochs=2, validate=False)
    assert [(s.why, [os.path.basename(p) for p in s.names]) for s in end.saves()] == [("train_end", ["last.ckpt"])]
    assert fit(ModelCheckpoint(dirpath=str(tmp_path / "none"), save_top_k=0), epochs=2, validate=False).files == set()


def test_filename_templates_take_the_metrics_and_the_version_counter_the_decided_names(tmp_path):
    info = StepInfo(stage="train", epoch=2, global_step=9, metrics={"val_acc": np.float32(0.8765), "other": 1.0})
    mc = ModelCheckpoint(
        dirpath=str(tmp_path), filename="best-{epoch}-{val_acc:.2f}", monitor="val_acc", mode="max", save_top_k=-1
    )
    d = mc.at_train_epoch_end(info)
    assert [os.path.basename(p) for p in d.names] == ["best-epoch=2-val_acc=0.88.ckpt"]
    plain = ModelCheckpoint(dirpath=str(tmp_path), filename="{epoch:02d}_{val_acc:.1f}", auto_insert_metric_name=False)
    assert os.path.basename(plain.at_train_epoch_end(info).names[0]) == "02_0.9.ckpt"
    # the same name decided twice: the second gets a version, from the policy's own view of the directory
    # (nothing is on disk: the first was only decided)
    again = dataclasses.replace(info, global_step=10)
    assert os.path.basename(mc.at_train_epoch_end(again).names[0]) == "best-epoch=2-val_acc=0.88-v1.ckpt"
    assert os.listdir(tmp_path) == []


def test_sanity_check_fast_dev_run_standalone_validate_and_a_step_already_saved_are_skipped(tmp_path):
    mc = ModelCheckpoint(dirpath=str(tmp_path), save_last=True, save_on_train_epoch_end=False)
    at = StepInfo(stage="train", epoch=0, global_step=4)
    assert mc.at_validation_end(dataclasses.replace(at, stage="sanity_check")) == Decision(why="sanity check")
    assert mc.at_validation_end(dataclasses.replace(at, stage="validate")) == Decision(why="not training")
    assert mc.at_validation_end(dataclasses.replace(at, fast_dev_run=1)) == Decision(why="fast_dev_run")
    assert mc.at_train_end(dataclasses.replace(at, fast_dev_run=1)).empty  # no last at the end either
    saved = mc.at_validation_end(at)
    assert saved.why == "validation_end" and [os.path.basename(p) for p in saved.names] == [name(0), "last.ckpt"]
    assert mc.at_validation_end(at) == Decision(why="saved at this step")  # a second validation at that step
    # before the first optimizer step there is nothing to save (Lightning starts its counter at step 0)
    fresh = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=1)
    assert fresh.at_train_epoch_end(StepInfo(stage="train")) == Decision(why="saved at this step")


def test_save_on_train_epoch_end_is_lightnings_automatic_choice(tmp_path):
    mc = ModelCheckpoint(dirpath=str(tmp_path))
    choice = mc._should_save_on_train_epoch_end
    validating = StepInfo(num_val_batches=2, has_val_dataloaders=True)
    assert choice(validating)  # validation once per epoch: at the train epoch's end
    assert not choice(dataclasses.replace(validating, val_check_interval=0.5))  # more often: after validation
    assert not choice(dataclasses.replace(validating, check_val_every_n_epoch=2))  # not every epoch
    assert choice(dataclasses.replace(validating, val_check_interval=0.5, limit_val_batches=0))  # no validation
    assert choice(dataclasses.replace(validating, val_check_interval=0.5, num_val_batches=0))
    assert not ModelCheckpoint(dirpath=str(tmp_path), save_on_train_epoch_end=False)._should_save_on_train_epoch_end(
        validating
    )

    # the choice in a stream: validating twice per epoch, the saves come after validation, never at epoch end
    twice = fit(ModelCheckpoint(dirpath=str(tmp_path / "v")), epochs=2, val_check_interval=0.5)
    assert {s.why for s in twice.saves()} == {"validation_end"} and twice.files == {name(1)}
    epoch_ends = [x for x in twice.decisions if x.why == "saves after validation"]
    assert len(epoch_ends) == 2 and all(x.empty for x in epoch_ends)


def test_a_validation_only_monitor_defers_a_step_save_until_validation(tmp_path):
    mc = ModelCheckpoint(
        dirpath=str(tmp_path), monitor="score", every_n_train_steps=2, save_top_k=1, save_on_train_epoch_end=False
    )
    d = fit(mc, epochs=1)
    deferred = [x for x in d.decisions if x.why == "deferred to validation"]
    assert [x.empty for x in deferred] == [True, True]  # steps 2 and 4: "score" not logged yet
    assert [(s.why, s.global_step) for s in d.saves()] == [("validation_end", BATCHES)]
    # without validation the value never arrives: said at the first due step, naming what was logged
    lone = ModelCheckpoint(dirpath=str(tmp_path), monitor="score", every_n_train_steps=1)
    with pytest.raises(MisconfigurationError, match=r"could not find the monitored key.*\['train_loss'\]"):
        lone.at_train_batch_end(StepInfo(stage="train", global_step=1, metrics={"train_loss": 0.3}))


def test_a_non_finite_loss_or_score_is_not_saved(tmp_path):
    mc = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=1, save_top_k=-1)
    ok = StepInfo(stage="train", global_step=1, outputs={"loss": 0.5})
    assert mc.at_train_batch_end(ok).names
    with pytest.warns(UserWarning, match="not saving global step 2: the training loss is nan"):
        assert mc.at_train_batch_end(StepInfo(stage="train", global_step=2, outputs={"loss": math.nan})) == Decision(
            why="non-finite"
        )
    keep = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=1, save_non_finite=True)
    assert keep.at_train_batch_end(StepInfo(stage="train", global_step=2, outputs={"loss": math.nan})).names


def test_a_forced_save_outside_the_top_k_is_an_extra_one(tmp_path):
    mc = ModelCheckpoint(dirpath=str(tmp_path), monitor="score", save_top_k=1)
    forced = mc.at_forced_save(StepInfo(stage="train", epoch=0, global_step=3, micro_batches=3), "preemption")
    # the monitored value is not logged yet: not a top-k checkpoint, an extra one kept until the next save
    assert forced.why == "preemption" and forced.names == (forced.extra,)
    assert os.path.basename(forced.extra) == name(0, 3) and mc.best_k_models == {}
    assert (forced.global_step, forced.micro_batches) == (3, 3)


# ---------------------------------------------------------------------------- against a real fit
class Scored(DropoutClassifier):
    def on_validation_epoch_end(self):
        self.log("score", SCORES[self.current_epoch])


class Recording(ModelCheckpoint):
    """A ModelCheckpoint that records, for each policy call of the run, the info it got (its values fetched:
    the live mappings move on) and the decision it returned."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.kwargs = {k: v for k, v in kwargs.items() if k != "dirpath"}
        self.calls: list[tuple[str, StepInfo, Decision]] = []

    def _record(self, method: str, info: StepInfo, decision: Decision) -> Decision:
        outputs = {"loss": float(info.outputs["loss"])} if info.outputs else None
        metrics = {k: float(np.asarray(v)) for k, v in info.metrics.items()}
        held = dataclasses.replace(info, outputs=outputs, metrics=metrics, state=None, compiled={}, optimizer=None)
        self.calls.append((method, held, decision))
        return decision

    def at_train_start(self, info):
        return self._record("at_train_start", info, super().at_train_start(info))

    def at_train_batch_end(self, info):
        return self._record("at_train_batch_end", info, super().at_train_batch_end(info))

    def at_train_epoch_end(self, info):
        return self._record("at_train_epoch_end", info, super().at_train_epoch_end(info))

    def at_validation_end(self, info):
        return self._record("at_validation_end", info, super().at_validation_end(info))

    def at_train_end(self, info):
        return self._record("at_train_end", info, super().at_train_end(info))


def _shape(decision: Decision) -> tuple:
    """A decision with its paths as basenames (a replay decides in another directory)."""
    base = os.path.basename
    return (
        decision.why,
        tuple(map(base, decision.names)),
        tuple((base(a), base(b)) for a, b in decision.links),
        tuple(map(base, decision.removals)),
        decision.global_step,
    )


def test_the_files_a_fit_writes_are_the_ones_the_policy_decides_from_its_infos(tmp_path):
    configs = {
        "top2": dict(monitor="score", mode="min", save_top_k=2, save_last=True),
        "steps": dict(every_n_train_steps=3, save_top_k=-1),
        "link": dict(monitor="score", mode="max", filename="{epoch}-{score:.2f}", save_last="link"),
        "time": dict(train_time_interval=timedelta(0)),  # due at every batch: the time path, deterministically
    }
    cbs = {k: Recording(dirpath=str(tmp_path / "run" / k), **kw) for k, kw in configs.items()}
    x, y = arrays(32)
    train = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)]
    epochs = 4
    trainer = jl.Trainer(
        max_epochs=epochs,
        callbacks=list(cbs.values()),
        **quiet(enable_checkpointing=None, num_sanity_val_steps=1),
    )
    trainer.fit(Scored(), train, [(x[:8], y[:8])])

    for key, cb in cbs.items():
        methods = [m for m, _, _ in cb.calls]
        assert methods.count("at_validation_end") == epochs + 1, key  # the sanity check's included
        assert cb.calls[methods.index("at_validation_end")][2] == Decision(why="sanity check"), key
        # what the run wrote is what its decisions named
        applied = Dir()
        for _, _, decision in cb.calls:
            applied.take(decision)
        on_disk = {n for n in os.listdir(cb.dirpath) if n.endswith(".ckpt")}
        assert applied.saves() and on_disk == applied.files, key
        for s in applied.saves():
            p = s.names[0]
            if os.path.basename(p) in on_disk and not os.path.islink(p):
                assert jl.checkpoint.read_meta(p)["global_step"] == s.global_step, (key, p)
        # and the policy alone, fed the same infos in another directory, decides the same
        replay = ModelCheckpoint(dirpath=str(tmp_path / "replay" / key), **cb.kwargs)
        replayed = [_shape(getattr(replay, m)(info)) for m, info, _ in cb.calls]
        assert replayed == [_shape(d) for _, _, d in cb.calls], key
        assert os.path.basename(replay.best_model_path) == os.path.basename(cb.best_model_path), key

    best2 = sorted(range(epochs), key=lambda e: SCORES[e])[:2]
    assert {n for n in os.listdir(cbs["top2"].dirpath) if n.endswith(".ckpt")} == {name(e) for e in best2} | {
        "last.ckpt"
    }
    steps = sorted(s.global_step for s in _applied(cbs["steps"]).saves())
    assert steps == list(range(3, epochs * BATCHES + 1, 3))
    assert len(_applied(cbs["time"]).saves()) == epochs * BATCHES  # one per batch, each replacing the one before


def _applied(cb: Recording) -> Dir:
    d = Dir()
    for _, _, decision in cb.calls:
        d.take(decision)
    return d
