"""Check that each strategy trains a module the way one device does.

:func:`verify` builds the user's module once per strategy and runs the same
few batches through the real :class:`~jaxlight.trainer.Trainer` on one device
and under each strategy, then compares, per parameter leaf, the gradients the
compiled step handed the optimizer at step 1, the parameters after the last
step and every step's loss. It prints one table (the differences, each
strategy's bytes per device, the collectives in its compiled step and its
compile time) and the tolerances it applied with where they come from, and
names the leaves that differ most when a strategy is wrong.

The comparison is kept well conditioned: the module's optimizer is replaced
by SGD with momentum (parameters then move by ``lr`` times a sum of
gradients, so their tolerance follows from the gradients'; Adam's
``g / (|g| + eps)`` would turn rounding noise on near-zero gradients into
``lr``-sized moves and make a correct strategy look broken), and gradients
are compared against the scale of their leaf rather than entry by entry.
``jaxlight verify file.py:Module`` (see :mod:`jaxlight.cli`) runs it from the
command line and exits 1 when a strategy differs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import io
import itertools
import math
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxlight.callbacks.callback import Callback
from jaxlight.data import host_batch, leaf_path
from jaxlight.datamodule import LightningDataModule
from jaxlight.errors import MisconfigurationError
from jaxlight.hlo import Collectives, hlo_collectives
from jaxlight.module import LightningModule
from jaxlight.optim import configure
from jaxlight.precision import resolve_precision
from jaxlight.rank_zero import rank_zero_info
from jaxlight.strategies.expert import has_experts
from jaxlight.strategies.placement import mirror_shardings
from jaxlight.strategies.strategy import Piece, Strategy, resolve_strategy
from jaxlight.summary import fmt_bytes, per_device_bytes
from jaxlight.trainer import Trainer

__all__ = [
    "BUILTIN_STRATEGIES",
    "EXPERT_STRATEGIES",
    "SAFETY",
    "LeafDelta",
    "StrategyResult",
    "Tolerances",
    "VerifyReport",
    "keep_first_grad",
    "load_object",
    "verify",
]

BUILTIN_STRATEGIES: tuple[str, ...] = (
    "ddp",
    "fsdp",
    "tp",
    "fsdp+tp",
    "ddp+offload",
    "fsdp+offload",
    "fsdp+tp+offload",
    "sp",
    "pp",
)
"""What :func:`verify` runs by default (a strategy that refuses the model or batch is skipped, with why)."""
EXPERT_STRATEGIES: tuple[str, ...] = ("ep", "fsdp+ep", "ep+tp")
"""Run by default after :data:`BUILTIN_STRATEGIES` when the model has ``jaxlight.nn.MoE`` experts."""

SAFETY = 8.0
"""Factor on the reduction-order rounding bound ``n * eps`` (covers the forward pass's own reductions,
which reach the gradients through a few layers). Measured: correct strategies stay below 1/10 of the
resulting tolerance, a missing all-reduce exceeds it by orders of magnitude (docs/verify.md)."""

_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_CACHE_SAVED_EVENT = "/jax/compilation_cache/compile_time_saved_sec"


# ---------------------------------------------------------------------------- the first gradient
class FirstGrad(NamedTuple):
    """State of :func:`keep_first_grad`: the update count and the first update's gradients."""

    count: jax.Array
    grad: Any


def keep_first_grad() -> optax.GradientTransformation:
    """Pass updates through and keep a copy of the first ones in the optimizer state.

    The copy's leaves are keyed by parameter path with the parameters' shapes,
    so the trainer places them like the parameters; it is exactly the gradient
    the compiled step fed the optimizer (after its all-reduce or reduce-scatter).
    """

    def init(params: Any) -> FirstGrad:
        return FirstGrad(jnp.zeros([], jnp.int32), jax.tree.map(jnp.zeros_like, params))

    def update(updates: Any, state: FirstGrad, params: Any = None) -> tuple[Any, FirstGrad]:
        first = state.count == 0
        grad = jax.tree.map(lambda new, old: jnp.where(first, new, old), updates, state.grad)
        return updates, FirstGrad(state.count + 1, grad)

    return optax.GradientTransformation(init, update)


# ---------------------------------------------------------------------------- results
@dataclasses.dataclass(frozen=True)
class LeafDelta:
    """The largest absolute difference of one leaf and the tolerance it was held to."""

    kind: str  # "grad" (step 1), "param" (after the last step) or "loss" (path: "step N")
    path: str
    delta: float
    tol: float

    @property
    def ratio(self) -> float:
        if self.tol > 0:
            return self.delta / self.tol
        return 0.0 if self.delta == 0 else math.inf

    def __str__(self) -> str:
        return f"{self.path} |d{self.kind}| {self.delta:.2e} > tol {self.tol:.2e} (x{self.ratio:.3g})"


@dataclasses.dataclass
class StrategyResult:
    """One row of the report."""

    name: str
    status: str  # "ref", "ok", "FAIL", "error" or "skipped"
    mesh: str = ""
    reason: str = ""
    loss_delta: float = math.nan
    grad_delta: float = math.nan
    param_delta: float = math.nan
    worst_ratio: float = math.nan
    param_bytes: int | None = None
    opt_bytes: tuple[int, int] | None = None  # (device, host) per device, of the module's own optimizer
    collectives: Collectives | None = None
    compile_s: float | None = None
    leaves: list[LeafDelta] = dataclasses.field(default_factory=list)  # beyond tolerance, worst first

    @property
    def ok(self) -> bool:
        return self.status in ("ok", "ref", "skipped")


@dataclasses.dataclass
class Tolerances:
    """How far a strategy may differ from one device, and why (``lines``)."""

    rtol: float
    eps: float
    n: int
    n_why: str
    lr: float
    momentum: float
    steps: int
    momentum_sum: float
    lines: list[str]


@dataclasses.dataclass
class VerifyReport:
    """What :func:`verify` found: one :class:`StrategyResult` per strategy (the first is the reference)."""

    module: str
    devices: int
    steps: int
    results: list[StrategyResult]
    tolerances: Tolerances
    batch: str

    @property
    def ok(self) -> bool:
        """Every strategy that ran matched one device within tolerance (skipped ones do not count)."""
        return all(r.ok for r in self.results)

    @property
    def failed(self) -> list[StrategyResult]:
        return [r for r in self.results if not r.ok]

    def table(self) -> str:
        hdr = (
            "strategy",
            "mesh",
            "result",
            "max|dloss|",
            "max|dgrad@1|",
            "max|dparam|",
            "worst/tol",
            "params/dev",
            "optimizer/dev",
            "collectives (HLO)",
            "compile s",
        )
        rows = [hdr]
        for r in self.results:
            if r.status in ("skipped", "error") and r.param_bytes is None:
                rows.append((r.name, r.mesh, r.status, *("-",) * 8))
                continue
            opt = "-"
            if r.opt_bytes is not None:
                dev, host = r.opt_bytes
                opt = fmt_bytes(dev) + (f" +{fmt_bytes(host)} host" if host else "")
            rows.append(
                (
                    r.name,
                    r.mesh,
                    r.status,
                    _num(r.loss_delta),
                    _num(r.grad_delta),
                    _num(r.param_delta),
                    "-" if math.isnan(r.worst_ratio) else f"{r.worst_ratio:.3g}",
                    "-" if r.param_bytes is None else fmt_bytes(r.param_bytes),
                    opt,
                    "-" if r.collectives is None else r.collectives.summary(short=True),
                    "-" if r.compile_s is None else f"{r.compile_s:.1f}",
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(hdr))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def render(self) -> str:
        """The full report: a header line, the table, the tolerances, the failures and a verdict."""
        t = self.tolerances
        out = [
            f"jaxlight verify: {self.module}, {self.steps} steps of SGD(lr={t.lr:g}, momentum={t.momentum:g}) "
            f"on 1 device vs {self.devices} devices, batches {self.batch}",
            self.table(),
            "collectives: AR all-reduce, AG all-gather, RS reduce-scatter, A2A all-to-all, CP collective-permute "
            "(ops in the compiled train step, with their bytes); worst/tol: the largest difference over its "
            "tolerance, of any leaf, step or check",
            *t.lines,
        ]
        for r in self.results:
            if r.status == "FAIL" and not r.leaves:
                out.append(f"{r.name}: FAILED: {r.reason}")
            elif r.status == "FAIL":
                names = list(dict.fromkeys(d.path for d in r.leaves if d.kind != "loss"))
                more = f" and {len(names) - 6} more" if len(names) > 6 else ""
                shown = ", ".join(names[:6]) + more if names else "only the losses"
                out.append(
                    f"{r.name}: FAILED, {len(r.leaves)} checks beyond tolerance; leaves that differ most: {shown}"
                )
                out += [f"  {d}" for d in r.leaves[:8]]
                if len(r.leaves) > 8:
                    out.append(f"  ... {len(r.leaves) - 8} more checks beyond tolerance")
            elif r.status in ("error", "skipped"):
                out.append(f"{r.name}: {r.status}: {r.reason}")
        ran = [r for r in self.results if r.status in ("ok", "FAIL")]
        bad = [r.name for r in self.failed]
        skipped = [r.name for r in self.results if r.status == "skipped"]
        verdict = f"{sum(r.status == 'ok' for r in ran)} of {len(ran)} strategies match one device"
        if bad:
            verdict += f"; FAILED: {', '.join(bad)}"
        if skipped:
            verdict += f"; skipped (not applicable to this model or batch): {', '.join(skipped)}"
        out.append(verdict)
        return "\n".join(out)

    def __str__(self) -> str:
        return self.render()


def _num(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2e}"


# ---------------------------------------------------------------------------- runs
class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[Any] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(outputs["loss"])


@contextlib.contextmanager
def _compile_timer() -> Any:
    """Seconds tracing, lowering and compiling the train step take while the context is open (a persistent
    compilation-cache hit counts the compile time it saved, so the number is the cold cost)."""
    total = [0.0]
    saved = [0.0]  # a persistent-cache hit reports the compile time it saved just before its compile event

    def listen(event: str, duration_secs: float, **kwargs: Any) -> None:
        if event == _CACHE_SAVED_EVENT:
            saved[0] = max(0.0, duration_secs)
            return
        if event in _COMPILE_EVENTS and kwargs.get("fun_name") in ("train_step", "jit(train_step)"):
            total[0] += duration_secs
            if event == _COMPILE_EVENTS[-1]:
                total[0] += saved[0]
        if event == _COMPILE_EVENTS[-1]:
            saved[0] = 0.0

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield total
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


class _Run(NamedTuple):
    losses: list[float]
    grads: dict[str, np.ndarray]  # host copies, in the parameters' dtypes
    params: dict[str, np.ndarray]
    dtypes: dict[str, np.dtype]  # the parameters' own dtypes
    result: StrategyResult
    experts: bool = False  # the model has MoE experts (logical axis "exp")


def _run(
    name: str,
    strategy: str | Piece | Strategy,
    make_module: Callable[[], LightningModule],
    batches: list[Any],
    devices: int,
    steps: int,
    tx: optax.GradientTransformation,
    trainer_kwargs: Mapping[str, Any],
    quiet: bool,
) -> _Run:
    module = make_module()
    if not isinstance(module, LightningModule):
        raise TypeError(f"make_module must return a jaxlight.LightningModule, got {type(module).__name__}")
    own_optimizer = type(module).configure_optimizers
    module.configure_optimizers = lambda: tx  # the comparison's optimizer, in place of the module's
    rec = _Losses()
    kwargs = dict(
        strategy=strategy,
        devices=devices,
        max_steps=steps,
        max_epochs=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    kwargs.update(trainer_kwargs)
    kwargs["callbacks"] = [rec, *list(trainer_kwargs.get("callbacks", []) or [])]
    trainer = Trainer(**kwargs)
    out = io.StringIO()
    with _compile_timer() as secs, contextlib.redirect_stdout(out) if quiet else contextlib.nullcontext():
        trainer.fit(module, train_dataloaders=batches)
    state = trainer.train_state
    assert state is not None
    if len(rec.losses) != steps:
        raise RuntimeError(f"{name}: expected {steps} training steps, the trainer ran {len(rec.losses)}")
    first = [x for x in jax.tree.leaves(state.opt_state, is_leaf=_is_first_grad) if isinstance(x, FirstGrad)]
    grads = {k: np.asarray(jax.device_get(v)) for k, v in first[0].grad.items()}
    dtypes = {k: np.dtype(v.dtype) for k, v in state.params.items()}
    params = {k: np.asarray(jax.device_get(v)) for k, v in state.params.items()}
    mesh = ",".join(f"{a}={s}" for a, s in trainer.mesh.shape.items() if s > 1) or "1 device"
    result = StrategyResult(name, "ok", mesh=mesh)
    result.param_bytes = per_device_bytes(state.params)
    result.opt_bytes = _optimizer_bytes(module, own_optimizer, trainer.strategy, trainer.mesh, state.params)
    compiled = trainer.compiled.get("train")
    result.collectives = hlo_collectives(compiled.as_text()) if compiled is not None else None
    result.compile_s = secs[0]
    losses = [float(x) for x in rec.losses]
    return _Run(losses, grads, params, dtypes, result, has_experts(module))


def _is_first_grad(x: Any) -> bool:
    return isinstance(x, FirstGrad)


def _optimizer_bytes(
    module: LightningModule,
    own: Callable[..., Any],
    strategy: Strategy,
    mesh: jax.sharding.Mesh,
    params: Mapping[str, jax.Array],
) -> tuple[int, int] | None:
    """(device, host) bytes per device of the module's *own* optimizer state under ``strategy``'s layout,
    placed by the engine's rule (:func:`jaxlight.strategies.placement.mirror_shardings`): leaves keyed by a
    parameter path with its shape take its sharding, others are replicated, in the strategy's memory kind."""
    try:
        config = configure(own(module))
        if getattr(config, "tx", None) is None and callable(getattr(config, "build", None)):
            config = config.build(module, dict(params))
        tx = config.tx
        shapes = jax.eval_shape(tx.init, {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in params.items()})
    except Exception:  # an optimizer that needs more than the trainer gives at setup: leave the column empty
        return None
    shardings = mirror_shardings(
        shapes, params, {k: v.sharding for k, v in params.items()}, mesh, strategy, "opt_state"
    )
    dev = host = 0
    for leaf, sharding in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings)):
        n = math.prod(sharding.shard_shape(tuple(leaf.shape))) * np.dtype(leaf.dtype).itemsize
        if sharding.memory_kind in ("pinned_host", "unpinned_host"):
            host += n
        else:
            dev += n
    return int(dev), int(host)


# ---------------------------------------------------------------------------- tolerances
def _reduction_size(batches: Sequence[Any], params: Mapping[str, np.ndarray]) -> tuple[int, str]:
    """The largest number of terms one value of the step sums, and what it is.

    A weight's gradient sums one term per batch row and position (every
    element of an integer leaf such as token ids; a float leaf's elements
    less its feature dim), and a forward contraction sums over a parameter
    dimension.
    """
    best, why = 1, "1"
    for path, x in jax.tree_util.tree_flatten_with_path(batches[0])[0]:
        x = np.asarray(x)
        if x.ndim == 0:
            continue
        if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim >= 2:
            n = x.size // x.shape[-1]
            what = f"{' x '.join(map(str, x.shape[:-1]))} rows/positions of batch leaf {_path(path)}"
        else:
            n = x.size
            what = f"{' x '.join(map(str, x.shape))} elements of batch leaf {_path(path)}"
        if n > best:
            best, why = n, what
    for k, p in params.items():
        for d in p.shape:
            if d > best:
                best, why = int(d), f"a contraction over dim {d} of {k}"
    return int(best), why


def _path(path: tuple) -> str:
    return repr(leaf_path(path))


def _tolerances(
    batches: Sequence[Any],
    ref: _Run,
    compute_dtype: Any,
    lr: float,
    momentum: float,
    steps: int,
    rtol: float | None,
) -> Tolerances:
    # Sums accumulate in float32 (float64 when every parameter is float64); a coarser compute or storage
    # dtype (bf16) rounds each value once more, whatever the order of the sums.
    stored = {np.dtype(d) for d in ref.dtypes.values() if jnp.issubdtype(d, jnp.floating)}
    acc = np.float64 if stored == {np.dtype(np.float64)} else np.float32
    eps = float(jnp.finfo(acc).eps)
    coarse = [np.dtype(compute_dtype)] if compute_dtype is not None else []
    coarse += [d for d in stored if float(jnp.finfo(d).eps) > eps]
    eps_low = max((float(jnp.finfo(d).eps) for d in coarse), default=0.0)
    n, why = _reduction_size(batches, ref.params)
    msum = sum(sum(momentum ** (t - j) for j in range(1, t + 1)) for t in range(1, steps + 1))
    low = ""
    if eps_low > eps:
        low = f" + eps_low {eps_low:.2e} ({', '.join(sorted({d.name for d in coarse}))} rounding)"
    if rtol is None:
        rtol = SAFETY * (eps * n + (eps_low if eps_low > eps else 0.0))
        rule = f"rtol = {SAFETY:g} x (eps x n{' + eps_low' if low else ''}) = {rtol:.2e}"
    else:
        rule = f"rtol = {rtol:.2e} (given)"
    lines = [
        f"tolerances: eps = {eps:.2e} ({np.dtype(acc).name} accumulation){low}; n = {n}, the largest reduction "
        f"in the step ({why}); {rule}",
        "  gradient at step 1, per leaf: |dg| <= rtol x s, s = max(the leaf's largest |g|, RMS of all gradients): "
        "a sum of n terms taken in another order (per-device partial sums, then an all-reduce) differs by up to "
        f"n x eps of its terms' size; the factor {SAFETY:g} covers the forward pass's reductions upstream, and the "
        "RMS floor a leaf whose exact gradient is 0 (only rounding noise of its terms)",
        f"  parameters after {steps} SGD steps, per leaf: |dtheta| <= lr x S x tol_g + 2 x {steps} x eps x "
        f"max|theta|, S = sum_t sum_(j<=t) momentum^(t-j) = {msum:.3g} (each step moves theta by lr times the "
        "momentum sum of the gradients so far; each step's rounding of theta may differ by one ulp <= eps x |theta|, "
        "x2 for the rounding of the update itself)",
        "  loss at each step: |dL| <= rtol x |L| + sum over leaves of ||g||_1 x tol_theta (its own reduction, plus "
        "the first-order effect of the parameters' differences)",
        "  the module's own optimizer is not used: Adam's g / (|g| + eps) would turn rounding noise on near-zero "
        "gradients into lr-sized parameter moves",
    ]
    return Tolerances(rtol, eps, n, why, lr, momentum, steps, msum, lines)


def _compare(ref: _Run, run: _Run, tol: Tolerances) -> StrategyResult:
    res = run.result
    if ref.grads.keys() != run.grads.keys():
        missing = sorted(ref.grads.keys() ^ run.grads.keys())
        res.status, res.reason = "FAIL", f"parameter paths differ from one device's: {missing[:5]}"
        return res
    size = sum(g.size for g in ref.grads.values())
    rms = math.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64))) for g in ref.grads.values()) / max(size, 1))
    eps = tol.eps
    checks: list[LeafDelta] = []
    tol_theta: dict[str, float] = {}
    for k, g in ref.grads.items():
        scale = max(_absmax(g), rms)
        tg = tol.rtol * scale
        checks.append(LeafDelta("grad", k, _absmax_diff(run.grads[k], g), tg))
        theta = ref.params[k]
        tt = tol.lr * tol.momentum_sum * tg + 2 * tol.steps * eps * _absmax(theta)
        tol_theta[k] = tt
        checks.append(LeafDelta("param", k, _absmax_diff(run.params[k], theta), tt))
    drift = sum(float(np.sum(np.abs(g), dtype=np.float64)) * tol_theta[k] for k, g in ref.grads.items())
    for i, (a, b) in enumerate(zip(ref.losses, run.losses)):
        checks.append(LeafDelta("loss", f"step {i + 1}", abs(a - b), tol.rtol * abs(a) + drift))
    res.grad_delta = max((c.delta for c in checks if c.kind == "grad"), default=0.0)
    res.param_delta = max((c.delta for c in checks if c.kind == "param"), default=0.0)
    res.loss_delta = max((c.delta for c in checks if c.kind == "loss"), default=0.0)
    bad = [c for c in checks if not c.delta <= c.tol]  # NaN counts as beyond
    res.worst_ratio = max((c.ratio if not math.isnan(c.delta) else math.inf for c in checks), default=0.0)
    res.leaves = sorted(bad, key=lambda c: -c.ratio if not math.isnan(c.delta) else -math.inf)
    res.status = "FAIL" if bad else "ok"
    return res


def _absmax(x: np.ndarray) -> float:
    return float(np.max(np.abs(x.astype(np.float64)))) if x.size else 0.0


def _absmax_diff(a: np.ndarray, b: np.ndarray) -> float:
    """The largest |a - b|, computed in float64 (NaN when either holds a NaN)."""
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if a.size else 0.0


# ---------------------------------------------------------------------------- inputs
def _strategy_list(strategies: Sequence[str | Piece | Strategy] | str | None) -> list[tuple[str, Any, bool]]:
    """(label, strategy, explicitly asked for) in order; optional built-ins load their piece or drop out."""
    explicit = strategies is not None
    if strategies is None:
        strategies = BUILTIN_STRATEGIES
    elif isinstance(strategies, str):
        strategies = [s for s in (p.strip() for p in strategies.split(",")) if s]
    out: list[tuple[str, Any, bool]] = []
    for s in strategies:
        if isinstance(s, str):
            resolve_strategy(s)  # an unknown name raises here, listing the valid ones
            out.append((s, s, explicit))
        elif isinstance(s, (Piece, Strategy)):
            st = resolve_strategy(s)
            out.append((" + ".join(p.describe() for p in st.pieces), st, explicit))
        else:
            raise TypeError(f"strategies holds {type(s).__name__}; give names ('fsdp+tp'), pieces or Strategy objects")
    return out


def _first_batches(
    make_module: Callable[[], LightningModule],
    dataloader: Any,
    datamodule: LightningDataModule | None,
    steps: int,
) -> list[Any]:
    if dataloader is not None and datamodule is not None:
        raise MisconfigurationError("pass either a dataloader or a datamodule to verify, not both")
    if isinstance(dataloader, LightningDataModule):
        datamodule, dataloader = dataloader, None
    if datamodule is not None:
        datamodule.prepare_data()
        datamodule.setup("fit")
        dataloader = datamodule.train_dataloader()
    if dataloader is None:
        module = make_module()
        fn = getattr(module, "train_dataloader", None)
        dataloader = fn() if callable(fn) else None
        if dataloader is None:
            raise MisconfigurationError(
                "verify needs batches: pass a dataloader, a datamodule, or define the module's train_dataloader()"
            )
    batches = [host_batch(b) for b in itertools.islice(iter(dataloader), steps)]
    if len(batches) < steps:
        raise MisconfigurationError(f"verify runs {steps} steps but the loader yielded only {len(batches)} batches")
    return batches


def _describe_batch(batch: Any) -> str:
    parts = []
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        x = np.asarray(x)
        parts.append(f"{_path(path).strip(chr(39))} {x.dtype.name}{list(x.shape)}")
    return ", ".join(parts)


# ---------------------------------------------------------------------------- the entry point
def verify(
    make_module: Callable[[], LightningModule],
    dataloader: Iterable[Any] | LightningDataModule | None = None,
    strategies: Sequence[str | Piece | Strategy] | str | None = None,
    devices: int | None = None,
    steps: int = 3,
    *,
    datamodule: LightningDataModule | None = None,
    lr: float = 1e-2,
    momentum: float = 0.9,
    rtol: float | None = None,
    trainer_kwargs: Mapping[str, Any] | None = None,
    print_report: bool = True,
) -> VerifyReport:
    """Train ``make_module()`` for ``steps`` steps on one device and under each strategy, and compare.

    Args:
        make_module: builds a fresh module (a class works); called once per run, so every run starts
            from the same ``configure_model`` parameters.
        dataloader: where the batches come from (the first ``steps`` are read once and fed to every run);
            or ``datamodule=``, or the module's own ``train_dataloader()``.
        strategies: names (``"ddp"``, ``"fsdp+tp"``, a comma-separated string), pieces or
            :class:`~jaxlight.strategies.Strategy` objects. Default: :data:`BUILTIN_STRATEGIES`, where
            a strategy the model or batch does not admit (``pp`` without a LayerStack) is skipped with its
            reason; one given explicitly that cannot run is an error.
        devices: devices per strategy (default: every local device; at least 2).
        lr, momentum: the SGD that replaces the module's optimizer for the comparison.
        rtol: override the derived relative tolerance (see ``report.tolerances.lines``).
        trainer_kwargs: more ``Trainer`` arguments for every run (``precision="bf16-mixed"``).
        print_report: print :meth:`VerifyReport.render` (on process 0).

    Returns the :class:`VerifyReport`; ``report.ok`` is False when a strategy differs from one device
    beyond tolerance (its ``leaves`` name the leaves that differ most) or could not run.
    """
    if jax.process_count() > 1:
        raise MisconfigurationError(
            "verify runs in one process (it compares against one device); run it without a launcher"
        )
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise MisconfigurationError(f"steps must be an int >= 1, got {steps!r}")
    local = len(jax.local_devices())
    n = local if devices is None else devices
    if not isinstance(n, int) or isinstance(n, bool) or n < 2 or n > local:
        raise MisconfigurationError(
            f"verify compares N devices with one and needs 2 <= devices <= {local} (the local devices), got "
            f"{devices!r}; on CPU, start with XLA_FLAGS=--xla_force_host_platform_device_count=8 (the "
            f"`jaxlight verify --devices 8` command sets it)"
        )
    kwargs = dict(trainer_kwargs or {})
    for k in ("strategy", "devices", "max_steps"):
        if k in kwargs:
            raise MisconfigurationError(f"trainer_kwargs may not set {k!r}: verify sets it for every run")
    compute_dtype = resolve_precision(kwargs.get("precision", "32-true")).compute_dtype
    plan = _strategy_list(strategies)
    batches = _first_batches(make_module, dataloader, datamodule, steps)
    tx = optax.chain(keep_first_grad(), optax.sgd(lr, momentum=momentum or None))
    label = getattr(make_module, "__name__", None) or type(make_module).__name__

    ref = _run("1 device", "ddp", make_module, batches, 1, steps, tx, kwargs, quiet=True)
    ref.result.status = "ref"
    if not any(np.abs(g).max() > 0 for g in ref.grads.values() if g.size):
        raise MisconfigurationError(f"{label}: every gradient is zero at step 1 on one device; nothing to compare")
    tol = _tolerances(batches, ref, compute_dtype, lr, momentum, steps, rtol)
    results = [ref.result]
    if strategies is None and ref.experts:
        plan += [(s, s, False) for s in EXPERT_STRATEGIES]
    for name, strategy, explicit in plan:
        if strategy is None:
            results.append(StrategyResult(name, "skipped", reason=f"strategy {name!r} is not installed in this tree"))
            continue
        try:
            run = _run(name, strategy, make_module, batches, n, steps, tx, kwargs, quiet=True)
        except ValueError as e:  # a layout, batch or model the strategy refuses, said before any step
            status = "error" if explicit else "skipped"
            results.append(StrategyResult(name, status, reason=f"{type(e).__name__}: {_first_line(e)}"))
            continue
        except Exception as e:
            results.append(StrategyResult(name, "error", reason=f"{type(e).__name__}: {_first_line(e)}"))
            continue
        results.append(_compare(ref, run, tol))
    report = VerifyReport(label, n, steps, results, tol, _describe_batch(batches[0]))
    if print_report:
        rank_zero_info(report.render())
    return report


def _first_line(e: BaseException, limit: int = 400) -> str:
    text = str(e).strip().splitlines()
    line = text[0] if text else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


# ---------------------------------------------------------------------------- loading user code
def load_object(spec: str) -> Any:
    """``"path/to/file.py:Name"`` or ``"package.module:Name"`` -> the object.

    A file is executed as a module (its directory goes first on ``sys.path``,
    as when running it as a script, so it can import its neighbours). Raises
    ValueError with what was wrong: no ``:Name``, a missing file, a missing name.
    """
    if ":" not in spec:
        raise ValueError(f"{spec!r}: give path/to/file.py:ClassName (or package.module:ClassName)")
    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise ValueError(f"{spec!r}: give path/to/file.py:ClassName (or package.module:ClassName)")
    if where.endswith(".py") or os.sep in where or "/" in where:
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"{spec!r}: file {path} does not exist")
        mod_name = f"_jaxlight_user_{path.stem}_{abs(hash(str(path))) % 10**8}"
        mod = sys.modules.get(mod_name)
        if mod is None:
            sys.path.insert(0, str(path.parent))
            loader_spec = importlib.util.spec_from_file_location(mod_name, path)
            if loader_spec is None or loader_spec.loader is None:
                raise ValueError(f"{spec!r}: cannot import {path}")
            mod = importlib.util.module_from_spec(loader_spec)
            sys.modules[mod_name] = mod
            try:
                loader_spec.loader.exec_module(mod)
            except BaseException:
                del sys.modules[mod_name]
                raise
    else:
        mod = importlib.import_module(where)
    if not hasattr(mod, name):
        found = sorted(k for k, v in vars(mod).items() if isinstance(v, type) and not k.startswith("_"))
        raise ValueError(f"{spec!r}: {where} defines no {name!r} (classes there: {found})")
    return getattr(mod, name)
