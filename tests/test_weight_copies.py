"""Host hooks that copy weights between modules (a target network, as in Lightning's DQN template).

``nnx.update(self.target, nnx.state(self.net, nnx.Param))`` in ``on_train_batch_end`` hands the same arrays to
two modules; the compiled step donates every leaf of the train state, so the next step failed with XLA's
"Attempt to donate the same buffer twice". The binding now gives such a value its own copy: the next step sees
the copied values, and the trained network is unaffected.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from tests.core_models import MLP, batches, make_data, quiet, xent


class TargetNet(jl.LightningModule):
    """The online net trains; the target net is only read (its output enters the loss times zero) and is set
    from the online net every ``every`` batches by a host hook, in one of two ways users write."""

    def __init__(self, how: str | None, every: int = 2) -> None:
        super().__init__()
        self.how, self.every = how, every
        self.expected: list[float] = []  # the target kernel's sum the next step must see (host side)
        self.seen: list[float] = []  # what the step saw
        self.copied: list[np.ndarray] = []

    def configure_model(self) -> None:
        self.net = MLP(nnx.Rngs(0))
        self.target = MLP(nnx.Rngs(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        target_out = jax.lax.stop_gradient(self.target(x))
        loss = xent(self.net(x), y) + 0.0 * target_out.sum()
        return {"loss": loss, "target_sum": self.target.l1.kernel[...].sum()}

    def configure_optimizers(self):
        return optax.sgd(0.1, momentum=0.9)

    def on_train_batch_start(self, batch, batch_idx):
        self.expected.append(float(np.asarray(self.target.l1.kernel[...]).sum()))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.seen.append(float(outputs["target_sum"]))
        if self.how is not None and batch_idx % self.every == 0:
            if self.how == "nnx.update":
                nnx.update(self.target, nnx.state(self.net, nnx.Param))
            else:  # each variable's value set to the online one's array
                self.target.l1.kernel.value = self.net.l1.kernel.value
                self.target.l1.bias.value = self.net.l1.bias.value
                self.target.l2.kernel.value = self.net.l2.kernel.value
                self.target.l2.bias.value = self.net.l2.bias.value
            self.copied.append(np.asarray(self.net.l1.kernel[...]).copy())


def _params(m: nnx.Module) -> list[np.ndarray]:
    return [np.asarray(a) for a in jax.tree.leaves(nnx.state(m, nnx.Param))]


@pytest.mark.parametrize(
    "how, devices, strategy", [("nnx.update", 1, "auto"), ("value", 1, "auto"), ("nnx.update", 4, "fsdp")]
)
def test_a_hook_copying_weights_between_modules_trains_and_the_next_step_sees_the_copy(how, devices, strategy):
    data = batches(*make_data(96), 16)  # 6 batches an epoch
    kw = dict(devices=devices, strategy=strategy, max_epochs=2, **quiet())
    m = TargetNet(how)
    jl.Trainer(**kw).fit(m, train_dataloaders=data)
    ref = TargetNet(None)
    jl.Trainer(**kw).fit(ref, train_dataloaders=data)

    # every step saw the target the host set before it (the copy of the batch before, or the initial one)
    np.testing.assert_allclose(m.seen, m.expected, rtol=1e-6)
    assert len(set(np.round(m.expected, 5))) > 2  # the copies changed it several times
    # the last copy (batch 4 of epoch 1) is what the target holds; it shares no buffer with the online net
    np.testing.assert_array_equal(np.asarray(m.target.l1.kernel[...]), m.copied[-1])
    assert not np.array_equal(np.asarray(m.net.l1.kernel[...]), m.copied[-1])  # the online net trained on
    # the online net trained exactly as without the copies (the target enters its loss times zero)
    for a, b in zip(_params(m.net), _params(ref.net)):
        np.testing.assert_array_equal(a, b)
    # the run without copies kept the target's initial weights
    assert len(set(ref.expected)) == 1
