"""The trainable state of a LightningModule as flat, path-keyed dicts.

A module's flax NNX attributes are split once into a static graph definition
and two flat dicts of arrays keyed by "/"-joined paths: ``params`` (every
``nnx.Param``, which the optimizer owns) and ``rest`` (RNG streams, batch
statistics and any other NNX variable, carried through the step). Flat dicts
keep optimizer states, EMA copies, shardings and checkpoints readable and
keyed by the same names users see in error messages.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
from flax import nnx


def path_str(path: tuple) -> str:
    """Join a jax key path into "a/b/0/c", dropping the Variable's ``.value``."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            if k.name == "value":
                continue
            parts.append(k.name)
        else:
            parts.append(str(k))
    return "/".join(parts)


class StateCodec:
    """Converts between an NNX ``State`` and a flat ``{path: array}`` dict.

    Built from one State (abstract or concrete); the conversion is a pure
    re-labelling of leaves, free inside a traced function.
    """

    def __init__(self, state: nnx.State) -> None:
        leaves_with_path, self.treedef = jax.tree_util.tree_flatten_with_path(state)
        self.keys: list[str] = [path_str(p) for p, _ in leaves_with_path]
        if len(set(self.keys)) != len(self.keys):
            raise ValueError("two NNX variables map to the same path; rename one of them")
        # Metadata per path (logical axes and the like), read once.
        self.variables: dict[str, nnx.Variable] = {}
        for path, var in _variables_with_path(state):
            self.variables[path] = var

    def to_flat(self, state: nnx.State) -> dict[str, Any]:
        leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(state)
        if treedef != self.treedef:
            # Labelling leaves by position would silently mislabel them (a forward pass that sows a
            # new variable shifts every later leaf), so name what changed instead.
            now = [path_str(p) for p, _ in leaves_with_path]
            added = sorted(set(now) - set(self.keys))
            missing = sorted(set(self.keys) - set(now))
            raise ValueError(
                f"the model's variables changed since it was set up: added {added or 'none'}, missing "
                f"{missing or 'none'}; a step may not create or remove NNX variables (e.g. self.sow(...) into a "
                f"collection that did not exist at setup)"
            )
        return dict(zip(self.keys, (x for _, x in leaves_with_path)))

    def from_flat(self, flat: Mapping[str, Any]) -> nnx.State:
        try:
            leaves = [flat[k] for k in self.keys]
        except KeyError as e:  # pragma: no cover - guarded by callers
            raise KeyError(f"state is missing variable {e.args[0]!r}") from None
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def _variables_with_path(state: nnx.State):
    flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    for path, var in flat:
        if isinstance(var, nnx.Variable):
            yield path_str(path), var


def logical_axes(var: nnx.Variable) -> tuple | None:
    """The logical axis names a variable was annotated with, or None."""
    meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
    for key in ("out_sharding", "sharding_names", "sharding"):
        names = meta.get(key)
        if names is not None and isinstance(names, (tuple, list)):
            return tuple(names)
    return None


class ModelParts(NamedTuple):
    """What the trainer needs to rebuild a module's NNX attributes in a trace."""

    names: tuple[str, ...]  # attribute names on the LightningModule
    train_graphdef: Any  # graph with modules in train mode
    eval_graphdef: Any  # same graph in eval mode (dropout off, running stats)
    params: StateCodec
    rest: StateCodec
    given_graphdef: Any = None  # the graph as the user left it (each layer's own train/eval mode)


def nnx_attributes(module: Any) -> dict[str, nnx.Module]:
    """The flax NNX modules held as attributes of ``module``, by name."""
    return {k: v for k, v in vars(module).items() if isinstance(v, nnx.Module)}


_TRAIN_MODE = {"deterministic": False, "use_running_average": False}
_EVAL_MODE = {"deterministic": True, "use_running_average": True}


def mode_view(models: Mapping[str, nnx.Module], train: bool) -> dict[str, nnx.Module]:
    """Views of ``models`` in training or eval mode (what ``m.train()`` / ``m.eval()`` set: Dropout's
    ``deterministic``, BatchNorm's ``use_running_average``), sharing their arrays and leaving the
    modules themselves, and so the user's chosen mode, untouched."""
    attrs = _TRAIN_MODE if train else _EVAL_MODE
    return nnx.with_attributes(dict(models), raise_if_not_found=False, **attrs)


def split_models(models: Mapping[str, nnx.Module]) -> tuple[ModelParts, dict, dict]:
    """Split NNX modules into static parts (a graph in training mode and one in eval mode) and flat
    ``params``/``rest`` dicts. The modules are not changed (their train/eval mode included)."""
    models = dict(models)
    gd_train, params, rest = nnx.split(mode_view(models, True), nnx.Param, ...)
    gd_eval, _, _ = nnx.split(mode_view(models, False), nnx.Param, ...)
    gd_given, _, _ = nnx.split(models, nnx.Param, ...)
    pc, rc = StateCodec(params), StateCodec(rest)
    parts = ModelParts(tuple(models), gd_train, gd_eval, pc, rc, gd_given)
    return parts, pc.to_flat(params), rc.to_flat(rest)


def merge_models(parts: ModelParts, params: Mapping, rest: Mapping, train: bool | None = True) -> dict[str, nnx.Module]:
    """Rebuild the NNX modules from flat dicts (inside or outside a trace); ``train=None``: in the modes the
    user's layers had when they were split."""
    if train is None:
        gd = parts.given_graphdef if parts.given_graphdef is not None else parts.train_graphdef
    else:
        gd = parts.train_graphdef if train else parts.eval_graphdef
    return nnx.merge(gd, parts.params.from_flat(params), parts.rest.from_flat(rest))


def in_eval_mode(node: Any) -> bool:
    """Whether a layer was put in eval mode (``layer.eval()``, or built so: ``Dropout(deterministic=True)``,
    ``BatchNorm(use_running_average=True)``)."""
    return any(getattr(node, name, None) is True for name in _EVAL_MODE)


def train_graphdef(models: Mapping[str, nnx.Module], keep_eval_layers: bool) -> Any:
    """The graph the train step runs: every layer in training mode, except, with ``keep_eval_layers``, the
    layers the user put in eval mode (torch keeps a submodule's ``.eval()`` through training, and so does
    Lightning's loop)."""
    only = (lambda path, node: not in_eval_mode(node)) if keep_eval_layers else ...
    view = nnx.with_attributes(dict(models), only=only, raise_if_not_found=False, **_TRAIN_MODE)
    return nnx.split(view, nnx.Param, ...)[0]


def held_statistics(models: Mapping[str, nnx.Module]) -> frozenset[str]:
    """The flat keys of the non-parameter variables of layers with ``track_running_stats = False`` (torch's
    flag; ``BaseFinetuning.freeze`` sets it on BatchNorm): the train step keeps their values, so a BatchNorm
    normalises with its batch's statistics and leaves its running ones alone, as torch's does."""
    nodes = dict(nnx.iter_graph(dict(models)))
    held = [
        p for p, n in nodes.items() if isinstance(n, nnx.Module) and getattr(n, "track_running_stats", True) is False
    ]
    return frozenset(
        path_str(p)
        for p, n in nodes.items()
        if isinstance(n, nnx.Variable) and not isinstance(n, nnx.Param) and any(p[: len(h)] == h for h in held)
    )


def rest_after(parts: ModelParts, models: Mapping[str, nnx.Module]) -> dict:
    """Read the non-parameter variables back after a forward pass updated them."""
    _, _, rest = nnx.split(dict(models), nnx.Param, ...)
    return parts.rest.to_flat(rest)
