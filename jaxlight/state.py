"""The trainable state of a LightningModule as flat, path-keyed dicts.

A module's flax NNX attributes are split once into a static graph definition
and two flat dicts of arrays keyed by "/"-joined paths: ``params`` (every
``nnx.Param``, which the optimizer owns) and ``rest`` (RNG streams, batch
statistics and any other NNX variable, carried through the step). Flat dicts
keep optimizer states, EMA copies, shardings and checkpoints readable and
keyed by the same names users see in error messages.

Every NNX object the module holds is state: its models (``nnx.Module``) and
its *holders*, the other NNX objects held as attributes (an ``nnx.Rngs`` for
call-time dropout or noise, an ``nnx.MultiMetric``, a bare ``nnx.Variable``,
any other ``nnx.Pytree``). They are split as one graph, models first, so a
variable a holder shares with a model keeps the model's path (the path it had
before holders were carried).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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

    def __init__(self, state: nnx.State, rooted: bool = False) -> None:
        # rooted: the State of a (models, holders) pair, whose leading index is not part of a path
        self.rooted = rooted
        leaves_with_path, self.treedef = jax.tree_util.tree_flatten_with_path(state)
        self.keys: list[str] = [self._path(p) for p, _ in leaves_with_path]
        if len(set(self.keys)) != len(self.keys):
            raise ValueError("two NNX variables map to the same path; rename one of them")
        # Metadata per path (logical axes and the like), read once.
        self.variables: dict[str, nnx.Variable] = {}
        for path, var in _variables_with_path(state, rooted):
            self.variables[path] = var

    def _path(self, path: tuple) -> str:
        return path_str(path[1:] if self.rooted else path)

    def to_flat(self, state: nnx.State) -> dict[str, Any]:
        leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(state)
        if treedef != self.treedef:
            # Labelling leaves by position would silently mislabel them (a forward pass that sows a
            # new variable shifts every later leaf), so name what changed instead.
            now = [self._path(p) for p, _ in leaves_with_path]
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


def _variables_with_path(state: nnx.State, rooted: bool = False):
    flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    for path, var in flat:
        if isinstance(var, nnx.Variable):
            yield path_str(path[1:] if rooted else path), var


ANNOTATION_KEYS: tuple[str, ...] = ("out_sharding", "sharding_names", "sharding")
"""Variable metadata keys that hold a sharding annotation. flax 0.12 writes ``out_sharding``
(``nnx.with_partitioning``, ``kernel_metadata=``, the Linen bridge's ``LogicallyPartitioned`` /
``Partitioned`` boxes) and renames the deprecated ``sharding_names`` / ``sharding`` to it; the old
keys are still read for variables built by other means."""


def annotation_names(annotation: Any) -> tuple | None:
    """One entry per named dimension of a sharding annotation, in every form flax code writes, or None.

    A tuple, a list, a ``jax.sharding.PartitionSpec`` or a ``NamedSharding`` (its spec) all read the
    same: each entry is ``None`` (whole), a name (logical or a mesh axis), or a tuple of mesh axes that
    split the dimension together (``P(("fsdp", "tensor"))``; a one-name tuple or list is that name).
    ``P.UNCONSTRAINED`` reads as whole: the trainer places parameters, it does not leave them to XLA.
    Anything else (a bare string, a ``SingleDeviceSharding``) is not an annotation.
    """
    spec = getattr(annotation, "spec", None)
    if isinstance(annotation, jax.sharding.NamedSharding) and spec is not None:
        annotation = spec
    if not isinstance(annotation, (tuple, list, jax.sharding.PartitionSpec)):
        return None
    out: list = []
    for entry in annotation:
        if isinstance(entry, (tuple, list)):
            members = tuple(entry)
            entry = None if not members else members[0] if len(members) == 1 else members
        elif entry is not None and not isinstance(entry, str):
            entry = None  # P.UNCONSTRAINED
        out.append(entry)
    return tuple(out)


def logical_axes(var: nnx.Variable) -> tuple | None:
    """The axis names a variable was annotated with (:func:`annotation_names` of its metadata), or None."""
    meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
    for key in ANNOTATION_KEYS:
        names = annotation_names(meta.get(key))
        if names is not None:
            return names
    return None


class ModelParts(NamedTuple):
    """What the trainer needs to rebuild a module's NNX attributes in a trace."""

    names: tuple[str, ...]  # attribute names on the LightningModule: its models, then its holders
    train_graphdef: Any  # graph with modules in train mode
    eval_graphdef: Any  # same graph in eval mode (dropout off, running stats)
    params: StateCodec
    rest: StateCodec
    given_graphdef: Any = None  # the graph as the user left it (each layer's own train/eval mode)
    holders: tuple[str, ...] = ()  # the names that hold NNX objects other than modules (Rngs, metrics, ...)


def is_nnx_object(x: Any) -> bool:
    """Whether ``x`` is NNX state the trainer carries: a module, another ``nnx.Pytree`` (``nnx.Rngs``,
    ``nnx.Metric``, ``nnx.Optimizer`` ...) or a bare ``nnx.Variable``."""
    return isinstance(x, (nnx.Pytree, nnx.Variable))


def nnx_attributes(module: Any) -> dict[str, nnx.Module]:
    """The flax NNX modules held as attributes of ``module``, by name (its models)."""
    return {k: v for k, v in vars(module).items() if isinstance(v, nnx.Module)}


def nnx_objects(module: Any) -> dict[str, Any]:
    """Every NNX object held as an attribute of ``module`` (:func:`is_nnx_object`): the models first,
    then the holders, each in attribute order. This is the state the trainer carries."""
    objs = vars(module).items()
    return {
        **{k: v for k, v in objs if isinstance(v, nnx.Module)},
        **{k: v for k, v in objs if is_nnx_object(v) and not isinstance(v, nnx.Module)},
    }


def _root(objects: Mapping[str, Any], holders: Sequence[str]) -> tuple[dict, dict]:
    """The graph every split and merge works on: ``(models, holders)``. nnx walks a dict in sorted key
    order, so one flat dict would give a variable shared by ``self.a_rngs`` and ``self.net`` the holder's
    path; the pair makes the models' paths win."""
    held = set(holders)
    return (
        {k: v for k, v in objects.items() if k not in held},
        {k: v for k, v in objects.items() if k in held},
    )


def graph_root(parts: ModelParts, objects: Mapping[str, Any]) -> tuple[dict, dict]:
    """``objects`` (by attribute name) as the graph ``parts`` was split from (for ``nnx.split`` /
    ``nnx.update`` / ``nnx.iter_graph``; paths from it start with the pair's index)."""
    return _root(objects, parts.holders)


def split_state(parts: ModelParts, objects: Mapping[str, Any]) -> tuple[dict, dict]:
    """Flat ``params`` and ``rest`` of ``objects`` (the module's NNX attributes), keyed as ``parts``."""
    _, p, r = nnx.split(graph_root(parts, objects), nnx.Param, ...)
    return parts.params.to_flat(p), parts.rest.to_flat(r)


_TRAIN_MODE = {"deterministic": False, "use_running_average": False}
_EVAL_MODE = {"deterministic": True, "use_running_average": True}


def mode_view(models: Any, train: bool) -> Any:
    """Views of ``models`` in training or eval mode (what ``m.train()`` / ``m.eval()`` set: Dropout's
    ``deterministic``, BatchNorm's ``use_running_average``), sharing their arrays and leaving the
    modules themselves, and so the user's chosen mode, untouched."""
    attrs = _TRAIN_MODE if train else _EVAL_MODE
    if isinstance(models, Mapping):
        models = dict(models)
    return nnx.with_attributes(models, raise_if_not_found=False, **attrs)


def split_models(models: Mapping[str, Any]) -> tuple[ModelParts, dict, dict]:
    """Split NNX objects (modules and holders, by attribute name) into static parts (a graph in training
    mode and one in eval mode) and flat ``params``/``rest`` dicts. The objects are not changed (their
    train/eval mode included)."""
    models = dict(models)
    holders = tuple(k for k, v in models.items() if not isinstance(v, nnx.Module))
    root = _root(models, holders)
    gd_train, params, rest = nnx.split(mode_view(root, True), nnx.Param, ...)
    gd_eval, _, _ = nnx.split(mode_view(root, False), nnx.Param, ...)
    gd_given, _, _ = nnx.split(root, nnx.Param, ...)
    pc, rc = StateCodec(params, rooted=True), StateCodec(rest, rooted=True)
    names = tuple(root[0]) + tuple(root[1])
    parts = ModelParts(names, gd_train, gd_eval, pc, rc, gd_given, holders)
    return parts, pc.to_flat(params), rc.to_flat(rest)


def merge_models(parts: ModelParts, params: Mapping, rest: Mapping, train: bool | None = True) -> dict[str, Any]:
    """Rebuild the NNX objects (by attribute name) from flat dicts (inside or outside a trace); ``train=None``:
    in the modes the user's layers had when they were split."""
    if train is None:
        gd = parts.given_graphdef if parts.given_graphdef is not None else parts.train_graphdef
    else:
        gd = parts.train_graphdef if train else parts.eval_graphdef
    models, holders = nnx.merge(gd, parts.params.from_flat(params), parts.rest.from_flat(rest))
    return {**models, **holders}


def in_eval_mode(node: Any) -> bool:
    """Whether a layer was put in eval mode (``layer.eval()``, or built so: ``Dropout(deterministic=True)``,
    ``BatchNorm(use_running_average=True)``)."""
    return any(getattr(node, name, None) is True for name in _EVAL_MODE)


def train_graphdef(parts: ModelParts, objects: Mapping[str, Any], keep_eval_layers: bool) -> Any:
    """The graph the train step runs (``objects``: the module's NNX attributes, as ``parts`` names them): every
    layer in training mode, except, with ``keep_eval_layers``, the layers the user put in eval mode (torch
    keeps a submodule's ``.eval()`` through training, and so does Lightning's loop)."""
    only = (lambda path, node: not in_eval_mode(node)) if keep_eval_layers else ...
    view = nnx.with_attributes(graph_root(parts, objects), only=only, raise_if_not_found=False, **_TRAIN_MODE)
    return nnx.split(view, nnx.Param, ...)[0]


def held_statistics(parts: ModelParts, objects: Mapping[str, Any]) -> frozenset[str]:
    """The flat keys of the non-parameter variables of layers with ``track_running_stats = False`` (torch's
    flag; ``BaseFinetuning.freeze`` sets it on BatchNorm): the train step keeps their values, so a BatchNorm
    normalises with its batch's statistics and leaves its running ones alone, as torch's does."""
    nodes = dict(nnx.iter_graph(graph_root(parts, objects)))  # paths start with the pair's index
    held = [
        p for p, n in nodes.items() if isinstance(n, nnx.Module) and getattr(n, "track_running_stats", True) is False
    ]
    return frozenset(
        path_str(p[1:])
        for p, n in nodes.items()
        if isinstance(n, nnx.Variable) and not isinstance(n, nnx.Param) and any(p[: len(h)] == h for h in held)
    )


def rest_after(parts: ModelParts, models: Mapping[str, Any]) -> dict:
    """Read the non-parameter variables back after a forward pass updated them."""
    _, _, rest = nnx.split(graph_root(parts, models), nnx.Param, ...)
    return parts.rest.to_flat(rest)


def eval_changes(parts: ModelParts, models: Mapping[str, Any], rest: Mapping[str, Any]) -> dict:
    """The non-parameter variables an evaluation forward pass set (inside its trace), which evaluation
    carries: a metric updated in ``validation_step``, a holder's RNG stream drawn in ``predict_step``,
    a variable of the user's own type. A model's own RNG streams are left out: a Linen or Equinox
    adapter draws a key per call even in evaluation, and validation must not move the noise training
    sees next. Unchanged variables are the very tracers that came in, so nothing is carried for them."""
    after = rest_after(parts, models)
    held = set(parts.holders)
    out = {}
    for k, v in after.items():
        if v is rest[k]:
            continue
        var = parts.rest.variables.get(k)
        if k.split("/", 1)[0] not in held and isinstance(var, nnx.RngState):
            continue
        out[k] = v.astype(rest[k].dtype) if hasattr(v, "astype") and hasattr(rest[k], "dtype") else v
    return out


def written_params(
    parts: ModelParts, models: Mapping[str, Any], bound: Mapping[str, Any], stored: Mapping[str, Any], owner: str
) -> dict[str, Any]:
    """The parameters a traced step assigned (``nnx.update(self.target, nnx.state(self.net))``,
    ``layer.kernel.value = ...``), by key, in their storage dtype (``stored``'s). ``bound``: the arrays the
    models were built from; a parameter not written is that very array, so one identity check per
    parameter tells them apart, at trace time only. A written value of another shape is refused by name."""
    _, p, _ = nnx.split(graph_root(parts, models), nnx.Param, ...)
    out = {}
    for k, v in parts.params.to_flat(p).items():
        if v is bound[k]:
            continue
        if getattr(v, "shape", None) != tuple(stored[k].shape):
            raise ValueError(
                f"{owner}.training_step assigned parameter {k!r} a value of shape {getattr(v, 'shape', None)}, "
                f"but it has shape {tuple(stored[k].shape)}; a step may change a parameter's values, not its shape"
            )
        out[k] = v.astype(stored[k].dtype) if hasattr(v, "astype") else v
    return out


def holder_keys(parts: ModelParts) -> list[str]:
    """The ``rest`` keys of the NNX objects held beside the models (checkpoints from before jaxlight
    carried them lack these; a restore keeps their current values)."""
    held = set(parts.holders)
    return [k for k in parts.rest.keys if k.split("/", 1)[0] in held]


def configured_objects(module: Any) -> dict[str, Any]:
    """Run ``module.configure_model()`` (inside a trace: abstract or compiled creation) and return every
    NNX object the module then holds; the module is left as it was.

    Holders created in ``__init__`` (``self.rngs = nnx.Rngs(0)`` used by ``configure_model`` to
    initialise a model) are handed to ``configure_model`` as copies made inside the trace, since flax
    refuses to advance an RNG stream created outside it; what the copies hold afterwards (the streams
    advanced by the initialisation) is what is returned. Objects ``configure_model`` created are
    removed from the module again: the engine points it at placed ones.
    """
    before = {k: v for k, v in nnx_objects(module).items() if not isinstance(v, nnx.Module)}
    copies = nnx.merge(*nnx.split(before), copy=True) if before else {}  # new variables, of this trace
    for k, v in copies.items():
        object.__setattr__(module, k, v)
    try:
        module.configure_model()
        objects = nnx_objects(module)
    finally:
        for k, v in before.items():
            object.__setattr__(module, k, v)
    for k in objects:
        if k not in before:
            object.__delattr__(module, k)
    return objects
