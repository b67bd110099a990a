"""``"pp+sp"``: a pipeline stage that is also manual over ``sequence``.

Under pipeline and sequence parallelism together, the stage ``shard_map``
(:func:`jaxlight.strategies.pipeline.run_pipeline`) is manual over both
``stage`` and ``sequence``: each device holds ``T / sequence`` positions of
every activation inside its stage, and :func:`jaxlight.nn.attention` runs the
sequence piece's exchange (Ulysses all-to-all, all-gather or ring) in place,
over the axis name, instead of opening a ``shard_map`` of its own (a
``shard_map`` nested in the stage's does not lower on jax 0.10.2).

That is exact for layers whose only mixing of positions is
``jl.nn.attention``: projections, MLPs, norms over features, residuals. A
layer that mixes positions otherwise (attention written by hand, a
convolution or scan over time, positions built with ``arange``) would see
only its device's chunk, so :func:`sequence_split` traces one layer at a
probe length and refuses, by name, every operation it finds acting along the
length (see :func:`position_mixing`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxlight.strategies.attention_kernel import active_attend, attention_context

__all__ = ["position_mixing", "sequence_split"]

_AXES_PARAM = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor")
_ALONG_AXIS = ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "argmax", "argmin")
_ANY_OPERAND = ("conv_general_dilated", "reduce_window_sum", "reduce_window_max", "reduce_window_min")
_ANY_OPERAND += ("reduce_window", "select_and_scatter_add", "sort", "fft", "gather", "scatter", "scatter-add")
_ANY_OPERAND += ("scatter_add", "scatter_mul", "scatter_min", "scatter_max")


def sequence_split(
    mesh: Mesh,
    x: jax.Array,
    kinds: list[str],
    rest: list[Any],
    layer_at: Callable[[jax.ShapeDtypeStruct], Any],
) -> str | None:
    """The mesh axis a pipeline stage splits positions (dim 1 of ``x``) over, or None.

    Returns the sequence piece's axis when a sequence-parallel attention is
    installed (:func:`~jaxlight.strategies.attention_kernel.active_attend`
    names its ``axis``) and that axis has more than one device; None leaves
    the stage manual over ``stage`` only (a ``sequence`` axis without the
    sequence piece stays with GSPMD, exact for any layer). ``kinds`` says
    how each extra stack argument travels (``"row"``, ``"whole"``,
    ``"static"``), ``rest`` the stack's non-parameter leaves, and
    ``layer_at(h)`` applies one layer to an abstract input ``h``.

    Refused by name, before the step runs: an input without a length dim
    the axis divides, per-row arguments beside the input (their positions
    cannot be matched to the split input's), RNG streams in the stack (every
    device would draw the same bits for its own positions), and layers that
    mix positions other than through ``jl.nn.attention``.
    """
    attend = active_attend()
    axis = getattr(attend, "axis", None)  # the sequence piece's exchange names the axis it runs over
    n = int(dict(mesh.shape).get(axis, 1)) if isinstance(axis, str) else 1
    if n == 1:
        return None
    what = f'a pipelined LayerStack under sequence parallelism ("pp+sp", {axis}={n})'
    if getattr(x, "ndim", 0) < 2 or x.shape[1] % n:
        raise ValueError(
            f"{what} splits dim 1 (length) of its input over {axis}, but the input has shape "
            f"{tuple(x.shape)}; give it [batch, length, ...] with a length divisible by {n}"
        )
    if "row" in kinds:
        raise ValueError(
            f"{what} takes no per-row array arguments besides its input (got {kinds.count('row')}): their "
            f"positions cannot be matched to the split input's; compute them inside the layers, or drop 'sp'"
        )
    keys = [a for a in rest if jnp.issubdtype(getattr(a, "dtype", jnp.float32), jax.dtypes.prng_key)]
    if keys:
        raise ValueError(
            f"{what}: the stacked layers carry {len(keys)} RNG stream(s) (e.g. dropout), and every device "
            f"would draw the same random bits for its own {x.shape[1] // n} positions; build the stack "
            f"without RNG streams (dropout=0), or drop 'sp'"
        )
    found = position_mixing(layer_at, x)
    if found:
        raise ValueError(
            f"{what}: each device holds {x.shape[1] // n} of the {x.shape[1]} positions inside its stage, and "
            f"only jl.nn.attention exchanges them; the stacked layer also mixes positions by itself: "
            + "; ".join(found[:3])
            + ". Route attention through jl.nn.attention and keep the other operations per position, "
            "or drop 'sp' (or 'pp')"
        )
    return axis


def _zero_attention(q: jax.Array, k: jax.Array, v: jax.Array, **_: Any) -> jax.Array:
    return jnp.zeros(q.shape[:-1] + v.shape[-1:], q.dtype)


def position_mixing(layer_at: Callable[[jax.ShapeDtypeStruct], Any], x: jax.Array) -> list[str]:
    """Operations along the length dim of one stacked layer, other than :func:`jaxlight.nn.attention`.

    The layer is traced (no computation) with its attention calls replaced
    by zeros, at a probe length that is a prime larger than every other
    dimension of its input (so a dimension of that size is the length);
    when the layer refuses that length, at ``x``'s own. Reported: arrays
    with two length dims (attention written by hand), ``iota`` over the
    length (positions), reductions, contractions, cumulative ops, scans,
    sorts, convolutions and gathers along it, and slicing, padding,
    reversing or concatenating that changes it.
    """
    probe = _prime_above(max([int(d) for d in x.shape] + [2]))
    jaxpr = None
    for length in (probe, int(x.shape[1])):
        h = jax.ShapeDtypeStruct((x.shape[0], length, *x.shape[2:]), x.dtype)
        try:
            with attention_context(_zero_attention):
                jaxpr = jax.make_jaxpr(layer_at)(h)
        except Exception:
            if length == int(x.shape[1]):
                raise
            continue
        break
    assert jaxpr is not None
    return sorted(set(_scan_eqns(jaxpr.jaxpr, length)))


def _prime_above(n: int) -> int:
    p = n + 1
    while any(p % d == 0 for d in range(2, int(p**0.5) + 1)):
        p += 1
    return p


def _sub_jaxprs(value: Any) -> Iterator[Any]:
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
        yield value.jaxpr
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _sub_jaxprs(v)


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(getattr(getattr(v, "aval", None), "shape", ()) or ())


def _scan_eqns(jaxpr: Any, t: int) -> Iterator[str]:
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        ins = [_shape(v) for v in eqn.invars]
        outs = [_shape(v) for v in eqn.outvars]
        yield from _one(name, eqn.params, ins, outs, t)
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                yield from _scan_eqns(sub, t)


def _one(name: str, params: Mapping[str, Any], ins: list[tuple], outs: list[tuple], t: int) -> Iterator[str]:
    show = lambda s: "[" + ", ".join("length" if d == t else str(d) for d in s) + "]"
    for s in outs:
        if sum(d == t for d in s) >= 2:
            yield f"{name} makes a {show(s)} array (attention written by hand?)"
    if name == "iota" and outs and t in outs[0]:
        yield f"iota {show(outs[0])} builds positions"
    elif name in _AXES_PARAM and ins and any(ins[0][a] == t for a in params.get("axes", ())):
        yield f"{name} of {show(ins[0])} reduces over the length"
    elif name in _ALONG_AXIS and ins and ins[0] and ins[0][params.get("axis", 0)] == t:
        yield f"{name} of {show(ins[0])} runs along the length"
    elif name == "dot_general" and len(ins) == 2:
        (lc, _), _ = params["dimension_numbers"]
        if any(ins[0][a] == t for a in lc):
            yield f"dot_general of {show(ins[0])} and {show(ins[1])} contracts the length"
    elif name == "scan" and int(params.get("length", 0)) == t:
        yield "a scan over the length"
    elif name in _ANY_OPERAND and any(t in s for s in ins):
        yield f"{name} of {', '.join(show(s) for s in ins if t in s)} acts along the length"
    elif name == "rev" and ins and any(ins[0][a] == t for a in params.get("dimensions", ())):
        yield f"rev of {show(ins[0])} reverses the length"
    elif name in ("slice", "dynamic_slice", "pad", "concatenate", "dynamic_update_slice"):
        if outs and sum(d == t for d in outs[0]) != max((sum(d == t for d in s) for s in ins), default=0):
            yield f"{name} of {', '.join(show(s) for s in ins)} to {show(outs[0])} shifts or cuts the length"
