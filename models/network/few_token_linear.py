"""Linear layers over a few tokens with half-precision stored weights (the camera head's).

The camera head runs 16 transformer blocks per frame on one token each, in float32 as the
reference does. At one token a linear layer is a matrix-vector product: its time is the time to
read its weights, 3.4 GB per frame in float32. Stored in float16 they are half of that, and the
kernel here reads them as float16, multiplies by the float32 activations and accumulates in
float32, so the only new rounding is the weights' (relative 2^-12, eight times finer than
bfloat16's; the camera head in bfloat16 throughout doubles the pose error).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from .custom_ops import operator_for_compiled_code
from .layers import Mlp

# Largest magnitude float16 holds; a weight beyond it keeps its layer in float32.
FLOAT16_MAX = 65504.0
# Layers smaller than this stay float32: reading them is not what costs (the pose embedding, 9 x C).
MIN_HALF_WEIGHTS = 1 << 20
# The fastest over the camera head's layer mix in a probe of tile shapes:
# 0.73 ms per frame against cuBLAS's 1.45 ms in float32 and 0.84 ms in bfloat16.
BLOCK_OUTPUTS, BLOCK_INPUTS, NUM_WARPS = 4, 1024, 4


@triton.jit
def _few_token_linear_kernel(x, weight, bias, out, num_outputs, num_inputs, stride_x, stride_out,
                             GELU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program: BLOCK_N outputs of one token. Each thread keeps partial products of its slice
    of the weight tile and the tile is summed once at the end, so the loop is loads and FMAs only."""
    block, token = tl.program_id(0), tl.program_id(1)
    outputs = block * BLOCK_N + tl.arange(0, BLOCK_N)
    partial = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, num_inputs, BLOCK_K):
        inputs = k0 + tl.arange(0, BLOCK_K)
        xs = tl.load(x + token * stride_x + inputs, mask=inputs < num_inputs, other=0.0)
        ws = tl.load(weight + outputs[:, None] * num_inputs + inputs[None, :],
                     mask=(outputs[:, None] < num_outputs) & (inputs[None, :] < num_inputs), other=0.0)
        partial += ws.to(tl.float32) * xs[None, :]
    y = tl.sum(partial, 1) + tl.load(bias + outputs, mask=outputs < num_outputs, other=0.0)
    if GELU:  # exact (erf) GELU, as F.gelu's default
        y = 0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))
    tl.store(out + token * stride_out + outputs, y, mask=outputs < num_outputs)


def few_token_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, gelu: bool = False,
                     block_outputs: int = BLOCK_OUTPUTS, block_inputs: int = BLOCK_INPUTS,
                     num_warps: int = NUM_WARPS) -> torch.Tensor:
    """x [..., K] float32, weight [N, K] float16 (contiguous), bias [N] float32 -> [..., N] float32,
    optionally through GELU. One program per BLOCK_N outputs and token; the tokens of one call
    (one frame, or the scale frames together) read the same weight tile from L2."""
    if x.dtype != torch.float32 or bias.dtype != torch.float32 or weight.dtype != torch.float16:
        raise ValueError(f"few_token_linear takes float32 x and bias with float16 weights, got {x.dtype}, "
                         f"{bias.dtype}, {weight.dtype}")
    num_outputs, num_inputs = weight.shape
    if x.shape[-1] != num_inputs or bias.shape != (num_outputs,) or not weight.is_contiguous():
        raise ValueError(f"shapes do not match: x {tuple(x.shape)}, weight {tuple(weight.shape)} (contiguous "
                         f"required), bias {tuple(bias.shape)}")
    rows = x.reshape(-1, num_inputs)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], num_outputs, dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        grid = (triton.cdiv(num_outputs, block_outputs), rows.shape[0])
        _few_token_linear_kernel[grid](rows, weight, bias, out, num_outputs, num_inputs, rows.stride(0), out.stride(0),
                                       GELU=gelu, BLOCK_N=block_outputs, BLOCK_K=block_inputs, num_warps=num_warps)
    return out.reshape(*x.shape[:-1], num_outputs)


def _widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, gelu: bool) -> torch.Tensor:
    """The same layer as a plain product in x's dtype (the weights widened)."""
    y = F.linear(x, weight.to(x.dtype), bias.to(x.dtype))
    return F.gelu(y) if gelu else y


def _output_like(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, gelu: bool) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@operator_for_compiled_code("stream_recon::few_token_linear", _output_like)
def _few_token_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, gelu: bool) -> torch.Tensor:
    # An operator under torch.compile, so that it keeps the kernel whole and fuses around it.
    if not x.is_cuda:  # the same arithmetic on the CPU: float32 products of the widened weights
        return _widened_linear(x, weight, bias, gelu)
    return few_token_linear(x, weight, bias, gelu)


class HalfWeightLinear(nn.Module):
    """A float32 linear layer whose weight is stored in float16 (same parameter names, so the state
    dict keeps its keys). `gelu`: the layer applies GELU to its output (an MLP's first layer)."""

    def __init__(self, linear: nn.Linear, gelu: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.gelu = linear.in_features, linear.out_features, gelu
        self.weight = nn.Parameter(linear.weight.detach().to(torch.float16).contiguous(), requires_grad=False)
        bias = linear.bias if linear.bias is not None else torch.zeros(linear.out_features)
        self.bias = nn.Parameter(bias.detach().to(device=self.weight.device, dtype=torch.float32),
                                 requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == torch.float16 and self.bias.dtype == x.dtype == torch.float32:
            return _few_token_linear_op(x, self.weight, self.bias, self.gelu)
        # After a dtype change of the whole model (model.float(), model.to(...)): a plain layer.
        return _widened_linear(x, self.weight, self.bias, self.gelu)

    def half_weights(self) -> None:
        self.weight.data = self.weight.data.to(torch.float16).contiguous()
        self.bias.data = self.bias.data.float()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight=float16, gelu={self.gelu}"


def _storable_in_half(linear: nn.Module, min_weights: int) -> bool:
    return (type(linear) is nn.Linear and linear.weight.dtype == torch.float32
            and linear.weight.numel() >= min_weights
            and bool(linear.weight.detach().abs().max() <= FLOAT16_MAX))


def store_weights_in_half(module: nn.Module, min_weights: int = MIN_HALF_WEIGHTS) -> int:
    """Replace the float32 linear layers under `module` with at least `min_weights` weights by
    HalfWeightLinear; an MLP's first layer takes over its GELU. Returns the number replaced."""

    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, HalfWeightLinear) and child.weight.dtype != torch.float16:
                child.half_weights()  # converted before, then widened by a dtype change of the model
                replaced += 1
            if not _storable_in_half(child, min_weights):
                continue
            fuse_gelu = isinstance(parent, Mlp) and name == "fc1" and isinstance(parent.act, nn.GELU) \
                and parent.act.approximate == "none"
            setattr(parent, name, HalfWeightLinear(child, gelu=fuse_gelu))
            if fuse_gelu:
                parent.act = nn.Identity()
            replaced += 1
    return replaced
