"""jaxlight.migrate.load_torch_weights: torch models and their NNX twins agree after loading (every source
kind, one device and FSDP on 8), strict errors list every problem, files are never unpickled, tensors are
read one at a time and placed on each variable's own sharding."""

import pickle
import warnings
import weakref
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import torch.nn as tnn
from flax import nnx
from safetensors.torch import save_file

import jaxlight as jl
from jaxlight.migrate import IncompatibleKeys, TorchWeightsError, load_torch_weights, torch_names
from tests.core_models import quiet

V, E, C, H, HID, OUT = 20, 16, 16, 2, 32, 8
TOL = 1e-5


class TorchText(tnn.Module):
    """Embedding, Conv1d, BatchNorm1d, MultiheadAttention (packed in_proj), LayerNorm, Sequential of Linears."""

    def __init__(self):
        super().__init__()
        self.emb = tnn.Embedding(V, E)
        self.conv = tnn.Conv1d(E, C, 3, padding=1)
        self.bn = tnn.BatchNorm1d(C)
        self.attn = tnn.MultiheadAttention(C, H, batch_first=True)
        self.ln = tnn.LayerNorm(C)
        self.head = tnn.Sequential(tnn.Linear(C, HID), tnn.ReLU(), tnn.Linear(HID, OUT))

    def forward(self, tok):
        h = self.emb(tok)
        h = self.bn(self.conv(h.transpose(1, 2))).transpose(1, 2)  # torch convolves NCL
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(self.ln(h).mean(1))


class NNXText(nnx.Module):
    """The twin: torch's epsilons, BatchNorm momentum (1 - 0.1) and conv padding; NLC layout."""

    def __init__(self, rngs: nnx.Rngs):
        self.emb = nnx.Embed(V, E, rngs=rngs)
        self.conv = nnx.Conv(E, C, (3,), padding=1, rngs=rngs)
        self.bn = nnx.BatchNorm(C, momentum=0.9, epsilon=1e-5, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(H, C, decode=False, rngs=rngs)
        self.ln = nnx.LayerNorm(C, epsilon=1e-5, rngs=rngs)
        self.head = nnx.Sequential(nnx.Linear(C, HID, rngs=rngs), nnx.relu, nnx.Linear(HID, OUT, rngs=rngs))

    def __call__(self, tok):
        h = self.bn(self.conv(self.emb(tok)))
        h = h + self.attn(h)
        return self.head(self.ln(h).mean(1))


class TorchImage(tnn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = tnn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.bn = tnn.BatchNorm2d(8)
        self.c2 = tnn.Conv2d(8, 8, 3, padding=1, groups=2, bias=False)
        self.fc = tnn.Linear(8, OUT)

    def forward(self, x):  # NCHW
        h = torch.relu(self.bn(self.c1(x)))
        return self.fc(self.c2(h).mean((2, 3)))


class NNXImage(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.c1 = nnx.Conv(3, 8, (3, 3), strides=2, padding=1, rngs=rngs)
        self.bn = nnx.BatchNorm(8, momentum=0.9, epsilon=1e-5, rngs=rngs)
        self.c2 = nnx.Conv(8, 8, (3, 3), padding=1, feature_group_count=2, use_bias=False, rngs=rngs)
        self.fc = nnx.Linear(8, OUT, rngs=rngs)

    def __call__(self, x):  # NHWC
        h = nnx.relu(self.bn(self.c1(x)))
        return self.fc(self.c2(h).mean((1, 2)))


def randomized(model: tnn.Module, seed: int = 0) -> tnn.Module:
    """Non-trivial values everywhere (default norm weights are ones/zeros, which would hide a swap)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("running_var"):
                t.uniform_(0.5, 2.0)
            elif t.is_floating_point():
                t.normal_(0, 0.5)
    return model


TOKENS = np.random.default_rng(0).integers(0, V, (8, 6))
IMAGES = np.random.default_rng(1).normal(size=(8, 3, 8, 8)).astype(np.float32)


def torch_out(model: tnn.Module, x: np.ndarray, train: bool) -> np.ndarray:
    model.train(train)
    with torch.no_grad():
        return model(torch.from_numpy(x)).numpy()


def assert_twins(tm: tnn.Module, m: nnx.Module, x: np.ndarray, nhwc: bool = False) -> None:
    n = 8 * 4 * 4 if nhwc else TOKENS.size  # values per channel BatchNorm sees: N*H*W or N*L
    """Eval outputs, train outputs and the running statistics after one train-mode batch agree."""
    xn = jnp.asarray(np.moveaxis(x, 1, -1) if nhwc else x)
    m.eval()
    np.testing.assert_allclose(np.asarray(m(xn)), torch_out(tm, x, train=False), atol=TOL, rtol=TOL)
    mean0, var0 = tm.bn.running_mean.clone().numpy(), tm.bn.running_var.clone().numpy()
    np.testing.assert_allclose(np.asarray(m.bn.mean[...]), mean0, atol=TOL)
    m.train()
    np.testing.assert_allclose(np.asarray(m(xn)), torch_out(tm, x, train=True), atol=TOL, rtol=TOL)
    np.testing.assert_allclose(np.asarray(m.bn.mean[...]), tm.bn.running_mean.numpy(), atol=TOL)
    # torch folds the *unbiased* batch variance into running_var, flax the biased one (both normalise with
    # the biased one): the two updates differ by exactly n / (n - 1)
    np.testing.assert_allclose(
        (np.asarray(m.bn.var[...]) - 0.9 * var0) * n / (n - 1), tm.bn.running_var.numpy() - 0.9 * var0, atol=TOL
    )
    tm.eval()


@pytest.fixture
def text_pair(tmp_path):
    return randomized(TorchText()), NNXText(nnx.Rngs(7))


def as_source(kind: str, tm: tnn.Module, tmp_path) -> object:
    sd = tm.state_dict()
    if kind == "state_dict":
        return sd
    if kind == "module":
        return tm
    if kind in ("pt", "bin"):
        path = tmp_path / f"w.{kind}"
        torch.save(sd, path)
        return str(path)
    if kind == "lightning_ckpt":  # {"state_dict": ..., "epoch": ...}: the usual nesting
        path = tmp_path / "w.ckpt"
        torch.save({"state_dict": sd, "epoch": 3}, path)
        return path
    if kind == "safetensors":
        path = tmp_path / "w.safetensors"
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
        return path
    if kind == "sharded":  # a Hugging Face style index over two files, given as its directory
        keys = list(sd)
        parts = {"model-1.safetensors": keys[: len(keys) // 2], "model-2.safetensors": keys[len(keys) // 2 :]}
        for name, ks in parts.items():
            save_file({k: sd[k].contiguous() for k in ks}, str(tmp_path / name))
        import json

        weight_map = {k: name for name, ks in parts.items() for k in ks}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        return tmp_path
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["state_dict", "module", "pt", "bin", "lightning_ckpt", "safetensors", "sharded"])
def test_twin_agrees_after_loading(kind, text_pair, tmp_path):
    tm, m = text_pair
    before = np.asarray(m(jnp.asarray(TOKENS)))
    assert np.abs(before - torch_out(tm, TOKENS, train=False)).max() > 1e-2  # different before loading
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        result = load_torch_weights(m, as_source(kind, tm, tmp_path))
    assert not [w for w in rec if "differ in settings" in str(w.message)]  # the twin matches torch's settings
    assert result == IncompatibleKeys([], [])
    assert_twins(tm, m, TOKENS)


def test_conv2d_twin_nchw_to_nhwc():
    tm, m = randomized(TorchImage()), NNXImage(nnx.Rngs(0))
    load_torch_weights(m, tm.state_dict())
    assert m.c2.kernel[...].shape == (3, 3, 4, 8)  # grouped: (kH, kW, in/groups, out)
    assert_twins(tm, m, IMAGES, nhwc=True)


def test_cross_attention_with_separate_projections():
    """kdim != embed_dim: torch keeps q/k/v_proj_weight apart (and in_proj_bias packed)."""
    torch.manual_seed(0)
    tm = randomized(tnn.MultiheadAttention(C, H, kdim=12, vdim=12, batch_first=True))
    m = nnx.MultiHeadAttention(H, C, in_kv_features=12, decode=False, rngs=nnx.Rngs(0))
    assert {"q_proj_weight", "k_proj_weight", "in_proj_bias"} <= set(tm.state_dict())
    load_torch_weights(m, tm)
    rng = np.random.default_rng(0)
    q, kv = rng.normal(size=(2, 5, C)).astype(np.float32), rng.normal(size=(2, 7, 12)).astype(np.float32)
    with torch.no_grad():
        want = tm(torch.from_numpy(q), torch.from_numpy(kv), torch.from_numpy(kv), need_weights=False)[0].numpy()
    np.testing.assert_allclose(np.asarray(m(jnp.asarray(q), jnp.asarray(kv))), want, atol=TOL, rtol=TOL)


def test_names_follow_state_py_paths():
    """NNX paths are the trainer's flat state keys; nn.Sequential numbering skips nnx's 'layers'."""
    from jaxlight.state import StateCodec

    m = NNXText(nnx.Rngs(0))
    names = torch_names(m)
    assert set(names) == set(TorchText().state_dict()) - {"bn.num_batches_tracked"}
    assert names["head.2.weight"] == "head/layers/2/kernel"
    assert names["attn.in_proj_weight"] == "attn/query/kernel, attn/key/kernel, attn/value/kernel"
    paths = {p for v in names.values() for p in v.split(", ")}
    assert paths == set(StateCodec(nnx.state(m, nnx.Any(nnx.Param, nnx.BatchStat))).keys)


class LitText(jl.LightningModule):
    def configure_model(self):
        self.net = NNXText(nnx.Rngs(0))

    def forward(self, tok):
        return self.net(tok)

    def training_step(self, batch, batch_idx):
        tok, labels = batch
        return optax.softmax_cross_entropy_with_integer_labels(self(tok), labels).mean()

    def configure_optimizers(self):
        return optax.sgd(0.1)


def test_fsdp_sharded_module_loads_in_place(tmp_path):
    """A module a trainer built FSDP-sharded on 8 devices: each leaf lands on its own sharding, and the
    trainer's compiled SPMD predict then agrees with torch."""
    tm = randomized(TorchText())
    path = as_source("safetensors", tm, tmp_path)
    model = LitText()
    trainer = jl.Trainer(strategy=jl.strategies.FSDP(min_shard=16), devices=8, **quiet())
    before = np.asarray(trainer.predict(model, [TOKENS])[0])
    shardings = {p: v.get_value().sharding for p, v in nnx.iter_graph(model.net) if isinstance(v, nnx.Param)}
    split = [p for p, s in shardings.items() if not s.is_fully_replicated]
    assert len(split) >= 10, f"the test needs sharded leaves, got {split}"
    # the LightningModule addresses its NNX attributes by name, as a Lightning checkpoint's state_dict does
    load_torch_weights(model, path, mapping=lambda k: f"net.{k}")
    for p, v in nnx.iter_graph(model.net):
        if isinstance(v, nnx.Param):
            arr = v.get_value()
            assert arr.sharding == shardings[p], p
            if not arr.sharding.is_fully_replicated:  # each device holds only its slice
                assert arr.addressable_shards[0].data.size < arr.size
    expected = torch_out(tm, TOKENS, train=False)
    after = np.asarray(trainer.predict(model, [TOKENS])[0])
    assert np.abs(before - expected).max() > 1e-2
    np.testing.assert_allclose(after, expected, atol=TOL, rtol=TOL)
    model.net.eval()
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(TOKENS))), expected, atol=TOL, rtol=TOL)

    # fit continues from the loaded weights: one FSDP SGD step equals torch's SGD step on the same batch
    labels = np.arange(len(TOKENS)) % OUT
    model.net.train()  # as torch: a submodule left in eval mode would train in eval mode (issue 23)
    jl.Trainer(strategy=jl.strategies.FSDP(min_shard=16), devices=8, max_steps=1, **quiet()).fit(
        model, [(TOKENS, labels)]
    )
    tm.train()
    opt = torch.optim.SGD(tm.parameters(), lr=0.1)
    tnn.functional.cross_entropy(tm(torch.from_numpy(TOKENS)), torch.from_numpy(labels)).backward()
    before_step = {k: v.clone() for k, v in tm.state_dict().items()}
    opt.step()
    assert max((v - before_step[k]).abs().max().item() for k, v in tm.named_parameters()) > 1e-3  # a real step
    stepped = NNXText(nnx.Rngs(1))
    load_torch_weights(stepped, tm)  # the loader doubles as the converter for the comparison
    got, want = nnx.state(model.net, nnx.Param), nnx.state(stepped, nnx.Param)
    moved = max(
        np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))
    )
    assert moved < TOL
    np.testing.assert_allclose(np.asarray(model.net.bn.mean[...]), tm.bn.running_mean.numpy(), atol=TOL)


def test_strict_lists_every_problem_and_loads_nothing(text_pair):
    tm, m = text_pair
    sd = dict(tm.state_dict())
    sd["decoder.weight"] = sd.pop("head.2.weight")  # unexpected + missing
    del sd["ln.bias"]  # missing
    sd["extra.scale"] = torch.ones(3)  # unexpected
    sd["conv.weight"] = torch.zeros(C, E, 5)  # mis-shaped (kernel 5 instead of 3)
    before = jax.tree.map(np.asarray, nnx.state(m))
    with pytest.raises(TorchWeightsError) as e:
        load_torch_weights(m, sd)
    msg = str(e.value)
    assert "2 missing, 2 unexpected, 1 mis-shaped" in msg and "nothing was loaded" in msg
    assert "head.2.weight  -> head/layers/2/kernel (32, 8)" in msg and "ln.bias  -> ln/bias (16,)" in msg
    assert "conv.weight: source (16, 16, 5), expected (16, 16, 3) for conv/kernel" in msg
    assert e.value.missing == ["head.2.weight", "ln.bias"]
    assert e.value.unexpected == ["decoder.weight", "extra.scale"]
    assert e.value.mismatched == ["conv.weight"]
    after = jax.tree.map(np.asarray, nnx.state(m))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))

    # strict=False skips missing/unexpected but never loads a mis-shaped tensor
    with pytest.raises(TorchWeightsError, match="1 mis-shaped"):
        load_torch_weights(m, sd, strict=False)
    sd["conv.weight"] = tm.conv.weight
    res = load_torch_weights(m, sd, strict=False)
    assert res == IncompatibleKeys(["head.2.weight", "ln.bias"], ["decoder.weight", "extra.scale"])
    np.testing.assert_allclose(np.asarray(m.conv.kernel[...]), tm.conv.weight.detach().numpy().transpose(2, 1, 0))
    np.testing.assert_array_equal(np.asarray(m.ln.bias[...]), before["ln"]["bias"])  # kept its value


def test_mapping_renames_prefixes_drops_and_suggests(text_pair):
    tm, m = text_pair
    sd = {f"model.backbone.{k}": v for k, v in tm.state_dict().items()}
    sd["model.classifier.weight"] = torch.ones(2, 2)
    with pytest.raises(TorchWeightsError, match=r"did you mean 'emb.weight'\?"):
        load_torch_weights(m, {"emb.weigth": sd["model.backbone.emb.weight"]}, strict=True)
    load_torch_weights(m, sd, mapping={"model.backbone": "", "model.classifier": None})
    assert_twins(tm, m, TOKENS)
    # a prefix renames whole components only; a callable sees every key
    m2 = NNXText(nnx.Rngs(1))
    sd2 = {k.replace("head.", "mlp."): v for k, v in tm.state_dict().items()}
    load_torch_weights(m2, sd2, mapping={"mlp": "head"})
    res = load_torch_weights(m2, tm.state_dict(), mapping=lambda k: None if k.startswith("attn.") else k, strict=False)
    assert res.missing_keys == [
        "attn.in_proj_bias",
        "attn.in_proj_weight",
        "attn.out_proj.bias",
        "attn.out_proj.weight",
    ]
    load_torch_weights(m2, tm.state_dict(), mapping=lambda k: k if k.startswith("attn.") else None, strict=False)
    assert_twins(tm, m2, TOKENS)
    with pytest.raises(TorchWeightsError, match=r"several source keys to the same name: \['a.bias', 'b.bias'\]"):
        load_torch_weights(m2, {"a.bias": torch.zeros(1), "b.bias": torch.zeros(1)}, mapping={"a": "x", "b": "x"})


def test_settings_the_weights_do_not_carry_are_reported(text_pair):
    tm, _ = text_pair

    class Defaults(NNXText):  # flax defaults, as a naive layer-by-layer port would have them
        def __init__(self, rngs):
            super().__init__(rngs)
            self.conv = nnx.Conv(E, C, (3,), rngs=rngs)  # 'SAME' = (1, 1) here: no difference
            self.bn = nnx.BatchNorm(C, rngs=rngs)  # momentum 0.99, epsilon 1e-5
            self.ln = nnx.LayerNorm(C, rngs=rngs)  # epsilon 1e-6
            self.attn = nnx.MultiHeadAttention(4, C, decode=False, rngs=rngs)  # same weight shapes, 4 heads

    tm.conv.padding = (2,)
    with pytest.warns(UserWarning) as rec:
        load_torch_weights(Defaults(nnx.Rngs(0)), tm)
    assert len(rec) == 1
    msg = str(rec[0].message)
    assert "'bn': BatchNorm momentum: torch 0.1" in msg and "set momentum=0.9 (NNX has 0.99)" in msg
    assert "'ln': LayerNorm eps: torch 1e-05, NNX epsilon 1e-06" in msg
    assert "'attn': attention heads: torch 2, NNX 4" in msg
    assert "conv padding: torch (2,) pads ((2, 2),), NNX 'SAME' pads ((1, 1),)" in msg


def test_abstract_model_is_filled_without_random_init(text_pair):
    tm, _ = text_pair
    m = nnx.eval_shape(lambda: NNXText(nnx.Rngs(0)))
    assert isinstance(m.conv.kernel.get_value(), jax.ShapeDtypeStruct)
    sd = dict(tm.state_dict())
    del sd["ln.bias"]
    with pytest.raises(TorchWeightsError, match=r"model is abstract and the source has no value for 1 .*'ln/bias'"):
        load_torch_weights(m, sd, strict=False)
    load_torch_weights(m, tm.state_dict())
    assert isinstance(m.conv.kernel.get_value(), jax.Array)
    m.eval()
    np.testing.assert_allclose(np.asarray(m(jnp.asarray(TOKENS))), torch_out(tm, TOKENS, False), atol=TOL, rtol=TOL)


def test_dtypes_follow_the_model(tmp_path):
    tm = randomized(TorchImage())
    path = tmp_path / "bf16.safetensors"
    save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tm.state_dict().items()}, str(path))
    m = NNXImage(nnx.Rngs(0))
    load_torch_weights(m, path)
    assert m.c1.kernel[...].dtype == jnp.float32  # the variable keeps its dtype
    ref = tm.c1.weight.detach().to(torch.bfloat16).float().numpy().transpose(2, 3, 1, 0)
    np.testing.assert_array_equal(np.asarray(m.c1.kernel[...]), ref)
    half = NNXImage(nnx.Rngs(0))
    half.fc.kernel.set_value(half.fc.kernel[...].astype(jnp.bfloat16))
    load_torch_weights(half, tm.state_dict())
    assert half.fc.kernel[...].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(half.fc.kernel[...], np.float32), tm.fc.weight.detach().numpy().T, rtol=1e-2)


class LazyStateDict(Mapping):
    """Creates each tensor on access and remembers it weakly: the loader must drop a tensor before the next."""

    def __init__(self, sd):
        self.sd = {k: v.detach().numpy().copy() for k, v in sd.items()}
        self.alive: list[weakref.ref] = []
        self.most_alive = 0

    def __getitem__(self, k):
        self.most_alive = max(self.most_alive, sum(r() is not None for r in self.alive))
        t = torch.from_numpy(self.sd[k].copy())
        self.alive.append(weakref.ref(t))
        return t

    def __iter__(self):
        return iter(self.sd)

    def __len__(self):
        return len(self.sd)


def test_one_tensor_at_a_time_and_weights_only(text_pair, tmp_path, monkeypatch):
    tm, m = text_pair
    lazy = LazyStateDict(tm.state_dict())
    load_torch_weights(m, lazy)
    assert lazy.most_alive == 0  # no earlier tensor was still referenced when the next was read
    assert_twins(tm, m, TOKENS)

    calls = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    load_torch_weights(NNXText(nnx.Rngs(0)), as_source("pt", tm, tmp_path))
    assert calls[0]["weights_only"] is True and calls[0]["mmap"] is True


class NotATensor:
    pass


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (
            lambda p: p.write_bytes(b"not a torch file"),
            r"cannot read torch file .*w\.pt: not a torch.save file of tensors \(Unsupported operand",
        ),
        (
            lambda p: torch.save({"w": NotATensor()}, p),
            r"w\.pt holds Python objects besides tensors \(.*NotATensor\).*never unpickles",
        ),
        (lambda p: torch.save({"opt": {"lr": 1}, "step": 2}, p), r"w\.pt is a dict but not a state_dict"),
        (lambda p: torch.save(torch.zeros(2), p), r"w\.pt holds a Tensor, not a state_dict"),
    ],
    ids=["garbage", "pickled-object", "no-state-dict", "bare-tensor"],
)
def test_bad_torch_files(write, message, tmp_path):
    path = tmp_path / "w.pt"
    write(path)
    with pytest.raises(TorchWeightsError, match=message):
        load_torch_weights(NNXImage(nnx.Rngs(0)), path)


def test_bad_sources(tmp_path):
    m = NNXImage(nnx.Rngs(0))
    bad = tmp_path / "w.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(TorchWeightsError, match=r"cannot read safetensors file .*w\.safetensors"):
        load_torch_weights(m, bad)
    bad.rename(tmp_path / "w.orig")
    with pytest.raises(TorchWeightsError, match=r"w\.orig: unknown weights format"):
        load_torch_weights(m, tmp_path / "w.orig")
    with pytest.raises(FileNotFoundError, match="no such weights file"):
        load_torch_weights(m, tmp_path / "missing.pt")
    with pytest.raises(TorchWeightsError, match=r"holds none of \['model.safetensors'"):
        load_torch_weights(m, tmp_path)
    with pytest.raises(TypeError, match="needs a flax.nnx.Module or a LightningModule"):
        load_torch_weights(object(), {})
    with pytest.raises(TypeError, match="source must be a state_dict"):
        load_torch_weights(m, 3)

    def inside_jit():
        load_torch_weights(NNXImage(nnx.Rngs(0)), TorchImage().state_dict())
        return 0

    with pytest.raises(RuntimeError, match="called inside a jax transformation"):
        jax.jit(inside_jit)()
    with pytest.raises(pickle.UnpicklingError):  # sanity: torch itself refuses the object without weights_only
        path = tmp_path / "o.pt"
        torch.save({"w": NotATensor()}, path)
        torch.load(path, weights_only=True)
