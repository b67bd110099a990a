"""The Logger interface (Lightning's), artifacts (text, images), and the fan-out that isolates failing trackers."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from jaxlight.integrations import require
from jaxlight.loggers.delivery import LoggerDeliveryWarning, Outbox
from jaxlight.rank_zero import WarnOnce, process_rank, rank_zero_warn


class Logger:
    """Receives metrics, hyperparameters and artifacts on process 0.

    ``log_metrics`` gets host floats keyed by name, with the global step.
    Non-finite values are passed through as such (never dropped).

    ``setup()`` creates the run (directory, event file, tracking run) and is
    called by the trainer on process 0 when ``fit`` starts, before anything
    is compiled, so a misconfigured tracker fails before any work is done.
    It must be idempotent; the default does nothing.

    ``log_text`` and ``log_image`` take artifacts, with the arguments of
    Lightning's ``WandbLogger``; loggers that cannot store them leave the
    defaults, which raise ``NotImplementedError`` (the fan-out skips such a
    logger with one warning).

    ``background_delivery`` (a class attribute) says where the fan-out
    (:class:`LoggerCollection`) calls the logger: ``False`` (the default) on
    the calling thread, as Lightning does; ``True`` (while ``fit`` runs:
    see :meth:`LoggerCollection.open`) from a worker thread of its own, in
    order, so a tracker that blocks (a network call, a locked database)
    never holds up a training step. Set it for a logger whose
    calls may block and whose methods may run on another thread.
    """

    background_delivery: bool = False

    @property
    def name(self) -> str | None:
        return None

    @property
    def version(self) -> int | str | None:
        return None

    @property
    def save_dir(self) -> str | None:
        return None

    @property
    def log_dir(self) -> str | None:
        return None

    @property
    def root_dir(self) -> str | None:
        return None

    def setup(self) -> None:
        """Create the run now (a no-op by default). Errors propagate: they mean the logger is misconfigured."""

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        raise NotImplementedError

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        pass

    def log_text(
        self,
        key: str,
        text: str | None = None,
        *,
        columns: Sequence[str] | None = None,
        data: Sequence[Sequence[Any]] | None = None,
        step: int | None = None,
    ) -> None:
        """Log a text artifact: one string (``text``) or a table (``columns`` and ``data`` rows).

        See :func:`text_table` for how the two forms relate.
        """
        raise NotImplementedError(f"{type(self).__name__} does not store text artifacts")

    def log_image(self, key: str, images: Sequence[Any], step: int | None = None, **kwargs: Any) -> None:
        """Log a list of images under ``key``; ``caption=[...]`` (one per image) where the backend shows captions.

        An image is an array (``(H, W)``, ``(H, W, C)`` or ``(C, H, W)`` with C
        in 1, 3, 4; floats in [0, 1] or integers in [0, 255]), a PIL image, a
        matplotlib figure, or the path of an image file (see :func:`image_array`).
        """
        raise NotImplementedError(f"{type(self).__name__} does not store images")

    def save(self) -> None:
        pass

    def finalize(self, status: str) -> None:
        self.save()

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue the same run (e.g. a run id)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


def next_version(root: str) -> int:
    """The next free ``version_N`` number under ``root`` (0 when there is none)."""
    if not os.path.isdir(root):
        return 0
    versions = []
    for d in os.listdir(root):
        if d.startswith("version_") and os.path.isdir(os.path.join(root, d)):
            try:
                versions.append(int(d.split("_", 1)[1]))
            except ValueError:
                pass
    return max(versions) + 1 if versions else 0


class VersionedDirLogger(Logger):
    """A logger writing to ``save_dir/name/version_N`` (Lightning's layout); ``version=None``
    takes the next free ``version_N`` on first use, a string is used as the directory name."""

    def __init__(self, save_dir: str | os.PathLike, name: str | None, version: int | str | None) -> None:
        self._save_dir = os.fspath(save_dir)
        self._name = name or ""
        self._version = version

    @property
    def name(self) -> str:
        return self._name

    @property
    def version(self) -> int | str:
        if self._version is None:
            self._version = next_version(self.root_dir)
        return self._version

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @property
    def root_dir(self) -> str:
        return os.path.join(self._save_dir, self._name)

    @property
    def log_dir(self) -> str:
        v = self.version
        return os.path.join(self.root_dir, v if isinstance(v, str) else f"version_{v}")

    def setup(self) -> None:
        """Fix the version and create the directory (an unwritable ``save_dir`` fails here, at fit start)."""
        os.makedirs(self.log_dir, exist_ok=True)


# ---------------------------------------------------------------------------- artifacts
def text_table(
    text: str | None = None, columns: Sequence[str] | None = None, data: Sequence[Sequence[Any]] | None = None
) -> tuple[list[str], list[list[str]], bool]:
    """``(columns, rows, is_plain_text)`` of a text artifact, checked.

    ``text`` is one string (the table ``[["text"], [[text]]]``); otherwise
    ``columns`` and ``data`` (rows of as many cells as columns) form a table.
    Cells become strings. Raises ``ValueError``/``TypeError`` saying what is wrong.
    """
    if text is not None:
        if columns is not None or data is not None:
            raise ValueError("log_text takes either text= or columns= with data=, not both")
        if not isinstance(text, str):
            raise TypeError(f"log_text(text=...) must be a str, got {type(text).__name__}")
        return ["text"], [[text]], True
    if data is None:
        raise ValueError("log_text needs text= (a string) or data= (rows of a table, with columns=)")
    rows = [list(r) for r in data]
    if columns is None:
        raise ValueError("log_text(data=...) needs columns= (the table's column names)")
    cols = [str(c) for c in columns]
    bad = [i for i, r in enumerate(rows) if len(r) != len(cols)]
    if bad:
        raise ValueError(f"log_text: rows {bad[:10]} do not have {len(cols)} cells (columns={cols})")
    return cols, [[str(c) for c in r] for r in rows], False


def image_array(image: Any) -> Any:
    """An image as a ``uint8`` numpy array of shape ``(H, W, C)`` with C in 1, 3 or 4.

    Accepts numpy/jax/torch arrays (``(H, W)``, ``(H, W, C)``, or ``(C, H, W)``
    when only the first axis can be channels), floats in [0, 1] (clipped) or
    integers in [0, 255], PIL images, matplotlib figures and image file paths.
    """
    import numpy as np

    if isinstance(image, (str, os.PathLike)):
        from PIL import Image

        with Image.open(os.fspath(image)) as im:
            image = np.asarray(im.convert("RGBA" if "A" in im.getbands() else "RGB"))
    elif hasattr(image, "canvas") and hasattr(image, "savefig"):  # a matplotlib Figure
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        canvas = image.canvas if isinstance(image.canvas, FigureCanvasAgg) else FigureCanvasAgg(image)
        canvas.draw()
        image = np.asarray(canvas.buffer_rgba()).copy()
    elif type(image).__module__.startswith("PIL."):
        image = np.asarray(image.convert("RGBA" if "A" in image.getbands() else "RGB"))
    elif hasattr(image, "detach") and hasattr(image, "cpu"):  # a torch tensor
        image = image.detach().cpu().numpy()
    arr = np.asarray(image)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    elif arr.ndim == 3 and arr.shape[-1] not in (1, 3, 4) and arr.shape[0] in (1, 3, 4):
        arr = np.moveaxis(arr, 0, -1)  # (C, H, W), as torch lays images out
    if arr.ndim != 3 or arr.shape[-1] not in (1, 3, 4) or 0 in arr.shape:
        raise ValueError(
            f"an image must be (H, W), (H, W, C) or (C, H, W) with C in 1, 3, 4; got shape {tuple(np.shape(image))}"
        )
    if arr.dtype == np.bool_:
        return arr.astype(np.uint8) * 255
    if np.issubdtype(arr.dtype, np.floating):
        if not np.isfinite(arr).all():
            raise ValueError("an image holds NaN or Inf values")
        return np.round(np.clip(arr, 0.0, 1.0) * 255.0).astype(np.uint8)
    if np.issubdtype(arr.dtype, np.integer):
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > 255:
            raise ValueError(f"an integer image must hold values in [0, 255], got [{lo}, {hi}]")
        return arr.astype(np.uint8)
    raise TypeError(f"cannot read an image from an array of dtype {arr.dtype}")


def png_bytes(arr: Any) -> bytes:
    """PNG encoding of an :func:`image_array` result (grayscale, RGB or RGBA kept as such)."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr[:, :, 0] if arr.shape[-1] == 1 else arr).save(buf, format="PNG")
    return buf.getvalue()


def image_batch(images: Sequence[Any], kwargs: Mapping[str, Any], allowed: Sequence[str] = ("caption",)) -> list[Any]:
    """Check ``log_image`` arguments; the images as :func:`image_array` arrays."""
    if isinstance(images, (str, os.PathLike)) or not isinstance(images, (list, tuple)):
        raise TypeError(f'log_image expects a list of images as "images", got {type(images).__name__}')
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise ValueError(f"log_image got unsupported arguments {unknown}; this logger takes {list(allowed)}")
    for k, v in kwargs.items():
        if v is not None and (not isinstance(v, (list, tuple)) or len(v) != len(images)):
            raise ValueError(f"log_image: {k}= must be a list with one entry per image ({len(images)})")
    require("pillow", "log_image")
    return [image_array(im) for im in images]


def artifact_step(step: int | None) -> str:
    """The ``step=N`` part of artifact file names."""
    return "step=none" if step is None else f"step={int(step)}"


def safe_key(key: str) -> str:
    """``key`` as a relative path: "/" separates directories; empty, "." and ".." parts are refused."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"an artifact key must be a non-empty string, got {key!r}")
    parts = key.replace("\\", "/").split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"artifact key {key!r} must be a relative name without empty, '.' or '..' parts")
    return "/".join(parts)


# ---------------------------------------------------------------------------- the fan-out
def _outbox(lg: Logger, policy: Any) -> Outbox:
    # Kept on the logger, not the collection: the trainer builds a LoggerCollection per call.
    ob = lg.__dict__.get("_jaxlight_outbox")
    if ob is None:
        background = bool(getattr(lg, "background_delivery", False))
        ob = lg.__dict__["_jaxlight_outbox"] = Outbox(lg, _label(lg), background, policy)
    ob.policy = policy
    return ob


def undelivered(lg: Logger) -> int:
    """How many logging calls ``lg`` has not accepted so far (queued, kept for a retry, or dropped past the limit)."""
    ob = lg.__dict__.get("_jaxlight_outbox")
    return 0 if ob is None else ob.undelivered()


def _label(lg: Logger) -> str:
    return type(lg).__name__


class LoggerCollection:
    """Fans every call out to several loggers; a failing or stalled tracker never stops the run, a step, or
    the other loggers.

    - ``setup()`` creates every logger's run and lets errors propagate: a
      misconfigured tracker fails at fit start, before any work.
    - Every later call is queued per logger, in order. During a trainer
      stage (from :meth:`setup` or :meth:`open` to :meth:`finalize`) a
      logger with ``background_delivery = True`` (W&B, MLflow) gets its
      calls from a worker thread: the training thread only appends to the
      queue, so a tracker that hangs (a locked database, a server that does
      not answer) costs a step nothing. Other loggers, and every logger
      outside a stage, are called before the call returns (behind any calls
      still queued, so the order holds).
    - A call that raises (server gone, disk full, ...) is reported once per
      logger as a warning; it is kept and retried, in order, when that
      logger's next call comes, waiting :attr:`retry_min_s` doubling up to
      :attr:`retry_max_s` between attempts so a dead server costs one failed
      call per interval. The other loggers get every call as usual.
    - At most :attr:`max_pending` calls wait per logger. Past that the
      oldest ``log_metrics`` call is dropped (other kinds only when no
      metrics row waits), with one warning; drops are counted and reported.
      A call in flight for more than :attr:`stall_warn_s` is warned about
      once.
    - ``finalize(status)`` tries what is kept once more, finalizes each
      logger (a background logger on its worker, all within
      :attr:`finalize_timeout_s` together), warns about what could not be
      delivered and returns ``{logger class: calls not delivered}`` for the
      loggers that lost some. Calls of a tracker that did not answer in time
      stay queued and are still sent if it answers before the process exits
      (an exit hook waits up to :attr:`finalize_timeout_s` for them, then
      warns about the rest).

    The queues live on the logger objects, so short-lived collections (one
    per call) share them. Warnings are issued on the calling thread, at the
    next call or at finalize. Argument errors (a bad image, a malformed
    table) are raised to the caller before anything is queued. Every method
    does nothing on processes other than 0 (loggers live on process 0), so
    hooks that run on every process may call it as they are.
    """

    max_pending: int = 10_000
    retry_min_s: float = 1.0
    retry_max_s: float = 60.0
    finalize_timeout_s: float = 30.0
    stall_warn_s: float = 10.0

    def __init__(self, loggers: Sequence[Logger]) -> None:
        self.loggers = list(loggers)

    # ---------------------------------------------------------------- fit start: errors propagate
    def setup(self) -> None:
        """Create every logger's run now (raises the first logger's error as it comes), then :meth:`open`."""
        if process_rank() != 0:
            return
        for lg in self.loggers:
            lg.setup()
        self.open()

    def open(self) -> None:
        """A trainer stage starts: until :meth:`finalize`, background loggers get their calls from their
        worker threads. (Outside a stage every logger is called before the call returns, as in Lightning,
        so a script that logs and then reads the tracker sees what it logged.)"""
        if process_rank() != 0:
            return
        for lg in self.loggers:
            ob = _outbox(lg, self)
            with ob.cond:
                ob.active = True

    # ---------------------------------------------------------------- isolated calls
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self._deliver("log_metrics", (dict(metrics), step), {})

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self._deliver("log_hyperparams", (dict(params),), {})

    def log_text(
        self,
        key: str,
        text: str | None = None,
        *,
        columns: Sequence[str] | None = None,
        data: Sequence[Sequence[Any]] | None = None,
        step: int | None = None,
    ) -> None:
        """A text artifact to every logger that stores text (see :meth:`Logger.log_text`)."""
        safe_key(key)
        cols, rows, plain = text_table(text, columns, data)
        kw: dict[str, Any] = {"step": step}
        if plain:
            kw["text"] = text
        else:
            kw.update(columns=cols, data=rows)
        self._deliver("log_text", (key,), kw, optional=True)

    def log_image(
        self, key: str, images: Sequence[Any], step: int | None = None, caption: Sequence[str] | None = None
    ) -> None:
        """Images to every logger that stores images; converted and checked once (see :func:`image_array`)."""
        safe_key(key)
        arrays = image_batch(images, {"caption": caption})
        kw: dict[str, Any] = {"step": step}
        if caption is not None:
            kw["caption"] = [str(c) for c in caption]
        self._deliver("log_image", (key, arrays), kw, optional=True)

    def save(self) -> None:
        """Ask every logger to write what it buffers (queued behind its earlier calls; a failure is not kept:
        the rows stay in the logger and its next save writes them)."""
        if process_rank() != 0:
            return
        for lg in self.loggers:
            ob = _outbox(lg, self)
            ob.put("save", (), {}, keep=False)
            ob.emit()

    def finalize(self, status: str) -> dict[str, int]:
        """Retry what is kept, finalize each logger, report and return what could not be delivered.

        Waits at most :attr:`finalize_timeout_s` in all for the background loggers (they finish in parallel).
        """
        lost: dict[str, int] = {}
        if process_rank() != 0:
            return lost
        deadline = time.monotonic() + float(self.finalize_timeout_s)
        boxes = [_outbox(lg, self) for lg in self.loggers]
        gens = [ob.request_final(status) for ob in boxes]  # the background ones start now, side by side
        for ob, gen in zip(boxes, gens):
            done = ob.finish(gen, deadline)
            ob.emit()
            n = ob.undelivered()
            if not n:
                continue
            kinds = ob.waiting()
            detail = ", ".join(f"{v} {k}" for k, v in sorted(kinds.items()))
            dropped = f", {ob.dropped} dropped past the limit of {self.max_pending}" if ob.dropped else ""
            if done:
                rank_zero_warn(
                    f"{ob.label}: {n} logging call(s) could not be delivered ({detail or 'none kept'}{dropped}); "
                    f"last error: {ob.last_error}",
                    category=LoggerDeliveryWarning,
                )
            else:
                with ob.cond:
                    busy = (
                        f"busy in {ob.inflight.method} for {time.monotonic() - ob.inflight_since:.1f} s"
                        if ob.inflight is not None
                        else "busy"
                    )
                rank_zero_warn(
                    f"{ob.label}: {n} logging call(s) not delivered: the logger did not finish within "
                    f"LoggerCollection.finalize_timeout_s={self.finalize_timeout_s:g} s ({busy}; "
                    f"{detail or 'none queued'}{dropped}); last error: {ob.last_error or 'none'}. The queued calls "
                    f"are still sent, in order, if it answers before the process exits.",
                    category=LoggerDeliveryWarning,
                )
            lost[ob.label] = lost.get(ob.label, 0) + n
        for ob in boxes:
            with ob.cond:
                ob.active = False  # the stage is over; later calls are delivered before they return
        return lost

    # ---------------------------------------------------------------- machinery
    def _deliver(self, method: str, args: tuple, kwargs: dict[str, Any], optional: bool = False) -> None:
        if process_rank() != 0:
            return
        for lg in self.loggers:
            if optional and getattr(type(lg), method, None) is getattr(Logger, method):
                _SKIPPED(
                    (type(lg), method),
                    f"{_label(lg)} does not implement {method}; {method} calls are not sent to it",
                )
                continue
            ob = _outbox(lg, self)
            ob.put(method, args, kwargs)
            ob.emit()


_SKIPPED = WarnOnce()  # (logger class, method) pairs already reported as unsupported


def flatten_hparams(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts to "a/b" keys; values that are not plain become their repr."""
    out: dict[str, Any] = {}
    for k, v in params.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten_hparams(v, key + "/"))
        elif isinstance(v, (int, float, str, bool)) or v is None:
            out[key] = v
        else:
            out[key] = repr(v)
    return out
