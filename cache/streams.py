"""Two pieces of work side by side on one GPU: the fork and join both users of a side stream need."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

A = TypeVar("A")
B = TypeVar("B")


def run_beside(side: torch.cuda.Stream | None, on_side: Callable[[], A], on_current: Callable[[], B]) -> tuple[A, B]:
    """`on_side()` on the `side` stream while `on_current()` runs on the current one; the current
    stream waits for both before anything enqueued after this returns. The side stream starts after
    everything already enqueued on the current one. Without a side stream (CPU), one after the other.

    Both results are the same either way: each piece keeps its own kernels in their order.
    """
    if side is None:
        return on_side(), on_current()
    current = torch.cuda.current_stream(side.device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        first = on_side()
    second = on_current()
    current.wait_stream(side)
    return first, second
