"""`all`: every frame is kept."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..keyframe_policy import FrameFacts, KeyframePolicy


@dataclass(frozen=True)
class AllKeyframes(KeyframePolicy):
    word: ClassVar[str] = "all"
    usage: ClassVar[str] = "all"

    def decided_before(self, frame: FrameFacts) -> bool | None:
        return True

    @property
    def input_frames_per_cached_frame(self) -> int | None:
        return 1
