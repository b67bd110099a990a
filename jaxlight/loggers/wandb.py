"""WandbLogger: metrics and hyperparameters to a Weights & Biases run."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from jaxlight.integrations import require
from jaxlight.loggers.delivery import logger_notice
from jaxlight.loggers.logger import Logger, flatten_hparams, image_batch, safe_key, text_table


class WandbLogger(Logger):
    """Logs to a W&B run (Lightning's ``WandbLogger`` arguments).

    ``wandb`` is imported and the run started (``wandb.init``) on first use
    (``self.experiment``), on process 0 only. ``offline=True`` writes the run
    under ``save_dir/wandb`` for a later ``wandb sync`` without an account.
    Metrics are logged with ``trainer/global_step`` as their step metric, as
    Lightning does, so several ``log_metrics`` calls for one step are fine;
    NaN/Inf are logged as such. Hyperparameters go to ``run.config``. The run
    id is part of ``state_dict()``: a run resumed from a checkpoint continues
    the same W&B run (``resume="allow"``); ``id=``/``version=`` does the same
    by hand. ``finalize`` does not finish the run (call ``wandb.finish()`` or
    ``logger.experiment.finish()``), so ``trainer.test`` after ``fit`` logs to
    the same run. Extra keyword arguments go to ``wandb.init``.

    ``log_text`` logs a ``wandb.Table`` (a plain string as a one-cell table
    with the column ``text``) and ``log_image`` a list of ``wandb.Image``, as
    Lightning's logger does; ``log_image``'s other keyword arguments (``caption``,
    ``masks``, ``boxes``, ...) are lists with one entry per image, passed to
    ``wandb.Image``.

    While ``fit`` runs, the trainer's calls reach the run from a worker
    thread (``background_delivery``), so a slow W&B never slows a step. An offline
    run whose directory (or ``.wandb`` file) is deleted during the run would
    lose everything logged after, silently (wandb writes on into the deleted
    file): each call checks the file first, and when it is gone the logger
    finishes that session and continues the same run id in a new offline
    session (``resume="allow"``, the config logged again), with one
    ``LoggerDeliveryWarning`` saying what went with the deleted file. A run
    started outside the logger is not reopened; its calls then fail, are kept
    and reported as undelivered.
    """

    LOGGER_JOIN_CHAR = "-"
    background_delivery = True

    def __init__(
        self,
        name: str | None = None,
        save_dir: str = ".",
        version: str | None = None,
        offline: bool = False,
        dir: str | None = None,
        id: str | None = None,
        anonymous: bool | None = None,
        project: str | None = None,
        log_model: bool = False,
        experiment: Any = None,
        prefix: str = "",
        **kwargs: Any,
    ) -> None:
        require("wandb", "WandbLogger")
        if log_model:
            raise ValueError(
                "WandbLogger(log_model=True) is not supported; checkpoints are orbax directories "
                "(log them as a wandb.Artifact yourself)"
            )
        self._name = name
        self._save_dir = os.fspath(dir if dir is not None else save_dir)
        self._id = version or id
        self._offline = offline
        self._anonymous = "allow" if anonymous else None
        self._project = project or os.environ.get("WANDB_PROJECT", "lightning_logs")
        self._prefix = prefix
        self._kwargs = kwargs
        self._experiment = experiment
        self._lock = threading.RLock()  # the run is started (or reopened) by one thread at a time
        self._owned = False  # the run was started by this logger (so it may be reopened)
        self._session: tuple[str, tuple[int, int]] | None = None  # an offline run's .wandb file and its inode
        self._session_calls = 0  # calls logged into the current offline session
        self._config: dict[str, Any] = {}  # what went to run.config (logged again in a reopened session)
        self._lost: tuple[str, int] | None = None  # a deleted offline session (file, calls) not yet replaced

    @property
    def experiment(self) -> Any:
        """The ``wandb`` Run; started on first access."""
        if self._experiment is not None:
            return self._experiment
        with self._lock:
            if self._experiment is None:
                self._start()
        return self._experiment

    def _start(self) -> None:
        import wandb

        lost = self._lost  # (file, calls) of an offline session whose file was deleted: open a new session
        if lost is None and wandb.run is not None and self._id in (None, wandb.run.id):
            run = wandb.run  # a run the user started themselves
            self._owned = False
        else:
            os.makedirs(self._save_dir, exist_ok=True)
            init = dict(
                name=self._name,
                project=self._project,
                dir=self._save_dir,
                id=self._id,
                resume="allow",
                anonymous=self._anonymous,
            )
            if self._offline:
                init["mode"] = "offline"
            init.update(self._kwargs)
            run = wandb.init(**{k: v for k, v in init.items() if v is not None})
            self._owned = True
        if getattr(run, "define_metric", None) is not None:
            run.define_metric("trainer/global_step")
            run.define_metric("*", step_metric="trainer/global_step", step_sync=True)
        if lost is not None and self._config:
            run.config.update(self._config, allow_val_change=True)
        self._id = run.id
        self._session, self._session_calls = _offline_file(run), 0
        self._experiment, self._lost = run, None
        if lost is not None:
            where = os.path.dirname(self._session[0]) if self._session is not None else self._save_dir
            logger_notice(
                f"WandbLogger: the offline run file {lost[0]} was deleted during the run, and with it the "
                f"{lost[1]} logging call(s) this session had written. Logging goes on in a new offline session "
                f"of the same run {self._id} in {where} (the config is logged again); `wandb sync` it."
            )

    def _check_offline_run(self) -> None:
        """Reopen an offline run whose ``.wandb`` file was deleted (or replaced); raise if it is not ours."""
        session = self._session
        if session is None or self._experiment is None:
            return
        path, ident = session
        try:
            st = os.stat(path)
            if (st.st_dev, st.st_ino) == ident:
                return
        except OSError:
            pass
        with self._lock:
            if self._session is not session:
                return  # another thread reopened it meanwhile
            if not self._owned:
                raise FileNotFoundError(
                    f"the W&B offline run file {path} was deleted during the run; the run was started outside "
                    f"WandbLogger, so it is not reopened, and what is logged to it would be lost"
                )
            old, self._experiment, self._session = self._experiment, None, None
            self._lost = (path, self._session_calls)  # kept until a new session starts (a failed start is retried)
            try:
                old.finish()
            except Exception:  # the deleted session is lost either way; a new one is what matters
                pass

    def setup(self) -> None:
        """Start the run (``wandb.init``) now, so a bad project, entity or key fails at fit start."""
        _ = self.experiment

    @property
    def name(self) -> str | None:
        return self._project

    @property
    def version(self) -> str | None:
        return self._experiment.id if self._experiment is not None else self._id

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @property
    def log_dir(self) -> str | None:
        return None

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        flat = flatten_hparams(params)
        self._check_offline_run()
        self.experiment.config.update(flat, allow_val_change=True)
        self._config.update(flat)

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        out = {(f"{self._prefix}{self.LOGGER_JOIN_CHAR}{k}" if self._prefix else k): v for k, v in metrics.items()}
        if step is not None:
            out["trainer/global_step"] = step
        self._check_offline_run()
        self.experiment.log(out)
        self._session_calls += 1

    def log_text(
        self,
        key: str,
        text: str | None = None,
        *,
        columns: Sequence[str] | None = None,
        data: Sequence[Sequence[Any]] | None = None,
        step: int | None = None,
        dataframe: Any = None,
    ) -> None:
        """A ``wandb.Table`` under ``key`` (``dataframe=`` takes a pandas DataFrame, as in Lightning)."""
        import wandb

        if dataframe is not None:
            table = wandb.Table(dataframe=dataframe)
        else:
            cols, rows, _ = text_table(text, columns, data)
            table = wandb.Table(columns=cols, data=rows)
        self.log_metrics({safe_key(key): table}, step)

    def log_image(self, key: str, images: Sequence[Any], step: int | None = None, **kwargs: Any) -> None:
        """A list of ``wandb.Image`` under ``key``; each keyword argument is a list with one entry per image."""
        import wandb

        arrays = [a[:, :, 0] if a.shape[-1] == 1 else a for a in image_batch(images, kwargs, allowed=tuple(kwargs))]
        per_image = [{k: v[i] for k, v in kwargs.items() if v is not None} for i in range(len(arrays))]
        self.log_metrics({safe_key(key): [wandb.Image(a, **kw) for a, kw in zip(arrays, per_image)]}, step)

    def finalize(self, status: str) -> None:
        pass  # the run stays open for later stages; wandb finishes it at exit or on wandb.finish()

    def state_dict(self) -> dict[str, Any]:
        return {"id": self.version, "project": self._project}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        run_id = state.get("id")
        if run_id is None:
            return
        if self._experiment is not None and self._experiment.id != run_id:
            raise ValueError(
                f"WandbLogger already logs to run {self._experiment.id}; cannot switch to the "
                f"checkpoint's run {run_id} (create the logger fresh, or pass id=)"
            )
        self._id = run_id


def _offline_file(run: Any) -> tuple[str, tuple[int, int]] | None:
    """An offline run's ``.wandb`` file with its (device, inode), to notice when it is deleted; else None."""
    if getattr(run, "offline", None) is not True:
        return None
    path = getattr(getattr(run, "settings", None), "sync_file", None)
    if not isinstance(path, str):
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return path, (st.st_dev, st.st_ino)
