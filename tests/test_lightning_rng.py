"""Differential test: under torch's global generator (``torch.manual_seed`` and a ``DataLoader(shuffle=True)``
without a ``generator``) jaxlight trains on Lightning's batches, epoch after epoch, and leaves torch's global
random state where Lightning leaves it.

Every ``iter()`` of a torch ``DataLoader`` draws a base seed from torch's global generator (even with
``num_workers=0``) and a shuffled sampler without a generator draws its permutation's seed there too, so the
sequence is the same only if both frameworks create their loader iterators at the same points. Lightning runs
its sanity check inside ``isolate_rng()``: the validation iterator it creates there draws nothing the
training sees. The batches are the rows' indices, so the test reads every batch's order.
"""

from __future__ import annotations

import logging
import random
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pytorch_lightning")

ROWS, BATCH, EPOCHS = 12, 4, 3


def _loaders(val: bool, workers: int) -> tuple[object, object]:
    x = torch.arange(ROWS, dtype=torch.float32).reshape(ROWS, 1)
    ds = torch.utils.data.TensorDataset(x, torch.zeros(ROWS, 1))
    kw = dict(num_workers=workers, persistent_workers=False) if workers else {}
    train = torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=True, **kw)
    return train, (torch.utils.data.DataLoader(ds, batch_size=BATCH, **kw) if val else None)


def _run_pl(val: bool, workers: int) -> tuple[list, torch.Tensor]:
    import pytorch_lightning as pl

    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    seen: list[tuple[int, list[int]]] = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):
            return ((self.net(batch[0]) - batch[1]) ** 2).mean()

        def validation_step(self, batch, batch_idx):
            return None

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append((trainer.current_epoch, batch[0][:, 0].int().tolist()))

    module = Module()  # built before the seed: its initialisation draws from torch's generator, jaxlight's not
    torch.manual_seed(0)
    train, val_loader = _loaders(val, workers)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Record()],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, train, val_loader)
    return seen, torch.random.get_rng_state()


def _run_jl(val: bool, workers: int) -> tuple[list, torch.Tensor]:
    import optax
    from flax import nnx

    import jaxlight as jl

    seen: list[tuple[int, list[int]]] = []

    class Module(jl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nnx.Linear(1, 1, rngs=nnx.Rngs(0))

        def training_step(self, batch, batch_idx):
            return ((self.net(batch[0]) - batch[1]) ** 2).mean()

        def validation_step(self, batch, batch_idx):
            return None

        def configure_optimizers(self):
            return optax.sgd(0.01)

    class Record(jl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append((trainer.current_epoch, np.asarray(batch[0])[:, 0].astype(int).tolist()))

    module = Module()
    torch.manual_seed(0)
    train, val_loader = _loaders(val, workers)
    trainer = jl.Trainer(
        devices=1,
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Record()],
    )
    trainer.fit(module, train, val_loader)
    return seen, torch.random.get_rng_state()


@pytest.mark.parametrize("workers", [0, 2], ids=["workers0", "workers2"])
@pytest.mark.parametrize("val", [False, True], ids=["no_val", "val_sanity_check"])
def test_global_generator_batches_as_lightning(val: bool, workers: int) -> None:
    pl_batches, pl_state = _run_pl(val, workers)
    jl_batches, jl_state = _run_jl(val, workers)
    assert len(pl_batches) == EPOCHS * ROWS // BATCH
    assert jl_batches == pl_batches
    assert torch.equal(jl_state, pl_state), "torch's global random state after fit differs from Lightning's"


def test_isolate_rng_restores_python_numpy_torch() -> None:
    from jaxlight.seed import isolate_rng

    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    expected = random.random(), np.random.rand(), torch.rand(1).item()
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    with isolate_rng():
        random.random(), np.random.rand(), torch.rand(3)
        next(iter(torch.utils.data.DataLoader(range(4), shuffle=True)))  # a base seed and a sampler seed drawn
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
