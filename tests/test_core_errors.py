"""Each bad input from the issue raises a clear error naming what was wrong, with the numbers, before
any training work is done."""

import jax.numpy as jnp
import optax
import pytest

import jaxlight as jl
from jaxlight.data import BatchError
from tests.core_models import EagerClassifier as Classifier
from tests.core_models import batches, make_data, quiet, xent

x, y = make_data(64)
TRAIN = batches(x, y, 16)


def fit(model, data=TRAIN, **kw):
    trainer = jl.Trainer(max_epochs=1, **quiet(**kw))
    trainer.fit(model, data)
    return trainer


class Returns(Classifier):
    def __init__(self, what):
        super().__init__()
        self.what = what

    def training_step(self, batch, batch_idx):
        bx, by = batch
        per_row = optax.softmax_cross_entropy_with_integer_labels(self.net(bx), by)
        return {
            "vector": per_row,
            "none": None,
            "no_loss": {"out": per_row.mean()},
            "int": jnp.int32(1),
            "dict_vector": {"loss": per_row},
        }[self.what]


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("vector", r"loss must be a scalar, got shape \(16,\)"),
        ("dict_vector", r"loss must be a scalar, got shape \(16,\)"),
        ("none", r"training_step returned None; it must return a scalar loss or a dict with a scalar 'loss'"),
        ("no_loss", r"training_step returned a dict without a 'loss' key \(keys: \['out'\]\)"),
        ("int", r"loss must be floating point, got dtype int32"),
    ],
)
def test_bad_training_step_output(what, message):
    trainer = jl.Trainer(max_epochs=1, **quiet())
    with pytest.raises(jl.StepError, match=message):
        trainer.fit(Returns(what), TRAIN)
    assert trainer.global_step == 0


@pytest.mark.parametrize(
    ("opt", "message"),
    [
        (lambda: "adam", r"optax.GradientTransformation.*got str"),
        (lambda: optax.adam, r"optax.GradientTransformation.*got function"),
        (
            lambda: {"lr_scheduler": optax.constant_schedule(1.0)},
            r"dict without 'optimizer' \(keys: \['lr_scheduler'\]\)",
        ),
        (lambda: {"optimizer": optax.sgd(0.1), "lr_scheduler": 3}, r"lr_scheduler must be an optax schedule.*got int"),
    ],
)
def test_bad_configure_optimizers(opt, message):
    class Bad(Classifier):
        def configure_optimizers(self):
            return opt()

    with pytest.raises(jl.MisconfigurationError, match=message):
        fit(Bad())


def test_torch_optimizer_is_refused():
    torch = pytest.importorskip("torch")

    class Torchy(Classifier):
        def configure_optimizers(self):
            return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    with pytest.raises(jl.MisconfigurationError, match="got SGD"):
        fit(Torchy())


def test_leading_dims_disagree():
    with pytest.raises(BatchError, match=r"batch 0 has leaves whose leading dims disagree \(\[0\]: 16, \[1\]: 12\)"):
        fit(Classifier(), [(x[:16], y[:12])])


def test_too_many_devices():
    with pytest.raises(jl.MisconfigurationError, match=r"devices=9 requested but only 8 cpu device\(s\)"):
        jl.Trainer(devices=9)
    with pytest.raises(jl.MisconfigurationError, match=r"indices \[8\] do not exist \(8 local devices\)"):
        jl.Trainer(devices=[0, 8])


def test_unknown_strategy():
    with pytest.raises(ValueError, match="bogus") as e:
        jl.Trainer(strategy="bogus")
    assert "ddp" in str(e.value)  # the message lists the known strategies


@pytest.mark.parametrize("precision", ["64-true", "fp8", 8])
def test_unknown_precision(precision):
    choices = r"choose one of \('32-true', 'bf16-mixed', '16-mixed', 'bf16-true', '16-true', '64-true'\)"
    with pytest.raises(ValueError, match=r"precision=.*is not supported; " + choices):
        jl.Trainer(precision=precision)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"limit_train_batches": 1.5}, r"limit_train_batches=1.5 as a float must be within \[0.0, 1.0\]"),
        ({"limit_val_batches": -1}, r"limit_val_batches=-1 must be >= 0"),
        ({"accumulate_grad_batches": 0}, r"accumulate_grad_batches must be an int >= 1, got 0"),
        ({"gradient_clip_algorithm": "max"}, r"gradient_clip_algorithm='max'; choose 'norm' or 'value'"),
        ({"gradient_clip_val": -1.0}, r"gradient_clip_val must be >= 0, got -1.0"),
        ({"val_check_interval": 1.5}, r"val_check_interval=1.5 as a float must be in \(0, 1\]"),
        ({"log_every_n_steps": 0}, r"log_every_n_steps must be >= 1, got 0"),
        ({"max_steps": -5}, r"max_steps must be -1 \(no limit\) or >= 0, got -5"),
        ({"ragged_batches": "pad"}, r"ragged_batches='pad'; choose 'error' or 'drop'"),
        ({"fast_dev_run": -1}, r"fast_dev_run=-1 must be >= 0"),
    ],
)
def test_bad_trainer_arguments(kw, message):
    with pytest.raises(jl.MisconfigurationError, match=message):
        jl.Trainer(**kw)


def test_bad_module_and_loaders():
    class Empty(jl.LightningModule):
        def training_step(self, batch, batch_idx):
            return jnp.float32(0)

        def configure_optimizers(self):
            return optax.sgd(0.1)

    with pytest.raises(jl.MisconfigurationError, match="holds no flax.nnx.Module attribute"):
        fit(Empty())
    with pytest.raises(jl.MisconfigurationError, match="fit needs train_dataloaders"):
        jl.Trainer(**quiet()).fit(Classifier())
    with pytest.raises(jl.MisconfigurationError, match="model must be a jaxlight.LightningModule, got str"):
        jl.Trainer(**quiet()).fit("model", TRAIN)


def test_log_errors_name_the_metric():
    class BadLog(Classifier):
        def training_step(self, batch, batch_idx):
            loss = xent(self.net(batch[0]), batch[1])
            self.log("vec", self.net(batch[0]).mean(0))
            return loss

    with pytest.raises(ValueError, match=r"self.log\('vec'\) needs a scalar, got shape \(4,\)"):
        fit(BadLog())


def test_missing_eval_step():
    class NoEval(Classifier):
        validation_step = jl.LightningModule.validation_step
        test_step = jl.LightningModule.test_step

    with pytest.raises(jl.MisconfigurationError, match=r"validate\(\) needs NoEval.validation_step"):
        jl.Trainer(**quiet()).validate(NoEval(), TRAIN)
    with pytest.raises(jl.MisconfigurationError, match=r"test\(\) needs NoEval.test_step"):
        jl.Trainer(**quiet()).test(NoEval(), TRAIN)
    # Lightning: fit with a val loader but no validation_step skips validation with a warning
    trainer = jl.Trainer(max_epochs=1, **quiet(num_sanity_val_steps=2))
    with pytest.warns(UserWarning, match="no validation_step; skipping validation"):
        trainer.fit(NoEval(), TRAIN, TRAIN)
    assert trainer.global_step == len(TRAIN) and "validate" not in trainer.compile_counts
