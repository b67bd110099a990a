"""Hook order against PyTorch Lightning 2.x (``tests/tests_pytorch/models/test_hooks.py`` upstream).

The expected lists below are written by hand from Lightning's semantics: callbacks before the module,
sanity check before training, validation inside the epoch after the last ``on_train_batch_end``,
``on_train_epoch_end`` of monitoring/checkpoint callbacks after the module's, ``teardown`` last.

Deliberate deviations from Lightning's list (JAX has no per-batch Python step):
- ``training_step``/``validation_step``/``predict_step`` are *traced once* into a compiled program, so
  they appear once (at the first batch), not per batch.
- torch-only hooks do not exist: ``backward``, ``on_before_backward``, ``on_after_backward``,
  ``optimizer_step``, ``optimizer_zero_grad``, ``zero_grad``, ``on_before_zero_grad``,
  ``on_before_optimizer_step``, ``clip_gradients``/``configure_gradient_clipping``, ``lr_scheduler_step``,
  ``transfer_batch_to_device`` and the batch-transfer hooks (the optimizer, clipping, schedules and the
  host-to-device transfer all happen inside the compiled step / the prefetcher).
- ``configure_model`` runs twice: once under ``nnx.eval_shape`` for shapes and logical annotations, once
  inside ``jax.jit`` to create the parameters sharded.
- dataloaders are requested right after ``setup`` (before the model is built), so a missing loader fails
  before any work; Lightning asks for them at the start of the sanity check / training (same relative
  order: val, then train).
- the module's ``on_validation_model_train`` is called after in-fit validation (Lightning 2.x calls it
  only when overridden, and it is overridden here because every hook is recorded).
"""

import inspect

import jax.numpy as jnp
import numpy as np
import pytest

import jaxlight as jl
from jaxlight.module import DataHooks, ModelHooks
from tests.core_models import Classifier, batches, make_data, quiet

NOT_HOOKS = {
    "step_extension",
    "init_step_state",
    "state_dict",
    "load_state_dict",
    "eval_params",
    "wait_until_finished",
}


def hooked_callback(called, prefix="Callback", **attrs):
    """A Callback recording every hook it gets, by name."""
    ns = dict(attrs)
    for name, _ in inspect.getmembers(jl.Callback, inspect.isfunction):
        if name.startswith("_") or name in NOT_HOOKS:
            continue
        ns[name] = (lambda n: lambda self, *a, **k: called.append(f"{prefix}.{n}"))(name)
    return type("HookedCallback", (jl.Callback,), ns)()


def hooked_model(called, data, **kw):
    """A Classifier recording its hooks, step methods and data/setup methods."""
    names = {n for n, _ in inspect.getmembers(ModelHooks, inspect.isfunction)}
    names |= {n for n, _ in inspect.getmembers(DataHooks, inspect.isfunction)}
    names |= {
        "configure_model",
        "configure_optimizers",
        "configure_callbacks",
        "training_step",
        "validation_step",
        "test_step",
        "predict_step",
    }
    ns = {}
    for name in names:
        base = getattr(Classifier, name)
        ns[name] = (lambda n, b: lambda self, *a, **k: (called.append(n), b(self, *a, **k))[1])(name, base)
    for name in ("train_dataloader", "val_dataloader", "test_dataloader"):
        ns[name] = (lambda n: lambda self: (called.append(n), data)[1])(name)
    ns["predict_dataloader"] = lambda self: (called.append("predict_dataloader"), [x for x, _ in data])[1]
    return type("HookedModel", (Classifier,), ns)(**kw)


def eval_epoch(fn, n, traced=True):
    out = [f"Callback.on_{fn}_epoch_start", f"on_{fn}_epoch_start"]
    for i in range(n):
        out += [f"Callback.on_{fn}_batch_start", f"on_{fn}_batch_start"]
        if i == 0 and traced:
            out += [f"{fn}_step"]  # traced once, at the first batch
        out += [f"Callback.on_{fn}_batch_end", f"on_{fn}_batch_end"]
    return out + [f"Callback.on_{fn}_epoch_end", f"on_{fn}_epoch_end"]


def validation_run(n, traced):
    return [
        "on_validation_model_eval",
        "Callback.on_validation_start",
        "on_validation_start",
        *eval_epoch("validation", n, traced),
        "Callback.on_validation_end",
        "on_validation_end",
        "on_validation_model_train",
    ]


@pytest.fixture
def data():
    x, y = make_data(64)
    return batches(x, y, 16)


def test_fit_hook_order(data):
    called = []
    monitor = hooked_callback(called, prefix="Monitor", is_monitoring_callback=True)
    model = hooked_model(called, data[:2])
    # the monitoring callback is listed first but runs its on_train_epoch_end last, like ModelCheckpoint
    trainer = jl.Trainer(
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=2,
        num_sanity_val_steps=2,
        callbacks=[monitor, hooked_callback(called)],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(model)
    called = [c for c in called if not c.startswith("Monitor.") or c == "Monitor.on_train_epoch_end"]

    train = []
    for i in range(2):
        train += ["Callback.on_train_batch_start", "on_train_batch_start"]
        train += ["training_step"] if i == 0 else []
        train += ["Callback.on_train_batch_end", "on_train_batch_end"]
    expected = [
        "configure_callbacks",
        "prepare_data",
        "Callback.setup",
        "setup",
        "val_dataloader",
        "train_dataloader",
        "configure_model",
        "configure_model",
        "configure_optimizers",
        "Callback.on_fit_start",
        "on_fit_start",
        "Callback.on_sanity_check_start",
        *validation_run(2, traced=True),
        "Callback.on_sanity_check_end",
        "Callback.on_train_start",
        "on_train_start",
        "Callback.on_train_epoch_start",
        "on_train_epoch_start",
        *train,
        *validation_run(2, traced=False),  # inside the epoch, after the last on_train_batch_end
        "Callback.on_train_epoch_end",
        "on_train_epoch_end",
        "Monitor.on_train_epoch_end",
        "Callback.on_train_end",
        "on_train_end",
        "Callback.on_fit_end",
        "on_fit_end",
        "Callback.teardown",
        "teardown",
    ]
    assert called == expected


@pytest.mark.parametrize(("verb", "noun", "loader"), [("validate", "validation", "val"), ("test", "test", "test")])
def test_eval_hook_order(data, verb, noun, loader):
    called = []
    model = hooked_model(called, data[:2])
    trainer = jl.Trainer(
        limit_val_batches=2,
        limit_test_batches=2,
        callbacks=[hooked_callback(called)],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    getattr(trainer, verb)(model, verbose=False)
    expected = [
        "configure_callbacks",
        "prepare_data",
        "Callback.setup",
        "setup",
        f"{loader}_dataloader",
        "configure_model",
        "configure_model",
        f"on_{noun}_model_eval",
        f"Callback.on_{noun}_start",
        f"on_{noun}_start",
        *eval_epoch(noun, 2),
        f"Callback.on_{noun}_end",
        f"on_{noun}_end",
        # Lightning puts the module back in train mode after a standalone validate (checked against
        # pytorch-lightning in tests/test_lightning_diff.py); test has no such hook
        *(["on_validation_model_train"] if noun == "validation" else []),
        "Callback.teardown",
        "teardown",
    ]
    assert called == expected


def test_predict_hook_order(data):
    called = []
    model = hooked_model(called, data[:2])
    trainer = jl.Trainer(
        limit_predict_batches=2,
        callbacks=[hooked_callback(called)],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    preds = trainer.predict(model)
    assert len(preds) == 2
    expected = [
        "configure_callbacks",
        "prepare_data",
        "Callback.setup",
        "setup",
        "predict_dataloader",
        "configure_model",
        "configure_model",
        "on_predict_model_eval",
        "Callback.on_predict_start",
        "on_predict_start",
        *eval_epoch("predict", 2),
        "Callback.on_predict_end",
        "on_predict_end",
        "Callback.teardown",
        "teardown",
    ]
    assert called == expected


def test_train_batch_end_gets_device_outputs_and_hook_args(data):
    seen = []

    class Spy(jl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append((outputs, batch_idx, type(batch_idx), batch[0].shape))

    trainer = jl.Trainer(max_epochs=1, callbacks=[Spy()], **quiet())
    trainer.fit(Classifier(), data)
    assert [s[1] for s in seen] == list(range(len(data)))
    assert all(s[2] is int for s in seen)
    for outputs, *_ in seen:
        assert set(outputs) == {"loss"}
        assert isinstance(outputs["loss"], jnp.ndarray) and outputs["loss"].shape == ()
    assert seen[0][3] == (16, 8)


def test_on_exception_called_callbacks_then_module(data):
    called = []

    class Boom(Classifier):
        def on_train_batch_start(self, batch, batch_idx):
            if batch_idx == 1:
                raise RuntimeError("boom at 1")

        def on_exception(self, exception):
            called.append(("module", str(exception)))

    class Cb(jl.Callback):
        def on_exception(self, trainer, pl_module, exception):
            called.append(("callback", str(exception)))

    trainer = jl.Trainer(max_epochs=1, callbacks=[Cb()], **quiet())
    model = Boom()
    with pytest.raises(RuntimeError, match="boom at 1"):
        trainer.fit(model, data)
    assert called == [("callback", "boom at 1"), ("module", "boom at 1")]
    assert trainer.global_step == 1
    # the module is left usable, holding the weights of the last completed step
    np.testing.assert_array_equal(
        np.asarray(model.net.l1.kernel[...]), np.asarray(trainer.train_state.params["net/l1/kernel"])
    )
    assert model.net(jnp.asarray(data[0][0])).shape == (16, 4)


def test_module_usable_in_epoch_level_hooks(data):
    """The train step donates its state; the module is re-pointed before validation and epoch-end hooks, so
    Lightning-style callbacks can run the model there, on the current weights."""
    seen = []

    class UseModel(jl.Callback):
        def _run(self, trainer, pl_module, where):
            out = pl_module.net(jnp.asarray(data[0][0]))
            ref = trainer.train_state.params["net/l2/bias"]
            seen.append((where, out.shape, bool(jnp.all(pl_module.net.l2.bias[...] == ref))))

        def on_validation_epoch_end(self, trainer, pl_module):
            self._run(trainer, pl_module, "val")

        def on_train_epoch_end(self, trainer, pl_module):
            self._run(trainer, pl_module, "train")

    trainer = jl.Trainer(max_epochs=2, callbacks=[UseModel()], **quiet())
    trainer.fit(Classifier(), data, data[:1])
    assert seen == [("val", (16, 4), True), ("train", (16, 4), True)] * 2


def test_on_train_batch_start_returning_minus_one_skips_rest_of_epoch(data):
    class Stop(Classifier):
        def on_train_batch_start(self, batch, batch_idx):
            return -1 if batch_idx == 2 else None

    trainer = jl.Trainer(max_epochs=2, **quiet())
    trainer.fit(Stop(), data)
    assert trainer.global_step == 4  # two batches in each of the two epochs
    assert trainer.current_epoch == 2


def test_datamodule_hook_order(data):
    called = []

    class DM(jl.LightningDataModule):
        def prepare_data(self):
            called.append("prepare_data")

        def setup(self, stage):
            called.append(f"setup:{stage}")

        def teardown(self, stage):
            called.append(f"teardown:{stage}")

        def train_dataloader(self):
            called.append("train_dataloader")
            return data

        def val_dataloader(self):
            called.append("val_dataloader")
            return data[:1]

        def test_dataloader(self):
            called.append("test_dataloader")
            return data[:1]

    trainer = jl.Trainer(max_epochs=1, **quiet())
    model = Classifier()
    trainer.fit(model, datamodule=DM())
    assert called == ["prepare_data", "setup:fit", "val_dataloader", "train_dataloader", "teardown:fit"]
    assert trainer.global_step == len(data)
    called.clear()
    trainer.test(model, datamodule=DM(), verbose=False)
    assert called == ["prepare_data", "setup:test", "test_dataloader", "teardown:test"]
