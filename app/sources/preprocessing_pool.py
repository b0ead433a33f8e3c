"""The source's preprocessing pool: which frames are made model inputs on it rather than on the reader thread
(POOL_FROM_PIXELS), how many threads it has, its helper policy, and a frame waiting in the reader's hand-off
while its model input is made there (`Preprocessing`).

Its own module because it is a helper of its own (models/supervision.py's contract: its policy, its stall),
beside the reader thread that reader.py's FrameSource runs; readers.py takes its sizes as defaults.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from stream_recon.app.sources.frames import Frame, SourceError
from stream_recon.models.supervision import Helper, HelperPolicy, WhenDown, WhenFull

# Threads that resize frames into model inputs. One keeps up with 640x480 at ~200 FPS; four keep a
# 4K video above 40 FPS where the cores exist.
PREPROCESS_WORKERS = max(1, min(4, (os.cpu_count() or 1) // 2))


# Frames up to this many pixels are made model inputs on the reader thread, larger ones on the pool: on the GPU
# host the reader alone kept the product path at 47.0 FPS at 1280x720 (the pool 46.6), but at 1920x1080 held it
# to 42.3 (the pool 53.6) and at 3840x2160 to 12.6 (the pool 45.8).
POOL_FROM_PIXELS = 1280 * 720


def preprocessing_policy(frame_timeout_s: float) -> HelperPolicy:
    """The preprocessing pool's: it takes what the reader hands it in the reader's bounded queue (push back);
    a frame it cannot make, or does not make within the frame timeout, fails the run with one SourceError line."""
    return HelperPolicy("the source's preprocessing", WhenFull.PUSH_BACK, WhenDown.FAIL_RUN,
                        stall_s=frame_timeout_s)


@dataclass(frozen=True)
class Preprocessing:
    """A frame in the queue whose model input is still being made on a preprocessing thread."""

    index: int
    source_index: int
    timestamp: float
    image: Future  # -> [3, H', W'] uint8 array

    def result(self, helper: Helper, description: str) -> Frame:
        """The frame once its model input is made; SourceError, `helper` (the pool's) marked down, where that
        raised or took over the helper's stall_s (the stream's frame timeout: a resize takes milliseconds), so
        that the run ends "failed" on it."""
        what = f"preparing frame {self.index} of {description}"
        timeout_s = helper.policy.stall_s
        try:
            image = self.image.result(timeout=timeout_s)
        except FutureTimeout:
            helper.fail(f"it made no progress for {timeout_s:g} s")
            raise SourceError(f"{what} took more than {timeout_s:g} s: the preprocessing stalled") from None
        except Exception as error:
            failure = _preparing_failed(self.index, description, error)
            helper.fail(str(failure))
            raise failure from error
        helper.beat()
        return Frame(self.index, self.source_index, self.timestamp, None, image)


@contextlib.contextmanager
def preparing(index: int, description: str) -> Iterator[None]:
    """Around frame `index`'s model input made on the reader: what that raises becomes the SourceError that the
    pool's failure would be."""
    try:
        yield
    except Exception as error:
        raise _preparing_failed(index, description, error) from error


def _preparing_failed(index: int, description: str, error: Exception) -> SourceError:
    """The one line of a frame whose model input could not be made, on the reader or the pool."""
    return SourceError(f"preparing frame {index} of {description} failed: {type(error).__name__}: {error}")


def cancel_preprocessing(item: Frame | Preprocessing) -> None:
    """A frame that leaves the hand-off untaken: its model input, if still being made, is not made."""
    if isinstance(item, Preprocessing):
        item.image.cancel()
