"""Errors from tracing a step method, explained: what was traced, where in the user's code, and what to
write instead (JAX's own error chained). ``StepError`` is also raised for step outputs the trainer
cannot use."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import traceback
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import optax


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


def explain_tracing_error(err: Exception, owner: str, method: str) -> TracingError:
    """jaxlight's :class:`TracingError` for a JAX error raised while tracing ``owner.method``."""
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
    try:
        yield
    except TracingError:
        raise
    except _TRACING_ERRORS as e:
        raise explain_tracing_error(e, owner, method) from e


def check_loss(loss: Any, what: str) -> None:
    if not hasattr(loss, "shape") or not hasattr(loss, "dtype"):
        raise StepError(f"{what} must be a jax scalar, got {type(loss).__name__}")
    if loss.shape != ():
        raise StepError(f"{what} must be a scalar, got shape {tuple(loss.shape)} (reduce it, e.g. .mean())")
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise StepError(f"{what} must be floating point, got dtype {loss.dtype}")
