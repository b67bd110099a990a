"""The training loop and the evaluation loop, in Lightning's hook order.

``FitLoop.run`` is epochs of train batches with validation inside (every
``val_check_interval``) and at the epoch end; ``EvalLoop.run`` is one pass of
validation, test or predict over one or several loaders. Both get a
:class:`LoopParts`: the arguments (``config``), the hook caller, the engine
(compiled steps and the train state), the reporter (the logging path), the
loop position, and the Trainer's run state (:class:`RunState`: the flags and
counts Lightning shows on the Trainer, which the loops set and callbacks read).
"""

from __future__ import annotations

import collections
import contextlib
import math
import reprlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import jax
import numpy as np

from jaxlight import rank_failure
from jaxlight.config import RUN_AHEAD as RUN_AHEAD  # its home is jaxlight.config; this path keeps working
from jaxlight.config import TrainerConfig
from jaxlight.data import BatchPlacer
from jaxlight.errors import BatchError, MisconfigurationError
from jaxlight.executions import Executions, plan_executions
from jaxlight.grain_data import adapt_loaders, set_loader_epoch
from jaxlight.hooks import overrides, stop_poll, takes_argument
from jaxlight.loaders import is_loader_collection, num_batches, split_loaders, tail_rows
from jaxlight.prefetch import Prefetcher, compiled_signature
from jaxlight.rank_zero import rank_zero_info, rank_zero_warn
from jaxlight.seed import isolate_rng
from jaxlight.stages import STAGES, TRAIN, VALIDATE, Stage
from jaxlight.workers import safe_workers

if TYPE_CHECKING:  # pragma: no cover
    from jaxlight.engine import Engine
    from jaxlight.hooks import HookCaller
    from jaxlight.position import LoopPosition
    from jaxlight.reporting import MetricReporter


class RunAhead:
    """Bounds how far the host runs ahead of the device (one wait per step, on the step ``depth`` behind)."""

    def __init__(self, depth: int = RUN_AHEAD) -> None:
        self.depth = depth
        self._inflight: collections.deque = collections.deque()

    def push(self, token: Any) -> None:
        inflight = self._inflight
        inflight.append(token)
        if len(inflight) > self.depth:
            old = inflight.popleft()
            wait = getattr(old, "block_until_ready", None)  # a step's loss: the array's own wait, no tree walk
            if wait is not None:
                wait()
            else:
                jax.block_until_ready(old)

    def clear(self) -> None:
        self._inflight.clear()


class RunState(Protocol):
    """What the loops read and set on the Trainer: Lightning's run flags and counts (callbacks read them
    there, e.g. ``trainer.sanity_checking``, ``trainer.num_val_batches``), and the weights to evaluate."""

    should_stop: bool
    sanity_checking: bool
    training: bool
    validating: bool
    testing: bool
    predicting: bool
    num_training_batches: int | float
    num_val_batches: int | float | list
    num_test_batches: int | float | list
    num_predict_batches: int | float | list
    batch_idx: int
    config: TrainerConfig  # the one copy: an argument assigned during a run (trainer.max_steps = n) is seen here

    def eval_params(self) -> dict[str, jax.Array]: ...


class LoopParts(NamedTuple):
    """Everything a loop works with; the Trainer builds one per run."""

    hooks: HookCaller
    engine: Engine
    reporter: MetricReporter
    position: LoopPosition
    state: RunState

    @property
    def config(self) -> TrainerConfig:
        """The checked arguments, read from the run state each time (no copy of its own)."""
        return self.state.config


@contextlib.contextmanager
def stage_run(
    stage: Stage,
    hooks: HookCaller,
    reporter: MetricReporter,
    state: RunState,
    datamodule: Any,
    sync_module: Callable[[], None],
) -> Iterator[None]:
    """Lightning's frame around one fit/validate/test/predict call.

    Before: ``prepare_data`` on process 0 (the datamodule's, then the
    module's), the datamodule's ``setup``, the ``setup`` hook, empty metric
    views. On failure: a failed fit first points the module at the last
    completed step's weights (``sync_module``), then ``on_exception`` runs;
    in a multi-process run the failure is first published to the other
    processes, which stop (:mod:`jaxlight.rank_failure`). After, always: the loggers' ``finalize``, the datamodule's ``teardown``,
    the ``teardown`` hook, and the stage flags cleared.
    """
    reporter.stage = stage.name
    status = "success"
    with rank_failure.watching():
        try:
            if datamodule is not None and jax.process_index() == 0:
                datamodule.prepare_data()
            if jax.process_index() == 0:
                hooks.call_module("prepare_data")
            if datamodule is not None:
                datamodule.setup(stage.fn)
            hooks.call("setup", stage.fn)
            reporter.reset()  # Lightning: every run starts with empty metric views
            reporter.open_loggers()
            yield
        except BaseException as e:
            status = "failed"
            # first: the hooks below may block in a collective the peers never join
            rank_failure.report(e)
            if stage.name == "train":
                try:  # leave the module usable with the last completed step's weights
                    sync_module()
                except Exception:
                    pass  # e.g. the state was donated to the failed step
            hooks.call_on_exception(e)
            raise
        finally:
            reporter.finalize_loggers(status)
            if datamodule is not None:
                datamodule.teardown(stage.fn)
            hooks.call("teardown", stage.fn)
            reporter.stage = "train"
            state.training = state.validating = state.testing = state.predicting = False


# ---------------------------------------------------------------------------- data of a stage
def loader_for(stage: Stage, given: Any, datamodule: Any, module: Any) -> Any:
    """The loader(s) given to the call, else the datamodule's, else the module's ``*_dataloader()``: grain
    pipelines wrapped in a resumable ``GrainLoader``, torch loaders with worker processes started without
    ``os.fork()`` (:func:`jaxlight.workers.safe_workers`)."""
    if given is None and datamodule is not None:
        given = getattr(datamodule, stage.loader_method)()
    elif given is None:
        fn = getattr(module, stage.loader_method, None)
        given = fn() if callable(fn) else None
    for loader in split_loaders(given):
        safe_workers(loader)
    return adapt_loaders(given)


def batch_limit(config: TrainerConfig, stage: Stage, loader: Any) -> int | float:
    """Batches the stage runs: the loader's length cut by ``limit_*_batches`` (inf when unknown)."""
    limit = getattr(config, stage.limit_attr)
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


def train_batches(config: TrainerConfig, loader: Any) -> int | float:
    """Train batches per epoch, with a ragged last batch settled before any step.

    When the loader tells its batch sizes without being iterated (a torch
    ``DataLoader`` with a ``batch_size``, a list of batches) and the epoch
    reaches a last batch with fewer rows than the others, ``ragged_batches=
    "keep"`` (the default) counts it (it trains in a step compiled for its
    shape), ``"error"`` raises now, and ``"drop"`` leaves it out of the count
    (so the epoch's last batch, where a partial accumulation window steps and
    validation runs, is the last full one).
    """
    if is_loader_collection(loader):
        raise MisconfigurationError(
            f"fit got {len(loader)} train loaders; jaxlight trains on one loader (Lightning's CombinedLoader modes "
            f"are not supported): combine them into one loader that yields the batches you want"
        )
    n = batch_limit(config, TRAIN, loader)
    tail = tail_rows(loader)
    if tail is None:
        return n
    batches, first, last = tail
    if first == last or n < batches or config.ragged_batches == "keep":
        return n
    if config.ragged_batches == "drop":
        return batches - 1
    raise BatchError(
        f"train batch {batches - 1} has {last} rows but the first had {first} (the loader's last batch, found "
        f"before training); the train step is compiled for one shape. Drop the ragged batch in the loader "
        f"(DataLoader(drop_last=True)) or pass Trainer(ragged_batches='drop'), or leave ragged_batches at its "
        f"default 'keep', which trains it in a step compiled for its own shape"
    )


def prefetcher(
    parts: LoopParts,
    stage: Stage,
    loader: Any,
    limit: int | float,
    start: int = 0,
    loader_state: Any = None,
    key: str | None = None,
    placer: BatchPlacer | None = None,
) -> Prefetcher:
    """Background reader of one loader. A batch with other rows passes as it is (``ragged_batches="keep"``,
    always in evaluation: the loop runs it in a step compiled for its shape); training may instead drop it or
    raise. Evaluation pads only the shares of a multi-process run with ``process_local_batches``."""
    train, config = stage.name == "train", parts.config
    placer = placer or batch_placer(parts)
    pad = not train and placer.global_rows(1) > 1  # per-process shares cannot be replicated: padded and masked
    drop = train and config.ragged_batches == "drop"
    return Prefetcher(
        loader,
        placer,
        limit=None if limit == math.inf else int(limit),
        start=start,
        depth=config.prefetch,
        drop_ragged=drop,
        stage=stage.name,
        # evaluation: each run's first batch sets the shape (a later run may bring another loader)
        expected_rows=parts.engine.batch_rows.get(key or stage.name) if train else None,
        loader_state=loader_state,
        pad=pad,
        exact=not pad and (not train or config.ragged_batches == "keep"),
        interrupt=stop_poll(parts.hooks.callbacks),
        signature=compiled_signature(parts.engine.compiled.get("train")) if train else None,
        # the train step may take the loader's host arrays when no per-batch hook looks at the batch
        host_batches=train
        and not parts.hooks.reads_batch("on_train_batch_start")
        and not parts.hooks.reads_batch("on_train_batch_end"),
    )


def batch_placer(parts: LoopParts) -> BatchPlacer:
    """How this run's batches go onto the engine's mesh."""
    return BatchPlacer(parts.engine.mesh, parts.config.process_local_batches, parts.engine.strategy)


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

    def __init__(self, parts: LoopParts, stage: Stage) -> None:
        self.parts = parts
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
        parts, stage = self.parts, self.stage
        hooks, engine, reporter, state = parts.hooks, parts.engine, parts.reporter, parts.state
        predict = stage.name == "predict"
        if not loaders or sum(limits) == 0:
            return []
        multi = len(loaders) > 1
        if multi:
            self._check_hooks_take_dataloader_idx()
        hook = stage.hook
        setattr(state, stage.flag_attr, True)
        prev_stage, reporter.stage = reporter.stage, stage.name
        setattr(state, stage.count_attr, list(limits) if multi else limits[0])
        if in_fit:
            assert engine.train_state is not None
            params, rest = engine.on_device(state.eval_params()), engine.train_state.model_state
            engine.binding.write_back(params, rest)  # hooks see the weights being evaluated (not donated arrays)
        elif engine.train_state is not None:
            engine.eval_state()  # the eval steps need a builder even when fit built none
            params, rest = engine.on_device(state.eval_params()), engine.train_state.model_state
        else:
            params, rest = engine.eval_state()
        hooks.call_module(f"on_{hook}_model_eval")
        hooks.call(f"on_{hook}_start")
        reporter.reset_epoch(stage.name)
        hooks.call(f"on_{hook}_epoch_start")
        predictions: list[list[Any]] = []
        # what the step reads as self.global_step / self.current_epoch: an argument, made once per run
        counters = np.array([parts.position.global_step, parts.position.epoch], np.int32)
        placer = batch_placer(parts)
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
                fetcher = prefetcher(parts, stage, loader, limit, key=key, placer=placer)
                try:
                    for item in fetcher:
                        batch, idx, valid = item.batch, item.index, item.valid
                        seen = batch if valid is None else _take_rows(batch, item.rows, valid, shares)
                        hooks.call(f"on_{hook}_batch_start", seen, idx, *extra)
                        n_valid = np.int32(item.rows // shares if valid is None else valid)
                        compiled = engine.eval_step_for(key, batch)
                        if compiled is None:  # a new loader or batch shape: one compiled step per shape
                            if item.rows == fetcher.expected_rows:  # the loader's batch size, not a ragged tail
                                engine.batch_rows[key] = item.rows
                            compiled = engine.compile_eval(
                                stage.name,
                                key,
                                params,
                                rest,
                                batch,
                                np.int32(idx),
                                n_valid,
                                counters,
                                shares=shares,
                                dataloader_idx=dl_idx if multi else None,
                            )
                            reporter.store(stage.name).register(engine.builder.log_specs.get(stage.name, {}))
                        out, logs = compiled(params, rest, batch, np.int32(idx), n_valid, counters)
                        ahead.push(out if out is not None else logs)
                        if valid is not None and out is not None:
                            out = _take_rows(out, item.rows, valid, shares)  # one output row per sample
                        reporter.on_eval_step(stage.name, logs, dl_idx)
                        if predict:
                            outs.append(out)
                        hooks.call(f"on_{hook}_batch_end", out, seen, idx, *extra)
                finally:
                    fetcher.close()
                predictions.append(outs)
        finally:
            ahead.clear()
            reporter.dataloader_idx = None
        # Lightning's order: the epoch's reductions (and, inside fit, the latest train step's progress-bar
        # values) are in callback/logged/progress-bar metrics before the epoch-end hooks run; what the hooks
        # log joins them after, and the loggers get all of it once
        metrics: dict[str, float] = {}
        logs = log and not predict and not state.sanity_checking
        if not predict:
            if logs:
                reporter.flush_eval_steps()
            metrics = reporter.epoch_values(stage.name)
            reporter.logged_metrics.update(metrics)  # the sanity check's too: it clears the views after
            if state.training:
                reporter.refresh_progress_bar()
        hooks.call(f"on_{hook}_epoch_end")
        if not predict:
            metrics.update(reporter.epoch_values(stage.name))
            if logs:
                reporter.send(metrics, step=log_step)
        hooks.call(f"on_{hook}_end")
        # Lightning's undo of on_*_model_eval (jaxlight never changes the module's own mode, so only the hook)
        if stage.name == "validate" or hasattr(hooks.module, f"on_{hook}_model_train"):
            hooks.call_module(f"on_{hook}_model_train")
        setattr(state, stage.flag_attr, False)
        reporter.stage = prev_stage
        if predict:
            return predictions if multi else predictions[0]
        return reporter.by_loader(metrics, len(loaders))

    def _check_hooks_take_dataloader_idx(self) -> None:
        """Lightning's rule: with several loaders, the module's batch hooks must accept ``dataloader_idx``."""
        module = self.parts.hooks.module
        for name, position in ((f"on_{self.stage.hook}_batch_start", 2), (f"on_{self.stage.hook}_batch_end", 3)):
            if not overrides(module, name):
                continue
            if takes_argument(getattr(module, name), "dataloader_idx", position) is False:
                raise MisconfigurationError(
                    f"several {self.stage.name} loaders were given, but {type(module).__name__}.{name} does not "
                    f"accept a dataloader_idx argument; add `dataloader_idx=0` to its signature"
                )


# ---------------------------------------------------------------------------- training
def _describe_loader(loader: Any) -> str:
    return f"{type(loader).__name__} {reprlib.repr(loader)}"


def warn_if_empty(loader: Any) -> None:
    """Lightning's warning for a train loader of length 0: fit then trains nothing (said once per fit)."""
    if num_batches(loader) == 0:
        rank_zero_warn(
            f"the train loader ({_describe_loader(loader)}) has length 0: fit trains nothing. "
            f"Make sure this was your intention"
        )


def empty_epoch_error(loader: Any, epoch: int, dropped: int) -> MisconfigurationError:
    """The error for an epoch in which the train loader yielded no batch (run on, fit would spin on empty
    epochs until ``max_epochs``, or forever under ``max_steps``)."""
    n = num_batches(loader)
    why = ""
    if dropped:
        why = f"; all {dropped} batches it yielded were ragged and dropped (ragged_batches='drop')"
    elif n:
        why = f" although its length is {n}"
    elif epoch:
        why = (
            ": a one-shot iterator or generator is used up after one epoch; pass a loader that starts over on "
            "every iter() (a list, a DataLoader)"
        )
    return MisconfigurationError(
        f"the train loader ({_describe_loader(loader)}) yielded no batch in epoch {epoch}{why}; "
        f"fit stops rather than run empty epochs"
    )


class FitLoop:
    """Epochs of train batches, validation inside them, epoch-end hooks; stops on the configured limits."""

    def __init__(self, parts: LoopParts) -> None:
        self.parts = parts
        self.position = parts.position
        self.state = parts.state
        self.executions: Executions | None = None  # set by fit (jaxlight/executions.py)

    @property
    def config(self) -> TrainerConfig:
        """``trainer.config`` as it is now: ``max_steps``, ``max_epochs`` and ``min_*`` are read at every check."""
        return self.parts.config

    # -- stopping and validation cadence ---------------------------------------------------
    def can_stop_early(self) -> bool:
        # Lightning: should_stop is honoured once min_epochs *completed* epochs and min_steps are reached
        # (the epoch counts completed epochs at the epoch boundary and during an epoch alike).
        c, pos = self.config, self.position
        return pos.epoch >= c.min_epochs and pos.global_step >= c.min_steps

    def done(self) -> bool:
        if self.config.max_steps != -1 and self.position.global_step >= self.config.max_steps:
            return True
        return self.state.should_stop and self.can_stop_early()

    def finished(self) -> bool:
        """Lightning's ``FitLoop.done``: nothing (more) to train, so ``run`` returns before ``on_train_start``."""
        if self.state.num_training_batches == 0 or self.done():
            return True
        return self.config.max_epochs != -1 and self.position.epoch >= self.config.max_epochs

    def val_check_batch(self) -> int | float:
        """Train batches between validations (inf: only at epoch ends)."""
        c, total = self.config, self.state.num_training_batches
        if isinstance(c.val_check_interval, float):
            if total == math.inf:
                if c.val_check_interval != 1.0:
                    raise MisconfigurationError(
                        f"val_check_interval={c.val_check_interval} needs a train loader with a length; "
                        f"pass an int number of batches"
                    )
                return math.inf
            return max(1, int(total * c.val_check_interval))
        if c.check_val_every_n_epoch is not None and c.val_check_interval > total:
            raise MisconfigurationError(
                f"val_check_interval ({c.val_check_interval}) must be <= the number of training batches "
                f"({total}); set check_val_every_n_epoch=None to count batches across epochs"
            )
        return c.val_check_interval

    def val_epoch_due(self) -> bool:
        n = self.config.check_val_every_n_epoch
        return n is None or (self.position.epoch + 1) % n == 0

    def validation_enabled(self, val_loaders: Sequence[Any]) -> bool:
        """Lightning's ``enable_validation``: a loader, a ``validation_step`` and ``limit_val_batches > 0``."""
        return bool(val_loaders) and self.config.limit_val_batches != 0

    def should_validate(self, val_loaders: Sequence[Any], idx: int, total: int, every: int | float) -> bool:
        """Lightning's ``_should_check_val_fx`` after train batch ``idx`` (``total`` batches this run)."""
        if not self.validation_enabled(val_loaders) or not self.val_epoch_due():
            return False
        if self.state.should_stop and self.can_stop_early():
            return True
        if every == math.inf:
            return False
        current = total if self.config.check_val_every_n_epoch is None else idx + 1
        return current % every == 0

    def validate(self, val_loaders: Sequence[Any]) -> None:
        pos = self.position
        # Lightning logs in-fit validation at the step of the last optimizer update (before its counter moves)
        step = max(pos.global_step - (1 if pos.last_stepped else 0), 0)
        limits = [batch_limit(self.config, VALIDATE, dl) for dl in val_loaders]
        EvalLoop(self.parts, VALIDATE).run(val_loaders, limits, in_fit=True, log_step=step)

    def sanity_check(self, val_loaders: Sequence[Any]) -> None:
        hooks, reporter, state = self.parts.hooks, self.parts.reporter, self.state
        limits = [batch_limit(self.config, VALIDATE, dl) for dl in val_loaders]
        steps = self.config.num_sanity_val_steps
        limits = [n if steps == -1 else min(steps, n) for n in limits]
        state.sanity_checking = True
        try:
            with reporter.discarding():
                hooks.call("on_sanity_check_start", module=False)
                EvalLoop(self.parts, VALIDATE).run(val_loaders, limits, in_fit=True, log=False)
                hooks.call("on_sanity_check_end", module=False)
            reporter.reset_epoch("validate")
        finally:
            state.sanity_checking = False

    # -- the loop ----------------------------------------------------------------------------
    def fit(self, train_loader: Any, val_loaders: Sequence[Any]) -> None:
        """The sanity check (unless ``num_sanity_val_steps=0``, or resuming inside an epoch, as in
        Lightning), then :meth:`run`. With ``steps_per_execution > 1`` the run's cadences are checked
        against the execution boundaries first (:func:`~jaxlight.executions.plan_executions`)."""
        self.executions = plan_executions(self, val_loaders)
        if (
            self.validation_enabled(val_loaders)
            and self.config.num_sanity_val_steps != 0
            and not self.position.resume_offset
        ):
            with isolate_rng():  # Lightning's: the check's loader iterators draw nothing the training would
                self.sanity_check(val_loaders)
        self.run(train_loader, val_loaders)

    def run(self, train_loader: Any, val_loaders: Sequence[Any]) -> None:
        parts, config, state, pos = self.parts, self.config, self.state, self.position
        hooks, engine, reporter = parts.hooks, parts.engine, parts.reporter
        warn_if_empty(train_loader)
        if self.finished():
            return
        state.training = True
        k = config.accumulate_grad_batches
        if state.num_training_batches == math.inf and k > 1:
            rank_zero_info(
                f"jaxlight: the train loader has no length, so an epoch's last batch is not known in advance: "
                f"with accumulate_grad_batches={k} a partial window at an epoch's end carries into the next "
                f"epoch's first update (with a length, it steps at the epoch's end, as Lightning does)"
            )
        val_every = self.val_check_batch()
        hooks.call("on_train_start")
        total_batches = pos.micro_batches
        executions = self.executions or plan_executions(self, val_loaders)
        ahead = RunAhead()
        while not self.done() and (self.config.max_epochs == -1 or pos.epoch < self.config.max_epochs):
            start, n_batches = pos.start_epoch(), state.num_training_batches
            set_loader_epoch(train_loader, pos.epoch)  # Lightning: samplers reshuffle per epoch
            if not start:  # a mid-epoch resume continues the restored epoch accumulators
                reporter.reset_epoch("train")
                hooks.call("on_train_epoch_start")  # Lightning: not again when resuming inside the epoch
            engine.refresh_train_modes()  # a layer's .eval() (or BaseFinetuning) set in a hook: the step follows
            fetcher = prefetcher(parts, TRAIN, train_loader, n_batches, start, pos.take_resume_loader_state())
            ran_val_at_end = False  # validation ran after the last batch this epoch processed
            exhausted = True
            try:
                # the one per-batch body: executions of steps_per_execution steps (one step when it is 1)
                exhausted, ran_val_at_end, total_batches = executions.run_epoch(
                    fetcher, n_batches, total_batches, val_loaders, val_every, ahead
                )
            finally:
                fetcher.close()  # the run-ahead bound spans epochs: one wait per step, RUN_AHEAD steps behind
            if exhausted and start == 0 and pos.batches_in_epoch == 0:  # no batch at all: never loop on
                raise empty_epoch_error(train_loader, pos.epoch, fetcher.dropped)
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
            # (logged and progress-bar metrics too, as in Lightning; the loggers get them after the hooks)
            epoch_logged = reporter.epoch_values("train")
            reporter.logged_metrics.update(epoch_logged)
            reporter.refresh_progress_bar()
            reporter.stage = "train"
            engine.binding.sync_module()
            self.call_train_epoch_end()
            epoch_logged.update(reporter.epoch_values("train"))
            # a NaN loss is said by the epoch's end, whatever log_every_n_steps is (after the epoch-end hooks:
            # a NonFiniteGuard raising there says it first)
            reporter.check_epoch_loss()
            reporter.send(epoch_logged)
            pos.end_epoch()
        engine.binding.sync_module()
        hooks.call("on_train_end")

    def call_train_epoch_end(self) -> None:
        # Lightning: other callbacks, then the module, then monitoring callbacks
        # (checkpointing, early stopping) so they see what the module logged.
        hooks = self.parts.hooks
        monitoring = [c for c in hooks.callbacks if c.is_monitoring_callback or c.is_checkpoint_callback]
        others = [c for c in hooks.callbacks if c not in monitoring]
        hooks.call("on_train_epoch_end", callbacks=others)
        hooks.call("on_train_epoch_end", module=False, callbacks=monitoring)


__all__ = [
    "RUN_AHEAD",
    "STAGES",
    "EvalLoop",
    "FitLoop",
    "LoopParts",
    "RunAhead",
    "RunState",
    "batch_limit",
    "empty_epoch_error",
    "loader_for",
    "prefetcher",
    "stage_run",
    "train_batches",
    "warn_if_empty",
]
