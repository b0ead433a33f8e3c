"""Which keyframes loop detection indexes: a spacing rule, never the timing of the queue to the child.

A keyframe is *due* when at least `spacing` frames have passed since the last indexed one (the first
keyframe is always due). A due keyframe is indexed when the loop closer has room for it (the process:
fewer than `keyframes_in_flight` unanswered and `keyframes_waiting` waiting). When it has none, detection is not keeping up at this density: the
keyframe waits for the next one (it is not sent, and the next keyframe is due instead) and the spacing
doubles, at most once per indexed keyframe and up to `max_spacing`, so the density falls evenly over
the rest of the stream instead of by the drops of a full queue.

Pure bookkeeping (no clock, no I/O): the loop-closure process (process.py) asks it about each keyframe.

    spacing 4, a keyframe every frame, room everywhere but at frame 8:
    frame    0 . . . 4 . . . 8 . . . 12 . . . . . . . 20 . . . . . . . 28
    indexed  x       x       -       x                x                x
    (frame 8 is due and finds no room: the spacing becomes 8, counted from frame 4)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class IndexingRule:
    spacing: int  # frames from one indexed keyframe to the next, at the start
    max_spacing: int  # the most the spacing is lowered to when detection cannot keep up

    def __post_init__(self) -> None:
        if not 1 <= self.spacing <= self.max_spacing:
            raise ValueError(f"the indexing spacing must be between 1 and max_spacing ({self.max_spacing}), "
                             f"got {self.spacing}")


class IndexingSchedule:
    """The indexed keyframes' frames so far and the spacing in force; `offer` decides each keyframe."""

    def __init__(self, rule: IndexingRule) -> None:
        self.rule = rule
        self.spacing = rule.spacing
        self.indexed = 0
        self.deferred = 0  # due keyframes that found no room
        self.lowerings = 0  # how many times the spacing doubled
        self._last_indexed: int | None = None
        self._lowered_since_indexed = False
        self._first_frame: int | None = None
        self._last_frame: int | None = None
        self._longest_between = 0  # frames strictly between two consecutive indexed keyframes, at most
        self._before_first = 0  # frames seen before the first indexed keyframe

    def saw_frame(self, frame_index: int) -> None:
        """Any frame of the stream (keyframe or not), for the stretches at its start and end."""
        if self._first_frame is None or frame_index < self._first_frame:
            self._first_frame = frame_index
        if self._last_frame is None or frame_index > self._last_frame:
            self._last_frame = frame_index

    def is_due(self, frame_index: int) -> bool:
        return self._last_indexed is None or frame_index >= self._last_indexed + self.spacing

    def offer(self, frame_index: int, has_room: bool, may_lower: bool = True) -> bool:
        """Whether this keyframe is indexed. A due keyframe without room lowers the density (doubles the
        spacing) unless `may_lower` is False: a loop closer still starting up is not slow detection."""
        self.saw_frame(frame_index)
        if not self.is_due(frame_index):
            return False
        if not has_room:
            self.deferred += 1
            if may_lower and not self._lowered_since_indexed and self.spacing < self.rule.max_spacing:
                self.spacing = min(2 * self.spacing, self.rule.max_spacing)
                self._lowered_since_indexed = True
                self.lowerings += 1
            return False
        if self._last_indexed is None:
            self._before_first = frame_index - self._first_frame
        else:
            self._longest_between = max(self._longest_between, frame_index - self._last_indexed - 1)
        self._last_indexed = frame_index
        self._lowered_since_indexed = False
        self.indexed += 1
        return True

    @property
    def frames_seen(self) -> int:
        return 0 if self._first_frame is None else self._last_frame - self._first_frame + 1

    @property
    def longest_unindexed_stretch(self) -> int:
        """The most consecutive frames of the stream, so far, none of which is indexed."""
        if self._last_indexed is None:
            return self.frames_seen
        return max(self._before_first, self._longest_between, self._last_frame - self._last_indexed)

    def summary(self) -> dict[str, Any]:
        density = 100.0 * self.indexed / self.frames_seen if self.frames_seen else 0.0
        return {
            "index_spacing": {"start": self.rule.spacing, "end": self.spacing},
            "indexed_per_100_frames": round(density, 3),
            "longest_unindexed_stretch": self.longest_unindexed_stretch,
            "keyframes_deferred": self.deferred,
        }
