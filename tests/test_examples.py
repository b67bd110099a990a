"""examples/gpt.py: its data is deterministic, it learns, and its annotated model
gives the same run under FSDP+TP on 8 devices as on one device. examples/hf_gpt2_roundtrip.py: a
transformers GPT-2 loaded, fine-tuned under FSDP and written back, transformers' logits matched."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

import jaxlight as jl
from examples.gpt import WindowLoader, parse_args, train
from examples.models import stdlib_bytes


def _args(*extra: str):
    return parse_args(
        [
            "--d-model",
            "32",
            "--layers",
            "2",
            "--heads",
            "2",
            "--seq-len",
            "16",
            "--batch-size",
            "16",
            "--batches-per-epoch",
            "10",
            "--val-batches",
            "2",
            "--data-bytes",
            "200000",
            "--lr",
            "1e-2",
            "--warmup-steps",
            "2",
            "--log-every-n-steps",
            "5",
            "--out",
            "logs",
            *extra,
        ]
    )


def test_window_loader_is_deterministic_and_shifted():
    data = stdlib_bytes(50_000)
    a = WindowLoader(data, 4, 16, 3, seed=7)
    b = WindowLoader(data, 4, 16, 3, seed=7)
    first_a, first_b = list(a), list(b)
    for (xa, ya), (xb, yb) in zip(first_a, first_b):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)
        np.testing.assert_array_equal(xa[:, 1:], ya[:, :-1])  # targets are the next bytes
    second = list(a)  # a new epoch draws new windows
    assert not np.array_equal(first_a[0][0], second[0][0])
    fixed = WindowLoader(data, 4, 16, 3, seed=7, fixed=True)
    np.testing.assert_array_equal(list(fixed)[0][0], list(fixed)[0][0])
    assert len(a) == 3 and first_a[0][0].shape == (4, 16) and first_a[0][0].dtype == np.int32


def test_gpt_example_learns_and_fsdp_tp_matches_one_device():
    steps = 20
    args1 = _args("--devices", "1", "--max-steps", str(steps))
    t1, m1, losses1 = train(args1)
    assert len(losses1) == steps and t1.global_step == steps
    # learning: well below the uniform guess ln(256) = 5.55 within 20 steps
    assert losses1[-5:].mean() < losses1[0] - 1.0, losses1

    # the same run placed on 8 devices: 4-way FSDP x 2-way tensor parallel, small min_shard so
    # the annotated matrices really are split
    args8 = _args("--devices", "8", "--max-steps", str(steps))
    args8.strategy = jl.strategies.FSDP(min_shard=256) + jl.strategies.TensorParallel(2)
    t8, m8, losses8 = train(args8)
    assert dict(t8.mesh.shape)["fsdp"] == 4 and dict(t8.mesh.shape)["tensor"] == 2
    w1 = m8.net.blocks.layers.mlp.w1[...]  # the blocks' stacked weights: ("layers", "embed", "mlp")
    assert tuple(w1.sharding.spec) == (None, "fsdp", "tensor"), w1.sharding.spec
    layers = w1.shape[0]
    assert len(w1.addressable_shards) == 8 and w1.addressable_shards[0].data.shape == (layers, 32 // 4, 128 // 2)

    np.testing.assert_allclose(losses8, losses1, rtol=0, atol=2e-4)
    p1 = jax.tree.leaves(jax.device_get(jax.tree.map(lambda v: v, _params(m1))))
    p8 = jax.tree.leaves(jax.device_get(jax.tree.map(lambda v: v, _params(m8))))
    for a, b in zip(p1, p8):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=2e-4)
    assert float(t8.callback_metrics["val_loss"]) == pytest.approx(float(t1.callback_metrics["val_loss"]), abs=2e-4)


def _params(module):
    from flax import nnx

    return nnx.state(module.net, nnx.Param)


def test_readme_module_example_runs_as_written(capsys):
    """README.md's LightningModule example, executed verbatim: it trains and validates."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    code = re.findall(r"```python\n(.*?)```", readme, flags=re.S)[0]
    ns: dict = {"__name__": "readme_example"}
    exec(compile(code, "README.md[block 0]", "exec"), ns)
    trainer = ns["trainer"]
    assert trainer.global_step == 2 * 50 and trainer.current_epoch == 2
    assert ns["logits"].shape == (64, 10)
    out = capsys.readouterr().out
    assert "val_acc" in out
    # the reported accuracy is the trained net's accuracy on the validation batches, recomputed here
    net, val = trainer.lightning_module.net, ns["batches"][:5]
    import numpy as np

    acc = np.mean([np.mean(np.asarray(net(x)).argmax(-1) == y) for x, y in val])
    assert float(trainer.callback_metrics["val_acc"]) == pytest.approx(acc, abs=1e-6)
    # labels are random: the point is that the logged value is exactly what the weights do


def test_hf_gpt2_roundtrip_example(tmp_path, capsys):
    """examples/hf_gpt2_roundtrip.py: no network, FSDP on 8 devices, transformers as the oracle."""
    pytest.importorskip("transformers")
    from examples.hf_gpt2_roundtrip import main
    from examples.hf_gpt2_roundtrip import parse_args as hf_args

    result = main(hf_args(["--out", str(tmp_path), "--steps", "3"]))
    assert result["load_diff"] < 1e-5 and result["export_diff"] < 1e-5, result
    assert len(result["losses"]) == 3 and result["losses"][-1] < result["losses"][0] - 0.1, result["losses"]
    assert sorted(os.listdir(result["out"])) == ["config.json", "model.safetensors"]
    assert "(fsdp, 8 devices)" in capsys.readouterr().out
