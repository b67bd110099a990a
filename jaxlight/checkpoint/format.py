"""The on-disk format: the orbax items of a checkpoint, the one rule for "complete", and trees of arrays.

A checkpoint is one directory written by an orbax ``CompositeCheckpointHandler``
with these items (docs/checkpointing.md describes each file):

- ``model``: ``{"params": {path: array}, "rest": {path: array}}``, the module's
  parameters and its other NNX state (``TrainState.model_state``) keyed by the
  same "/"-joined paths as ``jaxlight.state`` (RNG keys are stored as their raw
  ``key_data`` and re-wrapped on restore);
- ``train``: ``{"opt_state": ..., "extra": ..., "step": ..., "loss_scale": ...}``, the optax state,
  callback-owned in-step state (``TrainState.callback_state``, e.g. EMA), the
  device step counter and ``"16-mixed"``'s loss scaler state (absent under other precisions), each flattened to path-keyed dicts (absent in
  weights-only checkpoints);
- ``meta``: JSON with readable facts and the encoded host state
  (:mod:`jaxlight.checkpoint.host_state`);
- ``host_arrays``: the large arrays of that host state (absent when there are none);
- ``hparams``: ``hparams.yaml``, a readable copy of the hparams.

The item and group names (``rest``, ``extra``) are the format's, older than the
TrainState field names, and stay so that every checkpoint written so far loads.
Nothing here knows the Trainer: :mod:`jaxlight.checkpoint.run_state` builds the
trees this module writes and reads.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import shutil
import warnings
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import jax

from jaxlight import compat
from jaxlight.checkpoint.schema import KEY_IMPLS, check_meta
from jaxlight.errors import CheckpointError
from jaxlight.state import path_str

FORMAT = "jaxlight-checkpoint"
# 1: host state pickled in meta["host"] (refused: unpickling runs code); 2: tagged JSON + orbax arrays.
FORMAT_VERSION = 2
META_FILE = "metadata"  # the file orbax's JsonCheckpointHandler writes inside the meta item
# Orbax's mark on the temporary name of a save that has not committed. Every intermediate name jaxlight
# itself uses (jaxlight.checkpoint.publish) carries it too, so no such name ever counts as complete.
TMP_MARK = ".orbax-checkpoint-tmp"
# What every committed checkpoint holds at its top: orbax's checkpoint metadata file and the two items
# written in every save. A directory missing one of them is not a checkpoint.
REQUIRED_FILES = ("_CHECKPOINT_METADATA",)
REQUIRED_ITEMS = ("meta", "model")
# The files orbax writes at the top of a directory when it commits. A copy of a checkpoint puts them last,
# so a copy cut short never holds REQUIRED_FILES.
COMMIT_FILES = ("commit_success.txt", "_CHECKPOINT_METADATA")
# The largest meta item read (bytes): a bigger file is refused unread, so a damaged or hostile one cannot
# take minutes and gigabytes to parse (a 60 MB one took 24 s and ~1 GB). A run's metadata is small: large
# host arrays go to the host_arrays item, a torchdata StatefulDataLoader state is ~7 KB, so the largest
# legitimate one is per-process loader states, ~29 MB for 4096 processes; a single process's is well under
# 1 MB. JAXLIGHT_MAX_CHECKPOINT_META_BYTES raises (or lowers) it.
MAX_META_BYTES = 32 * 2**20
META_BYTES_ENV = "JAXLIGHT_MAX_CHECKPOINT_META_BYTES"
LIST_LIMIT = 20  # paths listed in an error before "... and N more"


def listing(items: list[str]) -> str:
    """``items`` joined for an error message, the first :data:`LIST_LIMIT` of them."""
    more = f" ... and {len(items) - LIST_LIMIT} more" if len(items) > LIST_LIMIT else ""
    return ", ".join(items[:LIST_LIMIT]) + more


# ---------------------------------------------------------------------------- complete or not: the one rule
def missing_parts(path: str | os.PathLike) -> list[str]:
    """The required top-level entries (:data:`REQUIRED_FILES`, :data:`REQUIRED_ITEMS`) ``path`` lacks."""
    p = Path(path)
    return [n for n in REQUIRED_FILES if not (p / n).is_file()] + [n for n in REQUIRED_ITEMS if not (p / n).is_dir()]


def is_whole(path: str | os.PathLike) -> bool:
    """A real directory (not a link) holding a whole checkpoint, whatever its name (an intermediate
    name of :mod:`jaxlight.checkpoint.publish` included)."""
    p = Path(path)
    return p.is_dir() and not p.is_symlink() and not missing_parts(p)


def is_complete(path: str | os.PathLike) -> bool:
    """True for a committed checkpoint directory: a final name (no :data:`TMP_MARK`: orbax renamed it from its
    temporary name) holding every required entry. A link is judged by its own name and what it points at."""
    p = Path(path)
    return p.is_dir() and TMP_MARK not in p.name and not missing_parts(p)


def resolves_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` (a link, possibly a chain of them) ends at a complete checkpoint."""
    return os.path.exists(path) and is_complete(os.path.realpath(path))


# ---------------------------------------------------------------------------- orbax items
def ocp() -> Any:
    """``orbax.checkpoint``, imported on first use (it is slow to import)."""
    import orbax.checkpoint as ocp

    return ocp


@functools.cache
def _hparams_yaml() -> tuple[type, type]:
    """An orbax handler writing ``hparams.yaml`` (``yaml.safe_dump``) and its save args (built on first use:
    orbax is imported lazily)."""
    import dataclasses

    import yaml
    from orbax.checkpoint import checkpoint_args

    orbax = ocp()

    class HparamsYamlHandler(orbax.JsonCheckpointHandler):
        """Writes a readable copy of the hparams as ``hparams.yaml`` (the exact values are in ``meta``)."""

        def __init__(self) -> None:
            super().__init__(filename="hparams.yaml")

        async def _save_fn(self, x: Any, directory: Any) -> None:
            if jax.process_index() == 0:  # the primary host writes, as for the JSON item
                (directory / self._filename).write_text(x["text"])  # rendered before the save returned

        def restore(self, directory: Any, item: Any = None, args: Any = None) -> Any:
            return yaml.safe_load((directory / self._filename).read_text())

    # Orbax records the handler's dotted name in every checkpoint's _CHECKPOINT_METADATA: it stays the name it
    # had when this code lived in jaxlight/checkpoint.py, so old and new checkpoints name the same handler.
    HparamsYamlHandler.__module__, HparamsYamlHandler.__qualname__ = "jaxlight.checkpoint", "HparamsYamlHandler"

    @checkpoint_args.register_with_handler(HparamsYamlHandler, for_save=True, for_restore=True)
    @dataclasses.dataclass
    class HparamsYamlArgs(checkpoint_args.CheckpointArgs):
        item: Mapping[str, Any]

    HparamsYamlArgs.__module__, HparamsYamlArgs.__qualname__ = "jaxlight.checkpoint", "HparamsYamlArgs"
    return HparamsYamlHandler, HparamsYamlArgs


def new_checkpointer(async_: bool, temporary_path_class: type | None = None) -> Any:
    """An orbax checkpointer for jaxlight's items (``AsyncCheckpointer`` when ``async_``).

    ``temporary_path_class`` replaces orbax's rename-on-commit (how :mod:`jaxlight.checkpoint.publish`
    gives a committed save its names)."""
    orbax = ocp()
    handler = orbax.CompositeCheckpointHandler(
        model=orbax.StandardCheckpointHandler(),
        train=orbax.StandardCheckpointHandler(),
        meta=orbax.JsonCheckpointHandler(filename=META_FILE),
        host_arrays=orbax.StandardCheckpointHandler(),
        hparams=_hparams_yaml()[0](),
    )
    cls = orbax.AsyncCheckpointer if async_ else orbax.Checkpointer
    return cls(handler) if temporary_path_class is None else cls(handler, temporary_path_class=temporary_path_class)


def save_in_flight(checkpointer: Any) -> bool:
    """Whether an async save's background commit is still running (cheap, no waiting)."""
    return compat.async_save_in_flight(checkpointer)


def write(
    path: Path,
    groups: Mapping[str, Mapping[str, Any]],
    meta: Mapping[str, Any],
    host_arrays: Mapping[str, Any],
    hparams_text: str,
    checkpointer: Any = None,
    needed: int | None = None,
) -> Any:
    """One orbax save of every item into ``path``; returns the checkpointer (async ones commit in the background).

    ``groups`` maps the array items (``model``, ``train``) to ``{group: {path: array}}`` with RNG keys
    already turned into key data (:func:`encode_keys`). A full disk is a :class:`CheckpointError` saying
    where and how much the save needed (``needed``: :func:`bytes_needed`)."""
    orbax = ocp()
    ck = checkpointer if checkpointer is not None else new_checkpointer(async_=False)
    asynchronous = isinstance(ck, orbax.AsyncCheckpointer)
    items = {g: orbax.args.StandardSave(own_host_buffers(tree) if asynchronous else tree) for g, tree in groups.items()}
    items["meta"] = orbax.args.JsonSave(dict(meta))
    if host_arrays:
        items["host_arrays"] = orbax.args.StandardSave(dict(host_arrays))
    items["hparams"] = _hparams_yaml()[1]({"text": hparams_text})
    try:
        ck.save(path, args=orbax.args.Composite(**items))
    except Exception as e:
        full = disk_full_error(e, path, bytes_needed(groups, host_arrays, meta) if needed is None else needed)
        if full is not None:
            raise full from e
        raise
    return ck


# ---------------------------------------------------------------------------- disk space
def bytes_needed(
    groups: Mapping[str, Mapping[str, Mapping[str, Any]]], host_arrays: Mapping[str, Any], meta: Any
) -> int:
    """About how many bytes a save of these items writes: every array's bytes (all shards) and the metadata."""
    arrays = [a for item in groups.values() for group in item.values() for a in group.values()]
    arrays += list(host_arrays.values())
    total = sum(int(getattr(a, "nbytes", 0)) for a in arrays)
    # orbax's own files: a few per item, about 2 KiB of metadata and index per array
    return total + len(json.dumps(meta, allow_nan=False)) + 64 * 1024 + 2048 * len(arrays)


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes on the filesystem that would hold ``path`` (its nearest existing ancestor); None if unknown."""
    p = os.path.abspath(os.fspath(path))
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _space_message(path: str | os.PathLike, needed: int, free: int | None, why: str) -> CheckpointError:
    directory = os.path.dirname(os.path.abspath(os.fspath(path)))
    have = f"{_size(free)} free" if free is not None else "free space unknown"
    return CheckpointError(
        f"cannot save checkpoint {path}: {why} in {directory} (the save needs about {_size(needed)}, {have}). "
        f"Nothing was replaced: the previous checkpoints are kept. Free some space, keep fewer checkpoints "
        f"(save_top_k) or save to a larger disk (ModelCheckpoint(dirpath=...))"
    )


def check_space(path: str | os.PathLike, needed: int) -> None:
    """Raise a :class:`CheckpointError` before anything is written when the disk holding ``path`` has less
    than ``needed`` bytes free (what is not known is not refused)."""
    free = free_bytes(path)
    if free is not None and free < needed:
        raise _space_message(path, needed, free, "not enough disk space")


_DISK_FULL = ("no space left on device", "disk quota exceeded", "resource_exhausted", "enospc", "edquot")


def disk_full_error(e: BaseException, path: str | os.PathLike, needed: int) -> CheckpointError | None:
    """The :class:`CheckpointError` for a save that failed because the disk is full (``e``, or an exception it
    was raised from, says so: ``ENOSPC``/``EDQUOT``, or tensorstore's ``RESOURCE_EXHAUSTED``); None otherwise."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in (errno.ENOSPC, errno.EDQUOT):
            return _space_message(path, needed, free_bytes(path), "the disk is full")
        if any(mark in str(cur).lower() for mark in _DISK_FULL):
            return _space_message(path, needed, free_bytes(path), "the disk is full")
        cur = cur.__cause__ or cur.__context__
    return None


# ---------------------------------------------------------------------------- trees of arrays
def flatten(tree: Any) -> dict[str, Any]:
    """Path-keyed leaves of a pytree (``None`` and empty nodes have no leaves), keys from ``jaxlight.state``."""
    return {path_str(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def unflatten_like(like: Any, flat: Mapping[str, Any]) -> Any:
    """The tree of the same structure as ``like`` with the leaves of ``flat`` (from :func:`flatten`)."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(like)
    return jax.tree_util.tree_unflatten(treedef, [flat[path_str(p)] for p, _ in paths])


def is_key(x: Any) -> bool:
    """Whether ``x`` is a typed PRNG key array (stored as its key data)."""
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def encode_keys(flat: Mapping[str, Any], prefix: str, impls: dict[str, str]) -> dict[str, Any]:
    """``flat`` with typed keys replaced by their key data; each one's implementation recorded in ``impls``
    under ``"{prefix}/{path}"`` (the meta item's ``key_impls``)."""
    out = {}
    for k, v in flat.items():
        if is_key(v):
            impl = str(jax.random.key_impl(v))
            if impl not in KEY_IMPLS:  # what a load accepts (jaxlight.checkpoint.schema)
                raise CheckpointError(
                    f"cannot save {prefix}/{k}: a PRNG key of implementation {impl!r}; a checkpoint stores keys of "
                    f"{list(KEY_IMPLS)} only"
                )
            impls[f"{prefix}/{k}"] = impl
            v = jax.random.key_data(v)
        out[k] = v
    return out


def abstract(value: Any, sharding: Any) -> jax.ShapeDtypeStruct:
    """What restoring into ``value``'s place reads: its shape and dtype (a key's data), placed by ``sharding``."""
    if is_key(value):
        data = jax.eval_shape(jax.random.key_data, value)
        # A spec shorter than the rank replicates the trailing key-data dim.
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
    return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)


def abstract_like(values: Mapping[str, Any], shardings: Mapping[str, Any]) -> dict[str, jax.ShapeDtypeStruct]:
    """:func:`abstract` for each entry of a flat dict, with the sharding of the same key."""
    return {k: abstract(v, shardings[k]) for k, v in values.items()}


def own_host_buffers(tree: Any) -> Any:
    """``tree`` with its host-memory leaves (HostOffload's ``pinned_host`` state) copied.

    Orbax reads a host-memory array through a zero-copy numpy view and holds it
    until the files are written. While such a view exists XLA:GPU refuses to
    donate the buffer ("Donation requested for buffer with external reference"),
    so the train step after an async save would fail, and so would the first
    step on state restored from numpy buffers. A copy gives the save (or the
    restored state) a buffer of its own; it costs one host copy of the
    offloaded bytes, held until the save commits. Device-memory leaves are
    returned as they are.
    """

    def own(x: Any) -> Any:
        kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
        if kind in (None, "device"):
            return x
        return jax.device_put(x, x.sharding, may_alias=False)

    return jax.tree.map(own, tree)


def _shape_tree(meta_item: Any) -> dict[str, dict[str, tuple]]:
    tree = getattr(meta_item, "tree", meta_item)
    out: dict[str, dict[str, tuple]] = {}
    for group, leaves in (tree or {}).items():
        out[group] = {k: tuple(getattr(v, "shape", ())) for k, v in leaves.items()}
    return out


def _check_match(path: Path, saved: dict[str, dict[str, tuple]], target: dict[str, dict[str, Any]], item: str) -> None:
    missing, unexpected, shapes = [], [], []
    for group in sorted(set(saved) | set(target)):
        s, t = saved.get(group, {}), target.get(group, {})
        missing += [f"{group}/{k}" for k in t if k not in s]
        unexpected += [f"{group}/{k}" for k in s if k not in t]
        for k in t:
            if k in s and tuple(s[k]) != tuple(t[k].shape):
                shapes.append(f"{group}/{k}: checkpoint {tuple(s[k])} vs model {tuple(t[k].shape)}")
    if missing or unexpected or shapes:
        what = "parameters and model state" if item == "model" else "optimizer/training state"
        lines = [f"checkpoint {path} does not match the {what} of this run:"]
        if missing:
            lines.append(f"  in the model but not in the checkpoint ({len(missing)}): {listing(missing)}")
        if unexpected:
            lines.append(f"  in the checkpoint but not in the model ({len(unexpected)}): {listing(unexpected)}")
        if shapes:
            lines.append(f"  shapes differ ({len(shapes)}): {listing(shapes)}")
        if item == "train":
            lines.append(
                "  (was the optimizer, accumulate_grad_batches, gradient clipping, an EMA callback or the "
                "precision ('16-mixed' saves its loss scale) changed since the checkpoint was written?)"
            )
        raise CheckpointError("\n".join(lines))


def drop_unsaved_state(path: Path, targets: dict[str, dict], optional: Collection[str]) -> list[str]:
    """Remove from ``targets["model"]["rest"]`` the keys in ``optional`` that the checkpoint has no array
    for, and return them (warned about; the caller keeps their current values).

    ``optional``: the state of NNX objects a module holds beside its models (``nnx.Rngs``, metrics),
    which checkpoints written before jaxlight carried them lack; anything else must match exactly.
    """
    rest = targets.get("model", {}).get("rest")
    if not rest or not optional:
        return []
    try:
        saved = _shape_tree(new_checkpointer(async_=False).metadata(path).item_metadata.get("model", None))
    except Exception:
        return []  # restore_arrays reports an unreadable checkpoint
    unsaved = sorted(k for k in optional if k in rest and k not in saved.get("rest", {}))
    for k in unsaved:
        del rest[k]
    if not rest:
        del targets["model"]["rest"]
    if unsaved:
        warnings.warn(
            f"checkpoint {path} holds no values for {listing(unsaved)} (NNX objects the module holds beside "
            f"its models, e.g. an nnx.Rngs or metrics, added since it was written or saved before jaxlight "
            f"carried them); they keep their current values",
            UserWarning,
            stacklevel=3,
        )
    return unsaved


def restore_arrays(path: Path, targets: dict[str, dict], impls: Mapping[str, str]) -> dict[str, dict]:
    """Read the array items ``targets`` names (``{item: {group: {path: ShapeDtypeStruct}}}``) into their
    shardings; RNG keys named in ``impls`` come back as typed keys. Names and shapes are checked first."""
    orbax = ocp()
    ck = new_checkpointer(async_=False)
    try:
        md = ck.metadata(path).item_metadata
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} is corrupt or unreadable: {type(e).__name__}: {e}") from e
    for item, target in targets.items():
        saved_item = md.get(item, None)
        if saved_item is None:
            if item == "train":
                raise CheckpointError(
                    f"checkpoint {path} holds only the model weights (ModelCheckpoint(save_weights_only=True)); "
                    f"it cannot resume training (optimizer and loop state are missing). Load the weights with "
                    f"{{Module}}.load_from_checkpoint for inference, or resume from a full checkpoint"
                )
            raise CheckpointError(f"checkpoint {path} has no '{item}' item; it is corrupt or not a jaxlight checkpoint")
        _check_match(path, _shape_tree(saved_item), target, item)
    args = {item: orbax.args.StandardRestore(target) for item, target in targets.items()}
    try:
        out = ck.restore(path, args=orbax.args.Composite(**args))
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {path} could not be read (corrupt or partial files?): {type(e).__name__}: {e}"
        ) from e
    restored: dict[str, dict] = {}
    for item in targets:
        restored[item] = {}
        for group, leaves in out[item].items():
            dec = {}
            for k, v in leaves.items():
                impl = impls.get(f"{group}/{k}")
                if impl is not None:
                    sh = targets[item][group][k].sharding
                    v = jax.device_put(jax.random.wrap_key_data(v, impl=impl), sh)
                dec[k] = own_host_buffers(v)
            restored[item][group] = dec
    return restored


def restore_numpy_item(path: Path, item: str, target: Mapping[str, Any]) -> dict[str, Any]:
    """Read the item ``item`` of numpy arrays into ``target``'s shapes and dtypes (host memory)."""
    orbax = ocp()
    out = new_checkpointer(async_=False).restore(
        path, args=orbax.args.Composite(**{item: orbax.args.StandardRestore(dict(target))})
    )
    return dict(out[item])


def stored_shapes(path: Path, item: str) -> dict[str, tuple[str, tuple]]:
    """``{key: (dtype name, shape)}`` of the leaves orbax's metadata lists for ``item``."""
    md = new_checkpointer(async_=False).metadata(path).item_metadata.get(item)
    return {k: (str(getattr(m, "dtype", "")), tuple(getattr(m, "shape", ()))) for k, m in (md.tree or {}).items()}


# ---------------------------------------------------------------------------- the meta item
class CheckpointMeta(dict):
    """The ``meta`` item of a checkpoint as a dict, remembering the directory (``path``) and file it came from."""

    path: Path | None = None
    file: Path | None = None


def meta_bytes_bound() -> int:
    """The size bound of a checkpoint's meta item: :data:`MAX_META_BYTES`, or the value of
    ``JAXLIGHT_MAX_CHECKPOINT_META_BYTES`` when set."""
    raw = os.environ.get(META_BYTES_ENV)
    if raw is None or not raw.strip():
        return MAX_META_BYTES
    try:
        bound = int(raw)
    except ValueError:
        bound = -1
    if bound <= 0:
        raise CheckpointError(f"{META_BYTES_ENV}={raw!r} should be a positive number of bytes")
    return bound


def check_meta_size(f: Path) -> None:
    """Refuse the metadata file ``f`` before reading it when it is larger than the bound (a stat, no read)."""
    size, bound = f.stat().st_size, meta_bytes_bound()
    if size > bound:
        raise CheckpointError(
            f"checkpoint metadata {f} is {size} bytes, over the bound of {bound} bytes for a meta item; it was not "
            f"read (corrupt or not jaxlight's?). A real one this large: set {META_BYTES_ENV} above {size}"
        )


def read_meta(path: str | os.PathLike) -> CheckpointMeta:
    """The ``meta`` item of a checkpoint: readable facts (step, epoch, position, mesh) and the encoded host state.

    Only JSON is parsed here. A missing, truncated or malformed file, or one over :func:`meta_bytes_bound`
    (checked by its size before it is read), raises a :class:`CheckpointError` naming it. Checkpoints of every format version
    are read, so ``"last"`` can find an old one;
    :func:`jaxlight.checkpoint.host_checkpoint` refuses the pickled ones.
    """
    d = Path(path) / "meta"
    f = d / META_FILE
    if not f.is_file():
        raise CheckpointError(
            f"{path} holds no jaxlight meta item ({f} is missing); it is not a jaxlight checkpoint or it is corrupt"
        )
    check_meta_size(f)
    try:
        data = json.loads(f.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"checkpoint metadata {f} is not UTF-8 text (corrupt?): {e}") from None
    except RecursionError:
        raise CheckpointError(f"checkpoint metadata {f} is nested too deeply to be jaxlight metadata") from None
    except ValueError as e:
        raise CheckpointError(f"checkpoint metadata {f} is not valid JSON (truncated or corrupt?): {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f'{f} is not jaxlight checkpoint metadata (no "format": "{FORMAT}" field)')
    check_meta(data, f)  # the readable facts are checked here, before anyone reads them
    meta = CheckpointMeta(data)
    meta.path, meta.file = Path(path), f
    return meta


def order_key(meta: Mapping[str, Any]) -> tuple[int, int, int]:
    """Where a checkpoint stands in its run, for ``"last"``: its progress (global step, then micro-batches:
    a preemption save may fall inside an accumulation window), then its commit sequence number (``commit_seq``,
    one more than any checkpoint in the directory when it was saved). Never its ``time``: a clock can be set
    wrong, and a file can claim any time."""
    return (meta.get("global_step", 0), meta.get("micro_batches", 0), meta.get("commit_seq", 0))


def checkpoint_order(path: str | os.PathLike) -> tuple[int, int, int]:
    """:func:`order_key` of the checkpoint at ``path``; below every checkpoint when it cannot be read."""
    try:
        return order_key(read_meta(path))
    except CheckpointError:  # unreadable: never preferred
        return (-1, -1, -1)


__all__ = [
    "COMMIT_FILES",
    "FORMAT",
    "FORMAT_VERSION",
    "MAX_META_BYTES",
    "META_BYTES_ENV",
    "META_FILE",
    "REQUIRED_FILES",
    "REQUIRED_ITEMS",
    "TMP_MARK",
    "CheckpointMeta",
    "abstract",
    "abstract_like",
    "bytes_needed",
    "check_space",
    "checkpoint_order",
    "disk_full_error",
    "encode_keys",
    "flatten",
    "is_complete",
    "is_key",
    "is_whole",
    "free_bytes",
    "check_meta_size",
    "listing",
    "meta_bytes_bound",
    "missing_parts",
    "new_checkpointer",
    "order_key",
    "own_host_buffers",
    "read_meta",
    "resolves_complete",
    "restore_arrays",
    "restore_numpy_item",
    "save_in_flight",
    "stored_shapes",
    "unflatten_like",
    "write",
]
