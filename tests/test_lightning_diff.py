"""Differential tests: the same tiny program through PyTorch Lightning 2.x and jaxlight must leave the same
things behind (issue 16).

Each configuration of the table is one test. Both frameworks train the same linear model from the same
initial weights on the same batches with SGD (``tests/lightning_programs.py``); the test then compares
everything a user can see: the hook sequence (callback and module hooks, with batch index, dataloader index,
``global_step`` and ``current_epoch`` at each call), the module's weights read in every callback hook,
``callback_metrics`` / ``logged_metrics`` / ``progress_bar_metrics`` (keys and values, at the end and as
every epoch-end hook sees them), every CSV row the
CSVLogger wrote, EarlyStopping's decision and state, checkpoint file names, ``best_model_path``,
``last.ckpt``'s step, the weights after training, ``estimated_stepping_batches`` and the results of
``validate``/``test``/``predict``. Values agree to float32 rounding (rtol 1e-4).

Documented differences (docs/trainer.md, "Differences from Lightning") are normalised here, each named:
- ``save_last=True``: jaxlight's ``last.ckpt`` shares the files of the top-k checkpoint of the same step,
  so ``on_save_checkpoint`` runs once per saved step where Lightning runs it twice;
- ``num_training_batches`` inside ``configure_optimizers``: jaxlight always knows it, Lightning only once
  ``estimated_stepping_batches`` was read (which our program does first, except with ``max_epochs=-1``);
- ``estimated_stepping_batches`` with ``limit_train_batches=0``: jaxlight says 0, Lightning -1 (it never
  looks at the loader then and returns ``max_steps``);
- the sanity check's epoch-end hooks with several validation loaders: Lightning shows empty callback and
  progress-bar metrics (and only the per-batch values in ``logged_metrics``), jaxlight the reductions as it
  does with one loader; those three views are not compared there;
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

pytest.importorskip("pytorch_lightning")
pytest.importorskip("torch")

from tests.lightning_programs import CALLBACK_HOOKS, Program, Run, callback_hook_names, run

RTOL, ATOL = 1e-4, 1e-6

ES = "es"
CKPT = "ckpt"
ES_VAL = (ES, {"monitor": "val_loss", "patience": 2})
CKPT_VAL = (CKPT, {"monitor": "val_loss", "save_top_k": 2, "save_last": True})

CONFIGS: dict[str, Program] = {
    # epochs, steps, logging cadence
    "epochs": Program(trainer=dict(max_epochs=2)),
    "log_every_2": Program(trainer=dict(max_epochs=3, log_every_n_steps=2)),
    "log_every_1": Program(trainer=dict(max_epochs=1, log_every_n_steps=1)),
    "max_steps_mid_epoch": Program(trainer=dict(max_steps=4)),
    "max_steps_across_epochs": Program(trainer=dict(max_steps=8, max_epochs=5, log_every_n_steps=3)),
    "max_steps_zero": Program(trainer=dict(max_steps=0, max_epochs=3)),
    "min_steps": Program(
        trainer=dict(max_epochs=4, min_steps=14), callbacks=((ES, {"monitor": "val_loss", "patience": 1}),)
    ),
    # validation cadence
    "val_check_half": Program(trainer=dict(max_epochs=2, val_check_interval=0.5)),
    "val_check_quarter": Program(trainer=dict(max_epochs=1, val_check_interval=0.25, log_every_n_steps=1)),
    "val_check_int": Program(trainer=dict(max_epochs=2, val_check_interval=2)),
    "val_check_across_epochs": Program(trainer=dict(max_epochs=3, val_check_interval=4, check_val_every_n_epoch=None)),
    "check_val_every_2": Program(trainer=dict(max_epochs=4, check_val_every_n_epoch=2)),
    # limits and the sanity check
    "limits_int": Program(trainer=dict(max_epochs=2, limit_train_batches=3, limit_val_batches=1)),
    "limits_float": Program(trainer=dict(max_epochs=2, limit_train_batches=0.5, limit_val_batches=0.5)),
    "limit_val_zero": Program(trainer=dict(max_epochs=2, limit_val_batches=0, num_sanity_val_steps=2)),
    "limit_train_zero": Program(trainer=dict(max_epochs=2, limit_train_batches=0)),
    "no_sanity": Program(trainer=dict(max_epochs=1, num_sanity_val_steps=0)),
    "sanity_all": Program(trainer=dict(max_epochs=1, num_sanity_val_steps=-1)),
    "sanity_more_than_batches": Program(trainer=dict(max_epochs=1, num_sanity_val_steps=5)),
    # gradient accumulation (a partial window steps at the epoch's end)
    "accumulate_2": Program(trainer=dict(max_epochs=2, accumulate_grad_batches=2, log_every_n_steps=1)),
    "accumulate_4_partial": Program(trainer=dict(max_epochs=2, accumulate_grad_batches=4, log_every_n_steps=1)),
    "accumulate_max_steps": Program(trainer=dict(max_epochs=3, accumulate_grad_batches=4, max_steps=3)),
    "accumulate_val_half": Program(trainer=dict(max_epochs=2, accumulate_grad_batches=4, val_check_interval=0.5)),
    # fast_dev_run, max_time
    "fast_dev_run": Program(trainer=dict(fast_dev_run=True)),
    "fast_dev_run_3": Program(trainer=dict(fast_dev_run=3)),
    "max_time_spent": Program(trainer=dict(max_time={"seconds": 0})),
    "max_time_spent_checkpoint": Program(trainer=dict(max_time={"seconds": 0}), callbacks=(CKPT_VAL,)),
    # what the module does
    "log_in_hooks_and_eval_stages": Program(
        trainer=dict(max_epochs=2), log_in_hooks=True, stages=("fit", "validate", "test", "predict")
    ),
    "end_epoch_from_batch_start": Program(trainer=dict(max_epochs=3), end_epoch_at=3),
    "user_stops_mid_epoch": Program(trainer=dict(max_epochs=3), callbacks=(("stop_at", {"step": 8}),)),
    "ragged_last_val_batch": Program(
        trainer=dict(max_epochs=2), val_rows=10, stages=("fit", "validate", "test", "predict")
    ),
    # a ragged last train batch trains in a step compiled for its shape, as Lightning trains it (issue 23)
    "ragged_last_train_batch": Program(trainer=dict(max_epochs=2), train_rows=26, val_rows=10),
    "ragged_train_accumulate_4": Program(
        trainer=dict(max_epochs=2, accumulate_grad_batches=4, log_every_n_steps=1), train_rows=26, val_rows=10
    ),
    "two_val_loaders": Program(
        trainer=dict(max_epochs=2), val_loaders=2, stages=("fit", "validate", "test", "predict")
    ),
    "eval_only": Program(stages=("validate", "test", "predict"), val_rows=10),
    # learning-rate schedule and LearningRateMonitor
    "lr_monitor_step": Program(
        trainer=dict(max_epochs=2, log_every_n_steps=1), schedule=True, callbacks=(("lrm", {}),)
    ),
    "lr_monitor_step_accumulate_2": Program(
        trainer=dict(max_epochs=2, log_every_n_steps=1, accumulate_grad_batches=2),
        schedule=True,
        callbacks=(("lrm", {}),),
    ),
    "lr_monitor_epoch": Program(
        trainer=dict(max_epochs=2), schedule=True, callbacks=(("lrm", {"logging_interval": "epoch"}),)
    ),
    # EarlyStopping
    "es_patience_2": Program(trainer=dict(max_epochs=6), callbacks=(ES_VAL,)),
    "es_min_epochs": Program(
        trainer=dict(max_epochs=6, min_epochs=4), callbacks=((ES, {"monitor": "val_loss", "patience": 1}),)
    ),
    "es_mode_max": Program(
        trainer=dict(max_epochs=5),
        callbacks=((ES, {"monitor": "val_loss", "mode": "max", "patience": 2, "min_delta": 0.01}),),
    ),
    "es_after_validation": Program(
        trainer=dict(max_epochs=6),
        callbacks=((ES, {"monitor": "val_loss", "patience": 1, "check_on_train_epoch_end": False}),),
    ),
    "es_val_half": Program(trainer=dict(max_epochs=6, val_check_interval=0.5), callbacks=(ES_VAL,)),
    "es_stopping_threshold": Program(
        trainer=dict(max_epochs=6), callbacks=((ES, {"monitor": "tl_epoch", "stopping_threshold": 0.5}),)
    ),
    "es_divergence_threshold": Program(
        trainer=dict(max_epochs=6),
        callbacks=((ES, {"monitor": "val_loss", "divergence_threshold": 0.12, "patience": 10}),),
    ),
    "es_on_train_metric": Program(
        trainer=dict(max_epochs=4), callbacks=((ES, {"monitor": "train_loss", "patience": 1}),)
    ),
    # ModelCheckpoint
    "ckpt_default": Program(trainer=dict(max_epochs=2), callbacks=((CKPT, {}),)),
    "ckpt_top_k_and_last": Program(trainer=dict(max_epochs=4), callbacks=(CKPT_VAL,)),
    "ckpt_every_n_steps": Program(
        trainer=dict(max_epochs=3), callbacks=((CKPT, {"every_n_train_steps": 4, "save_top_k": -1}),)
    ),
    "ckpt_every_2_epochs": Program(
        trainer=dict(max_epochs=4), callbacks=((CKPT, {"every_n_epochs": 2, "save_top_k": -1}),)
    ),
    "ckpt_filename_template": Program(
        trainer=dict(max_epochs=3), callbacks=((CKPT, {"monitor": "val_loss", "filename": "{epoch}-{val_loss:.3f}"}),)
    ),
    "ckpt_val_half": Program(trainer=dict(max_epochs=2, val_check_interval=0.5), callbacks=(CKPT_VAL,)),
    "ckpt_last_link": Program(
        trainer=dict(max_epochs=2), callbacks=((CKPT, {"monitor": "val_loss", "save_last": "link"}),)
    ),
    "ckpt_accumulate_max_steps": Program(
        trainer=dict(max_epochs=3, accumulate_grad_batches=4, max_steps=3), callbacks=((CKPT, {"save_last": True}),)
    ),
    # checkpointing runs after the other epoch-end callbacks, whatever the list order (issue 16 item 1)
    "ckpt_then_es": Program(trainer=dict(max_epochs=6), callbacks=(CKPT_VAL, ES_VAL)),
    "es_then_ckpt": Program(trainer=dict(max_epochs=6), callbacks=(ES_VAL, CKPT_VAL)),
    "ckpt_then_es_val_half": Program(trainer=dict(max_epochs=6, val_check_interval=0.5), callbacks=(CKPT_VAL, ES_VAL)),
    "es_then_ckpt_val_half": Program(trainer=dict(max_epochs=6, val_check_interval=0.5), callbacks=(ES_VAL, CKPT_VAL)),
}


# ------------------------------------------------------------------------------------------ comparison
def _close(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        if a is None or b is None:
            return a is b
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL)
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and np.allclose(a, b, rtol=RTOL, atol=1e-5)
    return a == b


def _events(run: Run) -> tuple[list[tuple], list]:
    """The hook sequence and the weights seen at each hook, with Lightning's second ``on_save_checkpoint``
    round for ``last.ckpt`` folded into the first (jaxlight writes that step once; see the module docstring)."""
    out: list[tuple] = []
    weights: list = []
    for e, w in zip(run.events, run.weights):
        if e[1] == "on_save_checkpoint" and (
            (e[0] == "cb" and out[-2:] == [("cb", *e[1:]), ("module", *e[1:])])
            or (e[0] == "module" and out[-1:] == [("module", *e[1:])])
        ):
            continue
        out.append(e)
        weights.append(w)
    return out, weights


def compare(a: Run, b: Run, prog: Program | None = None) -> tuple[list[str], int]:
    """Differences between a Lightning run ``a`` and a jaxlight run ``b``, and how many values were compared."""
    diffs: list[str] = []
    n = 0

    def check(what: str, x, y) -> None:
        nonlocal n
        n += 1
        if not _close(x, y):
            diffs.append(f"{what}:\n  lightning: {x}\n  jaxlight:  {y}")

    (ea, wa), (eb, wb) = _events(a), _events(b)
    n += len(ea)
    if ea != eb:
        import difflib

        lines = difflib.unified_diff(
            [str(e) for e in ea], [str(e) for e in eb], "lightning", "jaxlight", n=2, lineterm=""
        )
        diffs.append("hook sequence:\n" + "\n".join(list(lines)[:60]))
    else:
        seen = [(e, u, v) for e, u, v in zip(ea, wa, wb) if u is not None]
        n += len(seen)
        bad = [(e, u, v) for e, u, v in seen if float(np.abs(u - v).max()) > 1e-5]
        if bad:
            e, u, v = bad[0]
            diffs.append(f"module weights seen in {len(bad)} hooks differ, first at {e}: {u} vs {v}")
    for view in ("callback_metrics", "logged_metrics", "progress_bar_metrics"):
        x, y = getattr(a, view), getattr(b, view)
        check(f"{view} keys", sorted(x), sorted(y))
        for k in sorted(set(x) & set(y)):
            check(f"{view}[{k!r}]", x[k], y[k])
    # what every epoch-end hook (callback's and module's, train/validation/test) sees in the three views
    check("epoch-end hooks seen", [e[:2] for e in a.epoch_end_metrics], [e[:2] for e in b.epoch_end_metrics])
    for i, (x, y) in enumerate(zip(a.epoch_end_metrics, b.epoch_end_metrics)):
        if x[5] and prog is not None and prog.val_loaders > 1:  # the sanity check: see the module docstring
            continue
        for j, view in enumerate(("callback_metrics", "logged_metrics", "progress_bar_metrics")):
            check(f"{view} in {x[0]}'s {x[1]} (#{i})", x[2 + j], y[2 + j])
    check("number of CSV rows", len(a.csv_rows), len(b.csv_rows))
    for i, (r1, r2) in enumerate(zip(a.csv_rows, b.csv_rows)):
        check(f"CSV row {i}", r1, r2)
    check("global_step", a.global_step, b.global_step)
    check("current_epoch", a.current_epoch, b.current_epoch)
    check("final weights", a.final_weights, b.final_weights)
    check("EarlyStopping", a.early_stopping, b.early_stopping)
    check("ModelCheckpoint", a.checkpoints, b.checkpoints)
    if prog is None or prog.trainer.get("limit_train_batches") != 0:
        check("estimated_stepping_batches", a.estimated_stepping_batches, b.estimated_stepping_batches)
    if a.num_training_batches_in_configure not in (None, math.inf):
        check(
            "num_training_batches in configure_optimizers",
            a.num_training_batches_in_configure,
            b.num_training_batches_in_configure,
        )
    check("stages run", sorted(a.results), sorted(b.results))
    for stage in sorted(set(a.results) & set(b.results)):
        x, y = a.results[stage], b.results[stage]
        if stage == "predict":
            flat = lambda r: r if not r or not isinstance(r[0], list) else [p for dl in r for p in dl]
            check("predict output shapes", [p.shape for p in flat(x)], [p.shape for p in flat(y)])
            x, y = flat(x), flat(y)
        check(f"{stage} results", x, y)
    return diffs, n


@pytest.mark.parametrize("name", list(CONFIGS))
def test_same_as_lightning(name, tmp_path):
    prog = CONFIGS[name]
    a = run("pl", prog, str(tmp_path))
    b = run("jl", prog, str(tmp_path))
    diffs, checked = compare(a, b, prog)
    assert checked > 20, checked  # the comparison saw the run (hooks, metrics, rows)
    assert not diffs, f"{name}: {len(diffs)} of {checked} checks differ\n" + "\n".join(diffs)


def test_recorded_hooks_cover_jaxlight_callbacks():
    # every jaxlight Callback hook is compared above, except on_exception (no run here raises)
    assert set(callback_hook_names()) - set(CALLBACK_HOOKS) == {"on_exception"}


# ------------------------------------------------------------------------------------------ resume
RESUME = {
    # EarlyStopping(patience=3) with a checkpoint at every epoch end: the example (resume from epoch 2)
    "epoch_end": (
        Program(
            trainer=dict(max_epochs=10),
            callbacks=((CKPT, {"save_top_k": -1, "monitor": "val_loss"}), (ES, {"monitor": "val_loss", "patience": 3})),
        ),
        "epoch=2-step=18.ckpt",
        True,
    ),
    # validation and checkpointing twice per epoch: resume from the middle of an epoch. Lightning cannot
    # resume a plain DataLoader inside an epoch (it warns and trains the epoch's first batches again), so
    # only the stop point and the hooks are compared with it; jaxlight skips the batches already trained.
    "mid_epoch": (
        Program(
            trainer=dict(max_epochs=10, val_check_interval=0.5),
            callbacks=((ES, {"monitor": "val_loss", "patience": 3}), (CKPT, {"save_top_k": -1, "monitor": "val_loss"})),
        ),
        "epoch=1-step=9.ckpt",
        False,
    ),
}


def _split_at_train_start(r: Run) -> tuple[list[tuple], Run]:
    """The hooks before ``on_train_start`` (without counters and ``on_load_checkpoint``) and the run from
    ``on_train_start`` on. Before it a resumed jaxlight run already holds the restored counters (Lightning
    restores its loops after ``on_fit_start``) and calls the callbacks' ``on_load_checkpoint`` before the
    module's (Lightning: the module's first)."""
    i = next(i for i, e in enumerate(r.events) if e[1] == "on_train_start")
    head = [e[:4] for e in r.events[:i] if e[1] != "on_load_checkpoint"]
    tail = Run(**{**r.__dict__, "events": r.events[i:], "weights": r.weights[i:]})
    return head, tail


@pytest.mark.parametrize("name", list(RESUME))
def test_resume_stops_where_the_uninterrupted_run_stops(name, tmp_path):
    prog, ckpt_name, lightning_exact = RESUME[name]
    tmp = str(tmp_path)
    whole_pl = run("pl", prog, tmp, run_dir="pl_whole")
    whole_jl = run("jl", prog, tmp, run_dir="jl_whole")
    stop = (whole_pl.current_epoch, whole_pl.global_step)
    assert stop[1] < 10 * 6  # EarlyStopping ended the run
    assert (whole_jl.current_epoch, whole_jl.global_step) == stop
    assert ckpt_name in whole_jl.checkpoints[0]["files"]
    assert whole_jl.checkpoints[0]["files"] == whole_pl.checkpoints[0]["files"]

    # resume each framework from its own checkpoint, in a fresh output directory
    resumed_pl = run("pl", prog, tmp, ckpt_path=os.path.join(tmp, "pl_whole", "ckpts", ckpt_name), run_dir="pl_res")
    resumed_jl = run("jl", prog, tmp, ckpt_path=os.path.join(tmp, "jl_whole", "ckpts", ckpt_name), run_dir="jl_res")
    assert (resumed_pl.current_epoch, resumed_pl.global_step) == stop
    assert (resumed_jl.current_epoch, resumed_jl.global_step) == stop
    # jaxlight trains on exactly as if it had never stopped
    assert _close(resumed_jl.final_weights, whole_jl.final_weights)
    assert _close(resumed_jl.early_stopping, whole_jl.early_stopping)

    head_pl, tail_pl = _split_at_train_start(resumed_pl)
    head_jl, tail_jl = _split_at_train_start(resumed_jl)
    assert head_jl == head_pl  # the sanity check runs only when resuming at an epoch boundary, as in Lightning
    if lightning_exact:
        diffs, _ = compare(tail_pl, tail_jl, prog)
        assert not diffs, "\n".join(diffs)
    else:
        assert _events(tail_jl)[0] == _events(tail_pl)[0]
