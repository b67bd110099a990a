"""Where the fit loop is: epoch, optimizer step, micro-batch and loader position.

One object owns the counters a resumed run needs, so checkpointing saves
``position.state_dict()`` and a restore hands it back with
``load_state_dict`` instead of reaching into the trainer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxlight.prefetch import FRESH_EPOCH_KEY, GENERATOR_KEY


class LoopPosition:
    """The fit loop's counters.

    - ``epoch``: completed epochs (Lightning's ``current_epoch``);
    - ``global_step``: optimizer updates applied (micro-batches inside
      gradient accumulation do not count);
    - ``micro_batches``: train batches consumed over the whole run;
    - ``window``: micro-batches accumulated since the last optimizer update
      (always 0 without gradient accumulation); ``last_stepped``: the last
      consumed batch completed an optimizer update;
    - ``batches_in_epoch``: train batches of the current epoch consumed;
    - ``epoch_finished``: every batch of the current epoch was consumed (set
      when the epoch's batches run out, cleared when the next epoch starts);
    - ``loader_state``: the train loader's ``state_dict()`` right after the
      last consumed batch (None for loaders without one);
    - ``resume_offset`` / ``resume_loader_state``: where the next epoch
      starts after a restore (batches to skip in a plain re-iterable, or the
      loader state to load), consumed once by the loop.

    Guarantees: ``state_dict()`` is plain JSON-able data plus the loader's own
    state, and a position loaded from it resumes on the next batch after the
    last consumed one (or at the next epoch when the saved one had finished).
    """

    def __init__(self) -> None:
        self.epoch = 0
        self.global_step = 0
        self.micro_batches = 0
        self.window = 0
        self.last_stepped = False
        self.batches_in_epoch = 0
        self.epoch_finished = False
        self.loader_state: Any = None
        self.resume_offset = 0
        self.resume_loader_state: Any = None

    # -- the loop moves it ---------------------------------------------------------
    def start_epoch(self) -> int:
        """Begin an epoch; returns the batch index it starts at (non-zero after a mid-epoch restore)."""
        start, self.resume_offset = self.resume_offset, 0
        self.batches_in_epoch = start
        self.epoch_finished = False
        return start

    def take_resume_loader_state(self) -> Any:
        """The restored loader state to load before the next epoch's first batch (once)."""
        state, self.resume_loader_state = self.resume_loader_state, None
        return state

    def advance(self, batch_idx: int, loader_state: Any, accumulate: int, flush: bool = False) -> bool:
        """Record train batch ``batch_idx`` as consumed; returns whether it completed an optimizer step
        (a full window of ``accumulate`` micro-batches, or a flushed partial one)."""
        self.loader_state = loader_state
        self.micro_batches += 1
        self.batches_in_epoch = batch_idx + 1
        self.window += 1
        self.last_stepped = self.window >= accumulate or flush
        if self.last_stepped:
            self.global_step += 1
            self.window = 0
        return self.last_stepped

    def end_epoch(self) -> None:
        self.epoch += 1
        self.batches_in_epoch = 0
        self.epoch_finished = False

    # -- checkpoints -------------------------------------------------------------------
    def resume_point(self, batches_per_epoch: int | float) -> tuple[int, int, bool]:
        """``(epoch to resume in, batches of it already consumed, whether it starts fresh)``."""
        done = self.batches_in_epoch
        # Only an epoch whose end has begun (``epoch_finished``: its validation and epoch-end hooks run or
        # running) resumes at the next one. A save after its last batch but before that (a step-cadence or
        # preemption save in ``on_train_batch_end``, a save at the last batch's validation) resumes inside it,
        # with every batch consumed, so the resumed run still runs its epoch end: before, it went straight to
        # the next epoch and lost what the epoch-end hooks do (a held nnx.Metric's reset, epoch-level logs,
        # an epoch scheduler), unlike the run that never stopped.
        finished = self.epoch_finished
        if finished:
            return self.epoch + 1, 0, True
        return self.epoch, done, done == 0

    def state_dict(self, batches_per_epoch: int | float) -> dict[str, Any]:
        """What a resume needs (Lightning's ``fit_loop`` entry of a checkpoint)."""
        epoch, in_epoch, fresh = self.resume_point(batches_per_epoch)
        return {
            "epoch": self.epoch,
            "global_step": self.global_step,
            "resume_epoch": epoch,
            "batches_in_epoch": in_epoch,
            "fresh_epoch": fresh,
            "micro_batches": self.micro_batches,
            "window": self.window,
            "loader_state": self.loader_state,
        }

    def load_state_dict(self, state: Mapping[str, Any], loader_state: Any = None) -> None:
        """Continue from ``state``; ``loader_state`` overrides the saved one (per-process loaders)."""
        self.global_step = int(state["global_step"])
        self.epoch = int(state["resume_epoch"])
        self.micro_batches = int(state["micro_batches"])
        self.window = int(state.get("window", 0))
        self.batches_in_epoch = int(state["batches_in_epoch"])
        self.resume_offset = int(state["batches_in_epoch"])
        self.epoch_finished = False
        loader = state.get("loader_state") if loader_state is None else loader_state
        if state.get("fresh_epoch"):
            # The saved epoch was finished: the next one starts from the loader's saved generator.
            gen = loader.get(GENERATOR_KEY) if isinstance(loader, Mapping) else None
            loader = {FRESH_EPOCH_KEY: True, **({GENERATOR_KEY: gen} if gen is not None else {})}
        self.resume_loader_state = loader
        if loader is not None:
            self.loader_state = loader
