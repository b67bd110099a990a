"""EMA: the in-step average equals an EMA computed by hand from the parameter trajectory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlight as jl
from jaxlight.callbacks import EMA
from jaxlight.callbacks.ema import ema_decay
from tests.core_models import Classifier, batches, make_data, quiet


class Recorder(jl.Callback):
    """Copies the parameters to the host after every optimizer update (a test-only per-step sync)."""

    def __init__(self):
        self.init = None
        self.after = []  # (optimizer step t, params) for each update

    def on_train_start(self, trainer, pl_module):
        self.init = jax.tree.map(np.asarray, trainer.train_state.params)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.position.last_stepped:
            self.after.append((trainer.global_step, jax.tree.map(np.asarray, trainer.train_state.params)))


def hand_ema(init, trajectory, decay, warmup, every):
    ema = {k: v.astype(np.float64) for k, v in init.items()}
    for t, params in trajectory:
        if t % every:
            continue
        d = min(decay, (1 + t) / (10 + t)) if warmup else decay
        ema = {k: d * ema[k] + (1 - d) * params[k] for k in ema}
    return ema


@pytest.mark.parametrize("warmup,every,accum", [(True, 1, 1), (False, 3, 2)])
def test_ema_equals_hand_computed(warmup, every, accum):
    x, y = make_data(128)
    data = batches(x, y, 16)
    rec = Recorder()
    ema = EMA(decay=0.9, warmup=warmup, every_n_steps=every)
    trainer = jl.Trainer(max_epochs=2, devices=8, accumulate_grad_batches=accum, callbacks=[rec, ema], **quiet())
    trainer.fit(Classifier(lr=5e-2), data)
    assert len(rec.after) == 2 * len(data) // accum
    want = hand_ema(rec.init, rec.after, 0.9, warmup, every)
    got = ema.ema_params(trainer)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), want[k], atol=2e-6, rtol=1e-5, err_msg=k)
    # the average differs from both the initial and the final parameters (it really averaged)
    final = rec.after[-1][1]
    assert max(float(np.abs(np.asarray(got[k]) - final[k]).max()) for k in got) > 1e-4
    assert max(float(np.abs(np.asarray(got[k]) - rec.init[k]).max()) for k in got) > 1e-4


def test_warmup_formula():
    assert float(ema_decay(0.999, 1, True)) == pytest.approx(2 / 11)
    assert float(ema_decay(0.999, 10_000, True)) == pytest.approx(0.999)
    assert float(ema_decay(0.5, 3, False)) == 0.5


class ParamSumProbe(Classifier):
    """Validation logs the sum of the first kernel, so the metric shows which weights were evaluated."""

    def validation_step(self, batch, batch_idx):
        self.log("kernel_sum", self.net.l1.kernel[...].sum())


def test_ema_placement_dtype_and_validation_weights():
    x, y = make_data(64)
    data = batches(x, y, 16)
    ema = EMA(decay=0.8)
    trainer = jl.Trainer(
        max_epochs=1,
        devices=8,
        strategy=jl.strategies.FSDP(min_shard=1),
        precision="bf16-true",
        callbacks=[ema],
        **quiet(),
    )
    model = ParamSumProbe(lr=5e-2)
    trainer.fit(model, data, data)
    params, avg = trainer.train_state.params, ema.ema_params(trainer)
    for k in params:
        assert avg[k].dtype == params[k].dtype == jnp.bfloat16
        assert avg[k].sharding == params[k].sharding, k
    assert any(not avg[k].sharding.is_fully_replicated for k in avg)  # fsdp really sharded something
    # validation inside fit ran on the EMA weights, and so does validate() afterwards
    ema_sum = float(jnp.sum(avg["net/l1/kernel"].astype(jnp.float32)))
    trained_sum = float(jnp.sum(params["net/l1/kernel"].astype(jnp.float32)))
    gap = abs(ema_sum - trained_sum)
    assert gap > 0.05
    # the logged sum is the EMA's, well inside the gap to the trained weights' (bf16 rounding is ~1e-2)
    assert abs(float(trainer.callback_metrics["kernel_sum"]) - ema_sum) < 0.25 * gap
    out = trainer.validate(model, data, verbose=False)
    assert abs(out[0]["kernel_sum"] - ema_sum) < 0.25 * gap


def test_ema_off_for_validation_uses_trained_weights():
    x, y = make_data(64)
    data = batches(x, y, 16)
    ema = EMA(decay=0.8, use_for_validation=False)
    trainer = jl.Trainer(max_epochs=1, devices=1, callbacks=[ema], **quiet())
    trainer.fit(ParamSumProbe(lr=5e-2), data, data)
    trained_sum = float(jnp.sum(trainer.train_state.params["net/l1/kernel"]))
    np.testing.assert_allclose(float(trainer.callback_metrics["kernel_sum"]), trained_sum, rtol=1e-5)


def test_ema_bad_arguments():
    with pytest.raises(ValueError, match="decay"):
        EMA(decay=1.5)
    with pytest.raises(ValueError, match="every_n_steps"):
        EMA(every_n_steps=0)


class WorseningScore(Classifier):
    """Logs a score that gets worse every epoch, so EarlyStopping's wait count depends on its restored state."""

    def on_train_epoch_end(self):
        self.log("score", [1.0, 2.0, 3.0][self.current_epoch])


def test_ema_and_early_stopping_state_survive_a_resume():
    """Stopped after epoch 2 and resumed from its checkpoint: same EMA and EarlyStopping state as one run."""
    x, y = make_data(64)
    data = batches(x, y, 16)

    def run(max_epochs, ckpt_path=None):
        ema = EMA(decay=0.7)
        es = jl.callbacks.EarlyStopping(monitor="score", patience=10)
        ckpt = jl.callbacks.ModelCheckpoint(dirpath="ckpt", save_last="link")
        trainer = jl.Trainer(
            max_epochs=max_epochs, devices=2, callbacks=[ema, es, ckpt], **quiet(enable_checkpointing=True)
        )
        trainer.fit(WorseningScore(lr=5e-2), data, ckpt_path=ckpt_path)
        return {k: np.asarray(v) for k, v in ema.ema_params(trainer).items()}, es.state_dict()

    whole, es_whole = run(3)
    import shutil

    shutil.rmtree("ckpt")
    run(2)
    resumed, es_resumed = run(3, ckpt_path="last")
    for k in whole:
        np.testing.assert_allclose(resumed[k], whole[k], atol=1e-7, err_msg=k)
    # the best score is epoch 0's and two worse epochs followed: a lost wait count would read 1 or 0 here
    assert es_whole == {"wait_count": 2, "stopped_epoch": 0, "best_score": 1.0, "patience": 10}
    assert es_resumed == es_whole
