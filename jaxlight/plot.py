"""PNG plots of logged metrics, read from a CSVLogger's metrics.csv (matplotlib, Agg backend)."""

from __future__ import annotations

import csv
import math
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path


def find_metrics_files(path: str | os.PathLike) -> list[Path]:
    """``path`` itself when it is a CSV file, else every ``metrics.csv`` below the directory (sorted)."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise FileNotFoundError(f"{str(p)!r} is neither a metrics CSV file nor a log directory")
    found = sorted(p.rglob("metrics.csv"))
    if not found:
        raise FileNotFoundError(f"no metrics.csv under {str(p)!r} (CSVLogger writes <save_dir>/<name>/version_N/)")
    return found


def _series(csv_path: Path, wanted: Sequence[str] | None) -> dict[str, tuple[list[float], list[float]]]:
    """{metric: (steps, values)}, streaming the file; empty cells (other rows' metrics) are skipped."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    with open(csv_path, newline="") as f:
        reader = csv.DictReader(f)
        cols = [c for c in (reader.fieldnames or []) if c not in ("step", "epoch")]
        if wanted is not None:
            missing = [m for m in wanted if m not in cols]
            if missing:
                raise ValueError(f"{csv_path}: no column(s) {missing}; columns are {cols}")
            cols = list(wanted)
        for row in reader:
            step_txt = row.get("step") or ""
            for c in cols:
                v = row.get(c)
                if v in (None, ""):
                    continue
                steps, vals = out.setdefault(c, ([], []))
                steps.append(float(step_txt) if step_txt else float(len(steps)))
                vals.append(float(v))  # "nan"/"inf" parse; matplotlib leaves gaps for them
    return out


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "metric"


def plot_metrics(
    path: str | os.PathLike, out_dir: str | os.PathLike | None = None, metrics: Iterable[str] | None = None
) -> list[Path]:
    """Write one PNG per metric (value against step) for a metrics.csv or every one under a log directory.

    Plots go to ``out_dir`` or ``<csv dir>/plots/``; returns their paths. The
    CSV is read row by row; nothing is kept in memory between calls.
    Non-finite values are left as gaps and counted in the title.
    """
    from jaxlight.integrations import require

    require("matplotlib", "plotting metrics")
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    wanted = list(metrics) if metrics is not None else None
    written: list[Path] = []
    for csv_path in find_metrics_files(path):
        target = Path(out_dir) if out_dir is not None else csv_path.parent / "plots"
        if out_dir is not None and len(find_metrics_files(path)) > 1:
            target = target / _safe(str(csv_path.parent.relative_to(Path(path))))
        target.mkdir(parents=True, exist_ok=True)
        for name, (steps, vals) in _series(csv_path, wanted).items():
            fig, ax = plt.subplots(figsize=(6, 4))
            ax.plot(steps, vals, marker="." if len(vals) < 50 else None)
            bad = sum(1 for v in vals if not math.isfinite(v))
            ax.set_title(name + (f" ({bad} non-finite)" if bad else ""))
            ax.set_xlabel("step")
            ax.set_ylabel(name)
            ax.grid(True, alpha=0.3)
            fig.tight_layout()
            out = target / f"{_safe(name)}.png"
            fig.savefig(out, dpi=100)
            plt.close(fig)
            written.append(out)
    return written
