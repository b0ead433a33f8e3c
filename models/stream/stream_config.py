"""What a stream is asked for: `StreamConfig`, the streaming engine's settings, and `KeyframePolicy`,
which frames stay in the cache (a class per policy, and KEYFRAME_POLICIES, the table `--keyframes` reads).

A module of their own because both the engine (engine.py) and the memory plan (memory.py) read a
StreamConfig, and the engine calls the plan: here, neither has to import the other's module for it.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

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


class KeyframePolicy(ABC):
    """Which streaming frames stay in the cache (the scale frames always do): what the engine and the
    chunked engine ask of a policy. A policy is a frozen subclass plus its row in KEYFRAME_POLICIES, the
    word `--keyframes` spells it with; nothing else names one.

    The engine asks `decided_before` before each streaming step and, where that answers None, asks
    `decided_after` once the frame's prediction is on the host; both run once a frame, so they compute
    and allocate nothing beyond the answer."""

    # The word before any ':' in the policy's spelling, and how its help and errors show that spelling.
    word: ClassVar[str]
    usage: ClassVar[str]

    @property
    def spelling(self) -> str:
        """The policy as `--keyframes` writes it; parsing it (with the same flow settings) gives it back."""
        return self.word

    @abstractmethod
    def decided_before(self, index: int, scale_frames: int) -> bool | None:
        """Whether streaming frame `index` is a keyframe, when that is known before its step
        (None: it is decided afterwards, from the frame's own prediction, by `decided_after`)."""

    def decided_after(self, flow: float, index: int, last_key_index: int, scale_frames: int) -> bool:
        """Whether streaming frame `index` is a keyframe, from the mean camera-motion flow (pixels) of its
        prediction to the last keyframe's (`last_key_index`); asked only where `decided_before` said None,
        so a policy that decides before the step answers the same here."""
        return bool(self.decided_before(index, scale_frames))

    @property
    def input_frames_per_cached_frame(self) -> int | None:
        """Input frames a cached streaming frame stands for when the rule fixes it (a chunk's length is
        then known when it opens); None where the video decides."""
        return None

    @property
    def closes_on_keyframes(self) -> bool:
        """A chunk closes at its last keyframe, known only when that frame comes (no fixed length)."""
        return self.input_frames_per_cached_frame is None

    @property
    def reads_flow_threshold(self) -> bool:
        """The flow settings (--flow-threshold, --max-gap) change its decisions."""
        return False

    @classmethod
    def from_argument(cls, argument: str | None, flow_threshold: float, max_gap: int) -> KeyframePolicy | None:
        """The policy its spelling names, `argument` the text after the ':' (None: no ':'); None where
        the argument is not one it takes."""
        return cls() if argument is None else None

    @classmethod
    def parse(cls, text: str, flow_threshold: float = FLOW_THRESHOLD,
              max_gap: int = MAX_GAP) -> KeyframePolicy:
        """The policy `text` spells (`all`, `flow`, `interval:N`; any case, spaces around it), the flow
        settings given to the policies that read them. ValueError for a spelling no row takes."""
        return _parse_spelling(text, flow_threshold, max_gap)


@dataclass(frozen=True)
class AllKeyframes(KeyframePolicy):
    """`all`: every frame is kept."""

    word: ClassVar[str] = "all"
    usage: ClassVar[str] = "all"

    def decided_before(self, index: int, scale_frames: int) -> bool | None:
        return True

    @property
    def input_frames_per_cached_frame(self) -> int | None:
        return 1


@dataclass(frozen=True)
class IntervalKeyframes(KeyframePolicy):
    """`interval:N`: every N-th streaming frame is kept, the first one included, decided before the step."""

    interval: int
    word: ClassVar[str] = "interval"
    usage: ClassVar[str] = "interval:N (N >= 1)"

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise ValueError(f"interval keyframes need an interval >= 1, got {self.interval}")

    @property
    def spelling(self) -> str:
        return f"{self.word}:{self.interval}"

    def decided_before(self, index: int, scale_frames: int) -> bool | None:
        return (index - scale_frames) % self.interval == 0

    @property
    def input_frames_per_cached_frame(self) -> int | None:
        return self.interval

    @classmethod
    def from_argument(cls, argument: str | None, flow_threshold: float, max_gap: int) -> KeyframePolicy | None:
        try:
            interval = int(argument) if argument is not None else 0
        except ValueError:
            return None
        return cls(interval) if interval >= 1 else None


@dataclass(frozen=True)
class FlowKeyframes(KeyframePolicy):
    """`flow`: decided after the step from the camera-motion flow to the last keyframe: a keyframe when
    the flow passes `flow_threshold` pixels, after `max_gap` frames without one, and at the first
    streaming frame."""

    flow_threshold: float = FLOW_THRESHOLD
    max_gap: int = MAX_GAP
    word: ClassVar[str] = "flow"
    usage: ClassVar[str] = "flow"

    def __post_init__(self) -> None:
        if self.flow_threshold <= 0 or self.max_gap < 1:
            raise ValueError(f"flow keyframes need flow_threshold > 0 and max_gap >= 1, got "
                             f"{self.flow_threshold}, {self.max_gap}")

    def decided_before(self, index: int, scale_frames: int) -> bool | None:
        return None

    def decided_after(self, flow: float, index: int, last_key_index: int, scale_frames: int) -> bool:
        return index == scale_frames or flow > self.flow_threshold or index - last_key_index >= self.max_gap

    @property
    def reads_flow_threshold(self) -> bool:
        return True

    @classmethod
    def from_argument(cls, argument: str | None, flow_threshold: float, max_gap: int) -> KeyframePolicy | None:
        return cls(flow_threshold, max_gap) if argument is None else None


# The policies `--keyframes` takes, a row each: the word before any ':' of a spelling -> its policy. The
# order is the one help texts and errors list them in.
KEYFRAME_POLICIES: dict[str, type[KeyframePolicy]] = {
    policy.word: policy for policy in (AllKeyframes, FlowKeyframes, IntervalKeyframes)
}


def keyframe_spellings() -> str:
    """'all, flow or interval:N (N >= 1)': every spelling, for help texts and errors."""
    usages = [policy.usage for policy in KEYFRAME_POLICIES.values()]
    return f"{', '.join(usages[:-1])} or {usages[-1]}" if len(usages) > 1 else usages[0]


# Memoised: a run reads one spelling in several places (the app's option check, the StreamConfig a
# ChunkedEngine is given and the copies dataclasses.replace makes of it for its chunks and its spare),
# and it is parsed once; every reader gets the same frozen policy. A spelling that is refused raises
# again each time (an error is not cached).
@functools.lru_cache(maxsize=16)
def _parse_spelling(text: str, flow_threshold: float, max_gap: int) -> KeyframePolicy:
    word, colon, argument = text.strip().lower().partition(":")
    policy_class = KEYFRAME_POLICIES.get(word)
    policy = policy_class.from_argument(argument if colon else None, flow_threshold, max_gap) if policy_class else None
    if policy is None:
        raise ValueError(f"unknown keyframe policy {text.strip().lower()!r}: use {keyframe_spellings()}")
    return policy


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
        # it). The spelling's parse is memoised, so a read returns the policy parsed before.
        return KeyframePolicy.parse(self.keyframes, self.flow_threshold, self.max_gap)

    def cached_frames(self, model_max_frames: int) -> int:
        """The most frames the cache holds at once, for a model of `model_max_frames` positions."""
        return self.max_cached_frames or model_max_frames
