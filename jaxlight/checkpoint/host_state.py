"""The host state of a checkpoint: Lightning's checkpoint dict, stored as tagged JSON, never pickled.

The ``meta`` item's ``host_state`` field holds a dict in Lightning's checkpoint
shape (loop position, dataloader state, callback ``state_dict``s, datamodule
and logger state, hparams, and whatever ``on_save_checkpoint`` hooks added) in
tagged JSON (:mod:`jaxlight.serialization`). The arrays over 64 KiB inside it
(arrays in callback or loader states) go to the ``host_arrays`` item as numpy
arrays keyed "0", "1", ..., which ``host_state`` refers to; smaller arrays,
such as a torch generator's state, are inlined in the JSON as base64.

Nothing in a checkpoint is pickled, so opening one never runs code: decoding
builds only a fixed list of plain types.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from jaxlight import serialization
from jaxlight.checkpoint.format import FORMAT_VERSION, META_FILE, listing, restore_numpy_item, stored_shapes
from jaxlight.checkpoint.schema import check_host
from jaxlight.errors import CheckpointError

HOST_ARRAYS = "host_arrays"  # the orbax item holding the host state's large arrays


# ---------------------------------------------------------------------------- writing
def save_error(e: serialization.EncodeError) -> CheckpointError:
    """A save-time error naming the key path and type, and what to do about it."""
    path = e.path
    if path.startswith(("checkpoint['hyper_parameters'][", "checkpoint['datamodule_hyper_parameters'][")):
        name = path.split("][", 1)[1].split("]", 1)[0]
        owner = "datamodule" if path.startswith("checkpoint['datamodule_") else "module"
        advice = (
            f"it is a hyperparameter of the {owner}: leave it out with self.save_hyperparameters(ignore=[{name}]) "
            f"and pass it again when loading (load_from_checkpoint(path, {name.strip(chr(39))}=...))"
        )
    elif path.startswith("checkpoint['callbacks']["):
        advice = "it comes from that callback's state_dict(); return only plain data there"
    elif path.startswith("checkpoint['loops']['fit_loop']['loader_state"):
        advice = "it comes from the train dataloader's state_dict()"
    elif path.startswith("checkpoint['datamodule']"):
        advice = "it comes from the datamodule's state_dict()"
    elif path.startswith("checkpoint['loggers']"):
        advice = "it comes from a logger's state_dict()"
    else:
        advice = "it was added to the checkpoint dict by an on_save_checkpoint hook"
    why = f" ({e.reason})" if e.reason else ""
    return CheckpointError(
        f"cannot save the checkpoint: {path} has type {e.type_name}{why}, which a jaxlight checkpoint cannot "
        f"store; {advice}. Checkpoints hold data only, never pickles, so that opening one cannot run code. "
        f"Supported types: {serialization.SUPPORTED}"
    )


def encode_host(ckpt: dict[str, Any]) -> tuple[Any, dict[str, np.ndarray]]:
    """The host dict as tagged JSON plus the arrays it refers to (for the ``host_arrays`` item)."""
    arrays: dict[str, np.ndarray] = {}
    try:
        state = serialization.encode(ckpt, root="checkpoint", arrays=arrays)
    except serialization.EncodeError as e:
        raise save_error(e) from None
    return state, arrays


def hparams_text(ckpt: Mapping[str, Any]) -> str:
    """The readable ``hparams.yaml`` of a host dict."""
    import yaml

    return yaml.safe_dump(serialization.plain(ckpt.get("hyper_parameters") or {}), sort_keys=False)


def check_hparams(module: Any, datamodule: Any = None) -> None:
    """Raise now the :class:`CheckpointError` a save would raise for hyperparameters that a checkpoint
    cannot store (the trainer calls it at fit start when checkpointing is on, so no epoch is lost to it)."""
    pairs = [("checkpoint['hyper_parameters']", getattr(module, "hparams", None))]
    if datamodule is not None:
        pairs.append(("checkpoint['datamodule_hyper_parameters']", getattr(datamodule, "hparams", None)))
    for root, hp in pairs:
        if not hp:
            continue
        try:
            serialization.encode(dict(hp), root=root)
        except serialization.EncodeError as e:
            raise save_error(e) from None


# ---------------------------------------------------------------------------- reading
def host_checkpoint(meta: Mapping[str, Any], path: str | os.PathLike | None = None) -> dict[str, Any]:
    """The Lightning-shaped host dict of a checkpoint (``epoch``, ``global_step``, ``loops``, ``callbacks``,
    ``hyper_parameters``, ...), decoded from ``meta`` (from :func:`jaxlight.checkpoint.read_meta`) and its
    ``host_arrays`` item.

    Never unpickles: a checkpoint written by jaxlight before format version 2
    (pickled host state) raises :class:`CheckpointError` without being opened
    further, and so does anything that does not decode to the documented
    types. ``path`` is the checkpoint directory (default: where ``meta`` was
    read from).
    """
    path = Path(path) if path is not None else getattr(meta, "path", None)
    where = getattr(meta, "file", None) or (Path(path) / "meta" / META_FILE if path is not None else "the metadata")
    version = meta.get("format_version")
    if version == 1 or ("host" in meta and "host_state" not in meta):
        raise CheckpointError(
            f"checkpoint {path} was written by an older jaxlight (format version {version}) that stored its host "
            f"state (loop position, callback states, hparams) as a pickle; it is not loaded, because unpickling a "
            f"file can run arbitrary code. Its arrays are plain orbax items (model/, train/): "
            f"docs/checkpointing.md shows how to read them without jaxlight"
        )
    if type(version) is not int or version > FORMAT_VERSION or version < 1:
        raise CheckpointError(
            f"checkpoint {path} has format version {version!r}; this jaxlight reads version {FORMAT_VERSION} "
            f"(a newer jaxlight wrote it?)"
        )
    if "host_state" not in meta:
        raise CheckpointError(f"{where} has no host_state field; the checkpoint is corrupt")
    data = meta["host_state"]
    try:
        refs = serialization.array_refs(data, root="checkpoint")
    except serialization.DecodeError as e:
        raise CheckpointError(f"checkpoint metadata {where} is malformed at {e}") from None
    arrays = _restore_host_arrays(path, refs) if refs else {}

    def load(ref: str, dtype: np.dtype, shape: tuple, at: str) -> np.ndarray:
        return arrays[ref]

    try:
        ckpt = serialization.decode(data, root="checkpoint", load_array=load)
    except serialization.DecodeError as e:
        raise CheckpointError(f"checkpoint metadata {where} is malformed at {e}") from None
    check_host(ckpt, where, meta)
    return ckpt


def _restore_host_arrays(path: Path | None, refs: Mapping[str, tuple[np.dtype, tuple]]) -> dict[str, np.ndarray]:
    """The host-state arrays ``refs`` names, read from the ``host_arrays`` item as numpy arrays."""
    if path is None:
        raise CheckpointError("the host state refers to stored arrays; pass the checkpoint path to host_checkpoint")
    if not (Path(path) / HOST_ARRAYS).is_dir():
        raise CheckpointError(f"checkpoint {path} is incomplete or corrupt: missing ['{HOST_ARRAYS}']")
    try:
        stored = stored_shapes(Path(path), HOST_ARRAYS)
        # checked before anything is allocated: the metadata's shapes are only claims
        bad = [
            f"{k}: metadata {dtype}{shape} vs stored {stored[k][0]}{stored[k][1]}"
            if k in stored
            else f"{k}: not stored"
            for k, (dtype, shape) in refs.items()
            if stored.get(k) != (str(dtype), shape)
        ]
        if bad:
            raise CheckpointError(f"checkpoint {path}: host arrays do not match the metadata ({listing(bad)})")
        target = {k: np.zeros(shape, dtype) for k, (dtype, shape) in refs.items()}
        out = restore_numpy_item(Path(path), HOST_ARRAYS, target)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {path}: the host_arrays item could not be read (corrupt or partial files?): "
            f"{type(e).__name__}: {e}"
        ) from e
    for k, (dtype, shape) in refs.items():
        a = out.get(k)
        if not isinstance(a, np.ndarray) or a.dtype != dtype or a.shape != shape:
            raise CheckpointError(
                f"checkpoint {path}: host array {k} is not the {dtype}{shape} array the metadata names"
            )
    return out


__all__ = ["HOST_ARRAYS", "check_hparams", "encode_host", "hparams_text", "host_checkpoint", "save_error"]
