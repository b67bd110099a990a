"""Collectives in a compiled program, read from its HLO text.

``strategy="auto"`` (:mod:`jaxlight.planner`) ranks candidate layouts by the
bytes their collectives move, and ``jaxlight verify`` (:mod:`jaxlight.verify`)
prints the collectives of each strategy's train step; both read them here,
from ``compiled.as_text()``, so the two can never count differently.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Mapping

from jaxlight.summary import fmt_bytes

__all__ = ["COLLECTIVE_OPS", "Collectives", "hlo_collectives"]

COLLECTIVE_OPS: tuple[str, ...] = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
"""The HLO ops counted, in the order :meth:`Collectives.summary` lists them."""

_ABBREV = {
    "all-reduce": "AR",
    "all-gather": "AG",
    "reduce-scatter": "RS",
    "all-to-all": "A2A",
    "collective-permute": "CP",
}

_DTYPE_BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
# `%name = <result type> <op>(` or `<op>-start(` (an async collective); ROOT and the `%` are optional
_LINE = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.+?)\s+(?P<op>" + "|".join(COLLECTIVE_OPS) + r")(?P<start>-start)?\("
)
_SHAPE = re.compile(r"\b([a-z]+[0-9]*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_LIST_GROUPS = re.compile(r"replica_groups=\{\{([\d,]*)\}")


def _is_array_dtype(dtype: str) -> bool:
    return dtype in _DTYPE_BYTES or dtype.startswith("f8")


def _shape_bytes(dtype: str, dims: str) -> int:
    # every fp8 flavour (f8e4m3fn, f8e5m2, ...) is one byte; an unknown dtype counts as 4
    size = _DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else 4)
    n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
    return int(n * size)


def _group_size(line: str) -> int:
    m = _IOTA_GROUPS.search(line)
    if m:
        return int(m.group(2))
    m = _LIST_GROUPS.search(line)
    if m:
        return len([x for x in m.group(1).split(",") if x])
    return 1


@dataclasses.dataclass(frozen=True)
class Collectives:
    """The collectives of a compiled program: how many of each op, and their bytes.

    Bytes are each collective's full buffer: the result of an all-reduce,
    all-gather, all-to-all or collective-permute (the output buffers of an
    async ``-start``), and the input of a reduce-scatter (its result times the
    group size). A tuple all-reduce of many gradients counts as one op with
    all their bytes. An op inside a loop body counts once.
    """

    counts: Mapping[str, int]
    bytes: Mapping[str, int]

    @property
    def total_bytes(self) -> int:
        """Bytes of every collective together."""
        return int(sum(self.bytes.values()))

    def summary(self, short: bool = False) -> str:
        """``"all-reduce 1 (1.0 MB), all-gather 6 (3.0 MB)"``, or ``"none"``; ``short`` abbreviates op names."""
        parts = []
        for op in COLLECTIVE_OPS:
            if self.counts.get(op):
                name = _ABBREV[op] if short else op
                parts.append(f"{name} {self.counts[op]} ({fmt_bytes(self.bytes.get(op, 0))})")
        return ", ".join(parts) or "none"


def hlo_collectives(hlo_text: str) -> Collectives:
    """Count and size the collectives in a compiled program's HLO text (``compiled.as_text()``)."""
    counts: collections.Counter = collections.Counter()
    sizes: collections.Counter = collections.Counter()
    for line in hlo_text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        op = m.group("op")
        shapes = [(d, s) for d, s in _SHAPE.findall(m.group("type")) if _is_array_dtype(d)]
        if m.group("start") and op != "all-reduce":
            # async starts return (operands..., outputs..., [u32 contexts]): keep the outputs
            shapes = [x for x in shapes if x != ("u32", "")]
            shapes = shapes[len(shapes) // 2 :]
        n = sum(_shape_bytes(d, s) for d, s in shapes)
        if op == "reduce-scatter":
            n *= _group_size(line)
        counts[op] += 1
        sizes[op] += n
    return Collectives(dict(counts), dict(sizes))
