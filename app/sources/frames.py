"""What a source delivers, a `Frame`, and the error it says a source cannot be read with: plain values, free of
the decoding libraries, so that a command reports a source's error without loading OpenCV.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class SourceError(ValueError):
    """The source cannot be read: what is wrong with it and what to do instead."""


class TruncatedSourceError(SourceError):
    """A file ended before its header said it would; the frames before the damage were delivered."""

    def __init__(self, message: str, frames_decoded: int, frames_expected: int) -> None:
        super().__init__(message)
        self.frames_decoded = frames_decoded
        self.frames_expected = frames_expected


@dataclass(frozen=True)
class Frame:
    """One delivered frame."""

    index: int  # position among the delivered frames, from 0
    source_index: int  # position in the source (decoded frame number, file number)
    timestamp: float  # seconds: video PTS, file order / fps, or time since a live source opened
    # [H, W, 3] uint8, RGB, upright; None when the source preprocesses (a 4K frame is 25 MB, and the
    # queue would hold eight of them for nothing)
    rgb: np.ndarray | None
    image: np.ndarray | None = None  # [3, H', W'] uint8 model input, when the source preprocesses
