"""Errors from tracing a step method, explained: what was traced, where in the user's code, and what to
write instead (JAX's own error chained). ``StepError`` is also raised for step outputs the trainer
cannot use."""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import re
import threading
import traceback
import types
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxlight.errors import HostSideEffectWarning


class StepError(TypeError):
    """A step method returned something the trainer cannot use."""


DOCS = "docs/optimizers.md#errors-from-tracing"

_TRACING_ERRORS = (
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
    jax.errors.ConcretizationTypeError,
)


class TracingError(StepError):
    """A step method needed a concrete value while it was being traced.

    The raised object is also an instance of the JAX error it explains
    (``jax.errors.TracerBoolConversionError`` and so on), which is chained as
    its ``__cause__``, so code catching JAX's error type still catches it.
    """


@functools.cache
def _tracing_error_type(cls: type) -> type:
    def init(self: Any, message: str) -> None:
        Exception.__init__(self, message)

    return type("TracingError", (TracingError, cls), {"__init__": init, "__module__": __name__})


_PACKAGE_DIRS = tuple(
    os.path.dirname(m.__file__) + os.sep
    for m in (jax, optax, __import__("flax"), __import__("numpy"), __import__("jaxlight"))
    if getattr(m, "__file__", None)
)


def _user_frame(tb: Any) -> traceback.FrameSummary | None:
    """The innermost frame of the traceback outside jax, flax, optax, numpy and jaxlight (the user's line)."""
    frames = [f for f in traceback.extract_tb(tb) if not f.filename.startswith(_PACKAGE_DIRS)]
    return frames[-1] if frames else None


def _traced_what(message: str) -> str:
    m = re.search(r"depends on the value of the arguments? ([^\n]+?)\.?\s*(\n|$)", message)
    arg = m.group(1).strip() if m else ""
    if re.search(r"\bbatch_idx\b", arg):
        return (
            "`batch_idx` is traced: it is an int32 argument of the compiled step, so one program serves every batch "
            "index (host hooks such as on_train_batch_start receive it as a plain int)."
        )
    if re.search(r"\bbatch\b", arg):
        return "The value comes from the batch, which is traced: its numbers exist only when the step runs."
    if re.search(r"\b(params|state|rest)\b", arg):
        return "The value comes from the model's parameters or state, which are traced."
    return "Every array computed inside the step is traced: it has a shape and dtype, but no numbers yet."


def explain_tracing_error(err: Exception, owner: str, method: str, counters_read: Iterable[str] = ()) -> TracingError:
    """jaxlight's :class:`TracingError` for a JAX error raised while tracing ``owner.method``;
    ``counters_read``: the traced counters (``global_step``, ``current_epoch``) the step read."""
    counter_error = _explain_counter(err, owner, method, counters_read)
    if counter_error is not None:
        return counter_error
    if isinstance(err, jax.errors.TracerBoolConversionError):
        did = "uses a traced array as a Python bool (an `if`, `while`, `and`/`or`/`not` or `assert` on it)"
        fix = (
            "compute both results and pick one with jnp.where(cond, a, b), or branch with jax.lax.cond(cond, "
            "true_fn, false_fn, *operands) / jax.lax.switch; decisions about the run itself belong in host "
            "hooks (return -1 from on_train_batch_start to end the epoch, set trainer.should_stop = True)"
        )
    elif isinstance(err, jax.errors.TracerIntegerConversionError):
        did = "uses a traced array as a Python int (an index into a list or tuple, range(x), a Python slice)"
        fix = (
            "index jax arrays instead (x[i], jnp.take), loop with jax.lax.fori_loop, choose among functions "
            "with jax.lax.switch(i, fns, *operands)"
        )
    elif isinstance(err, jax.errors.TracerArrayConversionError):
        did = "passes a traced array to NumPy (np.asarray, np.mean, a NumPy-based library)"
        fix = "use the jax.numpy function of the same name (jnp.asarray, jnp.mean, ...)"
    else:
        did = "converts a traced array to a Python number (float(x), int(x), x.item(), or a function needing one)"
        fix = (
            "keep it an array: self.log(name, x) records it (the host fetches logged values every "
            "log_every_n_steps), self.print(x) or jax.debug.print('{}', x) prints it each time the step runs, "
            "and host hooks (on_train_batch_end receives the step's outputs) may call float() on it"
        )
    frame = _user_frame(err.__traceback__)
    where = f"at {frame.filename}:{frame.lineno} (`{(frame.line or '').strip()}`) " if frame else ""
    message = (
        f"{owner}.{method} cannot run as written inside jaxlight's compiled step: {where}it {did}. "
        f"{_traced_what(str(err))} Step methods are traced once into one compiled program, with placeholder "
        f"arrays (tracers) that have shapes but no values. Instead: {fix}. "
        f"See {DOCS} (JAX's error is chained below)."
    )
    return _tracing_error_type(type(err))(message)


@contextlib.contextmanager
def explained_tracing_errors(owner: str, method: str) -> Iterator[None]:
    """Re-raise JAX's concretization errors from tracing ``owner.method`` as :class:`TracingError`."""
    reads = _ACTIVE.stack[-1].read if _ACTIVE.stack else set()
    try:
        yield
    except TracingError:
        raise
    except _TRACING_ERRORS as e:
        raise explain_tracing_error(e, owner, method, sorted(reads)) from e


# ----------------------------------------------------------------------------------- traced counters
# While a step is traced, ``self.global_step`` / ``self.current_epoch`` (and the trainer's) are the step's
# traced int32 values: a Python int read at trace time would be compiled in as a constant, so logic such as
# ``jnp.where(self.global_step % 2 == 0, ...)`` would be decided once, on the step the trace happened at.
COUNTERS: tuple[str, ...] = ("global_step", "current_epoch")


class TracedCounters:
    """The traced values of the counters of the step being traced, and which of them the step read."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self.values = dict(values)
        self.read: set[str] = set()


class _Active(threading.local):
    # Per thread: the thread tracing a step sees its tracers; any other thread reading trainer.global_step
    # meanwhile (a watcher, a logger's worker, a user's thread) gets the Python int, never a leaked tracer.
    def __init__(self) -> None:
        self.stack: list[TracedCounters] = []  # tracing is synchronous: one step method at a time per thread


_ACTIVE = _Active()


def traced_counter(name: str) -> Any | None:
    """The traced value of counter ``name`` while a step method is traced (recording the read), else None."""
    stack = _ACTIVE.stack
    if not stack:
        return None
    active = stack[-1]
    value = active.values.get(name)
    if value is not None:
        active.read.add(name)
    return value


@contextlib.contextmanager
def traced_counters(values: Mapping[str, Any]) -> Iterator[TracedCounters]:
    """Make ``self.global_step`` / ``self.current_epoch`` (and ``trainer``'s) read ``values`` inside the block."""
    active = TracedCounters(values)
    _ACTIVE.stack.append(active)
    try:
        yield active
    finally:
        _ACTIVE.stack.pop()


_COUNTER_MEANS = {
    "global_step": "the optimizer steps done so far, this step's own value in every step the program runs",
    "current_epoch": "the epoch the step runs in, passed to the compiled step as an int32 argument",
}


def _explain_counter(err: Exception, owner: str, method: str, read: Iterable[str]) -> TracingError | None:
    """The error naming ``self.global_step`` / ``self.current_epoch`` when the failing line used one (or the
    step read one and the line names none of the step's other inputs), else None."""
    read = list(read)
    if not read:
        return None
    frame = _user_frame(err.__traceback__)
    line = (frame.line or "") if frame else ""
    named = [c for c in read if re.search(rf"\b{c}\b", line)]
    if not named:
        return None
    if isinstance(err, jax.errors.TracerBoolConversionError):
        did = "a Python bool (an `if`, `while`, `and`/`or`/`not` or `assert` on it)"
    elif isinstance(err, jax.errors.TracerIntegerConversionError):
        did = "a Python int (an index into a list, range(...))"
    else:
        did = "a concrete number (float(...), int(...), NumPy)"
    attrs = " and ".join(f"`self.{c}`" for c in named)
    means = "; ".join(f"`{c}` is {_COUNTER_MEANS[c]}" for c in named)
    where = f"at {frame.filename}:{frame.lineno} (`{line.strip()}`) " if frame else ""
    message = (
        f"{owner}.{method} uses {attrs} as {did} {where}inside jaxlight's compiled step. Inside a step method "
        f"{attrs} {'is' if len(named) == 1 else 'are'} traced int32 arrays ({means}): the step is traced once, "
        f"so a Python decision on {'it' if len(named) == 1 else 'them'} would be taken for the first step and "
        f"compiled in for every later one. Either decide inside the step with a traced condition "
        f"(`jnp.where(self.{named[0]} % 2 == 0, a, b)`, `jax.lax.cond(pred, true_fn, false_fn, *operands)`), or "
        f"move the logic to a host hook such as on_train_batch_start, where self.{named[0]} is a Python int. "
        f"See docs/trainer.md#counters-inside-a-step (JAX's error is chained below)."
    )
    return _tracing_error_type(type(err))(message)


# ----------------------------------------------------------------------------------- host side effects
# A step method's Python runs once, when it is traced: host state it changes (a replay buffer it fills, an
# environment it steps, a counter it bumps) changes once, not per batch. A snapshot of the module's plain
# attributes before and after the trace names what changed; it costs nothing per step.
_BASE_ATTRIBUTES = frozenset(
    {"_trainer", "_collector", "_hparams", "_hparams_initial", "_training", "_frozen", "_automatic_optimization"}
)
_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_SIZED = (list, dict, set, bytearray, collections.deque)


def _is_state(x: Any) -> bool:
    from jaxlight.state import is_nnx_object

    return is_nnx_object(x)


def _plain_object(x: Any) -> bool:
    """An instance of a user's class holding host state in its ``__dict__`` (an agent, a buffer)."""
    return (
        hasattr(x, "__dict__")
        and not isinstance(x, (type, types.ModuleType, types.FunctionType, types.MethodType, functools.partial))
        and not isinstance(x, (jax.Array, jax.core.Tracer))
        and not _is_state(x)
    )


def _summary(x: Any, deep: bool) -> Any:
    if isinstance(x, _SCALARS):
        return ("value", type(x), x)
    if isinstance(x, _SIZED):
        return ("sized", id(x), len(x))
    if deep and _plain_object(x):
        inner = {k: _summary(v, False) for k, v in vars(x).items() if not callable(v) or isinstance(v, _SIZED)}
        return ("object", id(x), inner)
    return ("id", id(x))


def host_snapshot(module: Any, skip: Iterable[str] = ()) -> dict[str, Any]:
    """The module's plain attributes (not NNX state, not methods), one level into plain objects it holds."""
    skipped = _BASE_ATTRIBUTES | set(skip)
    return {
        k: _summary(v, True)
        for k, v in vars(module).items()
        if k not in skipped and not _is_state(v) and not (callable(v) and not _plain_object(v))
    }


def _changes(before: Mapping[str, Any], after: Mapping[str, Any], prefix: str = "self.") -> list[str]:
    out: list[str] = []
    for k in sorted(set(before) | set(after)):
        a, b = before.get(k), after.get(k)
        if a == b:
            continue
        name = f"{prefix}{k}"
        if a is None or b is None:
            out.append(f"{name} ({'set' if a is None else 'deleted'})")
        elif a[0] == b[0] == "object" and a[1] == b[1]:
            out.extend(_changes(a[2], b[2], f"{name}."))
        elif a[0] == b[0] == "sized" and a[1] == b[1]:
            out.append(f"{name} (length {a[2]} -> {b[2]})")
        elif a[0] == b[0] == "value":
            out.append(f"{name} ({a[2]!r} -> {b[2]!r})")
        else:
            out.append(f"{name} (reassigned)")
    return out


@contextlib.contextmanager
def host_effects_watched(module: Any, method: str, skip: Iterable[str] = ()) -> Iterator[None]:
    """Warn (:class:`~jaxlight.errors.HostSideEffectWarning`) when tracing ``module.method`` in the block
    changed the module's host state, naming what changed."""
    before = host_snapshot(module, skip)
    yield
    changed = _changes(before, host_snapshot(module, skip))
    if changed:
        owner = type(module).__name__
        warnings.warn(
            f"{owner}.{method} changed host state while it was traced: {', '.join(changed)}. A step method's "
            f"Python code runs once, when jaxlight compiles the step, not at every batch: this change happened "
            f"once and will not happen again. Per-batch host work (stepping an environment, filling a replay "
            f"buffer, counting) belongs in a host hook such as on_train_batch_start (or the data loader); inside "
            f"the step, keep state in NNX variables (nnx.Variable), which the step carries.",
            HostSideEffectWarning,
            stacklevel=3,
        )


def check_loss(loss: Any, what: str) -> None:
    if not hasattr(loss, "shape") or not hasattr(loss, "dtype"):
        raise StepError(f"{what} must be a jax scalar, got {type(loss).__name__}")
    if loss.shape != ():
        raise StepError(f"{what} must be a scalar, got shape {tuple(loss.shape)} (reduce it, e.g. .mean())")
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise StepError(f"{what} must be floating point, got dtype {loss.dtype}")
