"""What the weights do not carry: a torch module's settings compared with its NNX twin's.

``load_torch_weights`` given a ``torch.nn.Module`` warns, once, about the
settings its twin must share for equal outputs (BatchNorm momentum, epsilons,
conv stride, dilation and padding, attention heads). Also here:
:func:`conv_transpose_padding`, the ``nnx.ConvTranspose`` padding that computes
what a torch ``nn.ConvTranspose*d`` computes.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from typing import Any

from flax import nnx


def torch_twin_name(source_key: str) -> str:
    """The torch module path (a ``named_modules()`` key) that owns the tensor named ``source_key``."""
    return source_key.rsplit(".", 1)[0] if "." in source_key else ""


def warn_setting_differences(targets: Sequence[Any], renamed: dict[str, str], torch_module: Any) -> None:
    """Compare what the weights do not carry (epsilons, momentum, conv geometry, heads) and warn once.

    ``targets``: ``load_torch_weights``' plan (each with ``.key``, ``.path``, ``.module``); ``renamed``: the
    model's torch-style keys to the source's keys."""
    named = dict(torch_module.named_modules())
    seen: set[int] = set()
    notes: list[str] = []
    for t in targets:
        if id(t.module) in seen or t.key not in renamed:
            continue
        tname = torch_twin_name(renamed[t.key])
        if isinstance(t.module, nnx.MultiHeadAttention) and tname.endswith(".out_proj"):
            continue  # the packed in_proj key names the attention module itself
        tmod = named.get(tname)
        if tmod is None:
            continue
        seen.add(id(t.module))
        npath = t.path.rsplit("/", 1)[0]
        if isinstance(t.module, nnx.MultiHeadAttention):
            npath = npath.rsplit("/", 1)[0]  # the attention module, not its query projection
        label = repr(tname) if npath.replace("/", ".") == tname else f"{tname!r} (NNX {npath!r})"
        notes += [f"{label}: {n}" for n in _differences(t.module, tmod)]
    if notes:
        warnings.warn(
            "the torch model and the NNX model differ in settings that weights do not carry, so their outputs "
            "will differ:\n  " + "\n  ".join(notes),
            UserWarning,
            stacklevel=3,
        )


def _differences(m: nnx.Module, tm: Any) -> list[str]:
    import torch.nn as tnn

    out = []

    def close(a: float, b: float) -> bool:
        return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-12)

    if isinstance(m, nnx.BatchNorm) and isinstance(tm, tnn.modules.batchnorm._BatchNorm):
        if not close(m.epsilon, tm.eps):
            out.append(f"BatchNorm eps: torch {tm.eps}, NNX epsilon {m.epsilon}")
        if tm.momentum is None:
            out.append("torch BatchNorm momentum=None (cumulative average) has no NNX equivalent")
        elif not close(m.momentum, 1 - tm.momentum):
            out.append(
                f"BatchNorm momentum: torch {tm.momentum} weighs the new batch, NNX momentum weighs the old "
                f"average: set momentum={1 - tm.momentum:g} (NNX has {m.momentum})"
            )
        if not tm.track_running_stats:
            out.append("torch BatchNorm has track_running_stats=False (always batch statistics)")
    elif isinstance(m, (nnx.LayerNorm, nnx.GroupNorm, nnx.InstanceNorm)) and hasattr(tm, "eps"):
        if not close(m.epsilon, tm.eps):
            out.append(f"{type(m).__name__} eps: torch {tm.eps}, NNX epsilon {m.epsilon} (flax's default is 1e-6)")
        if isinstance(m, nnx.GroupNorm) and getattr(tm, "num_groups", None) not in (None, m.num_groups):
            out.append(f"GroupNorm groups: torch {tm.num_groups}, NNX {m.num_groups}")
    elif isinstance(m, nnx.RMSNorm) and hasattr(tm, "eps"):
        if tm.eps is None:
            out.append(f"torch RMSNorm eps=None uses the dtype's machine epsilon; NNX epsilon {m.epsilon}")
        elif not close(m.epsilon, tm.eps):
            out.append(f"RMSNorm eps: torch {tm.eps}, NNX epsilon {m.epsilon}")
    elif isinstance(m, nnx.Conv) and isinstance(tm, tnn.modules.conv._ConvNd):
        out += _conv_differences(m, tm)
    elif isinstance(m, nnx.ConvTranspose) and isinstance(tm, tnn.modules.conv._ConvTransposeNd):
        out += _conv_transpose_differences(m, tm)
    elif isinstance(m, nnx.MultiHeadAttention) and isinstance(tm, tnn.MultiheadAttention):
        if tm.num_heads != m.num_heads:
            out.append(f"attention heads: torch {tm.num_heads}, NNX {m.num_heads} (the weights fit either)")
        if not tm.batch_first:
            out.append("torch MultiheadAttention has batch_first=False: it takes (length, batch, features)")
    return out


def _per_dim(v: Any, n: int) -> tuple[int, ...]:
    """A stride/dilation as flax or torch gives it (None, an int, or one per dimension) as ``n`` ints."""
    if v is None:
        return (1,) * n
    return tuple(v) if isinstance(v, (tuple, list)) else (int(v),) * n


def _conv_transpose_differences(m: nnx.ConvTranspose, tm: Any) -> list[str]:
    n = len(m.kernel_size)

    tup = functools.partial(_per_dim, n=n)

    out = []
    strides, dil = tup(m.strides), tup(m.kernel_dilation)
    if strides != tup(tm.stride):
        out.append(f"conv transpose stride: torch {tup(tm.stride)}, NNX {strides}")
    if dil != tup(tm.dilation):
        out.append(f"conv transpose dilation: torch {tup(tm.dilation)}, NNX {dil}")
    want = conv_transpose_padding(
        tuple(tm.kernel_size), tuple(tm.padding), tuple(tm.dilation), tuple(tm.output_padding)
    )
    fp = m.padding
    if isinstance(fp, str):
        up = fp.upper()
        if up not in ("SAME", "VALID"):
            out.append(f"NNX ConvTranspose padding {fp!r} has no torch equivalent; use padding={want}")
            return out
        nnx_pairs = tuple(_lax_transpose_pairs(d * (k - 1) + 1, s, up) for k, s, d in zip(m.kernel_size, strides, dil))
    else:
        nnx_pairs = _explicit_pairs(fp, n)
    if nnx_pairs != want:
        out.append(
            f"conv transpose padding: torch padding={tm.padding}, output_padding={tm.output_padding} is NNX "
            f"padding={want} (jaxlight.migrate.conv_transpose_padding), NNX {m.padding!r} pads {nnx_pairs}"
        )
    return out


def _explicit_pairs(padding: Any, n: int) -> tuple[tuple[int, int], ...]:
    """NNX's explicit padding (an int, or per-dimension ints or pairs) as ``n`` (low, high) pairs."""
    if isinstance(padding, int):
        return ((padding, padding),) * n
    return tuple((p, p) if isinstance(p, int) else tuple(p) for p in padding)


def _lax_transpose_pairs(k: int, s: int, padding: str) -> tuple[int, int]:
    """The explicit pads ``lax.conv_transpose`` uses for a string padding (dilated kernel size ``k``)."""
    if padding == "SAME":
        total = k + s - 2
        before = k - 1 if s > k - 1 else -(-total // 2)
    else:  # VALID
        total = k + s - 2 + max(k - s, 0)
        before = k - 1
    return (before, total - before)


def _conv_differences(m: nnx.Conv, tm: Any) -> list[str]:
    n = len(m.kernel_size)

    tup = functools.partial(_per_dim, n=n)

    out = []
    if tup(m.strides) != tup(tm.stride):
        out.append(f"conv stride: torch {tup(tm.stride)}, NNX {tup(m.strides)}")
    if tup(m.kernel_dilation) != tup(tm.dilation):
        out.append(f"conv dilation: torch {tup(tm.dilation)}, NNX {tup(m.kernel_dilation)}")
    if tm.padding_mode != "zeros":
        out.append(f"torch pads with padding_mode={tm.padding_mode!r}; check the NNX padding")
        return out
    dil = tup(m.kernel_dilation)
    kernel = tuple(m.kernel_size)

    def same_pairs() -> tuple[tuple[int, int], ...]:
        tot = [d * (k - 1) for d, k in zip(dil, kernel)]
        return tuple((t // 2, t - t // 2) for t in tot)

    tp = tm.padding
    if tp == "valid":
        torch_pairs = ((0, 0),) * n
    elif tp == "same":
        torch_pairs = same_pairs()
    else:
        torch_pairs = tuple((p, p) for p in tup(tp))
    fp = m.padding
    if isinstance(fp, str):
        if fp.upper() == "VALID":
            nnx_pairs = ((0, 0),) * n
        elif fp.upper() == "SAME" and tup(m.strides) == (1,) * n:
            nnx_pairs = same_pairs()
        else:
            return out  # stride-dependent or non-zero padding: not compared
    else:
        nnx_pairs = _explicit_pairs(fp, n)
    if nnx_pairs != torch_pairs:
        out.append(
            f"conv padding: torch {tm.padding!r} pads {torch_pairs}, NNX {m.padding!r} pads {nnx_pairs} "
            f"(flax's default is 'SAME', torch's is 0)"
        )
    return out


def conv_transpose_padding(
    kernel_size: int | Sequence[int],
    padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    output_padding: int | Sequence[int] = 0,
) -> tuple[tuple[int, int], ...]:
    """The ``padding`` an ``nnx.ConvTranspose`` needs to compute what torch's ``nn.ConvTranspose*d`` with these
    settings computes (``strides`` = torch's ``stride``, ``kernel_dilation`` = its ``dilation``; either
    ``transpose_kernel``: :func:`load_torch_weights` converts the kernel for the one the module has).

    ``lax.conv_transpose`` pads the stride-dilated input explicitly, so torch's ``padding=p`` (which *removes*
    ``p`` outputs at each side) is ``(d*(k-1) - p, d*(k-1) - p + output_padding)`` per spatial dimension
    (negative when ``p > d*(k-1)``, which lax accepts). flax's string paddings (its default ``'SAME'``)
    are other geometries: e.g. torch ``ConvTranspose2d(3, 8, 4, stride=2, padding=1)`` is
    ``nnx.ConvTranspose(3, 8, (4, 4), strides=2, padding=conv_transpose_padding((4, 4), 1))``, i.e.
    ``((2, 2), (2, 2))``."""
    sizes = [v for v in (kernel_size, padding, dilation, output_padding) if not isinstance(v, int)]
    n = len(sizes[0]) if sizes else 1

    def each(v: int | Sequence[int], name: str) -> tuple[int, ...]:
        out = (int(v),) * n if isinstance(v, int) else tuple(int(x) for x in v)
        if len(out) != n:
            raise ValueError(f"conv_transpose_padding: {name}={v!r} has {len(out)} entries, kernel has {n} dims")
        return out

    k, p, d, op = (
        each(v, name)
        for v, name in (
            (kernel_size, "kernel_size"),
            (padding, "padding"),
            (dilation, "dilation"),
            (output_padding, "output_padding"),
        )
    )
    return tuple((di * (ki - 1) - pi, di * (ki - 1) - pi + oi) for ki, pi, di, oi in zip(k, p, d, op))
