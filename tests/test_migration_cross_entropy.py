"""docs/migration.md's ``F.cross_entropy`` options table: every JAX/optax translation, evaluated as written in
the page (its definitions of ``ce``, ``keep`` and ``safe`` too), equals torch's ``F.cross_entropy`` as
written in the same row, on random data with ignored labels, weights and soft targets."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import torch.nn.functional as F

DOC = Path(__file__).resolve().parent.parent / "docs" / "migration.md"
N, C = 64, 5


def section() -> str:
    text = DOC.read_text()
    start = text.index("### `F.cross_entropy` options")
    return text[start : text.index("\n## ", start)]


def definitions() -> list[str]:
    """The ``name = expr`` code spans of the paragraph before the table, in order (the page's own words)."""
    intro = section().split("\n| torch |", 1)[0]
    return [c for c in re.findall(r"`([^`]+)`", intro) if re.fullmatch(r"\w+ = .+", c)]


def rows() -> list[tuple[str, str]]:
    """(torch code, JAX code): the first code span of each cell of the table's rows."""
    out = []
    for line in section().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`F.cross_entropy("):
            out.append((re.search(r"`([^`]+)`", cells[0]).group(1), re.search(r"`([^`]+)`", cells[1]).group(1)))
    return out


def data(ignore_index: int, seed: int):
    """Random logits, labels with some ignored (``ignore_index``: torch's default -100, or a class index,
    which torch allows), positive class weights and soft targets."""
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(N, C)) * 2).astype(np.float32)
    y = rng.integers(0, C, size=N)
    y[rng.random(N) < 0.25] = ignore_index
    w = rng.uniform(0.2, 3.0, size=C).astype(np.float32)
    p = rng.dirichlet(np.ones(C), size=N).astype(np.float32)
    return logits, y, w, p


def test_the_table_has_every_option():
    torch_side = " ".join(t for t, _ in rows())
    assert len(rows()) >= 12
    for option in ("ignore_index=", "label_smoothing=", "weight=", 'reduction="sum"', 'reduction="none"'):
        assert option in torch_side, option
    assert [d.split(" =")[0] for d in definitions()] == ["ce", "keep", "safe", "ignore_index"]


@pytest.mark.parametrize("ignore_index,seed", [(-100, 0), (2, 1), (-100, 2)])
@pytest.mark.parametrize("row", range(len(rows())))
def test_translation_equals_torch(row, ignore_index, seed):
    torch_code, jax_code = rows()[row]
    logits, y, w, p = data(ignore_index, seed)
    tns = {"F": F, "torch": torch, "ignore_index": ignore_index}
    tns.update(logits=torch.tensor(logits), y=torch.tensor(y), w=torch.tensor(w), p=torch.tensor(p))
    if "ignore_index=" not in torch_code and ignore_index != -100:
        # the row without the option: torch ignores its default -100, so the labels hold no other ignored one
        y = np.where(y == ignore_index, 0, y)
        tns["y"], ignore_index = torch.tensor(y), -100
    want = eval(torch_code, tns).numpy()

    jns = {"jax": jax, "jnp": jnp, "optax": optax, "ignore_index": ignore_index}
    jns.update(logits=jnp.asarray(logits), y=jnp.asarray(y), w=jnp.asarray(w), p=jnp.asarray(p))
    # the page's definitions ("with ignore_index = -100 unless you pass another": the test passes its own)
    for d in definitions():
        name, expr = d.split(" = ", 1)
        if name != "ignore_index":
            jns[name] = eval(expr, jns)
    got = np.asarray(eval(jax_code, jns))
    assert got.shape == want.shape, (torch_code, jax_code)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"{torch_code} vs {jax_code}")


def test_the_old_translation_is_nan_for_an_ignored_label():
    """The issue's report: the plain translation of the page's first table looks an ignored label up outside
    the logits (NaN), where torch ignores it; the options table's row gives torch's value."""
    logits, y, _, _ = data(-100, 0)
    plain = optax.softmax_cross_entropy_with_integer_labels(jnp.asarray(logits), jnp.asarray(y)).mean()
    assert np.isnan(float(plain))
    assert np.isfinite(F.cross_entropy(torch.tensor(logits), torch.tensor(y)).item())
