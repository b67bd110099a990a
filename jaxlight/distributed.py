"""Multi-process runs: start ``jax.distributed`` before anything touches a device.

Every process runs the same script. Call :func:`initialize` first thing
(before creating arrays, models or a Trainer); afterwards ``jax.devices()``
lists the devices of every process, the Trainer builds one global mesh over
them, logs and writes files on process 0 only, and each process reads its own
share of every batch (``Trainer(process_local_batches=True)`` with
:func:`jaxlight.data.data_partition`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxlight import compat


class ClusterSpec(NamedTuple):
    """Where the coordinator is and which process this is."""

    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    source: str  # "arguments", "JAX_* env", "torchrun env", or "jax auto-detect (SLURM, Open MPI, TPU, k8s)"


def _int_env(*names: str) -> int | None:
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            return int(v)
    return None


def detect(
    coordinator_address: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> ClusterSpec | None:
    """Work out the distributed setup from the arguments and the environment.

    Precedence: explicit arguments; ``JAX_COORDINATOR_ADDRESS`` with
    ``JAX_NUM_PROCESSES``/``JAX_PROCESS_ID``; torchrun/Lightning-style
    ``MASTER_ADDR``/``MASTER_PORT``/``WORLD_SIZE``/``RANK`` (under torchrun, whose
    agent holds ``MASTER_PORT``, the coordinator uses ``MASTER_PORT + 1``); then the cluster
    environments JAX detects itself (SLURM, Open MPI, TPU pods, Kubernetes),
    for which the fields are left None for jax to fill. Returns None for a
    plain single-process run.
    """
    if coordinator_address is not None or num_processes is not None or process_id is not None:
        return ClusterSpec(coordinator_address, num_processes, process_id, "arguments")
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return ClusterSpec(
            os.environ["JAX_COORDINATOR_ADDRESS"],
            _int_env("JAX_NUM_PROCESSES"),
            _int_env("JAX_PROCESS_ID"),
            "JAX_* env",
        )
    if os.environ.get("MASTER_ADDR") and os.environ.get("WORLD_SIZE"):
        port = os.environ.get("MASTER_PORT", "29500")
        if os.environ.get("TORCHELASTIC_RUN_ID") and port.isdigit():
            # under torchrun the elastic agent already serves its store on MASTER_PORT: JAX's coordinator
            # takes the next port
            port = str(int(port) + 1)
        return ClusterSpec(
            f"{os.environ['MASTER_ADDR']}:{port}", _int_env("WORLD_SIZE"), _int_env("RANK", "NODE_RANK"), "torchrun env"
        )
    if _cluster_env_present():
        return ClusterSpec(None, None, None, "jax auto-detect (SLURM, Open MPI, TPU, k8s)")
    return None


def _cluster_env_present() -> bool:
    for env in compat.cluster_environments():
        try:
            if env.is_env_present():
                # A SLURM allocation of one task is a single-process run.
                if env.__name__ == "SlurmCluster" and int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
                    continue
                return True
        except Exception:
            continue
    return False


def _backends_started() -> bool:
    return compat.backends_initialized()


def is_initialized() -> bool:
    """True once :func:`initialize` (or ``jax.distributed.initialize``) has run in this process."""
    return bool(jax.distributed.is_initialized())


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: int | Sequence[int] | None = None,
    *,
    initialization_timeout: int = 300,
) -> bool:
    """Join this process to a multi-process JAX run; a no-op for a single process.

    Call it before any JAX computation. With no arguments the setup is read
    from the environment (see :func:`detect`): ``JAX_COORDINATOR_ADDRESS`` /
    ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``, torchrun's ``MASTER_ADDR`` /
    ``MASTER_PORT`` / ``WORLD_SIZE`` / ``RANK``, or what jax detects itself
    (SLURM, Open MPI, TPU pods). Returns True when a multi-process run was
    joined, False when nothing asked for one. Raises a RuntimeError when JAX
    has already started its backends in this process (too late to join) and
    a ValueError when the setup is incomplete.
    """
    if is_initialized():
        return True
    spec = detect(coordinator_address, num_processes, process_id)
    if spec is None:
        return False
    if _backends_started():
        raise RuntimeError(
            "jaxlight.distributed.initialize() must run before any JAX computation, but JAX's backends are "
            "already initialized in this process (an array, a model or a Trainer was created first). Call it "
            "at the top of the script."
        )
    if spec.source != "jax auto-detect (SLURM, Open MPI, TPU, k8s)":
        missing = [
            n
            for n, v in (
                ("coordinator_address", spec.coordinator_address),
                ("num_processes", spec.num_processes),
                ("process_id", spec.process_id),
            )
            if v is None
        ]
        if missing:
            raise ValueError(
                f"distributed setup from {spec.source} is missing {', '.join(missing)} (got {spec._asdict()})"
            )
        if not 0 <= spec.process_id < spec.num_processes:  # type: ignore[operator]
            raise ValueError(f"process_id={spec.process_id} is outside [0, num_processes={spec.num_processes})")
    jax.distributed.initialize(
        coordinator_address=spec.coordinator_address,
        num_processes=spec.num_processes,
        process_id=spec.process_id,
        local_device_ids=local_device_ids,
        initialization_timeout=initialization_timeout,
    )
    return True


def shutdown() -> None:
    """Leave the multi-process run (at the end of a script; optional)."""
    if is_initialized():
        jax.distributed.shutdown()


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


# ------------------------------------------------------------------ agreeing across processes
# Every cross-process exchange in jaxlight goes through these. In a single process each returns its
# input without touching jax.distributed, so callers need no `process_count() == 1` branch.


def broadcast_int(value: int) -> int:
    """Process 0's ``value`` on every process (every process must call it)."""
    if jax.process_count() == 1:
        return int(value)
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def broadcast_bool(flag: bool) -> bool:
    """Process 0's ``flag`` on every process (every process must call it)."""
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.bool_(flag)))


def gather_ints(value: int) -> list[int]:
    """Every process's ``value``, indexed by process (every process must call it)."""
    if jax.process_count() == 1:
        return [int(value)]
    from jax.experimental import multihost_utils

    return [int(v) for v in np.asarray(multihost_utils.process_allgather(np.int32(value))).reshape(-1)]


def processes_where(flag: bool) -> list[int]:
    """The indices of the processes whose ``flag`` is True (every process must call it)."""
    return [i for i, f in enumerate(gather_ints(int(bool(flag)))) if f]


def gather_bytes(blob: bytes | None) -> list[bytes | None]:
    """Every process's ``blob`` (None where a process had none to give), indexed by process.

    Sizes go first, then one padded gather; a process passing None is reported as None everywhere,
    so no process is left waiting in the second gather."""
    sizes = gather_ints(-1 if blob is None else len(blob))
    if jax.process_count() == 1:
        return [blob]
    from jax.experimental import multihost_utils

    padded = np.zeros(max(max(sizes), 1), np.uint8)
    if blob:
        padded[: len(blob)] = np.frombuffer(blob, np.uint8)
    every = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    return [None if n < 0 else every[i, :n].tobytes() for i, n in enumerate(sizes)]


def _client(what: str) -> Any:
    client = compat.distributed_client()
    if client is None:
        raise RuntimeError(f"{what} in a multi-process run needs jax.distributed.initialize() first")
    return client


def broadcast_str(value: str, key: str, timeout_s: float = 300.0) -> str:
    """Process 0's string on every process, through the coordination service's key-value store.

    ``key`` must be unique for each exchange of a run (a fresh key per call)."""
    if jax.process_count() == 1:
        return value
    client = _client("broadcast_str")
    if jax.process_index() == 0:
        client.key_value_set(key, value)
        return value
    return client.blocking_key_value_get(key, int(timeout_s * 1000))


def barrier(name: str, timeout_s: float = 300.0) -> None:
    """Wait until every process reaches the barrier ``name`` (unique per use), through the coordination
    service; raises the service's error after ``timeout_s``. A no-op in a single process."""
    if jax.process_count() == 1:
        return
    _client("barrier").wait_at_barrier(name, int(timeout_s * 1000))


class ProcessesNotResponding(RuntimeError):
    """Processes that did not reach a :func:`wait_for_processes` within its timeout.

    ``missing``: the process indices that did not arrive; ``gone``: those of them the coordination
    service no longer hears from (dead, or cut off), as far as it could tell."""

    def __init__(self, name: str, waited_s: float, missing: Sequence[int], gone: Sequence[int]) -> None:
        self.name, self.waited_s, self.missing, self.gone = name, waited_s, list(missing), list(gone)
        alive = [p for p in self.missing if p not in self.gone]
        parts = []
        if self.gone:
            parts.append(f"process(es) {self.gone} stopped answering the coordination service (dead?)")
        if alive:
            parts.append(f"process(es) {alive} are alive but did not arrive (stuck?)")
        super().__init__(
            f"process {jax.process_index()} waited {waited_s:.0f} s at {name!r} for {self.missing}: {'; '.join(parts)}"
        )


class Heartbeat:
    """A beat every ``interval_s`` seconds in the coordination service's key-value store, so that any
    process can tell which peers are gone (their beat stopped) from those alive but stuck.

    A background thread publishes this process's beat and reads everyone's (two small RPCs per
    interval, during ``fit`` only); :meth:`gone` reads what it saw, without waiting. A process whose
    main thread is blocked in a collective still beats: only a dead or cut-off process stops. A no-op
    in a single process.
    """

    def __init__(self, namespace: str, interval_s: float = 1.0) -> None:
        self.namespace, self.interval_s = namespace, interval_s
        self._stop = threading.Event()
        self._moved_at: dict[int, float] = {}
        self._values: dict[int, str] = {}
        self._started = self._answered_at = time.monotonic()
        self._thread: threading.Thread | None = None

    def start(self) -> Heartbeat:
        if jax.process_count() > 1 and self._thread is None:
            self._started = self._answered_at = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="jaxlight-heartbeat", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 1.0)

    def _run(self) -> None:
        client, me, beat = compat.distributed_client(), jax.process_index(), 0
        if client is None:
            return
        while True:
            beat += 1
            try:
                client.key_value_set(f"{self.namespace}/{me}", str(beat), allow_overwrite=True)
                seen = client.key_value_dir_get(f"{self.namespace}/")
                now = self._answered_at = time.monotonic()
                for key, value in seen:
                    p = int(key.rsplit("/", 1)[-1])
                    if self._values.get(p) != value:
                        self._values[p], self._moved_at[p] = value, now
            except Exception:  # the coordinator does not answer: gone() says so once it is stale
                pass
            if self._stop.wait(self.interval_s):
                return

    def gone(self, stale_s: float | None = None) -> list[int] | None:
        """The other processes whose beat has not moved for ``stale_s`` seconds (default: 5 intervals,
        at least 5 s); None when the coordination service itself has not answered for that long (it
        runs in process 0, which may be the one gone). [] in a single process."""
        if self._thread is None:
            return []
        stale = max(5 * self.interval_s, 5.0) if stale_s is None else stale_s
        now = time.monotonic()
        if now - self._answered_at > stale:
            return None
        me = jax.process_index()
        return [p for p in range(jax.process_count()) if p != me and now - self._moved_at.get(p, self._started) > stale]


def wait_for_processes(
    name: str, timeout_s: float = 300.0, heartbeat: Heartbeat | None = None, poll_s: float = 0.05
) -> None:
    """Wait until every process has called ``wait_for_processes(name)`` (a barrier; ``name`` unique per use).

    Unlike :func:`barrier`, a timeout says who is missing: raises :class:`ProcessesNotResponding` naming
    the processes that did not arrive within ``timeout_s`` and, with a running ``heartbeat``, which of
    them are gone (it stops waiting as soon as one is). A no-op in a single process."""
    n = jax.process_count()
    if n == 1:
        return
    client = _client("wait_for_processes")
    client.key_value_set(f"{name}/{jax.process_index()}", "1")
    started = time.monotonic()
    deadline = started + timeout_s
    arrived: set[int] = set()
    while True:
        try:
            arrived = {int(k.rsplit("/", 1)[-1]) for k, _ in client.key_value_dir_get(f"{name}/")}
        except Exception:  # the coordinator is unreachable: nobody can be seen arriving
            pass
        gone = heartbeat.gone() if heartbeat is not None else []
        if len(arrived) >= n or time.monotonic() >= deadline or gone is None or set(gone) - arrived:
            break
        time.sleep(poll_s)
    missing = sorted(set(range(n)) - arrived)
    if missing:
        gone = heartbeat.gone() if heartbeat is not None else []
        raise ProcessesNotResponding(name, time.monotonic() - started, missing, missing if gone is None else gone)


def kv_set(key: str, value: str) -> None:
    """Publish ``value`` under ``key`` in the coordination service (multi-process runs only)."""
    _client("kv_set").key_value_set(key, value)


def kv_try_get(key: str) -> str | None:
    """The value under ``key`` if some process published it, else None; never waits."""
    client = compat.distributed_client()
    if client is None:
        return None
    try:
        return client.key_value_try_get(key)
    except Exception:  # the service answers "not found" with an error
        return None


__all__ = [
    "ClusterSpec",
    "Heartbeat",
    "ProcessesNotResponding",
    "barrier",
    "broadcast_bool",
    "broadcast_int",
    "broadcast_str",
    "detect",
    "gather_bytes",
    "gather_ints",
    "initialize",
    "is_initialized",
    "kv_set",
    "kv_try_get",
    "process_count",
    "process_index",
    "processes_where",
    "shutdown",
    "wait_for_processes",
]
