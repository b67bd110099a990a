"""A stand-in for Slurm's ``srun`` on one machine, for running examples/clusters/slurm.sbatch in the tests.

``srun [options] command args...`` inside an allocation described by the batch environment
(``SLURM_JOB_ID``, ``SLURM_NNODES``, ``SLURM_NTASKS``, ``SLURM_JOB_NODELIST``) starts
``SLURM_NTASKS`` local copies of the command with the variables real srun gives each task of a
step (``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_STEP_NODELIST``,
``SLURM_STEP_NUM_NODES``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_STEPID``), forwards SIGTERM/SIGINT to
them, kills the rest when one fails (``--kill-on-bad-exit``), and exits with the highest status.
Options it does not know are ignored; ``-n/--ntasks`` overrides the task count.
"""

import os
import signal
import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    ntasks = int(os.environ["SLURM_NTASKS"])
    kill_on_bad_exit = False
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        opt = argv[i]
        if opt in ("-n", "--ntasks"):
            ntasks, i = int(argv[i + 1]), i + 2
            continue
        if opt.startswith("--ntasks="):
            ntasks = int(opt.split("=", 1)[1])
        if opt.startswith("--kill-on-bad-exit") or opt == "-K":
            kill_on_bad_exit = not opt.endswith("=0")
        i += 1
    cmd = argv[i:]
    nnodes = int(os.environ.get("SLURM_NNODES", "1"))
    per_node = max(ntasks // nnodes, 1)
    procs = []
    for rank in range(ntasks):
        env = dict(os.environ)
        env.update(
            SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank % per_node),
            SLURM_NODEID=str(rank // per_node),
            SLURM_STEP_NODELIST=os.environ["SLURM_JOB_NODELIST"],
            SLURM_STEP_NUM_NODES=str(nnodes),
            SLURM_STEP_NUM_TASKS=str(ntasks),
            SLURM_NTASKS=str(ntasks),
            SLURM_STEPID="0",
        )
        procs.append(subprocess.Popen(cmd, env=env))

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while any(p.poll() is None for p in procs):
        if kill_on_bad_exit and any(p.returncode not in (None, 0) for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.1)
    codes = [128 - p.returncode if p.returncode < 0 else p.returncode for p in procs]
    return max(codes)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
