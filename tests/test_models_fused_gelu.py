"""The MLPs' fused first layer: the module swap keeps weights, keys and (off CUDA half precision)
the exact GELU; the epilogue operator's reshaping and its tanh-form GELU, on the CPU. The GPU runs
the fused path against the golden fixtures (tests/test_gpu_fast_path.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stream_recon.models.network.fused_gelu import GeluLinear, _linear_gelu_epilogue, fuse_mlp_gelu
from stream_recon.models.network.layers import Block, Mlp


def test_fusing_keeps_keys_and_the_exact_gelu_off_cuda():
    torch.manual_seed(0)
    block = Block(64, 4).eval()
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        before = block(x)
        keys = {k: v.clone() for k, v in block.state_dict().items()}
        assert fuse_mlp_gelu(block) == 1
        assert isinstance(block.mlp.fc1, GeluLinear) and isinstance(block.mlp.act, nn.Identity)
        assert block.state_dict().keys() == keys.keys()
        assert all(torch.equal(block.state_dict()[k], v) for k, v in keys.items())
        assert torch.equal(block(x), before)  # float32 on the CPU: the erf GELU, same kernels
    assert fuse_mlp_gelu(block) == 0  # once


def test_only_exact_gelu_mlps_with_plain_first_layers_are_fused():
    tanh = Mlp(8, 16)
    tanh.act = nn.GELU(approximate="tanh")
    assert fuse_mlp_gelu(nn.Sequential(tanh, Mlp(8, 16))) == 1
    assert type(tanh.fc1) is nn.Linear


def test_epilogue_operator_is_a_linear_layer_with_gelu_on_any_leading_shape():
    torch.manual_seed(0)
    x, weight, bias = torch.randn(2, 3, 8), torch.randn(16, 8), torch.randn(16)
    out = _linear_gelu_epilogue(x, weight, bias)
    assert out.shape == (2, 3, 16)
    # PyTorch's CPU kernel applies the erf form; cuBLASLt's epilogue the tanh form (GPU tests)
    for form in ("none", "tanh"):
        assert (out - F.gelu(F.linear(x, weight, bias), approximate=form)).abs().max() < 5e-4
