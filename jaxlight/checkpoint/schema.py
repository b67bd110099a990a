"""What a checkpoint's metadata may hold: every field jaxlight reads, its type and its range.

A checkpoint may come from someone else, so nothing read from ``meta/metadata``
is trusted before it has been checked here: the readable facts of the meta
item (:func:`check_meta`, when the file is read) and the fields of the decoded
host dict that the trainer itself reads (:func:`check_host`, before any array
is read into the trainer). Each failure is a :class:`CheckpointError` naming
the file and the key, with what was expected and what was found. Fields a
callback reads from its own state are checked by the callback
(:meth:`jaxlight.callbacks.Callback.check_state_dict`), also before any array
is read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from jaxlight.errors import CheckpointError
from jaxlight.serialization import KEY_IMPLS

# Counts (steps, epochs, batches) above this are not a run's: 2**53 - 1 is the largest integer a JSON reader
# in any language keeps exactly, and far beyond any real run (10**15 steps).
MAX_COUNT = 2**53 - 1
# The readable counts of the meta item and of the host dict's fit_loop entry.
COUNTS = ("global_step", "epoch", "resume_epoch", "batches_in_epoch", "micro_batches")
COUNT = "an int >= 0"
LOG_SPEC_FIELDS = {"on_step": bool, "on_epoch": bool, "prog_bar": bool, "logger": bool, "reduce_fx": str}


def _kind(value: Any) -> str:
    return type(value).__name__


def malformed(where: Any, key: str, want: str, value: Any) -> CheckpointError:
    """The error for ``key`` (a ``[...]`` path) of the file ``where`` holding ``value`` where ``want`` belongs:
    a number is shown with its value (and the limit of a count), anything else by its type."""
    if type(value) in (int, float):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        if type(value) is int and value > MAX_COUNT and want == COUNT:
            shown += f" (more than any run: the limit is {MAX_COUNT})"
    else:
        shown = _kind(value)
    return CheckpointError(f"checkpoint metadata {where} is malformed: {key} should be {want}, got {shown}")


def is_count(value: Any) -> bool:
    """An ``int`` (not a bool) in ``[0, MAX_COUNT]``."""
    return type(value) is int and 0 <= value <= MAX_COUNT


def is_number(value: Any) -> bool:
    """An ``int`` or ``float`` (not a bool); nan and inf included."""
    return type(value) in (int, float)


def _want(where: Any, key: str, value: Any, ok: bool, want: str) -> None:
    if not ok:
        raise malformed(where, key, want, value)


def check_meta(meta: Mapping[str, Any], where: Any) -> None:
    """The readable facts of a meta item have the types and ranges jaxlight reads them with.

    Every field is optional (checkpoints of earlier versions lack some), but one
    that is present must be valid. ``host_state`` is decoded and checked by
    :func:`jaxlight.checkpoint.host_checkpoint`.
    """
    for key in COUNTS + ("host_arrays", "commit_seq"):
        if key in meta:
            _want(where, f"[{key!r}]", meta[key], is_count(meta[key]), COUNT)
    if "format_version" in meta:
        v = meta["format_version"]
        _want(where, "['format_version']", v, type(v) is int and 0 < v < 2**31, "a positive int")
    if "time" in meta:
        t = meta["time"]
        _want(where, "['time']", t, is_number(t) and math.isfinite(t), "a finite number (seconds since 1970)")
    for key in ("jaxlight_version", "reason", "strategy"):
        if key in meta:
            _want(where, f"[{key!r}]", meta[key], type(meta[key]) is str, "a string")
    if "module_class" in meta:
        _want(
            where,
            "['module_class']",
            meta["module_class"],
            type(meta["module_class"]) in (str, type(None)),
            "a string or null",
        )
    if "weights_only" in meta:
        _want(where, "['weights_only']", meta["weights_only"], type(meta["weights_only"]) is bool, "a bool")
    if "mesh" in meta:
        mesh = meta["mesh"]
        _want(where, "['mesh']", mesh, type(mesh) is dict, "a dict of axis sizes")
        for axis, size in mesh.items():
            _want(where, f"['mesh'][{axis!r}]", size, type(size) is int and 1 <= size <= 2**31, "an int >= 1")
    if "key_impls" in meta:
        impls = meta["key_impls"]
        _want(where, "['key_impls']", impls, type(impls) is dict, "a dict of PRNG implementation names")
        for path, impl in impls.items():
            _want(where, f"['key_impls'][{path!r}]", impl, impl in KEY_IMPLS, f"one of {list(KEY_IMPLS)}")


def check_host(ckpt: Any, where: Any, meta: Mapping[str, Any] | None = None) -> None:
    """The fields the trainer reads from a decoded host dict have the types and ranges it expects.

    With ``meta`` (the meta item it came from), the step and epoch it names must
    be the ones the host dict holds: ``"last"`` orders checkpoints by the meta
    item's step, a resume continues from the host dict's.
    """
    _want(where, "checkpoint", ckpt, isinstance(ckpt, dict), "a dict")
    for key in ("epoch", "global_step"):
        _want(where, f"checkpoint[{key!r}]", ckpt.get(key), is_count(ckpt.get(key)), COUNT)
        if meta is not None and key in meta and meta[key] != ckpt[key]:
            raise CheckpointError(
                f"checkpoint metadata {where} is inconsistent: [{key!r}] is {meta[key]} but "
                f"checkpoint[{key!r}] (the state a resume continues from) is {ckpt[key]}"
            )
    loops = ckpt.get("loops")
    fl = loops.get("fit_loop") if isinstance(loops, dict) else None
    at = "checkpoint['loops']['fit_loop']"
    _want(where, at, fl, isinstance(fl, dict), "a dict")
    optional = tuple(k for k in ("window", "skipped_updates") if k in fl)  # older checkpoints lack them
    for key in ("resume_epoch", "batches_in_epoch", "micro_batches") + optional:
        _want(where, f"{at}[{key!r}]", fl.get(key), is_count(fl.get(key)), COUNT)
    _want(where, f"{at}['fresh_epoch']", fl.get("fresh_epoch"), type(fl.get("fresh_epoch")) is bool, "a bool")
    by_process = fl.get("loader_states_by_process")
    _want(
        where,
        f"{at}['loader_states_by_process']",
        by_process,
        isinstance(by_process, (list, type(None))),
        "a list or None",
    )
    _check_epoch_metrics(fl.get("train_metrics"), where, f"{at}['train_metrics']")
    for key, types, want in (
        ("hyper_parameters", (dict,), "a dict"),
        ("datamodule_hyper_parameters", (dict,), "a dict"),
        ("callbacks", (dict,), "a dict"),
        ("loggers", (list,), "a list"),
        ("datamodule", (dict,), "a dict"),
    ):
        if key in ckpt:
            _want(where, f"checkpoint[{key!r}]", ckpt[key], isinstance(ckpt[key], types), want)
    if not all(isinstance(k, str) for k in ckpt.get("hyper_parameters", {})):
        raise CheckpointError(f"checkpoint metadata {where} is malformed: hyperparameter names must be strings")
    if not all(isinstance(k, str) for k in ckpt.get("callbacks", {})):
        raise CheckpointError(f"checkpoint metadata {where} is malformed: checkpoint['callbacks'] keys must be strings")
    for i, s in enumerate(ckpt.get("loggers", [])):
        _want(where, f"checkpoint['loggers'][{i}]", s, isinstance(s, dict), "a dict")
    if "datamodule" in ckpt and "state" not in ckpt["datamodule"]:
        raise CheckpointError(f"checkpoint metadata {where} is malformed: checkpoint['datamodule'] has no 'state'")


def _check_epoch_metrics(state: Any, where: Any, at: str) -> None:
    """The epoch accumulators of ``self.log`` (``MetricStore.state_dict()``): specs and [value, weight] pairs."""
    if state is None:
        return
    _want(where, at, state, isinstance(state, dict), "a dict or None")
    specs, acc = state.get("specs", {}), state.get("acc", {})
    _want(where, f"{at}['specs']", specs, isinstance(specs, dict), "a dict")
    _want(where, f"{at}['acc']", acc, isinstance(acc, dict), "a dict")
    for name, spec in specs.items():
        key = f"{at}['specs'][{name!r}]"
        ok = isinstance(spec, dict) and set(spec) == set(LOG_SPEC_FIELDS)
        _want(where, key, spec, ok, f"a dict with the fields {sorted(LOG_SPEC_FIELDS)}")
        for field, t in LOG_SPEC_FIELDS.items():
            _want(where, f"{key}[{field!r}]", spec[field], type(spec[field]) is t, f"a {t.__name__}")
    for name, pair in acc.items():
        key = f"{at}['acc'][{name!r}]"
        ok = isinstance(pair, list) and len(pair) == 2 and all(is_number(x) for x in pair)
        _want(where, key, pair, ok, "a [value, weight] pair of numbers")
        if name not in specs:
            raise CheckpointError(f"checkpoint metadata {where} is malformed: {key} has no entry in {at}['specs']")


def check_checkpoint_callback_state(state: Any) -> None:
    """``ModelCheckpoint``'s saved state (its ``state_dict()``) has the types its ``load_state_dict`` reads:
    ``ValueError``/``TypeError`` naming the key otherwise (every key is optional: older states lack some)."""
    if not isinstance(state, dict):
        raise TypeError(f"the state should be a dict, got {_kind(state)}")

    def check(key: str, ok: Any, want: str) -> None:
        if key in state and not ok(state[key]):
            got = state[key]
            shown = repr(got) if isinstance(got, (bool, int, float, str, type(None))) else f"a {_kind(got)}"
            raise ValueError(f"[{key!r}] should be {want}, got {shown[:80]}")

    for key in ("best_model_path", "kth_best_model_path", "last_model_path", "last_checkpoint_saved", "extra_path"):
        check(key, lambda v: type(v) is str, "a string")
    for key in ("monitor", "dirpath"):
        check(key, lambda v: v is None or type(v) is str, "a string or None")
    for key in ("best_model_score", "current_score"):
        check(key, lambda v: v is None or is_number(v), "a number or None")
    check("kth_value", is_number, "a number")
    check("last_global_step_saved", is_count, COUNT)
    check(
        "best_k_models",
        lambda v: isinstance(v, dict) and all(type(k) is str and is_number(x) for k, x in v.items()),
        "a dict of checkpoint path -> score",
    )
    check("pending_removals", lambda v: isinstance(v, list) and all(type(p) is str for p in v), "a list of paths")


__all__ = [
    "COUNTS",
    "KEY_IMPLS",
    "MAX_COUNT",
    "check_checkpoint_callback_state",
    "check_host",
    "check_meta",
    "is_count",
    "is_number",
    "malformed",
]
