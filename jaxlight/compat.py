"""The only module that touches private APIs of jax and orbax.

Each function below names the private object it reads and the versions it was checked on
(jax/jaxlib 0.10.2, orbax-checkpoint 0.12.8). ``tests/test_compat.py`` calls each one against the
installed versions, so a move in either library fails loudly there rather than silently elsewhere.
Nothing of optax's private surface is used anywhere in jaxlight.
"""

from __future__ import annotations

import functools
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


def guard_persistent_cache_io(refuse: Any) -> str:
    """Route JAX's persistent-cache writes and reads of compiled programs through ``refuse``.

    ``refuse(module_name, executable, backend)`` returns None to let the program through, else a
    reason: a refused program is not written (``put``), and a refused program read back is
    dropped as a miss, so JAX compiles it afresh (``get``). Wraps the module-level functions
    ``put_executable_and_time`` and ``get_executable_and_time`` of ``jax._src.compilation_cache``
    (jax 0.10.2), which ``jax._src.compiler`` looks up on that module at every call; JAX offers no
    public hook between compiling and storing. Returns ``"installed"``, ``"already"`` (installed
    earlier in this process) or ``"unsupported"`` (the functions are missing).
    """
    try:
        from jax._src import compilation_cache as cc
    except ImportError:  # pragma: no cover - jax layout moved
        return "unsupported"
    put = getattr(cc, "put_executable_and_time", None)
    get = getattr(cc, "get_executable_and_time", None)
    if put is None or get is None:  # pragma: no cover - jax layout moved
        return "unsupported"
    if getattr(put, "_jaxlight_guard", None) is not None:
        put._jaxlight_guard[0] = refuse  # the latest guard wins; one wrapper per process
        return "already"
    box = [refuse]

    @functools.wraps(put)
    def guarded_put(cache_key, module_name, executable, backend, *args, **kwargs):
        if box[0](module_name, executable, backend) is not None:
            return None
        return put(cache_key, module_name, executable, backend, *args, **kwargs)

    @functools.wraps(get)
    def guarded_get(cache_key, compile_options, backend, *args, **kwargs):
        executable, compile_time = get(cache_key, compile_options, backend, *args, **kwargs)
        if executable is not None:
            module_name = cache_key.rsplit("-", 1)[0] if "-" in cache_key else cache_key
            if box[0](module_name, executable, backend) is not None:
                return None, None
        return executable, compile_time

    guarded_put._jaxlight_guard = box
    cc.put_executable_and_time = guarded_put
    cc.get_executable_and_time = guarded_get
    return "installed"


def executable_hlo_texts(executable: Any) -> list[str]:
    """The optimised HLO text of each module of a compiled ``LoadedExecutable``
    (``executable.hlo_modules()``, each ``to_string()``); raises when this jaxlib lacks them."""
    return [m.to_string() for m in executable.hlo_modules()]


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


def host_putter(shape: tuple[int, ...], dtype: Any, sharding: Any) -> Any | None:
    """A function that transfers a numpy array of ``shape`` and canonical ``dtype`` to ``sharding``
    (one process), or None when this jax's layout differs (then use ``jax.make_array_from_callback``).

    It is the last step of ``jax.make_array_from_callback`` and of a ``jax.jit`` call given a numpy
    argument, ``jax._src.interpreters.pxla.batched_device_put`` (jax 0.10.2), with the abstract value,
    devices and per-device slices worked out once instead of on every call: the Python around that one
    C++ call costs ~20 µs per leaf, more than a tiny model's step. Same result as
    ``jax.make_array_from_callback(shape, sharding, x.__getitem__)``.
    """
    try:
        from jax._src import core
        from jax._src.interpreters import pxla
    except ImportError:  # pragma: no cover - jax layout moved
        return None
    put = getattr(pxla, "batched_device_put", None)
    make_aval = getattr(core, "update_aval_with_sharding", None)
    if put is None or make_aval is None:  # pragma: no cover - jax layout moved
        return None
    aval = make_aval(core.ShapedArray(shape, dtype), sharding)
    index_map = sharding.addressable_devices_indices_map(shape)
    devices = list(index_map)
    indices = [index_map[d] for d in devices]
    if len(devices) == 1 and all(i == slice(None) for i in indices[0]):
        return lambda x: put(aval, sharding, [x], devices)
    return lambda x: put(aval, sharding, [x[i] for i in indices], devices)


@functools.cache
def variable_value_setter() -> Any:
    """A function ``set(variable, array)`` that points an ``nnx.Variable`` at a new array, as
    ``Variable.set_raw_value`` does, without its check that the caller is at the trace level the variable
    was made at (``object.__setattr__`` on the private ``_raw_value`` slot, flax 0.12.8).

    For the train loop's per-step re-pointing of the module's variables before a user's per-batch hook,
    which runs on the host outside any trace: the check costs ~4 µs per variable, ~250 µs a step for
    the 60 variables of the reference transformer. Falls back to ``set_raw_value`` when this flax keeps
    the value elsewhere.
    """
    from flax import nnx

    setattr_ = object.__setattr__

    def set_value(var: Any, value: Any) -> None:
        setattr_(var, "_raw_value", value)

    probe, marker = nnx.Variable(0), object()
    try:
        set_value(probe, marker)
        works = probe.get_raw_value() is marker
    except (AttributeError, TypeError):  # pragma: no cover - flax layout moved
        works = False
    return set_value if works else (lambda var, value: var.set_raw_value(value))
