"""Gallery programs with logic around the step (issue item 8), in the style of Lightning's own templates
(``tests/gallery_rl_programs.py``), run through pytorch-lightning and through their jaxlight ports from the
same initial torch weights on the same data.

DQN (``reinforce_learn_Qnet.py``): 48 steps' losses within 1e-4 relative (fp32; measured 2e-5: Adam with
``eps=1e-5`` over a replay buffer whose samples the argmax decisions shape), the replay buffer equal
element for element (every exploration draw and every argmax decision the same), every greedy decision's
Q-values within 1e-4 and their top-two margin over 100 times that difference (no near tie could flip), the
target network at the end within 1e-5. The template's in-step host work, run as written, is named by
jaxlight (a ``TracingError`` for its epsilon, a ``HostSideEffectWarning`` for its environment step).

UNet (``semantic_segmentation.py``): 10 steps' losses within 1e-5 relative on one device and under "ddp"
on 8 devices (BatchNorm over the global batch: Lightning's ``sync_batchnorm=True``, equal to its one-device
run).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

pytest.importorskip("pytorch_lightning")
pytest.importorskip("torch")

from jaxlight.errors import HostSideEffectWarning
from tests import gallery_rl_programs as rl

RTOL_DQN, RTOL_UNET = 1e-4, 1e-5
_RUNS: dict[str, dict] = {}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("gallery_logic")


def run(name: str, framework: str, workdir, **kw) -> dict:
    """One program's run, once per test session; the Lightning run writes the initial torch weights."""
    key = f"{name}-{framework}-{sorted(kw.items())}"
    if key not in _RUNS:
        init = str(workdir / f"{name}_init.pt")
        if framework == "jl":
            run(name, "pl", workdir)
        with warnings.catch_warnings():
            warnings.simplefilter("error", HostSideEffectWarning)  # the ports keep host work out of the step
            _RUNS[key] = getattr(rl, f"run_{name}")(framework, init, **kw)
    return _RUNS[key]


def test_dqn_losses_replay_buffer_and_target_net_equal_lightning(workdir):
    ref, got = run("dqn", "pl", workdir), run("dqn", "jl", workdir)
    assert ref["global_step"] == got["global_step"] == rl.DQN_STEPS
    assert ref["current_epoch"] == got["current_epoch"] == 12  # 4 batches per sampled epoch
    assert got["metric_names"] == ref["metric_names"] == ["reward", "steps", "total_reward"]
    losses_ref, losses = np.asarray(ref["losses"]), np.asarray(got["losses"])
    assert losses_ref.shape == losses.shape == (rl.DQN_STEPS,)
    np.testing.assert_allclose(losses, losses_ref, rtol=RTOL_DQN)

    # the replay buffer: warm-up plus one experience per step, the oldest dropped (capacity 64)
    assert len(ref["buffer"]) == len(got["buffer"]) == rl.DQN_HPARAMS["replay_size"]
    for a, b in zip(ref["buffer"], got["buffer"]):
        np.testing.assert_array_equal(b.state, a.state)
        np.testing.assert_array_equal(b.new_state, a.new_state)
        assert (b.action, b.reward, b.done) == (a.action, a.reward, a.done)
    assert got["total_reward"] == ref["total_reward"]

    # the argmax decisions: the same number, the same Q-values, and never close to a tie
    q_ref, q = np.asarray(ref["decisions"]), np.asarray(got["decisions"])
    assert q.shape == q_ref.shape and len(q) >= 20  # most of the 48 played steps are greedy
    np.testing.assert_allclose(q, q_ref, rtol=1e-4, atol=1e-5)
    top2 = np.sort(q_ref, axis=1)[:, -2:]
    margin = float((top2[:, 1] - top2[:, 0]).min())  # measured 6e-3 against a 2e-6 difference
    assert margin > 100 * float(np.abs(q - q_ref).max())

    # the target network after the last sync (step 45: the online net as that step started)
    for a, b in zip(ref["target"], got["target"]):
        np.testing.assert_allclose(b, a, atol=1e-5)
    assert got["compile_counts"] == {"train": 1}


@pytest.mark.parametrize("what", ["epsilon", "play_step"])
def test_dqn_template_host_work_inside_training_step_is_named(what, workdir):
    """Why the port moves the template's host work to on_train_batch_start: as written in training_step,
    the epsilon (a Python ``max`` on ``self.global_step``) raises, and the environment step warns."""
    import jax.numpy as jnp

    import jaxlight as jl
    from jaxlight.tracing import TracingError

    Model, _ = rl._dqn_jaxlight()
    traced: list[int] = []  # outside the module: counts the step's Python runs

    class AsWritten(Model):
        def on_train_batch_start(self, batch, batch_idx):
            pass

        def on_train_batch_end(self, outputs, batch, batch_idx):
            pass

        def training_step(self, batch, nb_batch):
            hp = self.hparams
            if what == "epsilon":
                epsilon = max(hp.eps_end, hp.eps_start - (self.global_step + 1) / hp.eps_last_frame)
            else:
                epsilon = 1.0  # exploring: the Q-network is not called on the host
            reward, done = self.agent.play_step(self.net, epsilon)
            self.episode_reward += reward
            traced.append(1)
            return self.dqn_mse_loss(batch) + 0.0 * jnp.float32(reward)

    model = AsWritten(**rl.DQN_HPARAMS)
    trainer = jl.Trainer(max_steps=2, enable_progress_bar=False, enable_model_summary=False, logger=False)
    if what == "epsilon":
        with pytest.raises(TracingError, match="global_step"):
            trainer.fit(model)
    else:
        with pytest.warns(HostSideEffectWarning, match=r"self\.episode_reward") as rec:
            trainer.fit(model)
        msg = next(str(w.message) for w in rec if w.category is HostSideEffectWarning)
        assert "self.agent" in msg and "on_train_batch_start" in msg
        assert trainer.global_step == 2 and len(traced) == 1  # two batches, one environment step


@pytest.mark.parametrize("devices, strategy", [(1, "auto"), (8, "ddp")])
def test_unet_segmentation_losses_equal_lightning(devices, strategy, workdir):
    ref = run("unet", "pl", workdir)
    got = run("unet", "jl", workdir, devices=devices, strategy=strategy)
    assert ref["global_step"] == got["global_step"] == rl.UNET_STEPS
    assert got["metric_names"] == ref["metric_names"] == ["train_loss"]
    losses_ref, losses = np.asarray(ref["losses"]), np.asarray(got["losses"])
    assert losses_ref.shape == losses.shape == (rl.UNET_STEPS,)
    np.testing.assert_allclose(losses, losses_ref, rtol=RTOL_UNET)
    assert losses_ref[-1] < losses_ref[0]  # it learns something
    assert got["compile_counts"] == {"train": 1}  # the epoch's learning rate compiles nothing
