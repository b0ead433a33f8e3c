"""Attention over the dense layout's visible range with one Triton kernel (dense-triton).

The split backend (dense_attention.SplitCudnnAttention) sends the patch keys to cuDNN, whose plan
is built per key count, and the growing special keys to a second kernel, then merges the two; it
must also run eagerly between CUDA-graph segments, because the key count lives on the host. This
kernel reads the range [start, end) of the store from device memory instead: one kernel for
specials and patches, no merge, no plan per shape, and the whole aggregator step fits in one
graph. On an H100 at the streaming shape (1,005 queries, 72,840 keys, 16 heads of 64) it takes
645 us (462 TFLOP/s), against cuDNN's 713 us for the 71,928 patch keys alone
(scripts/gpu/probe_triton_attention.py). What made the difference: keys and values loaded by the
tensor memory accelerator (pointer loads: 717 us) and 64-row query blocks (128 rows: 745 us).
Exponentials stay float32: the probe's half-precision `ex2.f16x2` variants were slower, their
conversions costing more than the exponentials they save at head dim 64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .dense import VisibleRange
from .streams import DeviceValues

# The probe's fastest configuration on an H100 (64 query rows per program: 256 programs for the
# 16 heads of a 1,005-token frame, two per SM; keys and values through TMA descriptors).
BLOCK_QUERIES, BLOCK_KEYS, NUM_WARPS, NUM_STAGES = 64, 128, 4, 3
LOG2_E = 1.4426950408889634


@triton.jit
def _fold_block(s, v, v_scale, m_i, l_i, acc, qk_scale, SCALED: tl.constexpr):
    """Fold one block of scores s [M, N] (float32) and values v [N, D] into the running max m_i,
    sum l_i and output acc (base-2 exponentials). SCALED: the values are fp8 codes whose scales
    v_scale [N] weigh the probabilities' columns (the sum l_i takes them unweighted)."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.math.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)  # 0 on the first block (m_i = -inf)
    l_i = l_i * alpha + tl.sum(p, 1)
    if SCALED:
        p = p * v_scale[None, :]
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _block_scales(exponents, first, inside):
    """float32 scales 2^e of one key block's int8 exponents (row `exponents` from `first`), built
    from their bits (exact); 0 where `inside` is False."""
    e = tl.load(exponents + first + tl.arange(0, inside.shape[0]), mask=inside, other=-127)
    return ((e.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _block(q, keys, values, key_exponents, value_exponents, first, column, inside, m_i, l_i, acc, qk_scale,
           PARTIAL: tl.constexpr, QUANTIZED: tl.constexpr, VALUES_DTYPE: tl.constexpr):
    """One key block [first, first + BLOCK_N) of one head folded into (m_i, l_i, acc). PARTIAL: the
    block runs past the range's end (`inside` says which rows belong to it). VALUES_DTYPE: what
    fp8 values are widened to for P.V."""
    v_scale = None
    if QUANTIZED:
        # e4m3 -> fp16 is one instruction per pair and exact (to bf16 it is three); q was made fp16.
        k = keys.load([first, column]).to(tl.float16)
        s = tl.dot(q, tl.trans(k)) * _block_scales(key_exponents, first, inside)[None, :]
        # The value scales ride on P, in bf16 for P.V: it keeps float32's range, where fp16 would
        # lose small probabilities times small scales to subnormals.
        v = values.load([first, column]).to(VALUES_DTYPE)
        v_scale = _block_scales(value_exponents, first, inside)
    else:
        s = tl.dot(q, tl.trans(keys.load([first, column])))
        v = values.load([first, column])
    if PARTIAL:  # rows past the end belong to other tokens
        s = tl.where(inside[None, :], s, -float("inf"))
        v = tl.where(inside[:, None], v, 0.0)
    return _fold_block(s, v, v_scale, m_i, l_i, acc, qk_scale, QUANTIZED)


@triton.jit
def _range_attention_kernel(Q, keys, values, key_exponents, value_exponents, Out, key_range, stride_q, stride_o,
                            stride_exponents, num_queries, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, QUANTIZED: tl.constexpr, VALUES_DTYPE: tl.constexpr):
    """One program: BLOCK_M queries of one head against keys [start, end) of that head. `keys` and
    `values` are descriptors of the [capacity, heads * HEAD_DIM] store, BLOCK_N rows by HEAD_DIM.
    QUANTIZED: the store holds e4m3 codes, with int8 scale exponents [heads, capacity] (row stride
    `stride_exponents`) for keys and values."""
    block, head = tl.program_id(0), tl.program_id(1)
    start, end = tl.load(key_range), tl.load(key_range + 1)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + rows[:, None] * stride_q + head * HEAD_DIM + dims[None, :], mask=rows[:, None] < num_queries,
                other=0.0)
    if QUANTIZED:
        q = q.to(tl.float16)  # exact for bf16 queries in fp16's normal range (QK-normed here: |q| << 65504)
        key_exponents += head * stride_exponents
        value_exponents += head * stride_exponents
    column = head * HEAD_DIM
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    num_keys = end - start
    whole = num_keys // BLOCK_N * BLOCK_N
    everything = cols < BLOCK_N
    for offset in range(0, whole, BLOCK_N):
        m_i, l_i, acc = _block(q, keys, values, key_exponents, value_exponents, start + offset, column, everything,
                               m_i, l_i, acc, qk_scale, False, QUANTIZED, VALUES_DTYPE)
    if whole < num_keys:  # the last, partial block
        m_i, l_i, acc = _block(q, keys, values, key_exponents, value_exponents, start + whole, column,
                               whole + cols < num_keys, m_i, l_i, acc, qk_scale, True, QUANTIZED, VALUES_DTYPE)
    out = acc / l_i[:, None]
    tl.store(Out + rows[:, None] * stride_o + head * HEAD_DIM + dims[None, :], out.to(Out.dtype.element_ty),
             mask=rows[:, None] < num_queries)


def attend_range(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_range: torch.Tensor,
                 key_exponents: torch.Tensor | None = None, value_exponents: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of q [T, H, D] over keys/values [capacity, H, D] at positions
    [key_range[0], key_range[1]) (int32 [2], on q's device; read by the kernel, so a CUDA graph
    may record the call). Returns [T, H, D] in q's dtype. keys and values: contiguous per token
    (the store's layout); the range must hold at least one key. With key_exponents and
    value_exponents [H, capacity] (int8, contiguous), keys and values are e4m3 codes whose value
    is code * 2^exponent (fp8.py): the kernel reads them in 8 bits, applies the key scales to the
    scores and the value scales to the probabilities."""
    num_queries, num_heads, head_dim = q.shape
    if keys.shape[1:] != (num_heads, head_dim) or values.shape != keys.shape:
        raise ValueError(f"keys/values {list(keys.shape)}/{list(values.shape)} do not match queries {list(q.shape)}")
    if q.stride(-1) != 1 or not (keys.is_contiguous() and values.is_contiguous()):
        raise ValueError("attend_range needs head-contiguous queries and contiguous [tokens, heads, dim] keys and values")
    quantized = key_exponents is not None
    if quantized:
        expected = (num_heads, keys.shape[0])
        if value_exponents is None or key_exponents.shape != expected or value_exponents.shape != expected:
            raise ValueError(f"fp8 keys and values need exponents [{num_heads}, {keys.shape[0]}] for both")
        if key_exponents.stride() != value_exponents.stride() or key_exponents.stride(1) != 1:
            raise ValueError("key and value exponents must be head-major rows with one stride")
    out = torch.empty(num_queries, num_heads, head_dim, dtype=q.dtype, device=q.device)
    flat = [t.flatten(1) for t in (keys, values)]  # [capacity, H * D] views
    descriptors = [TensorDescriptor(t, list(t.shape), list(t.stride()), [BLOCK_KEYS, head_dim]) for t in flat]
    grid = (triton.cdiv(num_queries, BLOCK_QUERIES), num_heads)
    _range_attention_kernel[grid](q, *descriptors, key_exponents, value_exponents, out, key_range, q.stride(0),
                                  out.stride(0), key_exponents.stride(0) if quantized else 0, num_queries,
                                  head_dim**-0.5 * LOG2_E, HEAD_DIM=head_dim, BLOCK_M=BLOCK_QUERIES,
                                  BLOCK_N=BLOCK_KEYS, QUANTIZED=quantized, VALUES_DTYPE=_values_dtype(q.dtype),
                                  num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out


def _values_dtype(query_dtype: torch.dtype):
    """What fp8 values are widened to: bf16, except for float32 queries, which only Triton's
    interpreter runs here (the CPU tests; it multiplies bf16 operands wrongly)."""
    return tl.float32 if query_dtype == torch.float32 else tl.bfloat16


class TritonRangeAttention:
    """Unmasked attention over the visible range of a DenseKV, its bounds kept on the device.

    `plan` copies the range to the device on the current stream (through a pinned buffer on CUDA),
    so a step enqueued after it, replayed or not, reads this frame's range. An fp8 store is read
    one of two ways (`fp8_read`): "kernel", the range kernel converting each block in registers,
    or "scratch", each layer's range dequantised to bf16 into one reused buffer first and read by
    the bf16 kernel (docs/PERFORMANCE.md compares them).
    """

    name = "dense-triton"
    reads_plan_on_device = True  # a recorded step may include the attention itself
    fp8_read = "scratch"

    def __init__(self, kv):
        self.kv = kv
        self._key_range = DeviceValues(2, torch.int32, kv.device)
        self._scratch: torch.Tensor | None = None  # [2, capacity, H, D] in the compute dtype
        self._scratch_range = DeviceValues(2, torch.int32, kv.device)

    def plan(self, visible: VisibleRange, num_queries: int) -> None:
        self._key_range.set(visible.start, visible.end)
        if self._reads_scratch:
            self._scratch_range.set(0, visible.end - visible.start)

    @property
    def _reads_scratch(self) -> bool:
        return self.kv.quantized and self.fp8_read == "scratch"

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [T, H, D] -> [T, H, D], in the store's dtype."""
        query = q.to(self.kv.dtype).contiguous()
        store = self.kv.store[layer]  # [2, capacity, H, D]
        if self._reads_scratch:
            from .triton_quantize import dequantize_range

            if self._scratch is None:
                self._scratch = torch.empty(store.shape, dtype=self.kv.dtype, device=store.device)
            dequantize_range(store, self.kv.exponents[layer], self._key_range.values, self._scratch)
            return attend_range(query, self._scratch[0], self._scratch[1], self._scratch_range.values)
        exponents = self.kv.exponents[layer] if self.kv.quantized else (None, None)  # [2, H, capacity]
        return attend_range(query, store[0], store[1], self._key_range.values, *exponents)
