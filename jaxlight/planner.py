"""``strategy="auto"``: pick the layout with the least communication that fits device memory.

Before anything is placed, the train step of a short list of candidate
strategies (:data:`CANDIDATES`: ddp, fsdp, fsdp+tp and their host-offload
variants) is lowered and compiled ahead of time on abstract shapes (the
model's, the optimizer state's and the first batch's; nothing is allocated),
through :meth:`jaxlight.engine.Engine.compile_abstract`. Per device, a
candidate needs

    argument + output + temporary - aliased bytes        (``compiled.memory_analysis()``)
    + in-step callback state (an EMA copy of the parameters)
    + the batches the prefetcher keeps ahead (``Trainer(prefetch=2)``)

and it fits when that is at most ``(1 - headroom)`` of the device memory
(read from the device, or given as ``Trainer(device_memory="16GiB")``).
Among those that fit, the one that moves the fewest bytes per step wins: the
result bytes of every collective in its compiled HLO plus twice its host-
offloaded bytes (copied in and out every step); ties go to the smaller need.
The choice is printed as one line on process 0 (in a multi-process run
process 0's choice is broadcast, so every process builds the same mesh), and
when nothing fits :class:`NoStrategyFits` says what each candidate needs.

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
from jaxlight.data import BatchPlacer, host_batch, leaf_path
from jaxlight.engine import Engine
from jaxlight.errors import MisconfigurationError
from jaxlight.hlo import Collectives, hlo_collectives
from jaxlight.optim import configure
from jaxlight.precision import resolve_precision
from jaxlight.rank_zero import rank_zero_info
from jaxlight.strategies.offload import HostOffload
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
    "choose_strategy",
    "device_memory_limit",
    "parse_memory",
]

CANDIDATES: tuple[str, ...] = ("ddp", "fsdp", "fsdp+tp", "ddp+offload", "fsdp+offload", "fsdp+tp+offload")
"""The layouts ``"auto"`` compiles, in the order ties and the printed line list them."""

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
    compile_s: float = 0.0
    error: str | None = None  # why the candidate could not be compiled (a layout the model refuses)
    exception: BaseException | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def traffic(self) -> int:
        """Bytes moved per step: collectives plus the host copies in and out."""
        return (self.collectives.total_bytes if self.collectives else 0) + 2 * self.host_bytes

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
    compiled, state = engine.compile_abstract(module, tx, shapes)
    cand.compile_s = time.perf_counter() - t0
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
        key = (tuple(sorted(shape.items())), s.find(HostOffload), s.logical_rules)
        if n_devices == 1:
            key = (key[1],)
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
) -> AutoChoice:
    """Compile each candidate's train step on abstract shapes and pick the least communication that fits.

    ``batch`` is one global batch (arrays or ``jax.ShapeDtypeStruct``), ``tx``
    what ``configure_optimizers`` returns (any form) or the parsed
    :class:`~jaxlight.optim.OptimizerConfig`. ``device_memory`` (bytes or a
    string such as ``"2GiB"``) overrides what the devices report. Returns an
    :class:`AutoChoice` whose ``message`` is the one line ``"auto"`` prints.
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
    tried: list[Candidate] = []
    best: Candidate | None = None
    pending_offload = []
    for name, strategy, reason in _dedupe(candidates, len(devices)):
        if reason is not None:
            tried.append(Candidate(name, strategy, {}, error=reason))
            continue
        if strategy.find(HostOffload) is not None:
            pending_offload.append((name, strategy))  # compiled only if it could win (below)
            continue
        cand = _try(name, strategy, module, tx, batch, devices, precision, trainer, callbacks, prefetch, process_local)
        tried.append(cand)
        if cand.error is None and cand.device_bytes <= budget and (best is None or _key(cand) < _key(best)):
            best = cand
    for name, strategy in pending_offload:
        base = _base_of(strategy, tried)
        # Offload adds two host copies of its state to its base layout's collectives: when the base
        # alone already moves more than the best fitting candidate, the offload variant cannot win.
        if best is not None and base is not None and base.collectives is not None:
            if base.collectives.total_bytes >= best.traffic:
                continue
        cand = _try(name, strategy, module, tx, batch, devices, precision, trainer, callbacks, prefetch, process_local)
        tried.append(cand)
        if cand.error is None and cand.device_bytes <= budget and (best is None or _key(cand) < _key(best)):
            best = cand
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
    others = []
    for c in tried:
        if c is best:
            continue
        if c.error is not None:
            others.append(f"{c.name} n/a")
        elif c.device_bytes > budget:
            others.append(f"{c.name} needs {c.need_text()}")
        else:
            others.append(f"{c.name} fits but moves {fmt_bytes(c.traffic)}")
    skipped = [n for n, _ in pending_offload if not any(c.name == n for c in tried)]
    if skipped:
        others.append(f"{', '.join(skipped)} not compiled (cannot move less)")
    moved = f"{fmt_bytes(best.collectives.total_bytes)} of collectives" if best.collectives else ""
    if best.host_bytes:
        moved += f" + {fmt_bytes(2 * best.host_bytes)} host copies"
    msg = (
        f'strategy="auto": {best.name} ({best.mesh_text}), the least communication that fits: needs '
        f"{best.need_text()} of {budget_text}, moves {moved} per step" + (f"; {'; '.join(others)}" if others else "")
    )
    return AutoChoice(best.strategy, best, tried, limit, budget, msg)


def _base_of(strategy: Strategy, tried: Sequence[Candidate]) -> Candidate | None:
    """The compiled candidate with ``strategy``'s pieces less HostOffload."""
    base = tuple(p for p in strategy.pieces if not isinstance(p, HostOffload))
    for c in tried:
        if tuple(p for p in c.strategy.pieces if not isinstance(p, HostOffload)) == base:
            return c
    return None


def _key(c: Candidate) -> tuple[int, int]:
    return (c.traffic, c.device_bytes)


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
