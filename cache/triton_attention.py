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
from .triton_quantize import dequantize_range

# The probe's fastest configuration on an H100 (64 query rows per program: 256 programs for the
# 16 heads of a 1,005-token frame, two per SM; keys and values through TMA descriptors).
BLOCK_QUERIES, BLOCK_KEYS, NUM_WARPS, NUM_STAGES = 64, 128, 4, 3
LOG2_E = 1.4426950408889634


@triton.jit
def _fold_block(s, v, m_i, l_i, acc, qk_scale):
    """Fold one block of scores s [M, N] (float32) and values v [N, D] into the running max m_i,
    sum l_i and output acc (base-2 exponentials)."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.math.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)  # 0 on the first block (m_i = -inf)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _range_attention_kernel(Q, keys, values, Out, key_range, stride_q, stride_o, num_queries, qk_scale,
                            HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: BLOCK_M queries of one head against keys [start, end) of that head. `keys` and
    `values` are descriptors of the [capacity, heads * HEAD_DIM] store, BLOCK_N rows by HEAD_DIM."""
    block, head = tl.program_id(0), tl.program_id(1)
    start, end = tl.load(key_range), tl.load(key_range + 1)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + rows[:, None] * stride_q + head * HEAD_DIM + dims[None, :], mask=rows[:, None] < num_queries,
                other=0.0)
    column = head * HEAD_DIM
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    num_keys = end - start
    whole = num_keys // BLOCK_N * BLOCK_N
    for offset in range(0, whole, BLOCK_N):
        s = tl.dot(q, tl.trans(keys.load([start + offset, column])))
        m_i, l_i, acc = _fold_block(s, values.load([start + offset, column]), m_i, l_i, acc, qk_scale)
    if whole < num_keys:  # the last, partial block: its rows past the end belong to other tokens
        inside = whole + cols < num_keys
        s = tl.where(inside[None, :], tl.dot(q, tl.trans(keys.load([start + whole, column]))), -float("inf"))
        v = tl.where(inside[:, None], values.load([start + whole, column]), 0.0)
        m_i, l_i, acc = _fold_block(s, v, m_i, l_i, acc, qk_scale)
    out = acc / l_i[:, None]
    tl.store(Out + rows[:, None] * stride_o + head * HEAD_DIM + dims[None, :], out.to(Out.dtype.element_ty),
             mask=rows[:, None] < num_queries)


def attend_range(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_range: torch.Tensor) -> torch.Tensor:
    """Softmax attention of q [T, H, D] over keys/values [capacity, H, D] at positions
    [key_range[0], key_range[1]) (int32 [2], on q's device; read by the kernel, so a CUDA graph
    may record the call). Returns [T, H, D] in q's dtype. keys and values: contiguous per token
    (the store's layout); the range must hold at least one key."""
    num_queries, num_heads, head_dim = q.shape
    if keys.shape[1:] != (num_heads, head_dim) or values.shape != keys.shape:
        raise ValueError(f"keys/values {list(keys.shape)}/{list(values.shape)} do not match queries {list(q.shape)}")
    if q.stride(-1) != 1 or not (keys.is_contiguous() and values.is_contiguous()):
        raise ValueError("attend_range needs head-contiguous queries and contiguous [tokens, heads, dim] keys and values")
    out = torch.empty(num_queries, num_heads, head_dim, dtype=q.dtype, device=q.device)
    flat = [t.flatten(1) for t in (keys, values)]  # [capacity, H * D] views
    descriptors = [TensorDescriptor(t, list(t.shape), list(t.stride()), [BLOCK_KEYS, head_dim]) for t in flat]
    grid = (triton.cdiv(num_queries, BLOCK_QUERIES), num_heads)
    _range_attention_kernel[grid](q, *descriptors, out, key_range, q.stride(0), out.stride(0), num_queries,
                                  head_dim**-0.5 * LOG2_E, HEAD_DIM=head_dim, BLOCK_M=BLOCK_QUERIES,
                                  BLOCK_N=BLOCK_KEYS, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out


class TritonRangeAttention:
    """Unmasked attention over the visible range of a DenseKV, its bounds kept on the device.

    `plan` copies the range to the device on the current stream (through a pinned buffer on CUDA),
    so a step enqueued after it, replayed or not, reads this frame's range. An fp8 store is read
    through one reused bf16 buffer: each layer's range dequantised into it first (one memory-bound
    Triton pass, exact), then the same bf16 kernel. Converting the e4m3 blocks inside the kernel
    instead took it from 25.2 to 43.1 ms per frame, the buffer to 28.3 (H100, docs/PERFORMANCE.md):
    the kernel is bound by instruction issue, and converted blocks go back through shared memory
    before the tensor-core products.
    """

    name = "dense-triton"
    reads_plan_on_device = True  # a recorded step may include the attention itself

    def __init__(self, kv):
        self.kv = kv
        self._key_range = DeviceValues(2, torch.int32, kv.device)
        self._scratch: torch.Tensor | None = None  # [2, capacity, H, D] in the compute dtype (fp8 stores)
        self._scratch_range = DeviceValues(2, torch.int32, kv.device)

    def plan(self, visible: VisibleRange, num_queries: int) -> None:
        self._key_range.set(visible.start, visible.end)
        if self.kv.quantized:
            self._scratch_range.set(0, visible.end - visible.start)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [T, H, D] -> [T, H, D], in the store's compute dtype."""
        query = q.to(self.kv.dtype).contiguous()
        store = self.kv.store[layer]  # [2, capacity, H, D]
        if not self.kv.quantized:
            return attend_range(query, store[0], store[1], self._key_range.values)
        if self._scratch is None:
            self._scratch = torch.empty(store.shape, dtype=self.kv.dtype, device=store.device)
        dequantize_range(store, self.kv.exponents[layer], self._key_range.values, self._scratch)
        return attend_range(query, self._scratch[0], self._scratch[1], self._scratch_range.values)
