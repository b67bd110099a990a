"""LearningRateMonitor: log each optimizer's learning rate under Lightning's names (``lr-AdamW``, ``lr-SGD/pg1``)."""

from __future__ import annotations

import collections
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxlight.callbacks.callback import Callback
from jaxlight.errors import MisconfigurationError
from jaxlight.optim.schedules import driven_states, hyperparams_with_path
from jaxlight.rank_zero import rank_zero_warn
from jaxlight.step_info import StepInfo


class _Entry(NamedTuple):
    """One named learning-rate source: an optimizer (through one of its schedulers, or alone)."""

    optimizer: int  # index into the optimizer config's optimizers (StepInfo.optimizer.optimizers)
    interval: str | None  # the scheduler's interval; None: an optimizer without scheduler (logged at both)
    names: list[str | None]  # one per optimized parameter group; None where its rate cannot be read
    added: list[tuple[str, Any]] = []  # (name, AddedGroup) for the groups fine-tuning added (BaseFinetuning)


def _suffix(name: str, groups: list[Any], j: int, added: int = 0) -> str:
    """Lightning's param-group suffix: ``/pg2`` or ``/<name>`` with several groups (``added``: groups
    added since the optimizer was built count too), ``/<name>`` for a single group the user named,
    nothing for a single unnamed one."""
    g = groups[j]
    if len(groups) + added > 1:
        return f"{name}/{g.label if g.label is not None else f'pg{j + 1}'}"
    return f"{name}/{g.label}" if g.explicit and g.label is not None else name


def _plan(config: Any, infos: list[Any]) -> list[_Entry]:
    """Lightning's naming: scheduler configs first (their ``name``, else ``lr-<Optimizer>``), then
    optimizers without one; a second optimizer of the same type gets ``-1``, a third ``-2``. Groups whose
    rate cannot be read keep their place in the numbering and are not logged."""
    seen: collections.defaultdict[str, int] = collections.defaultdict(int)
    entries: list[_Entry] = []
    with_scheduler: set[int] = set()

    def entry(base: str, kind: str, i: int, interval: str | None) -> _Entry:
        if kind in seen and seen[kind] > 1:
            base = f"{base}-{seen[kind] - 1}"
        groups = infos[i].optimized_groups
        added = [g for g in config.groups if g.optimizer == i]
        names = [_suffix(base, groups, j, len(added)) if g.readable else None for j, g in enumerate(groups)]
        # a group at a multiple of a plain alias's rate (lr_scale) has no rate to read: numbered, not logged
        logged = [(f"{base}/pg{len(groups) + k + 1}", g) for k, g in enumerate(added) if g.lr_scale is None]
        return _Entry(i, interval, names, logged)

    for c in config.schedulers:
        i = c.optimizer_index
        kind = _kind(infos[i])
        with_scheduler.add(i)
        if c.name is None:
            seen[kind] += 1
        entries.append(entry(c.name if c.name is not None else f"lr-{kind}", kind, i, c.interval))
    for i, info in enumerate(infos):
        if i in with_scheduler:
            continue
        kind = _kind(info)
        seen[kind] += 1
        entries.append(entry(f"lr-{kind}", kind, i, None))
    return entries


def _added_values(group: Any, state: Any) -> dict[str, Any]:
    """An added group's rate (and momentum, weight decay), from its injected state: the host sets it as a
    number (jaxlight.optim.finetune.set_learning_rates), so the stored value is the one the next update uses."""
    sub = group.state_of(state)
    at = next(iter(driven_states(sub)))  # the path of the group's injected state
    hp = {
        k: v[at]
        for k in ("learning_rate", "b1", "momentum", "weight_decay")
        if at in (v := hyperparams_with_path(sub, k))
    }
    out = {"lr": hp["learning_rate"]}
    momentum = hp.get("b1", hp.get("momentum"))
    if momentum is not None:
        out["momentum"] = momentum
    if "weight_decay" in hp:
        out["weight_decay"] = hp["weight_decay"]
    return out


def _kind(info: Any) -> str:
    groups = info.optimized_groups
    return groups[0].name if groups else "SGD"


def _where(i: int, g: Any) -> str:
    return f"optimizer {i} ({g.name}" + (f", group {g.label!r})" if g.label is not None else ")")


_HOW = (
    "jaxlight reads learning rates from the optax state only, and a rate baked into an optax optimizer "
    "(optax.adam(1e-3), optax.adamw(schedule)) lives in optax's closures, not in its state. Build the "
    "optimizer with optax.inject_hyperparams (optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), "
    "a schedule works too), use jl.optim.param_groups, or name the schedule it uses: "
    '{"optimizer": optax.adamw(schedule), "lr_scheduler": schedule}'
)


class LearningRateMonitor(Callback):
    """Logs the learning rate of every optimizer (and parameter group) as Lightning does.

    Names: ``lr-<Optimizer>`` with torch's class name for the optax optimizer
    (``lr-SGD``, ``lr-Adam``, ``lr-AdamW``, told by its state's types, also
    inside ``optax.chain``, ``inject_hyperparams``, ``partition`` and
    ``MultiSteps``); a scheduler's ``name`` when it has one; ``-1``, ``-2``
    for further optimizers of the same type; ``/pg1``, ``/pg2`` (or the
    group's name) for parameter groups. The value is the rate the next
    update uses, as torch's ``param_group["lr"]``: the injected learning rate
    (``optax.inject_hyperparams``, :func:`jaxlight.optim.param_groups`, a
    scheduler driving it) or the named schedule at the optimizer's step
    count, times any ``reduce_on_plateau`` scale. Only the optax *state* is
    read (:mod:`jaxlight.optim.inspect`): a rate baked into a transformation
    (``optax.adam(1e-3)``) is not there, so such an optimizer is not logged
    and a warning at train start names it; when no rate at all can be read,
    the monitor raises.

    When: ``logging_interval=None`` logs step-interval schedulers at the
    trainer's ``log_every_n_steps`` cadence (at the start of the batch; under
    gradient accumulation at every micro-batch of a logged update, as
    Lightning does, so a value repeats once per micro-batch),
    epoch-interval ones (plateau schedulers by default) at each epoch start,
    and optimizers without a scheduler at both; ``"step"``/``"epoch"`` log
    everything at that cadence only. Values go to the loggers at the step the
    trainer's metrics use, are kept in ``self.lrs``, and are put in
    ``trainer.callback_metrics`` (so ``ModelCheckpoint(monitor="lr-SGD")`` and
    ``"{lr-SGD}"`` in file names work). ``log_momentum`` adds
    ``<name>-momentum`` (Adam's ``b1``, SGD's momentum, else 0) and
    ``log_weight_decay`` ``<name>-weight_decay`` (decoupled weight decay,
    else 0), where the state holds them (injected, or param groups). Reading the values syncs with the device only when logging.
    """

    def __init__(
        self, logging_interval: str | None = None, log_momentum: bool = False, log_weight_decay: bool = False
    ) -> None:
        if logging_interval not in (None, "step", "epoch"):
            raise MisconfigurationError(
                f"logging_interval should be `step` or `epoch` or `None`, got {logging_interval!r}"
            )
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum
        self.log_weight_decay = log_weight_decay
        self.lrs: dict[str, list[float]] = {}
        self.last_momentum_values: dict[str, float | None] = {}
        self.last_weight_decay_values: dict[str, float | None] = {}
        self._entries: list[_Entry] = []
        self._infos: list[Any] = []  # jaxlight.optim.TransformInfo per optimizer, read at train start
        self._config: Any = None  # the optimizer config planned for; BaseFinetuning replaces it when adding groups

    @property
    def reads_optimizer_state_per_step(self) -> tuple[str, str] | None:
        # by step it reads the learning rate before each logged step: steps_per_execution refuses that
        if self.logging_interval == "epoch":
            return None
        return (
            f"LearningRateMonitor(logging_interval={self.logging_interval!r}) reads the learning rate from the "
            "optimizer state before each logged step",
            "use LearningRateMonitor(logging_interval='epoch')",
        )

    # -- the logic on a StepInfo (no Trainer)
    def start(self, info: StepInfo) -> None:
        """Find the rates of ``info.optimizer`` in ``info.state``'s optax state and plan their names (train
        start). Raises :class:`MisconfigurationError` without a logger (unless ``fast_dev_run``) or when no
        rate can be read; warns naming the groups (or momentum, weight decay) it cannot log."""
        if not info.loggers and not info.fast_dev_run:
            raise MisconfigurationError("Cannot use `LearningRateMonitor` callback with `Trainer` that has no logger.")
        config = info.optimizer
        self._infos = self._inspect(info)
        groups = [(i, g) for i, t in enumerate(self._infos) for g in t.optimized_groups]
        unread = [_where(i, g) for i, g in groups if not g.readable]
        if groups and len(unread) == len(groups):
            raise MisconfigurationError(
                f"LearningRateMonitor cannot find a learning rate in {', '.join(unread)}: {_HOW}"
            )
        wanted = {"momentum": self.log_momentum, "weight decay": self.log_weight_decay}
        partial = [
            f"{_where(i, g)}: its {' and '.join(m for m in g.missing if wanted.get(m))}"
            for i, g in groups
            if g.readable and any(wanted.get(m) for m in g.missing)
        ]
        if unread or partial:
            parts = ([f"the learning rate of {', '.join(unread)}"] if unread else []) + partial
            rank_zero_warn(f"LearningRateMonitor does not log {'; '.join(parts)}. {_HOW}")
        self._config, self._entries = config, _plan(config, self._infos)
        names = self._names()
        self.lrs = {n: [] for n in names}
        self.last_momentum_values = {f"{n}-momentum": None for n in names}
        self.last_weight_decay_values = {f"{n}-weight_decay": None for n in names}

    def should_log_step(self, info: StepInfo) -> bool:
        """Whether the batch starting now belongs to a logged update (the trainer logs the metrics of update
        ``g``, 0-based, when ``(g + 1) % log_every_n_steps == 0``), or a stop is requested."""
        return (info.global_step + 1) % info.log_every_n_steps == 0 or info.should_stop

    def at_batch_start(self, info: StepInfo) -> dict[str, float]:
        """The values to log at a train batch's start (``{}`` off the step cadence): step-interval
        schedulers and optimizers without one (everything with ``logging_interval="step"``)."""
        # Lightning's cadence is per batch: under gradient accumulation every micro-batch of a logged update
        # logs the rate again, at the same step (checked against pytorch-lightning, issue 23)
        if self.logging_interval == "epoch" or not self.should_log_step(info):
            return {}
        return self.read(info, "step" if self.logging_interval is None else "any")

    def at_epoch_start(self, info: StepInfo) -> dict[str, float]:
        """The values to log at a train epoch's start (``{}`` with ``logging_interval="step"``):
        epoch-interval schedulers and optimizers without one (everything with ``"epoch"``)."""
        if self.logging_interval == "step":
            return {}
        return self.read(info, "epoch" if self.logging_interval is None else "any")

    def read(self, info: StepInfo, interval: str) -> dict[str, float]:
        """Read the rates of the entries logged at ``interval`` (``"step"``, ``"epoch"``; ``"any"``: all)
        from ``info.state.opt_state`` in one host fetch, record them (``lrs``, ``last_momentum_values``,
        ``last_weight_decay_values``) and return ``{name: value}``. Plans the names again first when
        ``info.optimizer`` is not the one planned for (fine-tuning added parameter groups)."""
        if info.optimizer is not self._config:
            self._replan(info)
        entries = [e for e in self._entries if interval == "any" or e.interval in (None, interval)]
        if not entries:
            return {}
        config = info.optimizer
        state = self._state(info).opt_state
        read: dict[int, list[dict[str, Any]]] = {}
        for e in entries:
            if e.optimizer not in read:
                read[e.optimizer] = self._infos[e.optimizer].values(config.optimizers[e.optimizer].state_of(state))
        values: dict[str, Any] = {}
        for e in entries:
            pairs = [*zip(e.names, read[e.optimizer]), *((n, _added_values(g, state)) for n, g in e.added)]
            for name, got in pairs:
                if name is None:
                    continue
                values[name] = got["lr"]
                if self.log_momentum and "momentum" in got:
                    values[f"{name}-momentum"] = got["momentum"]
                if self.log_weight_decay and "weight_decay" in got:
                    values[f"{name}-weight_decay"] = got["weight_decay"]
        host = {k: float(v) for k, v in jax.device_get(values).items()}  # one fetch for every value
        for k, v in host.items():
            if k in self.lrs:
                self.lrs[k].append(v)
            elif k in self.last_momentum_values:
                self.last_momentum_values[k] = v
            elif k in self.last_weight_decay_values:
                self.last_weight_decay_values[k] = v
        return host

    def _names(self) -> list[str]:
        return [n for e in self._entries for n in [*e.names, *(a for a, _ in e.added)] if n is not None]

    @staticmethod
    def _state(info: StepInfo) -> Any:
        if info.state is None:
            raise RuntimeError("LearningRateMonitor needs a StepInfo with a train state (info.state is None)")
        return info.state

    def _inspect(self, info: StepInfo) -> list[Any]:
        if info.optimizer is None:
            raise RuntimeError("LearningRateMonitor needs a StepInfo with the optimizer (info.optimizer is None)")
        state = self._state(info)
        return info.optimizer.inspect(state.opt_state, state.params)

    def _replan(self, info: StepInfo) -> None:
        """The optimizer was rebuilt with added groups: plan again, and, as Lightning does, move the history
        of ``lr-Adam`` to ``lr-Adam/pg1`` when the first group gets a suffix; new names start empty."""
        config = info.optimizer
        self._infos = self._inspect(info)
        self._config, self._entries = config, _plan(config, self._infos)
        for name in self._names():
            old = name.replace("/pg1", "")
            if "/pg1" in name and old in self.lrs:
                self.lrs[name] = self.lrs.pop(old)
                for d, tail in (
                    (self.last_momentum_values, "-momentum"),
                    (self.last_weight_decay_values, "-weight_decay"),
                ):
                    d[name + tail] = d.pop(old + tail, None)
            elif name not in self.lrs:
                self.lrs[name] = []
                self.last_momentum_values[f"{name}-momentum"] = None
                self.last_weight_decay_values[f"{name}-weight_decay"] = None

    # -- Lightning-style adapters: build the info, log what the logic returns
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.start(StepInfo.of_trainer(trainer))

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.logging_interval == "epoch":  # nothing to log per batch: no info built
            return
        self._log(trainer, self.at_batch_start(StepInfo.of_trainer(trainer, batch_idx=batch_idx)))

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self.logging_interval != "step":
            self._log(trainer, self.at_epoch_start(StepInfo.of_trainer(trainer)))

    @staticmethod
    def _log(trainer: Any, stats: dict[str, float]) -> None:
        # Lightning puts the values in callback_metrics too (a monitor or a file name can use them)
        if stats:
            trainer.callback_metrics.update({k: jnp.float32(v) for k, v in stats.items()})
            trainer.reporter.log_metrics(stats, step=trainer.global_step)
