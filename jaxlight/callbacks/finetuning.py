"""Fine-tuning callbacks: Lightning's ``BaseFinetuning`` and ``BackboneFinetuning`` over NNX modules and optax.

A jax array has no ``requires_grad``, so "frozen" is kept here, per parameter
variable, and handed to the trainer before the optimizer is built
(:meth:`Callback.frozen_parameters`): frozen parameters are left out of every
optimizer, so they get no update and no optimizer state. Unfreezing a module
into a new parameter group (:meth:`BaseFinetuning.unfreeze_and_add_param_group`)
rebuilds the optimizer with one more group whose state starts fresh, at the
group's learning rate, as torch's ``add_param_group`` does; the other groups
keep their moments and step counts. The train step is compiled again once,
at the next batch (``trainer.compile_counts["train"]`` counts it).

BatchNorm follows torch: ``freeze(modules, train_bn=False)`` sets
``track_running_stats = False`` on each ``nnx.BatchNorm``, so the compiled step
normalises with the batch's statistics and leaves the running ones as they
are; ``make_trainable`` sets it back to True.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import optax
from flax import nnx

from jaxlight.callbacks.callback import Callback
from jaxlight.callbacks.lr_scheduler import LRSchedulerStepper
from jaxlight.errors import CheckpointError, MisconfigurationError
from jaxlight.optim.finetune import AddedGroup, carry_state, check_settable, scaled_alias, set_learning_rates
from jaxlight.optim.params import ParamGroups
from jaxlight.optim.schedules import driven_states
from jaxlight.rank_zero import rank_zero_info, rank_zero_warn
from jaxlight.state import nnx_attributes, path_str

if TYPE_CHECKING:  # pragma: no cover
    from jaxlight.module import LightningModule
    from jaxlight.trainer import Trainer

Modules = Any  # an nnx.Module, or an iterable (list, tuple, dict values) of modules and iterables


def multiplicative(epoch: int) -> float:
    """BackboneFinetuning's default ``lambda_func``: double the backbone's learning rate every epoch."""
    return 2.0


# ------------------------------------------------------------------------------------------ modules
def _modules_under(root: nnx.Module) -> list[tuple[tuple, nnx.Module]]:
    return [(p, n) for p, n in nnx.iter_graph(root) if isinstance(n, nnx.Module)]


def _own_params(module: nnx.Module) -> list[nnx.Param]:
    """The parameters a module holds itself, not through a submodule (torch's ``parameters(recurse=False)``)."""
    nodes = list(nnx.iter_graph(module))
    inner = [p for p, n in nodes if isinstance(n, nnx.Module) and p]
    return [
        n for p, n in nodes if isinstance(n, nnx.Param) and not any(p[: len(q)] == q for q in inner if len(q) < len(p))
    ]


class _ParamGroup(dict):
    """torch's ``param_group`` dict: ``"params"`` (the parameter paths) and ``"lr"``; setting ``"lr"`` sets
    the group's learning rate in the optimizer state (at the end of the hook)."""

    def __init__(self, owner: FinetuneOptimizer, index: int, params: tuple[str, ...], lr: float | None) -> None:
        super().__init__(params=params, lr=lr)
        self._owner, self._index = owner, index

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "lr":
            self._owner._set_lr(self._index, float(value))
            value = float(value)
        super().__setitem__(key, value)


class FinetuneOptimizer:
    """What ``finetune_function`` receives as ``optimizer``: one optimizer of ``configure_optimizers``, with
    torch's ``param_groups`` (group 0: the parameters it was built with; then the groups added since) and
    ``add_param_group``. ``optimizer`` is the optax transformation. Changes take effect when the hook
    returns (one rebuild for every group added in that hook)."""

    def __init__(self, trainer: Any, index: int, cache: dict | None = None) -> None:
        self._trainer = trainer
        self.index = index
        self._cache = {} if cache is None else cache
        self._new: list[AddedGroup] = []
        self._lr0: float | None = None
        self._lr0_set = False
        self.changed = False

    @property
    def _config(self) -> Any:
        return self._trainer.engine.optimizer

    @property
    def optimizer(self) -> Any:
        return self._config.optimizers[self.index].tx

    def _groups(self) -> list[AddedGroup]:
        return [g for g in self._config.groups if g.optimizer == self.index] + self._new

    def base_lr(self) -> float:
        """The learning rate of group 0 (the one the optimizer's next update uses)."""
        if self._lr0 is None:
            self._lr0 = read_learning_rate(self._trainer, self.index, self._cache)
        return self._lr0

    @property
    def param_groups(self) -> list[_ParamGroup]:
        opt = self._config.optimizers[self.index]
        try:
            lr0 = self.base_lr()
        except MisconfigurationError:
            lr0 = None  # a rate baked into the transformation: torch's "lr" cannot be read
        out = [_ParamGroup(self, 0, tuple(opt.keys), lr0)]
        return out + [_ParamGroup(self, i + 1, g.keys, g.lr) for i, g in enumerate(self._groups())]

    def _set_lr(self, index: int, lr: float) -> None:
        if index == 0:
            self._lr0, self._lr0_set = lr, True
        else:
            group = self._groups()[index - 1]
            if group.lr_scale is not None:
                raise MisconfigurationError(
                    f"parameter group {group.label!r} runs at {group.lr_scale:g} times optimizer {self.index}'s "
                    f"learning rate, which lives in optax's closure (a plain optax alias): its rate cannot be set "
                    f"to {lr:g}. Build the optimizer with an injected rate, "
                    f"optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), to change a group's rate"
                )
            group.lr = lr
        self.changed = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group({"params": [...], "lr": ...})``: ``params`` are parameter paths (as
        ``trainer.train_state.params`` names them); ``lr`` defaults to group 0's.

        An optimizer without an injected rate (a plain optax alias, ``optax.adam(1e-3)``) takes the group at
        ``"lr_scale"`` times its own rate (default 1), its update the alias's scaled by that (exact for the
        aliases :func:`~jaxlight.optim.finetune.scaled_alias` accepts); an absolute ``"lr"`` needs the
        optimizer's rate, so it needs the injected form."""
        keys = tuple(param_group["params"])
        if not keys:
            return
        params = self._trainer.train_state.params
        sub = {k: params[k] for k in keys}
        n = len(self._groups()) + 2  # torch counts groups from 1, and group 1 is the optimizer's own
        label = f"opt{self.index}_pg{n}"
        entry = self.optimizer_entry
        if isinstance(entry, optax.GradientTransformation) and not isinstance(entry, ParamGroups):
            injected = bool(driven_states(jax.eval_shape(entry.init, sub)))
        else:
            injected = True  # param_groups(...): check_settable says why it cannot take a group
        if injected:
            lr = float(param_group["lr"]) if param_group.get("lr") is not None else self.base_lr()
            check_settable(entry, sub, "add_param_group")
            self._new.append(AddedGroup(self.index, label, keys, lr))
        else:
            alias = scaled_alias(entry, sub, f"add_param_group (optimizer {self.index})")
            if any(c.optimizer_index == self.index for c in self._config.schedulers):
                raise MisconfigurationError(
                    f"add_param_group: optimizer {self.index} ({alias}) has an lr_scheduler, whose rate an added "
                    f"group must follow, and the rate lives in optax's closure: build it with "
                    f"optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)"
                )
            if param_group.get("lr") is not None:
                raise MisconfigurationError(
                    f"add_param_group(lr={param_group['lr']}): optimizer {self.index} is {alias} with its learning "
                    f"rate in optax's closure, so an absolute rate cannot be turned into a multiple of it. Leave "
                    f'lr out (unfreeze_and_add_param_group then uses initial_denom_lr; add_param_group "lr_scale"), '
                    f"or build it with optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)"
                )
            scale = float(param_group.get("lr_scale", 1.0))
            self._new.append(AddedGroup(self.index, label, keys, None, lr_scale=scale))
        self.changed = True

    @property
    def optimizer_entry(self) -> Any:
        """The transformation ``configure_optimizers`` returned for this optimizer (before schedulers)."""
        return self._config.parsed.entries[self.index].tx


def read_learning_rate(trainer: Any, index: int, cache: dict | None = None) -> float:
    """Optimizer ``index``'s current learning rate (torch's ``param_groups[0]["lr"]``), read from its state.
    ``cache`` keeps the reader (a small jitted function) per optimizer between calls."""
    cfg, st = trainer.engine.optimizer, trainer.train_state
    opt = cfg.optimizers[index]
    cache = {} if cache is None else cache
    if index not in cache or cache[index][0] is not opt:
        cache[index] = (opt, cfg.inspect_one(opt, st.opt_state, st.params))
    info = cache[index][1]
    groups = info.optimized_groups
    if not groups or not groups[0].readable:
        raise MisconfigurationError(
            f"optimizer {index}'s learning rate is not in its optax state (a rate baked into optax.adam(1e-3) "
            f"lives in a closure): build it with optax.inject_hyperparams(optax.adam)(learning_rate=1e-3) "
            f"(BaseFinetuning.unfreeze_and_add_param_group without lr= takes the plain optimizer: the group runs at "
            f"its rate / initial_denom_lr)"
        )
    return float(jax.device_get(info.values(opt.state_of(st.opt_state))[0]["lr"]))


# ------------------------------------------------------------------------------------------ the callbacks
class BaseFinetuning(Callback):
    """Freeze modules before training and unfreeze them into new parameter groups later (Lightning's API).

    Override :meth:`freeze_before_training` (called once the module's NNX models exist, before the
    optimizer is built) and :meth:`finetune_function` (called at every train epoch start with each
    optimizer, a :class:`FinetuneOptimizer`). ``modules`` arguments are NNX modules of the
    LightningModule or iterables of them (``self.net.layers[-2:]`` for torch's ``net[-2:]``).

    As in torch: frozen parameters get no update and no optimizer state; a group added with
    :meth:`unfreeze_and_add_param_group` starts with fresh optimizer state at its learning rate (group 0's
    divided by ``initial_denom_lr`` unless ``lr`` is given), so its first Adam step moves each weight by
    that rate. An optimizer with an epoch-interval or plateau scheduler scales its added groups' rates by
    the factor its own rate changed by at each epoch start (torch's ``StepLR``/``MultiStepLR``/
    ``ReduceLROnPlateau`` scale every group). Adding groups recompiles the train step once.
    """

    def __init__(self) -> None:
        self._internal_optimizer_metadata: dict[int, list[dict[str, Any]]] = {}
        self._restarting = False
        self._frozen: dict[int, nnx.Variable] = {}  # id(param variable) -> the variable, requires_grad=False
        self._froze = False
        self._optimizer_built = False
        self._last_lr: dict[int, float] = {}
        self._infos: dict[int, tuple[Any, Any]] = {}  # optimizer index -> (its BuiltOptimizer, TransformInfo)
        self._module: Any = None  # the LightningModule of the current fit (its BatchNorm flags are saved)

    # -- Lightning's state ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        # Lightning's key, plus what a resume after an unfreeze needs to continue exactly: the rate each
        # optimizer had at the last epoch start (the schedulers' factor is measured against it) and the
        # BatchNorm layers whose statistics are held (torch keeps track_running_stats in the module itself)
        return {
            "internal_optimizer_metadata": self._internal_optimizer_metadata,
            "last_lr": {str(k): v for k, v in self._last_lr.items()},
            "held_batchnorms": self._held_batchnorms(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restarting = True
        self._internal_optimizer_metadata = {
            int(k): v for k, v in state_dict.get("internal_optimizer_metadata", {}).items()
        }
        self._last_lr = {int(k): float(v) for k, v in state_dict.get("last_lr", {}).items()}

    def check_state_dict(self, state_dict: Any) -> None:
        if not isinstance(state_dict, dict):
            raise TypeError(f"expected a dict, got {type(state_dict).__name__}")
        meta = state_dict.get("internal_optimizer_metadata", {})
        if not isinstance(meta, dict):
            raise TypeError(f"internal_optimizer_metadata: expected a dict, got {type(meta).__name__}")
        for k, groups in meta.items():
            int(k)
            if not isinstance(groups, list):
                raise TypeError(f"internal_optimizer_metadata[{k!r}]: expected a list of param groups")
            for i, g in enumerate(groups):
                params = g.get("params") if isinstance(g, dict) else None
                if not (isinstance(params, list) and all(isinstance(x, str) for x in params)):
                    raise TypeError(f"internal_optimizer_metadata[{k!r}][{i}]['params']: expected parameter paths")
                if g.get("lr") is not None and not isinstance(g["lr"], (int, float)):
                    raise TypeError(f"internal_optimizer_metadata[{k!r}][{i}]['lr']: expected a number")
                if g.get("lr_scale") is not None and not isinstance(g["lr_scale"], (int, float)):
                    raise TypeError(f"internal_optimizer_metadata[{k!r}][{i}]['lr_scale']: expected a number")
        for k, v in state_dict.get("last_lr", {}).items():
            int(k), float(v)
        held = state_dict.get("held_batchnorms", [])
        if not (isinstance(held, list) and all(isinstance(x, str) for x in held)):
            raise TypeError("held_batchnorms: expected a list of module paths")

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning re-adds the saved param groups here; jaxlight has done it already, in prepare_resume,
        # before the checkpoint's optimizer state was read into them
        self._restarting = False

    def prepare_resume(self, trainer: Trainer, pl_module: LightningModule, state_dict: dict[str, Any]) -> None:
        """A resume after an unfreeze: the groups added since the optimizer was built are added again (same
        labels, parameters and rates), their parameters unfrozen and the BatchNorm layers' statistics held
        as they were saved, so the checkpoint's optimizer state, moments of the added groups included,
        restores into the same optimizer and training continues exactly."""
        cfg = trainer.engine.optimizer
        meta = {int(k): v for k, v in state_dict.get("internal_optimizer_metadata", {}).items()}
        if cfg is None or not meta:
            return
        by_path = {v: k for k, v in self._paths(pl_module).items()}
        new: list[AddedGroup] = []
        for index, groups in sorted(meta.items()):
            if index >= len(cfg.optimizers):
                raise CheckpointError(
                    f"{type(self).__name__}'s saved state has parameter groups for optimizer {index}, but "
                    f"configure_optimizers returns {len(cfg.optimizers)} optimizer(s)"
                )
            have = sum(g.optimizer == index for g in cfg.groups)
            for n, g in enumerate(groups[1 + have :], start=have + 2):  # group 1 is the optimizer's own
                missing = [k for k in g["params"] if k not in by_path]
                if missing:
                    raise CheckpointError(
                        f"{type(self).__name__}'s saved parameter group opt{index}_pg{n} names parameters this "
                        f"module does not have: {missing[:5]}"
                    )
                for k in g["params"]:
                    self._frozen.pop(by_path[k], None)
                scale = g.get("lr_scale")
                if scale is not None:  # a plain optax alias's group: its multiple is part of its transformation
                    new.append(AddedGroup(index, f"opt{index}_pg{n}", tuple(g["params"]), None, float(scale)))
                    continue
                lr = g["lr"] if g.get("lr") is not None else 0.0  # the real rate comes with the optimizer state
                new.append(AddedGroup(index, f"opt{index}_pg{n}", tuple(g["params"]), float(lr)))
        held = set(state_dict.get("held_batchnorms", []))
        for p, node in nnx.iter_graph(nnx_attributes(pl_module)):
            if isinstance(node, nnx.BatchNorm):
                node.track_running_stats = path_str(p) not in held
        if new:
            self._rebuild(trainer, new, [])
        trainer.engine.refresh_train_modes()

    def _held_batchnorms(self) -> list[str]:
        module = self._module
        if module is None:
            return []
        return sorted(
            path_str(p)
            for p, n in nnx.iter_graph(nnx_attributes(module))
            if isinstance(n, nnx.BatchNorm) and n.track_running_stats is False
        )

    # -- modules and parameters ---------------------------------------------------------------
    @staticmethod
    def flatten_modules(modules: Modules) -> list[nnx.Module]:
        """The leaf modules of ``modules`` (no submodules) and the modules that hold parameters themselves."""
        if isinstance(modules, dict):
            modules = list(modules.values())
        if isinstance(modules, nnx.Module):
            found = _modules_under(modules)
        elif isinstance(modules, Iterable) and not isinstance(modules, (str, bytes)):
            out: list[nnx.Module] = []
            for m in modules:
                if isinstance(m, (nnx.Module, dict)) or (isinstance(m, Iterable) and not isinstance(m, str)):
                    out.extend(BaseFinetuning.flatten_modules(m))
            return list({id(m): m for m in out}.values())
        else:
            return []  # a function in an nnx.Sequential (nnx.relu) holds nothing
        paths = [p for p, _ in found]
        leaf = {p: not any(q[: len(p)] == p and len(q) > len(p) for q in paths) for p in paths}
        return [m for p, m in found if leaf[p] or _own_params(m)]

    def filter_params(self, modules: Modules, train_bn: bool = True, requires_grad: bool = True) -> Iterator[nnx.Param]:
        """The parameters of ``modules`` whose ``requires_grad`` is ``requires_grad`` (BatchNorm's left out
        unless ``train_bn``)."""
        for mod in self.flatten_modules(modules):
            if isinstance(mod, nnx.BatchNorm) and not train_bn:
                continue
            for p in _own_params(mod):
                if (id(p) not in self._frozen) == requires_grad:
                    yield p

    def make_trainable(self, modules: Modules) -> None:
        """Unfreeze the parameters of ``modules`` (BatchNorm tracks its running statistics again). They are
        updated once they are in a parameter group (:meth:`unfreeze_and_add_param_group`)."""
        for mod in self.flatten_modules(modules):
            if isinstance(mod, nnx.BatchNorm):
                mod.track_running_stats = True
            for p in _own_params(mod):
                self._frozen.pop(id(p), None)

    def freeze_module(self, module: nnx.Module) -> None:
        """Freeze the parameters ``module`` holds itself (a BatchNorm also stops tracking running statistics)."""
        if isinstance(module, nnx.BatchNorm):
            module.track_running_stats = False
        for p in _own_params(module):
            self._frozen[id(p)] = p

    def freeze(self, modules: Modules, train_bn: bool = True) -> None:
        """Freeze ``modules``; with ``train_bn`` their BatchNorm layers stay trainable (as in Lightning)."""
        if self._optimizer_built:
            rank_zero_warn(
                "BaseFinetuning.freeze after the optimizer was built does not remove parameters from it: "
                "freeze in freeze_before_training"
            )
        for mod in self.flatten_modules(modules):
            if isinstance(mod, nnx.BatchNorm) and train_bn:
                self.make_trainable(mod)
            else:
                self.freeze_module(mod)

    @staticmethod
    def filter_on_optimizer(optimizer: FinetuneOptimizer, params: Iterable[str]) -> list[str]:
        """The parameter paths of ``params`` that no group of ``optimizer`` updates yet (the others are
        skipped with Lightning's warning)."""
        taken = {k for g in optimizer.param_groups for k in g["params"]}
        params = list(params)
        out = [p for p in params if p not in taken]
        if len(out) < len(params):
            rank_zero_warn(
                "The provided params to be frozen already exist within another group of this optimizer. Those "
                "parameters will be skipped.\nHINT: freeze them in freeze_before_training so configure_optimizers' "
                "optimizer does not take them"
            )
        return out

    def unfreeze_and_add_param_group(
        self,
        modules: Modules,
        optimizer: FinetuneOptimizer,
        lr: float | None = None,
        initial_denom_lr: float = 10.0,
        train_bn: bool = True,
    ) -> None:
        """Unfreeze ``modules`` and add their parameters to ``optimizer`` as a new group, at ``lr`` (default:
        group 0's rate divided by ``initial_denom_lr``), its optimizer state fresh."""
        self.make_trainable(modules)
        params_lr = optimizer.param_groups[0]["lr"] if lr is None else float(lr)
        denom_lr = initial_denom_lr if lr is None else 1.0
        paths = self._paths(optimizer._trainer.lightning_module)
        found = [paths[id(p)] for p in self.filter_params(modules, train_bn=train_bn, requires_grad=True)]
        found = self.filter_on_optimizer(optimizer, found)
        if not found:
            return
        if params_lr is None:  # a plain optax alias: the rate is unknown, its multiple is not
            optimizer.add_param_group({"params": found, "lr_scale": 1.0 / denom_lr})
        else:
            optimizer.add_param_group({"params": found, "lr": params_lr / denom_lr})

    @staticmethod
    def _paths(pl_module: Any) -> dict[int, str]:
        """``id(variable) -> its path in trainer.train_state.params`` for the module's NNX models."""
        return {id(n): path_str(p) for p, n in nnx.iter_graph(nnx_attributes(pl_module)) if isinstance(n, nnx.Variable)}

    # -- the hooks -----------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._module = pl_module
        self._froze = False
        self._optimizer_built = False
        self._last_lr = {}
        if stage == "fit" and nnx_attributes(pl_module):  # built in __init__: Lightning's moment
            self._frozen = {}
            self.freeze_before_training(pl_module)
            self._froze = True

    def frozen_parameters(self, trainer: Trainer, pl_module: LightningModule) -> list[str]:
        if not self._froze:  # the models came from configure_model: freeze them now, before the optimizer
            self._frozen = {}
            self.freeze_before_training(pl_module)
            self._froze = True
        if getattr(pl_module, "automatic_optimization", True) is False:
            raise MisconfigurationError(
                f"{type(self).__name__} works with automatic optimization; {type(pl_module).__name__} sets "
                f"automatic_optimization = False"
            )
        self._optimizer_built = True
        paths = self._paths(pl_module)
        return sorted(paths[k] for k in self._frozen if k in paths)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        cfg = trainer.engine.optimizer
        if cfg is None or not cfg.optimizers:
            return
        handles = [FinetuneOptimizer(trainer, i, self._infos) for i in range(len(cfg.optimizers))]
        self._follow_schedulers(trainer, handles)
        for i, opt in enumerate(handles):
            self.finetune_function(pl_module, trainer.current_epoch, opt)
            self._store(i, opt)
        self._apply(trainer, handles)

    def _follow_schedulers(self, trainer: Any, handles: list[FinetuneOptimizer]) -> None:
        """torch's epoch schedulers (StepLR, MultiStepLR, ReduceLROnPlateau) scale every param group: scale the
        added groups by the factor their optimizer's own rate changed by since the last epoch start."""
        cfg = trainer.engine.optimizer
        for opt in handles:
            follows = any(
                c.optimizer_index == opt.index and (c.interval == "epoch" or c.reduce_on_plateau)
                for c in cfg.schedulers
            )
            groups = opt._groups()
            if not (follows and groups):
                continue
            now, before = opt.base_lr(), self._last_lr.get(opt.index)
            if before and now != before:
                for g in groups:
                    g.lr *= now / before
                opt.changed = True
        for opt in handles:
            try:
                self._last_lr[opt.index] = opt.base_lr()
            except MisconfigurationError:
                pass

    def _store(self, index: int, opt: FinetuneOptimizer) -> None:
        # every epoch, not only when the group count changes (Lightning): the rates stored are those a
        # resume re-adds the groups with (the optimizer state then brings the exact values); a group of a
        # plain optax alias keeps its multiple of the optimizer's rate (part of its transformation)
        scales = [None, *(g.lr_scale for g in opt._groups())]
        self._internal_optimizer_metadata[index] = [
            {"params": list(g["params"]), "lr": g["lr"], **({"lr_scale": s} if s is not None else {})}
            for g, s in zip(opt.param_groups, scales)
        ]

    def _apply(self, trainer: Any, handles: list[FinetuneOptimizer]) -> None:
        """One optimizer rebuild for every group added in this hook; learning rates written into the state."""
        engine = trainer.engine
        cfg = engine.optimizer
        new = [g for opt in handles for g in opt._new]
        base = [(cfg.optimizers[o.index].state_of, o._lr0) for o in handles if o._lr0_set]
        if new:
            self._rebuild(trainer, new, [o for o in handles if o._lr0_set])
            added = sum(len(g.keys) for g in new)
            rank_zero_info(
                f"jaxlight: {type(self).__name__} added {len(new)} parameter group(s) ({added} parameters) at epoch "
                f"{trainer.current_epoch}; the train step is compiled again"
            )
        elif any(o.changed for o in handles):
            targets = [(g.state_of, g.lr) for g in cfg.groups] + base
            st = engine.train_state
            engine.train_state = st._replace(opt_state=set_learning_rates(st.opt_state, targets))

    @staticmethod
    def _rebuild(trainer: Any, new: list[AddedGroup], lr0_set: list[FinetuneOptimizer]) -> None:
        """Rebuild the optimizer with the groups ``new`` added (their state fresh, the others' carried) and
        group 0's rate of each optimizer in ``lr0_set`` written."""
        engine = trainer.engine
        cfg = engine.optimizer
        module = trainer.lightning_module
        grown = dataclasses.replace(cfg, groups=[*cfg.groups, *new])
        rebuilt = grown.build(module, trainer.train_state.params, frozen=cfg.frozen)
        targets = [(g.state_of, g.lr) for g in rebuilt.groups]
        engine.replace_optimizer(rebuilt, lambda old, fresh: set_learning_rates(carry_state(old, fresh), targets))
        base = [(rebuilt.optimizers[o.index].state_of, o._lr0) for o in lr0_set]
        if base:
            st = engine.train_state
            engine.train_state = st._replace(opt_state=set_learning_rates(st.opt_state, base))
        for cb in trainer.callbacks:  # its targets are positions in the optimizer state, which changed
            if isinstance(cb, LRSchedulerStepper):
                cb.on_train_start(trainer, module)

    # -- to override -----------------------------------------------------------------------------
    def finetune_function(self, pl_module: LightningModule, epoch: int, optimizer: FinetuneOptimizer) -> None:
        """Override to add your unfreeze logic (called at every train epoch start, for each optimizer)."""
        raise NotImplementedError

    def freeze_before_training(self, pl_module: LightningModule) -> None:
        """Override to add your freeze logic (called once the module's NNX models exist)."""
        raise NotImplementedError


class BackboneFinetuning(BaseFinetuning):
    """Lightning's ``BackboneFinetuning``: ``pl_module.backbone`` is frozen, unfrozen at
    ``unfreeze_backbone_at_epoch`` into a group at ``backbone_initial_lr`` (default: the current rate times
    ``backbone_initial_ratio_lr``), whose rate then grows by ``lambda_func(epoch + 1)`` every epoch,
    up to the optimizer's own rate when ``should_align``."""

    def __init__(
        self,
        unfreeze_backbone_at_epoch: int = 10,
        lambda_func: Callable[[int], float] = multiplicative,
        backbone_initial_ratio_lr: float = 10e-2,
        backbone_initial_lr: float | None = None,
        should_align: bool = True,
        initial_denom_lr: float = 10.0,
        train_bn: bool = True,
        verbose: bool = False,
        rounding: int = 12,
    ) -> None:
        super().__init__()
        self.unfreeze_backbone_at_epoch = unfreeze_backbone_at_epoch
        self.lambda_func = lambda_func
        self.backbone_initial_ratio_lr = backbone_initial_ratio_lr
        self.backbone_initial_lr = backbone_initial_lr
        self.should_align = should_align
        self.initial_denom_lr = initial_denom_lr
        self.train_bn = train_bn
        self.verbose = verbose
        self.rounding = rounding
        self.previous_backbone_lr: float | None = None

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "previous_backbone_lr": self.previous_backbone_lr}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.previous_backbone_lr = state_dict.get("previous_backbone_lr")
        super().load_state_dict(state_dict)

    def _check_backbone(self, pl_module: Any) -> None:
        if not isinstance(getattr(pl_module, "backbone", None), nnx.Module):
            raise MisconfigurationError("The LightningModule should have a nnx.Module `backbone` attribute")

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._check_backbone(pl_module)
        super().on_fit_start(trainer, pl_module)

    def freeze_before_training(self, pl_module: LightningModule) -> None:
        self._check_backbone(pl_module)
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module: LightningModule, epoch: int, optimizer: FinetuneOptimizer) -> None:
        if epoch == self.unfreeze_backbone_at_epoch:
            current_lr = optimizer.param_groups[0]["lr"]
            if current_lr is None:  # BackboneFinetuning computes rates from the optimizer's: it must be readable
                optimizer.base_lr()  # raises, naming the fix
            initial_backbone_lr = (
                self.backbone_initial_lr
                if self.backbone_initial_lr is not None
                else current_lr * self.backbone_initial_ratio_lr
            )
            self.previous_backbone_lr = initial_backbone_lr
            self.unfreeze_and_add_param_group(
                pl_module.backbone,
                optimizer,
                initial_backbone_lr,
                train_bn=self.train_bn,
                initial_denom_lr=self.initial_denom_lr,
            )
            if self.verbose:
                rank_zero_info(
                    f"Current lr: {round(current_lr, self.rounding)}, "
                    f"Backbone lr: {round(initial_backbone_lr, self.rounding)}"
                )
        elif epoch > self.unfreeze_backbone_at_epoch:
            current_lr = optimizer.param_groups[0]["lr"]
            assert self.previous_backbone_lr is not None
            next_lr = self.lambda_func(epoch + 1) * self.previous_backbone_lr
            next_lr = current_lr if (self.should_align and next_lr > current_lr) else next_lr
            optimizer.param_groups[-1]["lr"] = next_lr
            self.previous_backbone_lr = next_lr
            if self.verbose:
                rank_zero_info(
                    f"Current lr: {round(current_lr, self.rounding)}, Backbone lr: {round(next_lr, self.rounding)}"
                )


__all__ = ["BackboneFinetuning", "BaseFinetuning", "FinetuneOptimizer", "multiplicative"]
