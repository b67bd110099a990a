"""The training loop and the evaluation loop, in Lightning's hook order.

``FitLoop.run`` is epochs of train batches with validation inside (every
``val_check_interval``) and at the epoch end; ``EvalLoop.run`` is one pass of
validation, test or predict. Both read and move only public trainer state:
the hook dispatcher (``trainer.call_hook``), the engine (compiled steps and
the train state), the reporter (the logging path) and the loop position.
"""

from __future__ import annotations

import collections
import math
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxlight.data import BatchPlacer, Prefetcher, num_batches
from jaxlight.errors import MisconfigurationError
from jaxlight.stages import STAGES, TRAIN, VALIDATE, Stage

if TYPE_CHECKING:  # pragma: no cover
    from jaxlight.trainer import Trainer

RUN_AHEAD = 2
"""Steps the host may dispatch ahead of the device before it waits for the oldest one."""


class RunAhead:
    """Bounds how far the host runs ahead of the device (one wait per step, on a step two behind)."""

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
    """The loader given to the call, else the datamodule's, else the module's ``*_dataloader()``."""
    if given is not None:
        return given
    if trainer.datamodule is not None:
        return getattr(trainer.datamodule, stage.loader_method)()
    fn = getattr(trainer.lightning_module, stage.loader_method, None)
    return fn() if callable(fn) else None


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


def prefetcher(
    trainer: Trainer, stage: Stage, loader: Any, limit: int | float, start: int = 0, loader_state: Any = None
) -> Prefetcher:
    return Prefetcher(
        loader,
        BatchPlacer(trainer.mesh, trainer.process_local_batches, trainer.strategy),
        limit=None if limit == math.inf else int(limit),
        start=start,
        depth=trainer.prefetch,
        drop_ragged=trainer.ragged_batches == "drop",
        stage=stage.name,
        expected_rows=trainer.engine.batch_rows.get(stage.name),
        loader_state=loader_state,
    )


# ---------------------------------------------------------------------------- evaluation
class EvalLoop:
    """One pass of validation, test or predict over a loader."""

    def __init__(self, trainer: Trainer, stage: Stage) -> None:
        self.trainer = trainer
        self.stage = stage

    def run(self, loader: Any, limit: int | float, in_fit: bool = False, log: bool = True) -> Any:
        """Returns the epoch's logged metrics (``{name: value}``) or, for predict, the per-batch outputs."""
        trainer, stage, engine, reporter = self.trainer, self.stage, self.trainer.engine, self.trainer.reporter
        hook = stage.hook
        setattr(trainer, stage.flag_attr, True)
        prev_stage, reporter.stage = reporter.stage, stage.name
        setattr(trainer, stage.count_attr, limit)
        if in_fit:
            assert engine.train_state is not None
            params, rest = engine.on_device(trainer.eval_params()), engine.train_state.rest
            engine.write_back(params, rest)  # hooks see the weights being evaluated (not donated arrays)
        elif engine.train_state is not None:
            engine.eval_state()  # the eval steps need a builder even when fit built none
            params, rest = engine.on_device(trainer.eval_params()), engine.train_state.rest
        else:
            params, rest = engine.eval_state()
        trainer.call_module_hook(f"on_{hook}_model_eval")
        trainer.call_hook(f"on_{hook}_start")
        reporter.reset_epoch(stage.name)
        trainer.call_hook(f"on_{hook}_epoch_start")
        predictions: list[Any] = []
        ahead = RunAhead()
        fetcher = prefetcher(trainer, stage, loader, limit)
        try:
            for item in fetcher:
                batch, idx = item.batch, item.index
                trainer.call_hook(f"on_{hook}_batch_start", batch, idx)
                compiled = engine.compiled.get(stage.name)
                if compiled is None:
                    engine.batch_rows[stage.name] = item.rows
                    compiled = engine.compile(stage.name, params, rest, batch, np.int32(idx))
                    reporter.store(stage.name).register(engine.builder.log_specs.get(stage.name, {}))
                out, logs = compiled(params, rest, batch, np.int32(idx))
                ahead.push(out if out is not None else logs)
                reporter.on_eval_step(stage.name, logs)
                if stage.name == "predict":
                    predictions.append(out)
                trainer.call_hook(f"on_{hook}_batch_end", out, batch, idx)
        finally:
            fetcher.close()
            ahead.clear()
        trainer.call_hook(f"on_{hook}_epoch_end")
        metrics = reporter.epoch_values(stage.name) if stage.name != "predict" else {}
        if log and not trainer.sanity_checking and stage.name != "predict":
            reporter.send(metrics)
        trainer.call_hook(f"on_{hook}_end")
        if in_fit:
            trainer.call_module_hook("on_validation_model_train")
        setattr(trainer, stage.flag_attr, False)
        reporter.stage = prev_stage
        return predictions if stage.name == "predict" else metrics


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
        return n is not None and (self.trainer.current_epoch + 1) % n == 0

    def should_validate(self, val_loader: Any, idx: int, total: int, every: int | float, is_last: bool) -> bool:
        t = self.trainer
        if val_loader is None or t.limit_val_batches == 0:
            return False
        if t.check_val_every_n_epoch is not None and not self.val_epoch_due():
            return False
        if t.should_stop and self.can_stop_early():
            return True
        if every == math.inf:
            return False
        current = total if t.check_val_every_n_epoch is None else idx + 1
        return current % every == 0 or (is_last and every >= t.num_training_batches)

    def validate(self, val_loader: Any) -> None:
        EvalLoop(self.trainer, VALIDATE).run(val_loader, batch_limit(self.trainer, VALIDATE, val_loader), in_fit=True)

    def sanity_check(self, val_loader: Any) -> None:
        t = self.trainer
        t.sanity_checking = True
        with t.reporter.discarding():
            t.call_hook("on_sanity_check_start", module=False)
            limit = batch_limit(t, VALIDATE, val_loader)
            n = limit if t.num_sanity_val_steps == -1 else min(t.num_sanity_val_steps, limit)
            EvalLoop(t, VALIDATE).run(val_loader, n, in_fit=True, log=False)
            t.call_hook("on_sanity_check_end", module=False)
        t.reporter.reset_epoch("validate")
        t.sanity_checking = False

    # -- the loop ----------------------------------------------------------------------------
    def run(self, train_loader: Any, val_loader: Any) -> None:
        t, engine, reporter, pos = self.trainer, self.trainer.engine, self.trainer.reporter, self.trainer.position
        t.training = True
        t.num_training_batches = batch_limit(t, TRAIN, train_loader)
        if t.num_training_batches == 0:
            return
        k = t.accumulate_grad_batches
        if t.num_training_batches == math.inf and k > 1 and t.is_global_zero:
            print(
                f"jaxlight: the train loader has no length, so an epoch's last batch is not known in advance: "
                f"with accumulate_grad_batches={k} a partial window at an epoch's end carries into the next "
                f"epoch's first update (with a length, it steps at the epoch's end, as Lightning does)"
            )
        val_every = self.val_check_batch()
        t.call_hook("on_train_start")
        total_batches = pos.micro_batches
        log_every = t.log_every_n_steps
        ahead = RunAhead()
        while not self.done() and (t.max_epochs == -1 or t.current_epoch < t.max_epochs):
            start = pos.start_epoch()
            if not start:  # a mid-epoch resume continues the restored epoch accumulators
                reporter.reset_epoch("train")
            t.call_hook("on_train_epoch_start")
            fetcher = prefetcher(t, TRAIN, train_loader, t.num_training_batches, start, pos.take_resume_loader_state())
            ran_val_at_end = False  # validation ran after the last batch this epoch processed
            exhausted = True
            try:
                for item in fetcher:
                    ran_val_at_end = False
                    batch, idx = item.batch, item.index
                    t.batch_idx = idx
                    if t.call_hook("on_train_batch_start", batch, idx) == -1:
                        exhausted = False
                        break
                    is_last = t.num_training_batches != math.inf and idx + 1 >= t.num_training_batches
                    # Lightning steps on a partial accumulation window at the epoch's last batch
                    flush = np.bool_(k > 1 and is_last)
                    compiled = engine.compiled.get("train")
                    if compiled is None:
                        engine.batch_rows["train"] = item.rows
                        compiled = engine.compile("train", engine.train_state, batch, np.int32(idx), flush)
                        reporter.store("train").register(engine.builder.log_specs.get("train", {}))
                    engine.train_state, outputs, logs = compiled(engine.train_state, batch, np.int32(idx), flush)
                    ahead.push(outputs["loss"])
                    stepped = pos.advance(idx, item.loader_state, k, bool(flush))
                    total_batches += 1
                    reporter.on_train_step(logs)
                    t.call_hook("on_train_batch_end", outputs, batch, idx)
                    if stepped and t.global_step % log_every == 0:
                        reporter.publish_step()
                    if self.should_validate(val_loader, idx, total_batches, val_every, is_last):
                        self.validate(val_loader)
                        ran_val_at_end = True
                    if self.done():
                        exhausted = idx + 1 >= t.num_training_batches
                        break
            finally:
                fetcher.close()
                ahead.clear()
            pos.epoch_finished = exhausted
            if val_loader is not None and not ran_val_at_end and val_every == math.inf and self.val_epoch_due():
                self.validate(val_loader)
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


__all__ = ["STAGES", "EvalLoop", "FitLoop", "RunAhead", "batch_limit", "loader_for", "prefetcher"]
