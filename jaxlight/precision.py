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
import numpy as np
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes

from jaxlight.errors import Float32MatmulWarning
from jaxlight.flops import MatmulDtypes, matmul_dtypes
from jaxlight.loss_scale import GradScaler
from jaxlight.rank_zero import rank_zero_warn

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

        Every flax layer that leaves its compute ``dtype`` to flax (:func:`follows_policy`: ``Linear``,
        ``LinearGeneral``, ``Einsum``, ``Conv``, ``ConvTranspose``, ``Embed``, ``MultiHeadAttention``,
        the normalisation layers, the recurrent cells, ``LoRA``...) gets the compute dtype, as Lightning's
        autocast runs every matrix product in it: without this an ``nnx.Embed`` returns its float32 default
        dtype and every later layer promotes back to float32. Layers that set a ``dtype`` themselves
        keep it (:func:`explicit_dtype_layers` lists them; the trainer names them when they leave matmul
        FLOPs in float32). Adapters (``from_linen``) get the dtype through their
        ``_jaxlight_compute_dtype`` hook and apply the same rule to the layers they hold.

        A BatchNorm would promote its input with its float32 running mean and variance; here each
        BatchNorm gets a ``promote_dtype`` that promotes only the input, scale and bias: the statistics
        are still computed, applied and accumulated in float32 (flax computes every normalisation's
        statistics in at least float32), and the output comes back in the compute dtype. The running
        statistics are deliberately not cast to bf16: a 0.99-momentum update of a bf16 value rounds back
        to the old value, so the statistics would stop moving. Idempotent; a BatchNorm with its own
        ``promote_dtype`` is left alone.
        """
        if self.compute_dtype is None:
            return models
        roots = models.values() if isinstance(models, Mapping) else (models,)
        for root in roots:
            for _, m in nnx.iter_modules(root):
                if isinstance(m, nnx.BatchNorm) and m.dtype is None and m.promote_dtype is nnx_dtypes.promote_dtype:
                    m.promote_dtype = _promote_keeping_statistics
                if follows_policy(m):
                    m.dtype = self.compute_dtype
                hook = getattr(m, "_jaxlight_compute_dtype", None)
                if callable(hook):
                    hook(self.compute_dtype)
        return models

    @property
    def half(self) -> bool:
        """Whether the forward computes in a 16-bit float (bf16 or fp16)."""
        return self.compute_dtype is not None and jnp.dtype(self.compute_dtype).itemsize == 2


#: NNX layers whose ``dtype`` parametrises a weight (a power iteration, a norm of the kernel), not the
#: activations' compute: they keep flax's default.
_WEIGHT_REPARAMETRISATIONS = (nnx.SpectralNorm, nnx.WeightNorm)


def _flax_layer(m: Any) -> bool:
    return type(m).__module__.startswith("flax.") and hasattr(m, "dtype") and hasattr(m, "param_dtype")


def follows_policy(m: Any) -> bool:
    """Whether ``m`` is a flax NNX layer that leaves its compute dtype to flax (so the precision sets it).

    That is a ``dtype`` of None, or for ``nnx.Embed`` the table's own dtype that flax stores when none is
    given (a ``numpy.dtype`` instance; an explicit ``dtype=jnp.float32`` is a scalar type and is kept).
    Users' own modules are never touched, whatever attributes they have.
    """
    if not _flax_layer(m) or isinstance(m, _WEIGHT_REPARAMETRISATIONS):
        return False
    if isinstance(m, nnx.Embed):
        return isinstance(m.dtype, np.dtype) and m.dtype == jnp.dtype(m.param_dtype)
    return m.dtype is None


def explicit_dtype_layers(models: Mapping[str, nnx.Module] | nnx.Module, compute_dtype: Any) -> list[str]:
    """``"path (Type, dtype=...)"`` of every flax layer in ``models`` that sets its own floating compute dtype
    other than ``compute_dtype`` (the layers a precision policy leaves alone)."""
    roots = models.items() if isinstance(models, Mapping) else (("", models),)
    out = []
    for name, root in roots:
        for path, m in nnx.iter_modules(root):
            if not _flax_layer(m) or isinstance(m, _WEIGHT_REPARAMETRISATIONS) or follows_policy(m):
                continue
            dt = m.dtype
            if dt is None or not jnp.issubdtype(dt, jnp.floating) or jnp.dtype(dt) == jnp.dtype(compute_dtype):
                continue
            where = "/".join(str(p) for p in (name, *path) if str(p))
            out.append(f"{where or '<root>'} ({type(m).__name__}, dtype={jnp.dtype(dt).name})")
    return out


#: The share of a half-precision step's matmul FLOPs allowed a float32 operand before the trainer warns.
FLOAT32_TOLERANCE = 0.05


def check_matmul_dtypes(
    precision: Precision, jaxpr: Any, models: Mapping[str, nnx.Module] | nnx.Module
) -> MatmulDtypes | None:
    """The matmul FLOPs of a traced train step by operand dtype (None unless ``precision`` computes in a half
    dtype); a :class:`~jaxlight.errors.Float32MatmulWarning` (process 0) when more than
    :data:`FLOAT32_TOLERANCE` of them have a float32 operand, naming the layers of ``models`` that keep their
    own dtype and the largest float32 sources."""
    if not precision.half:
        return None
    counts = matmul_dtypes(jaxpr)
    if counts.float32_fraction <= FLOAT32_TOLERANCE:
        return counts
    half = jnp.dtype(precision.compute_dtype).name
    lines = [
        f"precision={precision.name!r} computes in {half}, but {counts.float32_fraction:.1%} of the train step's "
        f"matmul FLOPs ({sum(counts.float32_sites.values()):.3g} of {counts.flops:.3g}) have a float32 operand and "
        f"run at the float32 rate (more than {FLOAT32_TOLERANCE:.0%})."
    ]
    kept = explicit_dtype_layers(models, precision.compute_dtype)
    if kept:
        lines.append("Layers that set their own dtype (kept as set): " + "; ".join(kept) + ".")
    top = list(counts.float32_sites.items())[:5]
    lines.append(
        "Largest float32 products: "
        + "; ".join(f"{where}: {flops / counts.flops:.1%}" for where, flops in top)
        + ". Cast the activations feeding them (an array made in float32 inside the model, e.g. a position "
        "table from jnp.arange) or leave the layer's dtype unset."
    )
    rank_zero_warn(" ".join(lines), category=Float32MatmulWarning)
    return counts


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
