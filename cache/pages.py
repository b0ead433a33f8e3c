"""Page-id bookkeeping for the two-stream KV cache. Pure Python: no tensors live here."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .layout import CacheCapacityError

# Pages a pool adds when it runs out: in steps, so that the storage behind the ids is re-allocated rarely
# (`pages_to_hold` says where the steps end; the host estimate of a CPU run asks it).
POOL_GROWTH_PAGES = 16


class PagePool:
    """Page ids and a free list, like vLLM's block pool without hashing or ref counts.

    Ids are dense integers [0, num_pages). The pool grows instead of failing: the backend that owns
    the physical pages reads `num_pages` before writing and enlarges its storage to match. With
    `max_pages` it grows up to that many pages and no further (a memory budget's limit).
    """

    def __init__(self, num_pages: int, grow_by: int = POOL_GROWTH_PAGES, max_pages: int | None = None):
        if num_pages < 1 or grow_by < 1:
            raise ValueError(f"a page pool needs at least one page and a positive growth step, got {num_pages}, {grow_by}")
        if max_pages is not None:
            num_pages = min(num_pages, max_pages)
        self.num_pages = num_pages
        self.grow_by = grow_by
        self.max_pages = max_pages
        self._free: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def require(self, count: int) -> None:
        """Raise CacheCapacityError unless `count` more pages can be handed out (growing if need
        be), so that a caller can check before it changes anything."""
        if self.max_pages is not None and count > self.num_free + self.max_pages - self.num_pages:
            raise CacheCapacityError(f"the K/V cache needs {count} more pages but is at its limit of {self.max_pages}; "
                                     "start a fresh cache (chunked streaming)")

    def pages_to_hold(self, count: int) -> int:
        """The pages this pool holds once `count` pages have been in use at once: grown in `grow_by`
        steps as `allocate` grows it, up to `max_pages`. Asks without changing the pool."""
        if count <= self.num_pages:
            return self.num_pages
        grown = self.num_pages + self.grow_by * -(-(count - self.num_pages) // self.grow_by)
        return grown if self.max_pages is None else min(grown, self.max_pages)

    def allocate(self) -> int:
        if not self._free:
            self.require(1)
            grow = self.grow_by if self.max_pages is None else min(self.grow_by, self.max_pages - self.num_pages)
            self._free.extend(range(self.num_pages, self.num_pages + grow))
            self.num_pages += grow
        return self._free.popleft()

    def free(self, page_id: int) -> None:
        # Freed pages go to the front: the most recently used page is reused first, which keeps the
        # set of touched pages small (and lets a rolled-back page come straight back).
        self._free.appendleft(page_id)

    def free_ids(self) -> list[int]:
        return list(self._free)


@dataclass(frozen=True)
class VisiblePages:
    """What one attention step reads, in key order: scale | window | special.

    Every page is full except the last, which holds `last_page_len` tokens (FlashInfer's paged
    layout). Patch pages hold exactly one frame's patch tokens; special pages hold the 6 special
    tokens of consecutive frames packed back to back, so a frame's specials may straddle two pages.
    """

    page_ids: tuple[int, ...]
    last_page_len: int
    page_size: int
    num_scale_pages: int
    num_window_pages: int
    num_special_pages: int
    num_special_tokens: int

    @property
    def num_tokens(self) -> int:
        if not self.page_ids:
            return 0
        return (len(self.page_ids) - 1) * self.page_size + self.last_page_len
