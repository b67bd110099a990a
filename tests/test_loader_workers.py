"""DataLoader worker processes without JAX's fork hazard (issue 23, item 4).

``DataLoader(num_workers=2)`` printed JAX's ``RuntimeWarning: os.fork() was called ... will likely lead to a
deadlock`` on every fit: its workers were forked from a process running JAX's threads. Such a loader now
gets ``multiprocessing_context="forkserver"`` (said once), unless a fork-free start would fail.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import workers
from jaxlight.rank_zero import WarnOnce
from tests.core_models import Classifier, make_data, max_diff, quiet

torch = pytest.importorskip("torch")

X, Y = make_data(96)


def loader(num_workers, **kw):
    ds = torch.utils.data.TensorDataset(torch.from_numpy(X), torch.from_numpy(Y))
    gen = torch.Generator().manual_seed(7)
    return torch.utils.data.DataLoader(ds, batch_size=16, shuffle=True, generator=gen, num_workers=num_workers, **kw)


def fit(dl):
    model = Classifier()
    trainer = jl.Trainer(max_epochs=2, devices=1, **quiet())
    trainer.fit(model, dl)
    return nnx.state(model.net, nnx.Param), trainer


def test_two_epochs_with_workers_and_a_shuffled_sampler_no_fork(monkeypatch, capsys):
    monkeypatch.setattr(workers, "_said", set())
    with warnings.catch_warnings(record=True) as before:  # the forked workers of before: JAX warns
        warnings.simplefilter("always")
        ref, _ = fit(loader(2, multiprocessing_context="fork"))
    assert any("os.fork() was called" in str(w.message) for w in before)
    dl = loader(2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got, trainer = fit(dl)
    forks = [str(w.message) for w in seen if "fork" in str(w.message)]
    assert forks == []  # neither JAX's deadlock warning nor jaxlight's
    assert dl.multiprocessing_context.get_start_method() == workers.fork_free_method()
    assert trainer.global_step == 12 and max_diff(got, ref) <= 1e-6  # the same shuffled batches, in order
    out = capsys.readouterr().out
    assert out.count("starts its worker processes with multiprocessing_context='forkserver'") == 1
    fit(loader(2))  # said once per process
    assert "multiprocessing_context" not in capsys.readouterr().out


def test_a_context_of_the_users_own_is_kept():
    dl = loader(2, multiprocessing_context="spawn")
    workers.safe_workers(dl)
    assert dl.multiprocessing_context.get_start_method() == "spawn"
    plain = loader(0)
    assert workers.safe_workers(plain) is plain and plain.multiprocessing_context is None


def test_a_loader_a_fresh_process_cannot_load_keeps_fork_and_says_why(monkeypatch):
    monkeypatch.setattr(workers, "_warn_once", WarnOnce())
    dl = loader(2, collate_fn=lambda rows: torch.utils.data.default_collate(rows))
    with pytest.warns(RuntimeWarning, match=r"keeps starting its workers with os.fork\(\).*cannot be pickled"):
        workers.safe_workers(dl)
    assert dl.multiprocessing_context is None


def test_a_script_that_trains_outside_its_main_guard_keeps_fork(tmp_path):
    """The worker runs the main script again: training at its top level would run in every worker."""
    script = tmp_path / "train.py"
    script.write_text("x = 1\nif __name__ == '__main__':\n    y = 2\n")
    main = type("Main", (), {"__file__": str(script), "__spec__": None})()
    assert workers._main_reruns(main)
    assert workers._guards(main) == [(2, 3)]


class FirstValues(jl.Callback):
    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append(float(np.asarray(batch[0])[0, 0]))


def test_a_plain_shuffled_loader_resumes_in_its_own_order(tmp_path):
    # a plain DataLoader has no state_dict: its order comes from the generator's state when an epoch starts,
    # which the checkpoint now keeps (the epoch's start inside it, the epoch's end after its last batch)
    def dl():
        ds = torch.utils.data.TensorDataset(torch.from_numpy(X), torch.from_numpy(Y))
        return torch.utils.data.DataLoader(ds, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(7))

    full = FirstValues()
    ckpt = jl.callbacks.ModelCheckpoint(dirpath=str(tmp_path), save_top_k=-1, every_n_train_steps=3)
    kw = {**quiet(), "enable_checkpointing": True}
    jl.Trainer(max_epochs=3, devices=1, callbacks=[full, ckpt], **kw).fit(Classifier(), dl())
    assert len(full.seen) == 18
    for name, done in [("epoch=0-step=6", 6), ("epoch=1-step=9", 9), ("epoch=1-step=12", 12)]:
        rec = FirstValues()
        trainer = jl.Trainer(max_epochs=3, devices=1, callbacks=[rec], **quiet())
        trainer.fit(Classifier(), dl(), ckpt_path=str(tmp_path / f"{name}.ckpt"))
        assert rec.seen == full.seen[done:], name
