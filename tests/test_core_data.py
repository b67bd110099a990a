"""Dataloaders: torch DataLoader and torchdata StatefulDataLoader equal numpy batches; ragged (with
ragged_batches="error") and non-divisible batches raise with the numbers; ragged_batches="drop" drops."""

import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight.data import BatchError
from tests.core_models import EagerClassifier as Classifier
from tests.core_models import batches, hand_loop, make_data, max_diff, quiet

torch = pytest.importorskip("torch")

x, y = make_data(128)


def fit(data, **kw):
    model = Classifier()
    trainer = jl.Trainer(max_epochs=1, **quiet(**kw))
    trainer.fit(model, data)
    return nnx.state(model.net, nnx.Param), trainer


def torch_loader(cls):
    ds = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    return cls(ds, batch_size=16, shuffle=False)


@pytest.mark.parametrize("kind", ["DataLoader", "StatefulDataLoader"])
def test_torch_loaders_equal_numpy_batches(kind):
    if kind == "DataLoader":
        loader = torch_loader(torch.utils.data.DataLoader)
    else:
        tdn = pytest.importorskip("torchdata.stateful_dataloader")
        loader = torch_loader(tdn.StatefulDataLoader)
    assert isinstance(next(iter(loader))[0], torch.Tensor)
    got, trainer = fit(loader, devices=8)
    ref, _, _ = hand_loop(optax.adam(1e-2), batches(x, y, 16))
    assert max_diff(got, ref) <= 1e-6
    assert trainer.global_step == 8


def test_dict_batches_of_jax_and_numpy():
    class DictModel(Classifier):
        def training_step(self, batch, batch_idx):
            return super().training_step((batch["x"], batch["y"]), batch_idx)

    import jax.numpy as jnp

    data = [{"x": jnp.asarray(bx), "y": by} for bx, by in batches(x, y, 16)]
    model = DictModel()
    jl.Trainer(max_epochs=1, **quiet()).fit(model, data)
    ref, _, _ = hand_loop(optax.adam(1e-2), batches(x, y, 16))
    assert max_diff(nnx.state(model.net, nnx.Param), ref) <= 1e-6


def test_ragged_last_batch_raises_with_numbers():
    data = batches(x[:100], y[:100], 16)  # last batch has 4 rows
    with pytest.raises(BatchError, match=r"batch 6 has 4 rows but the first had 16.*ragged_batches='drop'"):
        fit(data, ragged_batches="error")


def test_ragged_last_batch_dropped_when_asked():
    data = batches(x[:100], y[:100], 16)
    got, trainer = fit(data, ragged_batches="drop")
    assert trainer.global_step == 6  # the 6 full batches
    ref, _, _ = hand_loop(optax.adam(1e-2), data[:6])
    assert max_diff(got, ref) <= 1e-6


def test_ragged_torch_loader_raises():
    ds = torch.utils.data.TensorDataset(torch.from_numpy(x[:40]), torch.from_numpy(y[:40]))
    with pytest.raises(BatchError, match="has 8 rows but the first had 16"):
        fit(torch.utils.data.DataLoader(ds, batch_size=16), ragged_batches="error")


def test_batch_not_divisible_by_batch_axes():
    data = batches(x[:48], y[:48], 12)
    with pytest.raises(BatchError, match=r"global batch 12.*not divisible.*= 8"):
        fit(data, devices=8)
    _, trainer = fit(data, devices=4)  # 12 rows split over 4 devices is fine
    assert trainer.global_step == 4
