"""Bookkeeping of the dense layout: the two streams placed so that the visible keys are ONE range.

The paged layout (two_stream.py) lets any page hold any frame, so a kernel must follow a page
table. Here the same two streams are placed so that every step's key set is the contiguous token
range [start, end) of one store per layer, which a dense attention kernel reads in place:

```
 token 0                        special_capacity                                         capacity
 | ...free... | specials, newest first | scale slots | window slots (compact) | spare slot |
              ^ start                                                          ^ end (spare in use)
```

Specials (6 per live frame) grow downward from `special_capacity`; frame slots hold one frame's
patch tokens each. The window slots stay compact: evicting a window frame moves the newest frame
into the hole. Moves are data copies that the owner of the tensors makes (`take_moves`) before
the step writes new K/V. A rollback restores the exact previous state, data included: a frame
evicted by a not-yet-committed append is first saved in the spare slot.

Restriction against the paged cache: one step appends either scale frames only, or a single
window frame (the engine's patterns).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .layout import CacheCapacityError, CacheLayout


@dataclass(frozen=True)
class VisibleRange:
    """The key set of one step: tokens [start, end) of every layer's store; special tokens are
    [start, patch_start), patch tokens [patch_start, end)."""

    start: int
    end: int
    patch_start: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SlotMove:
    """Copy frame slot `source` onto frame slot `target` (all layers, K and V)."""

    source: int
    target: int


@dataclass
class _PendingWindowFrame:
    slot: int
    deferred: bool
    # A non-deferred append at a full window took the oldest frame's slot; that frame waits in the
    # spare slot until the commit.
    replaced_oldest: bool = False


class DenseTwoStreamCache:
    def __init__(self, layout: CacheLayout, max_frames: int):
        """`max_frames`: the most frames whose special tokens can be live at once (the model's
        temporal RoPE range bounds it)."""
        self.layout = layout
        self.max_frames = max_frames
        self.special_capacity = layout.specials_per_frame * max_frames
        self.num_frame_slots = layout.scale_frames + layout.allocated_window_slots + 1  # the last is the spare
        self.reset()

    # -- geometry --------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.special_capacity + self.num_frame_slots * self.layout.patches_per_frame

    @property
    def spare_slot(self) -> int:
        return self.num_frame_slots - 1

    def slot_tokens(self, slot: int) -> range:
        """Token positions of frame slot `slot` in the store."""
        first = self.special_capacity + slot * self.layout.patches_per_frame
        return range(first, first + self.layout.patches_per_frame)

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_pending_frames(self) -> int:
        return self._num_pending_scale + (1 if self._pending_window else 0)

    @property
    def num_committed_frames(self) -> int:
        return self._num_special_frames - self.num_pending_frames

    @property
    def num_scale_frames(self) -> int:
        return self._num_scale

    @property
    def num_patch_frames(self) -> int:
        return self._num_scale + len(self._window)

    @property
    def num_special_tokens(self) -> int:
        return self._num_special_frames * self.layout.specials_per_frame

    def visible(self) -> VisibleRange:
        start = self.special_capacity - self.num_special_tokens
        end = self.special_capacity + self.num_patch_frames * self.layout.patches_per_frame
        return VisibleRange(start, end, self.special_capacity)

    def token_ranges(self, frame: int = -1) -> tuple[range, range]:
        """Store positions of a pending frame's special tokens and of its patch tokens: two ranges."""
        index, slot = self._pending_order()[frame]
        specials = self.layout.specials_per_frame
        first = self.special_capacity - (index + 1) * specials
        return range(first, first + specials), self.slot_tokens(slot)

    def token_slots(self, frame: int = -1) -> list[int]:
        """Store positions of a pending frame's tokens in model order (specials, then patches)."""
        specials, patches = self.token_ranges(frame)
        return list(specials) + list(patches)

    def take_moves(self) -> list[SlotMove]:
        """Copies the store must make now, in order, before this step writes its K/V (the paged
        layout has no such method: its pages never move)."""
        moves, self._moves = self._moves, []
        return moves

    # -- updates ---------------------------------------------------------------------------
    def append(self, defer_eviction: bool = False) -> None:
        """Add one pending frame (see PagedTwoStreamCache.append for the eviction semantics)."""
        if self._pending_window is not None:
            raise ValueError("the dense layout takes one pending window frame per step; commit or roll back first")
        if self._num_special_frames >= self.max_frames:
            raise CacheCapacityError(
                f"the cache holds special tokens for {self.max_frames} frames; start a fresh cache (chunked streaming)"
            )
        pinned = self._num_scale < self.layout.scale_frames
        if not pinned and self._num_pending_scale:
            raise ValueError("a step that appends scale frames cannot also append window frames in the dense layout")
        if not pinned and len(self._window) == self.layout.allocated_window_slots < self.layout.window_frames:
            raise CacheCapacityError(
                f"the cache allocated {self.layout.allocated_window_slots} of the window's {self.layout.window_frames} "
                "frame slots, and they are all in use; a stream that fills its window needs them all"
            )
        self._num_special_frames += 1
        if pinned:
            self._num_scale += 1
            self._num_pending_scale += 1
        else:
            self._append_window_frame(defer_eviction)

    def _append_window_frame(self, deferred: bool) -> None:
        full = len(self._window) >= self.layout.window_frames
        if not full:
            slot = self._window_base + len(self._window)
            self._window.append(slot)
            self._pending_window = _PendingWindowFrame(slot, deferred)
        elif deferred:  # the window grows by one until the decision: the new frame takes the spare
            self._window.append(self.spare_slot)
            self._pending_window = _PendingWindowFrame(self.spare_slot, deferred)
        else:  # evict now; the oldest frame's data waits in the spare in case of a rollback
            slot = self._window.popleft()
            self._moves.append(SlotMove(slot, self.spare_slot))
            self._window.append(slot)
            self._pending_window = _PendingWindowFrame(slot, deferred, replaced_oldest=True)

    def commit(self) -> None:
        pending = self._pending_window
        if pending is not None and pending.deferred and len(self._window) > self.layout.window_frames:
            # Evict the oldest and move the new frame (in the spare) into its slot: compact again.
            hole = self._window.popleft()
            slot = self._window.pop()
            assert slot == self.spare_slot
            self._moves.append(SlotMove(self.spare_slot, hole))
            self._window.append(hole)
        self._num_pending_scale = 0
        self._pending_window = None

    def rollback(self) -> None:
        pending = self._pending_window
        if pending is not None:
            self._window.pop()
            if pending.replaced_oldest:
                self._moves.append(SlotMove(self.spare_slot, pending.slot))
                self._window.appendleft(pending.slot)
        self._num_special_frames -= self.num_pending_frames
        self._num_scale -= self._num_pending_scale
        self._num_pending_scale = 0
        self._pending_window = None

    def take_over(self, other: DenseTwoStreamCache) -> None:
        """Hold what `other` holds, slot for slot (the store's data is copied by its owner): a cache of
        the same geometry but for the window slots, with nothing pending and all of its window frames
        in slots this one has."""
        if (other.layout.patches_per_frame, other.layout.specials_per_frame, other.layout.scale_frames,
                other.special_capacity) != (self.layout.patches_per_frame, self.layout.specials_per_frame,
                                            self.layout.scale_frames, self.special_capacity):
            raise ValueError("a cache takes over only from one of its own geometry (tokens per frame, scale "
                             "frames, special tokens)")
        if other.num_pending_frames or other._moves:
            raise ValueError("a cache takes over committed frames only: commit or roll back first")
        if any(slot >= self.spare_slot for slot in other._window) or len(other._window) > self.layout.window_frames:
            raise ValueError(f"{len(other._window)} window frames do not fit this cache's "
                             f"{self.layout.window_frames}-frame window")
        self.reset()
        self._num_scale = other._num_scale
        self._num_special_frames = other._num_special_frames
        self._window = deque(other._window)

    def reset(self) -> None:
        self._num_scale = 0
        self._num_pending_scale = 0
        self._num_special_frames = 0
        self._window: deque[int] = deque()  # slots of the window frames, oldest first
        self._pending_window: _PendingWindowFrame | None = None
        self._moves: list[SlotMove] = []

    # -- internals -------------------------------------------------------------------------
    @property
    def _window_base(self) -> int:
        return self.layout.scale_frames

    def _pending_order(self) -> list[tuple[int, int]]:
        """(special index, frame slot) of each pending frame, oldest first."""
        if self._pending_window is not None:
            return [(self._num_special_frames - 1, self._pending_window.slot)]
        first = self._num_scale - self._num_pending_scale
        return [(self._num_special_frames - self._num_pending_scale + i, first + i) for i in range(self._num_pending_scale)]
