"""Numeric precision policies (Lightning's ``precision`` strings and their aliases).

A policy says what dtype parameters are stored in (``store``), what dtype the
forward computes in (``compute``, applied to the parameters and the batch),
and how the traced NNX modules are prepared for that compute pass (``bind``:
normalisation layers keep their running statistics in float32 without
promoting the activations back to float32).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, NoReturn

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes

from jaxlight.loss_scale import GradScaler

#: Every precision jaxlight accepts, in Lightning's spelling ("64-true" needs ``jax_enable_x64``).
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true")

#: Lightning's short forms, mapped as Lightning maps them.
ALIASES: dict[Any, str] = {
    "32": "32-true",
    32: "32-true",
    "64": "64-true",
    64: "64-true",
    "16": "16-mixed",
    16: "16-mixed",
    "bf16": "bf16-mixed",
}


class Precision(NamedTuple):
    """What dtype parameters are stored in and what dtype the forward computes in.

    "32-true": everything fp32. "bf16-mixed": fp32 master parameters and
    optimizer state; the forward sees bf16 copies of the float parameters and
    float inputs, gradients flow back to the fp32 masters. "16-mixed": the
    same in float16, with dynamic loss scaling (``scaler``, a
    :class:`~jaxlight.loss_scale.GradScaler`; None for every other policy). "bf16-true" /
    "16-true" / "64-true": parameters (and so optimizer state) stored in
    bf16 / fp16 / fp64, float inputs cast to the same dtype (Lightning's
    ``convert_input``). In every policy non-parameter state (BatchNorm running
    statistics, RNG keys) keeps its own dtype; ``bind`` makes the
    normalisation layers that read it return activations in the compute dtype.
    """

    name: str
    param_dtype: Any
    compute_dtype: Any | None
    scaler: GradScaler | None = None

    def store(self, params: dict) -> dict:
        """Cast float parameters to the storage dtype (a no-op for the mixed and fp32 policies)."""
        return _cast_floats(params, self.param_dtype) if self.param_dtype is not None else params

    def compute(self, tree: Any) -> Any:
        """Cast float leaves (parameters, a batch) to the compute dtype; other leaves pass through."""
        return _cast_floats(tree, self.compute_dtype) if self.compute_dtype is not None else tree

    def bind(self, models: Mapping[str, nnx.Module] | nnx.Module) -> Any:
        """Prepare NNX modules rebuilt inside a traced step for the compute pass; returns ``models``.

        A BatchNorm whose ``dtype`` is None promotes its input with its float32
        running mean and variance, so under a bf16 policy its output (and every
        later layer) would compute in float32. Here each such BatchNorm gets a
        ``promote_dtype`` that promotes only the input, scale and bias: the
        statistics are still computed, applied and accumulated in float32, and
        the output comes back in the input's dtype. The running statistics are
        deliberately not cast to bf16: a 0.99-momentum update of a bf16 value
        rounds back to the old value, so the statistics would stop moving.
        Idempotent; a BatchNorm with an explicit ``dtype`` or its own
        ``promote_dtype`` is left alone.
        """
        if self.compute_dtype is None:
            return models
        roots = models.values() if isinstance(models, Mapping) else (models,)
        for root in roots:
            for _, m in nnx.iter_modules(root):
                if isinstance(m, nnx.BatchNorm) and m.dtype is None and m.promote_dtype is nnx_dtypes.promote_dtype:
                    m.promote_dtype = _promote_keeping_statistics
        return models


def _promote_keeping_statistics(args: tuple, /, *, dtype: Any = None, inexact: bool = True) -> tuple:
    """BatchNorm's promote hook: ``(x, mean, var, scale, bias)`` with the statistics left as stored."""
    x, mean, var, scale, bias = args
    x, scale, bias = nnx_dtypes.promote_dtype((x, scale, bias), dtype=dtype, inexact=inexact)
    return x, mean, var, scale, bias


def _cast_floats(tree: Any, dtype: Any) -> Any:
    def cast(x):
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


_POLICIES = {
    "32-true": (None, None),
    "bf16-mixed": (None, jnp.bfloat16),
    "16-mixed": (None, jnp.float16),
    # float inputs are cast as well (Lightning's convert_input), or fp32 batches would promote
    # the whole forward back to fp32
    "bf16-true": (jnp.bfloat16, jnp.bfloat16),
    "16-true": (jnp.float16, jnp.float16),
    "64-true": (jnp.float64, jnp.float64),
}


def resolve_precision(precision: Any) -> Precision:
    """Map a precision setting (Lightning's strings, short aliases or ints, or a policy such as
    :func:`MixedPrecision` returns) to a policy. ``"16-mixed"`` gets a default
    :class:`~jaxlight.loss_scale.GradScaler` (torch's defaults).

    Raises ``ValueError`` naming the setting, why it cannot be used here and
    the valid values.
    """
    if isinstance(precision, Precision):
        return precision
    key = precision
    if isinstance(precision, str):
        key = precision.strip().lower()
    elif isinstance(precision, bool) or not isinstance(precision, int):
        key = str(precision)
    name = ALIASES.get(key, key)
    if name in _POLICIES:
        if name == "64-true" and not jax.config.jax_enable_x64:
            _refuse(
                precision,
                "'64-true' needs 64-bit JAX types: call jax.config.update('jax_enable_x64', True) "
                "before creating any array",
            )
        param_dtype, compute_dtype = _POLICIES[name]
        return Precision(name, param_dtype, compute_dtype, GradScaler() if name == "16-mixed" else None)
    reason = ""
    if isinstance(name, str) and name.startswith("transformer-engine"):
        reason = "Transformer Engine is a torch/CUDA integration with no counterpart in jaxlight"
    _refuse(precision, reason)


# named as Lightning's plugin class, so a Lightning user's line reads the same
def MixedPrecision(
    precision: str = "16-mixed", device: str | None = None, scaler: GradScaler | None = None
) -> Precision:
    """A mixed policy with its settings, as Lightning's ``MixedPrecision(precision, device, scaler)`` plugin:
    ``Trainer(precision=jl.MixedPrecision("16-mixed", scaler=jl.GradScaler(init_scale=2.0**10)))``.

    ``precision``: ``"16-mixed"`` (float16 forward with dynamic loss scaling; ``scaler`` None means
    ``GradScaler()``) or ``"bf16-mixed"`` (no scaler: passing one raises, as in Lightning). ``device``
    is accepted for Lightning's signature and must be None or a device type name (``"cuda"``, ``"cpu"``,
    ``"gpu"``, ``"tpu"``): the compiled step computes in the policy's dtype on whatever devices the Trainer
    runs on (JAX has no per-device autocast).
    """
    name = ALIASES.get(precision, precision)
    if name not in ("16-mixed", "bf16-mixed"):
        raise ValueError(f"MixedPrecision(precision={precision!r}): precision must be '16-mixed' or 'bf16-mixed'")
    if device not in (None, "cuda", "cpu", "gpu", "tpu"):
        raise ValueError(f"MixedPrecision(device={device!r}): choose None, 'cuda', 'gpu', 'cpu' or 'tpu'")
    if scaler is not None and not isinstance(scaler, GradScaler):
        raise TypeError(f"MixedPrecision(scaler=...) takes a jaxlight.GradScaler, got {type(scaler).__name__}")
    if name == "bf16-mixed":
        if scaler is not None:
            raise ValueError(f"precision='bf16-mixed' does not use a scaler, got {scaler}")
        return resolve_precision(name)
    param_dtype, compute_dtype = _POLICIES[name]
    return Precision(name, param_dtype, compute_dtype, scaler if scaler is not None else GradScaler())


def _refuse(precision: Any, reason: str) -> NoReturn:
    aliases = ", ".join(f"{k!r}={v!r}" for k, v in ALIASES.items() if v in _POLICIES)
    raise ValueError(
        f"precision={precision!r} is not supported; choose one of {PRECISIONS} or an alias ({aliases})"
        + (f". {reason}" if reason else "")
    )
