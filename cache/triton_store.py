"""The pages' writes as one Triton kernel per layer: a step's K and V straight into their
token rows, as they are (bf16/fp16/fp32 pages) or quantised (fp8 pages, fp8.py's rule); and
the fp8 runs' dequantisation into a compute-dtype buffer for the range kernel.

A plain write in PyTorch is two scattered copies per layer (`index_copy_` of K, then of V): 4.0 us
each at 1,042 tokens on a 132-SM Hopper GPU, 48 per frame, for 4 MB a layer. Here each
program copies one token's K or V, all heads, so a layer's write is one launch.

An fp8 write in PyTorch is about a dozen small kernels per tensor (absolute value, maximum, the
exponent's bit arithmetic, scaling, clamping, the cast, two scattered copies); inside a replayed
step their launches would cost more than the work, 24 layers times K and V per frame. Here each
program takes one token's K or V, all heads, and writes its codes and exponents. The integer
arithmetic is fp8.scale_exponents' and the cast rounds to nearest-even and saturates like
PyTorch's, so both paths store identical bytes (tests/test_cache_fp8.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import fp8
from .tile_pieces import TABLE_ENTRY, TABLE_HEAD

# (a kernel reads module constants only as constexpr)
E4M3_MAX, MIN_EXPONENT, MAX_EXPONENT = (tl.constexpr(x) for x in (fp8.E4M3_MAX, fp8.MIN_EXPONENT, fp8.MAX_EXPONENT))


@triton.jit
def _program_token(K, V, stride_k_token, stride_k_head, stride_v_token, stride_v_head, slots, num_heads,
                   HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """What a write kernel's program (t, which) takes: which (K 0, V 1), token t's store position
    slots[t], the head and dim indices, the live heads, and token t's K or V [HEADS, HEAD_DIM] (0 in the
    rows past the heads)."""
    token, which = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots + token).to(tl.int64)
    heads = tl.arange(0, HEADS)
    dims = tl.arange(0, HEAD_DIM)
    live = heads < num_heads
    if which == 0:
        x = tl.load(K + token * stride_k_token + heads[:, None] * stride_k_head + dims[None, :], mask=live[:, None],
                    other=0.0)
    else:
        x = tl.load(V + token * stride_v_token + heads[:, None] * stride_v_head + dims[None, :], mask=live[:, None],
                    other=0.0)
    return which, slot, heads, dims, live, x


@triton.jit
def _write_kernel(K, V, stride_k_token, stride_k_head, stride_v_token, stride_v_head, slots, store, capacity,
                  num_heads, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Program (t, which): token t's K (which = 0) or V (1), [num_heads, HEAD_DIM], into store
    [2, capacity, num_heads, HEAD_DIM] at position slots[t], in the store's dtype."""
    which, slot, heads, dims, live, x = _program_token(K, V, stride_k_token, stride_k_head, stride_v_token,
                                                       stride_v_head, slots, num_heads, HEADS, HEAD_DIM)
    tl.store(store + ((which * capacity + slot) * num_heads + heads[:, None]) * HEAD_DIM + dims[None, :],
             x.to(store.dtype.element_ty), mask=live[:, None])


def write(store: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """k, v [T, H, D] (D contiguous) into one layer's store [2, capacity, H, D] (contiguous, any
    float dtype but fp8) at positions slots [T]: what two index_copy_ calls write, in one launch."""
    _check_write("write", store, k, v)
    if k.shape[0]:
        _write_kernel[(k.shape[0], 2)](k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), slots, store,
                                       store.shape[1], k.shape[1], HEADS=triton.next_power_of_2(k.shape[1]),
                                       HEAD_DIM=k.shape[2])


def _check_write(name: str, store: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    num_heads, head_dim = k.shape[1:]
    if v.shape != k.shape or store.shape[2:] != (num_heads, head_dim):
        raise ValueError(f"k/v {list(k.shape)}/{list(v.shape)} do not fit a store of {list(store.shape)}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or not store.is_contiguous():
        raise ValueError(f"{name} needs D-contiguous k and v and a contiguous store")
    if head_dim & (head_dim - 1):
        raise ValueError(f"{name} needs a power-of-two head dim, got {head_dim}")


@triton.jit
def _quantize_write_kernel(K, V, stride_k_token, stride_k_head, stride_v_token, stride_v_head, slots, codes,
                           exponents, capacity, num_heads, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Program (t, which): token t's K (which = 0) or V (1), [num_heads, HEAD_DIM], into codes
    [2, capacity, num_heads, HEAD_DIM] and exponents [2, num_heads, capacity] at position slots[t]."""
    which, slot, heads, dims, live, x = _program_token(K, V, stride_k_token, stride_k_head, stride_v_token,
                                                       stride_v_head, slots, num_heads, HEADS, HEAD_DIM)
    x = x.to(tl.float32)
    bits = tl.max(tl.abs(x), 1).to(tl.int32, bitcast=True)  # [HEADS] amax bits
    # amax = m * 2^E, 448 = 1.75 * 2^8: e = E - 8, plus one when m > 1.75 (mantissa bits 0x600000)
    exponent = (bits >> 23) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    exponent = tl.minimum(tl.maximum(exponent, MIN_EXPONENT), MAX_EXPONENT)
    inverse = ((127 - exponent) << 23).to(tl.float32, bitcast=True)  # 2^-e, exact
    y = tl.minimum(tl.maximum(x * inverse[:, None], -E4M3_MAX), E4M3_MAX)
    # Round to e4m3's grid (3 mantissa bits; steps of 2^-9 below 2^-6) by adding and removing
    # 1.5 * 2^(binade + 20): float32 addition rounds to nearest-even there. The cast below is then
    # exact, the same on the GPU as in Triton's interpreter (whose own fp8 rounding drops carries).
    # Magnitudes are rounded and the sign put back, so that -0 stays -0 as in PyTorch's cast.
    bits = y.to(tl.int32, bitcast=True)
    binade = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    magic = (((binade + 147) << 23) | 0x400000).to(tl.float32, bitcast=True)
    rounded = (tl.abs(y) + magic) - magic
    y = tl.where(bits < 0, -rounded, rounded)
    row = num_heads * HEAD_DIM
    tl.store(codes + (which * capacity + slot) * row + heads[:, None] * HEAD_DIM + dims[None, :],
             y.to(codes.dtype.element_ty), mask=live[:, None])
    tl.store(exponents + (which * num_heads + heads) * capacity + slot, exponent.to(tl.int8), mask=live)


def write_quantized(codes: torch.Tensor, exponents: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> None:
    """Quantise k, v [T, H, D] (any float dtype, D contiguous) into one layer's codes
    [2, capacity, H, D] (float8_e4m3fn, contiguous) and exponents [2, H, capacity] (int8,
    contiguous) at store positions slots [T]."""
    num_tokens, num_heads, head_dim = k.shape
    _check_write("write_quantized", codes, k, v)
    if exponents.shape[1] != num_heads or not exponents.is_contiguous():
        raise ValueError(f"exponents {list(exponents.shape)} do not fit a store of {list(codes.shape)}")
    if num_tokens == 0:
        return
    _quantize_write_kernel[(num_tokens, 2)](
        k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), slots, codes, exponents, codes.shape[1], num_heads,
        HEADS=triton.next_power_of_2(num_heads), HEAD_DIM=head_dim,
    )


@triton.jit
def _dequantize_runs_kernel(codes, exponents, runs, out, capacity, out_capacity, num_heads, HEADS: tl.constexpr,
                            HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr):
    """Program (b, which): the keys [b * BLOCK_T, (b + 1) * BLOCK_T) of the run table `runs` (tile_pieces: the
    runs' rows one after another), K (which 0) or V (1), as values code * 2^e from the codes [2, capacity,
    num_heads, HEAD_DIM] and exponents [2, num_heads, capacity] into the same rows of out [2, out_capacity,
    num_heads, HEAD_DIM]; keys past the last run's end are not written."""
    block, which = tl.program_id(0), tl.program_id(1)
    keys = block * BLOCK_T + tl.arange(0, BLOCK_T)  # [T]
    # each key's run (a block of keys may span several short runs): its first row and first key
    start = tl.zeros([BLOCK_T], tl.int32)
    run_key = tl.zeros([BLOCK_T], tl.int32)
    end = block * 0
    for run in range(tl.load(runs)):
        entry = runs + TABLE_HEAD + run * TABLE_ENTRY
        first = tl.load(entry + 3)
        here = keys >= first
        start = tl.where(here, tl.load(entry), start)
        run_key = tl.where(here, first, run_key)
        end = first + tl.load(entry + 1)
    lines = start + keys - run_key  # [T] source rows
    present = keys < end
    heads = tl.arange(0, HEADS)
    dims = tl.arange(0, HEAD_DIM)
    live = present[:, None] & (heads < num_heads)[None, :]  # [T, H]
    row = num_heads * HEAD_DIM
    source = (which * capacity + lines).to(tl.int64)
    x = tl.load(codes + source[:, None, None] * row + heads[None, :, None] * HEAD_DIM + dims[None, None, :],
                mask=live[:, :, None], other=0.0)
    e = tl.load(exponents + (which * num_heads + heads[None, :]) * capacity + lines[:, None], mask=live, other=0)
    scale = ((e.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)  # 2^e, exact
    y = x.to(tl.float32) * scale[:, :, None]
    target = (which * out_capacity + keys).to(tl.int64)
    tl.store(out + target[:, None, None] * row + heads[None, :, None] * HEAD_DIM + dims[None, None, :],
             y.to(out.dtype.element_ty), mask=live[:, :, None] & (keys < out_capacity)[:, None, None])


def dequantize_runs(codes: torch.Tensor, exponents: torch.Tensor, runs: torch.Tensor, out: torch.Tensor) -> None:
    """One layer's keys of the run table `runs` (int32 on the device) from codes [2, capacity, H, D] e4m3 and
    exponents [2, H, capacity] int8, as values in out [2, N, H, D] (bf16 or fp16): the runs' rows one after
    another from row 0, so that out holds the keys as one range. N must hold them all. Exact: code * 2^e needs
    4 significant bits. The grid covers all of `out`, so a CUDA graph may record the call for any runs."""
    _, capacity, num_heads, head_dim = codes.shape
    block = 16
    grid = (triton.cdiv(out.shape[1], block), 2)
    _dequantize_runs_kernel[grid](codes, exponents, runs, out, capacity, out.shape[1], num_heads,
                                  HEADS=triton.next_power_of_2(num_heads), HEAD_DIM=head_dim, BLOCK_T=block)
