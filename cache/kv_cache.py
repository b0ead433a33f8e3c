"""The two-stream KV cache as the engine sees it: one interface over both layouts.

A cache here is three parts that only make sense together: the pure bookkeeping of a layout
(which frame owns which slots: paged.py or dense.py), the storage those slots index (one tensor
per layer, or one for all layers), and the attention backend that reads the storage. The engine
drives a step through this interface only, so it never asks which layout or kernel it has:

    append (pending frame) -> plan -> [per global layer: write K/V, attend] -> commit | rollback

Data the storage must change when the bookkeeping changes (pages to grow, dense slots to move)
is changed inside `append`, `commit` and `rollback`, before the next step can write.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from typing import Protocol

import torch

from .dense import DenseTwoStreamCache, VisibleRange
from .dense_attention import DenseKV
from .layout import CacheLayout
from .paged import PagedTwoStreamCache
from .paged_attention import PagedKV
from .pages import VisiblePages


class AttentionBackend(Protocol):
    """Reads one layout's storage. `plan` once per step (host work), then `attend` per layer."""

    name: str
    # True when `attend` reads the plan from device memory, so a CUDA graph may record the call.
    reads_plan_on_device: bool

    def plan(self, visible: VisiblePages | VisibleRange, num_queries: int) -> None: ...

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [T, H, D] -> [T, H, D] over the planned key set."""
        ...


class KVCache(ABC):
    """Bookkeeping + storage + backend of one layout, behind the engine's interface.

    Subclasses say how the storage follows the bookkeeping (`_follow_bookkeeping`) and what the
    backend is planned with (`_visible`).
    """

    layout_name: str
    # True when the storage never moves once allocated, so a CUDA graph that writes and reads it
    # stays valid for the whole stream.
    records_steps: bool

    def __init__(self, bookkeeping, storage, backend: AttentionBackend):
        self.bookkeeping = bookkeeping
        self.storage = storage
        self.backend = backend

    # -- what the engine reads -------------------------------------------------------------
    @property
    def layout(self) -> CacheLayout:
        return self.bookkeeping.layout

    @property
    def backend_name(self) -> str:
        return self.backend.name

    @property
    def records_attention(self) -> bool:
        """A recorded step may include the attention itself (the backend plans on the device)."""
        return self.records_steps and getattr(self.backend, "reads_plan_on_device", False)

    @property
    def device(self) -> torch.device:
        return self.storage.device

    @property
    def dtype(self) -> torch.dtype:
        """The precision attention computes in (queries are cast to it)."""
        return self.storage.dtype

    @property
    def store_dtype(self) -> torch.dtype:
        """The precision K/V are stored in: `dtype`, or float8_e4m3fn (a dense fp8 store)."""
        return self.storage.store_dtype

    @property
    def bytes_allocated(self) -> int:
        return self.storage.bytes_allocated

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
        return self._visible().num_tokens

    # -- updates ---------------------------------------------------------------------------
    def append(self, defer_eviction: bool = False) -> None:
        """Add one pending frame (eviction semantics: PagedTwoStreamCache.append)."""
        self.bookkeeping.append(defer_eviction)
        self._follow_bookkeeping()

    def commit(self) -> None:
        self.bookkeeping.commit()
        self._follow_bookkeeping()

    def rollback(self) -> None:
        self.bookkeeping.rollback()
        self._follow_bookkeeping()

    def reset(self) -> None:
        """Forget every frame; the storage keeps its size."""
        self.bookkeeping.reset()

    def clear(self) -> None:
        """Forget every frame and zero the storage, as allocated: for values that must not stay even
        where nothing reads them unmasked (a product with a zero weight is NaN where the value is)."""
        self.reset()
        self.storage.zero()

    # -- one step --------------------------------------------------------------------------
    def plan(self, num_queries: int) -> None:
        """Plan the backend for the current key set (pending frames included)."""
        self.backend.plan(self._visible(), num_queries)

    def pending_slots(self) -> torch.Tensor:
        """[T] store positions of the pending frames' tokens, oldest frame first, each frame's in
        model order (specials, then patches), on the storage's device."""
        bookkeeping = self.bookkeeping
        slots = [s for i in range(-bookkeeping.num_pending_frames, 0) for s in bookkeeping.token_slots(i)]
        return torch.tensor(slots, dtype=torch.long).to(self.device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of T tokens at store positions slots [T]; k, v [T, H, D]."""
        self.storage.write(layer, slots, k, v)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [T, H, D] -> [T, H, D] over the planned key set."""
        return self.backend.attend(layer, q)

    def step(self, slots: torch.Tensor) -> CacheStep:
        """The callable one model step hands its global layers (see CacheStep)."""
        return CacheStep(self, slots)

    # -- layout specifics ------------------------------------------------------------------
    @abstractmethod
    def _follow_bookkeeping(self) -> None:
        """Make the storage match the bookkeeping (grow pages, move slots)."""

    @abstractmethod
    def _visible(self) -> VisiblePages | VisibleRange:
        """The current key set, in the form the layout's backends are planned with."""

    @abstractmethod
    def take_over(self, other: KVCache) -> None:
        """Hold what `other` (a cache of this layout and geometry, nothing pending) holds, its data
        copied on the current stream: another engine's frames handed over to this one."""


class PagedKVCache(KVCache):
    """Any page holds any frame; the backend follows a page table (FlashInfer's paged layout)."""

    layout_name = "paged"
    # Graph replay over pages leaks ~75 KB of GPU memory per frame (cause not found) and the pages move when
    # the pool grows, so paged steps run eagerly.
    records_steps = False

    def __init__(self, bookkeeping: PagedTwoStreamCache, storage: PagedKV, backend: AttentionBackend):
        super().__init__(bookkeeping, storage, backend)

    def _follow_bookkeeping(self) -> None:
        self.storage.ensure_pages(self.bookkeeping.pool.num_pages)

    def take_over(self, other: PagedKVCache) -> None:
        """Page for page: `other`'s page tables and free list, and its pages' data."""
        if other.num_pending_frames:
            raise ValueError("a cache takes over committed frames only: commit or roll back first")
        self.bookkeeping = copy.deepcopy(other.bookkeeping)
        self.storage.ensure_pages(other.storage.num_pages)
        for mine, theirs in zip(self.storage.kv_pages, other.storage.kv_pages, strict=True):
            mine[: theirs.shape[0]] = theirs

    def _visible(self) -> VisiblePages:
        return self.bookkeeping.visible_pages()


class DenseKVCache(KVCache):
    """Every step's keys are one token range of the store, read in place; slots move instead."""

    layout_name = "dense"
    records_steps = True  # one store, allocated once for the model's whole temporal range

    def __init__(self, bookkeeping: DenseTwoStreamCache, storage: DenseKV, backend: AttentionBackend):
        super().__init__(bookkeeping, storage, backend)

    def token_ranges(self, frame: int = -1) -> tuple[range, range]:
        """Store positions of a pending frame's special tokens and of its patch tokens: the two
        ranges a recorded step derives its write positions from."""
        return self.bookkeeping.token_ranges(frame)

    def take_over(self, other: DenseKVCache) -> None:
        """Slot for slot, from a cache of this geometry whose window slots may be fewer than this one's
        (a spare engine's): its bookkeeping, and its visible tokens copied into this store."""
        self.bookkeeping.take_over(other.bookkeeping)
        visible = self.bookkeeping.visible()
        self.storage.copy_tokens(other.storage, visible.start, visible.end)

    def _follow_bookkeeping(self) -> None:
        moves = self.bookkeeping.take_moves()
        if moves:
            self.storage.apply_moves(moves, self.bookkeeping)

    def _visible(self) -> VisibleRange:
        return self.bookkeeping.visible()


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
