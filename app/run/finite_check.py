"""The run's first sink: a frame whose pose or depth is not finite stops the run before any other sink sees it.

Its own module because it is a sink like the writer and the viewer, with its own error
(`NonFinitePrediction`) and its own advice, which the stream's loop only catches. `plural` (a count and its
noun) is shared by its message and the run's last line.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class NonFinitePrediction(ValueError):
    """The model predicted NaN or infinity for a frame: that frame and everything after it would be garbage."""


class FiniteCheck:
    """The first sink: a frame whose pose or depth is not finite stops the run before any sink sees it.

    NaN needs no bad checkpoint (those are refused at load): a model passed in by a caller, or half
    precision overflowing on an unusual input, produce it too, and it would poison the cache, so every
    later frame would be NaN as well. The predictions are on the host already; one sum per array is
    the whole cost (NaN and infinity survive a sum). Once tripped, it refuses every later frame too,
    so nothing after the bad frame is written.
    """

    def __init__(self, *, half_precision: bool) -> None:
        self.half_precision = half_precision
        self.failure: NonFinitePrediction | None = None

    def on_frame(self, pred: Any, stats: dict) -> None:
        if self.failure is None:
            bad = [name for name, values in (("pose", pred.pose_enc), ("camera", pred.c2w), ("depth", pred.depth))
                   if not np.isfinite(np.sum(values))]
            if bad:
                self.failure = NonFinitePrediction(self._message(pred.frame_index, " and ".join(bad)))
        if self.failure is not None:
            raise self.failure

    def close(self, status: str) -> None:
        pass

    def _message(self, frame_index: int, what: str) -> str:
        advice = (
            "try --dtype float32 (half precision overflowed)" if self.half_precision
            else "the model's weights or this input make it diverge: check the checkpoint and the frames"
        )
        return (
            f"frame {frame_index}: the model predicted NaN or infinity ({what}); stopped there, keeping "
            f"{plural(frame_index, 'frame')} before it; {advice}"
        )


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
