"""MLFlowLogger: metrics, hyperparameters and artifacts to an MLflow tracking server or local store."""

from __future__ import annotations

import csv
import io
import os
import re
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from jaxlight.integrations import require
from jaxlight.loggers.delivery import logger_notice, path_identity
from jaxlight.loggers.logger import Logger, artifact_step, flatten_hparams, image_batch, safe_key, text_table

_PARAM_VALUE_LIMIT = 6000  # MLflow's limit on a parameter value's length
RESUMED_FROM_TAG = "jaxlight.resumed_from_run_id"  # on a run created because the store of this one was deleted


class MLFlowLogger(Logger):
    """Logs to an MLflow run (Lightning's ``MLFlowLogger`` arguments).

    ``mlflow`` is imported, and the experiment and run created, by ``setup()``
    (the trainer calls it when fit starts, so a bad URI fails before any
    compile) or on first use (``self.experiment``), on process 0 only.
    ``tracking_uri`` may be a server, ``sqlite:///path.db`` or another store
    MLflow accepts; unset, it is ``$MLFLOW_TRACKING_URI`` or, unlike
    Lightning (whose ``file:`` default MLflow 3 refuses), the SQLite store
    ``sqlite:///<save_dir>/mlflow.db`` with artifacts in
    ``<save_dir>/artifacts`` for experiments it creates. Metrics are
    logged with the trainer's step; NaN is kept as NaN (MLflow's stores clamp
    +/-Inf to +/-1.8e308, a limit of MLflow). Hyperparameters are logged once
    per run: the same key again with the same value is skipped, with a
    different value it raises (MLflow refuses to change a parameter). The run
    id is part of ``state_dict()``, so a run resumed from a checkpoint keeps
    logging into the same MLflow run; ``run_id=`` does the same by hand.
    ``finalize`` marks the run FINISHED/FAILED.

    ``log_text`` stores ``text/<key>/step=N.txt`` (a table: ``.csv``) as run
    artifacts (``MlflowClient.log_text``); ``log_image`` logs step-keyed
    images (``MlflowClient.log_image(key=..., step=...)``, shown with a step
    slider in the UI; ``key_<i>`` for the i-th of several). MLflow has no
    image captions; captions go to the other loggers only.

    A local store deleted during the run (the SQLite file or its directory, or
    a ``file:`` store's directory) is noticed at the next call (one
    ``os.stat`` per call): the store is created again and, its run gone with
    it, a new run (same experiment name, run name and tags, the parameters
    logged again) gets the rest of the run, tagged
    ``jaxlight.resumed_from_run_id`` with the old run's id; one
    ``LoggerDeliveryWarning`` names the store and both runs.

    While ``fit`` runs, the trainer's calls reach MLflow from a worker
    thread (``background_delivery``): a slow server or a locked SQLite database
    (MLflow waits up to 20 s for a lock, then fails) never holds up a step;
    the calls wait in order, failures are warned, kept and retried.
    """

    LOGGER_JOIN_CHAR = "-"
    background_delivery = True

    def __init__(
        self,
        experiment_name: str = "lightning_logs",
        run_name: str | None = None,
        tracking_uri: str | None = None,
        tags: Mapping[str, Any] | None = None,
        save_dir: str | None = "./mlruns",
        log_model: bool = False,
        prefix: str = "",
        artifact_location: str | None = None,
        run_id: str | None = None,
    ) -> None:
        require("mlflow", "MLFlowLogger")
        if log_model:
            raise ValueError(
                "MLFlowLogger(log_model=True) is not supported; checkpoints are orbax directories "
                "(log them with logger.experiment.log_artifacts(run_id, path))"
            )
        if tracking_uri is None:
            tracking_uri = os.getenv("MLFLOW_TRACKING_URI")
        self._local_store = False
        if tracking_uri is None and save_dir is not None:
            # MLflow 3 refuses the file store Lightning defaults to; SQLite keeps everything under save_dir
            tracking_uri = f"sqlite:///{os.path.abspath(save_dir)}/mlflow.db"
            self._local_store = True
            if artifact_location is None:
                artifact_location = os.path.join(os.path.abspath(save_dir), "artifacts")
        self._experiment_name = experiment_name
        self._run_name = run_name
        self._tracking_uri = tracking_uri
        self.tags = dict(tags or {})
        self._save_dir = save_dir
        self._prefix = prefix
        self._artifact_location = artifact_location
        self._run_id = run_id
        self._experiment_id: str | None = None
        self._client: Any = None
        self._logged_params: dict[str, str] = {}
        self._lock = threading.RLock()  # the worker thread and the training thread may both (re)connect
        self._store_path = _local_store_path(tracking_uri)  # the file or directory a local store lives in
        self._store_id: tuple[int, int] | None = None  # its (device, inode) once connected
        self._reopens = 0
        self._run_label: str | None = None  # the run's name in MLflow (given or generated), for a new run

    @property
    def experiment(self) -> Any:
        """The ``mlflow.tracking.MlflowClient``; creates the experiment and the run on first access (and again
        when the local store was deleted)."""
        client = self._client
        if client is not None and (self._store_path is None or path_identity(self._store_path) == self._store_id):
            return client
        with self._lock:
            if self._client is None:
                self._connect(self._tracking_uri)
            elif path_identity(self._store_path or "") != self._store_id:
                self._reopen()
            return self._client

    def _connect(self, uri: str | None, resumed_from: str | None = None) -> None:
        """Open ``uri``; reopen the run by id or create it (with the tag ``resumed_from``, when set)."""
        from mlflow.tracking import MlflowClient

        if self._local_store and self._save_dir is not None:
            os.makedirs(self._save_dir, exist_ok=True)
        client = MlflowClient(tracking_uri=uri)
        if self._run_id is not None and resumed_from is None:
            run = client.get_run(self._run_id)
            self._experiment_id = run.info.experiment_id
            if run.info.status != "RUNNING":
                client.update_run(self._run_id, status="RUNNING")
            self._logged_params = dict(run.data.params)
        else:
            exp = client.get_experiment_by_name(self._experiment_name)
            if exp is None:
                self._experiment_id = client.create_experiment(
                    self._experiment_name, artifact_location=self._artifact_location
                )
            else:
                self._experiment_id = exp.experiment_id
            tags = {k: str(v) for k, v in self.tags.items()}
            name = self._run_name or self._run_label
            if name is not None:
                tags.setdefault("mlflow.runName", name)
            if resumed_from is not None:
                tags[RESUMED_FROM_TAG] = resumed_from
            run = client.create_run(self._experiment_id, run_name=name, tags=tags)
            self._run_id = run.info.run_id
        self._run_label = run.info.run_name
        self._client = client
        if self._store_path is not None:
            self._store_id = path_identity(self._store_path)

    def _reopen(self) -> None:
        """The local store was deleted: create it again and go on in the old run if it is there (a store put
        back), else in a new run tagged with the old one's id, with the parameters logged again."""
        from mlflow.entities import Param

        old_client, old_run = self._client, self._run_id
        self._client = None
        _dispose(old_client)
        self._reopens += 1
        if self._store_path is not None:  # a file: store is its directory; SQLite creates its file itself
            sqlite = (self._tracking_uri or "").startswith("sqlite:")
            path = os.path.abspath(self._store_path)
            os.makedirs(os.path.dirname(path) if sqlite else path, exist_ok=True)
        uri = _respelled(self._tracking_uri, self._reopens)
        try:
            self._connect(uri)  # the old run id, in case the store came back with it
            what = f"logging goes on in run {old_run}"
        except Exception:
            try:
                self._connect(uri, resumed_from=old_run)
            except BaseException:
                # the store cannot be created now (the call fails, is kept and retried): the next call tries again
                self._client, self._run_id = old_client, old_run
                raise
            params = [Param(k, v) for k, v in self._logged_params.items()]
            for i in range(0, len(params), 100):  # MLflow accepts at most 100 params per batch
                self._client.log_batch(self._run_id, params=params[i : i + 100])
            what = (
                f"run {old_run} went with it, so the rest of the run goes to the new run {self._run_id} "
                f"(tag {RESUMED_FROM_TAG}={old_run}, its parameters logged again); what was logged before is lost"
            )
        logger_notice(f"MLFlowLogger: the tracking store {self._store_path} was deleted during the run; {what}")

    def setup(self) -> None:
        """Connect, create (or find) the experiment and create (or reopen) the run now."""
        _ = self.experiment

    @property
    def run_id(self) -> str:
        _ = self.experiment
        assert self._run_id is not None
        return self._run_id

    @property
    def experiment_id(self) -> str | None:
        _ = self.experiment
        return self._experiment_id

    @property
    def name(self) -> str | None:
        return self._experiment_id if self._client is not None else self._experiment_name

    @property
    def version(self) -> str | None:
        return self._run_id

    @property
    def save_dir(self) -> str | None:
        """The local directory holding the store (the default SQLite store or a ``file:`` store), else None."""
        if self._local_store and self._save_dir is not None:
            return os.path.abspath(self._save_dir)
        uri = self._tracking_uri or ""
        return uri[len("file:") :] if uri.startswith("file:") else None

    @property
    def log_dir(self) -> str | None:
        return None

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        flat = {k: str(v)[:_PARAM_VALUE_LIMIT] for k, v in flatten_hparams(params).items()}
        client = self.experiment
        changed = {
            k: (self._logged_params[k], v)
            for k, v in flat.items()
            if k in self._logged_params and self._logged_params[k] != v
        }
        if changed:
            raise ValueError(
                f"MLFlowLogger: run {self._run_id} already has different values for parameters "
                f"{changed} (old, new); MLflow cannot change a logged parameter"
            )
        new = [Param(k, v) for k, v in flat.items() if k not in self._logged_params]
        for i in range(0, len(new), 100):  # MLflow accepts at most 100 params per batch
            client.log_batch(self._run_id, params=new[i : i + 100])
        self._logged_params.update(flat)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = []
        for k, v in metrics.items():
            if isinstance(v, str):
                raise ValueError(f"MLFlowLogger got a string for metric {k!r}; metrics must be numbers")
            name = f"{self._prefix}{self.LOGGER_JOIN_CHAR}{k}" if self._prefix else k
            # MLflow metric names allow alphanumerics, _ - . space / ; replace anything else
            name = re.sub(r"[^A-Za-z0-9_\-. /]", "_", name)
            items.append(Metric(name, float(v), ts, 0 if step is None else int(step)))
        client = self.experiment
        for i in range(0, len(items), 1000):
            client.log_batch(self._run_id, metrics=items[i : i + 1000])

    def log_text(
        self,
        key: str,
        text: str | None = None,
        *,
        columns: Sequence[str] | None = None,
        data: Sequence[Sequence[Any]] | None = None,
        step: int | None = None,
    ) -> None:
        cols, rows, plain = text_table(text, columns, data)
        path = f"text/{safe_key(key)}/{artifact_step(step)}"
        if plain:
            self.experiment.log_text(self.run_id, rows[0][0], f"{path}.txt")
        else:
            buf = io.StringIO()
            w = csv.writer(buf)
            w.writerow(cols)
            w.writerows(rows)
            self.experiment.log_text(self.run_id, buf.getvalue(), f"{path}.csv")

    def log_image(
        self, key: str, images: Sequence[Any], step: int | None = None, caption: Sequence[str] | None = None
    ) -> None:
        arrays = image_batch(images, {"caption": caption})
        name = re.sub(r"[^A-Za-z0-9_\-. /]", "_", safe_key(key))
        client = self.experiment
        for i, arr in enumerate(arrays):
            client.log_image(
                self.run_id,
                arr[:, :, 0] if arr.shape[-1] == 1 else arr,
                key=name if len(arrays) == 1 else f"{name}_{i}",
                step=0 if step is None else int(step),
            )

    def finalize(self, status: str) -> None:
        if self._client is None:
            return
        mlflow_status = {"success": "FINISHED", "finished": "FINISHED", "failed": "FAILED"}.get(status, status)
        self.experiment.set_terminated(self._run_id, mlflow_status)  # a store deleted at the end is reopened

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self._run_id, "experiment_id": self._experiment_id}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        run_id = state.get("run_id")
        if run_id is None:
            return
        if self._client is not None and self._run_id != run_id:
            raise ValueError(
                f"MLFlowLogger already logs to run {self._run_id}; cannot switch to the checkpoint's "
                f"run {run_id} (create the logger fresh, or pass run_id=)"
            )
        self._run_id = run_id


def _local_store_path(uri: str | None) -> str | None:
    """The SQLite file of a ``sqlite:///`` URI or the directory of a ``file:`` store; None for a server."""
    if not uri:
        return None
    if uri.startswith("sqlite:///"):
        path = uri[len("sqlite:///") :].split("?", 1)[0]
        return path if path and path != ":memory:" else None
    if uri.startswith("file:"):
        return uri[len("file:") :] or None
    return None


def _respelled(uri: str | None, n: int) -> str | None:
    """``uri`` naming the same local store another way (``dir/./././name.db``, ``store/././.``: ``n`` times
    ``.``): MLflow keeps one store object (and for SQL one SQLAlchemy engine) per URI string, whose pooled
    connections still point at the deleted SQLite file (every write then fails with "attempt to write a
    readonly database") and whose ``file:`` store was set up in the deleted directory; a new spelling gets a new
    store, which sets itself up in the new file or directory. Other URIs are returned as they are."""
    if uri and uri.startswith("sqlite:///"):
        path, _, query = uri[len("sqlite:///") :].partition("?")
        head, tail = os.path.split(path)
        return f"sqlite:///{os.path.join(head, *(['.'] * n), tail)}" + (f"?{query}" if query else "")
    if uri and uri.startswith("file:"):
        return uri.rstrip("/") + "/." * n
    return uri


def _dispose(client: Any) -> None:
    """Close the pooled connections of ``client``'s SQL store (best effort: they point at a deleted file)."""
    store = getattr(getattr(client, "_tracking_client", None), "store", None)
    engine = getattr(store, "engine", None)
    try:
        if engine is not None:
            engine.dispose()
    except Exception:
        pass
