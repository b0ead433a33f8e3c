"""Attention over the paged two-stream cache: physical K/V pages plus a backend that reads them.

Storage layout per layer (FlashInfer's NHD paged layout):
    kv_pages [num_pages, 2, page_size, H, D]   (index 0 = K, 1 = V)

A step writes the pending frames' K/V into their slots, plans once for the visible page table,
and then every global layer calls `attend`. The SDPA backend gathers the visible pages and runs
PyTorch's scaled_dot_product_attention; the FlashInfer backend runs a paged prefill kernel on the
same pages. Both share this bookkeeping, so the CPU tests exercise the GPU path's page tables.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .pages import VisiblePages


class PagedKV:
    """Physical pages of every global layer, grown on demand (ids come from the PagePool)."""

    def __init__(self, num_layers: int, num_heads: int, head_dim: int, page_size: int,
                 dtype: torch.dtype, device: torch.device | str, num_pages: int):
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.kv_pages = [self._empty(num_pages) for _ in range(num_layers)]

    @property
    def num_pages(self) -> int:
        return self.kv_pages[0].shape[0]

    @property
    def store_dtype(self) -> torch.dtype:
        """What K/V are stored in: always the compute dtype here (fp8 is the dense store's)."""
        return self.dtype

    @staticmethod
    def bytes_needed(num_layers: int, num_heads: int, head_dim: int, page_size: int, num_pages: int,
                     dtype: torch.dtype) -> int:
        """Bytes `num_pages` pages of every layer take."""
        return num_layers * num_pages * 2 * page_size * num_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def bytes_allocated(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv_pages)

    def _empty(self, num_pages: int) -> torch.Tensor:
        shape = (num_pages, 2, self.page_size, self.num_heads, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def ensure_pages(self, num_pages: int) -> bool:
        """Grow every layer to hold `num_pages`; returns True when storage moved (plans are stale)."""
        if num_pages <= self.num_pages:
            return False
        for layer, old in enumerate(self.kv_pages):
            new = self._empty(num_pages)
            new[: old.shape[0]] = old
            self.kv_pages[layer] = new
        return True

    def zero(self) -> None:
        """Every page's values back to zero, as allocated."""
        for pages in self.kv_pages:
            pages.zero_()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of T tokens. slots [T] flat ids (page * page_size + offset); k, v [T, H, D]."""
        pages = self.kv_pages[layer]
        page, offset = slots // self.page_size, slots % self.page_size
        pages[page, 0, offset] = k.to(self.dtype)
        pages[page, 1, offset] = v.to(self.dtype)

    def gather(self, layer: int, visible: VisiblePages, page_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Visible keys and values in key order: [N, H, D] each."""
        pages = self.kv_pages[layer].index_select(0, page_ids)  # [n_pages, 2, page_size, H, D]
        keys = pages[:, 0].reshape(-1, self.num_heads, self.head_dim)[: visible.num_tokens]
        values = pages[:, 1].reshape(-1, self.num_heads, self.head_dim)[: visible.num_tokens]
        return keys, values


class SDPAPagedAttention:
    """Reference backend: gather the visible pages, then one unmasked SDPA per layer.

    Runs anywhere; on CPU in float32 it reproduces the official SDPA path up to summation order.
    """

    name = "sdpa"

    def __init__(self, kv: PagedKV):
        self.kv = kv
        self._visible: VisiblePages | None = None
        self._page_ids: torch.Tensor | None = None

    def plan(self, visible: VisiblePages, num_queries: int) -> None:
        self._visible = visible
        self._page_ids = torch.tensor(visible.page_ids, dtype=torch.long, device=self.kv.device)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [T, H, D] -> [T, H, D] over the planned visible set, in the page dtype (a bf16 cache
        attends in bf16, as FlashInfer does; an fp32 cache in fp32)."""
        keys, values = self.kv.gather(layer, self._visible, self._page_ids)
        out = F.scaled_dot_product_attention(
            q.to(keys.dtype).transpose(0, 1).unsqueeze(0),  # [1, H, T, D]
            keys.transpose(0, 1).unsqueeze(0),  # [1, H, N, D]
            values.transpose(0, 1).unsqueeze(0),
        )
        return out[0].transpose(0, 1)  # [T, H, D]
