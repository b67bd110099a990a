"""Trainer overhead: ``Trainer.fit`` against a hand-written jit+optax loop.

Workload (issue 2's reference): byte-level causal transformer, d_model=256,
4 layers, 4 heads, sequence 128, batch 16, AdamW 3e-4, fp32, on the stdlib
text. Both sides train the same NNX model from the same initialisation on the
same host batches (numpy, transferred every step), with the state donated.

Method. The two loops alternate inside one process and one ``fit``: a
callback lets the trainer run ``--steps`` optimizer steps, then, from inside
``on_train_batch_end``, runs the hand loop for ``--steps`` steps on the same
batches, then hands control back, ``--rounds`` times. Each segment is timed
from a drained device (``block_until_ready`` on the last step's loss and
state) to a drained device, so each side keeps its normal asynchronous
dispatch *within* the segment (the trainer's prefetch thread and run-ahead,
the hand loop's plain async dispatch) and pays one drain per segment, the
same for both. Compilation is excluded: the first ``--warmup`` trainer steps
are not timed and the hand loop is compiled and run once before timing.
Segments alternate T H T H ..., so slow drifts of a shared machine hit both
sides alike; we report the median ms/step of each side, the ratio of the
medians, and the median of the per-round ratios (each trainer segment against
the hand segment that follows it). Besides wall time each segment records the
process's CPU time (all threads: XLA's, the prefetch thread, Python), which
other processes on a shared machine disturb far less than wall time. Timing
whole fits of N steps minus a fit of 0 steps was rejected: every ``fit``
re-creates the optimizer state and recompiles, and that compile time
(seconds) swamps a 1% difference.

``--profile N`` then runs N more trainer steps under cProfile and splits the
loop's main-thread time into waiting for the device (the run-ahead bound and
the periodic metric fetch) and host work (hooks, metric bookkeeping, the
dispatch of the compiled step).

The trainer runs with progress bar, logger, model summary, sanity check and
checkpointing disabled; the module logs ``train_loss`` (a traced
``self.log``), as real modules do, and ``log_every_n_steps`` keeps its
default, so the periodic metric fetch is part of what is measured.

    python benchmarks/overhead.py                 # 12 rounds x 6 steps
    python benchmarks/overhead.py --profile 20    # + cProfile of 20 trainer steps

``--tiny`` measures the per-step *host overhead* instead: a tiny MLP whose
compiled step takes about 0.1 ms, one CPU device, with the progress bar,
checkpointing (``ModelCheckpoint`` at epoch end), preemption and the CSV logger
at their defaults. Each round is one trainer epoch of ``--tiny-steps`` steps
(timed from ``on_train_epoch_start`` to a drained device in
``on_train_epoch_end``, so no per-step hook of the benchmark's own is added)
against the hand loop over the same batches, alternating; the table reports
the median ms/step of each and their difference in microseconds per step.
With PyTorch Lightning installed it also runs the same MLP in torch, through
``lightning.Trainer`` (same defaults) and a raw torch loop, alternating the
same way, so both frameworks' overheads stand side by side.

    python benchmarks/overhead.py --tiny          # 9 rounds x 400 steps
    python benchmarks/overhead.py --tiny --steps-per-execution 32   # + a row with N=32 steps per call
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import optax
from common import BATCH_SIZE, LEARNING_RATE, REFERENCE, LMModule, build_model, lm_loss, make_batches
from flax import nnx

import jaxlight as jl


class HandLoop:
    """The baseline: ``jax.jit`` over value_and_grad + optax, params/opt state donated."""

    def __init__(self, seed: int = 0, cfg=REFERENCE) -> None:
        net = build_model(cfg, seed)
        self.graphdef, self.params, self.rest = nnx.split(net, nnx.Param, ...)
        tx = optax.adamw(LEARNING_RATE)
        self.opt_state = tx.init(self.params)
        graphdef = self.graphdef

        def step(params, opt_state, rest, x, y):
            def loss_fn(p):
                return lm_loss(nnx.merge(graphdef, p, rest), x, y)

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self.step = jax.jit(step, donate_argnums=(0, 1))

    def run(self, batches: list) -> tuple[float, float]:
        """Run one step per batch from a drained device to a drained device; (wall, CPU) ms/step."""
        t0, c0 = time.perf_counter(), time.process_time()
        loss = None
        for x, y in batches:
            self.params, self.opt_state, loss = self.step(self.params, self.opt_state, self.rest, x, y)
        jax.block_until_ready((loss, self.params))
        n = len(batches)
        return (time.perf_counter() - t0) / n * 1e3, (time.process_time() - c0) / n * 1e3


class Alternate(jl.Callback):
    """Times trainer segments and runs the hand loop between them."""

    def __init__(self, hand: HandLoop, batches: list, warmup: int, steps: int) -> None:
        self.hand, self.batches, self.warmup, self.steps = hand, batches, warmup, steps
        self.trainer_ms: list[float] = []
        self.hand_ms: list[float] = []
        self.trainer_cpu: list[float] = []
        self.hand_cpu: list[float] = []
        self.t0 = self.c0 = 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        done = batch_idx + 1
        if done < self.warmup:
            return
        if done > self.warmup and (done - self.warmup) % self.steps:
            return
        jax.block_until_ready((outputs["loss"], trainer.train_state))
        if done == self.warmup:
            self.hand.run(self.batches[:2])  # compile + one steady step, untimed
        else:
            self.trainer_ms.append((time.perf_counter() - self.t0) / self.steps * 1e3)
            self.trainer_cpu.append((time.process_time() - self.c0) / self.steps * 1e3)
            r = len(self.trainer_ms) - 1
            lo = self.warmup + r * self.steps
            wall, cpu = self.hand.run(self.batches[lo : lo + self.steps])
            self.hand_ms.append(wall)
            self.hand_cpu.append(cpu)
        self.t0, self.c0 = time.perf_counter(), time.process_time()


def bench_trainer(**overrides) -> jl.Trainer:
    kw = dict(
        devices=1,
        enable_progress_bar=False,
        logger=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
    )
    kw.update(overrides)
    return jl.Trainer(**kw)


def profile(n: int, batches: list) -> None:
    """cProfile ``n`` steady trainer steps and print where the host time goes."""
    import cProfile
    import pstats

    class Prof(jl.Callback):
        def __init__(self) -> None:
            self.prof = cProfile.Profile()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx == 1:  # after the compile
                jax.block_until_ready(outputs["loss"])
                self.prof.enable()

        def on_train_end(self, trainer, pl_module) -> None:
            self.prof.disable()

    cb = Prof()
    trainer = bench_trainer(max_steps=n + 2, callbacks=[cb])
    trainer.fit(LMModule(), train_dataloaders=batches[: n + 2])
    stats = pstats.Stats(cb.prof)
    total = stats.total_tt
    # time the loop spends waiting for the device: the run-ahead bound and the periodic metric fetch
    waiting = sum(v[2] for k, v in stats.stats.items() if k[2] in ("try_to_block", "_value"))
    print(
        f"\ncProfile of {n} trainer steps (main thread; the prefetch thread is not profiled): "
        f"{total / n * 1e3:.1f} ms/step in all, {waiting / n * 1e3:.1f} ms/step waiting for the device, "
        f"{(total - waiting) / n * 1e3:.2f} ms/step of host work. By own time:"
    )
    stats.sort_stats("tottime").print_stats(15)


# ---------------------------------------------------------------------------- --tiny: per-step host overhead
TINY_IN, TINY_HIDDEN, TINY_OUT, TINY_BATCH = 32, 64, 10, 64


def tiny_batches(n: int, seed: int = 0) -> list:
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, TINY_BATCH, TINY_IN)).astype(np.float32)
    y = rng.integers(0, TINY_OUT, size=(n, TINY_BATCH)).astype(np.int32)
    return [(x[i], y[i]) for i in range(n)]


class TinyMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(TINY_IN, TINY_HIDDEN, rngs=rngs)
        self.l2 = nnx.Linear(TINY_HIDDEN, TINY_OUT, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def tiny_loss(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


class TinyModule(jl.LightningModule):
    def __init__(self, on_epoch: bool = False) -> None:
        super().__init__()
        self.net = TinyMLP(nnx.Rngs(0))
        self.on_epoch = on_epoch

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = tiny_loss(self.net(x), y)
        self.log("train_loss", loss, on_epoch=self.on_epoch)
        return loss

    def configure_optimizers(self):
        return optax.adam(1e-3)


class TinyHand:
    """The tiny MLP's hand-written jit + optax loop (state donated, numpy batches)."""

    def __init__(self) -> None:
        gd, self.params, self.rest = nnx.split(TinyMLP(nnx.Rngs(0)), nnx.Param, ...)
        tx = optax.adam(1e-3)
        self.opt_state = tx.init(self.params)

        def step(params, opt_state, rest, x, y):
            loss, grads = jax.value_and_grad(lambda p: tiny_loss(nnx.merge(gd, p, rest)(x), y))(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self.step = jax.jit(step, donate_argnums=(0, 1))

    def run(self, batches: list) -> float:
        t0 = time.perf_counter()
        loss = None
        for x, y in batches:
            self.params, self.opt_state, loss = self.step(self.params, self.opt_state, self.rest, x, y)
        jax.block_until_ready((loss, self.params))
        return (time.perf_counter() - t0) / len(batches) * 1e3


class EpochAlternate:
    """Mixin logic shared by the jaxlight and Lightning callbacks: time each epoch (after a warm-up epoch)
    and run the baseline loop over the same batches before the next one."""

    def __init__(self, baseline, batches, drain) -> None:
        self.baseline, self.batches, self.drain = baseline, batches, drain
        self.framework_ms: list[float] = []
        self.baseline_ms: list[float] = []
        self.t0 = 0.0
        self.epoch = 0

    def start(self) -> None:
        if self.epoch >= 1:  # epoch 0 compiles / warms up
            self.baseline_ms.append(self.baseline.run(self.batches))
        self.t0 = time.perf_counter()

    def end(self, state) -> None:
        self.drain(state)
        if self.epoch >= 1:
            self.framework_ms.append((time.perf_counter() - self.t0) / len(self.batches) * 1e3)
        self.epoch += 1


def tiny_jaxlight(
    rounds: int,
    steps: int,
    root: str,
    prefetch: int | None = None,
    on_epoch: bool = False,
    steps_per_execution: int = 1,
) -> tuple[list[float], list[float], jl.Trainer]:
    batches = tiny_batches(steps)
    hand = TinyHand()
    hand.run(batches[:2])  # compile the baseline

    class Cb(jl.Callback, EpochAlternate):
        def __init__(self) -> None:
            EpochAlternate.__init__(self, hand, batches, jax.block_until_ready)

        def on_train_epoch_start(self, trainer, pl_module) -> None:
            self.start()

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            self.end(trainer.train_state)

    cb = Cb()
    # every default on: progress bar, ModelCheckpoint (one save per epoch), preemption, CSV logger
    extra = {} if prefetch is None else {"prefetch": prefetch}
    trainer = jl.Trainer(
        max_epochs=rounds + 1,
        devices=1,
        callbacks=[cb],
        default_root_dir=root,
        steps_per_execution=steps_per_execution,
        **extra,
    )
    trainer.fit(TinyModule(on_epoch), train_dataloaders=batches)
    return cb.framework_ms, cb.baseline_ms, trainer


def tiny_lightning(
    rounds: int, steps: int, root: str, on_epoch: bool = False
) -> tuple[list[float], list[float]] | None:
    try:
        import lightning.pytorch as pl
    except ImportError:
        try:
            import pytorch_lightning as pl
        except ImportError:
            return None
    import torch

    torch.set_num_threads(1)
    data = tiny_batches(steps)
    tbatches = [(torch.from_numpy(x), torch.from_numpy(y).long()) for x, y in data]

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(TINY_IN, TINY_HIDDEN), torch.nn.ReLU(), torch.nn.Linear(TINY_HIDDEN, TINY_OUT)
        )

    class RawTorch:
        def __init__(self) -> None:
            self.net = mlp()
            self.opt = torch.optim.Adam(self.net.parameters(), 1e-3)

        def run(self, batches) -> float:
            t0 = time.perf_counter()
            for x, y in batches:
                self.opt.zero_grad(set_to_none=True)
                loss = torch.nn.functional.cross_entropy(self.net(x), y)
                loss.backward()
                self.opt.step()
            return (time.perf_counter() - t0) / len(batches) * 1e3

    raw = RawTorch()
    raw.run(tbatches[:2])

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            self.log("train_loss", loss, on_epoch=on_epoch)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), 1e-3)

    class Cb(pl.Callback, EpochAlternate):
        def __init__(self) -> None:
            EpochAlternate.__init__(self, raw, tbatches, lambda state: None)

        def on_train_epoch_start(self, trainer, pl_module) -> None:
            self.start()

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            self.end(None)

    class Batches:  # a plain iterable of ready batches (Lightning reads a list as several loaders)
        def __iter__(self):
            return iter(tbatches)

        def __len__(self) -> int:
            return len(tbatches)

    cb = Cb()
    trainer = pl.Trainer(max_epochs=rounds + 1, accelerator="cpu", devices=1, callbacks=[cb], default_root_dir=root)
    trainer.fit(Lit(), train_dataloaders=Batches())
    return cb.framework_ms, cb.baseline_ms


def tiny(args) -> None:
    import contextlib
    import io
    import tempfile

    med = statistics.median
    rows = []
    with tempfile.TemporaryDirectory() as root, contextlib.redirect_stderr(io.StringIO()):
        fw, base, trainer = tiny_jaxlight(args.rounds, args.tiny_steps, root, args.prefetch, args.epoch_log)
        rows.append(("jaxlight.Trainer", "jax.jit + optax", fw, base))
        if trainer.compile_counts["train"] != 1:
            raise RuntimeError(f"the trainer compiled {trainer.compile_counts['train']} times; expected 1")
        n = args.steps_per_execution
        if n > 1:  # Trainer(steps_per_execution=N): N steps per compiled call, beside the N=1 row
            fw, base, trainer = tiny_jaxlight(args.rounds, args.tiny_steps, root, args.prefetch, args.epoch_log, n)
            rows.append((f"jaxlight N={n}", "jax.jit + optax", fw, base))
            want = 1 if args.tiny_steps % n == 0 else 2  # the epoch's partial last execution compiles once
            if trainer.compile_counts["train"] != want:
                raise RuntimeError(f"the trainer compiled {trainer.compile_counts['train']} times; expected {want}")
        if not args.no_lightning:
            lit = tiny_lightning(args.rounds, args.tiny_steps, root, args.epoch_log)
            if lit is not None:
                rows.append(("lightning.Trainer", "raw torch loop", *lit))
    print(
        f"jax {jax.__version__}, 1 {jax.devices()[0].platform} device; tiny MLP {TINY_IN}-{TINY_HIDDEN}-{TINY_OUT}, "
        f"batch {TINY_BATCH}, Adam; defaults on (progress bar, checkpoint per epoch, preemption, CSV logger); "
        f"train_loss logged {'on_step and on_epoch' if args.epoch_log else 'on_step'}; "
        f"{args.rounds} rounds x {args.tiny_steps} steps, alternating, medians"
    )
    print(f"{'framework':<20}{'ms/step':>9}  {'baseline':<18}{'ms/step':>9}  {'overhead us/step':>17}  {'ratio':>6}")
    for name, bname, fw, base in rows:
        f, b = med(fw), med(base)
        over = med([x - y for x, y in zip(fw, base)]) * 1e3
        print(f"{name:<20}{f:>9.4f}  {bname:<18}{b:>9.4f}  {over:>17.1f}  {f / b:>6.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="per-step host overhead on a tiny MLP (see the docstring)")
    p.add_argument("--tiny-steps", type=int, default=400, help="steps per round in --tiny mode")
    p.add_argument("--no-lightning", action="store_true", help="--tiny without the PyTorch Lightning rows")
    p.add_argument("--epoch-log", action="store_true", help="--tiny: log train_loss with on_epoch=True too")
    p.add_argument("--prefetch", type=int, default=None, help="Trainer(prefetch=N); 0 reads batches inline")
    p.add_argument(
        "--steps-per-execution",
        type=int,
        default=1,
        help="--tiny: also a row with Trainer(steps_per_execution=N) (N train steps per compiled call)",
    )
    p.add_argument("--scan", action="store_true", help="the reference model with its blocks as a scanned LayerStack")
    p.add_argument("--rounds", type=int, default=12, help="trainer/hand segment pairs")
    p.add_argument("--steps", type=int, default=6, help="steps per segment")
    p.add_argument("--warmup", type=int, default=3, help="untimed trainer steps (compile) before the first round")
    p.add_argument("--profile", type=int, default=0, help="also cProfile this many trainer steps")
    args = p.parse_args()
    if args.tiny:
        if args.rounds == 12:
            args.rounds = 9
        tiny(args)
        return

    total = args.warmup + args.rounds * args.steps
    batches = make_batches(total, BATCH_SIZE, REFERENCE.seq_len, seed=0)
    cfg = dataclasses.replace(REFERENCE, scan_layers=True) if args.scan else REFERENCE
    hand = HandLoop(seed=0, cfg=cfg)
    alt = Alternate(hand, batches, args.warmup, args.steps)
    extra = {} if args.prefetch is None else {"prefetch": args.prefetch}
    trainer = bench_trainer(max_steps=total, callbacks=[alt], **extra)
    print(
        f"jax {jax.__version__}, {jax.devices()[0].device_kind} x{trainer.num_devices}; reference workload "
        f"d={REFERENCE.d_model} L={REFERENCE.n_layers} H={REFERENCE.n_heads} T={REFERENCE.seq_len} "
        f"B={BATCH_SIZE}, blocks {'scanned (LayerStack)' if cfg.scan_layers else 'unrolled'}; "
        f"{args.rounds} rounds x {args.steps} steps, alternating"
    )
    trainer.fit(LMModule(cfg), train_dataloaders=batches)
    if trainer.compile_counts["train"] != 1:
        raise RuntimeError(f"the trainer compiled its step {trainer.compile_counts['train']} times; expected 1")

    t, h, tc, hc = alt.trainer_ms, alt.hand_ms, alt.trainer_cpu, alt.hand_cpu
    pair = [x / y for x, y in zip(t, h)]
    pair_cpu = [x / y for x, y in zip(tc, hc)]
    print(f"\n{'':>5} {'wall ms/step':^34} {'process CPU ms/step':^34}")
    print(f"{'round':>5} {'trainer':>11} {'hand':>11} {'ratio':>10} {'trainer':>11} {'hand':>11} {'ratio':>10}")
    for i in range(len(t)):
        print(f"{i:>5} {t[i]:>11.2f} {h[i]:>11.2f} {pair[i]:>10.4f} {tc[i]:>11.2f} {hc[i]:>11.2f} {pair_cpu[i]:>10.4f}")
    med = statistics.median
    print(
        f"{'median':>6}{med(t):>11.2f} {med(h):>11.2f} {med(pair):>10.4f} {med(tc):>11.2f} {med(hc):>11.2f} "
        f"{med(pair_cpu):>10.4f}"
    )
    print(f"\ntrainer / hand, ratio of median wall ms/step: {med(t) / med(h):.4f}  (target <= 1.01)")
    print(f"trainer / hand, ratio of median CPU ms/step:  {med(tc) / med(hc):.4f}")
    if args.profile:
        profile(args.profile, batches)


if __name__ == "__main__":
    main()
