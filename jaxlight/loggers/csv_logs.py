"""CSVLogger: ``save_dir/name/version_N/metrics.csv`` and ``hparams.yaml``, as Lightning writes them, plus
text and image artifacts as files beside them."""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping, Sequence
from typing import Any

from jaxlight.loggers.delivery import logger_notice
from jaxlight.loggers.logger import VersionedDirLogger, artifact_step, image_batch, png_bytes, safe_key, text_table


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

    A write that fails (disk full) leaves ``metrics.csv`` as it was (a partial
    append is cut off again) and keeps the rows for the next write. When
    ``metrics.csv`` (or its directory) is deleted during the run, the next
    write creates it again with the header and the rows not yet written
    (``hparams.yaml`` too), with one ``LoggerDeliveryWarning`` saying how many
    rows went with the deleted file.

    Artifacts are files beside ``metrics.csv``: ``log_text`` writes
    ``text/<key>/step=N.txt`` (a table: ``.csv``), ``log_image`` writes
    ``images/<key>/step=N-<i>.png``; ``artifacts.csv`` lists every file with
    its step, key and caption. A key's "/" makes subdirectories.
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
        self._written = 0  # rows this logger wrote to metrics.csv
        self._last_step: int | None = None  # the step of the last of them

    @property
    def metrics_file_path(self) -> str:
        return os.path.join(self.log_dir, "metrics.csv")

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self._hparams.update(_yaml_safe(dict(params)))
        self._write_hparams()

    def _write_hparams(self) -> None:
        os.makedirs(self.log_dir, exist_ok=True)
        path = os.path.join(self.log_dir, "hparams.yaml")
        import yaml  # a core dependency

        with open(path, "w") as f:
            yaml.safe_dump(self._hparams, f, sort_keys=False)

    def save(self) -> None:
        if not self._rows:
            return
        os.makedirs(self.log_dir, exist_ok=True)  # also brings back a directory deleted during the run
        path = self.metrics_file_path
        exists = os.path.exists(path) and os.path.getsize(path) > 0
        rewrite = False
        if self._columns and not exists:
            # this logger wrote the file before, and it (or its directory) was deleted: what was written is
            # gone, the header and the rows still held here are not
            self._recreated(path)
            rewrite = True
        if exists and not self._columns:
            with open(path, newline="") as f:
                self._columns = next(csv.reader(f), [])
        new_cols = [k for r in self._rows for k in r if k not in self._columns]
        if new_cols or rewrite:
            # the whole file again under a temporary name, then an atomic rename
            old: list[dict[str, Any]] = []
            if exists:
                with open(path, newline="") as f:
                    old = list(csv.DictReader(f))
            columns = list(dict.fromkeys(self._columns + new_cols))
            tmp = path + ".tmp"
            try:
                with open(tmp, "w", newline="") as f:
                    w = csv.DictWriter(f, fieldnames=columns)
                    w.writeheader()
                    w.writerows(old)
                    w.writerows(self._rows)
                os.replace(tmp, path)
            except BaseException:
                if os.path.exists(tmp):
                    os.remove(tmp)
                raise
            self._columns = columns
        else:
            size = os.path.getsize(path)
            try:
                with open(path, "a", newline="") as f:
                    csv.DictWriter(f, fieldnames=self._columns).writerows(self._rows)
            except BaseException:
                _truncate(path, size)  # no half-written row; the rows stay kept for the next save
                raise
        self._written += len(self._rows)
        self._last_step = next((r["step"] for r in reversed(self._rows) if r.get("step") is not None), self._last_step)
        self._rows = []

    def _recreated(self, path: str) -> None:
        """Say that ``path`` was deleted and is written again; put back ``hparams.yaml`` if it went too."""
        hparams = ""
        if self._hparams and not os.path.exists(os.path.join(self.log_dir, "hparams.yaml")):
            self._write_hparams()
            hparams = " hparams.yaml was gone too and is written again."
        upto = f" (up to step {self._last_step})" if self._last_step is not None else ""
        logger_notice(
            f"CSVLogger: {path} was deleted during the run; writing it again with its header and the "
            f"{len(self._rows)} row(s) not yet written. The {self._written} row(s) written before{upto} were in "
            f"the deleted file and are lost.{hparams}"
        )

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        row: dict[str, Any] = {(self._prefix + k if self._prefix else k): v for k, v in metrics.items()}
        epoch = self._prefix + "epoch" if self._prefix else "epoch"
        if isinstance(row.get(epoch), float) and row[epoch].is_integer():
            row[epoch] = int(row[epoch])  # Lightning's column: the epoch as an integer ("0", not "0.0")
        row["step"] = step
        self._rows.append(row)
        if step is not None and self._flush_every and (step + 1) % self._flush_every == 0:
            try:
                self.save()
            except BaseException:
                # the caller keeps and resends this call: take its row back so it is written once
                self._rows.pop()
                raise

    # ---------------------------------------------------------------- artifacts
    def log_text(
        self,
        key: str,
        text: str | None = None,
        *,
        columns: Sequence[str] | None = None,
        data: Sequence[Sequence[Any]] | None = None,
        step: int | None = None,
    ) -> None:
        """``text/<key>/step=N.txt`` for a string, ``.csv`` (with a header row) for a table."""
        cols, rows, plain = text_table(text, columns, data)
        folder = os.path.join(self.log_dir, "text", *safe_key(key).split("/"))
        os.makedirs(folder, exist_ok=True)
        path = _free(os.path.join(folder, artifact_step(step) + (".txt" if plain else ".csv")))
        tmp = path + ".tmp"
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            if plain:
                f.write(rows[0][0])
            else:
                w = csv.writer(f)
                w.writerow(cols)
                w.writerows(rows)
        os.replace(tmp, path)
        self._index([(step, key, "text", path, "")])

    def log_image(
        self, key: str, images: Sequence[Any], step: int | None = None, caption: Sequence[str] | None = None
    ) -> None:
        """``images/<key>/step=N-<i>.png`` per image (PNG keeps grayscale, RGB or RGBA as given)."""
        arrays = image_batch(images, {"caption": caption})
        folder = os.path.join(self.log_dir, "images", *safe_key(key).split("/"))
        os.makedirs(folder, exist_ok=True)
        entries = []
        for i, arr in enumerate(arrays):
            path = _free(os.path.join(folder, f"{artifact_step(step)}-{i}.png"))
            with open(path + ".tmp", "wb") as f:
                f.write(png_bytes(arr))
            os.replace(path + ".tmp", path)
            entries.append((step, key, "image", path, "" if caption is None else str(caption[i])))
        self._index(entries)

    @property
    def artifacts_file_path(self) -> str:
        return os.path.join(self.log_dir, "artifacts.csv")

    def _index(self, entries: list[tuple[int | None, str, str, str, str]]) -> None:
        path = self.artifacts_file_path
        new = not os.path.exists(path)
        with open(path, "a", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            if new:
                w.writerow(["step", "key", "kind", "path", "caption"])
            for step, key, kind, p, cap in entries:
                w.writerow(["" if step is None else int(step), key, kind, os.path.relpath(p, self.log_dir), cap])

    def finalize(self, status: str) -> None:
        self.save()


def _truncate(path: str, size: int) -> None:
    try:
        os.truncate(path, size)
    except OSError:  # pragma: no cover - the original error is the one to report
        pass


def _free(path: str) -> str:
    """``path``, or ``<stem>-v1<ext>``, ``-v2``, ... when it is taken (the same step logged twice)."""
    if not os.path.exists(path):
        return path
    stem, ext = os.path.splitext(path)
    v = 1
    while os.path.exists(f"{stem}-v{v}{ext}"):
        v += 1
    return f"{stem}-v{v}{ext}"
