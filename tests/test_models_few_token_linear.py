"""The camera head's half-stored weights: the Triton kernel on the CPU through Triton's interpreter
(the same source the GPU compiles) against a float64 product, and the module swap on real blocks.
The GPU runs the converted camera head against the golden fixtures (tests/test_gpu_fast_path.py)."""

from __future__ import annotations

import textwrap

import pytest
import torch
from torch import nn
from triton_interpreter import interpret

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

from stream_recon.models.network.few_token_linear import HalfWeightLinear, store_weights_in_half  # noqa: E402
from stream_recon.models.network.layers import Block, Mlp  # noqa: E402

# (tokens, outputs, inputs, gelu): partial output and input blocks, one token and several, and a
# strided token view (every other row of a larger tensor, as the camera tokens are).
CASES = [(1, 37, 1030, False), (3, 64, 512, True), (2, 5, 100, True), (1, 128, 2048, False)]

SCRIPT = textwrap.dedent("""
    import sys, torch
    import torch.nn.functional as F
    from stream_recon.models.network.few_token_linear import few_token_linear

    torch.manual_seed(0)
    worst = []
    for tokens, outputs, inputs, gelu in eval(sys.argv[1]):
        x = torch.randn(tokens, 2, inputs)[:, 0]  # rows 2 * inputs apart
        weight = (torch.randn(outputs, inputs) / inputs ** 0.5).half()
        bias = torch.randn(outputs)
        out = few_token_linear(x, weight, bias, gelu=gelu, block_outputs=16, block_inputs=256)
        expected = F.linear(x.double(), weight.double(), bias.double())
        expected = F.gelu(expected) if gelu else expected
        assert out.shape == (tokens, outputs) and out.dtype == torch.float32
        worst.append(((out.double() - expected).abs().max() / expected.abs().max()).item())
    print(" ".join(f"{w:.3e}" for w in worst))
""")


@pytest.mark.slow
def test_kernel_matches_a_float64_product_of_the_stored_weights():
    errors = [float(x) for x in interpret(SCRIPT, CASES).split()]
    assert len(errors) == len(CASES)
    for case, error in zip(CASES, errors, strict=True):
        assert error <= 1e-6, f"{case}: relative error {error:.2e}"  # float32 accumulation only


def test_kernel_refuses_wrong_dtypes_and_shapes():
    from stream_recon.models.network.few_token_linear import few_token_linear

    x, weight, bias = torch.zeros(1, 8), torch.zeros(4, 8, dtype=torch.float16), torch.zeros(4)
    with pytest.raises(ValueError, match="float16 weights"):
        few_token_linear(x, weight.float(), bias)
    with pytest.raises(ValueError, match="shapes do not match"):
        few_token_linear(torch.zeros(1, 9), weight, bias)
    with pytest.raises(ValueError, match="contiguous"):
        few_token_linear(x, torch.zeros(8, 4, dtype=torch.float16).t(), bias)


def _rounded_copy(module: nn.Module) -> nn.Module:
    """The module with its weights rounded to float16 and kept in float32: what the kernel computes."""
    import copy

    rounded = copy.deepcopy(module)
    for layer in rounded.modules():
        if isinstance(layer, nn.Linear):
            layer.weight.data = layer.weight.data.half().float()
    return rounded


def test_a_block_keeps_its_keys_and_computes_with_rounded_weights():
    torch.manual_seed(0)
    block = Block(64, 4).eval()
    for p in block.parameters():  # LayerScale starts at ones; make every parameter matter
        p.data.normal_(0, 0.3)
    reference, rounded = _rounded_copy(block), _rounded_copy(block)
    reference.load_state_dict(block.state_dict())
    keys = list(block.state_dict())

    assert store_weights_in_half(block, min_weights=1) == 4  # qkv, proj, fc1, fc2
    assert list(block.state_dict()) == keys
    assert block.mlp.fc1.gelu and isinstance(block.mlp.act, nn.Identity)
    assert not block.attn.qkv.gelu and block.attn.qkv.weight.dtype == torch.float16
    x = torch.randn(1, 3, 64)
    with torch.no_grad():
        out, exact, widened = block(x), reference(x), rounded(x)
    assert torch.allclose(out, widened, atol=1e-5, rtol=1e-5)
    assert (out - exact).abs().max() < 1e-2 * exact.abs().max()  # float16 weight rounding, no more
    assert store_weights_in_half(block, min_weights=1) == 0  # converted layers are left alone


def test_small_layers_and_out_of_range_weights_stay_float32():
    mlp = Mlp(32, 64, 9)
    mlp.fc1.weight.data[0, 0] = 1e6  # beyond float16's range
    assert store_weights_in_half(mlp, min_weights=1000) == 0  # fc2 (9 x 64) too small, fc1 (64 x 32) out of range
    assert type(mlp.fc1) is nn.Linear and type(mlp.fc2) is nn.Linear and isinstance(mlp.act, nn.GELU)
    mlp.fc1.weight.data[0, 0] = 0.5
    assert store_weights_in_half(mlp, min_weights=1000) == 1
    assert isinstance(mlp.fc1, HalfWeightLinear) and mlp.fc1.gelu


def test_a_dtype_change_of_the_model_leaves_a_working_layer_and_conversion_restores_it():
    torch.manual_seed(0)
    mlp = Mlp(64, 128)
    assert store_weights_in_half(mlp, min_weights=1) == 2
    x = torch.randn(2, 64)
    with torch.no_grad():
        half = mlp(x)
        mlp.float()  # as a test harness does to give the next engine float32 weights
        assert mlp.fc1.weight.dtype == torch.float32
        assert torch.allclose(mlp(x), half, atol=1e-6)
        assert store_weights_in_half(mlp, min_weights=1) == 2
        assert mlp.fc1.weight.dtype == torch.float16 and torch.equal(mlp(x), half)
