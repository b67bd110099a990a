#!/usr/bin/env bash
# The checks that need a real accelerator, as one script for a short lease on one GPU.
# Run from the repository root: bash benchmarks/gpu_check.sh [OUTDIR]
# Uses the machine's own python3 and JAX (jaxlight from this checkout via PYTHONPATH); every stage
# has its own time cap and a failing stage does not stop the next. One log (all.log) and the demo's plots go to
# OUTDIR (default: $OUT, else ./gpu_check_out).
set -u
OUTDIR=${1:-${OUT:-gpu_check_out}}
mkdir -p "$OUTDIR"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TQDM_DISABLE=1
PY=${PY:-python3}

stage() {  # stage NAME CAP_SECONDS CMD...
  local name=$1 cap=$2; shift 2
  echo "=== $name (cap ${cap}s): $*"
  local t0=$SECONDS
  # SIGTERM first (the trainer stops cleanly on it), SIGKILL 15 s later
  timeout -k 15 "$cap" "$@" >"$OUTDIR/stage.log" 2>&1
  local rc=$?
  { echo "=== $name: $*"; cat "$OUTDIR/stage.log"; echo "=== $name: rc=$rc in $((SECONDS - t0))s"; } >>"$OUTDIR/all.log"
  tail -n 40 "$OUTDIR/stage.log"
  rm -f "$OUTDIR/stage.log"
  echo "=== $name: rc=$rc in $((SECONDS - t0))s"
}

stage env 60 bash -c "nvidia-smi -L; $PY -c 'import jax, flax, optax, orbax.checkpoint as o, jaxlight; \
print(\"jax\", jax.__version__, \"flax\", flax.__version__, \"optax\", optax.__version__); print(jax.devices())'"
# per-step overhead where a step is ~1 ms (issue 12), on the reference workload
stage overhead 120 $PY benchmarks/overhead.py --rounds 12 --steps 20
# host offload with a real PCIe link and a memory_analysis that counts host bytes; its third row streams
# the offloaded state in 8 groups (HostOffload(stream=8), issue 25: target <= 1.3x no offload)
stage offload 180 $PY benchmarks/offload.py
# MFU of the demo GPT scaled to ~1 B parameters in bf16: achieved TFLOP/s per device against the chip's peak
# (issue 25); the monitor's count (every layer of the scanned stack) beside the analytic 6NT + attention
stage mfu 300 $PY benchmarks/mfu.py
# jaxlight against the hand loop and Keras 3 (when installed) per tiny-MLP step (issue 25)
stage peers_tiny 120 $PY benchmarks/peers.py --quick --workloads tiny --no-torch
# per-step host overhead on the tiny MLP
stage overhead_tiny 90 $PY benchmarks/overhead.py --tiny --no-lightning
# the demo, end to end, on the GPU, in fp32 and bf16-mixed
stage gpt 150 $PY examples/gpt.py --out "$OUTDIR/gpt_run"
stage gpt_bf16 90 $PY examples/gpt.py --precision bf16-mixed --out "$OUTDIR/gpt_bf16_run"
find "$OUTDIR/gpt_run" -name "*.png" -exec cp {} "$OUTDIR" \; 2>/dev/null
rm -rf "$OUTDIR/gpt_run" "$OUTDIR/gpt_bf16_run"
ls -la "$OUTDIR"
