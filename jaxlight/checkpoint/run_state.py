"""A whole run's state as a value, and its save and restore: trees in, trees out, no Trainer.

:class:`RunSnapshot` is what a checkpoint holds: a pytree of the train state's
arrays (parameters, the module's other NNX state, optax state, callback-owned
in-step state, the step counter) with the host side beside it (Lightning's
checkpoint dict: loop position, epoch metrics, callback/datamodule/logger
states, hparams) and the readable facts of the run (step, epoch, module class,
strategy, mesh). :func:`save` writes one into a new directory in the items of
:mod:`jaxlight.checkpoint.format`; :func:`restore` reads one back into the
shapes and shardings of a ``like`` snapshot, so a checkpoint saved under one
strategy or device count restores under another. Building a snapshot from a
Trainer, and handing a restored one back to it, is
:mod:`jaxlight.checkpoint.trainer_io`'s work.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import jax

from jaxlight import distributed, rank_failure, serialization
from jaxlight.checkpoint.discovery import next_commit_seq
from jaxlight.checkpoint.format import (
    FORMAT,
    FORMAT_VERSION,
    META_BYTES_ENV,
    CheckpointMeta,
    abstract_like,
    bytes_needed,
    check_space,
    drop_unsaved_state,
    encode_keys,
    flatten,
    meta_bytes_bound,
    read_meta,
    restore_arrays,
    unflatten_like,
    write,
)
from jaxlight.checkpoint.host_state import encode_host, host_checkpoint, hparams_text, save_error
from jaxlight.errors import CheckpointError
from jaxlight.rank_zero import rank_zero_warn

# the fields of a snapshot that hold arrays (a pytree's children); the others are host data
ARRAY_FIELDS = ("params", "model_state", "opt_state", "callback_state", "step", "loss_scale")


@dataclasses.dataclass(frozen=True)
class RunSnapshot:
    """What a checkpoint of a run holds, as one value (a pytree whose leaves are the arrays).

    ``params`` and ``model_state`` map ``jaxlight.state`` paths to arrays (the
    ``model`` item); ``opt_state``, ``callback_state``, ``step`` and ``loss_scale``
    (``"16-mixed"``'s scaler state, else None) are the rest
    of a ``TrainState`` (the ``train`` item), ``None`` when there is no train
    state (a module saved outside fit, or a weights-only checkpoint). ``host``
    is Lightning's checkpoint dict without the device arrays (stored as tagged
    JSON); ``facts`` the readable facts the meta item records beside it
    (``global_step``, ``epoch``, ``module_class``, ``strategy``, ``mesh``);
    ``weights_only`` marks a checkpoint that cannot resume fit. ``host``,
    ``facts`` and ``weights_only`` are the pytree's static part: ``jax.tree``
    functions map the arrays and carry them along (a snapshot is not a ``jit``
    argument: the host dict is not hashable).
    """

    params: Mapping[str, Any]
    model_state: Mapping[str, Any]
    opt_state: Any = None
    callback_state: Any = None
    step: Any = None
    loss_scale: Any = None
    host: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    facts: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    weights_only: bool = False

    @property
    def has_train(self) -> bool:
        """Whether the snapshot holds the train item (optimizer, callback state, step), what a resume needs."""
        return self.step is not None

    def replace(self, **changes: Any) -> RunSnapshot:
        """A copy with ``changes`` (field names) applied."""
        return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(
    RunSnapshot, data_fields=list(ARRAY_FIELDS), meta_fields=["host", "facts", "weights_only"]
)


# ---------------------------------------------------------------------------- saving
def _version() -> str:
    # read from the loaded package, not imported: jaxlight's __init__ imports this package
    return str(getattr(sys.modules.get("jaxlight"), "__version__", "unknown"))


def _groups(contents: RunSnapshot) -> tuple[dict[str, dict], dict[str, str]]:
    """The arrays to save, grouped per orbax item (the format's names), with typed keys turned into raw data."""
    impls: dict[str, str] = {}
    model = {"params": dict(contents.params), "rest": dict(contents.model_state)}
    groups = {"model": {g: encode_keys(d, g, impls) for g, d in model.items() if d}}
    if contents.has_train and not contents.weights_only:
        train = {
            "opt_state": flatten(contents.opt_state),
            "extra": flatten(contents.callback_state),
            "step": {"step": contents.step},
            "loss_scale": flatten(contents.loss_scale),
        }
        groups["train"] = {g: encode_keys(d, g, impls) for g, d in train.items() if d}
    return groups, impls


def _meta(
    contents: RunSnapshot, host_state: Any, n_arrays: int, impls: dict[str, str], reason: str, commit_seq: int
) -> dict[str, Any]:
    """The meta item: the format's readable facts (in the order every checkpoint so far has them) and the
    encoded host state."""
    ckpt, facts = contents.host, contents.facts
    fl = ckpt["loops"]["fit_loop"]
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "jaxlight_version": ckpt["jaxlight_version"],
        "time": time.time(),  # for people: "last" orders by progress and commit_seq, never by a clock
        "commit_seq": commit_seq,
        "reason": reason,
        "global_step": facts["global_step"],
        "epoch": facts["epoch"],
        "resume_epoch": fl["resume_epoch"],
        "batches_in_epoch": fl["batches_in_epoch"],
        "micro_batches": fl["micro_batches"],
        "weights_only": contents.weights_only,
        "module_class": facts.get("module_class"),
        "strategy": facts["strategy"],
        "mesh": {k: int(v) for k, v in facts["mesh"].items()},
        "key_impls": impls,
        "host_arrays": n_arrays,
        "host_state": host_state,
    }


@dataclasses.dataclass
class PreparedSave:
    """A save checked on every process and ready for orbax: :func:`prepare` makes it, :meth:`write` writes it."""

    path: Path
    groups: dict[str, dict]
    meta: dict[str, Any]
    host_arrays: dict[str, Any]
    hparams_text: str
    needed: int  # about how many bytes the save writes (:func:`jaxlight.checkpoint.format.bytes_needed`)

    def write(self, checkpointer: Any = None) -> Any:
        """One orbax save of every item; returns the checkpointer (an async one commits in the background)."""
        return write(self.path, self.groups, self.meta, self.host_arrays, self.hparams_text, checkpointer, self.needed)


def prepare(
    contents: RunSnapshot | Callable[[], RunSnapshot],
    path: str | os.PathLike,
    *,
    reason: str = "manual",
    commit_seq: int | None = None,
) -> PreparedSave:
    """Everything of a save that can fail on the host, before orbax writes anything; every process calls it.

    ``contents`` may be a function building the snapshot: it then runs inside the
    processes' agreement, so a snapshot that fails to build on one process makes
    every process raise (none is left waiting in orbax). A path that exists, a
    disk without room, or host state that cannot be stored is a
    :class:`CheckpointError` before anything is written.
    """
    path = Path(os.path.abspath(os.fspath(path)))
    error: BaseException | None = None
    try:
        snap = contents() if callable(contents) else contents
        host_state, host_arrays = encode_host(dict(snap.host))
        groups, impls = _groups(snap)
        seq = next_commit_seq(path.parent) if commit_seq is None else commit_seq
        meta = _meta(snap, host_state, len(host_arrays), impls, reason, seq)
        size = len(json.dumps(meta, allow_nan=False).encode("utf-8"))  # standard JSON (the facts are plain too)
        if size > meta_bytes_bound():  # saved all the same: refusing would stop the run; a resume needs the bound
            rank_zero_warn(
                f"jaxlight: the metadata of checkpoint {path} is about {size} bytes, over the {meta_bytes_bound()} "
                f"bytes a resume reads; set {META_BYTES_ENV} above it to resume from it"
            )
        text = hparams_text(snap.host)
        if path.exists():
            raise CheckpointError(f"checkpoint path {path} already exists; refusing to overwrite it")
        needed = bytes_needed(groups, host_arrays, meta)
        check_space(path, needed)
    except Exception as e:
        error = e
    # Multi-process saves: if any process failed to build its part, all of them raise (none waits in orbax).
    rank_failure.raise_together(
        error,
        lambda failed: CheckpointError(
            f"cannot save the checkpoint: process(es) {failed} failed to build their part of it"
        ),
    )
    return PreparedSave(path, groups, meta, host_arrays, text, needed)


def save(
    contents: RunSnapshot | Callable[[], RunSnapshot],
    path: str | os.PathLike,
    *,
    checkpointer: Any = None,
    reason: str = "manual",
    commit_seq: int | None = None,
) -> Any:
    """Write ``contents`` to the directory ``path`` (which must not exist yet); every process calls it.

    With an ``orbax.checkpoint.AsyncCheckpointer`` this returns once every array
    has been copied off the devices; the files are written and committed in the
    background (``checkpointer.wait_until_finished()`` waits). Without one the
    save is synchronous. ``commit_seq`` orders checkpoints of the same progress
    for ``"last"`` (default: one more than any checkpoint in ``path``'s
    directory holds). ``contents.host`` must hold Lightning's
    ``checkpoint["loops"]["fit_loop"]`` position and ``jaxlight_version``
    (:func:`host_dict` builds the minimal one). Returns the checkpointer.
    """
    return prepare(contents, path, reason=reason, commit_seq=commit_seq).write(checkpointer)


def host_dict(global_step: int = 0, epoch: int = 0, **extra: Any) -> dict[str, Any]:
    """The smallest host side a snapshot saved outside a Trainer needs (a fresh loop position), plus ``extra``."""
    fit_loop = {"resume_epoch": epoch, "batches_in_epoch": 0, "micro_batches": 0, "fresh_epoch": True}
    return {
        "epoch": epoch,
        "global_step": global_step,
        "jaxlight_version": _version(),
        "loops": {"fit_loop": fit_loop},
        **extra,
    }


def gather_loader_states(state: Any) -> list[Any]:
    """Every process's loader state, in process order (a collective: all processes call it).

    Sent as tagged JSON (arrays inlined), never pickled. A state that cannot be
    encoded makes every process raise (it sends nothing, which every process
    sees), so no process is left waiting in a later collective.
    """
    root = "checkpoint['loops']['fit_loop']['loader_state']"
    try:
        blob, error = serialization.dumps(state, root=root).encode("utf-8"), None
    except serialization.EncodeError as e:
        blob, error = None, e
    every = distributed.gather_bytes(blob)
    if error is not None:
        raise save_error(error) from error
    bad = [i for i, b in enumerate(every) if b is None]
    if bad:
        raise CheckpointError(
            f"cannot save the checkpoint: the train loader state of process(es) {bad} cannot be stored"
        )
    return [serialization.loads(b, root=root) for b in every if b is not None]


# ---------------------------------------------------------------------------- restoring
def read_host(path: str | os.PathLike) -> tuple[CheckpointMeta, dict[str, Any]]:
    """The meta item of the checkpoint at ``path`` and its decoded host state, both checked (no array is read)."""
    meta = read_meta(path)  # the readable facts are checked as the file is read (checkpoint/schema.py)
    return meta, host_checkpoint(meta, path)


def _targets(like: RunSnapshot, shardings: RunSnapshot) -> dict[str, dict]:
    """Abstract arrays (shape, dtype, sharding) per orbax item and group, for what ``like`` holds."""
    out = {
        "model": {
            "params": abstract_like(dict(like.params), dict(shardings.params)),
            "rest": abstract_like(dict(like.model_state), dict(shardings.model_state)),
        }
    }
    if like.has_train:
        out["train"] = {
            "opt_state": abstract_like(flatten(like.opt_state), flatten(shardings.opt_state)),
            "extra": abstract_like(flatten(like.callback_state), flatten(shardings.callback_state)),
            "step": abstract_like({"step": like.step}, {"step": shardings.step}),
            "loss_scale": abstract_like(flatten(like.loss_scale), flatten(shardings.loss_scale)),
        }
    return {g: {k: d for k, d in item.items() if d} for g, item in out.items()}


def restore(
    like: RunSnapshot,
    path: str | os.PathLike,
    *,
    shardings: RunSnapshot | None = None,
    optional: Collection[str] = (),
    host: tuple[CheckpointMeta, dict[str, Any]] | None = None,
) -> RunSnapshot:
    """The snapshot saved at ``path``, read into the structure, shapes and dtypes of ``like``.

    Each array is placed by the sharding of the same leaf of ``shardings`` (a
    snapshot of shardings; default: each leaf of ``like``'s own). The train item
    is read only when ``like`` holds one. Keys of ``like.model_state`` named in
    ``optional`` that the checkpoint has no array for (NNX objects held beside
    the models, which older checkpoints lack) keep ``like``'s value, with a
    warning. ``host``: what :func:`read_host` returned, when the caller read it
    first. Names and shapes are checked before any array is read; a mismatch is
    a :class:`CheckpointError` listing them.
    """
    path = Path(path)
    meta, ckpt = read_host(path) if host is None else host
    if shardings is None:
        shardings = jax.tree.map(lambda x: x.sharding, like)
    targets = _targets(like, shardings)
    unsaved = drop_unsaved_state(path, targets, optional)
    arrays = restore_arrays(path, targets, meta.get("key_impls", {}))
    model_state = arrays["model"].get("rest", {})
    if unsaved:  # kept as they are now
        model_state = {**model_state, **{k: like.model_state[k] for k in unsaved}}
    out = RunSnapshot(
        params=arrays["model"].get("params", {}),
        model_state=model_state,
        host=ckpt,
        facts={k: v for k, v in meta.items() if k != "host_state"},  # the host state is decoded in ``host``
        weights_only=bool(meta.get("weights_only")),
    )
    if like.has_train:
        train = arrays["train"]
        out = out.replace(
            opt_state=unflatten_like(like.opt_state, train.get("opt_state", {})),
            callback_state=unflatten_like(like.callback_state, train.get("extra", {})),
            step=train["step"]["step"],
            loss_scale=unflatten_like(like.loss_scale, train.get("loss_scale", {})),
        )
    return out


__all__ = [
    "ARRAY_FIELDS",
    "PreparedSave",
    "RunSnapshot",
    "gather_loader_states",
    "host_dict",
    "prepare",
    "read_host",
    "restore",
    "save",
]
