"""The only module that touches private APIs of jax and orbax.

Each function below names the private object it reads and the versions it was checked on
(jax/jaxlib 0.10.2, orbax-checkpoint 0.12.8). ``tests/test_compat.py`` calls each one against the
installed versions, so a move in either library fails loudly there rather than silently elsewhere.
Nothing of optax's private surface is used anywhere in jaxlight.
"""

from __future__ import annotations

from typing import Any

#: The versions every private use below was checked on.
CHECKED_ON = {"jax": "0.10.2", "orbax-checkpoint": "0.12.8"}


class CompatError(RuntimeError):
    """A private API jaxlight relies on is missing from the installed jax or orbax."""


def backends_initialized() -> bool:
    """Whether JAX has started its backends (``jax._src.xla_bridge.backends_are_initialized``).

    Used to read the process index without starting a backend as a side effect (rank-zero logging
    before ``jax.distributed.initialize``). There is no public equivalent in jax 0.10.
    """
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - jax layout moved
        return False
    fn = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(fn()) if fn is not None else False


def distributed_client() -> Any | None:
    """The ``jax.distributed`` coordination-service client (``jax._src.distributed.global_state.client``),
    or None before ``jax.distributed.initialize``.

    Its key-value store (``key_value_set``, ``blocking_key_value_get``, ``key_value_try_get``) is what
    processes use to agree on strings and stop points; jax 0.10 exposes no public handle to it.
    """
    try:
        from jax._src import distributed
    except ImportError:  # pragma: no cover - jax layout moved
        return None
    state = getattr(distributed, "global_state", None)
    return getattr(state, "client", None)


def cluster_environments() -> tuple[Any, ...]:
    """jax's own cluster detectors (SLURM, Open MPI, TPU, k8s...), read from
    ``jax._src.clusters.ClusterEnv._cluster_types``; each has ``is_env_present()``. Empty if the layout moved."""
    try:
        from jax._src import clusters
    except ImportError:  # pragma: no cover - jax layout moved
        return ()
    return tuple(getattr(clusters.ClusterEnv, "_cluster_types", ()))


def _compilation_cache_module() -> Any:
    try:
        from jax._src import compilation_cache as cc
    except ImportError as e:  # pragma: no cover - jax layout moved
        raise CompatError("jax._src.compilation_cache is gone from this jax") from e
    for name in ("_cache", "_cache_initialized", "_cache_initialized_mutex"):
        if not hasattr(cc, name):
            raise CompatError(f"jax._src.compilation_cache.{name} is gone from this jax")
    return cc


def persistent_cache_in_use() -> tuple[Any | None, str | None]:
    """The object JAX uses as its persistent compilation cache (``jax._src.compilation_cache._cache``)
    and its path if it has one; ``(None, None)`` when none is set up or this jax's layout differs."""
    try:
        cc = _compilation_cache_module()
    except CompatError:
        return None, None
    cache = cc._cache
    if cache is None:
        return None, None
    return cache, str(getattr(cache, "_path", "<unknown>"))


def install_persistent_cache(store: Any) -> str:
    """Make ``store`` JAX's persistent compilation cache, under JAX's own lock.

    Returns ``"installed"``, ``"busy"`` (JAX has set its cache up already) or ``"unsupported"`` (the
    private attributes ``_cache``, ``_cache_initialized`` and ``_cache_initialized_mutex`` of
    ``jax._src.compilation_cache`` are missing).
    """
    try:
        cc = _compilation_cache_module()
    except CompatError:
        return "unsupported"
    with cc._cache_initialized_mutex:
        if cc._cache is not None or cc._cache_initialized:
            return "busy"
        cc._cache = store
        cc._cache_initialized = True
    return "installed"


def async_save_in_flight(checkpointer: Any) -> bool:
    """Whether an orbax ``AsyncCheckpointer``'s background commit is still running, without waiting.

    Reads ``checkpointer._async_manager._thread`` (orbax 0.12.8): orbax's public surface only offers
    the blocking ``wait_until_finished``. A synchronous checkpointer, or a layout without these
    attributes, reports False (nothing in flight that jaxlight can see).
    """
    mgr = getattr(checkpointer, "_async_manager", None)
    if mgr is None:
        return False
    thread = getattr(mgr, "_thread", None)
    return thread is not None and thread.is_alive()
