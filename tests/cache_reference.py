"""The cache's shared property-test harness: a reference of the visible key set computed from the live
frames alone, a harness that drives the real page tables beside it, the layouts and op sequences
hypothesis draws, and the driver. tests/test_cache_paged.py and test_cache_fp8.py use it."""

from __future__ import annotations

from hypothesis import strategies as st

from stream_recon.cache import CacheLayout


class VisibleReference:
    """What the visible key set must be, computed from the list of live frames alone."""

    def __init__(self, layout: CacheLayout):
        self.layout = layout
        self.committed: list[int] = []
        self.pending: list[int] = []
        self.pending_deferred = False

    @property
    def live(self) -> list[int]:
        return self.committed + self.pending

    def visible_patch_frames(self) -> list[int]:
        scale = self.live[: self.layout.scale_frames]
        # A deferred pending frame keeps the oldest window frame visible until the decision.
        limit = self.layout.window_frames + (1 if self.pending_deferred else 0)
        window = self.live[self.layout.scale_frames :][-limit:]
        return scale + window

    def visible_tokens(self) -> list[tuple[int, int]]:
        """(frame, token) in key order: scale patches, window patches, then every live frame's specials."""
        specials = self.layout.specials_per_frame
        patches = [(f, specials + j) for f in self.visible_patch_frames() for j in range(self.layout.patches_per_frame)]
        return patches + [(f, s) for f in self.live for s in range(specials)]

    def commit(self):
        self.committed += self.pending
        self.pending, self.pending_deferred = [], False


class LabelHarness:
    """Drives real page tables beside the reference and writes (frame, token) labels into a fake store
    through the cache's token slots."""

    def __init__(self, layout: CacheLayout, cache):
        self.layout = layout
        self.cache = cache
        self.reference = VisibleReference(layout)
        self.store: dict[int, tuple[int, int]] = {}
        self.next_frame = 0

    def append(self, defer: bool):
        frame = self.next_frame
        self.next_frame += 1
        self.cache.append(defer_eviction=defer)
        for token, slot in enumerate(self.cache.token_slots(-1)):
            self.store[slot] = (frame, token)
        self.reference.pending.append(frame)
        self.reference.pending_deferred = defer

    def commit(self):
        self.cache.commit()
        self.reference.commit()

    def rollback(self):
        self.cache.rollback()
        self.reference.pending, self.reference.pending_deferred = [], False


@st.composite
def layouts(draw):
    return CacheLayout(
        patches_per_frame=draw(st.sampled_from([1, 2, 3, 5, 7])),
        specials_per_frame=draw(st.integers(0, 7)),
        scale_frames=draw(st.integers(1, 3)),
        window_frames=draw(st.integers(1, 4)),
    )


# One op per step, in the engine's patterns: a decided keyframe (append, commit), a frame that is
# decided later or known to be dropped (deferred append, then commit or rollback), or a rejected
# non-deferred append.
OPS = st.sampled_from(["key", "defer_commit", "defer_rollback", "append_rollback"])


def drive(h, scale_batch: int, ops: list[str]) -> None:
    """Phase 1 (several frames pending together), then one op per streaming frame, checking the
    harness against its reference after every change."""
    for _ in range(scale_batch):
        h.append(defer=False)
        h.check()
    h.commit()
    h.check()
    for op in ops:
        h.append(defer=op.startswith("defer"))
        h.check()
        (h.commit if op in ("key", "defer_commit") else h.rollback)()
        h.check()
