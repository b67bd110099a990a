"""NonFiniteGuard: stops at the injected NaN step, or skips exactly that update."""

import jax
import numpy as np
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight.callbacks import NonFiniteError, NonFiniteGuard
from tests.core_models import Classifier, batches, make_data, max_diff, quiet


def poisoned(bad: int, n_batches: int = 8, bs: int = 16):
    x, y = make_data(n_batches * bs)
    x = x.copy()
    x[bad * bs + 3, 0] = np.nan  # one NaN feature in batch `bad`
    return batches(x, y, bs)


@pytest.mark.parametrize("bad", [2, 7])  # 7: the last batch, inside the run-ahead window at the end
def test_stop_names_the_step(bad):
    data = poisoned(bad)
    trainer = jl.Trainer(max_epochs=1, devices=8, callbacks=[NonFiniteGuard()], **quiet())
    with pytest.raises(NonFiniteError, match=rf"at step {bad} \(epoch 0, batch {bad}\)") as ei:
        trainer.fit(Classifier(), data)
    assert ei.value.step == bad
    from jaxlight.loops import RUN_AHEAD

    assert trainer.global_step <= bad + RUN_AHEAD + 1  # stopped within the bounded run-ahead


def test_stop_step_counts_optimizer_updates_with_accumulation():
    data = poisoned(5)
    trainer = jl.Trainer(max_epochs=1, devices=1, accumulate_grad_batches=2, callbacks=[NonFiniteGuard()], **quiet())
    with pytest.raises(NonFiniteError) as ei:
        trainer.fit(Classifier(), data)
    assert (ei.value.step, ei.value.batch_idx) == (2, 5)  # micro-batch 5 belongs to update 2


def test_skip_drops_exactly_that_update():
    bad = 3
    data = poisoned(bad)
    guard = NonFiniteGuard(action="skip", verbose=False)
    model = Classifier()
    jl.Trainer(max_epochs=1, devices=8, callbacks=[guard], **quiet()).fit(model, data)
    assert guard.skipped == [bad]
    # Skipping keeps params and optimizer state (Adam's count too), so the result equals training without that batch.
    ref = Classifier()
    jl.Trainer(max_epochs=1, devices=8, **quiet()).fit(ref, data[:bad] + data[bad + 1 :])
    got, want = nnx.state(model.net, nnx.Param), nnx.state(ref.net, nnx.Param)
    assert max_diff(got, want) <= 1e-6
    assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(got))


def test_skip_leaves_params_unchanged_at_that_step():
    bad = 2
    data = poisoned(bad)
    seen = {}

    class Snap(jl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx in (bad - 1, bad):
                seen[batch_idx] = {k: np.asarray(v) for k, v in trainer.train_state.params.items()}
                seen[f"skipped{batch_idx}"] = bool(outputs["skipped"])

    trainer = jl.Trainer(max_epochs=1, devices=1, callbacks=[NonFiniteGuard("skip", verbose=False), Snap()], **quiet())
    trainer.fit(Classifier(), data)
    assert seen[f"skipped{bad}"] and not seen[f"skipped{bad - 1}"]
    for k in seen[bad]:
        np.testing.assert_array_equal(seen[bad][k], seen[bad - 1][k])
    assert int(trainer.train_state.step) == len(data) - 1  # the device's update count skipped one


def test_bad_action():
    with pytest.raises(ValueError, match="action"):
        NonFiniteGuard(action="ignore")


def test_skip_under_accumulation_keeps_update_boundaries():
    # The bad micro-batch contributes a zero gradient to its window; the window still updates, so the
    # device's update count stays equal to the host's global_step.
    data = poisoned(3)
    guard = NonFiniteGuard(action="skip", verbose=False)
    model = Classifier()
    trainer = jl.Trainer(max_epochs=1, devices=1, accumulate_grad_batches=2, callbacks=[guard], **quiet())
    trainer.fit(model, data)
    assert guard.skipped == [1]  # micro-batch 3 belongs to update 1
    assert int(trainer.train_state.step) == trainer.global_step == len(data) // 2
    # the same windows by hand: each update is (g_a + g_b) / 2, with the poisoned micro-batch's g = 0
    import jax.numpy as jnp
    import optax

    from tests.core_models import initial_state, xent

    gd, params, rest = initial_state()
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)
    grad = jax.jit(jax.grad(lambda p, xb, yb: xent(nnx.merge(gd, p, rest, copy=True)(xb), yb)))
    for w in range(len(data) // 2):
        gs = [
            grad(params, jnp.asarray(xb), jnp.asarray(yb)) if 2 * w + i != 3 else None
            for i, (xb, yb) in enumerate(data[2 * w : 2 * w + 2])
        ]
        gs = [g if g is not None else jax.tree.map(jnp.zeros_like, params) for g in gs]
        upd, opt_state = tx.update(jax.tree.map(lambda a, b: (a + b) / 2, *gs), opt_state, params)
        params = optax.apply_updates(params, upd)
    assert max_diff(nnx.state(model.net, nnx.Param), params) <= 1e-6
