"""The decoders behind a FrameSource (reader.py), one a kind of source: an OpenCV capture (a video file, a
webcam, a network stream), an image folder, any iterable of frames; each what the reader thread needs of a
source (reader.py's `Reader`: cheap skipping, then decoding of the kept frames), used by the reader thread
only, after open_source (opening.py) returns. And `frames_source`, a source over any iterable.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Literal

import cv2
import numpy as np

from stream_recon.app.sources.frames import SourceError, TruncatedSourceError
from stream_recon.app.sources.preprocess import ImageReadError, load_image, upright_rgb
from stream_recon.app.sources.preprocessing_pool import POOL_FROM_PIXELS, PREPROCESS_WORKERS
from stream_recon.app.sources.reader import (
    DEFAULT_FRAME_TIMEOUT_S,
    DEFAULT_QUEUE_SIZE,
    FrameSource,
)
from stream_recon.app.sources.settings import FrameSelection

# A container's frame count can be an estimate (duration x rate); only a clear shortfall means damage.
_TRUNCATION_SLACK_FRAMES = 2


def frames_source(
    frames: Iterable[tuple[np.ndarray, float]],
    selection: FrameSelection | None = None,
    *,
    name: str = "frames",
    live: bool = False,
    length: int | None = None,
    image_width: int | None = None,
    frame_timeout_s: float = DEFAULT_FRAME_TIMEOUT_S,
    queue_size: int = DEFAULT_QUEUE_SIZE,
    preprocess_workers: int = PREPROCESS_WORKERS,
    pool_from_pixels: int = POOL_FROM_PIXELS,
) -> FrameSource:
    """A source over any iterable of (rgb [H, W, 3] uint8, timestamp in seconds), e.g. a generator.

    The iterable is consumed in the reader thread, one item at a time, like any other source. A
    length is taken from `len(frames)` when the iterable has one.
    """
    selection = selection or FrameSelection()
    if length is None and hasattr(frames, "__len__"):
        length = len(frames)  # type: ignore[arg-type]
    return FrameSource(
        IterableReader(frames, name),
        kind="frames",
        description=f"frame sequence {name}",
        name=name,
        selection=selection,
        estimated_length=selection.estimate_count(length, None),
        live=live,
        image_width=image_width,
        queue_size=queue_size,
        frame_timeout_s=frame_timeout_s,
        preprocess_workers=preprocess_workers,
        pool_from_pixels=pool_from_pixels,
    )

def check_same_size(first: Path, first_size: tuple[int, int], path: Path, size: tuple[int, int]) -> None:
    if size != first_size:
        raise SourceError(
            f"images in {path.parent} have different sizes: {first.name} is "
            f"{first_size[0]}x{first_size[1]} but {path.name} is {size[0]}x{size[1]}; "
            "a sequence must come from one camera at one resolution"
        )


class CaptureReader:
    """OpenCV capture: a video file, a webcam or a network stream."""

    def __init__(
        self,
        capture: cv2.VideoCapture,
        *,
        label: str,
        clock: Literal["pts", "wall"],
        expected_frames: float | None,
        reopen: Callable[[float], cv2.VideoCapture] | None = None,  # timeout_s -> a new capture
        shortfall_cause: str = "the file is truncated or damaged",
    ) -> None:
        self._capture = capture
        self._reopen = reopen
        self._shortfall_cause = shortfall_cause
        self._label = label
        self._clock = clock
        self._expected_frames = int(expected_frames) if expected_frames else None
        self._peeked = False
        self._opened_at = time.monotonic()
        self._wall_timestamp = 0.0

    def peek(self, failure_message: str | Callable[[], str]) -> None:
        """Decode the first frame now, so a source that opens but never yields fails at open time.
        failure_message: the error, or a function that finds out what it is (only called on failure)."""
        if not self._capture.grab():
            self.release()
            raise SourceError(failure_message if isinstance(failure_message, str) else failure_message())
        self._opened_at = time.monotonic()
        self._wall_timestamp = 0.0
        self._peeked = True

    def grab(self) -> bool:
        if self._peeked:
            self._peeked = False
            return True
        grabbed = self._capture.grab()
        self._wall_timestamp = time.monotonic() - self._opened_at
        return grabbed

    def timestamp(self) -> float:
        if self._clock == "wall":
            return self._wall_timestamp
        return self._capture.get(cv2.CAP_PROP_POS_MSEC) / 1000.0

    def retrieve(self) -> np.ndarray:
        ok, bgr = self._capture.retrieve()
        if not ok or bgr is None:
            raise SourceError(f"{self._label}: a frame was read but could not be decoded")
        if bgr.ndim == 2:
            return cv2.cvtColor(bgr, cv2.COLOR_GRAY2RGB)
        return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)

    def check_complete(self, frames_grabbed: int) -> None:
        expected = self._expected_frames
        if expected is not None and frames_grabbed + _TRUNCATION_SLACK_FRAMES < expected:
            raise TruncatedSourceError(
                f"{self._label} stopped decoding after {frames_grabbed} of {expected} frames: "
                f"{self._shortfall_cause}; the {frames_grabbed} frames before the damage were used",
                frames_decoded=frames_grabbed,
                frames_expected=expected,
            )

    def reconnect(self, timeout_s: float) -> bool:
        if self._reopen is None:
            return False
        self._capture.release()
        try:
            capture = self._reopen(timeout_s)
        except SourceError:  # the opener hung past its deadline: as good as no answer
            return False
        if not capture.isOpened() or not capture.grab():
            capture.release()
            return False
        self._capture = capture
        # the clock keeps running from the first connection, so timestamps stay increasing
        self._wall_timestamp = time.monotonic() - self._opened_at
        self._peeked = True
        return True

    def release(self) -> None:
        self._capture.release()


class FolderReader:
    """A sorted list of picture files; the timestamp of file i is i x seconds_per_frame."""

    def __init__(self, paths: list[Path], frame_size: tuple[int, int], seconds_per_frame: float) -> None:
        self._paths = paths
        self._frame_size = frame_size
        self._seconds_per_frame = seconds_per_frame
        self._position = -1

    def grab(self) -> bool:
        self._position += 1
        return self._position < len(self._paths)

    def timestamp(self) -> float:
        return self._position * self._seconds_per_frame

    def retrieve(self) -> np.ndarray:
        path = self._paths[self._position]
        try:
            rgb = np.asarray(upright_rgb(load_image(path)), dtype=np.uint8)
        except ImageReadError as error:
            raise SourceError(str(error)) from None
        check_same_size(self._paths[0], self._frame_size, path, (rgb.shape[1], rgb.shape[0]))
        return rgb

    def check_complete(self, frames_grabbed: int) -> None:
        """A folder cannot be truncated: missing files are simply not listed."""

    def reconnect(self, timeout_s: float) -> bool:
        """A folder is not live."""
        return False

    def release(self) -> None:
        """Nothing is held open between frames."""


class IterableReader:
    """(rgb, timestamp) pairs from any iterable, checked as they arrive."""

    def __init__(self, frames: Iterable[tuple[np.ndarray, float]], label: str) -> None:
        self._frames = iter(frames)
        self._label = label
        self._current: tuple[np.ndarray, float] | None = None
        self._position = -1

    def grab(self) -> bool:
        try:
            self._current = next(self._frames)
        except StopIteration:
            return False
        self._position += 1
        return True

    def timestamp(self) -> float:
        return float(self._current[1])

    def retrieve(self) -> np.ndarray:
        rgb = np.asarray(self._current[0])
        if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
            raise SourceError(
                f"{self._label}: item {self._position} is not an RGB frame [H, W, 3] uint8 "
                f"(got shape {rgb.shape}, dtype {rgb.dtype})"
            )
        return rgb

    def check_complete(self, frames_grabbed: int) -> None:
        """An iterable ends when it ends."""

    def reconnect(self, timeout_s: float) -> bool:
        """An iterator that ended cannot be restarted."""
        return False

    def release(self) -> None:
        close = getattr(self._frames, "close", None)  # generators: run their cleanup now
        if close is not None:
            close()
