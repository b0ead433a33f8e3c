"""The two-stream KV cache's shape (CacheLayout), its page ids (PagePool) and what one step reads (VisiblePages).
Pure Python: no tensors live here."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


class CacheCapacityError(ValueError):
    """A request the cache cannot serve with the limits it was given."""


@dataclass(frozen=True)
class CacheLayout:
    # Every count is the caller's (the model's tokens, the stream's frame counts): the cache keeps no
    # defaults of its own for them.
    patches_per_frame: int  # one patch page holds exactly one frame's patches
    specials_per_frame: int
    scale_frames: int
    window_frames: int
    # Window frames the cache holds pages for: None, as many as the window holds. Fewer only for a stream
    # known to hand its frames over before it fills them (a chunk's spare engine): its pool then holds no
    # more pages, and an append past them is refused instead of evicting early (the window is not full).
    window_slots: int | None = None

    def __post_init__(self):
        if self.patches_per_frame < 1 or self.specials_per_frame < 0:
            raise ValueError(f"bad token counts per frame: {self.patches_per_frame} patches, {self.specials_per_frame} specials")
        if self.scale_frames < 1 or self.window_frames < 1:
            raise ValueError(
                f"scale_frames and window_frames must be >= 1, got {self.scale_frames} and {self.window_frames}"
            )
        if self.window_slots is not None and not 1 <= self.window_slots <= self.window_frames:
            raise ValueError(f"window_slots must be between 1 and window_frames={self.window_frames}, "
                             f"got {self.window_slots}")

    @property
    def allocated_window_slots(self) -> int:
        """Window frames the cache holds pages for."""
        return self.window_frames if self.window_slots is None else self.window_slots

    @property
    def page_size(self) -> int:
        return self.patches_per_frame

    @property
    def tokens_per_frame(self) -> int:
        return self.specials_per_frame + self.patches_per_frame

    @property
    def max_patch_pages(self) -> int:
        """Patch pages that can be in use at once: scale + window + one appended before eviction; a window held
        in fewer pages (window_slots) never fills, so never evicts: scale + those pages."""
        if self.allocated_window_slots < self.window_frames:
            return self.scale_frames + self.allocated_window_slots
        return self.scale_frames + self.window_frames + 1


# Pages a pool adds when it runs out: in steps, so that the storage behind the ids is re-allocated rarely
# (`pages_to_hold` says where the steps end; the host estimate of a CPU run asks it).
POOL_GROWTH_PAGES = 16


class PagePool:
    """Page ids and a free list, like vLLM's block pool without hashing or ref counts.

    Ids are dense integers [first_id, first_id + num_pages): first_id is 0 but for a pool over the block of
    pages that another pool's storage holds past its own (a chunk's spare engine takes its pages so). The
    pool grows instead of failing: the storage that owns the physical pages reads `num_pages` before
    writing and enlarges itself to match. With `max_pages` it grows up to that many pages and no further (a
    memory budget's limit, or a GPU pool allocated whole).

    A page freed goes to the front of the free list and is handed out first (a rolled-back frame's page
    comes straight back). `allocate(after=p)` hands out page p + 1 where it is free: a stream's pages then
    lie side by side, so that the range kernel reads them as a few long runs of keys (VisiblePages.runs);
    `allocate(last=True)` takes from the back of the free list instead, away from the pages taken from the front.
    """

    def __init__(self, num_pages: int, grow_by: int = POOL_GROWTH_PAGES, max_pages: int | None = None,
                 first_id: int = 0):
        if num_pages < 1 or grow_by < 1 or first_id < 0:
            raise ValueError(f"a page pool needs at least one page, a positive growth step and ids from 0 up, got "
                             f"{num_pages}, {grow_by}, {first_id}")
        if max_pages is not None:
            num_pages = min(num_pages, max_pages)
        self.first_id = first_id
        self.num_pages = num_pages
        self.grow_by = grow_by
        self.max_pages = max_pages
        # (an ordered dict: pop from the front, free to the front, and take one page by id, each O(1))
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(first_id, first_id + num_pages))

    @property
    def end_id(self) -> int:
        """One past the pool's last id."""
        return self.first_id + self.num_pages

    @property
    def whole(self) -> bool:
        """Holds every page it may ever hand out: it never grows, so the storage behind it never moves."""
        return self.num_pages == self.max_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

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

    def allocate(self, after: int | None = None, last: bool = False) -> int:
        """A free page: `after + 1` where that one is free, else the front (`last`: the back) of the free list."""
        if not self._free:
            self.require(1)
            grow = self.grow_by if self.max_pages is None else min(self.grow_by, self.max_pages - self.num_pages)
            self._free.update(OrderedDict.fromkeys(range(self.end_id, self.end_id + grow)))
            self.num_pages += grow
        if after is not None and after + 1 in self._free:
            del self._free[after + 1]
            return after + 1
        return self._free.popitem(last=last)[0]

    def free(self, page_id: int, last: bool = False) -> None:
        """Page `page_id` back to the front of the free list (`last`: to its back, where `allocate(last=True)`
        takes it again)."""
        if page_id in self._free or not self.first_id <= page_id < self.end_id:
            raise ValueError(f"page {page_id} is not in use in this pool of {self.num_pages}")
        self._free[page_id] = None
        self._free.move_to_end(page_id, last=last)

    def free_in_order(self) -> list[int]:
        """The free ids in the order `allocate` hands them out (a cache taking over another's pages keeps it)."""
        return list(self._free)

    def sort_free(self) -> None:
        """The free list in id order: an emptied cache starts again from its lowest pages, side by side."""
        self._free = OrderedDict.fromkeys(sorted(self._free))

    def take(self, page_ids: list[int], free_first: list[int]) -> None:
        """Hand out exactly `page_ids` (free ones; the pool grows to hold them, up to its limit), then order the
        free list: `free_first`'s free ids first, in that order, the rest as they were. A cache taking over
        another's pages keeps them where they were, and the free list that cache's next frames would find."""
        needed = max(page_ids, default=self.first_id - 1) + 1 - self.first_id
        if needed > self.num_pages:
            if self.max_pages is not None and needed > self.max_pages:
                raise CacheCapacityError(f"page {self.first_id + needed - 1} is past this pool's limit of "
                                         f"{self.max_pages}")
            self._free.update(OrderedDict.fromkeys(range(self.end_id, self.first_id + needed)))
            self.num_pages = needed
        if any(page not in self._free for page in page_ids):
            raise ValueError("pages handed out already cannot be taken")
        for page in page_ids:
            del self._free[page]
        for page in reversed([page for page in free_first if page in self._free]):
            self._free.move_to_end(page, last=False)


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

    def runs(self) -> tuple[tuple[int, int], ...]:
        """The visible tokens as runs (first token row, tokens) of the pages' storage, token row = page *
        page_size + offset: each page's tokens, pages next to each other in the storage merged into one run.

        Softmax attention over a set of keys does not depend on their order, so the pages are taken in id
        order: a window recycled oldest first (a ring over its pages) and the scale pages beside it then
        read as one or two runs instead of one run per frame. A partial page (the last special page) ends
        its run: the rows past its tokens belong to no key.

        ```
        page_ids (7, 8, 2, 3, 4, 9), page_size 4, last_page_len 2  ->  rows [8, 20) and [28, 38)
        sorted: 2 3 4 | 7 8 9 (partial: 2 tokens)                   ->  runs (8, 12), (28, 10)
        ```
        """
        if not self.page_ids:
            return ()
        size = self.page_size
        last = self.page_ids[-1]
        runs: list[list[int]] = []
        for page in sorted(self.page_ids):
            length = self.last_page_len if page == last else size
            if runs and runs[-1][0] + runs[-1][1] == page * size and runs[-1][1] % size == 0:
                runs[-1][1] += length
            else:
                runs.append([page * size, length])
        return tuple((start, length) for start, length in runs)
