"""MLFlowLogger: metrics, hyperparameters and artifacts to an MLflow tracking server or local store."""

from __future__ import annotations

import csv
import io
import os
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

from jaxlight.integrations import require
from jaxlight.loggers.logger import Logger, artifact_step, flatten_hparams, image_batch, safe_key, text_table

_PARAM_VALUE_LIMIT = 6000  # MLflow's limit on a parameter value's length


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

    @property
    def experiment(self) -> Any:
        """The ``mlflow.tracking.MlflowClient``; creates the experiment and the run on first access."""
        if self._client is not None:
            return self._client
        from mlflow.tracking import MlflowClient

        if self._local_store and self._save_dir is not None:
            os.makedirs(self._save_dir, exist_ok=True)
        client = MlflowClient(tracking_uri=self._tracking_uri)
        if self._run_id is not None:
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
            if self._run_name is not None:
                tags.setdefault("mlflow.runName", self._run_name)
            run = client.create_run(self._experiment_id, run_name=self._run_name, tags=tags)
            self._run_id = run.info.run_id
        self._client = client
        return client

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
        self._client.set_terminated(self._run_id, mlflow_status)

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
