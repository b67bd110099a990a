"""CSVLogger: ``save_dir/name/version_N/metrics.csv`` and ``hparams.yaml``, as Lightning writes them."""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping
from typing import Any

from jaxlight.loggers.logger import VersionedDirLogger


def _yaml_safe(value: Any) -> Any:
    """Nested dicts/lists of plain values as they are (Lightning keeps hparams.yaml nested, so it can be
    read back); anything else becomes its repr."""
    if isinstance(value, Mapping):
        return {str(k): _yaml_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_yaml_safe(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return repr(value)


class CSVLogger(VersionedDirLogger):
    """Writes metrics to a CSV file, one row per ``log_metrics`` call.

    Rows are buffered and appended every ``flush_logs_every_n_steps`` and at
    the end; when a new metric name appears the file is rewritten once with
    the widened header (so every row has every column). Non-finite values are
    written as ``nan``/``inf``. Hyperparameters go to ``hparams.yaml``.
    ``version=None`` takes the next free ``version_N``.
    """

    def __init__(
        self,
        save_dir: str = "logs",
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
    ) -> None:
        super().__init__(save_dir, name, version)
        self._prefix = prefix
        self._flush_every = flush_logs_every_n_steps
        self._rows: list[dict[str, Any]] = []
        self._columns: list[str] = []
        self._hparams: dict[str, Any] = {}

    @property
    def metrics_file_path(self) -> str:
        return os.path.join(self.log_dir, "metrics.csv")

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self._hparams.update(_yaml_safe(dict(params)))
        os.makedirs(self.log_dir, exist_ok=True)
        path = os.path.join(self.log_dir, "hparams.yaml")
        try:
            import yaml

            with open(path, "w") as f:
                yaml.safe_dump(self._hparams, f, sort_keys=False)
        except ImportError:  # pragma: no cover - pyyaml comes with orbax
            with open(path, "w") as f:
                for k, v in self._hparams.items():
                    f.write(f"{k}: {v!r}\n")

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        row: dict[str, Any] = {(self._prefix + k if self._prefix else k): v for k, v in metrics.items()}
        row["step"] = step
        self._rows.append(row)
        if step is not None and self._flush_every and (step + 1) % self._flush_every == 0:
            self.save()

    def save(self) -> None:
        if not self._rows:
            return
        os.makedirs(self.log_dir, exist_ok=True)
        new_cols = [k for r in self._rows for k in r if k not in self._columns]
        path = self.metrics_file_path
        if os.path.exists(path) and not self._columns:
            with open(path, newline="") as f:
                self._columns = next(csv.reader(f), [])
            new_cols = [k for r in self._rows for k in r if k not in self._columns]
        if new_cols:
            old: list[dict[str, Any]] = []
            if os.path.exists(path):
                with open(path, newline="") as f:
                    old = list(csv.DictReader(f))
            self._columns = list(dict.fromkeys(self._columns + new_cols))
            tmp = path + ".tmp"
            with open(tmp, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=self._columns)
                w.writeheader()
                w.writerows(old)
                w.writerows(self._rows)
            os.replace(tmp, path)
        else:
            with open(path, "a", newline="") as f:
                csv.DictWriter(f, fieldnames=self._columns).writerows(self._rows)
        self._rows = []

    def finalize(self, status: str) -> None:
        self.save()
