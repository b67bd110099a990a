"""A process for the launcher tests (tests/test_launch.py); imports no JAX.

Usage: python tests/launch_child.py MODE OUT_DIR
Prints its launch environment on stdout and a line on stderr, writes OUT_DIR/rank_<i>.json, then:
  ok     exit 0
  fail   rank 1 exits with status 3 at once; the others wait for a signal
  wait   wait for a signal (SIGTERM/SIGINT/SIGUSR1: record it in OUT_DIR/signal_<i>, exit 143)
  stubborn  rank 1 exits with status 5; the others ignore SIGTERM (only SIGKILL stops them)
  raise  rank 1 raises RuntimeError("plain 7") (an uncaught traceback, status 1); the others wait for a signal
"""

import json
import os
import signal
import sys
import time

mode, out = sys.argv[1], sys.argv[2]
rank = int(os.environ["JAX_PROCESS_ID"])
info = {
    k: os.environ.get(k)
    for k in (
        "JAX_COORDINATOR_ADDRESS",
        "JAX_NUM_PROCESSES",
        "JAX_PROCESS_ID",
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "XLA_FLAGS",
        "CUDA_VISIBLE_DEVICES",
        "MASTER_ADDR",
    )
}
info.update(pid=os.getpid(), pgid=os.getpgid(0), sid=os.getsid(0))


# the handlers go in before the ready file appears: the tests signal as soon as they see it
def on_signal(signum, frame):
    with open(os.path.join(out, f"signal_{rank}"), "w") as f:
        f.write(str(signum))
    print(f"rank {rank} got signal {signum}", flush=True)
    sys.exit(143)


for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
    signal.signal(s, on_signal)
if mode == "stubborn" and rank != 1:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
tmp = os.path.join(out, f".rank_{rank}.json.tmp")
with open(tmp, "w") as f:
    json.dump(info, f)
os.replace(tmp, os.path.join(out, f"rank_{rank}.json"))  # whole or absent
print(f"ready {rank} on stdout", flush=True)
print(f"note {rank} on stderr", file=sys.stderr, flush=True)
if mode == "ok":
    sys.exit(0)
if mode == "raise" and rank == 1:
    raise RuntimeError("plain 7")
if mode in ("fail", "stubborn") and rank == 1:
    sys.exit(3 if mode == "fail" else 5)
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(0)
