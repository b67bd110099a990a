"""One tiny program written twice, for PyTorch Lightning 2.x and for jaxlight, and what each run leaves behind.

The program is a linear regression (3 inputs, 1 output) trained with plain SGD. The jaxlight model starts
from the torch model's initial weights (copied into ``nnx.Linear``) and both read the same batches from
the same ``torch.utils.data.DataLoader``\\ s, so every number a user can see (losses, weights, metrics,
CSV cells, early-stopping decisions) is the same up to float32 rounding. ``run(framework, ...)`` runs
one configuration and returns a :class:`Run`: plain Python data to compare.

The validation target is a shrunk copy of the training target, so the validation loss falls for an
epoch and then rises steadily: EarlyStopping has a clear decision to make at every check.
"""

from __future__ import annotations

import csv
import glob
import inspect
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

IN = 3
TRAIN_ROWS, VAL_ROWS, BATCH = 24, 8, 4  # 6 train batches and 2 validation batches per epoch
W_TRUE = np.array([[1.5, -2.0, 0.75]], np.float32)
LR = 0.05

# Hooks both frameworks have, recorded on a callback and on the module (torch-only hooks left out).
CALLBACK_HOOKS = [
    "setup",
    "teardown",
    "on_fit_start",
    "on_fit_end",
    "on_sanity_check_start",
    "on_sanity_check_end",
    "on_train_start",
    "on_train_end",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_train_batch_start",
    "on_train_batch_end",
    "on_validation_start",
    "on_validation_end",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_start",
    "on_test_end",
    "on_test_epoch_start",
    "on_test_epoch_end",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_predict_start",
    "on_predict_end",
    "on_predict_epoch_start",
    "on_predict_epoch_end",
    "on_predict_batch_start",
    "on_predict_batch_end",
    "on_save_checkpoint",
    "on_load_checkpoint",
]
MODULE_HOOKS = tuple(h for h in CALLBACK_HOOKS if h not in ("on_sanity_check_start", "on_sanity_check_end")) + (
    "on_validation_model_eval",
    "on_validation_model_train",
    "on_test_model_eval",
    "on_predict_model_eval",
)


def data(rows: int = TRAIN_ROWS, seed: int = 0, val: bool = False) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, IN)).astype(np.float32)
    w = W_TRUE * (0.35 if val else 1.0)
    y = (x @ w.T + 0.1 * rng.normal(size=(rows, 1))).astype(np.float32)
    return x, y


def loader(rows: int = TRAIN_ROWS, seed: int = 0, val: bool = False, batch_size: int = BATCH):
    import torch

    x, y = data(rows, seed, val)
    ds = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=False)


def initial_weights() -> tuple[np.ndarray, np.ndarray]:
    import torch

    g = torch.Generator().manual_seed(0)
    w = (torch.rand(1, IN, generator=g) - 0.5).numpy()
    b = (torch.rand(1, generator=g) - 0.5).numpy()
    return w.astype(np.float32), b.astype(np.float32)


# ----------------------------------------------------------------------------- what a run leaves behind
@dataclass
class Run:
    events: list[tuple] = field(default_factory=list)  # (owner, hook, batch_idx, dataloader_idx, step, epoch)
    weights: list[np.ndarray | None] = field(default_factory=list)  # per event: weights a callback hook saw
    callback_metrics: dict[str, float] = field(default_factory=dict)
    logged_metrics: dict[str, float] = field(default_factory=dict)
    progress_bar_metrics: dict[str, float] = field(default_factory=dict)
    csv_rows: list[dict[str, float]] = field(default_factory=list)
    global_step: int = 0
    current_epoch: int = 0
    final_weights: np.ndarray | None = None
    early_stopping: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    results: Any = None  # validate/test return values, predictions
    estimated_stepping_batches: Any = None
    num_training_batches_in_configure: Any = None
    # at each epoch-end hook (callback and module): (owner, hook, callback, logged, progress-bar metrics,
    # whether in the sanity check)
    epoch_end_metrics: list[tuple] = field(default_factory=list)


def _metrics(d: dict) -> dict[str, float]:
    return {k: float(np.asarray(v.detach() if hasattr(v, "detach") else v)) for k, v in d.items()}


EPOCH_END_HOOKS = ("on_train_epoch_end", "on_validation_epoch_end", "on_test_epoch_end")


def _metric_views(trainer) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """``callback_metrics``, ``logged_metrics`` and ``progress_bar_metrics`` as a hook sees them."""
    return _metrics(trainer.callback_metrics), _metrics(trainer.logged_metrics), _metrics(trainer.progress_bar_metrics)


def _nested(preds: list, fn) -> list:
    """Per-batch predictions (a list per loader when there are several) as numpy arrays."""
    return [_nested(p, fn) if isinstance(p, list) else fn(p) for p in preds]


def _csv_rows(log_dir: str) -> list[dict[str, float]]:
    path = os.path.join(log_dir, "metrics.csv")
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(f)]


# ----------------------------------------------------------------------------- shared behaviour (mixins)
class RecorderMixin:
    """A callback recording every hook with its counters and the module's weights at that moment."""

    def __init__(self, run: Run, read_weights) -> None:
        super().__init__()
        self._run = run
        self._read = read_weights


def _make_recorder_hook(name: str):
    def hook(self, trainer, pl_module, *args, **kwargs):
        rec = self._run
        idx, dl = _batch_args(name, args, kwargs)
        rec.events.append(("cb", name, idx, dl, trainer.global_step, trainer.current_epoch))
        rec.weights.append(self._read(pl_module))
        if name in EPOCH_END_HOOKS:
            rec.epoch_end_metrics.append(("cb", name, *_metric_views(trainer), trainer.sanity_checking))

    hook.__name__ = name
    return hook


def _batch_args(name: str, args: tuple, kwargs: dict) -> tuple[Any, Any]:
    if "_batch_" not in name:
        return None, None
    first = 1 if name.endswith("_start") else 2  # (batch, idx[, dl]) or (outputs, batch, idx[, dl])
    idx = args[first] if len(args) > first else kwargs.get("batch_idx")
    dl = args[first + 1] if len(args) > first + 1 else kwargs.get("dataloader_idx")
    return int(idx), (None if dl is None else int(dl))


def _module_hook(name: str, base: Any):
    def hook(self, *args, **kwargs):
        idx, dl = _batch_args(name, args, kwargs)
        t = self.trainer
        self._run.events.append(("module", name, idx, dl, t.global_step, t.current_epoch))
        self._run.weights.append(None)
        if name in EPOCH_END_HOOKS:
            self._run.epoch_end_metrics.append(("module", name, *_metric_views(t), t.sanity_checking))
        return base(self, *args, **kwargs)

    hook.__name__ = name
    return hook


class StopAtMixin:
    """Sets ``trainer.should_stop`` once ``global_step`` reaches ``step`` (a user's own stopping rule)."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, *args, **kwargs):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


# ----------------------------------------------------------------------------- the configuration
@dataclass
class Program:
    """One configuration: Trainer arguments, callbacks and what the module logs."""

    trainer: dict[str, Any] = field(default_factory=dict)
    callbacks: tuple[tuple[str, dict], ...] = ()
    train_rows: int = TRAIN_ROWS
    val_rows: int = VAL_ROWS
    val_loaders: int = 1  # several validation loaders (the second has its own rows and seed)
    val: bool = True
    log_in_hooks: bool = False  # self.log in on_train_epoch_end / on_validation_epoch_end too
    end_epoch_at: int | None = None  # on_train_batch_start returns -1 at this batch_idx
    schedule: bool = False  # a step-wise learning-rate schedule (halves every 2 optimizer steps)
    stages: tuple[str, ...] = ("fit",)  # then "validate", "test", "predict" with the fitted module
    csv: bool = True


def _callbacks(fw: str, prog: Program, tmp: str, run_dir: str) -> list:
    out = []
    for kind, kw in prog.callbacks:
        kw = dict(kw)
        if fw == "pl":
            import pytorch_lightning as pl

            cbs = pl.callbacks
        else:
            import jaxlight as jl

            cbs = jl.callbacks
        if kind == "es":
            out.append(cbs.EarlyStopping(**kw))
        elif kind == "ckpt":
            kw.setdefault("dirpath", os.path.join(tmp, run_dir, "ckpts"))
            if fw == "jl":
                kw.setdefault("async_save", False)
            out.append(cbs.ModelCheckpoint(**kw))
        elif kind == "lrm":
            out.append(cbs.LearningRateMonitor(**kw))
        elif kind == "stop_at":
            base = cbs.Callback
            out.append(type("StopAt", (StopAtMixin, base), {})(**kw))
        else:  # pragma: no cover
            raise ValueError(kind)
    return out


def _val_loaders(prog: Program):
    if not prog.val:
        return None
    loaders = [loader(prog.val_rows, seed=1, val=True)]
    if prog.val_loaders > 1:
        loaders += [loader(prog.val_rows + 4 * i, seed=1 + i, val=True) for i in range(1, prog.val_loaders)]
        return loaders
    return loaders[0]


def _eval_steps(multi: bool) -> type:
    """The eval step methods both frameworks' modules share, word for word (each module defines
    ``_eval`` and ``net``); with several validation loaders they take ``dataloader_idx``."""
    if multi:

        class MultiLoader:
            def validation_step(self, batch, batch_idx, dataloader_idx=0):
                loss = self._eval(batch, "val")
                if dataloader_idx == 1:  # a name without the loader suffix, logged by one loader only
                    self.log("second_only", loss, add_dataloader_idx=False)
                return loss

            def test_step(self, batch, batch_idx, dataloader_idx=0):
                return self._eval(batch, "test")

            def predict_step(self, batch, batch_idx, dataloader_idx=0):
                return self.net(batch[0])

        return MultiLoader

    class OneLoader:
        def validation_step(self, batch, batch_idx):
            return self._eval(batch, "val")

        def test_step(self, batch, batch_idx):
            return self._eval(batch, "test")

        def predict_step(self, batch, batch_idx):
            return self.net(batch[0])

    return OneLoader


# ----------------------------------------------------------------------------- PyTorch Lightning
def _pl_module(prog: Program, run: Run):
    import pytorch_lightning as pl
    import torch

    w, b = initial_weights()
    multi = prog.val_loaders > 1

    class Lit(_eval_steps(multi), pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(IN, 1)
            with torch.no_grad():
                self.net.weight.copy_(torch.from_numpy(w))
                self.net.bias.copy_(torch.from_numpy(b))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = ((self.net(x) - y) ** 2).mean()
            self.log("train_loss", loss, prog_bar=True)
            self.log("tl", loss, on_step=True, on_epoch=True)
            return loss

        def _eval(self, batch, prefix):
            x, y = batch
            loss = ((self.net(x) - y) ** 2).mean()
            self.log(f"{prefix}_loss", loss, prog_bar=True)
            if prefix == "val":
                self.log("vs", loss, on_step=True)
            return loss

        def configure_optimizers(self):
            run.estimated_stepping_batches = self.trainer.estimated_stepping_batches
            run.num_training_batches_in_configure = self.trainer.num_training_batches
            opt = torch.optim.SGD(self.parameters(), lr=LR)
            if prog.schedule:
                sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
                return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
            return opt

        def on_train_epoch_end(self):
            if prog.log_in_hooks:
                self.log("epoch_marker", float(self.current_epoch + 1))

        def on_validation_epoch_end(self):
            if prog.log_in_hooks:
                self.log("val_marker", float(self.global_step))

        def on_train_batch_start(self, batch, batch_idx):
            if prog.end_epoch_at is not None and batch_idx == prog.end_epoch_at:
                return -1
            return None

    ns = {h: _module_hook(h, getattr(Lit, h)) for h in MODULE_HOOKS}
    ns.update(prepare_data=_module_hook("prepare_data", Lit.prepare_data))
    cls = type("RecordedLit", (Lit,), ns)
    m = cls()
    m._run = run
    return m


def _pl_weights(module) -> np.ndarray:
    return np.concatenate([module.net.weight.detach().numpy().ravel(), module.net.bias.detach().numpy().ravel()])


def _run_pl(prog: Program, tmp: str, ckpt_path: str | None = None, run_dir: str = "pl") -> Run:
    import logging
    import warnings

    import pytorch_lightning as pl

    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    run = Run()
    rec_cls = type("Recorder", (RecorderMixin, pl.Callback), {h: _make_recorder_hook(h) for h in CALLBACK_HOOKS})
    callbacks = [rec_cls(run, _pl_weights), *_callbacks("pl", prog, tmp, run_dir)]
    kw = dict(prog.trainer)
    logger = pl.loggers.CSVLogger(os.path.join(tmp, run_dir), name="logs") if prog.csv else False
    if not any(k == "ckpt" for k, _ in prog.callbacks):
        kw.setdefault("enable_checkpointing", False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=logger,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=os.path.join(tmp, run_dir),
        **kw,
    )
    module = _pl_module(prog, run)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if "fit" in prog.stages:
            trainer.fit(module, loader(prog.train_rows), _val_loaders(prog), ckpt_path=ckpt_path)
        results = {}
        for stage in prog.stages:
            if stage == "validate":
                results["validate"] = [_metrics(d) for d in trainer.validate(module, _val_loaders(prog), verbose=False)]
            elif stage == "test":
                results["test"] = [_metrics(d) for d in trainer.test(module, _val_loaders(prog), verbose=False)]
            elif stage == "predict":
                preds = trainer.predict(module, _val_loaders(prog))
                results["predict"] = _nested(preds, lambda p: p.detach().numpy())
    _finish(run, trainer, module, _pl_weights, results)
    if logger:
        run.csv_rows = _csv_rows(logger.log_dir)
    return run


# ----------------------------------------------------------------------------- jaxlight
def _jl_module(prog: Program, run: Run):
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jaxlight as jl
    from jaxlight.data import batch_mask

    w, b = initial_weights()
    multi = prog.val_loaders > 1

    class Lit(_eval_steps(multi), jl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nnx.Linear(IN, 1, rngs=nnx.Rngs(0))
            self.net.kernel[...] = jnp.asarray(w.T)
            self.net.bias[...] = jnp.asarray(b)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = ((self.net(x) - y) ** 2).mean()
            self.log("train_loss", loss, prog_bar=True)
            self.log("tl", loss, on_step=True, on_epoch=True)
            return loss

        def _eval(self, batch, prefix):
            # a padded last batch: the mean over its real rows (jaxlight's mask; all True for full batches)
            x, y = batch
            mask = batch_mask(batch)
            loss = (((self.net(x) - y) ** 2).mean(-1) * mask).sum() / mask.sum()
            self.log(f"{prefix}_loss", loss, prog_bar=True)
            if prefix == "val":
                self.log("vs", loss, on_step=True)
            return loss

        def configure_optimizers(self):
            run.estimated_stepping_batches = self.trainer.estimated_stepping_batches
            run.num_training_batches_in_configure = self.trainer.num_training_batches
            if prog.schedule:
                sched = optax.exponential_decay(LR, transition_steps=2, decay_rate=0.5, staircase=True)
                return {"optimizer": optax.inject_hyperparams(optax.sgd)(learning_rate=LR), "lr_scheduler": sched}
            return optax.sgd(LR)

        def on_train_epoch_end(self):
            if prog.log_in_hooks:
                self.log("epoch_marker", float(self.current_epoch + 1))

        def on_validation_epoch_end(self):
            if prog.log_in_hooks:
                self.log("val_marker", float(self.global_step))

        def on_train_batch_start(self, batch, batch_idx):
            if prog.end_epoch_at is not None and batch_idx == prog.end_epoch_at:
                return -1
            return None

    ns = {h: _module_hook(h, getattr(Lit, h)) for h in MODULE_HOOKS}
    ns.update(prepare_data=_module_hook("prepare_data", Lit.prepare_data))
    cls = type("RecordedLit", (Lit,), ns)
    m = cls()
    m._run = run
    return m


def _jl_weights(module) -> np.ndarray:
    net = module.net
    return np.concatenate([np.asarray(net.kernel[...]).T.ravel(), np.asarray(net.bias[...]).ravel()])


def _run_jl(prog: Program, tmp: str, ckpt_path: str | None = None, run_dir: str = "jl") -> Run:
    import jaxlight as jl

    run = Run()
    rec_cls = type("Recorder", (RecorderMixin, jl.Callback), {h: _make_recorder_hook(h) for h in CALLBACK_HOOKS})
    callbacks = [rec_cls(run, _jl_weights), *_callbacks("jl", prog, tmp, run_dir)]
    kw = dict(prog.trainer)
    logger = jl.loggers.CSVLogger(os.path.join(tmp, run_dir), name="logs") if prog.csv else False
    if not any(k == "ckpt" for k, _ in prog.callbacks):
        kw.setdefault("enable_checkpointing", False)
    trainer = jl.Trainer(
        devices=1,
        logger=logger,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=os.path.join(tmp, run_dir),
        **kw,
    )
    module = _jl_module(prog, run)
    if "fit" in prog.stages:
        trainer.fit(module, loader(prog.train_rows), _val_loaders(prog), ckpt_path=ckpt_path)
    results = {}
    for stage in prog.stages:
        if stage == "validate":
            results["validate"] = [_metrics(d) for d in trainer.validate(module, _val_loaders(prog), verbose=False)]
        elif stage == "test":
            results["test"] = [_metrics(d) for d in trainer.test(module, _val_loaders(prog), verbose=False)]
        elif stage == "predict":
            preds = trainer.predict(module, _val_loaders(prog))
            results["predict"] = _nested(preds, np.asarray)
    _finish(run, trainer, module, _jl_weights, results)
    if logger:
        run.csv_rows = _csv_rows(logger.log_dir)
    return run


# ----------------------------------------------------------------------------- common
def _finish(run: Run, trainer, module, read_weights, results) -> None:
    run.callback_metrics = _metrics(trainer.callback_metrics)
    run.logged_metrics = _metrics(trainer.logged_metrics)
    run.progress_bar_metrics = _metrics(trainer.progress_bar_metrics)
    run.global_step = int(trainer.global_step)
    run.current_epoch = int(trainer.current_epoch)
    run.final_weights = read_weights(module)
    run.results = results
    for cb in trainer.callbacks:
        name = type(cb).__name__
        if name == "EarlyStopping":
            run.early_stopping.append(
                {
                    "stopped_epoch": int(cb.stopped_epoch),
                    "wait_count": int(cb.wait_count),
                    "best_score": float(np.asarray(cb.best_score)),
                }
            )
        elif name == "ModelCheckpoint":
            d = cb.dirpath
            run.checkpoints.append(
                {
                    "files": sorted(os.path.basename(p) for p in glob.glob(os.path.join(d, "*.ckpt"))),
                    "best": os.path.basename(cb.best_model_path),
                    "last": os.path.basename(cb.last_model_path),
                    "best_score": None if cb.best_model_score is None else float(np.asarray(cb.best_model_score)),
                    "last_step": _ckpt_step(cb.last_model_path) if cb.last_model_path else None,
                    "kth": os.path.basename(cb.kth_best_model_path),
                    "best_k": sorted(os.path.basename(p) for p in cb.best_k_models),
                }
            )


def _ckpt_step(path: str) -> int:
    if os.path.isdir(path):  # jaxlight: an orbax directory with JSON metadata
        from jaxlight.checkpoint import read_meta

        return int(read_meta(path)["global_step"])
    import torch

    return int(torch.load(path, map_location="cpu", weights_only=False)["global_step"])


def run(framework: str, prog: Program, tmp: str, ckpt_path: str | None = None, run_dir: str | None = None) -> Run:
    """Run ``prog`` with ``framework`` ("pl" or "jl"); files go under ``tmp/<run_dir or framework>``."""
    fn = _run_pl if framework == "pl" else _run_jl
    return fn(prog, tmp, ckpt_path, run_dir or framework)


def callback_hook_names() -> list[str]:
    """Hooks of jaxlight's Callback (so a test can check CALLBACK_HOOKS misses none)."""
    import jaxlight as jl

    # declared capabilities (not hooks the loop calls at a point of its own)
    skip = {
        "state_dict",
        "load_state_dict",
        "step_extension",
        "init_step_state",
        "eval_params",
        "wait_until_finished",
        "best_checkpoint_path",
        "save_now",
        "check_state_dict",
    }
    return [
        n for n, _ in inspect.getmembers(jl.Callback, inspect.isfunction) if not n.startswith("_") and n not in skip
    ]
