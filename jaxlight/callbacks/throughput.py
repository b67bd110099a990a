"""ThroughputMonitor: samples/s, tokens/s, step time, FLOPs and MFU of the train step."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxlight.callbacks.callback import Callback
from jaxlight.flops import MatmulDtypes, matmul_dtypes
from jaxlight.rank_zero import rank_zero_warn
from jaxlight.step_info import StepInfo

# Dense peak FLOP/s per device by device_kind substring: (bf16/fp16, fp32 matmul as XLA runs it by default).
# Numbers are the vendors' published dense peaks (no sparsity).
_PEAK_FLOPS: list[tuple[str, float, float]] = [
    ("H200", 989.4e12, 494.7e12),
    ("H100 PCIe", 756.0e12, 378.0e12),
    ("H100", 989.4e12, 494.7e12),
    ("GH200", 989.4e12, 494.7e12),
    ("B200", 2250e12, 1100e12),
    ("A100", 312e12, 156e12),
    ("A10G", 70e12, 35e12),
    ("L40S", 362e12, 183e12),
    ("L4", 121e12, 60e12),
    ("V100", 125e12, 15.7e12),
    ("TPU v4", 275e12, 275e12),
    ("TPU v5 lite", 197e12, 197e12),
    ("TPU v5e", 197e12, 197e12),
    ("TPU v5p", 459e12, 459e12),
    ("TPU v5", 459e12, 459e12),
    ("TPU v6 lite", 918e12, 918e12),
    ("TPU v6e", 918e12, 918e12),
]


def peak_flops(device: Any, precision: str = "bf16-mixed") -> float | None:
    """Published dense peak FLOP/s of one ``device`` for the trainer's precision, or None when unknown."""
    kind = getattr(device, "device_kind", "")
    half = "bf16" in precision or "16" in precision
    for key, bf16, fp32 in _PEAK_FLOPS:
        if key.lower() in kind.lower():
            return bf16 if half else fp32
    return None


def _default_batch_size(batch: Any) -> int:
    leaves = jax.tree.leaves(batch)
    if not leaves or not getattr(leaves[0], "ndim", 0):
        raise ValueError(
            "ThroughputMonitor could not find the batch size (first array has no leading "
            "dimension); pass batch_size_fn=lambda batch: ..."
        )
    return int(leaves[0].shape[0])


def _default_length(batch: Any) -> int | None:
    # A 2-D integer array (token ids, [batch, seq]) says how many tokens the batch holds.
    for leaf in jax.tree.leaves(batch):
        if getattr(leaf, "ndim", 0) == 2 and np.issubdtype(leaf.dtype, np.integer):
            return int(leaf.shape[0] * leaf.shape[1])
    return None


class ThroughputMonitor(Callback):
    """Logs training throughput every ``log_every_n_steps``, averaged over the last ``window`` train steps.

    Logged (with Lightning's ``train/`` prefix): ``step_time`` (seconds per
    train-step call), ``batches_per_sec``, ``samples_per_sec`` and
    ``device/samples_per_sec``, ``items_per_sec`` (tokens, when ``length_fn``
    is given or the batch holds a 2-D integer array), ``flops_per_step``
    (per device: the matrix products of the traced train step, forward,
    backward and recomputation, a scanned layer stack once per layer, over the
    devices: :func:`jaxlight.flops.matmul_flops`; XLA's ``cost_analysis()``
    counts a loop's body once, so it reads a ``LayerStack`` model's FLOPs
    ``layers`` times too low), ``device/flops_per_sec``,
    ``flops_per_sec`` (all devices) and ``device/mfu`` when the device's peak
    is known (``peak_flops``, or a table of common GPUs/TPUs by
    ``device_kind``). Timing uses host timestamps after the trainer's bounded
    run-ahead wait, so there is no extra device sync: over a window of ``n``
    steps the error is at most the in-flight steps (``jaxlight.config.RUN_AHEAD``). Time spent in
    validation inside ``fit`` is left out. ``batch_size_fn`` and
    ``length_fn`` get the batch (global arrays) and should read shapes;
    returning a device scalar is allowed and is only fetched at logging time.
    Memory per device is logged beside the rates: ``device/state_bytes`` and
    ``host/state_bytes`` (the train state's bytes in device memory and in host
    memory under host offload, counted from the arrays' shards, since XLA:CPU's
    ``memory_analysis()`` reports no host bytes) and ``device/temp_bytes``
    (the compiled step's temporaries from ``memory_analysis()``). The matrix products' FLOPs per step and
    device by operand dtypes are logged as ``matmul_flops/<lhs>_<rhs>`` (``matmul_flops/bf16_bf16``,
    ``matmul_flops/fp32_bf16``...), with ``matmul_half_fraction``, the share whose two operands are 16-bit
    floats (what a ``"bf16-mixed"`` step should have near 1; see
    :class:`~jaxlight.errors.Float32MatmulWarning`); the breakdown is also in ``self.flops_by_dtype``. Latest
    values are in ``self.metrics``.
    """

    def __init__(
        self,
        batch_size_fn: Callable[[Any], int] | None = None,
        length_fn: Callable[[Any], Any] | None = None,
        peak_flops: float | None = None,
        window: int = 100,
        separator: str = "/",
    ) -> None:
        if window < 1:
            raise ValueError(f"ThroughputMonitor window must be >= 1, got {window}")
        if peak_flops is not None and peak_flops <= 0:
            raise ValueError(f"peak_flops must be > 0 (FLOP/s per device), got {peak_flops}")
        self.batch_size_fn = batch_size_fn or _default_batch_size
        self.length_fn = length_fn or _default_length
        self.peak_flops = peak_flops
        self.window = window
        self.separator = separator
        self.flops_per_step: float | None = None
        self.flops_by_dtype: dict[str, float] = {}
        self.memory: dict[str, float] = {}
        self._peak: float | None = peak_flops
        self._paused = 0.0
        self._val_start: float | None = None
        self.metrics: dict[str, float] = {}
        self._times: collections.deque = collections.deque(maxlen=window + 1)
        self._samples: collections.deque = collections.deque(maxlen=window + 1)
        self._items: collections.deque = collections.deque(maxlen=window + 1)

    # -- the logic on a StepInfo (no Trainer)
    def start(self, info: StepInfo) -> None:
        """A new training run: empty window, FLOPs counted again, the peak read from ``info.device`` and
        ``info.precision`` unless given."""
        self._times.clear()
        self._samples.clear()
        self._items.clear()
        self.flops_per_step = None
        self.flops_by_dtype = {}
        self._peak = self.peak_flops or peak_flops(info.device, info.precision)
        self._paused = 0.0

    # validation inside fit is not training time: it is taken out of the timestamps
    def pause(self, info: StepInfo) -> None:
        """Validation starts at ``info.time``: time until :meth:`resume` is not counted."""
        self._val_start = info.time

    def resume(self, info: StepInfo) -> None:
        """Validation ended at ``info.time``."""
        if self._val_start is not None:
            self._paused += info.time - self._val_start
            self._val_start = None

    def on_step(self, info: StepInfo) -> dict[str, float] | None:
        """Time and count the train batch of ``info`` (``info.time``, ``info.batch``); every
        ``info.log_every_n_steps`` optimizer steps, the window's rates to log (also kept in ``self.metrics``),
        else None. FLOPs and memory are read once, from ``info.compiled["train"]`` and ``info.state``."""
        # After the trainer's run-ahead wait: the host is at most RUN_AHEAD steps ahead of the device here.
        self._times.append(info.time - self._paused)
        self._samples.append(self.batch_size_fn(info.batch))
        self._items.append(self.length_fn(info.batch))
        if self.flops_per_step is None and "train" in info.compiled:
            count = _count(info.compiled["train"])
            self.flops_per_step = _flops(info.compiled["train"], info.num_devices, count)
            self.flops_by_dtype = _flops_by_dtype(info.compiled["train"], info.num_devices, self.separator, count)
            self.memory = _memory(info.compiled["train"], info.state, self.separator)
        if not (info.stepped and info.global_step % info.log_every_n_steps == 0):
            return None
        metrics = self.compute(info.num_devices)
        if not metrics:
            return None
        self.metrics = metrics
        return metrics

    # -- Lightning hooks: build the StepInfo, apply what the logic returns
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.start(StepInfo.of_trainer(trainer))

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self.pause(StepInfo.of_trainer(trainer))

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self.resume(StepInfo.of_trainer(trainer))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        metrics = self.on_step(StepInfo.of_trainer(trainer, batch=batch, outputs=outputs, batch_idx=batch_idx))
        if metrics:
            trainer.reporter.log_metrics(metrics)  # at the step that produced them (global_step - 1), process 0

    def compute(self, num_devices: int) -> dict[str, float]:
        """Rates over the current window (empty until two steps have been timed)."""
        n = len(self._times) - 1
        if n < 1:
            return {}
        dt = self._times[-1] - self._times[0]
        if dt <= 0:
            return {}
        sep = self.separator
        samples = float(sum(float(np.asarray(s)) for s in list(self._samples)[1:]))
        out = {
            "step_time": dt / n,
            "batches_per_sec": n / dt,
            "samples_per_sec": samples / dt,
            f"device{sep}samples_per_sec": samples / dt / num_devices,
        }
        items = list(self._items)[1:]
        if items and all(i is not None for i in items):
            tokens = float(sum(float(np.asarray(i)) for i in items))
            out["items_per_sec"] = tokens / dt
            out[f"device{sep}items_per_sec"] = tokens / dt / num_devices
        if self.flops_per_step is not None:
            dev = self.flops_per_step * n / dt
            out["flops_per_step"] = self.flops_per_step
            out[f"device{sep}flops_per_sec"] = dev
            out["flops_per_sec"] = dev * num_devices
            if self._peak:
                out[f"device{sep}mfu"] = dev / self._peak
        out.update(self.flops_by_dtype)
        out.update(self.memory)
        return {f"train{sep}{k}": v for k, v in out.items()}


def _memory(compiled: Any, state: Any, sep: str) -> dict[str, float]:
    from jaxlight.summary import per_device_bytes

    out = {
        f"device{sep}state_bytes": float(per_device_bytes(state, "device")),
        f"host{sep}state_bytes": float(per_device_bytes(state, "host")),
    }
    try:
        out[f"device{sep}temp_bytes"] = float(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:
        pass  # not every backend reports it
    return out


_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def _count(compiled: Any) -> MatmulDtypes | None:
    """The traced step's matrix products by operand dtype (one walk of its jaxpr: the total and the split both
    come from it); None when the step carries no traced program."""
    jaxpr = getattr(compiled, "jaxpr", None)
    return matmul_dtypes(jaxpr) if jaxpr is not None else None


def _flops_by_dtype(compiled: Any, devices: int, sep: str, count: MatmulDtypes | None) -> dict[str, float]:
    """``matmul_flops/<lhs>_<rhs>`` per step and device and ``matmul_half_fraction`` of the traced step
    (:func:`jaxlight.flops.matmul_dtypes`); empty when the step carries no traced program."""
    if count is None:
        return {}
    per = max(1, devices) * max(1, getattr(compiled, "steps", 1))
    out = {
        f"matmul_flops{sep}{_SHORT.get(a, a)}_{_SHORT.get(b, b)}": flops / per
        for (a, b), flops in count.by_dtype.items()
    }
    if count.flops:
        out["matmul_half_fraction"] = count.half_fraction
    return out


def _flops(compiled: Any, devices: int, count: MatmulDtypes | None) -> float | None:
    """FLOPs of one train step on one device: the traced step's matrix products (:func:`jaxlight.flops.matmul_flops`,
    loops counted as often as they run) over the devices and the steps one call runs; XLA's ``cost_analysis()``
    when the step carries no traced program."""
    if count is not None:
        if not count.exact:
            rank_zero_warn(
                "ThroughputMonitor: the train step has a while loop, whose trip count is known only at run time; "
                "its body's FLOPs are counted once, so flops_per_step and MFU are a lower bound"
            )
        return count.flops / max(1, devices) / max(1, getattr(compiled, "steps", 1))
    try:
        cost = compiled.cost_analysis()
    except Exception:
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        return None
    return float(cost["flops"])
