"""A Hugging Face GPT-2 into its NNX twin, fine-tuned under FSDP, and back to ``transformers``.

transformers is the oracle: the twin's logits equal its own after loading (fp32, 1e-5), the export of an
untouched twin is the original file bit for bit, 3 SGD steps under FSDP on 8 devices equal one device,
and ``from_pretrained`` of the fine-tuned export gives the twin's logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from examples.hf_gpt2_roundtrip import GPT2LMHeadModel, hf_key, hf_logits, tiny_hf_gpt2
from jaxlight.migrate import TorchWeightsError, export_torch_weights, load_torch_weights
from tests.helpers import quiet

transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

VOCAB, SEQ = 101, 17


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A saved tiny random GPT-2 (n_layer=2, n_head=2, n_embd=32, vocab 101, n_positions 64) and the model."""
    directory = str(tmp_path_factory.mktemp("gpt2"))
    return directory, tiny_hf_gpt2(directory)


def _ids(seed: int, rows: int = 4) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (rows, SEQ)).astype(np.int32)


def _twin(directory: str) -> GPT2LMHeadModel:
    with open(f"{directory}/config.json") as f:
        return GPT2LMHeadModel.from_config(json.load(f))


def test_loaded_twin_logits_equal_transformers(hf_dir):
    directory, hf = hf_dir
    twin = _twin(directory)
    ids = _ids(0)
    before = np.asarray(twin(ids))
    assert load_torch_weights(twin, directory) == ([], [])  # the file: no lm_head (tied), no buffers
    got, expected = np.asarray(twin(ids)), hf_logits(hf, ids)
    assert np.abs(before - expected).max() > 0.1  # the twin's own random init is far off
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    print(f"loaded twin vs transformers: max |logits difference| {np.abs(got - expected).max():.2e}")

    # From the torch module: its state_dict also has the tied lm_head.weight, which the twin reads from wte.
    from_module = _twin(directory)
    load_torch_weights(from_module, hf, mapping={"lm_head": None})
    np.testing.assert_array_equal(np.asarray(from_module(ids)), got)


def test_old_checkpoint_keys_and_mask_buffers(hf_dir):
    # The Hub's original gpt2 files: GPT2Model keys (no "transformer."), plus each layer's causal-mask
    # buffers attn.bias / attn.masked_bias, which are not weights: strict loading refuses them unmapped
    directory, hf = hf_dir
    original = safetensors_numpy.load_file(f"{directory}/model.safetensors")
    old = {k.removeprefix("transformer."): v for k, v in original.items()}
    for i in range(2):
        old[f"h.{i}.attn.bias"] = np.tril(np.ones((64, 64), np.float32))[None, None]
        old[f"h.{i}.attn.masked_bias"] = np.float32(-1e4)
    with pytest.raises(TorchWeightsError) as e:
        load_torch_weights(_twin(directory), old)
    assert len(e.value.missing) == len(original) and "h.0.attn.bias" in e.value.unexpected
    twin = _twin(directory)
    load_torch_weights(twin, old, mapping=hf_key)
    ids = _ids(3)
    np.testing.assert_allclose(np.asarray(twin(ids)), hf_logits(hf, ids), atol=1e-5, rtol=0)


def test_plain_linear_twin_is_refused(hf_dir):
    # Conv1D's weight is (in, out): an nnx.Linear twin would read it transposed, and the rectangular ones
    # do not fit (the square attn.c_proj would, silently: hence the type declares the layout)
    directory, _ = hf_dir
    twin = _twin(directory)
    block = twin.transformer.h[0]
    block.attn.c_attn = nnx.Linear(32, 96, rngs=nnx.Rngs(0))
    with pytest.raises(TorchWeightsError) as e:
        load_torch_weights(twin, directory)
    assert e.value.mismatched == ["transformer.h.0.attn.c_attn.weight"]
    assert "source (32, 96), expected (96, 32)" in str(e.value)


def test_export_untouched_is_bit_exact_and_loads_in_transformers(hf_dir, tmp_path):
    directory, hf = hf_dir
    twin = _twin(directory)
    load_torch_weights(twin, directory)
    out = tmp_path / "export"
    state = export_torch_weights(twin, out, config=directory)
    original = safetensors_numpy.load_file(f"{directory}/model.safetensors")
    written = safetensors_numpy.load_file(str(out / "model.safetensors"))
    assert sorted(written) == sorted(original) == sorted(state)  # transformer.wte.weight once, no lm_head
    for k in original:
        assert written[k].dtype == original[k].dtype and written[k].shape == original[k].shape, k
        assert np.array_equal(written[k], original[k]), k
    assert (out / "config.json").read_bytes() == Path(directory, "config.json").read_bytes()

    reloaded, info = transformers.GPT2LMHeadModel.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert reloaded.lm_head.weight.data_ptr() == reloaded.transformer.wte.weight.data_ptr()  # re-tied
    ids = _ids(1)
    np.testing.assert_array_equal(hf_logits(reloaded.eval(), ids), hf_logits(hf, ids))


class FineTune(jl.LightningModule):
    """Next-token cross entropy on the twin, loaded from the Hugging Face directory where Lightning loads."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.directory = directory

    def configure_model(self) -> None:
        self.net = _twin(self.directory)

    def on_fit_start(self) -> None:  # the trainer's parameters, already on their FSDP shards
        load_torch_weights(self, self.directory, mapping=lambda k: f"net.{k}")

    def training_step(self, batch, batch_idx):
        logits = self.net(batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    def configure_optimizers(self):
        return optax.sgd(0.5)


def _fine_tune(directory: str, **trainer_kw) -> tuple[jl.Trainer, FineTune]:
    trainer = jl.Trainer(max_steps=3, **quiet(), **trainer_kw)
    module = FineTune(directory)
    trainer.fit(module, [_ids(10 + i, rows=8) for i in range(3)])
    return trainer, module


def _params(module: FineTune) -> dict[str, np.ndarray]:
    return export_torch_weights(module, mapping={"net": ""})


def test_fsdp_fine_tune_equals_one_device_and_exports_to_transformers(hf_dir, tmp_path):
    directory, hf = hf_dir
    original = safetensors_numpy.load_file(f"{directory}/model.safetensors")
    _, one = _fine_tune(directory, devices=1)
    trainer, fsdp = _fine_tune(directory, devices=8, strategy=jl.strategies.FSDP(min_shard=256))
    kernel = fsdp.net.transformer.h[0].mlp.c_fc.kernel[...]
    assert not kernel.sharding.is_fully_replicated and len(kernel.addressable_shards) == 8  # really sharded

    a, b = _params(one), _params(fsdp)
    assert sorted(a) == sorted(b) == sorted(original)
    moved = max(float(np.abs(a[k] - original[k]).max()) for k in a)
    assert moved > 1e-2, moved  # the steps did change the weights
    diff = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    assert diff < 1e-5, diff
    print(f"fsdp(8) vs one device after 3 SGD steps: max |weight difference| {diff:.2e} (moved {moved:.2e})")

    out = tmp_path / "fine_tuned"
    export_torch_weights(fsdp, out, mapping={"net": ""}, config=directory)
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(str(out)).eval()
    ids = _ids(2)
    got, expected = hf_logits(reloaded, ids), np.asarray(fsdp.net(ids))
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    assert np.abs(got - hf_logits(hf, ids)).max() > 1e-3  # the export is the fine-tuned model, not the original
    print(f"fine-tuned export in transformers vs the twin: max |logits difference| {np.abs(got - expected).max():.2e}")
