"""Shared by tests/test_checkpoint_safety.py and its multi-process worker: pickle switched off, a callback
whose state holds every kind of value a checkpoint stores, and a module with non-JSON hparams."""

from __future__ import annotations

import collections
import contextlib
import datetime
import pathlib
import pickle
from collections.abc import Iterator

import jax.numpy as jnp
import numpy as np

import jaxlight as jl
from tests.checkpoint_models import DropoutClassifier

_PICKLE_ENTRY_POINTS = ("load", "loads", "Unpickler", "_load", "_loads", "_Unpickler")


class PickleUsed(AssertionError):
    pass


@contextlib.contextmanager
def no_pickle() -> Iterator[list[str]]:
    """Every unpickling entry point raises (and is recorded) inside the block; ``numpy.load`` refuses pickles."""
    import _pickle

    used: list[str] = []
    saved = []
    for mod in (pickle, _pickle):
        for name in _PICKLE_ENTRY_POINTS:
            if hasattr(mod, name):
                saved.append((mod, name, getattr(mod, name)))

                def refuse(*args, _where=f"{mod.__name__}.{name}", **kwargs):
                    used.append(_where)
                    raise PickleUsed(f"{_where} called while pickle is disabled")

                setattr(mod, name, refuse)
    np_load = np.load

    def load_without_pickle(*args, **kwargs):
        kwargs["allow_pickle"] = False
        return np_load(*args, **kwargs)

    np.load = load_without_pickle
    try:
        yield used
    finally:
        np.load = np_load
        for mod, name, fn in saved:
            setattr(mod, name, fn)
    assert not used, f"pickle was used: {used}"


def rich_state(step: int) -> dict:
    """A state_dict with one of every kind of value jaxlight checkpoints store (it depends on ``step``)."""
    import torch

    g = torch.Generator()
    g.manual_seed(step)
    return {
        "count": step,
        "pair": (step, float(step) / 3),
        "seen": {step, step + 1},
        "frozen": frozenset({"a"}),
        "by_epoch": {0: "zero", 1: (1, "one")},  # int keys
        "ordered": collections.OrderedDict([("z", 1), ("a", 2)]),
        "best": float("inf"),
        "nan": float("nan"),
        "blob": bytes(range(step % 7 + 1)),
        "c": complex(step, -1),
        "np_scalars": [np.float32(step / 7), np.int64(-(2**40)), np.uint8(255), np.bool_(True)],
        "table": np.arange(step, step + 6, dtype=np.float64).reshape(2, 3) / 7,
        "big": np.arange(step, step + 10_000, dtype=np.float64) / 7,  # over 64 KiB: stored by orbax
        "empty": np.zeros((0, 2), np.int32),
        "gen": g.get_state(),  # a uint8 tensor, like a loader's generator state
        "bf16": torch.full((3,), step / 3, dtype=torch.bfloat16),
        "jx": jnp.arange(3, dtype=jnp.int32) + step,
        "dtype": jnp.bfloat16,
        "path": pathlib.Path("/data") / str(step),
        "interval": datetime.timedelta(seconds=step, microseconds=5),
        "__type__": "a user key that looks like a tag",
    }


class RichState(jl.Callback):
    """A callback with state: counts batches and keeps ``rich_state(count)``; records what it was given back."""

    def __init__(self) -> None:
        self.count = 0
        self.loaded: dict | None = None
        self.extra_loaded = None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.count += 1

    def state_dict(self) -> dict:
        return rich_state(self.count)

    def load_state_dict(self, state_dict: dict) -> None:
        self.loaded = state_dict
        self.count = state_dict["count"]

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        checkpoint["rich_extra"] = ("added by on_save_checkpoint", np.float16(0.5), b"\x00")

    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.extra_loaded = checkpoint["rich_extra"]


class TypedHparams(DropoutClassifier):
    """hparams that plain JSON would not keep: a tuple, a dtype, a path and a nested dict with int keys."""

    def __init__(
        self,
        hidden: int = 16,
        widths: tuple = (16, 8),
        dtype=jnp.float32,
        data_dir: pathlib.Path = pathlib.Path("/data"),
        schedule: dict | None = None,
    ) -> None:
        super().__init__(hidden=hidden)  # its save_hyperparameters() records these arguments too


def same(a, b, path: str = "") -> None:
    """Equal values of the same types, recursively (NaN equals NaN; arrays bit for bit)."""
    import jax
    import torch

    assert type(a) is type(b), f"{path}: {type(a)} vs {type(b)}"
    if isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} vs {list(b)}"
        for k in a:
            same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), path
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, jax.Array):
        assert a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all()), path
    elif isinstance(a, (float, np.floating)) and np.isnan(a):
        assert np.isnan(b), path
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"
