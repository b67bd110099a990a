"""Checkpoint I/O takes trees: ``save(contents, path)`` and ``restore(like, path)`` with no Trainer, and the
Trainer read in one function and written in one (issue 30)."""

from __future__ import annotations

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxlight as jl
from jaxlight.checkpoint import RunSnapshot, host_dict, restore, save
from tests.checkpoint_models import NormRegressor, norm_batches, norm_trainer

PACKAGE = pathlib.Path(jl.__file__).parent / "checkpoint"
MODEL_CHECKPOINT = pathlib.Path(jl.__file__).parent / "callbacks" / "model_checkpoint.py"


def _contents(step: int = 3) -> RunSnapshot:
    params = {"dense/kernel": jnp.arange(32.0).reshape(8, 4), "dense/bias": jnp.full((4,), 0.5)}
    model_state = {"rngs/default/key": jax.random.key(7), "bn/mean": jnp.ones((4,))}
    opt_state = optax.adam(1e-3).init(params)
    # a state that moved: restored values must be these, not a fresh init
    opt_state = jax.tree.map(lambda x: x + 1 if jnp.issubdtype(x.dtype, jnp.floating) else x, opt_state)
    host = host_dict(global_step=step, epoch=1, callbacks={"Mine": {"seen": [1, 2, 3]}})
    facts = {"global_step": step, "epoch": 1, "strategy": "none", "mesh": {"data": 1}}
    return RunSnapshot(
        params, model_state, opt_state, {"ema": {"w": jnp.zeros((2,))}}, jnp.asarray(step), host=host, facts=facts
    )


def _blank(like: RunSnapshot) -> RunSnapshot:
    """The same structure with other values (keys kept as keys), so a restore that reads nothing fails."""
    return jax.tree.map(
        lambda x: jax.random.key(0) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else jnp.zeros_like(x) - 9, like
    )


def _equal(a, b) -> None:
    unwrap = lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    la, lb = jax.tree.leaves(jax.tree.map(unwrap, a)), jax.tree.leaves(jax.tree.map(unwrap, b))
    assert len(la) == len(lb) > 0, (len(la), len(lb))
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_tree_saves_and_restores_with_no_trainer(tmp_path, monkeypatch):
    def no_trainer(*a, **k):
        raise AssertionError("a Trainer was built")

    monkeypatch.setattr(jl.Trainer, "__init__", no_trainer)
    contents = _contents()
    path = tmp_path / "tree.ckpt"
    save(contents, path)
    assert jl.checkpoint.is_complete(path)
    meta = jl.checkpoint.read_meta(path)
    assert (meta["global_step"], meta["epoch"], meta["weights_only"]) == (3, 1, False)

    back = restore(_blank(contents), path)
    assert isinstance(back, RunSnapshot) and back.has_train
    _equal(back, contents)
    assert jax.random.key_impl(back.model_state["rngs/default/key"]) == jax.random.key_impl(jax.random.key(0))
    assert back.host["callbacks"] == {"Mine": {"seen": [1, 2, 3]}}
    assert back.host["loops"]["fit_loop"]["resume_epoch"] == 1
    assert back.facts["global_step"] == 3 and "host_state" not in back.facts


def test_a_tree_restores_into_the_shardings_it_is_given(tmp_path):
    contents = _contents()
    path = tmp_path / "tree.ckpt"
    save(contents, path)
    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    rows = NamedSharding(mesh, P("data"))
    shardings = jax.tree.map(lambda x: NamedSharding(mesh, P()), contents)
    shardings = shardings.replace(params={**shardings.params, "dense/kernel": rows})
    back = restore(_blank(contents), path, shardings=shardings)
    _equal(back, contents)
    assert back.params["dense/kernel"].sharding == rows, back.params["dense/kernel"].sharding
    assert back.params["dense/bias"].sharding.is_fully_replicated


def test_a_like_without_a_train_part_reads_only_the_model(tmp_path):
    contents = _contents()
    path = tmp_path / "tree.ckpt"
    save(contents.replace(weights_only=True), path)
    assert jl.checkpoint.read_meta(path)["weights_only"] is True
    like = RunSnapshot(contents.params, contents.model_state)
    back = restore(_blank(like), path)
    assert not back.has_train and back.weights_only
    _equal(back, like)
    with pytest.raises(jl.CheckpointError, match="holds only the model weights"):
        restore(_blank(contents), path)  # the train item is not there


def test_a_trainer_checkpoint_restores_as_a_tree(tmp_path):
    """The Trainer's save goes through the same value: ``restore(like, path)`` reads its checkpoint."""
    path = tmp_path / "run.ckpt"

    class SaveAtTwo(jl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                trainer.save_checkpoint(path)
                self.state = trainer.train_state

    cb = SaveAtTwo()
    norm_trainer(2, callbacks=[cb]).fit(NormRegressor(), norm_batches())
    st = cb.state
    like = RunSnapshot(dict(st.params), dict(st.model_state), st.opt_state, st.callback_state, st.step)
    back = restore(_blank(like), path)
    _equal(back, like)
    assert int(back.step) == 2 and back.host["global_step"] == 2 and back.facts["global_step"] == 2


def _trainer_attributes(path: pathlib.Path) -> list[tuple[str, str, str]]:
    """(enclosing function, attribute, "load"/"store") for every ``trainer.<attr>`` in the file."""
    found = []

    def walk(node: ast.AST, fn: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            if isinstance(child, ast.Attribute) and isinstance(child.value, ast.Name) and child.value.id == "trainer":
                found.append((name, child.attr, "store" if isinstance(child.ctx, ast.Store) else "load"))
            walk(child, name)

    walk(ast.parse(path.read_text()), "<module>")
    return found


def test_one_function_reads_the_trainer_and_one_writes_it():
    """In the checkpoint package only ``trainer_io.view_of`` reads Trainer attributes and only
    ``trainer_io.apply_restored`` assigns them (before: 17 attributes read in 14 functions of run_state.py)."""
    files = sorted(PACKAGE.glob("*.py"))
    assert {f.name for f in files} >= {"run_state.py", "trainer_io.py", "writer.py"}
    touched = {f.name: _trainer_attributes(f) for f in files}
    assert {name for name, found in touched.items() if found} == {"trainer_io.py"}, touched
    reads = {(fn, attr) for fn, attr, how in touched["trainer_io.py"] if how == "load"}
    writes = {(fn, attr) for fn, attr, how in touched["trainer_io.py"] if how == "store"}
    assert {fn for fn, _ in reads} == {"view_of"}, reads
    assert writes == {("apply_restored", "train_state"), ("apply_restored", "ckpt_path")}, writes
    # the I/O modules have no trainer at all, not even as a parameter they pass on
    for name in ("run_state.py", "format.py", "writer.py", "publish.py", "dirlock.py", "host_state.py"):
        nodes = list(ast.walk(ast.parse((PACKAGE / name).read_text())))
        names = {n.id for n in nodes if isinstance(n, ast.Name)} | {n.arg for n in nodes if isinstance(n, ast.arg)}
        assert not names & {"trainer", "Trainer"}, name


def test_model_checkpoint_hands_the_trainer_to_checkpoint_code_only_through_view_of():
    """ModelCheckpoint keeps the policy; the lock, the checkpointer, commit order and save errors are the
    writer's (``checkpoint/writer.py``), and the only checkpoint function it gives the trainer is ``view_of``."""
    tree = ast.parse(MODEL_CHECKPOINT.read_text())
    given = {
        n.func.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
        for a in n.args
        if isinstance(a, ast.Name) and a.id == "trainer"
    }
    assert given == {"view_of"}, given
    source = MODEL_CHECKPOINT.read_text()
    for mechanic in ("dirlock.acquire", "publishing_checkpointer", "check_for_errors", "next_commit_seq", "marked("):
        assert mechanic not in source, mechanic
    assert not [fn for fn, attr, _ in _trainer_attributes(MODEL_CHECKPOINT) if fn in ("_write", "_take_directory")]
