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
from jaxlight.strategies import DataParallel, HostOffload, offload
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
    ev = re.sub(r"U+", "U", "".join(_events(_gpu_program(streamed))))
    # in the order jax emits it (after the forward and backward arithmetic): groups 0 and 1 fetched, then per
    # group its update and write-back, with the next group's fetch (behind a barrier from group 2 on) before
    # the update after it; the last group's write-back is the run of output copies left out by _events
    assert re.fullmatch(rf"U+F+(?:UW+BF+){{{groups - 2}}}UW+U", ev), ev

    # each barrier holds one group's host leaves and the write-backs of the group two before it (no
    # gradients): the copies in wait for a copy out, not for the backward pass
    body = _gpu_program(streamed)
    barriers = [line for line in body if "stablehlo.optimization_barrier" in line]
    n_host = sum(
        x.sharding.memory_kind == "pinned_host"
        for x in jax.tree.leaves((streamed.train_state.opt_state, streamed.train_state.callback_state))
    )
    writes = {line.split("=")[0].strip() for line in body if '_xla_buffer_placement = "pinned_host"' in line}
    for line in barriers:
        operands = line.split("optimization_barrier")[1].split(":")[0].replace(",", " ").split()
        host = [o for o in operands if o.startswith("%arg")]
        assert 0 < len(host) < n_host, line
        assert set(operands) - set(host) <= writes and len(operands) > len(host), line

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


# ------------------------------------------------------------------- overlap (issue 31, item 4)
_ARITH = re.compile(r"^(multiply|divide|sqrt|rsqrt|add|subtract|dot|power|exponential|tanh|log)$")


def _entry(hlo: str) -> list[tuple[str, str, list[str], str]]:
    """The ENTRY computation of an HLO module's text, in program order: (name, opcode, operand names, line)."""
    lines = hlo.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY "))
    out, names = [], set()
    for line in lines[start + 1 :]:
        if line.strip() == "}":
            break
        name, rhs = line.strip().removeprefix("ROOT ").split(" = ", 1)
        if rhs.startswith("("):  # a tuple type: skip its balanced parentheses
            depth = 0
            for j, ch in enumerate(rhs):
                depth += {"(": 1, ")": -1}.get(ch, 0)
                if depth == 0:
                    rhs = rhs[j + 1 :]
                    break
        m = re.match(r"\s*\S*\s+([\w\-]+)\((.*?)\)(,|$)", rhs)
        ops = [o.strip() for o in m.group(2).split(",") if o.strip() in names]
        out.append((name, m.group(1), ops, line))
        names.add(name)
    return out


def _gpu_hlo(trainer) -> str:
    """The trainer's train step as XLA:GPU receives it (before its passes), as HLO text."""
    eng = trainer.engine
    batch = BatchPlacer(trainer.mesh, strategy=trainer.strategy).place(token_batches(1, 16, vocab=32)[0])
    with eng.context():
        traced = jax.jit(
            eng.builder.train_step, donate_argnums=0, out_shardings=(eng.state_shardings, None, None)
        ).trace(trainer.train_state, batch, np.int32(0), np.bool_(False))
        return traced.lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")


def _copy_groups(hlo: str, plan_groups: list[list[int]]):
    """The in-step copies of the step and their dependences.

    Returns (entry, groups, data, order, position). ``data[name]``: the instructions ``name`` depends on for
    its value (an element read out of an optimization barrier's tuple depends on that element only);
    ``order[name]``: everything it must wait for (a barrier's outputs wait for all of its operands).
    ``groups`` lists per group of the streaming plan (``plan_groups``: the step arguments of each group, in
    stream order) its fetches (copies of those arguments into device memory) and write-backs (copies into
    pinned host memory of values computed from them)."""
    entry = _entry(hlo)
    position = {n: i for i, (n, *_) in enumerate(entry)}
    by_name = {n: (op, ops, line) for n, op, ops, line in entry}

    def element(n: str) -> str | None:
        """For an element read out of (a barrier of) a tuple: the instruction it reads."""
        op, ops, line = by_name[n]
        if op != "get-tuple-element":
            return None
        inner = ops[0]
        if by_name[inner][0] == "opt-barrier":
            inner = by_name[inner][1][0]
        if by_name[inner][0] != "tuple":
            return None
        return by_name[inner][1][int(re.search(r"index=(\d+)", line).group(1))]

    data: dict[str, set[str]] = {}
    order: dict[str, set[str]] = {}
    for name, _, ops, _ in entry:
        order[name] = set(ops).union(*(order[o] for o in ops))
        src = element(name)
        direct = [src] if src is not None else ops
        data[name] = set(direct).union(*(data[o] for o in direct))

    def source(n: str) -> str:
        """The instruction a value is passed through from (sharding annotations, tuples, barriers)."""
        op, ops, line = by_name[n]
        if op == "custom-call" and 'custom_call_target="Sharding"' in line:
            return source(ops[0])
        src = element(n)
        return n if src is None else source(src)

    def argument(n: str) -> int | None:
        op, _, line = by_name[n]
        return int(re.search(r"parameter\((\d+)\)", line).group(1)) if op == "parameter" else None

    group_of = {arg: g for g, args in enumerate(plan_groups) for arg in args}
    groups: list[dict[str, list[str]]] = [{"fetch": [], "write": []} for _ in plan_groups]
    copies = [(n, line) for n, op, _, line in entry if op == "custom-call" and "annotate_device_placement" in line]
    fetches = {}
    for n, line in copies:
        if '_xla_buffer_placement="device"' not in line:
            continue
        arg = argument(source(by_name[n][1][0]))
        if arg is not None:  # not one of jax's annotations of computed outputs
            groups[group_of[arg]]["fetch"].append(n)
            fetches[n] = group_of[arg]
    for n, line in copies:
        if (
            '_xla_buffer_placement="pinned_host"' in line
            and "annotate_device" not in by_name[source(by_name[n][1][0])][2]
        ):
            # (jax's annotation of an output already copied to host memory is not another write-back)
            mine = {fetches[f] for f in data[n] if f in fetches}
            if mine:
                assert len(mine) == 1, (n, mine)  # a written-back value is computed from one group's state
                groups[mine.pop()]["write"].append(n)
    return entry, groups, data, order, position


def test_streamed_copies_can_overlap_compute_in_the_program_xla_gpu_schedules(monkeypatch):
    """Issue 31: the copies of the offloaded state must run while the device computes. XLA:CPU strips
    memory-placement annotations before scheduling (host and device are the same RAM: its compiled HLO has
    no copy at all, checked below), so there are no copy-start/copy-done pairs to read on this machine.
    What is checked instead is the structure that lets XLA:GPU's scheduler overlap them, in the HLO it
    receives: groups 0 and 1 are fetched from the step's inputs alone (their copies can run under the forward
    and backward pass); the fetch of group g+1 is issued before the update of group g, does not depend on it,
    and has arithmetic of that update between it and its own first use; and it waits for the write-back of
    group g-1 (at most three groups in device memory)."""
    groups_n = 4
    trainer, _ = _fit(DataParallel() + HostOffload(stream=groups_n), max_steps=1, accumulate=1)
    plans = []
    plan_of = offload._stream_plan
    monkeypatch.setattr(offload, "_stream_plan", lambda *a: plans.append(plan_of(*a)) or plans[-1])
    hlo = _gpu_hlo(trainer)
    # the state is the step's first argument: a plan's flat index of a state leaf is its HLO parameter number
    entry, groups, data, order, position = _copy_groups(hlo, plans[-1].groups)
    op_of = {n: op for n, op, *_ in entry}
    assert len(groups) == groups_n, [g["fetch"] for g in groups]
    n_host = sum(
        x.sharding.memory_kind == "pinned_host"
        for x in jax.tree.leaves((trainer.train_state.opt_state, trainer.train_state.callback_state))
    )
    assert sum(len(g["fetch"]) for g in groups) == n_host  # every offloaded leaf is fetched, once
    assert all(g["write"] for g in groups)

    def arith(names):
        return {a for a in names if _ARITH.match(op_of[a])}

    def update(g):  # the arithmetic that reads group g's fetched state
        fs = set(groups[g]["fetch"])
        return {n for n, op, *_ in entry if _ARITH.match(op) and data[n] & fs}

    dots = {n for n, op, *_ in entry if op == "dot"}  # the forward and backward pass (Adam has none)
    assert dots
    for g in (0, 1):  # can start with the step: neither they nor the matmuls wait for the other
        for f in groups[g]["fetch"]:
            assert not arith(order[f]), (g, f, sorted(arith(order[f]))[:5])
            assert not any(f in order[d] for d in dots), (g, f)
    for g in range(groups_n - 1):
        upd = update(g)
        assert upd and not (upd & update(g + 1))
        for f in groups[g + 1]["fetch"]:
            # the copy in of group g+1 and the update of group g wait for nothing of each other, so they can run
            # at the same time; the update of group g+1 waits for it
            assert not (order[f] & upd) and not (order[f] & set(groups[g]["write"])), (g, f)
            assert not any(f in order[u] for u in upd), (g, f)
            assert any(f in data[u] for u in update(g + 1)), (g, f)
            if g + 1 >= 2:  # and it waits for group g-1's write-back: at most three groups in device memory
                assert set(groups[g - 1]["write"]) <= order[f], (g, f)
                assert not (set(groups[g]["write"]) & order[f])
        for w in groups[g]["write"]:  # the write-back of group g does not wait for later groups' updates
            assert not (order[w] & update(g + 1)), (g, w)

    # XLA:CPU: the compiled program has no copies (memory-placement annotations stripped): no async pairs
    compiled = trainer.compiled["train"].as_text()
    assert "annotate_device_placement" not in compiled
    assert not re.search(r"\b(copy-start|copy-done)\(", compiled)
