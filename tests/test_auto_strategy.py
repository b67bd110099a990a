"""strategy="auto": the layout with the least communication whose compiled step fits device memory.

The numbers come from each candidate's train step compiled ahead of time on abstract shapes
(``memory_analysis()`` and the HLO text); the tests size ``device_memory`` from the model's own
state (parameters plus Adam's two moments), never from a recorded run.
"""

from __future__ import annotations

import contextlib
import io
import math

import jax
import numpy as np
import pytest

import jaxlight as jl
from jaxlight.errors import MisconfigurationError
from jaxlight.planner import CANDIDATES, HEADROOM, NoStrategyFits, choose_strategy, parse_memory, peek_first_batch
from jaxlight.strategies import FSDP, DataParallel, HostOffload, resolve_strategy
from tests.helpers import quiet
from tests.verify_models import CenteredLM, batches

DATA = batches(2)


def _state_bytes() -> tuple[int, int]:
    """(parameter bytes, parameter + Adam moment bytes) of CenteredLM, from its parameters."""
    from flax import nnx

    m = CenteredLM()
    with nnx.use_eager_sharding(False):
        m.configure_model()
    p = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(m.net, nnx.Param)))
    return p, 3 * p


def _fit(device_memory, callbacks=(), summary=True):
    # the strategy="auto" line is printed with the model summary (issue 23): on here, to read it
    trainer = jl.Trainer(
        strategy="auto",
        device_memory=device_memory,
        devices=8,
        max_steps=1,
        callbacks=list(callbacks),
        **quiet(enable_model_summary=summary, num_sanity_val_steps=None),
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer.fit(CenteredLM(), DATA)
    return trainer, out.getvalue()


def test_device_memory_forms():
    assert parse_memory("2GiB") == 2 * 1024**3
    assert parse_memory("512MB") == 512 * 10**6
    assert parse_memory("1.5 gb") == 1_500_000_000
    assert parse_memory(4096) == 4096 and parse_memory(np.int64(7)) == 7
    for bad in ("2 gigs", "2", "GiB", "-1GB", 0, -5, 1.5, True, None, "0.1B"):
        with pytest.raises(ValueError, match=r"'2GiB', '512MB'.*KiB, MiB, GiB, TiB powers of 1024"):
            parse_memory(bad)
    # the Trainer refuses before any work: a bad size, and a size that nothing would read
    with pytest.raises(MisconfigurationError, match="device_memory='2 gigs' is not a size"):
        jl.Trainer(strategy="auto", device_memory="2 gigs", logger=False)
    with pytest.raises(MisconfigurationError, match="read only by strategy='auto'"):
        jl.Trainer(strategy="fsdp", device_memory="2GiB", logger=False)


def test_cpu_without_device_memory_keeps_data_parallel():
    trainer, out = _fit(None)
    assert trainer.strategy == resolve_strategy("ddp") and dict(trainer.mesh.shape)["data"] == 8
    assert out.count('strategy="auto"') == 1 and "cpu devices report no memory limit" in out
    assert trainer.auto_strategy.choice.candidates == []  # nothing compiled for nothing to choose by


def test_the_line_is_quiet_with_the_summary_off():
    """Issue 23: the line was printed on every fit, even with enable_model_summary=False."""
    trainer, out = _fit(None, summary=False)
    assert 'strategy="auto"' not in out
    assert "cpu devices report no memory limit" in trainer.auto_strategy.choice.message  # still there to read


def test_small_model_picks_ddp_and_says_why():
    params, _ = _state_bytes()
    trainer, out = _fit("1GiB", callbacks=[jl.callbacks.EMA(decay=0.9)])
    choice = trainer.auto_strategy.choice
    assert trainer.strategy == resolve_strategy("ddp") and choice.chosen.name == "ddp"
    lines = [line for line in out.splitlines() if 'strategy="auto"' in line]
    assert len(lines) == 1 and lines[0].startswith('strategy="auto": ddp (data=8), the least communication')
    assert "device_memory='1GiB' = 1.0 GB" in lines[0] and "of collectives" in lines[0]
    by = {c.name: c for c in choice.candidates}
    budget = int(2**30 * (1 - HEADROOM))
    assert choice.budget == budget
    # every candidate that fits moves more than ddp; offload variants cannot move less and are not compiled
    fits = [c for c in choice.candidates if c.error is None and c.device_bytes <= budget]
    assert {"ddp", "fsdp", "fsdp+tp"} <= {c.name for c in fits}
    assert all(by["ddp"].traffic < c.traffic for c in fits if c.name != "ddp")
    assert not any(HostOffload() in c.strategy.pieces for c in choice.candidates)
    # the collectives are the compiled step's: ddp all-reduces and gathers nothing, fsdp gathers weights
    assert by["ddp"].collectives.counts.get("all-gather", 0) == 0 < by["fsdp"].collectives.counts["all-gather"]
    # ddp's need holds the replicated parameters + Adam state; the EMA copy is counted on top
    assert by["ddp"].extra_bytes == params and by["ddp"].device_bytes >= 4 * params
    assert by["fsdp"].extra_bytes < 0.35 * params
    ema = trainer.train_state.callback_state
    assert sum(x.nbytes for x in jax.tree.leaves(ema)) == params  # the real EMA state is that copy


def test_memory_below_the_replicated_state_picks_fsdp():
    params, replicated = _state_bytes()
    trainer, out = _fit(replicated)  # ddp would hold all of it on every device, plus gradients
    choice = trainer.auto_strategy.choice
    by = {c.name: c for c in choice.candidates}
    assert by["ddp"].device_bytes > choice.budget >= by["fsdp"].device_bytes
    fitting = [c for c in choice.candidates if c.error is None and c.device_bytes <= choice.budget]
    assert choice.chosen is min(fitting, key=lambda c: (c.traffic, c.device_bytes))
    assert choice.chosen.name == "fsdp" and trainer.strategy == resolve_strategy("fsdp")
    assert dict(trainer.mesh.shape)["fsdp"] == 8 and trainer.engine.strategy == FSDP().as_strategy()
    big = [v for v in trainer.train_state.params.values() if v.size >= 2**16]
    assert big and all(not v.sharding.is_fully_replicated for v in big)  # placed as chosen
    assert math.isfinite(float(trainer.callback_metrics["train_loss"]))
    line = next(line for line in out.splitlines() if 'strategy="auto"' in line)
    assert line.startswith('strategy="auto": fsdp (fsdp=8)') and "ddp needs" in line


@pytest.fixture(scope="module")
def too_small():
    """Every candidate's need, from a budget smaller than 1/8 of the parameters (no layout holds less)."""
    params, _ = _state_bytes()
    memory = params // 8
    with pytest.raises(NoStrategyFits) as e:
        choose_strategy(
            CenteredLM(),
            jl.optim.configure(CenteredLM().configure_optimizers()),
            DATA[0],
            jax.devices(),
            device_memory=memory,
        )
    return memory, e.value


def test_memory_below_every_layout_raises_with_the_numbers(too_small):
    memory, err = too_small
    names = [c.name for c in err.candidates]
    assert names == list(CANDIDATES)
    assert all(c.error is None and c.device_bytes > err.budget for c in err.candidates)
    smallest = min(err.candidates, key=lambda c: c.device_bytes)
    assert HostOffload() in smallest.strategy.pieces  # offloading the moments is what helps most
    msg = str(err)
    from jaxlight.summary import fmt_bytes

    assert f"no candidate layout fits in {fmt_bytes(int(memory * (1 - HEADROOM)))} per device" in msg
    assert f"the smallest requirement is {smallest.name}" in msg and fmt_bytes(smallest.device_bytes) in msg
    for c in err.candidates:
        assert f"{c.name} needs {fmt_bytes(c.device_bytes)}" in msg
    # fsdp's need is its compiled step: the sharded state is 1/8 of ddp's
    by = {c.name: c for c in err.candidates}
    assert by["fsdp"].step_bytes < by["ddp"].step_bytes
    assert by["fsdp+offload"].host_bytes > 0 and by["fsdp"].host_bytes == 0


def test_trainer_raises_before_any_state_is_placed(too_small):
    memory, _ = too_small
    trainer = jl.Trainer(
        strategy="auto",
        device_memory=memory,
        devices=8,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    with pytest.raises(NoStrategyFits, match="no candidate layout fits"):
        trainer.fit(CenteredLM(), DATA)
    assert trainer.train_state is None


def test_memory_between_offload_and_fsdp_picks_offload(too_small):
    _, err = too_small
    by = {c.name: c for c in err.candidates}
    fitting_offload = by["fsdp+offload"].device_bytes
    assert fitting_offload < by["fsdp"].device_bytes
    memory = int((fitting_offload + by["fsdp"].device_bytes) / 2 / (1 - HEADROOM))
    trainer, out = _fit(memory)
    chosen = trainer.auto_strategy.choice.chosen
    assert HostOffload() in chosen.strategy.pieces and chosen.device_bytes < by["fsdp"].device_bytes
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(trainer.train_state.opt_state) if x.ndim}
    assert kinds == {"pinned_host"}  # Adam's moments live in host memory, as chosen
    assert "host copies" in next(line for line in out.splitlines() if 'strategy="auto"' in line)


@pytest.mark.filterwarnings("ignore:.set_vital. is deprecated")
def test_peeking_the_first_batch_keeps_the_data_order():
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = TensorDataset(torch.arange(64).reshape(32, 2))
    for make in (
        lambda: DataLoader(data, batch_size=4, shuffle=True),  # draws from torch's global generator
        lambda: DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3)),
        lambda: StatefulDataLoader(data, batch_size=4, shuffle=True),
    ):
        torch.manual_seed(0)
        expected = [b[0].tolist() for b in make()]
        torch.manual_seed(0)
        loader = make()
        first = peek_first_batch(loader)
        assert first[0].tolist() == expected[0]
        assert [b[0].tolist() for b in loader] == expected
    with pytest.raises(MisconfigurationError, match="one-shot generator iterator"):
        peek_first_batch(b for b in DATA)
    assert peek_first_batch(DATA) is DATA[0]


def test_choice_is_made_once_per_module():
    trainer, _ = _fit(None)
    model = trainer.lightning_module
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer.fit(model, DATA)  # the same module again: its state is placed, the strategy stays
    assert 'strategy="auto"' not in out.getvalue() and trainer.strategy == DataParallel().as_strategy()
