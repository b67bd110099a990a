"""Step methods that need concrete values while traced get jaxlight's explanation; self.print prints values."""

import jax
import numpy as np
import pytest

import jaxlight as jl
from jaxlight.tracing import DOCS, TracingError
from tests.core_models import EagerClassifier, batches, make_data, quiet, xent
from tests.helpers import Losses

DATA = batches(*make_data(64), 16)


def fit(model, **kw):
    jl.Trainer(max_epochs=1, devices=1, **quiet(**kw)).fit(model, DATA)


class BranchOnIndex(EagerClassifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        if batch_idx == 0:  # the line the error must point at
            self.log("first", 1.0)
        return xent(self.net(x), y)


class FloatOfLoss(EagerClassifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = xent(self.net(x), y)
        self.log("lr_scaled", float(loss) * 0.1)
        return loss


class IndexWithBatchIdx(EagerClassifier):
    weights = (1.0, 0.5, 0.25, 0.125)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return xent(self.net(x), y) * self.weights[batch_idx]


class NumpyInValidation(EagerClassifier):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", np.mean(np.asarray(self.net(x).argmax(-1) == y)))


@pytest.mark.parametrize(
    ("model", "jax_error", "words"),
    [
        (BranchOnIndex, jax.errors.TracerBoolConversionError, ["`batch_idx` is traced", "jnp.where", "jax.lax.cond"]),
        (FloatOfLoss, jax.errors.ConcretizationTypeError, ["Python number", "self.log", "self.print"]),
        (IndexWithBatchIdx, jax.errors.TracerIntegerConversionError, ["Python int", "jax.lax.switch"]),
    ],
)
def test_training_step_errors_are_explained(model, jax_error, words):
    with pytest.raises(TracingError) as info:
        fit(model())
    err = info.value
    assert isinstance(err, jax_error)  # code catching JAX's error type still catches it
    assert isinstance(err, jl.StepError)
    assert isinstance(err.__cause__, jax_error) and not isinstance(err.__cause__, TracingError)
    msg = str(err)
    assert msg.startswith(f"{model.__name__}.training_step cannot run as written")
    assert __file__ in msg  # where: the user's file and line, with the source text
    for w in words:
        assert w in msg, (w, msg)
    assert DOCS in msg


def test_branch_error_points_at_the_users_line():
    with pytest.raises(TracingError, match=r"`if batch_idx == 0:  # the line the error must point at`"):
        fit(BranchOnIndex())


def test_validation_step_numpy_error_names_the_method():
    with pytest.raises(TracingError, match=r"NumpyInValidation.validation_step .* NumPy") as info:
        jl.Trainer(devices=1, **quiet()).validate(NumpyInValidation(), DATA)
    assert isinstance(info.value, jax.errors.TracerArrayConversionError)
    assert "jnp.asarray" in str(info.value)


def test_error_inside_manual_backward_is_explained():
    from tests.test_manual_optimization import GAN, gan_data

    class Bad(GAN):
        def training_step(self, batch, batch_idx):
            real, z = batch
            _, opt_d = self.optimizers()

            def loss_fn():
                loss = self.disc(real).mean()
                return loss if loss > 0 else -loss

            loss, grads = self.manual_backward(loss_fn, optimizer=opt_d)
            opt_d.step(grads)
            return loss

    with pytest.raises(TracingError, match=r"Bad.training_step .*Python bool"):
        jl.Trainer(max_epochs=1, devices=1, **quiet()).fit(Bad(), gan_data(2))


class Printing(EagerClassifier):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.print("step", batch_idx, "loss", loss, sep="|")
        return loss


@pytest.mark.parametrize("devices", [1, 8])
def test_self_print_prints_values_each_time_the_step_runs(capsys, devices):
    rec = Losses(as_float=True)
    model = Printing()
    jl.Trainer(max_epochs=2, devices=devices, callbacks=[rec], **quiet()).fit(model, DATA)
    jax.effects_barrier()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step|")]
    assert len(lines) == 2 * len(DATA)  # once per run of the step (not once per trace, not once per device)
    got = sorted((int(ln.split("|")[1]), float(ln.split("|")[3])) for ln in lines)
    want = sorted((i % len(DATA), v) for i, v in enumerate(rec.losses))
    assert [g[0] for g in got] == [w[0] for w in want]
    np.testing.assert_allclose([g[1] for g in got], [w[1] for w in want], rtol=1e-5)
    assert "Traced" not in "".join(lines)


def test_self_print_in_host_hooks_prints_directly(capsys):
    class Hooked(EagerClassifier):
        def on_train_epoch_end(self):
            self.print("epoch done", self.current_epoch)

    fit(Hooked())
    assert "epoch done 0" in capsys.readouterr().out
