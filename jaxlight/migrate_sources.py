"""Where ``load_torch_weights`` reads from: state dicts, torch modules, ``.pt``/``.safetensors`` files.

Each source lists its keys and shapes without reading data and returns one tensor at a time as numpy;
torch files are read with ``torch.load(weights_only=True, mmap=True)``, never unpickled.
``TorchWeightsError`` lives here so that both ``jaxlight.migrate`` (which re-exports it) and the sources
can raise it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

import ml_dtypes  # also registers bfloat16 & co. with numpy, so safetensors can return them
import numpy as np

from jaxlight.integrations import require


class TorchWeightsError(ValueError):
    """The source does not fit the model. ``missing``, ``unexpected`` and ``mismatched`` list every
    problem found (torch-style keys); nothing was loaded."""

    def __init__(
        self, message: str, missing: list[str] = (), unexpected: list[str] = (), mismatched: list[str] = ()
    ) -> None:
        super().__init__(message)
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)


class _Source:
    """Keys, shapes (without reading data) and one tensor at a time as numpy."""

    torch_module: Any = None

    def names(self) -> list[str]:
        raise NotImplementedError

    def shape(self, key: str) -> tuple[int, ...] | None:
        raise NotImplementedError

    def read(self, key: str) -> np.ndarray:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _MappingSource(_Source):
    def __init__(self, d: Mapping[str, Any], origin: str = "the state_dict") -> None:
        bad = [k for k in d if not isinstance(k, str)]
        if bad:
            raise TorchWeightsError(f"{origin} has non-string keys: {bad[:5]}")
        self.d, self.origin = d, origin

    def names(self) -> list[str]:
        return list(self.d)

    def shape(self, key: str) -> tuple[int, ...] | None:
        v = self.d[key]
        return tuple(v.shape) if hasattr(v, "shape") and hasattr(v, "dtype") else None

    def read(self, key: str) -> np.ndarray:
        return _to_numpy(self.d[key], f"{key!r} of {self.origin}")


def _to_numpy(v: Any, what: str) -> np.ndarray:
    if type(v).__module__.startswith("torch"):
        import torch

        if isinstance(v, torch.Tensor):
            t = v.detach()
            if t.is_meta:
                raise TorchWeightsError(f"{what} is a meta tensor: it has no data to load")
            if t.device.type != "cpu":
                t = t.cpu()
            if t.dtype == torch.bfloat16:
                return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
            try:
                return t.numpy()
            except TypeError:  # dtypes numpy lacks (float8, ...): go through float32
                return t.float().numpy()
    return np.asarray(v)


class _SafetensorsSource(_Source):
    def __init__(self, path: str) -> None:
        require("safetensors", f"reading {path}")
        from safetensors import safe_open

        self.path = path
        try:
            self._cm = safe_open(path, framework="numpy")
            self.f = self._cm.__enter__()
            self._keys = list(self.f.keys())
        except Exception as e:
            raise TorchWeightsError(f"cannot read safetensors file {path}: {e}") from e

    def names(self) -> list[str]:
        return self._keys

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.f.get_slice(key).get_shape())

    def read(self, key: str) -> np.ndarray:
        try:
            return self.f.get_tensor(key)
        except Exception as e:
            raise TorchWeightsError(f"cannot read tensor {key!r} from {self.path}: {e}") from e

    def close(self) -> None:
        self._cm.__exit__(None, None, None)


def _torch_file(path: str) -> _MappingSource:
    import pickle

    from jaxlight.integrations import require

    require("torch", f"reading the torch file {path}")
    import torch

    try:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e) and "zipfile" not in str(e):
                raise
            obj = torch.load(path, map_location="cpu", weights_only=True)  # legacy (non-zip) format
    except pickle.UnpicklingError as e:
        text = str(e)
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
        if found is None:
            detail = re.search(r"WeightsUnpickler error:\s*(.+)", text)
            raise TorchWeightsError(
                f"cannot read torch file {path}: not a torch.save file of tensors"
                + (f" ({detail.group(1).strip()})" if detail else f" ({text.splitlines()[0]})")
            ) from e
        raise TorchWeightsError(
            f"{path} holds Python objects besides tensors ({found.group(1)}), and jaxlight never unpickles "
            f"files (torch.load(weights_only=True)); save only the weights: torch.save(model.state_dict(), path)"
        ) from e
    except Exception as e:
        raise TorchWeightsError(f"cannot read torch file {path}: {type(e).__name__}: {e}") from e
    return _MappingSource(_state_dict_of(obj, path), path)


def _state_dict_of(obj: Any, origin: str) -> Mapping[str, Any]:
    """The tensors of a loaded file: a plain state_dict, or one nested under a usual key."""

    def is_tensors(d: Any) -> bool:
        return isinstance(d, Mapping) and all(hasattr(v, "shape") for v in d.values())

    if is_tensors(obj):
        return obj
    if isinstance(obj, Mapping):
        for k in ("state_dict", "model", "module", "model_state_dict"):
            if is_tensors(obj.get(k)):
                return obj[k]
        kinds = {k: type(v).__name__ for k, v in list(obj.items())[:10]}
        raise TorchWeightsError(
            f"{origin} is a dict but not a state_dict (top-level entries: {kinds}); pass the state_dict "
            f"itself, e.g. load_torch_weights(model, torch.load(path, weights_only=True)['<key>'])"
        )
    raise TorchWeightsError(f"{origin} holds a {type(obj).__name__}, not a state_dict")


class _IndexSource(_Source):
    """A sharded checkpoint: ``{"weight_map": {key: file}}`` next to its files, opened lazily."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            with open(path) as f:
                data = json.load(f)
            self.weight_map: dict[str, str] = dict(data["weight_map"])
        except Exception as e:
            raise TorchWeightsError(f"cannot read checkpoint index {path}: {type(e).__name__}: {e}") from e
        self.dir = os.path.dirname(os.path.abspath(path))
        self._open: dict[str, _Source] = {}

    def _file(self, key: str) -> _Source:
        name = self.weight_map[key]
        if name not in self._open:
            self._open[name] = _file_source(os.path.join(self.dir, name))
        return self._open[name]

    def names(self) -> list[str]:
        return sorted(self.weight_map, key=lambda k: (self.weight_map[k], k))  # file by file

    def shape(self, key: str) -> tuple[int, ...] | None:
        return self._file(key).shape(key)

    def read(self, key: str) -> np.ndarray:
        return self._file(key).read(key)

    def close(self) -> None:
        for s in self._open.values():
            s.close()


_DIR_CANDIDATES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def _file_source(path: str) -> _Source:
    if os.path.isdir(path):
        for name in _DIR_CANDIDATES:
            if os.path.exists(os.path.join(path, name)):
                return _file_source(os.path.join(path, name))
        raise TorchWeightsError(f"directory {path} holds none of {list(_DIR_CANDIDATES)}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such weights file: {path}")
    if path.endswith(".safetensors"):
        return _SafetensorsSource(path)
    if path.endswith(".json"):
        return _IndexSource(path)
    if path.endswith((".pt", ".pth", ".bin", ".ckpt")):
        return _torch_file(path)
    raise TorchWeightsError(
        f"{path}: unknown weights format; expected .safetensors, .pt, .pth, .bin, .ckpt, an *.index.json or a directory"
    )


def _open_source(source: Any) -> _Source:
    if isinstance(source, (str, os.PathLike)):
        return _file_source(os.fspath(source))
    if type(source).__module__.startswith("torch") or hasattr(source, "state_dict"):
        try:
            import torch
        except ImportError:  # pragma: no cover - no torch, so it cannot be a torch module
            torch = None
        if torch is not None and isinstance(source, torch.nn.Module):
            src = _MappingSource(source.state_dict(), f"{type(source).__name__}.state_dict()")
            src.torch_module = source
            return src
    if isinstance(source, Mapping):
        return _MappingSource(source)
    raise TypeError(
        f"source must be a state_dict, a torch.nn.Module or a path to a weights file, got {type(source).__name__}"
    )
