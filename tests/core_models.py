"""Small models, data and reference loops shared by the core trainer tests (tests/test_core_*.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxlight as jl
from tests.helpers import quiet  # noqa: F401 - re-exported: the test files import it from here

IN, HID, OUT = 8, 16, 4


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dropout: float = 0.0, batchnorm: bool = False) -> None:
        self.l1 = nnx.Linear(IN, HID, rngs=rngs)
        self.bn = nnx.BatchNorm(HID, rngs=rngs) if batchnorm else None
        self.do = nnx.Dropout(dropout, rngs=rngs) if dropout else None
        self.l2 = nnx.Linear(HID, OUT, rngs=rngs)

    def __call__(self, x):
        h = self.l1(x)
        if self.bn is not None:
            h = self.bn(h)
        h = nnx.relu(h)
        if self.do is not None:
            h = self.do(h)
        return self.l2(h)


def xent(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


class Classifier(jl.LightningModule):
    """The issue's example module: an MLP classifier with Adam."""

    def __init__(self, lr: float = 1e-2, dropout: float = 0.0, batchnorm: bool = False, opt: str = "adam") -> None:
        super().__init__()
        self.save_hyperparameters()

    def configure_model(self) -> None:
        self.net = MLP(nnx.Rngs(0), self.hparams.dropout, self.hparams.batchnorm)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = xent(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(-1) == y).mean())

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_acc", (self.net(x).argmax(-1) == y).mean())

    def predict_step(self, batch, batch_idx):
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self.net(x)

    def configure_optimizers(self):
        return getattr(optax, self.hparams.opt)(self.hparams.lr)


def make_data(n: int = 256, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, IN)).astype(np.float32)
    y = x[:, :OUT].argmax(-1).astype(np.int32)
    return x, y


def batches(x, y, bs: int):
    return [(x[i : i + bs], y[i : i + bs]) for i in range(0, len(x), bs)]


def initial_state(model_cls=MLP, **kw):
    """(graphdef, params, rest) of a freshly created model: the same values configure_model creates."""
    return nnx.split(model_cls(nnx.Rngs(0), **kw), nnx.Param, ...)


def hand_loop(tx: optax.GradientTransformation, data, loss_fn=xent, **model_kw):
    """A hand-written jit + optax loop over ``data``; returns the final (params, rest) nnx States."""
    gd, params, rest = initial_state(**model_kw)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, rest, opt_state, x, y):
        def f(p):
            m = nnx.merge(gd, p, rest, copy=True)
            loss = loss_fn(m(x), y)
            return loss, nnx.state(m, nnx.Not(nnx.Param))

        (loss, new_rest), g = jax.value_and_grad(f, has_aux=True)(params)
        upd, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, upd), new_rest, opt_state, loss

    losses = []
    for x, y in data:
        params, rest, opt_state, loss = step(params, rest, opt_state, jnp.asarray(x), jnp.asarray(y))
        losses.append(float(loss))
    return params, rest, losses


def _leaf(x):
    x = x[...] if isinstance(x, nnx.Variable) else x
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x, np.float32)


def max_diff(a, b) -> float:
    """Largest absolute difference between two pytrees of arrays (or NNX states) with the same leaves."""
    la = [_leaf(v) for v in jax.tree.leaves(a, is_leaf=lambda v: isinstance(v, nnx.Variable))]
    lb = [_leaf(v) for v in jax.tree.leaves(b, is_leaf=lambda v: isinstance(v, nnx.Variable))]
    assert len(la) == len(lb), (len(la), len(lb))
    return max(float(np.max(np.abs(u - v))) for u, v in zip(la, lb))


class EagerClassifier(Classifier):
    """Classifier whose net exists before fit (created in ``__init__``): the trainer adopts and places it,
    skipping the compiled creation. Used where a test runs many fits, to keep the suite fast."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.configure_model()


def csv_history(path):
    """{metric: [(step, value), ...]} read from a CSVLogger metrics.csv (an independent reader for tests)."""
    import csv

    hist = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            for k, v in row.items():
                if k != "step" and v not in ("", None):
                    hist.setdefault(k, []).append((int(row["step"]), float(v)))
    return hist
