"""ModelSummary: parameter counts per module, bytes per device and sharding, printed at fit start."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxlight.callbacks.callback import Callback
from jaxlight.flops import MatmulDtypes, matmul_dtypes
from jaxlight.strategies.placement import layout_summary_lines
from jaxlight.summary import fmt_bytes, fmt_count, fmt_matmul_dtypes, fmt_state_bytes, per_device_bytes


def summary_rows(params: dict[str, Any], module_types: dict[str, str], max_depth: int = 1) -> list[dict[str, Any]]:
    """One row per module path up to ``max_depth`` levels (-1: every module), with its parameters' totals.

    ``params`` is the flat ``{"net/l1/kernel": array}`` dict; a module's row
    counts every parameter below it. Rows come in the order parameters first
    appear; a parent comes before its children.
    """
    rows: dict[str, dict[str, Any]] = {}
    for path, arr in params.items():
        parts = path.split("/")[:-1] or path.split("/")
        depth = len(parts) if max_depth < 0 else min(max_depth, len(parts))
        for d in range(1, depth + 1):
            name = "/".join(parts[:d])
            row = rows.setdefault(
                name, {"name": name, "type": module_types.get(name, ""), "params": 0, "arrays": [], "sharding": set()}
            )
            row["params"] += int(np.prod(arr.shape))
            row["arrays"].append(arr)
            spec = getattr(getattr(arr, "sharding", None), "spec", None)
            if spec is not None:
                row["sharding"].add(str(spec))
    out = []
    for row in rows.values():
        out.append(
            {
                "name": row["name"],
                "type": row["type"],
                "params": row["params"],
                "bytes_per_device": per_device_bytes(row.pop("arrays")),
                "sharding": sorted(row["sharding"]),
            }
        )
    return out


def _module_types(trainer: Any) -> dict[str, str]:
    from flax import nnx

    module = trainer.lightning_module
    names = trainer.engine.parts.names if trainer.engine.parts is not None else ()
    models = {k: getattr(module, k) for k in names}
    out = {}
    for path, node in nnx.iter_graph(models):
        if isinstance(node, nnx.Module) and path:
            out["/".join(str(p) for p in path)] = type(node).__name__
    return out


class ModelSummary(Callback):
    """Prints a table of the model at the start of ``fit`` (process 0).

    One row per module down to ``max_depth`` levels (``-1``: all, ``0``: no
    table, only totals): name, type, parameter count, the bytes of its
    parameters the fullest device holds (from the actual shards) and the
    parameters' PartitionSpecs; then the mesh, total parameters and per-device
    bytes of parameters and optimizer state. The rows are in ``self.rows`` and
    the text in ``self.summary``. When this callback is present the trainer
    prints it instead of its default summary (``enable_model_summary=True``
    is the default summary with ``max_depth=1``).

    When the train step is first compiled (the end of the first train batch), one more line gives its
    matrix products' FLOPs by operand dtype (``bfloat16 x bfloat16 100.0%`` under a working
    ``"bf16-mixed"``; :func:`jaxlight.flops.matmul_dtypes`): printed, added to ``self.summary`` and kept in
    ``self.matmul_dtypes``.
    """

    def __init__(self, max_depth: int = 1) -> None:
        if not isinstance(max_depth, int) or max_depth < -1:
            raise ValueError(f"ModelSummary max_depth must be an int >= -1, got {max_depth!r}")
        self.max_depth = max_depth
        self.rows: list[dict[str, Any]] = []
        self.summary: str = ""
        self.matmul_dtypes: MatmulDtypes | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit" and not trainer.enable_model_summary:
            raise ValueError(
                "Trainer was configured with enable_model_summary=False but found ModelSummary in the callbacks list"
            )

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.matmul_dtypes = None  # read again from this fit's train step
        if not trainer.is_global_zero or trainer.train_state is None:
            return
        self.summary = self.summarize(trainer)
        print(self.summary)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.matmul_dtypes is not None or not trainer.is_global_zero:
            return
        jaxpr = getattr(trainer.compiled.get("train"), "jaxpr", None)
        if jaxpr is None:
            return
        self.matmul_dtypes = matmul_dtypes(jaxpr)
        line = fmt_matmul_dtypes(self.matmul_dtypes)
        self.summary = f"{self.summary}\n{line}" if self.summary else line
        print(line)

    def summarize(self, trainer: Any) -> str:
        state = trainer.train_state
        params = state.params
        self.rows = summary_rows(params, _module_types(trainer), self.max_depth) if self.max_depth != 0 else []
        table = [("", "Name", "Type", "Params", "Bytes/device", "Sharding")]
        for i, r in enumerate(self.rows):
            table.append(
                (
                    str(i),
                    r["name"],
                    r["type"],
                    fmt_count(r["params"]),
                    fmt_bytes(r["bytes_per_device"]),
                    ", ".join(r["sharding"]),
                )
            )
        lines = []
        if len(table) > 1:
            widths = [max(len(t[c]) for t in table) for c in range(len(table[0]))]
            lines = [" | ".join(c.ljust(w) for c, w in zip(t, widths)).rstrip() for t in table]
            lines.insert(1, "-" * max(len(x) for x in lines))
            lines.append("-" * max(len(x) for x in lines))
        total = sum(int(np.prod(a.shape)) for a in params.values())
        mesh = trainer.mesh
        mesh_txt = ", ".join(f"{a}={s}" for a, s in mesh.shape.items() if s > 1) or "single device"
        lines += [
            f"{fmt_count(total):<10} Trainable params ({total})",
            f"{fmt_bytes(per_device_bytes(params)):<10} Params per device",
            f"{fmt_state_bytes(state.opt_state):<10} Optimizer state per device",
            *(
                [f"{fmt_state_bytes(state.callback_state):<10} Callback state per device (EMA ...)"]
                if state.callback_state
                else []
            ),
            f"Mesh: {mesh_txt} ({mesh.size} devices)",
            *layout_summary_lines(params, _param_variables(trainer)),
        ]
        return "\n".join(lines)


def _param_variables(trainer: Any) -> Any:
    """The NNX variables behind the parameters (their annotations), when the engine holds them."""
    parts = getattr(trainer.engine, "parts", None)
    return parts.params.variables if parts is not None else None
