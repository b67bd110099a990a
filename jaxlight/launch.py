"""``jaxlight launch``: run one script as N local processes of one multi-process JAX run.

``jaxlight launch --nprocs N [--devices-per-process K] script.py args...`` starts N copies
of ``python script.py args...``. Each gets the coordinator environment that
:func:`jaxlight.distributed.initialize` reads (``JAX_COORDINATOR_ADDRESS`` on a free
localhost port, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``; also ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``) and its own devices: on CPU ``K`` simulated devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=K``), on an NVIDIA GPU host its own
``K`` GPUs (``CUDA_VISIBLE_DEVICES``). Every line a process prints is prefixed with
``[rank i]``. SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 sent to the launcher are
forwarded to every process (each runs in its own process group), so a scheduler's
preemption signal reaches all of them; a second SIGINT kills them. Either way the launcher escalates
once: processes still running ``--grace-period`` seconds after a forwarded SIGTERM, SIGINT or SIGHUP
get SIGKILL (so the grace period must cover a preemption checkpoint's save); when a process exits
with a non-zero status, the others get ``--grace-period`` seconds to exit on their own, then SIGTERM
and, ``TERM_TO_KILL_S`` seconds later, SIGKILL (with a peer gone no checkpoint can be written, so
nothing is worth a second grace period). The launcher exits with the first non-zero status (128 + N
for a process killed by signal N), or 0.

When a process fails, the launcher first prints which one and why: ``jaxlight launch: rank R failed
(exit status S): Type: message`` followed by that rank's traceback. A rank that raised in a Trainer
entry point says so itself (``jaxlight: rank R failed: ...``, see :mod:`jaxlight.rank_failure`), and
the others then stop within seconds; that rank is the one reported, and its status is the launch's,
even when a peer it stopped exited first. Otherwise the first process to exit non-zero is reported,
with the last Python traceback among its final stderr lines, if any.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

DESCRIPTION = (
    "Run a script as N local processes of one multi-process JAX run. Each process gets the coordinator "
    "environment jaxlight.distributed.initialize() reads and its own devices; output lines are prefixed with "
    "the rank; signals to the launcher reach every process; the exit status is the first non-zero one."
)

EPILOG = """\
examples:
  jaxlight launch --nprocs 2 --devices-per-process 4 examples/gpt_cli.py fit --config examples/gpt_cli.yaml
  jaxlight launch --nprocs 1 --devices-per-process 8 train.py     # 8 simulated CPU devices in one process
  jaxlight launch --nprocs 8 -m mypackage.train --lr 1e-3          # one process per GPU of an 8-GPU host
The script must call jaxlight.distributed.initialize() (LightningCLI does) before it uses JAX."""

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
STOPPING_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # SIGUSR1/2 are notices: nothing escalates
DEFAULT_GRACE_PERIOD = 30.0
TERM_TO_KILL_S = 2.0  # after a failure: from the launcher's own SIGTERM to SIGKILL
_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count(=\S*)?")
# What a failing rank prints (jaxlight.rank_failure.header / footer; not imported: it imports jax).
_FAILURE_HEADER = re.compile(r"^jaxlight: rank (\d+) failed: (.*)$")
_FAILURE_FOOTER = "jaxlight: end of rank {rank}'s traceback"
TAIL_LINES = 200  # stderr lines kept per rank, to show a failed rank's traceback
REPORT_LINES = 400  # at most this many lines of a rank's own failure report are kept


class LaunchError(ValueError):
    """Arguments the launcher cannot run (said before any process starts)."""


# ---------------------------------------------------------------------------- environment
def free_port(host: str = "localhost") -> int:
    """A TCP port that is free on ``host`` now (the coordinator binds it moments later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def visible_gpus(env: Mapping[str, str]) -> list[str]:
    """The NVIDIA GPUs processes started with ``env`` may use, as ``CUDA_VISIBLE_DEVICES`` entries.

    ``CUDA_VISIBLE_DEVICES`` when set (Slurm and container runtimes set it), else the GPUs the
    driver lists in ``/proc/driver/nvidia/gpus``. Nothing is initialized: the launcher never
    touches a device itself.
    """
    if "CUDA_VISIBLE_DEVICES" in env:
        ids = [x.strip() for x in env["CUDA_VISIBLE_DEVICES"].split(",")]
        out = []
        for x in ids:
            if not x or x == "-1":  # CUDA stops at the first invalid entry
                break
            out.append(x)
        return out
    try:
        n = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return []
    return [str(i) for i in range(n)]


def resolve_accelerator(accelerator: str, env: Mapping[str, str]) -> str:
    """``"cpu"`` or ``"gpu"``: ``auto`` is gpu when a GPU is visible and ``JAX_PLATFORMS`` allows it."""
    if accelerator not in ("auto", "cpu", "gpu"):
        raise LaunchError(f"--accelerator {accelerator!r}: choose auto, cpu or gpu")
    if accelerator != "auto":
        return accelerator
    platforms = [p.strip() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms and not {"cuda", "gpu"} & set(platforms):
        return "cpu"
    return "gpu" if visible_gpus(env) else "cpu"


def device_assignment(
    nprocs: int, devices_per_process: int | None, accelerator: str, env: Mapping[str, str]
) -> list[dict[str, str]]:
    """The device variables of each process: ``XLA_FLAGS`` (CPU) or ``CUDA_VISIBLE_DEVICES`` (GPU).

    On GPU each process gets its own ``devices_per_process`` GPUs (default: the visible GPUs split
    evenly); asking for more GPUs than are visible raises a :class:`LaunchError` with the numbers.
    On CPU each process simulates ``devices_per_process`` devices (default: whatever ``XLA_FLAGS``
    already says, one device when it says nothing).
    """
    if nprocs < 1:
        raise LaunchError(f"--nprocs must be >= 1, got {nprocs}")
    if devices_per_process is not None and devices_per_process < 1:
        raise LaunchError(f"--devices-per-process must be >= 1, got {devices_per_process}")
    kind = resolve_accelerator(accelerator, env)
    if kind == "gpu":
        gpus = visible_gpus(env)
        k = devices_per_process if devices_per_process is not None else len(gpus) // nprocs
        if k < 1 or nprocs * k > len(gpus):
            raise LaunchError(
                f"--nprocs {nprocs} x --devices-per-process {devices_per_process or k} = {nprocs * max(k, 1)} GPUs "
                f"requested but {len(gpus)} are visible ({'CUDA_VISIBLE_DEVICES=' + env['CUDA_VISIBLE_DEVICES'] if 'CUDA_VISIBLE_DEVICES' in env else 'from /proc/driver/nvidia/gpus'})"
            )
        return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * k : (i + 1) * k])} for i in range(nprocs)]
    out: list[dict[str, str]] = []
    for _ in range(nprocs):
        d: dict[str, str] = {}
        if devices_per_process is not None:
            flags = _DEVICE_COUNT_FLAG.sub("", env.get("XLA_FLAGS", "")).split()
            d["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices_per_process}"])
        if accelerator == "cpu":
            d["JAX_PLATFORMS"] = "cpu"
        out.append(d)
    return out


def child_env(
    rank: int, nprocs: int, coordinator: str, devices: Mapping[str, str], base: Mapping[str, str]
) -> dict[str, str]:
    """The environment of process ``rank``: ``base`` with the coordinator variables and its devices.

    Inherited ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` /
    ``JAX_LOCAL_DEVICE_IDS`` and torchrun variables are replaced, so a launcher started inside
    another run's environment (a Slurm step, a torchrun worker) starts a run of its own.
    """
    env = {
        k: v
        for k, v in base.items()
        if k not in ("JAX_LOCAL_DEVICE_IDS", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_WORLD_SIZE")
    }
    env.update(
        JAX_COORDINATOR_ADDRESS=coordinator,
        JAX_NUM_PROCESSES=str(nprocs),
        JAX_PROCESS_ID=str(rank),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nprocs),
        PYTHONUNBUFFERED="1",  # lines reach the prefixer as they are printed
    )
    env.update(devices)
    return env


# ---------------------------------------------------------------------------- running
def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _set_pdeathsig() -> None:  # pragma: no cover - runs in the child between fork and exec
    # Linux: the child gets SIGKILL if the launcher dies without forwarding (e.g. SIGKILL), so no
    # process is left holding devices. Children run in their own session and would survive otherwise.
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class Launcher:
    """Starts, watches and stops the processes of one launch; :meth:`run` returns the exit status."""

    def __init__(
        self,
        cmd: Sequence[str],
        nprocs: int,
        devices_per_process: int | None = None,
        *,
        accelerator: str = "auto",
        port: int | None = None,
        grace_period: float = DEFAULT_GRACE_PERIOD,
        prefix: bool = True,
        env: Mapping[str, str] | None = None,
        stdout: IO[bytes] | None = None,
        stderr: IO[bytes] | None = None,
    ) -> None:
        if not cmd:
            raise LaunchError("nothing to launch: give a script (or -m module) and its arguments")
        if grace_period < 0:
            raise LaunchError(f"--grace-period must be >= 0, got {grace_period}")
        base = dict(os.environ if env is None else env)
        devices = device_assignment(nprocs, devices_per_process, accelerator, base)
        if port is not None and not 0 < port < 65536:
            raise LaunchError(f"--port {port} is not a TCP port")
        self.coordinator = f"localhost:{port if port is not None else free_port()}"
        self.cmd = list(cmd)
        self.nprocs = nprocs
        self.envs = [child_env(i, nprocs, self.coordinator, devices[i], base) for i in range(nprocs)]
        self.grace_period = grace_period
        self.prefix = prefix
        self.stdout = stdout if stdout is not None else sys.stdout.buffer
        self.stderr = stderr if stderr is not None else sys.stderr.buffer
        self.procs: list[subprocess.Popen] = []
        self.exit_codes: list[int | None] = [None] * nprocs
        self.first_failure: tuple[int, int] | None = None  # (rank, status)
        self.signals_received: list[int] = []
        self._kill_at: float | None = None  # when the processes still running get SIGKILL (one escalation)
        self._lock = threading.Lock()
        self._pumps: list[threading.Thread] = []
        self._rank_pumps: dict[int, list[threading.Thread]] = {}
        self._tails: list[collections.deque[str]] = [collections.deque(maxlen=TAIL_LINES) for _ in range(nprocs)]
        # rank -> (summary, traceback lines, footer seen) of the failure it reported itself, in arrival order
        self._reports: dict[int, tuple[str, list[str], bool]] = {}

    # -- output
    def _pump(self, rank: int, pipe: IO[bytes], sink: IO[bytes], is_stderr: bool = False) -> None:
        tag = f"[rank {rank}] ".encode() if self.prefix else b""
        for line in iter(pipe.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            if is_stderr:
                self._note(rank, line.decode(errors="replace").rstrip("\r\n"))
            with self._lock:
                try:
                    sink.write(tag + line)
                    sink.flush()
                except (OSError, ValueError):  # our own output closed: keep draining the child's pipe
                    pass
        pipe.close()

    def _note(self, rank: int, text: str) -> None:
        """Keep a stderr line of ``rank``: its tail, and its own failure report (header to footer)."""
        self._tails[rank].append(text)
        report = self._reports.get(rank)
        if report is None:
            m = _FAILURE_HEADER.match(text)
            if m and int(m.group(1)) == rank:
                self._reports[rank] = (m.group(2), [], False)
        elif not report[2]:
            if text == _FAILURE_FOOTER.format(rank=rank):
                self._reports[rank] = (report[0], report[1], True)
            elif len(report[1]) < REPORT_LINES:
                report[1].append(text)

    def failed_rank(self) -> int | None:
        """The rank whose failure ended the run: the first that reported one itself, else the first to exit
        non-zero (None while none has)."""
        if self._reports:
            return next(iter(self._reports))
        return self.first_failure[0] if self.first_failure else None

    def _failure_summary(self) -> str:
        """The block printed at the first failure: the failed rank, its status and error, its traceback."""
        rank = self.failed_rank()
        assert rank is not None
        status = self.exit_codes[rank]
        said = f"rank {rank} failed" + (f" (exit status {status})" if status is not None else "")
        if rank in self._reports:
            summary, lines, _ = self._reports[rank]
            return "\n".join([f"{said}: {summary}", *lines])
        tail = list(self._tails[rank])
        starts = [i for i, t in enumerate(tail) if t.startswith("Traceback (most recent call last):")]
        lines = tail[starts[-1] :] if starts else []
        error = next((t for t in reversed(lines) if t and not t[0].isspace()), None) if lines else None
        return "\n".join([f"{said}" + (f": {error}" if error else ""), *lines])

    def _say(self, msg: str) -> None:
        with self._lock:
            try:
                self.stderr.write(f"jaxlight launch: {msg}\n".encode())
                self.stderr.flush()
            except (OSError, ValueError):
                pass

    # -- signals
    def _signal_all(self, sig: int) -> None:
        for rank, p in enumerate(self.procs):
            if self.exit_codes[rank] is None and p.poll() is None:
                try:
                    os.killpg(p.pid, sig)  # the child's whole process group (its own workers too)
                except ProcessLookupError:
                    pass

    def _on_signal(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and signal.SIGINT in self.signals_received:
            self._signal_all(signal.SIGKILL)  # a second Ctrl-C: stop waiting
        else:
            self._signal_all(signum)
        if signum in STOPPING_SIGNALS and self._kill_at is None:
            self._kill_at = time.monotonic() + self.grace_period
        self.signals_received.append(signum)

    # -- the run
    def start(self) -> None:
        """Start every process (all before any output thread: the fork runs no Python code)."""
        for env in self.envs:
            self.procs.append(
                subprocess.Popen(
                    self.cmd,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                    preexec_fn=_set_pdeathsig if sys.platform.startswith("linux") else None,
                )
            )
        for rank, p in enumerate(self.procs):
            for pipe, sink, is_stderr in ((p.stdout, self.stdout, False), (p.stderr, self.stderr, True)):
                t = threading.Thread(target=self._pump, args=(rank, pipe, sink, is_stderr), daemon=True)
                t.start()
                self._pumps.append(t)
                self._rank_pumps.setdefault(rank, []).append(t)

    def wait(self, poll_interval: float = 0.05) -> int:
        """Wait for every process; stop the others after a failure; return the launch's exit status."""
        term_at: float | None = None  # after a failure: when the others get SIGTERM
        while any(c is None for c in self.exit_codes):
            for rank, p in enumerate(self.procs):
                if self.exit_codes[rank] is None and (rc := p.poll()) is not None:
                    status = _exit_status(rc)
                    self.exit_codes[rank] = status
                    if status != 0 and self.first_failure is None:
                        self.first_failure = (rank, status)
                        left = sum(c is None for c in self.exit_codes)
                        for t in self._rank_pumps.get(rank, []):  # its last lines (its traceback) first
                            t.join(timeout=2.0)
                        if self._reports or not self.signals_received:
                            self._say(self._failure_summary())
                        if self.signals_received:
                            # we forwarded a signal: the others are stopping (maybe saving a checkpoint) on their own
                            continue
                        if left:
                            self._say(
                                f"rank {rank} exited with status {status}; stopping the other {left} process(es) "
                                f"if they have not exited within {self.grace_period:g} s (SIGTERM, then SIGKILL "
                                f"{TERM_TO_KILL_S:g} s later)"
                            )
                            term_at = time.monotonic() + self.grace_period
            if term_at is not None and time.monotonic() >= term_at:
                self._signal_all(signal.SIGTERM)
                term_at = None
                if self._kill_at is None:
                    self._kill_at = time.monotonic() + TERM_TO_KILL_S
            if self._kill_at is not None and time.monotonic() >= self._kill_at:
                running = [r for r, c in enumerate(self.exit_codes) if c is None and self.procs[r].poll() is None]
                if running:
                    self._say(f"rank(s) {running} still running: SIGKILL")
                self._signal_all(signal.SIGKILL)
                self._kill_at = None
            time.sleep(poll_interval)
        for t in self._pumps:
            t.join(timeout=5.0)
        rank = self.failed_rank()
        if rank is not None and self.exit_codes[rank]:
            return int(self.exit_codes[rank])  # the failed rank's status, not that of a peer it stopped first
        return self.first_failure[1] if self.first_failure else 0

    def run(self) -> int:
        """Start the processes, forward signals while they run, return the exit status."""
        in_main = threading.current_thread() is threading.main_thread()
        previous = {s: signal.signal(s, self._on_signal) for s in FORWARDED_SIGNALS} if in_main else {}
        try:
            self.start()
            return self.wait()
        finally:
            if any(c is None for c in self.exit_codes):  # interrupted by an exception: leave nothing behind
                self._signal_all(signal.SIGKILL)
            for s, h in previous.items():
                signal.signal(s, h)


def launch(
    cmd: Sequence[str],
    nprocs: int,
    devices_per_process: int | None = None,
    *,
    accelerator: str = "auto",
    port: int | None = None,
    grace_period: float = DEFAULT_GRACE_PERIOD,
    prefix: bool = True,
) -> int:
    """Run ``cmd`` as ``nprocs`` processes of one multi-process run; returns the exit status (see the module doc)."""
    return Launcher(
        cmd,
        nprocs,
        devices_per_process,
        accelerator=accelerator,
        port=port,
        grace_period=grace_period,
        prefix=prefix,
    ).run()


# ---------------------------------------------------------------------------- command line
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``jaxlight launch``."""
    p.add_argument("--nprocs", type=int, required=True, help="number of processes to start")
    p.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        metavar="K",
        help="devices of each process: K simulated CPU devices, or K GPUs of this host "
        "(default on GPU: the visible GPUs split evenly; on CPU: XLA_FLAGS as inherited)",
    )
    p.add_argument(
        "--accelerator",
        default="auto",
        choices=("auto", "cpu", "gpu"),
        help="auto: gpu when an NVIDIA GPU is visible and JAX_PLATFORMS allows it",
    )
    p.add_argument("--port", type=int, default=None, help="coordinator port on localhost (default: a free one)")
    p.add_argument(
        "--grace-period",
        type=float,
        default=DEFAULT_GRACE_PERIOD,
        metavar="SECONDS",
        help="how long processes may run after a forwarded SIGTERM/SIGINT/SIGHUP before SIGKILL (leave time for a "
        "preemption checkpoint), or after another process failed before SIGTERM (default: %(default)s)",
    )
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with [rank i]")
    how = p.add_mutually_exclusive_group()
    how.add_argument("-m", "--module", action="store_true", help="run the target as a module (python -m)")
    how.add_argument("--no-python", action="store_true", help="run the target as an executable, not with python")
    p.add_argument("script", help="the training script (or module with -m, executable with --no-python)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to every process")


def run_from_args(args: argparse.Namespace) -> int:
    """``jaxlight launch`` with parsed arguments; returns the exit status (2 for bad arguments)."""
    if args.no_python:
        cmd = [args.script, *args.script_args]
    elif args.module:
        cmd = [sys.executable, "-m", args.script, *args.script_args]
    else:
        if not os.path.isfile(args.script):
            print(f"jaxlight launch: script {args.script!r} does not exist", file=sys.stderr)
            return 2
        cmd = [sys.executable, args.script, *args.script_args]
    try:
        launcher = Launcher(
            cmd,
            args.nprocs,
            args.devices_per_process,
            accelerator=args.accelerator,
            port=args.port,
            grace_period=args.grace_period,
            prefix=not args.no_prefix,
        )
    except LaunchError as e:
        print(f"jaxlight launch: {e}", file=sys.stderr)
        return 2
    return launcher.run()


__all__ = ["LaunchError", "Launcher", "child_env", "device_assignment", "free_port", "launch", "visible_gpus"]
