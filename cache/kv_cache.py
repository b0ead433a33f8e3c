"""The two-stream KV cache as the engine sees it: page tables, the pages' storage and the backend reading them.

A cache here is three parts that only make sense together: the pure bookkeeping of the page tables (which
frame owns which page: paged.py), the storage those pages index (store.py) and the attention backend that
reads it (backends/). The engine drives a step through this interface only, so it never asks which kernel
it has:

    append (pending frame) -> plan -> [per global layer: write K/V, attend] -> commit | rollback

Eviction and rollback are page-table edits; the storage only grows (on the CPU), inside `append`, before
the step can write.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .paged import PagedTwoStreamCache
from .pages import CacheLayout, VisiblePages
from .store import PagedKV


class AttentionBackend(Protocol):
    """Reads the pages. `plan` once per step (host work between steps), then `attend` per layer."""

    name: str
    # True when `attend` reads its plan from device buffers that `plan` refills, so that a CUDA graph may
    # record the call and replay it for every later plan.
    reads_plan_on_device: bool

    def plan(self, visible: VisiblePages, num_queries: int) -> None: ...

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [T, H, D] -> [T, H, D] over the planned key set."""
        ...


class KVCache:
    """Page tables + storage + backend, behind the engine's interface.

    A storage may hold a block of pages past the cache's own pool, for one cache built beside it later
    (`backends.build(beside=...)`: a chunk's spare engine), whose pool is that block and whose `lender` this
    cache is: the two caches' pages lie in one allocation, and one takes the other's over by copying pages
    inside it (`take_over`).
    """

    def __init__(self, bookkeeping: PagedTwoStreamCache, storage: PagedKV, backend: AttentionBackend,
                 lender: KVCache | None = None):
        self.bookkeeping = bookkeeping
        self.storage = storage
        self.backend = backend
        self.lender = lender

    # -- what the engine reads -------------------------------------------------------------
    @property
    def layout(self) -> CacheLayout:
        return self.bookkeeping.layout

    @property
    def backend_name(self) -> str:
        return self.backend.name

    @property
    def records_steps(self) -> bool:
        """A CUDA graph may write and read the storage for the whole stream: it never moves (a GPU pool is
        allocated whole)."""
        pool = self.bookkeeping.pool
        return self.storage.device.type == "cuda" and pool.whole and pool.end_id <= self.storage.num_pages

    @property
    def pages_beside(self) -> int:
        """The pages its storage holds past its pool, for a cache built beside it (none in a lender's block)."""
        return 0 if self.lender is not None else self.storage.num_pages - self.bookkeeping.pool.end_id

    @property
    def records_attention(self) -> bool:
        """A recorded step may include the attention itself (the backend plans into device buffers)."""
        return self.records_steps and self.backend.reads_plan_on_device

    @property
    def device(self) -> torch.device:
        return self.storage.device

    @property
    def dtype(self) -> torch.dtype:
        """The precision attention computes in (queries are cast to it)."""
        return self.storage.dtype

    @property
    def store_dtype(self) -> torch.dtype:
        """The precision K/V are stored in: `dtype`, or float8_e4m3fn."""
        return self.storage.store_dtype

    @property
    def bytes_allocated(self) -> int:
        """Its storage's bytes, the block lent beside its pool included; none for a cache in a lender's block."""
        return 0 if self.lender is not None else self.storage.bytes_allocated

    @property
    def num_pending_frames(self) -> int:
        return self.bookkeeping.num_pending_frames

    @property
    def num_committed_frames(self) -> int:
        return self.bookkeeping.num_committed_frames

    @property
    def num_patch_frames(self) -> int:
        """Frames whose patch tokens are visible: scale + window (pending included)."""
        return self.bookkeeping.num_patch_frames

    @property
    def num_special_tokens(self) -> int:
        return self.bookkeeping.num_special_tokens

    @property
    def num_visible_tokens(self) -> int:
        return self.bookkeeping.visible_pages().num_tokens

    # -- updates ---------------------------------------------------------------------------
    def append(self, defer_eviction: bool = False) -> None:
        """Add one pending frame (eviction semantics: PagedTwoStreamCache.append)."""
        self.bookkeeping.append(defer_eviction)
        self.storage.ensure_pages(self.bookkeeping.pool.end_id)

    def commit(self) -> None:
        self.bookkeeping.commit()

    def rollback(self) -> None:
        self.bookkeeping.rollback()

    def reset(self) -> None:
        """Forget every frame; the storage keeps its size."""
        self.bookkeeping.reset()

    def clear(self) -> None:
        """Forget every frame and zero its pool's pages, as allocated: for values that must not stay even
        where nothing reads them unmasked (a product with a zero weight is NaN where the value is)."""
        self.reset()
        pool = self.bookkeeping.pool
        self.storage.zero(pool.first_id, pool.end_id)

    def take_over(self, other: KVCache) -> None:
        """Hold what `other` (a cache of this geometry over a pool of its own, nothing pending) holds: its
        page tables, its pages' data copied on the current stream into pages of this cache's pool (inside
        one storage where `other` is this cache's, or its lender's, block)."""
        copies = self.bookkeeping.take_over(other.bookkeeping)
        self.storage.ensure_pages(self.bookkeeping.pool.end_id)
        self.storage.copy_pages(other.storage, copies)

    # -- one step --------------------------------------------------------------------------
    def plan(self, num_queries: int) -> None:
        """Plan the backend for the current key set (pending frames included)."""
        self.backend.plan(self.bookkeeping.visible_pages(), num_queries)

    def frame_slots(self, frame: int = -1) -> tuple[list[int], int]:
        """Where a pending frame's tokens go: its special tokens' token rows and its patch page's first
        row (the slots a recorded step uploads)."""
        return self.bookkeeping.frame_slots(frame)

    def pending_slots(self) -> torch.Tensor:
        """[T] token rows of the pending frames' tokens, oldest frame first, each frame's in model order
        (specials, then patches), on the storage's device."""
        bookkeeping = self.bookkeeping
        slots = [s for i in range(-bookkeeping.num_pending_frames, 0) for s in bookkeeping.token_slots(i)]
        return torch.tensor(slots, dtype=torch.long).to(self.device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of T tokens at token rows slots [T]; k, v [T, H, D]."""
        self.storage.write(layer, slots, k, v)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [T, H, D] -> [T, H, D] over the planned key set."""
        return self.backend.attend(layer, q)

    def step(self, slots: torch.Tensor) -> CacheStep:
        """The callable one model step hands its global layers (see CacheStep)."""
        return CacheStep(self, slots)


class CacheStep:
    """What one model step hands its global layers: write this step's K/V, then attend over the
    planned key set. The model calls `step(layer, q, k, v)` and never learns which backend serves it."""

    def __init__(self, cache: KVCache, slots: torch.Tensor):
        self.cache = cache
        self.slots = slots

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v [T, H, D] (RoPE already applied) -> attention output [T, H, D]."""
        self.cache.write(layer, self.slots, k, v)
        return self.cache.attend(layer, q)
