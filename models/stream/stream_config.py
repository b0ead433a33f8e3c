"""What a stream is asked for: `StreamConfig`, the streaming engine's settings, among them its keyframe
policy's spelling (`policy`: parsed by the table of keyframes/, a file a policy), and the stream's default
frame counts.

A module of their own because both the engine (engine.py) and the memory plan (memory.py) read a
StreamConfig, and the engine calls the plan: here, neither has to import the other's module for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .keyframe_policy import KeyframePolicy
from .keyframes import parse_keyframes
from .keyframes.flow import FLOW_THRESHOLD, MAX_GAP

# The stream's frame counts: the first frames processed together and kept for the whole chunk, and the
# sliding window of later keyframes whose patch tokens stay visible (the reference's).
SCALE_FRAMES = 8
WINDOW = 64
# Views per sequence the released checkpoints were trained with: the default chunk, the most cached frames
# a chunk holds before the next one starts (ChunkedEngine, the app's --chunk-frames).
TRAINED_VIEWS = 320


@dataclass(frozen=True)
class StreamConfig:
    scale_frames: int = SCALE_FRAMES
    window: int = WINDOW  # sliding-window frames whose patch tokens stay visible, the current one included
    keyframes: str = "all"
    flow_threshold: float = FLOW_THRESHOLD
    max_gap: int = MAX_GAP
    attention: str = "auto"  # a name of stream_recon.cache.backends (`auto`: the fastest available)
    cuda_graphs: bool = True  # replay streaming steps as CUDA graphs (CUDA; outputs identical)
    # With CUDA graphs: a frame's heads and its copy to the host run beside the next frame's
    # blocks, and a push returns the frame before (finish() returns the last one); with flow
    # keyframes the next frame's embedding also runs before the decision. Outputs identical;
    # 1.5-2.2 ms a frame faster at 518x378. Off: every push returns its own frame.
    pipeline: bool = True
    # K/V cache precision: `auto` (the model's: bf16 on a GPU, fp32 on the CPU) or `fp8` (e4m3 with
    # a scale per token and head, half of bf16's bytes; the backends that read it: backends.BACKENDS' reads_fp8).
    kv_cache: str = "auto"
    # Bytes of device memory the stream may take (weights, caches, activations). Before the first
    # frame the engine plans the K/V precision (with `auto`) and, only if it must, a shorter window
    # to fit (models/memory.py; `memory_plan`), or raises MemoryBudgetError. None: no budget.
    gpu_memory: int | None = None
    # The most frames whose special tokens the cache holds at once; a GPU's page pool holds pages for
    # all of them. None: the model's temporal range (max_frames). ChunkedEngine sets its chunk's.
    max_cached_frames: int | None = None
    # A chunk that closes once its cache holds this many frames (ChunkedEngine's, with a policy that closes on
    # keyframes) is judged full before its next frame: a pipelined engine decides a frame in flight at the end
    # of its push once it could be the one that fills it. None: decisions wait for the next push.
    closes_at_cached_frames: int | None = None
    # The camera head's refinement iterations, 1 up to the model's (4 for the released models): fewer
    # run faster for a small pose error. None: all of the model's (the reference's default).
    camera_iterations: int | None = None

    @property
    def policy(self) -> KeyframePolicy:
        # Not stored on the instance: its __dict__ stays its fields (StreamConfig(**vars(config)) copies
        # it). The spelling's parse is memoised, so a read returns the policy parsed before.
        return parse_keyframes(self.keyframes, self.flow_threshold, self.max_gap)

    def cached_frames(self, model_max_frames: int) -> int:
        """The most frames the cache holds at once, for a model of `model_max_frames` positions."""
        return self.max_cached_frames or model_max_frames
