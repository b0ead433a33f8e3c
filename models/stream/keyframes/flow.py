"""`flow`: decided after the step from the camera-motion flow to the last keyframe: a keyframe when the flow
passes `flow_threshold` pixels, after `max_gap` frames without one, and at the first streaming frame."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..keyframe_policy import FLOW, FrameFacts, KeyframePolicy

# The flow policy's defaults: a keyframe when the mean camera-motion flow to the last keyframe passes
# 15 pixels, or after 30 frames without one (the CLI's --flow-threshold and --max-gap).
FLOW_THRESHOLD = 15.0
MAX_GAP = 30


@dataclass(frozen=True)
class FlowKeyframes(KeyframePolicy):
    flow_threshold: float = FLOW_THRESHOLD
    max_gap: int = MAX_GAP
    word: ClassVar[str] = "flow"
    usage: ClassVar[str] = "flow"
    reads: ClassVar[frozenset[str]] = frozenset({FLOW})

    def __post_init__(self) -> None:
        if self.flow_threshold <= 0 or self.max_gap < 1:
            raise ValueError(f"flow keyframes need flow_threshold > 0 and max_gap >= 1, got "
                             f"{self.flow_threshold}, {self.max_gap}")

    def decided_before(self, frame: FrameFacts) -> bool | None:
        return None

    def decided_after(self, frame: FrameFacts) -> bool:
        return (frame.index == frame.scale_frames or frame.flow > self.flow_threshold
                or frame.index - frame.last_key_index >= self.max_gap)

    @property
    def reads_flow_threshold(self) -> bool:
        return True

    @classmethod
    def from_argument(cls, argument: str | None, flow_threshold: float, max_gap: int) -> KeyframePolicy | None:
        return cls(flow_threshold, max_gap) if argument is None else None
