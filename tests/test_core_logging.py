"""``self.log`` reductions, metric dicts, CSVLogger files and the logging cadence, checked against hand
computations over the data."""

import csv
import os

import jax.numpy as jnp
import numpy as np
import pytest
import yaml

import jaxlight as jl
from tests.core_models import EagerClassifier as Classifier
from tests.core_models import batches, make_data, quiet, xent

N, BS = 128, 16
STEPS = N // BS  # 8 batches per epoch


class Logs(Classifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = xent(self.net(x), y)
        idx = batch_idx.astype(jnp.float32)
        self.log("loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log("first", x[0, 0])  # default: on_step only
        self.log("bsum", idx, on_step=False, on_epoch=True, reduce_fx="sum")
        self.log("bmax", x[:, 1].max(), on_step=False, on_epoch=True, reduce_fx="max")
        self.log("bmin", x[:, 1].min(), on_step=False, on_epoch=True, reduce_fx="min", logger=False)
        # weighted epoch mean with a different explicit batch_size per batch (traced, like a valid-row count)
        self.log("wmean", x[:, 2].mean(), on_step=False, on_epoch=True, batch_size=batch_idx + 1)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(-1) == y).mean(), prog_bar=True)
        self.log("val_x", x[:, 0].mean())  # mean weighted by the inferred batch size (rows)

    def on_train_epoch_end(self):
        self.log("host_metric", float(self.current_epoch) + 0.5)


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_epoch_reductions_and_metric_dicts():
    x, y = make_data(N)
    data = batches(x, y, BS)
    val = batches(x[:40], y[:40], 8)  # 5 val batches
    trainer = jl.Trainer(max_epochs=1, log_every_n_steps=1, **quiet())
    model = Logs()
    trainer.fit(model, data, val)

    cm, lm, pm = trainer.callback_metrics, trainer.logged_metrics, trainer.progress_bar_metrics
    xs = [b[0] for b in data]
    # sum / max / min over the epoch
    assert float(cm["bsum"]) == sum(range(STEPS))
    assert float(cm["bmax"]) == pytest.approx(max(b[:, 1].max() for b in xs), abs=1e-6)
    assert float(cm["bmin"]) == pytest.approx(min(b[:, 1].min() for b in xs), abs=1e-6)
    # weighted mean: sum(v_i * w_i) / sum(w_i) with w_i = i + 1
    w = np.arange(1, STEPS + 1, dtype=np.float64)
    v = np.array([b[:, 2].mean() for b in xs], np.float64)
    assert float(cm["wmean"]) == pytest.approx((v * w).sum() / w.sum(), abs=1e-6)
    assert abs(float(cm["wmean"]) - v.mean()) > 1e-3  # the weighting made a difference
    # validation metrics: means over the val rows
    logits = np.asarray(model.net(jnp.asarray(x[:40])))
    assert float(cm["val_acc"]) == pytest.approx(float((logits.argmax(-1) == y[:40]).mean()), abs=1e-6)
    assert float(cm["val_x"]) == pytest.approx(float(x[:40, 0].mean()), abs=1e-6)
    # on_step + on_epoch forks into name_step / name_epoch; the bare name holds the epoch value
    assert {"loss", "loss_step", "loss_epoch"} <= set(cm)
    assert float(cm["loss"]) == float(cm["loss_epoch"])
    assert "loss" not in lm and {"loss_step", "loss_epoch"} <= set(lm)
    assert float(cm["loss_step"]) == pytest.approx(lm["loss_step"])  # last step, logged every step here
    # defaults: on_step only in training_step, on_epoch only in validation_step; no fork
    assert "val_acc" in lm and "val_acc_step" not in lm and "val_acc_epoch" not in lm
    assert "first" in lm and "first_step" not in lm and "first_epoch" not in lm
    assert lm["first"] == pytest.approx(float(xs[-1][0, 0]))
    # logger=False: in callback_metrics, not logged
    assert "bmin" in cm and "bmin" not in lm
    # host-side self.log in an epoch-end hook
    assert lm["host_metric"] == 0.5 and float(cm["host_metric"]) == 0.5
    # progress bar: only prog_bar=True metrics, with forked names
    assert set(pm) == {"loss_step", "loss_epoch", "val_acc"}
    # Lightning keeps "epoch" out of trainer.logged_metrics (the loggers still receive it: CSV column)
    assert "epoch" not in lm


def test_csv_logger_files_and_cadence(tmp_path):
    x, y = make_data(N)
    data = batches(x, y, BS)
    root = tmp_path / "root"
    every, epochs = 3, 2
    trainer = jl.Trainer(
        max_epochs=epochs,
        log_every_n_steps=every,
        default_root_dir=str(root),
        logger=True,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Logs(lr=0.05), data, data[:2])
    log_dir = root / "lightning_logs" / "version_0"
    assert trainer.log_dir == str(log_dir)
    hp = yaml.safe_load((log_dir / "hparams.yaml").read_text())
    assert hp == {"lr": 0.05, "dropout": 0.0, "batchnorm": False, "opt": "adam"}

    rows = read_csv(log_dir / "metrics.csv")
    step_rows = [r for r in rows if r["loss_step"]]
    total = STEPS * epochs
    # Lightning's cadence: a row when (step + 1) % log_every_n_steps == 0
    assert [int(r["step"]) for r in step_rows] == [s for s in range(total) if (s + 1) % every == 0]
    epoch_rows = [r for r in rows if r["loss_epoch"]]
    # epoch rows carry the step of the epoch's last batch, like Lightning's
    assert [(int(r["step"]), float(r["epoch"])) for r in epoch_rows] == [
        (STEPS * e + STEPS - 1, e) for e in range(epochs)
    ]
    val_rows = [r for r in rows if r["val_acc"]]
    assert len(val_rows) == epochs
    assert "bmin" not in rows[0]  # logger=False
    assert float(epoch_rows[-1]["bsum"]) == sum(range(STEPS))
    assert float(epoch_rows[-1]["host_metric"]) == 1.5
    # the last epoch's epoch loss in the file equals what the trainer reports
    assert float(epoch_rows[-1]["loss_epoch"]) == pytest.approx(float(trainer.callback_metrics["loss_epoch"]))

    # a second run with the default logger takes the next version
    trainer2 = jl.Trainer(
        max_epochs=1,
        default_root_dir=str(root),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer2.fit(Classifier(), data[:2])
    assert trainer2.log_dir == str(root / "lightning_logs" / "version_1")
    assert os.path.exists(root / "lightning_logs" / "version_1" / "metrics.csv")


def test_two_csv_loggers_both_written(tmp_path):
    x, y = make_data(64)
    a, b = jl.loggers.CSVLogger(str(tmp_path / "a")), jl.loggers.CSVLogger(str(tmp_path / "b"), name="run")
    trainer = jl.Trainer(
        max_epochs=1,
        log_every_n_steps=1,
        logger=[a, b],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(Classifier(), batches(x, y, 16))
    ra = read_csv(tmp_path / "a" / "lightning_logs" / "version_0" / "metrics.csv")
    rb = read_csv(tmp_path / "b" / "run" / "version_0" / "metrics.csv")
    assert len(ra) == 4 and ra == rb
    assert [float(r["train_loss"]) for r in ra][-1] == pytest.approx(float(trainer.callback_metrics["train_loss"]))
    assert (tmp_path / "b" / "run" / "version_0" / "hparams.yaml").exists()
    assert trainer.logger is a and trainer.loggers == [a, b]


def test_csv_logger_hparams_stay_nested_and_columns_widen(tmp_path):
    lg = jl.loggers.CSVLogger(str(tmp_path), name="exp", version=3, flush_logs_every_n_steps=1)
    lg.log_hyperparams({"opt": {"lr": 0.1, "betas": (0.9, 0.99)}, "act": object, "n": 2})
    assert lg.log_dir == str(tmp_path / "exp" / "version_3")
    hp = yaml.safe_load((tmp_path / "exp" / "version_3" / "hparams.yaml").read_text())
    assert hp == {"opt": {"lr": 0.1, "betas": [0.9, 0.99]}, "act": repr(object), "n": 2}
    lg.log_metrics({"a": 1.0}, step=0)
    lg.log_metrics({"b": float("nan"), "a": 2.0}, step=1)  # a new column: the file is rewritten once, widened
    lg.finalize("success")
    rows = read_csv(tmp_path / "exp" / "version_3" / "metrics.csv")
    assert [(r["a"], r["b"], r["step"]) for r in rows] == [("1.0", "", "0"), ("2.0", "nan", "1")]


def test_epoch_accumulators_fold_in_chunks_and_equal_a_step_by_step_fold():
    """Epoch values wait on the device and are folded FOLD_CHUNK steps per jitted call; the result is
    exactly the per-step fold it replaced (same order of float operations), across a mid-epoch
    state_dict, a change of the logged keys, and a partial last chunk."""
    import jax
    import jax.numpy as jnp

    from jaxlight.metrics import FOLD_CHUNK, LogSpec, MetricStore, _acc_init, _acc_step, _acc_value

    rng = np.random.default_rng(0)
    fxs = {"mean": "mean", "sum": "sum", "max": "max", "min": "min"}
    store = MetricStore()
    store.register({k: LogSpec(True, True, False, True, fx) for k, fx in fxs.items()})
    calls = []
    n_steps = 2 * FOLD_CHUNK + 5
    # the reference: the per-step jitted fold this replaced
    step_fold = {fx: jax.jit(lambda acc, vw, fx=fx: _acc_step(fx, acc, vw)) for fx in fxs}
    ref = {k: _acc_init(fx) for k, fx in fxs.items()}
    for i in range(n_steps):
        keys = list(fxs) if i != FOLD_CHUNK + 3 else ["mean", "max"]  # one step logs fewer keys
        vals = {k: (jnp.float32(rng.normal()), jnp.float32(rng.integers(1, 9))) for k in keys}
        for k, vw in vals.items():
            ref[k] = step_fold[k](ref[k], vw)
        before = sum(1 for _ in store._pending)
        store.update(vals)
        calls.append(before >= len(store._pending))  # pending shrank or stayed empty: a fold ran
        if i == FOLD_CHUNK + 8:
            saved = store.state_dict()  # folds what is pending
            assert not store._pending
            at_save = {k: float(v) for k, v in store.epoch_values().items()}
    got = {k: float(v) for k, v in store.epoch_values().items()}
    want = {k: float(_acc_value(fxs[k], r)) for k, r in ref.items()}
    assert got == want
    # far fewer folds than steps: every FOLD_CHUNK steps, plus one per key change and per read
    assert sum(calls) <= n_steps // FOLD_CHUNK + 3
    # and a store restored from the mid-epoch state continues from those accumulators
    restored = MetricStore()
    restored.load_state_dict(saved)
    assert {k: float(v) for k, v in restored.epoch_values().items()} == at_save
