"""Tagged JSON: an exact, code-free encoding of the host state a checkpoint carries.

Checkpoints hold the loop position, loader and callback states, hparams and
whatever ``on_save_checkpoint`` hooks add. Pickling them would make opening a
checkpoint run code, so they are stored as JSON instead. Plain JSON values
(``None``, ``bool``, ``int``, finite ``float``, ``str``, ``list`` and ``dict``
with ``str`` keys) are written as they are; every other supported type is a
JSON object tagged with ``"__type__"`` (see :data:`TAGS` and
docs/checkpointing.md), so that values come back with their exact type and
value. Arrays (numpy, torch, jax) larger than :data:`INLINE_ARRAY_BYTES` are
collected into a side table, which the checkpoint writes as an orbax item and
the JSON refers to by key; smaller ones (a torch generator state is 5 KB) are
inlined as the base64 of their bytes, which is exact and spares a save the
cost of another orbax item. With ``arrays=None`` (the cross-process gather of
loader states) every array is inlined, and so are arrays orbax cannot store.

Decoding only ever builds the listed types: a tag names no class to import and
no code to call, and anything unexpected raises :class:`DecodeError` with the
key path. Encoding a value outside the list raises :class:`EncodeError` with
the key path and type, before anything is written.
"""

from __future__ import annotations

import base64
import binascii
import collections
import datetime
import json
import math
import pathlib
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

TAG = "__type__"
INLINE_ARRAY_BYTES = 1 << 16  # arrays up to this size are inlined in the JSON; larger ones go to orbax

#: Every tag this version reads and writes (anything else is refused when decoding).
TAGS = (
    "float",
    "complex",
    "bytes",
    "bytearray",
    "tuple",
    "set",
    "frozenset",
    "dict",
    "collections.OrderedDict",
    "numpy.scalar",
    "numpy.ndarray",
    "torch.Tensor",
    "jax.Array",
    "numpy.dtype",
    "torch.dtype",
    "pathlib.Path",
    "datetime.timedelta",
)

SUPPORTED = (
    "None, bool, int, float (nan and inf included), str, bytes, bytearray, complex, list, tuple, set, frozenset, "
    "dict (keys of any supported hashable type), collections.OrderedDict, numpy arrays and scalars (bool, int, "
    "uint, float, complex, bfloat16 and the other ml_dtypes, str/bytes arrays), torch tensors (CPU, restored on "
    "the CPU), jax arrays (fully addressable or fully replicated; restored on the default device; typed PRNG "
    "keys included), numpy/jax/torch dtypes, pathlib paths, datetime.timedelta"
)

# Arrays of these dtypes go to orbax (tensorstore stores them natively); other supported dtypes are inlined.
_ORBAX_DTYPES = frozenset(
    ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
    + ["float16", "float32", "float64", "complex64", "complex128", "bfloat16"]
)
_ML_DTYPES = frozenset(
    [
        "bfloat16",
        "float8_e3m4",
        "float8_e4m3",
        "float8_e4m3b11fnuz",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn",
        "float6_e2m3fn",
        "float6_e3m2fn",
        "int2",
        "int4",
        "uint2",
        "uint4",
    ]
)
_NUMERIC_DTYPES = _ORBAX_DTYPES | _ML_DTYPES
_STR_DTYPE = re.compile(r"[<>|=]?[US][0-9]{1,9}")
# The torch dtypes a checkpoint may name, by the name torch prints (and its aliases). A tag is looked up on the
# torch module only when its name is listed here: any other attribute lookup on torch may import a submodule
# (torch loads ``torch._dynamo`` and others lazily on attribute access), which opening a file must never do.
_TORCH_DTYPES = frozenset(
    ["bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64"]
    + ["float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128"]
    + ["float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2"]
    + ["qint8", "qint32", "quint8", "quint4x2", "quint2x4"]
    + ["half", "float", "double", "short", "int", "long", "cfloat", "cdouble", "chalf"]
)
#: The PRNG implementations a stored key may name (jax registers them under these names).
KEY_IMPLS = ("threefry2x32", "threefry4x32", "philox2x32", "philox4x32", "rbg", "unsafe_rbg")
_PATH_CLASSES = ("PurePath", "PurePosixPath", "PureWindowsPath", "Path", "PosixPath", "WindowsPath")


class EncodeError(TypeError):
    """A value that tagged JSON cannot represent; ``path`` is its key path, ``type_name`` its type."""

    def __init__(self, path: str, type_name: str, reason: str = "") -> None:
        self.path, self.type_name, self.reason = path, type_name, reason
        why = f" ({reason})" if reason else ""
        super().__init__(f"{path or '<root>'} has type {type_name}{why}; supported types: {SUPPORTED}")


class DecodeError(ValueError):
    """Tagged JSON that is malformed or names something this version does not read; ``path`` says where."""

    def __init__(self, path: str, problem: str) -> None:
        self.path, self.problem = path, problem
        super().__init__(f"{path or '<root>'}: {problem}")


# ---------------------------------------------------------------------------- dtypes
def _dtype(name: Any, path: str) -> np.dtype:
    """A numpy dtype from its stored name, only from the supported list (never ``object`` or structured)."""
    if isinstance(name, str) and (name in _NUMERIC_DTYPES or _STR_DTYPE.fullmatch(name)):
        if name in _ML_DTYPES:
            import ml_dtypes

            return np.dtype(getattr(ml_dtypes, name))
        return np.dtype(name)
    raise DecodeError(path, f"dtype {name!r} is not one a checkpoint may hold")


def _dtype_name(dt: np.dtype) -> str | None:
    """The stored name of a supported dtype (native byte order), or None."""
    if dt.kind in "US":
        return dt.newbyteorder("=").str if dt.kind == "U" else dt.str
    return dt.name if dt.name in _NUMERIC_DTYPES and dt.names is None else None


def _type_name(x: Any) -> str:
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _is_torch(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, (torch.Tensor, torch.dtype))


def _is_jax_array(x: Any) -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.Array)


def _is_jax_scalar_type(x: Any) -> bool:
    # jnp.float32 and friends: what JAX users pass as dtype= hparams
    return type(x).__name__ == "_ScalarMeta" and type(x).__module__.startswith("jax.")


# ---------------------------------------------------------------------------- encoding
class _Encoder:
    def __init__(self, arrays: dict[str, np.ndarray] | None) -> None:
        self.arrays = arrays
        self.active: set[int] = set()  # containers on the current path (cycle detection)

    def __call__(self, x: Any, path: str) -> Any:
        t = type(x)
        if x is None or t is bool or t is str or t is int:
            return x
        if t is float:
            if math.isfinite(x):
                return x
            return {TAG: "float", "value": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}
        if t in (list, tuple, set, frozenset, dict, collections.OrderedDict):
            if id(x) in self.active:
                raise EncodeError(path, t.__name__, "it contains itself (a reference cycle)")
            self.active.add(id(x))
            try:
                return self._container(x, t, path)
            finally:
                self.active.discard(id(x))
        if t is complex:
            return {TAG: "complex", "real": self(x.real, path), "imag": self(x.imag, path)}
        if t is bytes or t is bytearray:
            return {TAG: t.__name__, "base64": base64.b64encode(bytes(x)).decode("ascii")}
        if isinstance(x, np.generic):
            return self._numpy_scalar(x, path)
        if t is np.ndarray:
            return self._array(x, "numpy.ndarray", path)
        if isinstance(x, np.dtype):
            return self._dtype_tag(x, "dtype", path)
        if isinstance(x, type) and issubclass(x, np.generic):
            return self._dtype_tag(np.dtype(x), "numpy", path)
        if _is_jax_scalar_type(x):
            return self._dtype_tag(np.dtype(x.dtype), "jax.numpy", path)
        if _is_torch(x):
            return self._torch(x, path)
        if _is_jax_array(x):
            return self._jax(x, path)
        if isinstance(x, pathlib.PurePath) and t.__name__ in _PATH_CLASSES and t.__module__ == "pathlib":
            return {TAG: "pathlib.Path", "class": t.__name__, "value": str(x)}
        if t is datetime.timedelta:
            return {TAG: "datetime.timedelta", "days": x.days, "seconds": x.seconds, "microseconds": x.microseconds}
        reason = "a named tuple" if isinstance(x, tuple) else ""
        raise EncodeError(path, _type_name(x), reason)

    def _container(self, x: Any, t: type, path: str) -> Any:
        if t is list:
            return [self(v, f"{path}[{i}]") for i, v in enumerate(x)]
        if t is tuple:
            return {TAG: "tuple", "items": [self(v, f"{path}[{i}]") for i, v in enumerate(x)]}
        if t is set or t is frozenset:
            items = [self(v, f"{path}{{{v!r}}}") for v in x]
            items.sort(key=lambda e: json.dumps(e, sort_keys=True))  # deterministic files
            return {TAG: t.__name__, "items": items}
        if t is dict and all(type(k) is str for k in x) and TAG not in x:
            return {k: self(v, f"{path}[{k!r}]") for k, v in x.items()}
        pairs = [[self(k, f"{path}<key {k!r}>"), self(v, f"{path}[{k!r}]")] for k, v in x.items()]
        return {TAG: "dict" if t is dict else "collections.OrderedDict", "items": pairs}

    def _numpy_scalar(self, x: np.generic, path: str) -> Any:
        name = _dtype_name(x.dtype)
        if name is None or x.dtype.kind in "US":
            raise EncodeError(path, _type_name(x), f"dtype {x.dtype} is not supported for scalars")
        value = x.item()
        if x.dtype.kind == "c":
            value = complex(value)
        return {TAG: "numpy.scalar", "dtype": name, "value": self(value, path)}

    def _dtype_tag(self, dt: np.dtype, kind: str, path: str) -> Any:
        name = _dtype_name(dt)
        if name is None:
            raise EncodeError(path, f"dtype {dt}", "not a supported dtype")
        return {TAG: "numpy.dtype", "name": name, "as": kind}

    def _array(self, a: np.ndarray, tag: str, path: str, **extra: Any) -> Any:
        if a.dtype.kind in "OV" and a.dtype.name not in _ML_DTYPES:
            raise EncodeError(path, f"{tag} of dtype {a.dtype}", "object and structured arrays cannot be stored")
        name = _dtype_name(a.dtype)
        if name is None:
            raise EncodeError(path, f"{tag} of dtype {a.dtype}", "unsupported dtype")
        a = np.array(a, dtype=_dtype(name, path), order="C", copy=True)  # native order, owned (saves may be async)
        out = {TAG: tag, "dtype": name, "shape": list(a.shape), **extra}
        if self.arrays is not None and a.nbytes > INLINE_ARRAY_BYTES and name in _ORBAX_DTYPES:
            key = str(len(self.arrays))
            self.arrays[key] = a
            out["ref"] = key
        else:  # small arrays, the gather, and dtypes orbax cannot store carry their bytes inline
            out["data"] = base64.b64encode(a.tobytes()).decode("ascii")
        return out

    def _torch(self, x: Any, path: str) -> Any:
        import torch

        if isinstance(x, torch.dtype):
            name = str(x).removeprefix("torch.")
            if name not in _TORCH_DTYPES or getattr(torch, name, None) is not x:
                raise EncodeError(path, f"torch dtype {x}", "not one of the torch dtypes a checkpoint may hold")
            return {TAG: "torch.dtype", "name": name}
        if type(x) is not torch.Tensor:
            raise EncodeError(path, _type_name(x), "only plain torch.Tensor is supported")
        if x.layout != torch.strided or x.is_quantized or x.device.type == "meta":
            raise EncodeError(path, f"torch.Tensor ({x.layout}, {x.device})", "only dense tensors with data")
        t = x.detach().cpu().resolve_conj().resolve_neg()
        try:
            a = (
                t.view(torch.int16).numpy().view(np.dtype(_dtype("bfloat16", path)))
                if t.dtype == torch.bfloat16
                else t.numpy()
            )
        except TypeError as e:
            raise EncodeError(path, f"torch.Tensor of dtype {t.dtype}", "no numpy equivalent") from e
        return self._array(a, "torch.Tensor", path)

    def _jax(self, x: Any, path: str) -> Any:
        import jax

        extra = {}
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            extra["key_impl"] = str(jax.random.key_impl(x))
            if extra["key_impl"] not in KEY_IMPLS:
                raise EncodeError(path, f"PRNG key of implementation {extra['key_impl']!r}", f"not one of {KEY_IMPLS}")
            x = jax.random.key_data(x)
        if not (x.is_fully_addressable or x.is_fully_replicated):
            raise EncodeError(
                path, f"jax.Array {x.shape} sharded over processes", "host state must be addressable on each process"
            )
        return self._array(np.asarray(jax.device_get(x)), "jax.Array", path, **extra)


def encode(value: Any, *, root: str = "", arrays: dict[str, np.ndarray] | None = None) -> Any:
    """``value`` as JSON-ready data (tagged where plain JSON would lose the type).

    With an ``arrays`` dict, arrays over :data:`INLINE_ARRAY_BYTES` of
    orbax-storable dtypes are moved there under fresh keys ("0", "1", ...) and
    referred to by key; all other arrays are inlined as base64. Raises :class:`EncodeError` naming the key
    path (``root`` plus ``['key'][index]`` steps) of the first value it cannot
    represent.
    """
    try:
        return _Encoder(arrays)(value, root)
    except RecursionError:
        raise EncodeError(root, _type_name(value), "nested too deeply") from None


def dumps(value: Any, *, root: str = "") -> str:
    """Compact tagged JSON text with arrays inlined (no side table)."""
    return json.dumps(encode(value, root=root), separators=(",", ":"), allow_nan=False)


# ---------------------------------------------------------------------------- decoding
ArrayLoader = Callable[[str, np.dtype, tuple, str], Any]

_FIELDS: dict[str, set[str]] = {
    "float": {"value"},
    "complex": {"real", "imag"},
    "bytes": {"base64"},
    "bytearray": {"base64"},
    "tuple": {"items"},
    "set": {"items"},
    "frozenset": {"items"},
    "dict": {"items"},
    "collections.OrderedDict": {"items"},
    "numpy.scalar": {"dtype", "value"},
    "numpy.dtype": {"name", "as"},
    "torch.dtype": {"name"},
    "pathlib.Path": {"class", "value"},
    "datetime.timedelta": {"days", "seconds", "microseconds"},
}
_ARRAY_TAGS = ("numpy.ndarray", "torch.Tensor", "jax.Array")


class _Decoder:
    def __init__(self, load: ArrayLoader | None, convert: bool) -> None:
        self.load = load
        self.convert = convert  # False: only check and collect array references

    def __call__(self, d: Any, path: str) -> Any:
        t = type(d)
        if d is None or t in (bool, int, float, str):
            return d
        if t is list:
            return [self(v, f"{path}[{i}]") for i, v in enumerate(d)]
        if t is not dict:
            raise DecodeError(path, f"unexpected JSON value of type {t.__name__}")
        if TAG not in d:
            return {k: self(v, f"{path}[{k!r}]") for k, v in d.items()}
        tag = d[TAG]
        if type(tag) is not str:
            raise DecodeError(path, f"type tag must be a string, got {type(tag).__name__}")
        if tag in _ARRAY_TAGS:
            return self._array(d, tag, path)
        if tag not in _FIELDS:
            raise DecodeError(
                path, f"unknown type tag {tag!r}; this jaxlight reads only {', '.join(TAGS)} (nothing is executed)"
            )
        self._fields(d, _FIELDS[tag], set(), path)
        return getattr(self, "_" + tag.replace(".", "_"))(d, path)

    @staticmethod
    def _fields(d: dict, required: set[str], optional: set[str], path: str) -> None:
        have = set(d) - {TAG}
        if not required <= have or not have <= required | optional:
            raise DecodeError(
                path, f"malformed {d[TAG]!r} value: fields {sorted(have)}, expected {sorted(required | optional)}"
            )

    @staticmethod
    def _want(v: Any, types: tuple, what: str, path: str) -> Any:
        if type(v) not in types:
            raise DecodeError(path, f"{what} must be {'/'.join(t.__name__ for t in types)}, got {type(v).__name__}")
        return v

    def _items(self, d: dict, path: str) -> list:
        return [self(v, f"{path}[{i}]") for i, v in enumerate(self._want(d["items"], (list,), "items", path))]

    def _float(self, d: dict, path: str) -> float:
        v = d["value"]
        if v not in ("nan", "inf", "-inf"):
            raise DecodeError(path, f"float value must be 'nan', 'inf' or '-inf', got {v!r}")
        return float(v)

    def _complex(self, d: dict, path: str) -> complex:
        re_, im = self(d["real"], path), self(d["imag"], path)
        return complex(self._want(re_, (float, int), "real", path), self._want(im, (float, int), "imag", path))

    def _b64(self, d: dict, field: str, path: str) -> bytes:
        try:
            return base64.b64decode(self._want(d[field], (str,), field, path), validate=True)
        except (binascii.Error, ValueError) as e:
            raise DecodeError(path, f"invalid base64 in {field!r}: {e}") from None

    def _bytes(self, d: dict, path: str) -> bytes:
        return self._b64(d, "base64", path)

    def _bytearray(self, d: dict, path: str) -> bytearray:
        return bytearray(self._b64(d, "base64", path))

    def _tuple(self, d: dict, path: str) -> tuple:
        return tuple(self._items(d, path))

    def _hashable(self, make: Callable, items: Any, path: str) -> Any:
        try:
            return make(items)
        except TypeError as e:
            raise DecodeError(path, f"unhashable key or set item ({e})") from None

    def _set(self, d: dict, path: str) -> set:
        return self._hashable(set, self._items(d, path), path)

    def _frozenset(self, d: dict, path: str) -> frozenset:
        return self._hashable(frozenset, self._items(d, path), path)

    def _pairs(self, d: dict, path: str) -> list:
        out = []
        for i, p in enumerate(self._want(d["items"], (list,), "items", path)):
            if type(p) is not list or len(p) != 2:
                raise DecodeError(f"{path}[{i}]", "dict items must be [key, value] pairs")
            k = self(p[0], f"{path}<key {i}>")
            out.append((k, self(p[1], f"{path}[{k!r}]")))
        return out

    def _dict(self, d: dict, path: str) -> dict:
        return self._hashable(dict, self._pairs(d, path), path)

    def _collections_OrderedDict(self, d: dict, path: str) -> collections.OrderedDict:
        return self._hashable(collections.OrderedDict, self._pairs(d, path), path)

    def _numpy_scalar(self, d: dict, path: str) -> Any:
        dt = _dtype(d["dtype"], path)
        if dt.kind in "US":
            raise DecodeError(path, f"dtype {d['dtype']!r} is not a scalar dtype")
        value = self(d["value"], path)
        want = {"b": (bool,), "i": (int,), "u": (int,), "c": (complex,)}.get(dt.kind, (float, int))
        self._want(value, want, "numpy scalar value", path)
        try:
            return dt.type(value)
        except (OverflowError, ValueError) as e:
            raise DecodeError(path, f"{value!r} does not fit {dt}: {e}") from None

    def _numpy_dtype(self, d: dict, path: str) -> Any:
        dt = _dtype(d["name"], path)
        kind = d["as"]
        if kind == "dtype":
            return dt
        if kind == "numpy":
            return dt.type
        if kind == "jax.numpy":
            import jax.numpy as jnp

            obj = getattr(jnp, dt.name, None)
            if obj is None or not _is_jax_scalar_type(obj):
                raise DecodeError(path, f"jax.numpy has no scalar type {dt.name!r}")
            return obj
        raise DecodeError(path, f"numpy.dtype 'as' must be 'dtype', 'numpy' or 'jax.numpy', got {kind!r}")

    def _torch_dtype(self, d: dict, path: str) -> Any:
        name = self._want(d["name"], (str,), "name", path)
        if name not in _TORCH_DTYPES:  # checked before torch is touched (see _TORCH_DTYPES)
            raise DecodeError(path, f"torch has no dtype {name!r} that a checkpoint may hold")
        if not self.convert:
            return None
        import torch

        obj = getattr(torch, name, None)
        if not isinstance(obj, torch.dtype):
            raise DecodeError(path, f"this torch has no dtype {name!r}")
        return obj

    def _pathlib_Path(self, d: dict, path: str) -> pathlib.PurePath:
        cls = d["class"]
        if cls not in _PATH_CLASSES:
            raise DecodeError(path, f"path class must be one of {_PATH_CLASSES}, got {cls!r}")
        value = self._want(d["value"], (str,), "value", path)
        try:
            return getattr(pathlib, cls)(value)
        except NotImplementedError:  # a WindowsPath read on POSIX (or the reverse)
            return pathlib.Path(value)

    def _datetime_timedelta(self, d: dict, path: str) -> datetime.timedelta:
        parts = {k: self._want(d[k], (int,), k, path) for k in ("days", "seconds", "microseconds")}
        try:
            return datetime.timedelta(**parts)
        except OverflowError as e:
            raise DecodeError(path, f"timedelta out of range: {e}") from None

    def _array(self, d: dict, tag: str, path: str) -> Any:
        optional = {"key_impl"} if tag == "jax.Array" else set()
        has_ref, has_data = "ref" in d, "data" in d
        if has_ref == has_data:
            raise DecodeError(path, f"an array needs exactly one of 'ref' and 'data', got fields {sorted(d)}")
        self._fields(d, {"dtype", "shape", "ref" if has_ref else "data"}, optional, path)
        dt = _dtype(d["dtype"], path)
        shape = self._want(d["shape"], (list,), "shape", path)
        if not all(type(n) is int and 0 <= n < 2**62 for n in shape) or len(shape) > 64:
            raise DecodeError(path, f"invalid array shape {shape!r}")
        shape = tuple(shape)
        if has_data:
            raw = self._b64(d, "data", path)
            if len(raw) != math.prod(shape) * dt.itemsize:
                raise DecodeError(path, f"{len(raw)} bytes of data for a {dt} array of shape {shape}")
            a = np.frombuffer(raw, dtype=dt).reshape(shape).copy()
        else:
            ref = self._want(d["ref"], (str,), "ref", path)
            if self.load is None:
                raise DecodeError(path, f"array refers to stored array {ref!r} but no stored arrays were given")
            a = self.load(ref, dt, shape, path)
        if "key_impl" in d and self._want(d["key_impl"], (str,), "key_impl", path) not in KEY_IMPLS:
            raise DecodeError(path, f"PRNG implementation {d['key_impl']!r} is not one of {KEY_IMPLS}")
        if not self.convert:
            return None
        if tag == "torch.Tensor":
            return _to_torch(a, path)
        if tag == "jax.Array":
            return _to_jax(a, d.get("key_impl"), path)
        return a


def _to_torch(a: np.ndarray, path: str) -> Any:
    import torch

    if a.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    try:
        return torch.from_numpy(np.ascontiguousarray(a))
    except TypeError as e:
        raise DecodeError(path, f"torch cannot hold a {a.dtype} array: {e}") from None


def _to_jax(a: np.ndarray, key_impl: str | None, path: str) -> Any:
    import jax
    import jax.numpy as jnp

    if key_impl is None:
        return jnp.asarray(a)
    try:
        return jax.random.wrap_key_data(a, impl=key_impl)
    except (ValueError, TypeError, KeyError) as e:
        raise DecodeError(
            path, f"cannot rebuild a {key_impl!r} PRNG key from a {a.dtype}{a.shape} array: {e}"
        ) from None


def decode(data: Any, *, root: str = "", load_array: ArrayLoader | None = None) -> Any:
    """The value :func:`encode` was given, rebuilt from JSON-ready ``data``.

    ``load_array(ref, dtype, shape, path)`` returns the stored array a ``ref``
    names (from the orbax item); inline arrays need no loader. Raises
    :class:`DecodeError` (with the key path) for unknown tags, malformed
    values and disallowed dtypes.
    """
    try:
        return _Decoder(load_array, convert=True)(data, root)
    except RecursionError:
        raise DecodeError(root, "nested too deeply") from None


def array_refs(data: Any, *, root: str = "") -> dict[str, tuple[np.dtype, tuple]]:
    """``{ref: (dtype, shape)}`` of the stored arrays ``data`` refers to, after checking all of it decodes."""
    refs: dict[str, tuple[np.dtype, tuple]] = {}

    def note(ref: str, dt: np.dtype, shape: tuple, path: str) -> None:
        if refs.setdefault(ref, (dt, shape)) != (dt, shape):
            raise DecodeError(path, f"stored array {ref!r} is referred to with two different dtypes/shapes")

    try:
        _Decoder(note, convert=False)(data, root)
    except RecursionError:
        raise DecodeError(root, "nested too deeply") from None
    return refs


def loads(text: str | bytes, *, root: str = "") -> Any:
    """Inverse of :func:`dumps`; :class:`DecodeError` for malformed text."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise DecodeError(root, f"not valid JSON: {e}") from None
    return decode(data, root=root)


# ---------------------------------------------------------------------------- readable copies
def plain(value: Any, max_elements: int = 64) -> Any:
    """A lossy, readable view for YAML (``hparams.yaml``): plain containers, arrays as lists or a summary."""
    if isinstance(value, Mapping):
        return {
            k if isinstance(k, (str, int, float, bool)) else str(k): plain(v, max_elements) for k, v in value.items()
        }
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return [plain(v, max_elements) for v in items]
    if value is None or type(value) in (bool, int, float, str, bytes):
        return value
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return value.item()
    if hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, type):
        try:
            a = np.asarray(value)
            if a.size <= max_elements and a.dtype.kind in "biufUS":
                return a.tolist()
        except Exception:  # e.g. a PRNG key array: summarised below
            pass
        return f"<{type(value).__name__} {value.dtype} {tuple(value.shape)}>"
    return str(value)


__all__ = [
    "INLINE_ARRAY_BYTES",
    "KEY_IMPLS",
    "SUPPORTED",
    "TAG",
    "TAGS",
    "DecodeError",
    "EncodeError",
    "array_refs",
    "decode",
    "dumps",
    "encode",
    "loads",
    "plain",
]
