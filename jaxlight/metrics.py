"""What ``self.log`` records and how it is reduced, without per-step host syncs.

Inside the compiled step ``self.log`` only records a traced scalar and its
weight; its flags (on_step, on_epoch, prog_bar, logger, reduce_fx) are static
and captured once at trace time. Epoch reductions accumulate on the device in
one small compiled update per step, and values reach the host only when the
trainer logs (every ``log_every_n_steps`` and at epoch end).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

REDUCE_FX = ("mean", "sum", "max", "min")


class LogSpec(NamedTuple):
    """Static flags of one logged name (Lightning's ``self.log`` arguments)."""

    on_step: bool
    on_epoch: bool
    prog_bar: bool
    logger: bool
    reduce_fx: str


DATALOADER_SUFFIX = "/dataloader_idx_{}"
"""Lightning's suffix for a value logged while one of several evaluation loaders runs."""


class StepContext(NamedTuple):
    """What the trainer tells a step being traced about its batch (set around the trace).

    ``valid``: real rows per share of a padded evaluation batch (a traced int32
    scalar; None when the batch is never padded, as in training); ``shares``:
    equal blocks of rows the batch is assembled from (one per process with
    ``process_local_batches``, else 1), each padded at its end; ``rows``: the
    batch's (padded) row count; ``dataloader_idx``: the loader being run when
    there are several (None for one).
    """

    valid: Any = None
    shares: int = 1
    rows: int | None = None
    dataloader_idx: int | None = None


_STEP_CONTEXT: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar("jaxlight_step", default=None)


@contextlib.contextmanager
def step_context(ctx: StepContext) -> Iterator[StepContext]:
    """Make ``ctx`` the context of the step traced (or hook run) inside."""
    token = _STEP_CONTEXT.set(ctx)
    try:
        yield ctx
    finally:
        _STEP_CONTEXT.reset(token)


def current_step_context() -> StepContext | None:
    """The context of the step being traced, or None outside a trainer's step."""
    return _STEP_CONTEXT.get()


def row_mask(ctx: StepContext, rows: int) -> Any:
    """``bool[rows]``: True for the real rows of a batch assembled from ``ctx.shares`` padded blocks."""
    if ctx.valid is None:
        return jnp.ones((rows,), jnp.bool_)
    share = rows // max(ctx.shares, 1)
    return (jnp.arange(rows) % share) < ctx.valid


class Collector:
    """Gathers ``self.log`` calls during one trace (or one host-side hook).

    Inside a padded evaluation step (see :class:`StepContext`) the default
    weight of a value is the number of *real* rows, so a padded last batch
    counts as many samples as it holds; with several evaluation loaders names
    get Lightning's ``/dataloader_idx_N`` suffix (unless
    ``add_dataloader_idx=False``).
    """

    def __init__(
        self,
        stage: str,
        default_batch_size: int | None,
        on_step: bool,
        on_epoch: bool,
        dataloader_idx: int | None = None,
    ) -> None:
        ctx = current_step_context()
        self.stage = stage
        self.default_batch_size = default_batch_size
        self.default_on_step = on_step
        self.default_on_epoch = on_epoch
        self.dataloader_idx = dataloader_idx if dataloader_idx is not None or ctx is None else ctx.dataloader_idx
        self._real_rows: Any = None
        if ctx is not None and ctx.valid is not None and default_batch_size is not None:
            real = jnp.asarray(ctx.valid, jnp.float32) * max(ctx.shares, 1)
            self._real_rows = jnp.minimum(real, jnp.float32(default_batch_size))
        self.values: dict[str, tuple[Any, Any]] = {}
        self.specs: dict[str, LogSpec] = {}

    def add(
        self,
        name: str,
        value: Any,
        *,
        prog_bar: bool,
        logger: bool,
        on_step: bool | None,
        on_epoch: bool | None,
        reduce_fx: str,
        batch_size: int | None,
        add_dataloader_idx: bool = True,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"self.log needs a non-empty string name, got {name!r}")
        if reduce_fx not in REDUCE_FX:
            raise ValueError(f"self.log({name!r}) reduce_fx={reduce_fx!r}; supported: {REDUCE_FX}")
        if isinstance(value, Mapping):
            raise ValueError(f"self.log({name!r}) got a dict; use self.log_dict for several values")
        arr = jnp.asarray(value)
        if arr.size != 1:
            raise ValueError(f"self.log({name!r}) needs a scalar, got shape {tuple(arr.shape)}")
        if not (
            jnp.issubdtype(arr.dtype, jnp.floating) or jnp.issubdtype(arr.dtype, jnp.integer) or arr.dtype == jnp.bool_
        ):
            raise ValueError(f"self.log({name!r}) needs a numeric scalar, got dtype {arr.dtype}")
        on_step = self.default_on_step if on_step is None else bool(on_step)
        on_epoch = self.default_on_epoch if on_epoch is None else bool(on_epoch)
        if not (on_step or on_epoch):
            raise ValueError(f"self.log({name!r}) with on_step=False and on_epoch=False logs nothing")
        if batch_size is not None:
            weight = jnp.asarray(batch_size, jnp.float32)
        elif self._real_rows is not None:
            weight = self._real_rows
        else:
            bs = self.default_batch_size
            weight = jnp.asarray(1.0 if bs is None else bs, jnp.float32)
        if add_dataloader_idx and self.dataloader_idx is not None:
            name = name + DATALOADER_SUFFIX.format(self.dataloader_idx)
        spec = LogSpec(on_step, on_epoch, bool(prog_bar), bool(logger), reduce_fx)
        prev = self.specs.get(name)
        if prev is not None and prev != spec:
            raise ValueError(f"self.log({name!r}) was called twice with different flags: {prev} vs {spec}")
        self.specs[name] = spec
        self.values[name] = (arr.reshape(()).astype(jnp.float32), weight)


def _acc_init(reduce_fx: str) -> tuple[Any, Any]:
    if reduce_fx == "max":
        return (jnp.float32(-jnp.inf), jnp.float32(0))
    if reduce_fx == "min":
        return (jnp.float32(jnp.inf), jnp.float32(0))
    return (jnp.float32(0), jnp.float32(0))


def _acc_step(reduce_fx: str, acc: tuple, vw: tuple) -> tuple:
    a, w = acc
    v, bw = vw
    if reduce_fx == "mean":
        return (a + v * bw, w + bw)
    if reduce_fx == "sum":
        return (a + v, w + bw)
    if reduce_fx == "max":
        return (jnp.maximum(a, v), w + bw)
    return (jnp.minimum(a, v), w + bw)


def _acc_value(reduce_fx: str, acc: tuple) -> Any:
    a, w = acc
    if reduce_fx == "mean":
        return a / w
    return a


def _placed(x: Any, target: Any) -> Any:
    s = getattr(x, "sharding", None)
    return x if s is target or s == target else jax.device_put(x, target)  # identity first: a step's outputs


FOLD_CHUNK = 16  # logged steps folded into the epoch accumulators by one jitted call


class MetricStore:
    """Latest step values and device-side epoch accumulators for one stage.

    Epoch values are folded in chunks: each step's values wait (as device
    arrays, unsynced) until ``FOLD_CHUNK`` steps have logged, or until the
    epoch values are read, and one jitted call then folds them all. A
    per-step fold cost a dispatch per step (about 10 us on CPU, as much as
    the rest of the trainer's per-step host work).
    """

    def __init__(self) -> None:
        self.specs: dict[str, LogSpec] = {}
        self.step_values: dict[str, Any] = {}
        self._acc: dict[str, tuple] = {}
        self._pending: list[dict[str, tuple]] = []  # steps not folded yet, all with the keys of _pending_key
        self._pending_key: tuple | None = None
        self._fold_fns: dict[tuple, Any] = {}
        self._masks: dict[int, Any] = {}
        self._sharding: Any = None  # where the epoch accumulators live
        self._plans: dict[tuple[str, ...], tuple[tuple[str, ...], tuple]] = {}  # see update

    def register(self, specs: Mapping[str, LogSpec]) -> None:
        for k, s in specs.items():
            prev = self.specs.get(k)
            if prev is not None and prev != s:
                raise ValueError(f"metric {k!r} is logged with different flags in two places: {prev} vs {s}")
            self.specs[k] = s
        self._plans = {}

    def update(self, values: Mapping[str, tuple[Any, Any]]) -> None:
        """Record one step's logged values (device arrays; nothing syncs)."""
        step_values = self.step_values
        for k, (v, _) in values.items():
            step_values[k] = v
        names = tuple(values)
        plan = self._plans.get(names)  # which of these names accumulate per epoch: the same every step
        if plan is None:
            epoch = tuple(sorted(k for k in values if self.specs[k].on_epoch))
            plan = self._plans[names] = (epoch, tuple((k, self.specs[k].reduce_fx) for k in epoch))
        epoch_keys, key = plan
        if not epoch_keys:
            return
        if self._sharding is None:
            # every accumulator lives where the first logged value did (a compiled step's values: the mesh),
            # so the fold compiles once; values logged elsewhere (a host hook's floats) are moved there
            self._sharding = getattr(values[epoch_keys[0]][0], "sharding", None)
        target = self._sharding
        if target is not None:
            step = {k: tuple(_placed(x, target) for x in values[k]) for k in epoch_keys}
        else:
            step = {k: values[k] for k in epoch_keys}
        if key != self._pending_key:
            self._fold()
            self._pending_key = key
        self._pending.append(step)
        if len(self._pending) == FOLD_CHUNK:
            self._fold()

    def _fold(self) -> None:
        """Fold the pending steps into the accumulators: one jitted call over a chunk padded with masked rows."""
        if not self._pending:
            return
        key, pending, n = self._pending_key, self._pending, len(self._pending)
        self._pending = []
        target = self._sharding
        for k, fx in key:
            if k not in self._acc:
                init = _acc_init(fx)
                self._acc[k] = jax.device_put(init, target) if target is not None else init
        fn = self._fold_fns.get(key)
        if fn is None:
            fx = dict(key)

            def fold_epoch_metrics(acc, rows, mask):
                for i, row in enumerate(rows):
                    acc = {
                        k: tuple(
                            jnp.where(mask[i], new, old) for new, old in zip(_acc_step(fx[k], acc[k], row[k]), acc[k])
                        )
                        for k in acc
                    }
                return acc

            fn = self._fold_fns[key] = jax.jit(fold_epoch_metrics, donate_argnums=0)
        mask = self._masks.get(n)
        if mask is None:
            m = np.arange(FOLD_CHUNK) < n
            mask = self._masks[n] = jax.device_put(m, target) if target is not None else jnp.asarray(m)
        rows = pending + [pending[-1]] * (FOLD_CHUNK - n)  # padding rows are masked out
        self._acc.update(fn({k: self._acc[k] for k, _ in key}, rows, mask))

    def epoch_values(self) -> dict[str, Any]:
        self._fold()
        return {k: _acc_value(self.specs[k].reduce_fx, a) for k, a in self._acc.items()}

    def reset_epoch(self) -> None:
        self._acc = {}
        self._pending, self._pending_key = [], None
        self.step_values = {}

    def state_dict(self) -> dict[str, Any]:
        """The epoch accumulators as host floats (one transfer), so a mid-epoch resume continues them."""
        self._fold()
        acc = jax.device_get(self._acc)
        return {
            "specs": {k: s._asdict() for k, s in self.specs.items()},
            "acc": {k: [float(np.asarray(a)), float(np.asarray(w))] for k, (a, w) in acc.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.register({k: LogSpec(**s) for k, s in state.get("specs", {}).items()})
        self._pending, self._pending_key = [], None
        self._acc = {k: (jnp.float32(a), jnp.float32(w)) for k, (a, w) in state.get("acc", {}).items()}


def to_host(values: Mapping[str, Any]) -> dict[str, float]:
    """One transfer for many scalars."""
    fetched = jax.device_get(dict(values))
    return {k: float(np.asarray(v)) for k, v in fetched.items()}
