"""The MLPs' first layer with its GELU in cuBLASLt's matrix-product epilogue (bf16/fp16 on CUDA).

At the streaming shape (1,005 tokens, 1024 -> 4096) the GELU as its own kernel costs ~8 us after a
15 us product, 72 times per frame; in the epilogue the pair takes 16.5 us (a probe);
end to end 26.4 -> 25.7 ms per frame. cuBLASLt's GELU epilogue is
the tanh form, not the erf form the model was trained with; the two differ by at most 4.7e-4 (at
x = 2.70, where GELU is 2.69 and a bf16 value is only known to within 7.8e-3). The fused layer is
the more accurate one: the epilogue applies GELU to the float32 product and rounds once, where the
separate path rounds the product to bf16 first. Against a float32 erf reference at the streaming
shape: 8.1e-3 fused, 1.6e-2 separate (tests/test_gpu_fast_path.py); the golden bf16 pose errors go
down (0.203 -> 0.161). Float32 runs and the CPU keep the erf form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stream_recon.cache.backends import HALF_DTYPES

from .custom_ops import operator_for_compiled_code
from .layers import Mlp


def _output_like(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@operator_for_compiled_code("stream_recon::linear_gelu_epilogue", _output_like)
def _linear_gelu_epilogue(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """GELU(x @ weight.T + bias) in one cuBLASLt call (an operator under torch.compile)."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch._addmm_activation(bias, rows, weight.t(), use_gelu=True)
    return out.reshape(*x.shape[:-1], weight.shape[0])


class GeluLinear(nn.Linear):
    """nn.Linear followed by GELU (same parameters and state-dict keys). Half precision on CUDA: one
    cuBLASLt call with the GELU in its epilogue (tanh form); otherwise the exact erf GELU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if x.is_cuda and weight.dtype in HALF_DTYPES and bias is not None and bias.dtype == weight.dtype:
            return _linear_gelu_epilogue(x.to(weight.dtype), weight, bias)  # (autocast would cast x too)
        return F.gelu(super().forward(x))


def fuse_mlp_gelu(module: nn.Module) -> int:
    """Give every MLP under `module` whose first layer is a plain nn.Linear followed by the exact GELU
    a GeluLinear first layer (same weights) and no separate activation. Returns the number fused."""

    fused = 0
    for mlp in module.modules():
        if isinstance(mlp, Mlp) and type(mlp.fc1) is nn.Linear and isinstance(mlp.act, nn.GELU) \
                and mlp.act.approximate == "none":
            fc1 = mlp.fc1
            layer = GeluLinear(fc1.in_features, fc1.out_features, bias=fc1.bias is not None,
                               device=fc1.weight.device, dtype=fc1.weight.dtype)
            layer.load_state_dict(fc1.state_dict())
            mlp.fc1, mlp.act = layer, nn.Identity()
            fused += 1
    return fused
