"""HostOffload: optimizer moments and EMA in pinned host memory, values bit-identical to no offload.

CPU devices run offloaded programs, so these tests prove the wiring and the values; XLA:CPU's
memory_analysis() reports no host bytes, so host bytes are counted from the arrays' shardings.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxlight as jl
from jaxlight.callbacks import EMA, ThroughputMonitor
from jaxlight.summary import per_device_bytes, summarize
from tests.core_models import quiet
from tests.strategy_models import LM, token_batches

DIMS = dict(embed=32, mlp=64, vocab=32, heads=2)


def _fit(strategy, max_steps=5, accumulate=2, callbacks=(), **kw):
    model = LM(**DIMS)
    ema = EMA(decay=0.9)
    trainer = jl.Trainer(
        strategy=strategy,
        devices=8,
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        callbacks=[ema, *callbacks],
        **quiet(**kw),
    )
    trainer.fit(model, token_batches(2 * max_steps * accumulate, 16, vocab=32))
    return trainer, model


def _leaves(state):
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}


def _kinds(tree):
    return {jax.tree_util.keystr(p): x.sharding.memory_kind for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.default_codegen  # compares two compiled programs bit for bit: see tests/test_default_codegen.py
@pytest.mark.parametrize("base", ["ddp", "fsdp", "fsdp+tp"])
def test_offload_is_bit_identical_with_adam_ema_and_accumulation(base):
    ref, _ = _fit(base)
    off, _ = _fit(base + "+offload")
    a, b = _leaves(ref.train_state), _leaves(off.train_state)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert off.global_step == 5 and off.compile_counts == {"train": 1}
    # and the offload really happened (equal values would also come from a silently dropped piece)
    moments = lambda t: {k: v for k, v in _kinds(t.train_state.opt_state).items() if "mu" in k or "nu" in k}
    assert set(moments(off).values()) == {"pinned_host"} and set(moments(ref).values()) == {"device"}
    assert set(_kinds(off.train_state.callback_state).values()) == {"pinned_host"}


def test_only_parameter_mirrors_move_to_host_and_the_step_says_so():
    trainer, _ = _fit("fsdp+offload")
    st = trainer.train_state
    opt = _kinds(st.opt_state)
    ema = _kinds(st.callback_state)
    # Adam moments and the accumulated gradients mirror parameters: host; counters stay on the device
    host = {k for k, v in {**opt, **ema}.items() if v == "pinned_host"}
    device = {k for k, v in {**opt, **ema}.items() if v == "device"}
    assert all(("mu" in k or "nu" in k or "acc_grads" in k) for k in host if k in opt)
    assert all(("count" in k or "window" in k) for k in device), device  # Adam's count, the accumulation window
    assert set(ema.values()) == {"pinned_host"}
    assert {v for k, v in _kinds(st.params).items()} == {"device"}  # parameters never leave the device
    n_params = len(st.params)
    assert sum(1 for k in host if k in opt) == 3 * n_params  # mu, nu, acc_grads per parameter
    # the compiled step writes the same leaves back to host memory
    kinds = trainer.compiled["train"].runtime_executable().get_output_memory_kinds()[0]
    assert kinds.count("pinned_host") == len(host)
    # and a host leaf keeps its parameter's partition spec
    w = "net/blocks/0/up/kernel"
    mu = next(
        x
        for p, x in jax.tree_util.tree_flatten_with_path(st.opt_state)[0]
        if w in jax.tree_util.keystr(p) and "mu" in jax.tree_util.keystr(p)
    )
    assert mu.sharding.spec == st.params[w].sharding.spec and mu.sharding.memory_kind == "pinned_host"


def test_validation_with_offloaded_ema_matches_no_offload():
    val = token_batches(2, 16, vocab=32, seed=3)

    def run(strategy):
        model = LM(**DIMS)

        def validation_step(batch, batch_idx, self=model):
            import optax

            tokens = batch["tokens"]
            logits = self.net(tokens[:, :-1])
            self.log("val_loss", optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean())

        model.validation_step = validation_step
        type(model)._overrides = lambda self, name: True if name == "validation_step" else LM._overrides(self, name)
        trainer = jl.Trainer(strategy=strategy, devices=8, max_steps=3, callbacks=[EMA(decay=0.5)], **quiet())
        trainer.fit(model, token_batches(3, 16, vocab=32), val_dataloaders=val)
        return float(trainer.callback_metrics["val_loss"])

    try:
        assert run("fsdp") == run("fsdp+offload")
    finally:
        del LM._overrides


@pytest.mark.parametrize(
    "save_with,load_with", [("fsdp+offload", "fsdp"), ("fsdp", "ddp+offload"), ("fsdp+offload", "fsdp+tp+offload")]
)
def test_checkpoints_cross_offload_exactly(save_with, load_with, tmp_path):
    saved, _ = _fit(save_with, max_steps=3)
    path = tmp_path / "ckpt"
    saved.save_checkpoint(path)
    model = LM(**DIMS)
    loaded = jl.Trainer(
        strategy=load_with, devices=8, max_steps=3, accumulate_grad_batches=2, callbacks=[EMA(decay=0.9)], **quiet()
    )
    loaded.fit(model, token_batches(12, 16, vocab=32), ckpt_path=str(path))  # restores; nothing left to train
    assert loaded.global_step == 3
    a, b = _leaves(saved.train_state), _leaves(loaded.train_state)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    # placement is what the new trainer asks for
    want = "pinned_host" if "offload" in load_with else "device"
    assert set(_kinds(loaded.train_state.callback_state).values()) == {want}
    for k, x in loaded.train_state.params.items():
        assert x.sharding == loaded.engine.state_shardings.params[k], k


def test_summary_and_throughput_count_host_bytes_apart():
    tm = ThroughputMonitor(window=2)
    trainer, _ = _fit("fsdp+offload", max_steps=4, accumulate=1, callbacks=[tm], log_every_n_steps=2)
    st = trainer.train_state
    host = per_device_bytes(st, "host")
    assert host == per_device_bytes(st.opt_state, "host") + per_device_bytes(st.callback_state)
    assert host > 0 and per_device_bytes(st.opt_state, "device") < 64  # only Adam's count stays
    text = summarize(st.params, st.opt_state, trainer.mesh)
    assert f"device + {jl.summary.fmt_bytes(per_device_bytes(st.opt_state, 'host'))} host" in text
    assert tm.metrics["train/host/state_bytes"] == host
    assert tm.metrics["train/device/state_bytes"] == per_device_bytes(st, "device")


class ReadsMoments(jl.Callback):
    state_on_device = ("opt_state",)


def test_a_callback_needing_device_state_is_refused_by_name():
    with pytest.raises(
        jl.MisconfigurationError,
        match=r"ReadsMoments reads TrainState.opt_state on the device "
        r"between steps .* keeps \d+ of its leaves in 'pinned_host' "
        r"memory; leave opt_state on the device \(e.g. "
        r"HostOffload\(optimizer_state=False\)\)",
    ):
        _fit("fsdp+offload", callbacks=[ReadsMoments()])
    # with the optimizer state left on the device the same callback is fine (EMA still offloaded)
    trainer, _ = _fit(
        jl.strategies.FSDP() + jl.strategies.HostOffload(optimizer_state=False), max_steps=1, callbacks=[ReadsMoments()]
    )
    assert set(_kinds(trainer.train_state.opt_state).values()) == {"device"}
    assert set(_kinds(trainer.train_state.callback_state).values()) == {"pinned_host"}


def test_offloaded_state_is_fetched_only_once_the_gradients_exist():
    """The host->device copies hang off an optimization barrier with the gradients: XLA:GPU otherwise
    starts them during the forward pass and the step's peak holds every offloaded byte (measured on an
    H200: 2.5 GB of temporaries against 1.8 GB). XLA:CPU drops barriers when compiling, so this reads
    the lowered program."""
    import re

    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxlight.step import TrainState
    from jaxlight.strategies.offload import HostOffload

    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    host, dev = NamedSharding(mesh, P(), memory_kind="pinned_host"), NamedSharding(mesh, P())
    w = jnp.ones((4, 4))
    state = TrainState({"w": w}, {}, {"mu": jax.device_put(w, host)}, {"ema": jax.device_put(w, host)}, jnp.int32(0))
    shardings = TrainState({"w": dev}, {}, {"mu": host}, {"ema": host}, dev)

    def update(state, grads, aux):
        mu = 0.9 * state.opt_state["mu"] + grads["w"]
        ema = 0.5 * state.callback_state["ema"] + 0.5 * state.params["w"]
        return state._replace(params={"w": state.params["w"] - mu}, opt_state={"mu": mu}, callback_state={"ema": ema})

    wrapped = HostOffload().wrap_update(update, shardings)

    def step(state):
        grads = jax.grad(lambda p: (jnp.tanh(p["w"]) ** 2).sum())(state.params)
        return wrapped(state, grads, None)

    text = jax.jit(step, out_shardings=shardings).lower(state).as_text()
    header = next(line for line in text.splitlines() if "func.func public @main" in line)
    host_args = re.findall(r'(%arg\d+): tensor<[^>]*> \{mhlo.memory_kind = "pinned_host"', header)
    assert len(host_args) == 2, header
    barriers = [line for line in text.splitlines() if "stablehlo.optimization_barrier" in line]
    assert len(barriers) == 1, barriers
    operands = barriers[0].split("optimization_barrier")[1].split(":")[0].replace(",", " ").split()
    assert sorted(o for o in operands if o.startswith("%arg")) == sorted(host_args)
    assert any(not o.startswith("%arg") for o in operands)  # the gradients, computed in the step
    for arg in host_args:  # the host state is read nowhere else: no copy can start before the barrier
        uses = [line for line in text.splitlines()[1:] if re.search(rf"{arg}\b", line) and "func.func" not in line]
        assert uses == barriers, uses


def _buffers(tree) -> set[int]:
    return {s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(tree) for s in x.addressable_shards}


@pytest.mark.parametrize("async_", [True, False])
def test_an_async_save_never_holds_the_live_offloaded_buffers(async_, tmp_path, monkeypatch):
    """Orbax reads host-memory arrays through zero-copy numpy views it holds until the files are written;
    XLA:GPU then refuses to donate those buffers to the next step ("Donation requested for buffer with
    external reference", seen on an H200). An async save therefore gets copies of the host-resident
    leaves; a synchronous save, done before the next step, does not pay for them."""
    from jaxlight import checkpoint as ckpt

    trainer, _ = _fit("fsdp+offload", max_steps=2)
    st = trainer.train_state
    live_host = _buffers(
        [x for x in jax.tree.leaves((st.opt_state, st.callback_state)) if x.sharding.memory_kind == "pinned_host"]
    )
    assert live_host
    saved = {}
    ck = ckpt._new_checkpointer(async_=async_)
    orig = type(ck).save

    def spy(self, path, *args, **kwargs):
        saved["train"] = kwargs["args"]["train"].item
        return orig(self, path, *args, **kwargs)

    monkeypatch.setattr(type(ck), "save", spy)
    ckpt.save_checkpoint(trainer, tmp_path / "c", checkpointer=ck)
    if async_:
        ck.wait_until_finished()
    handed = _buffers(
        [x for x in jax.tree.leaves(saved["train"]) if getattr(x.sharding, "memory_kind", None) == "pinned_host"]
    )
    assert len(handed) == len(live_host)
    if async_:
        assert handed.isdisjoint(live_host)
    else:
        assert handed == live_host
    # and the copy saved the same values: resuming from it continues exactly (see the cross-offload test)
    assert ckpt.is_complete(tmp_path / "c")
