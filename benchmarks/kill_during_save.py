"""kill -9 during asynchronous checkpoint saves, repeated: how many runs lose nothing.

Each run starts ``tests/checkpoint_kill_worker.py``: a small fit saving a checkpoint every step with
``async_save=True``, where a save takes longer than a step (so one is nearly always being written and the
next waits for it). After a random delay the process gets SIGKILL. The directory is then checked as it was
left:

- ``last.ckpt`` resolves to a complete checkpoint holding the newest step among the complete checkpoints
  (the issue's bug: it lagged many saves behind);
- at most ``save_top_k`` + 1 complete checkpoints besides ``last`` (one committed, its removals pending);

and the run is resumed from the ``last.ckpt`` *path* (what a user passes by hand). A run "lost nothing" when
the checks hold and the resume starts at the newest committed step. The configurations rotate through
``save_last`` True / "link" and the three top-k regimes.

Run: python benchmarks/kill_during_save.py [--runs 20] [--seed 0] [--max-delay 3.0]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import jaxlight as jl  # noqa: E402
from tests.test_checkpoint_bookkeeping import Worker  # noqa: E402

# (save_last, monitor, save_top_k)
CONFIGS = [(True, "train_loss", 2), ("link", None, 1), ("link", "score", 2), (True, None, 1)]


def _step(path: str) -> int:
    return int(jl.checkpoint.read_meta(path)["global_step"])


def inspect(ckdir: str, top_k: int) -> dict:
    """What the killed run left (the writer is dead: nothing changes while this reads)."""
    complete = [str(p) for p in jl.checkpoint.list_checkpoints(ckdir)]
    last = os.path.join(ckdir, "last.ckpt")
    names = os.listdir(ckdir) if os.path.isdir(ckdir) else []
    out = {
        "newest": max((_step(p) for p in complete), default=None),
        "last": None,
        "others": len([p for p in complete if os.path.basename(p) != "last.ckpt"]),
        "partial": sum(".orbax-checkpoint-tmp" in n for n in names),
        "problems": [],
    }
    if complete:
        if not os.path.exists(last) or not jl.checkpoint.is_complete(os.path.realpath(last)):
            out["problems"].append("last.ckpt does not resolve to a complete checkpoint")
        else:
            out["last"] = _step(os.path.realpath(last))
            if out["last"] != out["newest"]:
                out["problems"].append(f"last.ckpt holds step {out['last']}, newest complete is {out['newest']}")
    if out["others"] > top_k + 1:
        out["problems"].append(f"{out['others']} checkpoints besides last with save_top_k={top_k}")
    return out


def one_run(root: str, i: int, delay: float) -> dict:
    save_last, monitor, top_k = CONFIGS[i % len(CONFIGS)]
    out = os.path.join(root, f"run{i}")
    os.makedirs(out)
    ckdir = os.path.join(out, "ckpts")
    opts = dict(save_last=save_last, monitor=monitor, top_k=top_k)
    w = Worker(out, max_steps=10_000, **opts)
    w.wait_for(r"^STEP 3\b")
    time.sleep(delay)
    w.p.send_signal(signal.SIGKILL)
    w.finish()
    steps = [int(ln.split()[1]) for ln in w.output().splitlines() if ln.startswith("STEP ")]
    res = inspect(ckdir, top_k)
    res.update(config=f"{save_last!s}/{monitor}/k={top_k}", delay=delay, stepped=max(steps, default=0), resumed=None)
    if res["newest"] is not None and os.path.exists(os.path.join(ckdir, "last.ckpt")):
        r = Worker(out, max_steps=res["newest"] + 2, ckpt_path=os.path.join(ckdir, "last.ckpt"), **opts)
        try:
            res["resumed"] = int(r.wait_for(r"^RESUMED (\d+)").group(1))
        except AssertionError:
            res["problems"].append("resume from last.ckpt failed")
        if r.finish() != 0:
            res["problems"].append(f"resumed run exited with {r.p.returncode}")
    res["lost_nothing"] = not res["problems"] and res["resumed"] is not None and res["resumed"] == res["newest"]
    shutil.rmtree(out, ignore_errors=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-delay", type=float, default=3.0, help="kill up to this many seconds after step 3")
    args = ap.parse_args()
    rnd = random.Random(args.seed)
    root = tempfile.mkdtemp(prefix="jaxlight-kill-bench-")
    rows = []
    try:
        for i in range(args.runs):
            rows.append(one_run(root, i, rnd.uniform(0.0, args.max_delay)))
            r = rows[-1]
            print(
                f"run {i:2d} {r['config']:22s} kill {r['delay']:4.2f}s  stepped to {r['stepped']:3d}  "
                f"newest {r['newest']}  last {r['last']}  others {r['others']}  partial {r['partial']}  "
                f"resumed {r['resumed']}  {'ok' if r['lost_nothing'] else 'LOST: ' + '; '.join(r['problems'])}",
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ok = sum(r["lost_nothing"] for r in rows)
    lags = [r["stepped"] - r["newest"] for r in rows if r["newest"] is not None]
    print()
    print("| runs | lost nothing | last == newest complete | resumed at newest | max ckpts besides last |")
    print("|---|---|---|---|---|")
    print(
        f"| {len(rows)} | {ok} | {sum(r['last'] == r['newest'] for r in rows)} | "
        f"{sum(r['resumed'] == r['newest'] for r in rows)} | {max(r['others'] for r in rows)} |"
    )
    print(
        f"steps trained since the newest committed checkpoint at the kill (the save in flight, plus steps the "
        f"top k did not keep): min {min(lags)}, max {max(lags)}; runs with an unfinished save left at the kill: "
        f"{sum(r['partial'] > 0 for r in rows)}"
    )


if __name__ == "__main__":
    main()
