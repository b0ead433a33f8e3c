"""Stream helpers shared by the cache and the model: two pieces of work side by side on one GPU
(the fork and join both users of a side stream need), and small host values uploaded each step."""

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


class DeviceValues:
    """A small tensor on the device refilled from the host every step through one reused pinned
    buffer: the copy is asynchronous, so work recorded against `values` (a CUDA graph, say) and
    enqueued after `set` reads the new values. On the CPU a plain copy."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device):
        on_cuda = device.type == "cuda"
        self.values = torch.zeros(size, dtype=dtype, device=device)
        self._host = torch.zeros(size, dtype=dtype, pin_memory=on_cuda)
        self._copied = torch.cuda.Event() if on_cuda else None

    def set(self, *values: int) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # the pinned buffer is free again once its last copy ran
        self._host.numpy()[:] = values
        self.values.copy_(self._host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
