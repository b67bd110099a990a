"""An epoch as executions: the fit loop's one per-batch body.

An execution is one compiled call of N train steps (``Trainer(steps_per_execution=N)``;
N = 1 by default, so a single step is an execution of one step). An epoch is cut into
executions of N batches (the last one shorter when the epoch's length is not a
multiple of N).

One step runs in Lightning's order: ``on_train_batch_start``, the step,
``on_train_batch_end``. An execution of several steps puts its stacked batches
into one compiled call (:class:`jaxlight.multistep.MultiStep`), then runs the
per-batch hooks for each of its batches in order, ``on_train_batch_start`` then
``on_train_batch_end`` with that batch's own outputs, and each batch's logged
values reach the reporter as a single step's would. So those hooks run *after*
the execution, as Keras's batch callbacks do with ``steps_per_execution``: they
see each batch's outputs and the position (``global_step``, ``batch_idx``) of
that batch, but the weights and optimizer state as they are after the whole
execution.

What depends on the train state between batches happens on execution
boundaries only, so it sees the state it would after single steps:
validation, stopping (``max_steps``; a stop requested by a hook inside an
execution takes effect at its end, its other batches having already run),
and the per-batch hooks of checkpoint callbacks (``is_checkpoint_callback``)
and of :class:`~jaxlight.callbacks.Preemption`, which run at an execution's
last batch only (a time-based checkpoint or a preemption save waits for the
end of the execution). :func:`plan_executions` refuses, before any step, a run
whose cadences would need the state inside an execution, naming the first
point where that happens.

The batches of one execution are stacked, so they share one shape: with
``ragged_batches="keep"`` a batch of other rows ends the execution before it,
and a lone batch runs as the single train step compiled for its shape (as
with N = 1, hooks in Lightning's order). Executions still end at the
multiples of N, also after a resume from a point inside one (the first
execution then runs up to the next).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxlight.errors import MisconfigurationError
from jaxlight.multistep import ExecutionPlan, Miss
from jaxlight.rank_zero import rank_zero_info

if TYPE_CHECKING:  # pragma: no cover
    from jaxlight.callbacks.callback import Callback
    from jaxlight.engine import Engine
    from jaxlight.loops import FitLoop, RunAhead
    from jaxlight.prefetch import Prefetched, Prefetcher


_FLUSH, _NO_FLUSH = np.bool_(True), np.bool_(False)
_INDEX_CACHE: list[np.ndarray] = []


def step_index(i: int) -> np.ndarray:
    """``batch_idx`` as the int32 scalar the compiled steps take, made once per index (not per step)."""
    if i >= 1 << 16:  # bounded: an endless loader's indices are made on the fly
        return np.int32(i)
    while len(_INDEX_CACHE) <= i:
        _INDEX_CACHE.append(np.int32(len(_INDEX_CACHE)))
    return _INDEX_CACHE[i]


RAGGED_SHAPES_NOTE = 3  # a train step compiled for this many batch shapes says so once


def note_ragged_compiles(engine: Engine) -> None:
    """Say once when the train step has been compiled for :data:`RAGGED_SHAPES_NOTE` batch shapes: the usual
    ragged last batch costs one extra compile, a loader whose batch sizes keep changing costs one each."""
    n = len(engine.train_steps)
    if n == RAGGED_SHAPES_NOTE:
        rank_zero_info(
            f"jaxlight: the train step has now been compiled for {n} batch shapes; a batch with a new number of "
            f"rows (or other new shapes) compiles its own step once (kept in the compilation cache). If the "
            f"loader's batch sizes keep changing, fix them (DataLoader(drop_last=True), "
            f"Trainer(ragged_batches='drop') or padding in the loader)"
        )


def runs_at_boundaries_only(cb: Callback) -> bool:
    """Callbacks whose per-batch hooks write or stop from the train state: called at an execution's last
    batch only, where the state is the one single steps would have there."""
    return cb.is_checkpoint_callback or cb.runs_at_execution_end


def _where(plan: ExecutionPlan, miss: Miss) -> str:
    step = f"optimizer step {miss.step}, " if miss.step is not None else ""
    total = f" (batch {miss.total} of the run)" if miss.total is not None and miss.total != miss.count else ""
    return f"{step}after batch {miss.count} of epoch {miss.epoch}{total}, inside an execution ({plan.describe()})"


def plan_executions(loop: FitLoop, val_loaders: Sequence[Any]) -> Executions:
    """The executions of this fit (of one step each for ``steps_per_execution=1``), after the refusals.

    Refused, with the numbers: a validation cadence, a checkpoint cadence
    (``every_n_train_steps``) or ``max_steps`` that falls inside an
    execution; the per-batch readers of the optimizer state that would read
    it mid-execution (``LearningRateMonitor`` logging by step, a
    ``ReduceLROnPlateau`` stepped by step); a strategy keeping train state in
    host memory.
    """
    config, parts = loop.config, loop.parts
    n = config.steps_per_execution
    batches = loop.state.num_training_batches
    epochs = math.inf if config.max_epochs == -1 else config.max_epochs
    plan = ExecutionPlan(n, batches, config.accumulate_grad_batches, epochs)
    # every cadence ends an execution of one step; with no batch nothing trains (limit_train_batches=0)
    if n == 1 or batches == 0:
        return Executions(loop, plan)
    engine, hooks = parts.engine, parts.hooks
    assert engine.state_shardings is not None and engine.optimizer is not None
    arg = f"steps_per_execution={n}"

    moved = [
        s for s in jax.tree.leaves(engine.state_shardings) if getattr(s, "memory_kind", None) not in (None, "device")
    ]
    if moved:
        raise MisconfigurationError(
            f"{arg} runs the train steps in one compiled loop, but strategy {engine.strategy.name!r} keeps "
            f"{len(moved)} train-state leaves in {moved[0].memory_kind!r} memory between steps (host offload), "
            f"which a loop over steps cannot carry; use steps_per_execution=1 with host offload"
        )
    # a resume point inside an execution (saved with another N, or at a ragged batch) needs no refusal: the
    # first execution runs up to the next boundary (MultiStepEpochs._take), and the run is aligned again
    if config.max_steps != -1 and config.max_steps > 0:
        miss = plan.step_miss(config.max_steps)
        if miss is not None:
            raise MisconfigurationError(
                f"max_steps={config.max_steps} ends the run at {_where(plan, miss)}; choose a max_steps reached at "
                f"the end of an execution"
            )
    if loop.validation_enabled(val_loaders):
        every = loop.val_check_batch()
        if every != math.inf:
            across = config.check_val_every_n_epoch is None
            miss = plan.batch_cadence_miss(int(every), across)
            if miss is not None:
                vci = config.val_check_interval
                said = f"val_check_interval={vci}" + (f" ({int(every)} batches)" if isinstance(vci, float) else "")
                raise MisconfigurationError(
                    f"{said} is not a multiple of {arg}: it validates at {_where(plan, miss)}; choose a "
                    f"val_check_interval that is a multiple of {n} batches"
                )
    last_step = math.inf if config.max_steps == -1 else config.max_steps
    for cb in hooks.callbacks:
        every_n = getattr(cb, "every_n_train_steps", 0) if cb.is_checkpoint_callback else 0
        if every_n:
            miss = plan.step_cadence_miss(int(every_n), last_step)
            if miss is not None:
                raise MisconfigurationError(
                    f"{type(cb).__name__}(every_n_train_steps={every_n}) saves at {_where(plan, miss)}; choose "
                    f"every_n_train_steps so that every {every_n} optimizer steps (x accumulate_grad_batches="
                    f"{config.accumulate_grad_batches} batches) end an execution"
                )
        reads = cb.reads_optimizer_state_per_step  # e.g. LearningRateMonitor logging by step
        if reads is not None:
            what, fix = reads
            raise MisconfigurationError(
                f"{what}, but with {arg} the per-batch hooks run after the execution, when the state is {n} steps "
                f"on; {fix} or steps_per_execution=1"
            )
    plateau = [c for c in engine.optimizer.schedulers if c.reduce_on_plateau and c.interval == "step"]
    if plateau:
        raise MisconfigurationError(
            f"a ReduceLROnPlateau scheduler with interval='step' sets the learning rate between batches, inside "
            f"the executions of {arg}; use interval='epoch' or steps_per_execution=1"
        )
    return Executions(loop, plan)


class Executions:
    """Runs a fit's epochs as executions of ``plan.n`` steps: the one per-batch body of the fit loop.

    A single step is an execution of one step (``steps_per_execution=1``, or an
    epoch's lone ragged batch). Its ``on_train_batch_start`` hooks run before
    it, as in Lightning, and may end the epoch by returning -1. An execution
    of several steps runs first, then each batch's ``on_train_batch_start``
    and ``on_train_batch_end`` in order (Keras's order with
    ``steps_per_execution``). Validation and stopping are checked at an
    execution's end.
    """

    def __init__(self, loop: FitLoop, plan: ExecutionPlan) -> None:
        self.loop = loop
        self.plan = plan
        hooks = loop.parts.hooks
        # the callbacks called at batches before an execution's last one
        self.inside = [c for c in hooks.callbacks if not runs_at_boundaries_only(c)]
        self.sync_start = hooks.reads_module("on_train_batch_start")
        self.sync_end = hooks.reads_module("on_train_batch_end")
        self._ended = False  # the epoch's prefetcher has run out
        self._held: Prefetched | None = None  # a batch of other rows than the execution before it

    def _take(self, items: Iterator[Prefetched], n_batches: int | float) -> list[Prefetched]:
        """The next execution's batches: up to the next multiple of N batches of the epoch, or its last
        batch (fewer when the loader runs out first: a loader without a length, or shorter than it said).

        Batches of one execution are stacked, so they must have one shape: a batch with other rows than the
        execution's first (a ragged batch, ``ragged_batches="keep"``) ends the execution before it and starts
        the next one. The executions still end where the plan says (and at the ragged batch besides)."""
        n = self.plan.n
        if n == 1:  # the common case, kept cheap: one batch per execution
            item = next(items, None)
            return [] if item is None else [item]
        got: list[Prefetched] = []
        while True:
            if self._held is not None:
                item, self._held = self._held, None
            elif self._ended:
                break
            else:
                item = next(items, None)
                if item is None:  # the prefetcher has ended: never ask it again (it would wait for a batch)
                    self._ended = True
                    break
            if got and item.rows != got[0].rows:
                self._held = item
                break
            got.append(item)
            first = got[0].index
            want = n - first % n if n_batches == math.inf else min(n - first % n, int(n_batches) - first)
            if len(got) >= want:
                break
        return got

    def _single(self, item: Prefetched, batch: Any, idx: Any, flush: Any, epoch: Any) -> tuple[Any, Any]:
        """The train step for one batch, compiled once per batch shape (a ragged batch: the step for its own
        shape), and the batch to give it (placed when the step is compiled from it)."""
        engine = self.loop.parts.engine
        if self.plan.n == 1:  # the step of the loader's batch shape is at hand: no signature lookup per step
            compiled = engine.compiled.get("train")
            if compiled is not None and item.rows != engine.batch_rows.get("train"):
                compiled = engine.train_step_for(batch)
        else:  # compiled["train"] is the execution of N steps
            compiled = engine.train_step_for(batch)
        if compiled is None:
            if "train" not in engine.compiled:
                engine.batch_rows["train"] = item.rows
            batch = item.placed()  # compiled for the placed batch's shardings
            compiled = engine.compile_train(engine.train_state, batch, idx, flush, epoch)
            self.loop.parts.reporter.store("train").register(engine.builder.log_specs.get("train", {}))
            note_ragged_compiles(engine)
        return compiled, batch

    def _program(self, group: list[Prefetched], batches: tuple, idxs: Any, flush: Any, epoch: Any) -> Any:
        """The compiled program for an execution of several steps (N, or fewer: the epoch's partial last
        execution, the batches before a ragged one), compiled once per (steps, batch shapes)."""
        engine, reporter = self.loop.parts.engine, self.loop.parts.reporter
        compiled = engine.train_steps_for(batches)
        if compiled is not None:
            return compiled
        if "train" not in engine.compiled:
            engine.batch_rows["train"] = group[0].rows
        batches = tuple(it.placed() for it in group)  # compiled for the placed batches' shardings
        full = len(group) == self.plan.n
        compiled = engine.compile_train_steps(engine.train_state, batches, idxs, flush, epoch, full=full)
        reporter.store("train").register(engine.builder.log_specs.get("train", {}))
        return compiled

    def _refuse_edits(self, hook: str, item: Prefetched, group: list[Prefetched]) -> None:
        """A per-batch hook inside an execution may not write module state: the later batches of the
        execution have run already, so the write would silently skip them (with N = 1 the next step sees it)."""
        engine = self.loop.parts.engine
        st = engine.train_state
        edits = engine.binding.module_edits(st.params, st.model_state)
        if not edits:
            return
        names = sorted(key for _, key in edits)
        raise MisconfigurationError(
            f"{hook} at batch {item.index} set module state ({', '.join(names[:5])}) inside an execution: with "
            f"steps_per_execution={self.plan.n} batches {group[0].index}..{group[-1].index} ran in one call, so "
            f"batch {item.index + 1} has trained without it (with steps_per_execution=1 it would see it). Write it "
            f"at an execution's last batch ((batch_idx + 1) % {self.plan.n} == 0), in an epoch hook, or use "
            f"steps_per_execution=1"
        )

    def run_epoch(
        self,
        fetcher: Prefetcher,
        n_batches: int | float,
        total_batches: int,
        val_loaders: Sequence[Any],
        val_every: int | float,
        ahead: RunAhead,
    ) -> tuple[bool, bool, int]:
        """One epoch's executions; returns ``(exhausted, ran_val_at_end, total_batches)`` as the loop keeps them."""
        loop = self.loop
        parts, config, state, pos = loop.parts, loop.config, loop.state, loop.position
        hooks, engine, reporter = parts.hooks, parts.engine, parts.reporter
        k, log_every = config.accumulate_grad_batches, config.log_every_n_steps
        exhausted, ran_val = True, False
        items, self._ended, self._held = iter(fetcher), False, None
        # Lightning steps on a partial accumulation window at the epoch's last batch
        last_known = n_batches != math.inf and k > 1
        # self.current_epoch inside the step: an argument of the compiled step (no recompile per epoch)
        epoch = np.int32(pos.epoch)
        while True:
            group = self._take(items, n_batches)
            if not group:
                break
            size = len(group)
            ran_val = False
            if size == 1:  # one step: its start hooks run before it, as in Lightning
                item = group[0]
                # a batch left on the host (no per-batch hook reads it) goes to the step as it is: it transfers it
                batch = item.host if item.batch is None else item.batch
                state.batch_idx = item.index
                if self.sync_start:
                    engine.binding.sync_module()
                if hooks.call("on_train_batch_start", batch, item.index) == -1:
                    exhausted = False
                    break
                idx = step_index(item.index)
                flush = _FLUSH if last_known and item.index + 1 >= n_batches else _NO_FLUSH
                compiled, batch = self._single(item, batch, idx, flush, epoch)
                engine.train_state, out, log = compiled(engine.train_state, batch, idx, flush, epoch)
                outputs, logs, batches, flushes = (out,), (log,), (batch,), (flush,)
            else:
                batches = tuple(it.host if it.batch is None else it.batch for it in group)
                idxs = np.fromiter((it.index for it in group), np.int32, size)
                flushes = np.fromiter((last_known and it.index + 1 >= n_batches for it in group), np.bool_, size)
                compiled = self._program(group, batches, idxs, flushes, epoch)
                engine.train_state, outputs, logs = compiled(engine.train_state, batches, idxs, flushes, epoch)
            ahead.push(outputs[-1]["loss"])
            for j, item in enumerate(group):
                cbs = None if j == size - 1 else self.inside
                if size > 1:  # the execution has run: its batches' start hooks now, each before its end hook
                    state.batch_idx = item.index
                    if self.sync_start:
                        engine.binding.sync_module()
                    started = hooks.call("on_train_batch_start", batches[j], item.index, callbacks=cbs)
                    if j < size - 1:
                        self._refuse_edits("on_train_batch_start", item, group)
                    if started == -1:
                        raise MisconfigurationError(
                            f"on_train_batch_start returned -1 (skip the rest of the epoch) at batch {item.index}, "
                            f"but with steps_per_execution={self.plan.n} batches {group[0].index}..{group[-1].index} "
                            f"had already run in one execution; set trainer.should_stop = True (the run stops at "
                            f"the execution's end) or use steps_per_execution=1"
                        )
                stepped = pos.advance(item.index, item.loader_state, k, bool(flushes[j]))
                total_batches += 1
                reporter.on_train_step(logs[j], outputs[j]["loss"])
                if self.sync_end:
                    engine.binding.sync_module()
                hooks.call("on_train_batch_end", outputs[j], batches[j], item.index, callbacks=cbs)
                if j < size - 1:
                    self._refuse_edits("on_train_batch_end", item, group)
                # Lightning: logged when the update counter reaches the cadence, or when stopping
                if stepped and (pos.global_step % log_every == 0 or state.should_stop):
                    reporter.publish_step()
            # the execution's end: validation and stopping see the state single steps would have here
            idx = group[-1].index
            if loop.should_validate(val_loaders, idx, total_batches, val_every):
                loop.validate(val_loaders)
                ran_val = True
            if loop.done():
                exhausted = idx + 1 >= n_batches
                break
        return exhausted, ran_val, total_batches


__all__ = ["Executions", "plan_executions", "runs_at_boundaries_only"]
