"""TensorBoardLogger: TensorBoard event files written with tensorboard's own writer (no torch or TF)."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from jaxlight.integrations import require
from jaxlight.loggers.logger import VersionedDirLogger, flatten_hparams, image_batch, png_bytes, safe_key, text_table


class TensorBoardLogger(VersionedDirLogger):
    """Writes scalars to ``save_dir/name/version_N/events.out.tfevents.*`` (Lightning's layout and arguments).

    Needs only the ``tensorboard`` package (``pip install jaxlight[tensorboard]``),
    imported on first use; neither torch nor TensorFlow is imported. NaN/Inf
    are written as such. Hyperparameters go to ``hparams.yaml`` and to the
    HParams dashboard (with ``hp_metric`` set to -1 when
    ``default_hp_metric``, as Lightning does). A resumed run appends to the
    same version directory: the version is part of ``state_dict()``.

    ``log_text`` writes to the Text tab (a table as a markdown table),
    ``log_image`` to the Images tab (tag ``key``, or ``key/i`` for several
    images), both with tensorboard's own summary protos.
    """

    LOGGER_JOIN_CHAR = "-"

    def __init__(
        self,
        save_dir: str | os.PathLike = "logs",
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        default_hp_metric: bool = True,
        prefix: str = "",
        sub_dir: str | None = None,
        flush_secs: int = 120,
    ) -> None:
        require("tensorboard", "TensorBoardLogger")
        super().__init__(save_dir, name, version)
        self._default_hp_metric = default_hp_metric
        self._prefix = prefix
        self._sub_dir = sub_dir
        self._flush_secs = flush_secs
        self._writer: Any = None
        self._hparams: dict[str, Any] = {}

    @property
    def log_dir(self) -> str:
        d = super().log_dir
        return os.path.join(d, self._sub_dir) if self._sub_dir else d

    @property
    def experiment(self) -> Any:
        """tensorboard's ``EventFileWriter`` for this run; created on first access."""
        if self._writer is None:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            os.makedirs(self.log_dir, exist_ok=True)
            self._writer = EventFileWriter(self.log_dir, flush_secs=self._flush_secs)
        return self._writer

    def setup(self) -> None:
        """Create the version directory and open the event file."""
        _ = self.experiment

    def _add(self, summary: Any, step: int | None) -> None:
        from tensorboard.compat.proto import event_pb2

        self.experiment.add_event(event_pb2.Event(wall_time=time.time(), step=int(step or 0), summary=summary))

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        from tensorboard.compat.proto import summary_pb2

        values = []
        for k, v in metrics.items():
            tag = f"{self._prefix}{self.LOGGER_JOIN_CHAR}{k}" if self._prefix else k
            values.append(summary_pb2.Summary.Value(tag=tag, simple_value=float(v)))
        if values:
            self._add(summary_pb2.Summary(value=values), step)

    def log_text(
        self,
        key: str,
        text: str | None = None,
        *,
        columns: Sequence[str] | None = None,
        data: Sequence[Sequence[Any]] | None = None,
        step: int | None = None,
    ) -> None:
        from tensorboard.plugins.text.summary_v2 import text_pb

        cols, rows, plain = text_table(text, columns, data)
        if plain:
            body = rows[0][0]
        else:  # the Text tab renders markdown tables

            def cell(c: str) -> str:
                return c.replace("|", "\\|").replace("\n", " ")

            lines = ["| " + " | ".join(map(cell, cols)) + " |", "|" + "---|" * len(cols)]
            lines += ["| " + " | ".join(map(cell, r)) + " |" for r in rows]
            body = "\n".join(lines)
        self._add(text_pb(self._tag(safe_key(key)), body), step)

    def log_image(
        self, key: str, images: Sequence[Any], step: int | None = None, caption: Sequence[str] | None = None
    ) -> None:
        """One PNG per image; captions become the summary's description."""
        from tensorboard.compat.proto import summary_pb2

        arrays = image_batch(images, {"caption": caption})
        tag = self._tag(safe_key(key))
        values = []
        for i, arr in enumerate(arrays):
            img = summary_pb2.Summary.Image(
                height=arr.shape[0], width=arr.shape[1], colorspace=arr.shape[2], encoded_image_string=png_bytes(arr)
            )
            v = summary_pb2.Summary.Value(tag=tag if len(arrays) == 1 else f"{tag}/{i}", image=img)
            if caption is not None:
                v.metadata.summary_description = str(caption[i])
            values.append(v)
        self._add(summary_pb2.Summary(value=values), step)

    def _tag(self, key: str) -> str:
        return f"{self._prefix}{self.LOGGER_JOIN_CHAR}{key}" if self._prefix else key

    def log_hyperparams(self, params: Mapping[str, Any], metrics: Mapping[str, float] | None = None) -> None:
        from tensorboard.plugins.hparams import summary_v2 as hp

        self._hparams.update(flatten_hparams(params))
        os.makedirs(self.log_dir, exist_ok=True)
        import yaml

        with open(os.path.join(self.log_dir, "hparams.yaml"), "w") as f:
            yaml.safe_dump(self._hparams, f, sort_keys=False)
        plain = {k: (v if isinstance(v, (bool, int, float, str)) else str(v)) for k, v in self._hparams.items()}
        self._add(hp.hparams_pb(plain), 0)
        if metrics is None and self._default_hp_metric:
            metrics = {"hp_metric": -1}
        if metrics:
            self.log_metrics(metrics, 0)

    def save(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def finalize(self, status: str) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None  # a later stage reopens a new event file in the same directory

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") is not None:
            self._version = state["version"]
