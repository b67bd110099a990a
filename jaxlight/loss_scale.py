"""Dynamic loss scaling for ``"16-mixed"``: torch's ``GradScaler`` arithmetic, as values in the train state.

float16 has 5 exponent bits: small gradients underflow to zero. The loss is multiplied by a scale (2**16 to
start) before it is differentiated, so the backward pass runs on larger numbers; the gradients are divided by
it again, in float32, before the optimizer sees them. A step whose gradients hold an Inf or NaN (the scale was
too large) is skipped and the scale halves; after ``growth_interval`` steps in a row without one it doubles.
:class:`GradScaler` holds the settings (torch's names and defaults); :class:`LossScaleState` the scale and
the count of good steps, which the compiled step carries and updates on the device (no host sync), and which
checkpoints save with the rest of the train state.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class LossScaleState(NamedTuple):
    """The scaler's state in :class:`~jaxlight.step.TrainState` (``loss_scale``), both scalars replicated.

    - ``scale``: float32, what the next loss is multiplied by;
    - ``good_steps``: int32, optimizer steps since the last skip or growth (torch's growth tracker).
    """

    scale: jax.Array
    good_steps: jax.Array


@dataclasses.dataclass(frozen=True)
class GradScaler:
    """Settings of dynamic loss scaling, with ``torch.amp.GradScaler``'s names and defaults.

    ``init_scale`` is the first scale; a step with a non-finite gradient multiplies it by
    ``backoff_factor`` (and is skipped); ``growth_interval`` good steps in a row multiply it by
    ``growth_factor`` (unless that would overflow float32). ``enabled=False`` turns scaling off (the
    forward still computes in float16). Pass it as ``jl.MixedPrecision("16-mixed", scaler=GradScaler(...))``.
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True

    def __post_init__(self) -> None:
        def bad(what: str) -> ValueError:
            return ValueError(f"GradScaler({what}); see torch.amp.GradScaler for the meaning of each")

        if not (isinstance(self.init_scale, (int, float)) and math.isfinite(self.init_scale) and self.init_scale > 0):
            raise bad(f"init_scale={self.init_scale!r} must be a finite number > 0")
        if not (isinstance(self.growth_factor, (int, float)) and self.growth_factor > 1.0):
            raise bad(f"growth_factor={self.growth_factor!r} must be > 1.0")
        if not (isinstance(self.backoff_factor, (int, float)) and 0.0 < self.backoff_factor < 1.0):
            raise bad(f"backoff_factor={self.backoff_factor!r} must be in (0, 1)")
        if isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, int):
            raise bad(f"growth_interval={self.growth_interval!r} must be an int >= 1")
        if self.growth_interval < 1:
            raise bad(f"growth_interval={self.growth_interval} must be >= 1")

    def init(self) -> LossScaleState:
        """The state before the first step: ``init_scale`` and no good steps (unplaced arrays)."""
        return LossScaleState(jnp.float32(self.init_scale), jnp.int32(0))

    def scale(self, loss: jax.Array, state: LossScaleState) -> jax.Array:
        """``loss * scale`` (float32): what is differentiated. Identity when disabled."""
        return loss * state.scale if self.enabled else loss

    def unscale(self, grads: Any, state: LossScaleState) -> Any:
        """Gradients of the scaled loss divided by the scale, in float32 (exact: the scale is a power of two
        with the default factors). Identity when disabled."""
        if not self.enabled:
            return grads
        inv = 1.0 / state.scale
        return jax.tree.map(lambda g: (g.astype(jnp.float32) * inv).astype(g.dtype), grads)

    def update(self, state: LossScaleState, finite: jax.Array) -> LossScaleState:
        """The state after a step whose gradients were all finite (``finite``) or not: torch's
        ``GradScaler.update``. Unchanged when disabled."""
        if not self.enabled:
            return state
        good = state.good_steps + 1
        grow = good >= self.growth_interval
        grown = state.scale * jnp.float32(self.growth_factor)
        grown = jnp.where(jnp.isfinite(grown), grown, state.scale)
        scale = jnp.where(finite, jnp.where(grow, grown, state.scale), state.scale * jnp.float32(self.backoff_factor))
        good = jnp.where(finite & ~grow, good, 0)
        return LossScaleState(scale.astype(jnp.float32), good.astype(jnp.int32))


def all_finite(tree: Any) -> jax.Array:
    """Whether every float leaf of ``tree`` is finite (a bool scalar; True for an empty tree). Over the
    global arrays of an SPMD step, so every device reads the same answer."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


__all__ = ["GradScaler", "LossScaleState", "all_finite"]
