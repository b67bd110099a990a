"""What ``"bf16-mixed"`` computes in, and what it costs in loss, on four small models (issue 31, item 1).

For the demo GPT (NNX), an NNX CNN, a Linen encoder (``from_linen``) and an Equinox MLP
(``from_equinox``) (``examples/precision_models.py``): the share of the traced train step's matmul FLOPs
whose two operands are bf16 (target >= 95%), and the mean training loss of the last 10 of ``--steps`` steps
in fp32 and in bf16-mixed from the same initial parameters on the same batches (target: within 5%).
Both runs side by side in one process; CPU or GPU (the FLOP shares are read from the jaxpr, not timed).

    python benchmarks/precision.py                 # 100 steps per run, one device
    python benchmarks/precision.py --steps 40      # quicker
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

import jaxlight as jl
from examples.precision_models import MODELS
from jaxlight.errors import Float32MatmulWarning
from jaxlight.flops import matmul_dtypes


class LossHistory(jl.Callback):
    def __init__(self) -> None:
        self.losses: list = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"])


def run(make, data, precision: str) -> tuple[jl.Trainer, float, bool]:
    hist = LossHistory()
    trainer = jl.Trainer(
        max_steps=len(data),
        devices=1,
        precision=precision,
        callbacks=[hist],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", Float32MatmulWarning)
        trainer.fit(make(), data)
    warned = any(issubclass(w.category, Float32MatmulWarning) for w in seen)
    losses = np.asarray(jax.device_get(hist.losses), np.float64)
    return trainer, float(losses[-10:].mean()), warned


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="training steps per run")
    args = p.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {args.steps} steps per run")
    header = f"{'model':<16} {'bf16 x bf16 FLOPs':>17} {'fp32 loss':>10} {'bf16 loss':>10} {'bf16/fp32':>10}  warned"
    print(header)
    print("-" * len(header))
    ok = True
    for name, (make, batches) in MODELS.items():
        data = batches(args.steps)
        _, fp32, _ = run(make, data, "32-true")
        trainer, bf16, warned = run(make, data, "bf16-mixed")
        half = matmul_dtypes(trainer.compiled["train"].jaxpr).half_fraction
        ratio = bf16 / fp32
        ok &= half >= 0.95 and abs(ratio - 1) <= 0.05
        print(f"{name:<16} {half:>16.1%} {fp32:>10.4f} {bf16:>10.4f} {ratio:>10.4f}  {'yes' if warned else 'no'}")
    print(f"targets (>= 95% bf16 x bf16 FLOPs, loss within 5% of fp32): {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
