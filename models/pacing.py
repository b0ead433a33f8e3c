"""Stage boundaries inside a long model step, so that a step can be spread over several frames' time.

The next window's scale step (8 frames together: ~80 ms on an H100) runs while the stream goes on
(models/lookahead.py). Issued at once it would hold the stream's next frame behind all of it; issued
a few stages per frame it costs each frame a bounded share. The model calls `stage_boundary()` between
its stages (DINO blocks, aggregator blocks, the DPT head's frames); code that runs a step under
`at_stage_boundaries(callback)` has `callback` called there, and may wait in it. Anywhere else a
boundary is one context-variable lookup.

The callback runs between the launches of two stages, never inside a kernel or a CUDA graph capture
(`is_capturing` tells it when a capture is under way, so that it records no event into one).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch

_AT_BOUNDARY: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar(
    "stream_recon_stage_boundary", default=None
)


def stage_boundary() -> None:
    """Mark the end of one stage of a step and the start of the next."""
    callback = _AT_BOUNDARY.get()
    if callback is not None:
        callback()


@contextlib.contextmanager
def at_stage_boundaries(callback: Callable[[], None]) -> Iterator[None]:
    """Call `callback` at every stage boundary reached in this context (this thread only)."""
    token = _AT_BOUNDARY.set(callback)
    try:
        yield
    finally:
        _AT_BOUNDARY.reset(token)


def is_capturing() -> bool:
    """Whether the current CUDA stream is recording a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
