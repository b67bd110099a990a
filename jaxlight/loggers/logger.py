"""The Logger interface (Lightning's) and the fan-out used for several loggers."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any


class Logger:
    """Receives metrics and hyperparameters on process 0.

    ``log_metrics`` gets host floats keyed by name, with the global step.
    Non-finite values are passed through as such (never dropped).
    """

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

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        raise NotImplementedError

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        pass

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


class LoggerCollection:
    """Fans out to several loggers: every sink is attempted, the first failure is raised after."""

    def __init__(self, loggers: Sequence[Logger]) -> None:
        self.loggers = list(loggers)

    def _each(self, method: str, *args: Any, **kwargs: Any) -> None:
        first: BaseException | None = None
        for lg in self.loggers:
            try:
                getattr(lg, method)(*args, **kwargs)
            except Exception as e:
                if first is None:
                    first = e
        if first is not None:
            raise first

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self._each("log_metrics", metrics, step)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self._each("log_hyperparams", params)

    def save(self) -> None:
        self._each("save")

    def finalize(self, status: str) -> None:
        self._each("finalize", status)


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


def is_finite(v: float) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)
