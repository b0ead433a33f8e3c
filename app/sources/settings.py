"""How a source is read, in the terms a run's options give it: which frames (FrameSelection), how long
to wait for a stream to answer and how long to reconnect a live one that drops.

Plain values, free of the decoding libraries, so that the options (and the flags built from them)
can be read without loading OpenCV or torch; app.sources applies them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_OPEN_TIMEOUT_S = 10.0
# A camera rebooting or a Wi-Fi roam takes seconds to tens of seconds; past this, the camera is gone.
DEFAULT_RECONNECT_S = 30.0
# Clockwise turns a frame may be given before the model sees it (`--rotate`), as the reference demo's
# --rotate_clockwise_90 gives one: a phone video recorded sideways, a camera mounted on its side.
ROTATIONS = (0, 90, 180, 270)


@dataclass(frozen=True)
class FrameSelection:
    """Which source frames are delivered. Applied in this order: start, stride, fps, max_frames.

    `fps` keeps the first frame at or after each tick of a 1/fps grid anchored at the first kept
    frame, so a 25 fps video at `fps=10` keeps frames at 0, 0.12, 0.2, 0.32, 0.4 s: ten a second on
    average, each one a real frame with its own timestamp.
    """

    start: int = 0  # first source frame to use
    stride: int = 1  # then every stride-th source frame
    fps: float | None = None  # then at most this many frames per second of source time
    max_frames: int | None = None  # stop after this many delivered frames

    def __post_init__(self) -> None:
        if self.start < 0:
            raise ValueError(f"--start must be >= 0, got {self.start}")
        if self.stride < 1:
            raise ValueError(f"--stride must be >= 1, got {self.stride}")
        if self.fps is not None and not (self.fps > 0 and math.isfinite(self.fps)):
            raise ValueError(f"--fps must be a positive number, got {self.fps}")
        if self.max_frames is not None and self.max_frames < 1:
            raise ValueError(f"--max-frames must be >= 1, got {self.max_frames}")

    def estimate_count(self, source_frames: int | None, source_fps: float | None) -> int | None:
        """How many frames a source of `source_frames` frames at `source_fps` yields (None: unknown)."""
        if source_frames is None:
            return self.max_frames
        count = math.ceil(max(0, source_frames - self.start) / self.stride)
        if self.fps is not None and source_fps:
            count = math.ceil(count * min(1.0, self.fps * self.stride / source_fps))
        return count if self.max_frames is None else min(count, self.max_frames)


class Sampler:
    """Applies a FrameSelection to a sequence of (source index, timestamp), frame by frame (the reader
    thread's)."""

    # Timestamps in milliseconds carry float noise (0.12 s may read 0.11999999); a frame that sits
    # on a tick must not slip into the previous one.
    _TICK_EPS = 1e-6

    def __init__(self, selection: FrameSelection) -> None:
        self._selection = selection
        self._delivered = 0
        self._grid_origin: float | None = None
        self._last_tick = -1

    @property
    def done(self) -> bool:
        limit = self._selection.max_frames
        return limit is not None and self._delivered >= limit

    def accept(self, source_index: int, timestamp: float) -> bool:
        selection = self._selection
        if source_index < selection.start or (source_index - selection.start) % selection.stride:
            return False
        if selection.fps is not None:
            if self._grid_origin is None:
                self._grid_origin = timestamp
            tick = math.floor((timestamp - self._grid_origin) * selection.fps + self._TICK_EPS)
            if tick <= self._last_tick:
                return False
            self._last_tick = tick
        self._delivered += 1
        return True
