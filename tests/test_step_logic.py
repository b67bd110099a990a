"""Lightning programs with logic around the step (docs/trainer.md#counters-inside-a-step).

- ``self.global_step`` / ``self.current_epoch`` inside ``training_step`` are traced int32 values, so
  ``jnp.where(self.global_step % 2 == 0, ...)`` decides per step (single steps, ``steps_per_execution``,
  gradient accumulation) and a Python ``if`` on them raises ``TracingError`` naming the attribute;
  the epoch is an argument of the compiled step, so a new epoch compiles nothing.
- Host state a step changes while it is traced (a list it appends to, a counter on a held object) is
  named in a ``HostSideEffectWarning``; a clean module does not warn.
- Parameters ``training_step`` writes (a target network synced from the online one) land, in Lightning's
  order: the write sees the weights at the step's start, the optimizer then updates what it covers.

Every expected value comes from a hand-written jax loop.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight.errors import HostSideEffectWarning
from jaxlight.tracing import TracingError
from tests.helpers import host_params, quiet

IN, ROWS, LR = 4, 8, 0.1


def data(n: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.normal(size=(ROWS, IN)).astype(np.float32)
        out.append((x, (x @ np.arange(1, IN + 1, dtype=np.float32))[:, None]))
    return out


def mse(lin: nnx.Linear, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((lin(x) - y) ** 2)


class Gated(jl.LightningModule):
    """Trains only on odd optimizer steps (``by="global_step"``) or only in epoch 1 (``by="current_epoch"``)."""

    def __init__(self, by: str = "global_step", via_trainer: bool = False) -> None:
        super().__init__()
        self.by, self.via_trainer = by, via_trainer

    def configure_model(self) -> None:
        self.net = nnx.Linear(IN, 1, rngs=nnx.Rngs(0))

    def training_step(self, batch, batch_idx):
        x, y = batch
        owner = self.trainer if self.via_trainer else self
        if self.by == "global_step":
            gate = jnp.where(owner.global_step % 2 == 0, 0.0, 1.0)
        else:
            gate = jnp.where(owner.current_epoch == 1, 1.0, 0.0)
        return mse(self.net, x, y) * gate

    def configure_optimizers(self):
        return optax.sgd(LR)


def initial() -> dict[str, jax.Array]:
    return {
        "kernel": nnx.Linear(IN, 1, rngs=nnx.Rngs(0)).kernel.value,
        "bias": nnx.Linear(IN, 1, rngs=nnx.Rngs(0)).bias.value,
    }


def grad_of(p: dict[str, jax.Array], batch: tuple[np.ndarray, np.ndarray]) -> dict[str, jax.Array]:
    def loss(p):
        x, y = batch
        return jnp.mean((x @ p["kernel"] + p["bias"] - y) ** 2)

    return jax.grad(loss)(p)


def hand_loop(batches: list, gates: list[float], accumulate: int = 1) -> dict[str, np.ndarray]:
    """SGD over windows of ``accumulate`` batches (their mean gradient), window ``i`` scaled by ``gates[i]``."""
    p = initial()
    for i, gate in enumerate(gates):
        window = batches[i * accumulate : (i + 1) * accumulate]
        gs = [grad_of(p, b) for b in window]
        g = jax.tree.map(lambda *a: sum(a) / len(a), *gs)
        p = jax.tree.map(lambda w, d, s=gate: w - LR * s * d, p, g)
    return {k: np.asarray(v) for k, v in p.items()}


def assert_params(trainer: jl.Trainer, want: dict[str, np.ndarray], prefix: str = "net") -> None:
    got = host_params(trainer)
    for k, v in want.items():
        np.testing.assert_allclose(got[f"{prefix}/{k}"], v, atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------ item 1: counters
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"steps_per_execution": 2}, {"accumulate_grad_batches": 2}],
    ids=["single", "steps_per_execution=2", "accumulate=2"],
)
def test_global_step_inside_the_step_is_each_steps_own(kwargs):
    """Zeroing the loss on even optimizer steps trains on steps 1 and 3 only. Under accumulation,
    ``global_step`` inside the step is the optimizer steps done so far (Lightning's): both micro-batches of
    window ``k`` see ``k``."""
    k = kwargs.get("accumulate_grad_batches", 1)
    batches = data(4 * k)
    trainer = jl.Trainer(max_epochs=1, **kwargs, **quiet())
    trainer.fit(Gated(), batches)
    assert trainer.global_step == 4
    assert_params(trainer, hand_loop(batches, [0.0, 1.0, 0.0, 1.0], accumulate=k))
    # and not the frozen answer (trained on every step, or on none)
    assert not np.allclose(host_params(trainer)["net/kernel"], hand_loop(batches, [0.0] * 4, k)["kernel"])


def test_the_trainers_counters_inside_the_step_are_traced_too():
    batches = data(4)
    trainer = jl.Trainer(max_epochs=1, **quiet())
    trainer.fit(Gated(via_trainer=True), batches)
    assert_params(trainer, hand_loop(batches, [0.0, 1.0, 0.0, 1.0]))


def test_current_epoch_inside_the_step_is_an_argument_not_a_recompile():
    """Training only in epoch 1 (of 0..2): the epoch reaches the one compiled step as a value."""
    batches = data(2)
    trainer = jl.Trainer(max_epochs=3, **quiet())
    trainer.fit(Gated(by="current_epoch"), batches)
    assert_params(trainer, hand_loop(batches * 3, [0, 0, 1, 1, 0, 0]))
    assert trainer.compile_counts["train"] == 1


def test_current_epoch_through_executions_compiles_once_per_shape():
    batches = data(4)
    trainer = jl.Trainer(max_epochs=2, steps_per_execution=2, **quiet())
    trainer.fit(Gated(by="current_epoch"), batches)
    assert_params(trainer, hand_loop(batches * 2, [0] * 4 + [1] * 4))
    assert trainer.compile_counts["train"] == 1


class PythonIf(Gated):
    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.by == "global_step":
            if self.global_step % 2 == 0:
                return mse(self.net, x, y) * 0.0
        elif self.current_epoch == 1:
            return mse(self.net, x, y) * 0.0
        return mse(self.net, x, y)


@pytest.mark.parametrize("by", ["global_step", "current_epoch"])
def test_a_python_if_on_a_counter_is_refused_by_name(by):
    trainer = jl.Trainer(max_epochs=1, **quiet())
    with pytest.raises(TracingError) as err:
        trainer.fit(PythonIf(by=by), data(2))
    msg = str(err.value)
    assert f"self.{by}" in msg and "jnp.where" in msg and "on_train_batch_start" in msg
    assert isinstance(err.value, jax.errors.TracerBoolConversionError)  # JAX's own type still catches it
    assert isinstance(err.value.__cause__, jax.errors.TracerBoolConversionError)


class HostCounters(Gated):
    """Reads the counters in host hooks: plain ints there, as in Lightning."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, int]] = []

    def on_train_batch_start(self, batch, batch_idx):
        assert type(self.global_step) is int and type(self.current_epoch) is int
        self.seen.append((self.current_epoch, self.global_step))


def test_host_hooks_still_read_python_ints():
    model = HostCounters()
    jl.Trainer(max_epochs=2, **quiet()).fit(model, data(2))
    assert model.seen == [(0, 0), (0, 1), (1, 2), (1, 3)]


# ------------------------------------------------------------------------------------ item 2: host effects
class Agent:
    def __init__(self) -> None:
        self.steps = 0
        self.name = "agent"


class Effects(Gated):
    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what
        self.buffer: list[int] = []
        self.agent = Agent()

    def training_step(self, batch, batch_idx):
        if self.what == "append":
            self.buffer.append(1)
        else:
            self.agent.steps += 1  # a DQN's play_step: runs once, at tracing
        x, y = batch
        return mse(self.net, x, y)


@pytest.mark.parametrize("what,name", [("append", "self.buffer"), ("counter", "self.agent.steps")])
def test_host_state_changed_while_tracing_is_named(what, name):
    with pytest.warns(HostSideEffectWarning, match=name.replace(".", r"\.")) as rec:
        jl.Trainer(max_epochs=1, **quiet()).fit(Effects(what), data(4))
    msgs = [str(w.message) for w in rec if issubclass(w.category, HostSideEffectWarning)]
    assert len(msgs) == 1 and "on_train_batch_start" in msgs[0] and "once" in msgs[0]


class Clean(Effects):
    """Host work where it belongs: the hook fills the buffer and steps the agent, the step only computes."""

    def __init__(self) -> None:
        super().__init__("none")
        self.config = {"a": 1}

    def on_train_batch_start(self, batch, batch_idx):
        self.buffer.append(batch_idx)
        self.agent.steps += 1

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.log("loss", mse(self.net, x, y))
        return mse(self.net, x, y) * (self.global_step + 1.0) / (self.global_step + 1.0)


def test_a_clean_module_does_not_warn():
    model = Clean()
    with warnings.catch_warnings():
        warnings.simplefilter("error", HostSideEffectWarning)
        jl.Trainer(max_epochs=1, steps_per_execution=2, **quiet()).fit(model, data(4))
    assert model.buffer == [0, 1, 2, 3] and model.agent.steps == 4


# ------------------------------------------------------------------------------------ item 3: param writes
class TargetSync(jl.LightningModule):
    """A DQN's target sync inside training_step; the optimizer covers ``self.net`` only."""

    def __init__(self, every: int = 1) -> None:
        super().__init__()
        self.every = every

    def configure_model(self) -> None:
        self.net = nnx.Linear(IN, 1, rngs=nnx.Rngs(0))
        self.target = nnx.Linear(IN, 1, rngs=nnx.Rngs(1))

    def training_step(self, batch, batch_idx):
        if self.every == 1:
            nnx.update(self.target, nnx.state(self.net))
        else:  # every N steps: a traced condition (docs/trainer.md#counters-inside-a-step)
            sync = self.global_step % self.every == 0
            pick = lambda t, o: jnp.where(sync, o, t)
            nnx.update(self.target, jax.tree.map(pick, nnx.state(self.target), nnx.state(self.net)))
        x, y = batch
        return mse(self.net, x, y) + 0.0 * jnp.sum(self.target(x))  # reads the target after the write

    def configure_optimizers(self):
        return {"optimizer": optax.sgd(LR), "params": self.net}


@pytest.mark.parametrize("spe", [1, 2])
def test_a_target_network_written_in_the_step_gets_the_written_weights(spe):
    batches = data(4)
    trainer = jl.Trainer(max_epochs=1, steps_per_execution=spe, **quiet())
    trainer.fit(TargetSync(), batches)
    # Lightning's order: step 4's write copies the net as it was at that step's start (after 3 updates)
    assert_params(trainer, hand_loop(batches[:3], [1.0] * 3), prefix="target")
    assert_params(trainer, hand_loop(batches, [1.0] * 4), prefix="net")


def test_a_target_network_synced_every_two_steps_under_a_traced_condition():
    batches = data(5)
    trainer = jl.Trainer(max_epochs=1, **quiet())
    trainer.fit(TargetSync(every=2), batches)
    # synced at the starts of steps 0, 2 and 4: the net after 4 updates
    assert_params(trainer, hand_loop(batches[:4], [1.0] * 4), prefix="target")
    assert_params(trainer, hand_loop(batches, [1.0] * 5), prefix="net")


class ManualTargetSync(TargetSync):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        nnx.update(self.target, nnx.state(self.net))
        opt = self.optimizers()
        x, y = batch
        loss, grads = self.manual_backward(lambda: mse(self.net, x, y))
        opt.step(grads)
        return loss


def test_a_target_network_written_in_a_manual_step_gets_the_written_weights():
    batches = data(4)
    trainer = jl.Trainer(max_epochs=1, **quiet())
    trainer.fit(ManualTargetSync(), batches)
    assert_params(trainer, hand_loop(batches[:3], [1.0] * 3), prefix="target")
    assert_params(trainer, hand_loop(batches, [1.0] * 4), prefix="net")


class ReadFromAnotherThread(Gated):
    """While its step is traced, another thread reads the trainer's counters (as a watcher or a test's helper
    thread does): that thread must get Python ints, never the tracing thread's tracers."""

    def training_step(self, batch, batch_idx):
        import threading

        seen = {}

        def read() -> None:
            seen["step"], seen["epoch"] = self.trainer.global_step, self.trainer.current_epoch
            seen["module"] = self.global_step

        t = threading.Thread(target=read)
        t.start()
        t.join()
        self.seen_by_thread = seen
        return super().training_step(batch, batch_idx)


def test_another_thread_reading_the_counters_during_a_trace_gets_python_ints():
    """Before: the traced counters were global, so a watcher thread reading trainer.global_step during a trace
    got a tracer (JAX's UnexpectedTracerError in test_adversary_loop's signal thread)."""
    m = ReadFromAnotherThread()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HostSideEffectWarning)  # the recorded dict is a host change, on purpose
        jl.Trainer(devices=1, max_steps=2, **quiet()).fit(m, train_dataloaders=data(2))
    assert {k: type(v) for k, v in m.seen_by_thread.items()} == {"step": int, "epoch": int, "module": int}
