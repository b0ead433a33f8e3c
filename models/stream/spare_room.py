"""How much device memory a spare engine (the next chunk's, beside the stream) may take beside the engine,
and the largest provisional room whose spare fits in it.

Its own module because it is the rule that decides whether rollovers run ahead of the stream at all, with the
measurements behind it; the chunked engine asks it once, before the stream's first frame sets the engine's
cache up: the spare's pages are lent by that cache's storage (one allocation for both engines' pages), so its
size is known before either engine allocates.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import replace

import torch

from ..network.gct import GCTStream
from .memory import CUDA_CONTEXT_BYTES, WORKSPACE_BYTES, MemoryEstimate, estimate_memory, format_bytes
from .rollover import MIN_PROVISIONAL, PROVISIONAL_ROOM_STEP
from .stream_config import StreamConfig

logger = logging.getLogger("stream_recon.models.stream.spare_room")


def provisional_room_beside(model: GCTStream, config: StreamConfig, image_size: tuple[int, int], asked: int,
                            window_slots: Callable[[int], int], device: torch.device) -> int | None:
    """The provisional room of a spare beside an engine over `model` with `config` (as its memory plan makes
    it; `config.gpu_memory`, its budget) for frames of image_size, asked before that engine is set up: the
    largest room up to `asked` whose spare (of `window_slots(room)` window slots) fits beside it by their
    estimates, None where none does; one log line either way."""
    spare_config = replace(config, gpu_memory=None)

    @functools.cache  # (the log line asks again for the room chosen)
    def spare_bytes(room: int) -> int:
        return estimate_memory(model, spare_config, image_size, window_slots=window_slots(room)).another_engine

    budget_left = None
    if config.gpu_memory is not None:
        budget_left = config.gpu_memory - CUDA_CONTEXT_BYTES - torch.cuda.memory_reserved(device)
    room = room_beside_engine(torch.cuda.mem_get_info(device)[0], engine_takes(estimate_memory(model, config, image_size)),
                              budget_left)
    fitting = provisional_room_that_fits(spare_bytes, room, asked)
    shown = smallest_provisional_room(asked) if fitting is None else fitting
    logger.info("next chunk ahead of rollovers: %s (a second engine's cache, graphs and activations: %s; room %s)",
                "off, rollovers pause the stream" if fitting is None else f"on, {fitting} provisional frames",
                format_bytes(spare_bytes(shown)), format_bytes(max(room, 0)))
    return fitting


def engine_takes(estimate: MemoryEstimate) -> int:
    """The device bytes an engine of `estimate` adds once set up and warmed up, beyond the weights already
    on the device: its caches, graphs and step, and the depth head's tables its first step builds."""
    return estimate.another_engine + estimate.head_tables


def room_beside_engine(free: int, engine: int, budget_left: int | None = None) -> int:
    """Device bytes a spare may take beside an engine that will take `engine` bytes (`engine_takes`): what is
    free on the device before the engine is set up (under --gpu-memory, no more than `budget_left`, what the
    budget leaves beside the CUDA context and what the allocator holds now), less the engine's bytes and a
    margin for workspaces and rounding.

    The engine's own eager step (the stream's scale step, after the warm-up) and the spare's never hold their
    activations at once: the allocator's cache is emptied once the spare has warmed up and after the stream's
    scale step (ChunkedEngine._push_scale_frame), so each estimate's one step is room enough. Measured on a
    16 GB card at 518x392 while the room was read after the engine's warm-up (docs/performance-log.md has the
    runs): a 16-frame spare (4.61 GiB) beside the engine, every rollover ahead, the process at 14.94 GiB
    reserved; under --gpu-memory 16GiB 12 frames (4.23 GiB)."""
    available = free if budget_left is None else min(free, budget_left)
    return available - engine - WORKSPACE_BYTES


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
