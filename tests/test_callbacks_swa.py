"""StochasticWeightAveraging: Lightning's rates, average and BatchNorm pass; equal under ddp/fsdp; exact resume."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight.callbacks import StochasticWeightAveraging
from jaxlight.callbacks.swa import swalr_rates
from jaxlight.errors import MisconfigurationError
from jaxlight.optim.schedules import hyperparams_with_path
from tests.core_models import quiet

ROWS, BATCH, HIDDEN = 32, 8, 16  # 4 batches an epoch
EPOCHS, LR, SWA_LR = 5, 0.05, 0.01
SWA = {"swa_lrs": SWA_LR, "swa_epoch_start": 2, "annealing_epochs": 2}


def data(seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS, 4)).astype(np.float32)
    y = (np.tanh(x @ rng.normal(size=(4, 1))) + 0.1 * rng.normal(size=(ROWS, 1))).astype(np.float32)
    return [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, ROWS, BATCH)]


class Model(jl.LightningModule):
    """Linear -> BatchNorm -> ReLU -> Linear, SGD with momentum through an injected rate."""

    def __init__(self, init: str | None = None, lr: float = LR) -> None:
        super().__init__()
        self.init, self.lr = init, lr

    def configure_model(self) -> None:
        rngs = nnx.Rngs(0)
        bn = nnx.BatchNorm(HIDDEN, momentum=0.9, epsilon=1e-5, rngs=rngs)  # torch's momentum 0.1, eps 1e-5
        self.backbone = nnx.Sequential(nnx.Linear(4, HIDDEN, rngs=rngs), bn, nnx.relu)
        self.head = nnx.Linear(HIDDEN, 1, rngs=rngs)

    def on_fit_start(self) -> None:
        if self.init is not None:
            from jaxlight.migrate import load_torch_weights

            load_torch_weights(self, self.init)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.head(self.backbone(x)) - y) ** 2).mean()

    def configure_optimizers(self):
        return optax.inject_hyperparams(optax.sgd)(learning_rate=self.lr, momentum=0.9)


class Rec(jl.Callback):
    """Per-batch losses and the rate each epoch trains with."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.lrs: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            rates = hyperparams_with_path(trainer.train_state.opt_state, "learning_rate")
            self.lrs.append(float(np.asarray(next(iter(rates.values())))))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def _final(module) -> dict[str, np.ndarray]:
    lin, bn = module.backbone.layers[0], module.backbone.layers[1]
    return {
        "backbone.0.weight": np.asarray(lin.kernel[...]).T,
        "backbone.0.bias": np.asarray(lin.bias[...]),
        "backbone.1.weight": np.asarray(bn.scale[...]),
        "backbone.1.bias": np.asarray(bn.bias[...]),
        "backbone.1.running_mean": np.asarray(bn.mean[...]),
        "backbone.1.running_var": np.asarray(bn.var[...]),
        "head.weight": np.asarray(module.head.kernel[...]).T,
        "head.bias": np.asarray(module.head.bias[...]),
    }


def _run_jl(init=None, swa_kw=SWA, epochs=EPOCHS, **trainer_kw):
    rec, cb = Rec(), StochasticWeightAveraging(**swa_kw)
    kw = {**quiet(), **trainer_kw}
    trainer = jl.Trainer(max_epochs=epochs, callbacks=[cb, rec, *kw.pop("callbacks", [])], **kw)
    module = Model(init)
    trainer.fit(module, data())
    return trainer, module, cb, rec


# ------------------------------------------------------------------------ against pytorch-lightning
def _run_lightning(init: str) -> tuple[list[float], list[float], dict[str, np.ndarray], int, list[float]]:
    pl = pytest.importorskip("pytorch_lightning")
    torch = pytest.importorskip("torch")
    from torch import nn

    from tests.gallery_lightning_programs import _quiet_lightning

    _quiet_lightning()

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.backbone = nn.Sequential(nn.Linear(4, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU())
            self.head = nn.Linear(HIDDEN, 1)
            torch.save(self.state_dict(), init)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return ((self.head(self.backbone(x)) - y) ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

    losses, lrs, bn_losses = [], [], []

    class PlRec(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 0 and trainer.current_epoch < EPOCHS:
                lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            (losses if trainer.current_epoch < EPOCHS else bn_losses).append(float(outputs["loss"]))

    x = torch.from_numpy(np.concatenate([b[0] for b in data()]))
    y = torch.from_numpy(np.concatenate([b[1] for b in data()]))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    cb = pl.callbacks.StochasticWeightAveraging(**SWA)
    t = pl.Trainer(
        max_epochs=EPOCHS, callbacks=[cb, PlRec()], accelerator="cpu", enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, logger=False,
    )  # fmt: skip
    lit = Lit()
    t.fit(lit, loader)
    final = {k: v.detach().numpy().copy() for k, v in lit.state_dict().items() if "num_batches" not in k}
    # Lightning's extra BatchNorm epoch ends with an optimizer step (its last batch closes the accumulation
    # window it opened, with the stale gradient of the last training batch and SGD's momentum): its final
    # weights are the average moved by that step. Its statistics are computed before it, with the average,
    # and jaxlight leaves the weights at the average (what Lightning's comment says it does): the average
    # model's parameters are the reference, and the stray step is asserted to exist
    averaged = {k: p.detach().numpy().copy() for k, p in cb._average_model.named_parameters()}
    moved = max(float(np.abs(final[k] - averaged[k]).max()) for k in averaged)
    assert moved > 1e-5, "Lightning no longer steps in its BatchNorm epoch: compare its final weights directly"
    final.update(averaged)
    return losses, lrs, final, int(cb.n_averaged), bn_losses


def test_swa_matches_lightning(tmp_path):
    init = str(tmp_path / "init.pt")
    pl_losses, pl_lrs, pl_final, pl_n, pl_bn_losses = _run_lightning(init)
    trainer, module, cb, rec = _run_jl(init)
    # the rates: the optimizer's for epochs 0-1, then SWALR's cosine annealing to swa_lrs over 2 epochs
    assert len(pl_lrs) == len(rec.lrs) == EPOCHS
    np.testing.assert_allclose(rec.lrs, pl_lrs, rtol=1e-6)
    assert rec.lrs[0] == pytest.approx(LR) and rec.lrs[-1] == pytest.approx(SWA_LR)
    assert rec.lrs[1] == pytest.approx(LR) and LR > rec.lrs[2] > SWA_LR  # SWALR starts at epoch 1, anneals
    np.testing.assert_allclose(rec.losses, pl_losses, atol=1e-5, rtol=1e-5)
    assert cb.n_averaged == pl_n == 4  # the starts of epochs 1..4
    assert len(pl_bn_losses) == len(data())  # Lightning's extra epoch ran over the whole loader
    got = _final(module)
    # NNX folds the biased batch variance into the running variance, torch the unbiased one: the cumulative
    # averages differ by exactly BATCH / (BATCH - 1) (docs/migration.md)
    got["backbone.1.running_var"] = got["backbone.1.running_var"] * BATCH / (BATCH - 1)
    assert sorted(got) == sorted(pl_final)
    diffs = {k: float(np.abs(got[k] - pl_final[k]).max()) for k in got}
    print(f"max difference to Lightning: {max(diffs.values()):.3g}")
    assert max(diffs.values()) < 1e-5, diffs
    # the final weights are the average, not the last epoch's weights, and the statistics were recomputed
    last = trainer.train_state.callback_state["swa"]
    np.testing.assert_array_equal(np.asarray(last["head/kernel"]), np.asarray(module.head.kernel[...]))


def test_swalr_rates_follow_torch():
    torch = pytest.importorskip("torch")
    from torch.optim.swa_utils import SWALR

    for strategy, anneal in (("cos", 3), ("linear", 3), ("cos", 0), ("linear", 1)):
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([p, torch.nn.Parameter(torch.zeros(1))], lr=0.3)
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.7})
        sched = SWALR(opt, swa_lr=[0.01, 0.02], anneal_epochs=anneal, anneal_strategy=strategy)
        lrs = swalr_rates([0.3, 0.7], [0.01, 0.02], 1, anneal, strategy)
        for count in range(2, 7):
            assert lrs == [g["lr"] for g in opt.param_groups], (strategy, anneal, count)
            opt.step()
            sched.step()
            lrs = swalr_rates(lrs, [0.01, 0.02], count, anneal, strategy)


# ------------------------------------------------------------------------ ddp / fsdp equal one device
def _assert_close(a, b, tol, what):
    sa, sb = _final(a), _final(b)
    diffs = {k: float(np.abs(sa[k] - sb[k]).max()) for k in sa}
    assert max(diffs.values()) < tol, (what, diffs)
    return max(diffs.values())


@pytest.mark.parametrize(
    "devices,strategy",
    [(2, "ddp"), (4, jl.strategies.FSDP(min_shard=16))],
    ids=["ddp2", "fsdp4"],
)
def test_swa_sharded_equals_one_device(devices, strategy):
    t1, m1, cb1, rec1 = _run_jl(devices=1)
    tn, mn, cbn, recn = _run_jl(devices=devices, strategy=strategy)
    avg = tn.train_state.callback_state["swa"]
    params = tn.train_state.params
    for k in params:  # the average lives with the parameters, in their shardings
        assert avg[k].sharding == params[k].sharding, k
    if not isinstance(strategy, str):
        assert any(not a.sharding.is_fully_replicated for a in avg.values())  # something really sharded
    np.testing.assert_allclose(recn.losses, rec1.losses, atol=1e-5, rtol=1e-5)
    assert recn.lrs == rec1.lrs and cbn.n_averaged == cb1.n_averaged == 4
    print(f"max difference to one device ({strategy}): {_assert_close(mn, m1, 1e-5, strategy):.3g}")


# ------------------------------------------------------------------------ checkpoint and resume
def _states(trainer) -> dict[str, np.ndarray]:
    st = trainer.train_state
    flat = jax.tree_util.tree_flatten_with_path((st.params, st.model_state, st.opt_state, st.callback_state))[0]

    def host(v):
        return np.array(jax.random.key_data(v) if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) else v)

    return {jax.tree_util.keystr(k): host(v) for k, v in flat}


@pytest.mark.parametrize("resume_epoch", [1, 2])
def test_resume_mid_swa_is_bit_identical(tmp_path, resume_epoch):
    ckpt = jl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), save_top_k=-1)
    full, fm, fcb, frec = _run_jl(callbacks=[ckpt], enable_checkpointing=True)
    steps = len(data()) * (resume_epoch + 1)
    path = str(tmp_path / "ckpts" / f"epoch={resume_epoch}-step={steps}.ckpt")
    rec, cb = Rec(), StochasticWeightAveraging(**SWA)
    resumed = jl.Trainer(max_epochs=EPOCHS, callbacks=[cb, rec], **quiet())
    rm = Model()
    resumed.fit(rm, data(), ckpt_path=path)
    assert rec.lrs == frec.lrs[resume_epoch + 1 :]
    assert rec.losses == frec.losses[len(data()) * (resume_epoch + 1) :]
    assert cb.n_averaged == fcb.n_averaged == 4
    sa, sb = _states(resumed), _states(full)
    assert sa.keys() == sb.keys()
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)


def test_resume_without_the_average_differs(tmp_path):
    # the saved average matters: a resume whose callback starts afresh ends elsewhere (the test above can fail)
    ckpt = jl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), save_top_k=-1)
    full, fm, _, _ = _run_jl(callbacks=[ckpt], enable_checkpointing=True)
    path = str(tmp_path / "ckpts" / f"epoch=2-step={3 * len(data())}.ckpt")

    class Forgetful(StochasticWeightAveraging):
        def load_state_dict(self, state_dict):
            pass

    resumed = jl.Trainer(max_epochs=EPOCHS, callbacks=[Forgetful(**SWA)], **quiet())
    rm = Model()
    with pytest.warns(UserWarning, match="initializing after swa_start"):
        resumed.fit(rm, data(), ckpt_path=path)
    a, b = _final(rm), _final(fm)
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) > 1e-4


# ------------------------------------------------------------------------ refusals
def test_plain_alias_is_refused_with_the_fix():
    class Plain(Model):
        def configure_optimizers(self):
            return optax.sgd(0.1, momentum=0.9)

    trainer = jl.Trainer(max_epochs=2, callbacks=[StochasticWeightAveraging(swa_lrs=0.01)], **quiet())
    with pytest.raises(MisconfigurationError, match="inject_hyperparams"):
        trainer.fit(Plain(), data())


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"swa_lrs": -1.0}, "swa_lrs"),
        ({"swa_lrs": 0.1, "swa_epoch_start": 0}, "swa_epoch_start"),
        ({"swa_lrs": 0.1, "swa_epoch_start": 1.5}, "swa_epoch_start"),
        ({"swa_lrs": 0.1, "annealing_strategy": "exp"}, "annealing_strategy"),
        ({"swa_lrs": 0.1, "device": "cuda"}, "device"),
        ({"swa_lrs": 0.1, "avg_fn": 3}, "avg_fn"),
    ],
)
def test_bad_arguments_are_refused(kw, match):
    with pytest.raises(MisconfigurationError, match=match):
        StochasticWeightAveraging(**kw)
