"""Gallery programs with logic around the step (issue item 8): two programs in the style of Lightning's own
templates, each written twice, for pytorch-lightning (torch) and for jaxlight (NNX), tiny enough for a CPU.

1. ``domain_templates/reinforce_learn_Qnet.py`` (DQN): an ``Agent`` playing an environment with an
   epsilon-greedy policy, a ``ReplayBuffer`` (a deque), an ``RLDataset(IterableDataset)`` sampling from it,
   one environment step per training batch, a target network synced every ``sync_rate`` steps, an epsilon
   schedule by ``global_step``, the MSE TD loss, Adam on the online network only. The environment is a
   deterministic numpy corridor (no gym); every random draw (exploration, sampling) comes from a seeded
   ``numpy.random.Generator``, the same in both frameworks.

   What the port had to change, marked ``# port:``:

   * The template plays its environment step inside ``training_step``. A jaxlight ``training_step`` is
     traced once and then runs compiled, so that line would run once, at tracing; jaxlight says so with
     ``HostSideEffectWarning`` ("DQNLightning.training_step changed host state while it was traced:
     self.agent.state (reassigned), self.env.t (9 -> 10), self.episode_reward (0.0 -> -0.05). A step
     method's Python code runs once ... Per-batch host work (stepping an environment, filling a replay
     buffer, counting) belongs in a host hook such as on_train_batch_start", docs/trainer.md "Counters
     inside a step"). Its epsilon line, ``max(eps_end, eps_start - (self.global_step + 1) / ...)``, does
     not even trace: ``self.global_step`` is a traced int32 there and Python's ``max`` raises
     ``TracingError`` naming it. The port plays in ``on_train_batch_start``, a host hook that runs before
     every step with ``self.global_step`` a Python int equal to the one the template's ``training_step``
     reads, and with the online network as that step sees it (the epsilon, the action and the replay
     buffer are therefore the template's). The rewards are logged there too (``self.log_dict`` in a
     hook).
   * The template syncs the target inside ``training_step`` after the loss has read it: the target of step
     ``s`` (``s % sync_rate == 0``) becomes the online network of the step's *start*, first read by step
     ``s + 1``. In a host hook that is: copy the online weights in ``on_train_batch_start`` and write them
     into the target with ``nnx.update`` in ``on_train_batch_end`` (where the online network has already
     taken step ``s``'s update). The copy is a numpy copy: the compiled step donates the arrays it is given.
   * ``torch.max(q, 1)`` / ``gather`` / ``next_state_values[dones] = 0`` become ``argmax`` /
     ``take_along_axis`` / ``jnp.where``; ``Adam(self.net.parameters())`` is ``{"optimizer": ..., "params":
     self.net}``.

2. ``domain_templates/semantic_segmentation.py`` with its ``unet.py`` (UNet with ``DoubleConv`` (conv, BN,
   ReLU twice), ``Down`` (max pool, ``DoubleConv``), ``Up`` (``ConvTranspose2d`` 2x upsampling, pad, concat,
   ``DoubleConv``)), ``F.cross_entropy(out, mask, ignore_index=250)``, Adam with ``CosineAnnealingLR``
   stepped each epoch. The port: NHWC inside the network (NCHW batches moved once), ``nnx.ConvTranspose``
   with ``conv_transpose_padding``, BatchNorm momentum ``1 - 0.1``, the cross entropy row of
   docs/migration.md's ``F.cross_entropy`` table, the epoch scheduler as an epoch ``lr_scheduler`` over an
   injected learning rate. BatchNorm statistics in jaxlight are over the global batch under every strategy
   (Lightning's ``sync_batchnorm=True``), so "ddp" on 8 devices gives the one-device losses.

Each ``run_*`` trains one framework's version from the same initial torch weights (the Lightning run
writes them, the port loads them with ``load_torch_weights``) on the same data and returns what a user
sees as plain Python data (``tests/test_gallery_logic.py`` compares the two).
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from tests.gallery_lightning_programs import _quiet_lightning, _recorder

DQN_STEPS = 48  # training steps of the DQN program (12 epochs of 4 batches)
UNET_STEPS = 10  # training steps of the UNet program (2 epochs of 5 batches)


# ============================================================================ 1. DQN: shared numpy pieces
class Corridor:
    """A deterministic 1-D corridor: cells ``0 .. length-1``, start in cell 1, actions left / stay / right.
    Reaching the last cell gives 1.0 and ends the episode; every other step costs 0.05; an episode also ends
    after ``max_steps``. The observation is the one-hot cell and the fraction of the episode used."""

    n_actions = 3

    def __init__(self, length: int = 6, max_steps: int = 12) -> None:
        self.length, self.max_steps = length, max_steps
        self.obs_size = length + 1
        self.reset()

    def _obs(self) -> np.ndarray:
        obs = np.zeros(self.obs_size, np.float32)
        obs[self.pos] = 1.0
        obs[-1] = self.t / self.max_steps
        return obs

    def reset(self) -> np.ndarray:
        self.pos, self.t = 1, 0
        return self._obs()

    def step(self, action: int) -> tuple[np.ndarray, float, bool]:
        self.pos = int(np.clip(self.pos + action - 1, 0, self.length - 1))
        self.t += 1
        at_goal = self.pos == self.length - 1
        reward = 1.0 if at_goal else -0.05
        return self._obs(), reward, at_goal or self.t >= self.max_steps


Experience = collections.namedtuple("Experience", field_names=["state", "action", "reward", "done", "new_state"])


class ReplayBuffer:
    """The template's buffer; ``sample`` draws from a seeded Generator instead of ``np.random``."""

    def __init__(self, capacity: int, seed: int = 1) -> None:
        self.buffer: collections.deque = collections.deque(maxlen=capacity)
        self.rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        return len(self.buffer)

    def append(self, experience: Experience) -> None:
        self.buffer.append(experience)

    def sample(self, batch_size: int) -> tuple:
        indices = self.rng.choice(len(self.buffer), batch_size, replace=False)
        states, actions, rewards, dones, next_states = zip(*(self.buffer[idx] for idx in indices))
        return (
            np.array(states),
            np.array(actions),
            np.array(rewards, dtype=np.float32),
            np.array(dones, dtype=bool),
            np.array(next_states),
        )


def _rl_dataset():
    from torch.utils.data import IterableDataset

    class RLDataset(IterableDataset):
        """The template's dataset: each epoch samples ``sample_size`` experiences from the buffer."""

        def __init__(self, buffer: ReplayBuffer, sample_size: int = 32) -> None:
            self.buffer = buffer
            self.sample_size = sample_size

        def __iter__(self):
            states, actions, rewards, dones, new_states = self.buffer.sample(self.sample_size)
            for i in range(len(dones)):
                yield states[i], actions[i], rewards[i], dones[i], new_states[i]

    return RLDataset


class AgentBase:
    """The template's ``Agent``; the Q-values come from the framework's own ``q_values``. The exploration
    draws come from a seeded Generator, and every greedy decision's Q-values are kept (``decisions``) so the
    test can check the argmax was never a near tie."""

    def __init__(self, env: Corridor, replay_buffer: ReplayBuffer, seed: int = 2) -> None:
        self.env = env
        self.replay_buffer = replay_buffer
        self.rng = np.random.default_rng(seed)
        self.decisions: list[np.ndarray] = []
        self.reset()

    def q_values(self, net, state: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def reset(self) -> None:
        self.state = self.env.reset()

    def get_action(self, net, epsilon: float) -> int:
        if self.rng.random() < epsilon:
            return int(self.rng.integers(self.env.n_actions))
        q = self.q_values(net, self.state)
        self.decisions.append(q)
        return int(np.argmax(q))

    def play_step(self, net, epsilon: float = 0.0) -> tuple[float, bool]:
        action = self.get_action(net, epsilon)
        new_state, reward, done = self.env.step(action)
        self.replay_buffer.append(Experience(self.state, action, reward, done, new_state))
        self.state = new_state
        if done:
            self.reset()
        return reward, done


DQN_HPARAMS = dict(
    replay_size=64,
    warm_start_steps=64,
    gamma=0.9,
    eps_start=1.0,
    eps_end=0.1,
    eps_last_frame=24,
    sync_rate=5,
    lr=1e-2,
    episode_length=32,  # the RLDataset's sample size: 4 batches an epoch
    batch_size=8,
    hidden_size=16,
)


# ============================================================================ 1. DQN: pytorch-lightning
def _dqn_lightning():
    import pytorch_lightning as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    RLDataset = _rl_dataset()

    class DQN(nn.Module):
        def __init__(self, obs_size: int, n_actions: int, hidden_size: int = 128):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(obs_size, hidden_size), nn.ReLU(), nn.Linear(hidden_size, n_actions))

        def forward(self, x):
            return self.net(x.float())

    class Agent(AgentBase):
        @torch.no_grad()
        def q_values(self, net, state):
            return net(torch.tensor(state[None]))[0].numpy()

    class DQNLightning(pl.LightningModule):
        def __init__(self, init_weights: str = "", **hparams) -> None:
            super().__init__()
            self.save_hyperparameters()
            hp = self.hparams
            self.env = Corridor()
            self.net = DQN(self.env.obs_size, self.env.n_actions, hp.hidden_size)
            self.target_net = DQN(self.env.obs_size, self.env.n_actions, hp.hidden_size)
            if init_weights:
                torch.save(self.state_dict(), init_weights)
            self.buffer = ReplayBuffer(hp.replay_size)
            self.agent = Agent(self.env, self.buffer)
            self.total_reward = 0.0
            self.episode_reward = 0.0
            self.populate(hp.warm_start_steps)

        def populate(self, steps: int = 1000) -> None:
            for _ in range(steps):
                self.agent.play_step(self.net, epsilon=1.0)

        def forward(self, x):
            return self.net(x)

        def dqn_mse_loss(self, batch):
            states, actions, rewards, dones, next_states = batch
            state_action_values = self.net(states).gather(1, actions.unsqueeze(-1)).squeeze(-1)
            with torch.no_grad():
                next_state_values = self.target_net(next_states).max(1)[0]
                next_state_values[dones] = 0.0
                next_state_values = next_state_values.detach()
            expected_state_action_values = next_state_values * self.hparams.gamma + rewards
            return nn.MSELoss()(state_action_values, expected_state_action_values)

        def training_step(self, batch, nb_batch):
            hp = self.hparams
            epsilon = max(hp.eps_end, hp.eps_start - (self.global_step + 1) / hp.eps_last_frame)
            # step through environment with agent
            reward, done = self.agent.play_step(self.net, epsilon)
            self.episode_reward += reward
            # calculates training loss
            loss = self.dqn_mse_loss(batch)
            if done:
                self.total_reward = self.episode_reward
                self.episode_reward = 0.0
            # Soft update of target network
            if self.global_step % hp.sync_rate == 0:
                self.target_net.load_state_dict(self.net.state_dict())
            self.log_dict({"total_reward": self.total_reward, "reward": reward, "steps": float(self.global_step)})
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.net.parameters(), lr=self.hparams.lr, eps=1e-5)

        def train_dataloader(self):
            dataset = RLDataset(self.buffer, self.hparams.episode_length)
            return DataLoader(dataset=dataset, batch_size=self.hparams.batch_size)

    def target_weights(model) -> list[np.ndarray]:  # (out, in) weights and biases, torch's layout
        return [p.detach().numpy().copy() for p in model.target_net.parameters()]

    return DQNLightning, target_weights


# ============================================================================ 1. DQN: jaxlight
def _dqn_jaxlight():
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from torch.utils.data import DataLoader

    import jaxlight as jl
    from jaxlight.migrate import load_torch_weights

    RLDataset = _rl_dataset()

    class DQN(nnx.Module):  # port: an NNX module, its keys explicit
        def __init__(self, obs_size: int, n_actions: int, hidden_size: int = 128, seed: int = 0):
            rngs = nnx.Rngs(seed)
            self.net = nnx.Sequential(
                nnx.Linear(obs_size, hidden_size, rngs=rngs), nnx.relu, nnx.Linear(hidden_size, n_actions, rngs=rngs)
            )

        def __call__(self, x):
            return self.net(x.astype(jnp.float32))

    class Agent(AgentBase):
        def q_values(self, net, state):
            return np.asarray(net(jnp.asarray(state[None])))[0]

    class DQNLightning(jl.LightningModule):
        def __init__(self, init_weights: str = "", **hparams) -> None:
            super().__init__()
            self.save_hyperparameters()
            hp = self.hparams
            self.env = Corridor()
            self.net = DQN(self.env.obs_size, self.env.n_actions, hp.hidden_size, seed=0)
            self.target_net = DQN(self.env.obs_size, self.env.n_actions, hp.hidden_size, seed=1)
            self.buffer = ReplayBuffer(hp.replay_size)
            self.agent = Agent(self.env, self.buffer)
            self.total_reward = 0.0
            self.episode_reward = 0.0
            self.synced: Any = None  # port: the online weights the target takes after this step
            self.populate(hp.warm_start_steps)

        def on_fit_start(self):
            if self.hparams.init_weights:  # port: start from the original's torch weights
                load_torch_weights(self, self.hparams.init_weights)

        def populate(self, steps: int = 1000) -> None:
            for _ in range(steps):
                self.agent.play_step(self.net, epsilon=1.0)

        def forward(self, x):
            return self.net(x)

        def dqn_mse_loss(self, batch):
            states, actions, rewards, dones, next_states = batch
            state_action_values = jnp.take_along_axis(self.net(states), actions[:, None], axis=1).squeeze(-1)
            next_state_values = jax.lax.stop_gradient(self.target_net(next_states).max(1))
            next_state_values = jnp.where(dones, 0.0, next_state_values)  # port: no in-place masking
            expected_state_action_values = next_state_values * self.hparams.gamma + rewards
            return jnp.mean((state_action_values - expected_state_action_values) ** 2)

        def on_train_batch_start(self, batch, batch_idx):
            # port: the template's host work, moved out of the traced training_step (HostSideEffectWarning)
            hp = self.hparams
            epsilon = max(hp.eps_end, hp.eps_start - (self.global_step + 1) / hp.eps_last_frame)
            reward, done = self.agent.play_step(self.net, epsilon)
            self.episode_reward += reward
            if done:
                self.total_reward = self.episode_reward
                self.episode_reward = 0.0
            if self.global_step % hp.sync_rate == 0:  # port: the net as this step starts, for the target
                self.synced = jax.tree.map(np.array, nnx.state(self.net, nnx.Param))
            self.log_dict({"total_reward": self.total_reward, "reward": reward, "steps": float(self.global_step)})

        def training_step(self, batch, nb_batch):
            return self.dqn_mse_loss(batch)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if self.synced is not None:  # port: written after the step, as the template's sync follows its loss
                nnx.update(self.target_net, self.synced)
                self.synced = None

        def configure_optimizers(self):
            return {"optimizer": optax.adam(self.hparams.lr, eps=1e-5), "params": self.net}  # port: optax, net only

        def train_dataloader(self):
            dataset = RLDataset(self.buffer, self.hparams.episode_length)
            return DataLoader(dataset=dataset, batch_size=self.hparams.batch_size)

    def target_weights(model) -> list[np.ndarray]:  # in torch's layout and order
        out = []
        for layer in (model.target_net.net.layers[0], model.target_net.net.layers[2]):
            out += [np.asarray(layer.kernel[...]).T.copy(), np.asarray(layer.bias[...]).copy()]
        return out

    return DQNLightning, target_weights


def run_dqn(framework: str, init: str, steps: int = DQN_STEPS) -> dict[str, Any]:
    """The template's ``main``: ``Trainer(max_epochs=...)``; here a step budget, no logger or checkpoints."""
    kw = dict(
        max_steps=steps,
        max_epochs=10 * steps,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )
    if framework == "pl":
        _quiet_lightning()
        import pytorch_lightning as pl
        import torch

        torch.manual_seed(0)
        Model, target_weights = _dqn_lightning()
        model = Model(init_weights=init, **DQN_HPARAMS)
        trainer = pl.Trainer(accelerator="cpu", devices=1, **kw)
    else:
        import jaxlight as jl

        Model, target_weights = _dqn_jaxlight()
        model = Model(init_weights=init, **DQN_HPARAMS)
        trainer = jl.Trainer(**kw)
    rec: dict[str, Any] = {}
    trainer.callbacks = [*trainer.callbacks, _recorder(framework, rec)]
    trainer.fit(model)
    rec.update(
        global_step=trainer.global_step,
        current_epoch=trainer.current_epoch,
        metric_names=sorted(trainer.callback_metrics),
        buffer=list(model.buffer.buffer),
        decisions=[np.asarray(q) for q in model.agent.decisions],
        target=target_weights(model),
        total_reward=float(model.total_reward),
        compile_counts=dict(trainer.compile_counts) if framework == "jl" else None,
    )
    return rec


# ============================================================================ 2. UNet segmentation
UNET = dict(num_classes=3, num_layers=2, features_start=4, bilinear=False)
IMAGE, IGNORE = 16, 250


def segmentation_data(rows: int = 40, seed: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 3, 16, 16) in [0, 1] and masks (N, 16, 16): the class is the brightest smoothed channel,
    and a random rectangle per image is ``ignore_index`` (250, as KITTI's void pixels in the template)."""
    rng = np.random.default_rng(seed)
    img = rng.random((rows, 3, IMAGE, IMAGE)).astype(np.float32)
    smooth = img.copy()
    for axis in (2, 3):
        smooth = (smooth + np.roll(smooth, 1, axis) + np.roll(smooth, -1, axis)) / 3
    mask = smooth.argmax(1).astype(np.int64)
    for i in range(rows):
        r, c = rng.integers(0, IMAGE - 4, 2)
        mask[i, r : r + 4, c : c + 5] = IGNORE
    return img, mask


def _unet_lightning():
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F
    from torch import nn

    class DoubleConv(nn.Module):
        """[ Conv2d => BatchNorm (optional) => ReLU ] x 2."""

        def __init__(self, in_ch: int, out_ch: int):
            super().__init__()
            self.net = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, kernel_size=3, padding=1),
                nn.BatchNorm2d(out_ch),
                nn.ReLU(inplace=True),
                nn.Conv2d(out_ch, out_ch, kernel_size=3, padding=1),
                nn.BatchNorm2d(out_ch),
                nn.ReLU(inplace=True),
            )

        def forward(self, x):
            return self.net(x)

    class Down(nn.Module):
        def __init__(self, in_ch: int, out_ch: int):
            super().__init__()
            self.net = nn.Sequential(nn.MaxPool2d(kernel_size=2, stride=2), DoubleConv(in_ch, out_ch))

        def forward(self, x):
            return self.net(x)

    class Up(nn.Module):
        def __init__(self, in_ch: int, out_ch: int, bilinear: bool = False):
            super().__init__()
            assert not bilinear
            self.upsample = nn.ConvTranspose2d(in_ch, in_ch // 2, kernel_size=2, stride=2)
            self.conv = DoubleConv(in_ch, out_ch)

        def forward(self, x1, x2):
            x1 = self.upsample(x1)
            # Pad x1 to the size of x2
            diff_h = x2.shape[2] - x1.shape[2]
            diff_w = x2.shape[3] - x1.shape[3]
            x1 = F.pad(x1, [diff_w // 2, diff_w - diff_w // 2, diff_h // 2, diff_h - diff_h // 2])
            # Concatenate along the channels axis
            x = torch.cat([x2, x1], dim=1)
            return self.conv(x)

    class UNet(nn.Module):
        def __init__(self, num_classes: int = 19, num_layers: int = 5, features_start: int = 64, bilinear=False):
            super().__init__()
            self.num_layers = num_layers
            layers = [DoubleConv(3, features_start)]
            feats = features_start
            for _ in range(num_layers - 1):
                layers.append(Down(feats, feats * 2))
                feats *= 2
            for _ in range(num_layers - 1):
                layers.append(Up(feats, feats // 2, bilinear))
                feats //= 2
            layers.append(nn.Conv2d(feats, num_classes, kernel_size=1))
            self.layers = nn.ModuleList(layers)

        def forward(self, x):
            xi = [self.layers[0](x)]
            # Down path
            for layer in self.layers[1 : self.num_layers]:
                xi.append(layer(xi[-1]))
            # Up path
            for i, layer in enumerate(self.layers[self.num_layers : -1]):
                xi[-1] = layer(xi[-1], xi[-2 - i])
            return self.layers[-1](xi[-1])

    class SegModel(pl.LightningModule):
        def __init__(self, batch_size: int = 8, lr: float = 1e-3, init_weights: str = "", **unet):
            super().__init__()
            self.save_hyperparameters()
            self.net = UNet(**unet)
            if init_weights:
                torch.save(self.state_dict(), init_weights)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_nb):
            img, mask = batch
            img = img.float()
            mask = mask.long()
            out = self(img)
            loss = F.cross_entropy(out, mask, ignore_index=IGNORE)
            self.log_dict({"train_loss": loss})
            return loss

        def configure_optimizers(self):
            opt = torch.optim.Adam(self.net.parameters(), lr=self.hparams.lr)
            sch = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
            return [opt], [sch]

    return SegModel


def _unet_jaxlight():
    import math

    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jaxlight as jl
    from jaxlight.migrate import conv_transpose_padding, load_torch_weights

    class DoubleConv(nnx.Module):
        def __init__(self, in_ch: int, out_ch: int, rngs: nnx.Rngs):
            self.net = nnx.Sequential(
                nnx.Conv(in_ch, out_ch, (3, 3), padding=1, rngs=rngs),
                nnx.BatchNorm(out_ch, momentum=0.9, epsilon=1e-5, rngs=rngs),  # port: flax's momentum is 1 - torch's
                nnx.relu,
                nnx.Conv(out_ch, out_ch, (3, 3), padding=1, rngs=rngs),
                nnx.BatchNorm(out_ch, momentum=0.9, epsilon=1e-5, rngs=rngs),
                nnx.relu,
            )

        def __call__(self, x):
            return self.net(x)

    class Down(nnx.Module):
        def __init__(self, in_ch: int, out_ch: int, rngs: nnx.Rngs):
            self.net = nnx.Sequential(
                lambda x: nnx.max_pool(x, (2, 2), strides=(2, 2)), DoubleConv(in_ch, out_ch, rngs)
            )

        def __call__(self, x):
            return self.net(x)

    class Up(nnx.Module):
        def __init__(self, in_ch: int, out_ch: int, rngs: nnx.Rngs, bilinear: bool = False):
            assert not bilinear
            self.upsample = nnx.ConvTranspose(  # port: torch's padding through conv_transpose_padding
                in_ch, in_ch // 2, (2, 2), strides=(2, 2), padding=conv_transpose_padding((2, 2)), rngs=rngs
            )
            self.conv = DoubleConv(in_ch, out_ch, rngs)

        def __call__(self, x1, x2):  # NHWC
            x1 = self.upsample(x1)
            diff_h = x2.shape[1] - x1.shape[1]
            diff_w = x2.shape[2] - x1.shape[2]
            pads = ((0, 0), (diff_h // 2, diff_h - diff_h // 2), (diff_w // 2, diff_w - diff_w // 2), (0, 0))
            x1 = jnp.pad(x1, pads)
            x = jnp.concatenate([x2, x1], axis=-1)  # port: channels last
            return self.conv(x)

    class UNet(nnx.Module):
        def __init__(self, num_classes=19, num_layers=5, features_start=64, bilinear=False, seed: int = 0):
            rngs = nnx.Rngs(seed)
            self.num_layers = num_layers
            layers = [DoubleConv(3, features_start, rngs)]
            feats = features_start
            for _ in range(num_layers - 1):
                layers.append(Down(feats, feats * 2, rngs))
                feats *= 2
            for _ in range(num_layers - 1):
                layers.append(Up(feats, feats // 2, rngs, bilinear))
                feats //= 2
            layers.append(nnx.Conv(feats, num_classes, (1, 1), rngs=rngs))
            self.layers = nnx.List(layers)  # port: nnx.List for nn.ModuleList

        def __call__(self, x):
            xi = [self.layers[0](x)]
            for layer in self.layers[1 : self.num_layers]:
                xi.append(layer(xi[-1]))
            for i, layer in enumerate(self.layers[self.num_layers : -1]):
                xi[-1] = layer(xi[-1], xi[-2 - i])
            return self.layers[-1](xi[-1])

    class SegModel(jl.LightningModule):
        def __init__(self, batch_size: int = 8, lr: float = 1e-3, init_weights: str = "", **unet):
            super().__init__()
            self.save_hyperparameters()
            self.net = UNet(**unet)

        def on_fit_start(self):
            if self.hparams.init_weights:  # port: start from the original's torch weights
                load_torch_weights(self, self.hparams.init_weights)

        def forward(self, x):
            return self.net(jnp.moveaxis(x, 1, -1))  # port: NCHW batches, NHWC network; logits NHWC

        def training_step(self, batch, batch_nb):
            img, mask = batch
            out = self(img.astype(jnp.float32))
            # port: F.cross_entropy(out, mask, ignore_index=250), docs/migration.md's table
            keep = mask != IGNORE
            safe = jnp.where(keep, mask, 0)
            loss = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(out, safe), where=keep)
            self.log_dict({"train_loss": loss})
            return loss

        def configure_optimizers(self):  # port: CosineAnnealingLR(T_max=10) per epoch, on an injected rate
            lr, t_max = self.hparams.lr, 10
            return {
                "optimizer": optax.inject_hyperparams(optax.adam)(learning_rate=lr),
                "lr_scheduler": {
                    "scheduler": lambda e: lr * (1 + math.cos(math.pi * e / t_max)) / 2,
                    "interval": "epoch",
                },
            }

    return SegModel


def run_unet(framework: str, init: str, devices: int = 1, strategy: str = "auto") -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    kw = dict(
        max_epochs=UNET_STEPS // 5,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )
    img, mask = segmentation_data()
    loader = DataLoader(TensorDataset(torch.from_numpy(img), torch.from_numpy(mask)), batch_size=8)
    if framework == "pl":
        _quiet_lightning()
        import pytorch_lightning as pl

        torch.manual_seed(0)
        model = _unet_lightning()(init_weights=init, **UNET)
        trainer = pl.Trainer(accelerator="cpu", devices=1, **kw)
    else:
        import jaxlight as jl

        model = _unet_jaxlight()(init_weights=init, **UNET)
        trainer = jl.Trainer(devices=devices, strategy=strategy, **kw)
    rec: dict[str, Any] = {}
    trainer.callbacks = [*trainer.callbacks, _recorder(framework, rec)]
    trainer.fit(model, train_dataloaders=loader)
    rec.update(
        global_step=trainer.global_step,
        metric_names=sorted(trainer.callback_metrics),
        compile_counts=dict(trainer.compile_counts) if framework == "jl" else None,
    )
    return rec
