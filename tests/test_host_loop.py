"""The cheap host loop (issue 25): batches placed by jax's own per-device put with the plan made once,
in-memory lists read in the loop itself on CPU, the module's variables re-pointed without nnx's per-call
check. Exactness only: the fast paths give the same arrays, the same training and the same hooks' view
as the paths they replace (timings live in benchmarks/peers.py)."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

import jaxlight as jl
from jaxlight.data import BatchPlacer, flat_host_batch, leaf_path
from jaxlight.prefetch import Prefetcher, reads_inline
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
    paths = [leaf_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(batch)[0]]
    shardings = [placer.leaf_sharding(p, tuple(x.shape)) for p, x in zip(paths, leaves)]
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


# -- batches left on the host: the compiled step transfers them when no per-batch hook reads them ----------
def _decorated(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


class _Hooks(jl.Callback):
    """Per-batch hooks written the ways users write them: which of them may read their ``batch``."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # never looks at it
        self.seen = batch_idx

    def reads(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows = batch[0].shape[0]

    def renamed(self, trainer, pl_module, outputs, b, batch_idx):  # Lightning passes it positionally
        return len(b)

    def renamed_unused(self, trainer, pl_module, outputs, b, batch_idx):
        return batch_idx

    def captured(self, trainer, pl_module, outputs, batch, batch_idx):
        self.later = lambda: batch  # kept for later: reads it

    def by_locals(self, trainer, pl_module, outputs, batch, batch_idx):
        self.names = dict(locals())

    def star(self, trainer, pl_module, *args):
        self.args = args

    def reassigned(self, trainer, pl_module, outputs, batch, batch_idx):
        batch = None  # noqa: F841 - a store counts too (conservative)

    @_decorated
    def decorated(self, trainer, pl_module, outputs, batch, batch_idx):
        return batch_idx


def test_reads_argument_is_false_only_when_the_code_plainly_never_reads_it():
    from jaxlight.hooks import reads_argument

    h = _Hooks()
    at = 3  # batch's position in a callback's on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
    assert not reads_argument(h.on_train_batch_end, at)
    assert not reads_argument(h.renamed_unused, at)
    for name in ("reads", "renamed", "captured", "by_locals", "star", "reassigned", "decorated"):
        assert reads_argument(getattr(h, name), at), name
    assert reads_argument(h.on_train_batch_end, 4)  # batch_idx is read
    # a module's hook has no trainer/pl_module; a function set on an instance (LambdaCallback) no self
    assert not reads_argument(lambda trainer, pl_module, outputs, batch, batch_idx: batch_idx, 3)
    assert reads_argument(lambda trainer, pl_module, outputs, batch, batch_idx: batch, 3)
    assert not reads_argument(Classifier().on_train_batch_end, 1)  # the default: reads nothing
    assert reads_argument(print, 0) and reads_argument(functools.partial(h.reads, None), 2)  # unknown: reads
    assert reads_argument(h.on_train_batch_end, 9)  # no such parameter: unknown


class _Counting:
    """``compat.host_putter`` wrapped to count the leaves placed from Python."""

    def __init__(self, monkeypatch) -> None:
        import jaxlight.data

        self.calls = 0
        real = jaxlight.data.compat.host_putter

        def host_putter(*args):
            put = real(*args)

            def counted(x):
                self.calls += 1
                return put(x)

            return counted

        monkeypatch.setattr(jaxlight.data.compat, "host_putter", host_putter)


class WeightsOnly(jl.Callback):
    """A per-batch hook that reads the weights and the loss, never the batch."""

    def __init__(self) -> None:
        self.weights: list = []
        self.losses: list = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.weights.append(np.asarray(pl_module.net.l1.kernel[...]))
        self.losses.append(float(outputs["loss"]))


@pytest.mark.parametrize("spe", [1, 3])
def test_a_batch_no_hook_reads_is_transferred_by_the_step_and_trains_identically(monkeypatch, spe):
    data = batches(*make_data(96), 16)
    counted = _Counting(monkeypatch)

    def run(cb):
        trainer = jl.Trainer(devices=1, max_epochs=2, callbacks=[cb], steps_per_execution=spe, **quiet())
        trainer.fit(Classifier(), train_dataloaders=data)
        return trainer

    counted.calls = 0
    light = WeightsOnly()
    fast = run(light)
    from_python = counted.calls
    counted.calls = 0
    seen = Seen()  # reads the batch: every batch is placed for it
    slow = run(seen)
    # the first batch is placed to compile the step; after it the step takes the loader's numpy arrays
    assert from_python == 2 * spe and counted.calls == 2 * 12
    for a, b in zip(jax.tree.leaves(fast.train_state), jax.tree.leaves(slow.train_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(light.weights, seen.weights, strict=True):
        np.testing.assert_array_equal(a, b)
    assert fast.compile_counts == slow.compile_counts == {"train": 1}  # one program: 6 batches are 2 executions


def test_several_devices_place_every_batch_as_before(monkeypatch):
    """On a mesh of several devices jax's C++ dispatch would shard numpy arguments in Python (slower than the
    planned put): batches are placed as before, hooks or not."""
    counted = _Counting(monkeypatch)
    trainer = jl.Trainer(devices=8, max_epochs=1, callbacks=[WeightsOnly()], **quiet())
    trainer.fit(Classifier(), train_dataloaders=batches(*make_data(96), 16))
    assert counted.calls == 2 * 6


def test_built_in_callbacks_read_the_batch_only_where_their_logic_needs_it():
    """A callback whose hook passes ``batch`` on (into a StepInfo, say) is a batch reader, and every batch is then
    placed in Python before the step: only ThroughputMonitor counts samples from it."""
    import inspect

    import jaxlight.callbacks as C
    from jaxlight.callbacks.callback import Callback
    from jaxlight.hooks import reads_argument

    readers, checked = set(), 0
    for name in dir(C):
        cls = getattr(C, name)
        if not (inspect.isclass(cls) and issubclass(cls, Callback)) or cls is Callback:
            continue
        for hook, at in (("on_train_batch_start", 3), ("on_train_batch_end", 4)):  # self counts: unbound
            fn = getattr(cls, hook)
            if fn is not getattr(Callback, hook) and name != "LambdaCallback":  # Lambda runs the user's code
                checked += 1
                if reads_argument(fn, at):
                    readers.add(name)
    assert checked >= 8
    assert readers == {"ThroughputMonitor"}
