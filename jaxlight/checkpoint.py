"""Checkpoints of a whole run on orbax-checkpoint: save, find, restore.

A checkpoint is one directory written by an orbax ``CompositeCheckpointHandler``
with these items (docs/checkpointing.md describes each file):

- ``model``: ``{"params": {path: array}, "rest": {path: array}}``, the module's
  NNX state keyed by the same "/"-joined paths as ``jaxlight.state`` (RNG keys
  are stored as their raw ``key_data`` and re-wrapped on restore);
- ``train``: ``{"opt_state": ..., "extra": ..., "step": ...}``, the optax state,
  callback-owned in-step state (EMA) and the device step counter, each flattened
  to path-keyed dicts (absent in weights-only checkpoints);
- ``meta``: JSON with readable facts (step, epoch, position in the epoch, key
  types) and ``host_state``: a dict in Lightning's checkpoint shape (loop
  position, dataloader state, callback ``state_dict``s, datamodule and logger
  state, hparams, and whatever ``on_save_checkpoint`` hooks added) in tagged
  JSON (``jaxlight.serialization``);
- ``host_arrays``: the arrays over 64 KiB inside that host state (arrays in
  callback or loader states) as numpy arrays keyed "0", "1", ..., which
  ``host_state`` refers to (absent when there are none; smaller arrays, such as
  a torch generator's state, are inlined in the JSON as base64);
- ``hparams``: ``hparams.yaml``, a readable copy of the hparams.

Nothing in a checkpoint is pickled, so opening one never runs code: decoding
builds only a fixed list of plain types. Orbax writes into a temporary
directory and renames it on commit, so a directory with the final name is
complete; partial ones are never loaded. Restores read each array straight into
the *current* trainer's shardings, so a checkpoint saved under one strategy or
device count restores under another.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxlight import compat, serialization
from jaxlight.rank_zero import rank_zero_info

if TYPE_CHECKING:  # pragma: no cover
    from jaxlight.module import LightningModule
    from jaxlight.trainer import Trainer

FORMAT = "jaxlight-checkpoint"
# 1: host state pickled in meta["host"] (refused: unpickling runs code); 2: tagged JSON + orbax arrays.
FORMAT_VERSION = 2
META_FILE = "metadata"  # the file orbax's JsonCheckpointHandler writes inside the meta item
_TMP_MARK = ".orbax-checkpoint-tmp"
_LIST_LIMIT = 20  # paths listed in an error before "... and N more"


class Preempted(SystemExit):
    """``fit`` stopped at a preemption signal after writing that step's checkpoint.

    A ``SystemExit`` with code 143 (128 + SIGTERM), so an uncaught one ends the
    program the way schedulers expect from a preempted job. ``step`` is the
    global step the run stopped at, ``path`` the checkpoint written there (None
    when checkpointing is disabled), ``signum`` the signal received. Running
    the same script again with ``ckpt_path="last"`` resumes at that point.
    """

    def __init__(self, step: int, path: str | None = None, signum: int | None = None) -> None:
        super().__init__(143)
        self.step = step
        self.path = path
        self.signum = signum

    def __str__(self) -> str:
        where = f"; checkpoint {self.path}" if self.path else "; no checkpoint written (checkpointing disabled)"
        return f"preempted (signal {self.signum}) at global step {self.step}{where}"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: incomplete, corrupt, or not matching the model."""


# ---------------------------------------------------------------------------- orbax plumbing
def _ocp():
    import orbax.checkpoint as ocp

    return ocp


@functools.cache
def _hparams_yaml() -> tuple[type, type]:
    """An orbax handler writing ``hparams.yaml`` (``yaml.safe_dump``) and its save args (built on first use:
    orbax is imported lazily)."""
    import dataclasses

    import yaml
    from orbax.checkpoint import checkpoint_args

    ocp = _ocp()

    class HparamsYamlHandler(ocp.JsonCheckpointHandler):
        """Writes a readable copy of the hparams as ``hparams.yaml`` (the exact values are in ``meta``)."""

        def __init__(self) -> None:
            super().__init__(filename="hparams.yaml")

        async def _save_fn(self, x: Any, directory: Any) -> None:
            if jax.process_index() == 0:  # the primary host writes, as for the JSON item
                (directory / self._filename).write_text(x["text"])  # rendered before the save returned

        def restore(self, directory: Any, item: Any = None, args: Any = None) -> Any:
            return yaml.safe_load((directory / self._filename).read_text())

    HparamsYamlHandler.__module__, HparamsYamlHandler.__qualname__ = __name__, "HparamsYamlHandler"

    @checkpoint_args.register_with_handler(HparamsYamlHandler, for_save=True, for_restore=True)
    @dataclasses.dataclass
    class HparamsYamlArgs(checkpoint_args.CheckpointArgs):
        item: Mapping[str, Any]

    HparamsYamlArgs.__module__, HparamsYamlArgs.__qualname__ = __name__, "HparamsYamlArgs"
    return HparamsYamlHandler, HparamsYamlArgs


def _new_checkpointer(async_: bool) -> Any:
    ocp = _ocp()
    handler = ocp.CompositeCheckpointHandler(
        model=ocp.StandardCheckpointHandler(),
        train=ocp.StandardCheckpointHandler(),
        meta=ocp.JsonCheckpointHandler(filename=META_FILE),
        host_arrays=ocp.StandardCheckpointHandler(),
        hparams=_hparams_yaml()[0](),
    )
    return ocp.AsyncCheckpointer(handler) if async_ else ocp.Checkpointer(handler)


def save_in_flight(checkpointer: Any) -> bool:
    """Whether an async save's background commit is still running (cheap, no waiting)."""
    return compat.async_save_in_flight(checkpointer)


def _path_key(path: tuple) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")


def _flat(tree: Any) -> dict[str, Any]:
    """Path-keyed leaves of a pytree (``None`` and empty nodes have no leaves)."""
    return {_path_key(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _encode_keys(flat: Mapping[str, Any], prefix: str, impls: dict[str, str]) -> dict[str, Any]:
    out = {}
    for k, v in flat.items():
        if _is_key(v):
            impls[f"{prefix}/{k}"] = str(jax.random.key_impl(v))
            v = jax.random.key_data(v)
        out[k] = v
    return out


def _groups(trainer: Trainer, weights_only: bool) -> tuple[dict[str, dict], dict[str, str]]:
    """The arrays to save, grouped per orbax item, with typed keys turned into raw data."""
    state = trainer.train_state
    impls: dict[str, str] = {}
    if state is None:  # e.g. saved after validate() without fit: the module's own state
        params, rest = trainer.engine.read_module()
        model = {"params": params, "rest": rest}
        train: dict[str, Any] = {}
    else:
        model = {"params": dict(state.params), "rest": dict(state.model_state)}
        train = {
            "opt_state": _flat(state.opt_state),
            "extra": _flat(state.callback_state),
            "step": {"step": state.step},
        }
    groups = {"model": {g: _encode_keys(d, g, impls) for g, d in model.items() if d}}
    if not weights_only and train:
        groups["train"] = {g: _encode_keys(d, g, impls) for g, d in train.items() if d}
    return groups, impls


def _abstract(value: Any, sharding: Any) -> jax.ShapeDtypeStruct:
    if _is_key(value):
        data = jax.eval_shape(jax.random.key_data, value)
        # A spec shorter than the rank replicates the trailing key-data dim.
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
    return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)


def _targets(trainer: Trainer, with_train: bool) -> dict[str, dict]:
    """Abstract arrays (shape, dtype, *current* sharding) for what the trainer holds now."""
    state, shs = trainer.train_state, trainer.engine.state_shardings
    if state is None or shs is None:
        params, rest = trainer.engine.read_module()
        psh, rsh = trainer.engine.param_shardings, trainer.engine.rest_shardings
        out = {
            "model": {
                "params": {k: _abstract(v, psh[k]) for k, v in params.items()},
                "rest": {k: _abstract(v, rsh[k]) for k, v in rest.items()},
            }
        }
        return {g: {k: d for k, d in item.items() if d} for g, item in out.items()}
    model = {
        "params": {k: _abstract(v, shs.params[k]) for k, v in state.params.items()},
        "rest": {k: _abstract(v, shs.model_state[k]) for k, v in state.model_state.items()},
    }
    out = {"model": model}
    if with_train:
        ov, osh = _flat(state.opt_state), _flat(shs.opt_state)
        ev, esh = _flat(state.callback_state), _flat(shs.callback_state)
        out["train"] = {
            "opt_state": {k: _abstract(v, osh[k]) for k, v in ov.items()},
            "extra": {k: _abstract(v, esh[k]) for k, v in ev.items()},
            "step": {"step": _abstract(state.step, shs.step)},
        }
    return {g: {k: d for k, d in item.items() if d} for g, item in out.items()}


# ---------------------------------------------------------------------------- what a checkpoint holds
def dump_checkpoint(trainer: Trainer, weights_only: bool = False) -> dict[str, Any]:
    """The host-side checkpoint dict (Lightning's shape, without arrays), after the save hooks ran."""
    module = trainer.lightning_module
    fit_loop = trainer.position.state_dict(trainer.num_training_batches)
    loader_state = fit_loop["loader_state"]
    fit_loop["loader_states_by_process"] = (
        _gather_per_process(loader_state) if _loaders_are_per_process(trainer) else None
    )
    # epoch-level self.log accumulators of the epoch in progress
    fit_loop["train_metrics"] = trainer.reporter.epoch_state_dict("train") if fit_loop["batches_in_epoch"] else None
    ckpt: dict[str, Any] = {
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "jaxlight_version": _version(),
        "loops": {"fit_loop": fit_loop},
        "hyper_parameters": dict(module.hparams) if module is not None else {},
        "hparams_name": "kwargs",
    }
    if not weights_only:
        ckpt["callbacks"] = {}
        for cb in trainer.callbacks:
            sd = cb.state_dict()
            if sd:
                ckpt["callbacks"][cb.state_key] = sd
        dm = trainer.datamodule
        if dm is not None:
            ckpt["datamodule"] = {"class": type(dm).__qualname__, "state": dm.state_dict()}
            if getattr(dm, "hparams", None):
                ckpt["datamodule_hyper_parameters"] = dict(dm.hparams)
        ckpt["loggers"] = [{"class": type(lg).__qualname__, "state": lg.state_dict()} for lg in trainer.loggers]
        for cb in trainer.callbacks:
            cb.on_save_checkpoint(trainer, module, ckpt)
    if module is not None:
        module.on_save_checkpoint(ckpt)
    return ckpt


def _loaders_are_per_process(trainer: Trainer) -> bool:
    # With process-local batches each process's loader is at its own position; otherwise every
    # process reads the same loader and process 0's state stands for all.
    return jax.process_count() > 1 and bool(trainer.process_local_batches)


def _gather_per_process(state: Any) -> list[Any]:
    """Every process's loader state, in process order (a collective: all processes call it).

    Sent as tagged JSON (arrays inlined), never pickled. A state that cannot be
    encoded makes every process raise (its size is sent as -1), so no process
    is left waiting in the second gather.
    """
    from jax.experimental import multihost_utils

    root = "checkpoint['loops']['fit_loop']['loader_state']"
    try:
        blob, error = serialization.dumps(state, root=root).encode("utf-8"), None
    except serialization.EncodeError as e:
        blob, error = b"", e
    size = np.int32(-1 if error is not None else len(blob))
    sizes = np.asarray(multihost_utils.process_allgather(size)).reshape(-1)
    if error is not None:
        raise _save_error(error) from error
    if (sizes < 0).any():
        bad = [i for i, n in enumerate(sizes) if n < 0]
        raise CheckpointError(
            f"cannot save the checkpoint: the train loader state of process(es) {bad} cannot be stored"
        )
    padded = np.zeros(max(int(sizes.max()), 1), np.uint8)
    padded[: len(blob)] = np.frombuffer(blob, np.uint8)
    every = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    return [serialization.loads(every[i, : int(n)].tobytes(), root=root) for i, n in enumerate(sizes)]


def _version() -> str:
    try:
        import jaxlight

        return jaxlight.__version__
    except Exception:
        return "unknown"


def _save_error(e: serialization.EncodeError) -> CheckpointError:
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


def _encode_host(ckpt: dict[str, Any]) -> tuple[Any, dict[str, np.ndarray]]:
    """The host dict as tagged JSON plus the arrays it refers to (for the ``host_arrays`` item)."""
    arrays: dict[str, np.ndarray] = {}
    try:
        state = serialization.encode(ckpt, root="checkpoint", arrays=arrays)
    except serialization.EncodeError as e:
        raise _save_error(e) from None
    return state, arrays


def _hparams_text(ckpt: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(serialization.plain(ckpt.get("hyper_parameters") or {}), sort_keys=False)


def _meta(
    trainer: Trainer,
    ckpt: dict[str, Any],
    host_state: Any,
    n_arrays: int,
    impls: dict[str, str],
    weights_only: bool,
    reason: str,
) -> dict[str, Any]:
    fl = ckpt["loops"]["fit_loop"]
    module = trainer.lightning_module
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "jaxlight_version": ckpt["jaxlight_version"],
        "time": time.time(),
        "reason": reason,
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "resume_epoch": fl["resume_epoch"],
        "batches_in_epoch": fl["batches_in_epoch"],
        "micro_batches": fl["micro_batches"],
        "weights_only": weights_only,
        "module_class": f"{type(module).__module__}.{type(module).__qualname__}" if module is not None else None,
        "strategy": str(trainer.strategy),
        "mesh": {k: int(v) for k, v in trainer.mesh.shape.items()},
        "key_impls": impls,
        "host_arrays": n_arrays,
        "host_state": host_state,
    }


def _agree(error: BaseException | None) -> None:
    """Multi-process saves: if any process failed to build its part, all of them raise (none waits in orbax)."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    failed = np.asarray(multihost_utils.process_allgather(np.int32(error is not None))).reshape(-1)
    if error is None and failed.any():
        bad = [i for i, f in enumerate(failed) if f]
        raise CheckpointError(f"cannot save the checkpoint: process(es) {bad} failed to build their part of it")


def save_checkpoint(
    trainer: Trainer,
    path: str | os.PathLike,
    *,
    weights_only: bool = False,
    checkpointer: Any = None,
    reason: str = "manual",
) -> Any:
    """Write the run's state to the directory ``path`` (which must not exist yet).

    With an ``orbax.checkpoint.AsyncCheckpointer`` this returns once every array
    has been copied off the devices; the files are written and committed in the
    background (``checkpointer.wait_until_finished()`` waits). Without one the
    save is synchronous. Every process must call this with the same ``path``.
    """
    path = Path(os.path.abspath(os.fspath(path)))
    error: BaseException | None = None
    try:  # everything that can fail on the host, before orbax writes anything
        ckpt = dump_checkpoint(trainer, weights_only)
        host_state, host_arrays = _encode_host(ckpt)
        groups, impls = _groups(trainer, weights_only)
        meta = _meta(trainer, ckpt, host_state, len(host_arrays), impls, weights_only, reason)
        json.dumps(meta, allow_nan=False)  # standard JSON (the readable facts are plain too)
        hparams_text = _hparams_text(ckpt)
        if path.exists():
            raise CheckpointError(f"checkpoint path {path} already exists; refusing to overwrite it")
    except Exception as e:
        error = e
    _agree(error)
    if error is not None:
        raise error
    ocp = _ocp()
    items = {g: ocp.args.StandardSave(tree) for g, tree in groups.items()}
    items["meta"] = ocp.args.JsonSave(meta)
    if host_arrays:
        items["host_arrays"] = ocp.args.StandardSave(host_arrays)
    items["hparams"] = _hparams_yaml()[1]({"text": hparams_text})
    ck = checkpointer if checkpointer is not None else _new_checkpointer(async_=False)
    if isinstance(ck, ocp.AsyncCheckpointer):
        items.update({g: ocp.args.StandardSave(_own_host_buffers(tree)) for g, tree in groups.items()})
    ck.save(path, args=ocp.args.Composite(**items))
    return ck


def _own_host_buffers(tree: Any) -> Any:
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


# ---------------------------------------------------------------------------- finding checkpoints
def is_complete(path: str | os.PathLike) -> bool:
    """True for a committed checkpoint directory (orbax renamed it from its temporary name)."""
    p = Path(path)
    return (
        p.is_dir()
        and _TMP_MARK not in p.name
        and (p / "_CHECKPOINT_METADATA").exists()
        and (p / "meta").is_dir()
        and (p / "model").is_dir()
    )


class CheckpointMeta(dict):
    """The ``meta`` item of a checkpoint as a dict, remembering the directory (``path``) and file it came from."""

    path: Path | None = None
    file: Path | None = None


def read_meta(path: str | os.PathLike) -> CheckpointMeta:
    """The ``meta`` item of a checkpoint: readable facts (step, epoch, position, mesh) and the encoded host state.

    Only JSON is parsed here. A missing, truncated or malformed file raises a
    :class:`CheckpointError` naming it. Checkpoints of every format version
    are read, so ``"last"`` can find an old one; :func:`host_checkpoint`
    refuses the pickled ones.
    """
    d = Path(path) / "meta"
    f = d / META_FILE
    if not f.is_file():
        raise CheckpointError(
            f"{path} holds no jaxlight meta item ({f} is missing); it is not a jaxlight checkpoint or it is corrupt"
        )
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
    meta = CheckpointMeta(data)
    meta.path, meta.file = Path(path), f
    return meta


def host_checkpoint(meta: Mapping[str, Any], path: str | os.PathLike | None = None) -> dict[str, Any]:
    """The Lightning-shaped host dict of a checkpoint (``epoch``, ``global_step``, ``loops``, ``callbacks``,
    ``hyper_parameters``, ...), decoded from ``meta`` (from :func:`read_meta`) and its ``host_arrays`` item.

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
    _check_host(ckpt, where)
    return ckpt


def _restore_host_arrays(path: Path | None, refs: Mapping[str, tuple[np.dtype, tuple]]) -> dict[str, np.ndarray]:
    """The host-state arrays ``refs`` names, read from the ``host_arrays`` item as numpy arrays."""
    if path is None:
        raise CheckpointError("the host state refers to stored arrays; pass the checkpoint path to host_checkpoint")
    if not (Path(path) / "host_arrays").is_dir():
        raise CheckpointError(f"checkpoint {path} is incomplete or corrupt: missing ['host_arrays']")
    ocp = _ocp()
    ck = _new_checkpointer(async_=False)
    try:
        md = ck.metadata(path).item_metadata.get("host_arrays")
        stored = {k: (str(getattr(m, "dtype", "")), tuple(getattr(m, "shape", ()))) for k, m in (md.tree or {}).items()}
        # checked before anything is allocated: the metadata's shapes are only claims
        bad = [
            f"{k}: metadata {dtype}{shape} vs stored {stored[k][0]}{stored[k][1]}"
            if k in stored
            else f"{k}: not stored"
            for k, (dtype, shape) in refs.items()
            if stored.get(k) != (str(dtype), shape)
        ]
        if bad:
            raise CheckpointError(f"checkpoint {path}: host arrays do not match the metadata ({_listing(bad)})")
        target = {k: np.zeros(shape, dtype) for k, (dtype, shape) in refs.items()}
        out = ck.restore(path, args=ocp.args.Composite(host_arrays=ocp.args.StandardRestore(target)))["host_arrays"]
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
    return dict(out)


def _check_host(ckpt: Any, where: Any) -> None:
    """The fields jaxlight itself reads from the host dict have the types it expects (else a CheckpointError)."""

    def bad(key: str, want: str, value: Any) -> CheckpointError:
        return CheckpointError(
            f"checkpoint metadata {where} is malformed: checkpoint{key} should be {want}, got {type(value).__name__}"
        )

    def is_int(v: Any) -> bool:
        return type(v) is int and v >= 0

    if not isinstance(ckpt, dict):
        raise bad("", "a dict", ckpt)
    for key in ("epoch", "global_step"):
        if not is_int(ckpt.get(key)):
            raise bad(f"[{key!r}]", "an int >= 0", ckpt.get(key))
    loops = ckpt.get("loops")
    fl = loops.get("fit_loop") if isinstance(loops, dict) else None
    if not isinstance(fl, dict):
        raise bad("['loops']['fit_loop']", "a dict", fl)
    for key in ("resume_epoch", "batches_in_epoch", "micro_batches"):
        if not is_int(fl.get(key)):
            raise bad(f"['loops']['fit_loop'][{key!r}]", "an int >= 0", fl.get(key))
    if type(fl.get("fresh_epoch")) is not bool:
        raise bad("['loops']['fit_loop']['fresh_epoch']", "a bool", fl.get("fresh_epoch"))
    for key, types, want in (
        ("loader_states_by_process", (list, type(None)), "a list or None"),
        ("train_metrics", (dict, type(None)), "a dict or None"),
    ):
        if not isinstance(fl.get(key), types):
            raise bad(f"['loops']['fit_loop'][{key!r}]", want, fl.get(key))
    for key, types, want in (
        ("hyper_parameters", (dict,), "a dict"),
        ("datamodule_hyper_parameters", (dict,), "a dict"),
        ("callbacks", (dict,), "a dict"),
        ("loggers", (list,), "a list"),
        ("datamodule", (dict,), "a dict"),
    ):
        if key in ckpt and not isinstance(ckpt[key], types):
            raise bad(f"[{key!r}]", want, ckpt[key])
    if not all(isinstance(k, str) for k in ckpt.get("hyper_parameters", {})):
        raise CheckpointError(f"checkpoint metadata {where} is malformed: hyperparameter names must be strings")
    if not all(isinstance(s, dict) for s in ckpt.get("loggers", [])):
        raise bad("['loggers'][i]", "a dict", next(s for s in ckpt["loggers"] if not isinstance(s, dict)))
    if "datamodule" in ckpt and "state" not in ckpt["datamodule"]:
        raise CheckpointError(f"checkpoint metadata {where} is malformed: checkpoint['datamodule'] has no 'state'")


def list_checkpoints(dirpath: str | os.PathLike) -> list[Path]:
    """Complete checkpoint directories directly under ``dirpath`` (symlinks not followed twice)."""
    d = Path(dirpath)
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if not p.is_symlink() and is_complete(p))


def _incomplete(dirpath: str | os.PathLike) -> list[Path]:
    d = Path(dirpath)
    return sorted(p for p in d.iterdir() if _TMP_MARK in p.name) if d.is_dir() else []


def _search_dirs(trainer: Trainer) -> list[Path]:
    from jaxlight.callbacks.model_checkpoint import ModelCheckpoint

    dirs: list[Path] = []
    for cb in trainer.checkpoint_callbacks:
        dp = cb.dirpath if isinstance(cb, ModelCheckpoint) else None
        if dp:
            dirs.append(Path(dp))
            # With a versioned logger each run writes to a new version_N directory;
            # "last" should still find the previous run's checkpoints.
            parts = Path(dp).parts
            if len(parts) >= 2 and parts[-2].startswith("version_"):
                dirs.extend(sorted(Path(*parts[:-2]).glob(f"version_*/{parts[-1]}")))
    if not dirs:
        dirs.append(Path(trainer.default_root_dir) / "checkpoints")
    seen, out = set(), []
    for d in dirs:
        r = d.resolve()
        if r not in seen:
            seen.add(r)
            out.append(d)
    return out


def find_last(dirs: list[Path]) -> Path | None:
    """The most recently committed complete checkpoint in ``dirs`` (progress breaks ties, then a ``last``
    name: a ``last.ckpt`` sharing its files with a top-k checkpoint is what Lightning's "last" resumes from)."""
    best, best_key = None, None
    for d in dirs:
        for p in list_checkpoints(d):
            try:
                m = read_meta(p)
            except CheckpointError:
                continue
            key = (m.get("time", 0.0), m.get("micro_batches", 0), m.get("global_step", 0), p.name.startswith("last"))
            if best_key is None or key > best_key:
                best, best_key = p, key
    return best


def find_last_checkpoint(trainer: Trainer) -> Path | None:
    """What ``ckpt_path="last"`` resolves to for ``trainer``: the newest complete checkpoint in its
    checkpoint directories, or None when there is none yet."""
    return find_last(_search_dirs(trainer))


def no_last_checkpoint_reason(trainer: Trainer) -> str:
    """Where ``ckpt_path="last"`` looked and found no complete checkpoint (with any unfinished saves)."""
    dirs = _search_dirs(trainer)
    partial = [str(p) for d in dirs for p in _incomplete(d)]
    extra = f"; incomplete (never committed) saves there: {partial}" if partial else ""
    return f"ckpt_path='last': no complete checkpoint found in {[str(d) for d in dirs]}{extra}"


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
            raise _save_error(e) from None


def resolve_ckpt_path(trainer: Trainer, ckpt_path: str | os.PathLike) -> Path:
    """Turn ``"last"``, ``"best"`` or a path into a complete checkpoint directory, or raise saying why."""
    if ckpt_path == "last":
        found = find_last_checkpoint(trainer)
        if found is None:
            raise FileNotFoundError(
                f"{no_last_checkpoint_reason(trainer)}. Start without ckpt_path, or pass a checkpoint path"
            )
        return found
    if ckpt_path == "best":
        from jaxlight.callbacks.model_checkpoint import ModelCheckpoint

        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, ModelCheckpoint) and cb.best_model_path:
                return _check_path(cb.best_model_path)
        last = find_last(_search_dirs(trainer))
        if last is not None:
            cbs = host_checkpoint(read_meta(last), last).get("callbacks", {})
            for cb in trainer.checkpoint_callbacks:
                best = cbs.get(cb.state_key, {}).get("best_model_path")
                if best:
                    return _check_path(best)
        raise FileNotFoundError(
            "ckpt_path='best': no best checkpoint is known (no ModelCheckpoint has saved one in this run, and "
            f"no checkpoint in {[str(d) for d in _search_dirs(trainer)]} names one); pass monitor= to "
            "ModelCheckpoint or a checkpoint path"
        )
    return _check_path(ckpt_path)


def _check_path(path: str | os.PathLike) -> Path:
    p = Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
    if not p.exists():
        raise FileNotFoundError(f"checkpoint {p} does not exist")
    if p.is_symlink():
        p = p.resolve()
    if not p.is_dir():
        raise CheckpointError(f"checkpoint {p} is a file; jaxlight checkpoints are orbax directories")
    if _TMP_MARK in p.name:
        raise CheckpointError(
            f"checkpoint {p} is an unfinished save (orbax temporary directory); it was never "
            f"committed and cannot be loaded"
        )
    missing = [n for n in ("_CHECKPOINT_METADATA", "meta", "model") if not (p / n).exists()]
    if missing:
        raise CheckpointError(f"checkpoint {p} is incomplete or corrupt: missing {missing}")
    return p


# ---------------------------------------------------------------------------- restoring
def _shape_tree(meta_item: Any) -> dict[str, dict[str, tuple]]:
    tree = getattr(meta_item, "tree", meta_item)
    out: dict[str, dict[str, tuple]] = {}
    for group, leaves in (tree or {}).items():
        out[group] = {k: tuple(getattr(v, "shape", ())) for k, v in leaves.items()}
    return out


def _listing(items: list[str]) -> str:
    more = f" ... and {len(items) - _LIST_LIMIT} more" if len(items) > _LIST_LIMIT else ""
    return ", ".join(items[:_LIST_LIMIT]) + more


def _check_match(
    path: Path,
    saved: dict[str, dict[str, tuple]],
    target: dict[str, dict[str, Any]],
    impls: Mapping[str, str],
    item: str,
) -> None:
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
            lines.append(f"  in the model but not in the checkpoint ({len(missing)}): {_listing(missing)}")
        if unexpected:
            lines.append(f"  in the checkpoint but not in the model ({len(unexpected)}): {_listing(unexpected)}")
        if shapes:
            lines.append(f"  shapes differ ({len(shapes)}): {_listing(shapes)}")
        if item == "train":
            lines.append(
                "  (was the optimizer, accumulate_grad_batches, gradient clipping or an EMA callback "
                "changed since the checkpoint was written?)"
            )
        raise CheckpointError("\n".join(lines))


def _restore_arrays(path: Path, targets: dict[str, dict], impls: Mapping[str, str]) -> dict[str, dict]:
    ocp = _ocp()
    ck = _new_checkpointer(async_=False)
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
        _check_match(path, _shape_tree(saved_item), target, impls, item)
    args = {item: ocp.args.StandardRestore(target) for item, target in targets.items()}
    try:
        out = ck.restore(path, args=ocp.args.Composite(**args))
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
                dec[k] = _own_host_buffers(v)
            restored[item][group] = dec
    return restored


def _unflatten_like(template: Any, flat: Mapping[str, Any]) -> Any:
    paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    return jax.tree_util.tree_unflatten(treedef, [flat[_path_key(p)] for p, _ in paths])


def _as_given(ckpt_path: str | os.PathLike, resolved: Path) -> str:
    """Lightning's ``trainer.ckpt_path``: the path as the user gave it, so a ``last`` link stays ``last``
    (checkpoint callbacks protect the checkpoint a run resumed from, but never a ``last`` one)."""
    given = os.fspath(ckpt_path)
    if given not in ("last", "best"):
        return os.path.abspath(given)
    if given == "last":  # found by scanning: name it by the last link that points at it, when there is one
        for link in sorted(resolved.parent.glob("last*.ckpt")):
            if link.is_symlink() and link.resolve() == resolved.resolve():
                return str(link)
    return str(resolved)


def _load_logger_states(trainer: Trainer, ckpt: Mapping[str, Any]) -> None:
    # Match saved logger states to this run's loggers by class, in order, so a resume with
    # a different logger list still hands each logger its own run id.
    pending = list(ckpt.get("loggers", []))
    for lg in trainer.loggers:
        match = next((s for s in pending if s.get("class") == type(lg).__qualname__), None)
        if match is not None:
            pending.remove(match)
            if match.get("state"):
                lg.load_state_dict(match["state"])


def restore_logger_states(trainer: Trainer, ckpt_path: str | os.PathLike) -> None:
    """Hand the trainer's loggers their saved state (run ids) from the checkpoint a fit resumes from.

    Called when fit starts, before the loggers create their runs, so a resumed run keeps logging into the
    run it started rather than creating a new one. Reads only the checkpoint's metadata.
    """
    path = resolve_ckpt_path(trainer, ckpt_path)
    meta = read_meta(path)
    _load_logger_states(trainer, host_checkpoint(meta, path))


def restore_into_trainer(trainer: Trainer, ckpt_path: str | os.PathLike, stage: str) -> None:
    """Load a checkpoint into a set-up trainer: arrays into its current shardings, then loop and host state.

    For ``stage="fit"`` everything a resume needs is restored (optimizer, step,
    epoch, position in the epoch, dataloader, callback/datamodule/logger state);
    for validate/test/predict only the module's parameters and NNX state.
    """
    path = resolve_ckpt_path(trainer, ckpt_path)
    meta = read_meta(path)
    ckpt = host_checkpoint(meta, path)  # decoded (and checked) before anything is written into the trainer
    fit = stage == "fit"
    if fit and meta.get("weights_only"):
        raise CheckpointError(
            f"checkpoint {path} holds only the model weights (ModelCheckpoint(save_weights_only=True)); it cannot "
            f"resume fit (optimizer and loop state are missing)"
        )
    impls = meta.get("key_impls", {})
    targets = _targets(trainer, with_train=fit)
    arrays = _restore_arrays(path, targets, impls)
    model = arrays["model"]
    params = model.get("params", {})
    rest = model.get("rest", {})
    if trainer.train_state is not None and fit:
        st = trainer.train_state
        train = arrays["train"]
        opt_state = _unflatten_like(st.opt_state, train.get("opt_state", {}))
        extra = _unflatten_like(st.callback_state, train.get("extra", {}))
        trainer.train_state = type(st)(params, rest, opt_state, extra, train["step"]["step"])
    elif trainer.train_state is not None:
        trainer.train_state = trainer.train_state._replace(params=params, model_state=rest)
    trainer.engine.write_back(params, rest)

    module = trainer.lightning_module
    if fit:
        fl = {**ckpt["loops"]["fit_loop"], "global_step": ckpt["global_step"]}
        state = fl.get("loader_state")
        if fl.get("train_metrics") and not fl.get("fresh_epoch"):
            trainer.reporter.load_epoch_state_dict(fl["train_metrics"], "train")
        by_process = fl.get("loader_states_by_process")
        if by_process is not None or _loaders_are_per_process(trainer):
            if by_process is None or len(by_process) != jax.process_count():
                saved = "one shared loader" if by_process is None else f"{len(by_process)} per-process loaders"
                raise CheckpointError(
                    f"{path} holds the data position of {saved}, but this run has {jax.process_count()} "
                    f"processes with process_local_batches={trainer.process_local_batches}; an exact resume "
                    f"needs the same process count and loader layout"
                )
            state = by_process[jax.process_index()]
        trainer.position.load_state_dict(fl, loader_state=state)
        if module is not None:  # Lightning: the module's hook before the callbacks'
            module.on_load_checkpoint(ckpt)
        for cb in trainer.callbacks:
            cb.on_load_checkpoint(trainer, module, ckpt)
        states = ckpt.get("callbacks", {})
        for cb in trainer.callbacks:
            if cb.state_key in states:
                cb.load_state_dict(states[cb.state_key])
        dm = trainer.datamodule
        if dm is not None and "datamodule" in ckpt:
            dm.load_state_dict(ckpt["datamodule"]["state"])
        _load_logger_states(trainer, ckpt)
    if module is not None and not fit:
        module.on_load_checkpoint(ckpt)
    trainer.ckpt_path = _as_given(ckpt_path, path)
    rank_zero_info(
        f"jaxlight: restored {stage} state from {path} (global step {meta.get('global_step')}, "
        f"epoch {meta.get('epoch')})"
    )


def load_module_from_checkpoint(
    cls: type[LightningModule], checkpoint_path: str | os.PathLike, **kwargs: Any
) -> LightningModule:
    """Rebuild a module from a checkpoint's hparams (``kwargs`` override them) and load its weights.

    No trainer is needed: ``configure_model`` runs when ``__init__`` created no
    NNX attribute, and the arrays land on the default device.
    """
    import inspect

    from jaxlight.state import merge_models, nnx_attributes, split_models

    path = _check_path(checkpoint_path)
    meta = read_meta(path)
    ckpt = host_checkpoint(meta, path)
    hp = dict(ckpt.get("hyper_parameters") or {})
    sig = inspect.signature(cls.__init__)
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    if not takes_kwargs:
        hp = {k: v for k, v in hp.items() if k in sig.parameters}
    hp.update(kwargs)
    from flax import nnx

    # Logical sharding annotations stay metadata here: no mesh, the default device.
    with nnx.use_eager_sharding(False):
        module = cls(**hp)
        if not nnx_attributes(module):
            module.configure_model()
    models = nnx_attributes(module)
    if not models:
        raise CheckpointError(
            f"{cls.__name__} created no flax.nnx.Module attribute in __init__ or configure_model; "
            f"there is nothing to load the checkpoint into"
        )
    parts, params, rest = split_models(models)

    def sharding(x: Any) -> Any:
        return getattr(x, "sharding", None) or jax.sharding.SingleDeviceSharding(jax.devices()[0])

    targets = {
        "model": {
            g: {k: _abstract(v, sharding(v)) for k, v in d.items()}
            for g, d in (("params", params), ("rest", rest))
            if d
        }
    }
    arrays = _restore_arrays(path, targets, meta.get("key_impls", {}))["model"]
    new = merge_models(parts, arrays.get("params", {}), arrays.get("rest", {}), train=True)
    for k, m in new.items():
        object.__setattr__(module, k, m)
    module.on_load_checkpoint(ckpt)
    return module


__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointMeta",
    "Preempted",
    "dump_checkpoint",
    "check_hparams",
    "find_last",
    "find_last_checkpoint",
    "no_last_checkpoint_reason",
    "is_complete",
    "list_checkpoints",
    "load_module_from_checkpoint",
    "read_meta",
    "resolve_ckpt_path",
    "restore_into_trainer",
    "save_checkpoint",
]
