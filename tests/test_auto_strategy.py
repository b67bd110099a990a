"""strategy="auto": the layout with the fastest estimated step whose compiled step fits device memory.

The numbers come from each candidate's train step compiled ahead of time on abstract shapes
(``memory_analysis()``, the HLO text and the traced step's matmul FLOPs); the tests size
``device_memory`` from the model's own state (parameters plus Adam's two moments) or from the
candidates' compiled needs, never from a recorded run.
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
from jaxlight.planner import (
    CANDIDATES,
    HEADROOM,
    NoStrategyFits,
    StepSpeeds,
    choose_strategy,
    parse_memory,
    peek_first_batch,
)
from jaxlight.strategies import FSDP, DataParallel, HostOffload, Remat, resolve_strategy
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


def _fit(device_memory, callbacks=(), summary=True, model=None):
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
        trainer.fit(model or CenteredLM(), DATA)
    return trainer, out.getvalue()


def _plan_line(out: str, name: str) -> str:
    """The printed plan's line of candidate ``name``."""
    return next(line for line in out.splitlines() if line.split()[:1] == [name])


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
    assert len(lines) == 1 and lines[0].startswith('strategy="auto": ddp (data=8), the fastest estimated step')
    assert "device_memory='1GiB' = 1.0 GB" in lines[0] and f"estimated {choice.chosen.estimate_text()}" in lines[0]
    by = {c.name: c for c in choice.candidates}
    budget = int(2**30 * (1 - HEADROOM))
    assert choice.budget == budget
    # the same matmul FLOPs everywhere, so ddp's smaller collectives make it the fastest that fits; neither
    # remat (more FLOPs, where the layout fits as it is) nor offload (host copies on top) can be faster:
    # not compiled, and the plan says why
    fits = [c for c in choice.candidates if c.error is None and c.device_bytes <= budget]
    assert {"ddp", "fsdp", "fsdp+tp"} <= {c.name for c in fits}
    assert all(by["ddp"].estimate_s < c.estimate_s for c in fits if c.name != "ddp")
    assert len({c.flops for c in fits}) == 1 and by["ddp"].link_s < by["fsdp"].link_s
    assert not any(HostOffload() in c.strategy.pieces or Remat() in c.strategy.pieces for c in choice.candidates)
    for name in CANDIDATES:  # every candidate is in the plan, with its bytes and estimate or why not
        line = _plan_line(out, name)
        if name in by:
            c = by[name]
            assert jl.summary.fmt_bytes(c.device_bytes) in line and c.estimate_text() in line, line
        elif "remat" in name:
            assert f"not compiled: {name.removesuffix('+remat')} fits without recomputing" in line, line
        else:
            assert "not compiled: cannot be faster than ddp" in line, line
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
    assert choice.chosen is min(fitting, key=lambda c: (c.estimate_s, c.device_bytes))
    assert choice.chosen.name == "fsdp" and trainer.strategy == resolve_strategy("fsdp")
    assert dict(trainer.mesh.shape)["fsdp"] == 8 and trainer.engine.strategy == FSDP().as_strategy()
    big = [v for v in trainer.train_state.params.values() if v.size >= 2**16]
    assert big and all(not v.sharding.is_fully_replicated for v in big)  # placed as chosen
    assert math.isfinite(float(trainer.callback_metrics["train_loss"]))
    line = next(line for line in out.splitlines() if 'strategy="auto"' in line)
    assert line.startswith('strategy="auto": fsdp (fsdp=8)')
    assert _plan_line(out, "ddp").endswith("does not fit") and _plan_line(out, "fsdp").endswith("chosen")


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
    # offloading the moments or recomputing the activations is what helps most
    assert HostOffload() in smallest.strategy.pieces or Remat() in smallest.strategy.pieces
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
    # remat: the same layout in less device memory for more FLOPs (the recompute, counted in the traced step)
    assert by["fsdp+remat"].step_bytes < by["fsdp"].step_bytes and by["fsdp+remat"].flops > by["fsdp"].flops
    assert by["fsdp"].unset_remat > 0  # CenteredLM's LayerStack leaves remat unset


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


def test_remat_is_chosen_over_offload_when_it_fits_and_is_estimated_faster(too_small):
    """Issue 31: "auto" picked host offload (3.6x slower on an H200) where LayerStack remat would fit."""
    _, err = too_small
    by = {c.name: c for c in err.candidates}
    both = max(by["fsdp+remat"].device_bytes, by["fsdp+offload"].device_bytes)
    assert both < by["fsdp"].device_bytes
    memory = int((both + by["fsdp"].device_bytes) / 2 / (1 - HEADROOM))  # remat and offload fit, fsdp not
    model = CenteredLM()
    trainer, out = _fit(memory, model=model)
    choice = trainer.auto_strategy.choice
    cands = {c.name: c for c in choice.candidates}
    fitting = [c for c in choice.candidates if c.error is None and c.device_bytes <= choice.budget]
    assert {"fsdp+remat", "fsdp+offload"} <= {c.name for c in fitting} and "fsdp" not in {c.name for c in fitting}
    assert choice.chosen is min(fitting, key=lambda c: (c.estimate_s, c.device_bytes))
    assert Remat() in choice.chosen.strategy.pieces and trainer.strategy == choice.chosen.strategy
    remat, off = cands["fsdp+remat"], cands["fsdp+offload"]
    # the trade the estimate weighs: the recompute's FLOPs against the moments' trips over the host link
    assert remat.compute_s > off.compute_s and off.host_s > 0 == remat.host_s
    assert remat.estimate_s < off.estimate_s
    # the plan says what it chose and that it rematerialises, and lists both with bytes and estimates
    head = next(line for line in out.splitlines() if 'strategy="auto"' in line)
    assert "rematerialises (policy 'full') the LayerStacks built with remat=None" in head
    for c in (remat, off):
        line = _plan_line(out, c.name)
        assert jl.summary.fmt_bytes(c.device_bytes) in line and c.estimate_text() in line, line
    assert "host copies" in _plan_line(out, "fsdp+offload")
    # it trained with the stacks rematerialised, and the user's module still says remat=None
    assert model.net.blocks.remat is None and math.isfinite(float(trainer.callback_metrics["train_loss"]))
    assert trainer.engine.strategy.find(Remat) == Remat()


class UserRematLM(CenteredLM):
    """CenteredLM whose LayerStack has an explicit remat: "auto" must keep it and has no remat to add."""

    def configure_model(self) -> None:
        super().configure_model()
        self.net.blocks.remat = "dots_saveable"


def test_offload_is_chosen_when_it_is_the_only_fit_and_an_explicit_remat_is_kept():
    kw = dict(device_memory=10**9, candidates=("fsdp", "fsdp+remat", "fsdp+offload"))
    tx = jl.optim.configure(CenteredLM().configure_optimizers())
    probe = choose_strategy(UserRematLM(), tx, DATA[0], jax.devices(), **kw)
    fsdp = next(c for c in probe.candidates if c.name == "fsdp")
    assert fsdp.unset_remat == 0  # the only stack has remat set: a Remat piece would change nothing
    with pytest.raises(NoStrategyFits) as e:
        choose_strategy(UserRematLM(), tx, DATA[0], jax.devices(), **{**kw, "device_memory": 1000})
    off = next(c for c in e.value.candidates if c.name == "fsdp+offload")
    assert off.device_bytes < fsdp.device_bytes
    memory = int((off.device_bytes + fsdp.device_bytes) / 2 / (1 - HEADROOM))
    choice = choose_strategy(UserRematLM(), tx, DATA[0], jax.devices(), **{**kw, "device_memory": memory})
    assert choice.chosen.name == "fsdp+offload" and HostOffload() in choice.strategy.pieces
    assert [c.name for c in choice.candidates] == ["fsdp", "fsdp+offload"]
    assert "fsdp+remat" in choice.message and "not compiled: the model has no LayerStack built with remat=None" in (
        choice.message
    )
    model = UserRematLM()
    trainer, out = _fit(memory, model=model)
    assert HostOffload() in trainer.strategy.pieces and model.net.blocks.remat == "dots_saveable"
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(trainer.train_state.opt_state) if x.ndim}
    assert kinds == {"pinned_host"}  # Adam's moments live in host memory, as chosen


def test_the_estimate_decides_not_the_order(too_small):
    """With a host link fast and FLOPs slow, the same two fitting candidates rank the other way round."""
    _, err = too_small
    by = {c.name: c for c in err.candidates}
    memory = int((max(by["fsdp+remat"].device_bytes, by["fsdp+offload"].device_bytes) + by["fsdp"].device_bytes) / 2)
    tx = jl.optim.configure(CenteredLM().configure_optimizers())
    kw = dict(device_memory=int(memory / (1 - HEADROOM)), candidates=("fsdp", "fsdp+remat", "fsdp+offload"))
    slow_flops = StepSpeeds(flops_per_s=1e9, link_bytes_per_s=1e10, host_bytes_per_s=1e13)
    choice = choose_strategy(CenteredLM(), tx, DATA[0], jax.devices(), speeds=slow_flops, **kw)
    assert choice.chosen.name == "fsdp+offload", choice.message
    assert "1e+09 FLOP/s" in choice.message and "(given)" in choice.message
    with pytest.raises(ValueError, match=r"StepSpeeds\(host_bytes_per_s=0\) must be a positive number"):
        StepSpeeds(1e9, 1e9, 0)


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


def test_the_remat_piece_fills_only_stacks_left_unset():
    """Remat(policy) rematerialises a LayerStack built with remat=None and leaves an explicit remat as set."""
    import contextlib
    import re

    import jax.numpy as jnp
    from flax import nnx

    from jaxlight.strategies.remat import counting_unset_remat

    def policies(stack, piece=None):
        graph, params, rest = nnx.split(stack, nnx.Param, ...)
        loss = lambda p, x: (nnx.merge(graph, p, rest)(x) ** 2).sum()
        with piece.trace_context(None) if piece else contextlib.nullcontext(), counting_unset_remat() as seen:
            text = str(jax.make_jaxpr(jax.grad(loss))(params, jnp.ones((3, 4))))
        return re.findall(r"policy=(<function (\w+)|\w+)", text), len(seen)

    make = lambda r: nnx.Linear(4, 4, rngs=r)
    unset = jl.nn.LayerStack(make, 2, rngs=nnx.Rngs(0))
    explicit = jl.nn.LayerStack(make, 2, rngs=nnx.Rngs(0), remat="dots_saveable")
    assert policies(unset) == ([], 1)  # no piece: nothing rematerialised (the stack was counted as unset)
    assert policies(unset, Remat()) == ([("<function nothing_saveable", "nothing_saveable")], 1)
    assert policies(explicit, Remat()) == ([("DotsSaveable", "")], 0)  # the user's policy, not the piece's
    assert resolve_strategy("fsdp+remat") == FSDP() + Remat()
    with pytest.raises(ValueError, match="unknown remat policy 'fast'"):
        Remat("fast")
    with pytest.raises(ValueError, match=r"Remat\(policy=None\)"):
        Remat(None)
