"""The pages' storage: every global layer's keys and values, page by page, in the model's precision or in fp8.

One tensor per layer, pages in FlashInfer's NHD order with K and V apart:

    layers[l]    [2, N * P, H, D]   (0 = K, 1 = V; token row = page * P + offset)
    as pages     layers[l][0].view(N, P, H, D): FlashInfer's paged K cache (NHD), [1] its V cache
    as rows      layers[l][0] [N * P, H, D]: what the range kernel reads through the step's runs of rows

In fp8 (fp8.py) `layers` holds e4m3 codes and `exponents[l]` [2, H, N * P] int8 a power-of-two scale per
token and head (head-major, so that a kernel reads one head's scales of a key block as one row).

Every value is finite from the start (zeros) and stays so: a write stores a step's K/V, a clear zeroes.
The kernels rely on it: rows of a key block past a run's end belong to other pages and are multiplied by a
zero probability, which leaves a finite value out but would turn NaN into NaN.

A pool that grows (the CPU's) re-allocates each layer in turn, so that a growth holds one layer twice at
most; on the GPU the pool is allocated whole and the storage never moves, so CUDA graphs may write and
read it for the whole stream.
"""

from __future__ import annotations

import torch

from . import fp8
from .packages import importable
from .pages import VisiblePages


def store_write_kernel(device: torch.device, quantized: bool, head_dim: int):
    """The Triton kernel that writes a layer's K and V into the store on `device`, or None where PyTorch
    writes them: off CUDA, without Triton, at a head dim not a power of two (a kernel holds a token's heads
    in one block), and for fp8 codes before Triton has e4m3 (fp8.TRITON_E4M3_CAPABILITY)."""
    if device.type != "cuda" or not importable("triton") or head_dim & (head_dim - 1):
        return None
    if quantized and not fp8.triton_has_e4m3(device):
        return None
    # its module imports Triton, which the check above found
    from . import triton_store

    return triton_store.write_quantized if quantized else triton_store.write


class PagedKV:
    """Pages of every global layer's K/V, grown on demand (their ids come from a PagePool).

    dtype: the precision attention computes in (the model's); store_dtype: what K/V are stored in,
    dtype or float8_e4m3fn (writes quantise; `gather` and the range kernel's copy dequantise).
    """

    def __init__(self, num_layers: int, num_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str, num_pages: int, store_dtype: torch.dtype | None = None):
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.dtype = dtype
        self.store_dtype = store_dtype or dtype
        if self.store_dtype not in (dtype, fp8.E4M3):
            raise ValueError(f"pages hold {dtype} or float8_e4m3fn, not {self.store_dtype}")
        self.device = torch.device(device)
        self.layers = [self._values(num_pages) for _ in range(num_layers)]
        self.exponents = [self._exponents(num_pages) for _ in range(num_layers)] if self.quantized else None
        # Each layer's write as one Triton kernel on CUDA (two scattered copies, or for fp8 many small
        # kernels, otherwise).
        self._write_kernel = store_write_kernel(self.device, self.quantized, head_dim)

    @property
    def quantized(self) -> bool:
        return self.store_dtype == fp8.E4M3

    @property
    def num_pages(self) -> int:
        return self.layers[0].shape[1] // self.page_size

    @property
    def num_rows(self) -> int:
        """Token rows of each layer: pages x page size."""
        return self.layers[0].shape[1]

    @staticmethod
    def bytes_needed(num_layers: int, num_heads: int, head_dim: int, page_size: int, num_pages: int,
                     store_dtype: torch.dtype) -> int:
        """Bytes `num_pages` pages of every layer take (codes and, for fp8, exponents)."""
        values = num_layers * 2 * num_pages * page_size * num_heads * head_dim
        if store_dtype == fp8.E4M3:
            return values + num_layers * 2 * num_heads * num_pages * page_size  # one byte each, one more per head vector
        return values * torch.empty((), dtype=store_dtype).element_size()

    @property
    def bytes_allocated(self) -> int:
        tensors = self.layers + (self.exponents or [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def _values(self, num_pages: int) -> torch.Tensor:
        shape = (2, num_pages * self.page_size, self.num_heads, self.head_dim)
        return torch.zeros(shape, dtype=self.store_dtype, device=self.device)

    def _exponents(self, num_pages: int) -> torch.Tensor:
        return torch.zeros(2, self.num_heads, num_pages * self.page_size, dtype=torch.int8, device=self.device)

    def ensure_pages(self, num_pages: int) -> bool:
        """Grow every layer to hold `num_pages`, one layer at a time; True when the storage moved."""
        if num_pages <= self.num_pages:
            return False
        rows = self.num_rows
        for layer in range(self.num_layers):
            grown = self._values(num_pages)
            grown[:, :rows] = self.layers[layer]
            self.layers[layer] = grown
            if self.exponents is not None:
                grown = self._exponents(num_pages)
                grown[..., :rows] = self.exponents[layer]
                self.exponents[layer] = grown
        return True

    def zero(self, first_page: int = 0, end_page: int | None = None) -> None:
        """The values of pages [first_page, end_page) (None: to the last) back to zero, as allocated."""
        rows = slice(first_page * self.page_size, None if end_page is None else end_page * self.page_size)
        for layer in self.layers:
            layer[:, rows].zero_()
        for exponents in self.exponents or []:
            exponents[..., rows].zero_()

    def pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s K and V caches as FlashInfer reads them: [N, P, H, D] each (NHD), views."""
        shape = (self.num_pages, self.page_size, self.num_heads, self.head_dim)
        return self.layers[layer][0].view(shape), self.layers[layer][1].view(shape)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of T tokens at token rows slots [T] (page * P + offset); k, v [T, H, D]."""
        store = self.layers[layer]
        if self._write_kernel is not None and not self.quantized and k.stride(-1) == 1 and v.stride(-1) == 1:
            self._write_kernel(store, slots, k, v)
        elif not self.quantized:
            store[0].index_copy_(0, slots, k.to(self.dtype))
            store[1].index_copy_(0, slots, v.to(self.dtype))
        elif self._write_kernel is not None:
            self._write_kernel(store, self.exponents[layer], slots, k, v)
        else:
            for which, x in enumerate((k, v)):
                codes, exponents = fp8.quantize(x)  # [T, H, D], [T, H]
                # (index_copy_ has no float8 kernel on the CPU: the codes are copied as bytes)
                store[which].view(torch.uint8).index_copy_(0, slots, codes.view(torch.uint8))
                self.exponents[layer][which].index_copy_(1, slots, exponents.transpose(0, 1))

    def copy_pages(self, other: PagedKV, pages: list[tuple[int, int]]) -> None:
        """Pages of `other` (same dtype and head shape) copied into this storage, (their page, this page)
        each, every layer's K and V (and exponents)."""
        if other.store_dtype != self.store_dtype or (other.num_heads, other.head_dim, other.page_size) != (
                self.num_heads, self.head_dim, self.page_size):
            raise ValueError("pages are copied between storages of one dtype, page size and head shape only")
        if not pages:
            return
        size = self.page_size
        rows = torch.arange(size)
        source = torch.cat([page * size + rows for page, _ in pages]).to(self.device)
        target = torch.cat([page * size + rows for _, page in pages]).to(self.device)
        for layer in range(self.num_layers):
            self.layers[layer][:, target] = other.layers[layer][:, source]
            if self.exponents is not None:
                self.exponents[layer][..., target] = other.exponents[layer][..., source]

    def visible_rows(self, visible: VisiblePages) -> torch.Tensor:
        """[N] the token rows of the visible keys, in key order, on the storage's device (`gather` reads them)."""
        size = self.page_size
        rows = torch.cat([torch.arange(page * size, page * size + size) for page in visible.page_ids])
        return rows[: visible.num_tokens].to(self.device)

    def gather(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values at token rows `rows` [N], [N, H, D] each in `dtype` (copies; fp8 dequantised)."""
        store = self.layers[layer]
        if not self.quantized:
            return store[0, rows], store[1, rows]
        exponents = self.exponents[layer][:, :, rows].transpose(1, 2)  # [2, N, H]
        return (fp8.dequantize(store[0, rows], exponents[0], self.dtype),
                fp8.dequantize(store[1, rows], exponents[1], self.dtype))
