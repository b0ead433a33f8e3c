"""Storage of the dense layout, and the attention backends that read its visible range in place.

Storage: one tensor for every global layer, store [L, 2, capacity, H, D] (index 0 = K, 1 = V), so
that a slot move is one copy for all layers; in bf16/fp16/fp32, or in fp8 (e4m3) with a scale per
token and head (fp8.py). Each step's keys are the token range [start, end) of
its layer (DenseTwoStreamCache.visible), so PyTorch's scaled_dot_product_attention reads
them without a gather. On CUDA the cuDNN kernel is excluded: it is the fastest on a fixed shape,
but builds a new execution plan for every new key count (85 ms, measured), and the key count
changes every frame. FlashInfer's ragged prefill (flashinfer_backend.py) reads the same range.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import fp8
from .compiling import Compile, compiled
from .dense import DenseTwoStreamCache, SlotMove, VisibleRange
from .leftover_rows import KernelWaves, launch_ends, whole_wave_rows
from .packages import importable
from .streams import run_beside


def store_write_kernel(device: torch.device, quantized: bool, head_dim: int):
    """The Triton kernel that writes a layer's K and V into a dense store on `device`, or None where
    PyTorch writes them: off CUDA, without Triton, at a head dim not a power of two (a kernel holds a
    token's heads in one block), and for fp8 codes before Triton has e4m3 (fp8.TRITON_E4M3_CAPABILITY)."""
    if device.type != "cuda" or not importable("triton") or head_dim & (head_dim - 1):
        return None
    if quantized and not fp8.triton_has_e4m3(device):
        return None
    # its module imports Triton, which the check above found
    from . import triton_store

    return triton_store.write_quantized if quantized else triton_store.write


class DenseKV:
    """The store of every global layer's keys and values, read in place by the dense backends.

    store [L, 2, capacity, H, D] in `store_dtype`; `dtype` is the precision attention computes in
    (the model's). With store_dtype float8_e4m3fn (fp8.py) each token's head vector has a
    power-of-two scale: exponents [L, 2, H, capacity] int8, head-major so that a kernel reads one
    head's scales of a key block as one row. Writes quantise, slot moves carry the exponents with
    the codes, and `keys_values` hands out dequantised copies in `dtype`.
    """

    def __init__(self, num_layers: int, num_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: torch.device | str, store_dtype: torch.dtype | None = None):
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.store_dtype = store_dtype or dtype
        if self.store_dtype not in (dtype, fp8.E4M3):
            raise ValueError(f"a dense store holds {dtype} or float8_e4m3fn, not {self.store_dtype}")
        self.device = torch.device(device)
        self.store = torch.zeros(num_layers, 2, capacity, num_heads, head_dim, dtype=self.store_dtype, device=self.device)
        self.exponents = None
        if self.quantized:
            self.exponents = torch.zeros(num_layers, 2, num_heads, capacity, dtype=torch.int8, device=self.device)
        # Each layer's write as one Triton kernel on CUDA (two scattered copies, or for fp8 many
        # small kernels, otherwise).
        self._write_kernel = store_write_kernel(self.device, self.quantized, head_dim)

    @property
    def quantized(self) -> bool:
        return self.store_dtype == fp8.E4M3

    @property
    def capacity(self) -> int:
        return self.store.shape[2]

    @staticmethod
    def bytes_needed(num_layers: int, num_heads: int, head_dim: int, capacity: int, store_dtype: torch.dtype) -> int:
        """Bytes a store of this shape allocates (codes and, for fp8, exponents)."""
        values = num_layers * 2 * capacity * num_heads * head_dim
        if store_dtype == fp8.E4M3:
            return values + num_layers * 2 * num_heads * capacity  # one byte each, plus one per head vector
        return values * torch.empty((), dtype=store_dtype).element_size()

    @property
    def bytes_allocated(self) -> int:
        tensors = [self.store] if self.exponents is None else [self.store, self.exponents]
        return sum(t.numel() * t.element_size() for t in tensors)

    def zero(self) -> None:
        """Every value back to zero, as allocated."""
        self.store.zero_()
        if self.exponents is not None:
            self.exponents.zero_()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots [T] store positions; k, v [T, H, D]."""
        if self._write_kernel is not None and not self.quantized and k.stride(-1) == 1 and v.stride(-1) == 1:
            self._write_kernel(self.store[layer], slots, k, v)
        elif not self.quantized:
            self.store[layer, 0].index_copy_(0, slots, k.to(self.dtype))
            self.store[layer, 1].index_copy_(0, slots, v.to(self.dtype))
        elif self._write_kernel is not None:
            self._write_kernel(self.store[layer], self.exponents[layer], slots, k, v)
        else:
            for which, x in enumerate((k, v)):
                codes, exponents = fp8.quantize(x)  # [T, H, D], [T, H]
                # (index_copy_ has no float8 kernel on the CPU: the codes are copied as bytes)
                self.store[layer, which].view(torch.uint8).index_copy_(0, slots, codes.view(torch.uint8))
                self.exponents[layer, which].index_copy_(1, slots, exponents.transpose(0, 1))

    def apply_moves(self, moves: list[SlotMove], cache: DenseTwoStreamCache) -> None:
        for move in moves:
            source, target = cache.slot_tokens(move.source), cache.slot_tokens(move.target)
            self.store[:, :, target.start : target.stop] = self.store[:, :, source.start : source.stop]
            if self.exponents is not None:
                self.exponents[..., target.start : target.stop] = self.exponents[..., source.start : source.stop]

    def copy_tokens(self, other: DenseKV, start: int, end: int) -> None:
        """Store positions [start, end) of every layer, K and V (and their exponents), from `other`."""
        if other.store_dtype != self.store_dtype or other.store.shape[3:] != self.store.shape[3:]:
            raise ValueError("tokens are copied between stores of one dtype and head shape only")
        self.store[:, :, start:end] = other.store[:, :, start:end]
        if self.exponents is not None:
            self.exponents[..., start:end] = other.exponents[..., start:end]

    def keys_values(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values at store positions [start, end), [N, H, D] each in `dtype`: views
        (no copy), or for an fp8 store dequantised copies."""
        keys, values = self.store[layer, 0, start:end], self.store[layer, 1, start:end]
        if not self.quantized:
            return keys, values
        exponents = self.exponents[layer, :, :, start:end].transpose(1, 2)  # [2, N, H]
        return fp8.dequantize(keys, exponents[0], self.dtype), fp8.dequantize(values, exponents[1], self.dtype)


class DenseAttention:
    """Unmasked SDPA over the visible range, in the store's dtype. With the flash kernel's `waves`
    (CUDA), the query rows go in the launches leftover_rows.launch_ends names: pieces that each
    take flash's split-KV path."""

    name = "dense"

    def __init__(self, kv: DenseKV, waves: KernelWaves | None = None):
        self.kv = kv
        self.waves = waves
        self._visible: VisibleRange | None = None
        self.launch_ends: tuple[int, ...] = ()  # where each launch's query rows end (plan)

    def plan(self, visible: VisibleRange, num_queries: int) -> None:
        self._visible = visible
        self.launch_ends = launch_ends(num_queries, self.kv.num_heads, self.waves)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [T, H, D] -> [T, H, D]."""
        keys, values = self.kv.keys_values(layer, self._visible.start, self._visible.end)
        return in_launches(lambda rows: _sdpa_tokens(rows, keys, values), q.to(keys.dtype), self.launch_ends)


def in_launches(attend_rows, q: torch.Tensor, ends: tuple[int, ...]) -> torch.Tensor:
    """attend_rows (q rows [R, H, D] -> [R, H, D]) over q [T, H, D] in launches whose rows end at
    `ends` (the last at T), concatenated."""
    if len(ends) == 1:
        return attend_rows(q)
    starts = (0, *ends[:-1])
    return torch.cat([attend_rows(q[start:end]) for start, end in zip(starts, ends, strict=True)])


def _sdpa_tokens(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """SDPA without plan-building kernels, token-major: q [T, H, D], keys and values [N, H, D] ->
    [T, H, D] (a transposed view)."""
    with sdpa_kernel(_NO_PLAN_BUILDING_BACKENDS):
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, H, T, D]
            keys.transpose(0, 1).unsqueeze(0),  # [1, H, N, D], strided view
            values.transpose(0, 1).unsqueeze(0),
        )
    return out[0].transpose(0, 1)


_NO_PLAN_BUILDING_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class SplitCudnnAttention:
    """cuDNN's fused attention on the patch keys, PyTorch's flash kernel on the special keys, and
    the two partial results merged by their log-sum-exps (exact up to rounding).

    cuDNN is the fastest kernel measured for this shape but plans per key count; the patch keys
    take only two counts once the window is full (with and without the deferred frame), while the
    special keys change every frame and go to the kernel without plans. Until the window is full,
    the whole range goes to the flash kernel. CUDA, bf16/fp16 only.
    """

    name = "dense-cudnn"

    def __init__(self, kv: DenseKV, full_patch_tokens: tuple[int, ...], fixed_shape_kernel=None,
                 any_shape_kernel=None, compile: Compile = False, fixed_shape_waves: KernelWaves | None = None,
                 any_shape_waves: KernelWaves | None = None):
        """Kernels take q, k, v [1, H, *, D] and return (out [1, H, T, D], logsumexp); the defaults
        are cuDNN (fixed shapes) and PyTorch's flash kernel (any shape), both CUDA-only. With their
        waves (CUDA), the rows past the fixed-shape kernel's last whole wave go to the any-shape
        kernel over every key, and the any-shape kernel's rows in the launches
        leftover_rows.launch_ends names."""
        self.kv = kv
        self.full_patch_tokens = full_patch_tokens  # patch-token counts that take the fixed-shape kernel
        self.fixed_shape_kernel = fixed_shape_kernel or _cudnn_with_lse
        self.any_shape_kernel = any_shape_kernel or _flash_with_lse
        self.fixed_shape_waves, self.any_shape_waves = fixed_shape_waves, any_shape_waves
        # compile: the merge's dozen elementwise kernels become one (its shapes are fixed per stream).
        self.merge = compiled(merge_into_tokens, compile)
        on_cuda = kv.device.type == "cuda"
        # The special keys' kernel runs on a side stream, beside the patch keys' kernel (CUDA).
        self.side_stream = torch.cuda.Stream(kv.device) if on_cuda else None
        self._visible: VisibleRange | None = None
        # (plan) the step's first query rows, which the fixed-shape kernel takes in its whole waves
        # (0 before the window is full), and where the any-shape kernel's launches over the rest end
        self.fixed_rows, self.any_shape_ends = 0, ()

    def plan(self, visible: VisibleRange, num_queries: int) -> None:
        self._visible = visible
        heads = self.kv.num_heads
        fixed = whole_wave_rows(num_queries, heads, self.fixed_shape_waves) if self._fixed_shape(visible) else 0
        self.fixed_rows = fixed
        self.any_shape_ends = launch_ends(num_queries - fixed, heads, self.any_shape_waves) if fixed < num_queries else ()

    @property
    def launch_ends(self) -> tuple[int, ...]:
        """Where each launch's query rows end: the fixed-shape kernel's, then the any-shape kernel's."""
        fixed = (self.fixed_rows,) if self.fixed_rows else ()
        return fixed + tuple(self.fixed_rows + end for end in self.any_shape_ends)

    def _fixed_shape(self, visible: VisibleRange) -> bool:
        return visible.end - visible.patch_start in self.full_patch_tokens and visible.start != visible.patch_start

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [T, H, D] -> [T, H, D]."""
        visible, fixed = self._visible, self.fixed_rows
        # the visible range read once (an fp8 store dequantises it here), [1, H, N, D] views
        keys, values = (t.transpose(0, 1).unsqueeze(0) for t in self.kv.keys_values(layer, visible.start, visible.end))
        q = q.to(self.kv.dtype)
        parts = [self._fixed_shape_rows(q[:fixed].transpose(0, 1).unsqueeze(0), keys, values)] if fixed else []
        if self.any_shape_ends:
            def any_shape_rows(rows):  # [R, H, D] over every key -> [R, H, D]
                return self.any_shape_kernel(rows.transpose(0, 1).unsqueeze(0), keys, values)[0][0].transpose(0, 1)

            parts.append(in_launches(any_shape_rows, q[fixed:], self.any_shape_ends))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _fixed_shape_rows(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """query [1, H, R, D] over the full window's keys and values [1, H, N, D] -> [R, H, D]: the
        patch keys through the fixed-shape kernel, the specials beside it, merged."""
        specials = self._visible.patch_start - self._visible.start
        (special_out, special_lse), (patch_out, patch_lse) = run_beside(
            self.side_stream,
            lambda: self.any_shape_kernel(query, keys[:, :, :specials], values[:, :, :specials]),
            lambda: self.fixed_shape_kernel(query, keys[:, :, specials:], values[:, :, specials:]),
        )
        return self.merge(patch_out, patch_lse, special_out, special_lse)


def _cudnn_with_lse(q, k, v):
    return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)[:2]


def _flash_with_lse(q, k, v):
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[:2]


def merge_partial_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                            lse_b: torch.Tensor) -> torch.Tensor:
    """Softmax attention over keys A and B from its two halves. out_* [B, H, T, D]; lse_* the
    natural-log sum of exp(scores) per query, any shape holding B*H*T values."""
    shape = out_a.shape[:3]
    compute = torch.promote_types(out_a.dtype, torch.float32)  # bf16 halves merge in float32
    lse_a, lse_b = lse_a.reshape(shape).to(compute), lse_b.reshape(shape).to(compute)
    top = torch.maximum(lse_a, lse_b)
    weight_a, weight_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = weight_a + weight_b
    merged = out_a.to(compute) * (weight_a / total)[..., None] + out_b.to(compute) * (weight_b / total)[..., None]
    return merged.to(out_a.dtype)


def merge_into_tokens(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                      lse_b: torch.Tensor) -> torch.Tensor:
    """merge_partial_attention for one sequence (B = 1), laid out per token: [T, H, D] contiguous."""
    return merge_partial_attention(out_a, lse_a, out_b, lse_b)[0].transpose(0, 1).contiguous()
