"""grain pipelines as loaders (issue 22, problem 7): resumed from grain's own iterator state (no record read
twice, counted at the source), reshuffled per epoch the way ``ds.repeat()`` reshuffles, lengths used when
known; and the per-epoch ``set_epoch`` call on torch samplers."""

from __future__ import annotations

import grain
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight.grain_data import GrainLoader, set_loader_epoch, shard_options
from tests.core_models import quiet

N, BS = 40, 8  # 5 batches per epoch
SYNC = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)  # reads happen when elements are asked for


class Counting:
    """A random-access source that records every index read."""

    def __init__(self, n: int = N) -> None:
        self.n = n
        self.reads: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        self.reads.append(int(i))
        return {"x": np.full((4,), i, np.float32)}

    def __repr__(self) -> str:  # grain's DataLoader checks the source's repr on restore
        return f"Counting({self.n})"


class Seen(jl.Callback):
    def __init__(self) -> None:
        self.batches: list[tuple[int, tuple[int, ...]]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.append((trainer.current_epoch, tuple(int(v) for v in np.asarray(batch["x"])[:, 0])))


class Tiny(jl.LightningModule):
    def configure_model(self):
        self.net = nnx.Linear(4, 2, rngs=nnx.Rngs(0))

    def training_step(self, batch, batch_idx):
        return (self.net(batch["x"] / N) ** 2).mean()

    def configure_optimizers(self):
        return optax.sgd(0.1)


def fit(loader, tmp_path=None, stop: int | None = None, resume: str | None = None, **kw) -> tuple[jl.Trainer, Seen]:
    seen = Seen()
    callbacks = [seen]
    if stop is not None:
        callbacks.append(
            jl.callbacks.ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=stop, save_last="link")
        )
        kw["max_steps"] = stop
    trainer = jl.Trainer(devices=1, callbacks=callbacks, **quiet(enable_checkpointing=stop is not None), **kw)
    trainer.fit(Tiny(), loader, ckpt_path=resume)
    if stop is not None:
        trainer.checkpoint_callback.wait_until_finished()
    return trainer, seen


def map_pipeline(src: Counting):
    return grain.MapDataset.source(src).shuffle(seed=7).batch(BS, drop_remainder=True)


def test_map_dataset_resumes_without_replay_and_reshuffles_per_epoch(tmp_path):
    ref_src = Counting()
    trainer, ref = fit(GrainLoader(map_pipeline(ref_src), read_options=SYNC), max_epochs=2)
    assert trainer.num_training_batches == 5  # len(MapDataset), used
    epochs = [[b for e, b in ref.batches if e == k] for k in (0, 1)]
    assert len(epochs[0]) == len(epochs[1]) == 5
    assert epochs[0] != epochs[1] and sorted(sum(epochs[0], ())) == sorted(sum(epochs[1], ())) == list(range(N))
    # exactly what a hand-written loop over ds.repeat(2) delivers, batch for batch
    hand = [tuple(int(v) for v in b["x"][:, 0]) for b in map_pipeline(Counting()).repeat(2).to_iter_dataset(SYNC)]
    assert [b for _, b in ref.batches] == hand
    # stop in epoch 1 after 2 of its batches, then resume from grain's own state
    fit(GrainLoader(map_pipeline(Counting()), read_options=SYNC), tmp_path, stop=7, max_epochs=2)
    src = Counting()
    _, resumed = fit(
        GrainLoader(map_pipeline(src), read_options=SYNC), max_epochs=2, resume=str(tmp_path / "last.ckpt")
    )
    assert resumed.batches == ref.batches[7:]  # the same remaining batches, in order
    assert len(src.reads) == 3 * BS  # 24 records read to deliver the 3 remaining batches: nothing replayed
    assert not set(src.reads) & set(sum(epochs[1][:2], ()))


def test_the_trainer_wraps_grain_pipelines_it_is_given():
    src = Counting()
    trainer, seen = fit(map_pipeline(src), max_epochs=2)  # a bare MapDataset, grain's default read options
    assert isinstance(trainer.train_dataloader, GrainLoader)
    e0 = [b for e, b in seen.batches if e == 0]
    e1 = [b for e, b in seen.batches if e == 1]
    assert len(e0) == len(e1) == 5 and e0 != e1


def test_iter_dataset_resumes_from_its_state(tmp_path):
    def pipeline(src):
        return grain.MapDataset.source(src).shuffle(seed=3).to_iter_dataset(SYNC).batch(BS)

    _, ref = fit(GrainLoader(pipeline(Counting()), length=5), max_epochs=1)
    fit(GrainLoader(pipeline(Counting()), length=5), tmp_path, stop=2, max_epochs=1)
    src = Counting()
    _, resumed = fit(GrainLoader(pipeline(src), length=5), max_epochs=1, resume=str(tmp_path / "last.ckpt"))
    assert resumed.batches == ref.batches[2:] and len(resumed.batches) == 3
    assert len(src.reads) == 3 * BS


def test_data_loader_resumes_from_its_state(tmp_path):
    def loader(src):
        return grain.DataLoader(
            data_source=src,
            sampler=grain.samplers.IndexSampler(len(src), shuffle=True, seed=1, num_epochs=1),
            operations=[grain.transforms.Batch(BS, drop_remainder=True)],
            worker_count=0,
            shard_options=grain.sharding.NoSharding(),
            read_options=SYNC,
        )

    hand = [tuple(int(v) for v in b["x"][:, 0]) for b in loader(Counting())]
    fit(loader(Counting()), tmp_path, stop=3, max_steps=None)
    src = Counting()
    trainer, resumed = fit(loader(src), max_epochs=1, resume=str(tmp_path / "last.ckpt"))
    assert [b for _, b in resumed.batches] == hand[3:]
    assert len(src.reads) == 2 * BS  # the state is grain's own (bytes), nothing replayed


def test_factory_builds_each_epoch_and_set_epoch_reaches_torch_samplers():
    # per-epoch reshuffle for pipelines that do not reshuffle themselves: seed + epoch
    g = GrainLoader(lambda epoch: grain.MapDataset.range(8).shuffle(seed=10 + epoch).to_iter_dataset(SYNC), length=8)
    first = list(g)
    g.set_epoch(1)
    assert list(g) != first and sorted(first) == list(range(8))
    with pytest.raises(TypeError, match="has no length"):
        len(GrainLoader(grain.MapDataset.range(8).to_iter_dataset()))

    torch = pytest.importorskip("torch")

    class Recording(torch.utils.data.Sampler):
        def __init__(self, n):
            self.n, self.epochs = n, []

        def set_epoch(self, epoch):
            self.epochs.append(epoch)

        def __iter__(self):
            return iter(range(self.n))

        def __len__(self):
            return self.n

    ds = torch.utils.data.TensorDataset(torch.zeros(16, 4))
    sampler = Recording(16)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=8, sampler=sampler, collate_fn=lambda b: {"x": torch.zeros(8, 4)}
    )
    jl.Trainer(devices=1, max_epochs=3, **quiet()).fit(Tiny(), loader)
    assert sampler.epochs == [0, 1, 2]  # Lightning's rule: before every train epoch
    set_loader_epoch([], 5)  # loaders without samplers: nothing to do


def test_shard_options_follow_the_trainers_data_partition(monkeypatch):
    trainer = jl.Trainer(devices=8, strategy="fsdp", **quiet())
    assert isinstance(shard_options(trainer), grain.sharding.NoSharding)  # one process reads everything
    import jaxlight.data as data

    monkeypatch.setattr(data, "data_partition", lambda mesh: data.DataPartition(1, 2, 2, 0))
    trainer.process_local_batches = True
    opts = shard_options(trainer)
    assert (opts.shard_index, opts.shard_count, opts.drop_remainder) == (1, 2, True)
    trainer.process_local_batches = False  # every process reads the global batch and keeps its rows
    assert isinstance(shard_options(trainer), grain.sharding.NoSharding)
