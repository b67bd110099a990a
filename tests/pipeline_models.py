"""The LayerStack version of the strategy tests' transformer, shared by the pipeline tests and
benchmarks/pipeline.py: token embedding, a ``jaxlight.nn.LayerStack`` of pre-norm blocks
(tests/strategy_models.Block, annotated with the default logical names), final norm, head."""

from __future__ import annotations

import re

import numpy as np
import optax
from flax import nnx

import jaxlight as jl
from tests.strategy_models import Block, keep_first_grad, token_batches

__all__ = [
    "DIMS",
    "PipeLM",
    "StackLM",
    "collectives",
    "crosses_stage",
    "keep_first_grad",
    "token_batches",
    "unordered_collectives",
]

DIMS = dict(vocab=64, embed=64, heads=4, mlp=64, layers=8)
"""The tests' model: 8 blocks, so 4 stages x 2 repeats and 2 stages x 4 both divide; the stack holds
~96% of the parameters, so per-device memory is dominated by what the pipeline splits."""


class DropBlock(Block):
    """A Block with dropout on its output (an RNG stream stacked per layer)."""

    def __init__(self, embed: int, heads: int, mlp: int, rngs: nnx.Rngs, rate: float) -> None:
        super().__init__(embed, heads, mlp, rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(super().__call__(x) - x)


class StackLM(nnx.Module):
    """Embedding, ``layers`` Blocks in one LayerStack, final LayerNorm and head."""

    def __init__(
        self,
        rngs: nnx.Rngs,
        vocab: int = 64,
        embed: int = 64,
        heads: int = 4,
        mlp: int = 64,
        layers: int = 8,
        remat: str | None = None,
        dropout: float = 0.0,
    ) -> None:
        self.embed = nnx.Embed(
            vocab,
            embed,
            rngs=rngs,
            embedding_init=nnx.with_partitioning(nnx.initializers.normal(0.02), ("vocab", "embed")),
        )

        def make(r: nnx.Rngs) -> nnx.Module:
            return DropBlock(embed, heads, mlp, r, dropout) if dropout else Block(embed, heads, mlp, r)

        self.blocks = jl.nn.LayerStack(make, layers, rngs=rngs, remat=remat)
        scale_init = nnx.with_partitioning(nnx.initializers.ones_init(), ("norm",))
        self.ln = nnx.LayerNorm(embed, rngs=rngs, scale_init=scale_init, use_bias=False)
        self.head = nnx.Linear(
            embed,
            vocab,
            use_bias=False,
            rngs=rngs,
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "vocab")),
        )

    def __call__(self, tokens):
        x = jl.nn.constrain(self.embed(tokens), ("batch", "length", "embed"))
        x = self.blocks(x)
        return jl.nn.constrain(self.head(self.ln(x)), ("batch", "length", "vocab"))


class PipeLM(jl.LightningModule):
    """Next-token prediction with SGD(momentum) (and the step-1 gradients kept in the optimizer state)."""

    def __init__(self, lr: float = 0.05, momentum: float = 0.9, dropout: float = 0.0, **dims) -> None:
        super().__init__()
        self.save_hyperparameters()

    def configure_model(self) -> None:
        hp = dict(self.hparams)
        dims = {k: hp[k] for k in ("vocab", "embed", "heads", "mlp", "layers", "remat") if k in hp}
        self.net = StackLM(nnx.Rngs(0, dropout=1), dropout=hp.get("dropout", 0.0), **dims)

    def training_step(self, batch, batch_idx):
        tokens = batch["tokens"]
        logits = self.net(tokens[:, :-1])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        tokens = batch["tokens"]
        logits = self.net(tokens[:, :-1])
        self.log("val_loss", optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean())

    def configure_optimizers(self):
        return optax.chain(keep_first_grad(), optax.sgd(self.hparams.lr, momentum=self.hparams.momentum))


# ---------------------------------------------------------------------------- reading the HLO
_OP = re.compile(r"^\s*%?\S+ = (.+?) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(")
_EXPLICIT = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=(\(\[[\d,]+\](?:T\([\d,]+\))?\)|\[[\d,]*\]))?\s*\{([^}]*)\}"
)


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    a = np.arange(int(np.prod(dims))).reshape(dims)
    return (a.transpose(perm) if perm else a).reshape(-1)


def replica_groups(line: str) -> list[list[int]]:
    """The device groups of one collective HLO line (explicit, iota and named-mesh forms)."""
    if m := _EXPLICIT.search(line):
        return [[int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    if m := _IOTA.search(line):
        ids = _iota(
            [int(d) for d in m.group(3).split(",")], [int(p) for p in m.group(4).split(",")] if m.group(4) else None
        )
        return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
    if m := _MESH.search(line):
        axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        ids = np.arange(int(np.prod(sizes)))
        if m.group(2):
            d = m.group(2)
            if d.startswith("("):
                dm = re.match(r"\(\[([\d,]+)\](?:T\(([\d,]+)\))?\)", d)
                ids = _iota(
                    [int(x) for x in dm.group(1).split(",")],
                    [int(p) for p in dm.group(2).split(",")] if dm.group(2) else None,
                )
            else:
                ids = np.array([int(x) for x in d.strip("[]").split(",")])
        over = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(3))]
        rest = [i for i in range(len(names)) if i not in over]
        arr = ids.reshape(sizes).transpose(rest + over)
        return arr.reshape(-1, int(np.prod([sizes[i] for i in over]))).tolist()
    if "source_target_pairs" in line:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=")[1])]
    raise AssertionError(f"cannot read the replica groups of: {line[:300]}")


def collectives(hlo: str) -> list[tuple[str, str, list[list[int]]]]:
    """``(op, result shape, groups)`` of every collective in an HLO module's text."""
    out = []
    for line in hlo.splitlines():
        if m := _OP.match(line):
            out.append((m.group(2), m.group(1), replica_groups(line)))
    return out


def stage_of(mesh) -> dict[int, int]:
    """Logical device id (position in the mesh's device list) -> its coordinate on the stage axis."""
    pos = mesh.axis_names.index("stage")
    return {i: int(np.unravel_index(i, mesh.devices.shape)[pos]) for i in range(mesh.devices.size)}


def crosses_stage(groups: list[list[int]], mesh) -> bool:
    st = stage_of(mesh)
    return any(len({st[d] for d in g}) > 1 for g in groups)


_COLLECTIVE = re.compile(r"\s(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(")
_CALLS = re.compile(r"(?:body|condition|to_apply|calls|true_computation|false_computation)=%([\w.\-]+)")


def unordered_collectives(hlo: str) -> list[tuple[str, str, str]]:
    """``(computation, a, b)`` for each pair of instructions of one computation that both run collectives,
    at least one of them inside a loop, call or conditional, with no data path between them.

    XLA:CPU orders the collectives of one computation among themselves, but not those nested in a
    loop against the rest (jax 0.10.2): such a pair can run at once, and devices that enter them in
    different orders deadlock.
    """
    bodies: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        if line and not line.startswith((" ", "\t")):
            m = re.match(r"^(?:ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$", line)
            name = m.group(1) if m else None
            if name:
                bodies[name] = []
        elif name is not None and line.strip():
            bodies[name].append(line)
    holds: dict[str, bool] = {}

    def nested(comp: str) -> bool:
        if comp not in holds:
            holds[comp] = False  # (no recursion in HLO; guards the walk)
            lines = bodies.get(comp, [])
            holds[comp] = any(_COLLECTIVE.search(x) for x in lines) or any(
                nested(c) for x in lines for c in _CALLS.findall(x)
            )
        return holds[comp]

    out = []
    for comp, lines in bodies.items():
        before: dict[str, set[str]] = {}
        direct, loops = [], []
        for line in lines:
            m = re.match(r"\s*(?:ROOT\s+)?%(\S+) = .*?\b([a-z\-]+)\((.*?)\)(,|$)", line)
            if not m:
                continue
            ins, op, args = m.group(1), m.group(2), m.group(3)
            deps = set()
            for a in re.findall(r"%([\w.\-]+)", args):
                deps |= {a} | before.get(a, set())
            before[ins] = deps
            if _COLLECTIVE.search(line):
                direct.append(ins)
            elif op in ("while", "call", "conditional", "fusion") and any(nested(c) for c in _CALLS.findall(line)):
                loops.append(ins)
        for i, a in enumerate(loops):
            for b in loops[i + 1 :] + direct:
                if a not in before[b] and b not in before[a]:
                    out.append((comp, a, b))
    return out
