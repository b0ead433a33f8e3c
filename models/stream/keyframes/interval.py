"""`interval:N`: every N-th streaming frame is kept, the first one included, decided before the step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..keyframe_policy import FrameFacts, KeyframePolicy


@dataclass(frozen=True)
class IntervalKeyframes(KeyframePolicy):
    interval: int
    word: ClassVar[str] = "interval"
    usage: ClassVar[str] = "interval:N (N >= 1)"

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise ValueError(f"interval keyframes need an interval >= 1, got {self.interval}")

    def decided_before(self, frame: FrameFacts) -> bool | None:
        return (frame.index - frame.scale_frames) % self.interval == 0

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
