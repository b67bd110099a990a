"""Host offload: optimizer moments and the EMA copy live in pinned host memory between steps.

The piece gives every optimizer-state and callback-state leaf that mirrors a
parameter the ``pinned_host`` memory kind (same partition spec as its
parameter, so each device's host shard is the slice that device updates).
The compiled step fetches those leaves into device memory once the gradients
exist (an optimization barrier orders the copies after the backward pass, so
the fetched state never shares device memory with the activations), runs the
same update, and its out-shardings write them back to host memory; parameters
never leave the device. Values are bit-identical to the same run without
offload (8 CPU devices; on a GPU with ``Trainer(deterministic=True)``): only
where the bytes live changes.

``HostOffload(stream=N)`` streams the offloaded state instead, so that its
copies run while the device computes: the leaves are split into N groups by
the parameters they mirror (last layers first, the order the backward pass
makes their gradients) and the update walks the groups as a software pipeline.
Groups 0 and 1 are fetched at the start of the step (their copies depend on
nothing the step computes, so they can run under the forward and backward
pass); the fetch of group g+1 is issued before the update of group g and
waits only for the write-back of group g-1 (an optimization barrier), so while
group g updates, group g+1 comes in and group g-1 goes out (double buffering).
At most three groups of offloaded state are in device memory at once, two of
them during the forward and backward pass. Each group's update is the same
traced update, cut down by jit's dead-code elimination to that group's
outputs, so values stay bit-identical. It needs an update whose outputs each
depend on one group's offloaded state (per-leaf optimizers such as Adam, with
gradient clipping before them, EMA, gradient accumulation); otherwise (e.g. a
clip of the updates after Adam) it warns and fetches everything at once.

Where the copies really run concurrently is the backend's scheduler's call:
XLA:GPU turns each in-step memory move into an asynchronous copy-start /
copy-done pair that its scheduler may overlap with independent compute.
XLA:CPU strips memory-placement annotations (host and device are the same
RAM), so its compiled HLO has no copies; the tests therefore check the
program XLA:GPU receives for the dependence structure that permits overlap.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from jaxlight.strategies.strategy import Piece, UpdateFn, register_strategy

HOST = "pinned_host"


def _to_device(tree: Any, shardings: Any) -> Any:
    """Inside the step: host-resident leaves of ``tree`` copied into device memory (others untouched)."""

    def move(x: Any, s: Any) -> Any:
        if getattr(s, "memory_kind", None) in (None, "device"):
            return x
        return jax.device_put(x, s.with_memory_kind("device"))

    return jax.tree.map(move, tree, shardings)


@dataclasses.dataclass(frozen=True)
class HostOffload(Piece):
    """Keep optimizer state (``optimizer_state``) and callback-owned state such as the EMA copy
    (``callback_state``) in pinned host memory. ``ema=`` is the old, deprecated name of ``callback_state``.

    Only leaves that mirror a parameter move (Adam's moments, a momentum
    buffer, the gradient accumulator of ``accumulate_grad_batches``, EMA weights); step
    counters and other scalars stay in device memory. Composes with every
    placement (``"fsdp+offload"``, ``"ddp+offload"``, ``"fsdp+tp+offload"``):
    a host leaf keeps its parameter's partition spec. Costs two host<->device
    copies of the offloaded bytes per step; saves them from device memory.
    Callbacks that compute on these groups on the device between steps
    declare ``state_on_device`` and are refused with a clear error.
    """

    name: ClassVar[str] = "offload"
    optimizer_state: bool = True
    callback_state: bool = True
    ema: dataclasses.InitVar[bool | None] = None  # deprecated name of callback_state
    stream: int = 0  # groups the offloaded state is streamed in (0 or 1: all fetched after the backward pass)

    def __post_init__(self, ema: bool | None) -> None:
        if isinstance(self.stream, bool) or not isinstance(self.stream, int) or self.stream < 0:
            raise ValueError(f"HostOffload(stream={self.stream!r}): the number of groups must be an int >= 0")
        if ema is not None:
            warnings.warn(
                "HostOffload(ema=...) is deprecated: the flag covers every callback's in-step state, "
                "use HostOffload(callback_state=...)",
                DeprecationWarning,
                stacklevel=3,
            )
            object.__setattr__(self, "callback_state", bool(ema))

    def memory_kind(self, group: str, mirrors: str | None) -> str | None:
        if mirrors is None:
            return None
        if (group == "opt_state" and self.optimizer_state) or (group == "callback_state" and self.callback_state):
            return HOST
        return None

    def wrap_update(self, update: UpdateFn, shardings: Any) -> UpdateFn:
        if not (self.optimizer_state or self.callback_state):
            return update

        def fetch_then_update(state: Any, grads: Any, aux: Any) -> Any:
            # The copies to the device wait for the gradients, so the fetched state shares device memory
            # with the gradients only, not with the activations. Without this XLA:GPU starts them early
            # and the step's peak keeps every offloaded byte (measured: 2.5 GB temp against 1.8 GB).
            grads, opt_state, extra = jax.lax.optimization_barrier((grads, state.opt_state, state.callback_state))
            state = state._replace(
                opt_state=_to_device(opt_state, shardings.opt_state),
                callback_state=_to_device(extra, shardings.callback_state),
            )
            return update(state, grads, aux)

        if self.stream <= 1:
            return fetch_then_update
        groups = self.stream

        def streamed_update(state: Any, grads: Any, aux: Any) -> Any:
            plan = _stream_plan(update, state, grads, aux, shardings, groups)
            if isinstance(plan, str):
                warnings.warn(
                    f"HostOffload(stream={groups}) fetches the offloaded state at once instead: {plan}", stacklevel=2
                )
                return fetch_then_update(state, grads, aux)
            return _run_streamed(update, state, grads, aux, plan)

        return streamed_update


# ---------------------------------------------------------------------------------------- streaming
@dataclasses.dataclass
class _Plan:
    """How one traced update is streamed: which flat inputs are host leaves, their groups, where outputs come from."""

    in_tree: Any
    out_tree: Any
    host: dict[int, Any]  # flat input index -> its host sharding
    groups: list[list[int]]  # per group, in stream order: flat input indices of its host leaves
    source: list[int]  # per flat output: -1 (from the update with no offloaded input) or its group
    write_back: dict[int, Any]  # flat output index -> host sharding it is written back to in the step


def _mirror_key(path: tuple, shape: tuple, grads: dict) -> str | None:
    """The parameter a state leaf mirrors: the innermost str key of its path naming a gradient of its shape
    (the rule the engine places such leaves by)."""
    for k in reversed(path):
        key = getattr(k, "key", None)
        if isinstance(key, str) and key in grads and tuple(jnp.shape(grads[key])) == shape:
            return key
    return None


def _stream_plan(update: UpdateFn, state: Any, grads: Any, aux: Any, shardings: Any, n_groups: int) -> _Plan | str:
    """The streaming plan of this update, or why it cannot be streamed (a sentence)."""
    if not isinstance(grads, dict) or not grads:
        return "the step has no gradients by parameter (manual optimization)"
    flat, in_tree = jax.tree_util.tree_flatten_with_path((state, grads, aux))
    n_state = len(jax.tree.leaves(state))
    state_shardings = jax.tree.structure(state).flatten_up_to(shardings)
    host: dict[int, Any] = {}
    mirror: dict[int, str] = {}
    for i, ((path, x), sh) in enumerate(zip(flat[:n_state], state_shardings)):
        if getattr(sh, "memory_kind", None) in (None, "device"):
            continue
        key = _mirror_key(path, tuple(jnp.shape(x)), grads)
        if key is None:
            return f"state leaf {jax.tree_util.keystr(path)} is in host memory but mirrors no parameter"
        host[i], mirror[i] = sh, key
    if not host:
        return "no state leaf is in host memory"
    # groups: the parameters' modules, last first (the backward pass's order), cut into n_groups runs of about
    # equal host bytes
    modules: list[str] = []
    for key in reversed(list(grads)):
        mod = key.rsplit("/", 1)[0]
        if not modules or modules[-1] != mod:
            modules.append(mod)
    nbytes = dict.fromkeys(modules, 0)
    for i, key in mirror.items():
        x = flat[i][1]
        nbytes[key.rsplit("/", 1)[0]] += int(jnp.size(x)) * jnp.dtype(x.dtype).itemsize
    modules = [m for m in modules if nbytes[m]]
    target = sum(nbytes.values()) / max(1, min(n_groups, len(modules)))
    group_of: dict[str, int] = {}
    g, acc = 0, 0
    for m in modules:
        if acc >= target * (g + 1) and g + 1 < n_groups:
            g += 1
        group_of[m] = g
        acc += nbytes[m]
    count = g + 1
    groups: list[list[int]] = [[] for _ in range(count)]
    for i, key in mirror.items():
        gi = group_of[key.rsplit("/", 1)[0]]
        groups[gi].append(i)
    # which offloaded group each output depends on (read off the traced update)
    xs = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for _, x in flat]

    def flat_update(*leaves: Any) -> Any:
        return update(*jax.tree_util.tree_unflatten(in_tree, leaves))

    closed, out_shape = jax.make_jaxpr(flat_update, return_shape=True)(*xs)
    out_tree = jax.tree.structure(out_shape)
    deps = _dependencies(closed)
    group_bit = [sum(1 << i for i in idx) for idx in groups]
    source = []
    for k, d in enumerate(deps):
        hit = [gi for gi, bits in enumerate(group_bit) if d & bits]
        if len(hit) > 1:
            return (
                f"output {k} of the update depends on the offloaded state of {len(hit)} groups, so no group can "
                f"be updated before every group is fetched (an optimizer that mixes parameters after reading its "
                f'state, e.g. a clip of the updates after the moments; or "16-mixed" under gradient '
                f"accumulation, whose Inf/NaN check reads the whole accumulated window)"
            )
        source.append(hit[0] if hit else -1)
    # outputs that are new values of host leaves go back to host memory in the step
    write_back: dict[int, Any] = {}
    out_state = out_shape[0] if isinstance(out_shape, tuple) and out_shape else None
    if jax.tree.structure(out_state) == jax.tree.structure(state):
        for i in host:
            write_back[i] = host[i]  # the new state's leaf i is flat output i (the state comes first)
    return _Plan(in_tree, out_tree, host, groups, source, write_back)


def _dependencies(closed: ClosedJaxpr) -> list[int]:
    """Per output of ``closed``, the inputs it depends on (a bit mask over input positions)."""
    return _deps(closed.jaxpr, [1 << i for i in range(len(closed.jaxpr.invars))])


def _deps(jaxpr: Jaxpr, ins: list[int]) -> list[int]:
    dep: dict[Any, int] = dict(zip(jaxpr.invars, ins))
    read = lambda v: 0 if isinstance(v, Literal) else dep.get(v, 0)
    for eqn in jaxpr.eqns:
        args = [read(v) for v in eqn.invars]
        outs = _eqn_deps(eqn, args)
        for v, d in zip(eqn.outvars, outs):
            dep[v] = d
    return [read(v) for v in jaxpr.outvars]


def _eqn_deps(eqn: Any, args: list[int]) -> list[int]:
    """Dependencies of one equation's outputs: through the inner program of a call or a cond, else every
    output on every input (conservative: a false dependency only turns streaming off)."""
    n_out = len(eqn.outvars)
    branches = eqn.params.get("branches")
    if branches is not None and all(isinstance(b, ClosedJaxpr) for b in branches):
        pred, ops = args[0], args[1:]
        outs = [pred] * n_out
        for b in branches:
            if len(b.jaxpr.invars) != len(ops):
                break
            for j, d in enumerate(_deps(b.jaxpr, ops)):
                outs[j] |= d
        else:
            return outs
    for name in ("jaxpr", "call_jaxpr"):
        inner = eqn.params.get(name)
        inner = inner.jaxpr if isinstance(inner, ClosedJaxpr) else inner
        if isinstance(inner, Jaxpr) and len(inner.invars) == len(args) and len(inner.outvars) == n_out:
            return _deps(inner, args)
    every = 0
    for d in args:
        every |= d
    return [every] * n_out


def _run_streamed(update: UpdateFn, state: Any, grads: Any, aux: Any, plan: _Plan) -> Any:
    """One update per group on its fetched leaves (the other groups' leaves zeros that jit drops), software
    pipelined: groups 0 and 1 are fetched at the start of the step (they depend on nothing the step computes,
    so the scheduler can run their copies under the forward and backward pass), and the fetch of group g+1
    is issued before the update of group g, tied by an optimization barrier to the write-back of group g-1
    only: while group g updates, group g+1 comes in and group g-1 goes out (double buffering), and at most
    three groups of offloaded state are in device memory at once."""
    flat = jax.tree.leaves((state, grads, aux))
    placeholders = {i: jnp.zeros(jnp.shape(flat[i]), jnp.result_type(flat[i])) for i in plan.host}

    def run(fetched: dict[int, Any]) -> list[Any]:
        leaves = [fetched.get(i, placeholders.get(i, x)) for i, x in enumerate(flat)]
        return jax.tree.leaves(update(*jax.tree_util.tree_unflatten(plan.in_tree, leaves)))

    def fetch(g: int, tie: list[int]) -> dict[int, Any]:
        idx = plan.groups[g]
        host_in = [flat[i] for i in idx]
        if tie:  # the copies in wait for group g-2's write-back: a bound on the device memory they take
            host_in, tied = jax.lax.optimization_barrier((host_in, [out[k] for k in tie]))
            for k, v in zip(tie, tied):
                out[k] = v
        return {i: jax.device_put(x, plan.host[i].with_memory_kind("device")) for i, x in zip(idx, host_in)}

    out: list[Any] = list(run({}))  # outputs that read no offloaded leaf (step counters, logged values)
    n = len(plan.groups)
    written: list[list[int]] = []  # per group: its written-back output indices
    fetched = [fetch(0, [])]
    for g in range(n):
        if g + 1 < n:  # the next group's copies in, issued before this group's update and independent of it
            fetched.append(fetch(g + 1, written[g - 1] if g >= 1 else []))
        # the update reads the gradients themselves, so what every group computes from all of them (a global
        # norm) stays one expression that XLA's common-subexpression pass merges
        mine = run(fetched[g])
        fetched[g] = {}  # done with: the fetched leaves are dead after this group's update
        done = []
        for k, src in enumerate(plan.source):
            if src != g:
                continue
            if k in plan.write_back:
                out[k] = jax.device_put(mine[k], plan.write_back[k])
                done.append(k)
            else:
                out[k] = mine[k]
        written.append(done)
    return jax.tree_util.tree_unflatten(plan.out_tree, out)


register_strategy("offload", HostOffload)
