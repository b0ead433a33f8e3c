"""The shape of a two-stream cache, shared by both layouts (paged and dense)."""

from __future__ import annotations

from dataclasses import dataclass


class CacheCapacityError(ValueError):
    """A request the cache cannot serve with the limits it was given."""


@dataclass(frozen=True)
class CacheLayout:
    patches_per_frame: int  # one patch page holds exactly one frame's patches
    specials_per_frame: int = 6
    scale_frames: int = 8
    window_frames: int = 64

    def __post_init__(self):
        if self.patches_per_frame < 1 or self.specials_per_frame < 0:
            raise ValueError(f"bad token counts per frame: {self.patches_per_frame} patches, {self.specials_per_frame} specials")
        if self.scale_frames < 1 or self.window_frames < 1:
            raise ValueError(
                f"scale_frames and window_frames must be >= 1, got {self.scale_frames} and {self.window_frames}"
            )

    @property
    def page_size(self) -> int:
        return self.patches_per_frame

    @property
    def tokens_per_frame(self) -> int:
        return self.specials_per_frame + self.patches_per_frame

    @property
    def max_patch_pages(self) -> int:
        """Patch pages that can be in use at once: scale + window + one appended before eviction."""
        return self.scale_frames + self.window_frames + 1
