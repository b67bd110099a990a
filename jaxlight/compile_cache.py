"""A persistent XLA compilation cache, on by default: reruns start from compiled programs.

``Trainer(compile_cache=...)`` calls :func:`configure_compile_cache`. Compiled
executables are stored under JAX's own cache key (the program, jaxlib version,
backend and device kinds, XLA flags, compile options), so an entry is only ever
reused for the same program on the same software and hardware.

Where: ``compile_cache=None``/``True`` uses ``$JAXLIGHT_COMPILE_CACHE`` when set
(a directory, or ``0``/``false``/``off`` to turn the default off), else
``$XDG_CACHE_HOME/jaxlight/compile`` or ``~/.cache/jaxlight/compile``; a path
moves it; ``False`` turns it off. Size: ``$JAXLIGHT_COMPILE_CACHE_MAX_SIZE``
(bytes, or ``500M``/``8G``), default 4 GiB, least recently used entries evicted.

Safety. JAX keeps one cache per process, initialised once, and has no public
hook for the store behind it: jaxlight sets JAX's module-level cache object
(``jax._src.compilation_cache._cache``, under JAX's own lock, only while JAX
has none) to a :class:`DiskCache`, and falls back to JAX's built-in file store
where that layout differs. Compared with JAX's store, :class:`DiskCache`
writes entries atomically (temporary file + rename, so a killed process or a
concurrent reader never sees half an entry), checks a digest on every read
(a corrupt entry is dropped, recompiled and rewritten), needs no lock file
(several runs may share the directory; eviction by file mtime), and serves
reads from a read-only directory. JAX itself writes cache entries only from
process 0 of a multi-process run (``jax._src.compiler._cache_write``), so the
other processes only read (on CPU their keys differ from process 0's, so only
process 0 gets hits there). Any cache problem costs a recompile and one
:class:`CompileCacheWarning` per process, never an error. JAX's XLA GPU
autotuning side cache (``jax_persistent_cache_enable_xla_caches``) is turned
off while at its default: see :func:`_set_jax_options`.

Reload guard (XLA:CPU, jax 0.10.2, issue 37). A CPU program whose collectives
sit in two or more computations (e.g. a ring's collective-permute in a loop and
an all-reduce outside it) can deadlock once read back from the cache. Such
programs are neither written nor read back: see :func:`reload_hazard`.

A cache the user configured through JAX (``jax_compilation_cache_dir``,
``JAX_COMPILATION_CACHE_DIR``) is respected as it is; so is
``jax_enable_compilation_cache=False``.

``python -m jaxlight.compile_cache`` prints where the cache is and its size;
``python -m jaxlight.compile_cache clear`` empties it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import logging
import os
import re
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "DEFAULT_MAX_SIZE",
    "ENV_DIR",
    "ENV_MAX_SIZE",
    "CacheStats",
    "RELOAD_GUARD_SEEN_ON",
    "CompileCacheWarning",
    "DiskCache",
    "cache_stats",
    "clear_compile_cache",
    "configure_compile_cache",
    "default_cache_dir",
    "reload_hazard",
]

ENV_DIR = "JAXLIGHT_COMPILE_CACHE"
"""Environment variable: the default cache directory, or ``0``/``false``/``off``/``no`` to turn the default off."""
ENV_MAX_SIZE = "JAXLIGHT_COMPILE_CACHE_MAX_SIZE"
"""Environment variable: the cache's size bound, in bytes or with a K/M/G/T suffix (powers of 1024)."""
DEFAULT_MAX_SIZE = 4 * 1024**3
"""Default size bound (4 GiB); the least recently used entries are evicted beyond it."""

# Cache every compilation, however quick or small: the train/eval steps of a small model
# compile in well under JAX's default threshold of 1 s, and on a warm start the many small
# programs (parameter init, optimizer init, eager ops) add up too. JAX's own guide does the same.
MIN_COMPILE_TIME_SECS = 0.0
MIN_ENTRY_SIZE_BYTES = -1  # JAX: "-1 disables the size restriction"
_JAX_DEFAULT_MIN_COMPILE_TIME = 1.0
_JAX_DEFAULT_MIN_ENTRY_SIZE = 0
_JAX_DEFAULT_XLA_CACHES = "xla_gpu_per_fusion_autotune_cache_dir"
_OFF = {"0", "false", "off", "no", "none"}
_ON = {"1", "true", "on", "yes"}
_SUFFIX = ".xla"
_TMP_SUFFIX = ".tmp"
_STALE_TMP_SECS = 3600.0
_EVICT_TO = 0.9  # evict down to 90% of the bound, so a full cache is not rescanned on every write
_XLA_SUBDIRS = ("xla_gpu_per_fusion_autotune_cache_dir", "xla_gpu_kernel_cache_file")  # JAX's GPU side caches

log = logging.getLogger(__name__)


class CompileCacheWarning(UserWarning):
    """The persistent compilation cache could not be used as asked; programs are compiled instead."""


@dataclasses.dataclass
class CacheStats:
    """What the installed :class:`DiskCache` did in this process."""

    hits: int = 0
    misses: int = 0
    writes: int = 0
    corrupt: int = 0
    evicted: int = 0
    errors: int = 0
    hit_modules: list[str] = dataclasses.field(default_factory=list)  # e.g. "jit_train_step", in order
    written_modules: list[str] = dataclasses.field(default_factory=list)
    refused: int = 0  # programs the reload guard kept out of the cache (see reload_hazard)
    refused_modules: list[str] = dataclasses.field(default_factory=list)


def _module_name(key: str) -> str:
    return key.rsplit("-", 1)[0] if "-" in key else key


_SAFE_KEY = re.compile(r"[A-Za-z0-9_.-]{1,200}")


class DiskCache:
    """JAX's compilation cache store: one file per cache key in one directory.

    Guarantees: an entry is written to a temporary file and renamed into
    place, so readers in other processes see a whole entry or none; every
    entry carries a SHA-256 of its key and bytes, checked on read, and a
    corrupt entry counts as a miss (it is deleted, and rewritten after the
    recompile); a hit refreshes the file's mtime and the least recently used
    entries are deleted once the files exceed ``max_size`` bytes; with
    ``read_only=True`` nothing is written. No error escapes ``get``/``put``:
    problems go to ``on_problem(message)`` and cost a recompile.
    """

    _MAGIC = b"jaxlight-xla-cache-1\n"

    def __init__(
        self, path: str | os.PathLike, max_size: int = DEFAULT_MAX_SIZE, read_only: bool = False, on_problem=None
    ) -> None:
        if max_size <= 0:
            raise ValueError(f"max_size must be > 0 bytes, got {max_size}")
        self.path = Path(path)
        self._path = self.path  # the attribute JAX's CacheInterface declares (read by jax's reset_cache)
        self.max_size = int(max_size)
        self.read_only = read_only
        self.stats = CacheStats()
        self._on_problem = on_problem
        self._lock = threading.Lock()
        self._size: int | None = None  # bytes of entries, learned on the first write, then tracked

    # -------------------------------------------------------------- layout
    def file_for(self, key: str) -> Path:
        """The entry file of a JAX cache key (keys are ``<module name>-<sha256 hex>``)."""
        name = key if _SAFE_KEY.fullmatch(key) else "h-" + hashlib.sha256(key.encode()).hexdigest()
        return self.path / (name + _SUFFIX)

    def _digest(self, key: str, value: bytes) -> bytes:
        h = hashlib.sha256(key.encode())
        h.update(b"\0")
        h.update(value)
        return h.digest()

    def _problem(self, message: str) -> None:
        self.stats.errors += 1
        if self._on_problem is not None:
            self._on_problem(message)
        else:
            log.warning("%s", message)

    # -------------------------------------------------------------- JAX's CacheInterface
    def get(self, key: str) -> bytes | None:
        """The bytes JAX stored under ``key``, or None (absent, unreadable or corrupt)."""
        f = self.file_for(key)
        try:
            blob = f.read_bytes()
        except FileNotFoundError:
            self.stats.misses += 1
            return None
        except OSError as e:
            self.stats.misses += 1
            self._problem(f"cannot read compile cache entry {f}: {e}")
            return None
        head = len(self._MAGIC) + 32
        value = blob[head:]
        if (
            len(blob) < head
            or not blob.startswith(self._MAGIC)
            or blob[len(self._MAGIC) : head] != self._digest(key, value)
        ):
            self.stats.misses += 1
            self.stats.corrupt += 1
            if not self.read_only:
                try:
                    f.unlink()
                except OSError:
                    pass
            self._problem(
                f"compile cache entry {f} is corrupt ({len(blob)} bytes, digest mismatch); "
                f"recompiling{'' if self.read_only else ' and replacing it'}"
            )
            return None
        if not self.read_only:
            try:
                os.utime(f)  # least recently *used*: a hit keeps the entry
            except OSError:
                pass
        self.stats.hits += 1
        self.stats.hit_modules.append(_module_name(key))
        return value

    def put(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` (replacing any entry), then evict down to the bound if needed."""
        if self.read_only:
            return
        f = self.file_for(key)
        blob = self._MAGIC + self._digest(key, value) + value
        if len(blob) > self.max_size:
            self._problem(
                f"compiled program {_module_name(key)} ({len(blob)} bytes) is larger than the compile cache bound "
                f"({self.max_size} bytes) and is not cached; raise {ENV_MAX_SIZE}"
            )
            return
        tmp = f.with_name(f".{f.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{_TMP_SUFFIX}")
        try:
            with open(tmp, "wb") as fh:
                fh.write(blob)
            os.replace(tmp, f)  # atomic: readers see the old entry, the new one, or none
        except OSError as e:
            try:
                tmp.unlink()
            except OSError:
                pass
            self.read_only = True  # e.g. disk full or permissions changed: stop trying for this process
            self._problem(f"cannot write compile cache entry {f}: {e}; new compilations are no longer saved")
            return
        self.stats.writes += 1
        self.stats.written_modules.append(_module_name(key))
        self._account(len(blob), keep=f.name)

    # -------------------------------------------------------------- size bound
    def entries(self) -> list[tuple[int, str, int]]:
        """``(mtime_ns, file name, bytes)`` of every entry; stale temporary files of dead writers are removed."""
        out = []
        now = time.time()
        try:
            it = list(os.scandir(self.path))
        except OSError:
            return out
        for e in it:
            try:
                if e.name.endswith(_SUFFIX) and e.is_file():
                    st = e.stat()
                    out.append((st.st_mtime_ns, e.name, st.st_size))
                elif e.name.endswith(_TMP_SUFFIX) and e.name.startswith("."):
                    if now - e.stat().st_mtime > _STALE_TMP_SECS and not self.read_only:
                        os.unlink(e.path)
            except OSError:
                pass  # removed by another process meanwhile
        return out

    def _account(self, added: int, keep: str) -> None:
        with self._lock:
            if self._size is None:
                self._size = sum(s for _, _, s in self.entries())
            else:
                self._size += added
            if self._size <= self.max_size:
                return
            entries = sorted(self.entries())
            total = sum(s for _, _, s in entries)
            target = int(self.max_size * _EVICT_TO)
            for _, name, size in entries:  # oldest first
                if total <= target:
                    break
                if name == keep:
                    continue
                try:
                    os.unlink(self.path / name)
                    self.stats.evicted += 1
                except FileNotFoundError:
                    pass  # another process evicted it
                except OSError:
                    continue
                total -= size
            self._size = total


# ------------------------------------------------------------------ configuration
def _parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)i?b?\s*", text.lower())
    if not m:
        raise _misconfigured(f"{ENV_MAX_SIZE}={text!r} is not a size; use bytes or a K/M/G/T suffix, e.g. 8G")
    n = int(m.group(1)) * 1024 ** " kmgt".index(m.group(2) or " ")
    if n <= 0:
        raise _misconfigured(f"{ENV_MAX_SIZE}={text!r} must be > 0 (set {ENV_DIR}=0 to turn the cache off)")
    return n


def default_cache_dir() -> Path | None:
    """The directory ``compile_cache=None``/``True`` uses, or None when ``$JAXLIGHT_COMPILE_CACHE`` turns it off."""
    env = os.environ.get(ENV_DIR, "").strip()
    if env.lower() in _OFF:
        return None
    if env and env.lower() not in _ON:
        return Path(env).expanduser().absolute()
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    root = Path(base).expanduser() if base else Path.home() / ".cache"
    return (root / "jaxlight" / "compile").absolute()


def _max_size() -> int:
    """The size bound: ``$JAXLIGHT_COMPILE_CACHE_MAX_SIZE``, else JAX's ``jax_compilation_cache_max_size``
    when the user set it (0 there means no cache), else :data:`DEFAULT_MAX_SIZE`."""
    import jax

    env = os.environ.get(ENV_MAX_SIZE, "").strip()
    if env:
        return _parse_size(env)
    jax_max = jax.config.jax_compilation_cache_max_size
    return DEFAULT_MAX_SIZE if jax_max < 0 else jax_max


def _misconfigured(message: str) -> ValueError:
    try:  # the Trainer's error type (a ValueError); imported here so the store loads without jaxlight
        from jaxlight.errors import MisconfigurationError
    except ImportError:  # pragma: no cover
        return ValueError(message)
    return MisconfigurationError(message)


def _requested(setting: bool | str | os.PathLike | None) -> Path | None:
    if setting is None or setting is True:
        return default_cache_dir()
    if setting is False:
        return None
    if isinstance(setting, (str, os.PathLike)) and not isinstance(setting, bool):
        text = os.fspath(setting)
        if isinstance(text, bytes):
            text = os.fsdecode(text)
        if not text.strip():
            raise _misconfigured("compile_cache='' is not a directory; pass a path, True (default location) or False")
        return Path(text).expanduser().absolute()
    raise _misconfigured(
        f"compile_cache must be None/True (default location), False (off) or a directory path, "
        f"got {setting!r} ({type(setting).__name__})"
    )


@dataclasses.dataclass
class _State:
    directory: str | None = None  # the cache this module turned on in this process
    store: DiskCache | None = None  # ours, when installed into JAX
    warned: set = dataclasses.field(default_factory=set)


_state = _State()
_config_lock = threading.Lock()


def _warn_once(tag: object, message: str, stacklevel: int = 2) -> None:
    if tag in _state.warned:
        log.info("%s", message)
        return
    _state.warned.add(tag)
    warnings.warn(message, CompileCacheWarning, stacklevel=stacklevel + 1)


def _problem_reporter(directory: str):
    def report(message: str) -> None:
        _warn_once(
            ("problem", directory),
            f"jaxlight compile cache: {message}. Training continues (programs are compiled as without a cache); "
            f"further cache problems in this process are logged to the {__name__!r} logger.",
        )

    return report


def _probe(path: Path) -> tuple[bool, str]:
    """Create ``path`` if needed; return (writable, why not). Raises OSError when it cannot be used at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # Private when we create it: whoever can write a compilation cache can make this user run code.
    path.mkdir(mode=0o700, exist_ok=True)
    os.listdir(path)  # readable
    try:
        fd, name = tempfile.mkstemp(prefix=".probe-", suffix=_TMP_SUFFIX, dir=path)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        return False, str(e)
    return True, ""


def _user_configured() -> str | None:
    """A persistent cache JAX was set up with by someone else (config, env or an initialised cache), else None."""
    import jax

    d = jax.config.jax_compilation_cache_dir
    if d and d != _state.directory:
        return str(d)
    from jaxlight import compat

    cache, path = compat.persistent_cache_in_use()
    if cache is not None and cache is not _state.store:
        return path
    return None


def _install(store: DiskCache) -> str:
    """Make ``store`` JAX's persistent cache: "installed", "unsupported" (JAX's layout differs) or "busy"
    (JAX set its cache up already, e.g. from a directory configured and unset again)."""
    from jaxlight import compat

    return compat.install_persistent_cache(store)


def _set_jax_options() -> None:
    import jax

    # Only JAX's defaults are replaced; a value the user chose is kept.
    if jax.config.jax_persistent_cache_min_compile_time_secs == _JAX_DEFAULT_MIN_COMPILE_TIME:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_SECS)
    if jax.config.jax_persistent_cache_min_entry_size_bytes == _JAX_DEFAULT_MIN_ENTRY_SIZE:
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", MIN_ENTRY_SIZE_BYTES)
    # JAX's default also points XLA's GPU autotuning cache into the cache directory. Those files are
    # written by XLA without the guarantees above (jobs sharing a directory have crashed on them), are
    # not bounded, fail on a read-only directory, and put the directory's path into every cache key,
    # so a moved or read-only copy would never hit. A hit loads the tuned executable anyway.
    if jax.config.jax_persistent_cache_enable_xla_caches == _JAX_DEFAULT_XLA_CACHES:
        jax.config.update("jax_persistent_cache_enable_xla_caches", "none")


# ------------------------------------------------------------------ reload guard
RELOAD_GUARD_SEEN_ON = ("0.10.2",)
"""jax/jaxlib versions on which a reloaded XLA:CPU program was seen to deadlock (issue 37), which is why
:func:`reload_hazard` keeps such programs out of the cache. ``tests/test_compile_cache_rerun.py`` fails
once the installed jax no longer deadlocks, so the guard can be dropped."""

_COLLECTIVE = re.compile(
    r"\s(all-gather|all-reduce|all-to-all|ragged-all-to-all|collective-permute|collective-broadcast|reduce-scatter)"
    r"(?:-start)?\("
)
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")


def reload_hazard(hlo_text: str) -> str | None:
    """Why an XLA:CPU program may deadlock once read back from the persistent cache, or None if it is safe.

    ``hlo_text``: the optimised HLO of the compiled program (``HloModule.to_string()``). XLA:CPU orders
    a program's collectives through one shared "communicator" resource, so every device enters them in
    program order. A program read back from the cache (jax 0.10.2) gets a fresh resource for each nested
    thunk sequence (a while loop's body and condition, a conditional's branches, a call), so a collective
    inside a loop, e.g. a ring's ``collective-permute``, is no longer ordered against the collectives
    outside it; when the executor runs them concurrently, devices enter them in different orders and
    wait for each other forever (measured: ``tests/test_compile_cache_rerun.py``). Collectives that all
    sit in one computation keep their order. So a program is hazardous when collectives appear in two
    or more of its computations.
    """
    where: list[str] = []
    name = None
    for line in hlo_text.splitlines():
        if not line.startswith((" ", "\t")):
            m = _COMPUTATION.match(line)
            name = m.group(1) if m else None
            continue
        if name is not None and name not in where and _COLLECTIVE.search(line):
            where.append(name)
    if len(where) < 2:
        return None
    return (
        f"it has collectives in {len(where)} computations ({', '.join(where[:4])}{', ...' if len(where) > 4 else ''}), "
        f"whose order XLA:CPU loses when it reloads a cached program"
    )


def _refuse_unsafe(module_name: str, executable, backend) -> str | None:
    """The reload guard JAX's cache reads and writes go through (see :func:`reload_hazard`)."""
    if getattr(backend, "platform", None) != "cpu":
        return None  # seen on XLA:CPU's thunk runtime only; other backends' programs are cached as before
    from jaxlight import compat

    try:
        why = next(filter(None, map(reload_hazard, compat.executable_hlo_texts(executable))), None)
    except Exception as e:  # an unreadable program is not cached: it costs a recompile, never a hang
        why = f"its HLO could not be read ({type(e).__name__}: {e})"
    if why is None:
        return None
    store = _state.store
    if store is not None:
        with store._lock:
            store.stats.refused += 1
            store.stats.refused_modules.append(module_name)
            # A refused read was a file hit for the store, but JAX compiles it: count it as a miss.
            if module_name in store.stats.hit_modules and store.stats.hit_modules[-1] == module_name:
                store.stats.hit_modules.pop()
                store.stats.hits -= 1
                store.stats.misses += 1
    log.info("jaxlight compile cache: %s is compiled, not cached: %s", module_name, why)
    return why


def configure_compile_cache(setting: bool | str | os.PathLike | None = None) -> str | None:
    """Turn on the persistent compilation cache for this process; return the directory in use, or None.

    ``setting``: None/True for the default directory (see :func:`default_cache_dir`),
    a path, or False. JAX's cache is process-wide and set up once: the first
    call that turns it on wins; a later call asking for another directory (or
    for False) keeps it and warns once. A cache configured directly through
    JAX is left as it is and returned. A directory that cannot be created or
    read warns once and returns None; one that cannot be written is used for
    reading only (one warning). Raises ValueError for a setting that is not a
    bool, None or path, or a malformed ``$JAXLIGHT_COMPILE_CACHE_MAX_SIZE``.
    """
    import jax

    requested = _requested(setting)
    with _config_lock:
        if not jax.config.jax_enable_compilation_cache:
            if setting is not None and setting is not False:
                _warn_once(
                    ("disabled", str(requested)),
                    f"compile_cache={setting!r} has no effect: JAX's compilation cache is disabled "
                    f"(jax_enable_compilation_cache=False)",
                    stacklevel=3,
                )
            return None
        # Only an explicit choice that cannot be honoured warns; None/True accept the cache already in use.
        explicit = setting is not None and setting is not True
        user = _user_configured()
        if user is not None:
            if explicit and (requested is None or Path(user) != requested):
                _warn_once(
                    ("user", str(requested)),
                    f"compile_cache={setting!r} is ignored: JAX's persistent compilation cache was already set up "
                    f"(at {user}) outside jaxlight, and JAX keeps one cache per process; jaxlight leaves it as it is",
                    stacklevel=3,
                )
            return user
        current = _state.directory
        if current is not None:
            if explicit and (requested is None or Path(current) != requested):
                _warn_once(
                    ("conflict", str(requested)),
                    f"compile_cache={setting!r} is ignored: this process already caches compilations in {current} "
                    f"(set by an earlier Trainer), and JAX's cache is one per process and cannot be moved or turned "
                    f"off once in use; keeping {current}",
                    stacklevel=3,
                )
            return current
        if requested is None:
            return None
        max_size = _max_size()
        if max_size == 0:
            log.info("jaxlight compile cache: off (jax_compilation_cache_max_size=0)")
            return None
        directory = str(requested)
        try:
            writable, why = _probe(requested)
        except OSError as e:
            _warn_once(
                ("unusable", directory),
                f"jaxlight compile cache: cannot use {directory} ({e}); training continues without a persistent "
                f"compilation cache. Set {ENV_DIR} to a writable directory, or compile_cache=False.",
                stacklevel=3,
            )
            return None
        report = _problem_reporter(directory)
        if not writable:
            report(f"{directory} is not writable ({why}): its entries are read, new compilations are not saved")
        store = DiskCache(requested, max_size=max_size, read_only=not writable, on_problem=report)
        how = _install(store)
        if how == "installed":
            _state.store = store
        elif how == "unsupported" and writable:  # pragma: no cover - JAX's own file store, without our guarantees
            log.info("jaxlight compile cache: using JAX's built-in store at %s", directory)
            if jax.config.jax_compilation_cache_max_size < 0 and importlib.util.find_spec("filelock"):
                jax.config.update("jax_compilation_cache_max_size", max_size)  # JAX's LRU needs filelock
        else:  # pragma: no cover
            log.info("jaxlight compile cache: not used (JAX's cache is %s)", how)
            return None
        _set_jax_options()
        # Keeps programs that would deadlock once reloaded (XLA:CPU, issue 37) out of the cache.
        from jaxlight import compat

        if compat.guard_persistent_cache_io(_refuse_unsafe) == "unsupported":  # pragma: no cover
            log.info("jaxlight compile cache: cannot guard JAX's cache reads and writes in this jax")
        # Tells JAX (and other libraries asking it) that a persistent cache is on, and where.
        jax.config.update("jax_compilation_cache_dir", directory)
        _state.directory = directory
        log.info("jaxlight compile cache: %s (max %d bytes, %s)", directory, max_size, "rw" if writable else "ro")
        return directory


def cache_stats() -> CacheStats:
    """A copy of the counters of the cache jaxlight installed in this process (all zero when none)."""
    s = _state.store.stats if _state.store is not None else CacheStats()
    return dataclasses.replace(
        s,
        hit_modules=list(s.hit_modules),
        written_modules=list(s.written_modules),
        refused_modules=list(s.refused_modules),
    )


def clear_compile_cache(directory: str | os.PathLike | None = None) -> tuple[int, int]:
    """Delete the cache's entries (and JAX's GPU side caches) in ``directory`` (default: :func:`default_cache_dir`).

    Only files this module and JAX write there are removed, never the
    directory's other contents. Returns (entries removed, bytes freed).
    """
    path = Path(directory).expanduser() if directory is not None else default_cache_dir()
    if path is None or not path.is_dir():
        return 0, 0
    import shutil

    n = freed = 0
    for e in os.scandir(path):
        if e.is_file() and (e.name.endswith(_SUFFIX) or (e.name.startswith(".") and e.name.endswith(_TMP_SUFFIX))):
            size = e.stat().st_size
            os.unlink(e.path)
            n += e.name.endswith(_SUFFIX)
            freed += size
        elif e.is_dir() and e.name in _XLA_SUBDIRS:
            shutil.rmtree(e.path, ignore_errors=True)
    return n, freed


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jaxlight.compile_cache [info|clear] [--dir DIR]``."""
    p = argparse.ArgumentParser(prog="python -m jaxlight.compile_cache", description="jaxlight's compilation cache")
    p.add_argument("action", nargs="?", default="info", choices=["info", "clear"])
    p.add_argument("--dir", default=None, help=f"cache directory (default: ${ENV_DIR} or the user cache)")
    args = p.parse_args(argv)
    path = Path(args.dir).expanduser() if args.dir else default_cache_dir()
    if path is None:
        print(f"the default compile cache is turned off ({ENV_DIR}={os.environ.get(ENV_DIR)!r})")
        return 0
    if args.action == "clear":
        n, freed = clear_compile_cache(path)
        print(f"removed {n} entries ({freed / 2**20:.1f} MiB) from {path}")
        return 0
    entries = DiskCache(path, read_only=True).entries() if path.is_dir() else []
    total = sum(s for _, _, s in entries)
    try:
        bound = _max_size()
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    print(f"{path}: {len(entries)} entries, {total / 2**20:.1f} MiB (bound {bound / 2**20:.0f} MiB)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
