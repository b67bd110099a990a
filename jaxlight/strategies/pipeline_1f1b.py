"""The 1F1B pipeline schedule (``PipelineParallel(schedule="1f1b")``): forward and backward interleaved.

GPipe and circular (``pipeline.py``) run the forward schedule as a scan and let
autodiff of that scan produce the backward: every microbatch's activations live
until the backward starts. In 1F1B a stage starts the backward of a microbatch
as soon as its forward has left the last stage, so a stage holds the inputs of
a bounded number of microbatches whatever ``M`` is. Autodiff of a forward scan
cannot interleave, so this module runs both directions explicitly, inside one
SPMD program (``shard_map`` manual over ``stage``, the other axes under GSPMD).

**Splitting ``training_step``.** The loss of a microbatch must be known when its
forward leaves the last stage, so the step's loss function (the trainer's
forward, ``forward(params, batch) -> (loss, aux)``) is traced three ways, each
time with the LayerStack call playing another role (:func:`stack_call`):

1. *capture*: the step runs until its (first) LayerStack call, which hands over
   its input ``x``, its parameters and state and its extra arguments, and stops
   the trace. ``jax.vjp`` of that prefix (``pre``) maps the cotangents of ``x``
   and of the stack's parameters back to the flat parameter dict: the layers
   before the stack get their gradients, and the stack's gradients land at their
   own paths (through the precision's casts).
2. *post*: inside the schedule, the last stage re-runs ``training_step`` on one
   microbatch of the batch, the LayerStack call returning that microbatch's
   stack output ``y_mb``; the value and gradient of ``loss_mb / M`` with respect to
   ``y_mb`` and the parameters outside the stack are taken right there. The prefix
   is dead code in this trace (the stack ignores its input) and is compiled away.
3. *finalize*: after the schedule, the step is traced once more on the whole
   batch with the stack call installing its new non-parameter state (dropout
   counters, running statistics); only that state is read from it.

The step's loss is the mean of the microbatches' losses, the gradients those of
that mean (as gradient accumulation defines them): for a loss that is a mean over
rows this is the full batch's loss. Values logged with ``self.log`` and scalar
outputs are combined over microbatches by their ``reduce_fx`` (mean, sum, max,
min). Refused by name: a training_step without a LayerStack call or with more
than one, float extra arguments to the stack (they would get no gradient), batch
leaves whose rows do not match the stack input's, non-parameter state changed
outside the stack, parameters assigned in the step, non-scalar outputs, and
manual optimization. What runs after the stack must treat rows independently
(a per-row head and a per-row loss averaged over rows); this is the contract,
not something the trace can check.

**The schedule.** Stage ``s`` runs the forward of microbatch ``f = t - s`` and
the backward of microbatch ``b = t - (2S - 2 - s)`` at tick ``t`` (each when in
range): the last stage does the forward, the loss and the backward of a
microbatch in one tick, and a cotangent takes one tick per stage back. Ticks
``[0, S-1)`` have no backward work anywhere and ticks ``[M+S-1, M+2S-2)`` no
forward work, so the program is three scans (warm-up: forward only, ``S-1``
ticks; steady: forward, loss and backward, ``M`` ticks; cool-down: backward
only, ``S-1`` ticks) and every stage spends ``(S-1)/(M+S-1)`` of its forward and
of its backward slots idle: GPipe's bubble. A stage stores its input
``h`` (and the stack state it ran with) in a ring of ``K = min(M, 2S-1)`` slots at
the forward and recomputes its layer chunk with ``jax.vjp`` at the backward, so
the activation memory is ``K`` stage inputs plus one microbatch's residuals,
instead of GPipe's ``M`` microbatches' residuals; the price is one more forward
of the stage per microbatch (what ``remat="full"`` costs GPipe). Stage ``s``
holds ``2(S-1-s)+1`` microbatches at once (asynchronous 1F1B holds ``S - s``: it
alternates one forward and one backward per time unit, while one SPMD tick runs
a forward and a backward on every stage, so a round trip from stage ``s`` takes
``2(S-1-s)+1`` ticks of forwards; holding ``S`` would need ticks of one
operation each, half of them idle on every stage).

**Interleaved (``repeats=R``).** Stage ``s`` holds the layer chunks ``r*S + s``
(as in the circular schedule; the step regroups the natural-order weights).
Microbatches go in groups of ``S`` (``M`` must be a multiple of ``S``): a group
makes its ``R`` passes before the next starts, so forward item ``i`` is pass
``(i mod RS) div S`` of microbatch ``(i div RS)*S + i mod S``, run by stage ``s``
at tick ``i + s``; backward items take the passes in reverse, item ``j`` at tick
``RS - 1 + j + (S-1-s)``. A pass hands over between stage ``S-1`` and stage 0 in
one tick both ways (a ring ``ppermute``, no delay buffer). Warm-up and
cool-down are ``RS - 1`` ticks, the steady phase ``R(M-S) + S``; the bubble is
the circular schedule's ``(S-1)/(RM+S-1)``, and a stage keeps up to
``min(RM, 2RS-1)`` chunk inputs (each a microbatch's activation, for ``1/R``
of the stage's layers). ``R = 1`` is the schedule above.

**With sequence parallelism (``"pp+sp"``).** The program is manual over
``stage`` and ``sequence`` (:func:`~jaxlight.strategies.pipeline_sequence.sequence_split`
decides and refuses what cannot be split, as for GPipe): the stage inputs, the
ring, the activations and cotangents handed between stages hold ``T/sequence``
positions, and the layers' ``jl.nn.attention`` runs the exchange in place. The
last stage gathers a microbatch's stack output over ``sequence`` (an all-gather
typed invariant over it) and runs post on whole rows, the same on every
sequence device, so post's gradients are not summed over ``sequence``; the
cotangent of the stack output is sliced back to the device's positions. The
stage parameters are marked varying over ``sequence`` before the recomputing
``jax.vjp``, so each device accumulates its positions' share and the shares are
summed once after the schedule; the stage-0 input cotangents leave split on
the length like the input. XLA:CPU (jax 0.10.2) runs independent loops that
hold collectives at once and devices then enter them in different orders and
deadlock, so data dependencies (:func:`_after`) order the schedule after the
inputs' gathers, each tick's backward after its forward, and the final sums
after the cool-down.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxlight.strategies.pipeline import (
    STAGE_AXIS,
    LayerFn,
    PipelineConfig,
    _check_microbatches,
    _check_rows,
    _from_micro,
    _to_micro,
    check_groups,
    mark_varying,
    pipeline_context,
    run_pipeline,
    scan_layers,
    stage_sum,
)
from jaxlight.strategies.pipeline_sequence import sequence_split
from jaxlight.strategies.rules import BATCH_AXES

ForwardFn = Callable[[Mapping[str, Any], Any], tuple[jax.Array, tuple[jax.Array, dict, dict, dict, dict]]]
"""The trainer's loss function: ``forward(params, batch) -> (objective, (loss, extras, logs, rest, written))``;
the objective is what is differentiated (the loss, or the loss times the ``"16-mixed"`` loss scale)."""

SCHEDULE = "1f1b"


def slots(stages: int, microbatches: int, repeats: int = 1) -> int:
    """Stage inputs a stage keeps at most: ``min(R*M, 2*R*S - 1)``."""
    return min(repeats * microbatches, 2 * repeats * stages - 1)


def ticks(stages: int, microbatches: int, repeats: int = 1) -> tuple[int, int, int]:
    """``(warm-up, steady, cool-down)`` ticks: ``(R*S - 1, R*(M-S) + S, R*S - 1)`` (``(S-1, M, S-1)`` for R = 1)."""
    S, M, R = stages, microbatches, repeats
    return R * S - 1, R * (M - S) + S, R * S - 1


def bubble(stages: int, microbatches: int, repeats: int = 1) -> float:
    """Idle share of a stage's forward slots (and of its backward slots), counted from :func:`ticks`."""
    warm, steady, _ = ticks(stages, microbatches, repeats)
    return 1 - repeats * microbatches / (warm + steady)


def in_flight(stages: int, microbatches: int, repeats: int = 1) -> list[int]:
    """Stage inputs each stage holds at once, by stage: ``min(R*M, 2*R*S - 1 - 2s)``."""
    return [min(repeats * microbatches, 2 * repeats * stages - 1 - 2 * s) for s in range(stages)]


# ---------------------------------------------------------------------------- the LayerStack's roles
class _Captured(Exception):
    """Stops the capture trace at the LayerStack call (caught by :func:`value_and_grad`)."""


@dataclasses.dataclass
class _Capture:
    got: dict | None = None


@dataclasses.dataclass
class _Post:
    y: jax.Array
    calls: int = 0


@dataclasses.dataclass
class _Finalize:
    rest: Any


_local = threading.local()


@contextlib.contextmanager
def _role(role: Any) -> Iterator[None]:
    prev = getattr(_local, "role", None)
    _local.role = role
    try:
        yield
    finally:
        _local.role = prev


def stack_call(
    layer: LayerFn,
    params: Any,
    rest: Any,
    x: jax.Array,
    args: tuple,
    kwargs: dict,
    cfg: PipelineConfig,
    policy: Callable | None,
) -> tuple[jax.Array, Any]:
    """What a LayerStack call does under ``schedule="1f1b"``: ``(y, new rest)`` for the role of the trace.

    Outside the train step's loss (evaluation: no backward pass) the stack runs
    the GPipe forward schedule.
    """
    role = getattr(_local, "role", None)
    if role is None:
        return run_pipeline(layer, params, rest, x, args, kwargs, dataclasses.replace(cfg, schedule="gpipe"), policy)
    if isinstance(role, _Capture):
        role.got = dict(layer=layer, params=params, rest=rest, x=x, args=args, kwargs=kwargs, policy=policy)
        raise _Captured
    if isinstance(role, _Post):
        role.calls += 1
        if role.calls > 1:
            raise ValueError(
                f"schedule='1f1b' pipelines one LayerStack per training_step, and this training_step called "
                f"{role.calls} (LayerStack call {role.calls} came after the first one's output): the schedule "
                f"computes a microbatch's loss on the last stage right after the pipelined stack, so what follows "
                f"it cannot be another stack; use schedule='gpipe' or 'circular', or one LayerStack"
            )
        if role.y.shape != x.shape or role.y.dtype != x.dtype:  # pragma: no cover - the capture gave these shapes
            raise ValueError(f"LayerStack input changed between traces: {x.shape} {x.dtype} vs {role.y.shape}")
        return role.y, rest
    if isinstance(role, _Finalize):
        return x, role.rest
    raise AssertionError(role)  # pragma: no cover


# ---------------------------------------------------------------------------- the step's value and gradient
def value_and_grad(
    forward: ForwardFn,
    params: dict[str, jax.Array],
    batch: Any,
    model_state: Mapping[str, Any],
    stack_keys: frozenset[str],
    cfg: PipelineConfig,
) -> tuple[tuple[jax.Array, tuple[jax.Array, dict, dict, dict, dict]], dict[str, jax.Array]]:
    """``jax.value_and_grad(forward, has_aux=True)(params)`` on ``batch``, computed by the 1F1B schedule (the
    objective and the loss are the means of the microbatches').

    ``model_state``: the non-parameter variables ``forward`` starts from (to
    refuse changes outside the stack); ``stack_keys``: the parameter paths of
    LayerStacks (the post part is not differentiated with respect to them).
    Returns ``((objective, (loss, extras, logs, rest, written)), grads)`` as
    ``jax.value_and_grad`` of ``forward`` would, with the logs per microbatch
    stacked (combine them with :func:`combine_logs`) and ``written`` empty.
    """
    S, M, R = cfg.stages, cfg.microbatches, cfg.repeats
    _check_microbatches(S, M, R)
    check_groups(S, M, R)

    # 1. capture: the step up to the stack call
    static: dict[str, Any] = {}

    def pre(p):
        cap = _Capture()
        with _role(cap):
            try:
                forward(p, batch)
            except _Captured:
                pass
        if cap.got is None:
            raise ValueError(
                "schedule='1f1b' pipelines the LayerStack that training_step calls, and this training_step called "
                "none (it returned without calling a jaxlight.nn.LayerStack)"
            )
        got = cap.got
        static.update(layer=got["layer"], policy=got["policy"])
        a_leaves, static["a_def"] = jax.tree.flatten((got["args"], got["kwargs"]))
        static["a_static"] = [a if not isinstance(a, (jax.Array, np.ndarray)) else None for a in a_leaves]
        arrays = [a for a in a_leaves if isinstance(a, (jax.Array, np.ndarray))]
        return (got["x"], got["params"]), (got["rest"], arrays)

    (x, sp), pre_vjp, (sr, arg_arrays) = jax.vjp(pre, params, has_aux=True)
    layer, policy = static["layer"], static["policy"]
    if getattr(x, "ndim", 0) < 1:
        raise ValueError(f"a pipelined LayerStack takes a batch (B, ...) as its first argument, got shape {x.shape}")
    B = int(x.shape[0])
    shards = math.prod(int(cfg.mesh.shape[a]) for a in BATCH_AXES)
    _check_rows(f"LayerStack input {tuple(x.shape)}", B, shards, M)
    for a in arg_arrays:
        if jnp.issubdtype(a.dtype, jnp.inexact):
            raise ValueError(
                f"schedule='1f1b' passes a LayerStack's extra arguments to its stages as constants, and this call "
                f"has a floating-point one {tuple(a.shape)} {a.dtype}, which would get no gradient; compute it "
                f"inside the stacked layer, or use schedule='gpipe'"
            )
    kinds = ["row" if a.ndim >= 1 and a.shape[0] == B else "whole" for a in arg_arrays]
    rows_in = [_to_micro(a, M) for a, kd in zip(arg_arrays, kinds) if kd == "row"]
    whole_in = [a for a, kd in zip(arg_arrays, kinds) if kd == "whole"]

    b_leaves, b_def = jax.tree.flatten(batch)
    b_paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(batch)[0]]
    for path, a in zip(b_paths, b_leaves):
        if getattr(a, "ndim", 0) >= 1 and a.shape[0] != B:
            raise ValueError(
                f"schedule='1f1b' splits the batch into microbatches row for row with the LayerStack input "
                f"{tuple(x.shape)}, and batch leaf {path or '<root>'} {tuple(a.shape)} has {a.shape[0]} rows, not "
                f"{B}; use schedule='gpipe', or a batch whose leaves all have the stack input's rows"
            )
    b_row = [getattr(a, "ndim", 0) >= 1 for a in b_leaves]
    b_micro = [_to_micro(a, M) if r else a for a, r in zip(b_leaves, b_row)]

    p_leaves, p_def = jax.tree.flatten(sp)
    r_leaves, r_def = jax.tree.flatten(sr)

    def layer_at(h):  # one layer on an abstract input: what "pp+sp" checks is per position
        it = iter(arg_arrays)
        c_args, c_kwargs = jax.tree.unflatten(
            static["a_def"], [next(it) if a is None else a for a in static["a_static"]]
        )
        first = lambda leaves, d: jax.tree.unflatten(d, [a[0] for a in leaves])
        with pipeline_context(None):
            return layer(first(p_leaves, p_def), first(r_leaves, r_def), h, c_args, c_kwargs)[0]

    # "pp+sp": the stages run manual over the sequence axis too, on T/sequence positions of each row
    seq = sequence_split(cfg.mesh, x, kinds, r_leaves, layer_at)
    manual = (STAGE_AXIS,) if seq is None else (STAGE_AXIS, seq)
    act = P() if seq is None else P(None, None, seq)
    L = int(p_leaves[0].shape[0])
    if L % (S * R):
        raise ValueError(
            f"LayerStack of {L} layers is not divisible by stages x repeats = {S} x {R} = {S * R}; use a depth "
            f"that is a multiple of {S * R}"
        )
    k = L // (S * R)
    ns_keys = [key for key in params if key not in stack_keys]
    p_ns = {key: params[key] for key in ns_keys}
    dummies = {key: jax.ShapeDtypeStruct(params[key].shape, params[key].dtype) for key in params if key in stack_keys}

    # 2. post: the step after the stack, for one microbatch
    def post(pn, y, bmb):
        full = {**pn, **{key: jnp.zeros(d.shape, d.dtype) for key, d in dummies.items()}}
        role = _Post(y)
        with pipeline_context(cfg), _role(role):  # (the schedule's stages run with neither)
            obj, (loss, extras, logs, rest, written) = forward(full, jax.tree.unflatten(b_def, bmb))
        if role.calls == 0:
            raise ValueError(
                "schedule='1f1b': training_step called the LayerStack on the whole batch but not on a microbatch of "
                "it; the part after the stack must depend on the batch row for row"
            )
        changed = sorted(key for key, v in rest.items() if v is not model_state.get(key))
        if changed:
            raise ValueError(
                f"schedule='1f1b' runs training_step's layers outside the LayerStack once per microbatch (after "
                f"the stack) or once per batch (before it), so they may not change non-parameter state; these "
                f"changed: {changed[:5]}{' ...' if len(changed) > 5 else ''} (dropout or batch statistics outside "
                f"the stack). Move them into the stacked layers, or use schedule='gpipe'"
            )
        if written:
            raise ValueError(
                f"schedule='1f1b' does not support training_step assigning parameters ({sorted(written)[:5]}); "
                f"use schedule='gpipe'"
            )
        for name, v in extras.items():
            if getattr(v, "shape", ()) != ():
                raise ValueError(
                    f"schedule='1f1b' combines training_step's outputs over microbatches and can only average "
                    f"scalars; output {name!r} has shape {tuple(v.shape)}"
                )
        return obj / M, (loss, extras, logs)

    # R > 1 (interleaved): virtual stage v = r*S + s (layer chunk v) lives on stage s; items go by groups of S
    # microbatches, each group making its R passes before the next group starts
    V, n = R * S, R * M
    T0 = V - 1  # first backward tick (the last virtual stage's loss of microbatch 0)
    wrap = [(S - 1, 0)] if R > 1 else []
    perm_f = [(j, j + 1) for j in range(S - 1)] + wrap
    perm_b = [(j + 1, j) for j in range(S - 1)] + [(b, a) for a, b in wrap]
    K = slots(S, M, R)

    def forward_item(i):  # forward item i -> (pass, microbatch)
        return (i % V) // S, (i // V) * S + i % S

    def backward_item(j):  # backward item j -> (pass, microbatch, forward item of the same work)
        r = R - 1 - (j % V) // S
        return r, (j // V) * S + j % S, (j // V) * V + r * S + j % S

    def program(p_st, r_st, xs, rows, whole, bmb, pn):
        with pipeline_context(None), _role(None):  # a LayerStack inside a stacked layer is a plain scan
            return _program(p_st, r_st, xs, rows, whole, bmb, pn)

    def _program(p_st, r_st, xs, rows, whole, bmb, pn):
        if seq is not None:  # the schedule's exchanges start after the gathers of the inputs given whole
            xs = _after(xs, (rows, whole, bmb, pn))
        s = lax.axis_index(STAGE_AXIS)
        # [R, k, ...]: this stage's layer chunk of each pass. Under "pp+sp" marked varying over sequence: each
        # device's vjp then gives its own positions' share, summed over sequence once after the schedule
        p_st = [mark_varying(a[0], manual) for a in p_st]
        r_st = [a[0] for a in r_st]
        vary = lambda a: lax.pcast(a, STAGE_AXIS, to="varying")
        here = lambda a: mark_varying(a, manual)  # varying over every manual axis (this device's positions)
        # differentiate post with respect to a per-stage copy: the gradient of a stage-invariant input would be
        # summed over the stages (the transpose of pcast), adding the other stages' masked-out work
        pn = jax.tree.map(vary, pn)
        at = lambda a, i: lax.dynamic_index_in_dim(a, i, 0, keepdims=False)

        def put(a, i, v, c):  # a[i] = v where c
            return lax.dynamic_update_index_in_dim(a, jnp.where(c, v, at(a, i)), i, 0)

        def call_args(mb):
            it_rows = iter([at(a, mb) for a in rows])
            it_whole = iter(whole)
            arrays = [next(it_rows) if kd == "row" else next(it_whole) for kd in kinds]
            it = iter(arrays)
            leaves = [next(it) if a is None else a for a in static["a_static"]]
            return jax.tree.unflatten(static["a_def"], leaves)

        def stage_fn(p, r, h, mb):
            c_args, c_kwargs = call_args(mb)
            y, r_new = scan_layers(
                layer, jax.tree.unflatten(p_def, p), jax.tree.unflatten(r_def, r), h, c_args, c_kwargs, policy
            )
            return y, jax.tree.leaves(r_new)

        def tick(fwd, bwd, carry, t):
            f_recv, b_recv, ring_h, ring_r, r_cur, g_st, g_ns, gx = carry
            out = None
            g_y = None
            if fwd:
                i = t - s
                fvalid = (i >= 0) & (i < n)
                i = jnp.clip(i, 0, n - 1)
                r, m = forward_item(i)
                h = jnp.where((s == 0) & (r == 0), at(xs, m), f_recv)
                r_in = [at(a, r) for a in r_cur]
                y, r_new = stage_fn([at(a, r) for a in p_st], r_in, h, m)
                ring_h = put(ring_h, i % K, h, fvalid)
                ring_r = [put(a, i % K, v, fvalid) for a, v in zip(ring_r, r_in)]
                r_cur = [put(a, r, v, fvalid) for a, v in zip(r_cur, r_new)]
                if bwd:  # steady phase: a microbatch may leave the last virtual stage now
                    bm = [at(a, m) if row else a for a, row in zip(bmb, b_row)]
                    y_rows = y
                    if seq is not None:  # post sees whole rows: gathered, the same on every sequence device
                        y_rows = lax.all_gather(y, seq, axis=1, tiled=True, to="invarying")
                    (obj, (loss, extras, logs)), (g_pn, g_y) = jax.value_and_grad(post, argnums=(0, 1), has_aux=True)(
                        pn, y_rows, bm
                    )
                    if seq is not None:  # the cotangent of this device's positions
                        T = y.shape[1]
                        g_y = lax.dynamic_slice_in_dim(g_y, lax.axis_index(seq) * T, T, axis=1)
                    last = fvalid & (s == S - 1) & (r == R - 1)
                    g_ns = jax.tree.map(
                        lambda acc, g: acc + jnp.where(last, g, jnp.zeros_like(g)).astype(acc.dtype), g_ns, g_pn
                    )
                    out = jax.tree.map(
                        lambda v: jnp.where(last, v, jnp.zeros_like(v)),
                        (last.astype(jnp.int32), m, obj, loss, extras, logs),
                    )
                f_recv = lax.ppermute(y, STAGE_AXIS, perm_f)
            if bwd:
                j = t - T0 - (S - 1 - s)
                bvalid = (j >= 0) & (j < n)
                j = jnp.clip(j, 0, n - 1)
                r, m, i = backward_item(j)
                g = b_recv
                if g_y is not None:
                    g = jnp.where((s == S - 1) & (r == R - 1), g_y.astype(b_recv.dtype), b_recv)
                h_b = at(ring_h, i % K)
                r_b = [at(a, i % K) for a in ring_r]
                if fwd and seq is not None:
                    # the recomputed forward's exchanges start after every collective of this tick's forward
                    h_b = _after(h_b, (f_recv, g, g_ns, out))
                _, vjp = jax.vjp(lambda p, hh: stage_fn(p, r_b, hh, m)[0], [at(a, r) for a in p_st], h_b)
                g_p, g_h = vjp(g)
                g_st = [put(acc, r, at(acc, r) + gp.astype(acc.dtype), bvalid) for acc, gp in zip(g_st, g_p)]
                gx = put(gx, m, g_h, bvalid & (s == 0) & (r == 0))
                b_recv = lax.ppermute(g_h, STAGE_AXIS, perm_b)
            return (f_recv, b_recv, ring_h, ring_r, r_cur, g_st, g_ns, gx), out

        zero_mb = here(jnp.zeros_like(xs[0]))
        carry = (
            zero_mb,
            zero_mb,
            here(jnp.zeros((K,) + xs.shape[1:], xs.dtype)),
            [jnp.stack([a[0]] * K) for a in r_st],
            r_st,
            # gradients summed over microbatches in float32 at least (bfloat16 sums would round M times)
            [here(jnp.zeros(a.shape, _acc_dtype(a))) for a in p_st],
            jax.tree.map(lambda a: vary(jnp.zeros(a.shape, _acc_dtype(a))), pn),
            here(jnp.zeros_like(xs)),
        )
        warm, steady, cool = ticks(S, M, R)
        carry, _ = lax.scan(lambda c, t: tick(True, False, c, t), carry, jnp.arange(0, warm))
        carry, outs = lax.scan(lambda c, t: tick(True, True, c, t), carry, jnp.arange(warm, warm + steady))
        carry, _ = lax.scan(
            lambda c, t: tick(False, True, c, t), carry, jnp.arange(warm + steady, warm + steady + cool)
        )
        _, _, _, _, r_cur, g_st, g_ns, gx = carry
        if seq is not None:  # each sequence device differentiated its own positions
            g_st = [stage_sum(a, seq) for a in g_st]
            outs, g_ns = _after((outs, g_ns), g_st)  # summed after the cool-down's loops
        # only the last stage's are non-zero; float32 sums for half-precision leaves (see stage_sum)
        outs, g_ns = (jax.tree.map(lambda a: stage_sum(a, STAGE_AXIS), t) for t in (outs, g_ns))
        gx = stage_sum(gx, STAGE_AXIS)  # only stage 0's are non-zero; in float32 (a bfloat16 psum aborts XLA:CPU)
        return outs, g_ns, gx, [a[None] for a in g_st], [a[None] for a in r_cur]

    def to_stages(a):  # [L, ...] -> [S, R, k, ...]: stage s, pass r holds layer chunk r*S + s
        return jnp.swapaxes(a.reshape((R, S, k) + a.shape[1:]), 0, 1)

    def from_stages(a):
        return jnp.swapaxes(a, 0, 1).reshape((L,) + a.shape[3:])

    staged = jax.shard_map(
        program,
        mesh=cfg.mesh,
        in_specs=(P(STAGE_AXIS), P(STAGE_AXIS), act, P(), P(), P(), P()),
        out_specs=(P(), P(), act, P(STAGE_AXIS), P(STAGE_AXIS)),
        axis_names=set(manual),
    )
    (done, mb, objs, losses, extras, logs), g_ns, gx, g_st, r_out = staged(
        [to_stages(a) for a in p_leaves],
        [to_stages(a) for a in r_leaves],
        _to_micro(x, M),
        rows_in,
        whole_in,
        b_micro,
        p_ns,
    )
    # the steady ticks at which a microbatch left the last virtual stage, in microbatch order
    where_m = jnp.where(done > 0, mb, M)
    by_m = lambda v: jnp.zeros((M + 1,) + v.shape[1:], v.dtype).at[where_m].set(v)[:M]
    objs, losses, extras, logs = jax.tree.map(by_m, (objs, losses, extras, logs))
    g_sp = jax.tree.unflatten(p_def, [from_stages(a).astype(p.dtype) for a, p in zip(g_st, p_leaves)])
    (grads,) = pre_vjp((_from_micro(gx).astype(x.dtype), g_sp))
    grads = {key: (g + g_ns[key].astype(g.dtype)) if key in g_ns else g for key, g in grads.items()}
    new_rest = jax.tree.unflatten(r_def, [from_stages(a) for a in r_out])

    # 3. finalize: the step's non-parameter state with the stack's new state installed
    with _role(_Finalize(new_rest)):
        _, (_, _, _, rest, _) = forward(params, batch)
    loss = jnp.mean(losses)
    extras = {name: jnp.mean(v, axis=0).astype(v.dtype) for name, v in extras.items()}
    return (jnp.sum(objs), (loss, extras, logs, rest, {})), grads


def _after(x: Any, deps: Any) -> Any:
    """The arrays of ``x``, made to depend on every array in ``deps`` (on one element of each).

    Under ``"pp+sp"`` the stage's loops hold collectives (the sequence exchange), and XLA:CPU runs
    independent loops and collectives at once: devices that enter them in different orders wait for
    each other forever (seen on jax 0.10.2, which also drops ``optimization_barrier`` on CPU). This
    data dependency orders them: floats get ``+ 0 * tie`` (XLA folds ``x * 0`` for integers only),
    integers are kept where ``tie == tie``. A NaN among ``deps`` would be in the loss or gradients anyway.
    """
    number = lambda a: jnp.issubdtype(a.dtype, jnp.number) or a.dtype == jnp.bool_
    leaves = [a for a in jax.tree.leaves(deps) if getattr(a, "size", 0) and number(a)]
    if not leaves:
        return x
    tie = sum(jnp.ravel(a)[0].astype(jnp.float32) for a in leaves)

    def one(a):
        if jnp.issubdtype(a.dtype, jnp.inexact):
            return a + (tie * 0).astype(a.dtype)
        return jnp.where(tie == tie, a, jnp.zeros_like(a))

    return jax.tree.map(one, x)


def _acc_dtype(a: Any) -> Any:
    return jnp.promote_types(a.dtype, jnp.float32)


def combine_logs(logs: Mapping[str, tuple[jax.Array, jax.Array]], specs: Mapping[str, Any]) -> dict[str, tuple]:
    """Values logged once per microbatch (``{name: (values[M], weights[M])}``) as one step's values, by each
    log's ``reduce_fx``: the mean of the microbatches' values (all have the same rows), their sum, max or min,
    with the summed weight (the batch's rows)."""
    out = {}
    for name, (v, w) in logs.items():
        fx = getattr(specs.get(name), "reduce_fx", "mean")
        red = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}.get(fx, jnp.mean)
        out[name] = (red(v, axis=0), jnp.sum(w, axis=0))
    return out


__all__ = ["SCHEDULE", "combine_logs", "in_flight", "slots", "stack_call", "ticks", "value_and_grad"]
