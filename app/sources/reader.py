"""Streaming frame sources: a video file, an image folder, a webcam or a stream URL, one frame at a time.

The shape is DPVO's stream loop, hardened: a reader thread decodes into a bounded hand-off (models/supervision.py's
HandOff, by the reader's policy) and the consumer takes frames until the reader closes it. OpenCV and PIL release the GIL while decoding and resizing,
so the reader overlaps decoding with inference. Asked for model inputs, the reader makes them too, and
for frames larger than POOL_FROM_PIXELS a few preprocessing threads resize frames side by side instead (a
4K frame takes ~50 ms to resize: one thread would cap the stream at 20 FPS). The hand-off holds each frame, or
its pending result, in reading order, so frames come out in order.

    reader thread:   grab ─▶ select (start, stride, fps, max) ─▶ decode ─▶ resize, crop (uint8) ─▶ hand-off (8)
    preprocessing:   a frame over POOL_FROM_PIXELS resized and cropped here; the hand-off holds its pending result
    consumer:        for frame in source: ...   (raises the reader's error at the point it happened)

A frame's path then crosses two threads, the reader and the consumer, up to 1280x720; a larger one a third,
for the crop rule's pixels (PIL's resize, exact, which leaves no cheaper resize; POOL_FROM_PIXELS says why).
The decoders of each kind of source are readers.py's; a Frame and SourceError, frames.py's; the preprocessing
pool's sizes, its policy and a frame pending on it, preprocessing_pool.py's.

Host memory stays constant: at most `queue_size` frames exist at once, whatever the length. Model
inputs stay uint8 ([3, H, W], a quarter of the float bytes): the engine converts them on the device.
`open_source` (opening.py) checks everything it can before returning (the file exists and decodes, the folder
holds images of one size, the camera or URL answers within the timeout), so a bad input fails
before any model is loaded.

A live source (a webcam, a camera stream) that drops mid-run is reopened with exponential back-off,
the way an IP camera's viewer does after a network hiccup:

    frames ... drop ─ 0.25 s ─ try ─ 0.5 s ─ try ─ 1 s ─ try ─ ... (4 s apart) ─ try: frames again
                   └───────────── at most `reconnect_s`, then SourceError ─────────────┘

The frames delivered before the drop stay delivered; frames keep their index and their wall-clock
timestamps stay increasing across the gap. A URL to a file (it has a length) is not live: when it
stops, that is its end, and a shortfall against its length is a TruncatedSourceError.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, Protocol

import cv2
import numpy as np

from stream_recon.app.sources.frames import Frame, SourceError
from stream_recon.app.sources.preprocess import (
    preprocess_frame_uint8,
)
from stream_recon.app.sources.preprocessing_pool import (
    POOL_FROM_PIXELS,
    PREPROCESS_WORKERS,
    Preprocessing,
    cancel_preprocessing,
    preparing,
    preprocessing_policy,
)
from stream_recon.app.sources.settings import ROTATIONS, FrameSelection, Sampler
from stream_recon.app.stopping import interrupts_held
from stream_recon.models import DaemonPool
from stream_recon.models.supervision import (
    HandOff,
    Helper,
    HelperPolicy,
    WhenDown,
    WhenFull,
    start_supervised_thread,
)

SourceKind = Literal["video", "folder", "webcam", "stream", "frames"]

DEFAULT_QUEUE_SIZE = 8
# A live source's frame waits this long for the run loop to take one before the oldest waiting is dropped:
# a burst of frames buffered in the socket (after a stall of the network or the camera) meets a run loop
# busy for a moment, and a frame or two of 0.1 s is no latency a user sees.
LIVE_GRACE_S = 0.1
# A file decodes in milliseconds; a network stream may pause for its read timeout. Past these,
# the reader is stuck and waiting longer would only turn an error into a hang.
DEFAULT_FRAME_TIMEOUT_S = 30.0
_FIRST_RETRY_DELAY_S = 0.25
_MAX_RETRY_DELAY_S = 4.0
_JOIN_TIMEOUT_S = 2.0

logger = logging.getLogger(__name__)


def reader_policy(live: bool, frame_timeout_s: float) -> HelperPolicy:
    """The reader thread's, which its hand-off runs: when it is full a file's reader waits for the run loop
    (push back: the source is read at the stream's pace) and a live one's newest frame wins once the run
    loop has not made room for LIVE_GRACE_S, its oldest dropped (counted); one that raises, or grabs nothing
    for the frame timeout, fails the run with its one SourceError line, the frames before it kept."""
    if live:
        return HelperPolicy("the source's reader", WhenFull.LATEST, WhenDown.FAIL_RUN, stall_s=frame_timeout_s,
                            push_back_s=LIVE_GRACE_S)
    return HelperPolicy("the source's reader", WhenFull.PUSH_BACK, WhenDown.FAIL_RUN, stall_s=frame_timeout_s)


class Reader(Protocol):
    """What the reader thread needs from a source: cheap skipping, then decoding of the kept frames."""

    def grab(self) -> bool: ...  # advance to the next frame; False at the end

    def timestamp(self) -> float: ...  # of the frame just grabbed

    def retrieve(self) -> np.ndarray: ...  # [H, W, 3] uint8 RGB of the frame just grabbed

    def check_complete(self, frames_grabbed: int) -> None: ...  # raise when the end came too early

    # Live sources only: open the device or URL again within timeout_s and grab its first frame;
    # False when it does not answer (yet).
    def reconnect(self, timeout_s: float) -> bool: ...

    def release(self) -> None: ...


@dataclass(frozen=True)
class _EndOfStream:
    reason: str
    error: BaseException | None = None


class FrameSource:
    """An opened source; iterate it once to receive `Frame`s. Use as a context manager.

    Iteration raises the reader's error (SourceError, TruncatedSourceError, ...) after the frames
    that came before it. `close()` stops the reader at the next frame and may be called any time.
    """

    def __init__(
        self,
        reader: Reader,
        *,
        kind: SourceKind,
        description: str,
        name: str,
        selection: FrameSelection,
        estimated_length: int | None,
        live: bool,
        image_width: int | None = None,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        frame_timeout_s: float = DEFAULT_FRAME_TIMEOUT_S,
        reconnect_s: float = 0.0,
        frame_size: tuple[int, int] | None = None,
        preprocess_workers: int = PREPROCESS_WORKERS,
        pool_from_pixels: int = POOL_FROM_PIXELS,
    ) -> None:
        self.kind = kind
        self.description = description  # for messages: "video clip.mp4", "webcam 0", ...
        self.location: str | None = None  # what open_source opened: an absolute path, a URL, a webcam index
        self.name = name  # for default output folders: the file or folder stem, "webcam0", ...
        self.selection = selection
        self.estimated_length = estimated_length  # delivered frames, when the source's length is known
        self.frame_size = frame_size  # (width, height) of the source's frames when known before reading
        self.rotate = 0  # degrees each frame is turned clockwise after decoding (turn_clockwise)
        self.live = live  # live sources drop the oldest frame waiting instead of falling behind
        self.image_width = image_width
        self.end_reason: str | None = None
        # a live source that stops is reopened for up to this many seconds (0: its stop is its end)
        self.reconnect_s = reconnect_s if live else 0.0
        self.reconnects = 0  # drops that were followed by frames again
        self.reconnect_attempts = 0  # opens tried after drops, successful or not
        self.disconnected_s = 0.0  # total time between a drop and the next frame (or giving up)
        self._reader = reader
        # Both fail the run (their one SourceError line); the consumer, the run loop, watches them.
        self.reader_helper = Helper(reader_policy(live, frame_timeout_s))
        self._handoff = HandOff(self.reader_helper, queue_size, gives=True, on_discard=cancel_preprocessing)
        self._end: _EndOfStream | None = None  # how the reader ended, set before it closes the hand-off
        self.preprocessing_helper = Helper(preprocessing_policy(frame_timeout_s))
        self._preprocessing: DaemonPool | None = None  # (daemons: a stalled resize holds no exit)
        if image_width:
            self._preprocessing = DaemonPool(preprocess_workers, f"preprocess:{name}", self.preprocessing_helper)
        self._pool_from_pixels = pool_from_pixels  # frames with more pixels are made model inputs on the pool
        self._frame_timeout_s = frame_timeout_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._iterated = False
        self._closed = False
        self._reconnecting = False  # the reader's back-off has its own bound: not a stall

    def __enter__(self) -> FrameSource:
        return self

    @property
    def frames_dropped(self) -> int:
        """Frames a live source dropped, the oldest waiting, to keep up."""
        return self.reader_helper.dropped

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def turn_clockwise(self, degrees: int) -> None:
        """Turn every frame `degrees` (one of ROTATIONS) clockwise as it is decoded, before anything else sees
        it; the known frame size turns with it. Only before the frames are read."""
        if degrees not in ROTATIONS:
            raise SourceError(f"--rotate must be one of {', '.join(map(str, ROTATIONS))} (degrees clockwise), got {degrees}")
        if self._thread is not None:
            raise RuntimeError(f"{self.description} is being read already: turn it before reading")
        if self.frame_size is not None and (degrees - self.rotate) % 180:
            self.frame_size = self.frame_size[::-1]
        self.rotate = degrees

    def start(self) -> None:
        """Start decoding now rather than at the first `next()` (idempotent).

        A live source started early keeps only the newest frames while the consumer gets ready.
        """
        if self._thread is None:
            self.reader_helper.beat()
            # A stop signal raised between the thread's start and this assignment left _thread None with the
            # reader running: close() then released the capture under its read and FFmpeg deadlocked both
            # threads (a run that never ended). The signal is raised once the thread is recorded.
            # (_read_all hands whatever it raises to the consumer itself)
            with interrupts_held():
                self._thread = start_supervised_thread(self.reader_helper, self._read_all, f"reader:{self.name}")

    def __iter__(self) -> Iterator[Frame]:
        if self._iterated:
            raise RuntimeError(f"{self.description} can be iterated only once")
        self._iterated = True
        self.start()
        return self._frames()

    def request_stop(self) -> None:
        """Ask the reader to stop at the next frame; returns at once (safe in a signal handler).

        Iteration then ends with `end_reason == "stopped"` after at most the frame being decoded.
        """
        self._stop.set()

    def close(self) -> None:
        """Stop the reader and release the device or file; frames still waiting are discarded."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._handoff.close()
        self._handoff.discard()
        if self._thread is not None and self._thread is not threading.current_thread():
            # A reader stuck in a network read returns only at FFmpeg's read timeout; it is a daemon
            # that releases its capture when it does, so the caller need not wait that long.
            self._thread.join(timeout=_JOIN_TIMEOUT_S)
        if self._thread is None:
            self._reader.release()
        if self._preprocessing is not None:
            self._preprocessing.shutdown()  # unbounded-ok: a DaemonPool's shutdown returns at once

    def helpers(self) -> dict[str, Helper]:
        """The reader thread and, where one of its workers ran, the preprocessing pool, by run.json's names."""
        started = self._preprocessing is not None and self._preprocessing.started
        return {"reader": self.reader_helper, **({"preprocessing": self.preprocessing_helper} if started else {})}

    def _frames(self) -> Iterator[Frame]:
        """The frames the reader hands over, until it closes the hand-off. A wait ends when a frame comes, the
        reader ends, or (nothing from it meanwhile) it would have stalled: no polling."""
        while True:
            if self._stop.is_set():  # the frames waiting are not delivered after a stop; the reader ends at once
                self._handoff.discard()
            taken, item = self._handoff.take(timeout=self._stall_wait_s())
            if taken:
                yield item.result(self.preprocessing_helper, self.description) if isinstance(item, Preprocessing) \
                    else item
                continue
            if self._handoff.closed:
                end = self._end
                if end is None:  # (closed by close(), or the reader gone without saying how it ended)
                    raise self._reader_down(f"the reader of {self.description} ended without a last frame")
                self.end_reason = end.reason
                if isinstance(end.error, Exception) and not isinstance(end.error, SourceError):
                    # (a bug or a library's failure on the reader thread: still the run's one error line)
                    raise self._reader_down(f"reading {self.description} failed: {type(end.error).__name__}: "
                                            f"{end.error}") from end.error
                if end.error is not None:
                    self.reader_helper.fail(str(end.error))
                    raise end.error
                return
            # Skipping (--start, --stride, --fps) can leave the hand-off empty for long while the reader
            # works; only a reader that stopped advancing has stalled.
            if self._stall_wait_s() == 0:
                self.close()
                raise self._reader_down(
                    f"no frame from {self.description} for {self._frame_timeout_s:g} s: the source stalled")

    def _stall_wait_s(self) -> float:
        """Seconds until the reader counts as stalled (no grab for the frame timeout); while it reconnects
        (bounded on its own), a frame timeout from now."""
        if self._reconnecting:
            return self._frame_timeout_s
        return max(0.0, self._frame_timeout_s - self.reader_helper.seconds_since_beat())

    def _reader_down(self, message: str) -> SourceError:
        """The reader's helper marked down; the run's one error line."""
        self.reader_helper.fail(message)
        return SourceError(message)

    def _read_all(self) -> None:
        """Reader thread: every exit path says how it ended and closes the hand-off (after a stop, its frames
        discarded)."""
        try:
            end = self._read_until_end()
        except BaseException as error:  # handed to the consumer, which re-raises it in its own thread
            end = _EndOfStream("error", error)
        try:
            self._reader.release()
        except Exception as error:  # (the frames were read: the end still reaches the consumer)
            logger.warning("releasing %s failed: %s: %s", self.description, type(error).__name__, error)
        finally:
            if self._stop.is_set():
                self._handoff.discard()
            self._end = end
            self._handoff.close()

    def _read_until_end(self) -> _EndOfStream:
        sampler = Sampler(self.selection)
        frames_grabbed = 0
        delivered = 0
        while not self._stop.is_set():
            if sampler.done:
                return _EndOfStream("max_frames")
            if not self._reader.grab():
                if self.reconnect_s > 0 and not self._stop.is_set():
                    if self._reconnect(delivered):
                        continue
                    break  # stopped while reconnecting
                self._reader.check_complete(frames_grabbed)
                return _EndOfStream("end")
            self.reader_helper.beat()
            source_index = frames_grabbed
            frames_grabbed += 1
            timestamp = self._reader.timestamp()
            if not sampler.accept(source_index, timestamp):
                continue
            rgb = self._reader.retrieve()
            if self.rotate:  # (an unturned frame is not handed through one more function)
                rgb = turned_clockwise(rgb, self.rotate)
            if self._preprocessing is None:
                frame = Frame(delivered, source_index, timestamp, rgb)
            elif rgb.shape[0] * rgb.shape[1] > self._pool_from_pixels:
                image = self._preprocessing.submit(preprocess_frame_uint8, rgb, self.image_width)
                frame = Preprocessing(delivered, source_index, timestamp, image)
            else:  # made here, in line: one hop fewer on the frame's path (tests/test_frame_path.py)
                with preparing(delivered, self.description):
                    image = preprocess_frame_uint8(rgb, self.image_width)
                frame = Frame(delivered, source_index, timestamp, None, image)
            # (False: closed by the consumer; a stop while it waited for room: the frame is not delivered)
            if not self._handoff.give(frame) or self._stop.is_set():
                cancel_preprocessing(frame)
                break
            delivered += 1
        return _EndOfStream("stopped")

    def _reconnect(self, delivered: int) -> bool:
        """Reopen a live source that dropped, backing off exponentially: True once it sends frames
        again, False when a stop is requested meanwhile; SourceError when `reconnect_s` runs out.

        Attempts come 0.25, 0.5, 1, 2, 4, 4, ... s after the previous one ended; one that would come
        after the deadline is not made.
        """
        dropped_at = time.monotonic()
        deadline = dropped_at + self.reconnect_s
        logger.warning("%s dropped after %d frames; reconnecting for up to %g s", self.description, delivered,
                       self.reconnect_s)
        self._reconnecting = True
        back_at = None  # when the reader had its first frame again: the disconnection ends there, not after the log
        try:
            delay = _FIRST_RETRY_DELAY_S
            while True:
                remaining = deadline - time.monotonic()
                if delay >= remaining:
                    if self._stop.wait(max(0.0, remaining)):
                        return False
                    raise SourceError(
                        f"{self.description} dropped and did not come back within {self.reconnect_s:g} s "
                        f"({self.reconnect_attempts} reconnection attempts); the {delivered} frames before the "
                        "drop were kept. Check the camera or server, or allow longer with --reconnect SECONDS"
                    )
                if self._stop.wait(delay):
                    return False
                self.reconnect_attempts += 1
                if self._reader.reconnect(timeout_s=deadline - time.monotonic()):
                    back_at = time.monotonic()
                    self.reconnects += 1
                    logger.warning("%s is back after %.1f s", self.description, back_at - dropped_at)
                    return True
                delay = min(2 * delay, _MAX_RETRY_DELAY_S)
        finally:
            self.disconnected_s += (back_at or time.monotonic()) - dropped_at
            self.reader_helper.beat()
            self._reconnecting = False

# cv2.rotate's code for each clockwise turn: a copy in the turned layout, as contiguous as the decoder's.
_CV2_TURNS = {90: cv2.ROTATE_90_CLOCKWISE, 180: cv2.ROTATE_180, 270: cv2.ROTATE_90_COUNTERCLOCKWISE}


def turned_clockwise(rgb: np.ndarray, degrees: int) -> np.ndarray:
    """[H, W, 3] turned `degrees` (0, 90, 180 or 270) clockwise: [W, H, 3] for a quarter turn."""
    return rgb if degrees == 0 else cv2.rotate(rgb, _CV2_TURNS[degrees])
