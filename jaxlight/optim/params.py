"""Which parameters an optimizer (or a parameter group) updates: selectors, labels, torch-style groups.

A *selector* names parameters by path (``"net/l1/kernel"``), prefix, glob,
NNX module or variable of the LightningModule, callable or a list of these
(:func:`select_params`). :func:`param_groups` is torch's parameter groups
over one optax optimizer function; :func:`partition` turns labelled groups
into one ``optax.partition`` where parameters no group selects get no
update.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from jaxlight.errors import MisconfigurationError

FROZEN = "_jaxlight_not_optimized"
"""Partition label of parameters no optimizer (or parameter group) selected: they get a zero update."""


@dataclasses.dataclass(frozen=True)
class KnownGroup:
    """What jaxlight knows of a parameter group because it built the group's transformation itself.

    optax keeps an optimizer's fixed hyperparameters out of its state, so
    :mod:`jaxlight.optim.inspect` cannot read them there; for
    :func:`param_groups` jaxlight called the optax function and remembers
    with what (``hparams``: every numeric argument, the function's defaults
    included).
    """

    named: bool  # the label is a name the user gave (torch's param_group["name"])
    factory: str  # the optax function's name ("sgd", "adamw", ...)
    hparams: Mapping[str, float]


def _describe(selector: Any) -> str:
    if isinstance(selector, str):
        return repr(selector)
    if isinstance(selector, (nnx.Module, nnx.Variable)):
        return f"<{type(selector).__name__} object>"
    return getattr(selector, "__name__", type(selector).__name__)


def _graph_path(module: Any, obj: Any) -> str | None:
    """The "/"-joined path of an NNX module or variable inside ``module``'s NNX attributes."""
    from jaxlight.state import nnx_attributes

    for name, root in nnx_attributes(module).items():
        if root is obj:
            return name
        for path, node in nnx.iter_graph(root):
            if node is obj:
                return "/".join([name, *(str(p) for p in path)])
    return None


def select_params(selector: Any, paths: Sequence[str], module: Any = None, what: str = "params") -> list[str]:
    """The parameter paths ``selector`` picks, in ``paths`` order.

    A selector is ``None`` (every parameter), a path (``"net/l1/kernel"``), a
    path prefix ending at a ``/`` boundary (``"net/encoder"``), a glob
    (``"net/*/bias"``), an NNX module or variable held by ``module``
    (``self.net.encoder``, as torch's ``self.net.encoder.parameters()``), a
    callable ``path -> bool``, or a list of these (their union). A selector
    matching nothing raises, naming the parameter paths' prefixes.
    """
    if selector is None:
        return list(paths)
    if isinstance(selector, (list, tuple, set, frozenset)):
        picked = set()
        for s in selector:
            picked.update(select_params(s, paths, module, what))
        return [p for p in paths if p in picked]
    if isinstance(selector, str):
        if any(c in selector for c in "*?["):
            hit = [p for p in paths if fnmatch.fnmatchcase(p, selector)]
        else:
            prefix = selector.rstrip("/")
            hit = [p for p in paths if p == prefix or p.startswith(prefix + "/")]
    elif isinstance(selector, (nnx.Module, nnx.Variable)):
        found = _graph_path(module, selector) if module is not None else None
        if found is None:
            raise MisconfigurationError(
                f"{what}: the {type(selector).__name__} given is not part of the module's NNX attributes "
                f"(select parameters with an attribute of the module, e.g. self.net.encoder, or a path string)"
            )
        hit = [p for p in paths if p == found or p.startswith(found + "/")]
    elif callable(selector):
        hit = [p for p in paths if selector(p)]
    else:
        raise MisconfigurationError(
            f"{what} must be a path, a prefix, a glob, an NNX module/variable of the module, a callable "
            f"path -> bool or a list of these; got {type(selector).__name__}"
        )
    if not hit:
        tops = sorted({"/".join(p.split("/")[:2]) for p in paths})
        raise MisconfigurationError(
            f"{what} selector {_describe(selector)} matches no parameter; parameter paths start with {tops}"
        )
    return hit


def group_labels(groups: Sequence[tuple[str, list[str]]], paths: Sequence[str], what: str) -> dict[str, str]:
    """``{path: group label}``; overlapping groups raise (as torch refuses a parameter in two groups)."""
    owner: dict[str, str] = {}
    for label, keys in groups:
        for k in keys:
            if k in owner:
                raise MisconfigurationError(
                    f"{what}: parameter {k!r} is selected by both {owner[k]!r} and {label!r}; each parameter may "
                    f"belong to one optimizer or parameter group"
                )
            owner[k] = label
    return {p: owner.get(p, FROZEN) for p in paths}


def partition(
    transforms: Mapping[str, optax.GradientTransformation], labels: Mapping[str, str]
) -> optax.GradientTransformationExtraArgs:
    """One ``optax.partition`` applying ``transforms[labels[path]]`` to each parameter; :data:`FROZEN` ones
    get zero updates. Labels no parameter carries are dropped."""
    used = set(labels.values())
    transforms = {k: v for k, v in transforms.items() if k in used}
    if FROZEN in used:
        transforms[FROZEN] = optax.set_to_zero()
    return optax.partition(transforms, lambda tree: {k: labels[k] for k in tree})


def _numeric(value: Any) -> bool:
    numeric = isinstance(value, (int, float, np.ndarray, np.generic, jax.Array)) and not isinstance(value, bool)
    return numeric and np.ndim(value) == 0


class ParamGroups:
    """torch-style parameter groups: one optimizer family, per-group hyperparameters.

    Built by :func:`param_groups`; return it from ``configure_optimizers``
    (alone, as a dict's ``"optimizer"``, or in a list). Each group's
    transformation is ``optax.inject_hyperparams(factory)`` with its
    ``learning_rate`` injected (so schedulers and ``LearningRateMonitor``
    reach it) and every other argument static; parameters no group selects
    get no update, as parameters left out of a torch optimizer.
    """

    def __init__(
        self, factory: Callable[..., optax.GradientTransformation], groups: Sequence[Mapping[str, Any]], **defaults: Any
    ) -> None:
        if not callable(factory) or isinstance(factory, optax.GradientTransformation):
            raise MisconfigurationError(
                "param_groups(factory, groups, **defaults) takes an optax optimizer *function* (optax.sgd, "
                f"optax.adamw, ...), as torch takes the optimizer class; got {type(factory).__name__}"
            )
        if isinstance(groups, Mapping) or not groups:
            raise MisconfigurationError(
                "param_groups needs a non-empty list of group dicts, e.g. [{'params': self.net.encoder}, "
                "{'params': self.net.head, 'learning_rate': 1e-3}]"
            )
        accepted = inspect.signature(factory).parameters
        self.factory = factory
        self.groups: list[tuple[str, bool, Any, optax.GradientTransformation]] = []
        self.known: dict[str, KnownGroup] = {}
        names = [g.get("name") for g in groups if isinstance(g, Mapping)]
        dup = {n for n in names if n is not None and names.count(n) > 1}
        if dup:
            raise MisconfigurationError(f"param_groups: several groups are named {sorted(dup)}; names must be unique")
        for i, g in enumerate(groups):
            if not isinstance(g, Mapping) or "params" not in g:
                raise MisconfigurationError(
                    f"param_groups: group {i} must be a dict with a 'params' selector, got {g!r}"
                )
            kw = {**_lr_alias(defaults), **_lr_alias({k: v for k, v in g.items() if k not in ("params", "name")})}
            unknown = sorted(set(kw) - set(accepted))
            if unknown:
                raise MisconfigurationError(
                    f"param_groups: {getattr(factory, '__name__', factory)} has no argument(s) {unknown} "
                    f"(group {i}); it takes {sorted(accepted)}"
                )
            if "learning_rate" in kw:
                static = tuple(k for k in kw if k != "learning_rate")
                tx = optax.inject_hyperparams(factory, static_args=static)(**kw)
            else:
                tx = factory(**kw)
            name = g.get("name")
            label = str(name) if name is not None else f"pg{i + 1}"
            self.groups.append((label, name is not None, g["params"], tx))
            given = {k: p.default for k, p in accepted.items() if p.default is not inspect.Parameter.empty}
            given.update(kw)
            self.known[label] = KnownGroup(
                named=name is not None,
                factory=getattr(factory, "__name__", type(factory).__name__),
                hparams={k: float(v) for k, v in given.items() if _numeric(v)},
            )

    def resolve(self, paths: Sequence[str], module: Any) -> optax.GradientTransformationExtraArgs:
        """An ``optax.partition`` over ``paths`` (the parameters the owning optimizer updates)."""
        sel = [(label, select_params(s, paths, module, f"param group {label!r}")) for label, _, s, _ in self.groups]
        return partition({label: tx for label, _, _, tx in self.groups}, group_labels(sel, paths, "param_groups"))

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise MisconfigurationError(
            "param_groups(...) is resolved by the trainer: return it from configure_optimizers (alone, as "
            "{'optimizer': groups, ...} or in a list), not inside optax.chain; clipping is "
            "Trainer(gradient_clip_val=...)"
        )

    init = update = _refuse


def _lr_alias(kw: Mapping[str, Any]) -> dict[str, Any]:
    """torch's ``lr`` spelled as optax's ``learning_rate``."""
    kw = dict(kw)
    if "lr" in kw:
        if "learning_rate" in kw:
            raise MisconfigurationError("param_groups: give 'lr' or 'learning_rate', not both")
        kw["learning_rate"] = kw.pop("lr")
    return kw


def param_groups(
    factory: Callable[..., optax.GradientTransformation], groups: Sequence[Mapping[str, Any]], **defaults: Any
) -> ParamGroups:
    """Parameter groups as torch writes them: ``torch.optim.SGD([{"params": ...}, {"params": ..., "lr": 1e-3}],
    lr=1e-2, momentum=0.9)`` is ``param_groups(optax.sgd, [{"params": self.net.base}, {"params":
    self.net.head, "learning_rate": 1e-3}], learning_rate=1e-2, momentum=0.9)``.

    Each group dict has ``"params"`` (a selector, see :func:`select_params`),
    optionally ``"name"`` (``LearningRateMonitor`` logs ``lr-SGD/<name>``,
    else ``lr-SGD/pg<i>``) and any argument of ``factory`` overriding
    ``defaults`` (``"lr"`` is accepted for ``learning_rate``).
    """
    return ParamGroups(factory, groups, **defaults)


__all__ = [
    "FROZEN",
    "KnownGroup",
    "ParamGroups",
    "group_labels",
    "param_groups",
    "partition",
    "select_params",
]
