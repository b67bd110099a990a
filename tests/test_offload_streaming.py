"""HostOffload(stream=N): the offloaded state fetched, updated and written back group by group inside the
step (issue 25). Values stay bit-identical to no offload; the program XLA:GPU gets (lowered for "cuda"
on this CPU machine: XLA:CPU lowers in-step memory moves to nothing) interleaves the copies with the
updates instead of fetching everything after the backward pass."""

from __future__ import annotations

import re
import warnings

import jax
import numpy as np
import optax
import pytest

import jaxlight as jl
from jaxlight.data import BatchPlacer
from jaxlight.strategies import DataParallel, HostOffload
from jaxlight.strategies.placement import PlacementWarning
from tests.helpers import quiet
from tests.strategy_models import LM, token_batches
from tests.test_strategies_offload import DIMS, _fit, _kinds, _leaves

S = jl.strategies


@pytest.mark.default_codegen  # compares two compiled programs bit for bit: see tests/test_default_codegen.py
@pytest.mark.parametrize("base", ["ddp", "fsdp"])
def test_streamed_offload_is_bit_identical_with_adam_ema_and_accumulation(base):
    ref, _ = _fit(base)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a fallback to fetching at once warns: streaming really ran
        warnings.simplefilter("ignore", PlacementWarning)  # the tiny model stays below fsdp's min_shard (said once)
        off, _ = _fit(S.resolve_strategy(base) + HostOffload(stream=4))
    a, b = _leaves(ref.train_state), _leaves(off.train_state)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert off.global_step == 5 and off.compile_counts == {"train": 1}
    moments = {k: v for k, v in _kinds(off.train_state.opt_state).items() if "mu" in k or "nu" in k}
    assert set(moments.values()) == {"pinned_host"}
    assert set(_kinds(off.train_state.callback_state).values()) == {"pinned_host"}


def _gpu_program(trainer) -> list[str]:
    """The main function of the trainer's train step as lowered for XLA:GPU."""
    eng = trainer.engine
    batch = BatchPlacer(trainer.mesh, strategy=trainer.strategy).place(token_batches(1, 16, vocab=32)[0])
    with eng.context():
        traced = jax.jit(
            eng.builder.train_step, donate_argnums=0, out_shardings=(eng.state_shardings, None, None)
        ).trace(trainer.train_state, batch, np.int32(0), np.bool_(False))
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "func.func public @main" in line)
    end = next(i for i in range(start + 1, len(lines)) if lines[i].strip().startswith("return"))
    return lines[start + 1 : end]


def _events(body: list[str]) -> list[str]:
    """B: an optimization barrier; F: a copy into device memory (a fetch); W: a copy into pinned host memory
    (a write-back); U: arithmetic of the optimizer update (a multiply or a divide). The copies jax adds for
    the step's outputs (the run just before ``return``) are left out."""
    out = []
    for line in body:
        if "stablehlo.optimization_barrier" in line:
            out.append("B")
        elif "annotate_device_placement" in line:
            out.append("F" if '_xla_buffer_placement = "device"' in line else "W")
        elif re.search(r"stablehlo\.(multiply|divide|sqrt)", line):
            out.append("U")
    while out and out[-1] in "FW":
        out.pop()
    return out


def test_streamed_program_interleaves_fetches_updates_and_write_backs():
    groups = 4
    streamed, _ = _fit(DataParallel() + HostOffload(stream=groups), max_steps=1, accumulate=1)
    ev = _events(_gpu_program(streamed))
    assert ev.count("B") == groups, ev
    first = ev.index("B")
    segments = "".join(ev[first:]).split("B")[1:]  # what follows each barrier, up to the next one
    assert len(segments) == groups
    for i, seg in enumerate(segments[:-1]):
        # each group: its fetches, then its update, then its write-back, before the next group's barrier
        assert re.fullmatch(r"F+U[UF]*W+U*", seg), (i, seg)
    assert segments[-1].startswith("F") and "U" in segments[-1]
    # a write-back happens before a later group is even fetched: the copies are spread over the update,
    # not all fetched at its start and written back at its end
    assert ev.index("W") < len(ev) - 1 - ev[::-1].index("F")

    # each barrier holds only its own group's host leaves and gradients: a fetch waits for the gradients
    # of the layers it serves, not for the whole backward pass
    body = _gpu_program(streamed)
    barriers = [line for line in body if "stablehlo.optimization_barrier" in line]
    n_params = len(streamed.train_state.params)
    n_host = sum(
        x.sharding.memory_kind == "pinned_host"
        for x in jax.tree.leaves((streamed.train_state.opt_state, streamed.train_state.callback_state))
    )
    for line in barriers:
        operands = line.split("optimization_barrier")[1].split(":")[0].replace(",", " ").split()
        host = [o for o in operands if o.startswith("%arg")]
        assert 0 < len(host) < n_host, line
        # and some of the gradients (computed in the step, not arguments), never all of them
        assert 0 < len(operands) - len(host) < n_params + n_host, line

    # the unstreamed step: one barrier, every fetch right after it, no write-back before the outputs
    at_once, _ = _fit(DataParallel() + HostOffload(), max_steps=1, accumulate=1)
    ev0 = _events(_gpu_program(at_once))
    assert ev0.count("B") == 1 and "W" not in ev0, ev0
    assert "".join(ev0[ev0.index("B") :]).startswith("BF")


class ClipAfterAdam(LM):
    def configure_optimizers(self):
        # the clip reads every parameter's Adam update, so no group's update can be computed alone
        return optax.chain(optax.scale_by_adam(eps=1e-5), optax.clip_by_global_norm(1e-3), optax.scale(-1e-3))


def test_an_update_mixing_groups_is_fetched_at_once_with_a_warning_and_stays_exact():
    def run(strategy):
        model = ClipAfterAdam(**DIMS)
        trainer = jl.Trainer(strategy=strategy, devices=8, max_steps=3, **quiet(num_sanity_val_steps=None))
        trainer.fit(model, token_batches(3, 16, vocab=32))
        return trainer

    ref = run("ddp")
    with pytest.warns(
        UserWarning, match=r"HostOffload\(stream=3\) fetches the offloaded state at once instead: .*groups"
    ):
        off = run(DataParallel() + HostOffload(stream=3))
    a, b = _leaves(ref.train_state), _leaves(off.train_state)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_stream_must_be_a_count():
    with pytest.raises(ValueError, match=r"stream=-1"):
        HostOffload(stream=-1)
    with pytest.raises(ValueError, match=r"stream=True"):
        HostOffload(stream=True)
    assert HostOffload(stream=0) == HostOffload()
