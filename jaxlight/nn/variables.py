"""Existing parameters into NNX modules and the Linen/Equinox adapters: ``load_variables``.

A source is read into flat ``{"a/b/c": array}`` keys in the target's own
naming, every key and shape is compared with the target's variables before
anything is written, and each leaf is then placed straight onto the sharding
the variable already has (``jax.make_array_from_callback``: each device
receives only its slice). Sources:

- an in-memory pytree: nested dicts (``FrozenDict`` included; flax's
  ``LogicallyPartitioned`` boxes are unboxed), an ``nnx.State`` or another
  NNX module of the same structure, an Equinox model (``(model, state)`` for
  a stateful one);
- a flax msgpack file (``flax.serialization.to_bytes`` /
  ``msgpack_serialize`` output), read with ``flax.serialization.msgpack_restore``,
  which rebuilds arrays from their bytes and never unpickles;
- an orbax checkpoint directory (``ocp.StandardCheckpointer`` /
  ``PyTreeCheckpointer``): shapes come from its metadata, and only the
  selected leaves are read, each restored directly onto the target's sharding.

Key naming per target: a ``LinenModule`` uses Linen's variables layout
(``params/Conv_0/kernel``, ``batch_stats/BatchNorm_0/mean``; a source whose
top level holds no collection name is taken as ``params``); an
``EquinoxModule`` uses the wrapper's paths (``model/l1/weight``,
``state/bn/...``); any other NNX module its attribute paths (``l1/kernel``,
``layers/0/kernel``), as ``nnx.state(model).to_pure_dict()`` nests them. RNG
streams are never loaded.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx
from flax.core import meta

from jaxlight.state import nnx_attributes


class VariablesMismatchError(ValueError):
    """The source does not fit the target; ``missing``, ``unexpected`` and ``mismatched`` list every problem
    found. Nothing was loaded."""

    def __init__(
        self, message: str, missing: list[str] = (), unexpected: list[str] = (), mismatched: list[str] = ()
    ) -> None:
        super().__init__(message)
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)

    @classmethod
    def build(
        cls, target: str, missing: list[str], unexpected: list[str], mismatched: list[str], strict: bool
    ) -> VariablesMismatchError:
        lines = [f"the source does not fit {target}; nothing was loaded:"]
        if mismatched:
            lines.append(f"  {len(mismatched)} key(s) with another shape:")
            lines += [f"    {m}" for m in mismatched]
        if strict and missing:
            lines.append(f"  {len(missing)} key(s) the source lacks:")
            lines += [f"    {m}" for m in missing]
        if strict and unexpected:
            lines.append(f"  {len(unexpected)} key(s) the target does not have:")
            lines += [f"    {u}" for u in unexpected]
        if strict and (missing or unexpected):
            lines.append(
                "pick a sub-tree with select= (e.g. select='params' for a saved TrainState), or pass strict=False "
                "to keep the target's values for missing keys and ignore unexpected ones"
            )
        return cls("\n".join(lines), sorted(missing), sorted(unexpected), sorted(mismatched))


class LoadResult(NamedTuple):
    """What ``load_variables(..., strict=False)`` skipped."""

    missing_keys: list[str]
    unexpected_keys: list[str]


# ----------------------------------------------------------------------------------------- sources
def _flatten(tree: Any, prefix: tuple[str, ...] = ()) -> dict[str, Any]:
    """Nested mappings into ``{"a/b": leaf}``; boxes unboxed, NNX variables read."""
    out: dict[str, Any] = {}
    if isinstance(tree, meta.AxisMetadata):
        tree = tree.unbox()
    if isinstance(tree, nnx.Variable):
        tree = tree.get_value()
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            out.update(_flatten(v, (*prefix, str(k))))
        return out
    if isinstance(tree, (list, tuple)) and tree and not hasattr(tree, "_fields"):
        for i, v in enumerate(tree):
            out.update(_flatten(v, (*prefix, str(i))))
        return out
    out["/".join(prefix)] = tree
    return out


class _Orbax(NamedTuple):
    """An orbax checkpoint: its leaf shapes (from metadata) and where it is."""

    path: str
    shapes: dict[str, tuple[int, ...]]


def _orbax_shapes(path: str) -> _Orbax:
    import orbax.checkpoint as ocp

    md = ocp.PyTreeCheckpointer().metadata(path)
    tree = getattr(md, "item_metadata", md)
    tree = getattr(tree, "tree", tree)
    shapes = {k: tuple(getattr(v, "shape", ()) or ()) for k, v in _flatten(tree).items()}
    return _Orbax(path, shapes)


def _open(source: Any) -> Any:
    """A path becomes a nested dict (msgpack) or an :class:`_Orbax` handle; other sources pass through."""
    if not isinstance(source, (str, os.PathLike)):
        return source
    path = os.fspath(source)
    if os.path.isdir(path):
        return _orbax_shapes(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"variables source {path!r} is neither a file (msgpack) nor a directory (orbax)")
    from flax import serialization

    with open(path, "rb") as f:
        data = f.read()
    try:
        return serialization.msgpack_restore(data)
    except Exception as e:  # msgpack's own errors name no file
        raise ValueError(
            f"{path!r} is not a flax msgpack file ({type(e).__name__}: {e}); save with flax.serialization.to_bytes, "
            f"or pass an orbax checkpoint directory"
        ) from e


def _select(flat: dict[str, Any], select: str | None) -> dict[str, Any]:
    if not select:
        return flat
    prefix = select.strip("/") + "/"
    picked = {k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix)}
    if not picked:
        tops = sorted({k.split("/", 1)[0] for k in flat})
        raise KeyError(f"select={select!r} matches nothing in the source; its top-level keys are {tops}")
    return picked


def _as_linen(flat: dict[str, Any], collections: set[str]) -> dict[str, Any]:
    """Linen's rule: a source whose top level holds no collection name of the target is its ``params``."""
    tops = {k.split("/", 1)[0] for k in flat}
    if collections and not tops & collections and "params" in collections:
        return {f"params/{k}": v for k, v in flat.items()}
    return flat


def read_source(source: Any, *, select: str | None = None, linen_collections: set[str] | None = None) -> dict[str, Any]:
    """``{key: array}`` from an in-memory pytree, a msgpack file or an orbax directory (read in full: for
    the Linen adapter's ``variables=``, before any sharding exists)."""
    opened = _open(source)
    if isinstance(opened, _Orbax):
        prefix = select.strip("/") + "/" if select else ""
        picked = _select(dict(opened.shapes), select)
        read = _orbax_read(opened.path, dict.fromkeys((prefix + k for k in picked), None))
        flat = {k: read[prefix + k] for k in picked}
    else:
        flat = _select(_flatten(_pure(opened)), select)
    return _as_linen(flat, linen_collections) if linen_collections is not None else flat


def _pure(source: Any) -> Any:
    if isinstance(source, nnx.Module):
        source = nnx.state(source, nnx.Not(nnx.RngState))
    if isinstance(source, nnx.State):
        return source.to_pure_dict()
    return source


def check_keys(
    want: Mapping[str, tuple[int, ...]], have: Mapping[str, tuple[int, ...]]
) -> tuple[list[str], list[str], list[str]]:
    """``(missing, unexpected, mismatched)`` between the target's and the source's ``{key: shape}``."""
    missing = sorted(k for k in want if k not in have)
    unexpected = sorted(k for k in have if k not in want)
    mismatched = sorted(
        f"{k}: source {tuple(have[k])}, target {tuple(want[k])}"
        for k in want
        if k in have and tuple(have[k]) != want[k]
    )
    return missing, unexpected, mismatched


# ----------------------------------------------------------------------------------------- targets
def target_variables(target: Any) -> dict[str, nnx.Variable]:
    """The loadable variables of ``target`` by the key a source uses for them (RNG state left out).

    An adapter names them itself (``_jaxlight_loadable_variables``: the Linen wrapper by collection);
    any other NNX module by attribute path.
    """
    if not isinstance(target, nnx.Module):
        raise TypeError(
            f"load_variables loads into a flax.nnx.Module (an adapter included), got {type(target).__name__}"
        )
    own = getattr(type(target), "_jaxlight_loadable_variables", None)
    if callable(own):
        return own(target)
    out = {}
    for path, node in nnx.iter_graph(target):
        if isinstance(node, nnx.Variable) and not isinstance(node, nnx.RngState):
            out.setdefault("/".join(map(str, path)), node)
    return out


def _prepared(target: Any, source: Any) -> Any:
    """``source`` as the target names it (an adapter may turn a model of its kind into a pytree)."""
    prepare = getattr(type(target), "_jaxlight_prepare_source", None)
    return prepare(target, source) if callable(prepare) else source


def _is_concrete(v: Any) -> bool:
    return isinstance(v, (jax.Array, np.ndarray)) and not isinstance(v, jax.core.Tracer)


def _place(value: Any, current: Any) -> Any:
    """``value`` in ``current``'s dtype, on ``current``'s sharding (a host array stays on the host)."""
    dtype = np.dtype(current.dtype)
    if not isinstance(current, jax.Array):
        return np.asarray(value, dtype=dtype)
    if isinstance(value, jax.Array) and value.sharding == current.sharding and value.dtype == dtype:
        return value
    full = value if isinstance(value, np.ndarray) else np.asarray(value)
    cache: dict[Any, np.ndarray] = {}  # replicas of one slice are converted once

    def slice_for(index: tuple) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) if isinstance(s, slice) else s for s in index)
        if key not in cache:
            cache[key] = np.array(full[index], dtype=dtype)
        return cache[key]

    return jax.make_array_from_callback(tuple(current.shape), current.sharding, slice_for)


def load_variables(target: Any, source: Any, *, strict: bool = True, select: str | None = None) -> LoadResult:
    """Load existing values into ``target``'s variables in place, each placed on the sharding it has.

    ``target``: an NNX module (``from_linen`` / ``from_equinox`` wrappers
    included), or a ``LightningModule``, whose NNX attributes are addressed
    by attribute name (``{"net": <source for self.net>}``). Call it outside a
    trace: on a model built outside the trainer, or in ``on_fit_start`` once
    the trainer has placed the model (the trainer then trains the loaded
    values; the optimizer state is kept).

    ``source``: see the module docstring (pytree, msgpack file, orbax
    directory). ``select``: a ``/``-path inside the source to load from
    (``"params"`` for a checkpoint that holds a whole TrainState).

    Every key and shape is checked first; with ``strict`` (default) one
    :class:`VariablesMismatchError` lists every missing, unexpected and
    mis-shaped key, and nothing is loaded. ``strict=False`` keeps the values
    of missing keys and ignores unexpected ones (a mis-shaped key still
    raises) and returns them. Values are cast to each variable's dtype.
    """
    if not isinstance(target, nnx.Module) and hasattr(target, "__dict__") and nnx_attributes(target):
        # a LightningModule (or any object holding NNX modules as attributes)
        models = nnx_attributes(target)
        if not isinstance(source, Mapping) or not set(source) <= set(models):
            raise TypeError(
                f"loading into {type(target).__name__} needs a mapping from its NNX attributes {sorted(models)} to "
                f"their sources (e.g. {{'net': 'params.msgpack'}}); or call load_variables(self.net, source)"
            )
        missing: list[str] = []
        unexpected: list[str] = []
        for name, sub in source.items():
            r = load_variables(models[name], sub, strict=strict, select=select)
            missing += [f"{name}/{k}" for k in r.missing_keys]
            unexpected += [f"{name}/{k}" for k in r.unexpected_keys]
        return LoadResult(missing, unexpected)
    targets = target_variables(target)
    for key, var in targets.items():
        if isinstance(var.get_value(), jax.core.Tracer):
            raise RuntimeError(
                f"load_variables was called inside a jax transformation ({key} is a tracer): it reads files and "
                f"places arrays, so call it outside jit/eval_shape (not in configure_model): in on_fit_start, or on "
                f"a model built outside the trainer"
            )
    want = {k: tuple(v.get_value().shape) for k, v in targets.items()}
    linen = bool(getattr(type(target), "_jaxlight_linen_layout", False))
    collections = {k.split("/", 1)[0] for k in want} if linen else None
    opened = _open(_prepared(target, source))
    orbax = opened if isinstance(opened, _Orbax) else None
    if orbax is not None:
        flat_shapes = _select(dict(orbax.shapes), select)
        renamed = _as_linen(flat_shapes, collections) if collections is not None else flat_shapes
        # renamed key -> key inside the checkpoint
        origin = dict(zip(renamed, ((select.strip("/") + "/" if select else "") + k for k in flat_shapes)))
        have = renamed
        values: dict[str, Any] = {}
    else:
        values = _select(_flatten(_pure(opened)), select)
        if collections is not None:
            values = _as_linen(values, collections)
        have = {k: tuple(np.shape(v)) for k, v in values.items()}
    missing, unexpected, mismatched = check_keys(want, have)
    if mismatched or (strict and (missing or unexpected)):
        raise VariablesMismatchError.build(type(target).__name__, missing, unexpected, mismatched, strict)
    loadable = [k for k in want if k in have]
    if orbax is not None:
        values = _orbax_read(orbax.path, {origin[k]: targets[k].get_value() for k in loadable})
        values = {k: values[origin[k]] for k in loadable}
    for key in loadable:
        var = targets[key]
        var.set_value(_place(values[key], var.get_value()))
    return LoadResult(missing, unexpected)


def _orbax_read(path: str, currents: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint leaves ``currents`` names, each restored onto the sharding its current value has (a host
    array in the current value's dtype when it is not a jax array, as saved when it is None)."""
    import orbax.checkpoint as ocp

    def nest(flat: Mapping[str, Any]) -> dict:
        out: dict = {}
        for k, v in flat.items():
            node = out
            parts = k.split("/")
            for p in parts[:-1]:
                node = node.setdefault(p, {})
            node[parts[-1]] = v
        return out

    args = {}
    for k, cur in currents.items():
        if isinstance(cur, jax.Array):
            args[k] = ocp.ArrayRestoreArgs(sharding=cur.sharding, global_shape=tuple(cur.shape), dtype=cur.dtype)
        elif cur is None:  # as saved, on the host
            args[k] = ocp.RestoreArgs(restore_type=np.ndarray)
        else:
            args[k] = ocp.RestoreArgs(restore_type=np.ndarray, dtype=np.dtype(cur.dtype))
    item = nest(dict.fromkeys(currents, 0))
    restored = ocp.PyTreeCheckpointer().restore(
        path, args=ocp.args.PyTreeRestore(item=item, restore_args=nest(args), partial_restore=True)
    )
    return _flatten(restored)
