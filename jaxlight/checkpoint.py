"""Checkpoints of a whole run on orbax-checkpoint: save, find, restore.

A checkpoint is one directory written by an orbax ``CompositeCheckpointHandler``
with up to three items:

- ``model``: ``{"params": {path: array}, "rest": {path: array}}``, the module's
  NNX state keyed by the same "/"-joined paths as ``jaxlight.state`` (RNG keys
  are stored as their raw ``key_data`` and re-wrapped on restore);
- ``train``: ``{"opt_state": ..., "extra": ..., "step": ...}``, the optax state,
  callback-owned in-step state (EMA) and the device step counter, each flattened
  to path-keyed dicts (absent in weights-only checkpoints);
- ``meta``: JSON with readable facts (step, epoch, position in the epoch, key
  types) and ``host``: a pickled dict in Lightning's checkpoint shape (loop
  position, dataloader state, callback ``state_dict``s, datamodule and logger
  state, hparams, and whatever ``on_save_checkpoint`` hooks added).

Orbax writes into a temporary directory and renames it on commit, so a
directory with the final name is complete; partial ones are never loaded.
Restores read each array straight into the *current* trainer's shardings, so a
checkpoint saved under one strategy or device count restores under another.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from jaxlight.module import LightningModule
    from jaxlight.trainer import Trainer

FORMAT = "jaxlight-checkpoint"
FORMAT_VERSION = 1
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


def _new_checkpointer(async_: bool) -> Any:
    ocp = _ocp()
    handler = ocp.CompositeCheckpointHandler(
        model=ocp.StandardCheckpointHandler(), train=ocp.StandardCheckpointHandler(), meta=ocp.JsonCheckpointHandler()
    )
    return ocp.AsyncCheckpointer(handler) if async_ else ocp.Checkpointer(handler)


def save_in_flight(checkpointer: Any) -> bool:
    """Whether an async save's background commit is still running (cheap, no waiting)."""
    mgr = getattr(checkpointer, "_async_manager", None)
    if mgr is None:
        return False
    thread = getattr(mgr, "_thread", None)
    return thread is not None and thread.is_alive()


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
        model = {"params": dict(state.params), "rest": dict(state.rest)}
        train = {"opt_state": _flat(state.opt_state), "extra": _flat(state.extra), "step": {"step": state.step}}
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
        "rest": {k: _abstract(v, shs.rest[k]) for k, v in state.rest.items()},
    }
    out = {"model": model}
    if with_train:
        ov, osh = _flat(state.opt_state), _flat(shs.opt_state)
        ev, esh = _flat(state.extra), _flat(shs.extra)
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
    """Every process's loader state, in process order (a collective: all processes call it)."""
    from jax.experimental import multihost_utils

    blob = np.frombuffer(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.int32(blob.size))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: blob.size] = blob
    every = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    return [pickle.loads(every[i, : int(n)].tobytes()) for i, n in enumerate(sizes)]


def _version() -> str:
    try:
        import jaxlight

        return jaxlight.__version__
    except Exception:
        return "unknown"


def _meta(
    trainer: Trainer, ckpt: dict[str, Any], impls: dict[str, str], weights_only: bool, reason: str
) -> dict[str, Any]:
    fl = ckpt["loops"]["fit_loop"]
    module = trainer.lightning_module
    try:
        host = base64.b64encode(pickle.dumps(ckpt, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")
    except Exception as e:  # say which part cannot be saved
        raise CheckpointError(
            f"the checkpoint dict cannot be pickled ({e}); keys added by on_save_checkpoint "
            f"hooks and callback/loader state_dicts must be picklable"
        ) from e
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
        "host": host,
    }


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
    ckpt = dump_checkpoint(trainer, weights_only)
    groups, impls = _groups(trainer, weights_only)
    meta = _meta(trainer, ckpt, impls, weights_only, reason)
    ocp = _ocp()
    items = {g: ocp.args.StandardSave(tree) for g, tree in groups.items()}
    items["meta"] = ocp.args.JsonSave(meta)
    ck = checkpointer if checkpointer is not None else _new_checkpointer(async_=False)
    path = Path(os.path.abspath(os.fspath(path)))
    if path.exists():
        raise CheckpointError(f"checkpoint path {path} already exists; refusing to overwrite it")
    ck.save(path, args=ocp.args.Composite(**items))
    return ck


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


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The ``meta`` item of a checkpoint (readable facts + the pickled host dict)."""
    p = Path(path) / "meta"
    files = sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else []
    for f in files:
        try:
            meta = json.loads(f.read_text())
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(meta, dict) and meta.get("format") == FORMAT:
            return meta
    raise CheckpointError(
        f"{path} holds no readable jaxlight meta item (looked in {p}); it is not a jaxlight checkpoint or it is corrupt"
    )


def host_checkpoint(meta: Mapping[str, Any]) -> dict[str, Any]:
    return pickle.loads(base64.b64decode(meta["host"]))


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
    dirs: list[Path] = []
    for cb in trainer.checkpoint_callbacks:
        dp = getattr(cb, "dirpath", None)
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
    """The most recently committed complete checkpoint in ``dirs`` (progress breaks ties)."""
    best, best_key = None, None
    for d in dirs:
        for p in list_checkpoints(d):
            try:
                m = read_meta(p)
            except CheckpointError:
                continue
            key = (m.get("time", 0.0), m.get("micro_batches", 0), m.get("global_step", 0))
            if best_key is None or key > best_key:
                best, best_key = p, key
    return best


def resolve_ckpt_path(trainer: Trainer, ckpt_path: str | os.PathLike) -> Path:
    """Turn ``"last"``, ``"best"`` or a path into a complete checkpoint directory, or raise saying why."""
    if ckpt_path == "last":
        dirs = _search_dirs(trainer)
        found = find_last(dirs)
        if found is None:
            partial = [str(p) for d in dirs for p in _incomplete(d)]
            extra = f"; incomplete (never committed) saves there: {partial}" if partial else ""
            raise FileNotFoundError(
                f"ckpt_path='last': no complete checkpoint found in {[str(d) for d in dirs]}{extra}. "
                f"Start without ckpt_path, or pass a checkpoint path"
            )
        return found
    if ckpt_path == "best":
        for cb in trainer.checkpoint_callbacks:
            if getattr(cb, "best_model_path", ""):
                return _check_path(cb.best_model_path)
        last = find_last(_search_dirs(trainer))
        if last is not None:
            cbs = host_checkpoint(read_meta(last)).get("callbacks", {})
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
                dec[k] = v
            restored[item][group] = dec
    return restored


def _unflatten_like(template: Any, flat: Mapping[str, Any]) -> Any:
    paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    return jax.tree_util.tree_unflatten(treedef, [flat[_path_key(p)] for p, _ in paths])


def restore_into_trainer(trainer: Trainer, ckpt_path: str | os.PathLike, stage: str) -> None:
    """Load a checkpoint into a set-up trainer: arrays into its current shardings, then loop and host state.

    For ``stage="fit"`` everything a resume needs is restored (optimizer, step,
    epoch, position in the epoch, dataloader, callback/datamodule/logger state);
    for validate/test/predict only the module's parameters and NNX state.
    """
    path = resolve_ckpt_path(trainer, ckpt_path)
    meta = read_meta(path)
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
        extra = _unflatten_like(st.extra, train.get("extra", {}))
        trainer.train_state = type(st)(params, rest, opt_state, extra, train["step"]["step"])
    elif trainer.train_state is not None:
        trainer.train_state = trainer.train_state._replace(params=params, rest=rest)
    trainer.engine.write_back(params, rest)

    ckpt = host_checkpoint(meta)
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
        for cb in trainer.callbacks:
            cb.on_load_checkpoint(trainer, module, ckpt)
        states = ckpt.get("callbacks", {})
        for cb in trainer.callbacks:
            if cb.state_key in states:
                cb.load_state_dict(states[cb.state_key])
        dm = trainer.datamodule
        if dm is not None and "datamodule" in ckpt:
            dm.load_state_dict(ckpt["datamodule"]["state"])
        # Match saved logger states to this run's loggers by class, in order, so a resume with
        # a different logger list still hands each logger its own run id.
        pending = list(ckpt.get("loggers", []))
        for lg in trainer.loggers:
            match = next((s for s in pending if s.get("class") == type(lg).__qualname__), None)
            if match is not None:
                pending.remove(match)
                if match.get("state"):
                    lg.load_state_dict(match["state"])
    if module is not None:
        module.on_load_checkpoint(ckpt)
    trainer.restored_ckpt_path = str(path)
    if trainer.is_global_zero:
        print(
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
    ckpt = host_checkpoint(meta)
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
    "CheckpointError",
    "Preempted",
    "dump_checkpoint",
    "find_last",
    "is_complete",
    "list_checkpoints",
    "load_module_from_checkpoint",
    "read_meta",
    "resolve_ckpt_path",
    "restore_into_trainer",
    "save_checkpoint",
]
