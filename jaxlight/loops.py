"""The training loop and the evaluation loop, in Lightning's hook order.

``FitLoop.run`` is epochs of train batches with validation inside (every
``val_check_interval``) and at the epoch end; ``EvalLoop.run`` is one pass of
validation, test or predict over one or several loaders. Both read and move
only public trainer state: the hook dispatcher (``trainer.call_hook``), the
engine (compiled steps and the train state), the reporter (the logging path)
and the loop position.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxlight.data import BatchError, BatchPlacer, Prefetcher, is_loader_collection, num_batches, tail_rows
from jaxlight.errors import MisconfigurationError
from jaxlight.grain_data import adapt_loaders, set_loader_epoch
from jaxlight.imports import rank_zero_info
from jaxlight.stages import STAGES, TRAIN, VALIDATE, Stage

if TYPE_CHECKING:  # pragma: no cover
    from jaxlight.trainer import Trainer

_FLUSH, _NO_FLUSH = np.bool_(True), np.bool_(False)
_INDEX_CACHE: list[np.ndarray] = []


def step_index(i: int) -> np.ndarray:
    """``batch_idx`` as the int32 scalar the compiled steps take, made once per index (not per step)."""
    if i >= 1 << 16:  # bounded: an endless loader's indices are made on the fly
        return np.int32(i)
    while len(_INDEX_CACHE) <= i:
        _INDEX_CACHE.append(np.int32(len(_INDEX_CACHE)))
    return _INDEX_CACHE[i]


RUN_AHEAD = 4
"""Steps the host may dispatch ahead of the device before it waits for the oldest one. Deep enough that
the device never idles between steps (measured: with 2, the reference workload ran 1% slower than a plain
jit loop on XLA:CPU; with 4, 0.1%), shallow enough to bound memory and how late a stop takes effect."""


class RunAhead:
    """Bounds how far the host runs ahead of the device (one wait per step, on the step ``depth`` behind)."""

    def __init__(self, depth: int = RUN_AHEAD) -> None:
        self.depth = depth
        self._inflight: collections.deque = collections.deque()

    def push(self, token: Any) -> None:
        self._inflight.append(token)
        if len(self._inflight) > self.depth:
            jax.block_until_ready(self._inflight.popleft())

    def clear(self) -> None:
        self._inflight.clear()


# ---------------------------------------------------------------------------- data of a stage
def loader_for(trainer: Trainer, stage: Stage, given: Any) -> Any:
    """The loader(s) given to the call, else the datamodule's, else the module's ``*_dataloader()``
    (grain pipelines wrapped in a resumable ``GrainLoader``)."""
    if given is not None:
        return adapt_loaders(given)
    if trainer.datamodule is not None:
        return adapt_loaders(getattr(trainer.datamodule, stage.loader_method)())
    fn = getattr(trainer.lightning_module, stage.loader_method, None)
    return adapt_loaders(fn()) if callable(fn) else None


def batch_limit(trainer: Trainer, stage: Stage, loader: Any) -> int | float:
    """Batches the stage runs: the loader's length cut by ``limit_*_batches`` (inf when unknown)."""
    limit = getattr(trainer, stage.limit_attr)
    n = num_batches(loader)
    if limit is None or (isinstance(limit, float) and limit == 1.0):  # int 1 means one batch
        return n if n is not None else math.inf
    if isinstance(limit, float):
        if n is None:
            raise MisconfigurationError(
                f"limit_{stage.name}_batches={limit} is a fraction but the {stage.name} loader has no length; "
                f"pass an int"
            )
        return int(n * limit)
    return min(limit, n) if n is not None else limit


def train_batches(trainer: Trainer, loader: Any) -> int | float:
    """Train batches per epoch, with a ragged last batch settled before any step.

    When the loader tells its batch sizes without being iterated (a torch
    ``DataLoader`` with a ``batch_size``, a list of batches) and the epoch
    reaches a last batch with fewer rows than the others, ``ragged_batches=
    "error"`` raises now, and ``"drop"`` leaves it out of the count (so
    the epoch's last batch, where a partial accumulation window steps and
    validation runs, is the last full one).
    """
    if is_loader_collection(loader):
        raise MisconfigurationError(
            f"fit got {len(loader)} train loaders; jaxlight trains on one loader (Lightning's CombinedLoader modes "
            f"are not supported): combine them into one loader that yields the batches you want"
        )
    n = batch_limit(trainer, TRAIN, loader)
    tail = tail_rows(loader)
    if tail is None:
        return n
    batches, first, last = tail
    if first == last or n < batches:
        return n
    if trainer.ragged_batches == "drop":
        return batches - 1
    raise BatchError(
        f"train batch {batches - 1} has {last} rows but the first had {first} (the loader's last batch, found "
        f"before training); the train step is compiled for one shape. Drop the ragged batch in the loader "
        f"(DataLoader(drop_last=True)) or pass Trainer(ragged_batches='drop'). (Validation, test and predict "
        f"pad such a batch instead.)"
    )


def prefetcher(
    trainer: Trainer,
    stage: Stage,
    loader: Any,
    limit: int | float,
    start: int = 0,
    loader_state: Any = None,
    key: str | None = None,
    placer: BatchPlacer | None = None,
) -> Prefetcher:
    """Background reader of one loader. Training checks ragged batches (error or drop); evaluation pads them."""
    train = stage.name == "train"
    return Prefetcher(
        loader,
        placer or BatchPlacer(trainer.mesh, trainer.process_local_batches, trainer.strategy),
        limit=None if limit == math.inf else int(limit),
        start=start,
        depth=trainer.prefetch,
        drop_ragged=train and trainer.ragged_batches == "drop",
        stage=stage.name,
        # evaluation: each run's first batch sets the shape (a later run may bring another loader)
        expected_rows=trainer.engine.batch_rows.get(key or stage.name) if train else None,
        loader_state=loader_state,
        pad=not train,
    )


def _take_rows(tree: Any, rows: int, valid: int, shares: int) -> Any:
    """The real rows of a padded batch (or of a step output with one row per batch row)."""
    share = rows // shares
    idx = np.concatenate([np.arange(s * share, s * share + valid) for s in range(shares)])

    def take(x: Any) -> Any:
        if getattr(x, "ndim", 0) and x.shape[0] == rows:
            return x[: len(idx)] if shares == 1 else x[idx]
        return x

    return jax.tree.map(take, tree)


# ---------------------------------------------------------------------------- evaluation
class EvalLoop:
    """One pass of validation, test or predict over one or several loaders (one after the other)."""

    def __init__(self, trainer: Trainer, stage: Stage) -> None:
        self.trainer = trainer
        self.stage = stage

    def run(
        self,
        loaders: Sequence[Any],
        limits: Sequence[int | float],
        in_fit: bool = False,
        log: bool = True,
        log_step: int | None = None,
    ) -> Any:
        """Per loader, the epoch's logged metrics (``[{name: value}]``, Lightning's ``validate``/``test``
        result); for predict, the per-batch outputs (a list per loader when there are several).

        With every limit 0 nothing runs, no hook included (Lightning skips the loop)."""
        trainer, stage, engine, reporter = self.trainer, self.stage, self.trainer.engine, self.trainer.reporter
        predict = stage.name == "predict"
        if not loaders or sum(limits) == 0:
            return []
        multi = len(loaders) > 1
        if multi:
            self._check_hooks_take_dataloader_idx()
        hook = stage.hook
        setattr(trainer, stage.flag_attr, True)
        prev_stage, reporter.stage = reporter.stage, stage.name
        setattr(trainer, stage.count_attr, list(limits) if multi else limits[0])
        if in_fit:
            assert engine.train_state is not None
            params, rest = engine.on_device(trainer.eval_params()), engine.train_state.model_state
            engine.write_back(params, rest)  # hooks see the weights being evaluated (not donated arrays)
        elif engine.train_state is not None:
            engine.eval_state()  # the eval steps need a builder even when fit built none
            params, rest = engine.on_device(trainer.eval_params()), engine.train_state.model_state
        else:
            params, rest = engine.eval_state()
        trainer.call_module_hook(f"on_{hook}_model_eval")
        trainer.call_hook(f"on_{hook}_start")
        reporter.reset_epoch(stage.name)
        trainer.call_hook(f"on_{hook}_epoch_start")
        predictions: list[list[Any]] = []
        placer = BatchPlacer(trainer.mesh, trainer.process_local_batches, trainer.strategy)
        shares = placer.global_rows(1)
        ahead = RunAhead()
        try:
            for dl_idx, (loader, limit) in enumerate(zip(loaders, limits)):
                if limit == 0:
                    predictions.append([])
                    continue
                key = stage.name if dl_idx == 0 else f"{stage.name}/{dl_idx}"
                extra = (dl_idx,) if multi else ()
                reporter.dataloader_idx = dl_idx if multi else None
                outs: list[Any] = []
                fetcher = prefetcher(trainer, stage, loader, limit, key=key, placer=placer)
                try:
                    for item in fetcher:
                        batch, idx, valid = item.batch, item.index, item.valid
                        seen = batch if valid is None else _take_rows(batch, item.rows, valid, shares)
                        trainer.call_hook(f"on_{hook}_batch_start", seen, idx, *extra)
                        n_valid = np.int32(item.rows // shares if valid is None else valid)
                        compiled = engine.eval_step_for(key, batch)
                        if compiled is None:  # a new loader or batch shape: one compiled step per shape
                            engine.batch_rows[key] = item.rows
                            compiled = engine.compile_eval(
                                stage.name,
                                key,
                                params,
                                rest,
                                batch,
                                np.int32(idx),
                                n_valid,
                                shares=shares,
                                dataloader_idx=dl_idx if multi else None,
                            )
                            reporter.store(stage.name).register(engine.builder.log_specs.get(stage.name, {}))
                        out, logs = compiled(params, rest, batch, np.int32(idx), n_valid)
                        ahead.push(out if out is not None else logs)
                        if valid is not None and out is not None:
                            out = _take_rows(out, item.rows, valid, shares)  # one output row per sample
                        reporter.on_eval_step(stage.name, logs, dl_idx)
                        if predict:
                            outs.append(out)
                        trainer.call_hook(f"on_{hook}_batch_end", out, seen, idx, *extra)
                finally:
                    fetcher.close()
                predictions.append(outs)
        finally:
            ahead.clear()
            reporter.dataloader_idx = None
        trainer.call_hook(f"on_{hook}_epoch_end")
        metrics: dict[str, float] = {}
        if not predict:
            if log and not trainer.sanity_checking:
                reporter.flush_eval_steps()
            metrics = reporter.epoch_values(stage.name)
            if log and not trainer.sanity_checking:
                reporter.send(metrics, step=log_step)
        trainer.call_hook(f"on_{hook}_end")
        # Lightning's undo of on_*_model_eval (jaxlight never changes the module's own mode, so only the hook)
        if stage.name == "validate" or hasattr(trainer.lightning_module, f"on_{hook}_model_train"):
            trainer.call_module_hook(f"on_{hook}_model_train")
        setattr(trainer, stage.flag_attr, False)
        reporter.stage = prev_stage
        if predict:
            return predictions if multi else predictions[0]
        return reporter.by_loader(metrics, len(loaders))

    def _check_hooks_take_dataloader_idx(self) -> None:
        """Lightning's rule: with several loaders, the module's batch hooks must accept ``dataloader_idx``."""
        from jaxlight.module import LightningModule

        module = self.trainer.lightning_module
        for name, before in ((f"on_{self.stage.hook}_batch_start", 2), (f"on_{self.stage.hook}_batch_end", 3)):
            fn = getattr(type(module), name, None)
            if fn is None or fn is getattr(LightningModule, name, None):
                continue
            if not _accepts(getattr(module, name), before + 1):
                raise MisconfigurationError(
                    f"several {self.stage.name} loaders were given, but {type(module).__name__}.{name} does not "
                    f"accept a dataloader_idx argument; add `dataloader_idx=0` to its signature"
                )


def _accepts(fn: Any, positional: int) -> bool:
    """Whether ``fn`` takes a ``dataloader_idx`` keyword or ``positional`` positional arguments."""
    import inspect

    try:
        ps = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return True
    if any(p.name == "dataloader_idx" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in ps):
        return True
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in ps) >= positional


# ---------------------------------------------------------------------------- training
class FitLoop:
    """Epochs of train batches, validation inside them, epoch-end hooks; stops on the Trainer's limits."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    # -- stopping and validation cadence ---------------------------------------------------
    def can_stop_early(self) -> bool:
        # Lightning: should_stop is honoured once min_epochs *completed* epochs and min_steps are reached
        # (current_epoch counts completed epochs at the epoch boundary and during an epoch alike).
        t = self.trainer
        return t.current_epoch >= t.min_epochs and t.global_step >= t.min_steps

    def done(self) -> bool:
        t = self.trainer
        if t.max_steps != -1 and t.global_step >= t.max_steps:
            return True
        return t.should_stop and self.can_stop_early()

    def finished(self) -> bool:
        """Lightning's ``FitLoop.done``: nothing (more) to train, so ``run`` returns before ``on_train_start``."""
        t = self.trainer
        if t.num_training_batches == 0 or self.done():
            return True
        return t.max_epochs != -1 and t.current_epoch >= t.max_epochs

    def val_check_batch(self) -> int | float:
        """Train batches between validations (inf: only at epoch ends)."""
        t = self.trainer
        if isinstance(t.val_check_interval, float):
            if t.num_training_batches == math.inf:
                if t.val_check_interval != 1.0:
                    raise MisconfigurationError(
                        f"val_check_interval={t.val_check_interval} needs a train loader with a length; "
                        f"pass an int number of batches"
                    )
                return math.inf
            return max(1, int(t.num_training_batches * t.val_check_interval))
        if t.check_val_every_n_epoch is not None and t.val_check_interval > t.num_training_batches:
            raise MisconfigurationError(
                f"val_check_interval ({t.val_check_interval}) must be <= the number of training batches "
                f"({t.num_training_batches}); set check_val_every_n_epoch=None to count batches across epochs"
            )
        return t.val_check_interval

    def val_epoch_due(self) -> bool:
        n = self.trainer.check_val_every_n_epoch
        return n is None or (self.trainer.current_epoch + 1) % n == 0

    def validation_enabled(self, val_loaders: Sequence[Any]) -> bool:
        """Lightning's ``enable_validation``: a loader, a ``validation_step`` and ``limit_val_batches > 0``."""
        return bool(val_loaders) and self.trainer.limit_val_batches != 0

    def should_validate(self, val_loaders: Sequence[Any], idx: int, total: int, every: int | float) -> bool:
        """Lightning's ``_should_check_val_fx`` after train batch ``idx`` (``total`` batches this run)."""
        t = self.trainer
        if not self.validation_enabled(val_loaders) or not self.val_epoch_due():
            return False
        if t.should_stop and self.can_stop_early():
            return True
        if every == math.inf:
            return False
        current = total if t.check_val_every_n_epoch is None else idx + 1
        return current % every == 0

    def validate(self, val_loaders: Sequence[Any]) -> None:
        t = self.trainer
        pos = t.position
        # Lightning logs in-fit validation at the step of the last optimizer update (before its counter moves)
        step = max(pos.global_step - (1 if pos.last_stepped else 0), 0)
        limits = [batch_limit(t, VALIDATE, dl) for dl in val_loaders]
        EvalLoop(t, VALIDATE).run(val_loaders, limits, in_fit=True, log_step=step)

    def sanity_check(self, val_loaders: Sequence[Any]) -> None:
        t = self.trainer
        limits = [batch_limit(t, VALIDATE, dl) for dl in val_loaders]
        steps = t.num_sanity_val_steps
        limits = [n if steps == -1 else min(steps, n) for n in limits]
        t.sanity_checking = True
        try:
            with t.reporter.discarding():
                t.call_hook("on_sanity_check_start", module=False)
                EvalLoop(t, VALIDATE).run(val_loaders, limits, in_fit=True, log=False)
                t.call_hook("on_sanity_check_end", module=False)
            t.reporter.reset_epoch("validate")
        finally:
            t.sanity_checking = False

    def _module_readers(self) -> tuple[bool, bool]:
        t = self.trainer
        return t.hook_reads_module("on_train_batch_start"), t.hook_reads_module("on_train_batch_end")

    # -- the loop ----------------------------------------------------------------------------
    def run(self, train_loader: Any, val_loaders: Sequence[Any]) -> None:
        t, engine, reporter, pos = self.trainer, self.trainer.engine, self.trainer.reporter, self.trainer.position
        if self.finished():
            return
        t.training = True
        k = t.accumulate_grad_batches
        if t.num_training_batches == math.inf and k > 1:
            rank_zero_info(
                f"jaxlight: the train loader has no length, so an epoch's last batch is not known in advance: "
                f"with accumulate_grad_batches={k} a partial window at an epoch's end carries into the next "
                f"epoch's first update (with a length, it steps at the epoch's end, as Lightning does)"
            )
        val_every = self.val_check_batch()
        sync_start, sync_end = self._module_readers()
        t.call_hook("on_train_start")
        total_batches = pos.micro_batches
        log_every = t.log_every_n_steps
        ahead = RunAhead()
        while not self.done() and (t.max_epochs == -1 or t.current_epoch < t.max_epochs):
            start = pos.start_epoch()
            set_loader_epoch(train_loader, t.current_epoch)  # Lightning: samplers reshuffle per epoch
            if not start:  # a mid-epoch resume continues the restored epoch accumulators
                reporter.reset_epoch("train")
                t.call_hook("on_train_epoch_start")  # Lightning: not again when resuming inside the epoch
            fetcher = prefetcher(t, TRAIN, train_loader, t.num_training_batches, start, pos.take_resume_loader_state())
            ran_val_at_end = False  # validation ran after the last batch this epoch processed
            exhausted = True
            try:
                for item in fetcher:
                    ran_val_at_end = False
                    batch, idx = item.batch, item.index
                    t.batch_idx = idx
                    if sync_start:
                        engine.sync_module()
                    if t.call_hook("on_train_batch_start", batch, idx) == -1:
                        exhausted = False
                        break
                    is_last = t.num_training_batches != math.inf and idx + 1 >= t.num_training_batches
                    # Lightning steps on a partial accumulation window at the epoch's last batch
                    flush = _FLUSH if k > 1 and is_last else _NO_FLUSH
                    compiled = engine.compiled.get("train")
                    if compiled is None:
                        engine.batch_rows["train"] = item.rows
                        compiled = engine.compile("train", engine.train_state, batch, step_index(idx), flush)
                        reporter.store("train").register(engine.builder.log_specs.get("train", {}))
                    engine.train_state, outputs, logs = compiled(engine.train_state, batch, step_index(idx), flush)
                    ahead.push(outputs["loss"])
                    stepped = pos.advance(idx, item.loader_state, k, bool(flush))
                    total_batches += 1
                    reporter.on_train_step(logs)
                    if sync_end:
                        engine.sync_module()
                    t.call_hook("on_train_batch_end", outputs, batch, idx)
                    # Lightning: logged when the update counter reaches the cadence, or when stopping
                    if stepped and (t.global_step % log_every == 0 or t.should_stop):
                        reporter.publish_step()
                    if self.should_validate(val_loaders, idx, total_batches, val_every):
                        self.validate(val_loaders)
                        ran_val_at_end = True
                    if self.done():
                        exhausted = idx + 1 >= t.num_training_batches
                        break
            finally:
                fetcher.close()  # the run-ahead bound spans epochs: one wait per step, RUN_AHEAD steps behind
            pos.epoch_finished = exhausted
            if (
                self.validation_enabled(val_loaders)
                and not ran_val_at_end
                and val_every == math.inf
                and exhausted
                and self.val_epoch_due()
            ):
                self.validate(val_loaders)  # a loader without a length: its last batch is known only now
            # epoch end: epoch-level train metrics first, so epoch-end hooks see them
            epoch_logged = reporter.epoch_values("train")
            reporter.stage = "train"
            engine.sync_module()
            self.call_train_epoch_end()
            epoch_logged.update(reporter.epoch_values("train"))
            reporter.refresh_progress_bar()
            reporter.send(epoch_logged)
            pos.end_epoch()
        engine.sync_module()
        t.call_hook("on_train_end")

    def call_train_epoch_end(self) -> None:
        # Lightning: other callbacks, then the module, then monitoring callbacks
        # (checkpointing, early stopping) so they see what the module logged.
        t = self.trainer
        monitoring = [c for c in t.callbacks if c.is_monitoring_callback or c.is_checkpoint_callback]
        others = [c for c in t.callbacks if c not in monitoring]
        t.call_hook("on_train_epoch_end", callbacks=others)
        t.call_hook("on_train_epoch_end", module=False, callbacks=monitoring)


__all__ = [
    "STAGES",
    "EvalLoop",
    "FitLoop",
    "RunAhead",
    "batch_limit",
    "loader_for",
    "prefetcher",
    "train_batches",
]
