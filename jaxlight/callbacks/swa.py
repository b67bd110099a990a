"""StochasticWeightAveraging: Lightning's SWA callback, with the average on the device in the parameters' shardings.

Lightning's schedule, replicated: from epoch ``swa_start`` (0-based) the
learning rate follows torch's ``SWALR`` (stepped at every epoch's end, from
the optimizer's rate to ``swa_lrs`` over ``annealing_epochs``), and at the
start of every epoch from ``swa_start`` to the last one the running average
takes the parameters as they are then (``n_averaged`` counts them). At the
end of training the average becomes the model's weights and, when the model
has BatchNorm layers, their running statistics are recomputed over one pass
of the training data (Lightning's extra epoch with ``momentum=None``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlight.callbacks.callback import Callback
from jaxlight.data import BatchPlacer, host_batch
from jaxlight.errors import MisconfigurationError
from jaxlight.metrics import Collector
from jaxlight.optim.schedules import (
    driven_states,
    hyperparams_with_path,
    is_scheduled,
    learning_rate_value,
    outer_injected_states,
    set_hyperparam,
)
from jaxlight.rank_zero import rank_zero_info, rank_zero_warn
from jaxlight.state import graph_root, rest_after
from jaxlight.step import StepExtension

_INJECT_FIX = (
    "build the optimizer with an injected rate, optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, "
    "momentum=0.9) (or optax.inject_hyperparams(optax.adam)(learning_rate=1e-3))"
)


# ------------------------------------------------------------------------------------ the arithmetic
def default_avg_fn(average: jax.Array, param: jax.Array, num_averaged: jax.Array) -> jax.Array:
    """torch's equal-weight running mean: ``average + (param - average) / (num_averaged + 1)``."""
    return average + (param - average) / (num_averaged + 1)


def _anneal(strategy: str, t: float) -> float:
    return (1 - math.cos(math.pi * t)) / 2 if strategy == "cos" else t


def swalr_rates(lrs: Sequence[float], swa_lrs: Sequence[float], step_count: int, anneal_epochs: int, strategy: str):
    """torch's ``SWALR.get_lr`` at ``step_count`` (after ``_step_count`` became it) from the current rates ``lrs``,
    in Python floats as torch computes them: each rate moves from the one it was annealed from towards its
    ``swa_lr`` by the annealing function of ``(step_count - 1) / anneal_epochs`` (clipped to [0, 1])."""
    step = step_count - 1
    if anneal_epochs == 0:
        step = max(1, step)
    prev_alpha = _anneal(strategy, max(0, min(1, (step - 1) / max(1, anneal_epochs))))
    alpha = _anneal(strategy, max(0, min(1, step / max(1, anneal_epochs))))
    out = []
    for lr, swa in zip(lrs, swa_lrs):
        prev = swa if prev_alpha == 1 else (lr - prev_alpha * swa) / (1 - prev_alpha)
        out.append(swa * alpha + prev * (1 - alpha))
    return out


def _update_average(avg_fn: Callable) -> Callable:
    def update(average: dict[str, jax.Array], params: dict[str, jax.Array], n: jax.Array) -> dict[str, jax.Array]:
        def one(a: jax.Array, p: jax.Array) -> jax.Array:
            new = avg_fn(a, p.astype(a.dtype), n)
            return jnp.where(n == 0, p.astype(a.dtype), jnp.asarray(new).astype(a.dtype))

        return {k: one(average[k], params[k]) for k in average}

    return update


def _batch_norms(root: Any) -> list[nnx.BatchNorm]:
    """The BatchNorm layers of a graph that normalise with batch statistics in the train step (their running
    statistics move); a layer in eval mode keeps its statistics, in jaxlight as its forward uses them."""
    return [n for _, n in nnx.iter_graph(root) if isinstance(n, nnx.BatchNorm) and not n.use_running_average]


# ------------------------------------------------------------------------------------ the callback
class StochasticWeightAveraging(Callback):
    """Lightning's ``StochasticWeightAveraging``: an equal-weight average of the parameters from
    ``swa_epoch_start`` on, with ``SWALR``'s learning rate, put into the model at the end of training.

    - ``swa_lrs``: the SWA learning rate, one number for every parameter group, or a list with one per
      group (the optimizer's injected ``learning_rate`` states, in state order).
    - ``swa_epoch_start``: an int ``>= 1``: averaging starts at that epoch (1-based, as Lightning counts
      it: epoch ``swa_epoch_start - 1`` of ``trainer.current_epoch``); a float in ``[0, 1]``: at
      ``int(swa_epoch_start * max_epochs)``.
    - ``annealing_epochs``, ``annealing_strategy`` (``"cos"``/``"linear"``): torch's ``SWALR``, stepped at
      every epoch's end from the rate the optimizer has when SWA starts.
    - ``avg_fn(averaged, param, num_averaged)``: the update, traced with ``jax.numpy`` per parameter
      (``num_averaged``: an int32 scalar); default the running mean ``averaged + (param - averaged) /
      (num_averaged + 1)``. The first update copies the parameters.
    - ``device``: Lightning keeps its average model on ``"cpu"``. Here the average stays on the devices
      that hold the parameters, in their shardings (no host copy, works under FSDP), so ``device`` only
      accepts Lightning's default ``"cpu"`` or None, which both mean that; another device is refused.

    The average lives in ``TrainState.callback_state["swa"]`` (checkpointed with the train state;
    ``n_averaged``, the last averaged epoch and the ``SWALR`` state are this callback's ``state_dict``),
    so a resume continues it exactly. The learning rate is written into the optimizer's
    ``optax.inject_hyperparams`` state (a plain ``optax.sgd(0.1)`` is refused, naming the fix), replacing
    an ``"interval": "epoch"`` scheduler from ``swa_start`` on, as Lightning swaps it for ``SWALR``; a
    rate scheduled inside the update (``"interval": "step"``, a schedule given to ``inject_hyperparams``)
    or a plateau scheduler is refused. One optimizer, automatic optimization.

    At the end of a run that reached ``max_epochs`` the average is written into the parameters; NNX
    ``BatchNorm`` layers then get running statistics recomputed as the cumulative average over one pass
    of the training loader (``limit_train_batches`` batches), ``training_step`` run in train mode with the
    averaged weights and no update: Lightning's extra epoch, done inside ``on_train_end`` (no epoch is
    logged, ``current_epoch`` stays ``max_epochs``). The running variance is NNX's (biased) batch
    variance, where torch folds in the unbiased one (docs/migration.md). With ``max_epochs=-1`` the
    average is written at the end of training without the BatchNorm pass, as in Lightning.
    """

    state_on_device = ("callback_state",)  # the average is updated between steps by a jitted function

    def __init__(
        self,
        swa_lrs: float | list[float],
        swa_epoch_start: int | float = 0.8,
        annealing_epochs: int = 10,
        annealing_strategy: str = "cos",
        avg_fn: Callable[[Any, Any, Any], Any] | None = None,
        device: Any = "cpu",
        name: str = "swa",
    ) -> None:
        err = "swa_epoch_start should be a >0 integer or a float between 0 and 1."
        if isinstance(swa_epoch_start, bool) or not isinstance(swa_epoch_start, (int, float)):
            raise MisconfigurationError(err)
        if isinstance(swa_epoch_start, int) and swa_epoch_start < 1:
            raise MisconfigurationError(err)
        if isinstance(swa_epoch_start, float) and not 0 <= swa_epoch_start <= 1:
            raise MisconfigurationError(err)

        def positive(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0

        if not (positive(swa_lrs) or (isinstance(swa_lrs, list) and swa_lrs and all(map(positive, swa_lrs)))):
            raise MisconfigurationError("The `swa_lrs` should a positive float, or a list of positive floats")
        if not isinstance(annealing_epochs, int) or isinstance(annealing_epochs, bool) or annealing_epochs < 0:
            raise MisconfigurationError(f"annealing_epochs must be equal or greater than 0, got {annealing_epochs}")
        if annealing_strategy not in ("cos", "linear"):
            raise MisconfigurationError(
                f"annealing_strategy must be one of 'cos' or 'linear', instead got {annealing_strategy}"
            )
        if avg_fn is not None and not callable(avg_fn):
            raise MisconfigurationError("The `avg_fn` should be callable.")
        if device is not None and str(device) != "cpu":
            raise MisconfigurationError(
                f"StochasticWeightAveraging(device={device!r}): jaxlight keeps the average on the devices that hold "
                f"the parameters, in their shardings (so it works under FSDP and needs no host copy); leave device "
                f"out (or None / 'cpu', which mean the same here)"
            )
        self._swa_epoch_start = swa_epoch_start
        self._swa_lrs = [float(v) for v in swa_lrs] if isinstance(swa_lrs, list) else float(swa_lrs)
        self._annealing_epochs = annealing_epochs
        self._annealing_strategy = annealing_strategy
        self._avg_fn = avg_fn or default_avg_fn
        self._device = device
        self.name = name
        self.n_averaged = 0
        self._latest_update_epoch = -1
        # SWALR: the epoch it started at, its _step_count, the group rates it last set, the swa rates
        self._scheduler: dict[str, Any] | None = None
        self._start: int | None = None  # swa_epoch_start resolved to an int (1-based)
        self._max_epochs = -1
        self._has_batch_norm = False
        self._jitted: dict[str, Any] = {}

    # -- Lightning's properties
    @property
    def swa_start(self) -> int:
        """The first epoch (0-based) whose start takes part in the average."""
        assert self._start is not None, "swa_start is known once fit starts"
        return max(self._start - 1, 0)

    @property
    def swa_end(self) -> float:
        return math.inf if self._max_epochs == -1 else self._max_epochs - 1

    @property
    def state_key(self) -> str:
        return type(self).__qualname__

    # -- the in-step state: the average, carried (and checkpointed) with the train state
    def step_extension(self, trainer: Any) -> StepExtension:
        return StepExtension(self.name, lambda average, params, info: average)

    def init_step_state(self, trainer: Any, params: dict[str, jax.Array]) -> dict[str, jax.Array]:
        # a copy in the parameters' own shardings (the train state is donated: no buffer shared with them)
        shardings = {k: v.sharding for k, v in params.items()}
        return jax.jit(lambda p: {k: jnp.copy(v) for k, v in p.items()}, out_shardings=shardings)(params)

    def average(self, trainer: Any) -> dict[str, jax.Array]:
        """The averaged parameters (flat ``{path: array}``, sharded like the parameters)."""
        state = trainer.train_state
        if state is None or self.name not in state.callback_state:
            raise RuntimeError(
                "StochasticWeightAveraging has no average yet: it is created when fit() sets up training"
            )
        return state.callback_state[self.name]

    # -- setup
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        max_epochs = trainer.max_epochs
        self._max_epochs = -1 if max_epochs is None else int(max_epochs)
        if isinstance(self._swa_epoch_start, float):
            if self._max_epochs == -1:
                raise MisconfigurationError(
                    "SWA with `swa_epoch_start` as a float is not supported when `max_epochs=-1`. "
                    "Please provide `swa_epoch_start` as an integer."
                )
            self._start = int(self._max_epochs * self._swa_epoch_start)
        else:
            self._start = self._swa_epoch_start

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        engine = trainer.engine
        config = engine.optimizer
        if not config.automatic or len(config.optimizers) != 1:
            raise MisconfigurationError(
                "SWA currently works with 1 `optimizer` and automatic optimization "
                f"(found {len(config.optimizers)} optimizer(s), automatic={config.automatic})."
            )
        for c in config.schedulers:
            if c.reduce_on_plateau or c.interval != "epoch":
                raise MisconfigurationError(
                    f"StochasticWeightAveraging replaces the scheduler by SWALR, stepped per epoch; a "
                    f"{'plateau' if c.reduce_on_plateau else 'step-interval'} scheduler sets the rate inside the "
                    f'update, where SWALR cannot take over: return it with "interval": "epoch", or no scheduler'
                )
        state = trainer.train_state.opt_state
        scheduled = [p for p, n in outer_injected_states(state).items() if is_scheduled(n, "learning_rate")]
        if scheduled:
            raise MisconfigurationError(
                "StochasticWeightAveraging sets the learning rate from the host each epoch, but the optimizer's "
                "injected learning_rate is a schedule (optax.inject_hyperparams(...)(learning_rate=schedule)), "
                "recomputed inside every update: inject a number instead and return the schedule from "
                'configure_optimizers as {"scheduler": schedule, "interval": "epoch"} (SWA replaces it from '
                "swa_start on, as Lightning does)"
            )
        self._paths = list(driven_states(state))
        if not self._paths:
            raise MisconfigurationError(
                "StochasticWeightAveraging anneals the optimizer's learning rate (torch's SWALR), which needs the "
                "rate in the optimizer state; a plain optax alias (optax.sgd(0.1), optax.adam(1e-3)) keeps it in a "
                f"closure: {_INJECT_FIX}"
            )
        if isinstance(self._swa_lrs, list) and len(self._swa_lrs) != len(self._paths):
            raise MisconfigurationError(
                f"swa_lrs has {len(self._swa_lrs)} rates but the optimizer has {len(self._paths)} parameter "
                f"group(s) with an injected learning rate"
            )
        models = {k: getattr(pl_module, k) for k in engine.parts.names}
        self._has_batch_norm = bool(_batch_norms(graph_root(engine.parts, models)))
        self._jitted = {}
        if self._scheduler is not None:  # resumed: the saved SWALR rates (an epoch schedule may have set its own)
            self._write_rates(trainer, self._scheduler["lrs"])

    # -- the learning rate (SWALR)
    def _read_rates(self, trainer: Any) -> list[float]:
        found = hyperparams_with_path(trainer.train_state.opt_state, "learning_rate")
        return [float(np.asarray(found[p])) for p in self._paths]

    def _write_rates(self, trainer: Any, lrs: Sequence[float]) -> None:
        st = trainer.train_state
        if "rates" not in self._jitted:
            shardings = hyperparams_with_path(trainer.engine.state_shardings.opt_state, "learning_rate")

            def write(stored: list, rates: list) -> list:
                return [learning_rate_value(s, r) for s, r in zip(stored, rates)]

            self._jitted["rates"] = jax.jit(write, out_shardings=[shardings[p] for p in self._paths])
        found = hyperparams_with_path(st.opt_state, "learning_rate")
        new = self._jitted["rates"]([found[p] for p in self._paths], [np.float64(v) for v in lrs])
        opt_state = st.opt_state
        for path, value in zip(self._paths, new):
            opt_state = set_hyperparam(opt_state, path, "learning_rate", value)
        trainer.train_state = st._replace(opt_state=opt_state)

    def _advance(self, trainer: Any, step_count: int) -> None:
        """Step SWALR until its ``_step_count`` is ``step_count`` (a function of the epoch, so a resume from a
        checkpoint written before or after an epoch-end step lands on the same rates), and write the rates."""
        s = self._scheduler
        assert s is not None
        while s["step_count"] < step_count:
            s["step_count"] += 1
            s["lrs"] = swalr_rates(
                s["lrs"], s["swa_lrs"], s["step_count"], self._annealing_epochs, self._annealing_strategy
            )
        self._write_rates(trainer, s["lrs"])

    def _start_scheduler(self, trainer: Any, epoch: int) -> None:
        lrs = self._read_rates(trainer)
        swa = self._swa_lrs if isinstance(self._swa_lrs, list) else [self._swa_lrs] * len(lrs)
        # SWALR's constructor steps once: _step_count 1, the rates at annealing time 0
        first = swalr_rates(lrs, swa, 1, self._annealing_epochs, self._annealing_strategy)
        self._scheduler = {"start_epoch": epoch, "step_count": 1, "lrs": first, "swa_lrs": swa}
        if epoch != self.swa_start:
            rank_zero_warn(
                "SWA is initializing after swa_start without any checkpoint data. "
                "This may be caused by loading a checkpoint from an older version of PyTorch Lightning."
            )
        if trainer.engine.optimizer.schedulers:
            rank_zero_info("Swapping the epoch scheduler for `SWALR`")
        self._write_rates(trainer, first)

    # -- the epoch hooks
    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        epoch = int(trainer.current_epoch)
        if self._scheduler is None and self.swa_start <= epoch <= self.swa_end:
            self._start_scheduler(trainer, epoch)
        elif self._scheduler is not None:
            self._advance(trainer, epoch - self._scheduler["start_epoch"] + 1)
        if self.swa_start <= epoch <= self.swa_end and epoch > self._latest_update_epoch:
            self._update_average(trainer)
            self._latest_update_epoch = epoch

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self._scheduler is not None:  # Lightning steps the epoch scheduler after the epoch
            self._advance(trainer, int(trainer.current_epoch) - self._scheduler["start_epoch"] + 2)

    def _update_average(self, trainer: Any) -> None:
        st = trainer.train_state
        if "average" not in self._jitted:
            shardings = trainer.engine.state_shardings.callback_state[self.name]
            self._jitted["average"] = jax.jit(
                _update_average(self._avg_fn), out_shardings=shardings, donate_argnums=(0,)
            )
        n = jnp.asarray(self.n_averaged, jnp.int32)
        with trainer.engine.context():
            new = self._jitted["average"](st.callback_state[self.name], st.params, n)
        trainer.train_state = st._replace(callback_state={**st.callback_state, self.name: new})
        self.n_averaged += 1

    # -- the end: the average into the model, BatchNorm statistics recomputed
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._max_epochs != -1 and int(trainer.current_epoch) - 1 != self.swa_end:
            return  # stopped before the last epoch: the model keeps its trained weights, as in Lightning
        if self.n_averaged == 0:
            return
        engine = trainer.engine
        st = trainer.train_state
        copy = jax.jit(
            lambda a: {k: jnp.copy(v).astype(st.params[k].dtype) for k, v in a.items()},
            out_shardings=engine.state_shardings.params,
        )
        with engine.context():
            params = copy(st.callback_state[self.name])
        trainer.train_state = st._replace(params=params)
        if self._has_batch_norm and self._max_epochs != -1:
            self._recompute_batch_norm(trainer)
        engine.binding.sync_module()

    def _recompute_batch_norm(self, trainer: Any) -> None:
        """Lightning's extra epoch with ``momentum=None``: each trained BatchNorm's running mean and variance
        become the cumulative average of the batch statistics over one pass of the train loader,
        ``training_step`` run in train mode with the (averaged) parameters and no update."""
        engine = trainer.engine
        builder, module = engine.builder, engine.module
        st = trainer.train_state

        def bn_step(params: dict, rest: dict, batch: Any, batch_idx: Any, frac: Any, first: Any) -> dict:
            models = builder._models(params, rest, train=True)
            norms = _batch_norms(graph_root(builder.parts, models))
            before = [(bn.mean[...], bn.var[...]) for bn in norms]
            for bn in norms:
                bn.momentum = 0.0  # the statistics left in them are this batch's own
            with module._bound(models, Collector("train", None, on_step=True, on_epoch=False)):
                module.training_step(builder.precision.compute(batch), batch_idx)
            for bn, (mean, var) in zip(norms, before):
                for v, old in ((bn.mean, mean), (bn.var, var)):
                    f = frac.astype(old.dtype)
                    v[...] = jnp.where(first, v[...], (1 - f) * old + f * v[...]).astype(old.dtype)
            new = rest_after(builder.parts, models)
            new = {k: jnp.asarray(v).astype(rest[k].dtype) for k, v in new.items()}
            new.update({k: rest[k] for k in builder.held_rest})
            return new

        step = jax.jit(bn_step, out_shardings=engine.state_shardings.model_state, donate_argnums=(1,))
        placer = BatchPlacer(engine.mesh, trainer.config.process_local_batches, engine.strategy)
        limit = trainer.num_training_batches
        loader = trainer.train_dataloader
        batches = iter(loader) if limit == math.inf else itertools.islice(iter(loader), int(limit))
        rest = st.model_state
        with engine.context():
            rest = jax.jit(
                lambda r: {k: jnp.copy(v) for k, v in r.items()}, out_shardings=engine.state_shardings.model_state
            )(rest)
            for i, batch in enumerate(batches):
                placed = placer.place(host_batch(batch))
                rest = step(st.params, rest, placed, jnp.int32(i), np.float32(1.0 / (i + 1)), np.bool_(i == 0))
        trainer.train_state = trainer.train_state._replace(model_state=rest)

    # -- checkpointing
    def state_dict(self) -> dict[str, Any]:
        # The average itself is device state in TrainState.callback_state[name]; this is its bookkeeping.
        return {
            "n_averaged": self.n_averaged,
            "latest_update_epoch": self._latest_update_epoch,
            "scheduler_state": None if self._scheduler is None else dict(self._scheduler),
        }

    def check_state_dict(self, state_dict: Any) -> None:
        if not isinstance(state_dict, dict):
            raise TypeError(f"StochasticWeightAveraging state must be a dict, got {type(state_dict).__name__}")
        for key in ("n_averaged", "latest_update_epoch"):
            if not isinstance(state_dict.get(key), (int, np.integer)):
                raise ValueError(f"StochasticWeightAveraging state {key!r} must be an int, got {state_dict.get(key)!r}")
        s = state_dict.get("scheduler_state")
        if s is not None and not (isinstance(s, dict) and {"start_epoch", "step_count", "lrs", "swa_lrs"} <= set(s)):
            raise ValueError(f"StochasticWeightAveraging state 'scheduler_state' is not a SWALR state: {s!r}")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.n_averaged = int(state_dict["n_averaged"])
        self._latest_update_epoch = int(state_dict["latest_update_epoch"])
        s = state_dict.get("scheduler_state")
        self._scheduler = None
        if s is not None:
            self._scheduler = {
                "start_epoch": int(s["start_epoch"]),
                "step_count": int(s["step_count"]),
                "lrs": [float(v) for v in s["lrs"]],
                "swa_lrs": [float(v) for v in s["swa_lrs"]],
            }
