"""jaxlight against its peers, per training step, side by side in one process.

Contenders, each training the same model with the same Adam on the same numpy
batches, one device:

- ``hand jax.jit + optax``: the baseline, a ``jax.jit`` of value_and_grad +
  optax with the state donated (``overhead.HandLoop`` for the transformer);
- ``jaxlight defaults``: progress bar, CSV logger, ``ModelCheckpoint`` per
  epoch, model summary, preemption handling, and a per-batch timing callback
  (what a user adds first);
- ``jaxlight bare``: no progress bar, logger, checkpoint or summary;
- ``jaxlight steps_per_execution=32``: the defaults row with
  ``Trainer(steps_per_execution=32)``, 32 train steps per compiled call (the
  per-batch callbacks run after each call);
- ``Keras 3 model.fit`` on JAX with ``steps_per_execution`` 1 and 32, at
  Keras's defaults (progress bar, History); the transformer is the very same
  NNX model inside a ``keras.layers.JaxLayer``, the MLPs are Keras ``Dense``
  layers;
- ``raw torch loop`` and ``Lightning`` (``pytorch_lightning.Trainer`` at its
  defaults plus the same per-batch timing callback) over the same MLP, or a
  torch transformer of the same shape; Lightning's ratio is against raw torch.

Workloads: ``tiny`` MLP 32-64-10, batch 64 (where per-step host overhead
shows); ``mid`` MLP 784-1024-1024-10, batch 256; ``ref``, the reference
transformer of ``common.py`` (d=256, 4 layers, sequence 128, batch 16, AdamW).

Method. Every framework's ``fit`` runs on its own thread, parked at each
epoch start on a baton the driver (main thread) hands out, so exactly one
contender runs at a time and every fit compiles once. A round is one epoch of
every contender (the hand loops run on the driver), in an order that rotates
each round so no contender always follows the same one; drifts of a shared
machine hit all alike. An epoch is timed from its first batch to a drained
device after its last (``block_until_ready`` on the state), so each side
keeps its asynchronous dispatch within the epoch; epoch-end work (the
checkpoint save, logger flushes) happens after the timing, with the baton
still held, and an asynchronous save is waited for before the baton goes
back. The first epoch of each (compile) is not timed. Reported per contender:
the median ms/step over the rounds, min and max, the process CPU ms/step
(all threads), the ratio of medians against the hand loop (against raw torch
for Lightning), and the median over rounds of the overhead in µs/step against
that round's baseline.

``--busy [N]`` runs N processes (default 1) that spin on a core beside the
benchmark, the "cores are scarce" case of issue 25; ``--quick`` runs fewer,
shorter rounds (a few minutes in all on 2 cores).

    KERAS_BACKEND is set to "jax" here (keras must not be imported before).
    python benchmarks/peers.py --quick
    python benchmarks/peers.py --workloads tiny --rounds 9 --busy
"""

from __future__ import annotations

import os

if os.environ.setdefault("KERAS_BACKEND", "jax") != "jax":
    raise SystemExit(f"KERAS_BACKEND={os.environ['KERAS_BACKEND']!r}; this benchmark runs Keras on JAX (unset it)")

import argparse
import contextlib
import dataclasses
import logging
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import numpy as np
import optax
from common import BATCH_SIZE, LEARNING_RATE, REFERENCE, LMModule, build_model, make_batches
from flax import nnx
from overhead import HandLoop, tiny_loss

import jaxlight as jl


# ---------------------------------------------------------------------------- workloads
@dataclasses.dataclass(frozen=True)
class Workload:
    """One model + batch shape: its batches, and how each framework builds it."""

    name: str
    title: str
    batch: int
    steps: int  # per round (an epoch); steps_per_execution is min(32, steps), which must divide it
    quick_steps: int
    kind: str  # "mlp" or "lm"
    dims: tuple[int, ...] = ()

    def batches(self, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
        if self.kind == "lm":
            return make_batches(n, self.batch, REFERENCE.seq_len, seed=0)
        rng = np.random.default_rng(0)
        x = rng.normal(size=(n, self.batch, self.dims[0])).astype(np.float32)
        y = rng.integers(0, self.dims[-1], size=(n, self.batch)).astype(np.int32)
        return [(x[i], y[i]) for i in range(n)]


WORKLOADS = {
    "tiny": Workload("tiny", "tiny MLP 32-64-10, batch 64, Adam 1e-3", 64, 320, 160, "mlp", (32, 64, 10)),
    "mid": Workload("mid", "mid MLP 784-1024-1024-10, batch 256, Adam 1e-3", 256, 32, 32, "mlp", (784, 1024, 1024, 10)),
    "ref": Workload(
        "ref",
        f"reference transformer d={REFERENCE.d_model} L={REFERENCE.n_layers} H={REFERENCE.n_heads} "
        f"T={REFERENCE.seq_len}, batch {BATCH_SIZE}, AdamW {LEARNING_RATE}",
        BATCH_SIZE,
        16,
        8,
        "lm",
    ),
}


class MLP(nnx.Module):
    """Dense layers with ReLU between them (the MLP workloads' JAX model)."""

    def __init__(self, dims: tuple[int, ...], rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(dims[:-1], dims[1:])])

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == 0 else layer(nnx.relu(x))
        return x


class MLPModule(jl.LightningModule):
    """The MLP workloads as a LightningModule; logs ``train_loss`` on step, as real modules do."""

    def __init__(self, dims: tuple[int, ...]) -> None:
        super().__init__()
        self.net = MLP(dims, nnx.Rngs(0))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = tiny_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return optax.adam(1e-3)


# ---------------------------------------------------------------------------- baselines (run on the driver)
class HandJax:
    """The hand-written ``jax.jit`` + optax loop (state donated, numpy batches transferred every step)."""

    name = "hand jax.jit + optax"

    def __init__(self, wl: Workload, batches: list) -> None:
        self.batches = batches
        if wl.kind == "lm":
            self.loop = HandLoop(seed=0, cfg=REFERENCE)
            return
        gd, params, rest = nnx.split(MLP(wl.dims, nnx.Rngs(0)), nnx.Param, ...)
        tx = optax.adam(1e-3)

        def step(params, opt_state, rest, x, y):
            loss, grads = jax.value_and_grad(lambda p: tiny_loss(nnx.merge(gd, p, rest)(x), y))(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        # the same fields as overhead.HandLoop, so its run() drives both
        self.loop = HandLoop.__new__(HandLoop)
        self.loop.params, self.loop.rest, self.loop.opt_state = params, rest, tx.init(params)
        self.loop.step = jax.jit(step, donate_argnums=(0, 1))

    def epoch(self) -> tuple[float, float]:
        """One epoch over the batches: (wall, CPU) seconds per step."""
        wall, cpu = self.loop.run(self.batches)
        return wall / 1e3, cpu / 1e3


class RawTorch:
    """The raw torch loop over the same model Lightning trains (zero_grad, forward, backward, step)."""

    name = "raw torch loop"

    def __init__(self, wl: Workload, batches: list) -> None:
        self.net = torch_model(wl)
        self.opt = torch_optimizer(wl, self.net)
        self.batches = batches

    def epoch(self) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        for x, y in self.batches:
            self.opt.zero_grad(set_to_none=True)
            loss = torch_loss(self.net(x), y)
            loss.backward()
            self.opt.step()
        n = len(self.batches)
        return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n


# ---------------------------------------------------------------------------- torch models
def torch_model(wl: Workload):
    import torch
    from torch import nn

    torch.manual_seed(0)
    if wl.kind == "mlp":
        mods: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(wl.dims[:-1], wl.dims[1:])):
            if i:
                mods.append(nn.ReLU())
            mods.append(nn.Linear(a, b))
        return nn.Sequential(*mods)
    cfg = REFERENCE

    class TorchGPT(nn.Module):
        """The reference shape in torch: embeddings, pre-norm GELU blocks with a causal mask, untied head."""

        def __init__(self) -> None:
            super().__init__()
            d = cfg.d_model
            self.tok = nn.Embedding(cfg.vocab, d)
            self.pos = nn.Parameter(torch.randn(cfg.seq_len, d) * 0.01)
            layer = nn.TransformerEncoderLayer(
                d, cfg.n_heads, cfg.mlp_ratio * d, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
            )
            self.blocks = nn.TransformerEncoder(layer, cfg.n_layers, enable_nested_tensor=False)
            self.ln = nn.LayerNorm(d)
            self.head = nn.Linear(d, cfg.vocab, bias=False)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(cfg.seq_len))

        def forward(self, x):
            h = self.tok(x) + self.pos[: x.shape[1]]
            return self.head(self.ln(self.blocks(h, mask=self.mask, is_causal=True)))

    return TorchGPT()


def torch_optimizer(wl: Workload, net):
    import torch

    if wl.kind == "lm":
        return torch.optim.AdamW(net.parameters(), LEARNING_RATE, weight_decay=1e-4)
    return torch.optim.Adam(net.parameters(), 1e-3)


def torch_loss(logits, y):
    import torch

    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def torch_batches(batches: list) -> list:
    import torch

    return [
        (torch.from_numpy(x).long() if x.dtype == np.int32 else torch.from_numpy(x), torch.from_numpy(y).long())
        for x, y in batches
    ]


# ---------------------------------------------------------------------------- frameworks (each on a thread)
class Baton:
    """Hands one epoch at a time to a framework's fit running on its own thread.

    The framework's epoch-start hook calls :meth:`gate` with the epoch it just
    finished (None before the first): that result goes to the driver, and the
    thread parks until the driver asks for the next epoch."""

    def __init__(self) -> None:
        self._go = threading.Event()
        self._done = threading.Event()
        self._result: tuple[float, float] | None = None
        self.error: BaseException | None = None
        self.t0 = self.c0 = 0.0
        self.last: tuple[float, float] | None = None
        self.steps = 1

    # the framework's side
    def start(self) -> None:
        self.t0, self.c0 = time.perf_counter(), time.process_time()

    def stop(self) -> None:
        """The epoch's last step drained: record (wall, CPU) seconds per step."""
        self.last = ((time.perf_counter() - self.t0) / self.steps, (time.process_time() - self.c0) / self.steps)

    def gate(self, final: bool = False) -> None:
        self._result, self.last = self.last, None
        self._done.set()
        if final:
            return
        self._go.wait()
        self._go.clear()

    # the driver's side
    def run_epoch(self, thread: threading.Thread) -> tuple[float, float] | None:
        self._done.clear()
        self._go.set()
        while not self._done.wait(1.0):
            if not thread.is_alive():
                break
        if self.error is not None:
            raise RuntimeError(f"{thread.name} failed") from self.error
        if not self._done.is_set():
            raise RuntimeError(f"{thread.name} ended before its epochs did")
        return self._result


class Framework:
    """A contender whose fit runs on a thread, one epoch per :meth:`epoch` call."""

    name = ""
    baseline = "hand"

    def __init__(self, wl: Workload, batches: list, epochs: int, root: str) -> None:
        self.wl, self.batches, self.epochs, self.root = wl, batches, epochs, root
        self.baton = Baton()
        self.baton.steps = len(batches)
        self.thread = threading.Thread(target=self._main, name=self.name, daemon=True)
        self._started = False

    def _main(self) -> None:
        try:
            self.baton._go.wait()
            self.baton._go.clear()
            self.fit()
            if not self.baton._done.is_set():
                self.baton.gate(final=True)
        except BaseException as e:
            self.baton.error = e
            self.baton._done.set()

    def fit(self) -> None:
        raise NotImplementedError

    def before_epoch(self) -> None:
        """Runs with the baton held, before each epoch's first batch (A/B runs swap a code path here)."""

    def epoch(self) -> tuple[float, float] | None:
        if not self._started:
            self._started = True
            self.thread.start()
        return self.baton.run_epoch(self.thread)


class BatchTimer:
    """The per-batch timing callback a user adds (records the wall time at each batch end)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def record(self) -> None:
        self.times.append(time.perf_counter())


class Jaxlight(Framework):
    def __init__(self, wl, batches, epochs, root, defaults: bool, spe: int = 1, prefetch: int | None = None) -> None:
        self.defaults, self.spe, self.prefetch = defaults, spe, prefetch
        self.name = (
            f"jaxlight steps_per_execution={spe}"
            if spe > 1
            else ("jaxlight defaults + batch callback" if defaults else "jaxlight bare")
        ) + ("" if prefetch is None else f", prefetch={prefetch}")
        super().__init__(wl, batches, epochs, root)

    def fit(self) -> None:
        baton, contender = self.baton, self
        timer = BatchTimer()

        class Gate(jl.Callback):
            def on_train_epoch_start(self, trainer, pl_module) -> None:
                ck = trainer.checkpoint_callback
                if ck is not None and hasattr(ck, "wait_until_finished"):
                    ck.wait_until_finished()  # the last epoch's async save must not overlap another contender
                if trainer.current_epoch:
                    baton.gate()
                contender.before_epoch()
                timer.times.clear()
                baton.start()

            def on_train_epoch_end(self, trainer, pl_module) -> None:
                jax.block_until_ready(trainer.train_state)
                baton.stop()

            def on_train_end(self, trainer, pl_module) -> None:
                ck = trainer.checkpoint_callback
                if ck is not None and hasattr(ck, "wait_until_finished"):
                    ck.wait_until_finished()
                baton.gate(final=True)

        class Timing(jl.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                timer.record()

        kw: dict[str, Any] = dict(max_epochs=self.epochs, devices=1, default_root_dir=self.root)
        if self.spe > 1:
            kw["steps_per_execution"] = self.spe
        if self.prefetch is not None:
            kw["prefetch"] = self.prefetch
        if self.defaults:
            kw["callbacks"] = [Gate(), Timing()]
        else:
            kw.update(
                callbacks=[Gate()],
                enable_progress_bar=False,
                logger=False,
                enable_checkpointing=False,
                enable_model_summary=False,
            )
        module = LMModule() if self.wl.kind == "lm" else MLPModule(self.wl.dims)
        trainer = jl.Trainer(**kw)
        trainer.fit(module, train_dataloaders=self.batches)
        if trainer.compile_counts["train"] != 1:
            raise RuntimeError(f"{self.name} compiled its train step {trainer.compile_counts['train']} times")


class Keras(Framework):
    def __init__(self, wl, batches, epochs, root, spe: int) -> None:
        self.spe = spe
        self.name = f"Keras 3 fit, steps_per_execution={spe}"
        super().__init__(wl, batches, epochs, root)

    def model(self):
        import keras

        wl = self.wl
        if wl.kind == "mlp":
            keras.utils.set_random_seed(0)
            layers = [keras.Input((wl.dims[0],))]
            layers += [keras.layers.Dense(d, activation="relu") for d in wl.dims[1:-1]]
            layers.append(keras.layers.Dense(wl.dims[-1]))
            return keras.Sequential(layers), keras.optimizers.Adam(1e-3)
        # the transformer: the same NNX model (same init) as the other JAX contenders, in a JaxLayer
        gd, params, rest = nnx.split(build_model(REFERENCE, 0), nnx.Param, ...)
        leaves, treedef = jax.tree.flatten(params)

        def call_fn(params, inputs):
            return nnx.merge(gd, jax.tree.unflatten(treedef, params), rest)(inputs)

        inp = keras.Input((REFERENCE.seq_len,), dtype="int32")
        out = keras.layers.JaxLayer(call_fn, params=list(leaves))(inp)
        return keras.Model(inp, out), keras.optimizers.AdamW(LEARNING_RATE, weight_decay=1e-4)

    def fit(self) -> None:
        import keras

        baton = self.baton

        class Gate(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None) -> None:
                if epoch:
                    baton.gate()
                baton.start()

            def on_epoch_end(self, epoch, logs=None) -> None:
                jax.block_until_ready([v.value for v in self.model.variables])
                baton.stop()

            def on_train_end(self, logs=None) -> None:
                baton.gate(final=True)

        model, opt = self.model()
        model.compile(
            optimizer=opt,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=self.spe,
        )
        x = np.concatenate([b[0] for b in self.batches])
        y = np.concatenate([b[1] for b in self.batches])
        model.fit(x, y, batch_size=self.wl.batch, epochs=self.epochs, shuffle=False, callbacks=[Gate()])


class Lightning(Framework):
    name = "Lightning defaults + batch callback"
    baseline = "torch"

    def fit(self) -> None:
        import pytorch_lightning as pl

        baton, wl = self.baton, self.wl
        tbatches = torch_batches(self.batches)
        timer = BatchTimer()

        class Lit(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = torch_model(wl)

            def training_step(self, batch, batch_idx):
                x, y = batch
                loss = torch_loss(self.net(x), y)
                self.log("train_loss", loss)
                return loss

            def configure_optimizers(self):
                return torch_optimizer(wl, self)

        class Gate(pl.Callback):
            def on_train_epoch_start(self, trainer, pl_module) -> None:
                if trainer.current_epoch:
                    baton.gate()
                timer.times.clear()
                baton.start()

            def on_train_epoch_end(self, trainer, pl_module) -> None:
                baton.stop()

            def on_train_end(self, trainer, pl_module) -> None:
                baton.gate(final=True)

        class Timing(pl.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                timer.record()

        class Batches:  # one plain iterable of ready batches (Lightning reads a list as several loaders)
            def __iter__(self):
                return iter(tbatches)

            def __len__(self) -> int:
                return len(tbatches)

        trainer = pl.Trainer(
            max_epochs=self.epochs,
            accelerator="cpu",
            devices=1,
            callbacks=[Gate(), Timing()],
            default_root_dir=self.root,
        )
        trainer.fit(Lit(), train_dataloaders=Batches())


# ---------------------------------------------------------------------------- driver
@dataclasses.dataclass
class Row:
    contender: Any
    wall: list[float] = dataclasses.field(default_factory=list)  # s/step per round
    cpu: list[float] = dataclasses.field(default_factory=list)


def contenders(wl: Workload, steps: int, rounds: int, root: str, args) -> tuple[list[Any], list[str]]:
    batches = wl.batches(steps)
    epochs = rounds + 1
    multi = min(32, steps)  # steps per execution of the multi-step rows
    if steps % multi:
        raise SystemExit(f"--steps {steps} is not a multiple of 32 (the multi-step rows run 32 steps per call)")
    out: list[Any] = [HandJax(wl, batches)]
    notes = []
    out.append(Jaxlight(wl, batches, epochs, os.path.join(root, wl.name, "jl"), defaults=True))
    out.append(Jaxlight(wl, batches, epochs, os.path.join(root, wl.name, "jlbare"), defaults=False))
    if args.prefetch_row is not None:
        out.append(
            Jaxlight(wl, batches, epochs, os.path.join(root, wl.name, "jlp"), defaults=True, prefetch=args.prefetch_row)
        )
    out.append(Jaxlight(wl, batches, epochs, os.path.join(root, wl.name, "jl32"), defaults=True, spe=multi))
    if not args.no_keras and not _importable("keras"):
        notes.append("keras not installed: no Keras rows")
    elif not args.no_keras:
        for spe in (1, multi):
            out.append(Keras(wl, batches, epochs, root, spe))
    if not args.no_torch:
        try:
            import pytorch_lightning  # noqa: F401
            import torch
        except ImportError:
            notes.append("torch / pytorch_lightning not installed: no torch rows")
        else:
            for name in ("pytorch_lightning", "lightning_fabric"):  # their import set these to INFO
                logging.getLogger(name).setLevel(logging.ERROR)
            torch.set_num_threads(args.torch_threads)
            out.append(RawTorch(wl, torch_batches(batches)))
            out.append(Lightning(wl, batches, epochs, os.path.join(root, wl.name, "pl")))
    return out, notes


def run_workload(wl: Workload, steps: int, rounds: int, root: str, args) -> tuple[list[Row], list[str]]:
    cands, notes = contenders(wl, steps, rounds, root, args)
    return run_rounds(cands, rounds), notes


def run_rounds(cands: list[Any], rounds: int) -> list[Row]:
    """A warm-up epoch of each contender, then ``rounds`` rounds of one epoch each, in a rotating order.

    A contender is anything with a ``name`` and an ``epoch()`` returning (wall, CPU) seconds per step
    (None for a framework's warm-up epoch)."""
    rows = [Row(c) for c in cands]
    for r in rows:  # warm-up epoch: compile, first steps (untimed), one contender at a time
        r.contender.epoch()
    for i in range(rounds):
        k = i % len(rows)
        for r in rows[k:] + rows[:k]:
            res = r.contender.epoch()
            if res is None:
                raise RuntimeError(f"{r.contender.name}: no timing for round {i}")
            r.wall.append(res[0])
            r.cpu.append(res[1])
    for r in rows:
        if isinstance(r.contender, Framework):
            r.contender.thread.join(timeout=60)
    return rows


def table(wl: Workload, steps: int, rounds: int, rows: list[Row], notes: list[str], load: str) -> str:
    """The printed table: ms/step median/min/max, CPU ms/step, ratios and overhead against the baselines."""
    med = statistics.median
    by = {r.contender.name: r for r in rows}
    hand = by[HandJax.name]
    torch_row = by.get(RawTorch.name)
    lines = [
        f"\n{wl.title}; {rounds} rounds x {steps} steps, alternating, medians; {load}",
        f"{'contender':<42}{'ms/step':>10}{'min':>10}{'max':>10}{'cpu ms':>10}{'vs base':>9}{'+us/step':>10}"
        f"{'vs hand':>9}",
    ]
    for r in rows:
        base = torch_row if getattr(r.contender, "baseline", "hand") == "torch" and torch_row is not None else hand
        w = med(r.wall) * 1e3
        over = med([a - b for a, b in zip(r.wall, base.wall)]) * 1e6
        lines.append(
            f"{r.contender.name:<42}{w:>10.3f}{min(r.wall) * 1e3:>10.3f}{max(r.wall) * 1e3:>10.3f}"
            f"{med(r.cpu) * 1e3:>10.3f}{w / (med(base.wall) * 1e3):>9.3f}{over:>10.1f}"
            f"{w / (med(hand.wall) * 1e3):>9.3f}{'' if base is hand else '  (base: raw torch)'}"
        )
    lines += [f"  note: {n}" for n in notes]
    return "\n".join(lines)


@contextlib.contextmanager
def busy_load(n: int):
    """``n`` processes spinning on a core each, for the "cores are scarce" rows."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


@contextlib.contextmanager
def quiet():
    """Progress bars and framework chatter to /dev/null (every contender writes to the same sink)."""
    with (
        open(os.devnull, "w") as sink,
        contextlib.redirect_stdout(sink),
        contextlib.redirect_stderr(sink),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        yield


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="tiny,mid,ref", help="comma-separated: tiny, mid, ref")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds (each contender one epoch per round)")
    p.add_argument("--steps", type=int, default=None, help="steps per round (default: per workload)")
    p.add_argument("--quick", action="store_true", help="3 rounds, shorter rounds: a few minutes in all")
    p.add_argument("--busy", type=int, nargs="?", const=1, default=0, help="processes spinning beside (default 1)")
    p.add_argument(
        "--prefetch-row", type=int, default=None, help="add a jaxlight defaults row with Trainer(prefetch=N)"
    )
    p.add_argument("--no-keras", action="store_true")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--torch-threads", type=int, default=1, help="torch.set_num_threads (1: no OpenMP spinning)")
    args = p.parse_args()
    if args.quick:
        args.rounds = min(args.rounds, 3)
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        p.error(f"unknown workloads {unknown}; choose from {sorted(WORKLOADS)}")
    load = f"{args.busy} busy process(es) spinning beside" if args.busy else "no extra load"
    load += f", machine load average {os.getloadavg()[0]:.2f} at start"
    print(
        f"jax {jax.__version__}, 1 {jax.devices()[0].platform} device, {os.cpu_count()} cores; "
        f"keras {'off' if args.no_keras else _version('keras')}, torch {'off' if args.no_torch else _version('torch')} "
        f"({args.torch_threads} thread), pytorch_lightning {_version('pytorch_lightning')}; "
        f"jaxlight from {os.path.dirname(os.path.dirname(os.path.abspath(jl.__file__)))}"
    )
    with tempfile.TemporaryDirectory() as root, busy_load(args.busy):
        for name in names:
            wl = WORKLOADS[name]
            steps = args.steps or (wl.quick_steps if args.quick else wl.steps)
            t0 = time.perf_counter()
            with quiet():
                rows, notes = run_workload(wl, steps, args.rounds, root, args)
            notes.append(f"{time.perf_counter() - t0:.0f} s for this workload")
            print(table(wl, steps, args.rounds, rows, notes, load), flush=True)


def _importable(mod: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(mod) is not None


def _version(mod: str) -> str:
    try:
        return __import__(mod).__version__
    except ImportError:
        return "not installed"


if __name__ == "__main__":
    main()
