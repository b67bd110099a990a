"""A tiny module, datamodule and recording callbacks for the LightningCLI and launcher tests."""

from __future__ import annotations

import json
import os

import jax
import numpy as np

import jaxlight as jl
from tests.core_models import Classifier, batches, make_data

__all__ = ["Classifier", "RunRecorder", "ToyData"]


class ToyData(jl.LightningDataModule):
    """``n`` random rows of the core tests' classification data in batches of ``batch_size``."""

    def __init__(self, n: int = 64, batch_size: int = 16, seed: int = 0) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.x, self.y = make_data(n, seed)

    def train_dataloader(self):
        return batches(self.x, self.y, self.batch_size)

    def val_dataloader(self):
        return batches(self.x, self.y, self.batch_size)[:2]

    def test_dataloader(self):
        return batches(self.x, self.y, self.batch_size)[:2]

    def predict_dataloader(self):
        return [(x,) for x, _ in batches(self.x, self.y, self.batch_size)[:2]]


class RunRecorder(jl.Callback):
    """Keeps every train step's loss; with ``out`` it writes ``<out>/run_<process>.json`` (losses, mesh,
    the process of every mesh device) at the end of fit, and process 0 writes ``<out>/params.npz``
    (the parameters gathered from every process)."""

    def __init__(self, out: str | None = None) -> None:
        self.out = out
        self.losses: list = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"])

    def on_fit_end(self, trainer, pl_module) -> None:
        if self.out is None:
            return
        from jax.experimental import multihost_utils

        mesh = trainer.mesh
        params = {
            k: np.asarray(multihost_utils.process_allgather(v, tiled=True))
            for k, v in trainer.train_state.params.items()
        }
        info = {
            "process_index": jax.process_index(),
            "process_count": jax.process_count(),
            "local_devices": jax.local_device_count(),
            "mesh": {k: int(v) for k, v in mesh.shape.items() if v > 1},
            "mesh_processes": np.vectorize(lambda d: d.process_index)(mesh.devices)
            .reshape([int(v) for v in mesh.shape.values() if v > 1])
            .tolist(),
            "losses": [float(np.asarray(x.addressable_data(0))) for x in self.losses],
            "global_step": trainer.global_step,
            "sharded": sum(not v.sharding.is_fully_replicated for v in trainer.train_state.params.values()),
            "param_axes": sorted(
                {
                    a
                    for v in trainer.train_state.params.values()
                    for entry in v.sharding.spec
                    if entry is not None
                    for a in ((entry,) if isinstance(entry, str) else entry)
                }
            ),
            "seed": os.environ.get("PL_GLOBAL_SEED"),
        }
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, f"run_{jax.process_index()}.json"), "w") as f:
            json.dump(info, f)
        if jax.process_index() == 0:
            np.savez(os.path.join(self.out, "params.npz"), **params)
