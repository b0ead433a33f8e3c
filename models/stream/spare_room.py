"""How much device memory a spare engine (the next chunk's, beside the stream) may take beside the engine,
and the largest provisional room whose spare fits in it.

Its own module because it is the rule that decides whether rollovers run ahead of the stream at all, with the
measurements behind it; the chunked engine asks it once, before its first spare.
"""

from __future__ import annotations

from collections.abc import Callable

from .memory import WORKSPACE_BYTES
from .rollover import MIN_PROVISIONAL, PROVISIONAL_ROOM_STEP


def room_beside_engine(free: int, budget_left: int | None = None) -> int:
    """Device bytes a spare may take beside an engine that holds its cache and graphs: what is free on
    the device (under --gpu-memory, no more than `budget_left`, what the budget leaves beside the CUDA
    context and what the allocator holds now), less a margin for workspaces and rounding.

    The engine's own eager step (the stream's scale step, after the warm-up) needs no room of its own:
    it runs while the spare's activations are not held (the allocator's cache is emptied once the spare
    has warmed up), and its blocks go back to the device after it (ChunkedEngine._push_scale_frame), before
    the spare's next eager step. One step's activations at a time, which the spare's estimate counts.

    What the allocator holds unused is not counted as room: those blocks belong to the engine's stream
    and to its graphs' private pools, which the spare's stream gets only by the allocator returning them
    to the device, i.e. taking them from the engine. On a 16 GB card at 518x392
    (docs/performance-log.md has the runs):
    counting them, the stream's scale step ran out of memory beside the spare; so did the
    budget's room taken as the budget less the plan's estimate (4.67 GiB, a 4.57 GiB spare). By this rule
    the spare takes 4.61 GiB (16 provisional frames; 4.23 GiB, 12 frames, under --gpu-memory 16GiB), every
    rollover runs ahead, and the process peaks at 14.94 GiB reserved; with the engine's own step taken off
    the room as well, the spare had 8 frames (4 under the budget)."""
    available = free if budget_left is None else min(free, budget_left)
    return available - WORKSPACE_BYTES


def provisional_room_that_fits(spare_bytes: Callable[[int], int], available: int, asked: int) -> int | None:
    """The largest provisional room, from `asked` down in steps of PROVISIONAL_ROOM_STEP to
    MIN_PROVISIONAL (or `asked`, if smaller), whose spare (`spare_bytes(room)` bytes) fits in
    `available` bytes; None when none does. A smaller room is a smaller spare cache: the stream waits
    for the spare sooner at a long catch-up, which still beats a rollover in place."""
    smallest = smallest_provisional_room(asked)
    rooms = [*range(asked, smallest, -PROVISIONAL_ROOM_STEP), smallest]
    return next((room for room in rooms if spare_bytes(room) <= available), None)


def smallest_provisional_room(asked: int) -> int:
    """The smallest room `provisional_room_that_fits` tries: MIN_PROVISIONAL, or `asked` if smaller."""
    return min(asked, MIN_PROVISIONAL)
