"""A checkpoint callback that is not a ModelCheckpoint is found by what it declares: ``ckpt_path="last"`` and
``"best"`` look where it says, and Preemption has it write the stop checkpoint. The checkpoint package imports
no callback (ModelCheckpoint depends on it, never the reverse)."""

from __future__ import annotations

import ast
import os
import pathlib
import signal

import jax
import numpy as np
import optax
import pytest

import jaxlight as jl
from jaxlight.state import path_str
from tests.checkpoint_models import NormRegressor, norm_batches
from tests.helpers import quiet

PACKAGE = pathlib.Path(jl.__file__).parent / "checkpoint"


class EveryStep(jl.Callback):
    """A minimal checkpoint callback: a synchronous save after every step into ``dirpath/step=N``; its "best"
    is whatever it was given."""

    is_checkpoint_callback = True

    def __init__(self, dirpath: str, best: str | None = None, signal_at: int | None = None) -> None:
        self.dirpath, self.best, self.signal_at = dirpath, best, signal_at
        self.on_demand: list[str] = []

    @property
    def checkpoint_dirpath(self) -> str | None:
        return self.dirpath

    def best_checkpoint_path(self, saved_state=None):
        return self.best if saved_state is None else saved_state.get("best")

    def state_dict(self):
        return {"best": self.best}

    def _save(self, trainer) -> str:
        path = os.path.join(self.dirpath, f"step={trainer.global_step}")
        if not os.path.exists(path):
            jl.checkpoint.save_checkpoint(trainer, path, reason="test")
        return path

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self._save(trainer)
        if self.signal_at == trainer.global_step:
            os.kill(os.getpid(), signal.SIGTERM)

    def save_now(self, trainer, reason="preemption"):
        self.on_demand.append(reason)
        return self._save(trainer)


def _trainer(cb: jl.Callback, max_steps: int) -> jl.Trainer:
    # quiet(): no default ModelCheckpoint beside it either (the trainer adds one unless a ModelCheckpoint is given)
    return jl.Trainer(max_steps=max_steps, callbacks=[cb], **quiet(num_sanity_val_steps=None))


def test_last_and_best_come_from_a_checkpoint_callback_of_its_own(tmp_path):
    d = str(tmp_path / "own")
    first = EveryStep(d, best=os.path.join(d, "step=1"))
    t = _trainer(first, 3)
    assert t.checkpoint_callbacks == [first]  # found by its declaration, not its type
    t.fit(NormRegressor(), norm_batches())
    assert sorted(os.listdir(d)) == ["step=1", "step=2", "step=3"]

    seen = []
    t = _trainer(EveryStep(d, best=os.path.join(d, "step=1")), 4)  # its state in step=4 names step=1 best
    t.callbacks.append(jl.callbacks.LambdaCallback(on_train_batch_end=lambda tr, m, o, b, i: seen.append(i)))
    t.fit(NormRegressor(), norm_batches(), ckpt_path="last")  # found in the callback's own directory
    assert t.ckpt_path == os.path.join(d, "step=3") and seen == [3]

    # "best" in this run: what the callback knows; in a new run: what its state in the newest checkpoint names
    for cb, want in ((EveryStep(d, best=os.path.join(d, "step=2")), 2), (EveryStep(d), 1)):
        t = _trainer(cb, want)  # max_steps at the checkpoint's step: fit restores it and trains nothing
        t.fit(NormRegressor(), norm_batches(), ckpt_path="best")
        assert (t.ckpt_path, t.global_step) == (os.path.join(d, f"step={want}"), want)


def test_preemption_has_the_declared_callback_write_the_stop_checkpoint(tmp_path):
    cb = EveryStep(str(tmp_path / "own"), signal_at=2)
    with pytest.raises(jl.Preempted) as exc:
        _trainer(cb, 10).fit(NormRegressor(), norm_batches())
    # the signal came in the checkpoint callback's hook of step 2: the watcher sees it before step 3 starts
    # (issue 26: a signal is honoured at any point, not only at Preemption's own hook), so the run stops there
    assert cb.on_demand == ["preemption"] and exc.value.step == 2
    assert exc.value.path == os.path.join(cb.dirpath, "step=2") and jl.checkpoint.is_complete(exc.value.path)


def _imports(tree: ast.AST, type_checking: bool = False):
    """(module name, inside an ``if TYPE_CHECKING:`` block) for every import in ``tree``, functions included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for child in node.body:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), True)
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            yield from ((f"{node.module}.{a.name}", type_checking) for a in node.names)
        elif isinstance(node, ast.Import):
            yield from ((a.name, type_checking) for a in node.names)
        yield from _imports(node, type_checking)


def test_the_checkpoint_package_imports_no_callback():
    """At run time not even inside a function (type annotations excepted): ModelCheckpoint imports the
    package, never the reverse."""
    files = sorted(PACKAGE.glob("*.py"))
    assert {f.name for f in files} >= {"format.py", "publish.py", "discovery.py", "run_state.py", "module_load.py"}
    for f in files:
        found = list(_imports(ast.parse(f.read_text())))
        assert found, f.name
        runtime = [n for n, typing_only in found if not typing_only]
        assert not [n for n in runtime if n.startswith(("jaxlight.callbacks", "jaxlight.trainer"))], f.name
        assert not [n for n, _ in found if n.startswith("jaxlight.callbacks.model_checkpoint")], f.name


@pytest.mark.parametrize(
    "tx",
    [
        optax.adamw(1e-3),
        optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
        optax.MultiSteps(optax.adam(1e-3), 2),
        optax.chain(optax.clip_by_global_norm(1.0), optax.lion(1e-3)),
        optax.contrib.reduce_on_plateau(),
    ],
    ids=["adamw", "inject", "multisteps", "chain", "plateau"],
)
def test_state_keys_on_disk_are_the_keys_of_earlier_checkpoints(tx):
    """Train-state leaves are stored under jaxlight.state.path_str keys; for optax states these are the
    keys earlier jaxlight wrote (jax.tree_util.keystr(simple=True, separator="/"))."""
    state = tx.init({"a/b": np.ones(2, np.float32), "c": np.ones(3, np.float32)})
    for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]:
        assert path_str(p) == jax.tree_util.keystr(p, simple=True, separator="/")
