"""Bookkeeping of the paged two-stream KV cache (spec MODEL.md §5, §9.2).

Stream 1, patch tokens: one page per frame. The first `scale_frames` pages are pinned (anchor
frames); later pages form a sliding window of `window_frames` pages recycled oldest-first.
Stream 2, special tokens: the 6 special tokens (camera, 4 registers, scale) of every frame ever
committed, packed back to back into append-only pages: the trajectory memory.

A frame is appended as *pending* (a draft): it is visible to the step that appended it, and then
either committed or rolled back. Rollback restores the cache exactly as it was before the append,
including any window page the append evicted, so a rejected frame leaves no trace. Eviction and
rollback edit the page tables only: no key is ever copied or moved.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .pages import CacheCapacityError, CacheLayout, PagePool, VisiblePages

# Pages a new pool holds for the special stream beside its patch pages: a page takes the special tokens of
# page_size / 6 frames, and the pool grows when these fill.
SPECIAL_PAGES_AT_START = 2


@dataclass
class _PendingFrame:
    patch_page: int
    pinned: bool  # went to the scale pages
    specials_before: int  # special-token count before this frame
    special_pages_before: int
    deferred: bool  # eviction postponed to commit
    evicted: list[int] = field(default_factory=list)  # window pages this append pushed out, oldest first


class PagedTwoStreamCache:
    """Page tables of the two streams. Knows nothing about tensors, images or keyframe policies."""

    def __init__(self, layout: CacheLayout, pool: PagePool | None = None):
        self.layout = layout
        self.pool = pool or PagePool(layout.max_patch_pages + SPECIAL_PAGES_AT_START)
        self.scale_pages: list[int] = []
        self.window_pages: deque[int] = deque()
        self.special_pages: list[int] = []
        self.num_special_tokens = 0
        self.num_committed_frames = 0
        self._pending: list[_PendingFrame] = []

    @staticmethod
    def pages_needed(layout: CacheLayout, max_frames: int) -> int:
        """Pages a stream whose live frames never exceed `max_frames` can hold at once: every patch
        page that can be in use (scale, window, one pending) and the special tokens of them all."""
        return layout.max_patch_pages + -(-layout.specials_per_frame * max_frames // layout.page_size)

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_pending_frames(self) -> int:
        return len(self._pending)

    @property
    def num_patch_frames(self) -> int:
        """Frames whose patch tokens are visible: scale + window (pending included)."""
        return len(self.scale_pages) + len(self.window_pages)

    def frame_slots(self, frame: int = -1) -> tuple[list[int], int]:
        """Where a pending frame's tokens go: the flat slots (page_id * page_size + offset) of its special
        tokens, which may straddle two special pages, and the first slot of its patch page (the patches
        follow it in order)."""
        pending = self._pending[frame]
        size = self.layout.page_size
        first = pending.specials_before
        specials = [
            self.special_pages[i // size] * size + i % size
            for i in range(first, first + self.layout.specials_per_frame)
        ]
        return specials, pending.patch_page * size

    def token_slots(self, frame: int = -1) -> list[int]:
        """Flat slots of a pending frame's tokens, in token order: its specials first, then its patches
        (the model's per-frame token order)."""
        specials, patch_start = self.frame_slots(frame)
        return specials + list(range(patch_start, patch_start + self.layout.page_size))

    def visible_pages(self) -> VisiblePages:
        """The key set of the current step, pending frames included.

        ```
        | scale pages (pinned) | window pages, oldest first | special pages (packed 6 per frame) |
        | s0 s1 .. s7          | w0 w1 .. w63               | [f0 f0 .. f1 f1 ..] [.. fN fN  ]   |
                                                                               last_page_len ^
        ```
        """
        size = self.layout.page_size
        page_ids = tuple(self.scale_pages) + tuple(self.window_pages) + tuple(self.special_pages)
        if self.special_pages:
            last_page_len = self.num_special_tokens - (len(self.special_pages) - 1) * size
        else:
            last_page_len = size  # the last page is a (full) patch page
        return VisiblePages(
            page_ids=page_ids,
            last_page_len=last_page_len,
            page_size=size,
            num_scale_pages=len(self.scale_pages),
            num_window_pages=len(self.window_pages),
            num_special_pages=len(self.special_pages),
            num_special_tokens=self.num_special_tokens,
        )

    # -- updates ---------------------------------------------------------------------------
    def append(self, defer_eviction: bool = False) -> None:
        """Add one pending frame: a patch page and 6 special slots.

        Without deferral the window is trimmed right away (so the frame sees window_frames - 1 older
        frames); with deferral it is trimmed at commit (the frame sees window_frames older frames).
        A pool at its limit raises CacheCapacityError before anything changes.
        """
        size = self.layout.page_size
        pinned = len(self.scale_pages) < self.layout.scale_frames
        layout = self.layout
        if not pinned and len(self.window_pages) == layout.allocated_window_slots < layout.window_frames:
            raise CacheCapacityError(
                f"the cache holds pages for {layout.allocated_window_slots} of the window's {layout.window_frames} "
                "frames, and they are all in use; a stream that fills its window needs them all")
        new_special_pages = -(-(self.num_special_tokens + self.layout.specials_per_frame) // size) - len(self.special_pages)
        self.pool.require(1 + new_special_pages)
        page = self.pool.allocate(after=self._newest_patch_page())
        pending = _PendingFrame(
            patch_page=page,
            pinned=pinned,
            specials_before=self.num_special_tokens,
            special_pages_before=len(self.special_pages),
            deferred=defer_eviction,
        )
        (self.scale_pages.append if pinned else self.window_pages.append)(page)
        self._append_specials()
        if not defer_eviction:
            pending.evicted = self._trim_window()
        self._pending.append(pending)

    def commit(self) -> None:
        """Make every pending frame permanent and recycle the window pages they pushed out."""
        for pending in self._pending:
            for page in pending.evicted:
                self.pool.free(page)
        self.num_committed_frames += len(self._pending)
        self._pending.clear()
        for page in self._trim_window():
            self.pool.free(page)

    def rollback(self) -> None:
        """Undo every pending frame, newest first, as if it had never been appended."""
        while self._pending:
            pending = self._pending.pop()
            for page in reversed(pending.evicted):
                self.window_pages.appendleft(page)
            popped = self.scale_pages.pop() if pending.pinned else self.window_pages.pop()
            assert popped == pending.patch_page, "pending frames must be undone in reverse order"
            self.pool.free(pending.patch_page)
            while len(self.special_pages) > pending.special_pages_before:
                self.pool.free(self.special_pages.pop(), last=True)
            self.num_special_tokens = pending.specials_before

    def reset(self) -> None:
        """Forget every frame; pages go back to the pool (the pool keeps its size), in id order."""
        self.rollback()
        for page in [*self.scale_pages, *self.window_pages, *self.special_pages]:
            self.pool.free(page)
        self.pool.sort_free()
        self.scale_pages.clear()
        self.window_pages.clear()
        self.special_pages.clear()
        self.num_special_tokens = 0
        self.num_committed_frames = 0

    def take_over(self, other: PagedTwoStreamCache) -> list[tuple[int, int]]:
        """Hold what `other` (a cache of this geometry over a pool of its own, nothing pending) holds, page for
        page: this cache's frames are dropped and a page of this pool taken for each of `other`'s. Returns the
        copies its storage must make, (page of `other`'s pool, page of this one), in order. The two pools may
        index one storage (a spare's pool over the block past this one's): their ids never meet.

        The pages keep their places: a patch page the same distance from its pool's first id, a special page the
        same distance from the pool's end (special pages come from the back of the free list), and the free list
        the same order. A stream
        that rolls over ahead (a spare's cache taking the next chunk's first frames, this one taking them over)
        then holds its keys as one that rolled over in place would, in the same runs of rows, and the range
        kernel sums them in the same order: the same results, bit for bit. Where the places do not fit this
        pool, the pages are taken anew, side by side (the same keys, summed in another order)."""
        mine, theirs = self.layout, other.layout
        if (mine.patches_per_frame, mine.specials_per_frame, mine.scale_frames) != (
                theirs.patches_per_frame, theirs.specials_per_frame, theirs.scale_frames):
            raise ValueError("a cache takes over only from one of its own geometry (tokens per frame, scale frames)")
        if other.num_pending_frames:
            raise ValueError("a cache takes over committed frames only: commit or roll back first")
        if len(other.window_pages) > mine.allocated_window_slots:
            raise ValueError(f"{len(other.window_pages)} window frames do not fit this cache's "
                             f"{mine.allocated_window_slots} window pages")
        self.reset()
        self.pool.require(len(other.scale_pages) + len(other.window_pages) + len(other.special_pages))
        places = self._places_of(other)
        if places is None:
            return self._take_anew(other)
        patches = [*other.scale_pages, *other.window_pages]
        self.pool.take([places[page] for page in patches + other.special_pages],
                       free_first=[places[page] for page in other.pool.free_in_order() if page in places])
        self.scale_pages = [places[page] for page in other.scale_pages]
        self.window_pages = deque(places[page] for page in other.window_pages)
        self.special_pages = [places[page] for page in other.special_pages]
        self._adopt_counts(other)
        return [(page, places[page]) for page in patches + other.special_pages]

    def _places_of(self, other: PagedTwoStreamCache) -> dict[int, int] | None:
        """Where each of `other`'s pages goes in this pool (its free ones too: a patch page's place from the
        pool's first id, a special page's distance from the end kept), or None where two would land on one page
        or past this pool's limit."""
        mine, theirs = self.pool, other.pool
        limit = mine.max_pages if mine.max_pages is not None else max(mine.num_pages, theirs.num_pages)
        shift = max(mine.num_pages, theirs.num_pages) - theirs.num_pages
        special = set(other.special_pages)
        # (by place in each pool: the pools' ids may start elsewhere)
        places = {page: mine.first_id + page - theirs.first_id + (shift if page in special else 0)
                  for page in range(theirs.first_id, theirs.end_id)}
        used = [places[page] for page in [*other.scale_pages, *other.window_pages, *other.special_pages]]
        if len(set(used)) != len(used) or max(used, default=mine.first_id - 1) >= mine.first_id + limit:
            return None
        return places

    def _take_anew(self, other: PagedTwoStreamCache) -> list[tuple[int, int]]:
        copies = []
        for source, target in ((other.scale_pages, self.scale_pages), (other.window_pages, self.window_pages)):
            for page in source:
                target.append(self.pool.allocate(after=self._newest_patch_page()))
                copies.append((page, target[-1]))
        for page in other.special_pages:
            self._add_special_page()
            copies.append((page, self.special_pages[-1]))
        self._adopt_counts(other)
        return copies

    def _adopt_counts(self, other: PagedTwoStreamCache) -> None:
        self.num_special_tokens = other.num_special_tokens
        self.num_committed_frames = other.num_committed_frames

    def _newest_patch_page(self) -> int | None:
        if self.window_pages:
            return self.window_pages[-1]
        return self.scale_pages[-1] if self.scale_pages else None

    def _append_specials(self) -> None:
        size = self.layout.page_size
        self.num_special_tokens += self.layout.specials_per_frame
        while len(self.special_pages) * size < self.num_special_tokens:
            self._add_special_page()

    def _add_special_page(self) -> None:
        # From the back of the free list: the patch pages, taken from the front, stay side by side.
        after = self.special_pages[-1] if self.special_pages else None
        self.special_pages.append(self.pool.allocate(after=after, last=True))

    def _trim_window(self) -> list[int]:
        evicted = []
        while len(self.window_pages) > self.layout.window_frames:
            evicted.append(self.window_pages.popleft())
        return evicted
