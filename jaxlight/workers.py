"""Loader worker processes started without ``os.fork()`` of a process that runs JAX.

A torch ``DataLoader(num_workers=N)`` starts its workers with the platform's
default start method, ``fork`` on Linux. A forked child is a copy of a
process whose JAX runtime threads may hold locks at that moment (JAX warns
"os.fork() was called ... will likely lead to a deadlock"). :func:`safe_workers`
gives such a loader, when it has no ``multiprocessing_context`` of its own,
``forkserver`` (``spawn`` where there is none): the workers are forked from a
small server process started fresh, which never ran JAX.

Those start methods send the dataset, ``collate_fn`` and ``worker_init_fn`` to
each worker by pickling, and the workers import the main module again. So the
loader is left to ``fork`` (and JAX's warning, with jaxlight's reason beside
it) when that would fail: the main script would run its training again in
every worker (no ``if __name__ == "__main__":`` around it), or the worker's
arguments cannot be pickled or name a class that only lives in an interactive
``__main__`` (a notebook).
"""

from __future__ import annotations

import ast
import inspect
import multiprocessing
import pickle
import sys
from typing import Any

from jaxlight.rank_zero import WarnOnce, rank_zero_info

_said: set[str] = set()
_warn_once = WarnOnce()

PRELOAD = ("numpy", "torch", "torchvision", "torchdata", "jax", "flax", "optax", "jaxlight", "PIL", "pandas")
"""Packages the forkserver imports once, when they are already imported here: a worker forked from it
finds them loaded when it runs the main script again (importing them in every worker of every epoch
cost seconds each). Importing them starts no JAX backend, so the server never holds JAX threads."""


def fork_free_method() -> str:
    """The start method workers get: ``forkserver`` where the platform has it, else ``spawn``."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def _default_method() -> str:
    # allow_none: asking without it would fix the default for the whole process (a later
    # multiprocessing.set_start_method of the user's would fail); the first listed is the default
    return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]


def _main_reruns(main: Any) -> bool:
    """Whether a ``spawn``/``forkserver`` child runs the main module again (as ``__mp_main__``), as
    :mod:`multiprocessing` decides it: a script, or ``python -m pkg.mod`` (but not ``pkg/__main__.py``)."""
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if spec_name is not None:
        return spec_name != "__main__" and not spec_name.endswith(".__main__")
    path = getattr(main, "__file__", None)
    return path is not None and not str(path).lower().endswith(("ipython", "ipython.exe"))


def _guards(main: Any) -> list[tuple[int, int]] | None:
    """Line ranges of the main module's top-level ``if __name__ == "__main__":`` blocks; None when its
    source cannot be read."""
    path = getattr(main, "__file__", None)
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, TypeError, SyntaxError, ValueError):
        return None
    out = []
    for node in tree.body:
        if isinstance(node, ast.If) and "__name__" in ast.dump(node.test) and "__main__" in ast.dump(node.test):
            out.append((node.lineno, node.end_lineno or node.lineno))
    return out


def _unguarded_call_line(main: Any) -> int | None:
    """The line of the main module's top-level code this call runs under when it is outside every
    ``if __name__ == "__main__":`` block (the worker would run it again); None when it is inside one, or
    the main module's top level is not running (a function called later, an interactive session)."""
    guards = _guards(main)
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_globals is vars(main) and frame.f_code.co_name == "<module>":
            line = frame.f_lineno
            if guards is None or not any(a <= line <= b for a, b in guards):
                return line
            return None
        frame = frame.f_back
    return None


class _Sink:
    """A file that keeps nothing: the probe only needs pickling to succeed."""

    def write(self, data: bytes) -> int:
        return len(data)


class _Probe(pickle.Pickler):
    """Pickles the worker's arguments to see that a fresh process could load them: arrays and tensors are
    stood in for by an id (their bytes are never written), and classes/functions of ``__main__`` are
    recorded (a worker can import them only when it runs the main script again)."""

    def __init__(self) -> None:
        super().__init__(_Sink(), protocol=pickle.HIGHEST_PROTOCOL)
        self.from_main: list[str] = []

    def persistent_id(self, obj: Any) -> Any:
        kind = type(obj)
        mod = kind.__module__
        if mod.startswith("torch") and hasattr(obj, "storage") or (mod == "numpy" and kind.__name__ == "ndarray"):
            return id(obj)  # torch sends tensors through shared memory, numpy copies: either way they load
        if isinstance(obj, type) or callable(obj):
            if getattr(obj, "__module__", None) == "__main__":
                self.from_main.append(getattr(obj, "__qualname__", repr(obj)))
        return None


def _pickle_problem(payload: Any, main_reruns: bool) -> str | None:
    probe = _Probe()
    try:
        probe.dump(payload)
    except Exception as e:  # what a worker started without fork would fail with
        return f"its dataset, collate_fn or worker_init_fn cannot be pickled ({type(e).__name__}: {e})"
    if probe.from_main and not main_reruns:
        names = ", ".join(sorted(set(probe.from_main))[:3])
        return (
            f"its worker arguments use {names}, defined in an interactive __main__ that a fresh worker process "
            f"cannot import (define them in a module)"
        )
    return None


def _why_fork_stays(loader: Any) -> str | None:
    """Why the loader's workers must keep ``fork``, or None when a fork-free start works."""
    main = sys.modules.get("__main__")
    reruns = main is not None and _main_reruns(main)
    if reruns:
        line = _unguarded_call_line(main)
        if line is not None:
            return (
                f"the main script would run again in every worker process, and line {line} of "
                f"{getattr(main, '__file__', '__main__')} (which is training) is not inside "
                f'`if __name__ == "__main__":`'
            )
    payload = (getattr(loader, "dataset", None), getattr(loader, "collate_fn", None), loader.worker_init_fn)
    return _pickle_problem(payload, reruns)


def safe_workers(loader: Any) -> Any:
    """Give a torch ``DataLoader`` (or torchdata ``StatefulDataLoader``) with ``num_workers > 0`` and no
    ``multiprocessing_context`` a fork-free one (:func:`fork_free_method`), said once per process; leave it
    as it is when the platform does not fork by default, when its workers already run
    (``persistent_workers``), or when a fork-free start would fail (then a warning, once, says why and
    what to change). Returns ``loader``. Anything that is not such a loader passes through."""
    workers = getattr(loader, "num_workers", 0)
    if not type(loader).__module__.startswith(("torch", "torchdata")) or not isinstance(workers, int):
        return loader
    if workers <= 0 or getattr(loader, "multiprocessing_context", None) is not None:
        return loader
    if getattr(loader, "_iterator", None) is not None or _default_method() != "fork":
        return loader
    method = fork_free_method()
    reason = _why_fork_stays(loader)
    if reason is not None:
        _warn_once(
            ("fork", reason),
            f"jaxlight: DataLoader(num_workers={workers}) keeps starting its workers with os.fork(), which copies "
            f"this process and its JAX threads (JAX warns of a possible deadlock), because {reason}. Fix that, or "
            f"pass DataLoader(multiprocessing_context=...) to choose yourself",
            category=RuntimeWarning,
        )
        return loader
    if method == "forkserver" and method not in _said:
        # before the first forkserver start (ours or anyone's is the same server): heavy imports done once
        multiprocessing.set_forkserver_preload([m for m in PRELOAD if m in sys.modules])
    loader.multiprocessing_context = method
    if method not in _said:
        _said.add(method)
        rank_zero_info(
            f"jaxlight: DataLoader(num_workers={workers}) starts its worker processes with multiprocessing_context="
            f"{method!r}: os.fork() would copy this process and its JAX threads into them (a possible deadlock). "
            f"Said once; pass DataLoader(multiprocessing_context=...) to choose yourself (persistent_workers=True "
            f"starts them once per fit instead of once per epoch)"
        )
    return loader


__all__ = ["fork_free_method", "safe_workers"]
