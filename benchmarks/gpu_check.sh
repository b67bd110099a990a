#!/usr/bin/env bash
# The checks that need a real accelerator, as one script for a short lease on one GPU.
# Run from the repository root: bash benchmarks/gpu_check.sh [OUTDIR]
# Uses the machine's own python3 and JAX (jaxlight from this checkout via PYTHONPATH; nothing here needs
# torchdata, keras, mlflow or jsonargparse); every stage has its own time cap, all of them together at most
# BUDGET seconds (default 570: the lease's 10 minutes less start-up), and a failing stage does not stop the
# next. One log (all.log) and the demo's plots go to OUTDIR (default: $OUT, else ./gpu_check_out).
# GPU_CHECK_TINY=1 runs every stage on tiny settings (a dry run on a CPU: checks nothing crashes).
set -u
OUTDIR=${1:-${OUT:-gpu_check_out}}
mkdir -p "$OUTDIR"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TQDM_DISABLE=1
PY=${PY:-python3}
BUDGET=${BUDGET:-570}
TINY=${GPU_CHECK_TINY:-0}

stage() {  # stage NAME CAP_SECONDS CMD...  (the cap shrinks to what is left of BUDGET)
  local name=$1 cap=$2; shift 2
  local left=$((BUDGET - SECONDS))
  if [ "$left" -lt 20 ]; then echo "=== $name: skipped, ${left}s of the ${BUDGET}s budget left"; return; fi
  [ "$TINY" = 1 ] && cap=$((cap * 4))  # a CPU dry run: the caps are a GPU's
  [ "$cap" -gt "$left" ] && cap=$left
  echo "=== $name (cap ${cap}s): $*"
  local t0=$SECONDS
  # SIGTERM first (the trainer stops cleanly on it), SIGKILL 10 s later
  timeout -k 10 "$cap" "$@" >"$OUTDIR/stage.log" 2>&1
  local rc=$?
  { echo "=== $name: $*"; cat "$OUTDIR/stage.log"; echo "=== $name: rc=$rc in $((SECONDS - t0))s"; } >>"$OUTDIR/all.log"
  tail -n 40 "$OUTDIR/stage.log"
  rm -f "$OUTDIR/stage.log"
  echo "=== $name: rc=$rc in $((SECONDS - t0))s"
}

if [ "$TINY" = 1 ]; then
  ATTN="--tiny" MFU="--tiny" OFFLOAD="--embed 64 --layers 2 --vocab 256 --batch 4 --seq 32 --steps 4 --rounds 1 --stream 2"
  GPT="--max-steps 12 --batches-per-epoch 6 --val-batches 2 --d-model 32 --layers 2 --seq-len 32 --batch-size 4"
else
  ATTN="" MFU="--steps 15 --hand-steps 10" OFFLOAD="" GPT=""
fi

stage env 30 bash -c "nvidia-smi -L 2>/dev/null; $PY -c 'import jax, flax, optax, orbax.checkpoint as o, jaxlight; \
print(\"jax\", jax.__version__, \"flax\", flax.__version__, \"optax\", optax.__version__); print(jax.devices())'"
# jl.nn.attention's kernels: cuDNN's and XLA's against the blockwise kernel (outputs, gradients) and their times
stage attention 60 $PY benchmarks/attention_check.py $ATTN
# MFU of the demo GPT scaled to ~1 B parameters in bf16 (issue 25), the trainer beside the hand loop with the
# same kernels and the hand loop with each attention kernel (issue 31)
stage mfu 220 $PY benchmarks/mfu.py $MFU
# host offload with a real PCIe link and a memory_analysis that counts host bytes
stage offload 90 $PY benchmarks/offload.py $OFFLOAD
# the demo, end to end, on the GPU, in fp32 and bf16-mixed
stage gpt 75 $PY examples/gpt.py $GPT --out "$OUTDIR/gpt_run"
stage gpt_bf16 60 $PY examples/gpt.py $GPT --precision bf16-mixed --out "$OUTDIR/gpt_bf16_run"
# jaxlight against the hand loop and Keras 3 (when installed) per tiny-MLP step (issue 25)
stage peers_tiny 45 $PY benchmarks/peers.py --quick --workloads tiny --no-torch
find "$OUTDIR/gpt_run" -name "*.png" -exec cp {} "$OUTDIR" \; 2>/dev/null
rm -rf "$OUTDIR/gpt_run" "$OUTDIR/gpt_bf16_run"
echo "=== total ${SECONDS}s of ${BUDGET}s"
ls -la "$OUTDIR"
