"""``LayerStack``: identical NNX layers stored with a leading ``layers`` dimension.

A stack of ``num_layers`` layers built by one ``make_layer(rngs)`` is one NNX
module whose every variable (parameters, RNG streams, batch statistics) has a
leading dimension of size ``num_layers``, with the logical axis ``"layers"``
prepended to its annotation. Called as ``stack(x, *args)`` it applies the
layers in order. Outside a pipeline it is a ``lax.scan`` over that dimension,
so the layer body is traced and compiled once whatever the depth; under the
``"pp"`` strategy (:class:`jaxlight.strategies.PipelineParallel`) the trainer
traces the step inside the pipeline's context and the stack runs as a
pipeline over the ``stage`` mesh axis instead, with the same result (under
``schedule="1f1b"`` the call plays the role the train step's trace gives it:
``jaxlight/strategies/pipeline_1f1b.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jaxlight.state import logical_axes
from jaxlight.strategies import pipeline_1f1b
from jaxlight.strategies.pipeline import (
    STACK_AXIS,
    RematPolicy,
    active_pipeline,
    remat_policy,
    run_pipeline,
    scan_layers,
)
from jaxlight.strategies.remat import unset_remat

__all__ = ["LayerStack"]


class LayerStack(nnx.Module):
    """``num_layers`` copies of ``make_layer(rngs)``, stacked and applied in order.

    Args:
        make_layer: ``rngs -> nnx.Module``; called once under ``nnx.vmap`` with
            per-layer RNG streams (every stream of ``rngs`` is split
            ``num_layers`` ways, so layers start from different weights). The
            layer maps ``(x, *args, **kwargs)`` to an array of ``x``'s shape
            and dtype.
        num_layers: depth of the stack (>= 1).
        rngs: the streams to split.
        remat: rematerialisation of the layer body in the backward pass:
            None (keep every intermediate), ``"full"`` / ``"nothing_saveable"``
            (keep only each layer's input), ``"dots_saveable"``,
            ``"dots_with_no_batch_dims_saveable"``, or any policy from
            ``jax.checkpoint_policies`` (e.g. ``save_only_these_names(...)``).
            None lets a ``Remat`` strategy piece (``"fsdp+remat"``, or what
            ``strategy="auto"`` picks) choose; any other value is kept.

    Guarantees: every variable of the stack has shape ``(num_layers, ...)``
    and logical axes ``("layers", *the layer's names)`` (unannotated
    variables get ``("layers", None, ...)``), so the ``"layers"`` rule places
    the stack dimension and the other rules still place the rest. The forward
    pass equals applying the layers one after the other; ``args``/``kwargs``
    are given to every layer.

    Under a pipeline, array arguments whose leading dimension equals ``x``'s
    are split into microbatches together with ``x`` (per-row masks,
    positions); every other argument is given whole to each microbatch. RNG
    streams and other non-parameter state (dropout, batch statistics) are
    carried through the layers: under a pipeline each microbatch draws its
    own dropout mask and updates running statistics once, as with gradient
    accumulation.
    """

    def __init__(
        self,
        make_layer: Callable[[nnx.Rngs], nnx.Module],
        num_layers: int,
        *,
        rngs: nnx.Rngs,
        remat: RematPolicy = None,
    ) -> None:
        if not callable(make_layer):
            raise TypeError(f"make_layer must be a callable rngs -> nnx.Module, got {type(make_layer).__name__}")
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(f"rngs must be an nnx.Rngs, got {type(rngs).__name__}")
        remat_policy(remat)  # refuse an unknown policy now, not at the first step
        self.num_layers = num_layers
        self.remat = remat
        layers = nnx.vmap(_built(make_layer), in_axes=0, out_axes=0)(rngs.split(num_layers))
        _prepend_layers_axis(layers, num_layers)
        self.layers = layers

    def __call__(self, x: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
        graphdef, params, rest = nnx.split(self.layers, nnx.Param, ...)
        # remat=None: the user chose nothing, so a Remat strategy piece may (never over an explicit choice)
        policy = remat_policy(self.remat if self.remat is not None else unset_remat())

        def layer(p, r, h, a, kw):
            mod = nnx.merge(graphdef, p, r)
            out = mod(h, *a, **kw)
            if not (hasattr(out, "shape") and out.shape == h.shape and out.dtype == h.dtype):
                got = f"{type(out).__name__} {getattr(out, 'shape', '')} {getattr(out, 'dtype', '')}".strip()
                raise TypeError(
                    f"a LayerStack layer must return an array of its input's shape and dtype "
                    f"{tuple(h.shape)} {h.dtype}, got {got}"
                )
            return out, nnx.state(mod, nnx.Not(nnx.Param))

        cfg = active_pipeline()
        if cfg is not None and cfg.stages > 1 and cfg.schedule == pipeline_1f1b.SCHEDULE:
            y, rest = pipeline_1f1b.stack_call(layer, params, rest, x, args, kwargs, cfg, policy)
        elif cfg is not None and cfg.stages > 1:
            y, rest = run_pipeline(layer, params, rest, x, args, kwargs, cfg, policy)
        else:
            y, rest = scan_layers(layer, params, rest, x, args, kwargs, policy)
        nnx.update(self.layers, rest)
        return y


def _built(make_layer):
    def build(rngs):
        out = make_layer(rngs)
        if not isinstance(out, nnx.Module):
            raise TypeError(f"make_layer must return an nnx.Module, got {type(out).__name__}")
        return out

    return build


def _prepend_layers_axis(layers: nnx.Module, num_layers: int) -> None:
    """Give every variable of the stack the logical axes ("layers", *its names)."""
    for _, var in nnx.iter_graph(layers):
        if not isinstance(var, nnx.Variable):
            continue
        shape = tuple(getattr(var.get_value(), "shape", ()))
        if not shape or shape[0] != num_layers:  # pragma: no cover - vmap stacks every leaf
            raise ValueError(f"stacked variable has shape {shape}, expected a leading dimension of {num_layers}")
        names = logical_axes(var)  # any annotation form (tuple, list, PartitionSpec, ...)
        names = names if names else (None,) * (len(shape) - 1)
        var.set_metadata(out_sharding=(STACK_AXIS, *names))
