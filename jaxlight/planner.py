"""``strategy="auto"``: pick the layout with the fastest estimated step that fits device memory.

Before anything is placed, the train step of a short list of candidate
strategies (:data:`CANDIDATES`: ddp, fsdp, fsdp+tp, their rematerialising
variants and their host-offload variants) is traced, lowered and compiled
ahead of time on abstract shapes (the model's, the optimizer state's and the
first batch's; nothing is allocated), through
:meth:`jaxlight.engine.Engine.compile_abstract`. Per device, a candidate needs

    argument + output + temporary - aliased bytes        (``compiled.memory_analysis()``)
    + in-step callback state (an EMA copy of the parameters)
    + the batches the prefetcher keeps ahead (``Trainer(prefetch=2)``)

and it fits when that is at most ``(1 - headroom)`` of the device memory
(read from the device, or given as ``Trainer(device_memory="16GiB")``).
Among those that fit, the one with the smallest estimated step time wins
(ties go to the smaller need), with the estimate (:class:`StepSpeeds`)

    matmul FLOPs per device / peak FLOP/s               (the traced step, rematerialised recompute included)
    + collective result bytes in the compiled HLO / interconnect bytes/s
    + 2 x host-offloaded bytes / host<->device bytes/s  (copied in and out, not overlapped: HostOffload())

Rematerialisation is considered before offload: the ``+remat`` variant of a
layout (:class:`~jaxlight.strategies.Remat`) is compiled when that layout does
not fit and the model has a :class:`~jaxlight.nn.LayerStack` built with
``remat=None`` (a stack whose ``remat`` the user set keeps it); an offload
variant is compiled only when it could still be faster than the best fitting
candidate. Choosing a ``+remat`` variant is ``"auto"``'s documented behaviour,
and the printed plan says so. The plan (printed on process 0 with the model
summary; in a multi-process run process 0's choice is broadcast, so every
process builds the same mesh) lists every candidate with its bytes and its
estimate, and when nothing fits :class:`NoStrategyFits` says what each
candidate needs.

The planner sits above the engine, the batch placer and the optimizer parser
it drives; :mod:`jaxlight.strategies` never imports it (the Trainer resolves
``"auto"`` through :class:`AutoStrategy`).
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxlight import distributed
from jaxlight.callbacks.throughput import peak_flops
from jaxlight.data import BatchPlacer, host_batch, leaf_path
from jaxlight.engine import Engine
from jaxlight.errors import MisconfigurationError
from jaxlight.flops import matmul_flops
from jaxlight.hlo import Collectives, hlo_collectives
from jaxlight.optim import configure
from jaxlight.precision import resolve_precision
from jaxlight.rank_zero import rank_zero_info
from jaxlight.strategies.offload import HostOffload
from jaxlight.strategies.remat import Remat, counting_unset_remat
from jaxlight.strategies.strategy import Strategy, resolve_strategy
from jaxlight.summary import fmt_bytes

if TYPE_CHECKING:  # pragma: no cover
    from jaxlight.module import LightningModule
    from jaxlight.trainer import Trainer

__all__ = [
    "CANDIDATES",
    "HEADROOM",
    "AutoChoice",
    "AutoStrategy",
    "Candidate",
    "NoStrategyFits",
    "StepSpeeds",
    "choose_strategy",
    "device_memory_limit",
    "parse_memory",
]

CANDIDATES: tuple[str, ...] = (
    "ddp",
    "fsdp",
    "fsdp+tp",
    "ddp+remat",
    "fsdp+remat",
    "fsdp+tp+remat",
    "ddp+offload",
    "fsdp+offload",
    "fsdp+tp+offload",
)
"""The layouts ``"auto"`` considers, in the order it compiles them and the plan lists them: rematerialisation
before host offload."""

HEADROOM = 0.1
"""Fraction of device memory ``"auto"`` leaves free: the compiled step's buffers are not all a device
holds (allocator fragmentation, library workspaces, the evaluation step's temporaries)."""

HOST_KINDS = ("pinned_host", "unpinned_host")

# ---------------------------------------------------------------------------- sizes
_UNITS = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
ACCEPTED_SIZES = (
    "an int number of bytes, or a string like '2GiB', '512MB', '1.5 GB' (B, KB, MB, GB, TB are powers of 1000; "
    "KiB, MiB, GiB, TiB powers of 1024)"
)


def parse_memory(value: int | str) -> int:
    """Bytes from ``value``: a positive int, or a number with a unit (``"2GiB"``, ``"512MB"``, ``"1.5 GB"``).

    Raises ValueError naming the accepted forms for anything else (a float,
    a bool, an unknown unit, zero or a negative size).
    """
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"device_memory={value!r} must be positive; give {ACCEPTED_SIZES}")
        return int(value)
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m and m.group(2).lower() in _UNITS:
            n = float(m.group(1)) * _UNITS[m.group(2).lower()]
            if n >= 1:
                return int(n)
        if m and not m.group(2):
            raise ValueError(f"device_memory={value!r} has no unit; give {ACCEPTED_SIZES}")
    raise ValueError(f"device_memory={value!r} is not a size; give {ACCEPTED_SIZES}")


def device_memory_limit(devices: Iterable[Any]) -> int | None:
    """The smallest ``memory_stats()["bytes_limit"]`` of ``devices`` (GPU/TPU), or None when they report
    none (CPU devices report no limit)."""
    limits = []
    here = jax.process_index()
    for d in devices:
        if d.process_index != here:  # another process's device: it reports its own memory there
            continue
        try:
            stats = d.memory_stats()
        except Exception:  # some backends raise instead of returning None
            stats = None
        limit = (stats or {}).get("bytes_limit")
        if not limit:
            return None
        limits.append(int(limit))
    return min(limits) if limits else None


# ---------------------------------------------------------------------------- the time estimate
@dataclasses.dataclass(frozen=True)
class StepSpeeds:
    """What ``"auto"``'s step-time estimate divides by, per device: peak matmul FLOP/s, interconnect bytes/s
    (collectives) and host<->device bytes/s each way (offload). ``source`` says where they come from.

    The estimate is a ranking model, not a prediction: compute, collectives and host copies are added as if
    nothing overlapped, and elementwise work and memory bandwidth are left out. It is right about what
    matters here: rematerialising costs about one more forward pass of the stacks in FLOPs, offload costs
    two trips of the optimizer state over the host link, and on an accelerator the second is the larger for
    any batch of fewer than about peak / host bandwidth / 8 tokens (an H200: ~300 k).
    """

    flops_per_s: float
    link_bytes_per_s: float
    host_bytes_per_s: float
    source: str = "given"

    def __post_init__(self) -> None:
        for f in ("flops_per_s", "link_bytes_per_s", "host_bytes_per_s"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and math.isfinite(v)):
                raise ValueError(f"StepSpeeds({f}={v!r}) must be a positive number")

    @classmethod
    def for_devices(cls, devices: Sequence[Any], precision: str = "32-true") -> StepSpeeds:
        """Speeds of ``devices[0]``: its published dense peak for ``precision`` (the table
        :func:`jaxlight.callbacks.throughput.peak_flops` reads), a PCIe-class host link (25 GB/s each
        way) and an NVLink/ICI-class interconnect on accelerators; nominal CPU figures elsewhere."""
        dev = devices[0] if devices else None
        platform = getattr(dev, "platform", "cpu")
        peak = peak_flops(dev, precision) if dev is not None else None
        if platform == "cpu" or dev is None:
            return cls(peak or 1e11, 1e10, 1e10, "nominal CPU figures")
        link = 1e11 if platform == "tpu" else 3e11
        kind = getattr(dev, "device_kind", platform)
        if peak is None:
            return cls(1e14, link, 2.5e10, f"nominal {platform} figures ({kind} not in the peak table)")
        return cls(peak, link, 2.5e10, f"{kind} peak for {precision}, nominal link and host bandwidth")

    def describe(self) -> str:
        return (
            f"{self.flops_per_s:.3g} FLOP/s, {self.link_bytes_per_s / 1e9:.3g} GB/s interconnect, "
            f"{self.host_bytes_per_s / 1e9:.3g} GB/s host<->device ({self.source})"
        )


# ---------------------------------------------------------------------------- candidates
@dataclasses.dataclass
class Candidate:
    """One compiled candidate layout and what it needs per device."""

    name: str
    strategy: Strategy
    mesh: dict[str, int]
    device_bytes: int = 0  # everything the step needs in device memory, per device
    host_bytes: int = 0  # state kept in host memory between steps, per device
    step_bytes: int = 0  # memory_analysis(): argument + output + temp - alias (host part removed)
    extra_bytes: int = 0  # in-step callback state in device memory (EMA)
    batch_bytes: int = 0  # the batches the prefetcher keeps ahead, per device
    collectives: Collectives | None = None
    flops: float = 0.0  # matmul FLOPs of the step, all devices (rematerialised recompute included)
    devices: int = 1
    unset_remat: int = 0  # LayerStack calls traced with remat=None (what a Remat piece changes)
    compute_s: float = 0.0  # the estimate's parts (set by choose_strategy from its StepSpeeds)
    link_s: float = 0.0
    host_s: float = 0.0
    compile_s: float = 0.0
    error: str | None = None  # why the candidate could not be compiled (a layout the model refuses)
    exception: BaseException | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def traffic(self) -> int:
        """Bytes moved per step: collectives plus the host copies in and out."""
        return (self.collectives.total_bytes if self.collectives else 0) + 2 * self.host_bytes

    @property
    def estimate_s(self) -> float:
        """Estimated seconds per step: compute + collectives + host copies (:class:`StepSpeeds`)."""
        return self.compute_s + self.link_s + self.host_s

    def set_estimate(self, speeds: StepSpeeds) -> None:
        """Fill the estimate's parts from this candidate's FLOPs and bytes."""
        self.compute_s = self.flops / max(1, self.devices) / speeds.flops_per_s
        self.link_s = (self.collectives.total_bytes if self.collectives else 0) / speeds.link_bytes_per_s
        self.host_s = 2 * self.host_bytes / speeds.host_bytes_per_s

    def estimate_text(self) -> str:
        return (
            f"{self.estimate_s * 1e3:.3g} ms ({self.compute_s * 1e3:.3g} compute + {self.link_s * 1e3:.3g} "
            f"collectives + {self.host_s * 1e3:.3g} host copies)"
        )

    @property
    def mesh_text(self) -> str:
        return ",".join(f"{a}={s}" for a, s in self.mesh.items() if s > 1) or "1 device"

    def need_text(self) -> str:
        host = f" + {fmt_bytes(self.host_bytes)} host" if self.host_bytes else ""
        return f"{fmt_bytes(self.device_bytes)}{host}"


@dataclasses.dataclass
class AutoChoice:
    """What ``"auto"`` chose: the strategy, its candidate, every candidate considered, and the budget."""

    strategy: Strategy
    chosen: Candidate | None
    candidates: list[Candidate]
    limit: int | None
    budget: int | None
    message: str


class NoStrategyFits(MisconfigurationError):
    """No candidate layout fits device memory; ``candidates`` holds what each one needs."""

    def __init__(self, message: str, candidates: Sequence[Candidate], budget: int) -> None:
        super().__init__(message)
        self.candidates = list(candidates)
        self.budget = budget


def _shard_bytes(tree: Any, kinds: tuple[str, ...] | None = None) -> int:
    """Bytes one device holds of the abstract arrays in ``tree`` (only those in memory ``kinds`` if given)."""
    total = 0
    for x in jax.tree.leaves(tree):
        sh = getattr(x, "sharding", None)
        if sh is None:
            continue
        if kinds is not None and getattr(sh, "memory_kind", None) not in kinds:
            continue
        total += math.prod(sh.shard_shape(tuple(x.shape))) * np.dtype(x.dtype).itemsize
    return int(total)


def _extra_shardings(strategy: Strategy, params: Mapping[str, Any]) -> dict[str, Any]:
    """A parameter copy's shardings under ``strategy``: each parameter's, in the memory kind the strategy
    gives callback state (``"callback_state"``) that mirrors it."""
    out = {}
    for k, p in params.items():
        kind = strategy.memory_kind("callback_state", k)
        out[k] = p.sharding.with_memory_kind(kind) if kind is not None else p.sharding
    return out


def _callback_bytes(
    strategy: Strategy, trainer: Any, callbacks: Sequence[Any], params: Mapping[str, Any]
) -> tuple[int, int]:
    """(device, host) bytes per device of the callbacks' in-step state: one copy of the parameters per
    callback with a step extension (what EMA keeps; creating the real state needs placed arrays)."""
    dev = host = 0
    for cb in callbacks:
        if trainer is None or cb.step_extension(trainer) is None:
            continue
        shardings = _extra_shardings(strategy, params)
        for k, p in params.items():
            s = shardings[k]
            n = math.prod(s.shard_shape(tuple(p.shape))) * np.dtype(p.dtype).itemsize
            if getattr(s, "memory_kind", None) in HOST_KINDS:
                host += n
            else:
                dev += n
    return int(dev), int(host)


def evaluate(
    name: str,
    strategy: Strategy,
    module: LightningModule,
    tx: Any,
    batch: Any,
    devices: Sequence[Any],
    precision: Any,
    *,
    trainer: Any = None,
    callbacks: Sequence[Any] = (),
    prefetch: int = 2,
    process_local: bool = False,
) -> Candidate:
    """Compile ``strategy``'s train step for ``module`` on abstract shapes and measure what it needs."""
    mesh = strategy.build_mesh(devices)
    cand = Candidate(name, strategy, dict(mesh.shape))
    engine = Engine(strategy, mesh, precision)
    placer = BatchPlacer(mesh, process_local, strategy)
    shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((placer.global_rows(x.shape[0]), *x.shape[1:]), x.dtype), batch
    )
    t0 = time.perf_counter()
    with counting_unset_remat() as unset:
        compiled, state, jaxpr = engine.compile_abstract(module, tx, shapes, with_jaxpr=True)
    cand.compile_s = time.perf_counter() - t0
    cand.unset_remat = len(unset)
    cand.flops = matmul_flops(jaxpr).flops
    cand.devices = int(mesh.size)
    mem = compiled.memory_analysis()
    host = _shard_bytes(state, HOST_KINDS)
    step = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    if host and not (mem.host_argument_size_in_bytes or mem.host_output_size_in_bytes):
        # XLA:CPU reports host-memory arguments inside argument_size (and no host bytes): donated and
        # aliased, they count once in argument + output - alias, so remove them once.
        step -= host
    cand.step_bytes = int(step)
    cand.extra_bytes, extra_host = _callback_bytes(strategy, trainer, callbacks, state.params)
    with engine.context():
        batch_sds = jax.tree_util.tree_map_with_path(
            lambda p, x: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=placer.leaf_sharding(leaf_path(p), tuple(x.shape))
            ),
            shapes,
        )
    cand.batch_bytes = max(0, int(prefetch)) * _shard_bytes(batch_sds)
    cand.host_bytes = host + extra_host
    cand.device_bytes = cand.step_bytes + cand.extra_bytes + cand.batch_bytes
    cand.collectives = hlo_collectives(compiled.as_text())
    return cand


def _dedupe(names: Sequence[str | Strategy], n_devices: int) -> list[tuple[str, Strategy, str | None]]:
    """Candidates as (name, strategy, reason it cannot run here); layouts equal on this device count once."""
    seen: set = set()
    out: list[tuple[str, Strategy, str | None]] = []
    for n in names:
        s = resolve_strategy(n)
        label = n if isinstance(n, str) else s.name
        try:
            shape = s.mesh_shape(n_devices)
        except ValueError as e:
            out.append((label, s, str(e)))
            continue
        key = (tuple(sorted(shape.items())), s.find(HostOffload), s.find(Remat), s.logical_rules)
        if n_devices == 1:
            key = key[1:3]
        if key in seen:
            continue
        seen.add(key)
        out.append((label, s, None))
    return out


def choose_strategy(
    module: LightningModule,
    tx: Any,
    batch: Any,
    devices: Sequence[Any],
    *,
    precision: Any = "32-true",
    device_memory: int | str | None = None,
    headroom: float = HEADROOM,
    candidates: Sequence[str | Strategy] = CANDIDATES,
    trainer: Any = None,
    callbacks: Sequence[Any] = (),
    prefetch: int = 2,
    process_local: bool = False,
    speeds: StepSpeeds | None = None,
) -> AutoChoice:
    """Compile candidates' train steps on abstract shapes and pick the fastest estimated step that fits.

    ``batch`` is one global batch (arrays or ``jax.ShapeDtypeStruct``), ``tx``
    what ``configure_optimizers`` returns (any form) or the parsed
    :class:`~jaxlight.optim.OptimizerConfig`. ``device_memory`` (bytes or a
    string such as ``"2GiB"``) overrides what the devices report; ``speeds``
    what the estimate divides by (default :meth:`StepSpeeds.for_devices`).
    Returns an :class:`AutoChoice` whose ``message`` is the plan ``"auto"``
    prints: the choice and why, then every candidate with its bytes and its
    estimate (or why it was not compiled).
    Devices that report no memory limit (CPU) and no ``device_memory``: data
    parallel, as before, and the message says why. Raises
    :class:`NoStrategyFits` with every candidate's requirement when none fits.
    """
    if not 0.0 <= headroom < 1.0:
        raise ValueError(f"headroom must be within [0, 1), got {headroom}")
    devices = list(devices)
    precision = resolve_precision(precision) if isinstance(precision, (str, int)) else precision
    limit = parse_memory(device_memory) if device_memory is not None else device_memory_limit(devices)
    if limit is None:
        platform = devices[0].platform if devices else "cpu"
        msg = (
            f'strategy="auto": ddp ({platform} devices report no memory limit, so nothing to choose by; pass '
            f"Trainer(device_memory=...) e.g. '16GiB' to pick the layout by memory)"
        )
        return AutoChoice(resolve_strategy("ddp"), None, [], None, None, msg)
    budget = int(limit * (1.0 - headroom))
    where = (
        f"{fmt_bytes(limit)} device memory"
        if device_memory is None
        else f"device_memory={device_memory!r} = {fmt_bytes(limit)}"
    )
    budget_text = f"{fmt_bytes(budget)} per device ({where} less {headroom:.0%} headroom)"
    speeds = speeds or StepSpeeds.for_devices(devices, getattr(precision, "name", "32-true"))
    tried: list[Candidate] = []
    skipped: list[tuple[str, str]] = []  # (name, why it was not compiled)

    def fits(c: Candidate) -> bool:
        return c.error is None and c.device_bytes <= budget

    def run(name: str, strategy: Strategy) -> Candidate:
        cand = _try(name, strategy, module, tx, batch, devices, precision, trainer, callbacks, prefetch, process_local)
        if cand.error is None:
            cand.set_estimate(speeds)
        tried.append(cand)
        return cand

    def best_so_far() -> Candidate | None:
        return min((c for c in tried if fits(c)), key=_key, default=None)

    plain, remat, offload = [], [], []
    for name, strategy, reason in _dedupe(candidates, len(devices)):
        if reason is not None:
            tried.append(Candidate(name, strategy, {}, error=reason))
        elif strategy.find(HostOffload) is not None:
            offload.append((name, strategy))
        elif strategy.find(Remat) is not None:
            remat.append((name, strategy))
        else:
            plain.append((name, strategy))
    for name, strategy in plain:
        run(name, strategy)
    # LayerStack calls traced with remat=None in the plain layouts (None: none compiled, so unknown)
    unset = max((c.unset_remat for c in tried if c.error is None), default=None)
    # rematerialisation before offload: a +remat variant only where its layout does not fit as it is
    for name, strategy in remat:
        base = _base_of(strategy, tried, (Remat,))
        if unset == 0:
            skipped.append((name, "the model has no LayerStack built with remat=None"))
        elif base is not None and fits(base):
            skipped.append((name, f"{base.name} fits without recomputing"))
        else:
            run(name, strategy)
    for name, strategy in offload:
        base = _base_of(strategy, tried, (HostOffload,))
        best = best_so_far()
        # offload adds host copies to its base layout's compute and collectives: when those alone are
        # already estimated slower than the best fitting candidate, the offload variant cannot win
        if best is not None and base is not None and base.error is None:
            if base.compute_s + base.link_s >= best.estimate_s:
                skipped.append((name, f"cannot be faster than {best.name}"))
                continue
        run(name, strategy)
    best = best_so_far()
    idx = tried.index(best) if best is not None else -1
    # every process must build the same mesh: process 0's choice wins (the identity in one process)
    idx = distributed.broadcast_int(idx)
    best = tried[idx] if idx >= 0 else None
    compiled = [c for c in tried if c.error is None]
    if not compiled and tried and tried[0].exception is not None:
        raise tried[0].exception  # nothing compiled at all: the model's own error, not a memory verdict
    if best is None:
        smallest = min(compiled, key=lambda c: c.device_bytes, default=None)
        needs = "; ".join(
            f"{c.name} needs {c.need_text()}" if c.error is None else f"{c.name}: {c.error}" for c in tried
        )
        head = (
            f"the smallest requirement is {smallest.name} ({smallest.mesh_text}) with {smallest.need_text()} per device"
            if smallest is not None
            else "no candidate could be compiled"
        )
        raise NoStrategyFits(
            f'strategy="auto": no candidate layout fits in {budget_text} on {len(devices)} devices; {head}. '
            f"Per device: {needs}. Use more devices, a smaller batch, a larger device_memory, or give a strategy "
            f"explicitly",
            tried,
            budget,
        )
    rivals = sorted((c for c in tried if fits(c) and c is not best), key=_key)
    why = "the fastest estimated step that fits"
    if rivals:
        why += f" (next: {rivals[0].name}, {rivals[0].estimate_s * 1e3:.3g} ms)"
    remat_piece = best.strategy.find(Remat)
    if remat_piece is not None:
        why += (
            f"; it rematerialises (policy {remat_piece.policy!r}) the LayerStacks built with remat=None, "
            f"stacks with an explicit remat keep theirs"
        )
    msg = (
        f'strategy="auto": {best.name} ({best.mesh_text}), {why}: needs {best.need_text()} of {budget_text}, '
        f"estimated {best.estimate_text()} per step"
    )
    msg += "\n" + _plan_table(tried, skipped, best, budget) + f"\n  estimate speeds: {speeds.describe()}"
    return AutoChoice(best.strategy, best, tried, limit, budget, msg)


def _plan_table(tried: Sequence[Candidate], skipped: Sequence[tuple[str, str]], best: Candidate, budget: int) -> str:
    """One line per candidate: mesh, device need (memory_analysis), host bytes, estimate, verdict."""
    rows = [("candidate", "mesh", "device need", "host", "estimated step", "verdict")]
    for c in tried:
        if c.error is not None:
            rows.append((c.name, "-", "-", "-", "-", f"n/a: {c.error}"))
            continue
        verdict = "chosen" if c is best else ("fits" if c.device_bytes <= budget else "does not fit")
        rows.append(
            (c.name, c.mesh_text, fmt_bytes(c.device_bytes), fmt_bytes(c.host_bytes), c.estimate_text(), verdict)
        )
    for name, why in skipped:
        rows.append((name, "-", "-", "-", "-", f"not compiled: {why}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  " + "  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in rows)


def _base_of(strategy: Strategy, tried: Sequence[Candidate], less: tuple[type, ...]) -> Candidate | None:
    """The compiled candidate with ``strategy``'s pieces less those of the types ``less``."""
    base = tuple(p for p in strategy.pieces if not isinstance(p, less))
    for c in tried:
        if tuple(p for p in c.strategy.pieces if not isinstance(p, less)) == base and not (
            set(map(type, c.strategy.pieces)) & set(less)
        ):
            return c
    return None


def _key(c: Candidate) -> tuple[float, int]:
    return (c.estimate_s, c.device_bytes)


def _try(name, strategy, module, tx, batch, devices, precision, trainer, callbacks, prefetch, process_local):
    """``evaluate``, with a layout the model refuses (LayoutError, a piece's check) recorded as n/a."""
    try:
        return evaluate(
            name,
            strategy,
            module,
            tx,
            batch,
            devices,
            precision,
            trainer=trainer,
            callbacks=callbacks,
            prefetch=prefetch,
            process_local=process_local,
        )
    except (ValueError, TypeError) as e:
        return Candidate(name, strategy, {}, error=f"{type(e).__name__}: {e}", exception=e)


# ---------------------------------------------------------------------------- the Trainer's "auto"
class AutoStrategy:
    """What ``Trainer(strategy="auto")`` holds until ``fit`` knows the model and the batch.

    ``device_memory``: bytes or a string (``"2GiB"``); None reads the
    devices' limit. Checked when built, so a bad value fails in
    ``Trainer(...)``. :meth:`choose` runs once per module at the start of
    ``fit`` (before any state is placed) and returns the strategy to use.
    """

    def __init__(
        self,
        device_memory: int | str | None = None,
        *,
        headroom: float = HEADROOM,
        candidates: Sequence[str | Strategy] = CANDIDATES,
        speeds: StepSpeeds | None = None,
    ) -> None:
        if device_memory is not None:
            try:
                parse_memory(device_memory)
            except ValueError as e:
                raise MisconfigurationError(str(e)) from None
        if not 0.0 <= headroom < 1.0:
            raise MisconfigurationError(f"headroom must be within [0, 1), got {headroom}")
        self.device_memory = device_memory
        self.headroom = headroom
        self.candidates = tuple(candidates)
        self.speeds = speeds
        self.choice: AutoChoice | None = None
        self._module_id: int | None = None

    @classmethod
    def for_trainer(cls, strategy: Any, device_memory: int | str | None) -> AutoStrategy | None:
        """What ``Trainer(strategy=..., device_memory=...)`` holds: an AutoStrategy for ``"auto"``, else None.

        ``device_memory`` with any other strategy is refused (it would be ignored).
        """
        if isinstance(strategy, str) and strategy.strip().lower() == "auto":
            return cls(device_memory)
        if device_memory is not None:
            raise MisconfigurationError(
                f"device_memory={device_memory!r} is read only by strategy='auto' (it picks the layout that fits); "
                f"with strategy={strategy!r} drop it, or pass strategy='auto'"
            )
        return None

    def choose(self, trainer: Trainer, devices: Sequence[Any], train_loader: Any) -> Strategy:
        """The strategy for ``trainer.lightning_module`` (its one line printed on process 0 with the model
        summary, i.e. unless ``enable_model_summary=False``); the current one when the module's state is
        already placed (a second ``fit`` of the same module)."""
        module = trainer.lightning_module
        engine = trainer.engine
        if engine.parts is not None and engine.module is module:
            return trainer.strategy
        if self.choice is not None and self._module_id == id(module):
            return self.choice.strategy
        limit = parse_memory(self.device_memory) if self.device_memory is not None else device_memory_limit(devices)
        if limit is None:
            choice = choose_strategy(module, None, None, devices, device_memory=None)
        else:
            batch = jax.tree.map(_shape_dtype, host_batch(peek_first_batch(train_loader)))
            # parsed as fit will (clipping, accumulation); the engine builds it on the abstract parameters
            tx = configure(
                trainer.call_module_hook("configure_optimizers"),
                gradient_clip_val=trainer.gradient_clip_val,
                gradient_clip_algorithm=trainer.gradient_clip_algorithm,
                accumulate_grad_batches=trainer.accumulate_grad_batches,
            )
            choice = choose_strategy(
                module,
                tx,
                batch,
                devices,
                precision=trainer.precision_plugin,
                device_memory=self.device_memory,
                headroom=self.headroom,
                candidates=self.candidates,
                trainer=trainer,
                callbacks=trainer.callbacks,
                prefetch=trainer.prefetch,
                process_local=trainer.process_local_batches,
                speeds=self.speeds,
            )
        self.choice, self._module_id = choice, id(module)
        if trainer.enable_model_summary:  # part of the summary: quiet with it off (kept in self.choice.message)
            rank_zero_info(choice.message)
        return choice.strategy


def peek_first_batch(loader: Any) -> Any:
    """The first batch ``loader`` yields, leaving it to yield the same batches in the same order.

    A loader is re-iterable; what a fresh iterator draws from random state
    (torch's global generator, the loader's own ``generator``, a stateful
    loader's ``state_dict``) is saved before and put back after. A one-shot
    iterator cannot be peeked without losing its first batch and is refused.
    """
    if isinstance(loader, Iterator):
        raise MisconfigurationError(
            f'strategy="auto" reads the shapes of the first train batch, but the train loader is a one-shot '
            f"{type(loader).__name__} iterator (reading it would drop that batch from training); pass a re-iterable "
            f"loader (a list, a DataLoader) or give the strategy explicitly"
        )
    torch = sys.modules.get("torch")
    torch_state = torch.random.get_rng_state() if torch is not None else None
    gen = getattr(loader, "generator", None)
    gen_state = gen.get_state() if gen is not None and callable(getattr(gen, "get_state", None)) else None
    stateful = callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))
    saved = loader.state_dict() if stateful else None
    try:
        it = iter(loader)
        try:
            first = next(it)
        except StopIteration:
            raise MisconfigurationError("the train loader yielded no batch") from None
        finally:
            del it  # a torch DataLoader's iterator stops its worker processes when collected
    finally:
        if saved is not None:
            loader.load_state_dict(saved)
        if gen_state is not None:
            gen.set_state(gen_state)
        if torch_state is not None:
            torch.random.set_rng_state(torch_state)
    return first


def _shape_dtype(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)
