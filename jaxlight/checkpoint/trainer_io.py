"""The Trainer's side of a checkpoint: the only module of the package that knows the Trainer.

Two functions touch the Trainer: :func:`view_of` reads every part of it a
checkpoint needs into a :class:`RunView`, and :func:`apply_restored` writes a
restored :class:`~jaxlight.checkpoint.run_state.RunSnapshot` back into it.
Everything between works on the view: :func:`snapshot_of` builds the value a
save writes (running the save hooks), and the restore reads the checkpoint
through :func:`jaxlight.checkpoint.run_state.restore` into the trainer's
*current* shardings, so a checkpoint saved under one strategy or device count
restores under another.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxlight.checkpoint import run_state
from jaxlight.checkpoint.discovery import as_given, find_last, no_last_reason, resolve, search_dirs
from jaxlight.checkpoint.run_state import RunSnapshot, gather_loader_states
from jaxlight.errors import CheckpointError
from jaxlight.rank_zero import rank_zero_info
from jaxlight.state import holder_keys

if TYPE_CHECKING:  # pragma: no cover
    from jaxlight.trainer import Trainer


@dataclass(frozen=True)
class RunView:
    """The parts of a Trainer a checkpoint reads, taken at one moment by :func:`view_of`.

    ``trainer`` itself is only handed on, as is, to the Lightning hooks that take
    it (``Callback.on_save_checkpoint(trainer, module, checkpoint)`` and the like).
    """

    trainer: Any
    module: Any
    callbacks: Sequence[Any]
    loggers: Sequence[Any]
    datamodule: Any
    position: Any
    reporter: Any
    engine: Any
    train_state: Any
    num_training_batches: int | float
    process_local_batches: Any
    strategy: Any
    mesh: Any
    checkpoint_callbacks: Sequence[Any]
    default_root_dir: Any

    @property
    def search_dirs(self) -> list[str]:
        """Where ``ckpt_path="last"`` looks: the checkpoint callbacks' directories, else the root dir's."""
        return search_dirs(self.checkpoint_callbacks, self.default_root_dir)


def view_of(trainer: Trainer) -> RunView:
    """Read the trainer's parts a checkpoint needs (the one place that reads Trainer attributes)."""
    return RunView(
        trainer=trainer,
        module=trainer.lightning_module,
        callbacks=list(trainer.callbacks),
        loggers=list(trainer.loggers),
        datamodule=trainer.datamodule,
        position=trainer.position,
        reporter=trainer.reporter,
        engine=trainer.engine,
        train_state=trainer.train_state,
        num_training_batches=trainer.num_training_batches,
        process_local_batches=trainer.process_local_batches,
        strategy=trainer.strategy,
        mesh=trainer.mesh,
        checkpoint_callbacks=list(trainer.checkpoint_callbacks),
        default_root_dir=trainer.default_root_dir,
    )


def apply_restored(
    trainer: Trainer, view: RunView, restored: RunSnapshot, *, stage: str, path: Path, ckpt_path: Any
) -> None:
    """Hand a snapshot restored from ``path`` back to the run (the one place that writes into the Trainer).

    Arrays first (the train state, and the module's attributes through the engine),
    then for ``stage="fit"`` the host side (loop position, epoch metrics, dataloader,
    hooks, callback/datamodule/logger states); for other stages the module's
    ``on_load_checkpoint``. ``ckpt_path`` is recorded as the user gave it.
    """
    st = view.train_state
    if st is not None and restored.has_train:
        trainer.train_state = st._replace(
            params=restored.params,
            model_state=restored.model_state,
            opt_state=restored.opt_state,
            callback_state=restored.callback_state,
            step=restored.step,
            loss_scale=restored.loss_scale,
        )
    elif st is not None:
        trainer.train_state = st._replace(params=restored.params, model_state=restored.model_state)
    view.engine.binding.write_back(restored.params, restored.model_state)
    ckpt = dict(restored.host)
    if stage == "fit":
        _restore_host_state(view, ckpt, path)
    elif view.module is not None:
        view.module.on_load_checkpoint(ckpt)
    trainer.ckpt_path = ckpt_path


# ---------------------------------------------------------------------------- finding the trainer's checkpoints
def resolve_ckpt_path(trainer: Trainer, ckpt_path: str | os.PathLike) -> Path:
    """Turn ``"last"``, ``"best"`` or a path into a complete checkpoint directory, or raise saying why."""
    view = view_of(trainer)
    return resolve(ckpt_path, view.checkpoint_callbacks, view.default_root_dir)


def find_last_checkpoint(trainer: Trainer) -> Path | None:
    """What ``ckpt_path="last"`` resolves to for ``trainer``: the newest complete checkpoint in its
    checkpoint directories, or None when there is none yet."""
    return find_last(view_of(trainer).search_dirs)


def no_last_checkpoint_reason(trainer: Trainer) -> str:
    """Where ``ckpt_path="last"`` looked and found no complete checkpoint (with any unfinished saves)."""
    return no_last_reason(view_of(trainer).search_dirs)


# ---------------------------------------------------------------------------- saving
def _loaders_are_per_process(view: RunView) -> bool:
    # With process-local batches each process's loader is at its own position; otherwise every
    # process reads the same loader and process 0's state stands for all.
    return jax.process_count() > 1 and bool(view.process_local_batches)


def host_of(view: RunView, weights_only: bool = False) -> dict[str, Any]:
    """The host-side checkpoint dict (Lightning's shape, without arrays), after the save hooks ran."""
    module, position = view.module, view.position
    fit_loop = position.state_dict(view.num_training_batches)
    loader_state = fit_loop["loader_state"]
    fit_loop["loader_states_by_process"] = (
        gather_loader_states(loader_state) if _loaders_are_per_process(view) else None
    )
    if view.train_state is not None:
        # Updates the device step counter did not count (NonFiniteGuard("skip") drops them; global_step counts
        # them): a resume checks global_step against the restored counter plus these. One scalar, read as the
        # save copies the arrays off the devices anyway.
        counter = int(np.asarray(view.train_state.step.addressable_data(0)))
        fit_loop["skipped_updates"] = position.global_step - counter
    # epoch-level self.log accumulators of the epoch in progress
    fit_loop["train_metrics"] = view.reporter.epoch_state_dict("train") if fit_loop["batches_in_epoch"] else None
    ckpt: dict[str, Any] = {
        "epoch": position.epoch,
        "global_step": position.global_step,
        "jaxlight_version": run_state._version(),
        "loops": {"fit_loop": fit_loop},
        "hyper_parameters": dict(module.hparams) if module is not None else {},
        "hparams_name": "kwargs",
    }
    if not weights_only:
        ckpt["callbacks"] = {}
        for cb in view.callbacks:
            sd = cb.state_dict()
            if sd:
                ckpt["callbacks"][cb.state_key] = sd
        dm = view.datamodule
        if dm is not None:
            ckpt["datamodule"] = {"class": type(dm).__qualname__, "state": dm.state_dict()}
            if getattr(dm, "hparams", None):
                ckpt["datamodule_hyper_parameters"] = dict(dm.hparams)
        ckpt["loggers"] = [{"class": type(lg).__qualname__, "state": lg.state_dict()} for lg in view.loggers]
        for cb in view.callbacks:
            cb.on_save_checkpoint(view.trainer, module, ckpt)
    if module is not None:
        module.on_save_checkpoint(ckpt)
    return ckpt


def dump_checkpoint(trainer: Trainer, weights_only: bool = False) -> dict[str, Any]:
    """The host-side checkpoint dict of ``trainer`` (Lightning's shape, without arrays), after the save hooks ran."""
    return host_of(view_of(trainer), weights_only)


def snapshot_of(view: RunView, weights_only: bool = False) -> RunSnapshot:
    """What a checkpoint of the run holds now: its arrays (read, not fetched), host dict and readable facts.

    Runs the save hooks (callbacks' and the module's ``on_save_checkpoint``) and,
    with per-process loaders, a collective: every process calls it.
    """
    host = host_of(view, weights_only)
    state, module = view.train_state, view.module
    facts = {
        "global_step": view.position.global_step,
        "epoch": view.position.epoch,
        "module_class": f"{type(module).__module__}.{type(module).__qualname__}" if module is not None else None,
        "strategy": str(view.strategy),
        "mesh": {k: int(v) for k, v in view.mesh.shape.items()},
    }
    if state is None:  # e.g. saved after validate() without fit: the module's own state
        params, rest = view.engine.binding.read_module()
        return RunSnapshot(params, rest, host=host, facts=facts, weights_only=weights_only)
    snap = RunSnapshot(dict(state.params), dict(state.model_state), host=host, facts=facts, weights_only=weights_only)
    if weights_only:
        return snap
    return snap.replace(
        opt_state=state.opt_state, callback_state=state.callback_state, step=state.step, loss_scale=state.loss_scale
    )


def save_checkpoint(
    trainer: Trainer,
    path: str | os.PathLike,
    *,
    weights_only: bool = False,
    checkpointer: Any = None,
    reason: str = "manual",
    commit_seq: int | None = None,
) -> Any:
    """Write the run's state to the directory ``path`` (which must not exist yet): :func:`snapshot_of` the
    trainer, saved by :func:`jaxlight.checkpoint.run_state.save` (see there; every process calls it)."""
    view = view_of(trainer)
    return run_state.save(
        lambda: snapshot_of(view, weights_only), path, checkpointer=checkpointer, reason=reason, commit_seq=commit_seq
    )


# ---------------------------------------------------------------------------- restoring
def _like(view: RunView, with_train: bool) -> tuple[RunSnapshot, RunSnapshot]:
    """The run's current arrays and the shardings each is restored into (the engine's, not the arrays' own)."""
    state, shs = view.train_state, view.engine.state_shardings
    if state is None or shs is None:
        params, rest = view.engine.binding.read_module()
        like = RunSnapshot(params, rest)
        return like, RunSnapshot(view.engine.param_shardings, view.engine.rest_shardings)
    if not with_train:
        like = RunSnapshot(dict(state.params), dict(state.model_state))
        return like, RunSnapshot(dict(shs.params), dict(shs.model_state))
    like = RunSnapshot(
        dict(state.params), dict(state.model_state), state.opt_state, state.callback_state, state.step, state.loss_scale
    )
    shardings = (shs.opt_state, shs.callback_state, shs.step, shs.loss_scale)
    return like, RunSnapshot(dict(shs.params), dict(shs.model_state), *shardings)


def _load_logger_states(loggers: Sequence[Any], ckpt: Mapping[str, Any]) -> None:
    # Match saved logger states to this run's loggers by class, in order, so a resume with
    # a different logger list still hands each logger its own run id.
    pending = list(ckpt.get("loggers", []))
    for lg in loggers:
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
    view = view_of(trainer)
    path = resolve(ckpt_path, view.checkpoint_callbacks, view.default_root_dir)
    _load_logger_states(view.loggers, run_state.read_host(path)[1])


def restore_into_trainer(trainer: Trainer, ckpt_path: str | os.PathLike, stage: str) -> None:
    """Load a checkpoint into a set-up trainer: arrays into its current shardings, then loop and host state.

    For ``stage="fit"`` everything a resume needs is restored (optimizer, step,
    epoch, position in the epoch, dataloader, callback/datamodule/logger state);
    for validate/test/predict only the module's parameters and NNX state.
    """
    view = view_of(trainer)
    path = resolve(ckpt_path, view.checkpoint_callbacks, view.default_root_dir)
    meta, ckpt = host = run_state.read_host(path)  # decoded and checked before anything is written into the trainer
    fit = stage == "fit"
    if fit and meta.get("weights_only"):
        raise CheckpointError(
            f"checkpoint {path} holds only the model weights (ModelCheckpoint(save_weights_only=True)); it cannot "
            f"resume fit (optimizer and loop state are missing)"
        )
    if fit:
        _check_callback_states(view.callbacks, ckpt, meta.file or path)
        if _prepare_callbacks(view, ckpt):
            view = view_of(trainer)  # what the arrays restore into may have changed
    if fit:
        check_loader_position(ckpt, path)
    like, shardings = _like(view, with_train=fit)
    restored = run_state.restore(like, path, shardings=shardings, optional=holder_keys(view.engine.parts), host=host)
    if fit and restored.has_train:
        check_step_counter(ckpt, restored.step, path)  # before anything is written into the trainer
    apply_restored(trainer, view, restored, stage=stage, path=path, ckpt_path=as_given(ckpt_path, path))
    rank_zero_info(
        f"jaxlight: restored {stage} state from {path} (global step {meta.get('global_step')}, "
        f"epoch {meta.get('epoch')})"
    )


def check_step_counter(ckpt: Mapping[str, Any], step: Any, path: Path) -> None:
    """The global step the metadata names agrees with the train state's step counter restored beside it.

    The counter counts the optimizer updates applied (``accumulate_grad_batches`` micro-batches make one, as
    for ``global_step``); a checkpoint records how many updates it did not count
    (``fit_loop["skipped_updates"]``, NonFiniteGuard's skipped ones), so ``global_step == counter + skipped``.
    Checkpoints older than that record hold ``counter <= global_step <= micro_batches`` (a skipped update lowers
    the counter; every update consumes at least one micro-batch). Otherwise a :class:`CheckpointError` naming
    both numbers and ``path``: a resume would continue at a step its arrays never reached.
    """
    fl = ckpt["loops"]["fit_loop"]
    gs, counter = ckpt["global_step"], int(np.asarray(step.addressable_data(0)))
    skipped = fl.get("skipped_updates")
    if skipped is not None:
        if gs == counter + skipped:
            return
        also = f" plus the {skipped} updates it records as skipped" if skipped else ""
        raise CheckpointError(
            f"checkpoint {path} is inconsistent: its metadata says global step {gs}, but the train state's step "
            f"counter (the optimizer updates its arrays have seen) is {counter}{also}, which makes "
            f"{counter + skipped}; refusing to resume from it"
        )
    mb = fl["micro_batches"]
    if not counter <= gs <= mb:
        raise CheckpointError(
            f"checkpoint {path} is inconsistent: its metadata says global step {gs} after {mb} micro-batches, but "
            f"the train state's step counter (the optimizer updates its arrays have seen) is {counter}; a global "
            f"step lies between the counter and the micro-batches; refusing to resume from it"
        )


def check_loader_position(ckpt: Mapping[str, Any], path: Path) -> None:
    """The position in the epoch the metadata names agrees with the train loader state stored beside it.

    Checked where the loader state says it: a torchdata ``StatefulDataLoader`` counts the batches it yielded
    this epoch (``_num_yielded``), a ``GrainLoader`` its epoch. A finished epoch (``fresh_epoch``) resumes at the
    next one from a fresh loader, so there is nothing to compare. A disagreement is a :class:`CheckpointError`
    naming both numbers and ``path``.
    """
    fl = ckpt["loops"]["fit_loop"]
    if fl.get("fresh_epoch"):
        return
    at, epoch = fl["batches_in_epoch"], fl["resume_epoch"]
    states = [fl.get("loader_state")] + list(fl.get("loader_states_by_process") or [])
    for state in states:
        if not isinstance(state, Mapping):
            continue
        n = state.get("_num_yielded")
        if type(n) is int and n != at:
            raise CheckpointError(
                f"checkpoint {path} is inconsistent: its metadata resumes after batch {at} of epoch {epoch}, but "
                f"the train loader state stored with it has yielded {n} batches of that epoch; refusing to resume"
            )
        e = state.get("epoch") if set(state) == {"epoch", "iterator"} else None  # a GrainLoader's state
        if type(e) is int and e != epoch:
            raise CheckpointError(
                f"checkpoint {path} is inconsistent: its metadata resumes inside epoch {epoch}, but the train "
                f"loader state stored with it is at epoch {e}; refusing to resume"
            )


def _check_callback_states(callbacks: Sequence[Any], ckpt: Mapping[str, Any], where: Any) -> None:
    """Each callback checks the state it will be handed (:meth:`Callback.check_state_dict`) before any array
    is read into the trainer; a state it refuses is a CheckpointError naming the file and the key."""
    states = ckpt.get("callbacks", {})
    for cb in callbacks:
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


def _prepare_callbacks(view: RunView, ckpt: Mapping[str, Any]) -> bool:
    """Callbacks that change what the arrays restore into (:attr:`Callback.prepare_resume`) do so first;
    True when any did."""
    states = ckpt.get("callbacks", {})
    ran = False
    for cb in view.callbacks:
        if callable(cb.prepare_resume) and cb.state_key in states:
            cb.prepare_resume(view.trainer, view.module, states[cb.state_key])
            ran = True
    return ran


def _restore_host_state(view: RunView, ckpt: dict[str, Any], path: Path) -> None:
    """A resume's host side: loop position, epoch metrics, dataloader, hooks, callback/datamodule/logger states."""
    module = view.module
    fl = {**ckpt["loops"]["fit_loop"], "global_step": ckpt["global_step"]}
    state = fl.get("loader_state")
    if fl.get("train_metrics") and not fl.get("fresh_epoch"):
        view.reporter.load_epoch_state_dict(fl["train_metrics"], "train")
    by_process = fl.get("loader_states_by_process")
    if by_process is not None or _loaders_are_per_process(view):
        if by_process is None or len(by_process) != jax.process_count():
            saved = "one shared loader" if by_process is None else f"{len(by_process)} per-process loaders"
            raise CheckpointError(
                f"{path} holds the data position of {saved}, but this run has {jax.process_count()} "
                f"processes with process_local_batches={view.process_local_batches}; an exact resume "
                f"needs the same process count and loader layout"
            )
        state = by_process[jax.process_index()]
    view.position.load_state_dict(fl, loader_state=state)
    if module is not None:  # Lightning: the module's hook before the callbacks'
        module.on_load_checkpoint(ckpt)
    for cb in view.callbacks:
        cb.on_load_checkpoint(view.trainer, module, ckpt)
    states = ckpt.get("callbacks", {})
    for cb in view.callbacks:
        if cb.state_key in states:
            cb.load_state_dict(states[cb.state_key])
    dm = view.datamodule
    if dm is not None and "datamodule" in ckpt:
        dm.load_state_dict(ckpt["datamodule"]["state"])
    _load_logger_states(view.loggers, ckpt)


__all__ = [
    "RunView",
    "apply_restored",
    "dump_checkpoint",
    "find_last_checkpoint",
    "host_of",
    "no_last_checkpoint_reason",
    "resolve_ckpt_path",
    "restore_into_trainer",
    "restore_logger_states",
    "save_checkpoint",
    "snapshot_of",
    "view_of",
]
