"""Manual optimization's compiled step against the same alternating updates written by hand.

Workload: ``examples/gan.py``'s GAN (generator and discriminator MLPs,
``--hidden`` units, Adam for each), a global batch of ``--batch`` 2-D points,
one CPU device. Each step is a discriminator update followed by a generator
update against the updated discriminator.

Method. ``Trainer.fit`` runs one step, which compiles the train step; the
benchmark then calls that compiled program directly (state donated, as the
loop does) and, alternating with it, a hand-written ``jax.jit`` step that
does the same updates with ``jax.value_and_grad`` and optax on the same
parameter dicts and the same RNG stream (also donated; the noise stream must
advance between the two updates, or XLA merges the two generator passes). Each segment runs ``--steps`` steps from a
drained device to a drained device; segments alternate T H T H ... for
``--rounds`` rounds, and the table reports the median ms/step of each side,
their ratio, and the compiled programs' temporary memory
(``memory_analysis().temp_size_in_bytes``). Only the compiled programs are
compared: the trainer loop's per-step host overhead is measured by
``benchmarks/overhead.py``.

    python benchmarks/manual_step.py                 # 15 rounds x 50 steps
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxlight as jl
    from examples.gan import RingLoader, build
    from examples.gan import parse_args as gan_args

    gargs = gan_args(["--hidden", str(args.hidden), "--devices", "1"])
    model = build(gargs)(noise_dim=gargs.noise_dim, hidden=args.hidden, lr=gargs.lr, seed=0)
    loader = RingLoader(args.batch, 1, seed=0)
    trainer = jl.Trainer(
        max_steps=1,
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, loader)
    compiled = trainer.compiled["train"]
    state = trainer.train_state
    batch = jax.device_put(next(iter(RingLoader(args.batch, 1, seed=1))), state.params["generator/l1/kernel"].sharding)
    flush = np.bool_(False)

    # the hand-written step: same models, same losses, same optax transformations
    from flax import nnx

    parts = trainer.engine.parts
    from jaxlight.state import merge_models

    tx = optax.adam(gargs.lr, b1=0.5)
    gen_keys = [k for k in state.params if k.startswith("generator/")]
    dis_keys = [k for k in state.params if k.startswith("discriminator/")]

    def bce(logits, target):
        return optax.sigmoid_binary_cross_entropy(logits, jnp.full_like(logits, target)).mean()

    def hand_step(params, rest, sg, sd, real):
        n = real.shape[0]

        def d_loss(pd, rest):
            m = merge_models(parts, {**params, **pd}, rest)
            fake = jax.lax.stop_gradient(m["generator"].sample(n))
            loss = bce(m["discriminator"](real), 1.0) + bce(m["discriminator"](fake), 0.0)
            return loss, parts.rest.to_flat(nnx.state(m, nnx.Not(nnx.Param)))

        pd = {k: params[k] for k in dis_keys}
        (dl, rest), g = jax.value_and_grad(d_loss, has_aux=True)(pd, rest)  # the noise stream advances
        u, sd = tx.update(g, sd, pd)
        params = {**params, **optax.apply_updates(pd, u)}

        def g_loss(pg):
            m = merge_models(parts, {**params, **pg}, rest)
            return bce(m["discriminator"](m["generator"].sample(n)), 1.0), nnx.state(m, nnx.Not(nnx.Param))

        pg = {k: params[k] for k in gen_keys}
        (gl, rest), g = jax.value_and_grad(g_loss, has_aux=True)(pg)
        u, sg = tx.update(g, sg, pg)
        params = {**params, **optax.apply_updates(pg, u)}
        return params, parts.rest.to_flat(rest), sg, sd, gl

    hand = jax.jit(hand_step, donate_argnums=(0, 1, 2, 3))
    hp, hr = jax.tree.map(jnp.copy, (state.params, state.model_state))
    hs = (tx.init({k: hp[k] for k in gen_keys}), tx.init({k: hp[k] for k in dis_keys}))
    hand_c = hand.lower(hp, hr, *hs, batch).compile()
    real = batch

    def run_trainer(state):
        for i in range(args.steps):
            state, out, _ = compiled(state, real, np.int32(i), flush)
        jax.block_until_ready(state)
        return state

    def run_hand(hp, hr, hs):
        sg, sd = hs
        for _ in range(args.steps):
            hp, hr, sg, sd, loss = hand_c(hp, hr, sg, sd, real)
        jax.block_until_ready(hp)
        return hp, hr, (sg, sd)

    state = run_trainer(state)  # warm
    hp, hr, hs = run_hand(hp, hr, hs)
    t_ms, h_ms = [], []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        state = run_trainer(state)
        t_ms.append((time.perf_counter() - t0) * 1e3 / args.steps)
        t0 = time.perf_counter()
        hp, hr, hs = run_hand(hp, hr, hs)
        h_ms.append((time.perf_counter() - t0) * 1e3 / args.steps)
    tm, hm = statistics.median(t_ms), statistics.median(h_ms)
    tb = compiled.memory_analysis().temp_size_in_bytes
    hb = hand_c.memory_analysis().temp_size_in_bytes
    td, hd = (c.as_text().count(" dot(") for c in (compiled, hand_c))
    tf, hf = (c.as_text().count(" fusion(") for c in (compiled, hand_c))
    per_round = statistics.median(t / h for t, h in zip(t_ms, h_ms))
    print(f"GAN step, hidden={args.hidden}, batch={args.batch}, 1 CPU device, {args.rounds} rounds x {args.steps}")
    print(f"| {'':22} | {'ms/step (median)':>16} | {'temp bytes':>10} | {'dots':>4} | {'fusions':>7} |")
    print(f"| {'jaxlight manual step':22} | {tm:16.3f} | {tb:10d} | {td:4d} | {tf:7d} |")
    print(f"| {'hand-written jit step':22} | {hm:16.3f} | {hb:10d} | {hd:4d} | {hf:7d} |")
    print(f"| {'ratio (of medians)':22} | {tm / hm:16.3f} | {tb / max(hb, 1):10.3f} |      |         |")
    print(f"| {'median per-round ratio':22} | {per_round:16.3f} |            |      |         |")


if __name__ == "__main__":
    main()
