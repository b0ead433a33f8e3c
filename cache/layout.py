"""The shape of a two-stream cache, shared by both layouts (paged and dense)."""

from __future__ import annotations

from dataclasses import dataclass


class CacheCapacityError(ValueError):
    """A request the cache cannot serve with the limits it was given."""


@dataclass(frozen=True)
class CacheLayout:
    # Every count is the caller's (the model's tokens, the stream's frame counts): the cache keeps no
    # defaults of its own for them.
    patches_per_frame: int  # one patch page holds exactly one frame's patches
    specials_per_frame: int
    scale_frames: int
    window_frames: int
    # Frame slots the dense layout allocates for the window: None, as many as it holds. Fewer only for a
    # stream known to hand its frames over before it fills them (a chunk's spare engine); an append
    # past them is then refused instead of evicting early (DenseTwoStreamCache).
    window_slots: int | None = None

    def __post_init__(self):
        if self.patches_per_frame < 1 or self.specials_per_frame < 0:
            raise ValueError(f"bad token counts per frame: {self.patches_per_frame} patches, {self.specials_per_frame} specials")
        if self.scale_frames < 1 or self.window_frames < 1:
            raise ValueError(
                f"scale_frames and window_frames must be >= 1, got {self.scale_frames} and {self.window_frames}"
            )
        if self.window_slots is not None and not 1 <= self.window_slots <= self.window_frames:
            raise ValueError(f"window_slots must be between 1 and window_frames={self.window_frames}, "
                             f"got {self.window_slots}")

    @property
    def allocated_window_slots(self) -> int:
        """Frame slots the dense layout allocates for the window."""
        return self.window_frames if self.window_slots is None else self.window_slots

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
