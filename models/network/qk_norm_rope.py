"""The aggregator's per-head QK-norm and RoPE in one Triton kernel (CUDA).

Compiled by TorchInductor, Attention.heads took two kernels per block for this: one computed the
LayerNorm of q and k in float32 and wrote them out in float32 (11 us at the streaming shape, 1,005
tokens x 16 heads x 64 channels, 48 calls per frame), a second read them back, applied
the rotary embedding and cast (5-7 us): ~0.8 ms per frame. Here one program reads a block of (token,
head) rows of q and of k straight from the qkv projection's output, normalizes them, rotates them
with the rope's expanded tables (models/network/rope.py) and writes them once, token-major: 4.1-4.5 us
instead of 12-13 us per call (probe); the aggregator graph 25.07 -> 24.8 ms per frame (bench, one run).

Numerics are those of the unfused path under autocast: statistics, affine and rotation in float32
(the norms' weights widened), one rounding to the qkv dtype at the end. Only the order of the
float32 operations differs (reduction order, rsqrt), so a bf16 output may differ by one rounding.
Without autocast a bf16 model's unfused path rounds after the norm and rotates in bf16; this one does
not (the engine always runs half precision under autocast).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from .custom_ops import operator_for_compiled_code
from .rope import Rope2D, Rope3D, rotate_expanded

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# 32 (token, head) rows of q and k per program, 8 warps: 4.5 us (Rope2D) and 4.1 us (Rope3D) for q and
# k at the streaming shape, against 12-13 us unfused.
BLOCK_ROWS, NUM_WARPS = 32, 8


@triton.jit
def _swap_pairs(x, R: tl.constexpr, D: tl.constexpr, P: tl.constexpr):
    """x [R, D] -> x[:, partner(d)]: channels P apart swapped, in registers."""
    x = tl.permute(tl.reshape(x, [R, D // (2 * P), 2, P]), [0, 1, 3, 2])
    first, second = tl.split(x)
    return tl.reshape(tl.permute(tl.join(second, first), [0, 1, 3, 2]), [R, D])


@triton.jit
def _normalize_rotate(src, weight, bias, eps, chans, mates, live, cos, sin, R: tl.constexpr, D: tl.constexpr,
                      P: tl.constexpr, SWAP: tl.constexpr):
    """src [R, 1]: each row's first channel -> the rows LayerNormed and rotated, float32 [R, D]. The
    partner channels come from a register swap (SWAP) or a second load of the row (from L1)."""
    x = tl.load(src + chans[None, :], mask=live, other=0.0).to(tl.float32)
    mean = tl.sum(x, 1)[:, None] / D
    centred = x - mean
    rstd = tl.rsqrt(tl.sum(centred * centred, 1)[:, None] / D + eps)
    w, b = tl.load(weight + chans).to(tl.float32), tl.load(bias + chans).to(tl.float32)
    normed = centred * rstd * w[None, :] + b[None, :]
    if SWAP:
        normed_mate = _swap_pairs(normed, R, D, P)
    else:
        x_mate = tl.load(src + mates[None, :], mask=live, other=0.0).to(tl.float32)
        w_mate, b_mate = tl.load(weight + mates).to(tl.float32), tl.load(bias + mates).to(tl.float32)
        normed_mate = (x_mate - mean) * rstd * w_mate[None, :] + b_mate[None, :]
    return normed * cos + normed_mate * sin


@triton.jit
def _qk_norm_rope_kernel(qkv, q_out, k_out, q_weight, q_bias, k_weight, k_bias, cos, sin, q_eps, k_eps,
                         num_rows, heads, tokens, stride_token,
                         D: tl.constexpr, PAIR_OFFSET: tl.constexpr, BLOCK_R: tl.constexpr, SWAP: tl.constexpr):
    """One program: BLOCK_R (token, head) rows of q and the same rows of k, which share their table rows."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    token, head = rows // heads, rows % heads
    live = (rows < num_rows)[:, None]
    chans = tl.arange(0, D)
    mates = chans + tl.where((chans // PAIR_OFFSET) % 2 == 0, PAIR_OFFSET, -PAIR_OFFSET)
    table = ((token % tokens) * D)[:, None] + chans[None, :]
    c = tl.load(cos + table, mask=live, other=0.0)
    s = tl.load(sin + table, mask=live, other=0.0)
    src = qkv + token[:, None].to(tl.int64) * stride_token + head[:, None] * D
    dst = rows[:, None].to(tl.int64) * D + chans[None, :]
    q = _normalize_rotate(src, q_weight, q_bias, q_eps, chans, mates, live, c, s, BLOCK_R, D, PAIR_OFFSET, SWAP)
    tl.store(q_out + dst, q.to(q_out.dtype.element_ty), mask=live)
    k = _normalize_rotate(src + heads * D, k_weight, k_bias, k_eps, chans, mates, live, c, s, BLOCK_R, D,
                           PAIR_OFFSET, SWAP)
    tl.store(k_out + dst, k.to(k_out.dtype.element_ty), mask=live)


def launch(qkv: torch.Tensor, heads: int, q_weight: torch.Tensor, q_bias: torch.Tensor, k_weight: torch.Tensor,
           k_bias: torch.Tensor, q_eps: float, k_eps: float, cos: torch.Tensor, sin: torch.Tensor, pair_offset: int,
           block_rows: int = BLOCK_ROWS, num_warps: int = NUM_WARPS, swap: bool | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [B, N, 3 * H * D] (q | k | v, heads within each) -> q, k [B, N, H, D] contiguous in qkv's
    dtype. cos, sin: the rope's expanded tables [N, D] float32 (contiguous). `swap`: partners from a
    register swap, by default for adjacent pairs (Rope3D), whose reload is a scattered load (10-14 us
    instead of 4); pairs 16 apart (Rope2D) reload as whole vectors, a little faster than the swap."""
    batch, tokens, width = qkv.shape
    head_dim = width // (3 * heads)
    _check(qkv, heads, (q_weight, q_bias, k_weight, k_bias), cos, sin, pair_offset)
    rows = qkv.reshape(batch * tokens, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    q = torch.empty(batch, tokens, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty_like(q)
    num_rows = batch * tokens * heads
    if num_rows:
        _qk_norm_rope_kernel[(triton.cdiv(num_rows, block_rows),)](
            rows, q, k, q_weight, q_bias, k_weight, k_bias, cos, sin, q_eps, k_eps, num_rows, heads, tokens,
            rows.stride(0), D=head_dim, PAIR_OFFSET=pair_offset, BLOCK_R=block_rows,
            SWAP=pair_offset == 1 if swap is None else swap, num_warps=num_warps)
    return q, k


def _check(qkv, heads, params, cos, sin, pair_offset) -> None:
    batch, tokens, width = qkv.shape
    head_dim = width // (3 * heads)
    if width != 3 * heads * head_dim or head_dim & (head_dim - 1) or head_dim % (2 * pair_offset):
        raise ValueError(f"qkv width {width} is not 3 x {heads} heads of a power-of-two head dim "
                         f"in pairs {pair_offset} apart")
    if qkv.dtype not in DTYPES:
        raise ValueError(f"qk_norm_rope takes {DTYPES}, got {qkv.dtype}")
    tables_ok = cos.shape == sin.shape == (tokens, head_dim) and cos.is_contiguous() and sin.is_contiguous()
    if not tables_ok or any(p.shape != (head_dim,) or not p.is_contiguous() for p in params):
        raise ValueError(f"tables {tuple(cos.shape)}, {tuple(sin.shape)} must be contiguous [{tokens}, {head_dim}] "
                         f"and the norms' weights and biases contiguous [{head_dim}]")


def reference(qkv: torch.Tensor, heads: int, q_weight: torch.Tensor, q_bias: torch.Tensor, k_weight: torch.Tensor,
              k_bias: torch.Tensor, q_eps: float, k_eps: float, cos: torch.Tensor, sin: torch.Tensor,
              pair_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused computation in plain PyTorch, as Attention.heads does it under autocast: float32
    LayerNorm and rotation, one cast at the end."""
    batch, tokens, width = qkv.shape
    q, k, _ = qkv.reshape(batch, tokens, 3, heads, -1).unbind(2)

    def one(x, weight, bias, eps):
        normed = F.layer_norm(x.float(), x.shape[-1:], weight.float(), bias.float(), eps)
        return rotate_expanded(normed, cos, sin, pair_offset).to(qkv.dtype)

    return one(q, q_weight, q_bias, q_eps), one(k, k_weight, k_bias, k_eps)


def _outputs_like(qkv, heads, q_weight, q_bias, k_weight, k_bias, q_eps, k_eps, cos, sin, pair_offset):
    batch, tokens, width = qkv.shape
    shape = (batch, tokens, heads, width // (3 * heads))
    return qkv.new_empty(shape), qkv.new_empty(shape)


@operator_for_compiled_code("stream_recon::qk_norm_rope", _outputs_like)
def _qk_norm_rope_op(qkv: torch.Tensor, heads: int, q_weight: torch.Tensor, q_bias: torch.Tensor,
                     k_weight: torch.Tensor, k_bias: torch.Tensor, q_eps: float, k_eps: float, cos: torch.Tensor,
                     sin: torch.Tensor, pair_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    # An operator under torch.compile, so that it keeps the kernel whole (Inductor would re-split it).
    args = (qkv, heads, q_weight, q_bias, k_weight, k_bias, q_eps, k_eps, cos, sin, pair_offset)
    return launch(*args) if qkv.is_cuda else reference(*args)


def applies(qkv: torch.Tensor, q_norm: nn.Module, k_norm: nn.Module, rope) -> bool:
    """Whether Attention.heads may take the fused path: inference on CUDA, LayerNorm QK-norms with
    weights and biases, a Rope2D / Rope3D whose tables cover the sequence, a power-of-two head dim."""
    if not (qkv.is_cuda and qkv.dtype in DTYPES and not torch.is_grad_enabled()):
        return False
    if not isinstance(rope, (Rope2D, Rope3D)) or not all(_affine_layer_norm(n) for n in (q_norm, k_norm)):
        return False
    head_dim = q_norm.normalized_shape[0]
    return (k_norm.normalized_shape == (head_dim,) and head_dim & (head_dim - 1) == 0
            and rope.cos_full.shape == (qkv.shape[1], head_dim) and rope.cos_full.is_cuda)


def _affine_layer_norm(norm: nn.Module) -> bool:
    return (isinstance(norm, nn.LayerNorm) and len(norm.normalized_shape) == 1
            and norm.weight is not None and norm.bias is not None)


def qk_norm_rope(qkv: torch.Tensor, heads: int, q_norm: nn.LayerNorm, k_norm: nn.LayerNorm,
                 rope: Rope2D | Rope3D) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [B, N, 3C] -> q, k [B, N, H, D] normalized and rotated, in qkv's dtype (where `applies`)."""
    return _qk_norm_rope_op(qkv, heads, q_norm.weight, q_norm.bias, k_norm.weight, k_norm.bias, q_norm.eps,
                            k_norm.eps, rope.cos_full, rope.sin_signed, rope.pair_offset)
