"""Model summary: parameter counts per module and bytes held per device."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxlight.flops import MatmulDtypes
from jaxlight.strategies.placement import layout_summary_lines

HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")


def memory_kind(leaf: Any) -> str:
    """``"host"`` for arrays in a host memory kind (host offload), else ``"device"``."""
    kind = getattr(getattr(leaf, "sharding", None), "memory_kind", None)
    return "host" if kind in HOST_MEMORY_KINDS else "device"


def per_device_bytes(tree: Any, memory: str | None = None) -> int:
    """Bytes the largest single device holds of ``tree``'s arrays (from their shards).

    ``memory="device"`` counts only arrays in device memory, ``"host"`` only
    those a device keeps in host memory (offloaded state; XLA:CPU's
    ``memory_analysis()`` reports no host bytes, so they are counted here from
    the shards), None counts both.
    """
    totals: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array):
            continue
        if memory is not None and memory_kind(leaf) != memory:
            continue
        for shard in leaf.addressable_shards:
            totals[shard.device] = totals.get(shard.device, 0) + shard.data.nbytes
    return max(totals.values()) if totals else 0


def total_bytes(tree: Any) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TB"


def fmt_count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return str(n)


def fmt_state_bytes(tree: Any) -> str:
    """Per-device bytes of ``tree``, split into device and host memory when some of it is offloaded."""
    host = per_device_bytes(tree, "host")
    device = fmt_bytes(per_device_bytes(tree, "device"))
    return f"{device} device + {fmt_bytes(host)} host" if host else device


def fmt_matmul_dtypes(counts: MatmulDtypes) -> str:
    """One line: the share of a step's matmul FLOPs by operand dtypes, largest first
    (``"Matmul FLOPs by operand dtype: bfloat16 x bfloat16 100.0% (of 3.77e+08 per step)"``)."""
    if not counts.flops:
        return "Matmul FLOPs by operand dtype: no matrix products"
    parts = sorted(counts.by_dtype.items(), key=lambda kv: -kv[1])
    shares = ", ".join(f"{a} x {b} {f / counts.flops:.1%}" for (a, b), f in parts)
    return f"Matmul FLOPs by operand dtype: {shares} (of {counts.flops:.3g} per step)"


def summarize(
    params: Mapping[str, jax.Array],
    opt_state: Any,
    mesh: jax.sharding.Mesh,
    max_depth: int = 1,
    variables: Mapping[str, Any] | None = None,
) -> str:
    """A table of parameter counts and per-device bytes, by module path prefix."""
    groups: dict[str, list[jax.Array]] = {}
    for path, arr in params.items():
        parts = path.split("/")
        key = "/".join(parts[: max(1, max_depth)]) if len(parts) > 1 else parts[0]
        groups.setdefault(key, []).append(arr)
    rows = [("Name", "Params", "Bytes/device", "Sharding")]
    for key, arrs in groups.items():
        n = sum(int(np.prod(a.shape)) for a in arrs)
        shard = sorted({str(a.sharding.spec) for a in arrs if hasattr(a.sharding, "spec")})
        rows.append((key, fmt_count(n), fmt_bytes(per_device_bytes(arrs)), ", ".join(shard)[:40]))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    total = sum(int(np.prod(a.shape)) for a in params.values())
    mesh_txt = ", ".join(f"{a}={s}" for a, s in mesh.shape.items() if s > 1) or "single device"
    lines += [
        "-" * len(lines[0]),
        f"Mesh: {mesh_txt} ({mesh.size} devices)",
        f"Trainable params: {fmt_count(total)} ({fmt_bytes(total_bytes(params))} total)",
        f"Per device: params {fmt_bytes(per_device_bytes(params))}, optimizer state {fmt_state_bytes(opt_state)}",
        *layout_summary_lines(params, variables),
    ]
    return "\n".join(lines)
