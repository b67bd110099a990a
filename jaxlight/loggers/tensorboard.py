"""TensorBoardLogger: TensorBoard event files written with tensorboard's record format and protos (no torch or TF)."""

from __future__ import annotations

import itertools
import os
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any

from jaxlight.integrations import require
from jaxlight.loggers.delivery import logger_notice, path_identity
from jaxlight.loggers.logger import VersionedDirLogger, flatten_hparams, image_batch, png_bytes, safe_key, text_table

_FILE_IDS = itertools.count()  # the last part of an event file's name, as tensorboard's writer numbers them


class EventFile:
    """One TensorBoard event file: records framed by tensorboard's ``RecordWriter`` into a file held open.

    tensorboard's ``EventFileWriter`` appends to its file by path from a thread; with the directory deleted
    every write fails there and prints a traceback. An open file takes the writes (into the deleted file)
    and the logger notices the deletion itself. Flushed on :meth:`flush` and when an event comes
    ``flush_secs`` after the last flush.
    """

    def __init__(self, logdir: str, flush_secs: float = 120) -> None:
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._logdir = logdir
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_FILE_IDS)}"
        self.path = os.path.join(logdir, name)
        self._records = RecordWriter(open(self.path, "wb"))  # noqa: SIM115 - open as long as the writer
        self._flush_secs = flush_secs
        self._flushed_at = time.monotonic()
        meta = event_pb2.SourceMetadata(writer="jaxlight")
        self.add_event(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2", source_metadata=meta))
        self.flush()

    def get_logdir(self) -> str:
        return self._logdir

    def add_event(self, event: Any) -> None:
        self._records.write(event.SerializeToString())
        if time.monotonic() - self._flushed_at >= self._flush_secs:
            self.flush()

    def flush(self) -> None:
        self._records.flush()
        self._flushed_at = time.monotonic()

    def close(self) -> None:
        if not self._records.closed:
            self._records.close()


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

    A log directory deleted during the run (tensorboard's writer would go on
    appending into nothing) is noticed at the next event (one ``os.stat`` of
    the directory per event): the directory is created again with a new event
    file (and ``hparams.yaml`` and the hyperparameters), which gets the rest of
    the run, with one ``LoggerDeliveryWarning`` naming the directory and what
    was lost with it.
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
        self._dir_id: tuple[int, int] | None = None  # (device, inode) of the directory the writer writes into
        self._events = 0  # events given to the current writer (what a deleted directory takes with it)
        self._last_step: int | None = None

    @property
    def log_dir(self) -> str:
        d = super().log_dir
        return os.path.join(d, self._sub_dir) if self._sub_dir else d

    @property
    def experiment(self) -> Any:
        """This run's event file writer (``add_event``, ``flush``, ``close``, ``get_logdir``, as tensorboard's
        ``EventFileWriter``); created on first access."""
        if self._writer is None:
            os.makedirs(self.log_dir, exist_ok=True)
            self._writer = EventFile(self.log_dir, flush_secs=self._flush_secs)
            self._dir_id, self._events = path_identity(self.log_dir), 0
        return self._writer

    def _writer_alive(self) -> Any:
        """The writer, after making sure its directory is still there (an open file takes writes into a
        deleted directory without a word, and everything logged later would be lost)."""
        writer = self.experiment
        if self._dir_id is not None and path_identity(self.log_dir) != self._dir_id:
            writer = self._reopen()
        return writer

    def _reopen(self) -> Any:
        """Open a new event file in the recreated log directory (with the hyperparameters again) and say so."""
        old, self._writer = self._writer, None
        try:
            old.close()
        except OSError:
            pass  # its file went with the directory; what it still held is lost either way
        lost, upto = self._events, self._last_step
        writer = self.experiment
        again = ""
        if self._hparams:
            self._write_hparams()
            again = " hparams.yaml and the hyperparameters are written again."
        at = f" (up to step {upto})" if upto is not None else ""
        logger_notice(
            f"TensorBoardLogger: the log directory {self.log_dir} was deleted during the run; writing a new event "
            f"file there for the rest of the run. The {lost} event(s) written before{at} were in the deleted "
            f"directory and are lost.{again}"
        )
        return writer

    def setup(self) -> None:
        """Create the version directory and open the event file."""
        _ = self.experiment

    def _add(self, summary: Any, step: int | None) -> None:
        from tensorboard.compat.proto import event_pb2

        writer = self._writer_alive()
        writer.add_event(event_pb2.Event(wall_time=time.time(), step=int(step or 0), summary=summary))
        self._events += 1
        if step is not None:
            self._last_step = int(step)

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
        self._hparams.update(flatten_hparams(params))
        self._write_hparams()
        if metrics is None and self._default_hp_metric:
            metrics = {"hp_metric": -1}
        if metrics:
            self.log_metrics(metrics, 0)

    def _write_hparams(self) -> None:
        """``hparams.yaml`` and the HParams dashboard's summary, from every hyperparameter logged so far."""
        from tensorboard.plugins.hparams import summary_v2 as hp

        os.makedirs(self.log_dir, exist_ok=True)
        import yaml

        with open(os.path.join(self.log_dir, "hparams.yaml"), "w") as f:
            yaml.safe_dump(self._hparams, f, sort_keys=False)
        plain = {k: (v if isinstance(v, (bool, int, float, str)) else str(v)) for k, v in self._hparams.items()}
        self._add(hp.hparams_pb(plain), 0)

    def save(self) -> None:
        if self._writer is not None:
            self._writer_alive().flush()

    def finalize(self, status: str) -> None:
        if self._writer is not None:
            self._writer_alive().flush()
            self._writer.close()
            self._writer = None  # a later stage reopens a new event file in the same directory

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") is not None:
            self._version = state["version"]
