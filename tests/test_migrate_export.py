"""export_torch_weights is load_torch_weights' inverse for every layout rule: bit-exact both ways."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from jaxlight.migrate import conv_transpose_padding, export_torch_weights, load_torch_weights

torch = pytest.importorskip("torch")
tnn = torch.nn


class TorchNet(tnn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = tnn.Embedding(11, 8)
        self.lin = tnn.Linear(8, 6)
        self.conv = tnn.Conv2d(3, 4, 3)
        self.bn = tnn.BatchNorm2d(4)
        self.up = tnn.ConvTranspose2d(4, 2, 4, stride=2, padding=1)
        self.attn = tnn.MultiheadAttention(8, 2, batch_first=True)
        self.norm = tnn.LayerNorm(8)


class Twin(nnx.Module):
    def __init__(self, transpose_kernel: bool) -> None:
        r = nnx.Rngs(0)
        self.emb = nnx.Embed(11, 8, rngs=r)
        self.lin = nnx.Linear(8, 6, rngs=r)
        self.conv = nnx.Conv(3, 4, (3, 3), padding="VALID", rngs=r)
        self.bn = nnx.BatchNorm(4, momentum=0.9, epsilon=1e-5, rngs=r)
        pad = conv_transpose_padding((4, 4), 1)
        self.up = nnx.ConvTranspose(4, 2, (4, 4), strides=2, padding=pad, transpose_kernel=transpose_kernel, rngs=r)
        self.attn = nnx.MultiHeadAttention(2, 8, decode=False, rngs=r)
        self.norm = nnx.LayerNorm(8, epsilon=1e-5, rngs=r)


@pytest.mark.parametrize("transpose_kernel", [False, True])
def test_export_inverts_every_rule_bit_exactly(transpose_kernel, tmp_path):
    torch.manual_seed(0)
    net = TorchNet()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn_like(p))  # no zero biases or unit scales that a wrong inverse could keep
        net.bn.running_mean.copy_(torch.randn(4))
        net.bn.running_var.copy_(torch.rand(4) + 0.5)
    sd = {k: v.numpy() for k, v in net.state_dict().items() if not k.endswith("num_batches_tracked")}
    twin = Twin(transpose_kernel)
    load_torch_weights(twin, net.state_dict())
    out = export_torch_weights(twin, tmp_path / "w.safetensors", metadata={"source": "test"})
    assert sorted(out) == sorted(sd)
    for k in sd:
        assert out[k].dtype == sd[k].dtype and np.array_equal(out[k], sd[k]), k
    again = Twin(transpose_kernel)
    load_torch_weights(again, tmp_path / "w.safetensors")
    for (pa, a), (pb, b) in zip(nnx.iter_graph(twin), nnx.iter_graph(again)):
        if isinstance(a, nnx.Param | nnx.BatchStat):
            assert pa == pb and np.array_equal(np.asarray(a[...]), np.asarray(b[...])), pa
    fresh = TorchNet()
    fresh.load_state_dict({k: torch.from_numpy(v) for k, v in out.items()})  # strict: torch fills in the count


def test_export_mapping_and_refusals(tmp_path):
    twin = Twin(False)
    out = export_torch_weights(twin, mapping={"lin": "head", "attn": None})
    assert "head.weight" in out and not any(k.startswith(("lin.", "attn.")) for k in out)
    abstract = nnx.eval_shape(lambda: Twin(False))
    with pytest.raises(TypeError, match="holds no data"):
        export_torch_weights(abstract)
