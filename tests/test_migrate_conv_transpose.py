"""load_torch_weights converts nn.ConvTranspose1d/2d/3d into nnx.ConvTranspose (either transpose_kernel), with
the padding of jaxlight.migrate.conv_transpose_padding: outputs equal torch's (fp32)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn as tnn
from flax import nnx

from jaxlight.migrate import TorchWeightsError, conv_transpose_padding, load_torch_weights, torch_names

TOL = 1e-5
TORCH = {1: tnn.ConvTranspose1d, 2: tnn.ConvTranspose2d, 3: tnn.ConvTranspose3d}
# (dims, in, out, kernel, stride, padding, dilation, output_padding, bias)
CASES = [
    (1, 3, 5, 3, 1, 0, 1, 0, True),
    (1, 4, 6, 4, 2, 1, 1, 1, True),
    (1, 2, 3, 3, 1, 3, 1, 0, False),  # padding > k-1: negative lax padding
    (2, 3, 8, 4, 2, 1, 1, 0, True),  # the usual 2x upsampling layer
    (2, 2, 4, (3, 2), (3, 1), (1, 0), (2, 1), (1, 0), True),  # per-dimension settings
    (3, 2, 3, 3, 2, 1, 1, 1, True),
    (3, 3, 2, 2, 1, 0, 1, 0, False),
]


class TwinT(tnn.Module):
    def __init__(self, n, cin, cout, k, s, p, d, op, bias):
        super().__init__()
        self.up = TORCH[n](cin, cout, k, stride=s, padding=p, dilation=d, output_padding=op, bias=bias)


class TwinN(nnx.Module):
    def __init__(self, n, cin, cout, k, s, p, d, op, bias, transpose_kernel):
        ks = (k,) * n if isinstance(k, int) else k
        self.up = nnx.ConvTranspose(
            cin,
            cout,
            ks,
            strides=s,
            padding=conv_transpose_padding(ks, p, d, op),
            kernel_dilation=d,
            use_bias=bias,
            transpose_kernel=transpose_kernel,
            rngs=nnx.Rngs(0),
        )


def outputs(case, transpose_kernel, source="module"):
    n = case[0]
    torch.manual_seed(sum(map(hash, map(str, case))) % 1000)
    tm = TwinT(*case).eval()
    with torch.no_grad():  # a non-zero bias, so a bias mix-up shows
        if tm.up.bias is not None:
            tm.up.bias.normal_()
    model = TwinN(*case, transpose_kernel=transpose_kernel)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the settings check finds no difference with the helper's padding
        load_torch_weights(model, tm if source == "module" else tm.state_dict())
    x = torch.randn(2, case[1], *([5] * n))
    with torch.no_grad():
        want = tm.up(x).numpy()
    got = np.asarray(model.up(jnp.asarray(np.moveaxis(x.numpy(), 1, -1))))  # NC* -> N*C
    return want, np.moveaxis(got, -1, 1)


@pytest.mark.parametrize("transpose_kernel", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}d-k{c[3]}-s{c[4]}-p{c[5]}-d{c[6]}-op{c[7]}")
def test_conv_transpose_outputs_equal_torch(case, transpose_kernel):
    with jax.default_matmul_precision("highest"):
        want, got = outputs(case, transpose_kernel)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def test_state_dict_source_and_names():
    case = CASES[3]
    with jax.default_matmul_precision("highest"):
        want, got = outputs(case, False, source="state_dict")
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    assert torch_names(TwinN(*case, transpose_kernel=False)) == {"up.weight": "up/kernel", "up.bias": "up/bias"}


def test_grouped_conv_transpose_is_refused_by_name():
    tm = tnn.Sequential(tnn.ConvTranspose2d(4, 6, 3, groups=2))  # weight (4, 3, 3, 3)

    model = nnx.Sequential(nnx.ConvTranspose(4, 3, (3, 3), padding=((2, 2), (2, 2)), rngs=nnx.Rngs(0)))
    before = np.asarray(model.layers[0].kernel[...]).copy()
    with pytest.raises(TorchWeightsError, match=r"grouped transposed convolutions: '0' \(groups=2"):
        load_torch_weights(model, tm)
    np.testing.assert_array_equal(np.asarray(model.layers[0].kernel[...]), before)  # nothing loaded


def test_padding_difference_is_reported():
    # flax's default 'SAME' pads (2, 2) here: torch's padding=1, not its default 0
    tm = tnn.ConvTranspose2d(3, 4, 4, stride=2)
    model = nnx.ConvTranspose(3, 4, (4, 4), strides=2, rngs=nnx.Rngs(0))
    with pytest.warns(UserWarning, match=r"conv transpose padding: .* NNX padding=\(\(3, 3\), \(3, 3\)\)"):
        load_torch_weights(model, tm)


def test_conv_transpose_padding_helper():
    assert conv_transpose_padding((4, 4), 1) == ((2, 2), (2, 2))
    assert conv_transpose_padding(3, 0, 2, 1) == ((4, 5),)
    assert conv_transpose_padding((3, 2), (1, 0), (2, 1), (1, 0)) == ((3, 4), (1, 1))
    with pytest.raises(ValueError, match="padding=\\(1, 1, 1\\) has 3 entries"):
        conv_transpose_padding((3, 3), (1, 1, 1))
