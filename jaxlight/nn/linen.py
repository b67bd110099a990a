"""Flax Linen models as NNX modules the trainer can train."""

from __future__ import annotations

from typing import Any


def from_linen(module: Any, *sample_inputs: Any, rngs: Any = None, **kwargs: Any) -> Any:
    """Wrap a flax Linen module as an NNX module the trainer can train.

    Uses flax's nnx bridge (``nnx.bridge.ToNNX``) and initialises it lazily
    on ``sample_inputs``. Linen ``params`` become ``nnx.Param`` (trained),
    other collections (``batch_stats``...) are carried through the step.
    Call it in ``configure_model``:
    ``self.net = jl.nn.from_linen(MyLinen(), jnp.ones((1, 784)), rngs=nnx.Rngs(0))``.
    """
    from flax import nnx

    rngs = rngs if rngs is not None else nnx.Rngs(0)
    return nnx.bridge.ToNNX(module, rngs=rngs).lazy_init(*sample_inputs, **kwargs)
