"""The cheap host loop (issue 25): batches placed by jax's own per-device put with the plan made once,
in-memory lists read in the loop itself on CPU, the module's variables re-pointed without nnx's per-call
check. Exactness only: the fast paths give the same arrays, the same training and the same hooks' view
as the paths they replace (timings live in benchmarks/peers.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

import jaxlight as jl
from jaxlight.data import BatchPlacer, Prefetcher, flat_host_batch, reads_inline
from tests.core_models import Classifier, batches, make_data, quiet


def _same_array(a, b) -> None:
    assert isinstance(a, jax.Array) and isinstance(b, jax.Array)
    assert a.sharding == b.sharding and a.committed == b.committed
    assert a.aval == b.aval and a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "tp"])
def test_place_flat_gives_what_device_put_gives(strategy):
    trainer = jl.Trainer(strategy=strategy, devices=8, **quiet())
    placer = BatchPlacer(trainer.mesh, strategy=trainer.strategy)
    rng = np.random.default_rng(0)
    batch = {
        "x": rng.normal(size=(16, 3)).astype(np.float32),
        "y": rng.integers(0, 9, size=(16,)).astype(np.int32),
        "wide": rng.normal(size=(16, 2, 4)).astype(np.float64),  # jax narrows it: the device_put path
        "placed": jax.device_put(np.arange(16, dtype=np.float32)),  # already a jax array
    }
    leaves, treedef, _ = flat_host_batch(batch)
    got = placer.place_flat(leaves, treedef)
    again = placer.place_flat(leaves, treedef)  # the cached plan
    shardings = [sh for sh, _ in next(iter(placer._flat.values()))]
    want = jax.tree_util.tree_unflatten(treedef, jax.device_put(leaves, shardings))
    for out in (got, again):
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
            _same_array(a, b)
    # rows split over the 8 devices under ddp/fsdp (the per-shard slices path), whole under tp
    assert got["x"].sharding.is_fully_replicated == (strategy == "tp")


class _Iterable:
    """The same batches behind a loader that is not a list (read on the prefetch thread)."""

    def __init__(self, data) -> None:
        self.data = data

    def __iter__(self):
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)


def test_in_memory_lists_are_read_inline_on_cpu_and_other_loaders_on_a_thread():
    placer = BatchPlacer(jl.Trainer(devices=1, **quiet()).mesh)
    data = batches(*make_data(32), 8)
    assert reads_inline(data, placer, 2) and reads_inline(tuple(data), placer, 2)
    assert not reads_inline(_Iterable(data), placer, 2)
    assert reads_inline(_Iterable(data), placer, 0)
    listed, threaded = Prefetcher(data, placer, depth=2), Prefetcher(_Iterable(data), placer, depth=2)
    try:
        assert listed._thread is None and threaded._thread is not None
        for a, b in zip(listed, threaded, strict=True):
            assert a.index == b.index and a.rows == b.rows
            for x, y in zip(jax.tree.leaves(a.batch), jax.tree.leaves(b.batch)):
                _same_array(x, y)
    finally:
        listed.close()
        threaded.close()


class Seen(jl.Callback):
    """A user's per-batch hook: reads the batch and the module's weights between steps (so the loop
    re-points the module's variables at each new train state before calling it)."""

    def __init__(self) -> None:
        self.batches: list = []
        self.weights: list = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches.append([np.asarray(x) for x in jax.tree.leaves(batch)])
        assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(batch))
        self.weights.append(np.asarray(pl_module.net.l1.kernel[...]))


@pytest.mark.parametrize("devices", [1, 8])
def test_a_fit_from_a_list_trains_exactly_as_from_a_threaded_loader(devices):
    data = batches(*make_data(96), 16)

    def run(loader, prefetch=2):
        seen = Seen()
        trainer = jl.Trainer(devices=devices, max_epochs=2, callbacks=[seen], prefetch=prefetch, **quiet())
        trainer.fit(Classifier(), train_dataloaders=loader)
        return trainer, seen

    fast, fast_seen = run(data)  # read inline, placed by the host putter
    slow, slow_seen = run(_Iterable(data))  # the prefetch thread
    inline0, _ = run(_Iterable(data), prefetch=0)
    ref = jax.tree.leaves(slow.train_state)
    for other in (fast, inline0):
        for a, b in zip(jax.tree.leaves(other.train_state), ref, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert fast.global_step == slow.global_step == 12
    assert len(fast_seen.batches) == len(slow_seen.batches) == 12
    for a, b in zip(fast_seen.batches + fast_seen.weights, slow_seen.batches + slow_seen.weights):
        for x, y in zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b]):
            np.testing.assert_array_equal(x, y)
    # the hook saw the weights of the step just taken (the module points at the current train state)
    np.testing.assert_array_equal(fast_seen.weights[-1], np.asarray(fast.train_state.params["net/l1/kernel"]))
    assert not np.array_equal(fast_seen.weights[0], fast_seen.weights[-1])


def test_compiled_step_sees_the_same_shardings_as_before():
    trainer = jl.Trainer(strategy="ddp", devices=8, max_steps=2, **quiet())
    trainer.fit(Classifier(), train_dataloaders=batches(*make_data(64), 16))
    placer = BatchPlacer(trainer.mesh, strategy=trainer.strategy)
    x, y = batches(*make_data(64), 16)[0]
    placed = placer.place_flat(*flat_host_batch((x, y))[:2])
    assert placed[0].sharding == NamedSharding(trainer.mesh, placer.leaf_sharding("0", (16, x.shape[1])).spec)
    assert trainer.compile_counts == {"train": 1}
