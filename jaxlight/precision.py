"""Numeric precision policies (Lightning's ``precision`` strings)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")


class Precision(NamedTuple):
    """What dtype parameters are stored in and what dtype the forward computes in.

    "32-true": everything fp32. "bf16-mixed": fp32 master parameters and
    optimizer state; the forward sees bf16 copies of the float parameters and
    float inputs, gradients flow back to the fp32 masters. "bf16-true":
    parameters (and so optimizer state) stored in bf16, float inputs cast to
    bf16.
    """

    name: str
    param_dtype: Any
    compute_dtype: Any | None

    def store(self, params: dict) -> dict:
        return _cast_floats(params, self.param_dtype) if self.param_dtype is not None else params

    def compute(self, tree: Any) -> Any:
        return _cast_floats(tree, self.compute_dtype) if self.compute_dtype is not None else tree


def _cast_floats(tree: Any, dtype: Any) -> Any:
    def cast(x):
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


def resolve_precision(precision: Any) -> Precision:
    """Map a precision setting to a policy, or raise listing the valid ones."""
    key = str(precision)
    if key in ("32", "32-true"):
        return Precision("32-true", None, None)
    if key == "bf16-mixed":
        return Precision("bf16-mixed", None, jnp.bfloat16)
    if key == "bf16-true":
        # float inputs are cast as well (Lightning's convert_input), or fp32 batches would promote
        # the whole forward back to fp32
        return Precision("bf16-true", jnp.bfloat16, jnp.bfloat16)
    hint = ""
    if key.startswith("16") or key.startswith("fp16"):
        hint = " (fp16 needs dynamic loss scaling, which jaxlight does not do; use 'bf16-mixed')"
    if key == "64" or key.startswith("64"):
        hint = " (double precision needs jax_enable_x64, which jaxlight does not manage)"
    raise ValueError(f"precision={precision!r} is not supported; choose one of {PRECISIONS}{hint}")
