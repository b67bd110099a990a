"""PyTorch weights into flax NNX models and back: ``load_torch_weights``, ``export_torch_weights``.

A torch ``state_dict`` names tensors by module path (``encoder.0.weight``) and
stores them in torch's layouts; an NNX model names variables by attribute path
(``encoder/layers/0/kernel``) in flax's layouts. This module walks the NNX
model, derives for each variable the torch key its twin would use and the
layout conversion from the NNX module type found at that path, checks every
key and shape before touching the model, then reads, converts and places one
tensor at a time directly onto the sharding the variable already has.

Rules (torch key relative to the module -> NNX variable):

========================================  ==============================  ==========================
NNX module (torch module)                 torch key -> NNX variable       layout
========================================  ==============================  ==========================
``nnx.Linear`` (``nn.Linear``)            weight -> kernel, bias          (out, in) -> (in, out)
``Conv1D`` (transformers' ``Conv1D``)     weight -> kernel, bias          same: (in, out)
``nnx.Conv`` (``nn.Conv1d/2d/3d``)        weight -> kernel, bias          (O, I/g, *k) -> (*k, I/g, O)
``nnx.ConvTranspose``                     weight -> kernel, bias          (I, O, *k) -> (*k, I, O)
(``nn.ConvTranspose1d/2d/3d``,                                            flipped in space;
groups=1)                                                                 ``transpose_kernel=True``:
                                                                          (*k, O, I), not flipped
``nnx.Embed`` (``nn.Embedding``)          weight -> embedding             same
``nnx.LayerNorm/RMSNorm/GroupNorm/``      weight -> scale, bias           same
``InstanceNorm``
``nnx.BatchNorm`` (``nn.BatchNorm*d``)    weight -> scale, bias,          same; ``num_batches_tracked``
                                          running_mean -> mean,           is accepted and ignored
                                          running_var -> var
``nnx.MultiHeadAttention``                in_proj_weight -> query/key/    (3E, in) split in three, each
(``nn.MultiheadAttention``)               value kernel (or q/k/v_proj_    transposed to (in, heads,
                                          weight), in_proj_bias -> q/k/v  head_dim); out_proj.weight ->
                                          bias, out_proj.weight/bias ->   out/kernel (heads, head_dim,
                                          out/kernel, out/bias            out)
any other variable (custom ``nnx.Param``  its attribute name              same
or buffer)
========================================  ==============================  ==========================

Path components map one to one (``blocks/0`` <-> ``blocks.0``), except that
``nnx.Sequential``'s ``layers`` component is dropped (``seq/layers/2`` <->
``seq.2``), as torch's ``nn.Sequential`` numbers its children directly. RNG
state, caches and intermediates are never loaded.

``export_torch_weights`` is the inverse: the same keys and rules, each layout converted back, written
as a ``.safetensors`` file (with a ``config.json`` beside it when given) that torch or ``transformers``
loads.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx

from jaxlight.integrations import require
from jaxlight.migrate_settings import conv_transpose_padding as conv_transpose_padding  # public here too
from jaxlight.migrate_settings import torch_twin_name, warn_setting_differences
from jaxlight.migrate_sources import TorchWeightsError as TorchWeightsError  # public here, as before
from jaxlight.migrate_sources import _open_source, _Source

Mapping_ = Mapping[str, str | None] | Callable[[str], str | None]


class IncompatibleKeys(NamedTuple):
    """What ``load_torch_weights(..., strict=False)`` skipped, as torch's ``load_state_dict`` reports it."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class Conv1D(nnx.Linear):
    """An ``nnx.Linear`` whose torch twin stores its weight as ``(in, out)``: transformers' ``Conv1D``.

    GPT-2 (and GPT, CTRL ...) in ``transformers`` compute their projections (``c_attn``, ``c_proj``,
    ``c_fc``) with ``Conv1D``, ``x @ weight + bias`` with ``weight`` of shape ``(in, out)``: not
    transposed like ``nn.Linear``'s. Build those layers of the NNX twin with this class (same arguments
    and computation as ``nnx.Linear``) and ``load_torch_weights`` / ``export_torch_weights`` keep the
    weight's layout instead of transposing it. The layout is declared by the layer's type, as for every
    other rule, so loading and exporting need no extra argument.
    """


# ----------------------------------------------------------------------------------------- public API
def load_torch_weights(
    model: Any,
    source: Any,
    *,
    mapping: Mapping_ | None = None,
    strict: bool = True,
) -> IncompatibleKeys:
    """Load PyTorch weights into the NNX model ``model`` in place.

    ``model``: a ``flax.nnx.Module`` (concrete, sharded by a trainer, or
    abstract from ``nnx.eval_shape``), or a ``jaxlight.LightningModule``, whose
    NNX attributes are addressed by attribute name (``net.l1.weight``) as in a
    Lightning checkpoint's ``state_dict``.

    ``source``: a ``state_dict`` (a mapping of torch tensors or numpy/jax
    arrays), a ``torch.nn.Module`` (its ``state_dict()``; its settings are also
    compared with the NNX twin's and differences the weights do not carry,
    such as BatchNorm momentum, epsilons, conv padding or head counts, are
    reported in one warning), or a path to a ``.pt``/``.pth``/``.bin``/``.ckpt``
    file (read with ``torch.load(weights_only=True, mmap=True)``: never
    unpickled), a ``.safetensors`` file, a sharded checkpoint's
    ``*.index.json``, or a directory holding one of those
    (``model.safetensors``, ``pytorch_model.bin`` ...).

    ``mapping`` renames source keys to the torch-style names of ``model``
    (see ``torch_names``) before matching: a dict maps a key or a key prefix
    (whole components: ``{"backbone": "encoder"}`` renames
    ``backbone.0.weight`` to ``encoder.0.weight``; ``{"model.": ""}`` strips a
    prefix) to a new name, or to None to drop it; a callable gets each key and
    returns the new name or None.

    Guarantees: every key and shape is checked before anything is loaded; with
    ``strict=True`` one ``TorchWeightsError`` lists every missing, unexpected
    and mis-shaped key; with ``strict=False`` missing and unexpected keys are
    returned instead (mis-shaped ones still raise). Each tensor is read,
    converted to the variable's layout and dtype, and placed onto the
    variable's current sharding on its own (each device receives only its
    slice, via ``jax.make_array_from_callback``), so the host never holds more
    than one tensor and the model is never gathered on one device.
    """
    roots = _roots(model)
    src = _open_source(source)
    try:
        renamed = _rename(src.names(), mapping)
        targets, ignored = _plan(roots, set(renamed))
        missing, unexpected, mismatched = _check(targets, ignored, renamed, src)
        if src.torch_module is not None:  # before the shape report: it explains a grouped one's shapes
            _refuse_grouped_transposes(targets, renamed, src.torch_module)
        if mismatched or (strict and (missing or unexpected)):
            raise _mismatch_error(model, targets, renamed, missing, unexpected, mismatched, strict)
        unset = [t.path for t in targets if t.key in missing and not _is_concrete(t.var.get_value())]
        if unset:
            raise TorchWeightsError(
                f"strict=False, but the model is abstract and the source has no value for {len(unset)} "
                f"variable(s): {unset[:20]}{' ...' if len(unset) > 20 else ''}; they would stay without data",
                missing=[t.key for t in targets if t.key in missing],
            )
        if src.torch_module is not None:
            warn_setting_differences(targets, renamed, src.torch_module)
        _load(targets, renamed, src)
    finally:
        src.close()
    return IncompatibleKeys(sorted(missing), sorted(unexpected))


def torch_names(model: Any) -> dict[str, str]:
    """The torch-style key each loadable variable of ``model`` expects, mapped to its NNX path.

    Use it to write a ``mapping`` for ``load_torch_weights``: compare its keys
    with ``torch_model.state_dict().keys()``. A torch key feeding several NNX
    variables (``nn.MultiheadAttention``'s packed ``in_proj_weight``) maps to
    their paths joined by ", ".
    """
    targets, _ = _plan(_roots(model), set())
    out: dict[str, list[str]] = {}
    for t in targets:
        out.setdefault(t.key, []).append(t.path)
    return {k: ", ".join(v) for k, v in out.items()}


def export_torch_weights(
    model: Any,
    path: str | os.PathLike | None = None,
    *,
    mapping: Mapping_ | None = None,
    config: str | os.PathLike | Mapping[str, Any] | None = None,
    metadata: Mapping[str, str] | None = None,
) -> dict[str, np.ndarray]:
    """The torch ``state_dict`` of ``model`` (numpy arrays), optionally written as safetensors: the inverse
    of ``load_torch_weights``.

    Every variable ``load_torch_weights`` would load is written under the same torch key, its layout
    converted back by the same rule (``nnx.Linear`` kernels transposed to ``(out, in)``, conv kernels to
    ``(O, I, *k)``, ``nn.MultiheadAttention``'s projections packed again into ``in_proj_weight``, ...), in
    the variable's dtype. Loading the result back, or exporting what was loaded, is bit-exact. RNG state,
    caches and intermediates are not weights and are not written; neither are torch's buffers that the
    model does not hold (a torch module's non-persistent buffers, or ``num_batches_tracked``, which torch
    fills in itself). Tied weights are written once, under the key the model holds them by (a GPT-2 twin
    that reuses ``wte`` for its head writes ``transformer.wte.weight`` and ``transformers`` re-ties
    ``lm_head.weight``).

    ``mapping`` renames the model's torch-style keys (``torch_names(model)``) to the written ones, in
    ``load_torch_weights``' forms: a dict of exact keys or whole-component prefixes (``{"net": ""}`` strips
    a ``LightningModule`` attribute's name, None drops a key), or a callable returning the new name or None.

    ``path``: None returns the state dict only; a ``*.safetensors`` file name writes that file; any other
    path is a directory (created if needed) that receives ``model.safetensors``, the layout
    ``transformers``' ``from_pretrained(dir)`` reads. ``config``: a dict, a ``config.json`` file or a
    directory holding one (the checkpoint the weights came from), written as ``config.json`` next to the
    weights. ``metadata``: the safetensors header's metadata; by default ``{"format": "pt"}``, which
    ``transformers`` requires.

    Sharded variables are gathered one at a time (across processes too); in a multi-process run every
    process returns the state dict and only process 0 writes files. The returned dict holds the whole
    state dict on the host, as the safetensors file is written from it.
    """
    targets, _ = _plan(_roots(model), set())
    by_key: dict[str, list[_Target]] = {}
    for t in targets:
        by_key.setdefault(t.key, []).append(t)
    renamed = _rename(by_key, mapping)  # {written key: model key}
    out: dict[str, np.ndarray] = {}
    for new, key in renamed.items():
        out[new] = _unconvert(by_key[key])
    if path is not None:
        _write_safetensors(out, os.fspath(path), config, {"format": "pt"} if metadata is None else metadata)
    return out


def _unconvert(group: list[_Target]) -> np.ndarray:
    """One torch tensor from the variable(s) its key feeds: each variable's conversion undone."""
    values = []
    for t in group:
        v = t.var.get_value()
        if not _is_concrete(v):
            raise TypeError(
                f"cannot export {t.path}: it holds no data ({type(v).__name__}); export a concrete model, "
                f"outside jit/eval_shape"
            )
        if isinstance(v, jax.Array) and not v.is_fully_addressable:  # sharded across processes
            from jax.experimental import multihost_utils

            v = multihost_utils.process_allgather(v, tiled=True)
        values.append(np.asarray(jax.device_get(v)))
    if len(group) == 1 and group[0].convert in (_same, _transpose):  # the common cases, without an index map
        # a writable copy: device_get's arrays are read-only views, which torch.from_numpy warns about
        return np.array(values[0] if group[0].convert is _same else values[0].T, order="C")
    # Every other rule only moves, slices and reshapes elements: running it on the source positions gives,
    # for each variable element, where it came from, so writing back needs no inverse per rule.
    shape = group[0].expect
    dest = np.zeros(shape, np.result_type(*values))
    filled = np.zeros(shape, bool)
    for t, value in zip(group, values):
        where = t.convert(np.arange(math.prod(shape)).reshape(shape))
        np.put(dest, where, value)
        np.put(filled, where, True)
    if not filled.all():
        raise ValueError(f"cannot export {group[0].key}: the model's variables fill only part of it")
    return dest


def _write_safetensors(tensors: dict[str, np.ndarray], path: str, config: Any, metadata: Mapping[str, str]) -> None:
    if jax.process_index() != 0:
        return
    require("safetensors", f"writing {path}")
    from safetensors.numpy import save_file

    if path.endswith(".safetensors"):
        directory, file = os.path.dirname(path) or ".", path
    else:
        directory, file = path, os.path.join(path, "model.safetensors")
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, file, metadata=dict(metadata))
    if config is None:
        return
    target = os.path.join(directory, "config.json")
    if isinstance(config, Mapping):
        with open(target, "w") as f:
            json.dump(dict(config), f, indent=2)
            f.write("\n")
        return
    source = os.fspath(config)
    if os.path.isdir(source):
        source = os.path.join(source, "config.json")
    if os.path.abspath(source) != os.path.abspath(target):  # copied as is: the original's exact text
        shutil.copyfile(source, target)


# ----------------------------------------------------------------------------------------- planning
class _Target(NamedTuple):
    path: str  # NNX path, "net/l1/kernel"
    var: nnx.Variable  # the live variable to set
    key: str  # torch-style key in the model's naming
    expect: tuple[int, ...]  # the source shape this variable needs
    convert: Callable[[np.ndarray], np.ndarray]  # source layout -> variable layout (views where possible)
    module: nnx.Module
    rule: str


def _roots(model: Any) -> dict[str, nnx.Module]:
    if isinstance(model, nnx.Module):
        return {"": model}
    from jaxlight.module import LightningModule

    if isinstance(model, LightningModule):
        from jaxlight.state import nnx_attributes

        models = nnx_attributes(model)
        if not models:
            raise TypeError(
                f"{type(model).__name__} holds no flax.nnx.Module attribute to load into (a module built in "
                f"configure_model exists only once a Trainer has set it up)"
            )
        return models
    raise TypeError(f"load_torch_weights needs a flax.nnx.Module or a LightningModule, got {type(model).__name__}")


_SKIP_VARIABLES = (nnx.RngState, nnx.Cache, nnx.Intermediate)
_NORMS = (nnx.LayerNorm, nnx.RMSNorm, nnx.GroupNorm, nnx.InstanceNorm)


def _plan(roots: Mapping[str, nnx.Module], available: set[str]) -> tuple[list[_Target], set[str]]:
    """Every loadable NNX variable with its torch key, expected source shape and conversion."""
    ordered: list[tuple[tuple, _Target]] = []  # (owner path, target): a rule's targets stay in its order
    ignored: set[str] = set()
    for root_name, root in roots.items():
        modules = dict(nnx.iter_modules(root))
        variables = {p: v for p, v in nnx.iter_graph(root) if isinstance(v, nnx.Variable)}

        def torch_key(path: tuple, _modules=modules, _root=root_name) -> str:
            parts = [_root] if _root else []
            for i, comp in enumerate(path):
                if comp == "layers" and isinstance(_modules.get(tuple(path[:i])), nnx.Sequential):
                    continue
                parts.append(str(comp))
            return ".".join(parts)

        def nnx_path(path: tuple, _root=root_name) -> str:
            return "/".join(([_root] if _root else []) + [str(c) for c in path])

        claimed: set[int] = set()
        for mpath in sorted(modules, key=len):
            mod = modules[mpath]
            found = _module_targets(mod, mpath, torch_key, nnx_path, available, ignored)
            for t in found:
                if id(t.var) not in claimed:
                    claimed.add(id(t.var))
                    ordered.append((_natural((root_name, *mpath)), t))
            if isinstance(mod, nnx.MultiHeadAttention):  # its projections are covered by its own rule
                for child in ("query", "key", "value", "out"):
                    for v in vars(getattr(mod, child)).values():
                        if isinstance(v, nnx.Variable):
                            claimed.add(id(v))
        for vpath, var in variables.items():
            if id(var) in claimed or isinstance(var, _SKIP_VARIABLES) or not hasattr(var.get_value(), "shape"):
                continue
            shape = tuple(var.get_value().shape)
            owner = modules.get(tuple(vpath[:-1]))
            rule = type(owner).__name__ + " (as is)"
            target = _Target(nnx_path(vpath), var, torch_key(vpath), shape, _same, owner, rule)
            ordered.append((_natural((root_name, *vpath)), target))
            claimed.add(id(var))
    # the model's order (as nnx.state lists it, numbers in numeric order); a module's variables in its
    # rule's order, which is torch's (weight before bias, q/k/v)
    ordered.sort(key=lambda pair: pair[0])
    return [t for _, t in ordered], ignored


def _natural(path: tuple) -> tuple:
    return tuple((0, c, "") if isinstance(c, int) else (1, 0, str(c)) for c in path)


def _same(a: np.ndarray) -> np.ndarray:
    return a


def _module_targets(mod, mpath, torch_key, nnx_path, available, ignored) -> list[_Target]:
    """The rule for one NNX module type (empty when the type has none)."""

    def var(name: str):
        v = vars(mod).get(name)
        return v if isinstance(v, nnx.Variable) and hasattr(v.get_value(), "shape") else None

    def shape(v) -> tuple[int, ...]:
        return tuple(v.get_value().shape)

    def t(name: str, torch_name: str, expect, convert, rule: str) -> list[_Target]:
        v = var(name)
        if v is None:
            return []
        key = torch_key(mpath + (torch_name,))
        return [_Target(nnx_path(mpath + (name,)), v, key, tuple(expect(shape(v))), convert, mod, rule)]

    ident = (lambda s: s), _same
    if isinstance(mod, Conv1D):  # before nnx.Linear, its base class
        return t("kernel", "weight", *ident, "Conv1D: weight (in, out) as is") + t("bias", "bias", *ident, "Conv1D")
    if isinstance(mod, nnx.Linear):
        return t("kernel", "weight", lambda s: s[::-1], _transpose, "Linear: weight.T") + t(
            "bias", "bias", *ident, "Linear"
        )
    if isinstance(mod, nnx.Conv):
        return t("kernel", "weight", _conv_source_shape, _conv_to_flax, "Conv: OI* -> *IO") + t(
            "bias", "bias", *ident, "Conv"
        )
    if isinstance(mod, nnx.ConvTranspose):
        flip = not mod.transpose_kernel
        rule = (
            "ConvTranspose: (in, out, *k) -> (*k, in, out), spatially flipped"
            if flip
            else "ConvTranspose(transpose_kernel=True): (in, out, *k) -> (*k, out, in)"
        ) + "; torch groups=1 only (a grouped one stores (in, out/groups, *k))"
        return t("kernel", "weight", _conv_transpose_source_shape(flip), _conv_transpose_to_flax(flip), rule) + t(
            "bias", "bias", *ident, "ConvTranspose"
        )
    if isinstance(mod, nnx.Embed):
        return t("embedding", "weight", *ident, "Embedding")
    if isinstance(mod, nnx.BatchNorm):
        ignored.add(torch_key(mpath + ("num_batches_tracked",)))
        return (
            t("scale", "weight", *ident, "BatchNorm")
            + t("bias", "bias", *ident, "BatchNorm")
            + t("mean", "running_mean", *ident, "BatchNorm: running stats")
            + t("var", "running_var", *ident, "BatchNorm: running stats")
        )
    if isinstance(mod, _NORMS):
        name = type(mod).__name__
        return t("scale", "weight", *ident, name) + t("bias", "bias", *ident, name)
    if isinstance(mod, nnx.MultiHeadAttention):
        return _mha_targets(mod, mpath, torch_key, nnx_path, available)
    return []


def _transpose(a: np.ndarray) -> np.ndarray:
    return a.T


def _conv_source_shape(kernel_shape: tuple[int, ...]) -> tuple[int, ...]:
    *k, i, o = kernel_shape
    return (o, i, *k)


def _conv_to_flax(w: np.ndarray) -> np.ndarray:
    n = w.ndim - 2
    return w.transpose((*range(2, n + 2), 1, 0))


def _conv_transpose_source_shape(flip: bool) -> Callable[[tuple[int, ...]], tuple[int, ...]]:
    """torch's ``(in, out, *k)`` for an ``nnx.ConvTranspose`` kernel: ``(*k, in, out)``, or ``(*k, out, in)``
    with ``transpose_kernel=True``."""

    def expect(kernel_shape: tuple[int, ...]) -> tuple[int, ...]:
        *k, a, b = kernel_shape
        return (a, b, *k) if flip else (b, a, *k)

    return expect


def _conv_transpose_to_flax(flip: bool) -> Callable[[np.ndarray], np.ndarray]:
    """torch's ConvTranspose weight ``(in, out, *k)`` as an ``nnx.ConvTranspose`` kernel.

    torch computes ``y[o] = sum_i x[i] w[o + p - i*s]``: a correlation of the stride-dilated input, padded by
    ``d*(k-1) - p``, with the kernel flipped in space and its channel axes swapped. ``lax.conv_transpose``
    with ``transpose_kernel=True`` does that flip and swap itself, so the kernel is torch's, axes moved to
    ``(*k, out, in)``; with flax's default ``transpose_kernel=False`` it correlates with the kernel as
    stored, so it is stored flipped, ``(*k, in, out)``. Both give torch's outputs with the padding of
    :func:`conv_transpose_padding`."""

    def convert(w: np.ndarray) -> np.ndarray:
        n = w.ndim - 2
        if not flip:
            return w.transpose((*range(2, n + 2), 1, 0))
        return w.transpose((*range(2, n + 2), 0, 1))[(slice(None, None, -1),) * n]

    return convert


def _mha_targets(mod, mpath, torch_key, nnx_path, available) -> list[_Target]:
    """nn.MultiheadAttention: packed (or separate) q/k/v projections split per head."""
    proj = {name: getattr(mod, name) for name in ("query", "key", "value", "out")}
    rows = []  # (name, rows in the packed tensor)
    for name in ("query", "key", "value"):
        k = proj[name].kernel.get_value()
        rows.append((name, math.prod(k.shape[1:])))
    total = sum(r for _, r in rows)
    packed_key = torch_key(mpath + ("in_proj_weight",))
    separate = torch_key(mpath + ("q_proj_weight",)) in available and packed_key not in available
    same_in = len({proj[n].kernel.get_value().shape[0] for n in ("query", "key", "value")}) == 1
    use_packed = not separate and (same_in or packed_key in available)
    out: list[_Target] = []
    start = 0
    for name, n in rows:
        kvar = proj[name].kernel
        kshape = tuple(kvar.get_value().shape)  # (in, heads, head_dim)
        sl = slice(start, start + n)
        if use_packed:
            key, expect = packed_key, (total, kshape[0])
            convert = _PackedSlice(sl, kshape, transpose=True)
        else:
            key = torch_key(mpath + (f"{name[0]}_proj_weight",))
            expect, convert = (n, kshape[0]), _PackedSlice(slice(None), kshape, transpose=True)
        out.append(_Target(nnx_path(mpath + (name, "kernel")), kvar, key, expect, convert, mod, "MHA: in_proj split"))
        bvar = getattr(proj[name], "bias", None)
        if isinstance(bvar, nnx.Variable) and hasattr(bvar.get_value(), "shape"):
            bshape = tuple(bvar.get_value().shape)
            out.append(
                _Target(
                    nnx_path(mpath + (name, "bias")),
                    bvar,
                    torch_key(mpath + ("in_proj_bias",)),
                    (total,),
                    _PackedSlice(sl, bshape, transpose=False),
                    mod,
                    "MHA: in_proj_bias split",
                )
            )
        start += n
    o = proj["out"]
    oshape = tuple(o.kernel.get_value().shape)  # (heads, head_dim, out)
    out.append(
        _Target(
            nnx_path(mpath + ("out", "kernel")),
            o.kernel,
            torch_key(mpath + ("out_proj", "weight")),
            (oshape[-1], oshape[0] * oshape[1]),
            _OutProj(oshape),
            mod,
            "MHA: out_proj.weight.T per head",
        )
    )
    obias = getattr(o, "bias", None)
    if isinstance(obias, nnx.Variable) and hasattr(obias.get_value(), "shape"):
        out.append(
            _Target(
                nnx_path(mpath + ("out", "bias")),
                obias,
                torch_key(mpath + ("out_proj", "bias")),
                tuple(obias.get_value().shape),
                _same,
                mod,
                "MHA",
            )
        )
    return out


class _PackedSlice:
    """Rows ``sl`` of a (packed) projection, optionally transposed, reshaped to the NNX variable."""

    def __init__(self, sl: slice, shape: tuple[int, ...], transpose: bool) -> None:
        self.sl, self.shape, self.transpose = sl, shape, transpose

    def __call__(self, a: np.ndarray) -> np.ndarray:
        a = a[self.sl]
        return (a.T if self.transpose else a).reshape(self.shape)


class _OutProj:
    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape

    def __call__(self, a: np.ndarray) -> np.ndarray:
        return a.T.reshape(self.shape)


# ----------------------------------------------------------------------------------------- checking
def _rename(keys: Iterable[str], mapping: Mapping_ | None) -> dict[str, str]:
    """``{new key: source key}`` after applying ``mapping``; dropped keys are left out."""
    out: dict[str, str] = {}
    clashes: dict[str, list[str]] = {}
    if mapping is not None and not (callable(mapping) or isinstance(mapping, Mapping)):
        raise TypeError(f"mapping must be a dict or a callable, got {type(mapping).__name__}")
    for key in keys:
        new = _apply_mapping(key, mapping)
        if new is None:
            continue
        if not isinstance(new, str):
            raise TypeError(f"mapping returned {new!r} for {key!r}; it must return a str or None")
        if new in out:
            clashes.setdefault(new, [out[new]]).append(key)
        out[new] = key
    if clashes:
        listed = "; ".join(f"{sorted(v)} -> {k!r}" for k, v in sorted(clashes.items()))
        raise TorchWeightsError(f"mapping sends several source keys to the same name: {listed}")
    return out


def _apply_mapping(key: str, mapping: Mapping_ | None) -> str | None:
    if mapping is None:
        return key
    if not isinstance(mapping, Mapping):
        return mapping(key)
    if key in mapping:
        return mapping[key]
    best = None
    for prefix in mapping:
        if key.startswith(prefix) and (prefix.endswith(".") or key[len(prefix) : len(prefix) + 1] == "."):
            if best is None or len(prefix) > len(best):
                best = prefix
    if best is None:
        return key
    new = mapping[best]
    if new is None:
        return None
    rest = key[len(best) :]
    return rest.lstrip(".") if new == "" else new + rest


def _check(targets, ignored, renamed, src) -> tuple[set[str], set[str], dict[str, tuple]]:
    used = set()
    missing: set[str] = set()
    mismatched: dict[str, tuple] = {}
    for t in targets:
        if t.key not in renamed:
            missing.add(t.key)
            continue
        used.add(t.key)
        got = src.shape(renamed[t.key])
        if got is None:
            mismatched[t.key] = ("not an array", t)
        elif tuple(got) != tuple(t.expect):
            mismatched[t.key] = (tuple(got), t)
    unexpected = {k for k in renamed if k not in used and k not in ignored}
    return missing, unexpected, mismatched


def _mismatch_error(model, targets, renamed, missing, unexpected, mismatched, strict) -> TorchWeightsError:
    by_key: dict[str, list[_Target]] = {}
    for t in targets:
        by_key.setdefault(t.key, []).append(t)
    name = type(model).__name__
    head = [f"{len(missing)} missing", f"{len(unexpected)} unexpected", f"{len(mismatched)} mis-shaped"]
    lines = [f"cannot load the torch weights into {name}: {', '.join(head)} key(s); nothing was loaded"]

    def src_name(k: str) -> str:
        return k if renamed.get(k, k) == k else f"{k} (source key {renamed[k]!r})"

    if missing:
        lines.append("missing (the model has them, the source does not):")
        for k in sorted(missing):
            vs = by_key[k]
            lines.append(f"  {k}  -> {', '.join(v.path for v in vs)} {_shape_note(vs[0])}")
    if unexpected:
        lines.append("unexpected (in the source, not in the model):")
        for k in sorted(unexpected):
            close = difflib.get_close_matches(k, sorted(missing), n=1, cutoff=0.6)
            hint = f"  (did you mean {close[0]!r}? rename with mapping=)" if close else ""
            lines.append(f"  {src_name(k)}{hint}")
    if mismatched:
        lines.append("mis-shaped (source shape vs the shape this model needs):")
        for k in sorted(mismatched):
            got, t = mismatched[k]
            paths = ", ".join(v.path for v in by_key[k])
            lines.append(f"  {src_name(k)}: source {got}, expected {t.expect} for {paths} ({t.rule})")
    no_rule = sorted(
        {type(t.module).__name__ for t in targets if t.key in missing and t.rule.endswith("(as is)") and t.module}
        - {"Module"}
    )
    if no_rule and missing:
        lines.append(
            f"variables of {no_rule} are matched by their NNX name, as is (no torch layout rule for these types)"
        )
    if strict and (missing or unexpected):
        lines.append("rename keys with mapping=..., or pass strict=False to skip missing and unexpected keys")
    return TorchWeightsError(
        "\n".join(lines),
        missing=sorted(missing),
        unexpected=sorted(unexpected),
        mismatched=sorted(mismatched),
    )


def _shape_note(t: _Target) -> str:
    return f"{tuple(t.var.get_value().shape)}"


# ----------------------------------------------------------------------------------------- loading
def _is_concrete(v: Any) -> bool:
    return isinstance(v, (jax.Array, np.ndarray)) and not isinstance(v, jax.core.Tracer)


def _load(targets: list[_Target], renamed: dict[str, str], src: _Source) -> None:
    for t in targets:
        if isinstance(t.var.get_value(), jax.core.Tracer):
            raise RuntimeError(
                f"load_torch_weights was called inside a jax transformation ({t.path} is a tracer): it reads "
                f"files and places arrays, so call it outside jit/eval_shape (not in configure_model); load "
                f"into the module after the trainer has built it, or into a model created outside the trainer"
            )
    by_source: dict[str, list[_Target]] = {}
    for t in targets:
        if t.key in renamed:
            by_source.setdefault(renamed[t.key], []).append(t)
    for skey in src.names():  # file order: sequential reads of a memory-mapped file
        group = by_source.get(skey)
        if not group:
            continue
        raw = src.read(skey)
        for t in group:
            t.var.set_value(_place(t.convert(raw), t.var.get_value()))
        del raw  # one tensor at a time


def _place(full: np.ndarray, current: Any) -> jax.Array:
    """Build the new value on the sharding ``current`` has; each device gets only its slice."""
    shape, dtype = tuple(current.shape), np.dtype(current.dtype)
    sharding = getattr(current, "sharding", None)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    cache: dict[Any, np.ndarray] = {}  # replicas of the same slice are read once

    def slice_for(index: tuple) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) if isinstance(s, slice) else s for s in index)
        if key not in cache:
            cache[key] = np.array(full[index], dtype=dtype)  # a copy: never alias a memory-mapped file
        return cache[key]

    return jax.make_array_from_callback(shape, sharding, slice_for)


# ----------------------------------------------------------------------------------------- torch module checks
def _refuse_grouped_transposes(targets: list[_Target], renamed: dict[str, str], torch_module: Any) -> None:
    """``nnx.ConvTranspose`` has no ``feature_group_count``: a grouped torch ConvTranspose cannot be loaded
    into one (its weight, (in, out/groups, *k), may even fit an NNX layer with out/groups outputs)."""
    named = dict(torch_module.named_modules())
    grouped = []
    for t in targets:
        if isinstance(t.module, nnx.ConvTranspose) and t.key in renamed:
            name = torch_twin_name(renamed[t.key])
            groups = getattr(named.get(name), "groups", 1)
            if groups != 1:
                grouped.append(f"{name!r} (groups={groups}, NNX {t.path.rsplit('/', 1)[0]!r})")
    if grouped:
        raise TorchWeightsError(
            f"cannot load grouped transposed convolutions: {', '.join(sorted(set(grouped)))}. nnx.ConvTranspose "
            f"has no feature_group_count; split the layer into one nnx.ConvTranspose per group (torch's weight "
            f"rows in/groups at a time) or keep groups=1; nothing was loaded",
            mismatched=sorted({t.key for t in targets if isinstance(t.module, nnx.ConvTranspose)}),
        )
