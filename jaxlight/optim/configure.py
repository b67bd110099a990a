"""From what ``configure_optimizers`` returns to the one optax transformation the step applies.

:func:`configure` reads every return form Lightning accepts (an optimizer, a
list of them, ``([optimizers], [schedulers])``, a dict or a list of dicts,
with lr-scheduler dicts carrying ``interval``/``frequency``/``monitor``/
``strict``/``name``), plus jaxlight's parameter selectors (``"params"``) and
:func:`~jaxlight.optim.param_groups`. :meth:`OptimizerConfig.build` then
resolves the selectors against the module's parameters and makes the
transformations: one for automatic optimization (parameter groups as an
``optax.partition``, clipping via ``chain``, accumulation via
:func:`~jaxlight.optim.accumulate_gradients`), or one per optimizer for
manual optimization. Schedulers that Lightning steps outside the update
(``ReduceLROnPlateau`` fed with a monitored metric, epoch intervals) keep
their state in the optimizer state and are stepped by
:class:`jaxlight.callbacks.lr_scheduler.LRSchedulerStepper` with small jitted
functions; the compiled step never needs a ``value=`` argument.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxlight.errors import MisconfigurationError
from jaxlight.optim.accumulate import accumulate_gradients
from jaxlight.optim.finetune import AddedGroup, group_transform, zero_unoptimized
from jaxlight.optim.inspect import TransformInfo, inspect_transform
from jaxlight.optim.params import KnownGroup, ParamGroups, group_labels, partition, select_params
from jaxlight.optim.schedules import (
    SchedulerConfig,
    check_traceable,
    drive_learning_rate,
    hold_plateaus,
    outer_injected_states,
    plateau_states,
    scheduler_config,
)


@dataclasses.dataclass
class OptimizerEntry:
    """One optimizer as ``configure_optimizers`` returned it (before its selector is resolved)."""

    tx: Any  # optax.GradientTransformation or ParamGroups
    params: Any = None  # a selector (see select_params); None: every parameter
    monitor: str | None = None  # a dict's top-level "monitor" (Lightning), for a plateau inside tx


@dataclasses.dataclass
class BuiltOptimizer:
    """One optimizer after :meth:`OptimizerConfig.build`: its transformation and the parameters it updates."""

    index: int
    tx: optax.GradientTransformation  # with its schedulers attached; without clipping/accumulation/held plateaus
    keys: tuple[str, ...]  # parameter paths it updates
    state_of: Callable[[Any], Any]  # full TrainState.opt_state -> this optimizer's state
    masked: bool = False  # its state sits in a partition: its updates span every parameter, masked outside keys
    known: Mapping[str, KnownGroup] = dataclasses.field(default_factory=dict)  # param_groups facts, by label

    def updates_like(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The shapes of the updates ``tx`` sees, from the flat parameter dict (arrays or shapes)."""

        def shape(x: Any) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(jnp.shape(x), x.dtype)

        if self.masked:
            return {k: shape(v) if k in self.keys else optax.MaskedNode() for k, v in params.items()}
        return {k: shape(params[k]) for k in self.keys}


_FORMS = (
    "configure_optimizers must return one of:\n"
    " * an optax.GradientTransformation (or jl.optim.param_groups(...))\n"
    " * [tx, ...]\n"
    " * ([tx, ...], [schedule, ...])\n"
    ' * {"optimizer": tx, "lr_scheduler": schedule | {"scheduler": ..., "interval": ..., "monitor": ...}, '
    '"monitor": ..., "params": selector}\n'
    " * [{...}, {...}] (one dict per optimizer)\n"
    " * None (no optimizer)\n"
    "where a schedule is an optax schedule or optax.contrib.reduce_on_plateau(...)"
)


def _optimizable(x: Any) -> bool:
    return isinstance(x, (optax.GradientTransformation, ParamGroups))


def _entry_dict(d: Mapping[str, Any], index: int, schedulers: list[SchedulerConfig]) -> OptimizerEntry:
    extra = set(d) - {"optimizer", "lr_scheduler", "monitor", "params"}
    if extra:
        raise MisconfigurationError(
            f"configure_optimizers returned a dict with unknown key(s) {sorted(extra)}; supported: "
            f"'optimizer', 'lr_scheduler', 'monitor', 'params'"
        )
    if "optimizer" not in d:
        raise MisconfigurationError(f"configure_optimizers returned a dict without 'optimizer' (keys: {sorted(d)})")
    if not _optimizable(d["optimizer"]):
        raise MisconfigurationError(
            f"the dict's 'optimizer' must be an optax.GradientTransformation or jl.optim.param_groups(...), got "
            f"{type(d['optimizer']).__name__}\n{_FORMS}"
        )
    monitor = d.get("monitor")
    if d.get("lr_scheduler") is not None:
        schedulers.append(scheduler_config(d["lr_scheduler"], index, monitor))
    return OptimizerEntry(d["optimizer"], d.get("params"), monitor)


def _parse(out: Any) -> tuple[list[OptimizerEntry], list[SchedulerConfig]]:
    schedulers: list[SchedulerConfig] = []
    if out is None:
        warnings.warn("configure_optimizers returned None: this fit runs with no optimizer", stacklevel=3)
        return [], []
    if _optimizable(out):
        return [OptimizerEntry(out)], []
    if isinstance(out, Mapping):
        return [_entry_dict(out, 0, schedulers)], schedulers
    if isinstance(out, (list, tuple)):
        if (
            len(out) == 2
            and isinstance(out[0], (list, tuple))
            and out[0]
            and all(_optimizable(o) for o in out[0])
            and not _optimizable(out[1])
        ):
            opts, scheds = list(out[0]), out[1]
            scheds = list(scheds) if isinstance(scheds, (list, tuple)) else [scheds]
            if len(scheds) > len(opts):
                raise MisconfigurationError(
                    f"configure_optimizers returned {len(opts)} optimizer(s) and {len(scheds)} schedulers; the i-th "
                    f"scheduler belongs to the i-th optimizer, so there can be at most one per optimizer (return "
                    f"dicts to give one optimizer several)"
                )
            schedulers = [scheduler_config(s, i, None) for i, s in enumerate(scheds)]
            return [OptimizerEntry(o) for o in opts], schedulers
        if out and all(isinstance(d, Mapping) for d in out):
            return [_entry_dict(d, i, schedulers) for i, d in enumerate(out)], schedulers
        if out and all(_optimizable(o) for o in out):
            return [OptimizerEntry(o) for o in out], []
    hint = ""
    if callable(out) and getattr(out, "__module__", "").startswith("optax"):
        hint = f" (the optimizer function itself: call it, e.g. optax.{out.__name__}(learning_rate))"
    elif type(out).__module__.startswith("torch"):
        hint = " (a torch optimizer: use the optax one, e.g. optax.sgd(0.1, momentum=0.9) for torch.optim.SGD)"
    raise MisconfigurationError(
        f"configure_optimizers must return an optax.GradientTransformation or one of Lightning's forms; got "
        f"{type(out).__name__}{hint}.\n{_FORMS}"
    )


@dataclasses.dataclass
class OptimizerConfig:
    """What ``configure_optimizers`` returned, parsed; after :meth:`build`, the transformations to apply.

    Before ``build``: ``entries`` and ``schedulers``. After: ``automatic``;
    ``optimizers`` (one :class:`BuiltOptimizer` per optimizer returned);
    ``tx``, the transformation whose ``init`` makes ``TrainState.opt_state``
    (automatic: the one update the step applies, with parameter partitions,
    clipping and accumulation; manual: a tuple of each optimizer's state, and
    no ``update``).
    """

    entries: list[OptimizerEntry]
    schedulers: list[SchedulerConfig]
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str = "norm"
    accumulate_grad_batches: int = 1
    automatic: bool = True
    optimizers: list[BuiltOptimizer] = dataclasses.field(default_factory=list)
    tx: optax.GradientTransformation | None = None
    handles: list[Any] = dataclasses.field(default_factory=list)  # ManualOptimizer handles (self.optimizers())
    # fine-tuning (BaseFinetuning): parameters frozen when the optimizer was first built (None: no callback
    # freezes; a tuple, even empty, keeps every optimizer in a partition so that groups can be added), the
    # parameter groups added since, and the parsed config a rebuild starts from
    frozen: tuple[str, ...] | None = None
    groups: list[AddedGroup] = dataclasses.field(default_factory=list)
    parsed: OptimizerConfig | None = dataclasses.field(default=None, repr=False)

    @property
    def schedules(self) -> list[Any]:
        """The schedulers as returned (schedules and plateau transformations), in order."""
        return [c.scheduler for c in self.schedulers if c.scheduler is not None]

    @property
    def host_stepped(self) -> bool:
        """Whether some scheduler is stepped on the host (plateau, epoch interval): the trainer then adds
        :class:`~jaxlight.callbacks.lr_scheduler.LRSchedulerStepper`."""
        return any(c.reduce_on_plateau or c.interval == "epoch" for c in self.schedulers) or any(
            e.monitor is not None for e in self.entries
        )

    @property
    def built(self) -> bool:
        return self.tx is not None

    # -- build -----------------------------------------------------------------------------------
    def build(self, module: Any, params: Mapping[str, Any], frozen: tuple[str, ...] | None = None) -> OptimizerConfig:
        """Resolve the parameter selectors against ``params`` (flat, path-keyed; arrays or shapes) and make
        the transformations; returns a new, built config. Raises :class:`MisconfigurationError` for forms
        the module's optimization mode cannot use, before any work is done.

        ``frozen``: parameter paths no optimizer updates (left out of every selector; they get no state);
        ``self.groups``: parameter groups added by fine-tuning, each updated by a fresh copy of its
        optimizer's transformation (see :mod:`jaxlight.optim.finetune`)."""
        if self.tx is not None:  # rebuilding: start again from what configure_optimizers returned
            assert self.parsed is not None
            return dataclasses.replace(self.parsed, groups=list(self.groups)).build(module, params, frozen)
        automatic = bool(getattr(module, "automatic_optimization", True))
        paths = list(params)
        schedulers = [dataclasses.replace(c) for c in self.schedulers]
        cfg = dataclasses.replace(self, schedulers=schedulers, automatic=automatic, optimizers=[], handles=[])
        cfg.frozen, cfg.parsed = (tuple(frozen) if frozen is not None else None), self
        if frozen is not None and not automatic:
            raise MisconfigurationError(
                "a fine-tuning callback froze parameters, but the module uses manual optimization; BaseFinetuning "
                "works with automatic optimization (select each manual optimizer's parameters with 'params' instead)"
            )
        held_out = set(frozen or ()) | {k for g in self.groups for k in g.keys}
        if not automatic:
            if self.gradient_clip_val:
                raise MisconfigurationError(
                    "Automatic gradient clipping is not supported for manual optimization: remove "
                    f"Trainer(gradient_clip_val={self.gradient_clip_val}) and clip in training_step with "
                    f"grads = self.clip_gradients(opt, grads, gradient_clip_val=...), or use automatic optimization"
                )
            if self.accumulate_grad_batches > 1:
                raise MisconfigurationError(
                    "Automatic gradient accumulation is not supported for manual optimization: remove "
                    f"Trainer(accumulate_grad_batches={self.accumulate_grad_batches}), or use automatic optimization"
                )
        n = len(self.entries)
        if automatic and n > 1 and any(e.params is None for e in self.entries):
            raise MisconfigurationError(
                f"configure_optimizers returned {n} optimizers. Training with multiple optimizers is only supported "
                f"with manual optimization: set `self.automatic_optimization = False` and use `opt1, opt2 = "
                f"self.optimizers()` in training_step; or give each optimizer the parameters it updates "
                f'([{{"optimizer": tx1, "params": self.encoder}}, {{"optimizer": tx2, "params": self.head}}]) to '
                f"apply them together in one update"
            )
        txs: list[optax.GradientTransformation] = []
        keys: list[tuple[str, ...]] = []
        known: list[Mapping[str, KnownGroup]] = []
        for i, entry in enumerate(self.entries):
            sel = select_params(entry.params, paths, module, f"optimizer {i} 'params'")
            if held_out:
                sel = [p for p in sel if p not in held_out]
                if not sel:
                    raise MisconfigurationError(
                        f"optimizer {i} has no parameter left to update: every parameter it selects is frozen "
                        f"(BaseFinetuning.freeze) or in a parameter group added by fine-tuning"
                    )
            groups = entry.tx if isinstance(entry.tx, ParamGroups) else None
            base = groups.resolve(sel, module) if groups is not None else entry.tx
            sub = {k: params[k] for k in sel}
            tx, added = _attach_schedulers(base, [c for c in schedulers if c.optimizer_index == i], entry, i, sub)
            txs.append(tx)
            schedulers.extend(added)
            keys.append(tuple(sel))
            known.append(dict(groups.known) if groups is not None else {})
        if len({c.optimizer_index for c in schedulers} - set(range(n))):
            raise MisconfigurationError("a scheduler belongs to an optimizer that configure_optimizers did not return")

        if automatic:
            labels: dict[str, str] | None = None
            if n == 0:
                base = optax.set_to_zero()
                cfg.optimizers = []
            elif n == 1 and len(keys[0]) == len(paths) and frozen is None:
                base = txs[0]
                cfg.optimizers = [BuiltOptimizer(0, txs[0], keys[0], lambda s: s, known=known[0])]
            else:
                added = [(g.label, list(g.keys)) for g in self.groups]
                labels = group_labels(
                    [(f"opt{i}", list(k)) for i, k in enumerate(keys)] + added, paths, "configure_optimizers"
                )
                group_txs = {g.label: group_transform(self.entries[g.optimizer].tx, g) for g in self.groups}
                base = partition({**{f"opt{i}": t for i, t in enumerate(txs)}, **group_txs}, labels)
                cfg.optimizers = [
                    BuiltOptimizer(
                        i, t, k, lambda s, i=i: s.inner_states[f"opt{i}"].inner_state, masked=True, known=known[i]
                    )
                    for i, (t, k) in enumerate(zip(txs, keys))
                ]
                cfg.groups = [
                    dataclasses.replace(g, state_of=lambda s, label=g.label: s.inner_states[label].inner_state)
                    for g in self.groups
                ]
            tx = hold_plateaus(base) if _has_plateau(base, params) else base
            outer: list[Callable[[Any], Any]] = []
            if self.gradient_clip_val:
                clip = (
                    optax.clip_by_global_norm(self.gradient_clip_val)
                    if self.gradient_clip_algorithm == "norm"
                    else optax.clip(self.gradient_clip_val)
                )
                if frozen is not None and labels is not None:  # Lightning clips the optimizers' parameters only
                    clip = optax.chain(zero_unoptimized(labels), clip)
                tx = optax.chain(clip, tx)
                outer.append(lambda s: s[1])
            if self.accumulate_grad_batches > 1:
                tx = accumulate_gradients(tx, self.accumulate_grad_batches)
                outer.append(lambda s: s.inner_state)
            for opt in [*cfg.optimizers, *cfg.groups]:
                opt.state_of = _compose(list(reversed(outer)), opt.state_of)
            cfg.tx = tx
        else:
            cfg.optimizers = [
                BuiltOptimizer(i, t, k, lambda s, i=i: s[i], known=known[i]) for i, (t, k) in enumerate(zip(txs, keys))
            ]
            cfg.tx = _tuple_of_states(cfg.optimizers)
            from jaxlight.manual import ManualOptimizer  # the handles self.optimizers() returns

            cfg.handles = [
                ManualOptimizer(o.index, hold_plateaus(o.tx) if _has_plateau(o.tx, sub) else o.tx, o.keys)
                for o, sub in ((o, {k: params[k] for k in o.keys}) for o in cfg.optimizers)
            ]
        return cfg

    # -- reading (LearningRateMonitor, the scheduler stepper) -----------------------------------
    def inspect(self, opt_state: Any, params: Mapping[str, Any]) -> list[TransformInfo]:
        """:meth:`inspect_one` of each optimizer."""
        return [self.inspect_one(o, opt_state, params) for o in self.optimizers]

    def inspect_one(self, optimizer: BuiltOptimizer, opt_state: Any, params: Mapping[str, Any]) -> TransformInfo:
        """:func:`~jaxlight.optim.inspect.inspect_transform` of one optimizer on its part of ``opt_state``
        (the whole TrainState's); ``params``: the flat parameter dict (arrays or shapes). Call
        ``.values(optimizer.state_of(opt_state))`` on the result to read the current rates."""
        named = [
            c
            for c in self.schedulers
            if c.optimizer_index == optimizer.index and not c.reduce_on_plateau and c.interval == "step"
        ]
        return inspect_transform(
            optimizer.tx,
            optimizer.state_of(opt_state),
            optimizer.updates_like(params),
            known=optimizer.known,
            schedule=named[0].scheduler if named else None,
            frequency=named[0].frequency if named else 1,
        )


def _compose(getters: list[Callable[[Any], Any]], last: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def get(state: Any) -> Any:
        for g in getters:
            state = g(state)
        return last(state)

    return get


def _tuple_of_states(optimizers: list[BuiltOptimizer]) -> optax.GradientTransformation:
    """Manual optimization's ``TrainState.opt_state``: a tuple with each optimizer's state on its parameters."""

    def init(params: Mapping[str, Any]) -> tuple:
        return tuple(o.tx.init({k: params[k] for k in o.keys}) for o in optimizers)

    def update(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("manual optimization: each optimizer is stepped in training_step with opt.step(grads)")

    return optax.GradientTransformation(init, update)


def _init_shapes(tx: optax.GradientTransformation, params: Mapping[str, Any]) -> Any:
    return jax.eval_shape(tx.init, dict(params))


def _has_plateau(tx: optax.GradientTransformation, params: Mapping[str, Any]) -> bool:
    return bool(plateau_states(_init_shapes(tx, params)))


def _injected_lr(tx: optax.GradientTransformation, params: Mapping[str, Any]) -> bool:
    """Whether ``tx``'s state holds an ``inject_hyperparams`` learning rate (a numeric one, which can be set)."""
    return any("learning_rate" in n.hyperparams for n in outer_injected_states(_init_shapes(tx, params)).values())


def _attach_schedulers(
    tx: optax.GradientTransformation,
    configs: list[SchedulerConfig],
    entry: OptimizerEntry,
    index: int,
    params: Mapping[str, Any],
) -> tuple[optax.GradientTransformation, list[SchedulerConfig]]:
    """``tx`` with its schedulers applied: a plateau chained after it (unless ``tx`` holds one already), a
    schedule driving an injected learning rate. Each plateau config learns which of the optimizer's plateau
    states it steps; plateaus inside ``tx`` that no scheduler names get a config from the dict's top-level
    ``monitor`` (returned).

    Which plateau is which is read from ``tx``'s state, where optax's transformations are not visible: a
    plateau scheduler returned for an optimizer that contains one is taken to be that one (Lightning users
    write ``chain(tx, plateau)`` and name the same ``plateau``); with several on either side the pairing is
    ambiguous and raises."""
    params = dict(params)
    inside = len(plateau_states(_init_shapes(tx, params)))
    named = [c for c in configs if c.reduce_on_plateau]
    added: list[SchedulerConfig] = []
    if inside and named:
        if len(named) > 1 or inside > 1:
            raise MisconfigurationError(
                f"optimizer {index} contains {inside} optax.contrib.reduce_on_plateau and {len(named)} plateau "
                f"scheduler(s) are returned for it: which is which cannot be read from the optimizer state. Put "
                f"each plateau either inside the optimizer (named by one lr_scheduler dict, or by a top-level "
                f'"monitor") or only in "lr_scheduler" (the trainer chains it)'
            )
        named[0].plateau_nodes = (0,)
    elif inside:
        if entry.monitor is None:
            raise MisconfigurationError(
                "the optimizer contains optax.contrib.reduce_on_plateau, which needs a monitored metric: return "
                '{"optimizer": tx, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}} (the plateau may '
                'stay inside tx) or {"optimizer": tx, "monitor": "val_loss"}'
            )
        added = [
            SchedulerConfig(
                scheduler=None,  # it was not returned as a scheduler: lr_schedulers() does not list it
                interval="epoch",
                reduce_on_plateau=True,
                monitor=entry.monitor,
                optimizer_index=index,
                plateau_nodes=tuple(range(inside)),
            )
        ]
    else:
        for j, c in enumerate(named):
            tx = optax.chain(tx, c.scheduler)
            c.plateau_nodes = (j,)
    schedules = [c for c in configs if not c.reduce_on_plateau]
    if len(schedules) > 1:
        raise MisconfigurationError(
            f"optimizer {schedules[0].optimizer_index} has {len(schedules)} lr schedules; combine them into one "
            f"optax schedule (optax.join_schedules) "
        )
    if schedules:
        c = schedules[0]
        check_traceable(c)  # a step schedule is traced in the update: refuse an untraceable one now, by name
        if _injected_lr(tx, params):
            tx = drive_learning_rate(tx, c.scheduler, interval=c.interval, frequency=c.frequency)
        elif c.interval != "step" or c.frequency != 1:
            raise MisconfigurationError(
                f"lr_scheduler with interval={c.interval!r}, frequency={c.frequency} must set the optimizer's "
                f"learning rate, so the optimizer must inject it: optax.inject_hyperparams(optax.adamw)"
                f"(learning_rate=...) (a schedule baked into the optimizer counts optimizer steps)"
            )
    return tx, added


def configure(
    out: Any,
    *,
    gradient_clip_val: float | None = None,
    gradient_clip_algorithm: str = "norm",
    accumulate_grad_batches: int = 1,
) -> OptimizerConfig:
    """Parse ``configure_optimizers``' return value (every form Lightning accepts, for optax).

    Forms: a transformation (or :func:`~jaxlight.optim.param_groups`); a list
    of them; ``([tx, ...], [scheduler, ...])`` (the i-th scheduler belongs to
    the i-th optimizer); ``{"optimizer": tx, "lr_scheduler": ..., "monitor":
    ..., "params": selector}``; a list of such dicts; ``None``. A scheduler is
    an optax schedule, ``optax.contrib.reduce_on_plateau(...)`` or Lightning's
    scheduler dict (see :class:`~jaxlight.optim.SchedulerConfig`). As in
    Lightning, a schedule sets the optimizer's learning rate: when ``tx`` was
    built with ``optax.inject_hyperparams`` every update uses
    ``schedule(optimizer step)``; otherwise ``tx`` must already use the
    schedule as its learning rate and the entry names it for
    ``LearningRateMonitor``. Anything else raises
    :class:`MisconfigurationError` saying what came back and listing the
    forms. Call :meth:`OptimizerConfig.build` to get the transformations.
    """
    entries, schedulers = _parse(out)
    return OptimizerConfig(
        entries,
        schedulers,
        gradient_clip_val=gradient_clip_val,
        gradient_clip_algorithm=gradient_clip_algorithm,
        accumulate_grad_batches=accumulate_grad_batches,
    )


__all__ = ["BuiltOptimizer", "OptimizerConfig", "OptimizerEntry", "configure"]
