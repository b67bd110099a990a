"""Multi-step execution: N train steps in one compiled call (``Trainer(steps_per_execution=N)``).

Two pieces live here, both free of the run's objects (layer 3, beside the step):

- :class:`MultiStep`, the program: a ``lax.scan`` of the one-batch train step
  (:meth:`jaxlight.step.StepBuilder.train_step`) over N batches stacked on a
  new leading axis, the train state the scan's carry, so the state is donated
  once per execution and each step inside is the same computation as a single
  step (the same values, bit for bit). Each step's outputs and logged values
  come back separately, in order, so the loop hands every batch's own values
  to the per-batch hooks and the reporter.
- :class:`ExecutionPlan`, the arithmetic of execution boundaries: which batch
  counts end an execution (every N batches of an epoch, and the epoch's last
  batch, where a partial execution of ``batches % N`` steps runs), and whether
  a cadence (validation every V batches, a checkpoint every C optimizer steps,
  ``max_steps``) only falls on boundaries. The loop refuses a run whose
  cadence would fall inside an execution, with the first such point.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlight.step import TrainState

TrainStepFn = Callable[
    [TrainState, Any, jax.Array, jax.Array, jax.Array], tuple[TrainState, dict[str, Any], dict[str, Any]]
]


def stacked_sharding(sharding: Any) -> Any:
    """The sharding of N batch leaves stacked on a new leading axis: the leaf's own, one dim further in."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, P(None, *sharding.spec), memory_kind=sharding.memory_kind)
    return None


class MultiStep:
    """``(state, batches, batch_idx, flush, epoch) -> (state, outputs, logs)`` for ``len(batches)`` steps.

    ``batches`` is a tuple of N batches of one structure and shape (each placed
    as a single step's batch); ``batch_idx`` (int32[N]) and ``flush`` (bool[N])
    are each step's index and flush flag; ``epoch`` (int32) is every step's, as an execution never
    crosses an epoch's end. ``outputs`` and ``logs`` are tuples of
    N per-step trees, each shaped as a single step returns it. The carried state
    is constrained to ``state_shardings`` after every step, so each step sees its
    state laid out as a single step between calls would.
    """

    def __init__(self, train_step: TrainStepFn, state_shardings: TrainState | None) -> None:
        self.train_step = train_step
        self.state_shardings = state_shardings
        self.__name__ = "train_steps"  # the name of the compiled program (HLO module name)

    def _constrain(self, state: TrainState) -> TrainState:
        if self.state_shardings is None:
            return state
        return jax.lax.with_sharding_constraint(state, self.state_shardings)

    def __call__(
        self, state: TrainState, batches: Sequence[Any], batch_idx: jax.Array, flush: jax.Array, epoch: jax.Array
    ) -> tuple[TrainState, tuple[dict[str, Any], ...], tuple[dict[str, Any], ...]]:
        n = len(batches)
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *batches)
        first = jax.tree.leaves(batches[0])
        shardings = [stacked_sharding(getattr(x, "sharding", None)) for x in first]
        if all(s is not None for s in shardings):
            leaves, treedef = jax.tree.flatten(stacked)
            stacked = jax.tree.unflatten(treedef, jax.lax.with_sharding_constraint(leaves, shardings))

        def one_step(carry: TrainState, xs: tuple[Any, jax.Array, jax.Array]):
            batch, idx, fl = xs
            # each step reads its own global_step: the carried state's step counter
            carry, outputs, logs = self.train_step(carry, batch, idx, fl, epoch)
            return self._constrain(carry), (outputs, logs)

        state, (outputs, logs) = jax.lax.scan(one_step, state, (stacked, batch_idx, flush))
        # unstacked inside the program: the loop gets each step's values as arrays of their own,
        # with no per-batch slicing dispatched from the host
        per_step = lambda tree: tuple(jax.tree.map(lambda x, i=i: x[i], tree) for i in range(n))
        return state, per_step(outputs), per_step(logs)


# ---------------------------------------------------------------------------------------- boundaries
class Miss(NamedTuple):
    """A point of a cadence that falls inside an execution: after ``count`` batches of epoch ``epoch``
    (0-based), which is optimizer step ``step`` (None for a batch cadence) or batch ``total`` of the run."""

    epoch: int
    count: int
    step: int | None = None
    total: int | None = None


class ExecutionPlan(NamedTuple):
    """Where executions of ``n`` steps end, for epochs of ``batches`` train batches (``inf``: unknown).

    An epoch is cut into executions of ``n`` batches from its first one; the
    last execution of an epoch with a known length holds ``batches % n`` batches
    when that is not 0. ``accumulate``: micro-batches per optimizer step (a
    partial window steps at the epoch's last batch, as the loop does);
    ``epochs``: the epochs the run may take (``inf``: unbounded). For a loader
    without a length the plan assumes its epochs hold a multiple of ``n``.
    """

    n: int
    batches: int | float
    accumulate: int = 1
    epochs: int | float = math.inf

    @property
    def partial(self) -> int:
        """Steps of an epoch's last, partial execution (0: every execution is full or the length is unknown)."""
        return 0 if self.batches == math.inf else int(self.batches) % self.n

    def ends_execution(self, count: int) -> bool:
        """Whether the ``count``-th batch of an epoch (1-based) is the last of an execution."""
        return count % self.n == 0 or count == self.batches

    def _epochs_to_check(self, period: int, cycle: int) -> int:
        # cadence residues repeat every cycle // gcd(cycle, period) epochs
        span = period // math.gcd(period, cycle)
        return int(min(self.epochs, span))

    def step_batch(self, update: int) -> int:
        """The batch count (1-based, in its epoch) at which the ``update``-th optimizer step of an epoch happens."""
        if self.batches == math.inf:
            return update * self.accumulate
        return min(update * self.accumulate, int(self.batches))

    @property
    def steps_per_epoch(self) -> int | float:
        return math.inf if self.batches == math.inf else math.ceil(self.batches / self.accumulate)

    def step_miss(self, step: int) -> Miss | None:
        """Optimizer step ``step`` (1-based, over the run) when it falls inside an execution, else None."""
        per = self.steps_per_epoch
        if per == math.inf:
            count = step * self.accumulate
            return None if count % self.n == 0 else Miss(0, count, step)
        epoch, update = (step - 1) // int(per), (step - 1) % int(per) + 1
        if epoch >= self.epochs:
            return None  # the epochs run out first
        count = self.step_batch(update)
        return None if self.ends_execution(count) else Miss(epoch, count, step)

    def step_cadence_miss(self, every: int, last_step: int | float = math.inf) -> Miss | None:
        """The first optimizer step ``s`` with ``s % every == 0`` (up to ``last_step``) inside an execution."""
        per = self.steps_per_epoch
        if per == math.inf:
            return self.step_miss(every) if every <= last_step else None
        per = int(per)
        for epoch in range(self._epochs_to_check(every, per)):
            first = (-epoch * per) % every or every
            for update in range(first, per + 1, every):
                step = epoch * per + update
                if step > last_step:
                    return None
                if not self.ends_execution(self.step_batch(update)):
                    return Miss(epoch, self.step_batch(update), step)
        return None

    def batch_cadence_miss(self, every: int, across_epochs: bool) -> Miss | None:
        """The first point of a cadence of ``every`` batches inside an execution: counted in each epoch,
        or over the whole run (``across_epochs``, Lightning's ``check_val_every_n_epoch=None``)."""
        if self.batches == math.inf or not across_epochs:
            if every % self.n == 0:
                return None
            if self.batches == math.inf:
                return Miss(0, every, total=every)
            for count in range(every, int(self.batches) + 1, every):
                if not self.ends_execution(count):
                    return Miss(0, count, total=count)
            return None
        b = int(self.batches)
        for epoch in range(self._epochs_to_check(every, b)):
            first = (-epoch * b) % every or every
            for count in range(first, b + 1, every):
                if not self.ends_execution(count):
                    return Miss(epoch, count, total=epoch * b + count)
        return None

    def describe(self) -> str:
        """Where executions end, in words (for the refusals)."""
        n = self.n
        if self.batches == math.inf:
            return f"executions of steps_per_execution={n} end every {n} batches"
        ends = f"batches {n}, {2 * n}, ..." if self.batches > n else f"batch {int(self.batches)}"
        tail = f" and at the epoch's last batch {int(self.batches)} (a partial execution of {self.partial})"
        return f"executions of steps_per_execution={n} end at {ends} of each epoch{tail if self.partial else ''}"


__all__ = ["ExecutionPlan", "Miss", "MultiStep", "stacked_sharding"]
