"""A process for the launcher escalation tests (tests/test_adversary_loop.py); imports no JAX.

Usage: python tests/adversary_launch_worker.py MODE OUT_DIR
Writes OUT_DIR/rank_<i>.json ({"pid": ...}), ignores SIGTERM (only SIGKILL stops it), then:
  stubborn   every rank waits (at most 60 s)
  fail       rank 1 exits with status 3 once every rank has started (OUT_DIR/failed_at: when); the others wait
"""

import json
import os
import signal
import sys
import time

mode, out = sys.argv[1], sys.argv[2]
rank = int(os.environ["JAX_PROCESS_ID"])
signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(os.path.join(out, f"rank_{rank}.json"), "w") as f:
    json.dump({"pid": os.getpid(), "started": time.time()}, f)
if mode == "fail" and rank == 1:  # once every rank ignores SIGTERM (each writes its file after that)
    n = int(os.environ["JAX_NUM_PROCESSES"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(
        os.path.exists(os.path.join(out, f"rank_{i}.json")) for i in range(n)
    ):
        time.sleep(0.02)
    with open(os.path.join(out, "failed_at"), "w") as f:
        f.write(str(time.time()))
    sys.exit(3)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(0)
