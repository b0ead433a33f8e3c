"""What a stream is asked for: `StreamConfig`, the streaming engine's settings, and `KeyframePolicy`,
which frames stay in the cache.

A module of their own because both the engine (engine.py) and the memory plan (memory.py) read a
StreamConfig, and the engine calls the plan: here, neither has to import the other's module for it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

# The flow policy's defaults: a keyframe when the mean camera-motion flow to the last keyframe passes
# 15 pixels, or after 30 frames without one (the CLI's --flow-threshold and --max-gap).
FLOW_THRESHOLD = 15.0
MAX_GAP = 30
# The stream's frame counts: the first frames processed together and kept for the whole chunk, and the
# sliding window of later keyframes whose patch tokens stay visible (the reference's).
SCALE_FRAMES = 8
WINDOW = 64
# Views per sequence the released checkpoints were trained with: the default chunk, the most cached frames
# a chunk holds before the next one starts (ChunkedEngine, the app's --chunk-frames).
TRAINED_VIEWS = 320


@dataclass(frozen=True)
class KeyframePolicy:
    """`all`: every frame is kept. `interval:N`: every N-th streaming frame is kept, decided before
    the step. `flow`: decided after the step from the camera-motion flow to the last keyframe
    (keyframe when flow > threshold pixels, or after max_gap frames without one)."""

    kind: str = "all"
    interval: int = 1
    flow_threshold: float = FLOW_THRESHOLD
    max_gap: int = MAX_GAP

    @classmethod
    def parse(cls, text: str, flow_threshold: float = FLOW_THRESHOLD,
              max_gap: int = MAX_GAP) -> KeyframePolicy:
        kind, interval = _parse_spelling(text)
        if kind == "flow" and (flow_threshold <= 0 or max_gap < 1):
            raise ValueError(f"flow keyframes need flow_threshold > 0 and max_gap >= 1, got {flow_threshold}, {max_gap}")
        return cls(kind, interval, flow_threshold, max_gap)

    def decided_before(self, index: int, scale_frames: int) -> bool | None:
        """Whether streaming frame `index` is a keyframe, when that is known before its step
        (None: it is decided afterwards, from the frame's own prediction)."""
        if self.kind == "flow":
            return None
        return self.kind == "all" or (index - scale_frames) % self.interval == 0

    def decided_after(self, flow: float, index: int, last_key_index: int, scale_frames: int) -> bool:
        """flow: the first streaming frame, a flow over the threshold, or the longest gap reached."""
        return index == scale_frames or flow > self.flow_threshold or index - last_key_index >= self.max_gap


# Memoised: a run reads one spelling in several places (the app's option check, the StreamConfig a
# ChunkedEngine is given and the copies dataclasses.replace makes of it for its chunks and its spare),
# and it is parsed once. A spelling that is refused raises again each time (an error is not cached).
@functools.lru_cache(maxsize=16)
def _parse_spelling(text: str) -> tuple[str, int]:
    """(kind, interval) of a keyframe policy as written: `all`, `flow` or `interval:N`."""
    text = text.strip().lower()
    if text in ("all", "flow"):
        return text, 1
    if text.startswith("interval:"):
        try:
            interval = int(text.split(":", 1)[1])
        except ValueError:
            interval = 0
        if interval >= 1:
            return "interval", interval
    raise ValueError(f"unknown keyframe policy {text!r}: use 'all', 'interval:N' (N >= 1) or 'flow'")


@dataclass(frozen=True)
class StreamConfig:
    scale_frames: int = SCALE_FRAMES
    window: int = WINDOW  # sliding-window frames whose patch tokens stay visible, the current one included
    keyframes: str = "all"
    flow_threshold: float = FLOW_THRESHOLD
    max_gap: int = MAX_GAP
    attention: str = "auto"  # a name of stream_recon.cache.backends (`auto`: the fastest available)
    cuda_graphs: bool = True  # replay streaming steps as CUDA graphs (CUDA, dense layout; outputs identical)
    # With CUDA graphs: a frame's heads and its copy to the host run beside the next frame's
    # blocks, and a push returns the frame before (finish() returns the last one); with flow
    # keyframes the next frame's embedding also runs before the decision. Outputs identical;
    # 1.5-2.2 ms a frame faster at 518x378. Off: every push returns its own frame.
    pipeline: bool = True
    # K/V cache precision: `auto` (the model's: bf16 on a GPU, fp32 on the CPU) or `fp8` (e4m3 with
    # a scale per token and head, half of bf16's bytes; dense attention backends only).
    kv_cache: str = "auto"
    # Bytes of device memory the stream may take (weights, caches, activations). Before the first
    # frame the engine plans the K/V precision (with `auto`) and, only if it must, a shorter window
    # to fit (models/memory.py; `memory_plan`), or raises MemoryBudgetError. None: no budget.
    gpu_memory: int | None = None
    # The most frames whose special tokens the cache holds at once; the dense cache allocates for
    # all of them. None: the model's temporal range (max_frames). ChunkedEngine sets its chunk's.
    max_cached_frames: int | None = None
    # Each prediction also carries a global descriptor of its frame (GeM of its DINO patch tokens,
    # [1024] for the released models) for loop retrieval; off, the steps are exactly as without.
    descriptors: bool = False
    # The camera head's refinement iterations, 1 up to the model's (4 for the released models): fewer
    # run faster for a small pose error. None: all of the model's (the reference's default).
    camera_iterations: int | None = None

    @property
    def policy(self) -> KeyframePolicy:
        # Not stored on the instance: its __dict__ stays its fields (StreamConfig(**vars(config)) copies
        # it). The spelling's parse is memoised, so a read only builds the small frozen policy.
        return KeyframePolicy.parse(self.keyframes, self.flow_threshold, self.max_gap)

    def cached_frames(self, model_max_frames: int) -> int:
        """The most frames the cache holds at once, for a model of `model_max_frames` positions."""
        return self.max_cached_frames or model_max_frames
