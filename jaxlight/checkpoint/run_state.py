"""A whole run's state in and out of a checkpoint: the only part of the checkpoint package that knows the Trainer.

Saving reads the trainer (train state, loop position, callback, datamodule and
logger states, hooks) into the items of :mod:`jaxlight.checkpoint.format`;
restoring reads each array straight into the *current* trainer's shardings, so
a checkpoint saved under one strategy or device count restores under another,
then hands the host state back to the loop, callbacks, datamodule and loggers.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from jaxlight import distributed, serialization
from jaxlight.checkpoint.discovery import as_given, find_last, next_commit_seq, no_last_reason, resolve, search_dirs
from jaxlight.checkpoint.format import (
    FORMAT,
    FORMAT_VERSION,
    abstract_like,
    bytes_needed,
    check_space,
    drop_unsaved_state,
    encode_keys,
    flatten,
    read_meta,
    restore_arrays,
    unflatten_like,
    write,
)
from jaxlight.checkpoint.host_state import encode_host, host_checkpoint, hparams_text, save_error
from jaxlight.errors import CheckpointError
from jaxlight.rank_zero import rank_zero_info
from jaxlight.state import holder_keys

if TYPE_CHECKING:  # pragma: no cover
    from jaxlight.trainer import Trainer


# ---------------------------------------------------------------------------- finding the trainer's checkpoints
def resolve_ckpt_path(trainer: Trainer, ckpt_path: str | os.PathLike) -> Path:
    """Turn ``"last"``, ``"best"`` or a path into a complete checkpoint directory, or raise saying why."""
    return resolve(ckpt_path, trainer.checkpoint_callbacks, trainer.default_root_dir)


def find_last_checkpoint(trainer: Trainer) -> Path | None:
    """What ``ckpt_path="last"`` resolves to for ``trainer``: the newest complete checkpoint in its
    checkpoint directories, or None when there is none yet."""
    return find_last(search_dirs(trainer.checkpoint_callbacks, trainer.default_root_dir))


def no_last_checkpoint_reason(trainer: Trainer) -> str:
    """Where ``ckpt_path="last"`` looked and found no complete checkpoint (with any unfinished saves)."""
    return no_last_reason(search_dirs(trainer.checkpoint_callbacks, trainer.default_root_dir))


# ---------------------------------------------------------------------------- what a checkpoint holds
def dump_checkpoint(trainer: Trainer, weights_only: bool = False) -> dict[str, Any]:
    """The host-side checkpoint dict (Lightning's shape, without arrays), after the save hooks ran."""
    module = trainer.lightning_module
    fit_loop = trainer.position.state_dict(trainer.num_training_batches)
    loader_state = fit_loop["loader_state"]
    fit_loop["loader_states_by_process"] = (
        gather_loader_states(loader_state) if _loaders_are_per_process(trainer) else None
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


def _version() -> str:
    # read from the loaded package, not imported: jaxlight's __init__ imports this package
    return str(getattr(sys.modules.get("jaxlight"), "__version__", "unknown"))


def _groups(trainer: Trainer, weights_only: bool) -> tuple[dict[str, dict], dict[str, str]]:
    """The arrays to save, grouped per orbax item, with typed keys turned into raw data."""
    state = trainer.train_state
    impls: dict[str, str] = {}
    if state is None:  # e.g. saved after validate() without fit: the module's own state
        params, rest = trainer.engine.binding.read_module()
        model = {"params": params, "rest": rest}
        train: dict[str, Any] = {}
    else:
        model = {"params": dict(state.params), "rest": dict(state.model_state)}
        train = {
            "opt_state": flatten(state.opt_state),
            "extra": flatten(state.callback_state),
            "step": {"step": state.step},
        }
    groups = {"model": {g: encode_keys(d, g, impls) for g, d in model.items() if d}}
    if not weights_only and train:
        groups["train"] = {g: encode_keys(d, g, impls) for g, d in train.items() if d}
    return groups, impls


def checkpoint_bytes(trainer: Trainer, weights_only: bool = False) -> int:
    """About how many bytes a checkpoint of the trainer's state takes (every array's bytes, all shards, and
    orbax's files: :func:`jaxlight.checkpoint.format.bytes_needed` without the host state); reads only shapes
    and dtypes, nothing is fetched."""
    state = trainer.train_state
    if state is None:
        return 0
    trees = [state.params, state.model_state] + ([] if weights_only else [state.opt_state, state.callback_state])
    leaves = jax.tree_util.tree_leaves(trees)
    return bytes_needed({"state": {"arrays": dict(enumerate(leaves))}}, {}, {})


def _targets(trainer: Trainer, with_train: bool) -> dict[str, dict]:
    """Abstract arrays (shape, dtype, *current* sharding) for what the trainer holds now."""
    state, shs = trainer.train_state, trainer.engine.state_shardings
    if state is None or shs is None:
        params, rest = trainer.engine.binding.read_module()
        out = {
            "model": {
                "params": abstract_like(params, trainer.engine.param_shardings),
                "rest": abstract_like(rest, trainer.engine.rest_shardings),
            }
        }
        return {g: {k: d for k, d in item.items() if d} for g, item in out.items()}
    out = {
        "model": {
            "params": abstract_like(state.params, shs.params),
            "rest": abstract_like(state.model_state, shs.model_state),
        }
    }
    if with_train:
        out["train"] = {
            "opt_state": abstract_like(flatten(state.opt_state), flatten(shs.opt_state)),
            "extra": abstract_like(flatten(state.callback_state), flatten(shs.callback_state)),
            "step": abstract_like({"step": state.step}, {"step": shs.step}),
        }
    return {g: {k: d for k, d in item.items() if d} for g, item in out.items()}


def _meta(
    trainer: Trainer,
    ckpt: dict[str, Any],
    host_state: Any,
    n_arrays: int,
    impls: dict[str, str],
    weights_only: bool,
    reason: str,
    commit_seq: int,
) -> dict[str, Any]:
    fl = ckpt["loops"]["fit_loop"]
    module = trainer.lightning_module
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "jaxlight_version": ckpt["jaxlight_version"],
        "time": time.time(),  # for people: "last" orders by progress and commit_seq, never by a clock
        "commit_seq": commit_seq,
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


def save_checkpoint(
    trainer: Trainer,
    path: str | os.PathLike,
    *,
    weights_only: bool = False,
    checkpointer: Any = None,
    reason: str = "manual",
    commit_seq: int | None = None,
) -> Any:
    """Write the run's state to the directory ``path`` (which must not exist yet).

    With an ``orbax.checkpoint.AsyncCheckpointer`` this returns once every array
    has been copied off the devices; the files are written and committed in the
    background (``checkpointer.wait_until_finished()`` waits). Without one the
    save is synchronous. Every process must call this with the same ``path``.
    ``commit_seq`` orders checkpoints of the same progress for ``"last"`` (default: one more than any
    checkpoint in ``path``'s directory holds). A disk without room for the save raises a
    :class:`CheckpointError` before anything is written.
    """
    path = Path(os.path.abspath(os.fspath(path)))
    error: BaseException | None = None
    try:  # everything that can fail on the host, before orbax writes anything
        ckpt = dump_checkpoint(trainer, weights_only)
        host_state, host_arrays = encode_host(ckpt)
        groups, impls = _groups(trainer, weights_only)
        seq = next_commit_seq(path.parent) if commit_seq is None else commit_seq
        meta = _meta(trainer, ckpt, host_state, len(host_arrays), impls, weights_only, reason, seq)
        json.dumps(meta, allow_nan=False)  # standard JSON (the readable facts are plain too)
        text = hparams_text(ckpt)
        if path.exists():
            raise CheckpointError(f"checkpoint path {path} already exists; refusing to overwrite it")
        needed = bytes_needed(groups, host_arrays, meta)
        check_space(path, needed)
    except Exception as e:
        error = e
    # Multi-process saves: if any process failed to build its part, all of them raise (none waits in orbax).
    failed = distributed.processes_where(error is not None)
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"cannot save the checkpoint: process(es) {failed} failed to build their part of it")
    return write(path, groups, meta, host_arrays, text, checkpointer, needed)


# ---------------------------------------------------------------------------- restoring
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
    meta = read_meta(path)  # the readable facts are checked as the file is read (checkpoint/schema.py)
    ckpt = host_checkpoint(meta, path)  # decoded (and checked) before anything is written into the trainer
    fit = stage == "fit"
    if fit and meta.get("weights_only"):
        raise CheckpointError(
            f"checkpoint {path} holds only the model weights (ModelCheckpoint(save_weights_only=True)); it cannot "
            f"resume fit (optimizer and loop state are missing)"
        )
    if fit:
        _check_callback_states(trainer, ckpt, meta.file or path)
        _prepare_callbacks(trainer, ckpt)
    targets = _targets(trainer, with_train=fit)
    unsaved = drop_unsaved_state(path, targets, holder_keys(trainer.engine.parts))
    arrays = restore_arrays(path, targets, meta.get("key_impls", {}))
    params = arrays["model"].get("params", {})
    model_state = arrays["model"].get("rest", {})
    st = trainer.train_state
    if unsaved:  # kept as they are now
        now = st.model_state if st is not None else trainer.engine.binding.read_module()[1]
        model_state = {**model_state, **{k: now[k] for k in unsaved}}
    if st is not None and fit:
        train = arrays["train"]
        trainer.train_state = st._replace(
            params=params,
            model_state=model_state,
            opt_state=unflatten_like(st.opt_state, train.get("opt_state", {})),
            callback_state=unflatten_like(st.callback_state, train.get("extra", {})),
            step=train["step"]["step"],
        )
    elif st is not None:
        trainer.train_state = st._replace(params=params, model_state=model_state)
    trainer.engine.binding.write_back(params, model_state)

    module = trainer.lightning_module
    if fit:
        _restore_host_state(trainer, ckpt, path)
    if module is not None and not fit:
        module.on_load_checkpoint(ckpt)
    trainer.ckpt_path = as_given(ckpt_path, path)
    rank_zero_info(
        f"jaxlight: restored {stage} state from {path} (global step {meta.get('global_step')}, "
        f"epoch {meta.get('epoch')})"
    )


def _check_callback_states(trainer: Trainer, ckpt: Mapping[str, Any], where: Any) -> None:
    """Each callback checks the state it will be handed (:meth:`Callback.check_state_dict`) before any array
    is read into the trainer; a state it refuses is a CheckpointError naming the file and the key."""
    states = ckpt.get("callbacks", {})
    for cb in trainer.callbacks:
        if cb.state_key not in states:
            continue
        try:
            cb.check_state_dict(states[cb.state_key])
        except CheckpointError:
            raise
        except (TypeError, ValueError, KeyError) as e:
            raise CheckpointError(
                f"checkpoint metadata {where} is malformed at checkpoint['callbacks'][{cb.state_key!r}]: {e}"
            ) from None


def _prepare_callbacks(trainer: Trainer, ckpt: Mapping[str, Any]) -> None:
    """Callbacks that change what the arrays restore into (:attr:`Callback.prepare_resume`) do so first."""
    states = ckpt.get("callbacks", {})
    for cb in trainer.callbacks:
        if callable(cb.prepare_resume) and cb.state_key in states:
            cb.prepare_resume(trainer, trainer.lightning_module, states[cb.state_key])


def _restore_host_state(trainer: Trainer, ckpt: dict[str, Any], path: Path) -> None:
    """A resume's host side: loop position, epoch metrics, dataloader, hooks, callback/datamodule/logger states."""
    module = trainer.lightning_module
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


__all__ = [
    "checkpoint_bytes",
    "dump_checkpoint",
    "find_last_checkpoint",
    "gather_loader_states",
    "no_last_checkpoint_reason",
    "resolve_ckpt_path",
    "restore_into_trainer",
    "restore_logger_states",
    "save_checkpoint",
]
