"""Pipeline parallelism: the ``"pp"`` piece and the GPipe / circular schedules.

(The 1F1B schedule, which interleaves forward and backward, is ``pipeline_1f1b.py``;
this module dispatches to it.)

:class:`PipelineParallel` sets the ``stage`` mesh axis and the rule
``("layers", "stage")``, so the leading ``layers`` dimension of every
:class:`jaxlight.nn.LayerStack` variable is split over the stages: each device
holds 1/S of the stack's parameters, gradients and optimizer state. While the
trainer traces its steps it enters :meth:`PipelineParallel.trace_context`,
and a LayerStack called inside it runs :func:`run_pipeline` instead of a plain
scan.

The schedule is one SPMD program: inside ``shard_map`` over ``stage`` (the
other mesh axes stay under GSPMD, so data/FSDP/tensor parallelism compose),
a ``lax.scan`` runs ``R*M + S - 1`` ticks. At tick ``t`` stage ``s`` works on
item ``t - s`` (microbatch ``(t - s) % M`` in pass ``(t - s) // M``), applies
its chunk of layers for that pass and hands the result to stage ``s + 1``
with one ``ppermute``. Stage 0 reads first passes from the scanned inputs;
in the circular schedule stage ``S-1`` also hands its result back to stage 0,
which keeps it ``M - S + 1`` ticks for the microbatch's next pass. The last
stage's outputs of the last pass are the scan's outputs, broadcast over
``stage`` with one ``psum``. Autodiff of the scan gives the backward schedule
with the permutations reversed. GPipe is the case ``R = 1``; the idle
fraction of each step is ``(S-1) / (R*M + S-1)``.

Under ``"pp+sp"`` the ``shard_map`` is manual over ``sequence`` too: the
microbatches enter split on their length and attention runs the sequence
piece's exchange in place (:mod:`jaxlight.strategies.pipeline_sequence`).

Layer order: pass ``r`` on stage ``s`` applies layer chunk ``r*S + s`` (of
``L / (S*R)`` layers). Parameters stay in natural layer order in the train
state, checkpoints and the user's module (stage ``s`` stores the contiguous
block ``[s*L/S, (s+1)*L/S)``); for ``R > 1`` the step regroups them into the
interleaved chunks with one all-to-all over ``stage`` per step (and one for
the gradients), whose cost ``benchmarks/pipeline.py`` measures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxlight.state import logical_axes
from jaxlight.strategies.pipeline_sequence import sequence_split
from jaxlight.strategies.rules import BATCH_AXES, Rules
from jaxlight.strategies.strategy import FILL, Piece, register_strategy

STACK_AXIS = "layers"
"""Logical name of the leading dimension of LayerStack variables."""
STAGE_AXIS = "stage"
"""Mesh axis that holds pipeline stages."""
SCHEDULES = ("gpipe", "circular", "1f1b")

RematPolicy = Union[str, Callable[..., Any], None]  # noqa: UP007 - a runtime alias
REMAT_POLICIES: dict[str, Callable[..., Any]] = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
"""Named rematerialisation policies a LayerStack accepts (any ``jax.checkpoint_policies`` object works too)."""


def remat_policy(remat: RematPolicy) -> Callable[..., Any] | None:
    """The ``jax.checkpoint`` policy for a LayerStack's ``remat`` argument (None: no rematerialisation)."""
    if remat is None:
        return None
    if isinstance(remat, str):
        if remat not in REMAT_POLICIES:
            raise ValueError(
                f"unknown remat policy {remat!r}; use one of {sorted(REMAT_POLICIES)}, a "
                f"jax.checkpoint_policies object, or None"
            )
        return REMAT_POLICIES[remat]
    if callable(remat):
        return remat
    raise TypeError(
        f"remat must be a policy name, a jax.checkpoint_policies object or None, got {type(remat).__name__}"
    )


def bubble(stages: int, microbatches: int, repeats: int = 1) -> float:
    """Idle fraction of a pipelined step: ``(S-1) / (R*M + S-1)`` (0 for one stage)."""
    return (stages - 1) / (repeats * microbatches + stages - 1)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """What a LayerStack needs to run as a pipeline (the trace context's value)."""

    stages: int
    microbatches: int
    schedule: str
    repeats: int
    mesh: Mesh

    @property
    def ticks(self) -> int:
        """Scan iterations per forward pass: ``R*M + S - 1``."""
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        return bubble(self.stages, self.microbatches, self.repeats)


_local = threading.local()


@contextlib.contextmanager
def pipeline_context(cfg: PipelineConfig | None) -> Iterator[None]:
    """Make LayerStacks called inside run as the pipeline ``cfg`` describes (None: plain scans)."""
    prev = getattr(_local, "cfg", None)
    _local.cfg = cfg
    try:
        yield
    finally:
        _local.cfg = prev


def active_pipeline() -> PipelineConfig | None:
    """The pipeline a LayerStack traced now must run as, or None."""
    return getattr(_local, "cfg", None)


# ---------------------------------------------------------------------------- the piece
@dataclasses.dataclass(frozen=True)
class PipelineParallel(Piece):
    """Split every :class:`jaxlight.nn.LayerStack` by layers over ``stages`` devices and run it as a pipeline.

    Args:
        stages: size of the ``stage`` mesh axis (None: every device the other
            axes leave; 2 when composed with an FSDP that fills the rest).
        microbatches: microbatches per step, ``M``; None means ``M = stages``.
            Microbatch ``m`` takes batch rows ``m, m+M, m+2M, ...``, so rows
            stay on the data shards that hold them; each data shard's rows
            must divide by ``M``.
        schedule: ``"gpipe"`` (every microbatch crosses the stages once),
            ``"circular"`` (``repeats`` passes over the stages, each stage
            holding ``repeats`` non-adjacent layer chunks: bubble
            ``(S-1)/(R*M+S-1)``) or ``"1f1b"`` (GPipe's order and bubble, the
            backward of each microbatch starting once its forward left the
            last stage: a stage keeps at most ``min(M, 2S-1)`` microbatches'
            stage inputs instead of ``M`` microbatches' activations; see
            ``jaxlight/strategies/pipeline_1f1b.py``).
        repeats: passes over the stages (``R``); more than 1 needs ``"circular"``
            or ``"1f1b"`` (interleaved 1F1B: microbatches in groups of ``S``).

    Guarantees: the stack's parameters, gradients and optimizer state are
    split over ``stage`` (1/S per device) and are never all-gathered over it;
    activations cross stages by ``collective-permute``; losses, gradients and
    parameters equal one device's up to float reduction order. Layers outside
    the stack are placed by the other pieces (replicated over ``stage``).
    Refused before any work: a model without a LayerStack, a stack whose depth
    ``stages x repeats`` does not divide, batch rows per data shard that
    ``microbatches`` does not divide, and fewer microbatches than stages.
    With a :class:`~jaxlight.strategies.SequenceParallel` piece (``"pp+sp"``)
    every stage also splits positions over ``sequence``, exactly for layers
    that mix positions only through :func:`jaxlight.nn.attention`; what it
    cannot split is refused when the step is traced
    (:func:`~jaxlight.strategies.pipeline_sequence.sequence_split`).
    """

    name: ClassVar[str] = "pp"
    stages: int | None = None
    microbatches: int | None = None
    schedule: str = "gpipe"
    repeats: int = 1

    def __init__(
        self,
        stages: int | None = None,
        microbatches: int | None = None,
        schedule: str = "gpipe",
        repeats: int = 1,
    ) -> None:
        for label, v in (("stages", stages), ("microbatches", microbatches)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"PipelineParallel {label} must be a positive int or None, got {v!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {schedule!r}; schedules are {SCHEDULES}")
        if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
            raise ValueError(f"PipelineParallel repeats must be a positive int, got {repeats!r}")
        if repeats > 1 and schedule == "gpipe":
            raise ValueError(
                f"repeats={repeats} needs schedule='circular' or '1f1b' (GPipe passes each microbatch over the "
                f"stages once)"
            )
        if stages is not None and microbatches is not None:
            _check_microbatches(stages, microbatches, repeats)
            if schedule == "1f1b":
                check_groups(stages, microbatches, repeats)
        object.__setattr__(self, "stages", stages)
        object.__setattr__(self, "microbatches", microbatches)
        object.__setattr__(self, "schedule", schedule)
        object.__setattr__(self, "repeats", repeats)

    def mesh_axes(self) -> Mapping[str, int]:
        return {STAGE_AXIS: FILL if self.stages is None else self.stages}

    def rules(self) -> Rules:
        return ((STACK_AXIS, STAGE_AXIS),)

    def param_axes(self) -> tuple[str, ...]:
        return (STAGE_AXIS,)

    def num_microbatches(self, stages: int) -> int:
        """``M`` on a mesh with ``stages`` stages."""
        return self.microbatches if self.microbatches is not None else stages

    def check_model(self, params: Mapping[str, Any], variables: Mapping[str, Any], mesh: Mesh) -> None:
        stacks = stack_params(params, variables)
        if not stacks:
            raise ValueError(
                f"strategy 'pp' pipelines the layers of a jaxlight.nn.LayerStack, and this model has none: no "
                f"parameter has the leading logical axis {STACK_AXIS!r} (among {len(params)} parameters). Build the "
                f"repeated blocks with jaxlight.nn.LayerStack(make_layer, num_layers, rngs=rngs) and call the "
                f"stack as stack(x)"
            )
        stages = int(mesh.shape[STAGE_AXIS])
        per = stages * self.repeats
        for path, (depth, shape) in stacks.items():
            if depth % per:
                raise ValueError(
                    f"LayerStack parameter {path} {shape} has {depth} layers, not divisible by stages x repeats = "
                    f"{stages} x {self.repeats} = {per}; use a depth that is a multiple of {per} or other "
                    f"stages/repeats"
                )
        _check_microbatches(stages, self.num_microbatches(stages), self.repeats)

    def check_batch(self, shapes: Mapping[str, tuple[int, ...]], mesh_shape: Mapping[str, int]) -> None:
        stages = int(mesh_shape.get(STAGE_AXIS, 1))
        m = self.num_microbatches(stages)
        _check_microbatches(stages, m, self.repeats)
        shards = math.prod(int(mesh_shape.get(a, 1)) for a in BATCH_AXES)
        for path, shape in shapes.items():
            if not shape:
                continue
            _check_rows(f"batch leaf {path} {tuple(shape)}", int(shape[0]), shards, m)

    def trace_context(self, mesh: Mesh) -> contextlib.AbstractContextManager | None:
        stages = int(mesh.shape[STAGE_AXIS])
        m = self.num_microbatches(stages)
        _check_microbatches(stages, m, self.repeats)
        return pipeline_context(PipelineConfig(stages, m, self.schedule, self.repeats, mesh))


register_strategy("pp", PipelineParallel)


def stack_params(params: Mapping[str, Any], variables: Mapping[str, Any]) -> dict[str, tuple[int, tuple]]:
    """``{path: (depth, shape)}`` for the parameters whose leading logical axis is ``"layers"``."""
    out: dict[str, tuple[int, tuple]] = {}
    for path, arr in params.items():
        var = variables.get(path)
        names = logical_axes(var) if var is not None else None
        shape = tuple(getattr(arr, "shape", ()))
        if names and names[0] == STACK_AXIS and shape:
            out[path] = (int(shape[0]), shape)
    return out


def _check_microbatches(stages: int, microbatches: int, repeats: int) -> None:
    if stages > 1 and microbatches < stages:
        suggest = 4 * stages
        raise ValueError(
            f"microbatches={microbatches} is fewer than stages={stages}: the pipeline would idle "
            f"{bubble(stages, microbatches, repeats):.0%} of every step (bubble (S-1)/(R*M+S-1) with R={repeats}); "
            f"use microbatches >= {stages} (e.g. {suggest}: {bubble(stages, suggest, repeats):.0%})"
        )


def check_groups(stages: int, microbatches: int, repeats: int) -> None:
    """Interleaved 1F1B runs microbatches in groups of ``stages``: refuse an ``M`` they do not divide."""
    if repeats > 1 and microbatches % stages:
        raise ValueError(
            f"schedule='1f1b' with repeats={repeats} (interleaved) runs microbatches in groups of stages={stages}, "
            f"and microbatches={microbatches} is not a multiple of {stages}; use e.g. microbatches="
            f"{stages * max(1, -(-microbatches // stages))}"
        )


def _check_rows(what: str, rows: int, shards: int, microbatches: int) -> None:
    if rows % shards:
        raise ValueError(f"{what} has {rows} rows, not divisible by the {shards} batch shards (data*fsdp*expert)")
    per = rows // shards
    if per % microbatches:
        raise ValueError(
            f"{what} has {rows} rows: {per} per batch shard (data*fsdp*expert = {shards}), not divisible by "
            f"microbatches={microbatches}; use a batch size that is a multiple of {shards * microbatches}"
        )


# ---------------------------------------------------------------------------- the schedule
LayerFn = Callable[..., tuple[jax.Array, Any]]
"""``layer(params_l, rest_l, h, args, kwargs) -> (h, rest_l)`` for one layer's (unstacked) state."""


def scan_layers(
    layer: LayerFn, params: Any, rest: Any, x: jax.Array, args: tuple, kwargs: dict, policy: Callable | None
) -> tuple[jax.Array, Any]:
    """Apply stacked layers (leading dim of ``params``/``rest``) to ``x`` in order with one ``lax.scan``."""

    def body(h, pr):
        return layer(pr[0], pr[1], h, args, kwargs)

    if policy is not None:
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    y, new_rest = lax.scan(body, x, (params, rest))
    if jax.tree.structure(new_rest) != jax.tree.structure(rest):
        raise TypeError(
            "a LayerStack layer changed its non-parameter variables while called (e.g. sow() or a variable "
            "created lazily); every variable of a stacked layer must exist after construction"
        )
    return y, new_rest


def run_pipeline(
    layer: LayerFn,
    params: Any,
    rest: Any,
    x: jax.Array,
    args: tuple,
    kwargs: dict,
    cfg: PipelineConfig,
    policy: Callable | None = None,
) -> tuple[jax.Array, Any]:
    """Apply stacked layers to ``x`` as a pipeline over ``cfg.stages`` stages (see the module docstring).

    ``params``/``rest``: pytrees of arrays with a leading layers dimension
    (placed on ``stage``); ``x``: the global batch ``(B, ...)``. Returns the
    output (as a scan over the layers would) and the updated ``rest``.
    """
    S, M, R = cfg.stages, cfg.microbatches, cfg.repeats
    p_leaves, p_def = jax.tree.flatten(params)
    r_leaves, r_def = jax.tree.flatten(rest)
    if not p_leaves:
        raise ValueError("a LayerStack without parameters cannot be pipelined")
    L = int(p_leaves[0].shape[0])
    if L % (S * R):
        raise ValueError(
            f"LayerStack of {L} layers is not divisible by stages x repeats = {S} x {R} = {S * R}; "
            f"use a depth that is a multiple of {S * R}"
        )
    k = L // (S * R)
    if getattr(x, "ndim", 0) < 1:
        raise ValueError(f"a pipelined LayerStack takes a batch (B, ...) as its first argument, got shape {x.shape}")
    B = int(x.shape[0])
    shards = math.prod(int(cfg.mesh.shape[a]) for a in BATCH_AXES)
    _check_rows(f"LayerStack input {tuple(x.shape)}", B, shards, M)
    _check_microbatches(S, M, R)

    # Arguments: per-row arrays travel with their microbatch, other arrays go whole, the rest is static.
    a_leaves, a_def = jax.tree.flatten((args, kwargs))
    kinds = []
    for a in a_leaves:
        if isinstance(a, (jax.Array, np.ndarray)) and a.ndim >= 1 and a.shape[0] == B:
            kinds.append("row")
        elif isinstance(a, (jax.Array, np.ndarray)):
            kinds.append("whole")
        else:
            kinds.append("static")

    def layer_at(h):  # one layer on an abstract input: what "pp+sp" checks is per position
        with pipeline_context(None):
            first = lambda leaves, d: jax.tree.unflatten(d, [a[0] for a in leaves])
            return layer(first(p_leaves, p_def), first(r_leaves, r_def), h, args, kwargs)[0]

    seq = sequence_split(cfg.mesh, x, kinds, r_leaves, layer_at)
    rows_in = [_to_micro(a, M) for a, kd in zip(a_leaves, kinds) if kd == "row"]
    whole_in = [a for a, kd in zip(a_leaves, kinds) if kd == "whole"]

    def to_stages(a):  # [L, ...] -> [S, R, k, ...]: stage s, pass r holds layer chunk r*S + s
        return jnp.swapaxes(a.reshape((R, S, k) + a.shape[1:]), 0, 1)

    def from_stages(a):
        return jnp.swapaxes(a, 0, 1).reshape((L,) + a.shape[3:])

    # GPipe hands activations down the chain; circular also hands the last stage's back to stage 0
    perm = [(j, (j + 1) % S) for j in range(S if R > 1 else S - 1)]
    T = cfg.ticks
    D = M - S + 1  # ticks a re-entering microbatch waits at stage 0 (circular; M >= S)

    def stage_program(p_st, r_st, xs, rows, whole):
        # a LayerStack inside a stacked layer runs as a plain scan within its stage
        with pipeline_context(None):
            return _stage_program(p_st, r_st, xs, rows, whole)

    def _stage_program(p_st, r_st, xs, rows, whole):
        s = lax.axis_index(STAGE_AXIS)
        # inputs invariant over a manual axis (everything over stage but the stack's state; under "pp+sp" the
        # parameters over sequence too) made varying once, here: their gradients are summed by one all-reduce in
        # float32 (see stage_sum), not by a psum per tick and layer in the compute dtype, which jnp.where and the
        # layers' products would insert implicitly
        p_st = [mark_varying(a[0], manual) for a in p_st]  # [R, k, ...] on this stage
        r_st = [a[0] for a in r_st]
        xs, rows, whole = (
            mark_varying(xs, manual),
            [mark_varying(a, manual) for a in rows],
            [mark_varying(a, manual) for a in whole],
        )
        # stage 0's first-pass inputs, one per tick (zeros after the last microbatch)
        feed = jnp.concatenate([xs, jnp.zeros((T - M,) + xs.shape[1:], xs.dtype)])
        recv = mark_varying(jnp.zeros_like(xs[0]), manual)
        # circular: what stage 0 received from stage S-1, read again D ticks later for the next pass
        delay = mark_varying(jnp.zeros((D if R > 1 else 0,) + xs.shape[1:], xs.dtype), manual)

        def tick(carry, tx):
            recv, delay, r_st = carry
            t, x_t = tx
            item = t - s
            valid = (item >= 0) & (item < R * M)
            item = jnp.clip(item, 0, R * M - 1)
            rep, mb = item // M, item % M
            first = x_t
            if R > 1:
                again = lax.dynamic_index_in_dim(delay, t % D, 0, keepdims=False)
                first = jnp.where(t < M, x_t, again)
            h = jnp.where(s == 0, first, recv)
            p_r = [lax.dynamic_index_in_dim(a, rep, 0, keepdims=False) for a in p_st]
            r_r = [lax.dynamic_index_in_dim(a, rep, 0, keepdims=False) for a in r_st]
            it_rows = iter([lax.dynamic_index_in_dim(a, mb, 0, keepdims=False) for a in rows])
            it_whole = iter(whole)
            call_leaves = [
                next(it_rows) if kd == "row" else next(it_whole) if kd == "whole" else a
                for a, kd in zip(a_leaves, kinds)
            ]
            c_args, c_kwargs = jax.tree.unflatten(a_def, call_leaves)
            y, r_new = scan_layers(
                layer, jax.tree.unflatten(p_def, p_r), jax.tree.unflatten(r_def, r_r), h, c_args, c_kwargs, policy
            )
            r_new = jax.tree.leaves(r_new)
            # non-parameter state advances only for real work (not in the bubble)
            r_st = [
                lax.dynamic_update_index_in_dim(a, jnp.where(valid, n, o), rep, 0) for a, n, o in zip(r_st, r_new, r_r)
            ]
            sent = lax.ppermute(y, STAGE_AXIS, perm)
            if R > 1:  # the slot just read is free: keep what stage S-1 finished this tick
                delay = lax.dynamic_update_index_in_dim(delay, sent, t % D, 0)
            return (sent, delay, r_st), y

        (_, _, r_st), ys = lax.scan(tick, (recv, delay, r_st), (jnp.arange(T), feed))
        # the last stage finished microbatch m's last pass at tick T - M + m
        out = stage_sum(jnp.where(s == S - 1, ys[T - M :], jnp.zeros_like(ys[T - M :])), STAGE_AXIS)
        return out, [a[None] for a in r_st]

    # under "pp+sp" the stage is manual over sequence too: microbatches [M, B/M, T, ...] enter split on T
    manual = (STAGE_AXIS,) if seq is None else (STAGE_AXIS, seq)
    act = P() if seq is None else P(None, None, seq)
    staged = jax.shard_map(
        stage_program,
        mesh=cfg.mesh,
        in_specs=(P(STAGE_AXIS), P(STAGE_AXIS), act, P(), P()),
        out_specs=(act, P(STAGE_AXIS)),
        axis_names=set(manual),
    )
    out, r_out = staged(
        [to_stages(a) for a in p_leaves], [to_stages(a) for a in r_leaves], _to_micro(x, M), rows_in, whole_in
    )
    return _from_micro(out), jax.tree.unflatten(r_def, [from_stages(a) for a in r_out])


def sum_dtype(dtype: Any) -> Any:
    """The dtype a cross-stage sum of ``dtype`` runs in: float32 for narrower floats, ``dtype`` otherwise."""
    return jnp.promote_types(dtype, jnp.float32) if jnp.issubdtype(dtype, jnp.floating) else dtype


def stage_sum(x: jax.Array, axes: str | tuple[str, ...]) -> jax.Array:
    """``lax.psum(x, axes)`` summed in :func:`sum_dtype` (float32 for bfloat16/float16), returned in ``x.dtype``.

    Exact for the pipeline's sums, where one stage holds the values and the others zeros. Why: inside a
    ``shard_map`` that leaves some mesh axes automatic (the pipeline's), jax 0.10.2 lowers a psum's reducer with
    a sharding annotation on its root, a ``copy`` once partitioned; XLA:CPU's AllReducePromotion, which widens
    bfloat16 all-reduces to float32, rebuilds that reducer as a binary op of the root's opcode and aborts the
    process ("Invalid binary instruction opcode copy", hlo_instruction.cc). A float32 all-reduce is left alone.
    """
    return lax.psum(x.astype(sum_dtype(x.dtype)), axes).astype(x.dtype)


def mark_varying(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``x`` marked varying over those manual ``axes`` it is invariant over (a pipeline's scan carry that meets
    per-device values; an expert layer's weights that meet per-device tokens).

    The transpose of the mark is a psum of the gradient over ``axes``; for narrow floats it is marked in float32
    so that psum is a float32 one (see :func:`stage_sum`); the forward value is unchanged.
    """
    have = getattr(getattr(jax.typeof(x), "mat", None), "varying", ()) or ()
    missing = tuple(a for a in axes if a not in have)
    if not missing:
        return x
    return lax.pcast(x.astype(sum_dtype(x.dtype)), missing, to="varying").astype(x.dtype)


def _to_micro(a: jax.Array, m: int) -> jax.Array:
    """``(B, ...) -> (M, B/M, ...)``: microbatch i holds rows i, i+M, i+2M, ... (local to each batch shard)."""
    return jnp.swapaxes(a.reshape((a.shape[0] // m, m) + a.shape[1:]), 0, 1)


def _from_micro(a: jax.Array) -> jax.Array:
    return jnp.swapaxes(a, 0, 1).reshape((a.shape[0] * a.shape[1],) + a.shape[2:])
