"""The cache layouts' shared property-test harness: a dense reference of the visible key set, a
harness that drives a real cache beside it, the layouts and op sequences hypothesis draws, and the
driver. tests/test_cache_paged.py, test_cache_dense.py and test_cache_fp8.py use it. Also a stream
through a split dense backend beside the plain one (test_cache_dense.py, test_cache_leftover_rows.py)."""

from __future__ import annotations

from hypothesis import strategies as st

from stream_recon.cache import CacheLayout


class DenseReference:
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
    """Drives a real cache beside the dense reference and writes (frame, token) labels into a fake
    store through the cache's token slots. Layouts whose data moves override `apply_moves`."""

    def __init__(self, layout: CacheLayout, cache):
        self.layout = layout
        self.cache = cache
        self.reference = DenseReference(layout)
        self.store: dict[int, tuple[int, int]] = {}
        self.next_frame = 0

    def apply_moves(self):
        pass

    def append(self, defer: bool):
        frame = self.next_frame
        self.next_frame += 1
        self.cache.append(defer_eviction=defer)
        self.apply_moves()  # before the step writes (a backup must not see the new frame)
        for token, slot in enumerate(self.cache.token_slots(-1)):
            self.store[slot] = (frame, token)
        self.reference.pending.append(frame)
        self.reference.pending_deferred = defer

    def commit(self):
        self.cache.commit()
        self.apply_moves()
        self.reference.commit()

    def rollback(self):
        self.cache.rollback()
        self.apply_moves()
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


def exact_attention(q, k, v):
    """q, k, v [1, H, *, D] -> (out, logsumexp): what the CUDA kernels of the split backend compute."""
    import torch

    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def stream_split_beside_dense(split_for, seed: int, rows: int | None = None) -> tuple[int, int]:
    """Stream 14 steps of a small dense layout (deferred evictions, rollbacks, commits) through the split
    backend `split_for(kv, full_patch_tokens)` makes and DenseAttention side by side, in float64 on the
    CPU, asserting each step's outputs equal. rows: a step's query rows (None: the frame's tokens).
    Returns the full-window patch-token counts (without and with the deferred frame)."""
    import torch

    from stream_recon.cache import DenseAttention, DenseKV
    from stream_recon.cache.dense import DenseTwoStreamCache

    layout = CacheLayout(patches_per_frame=3, specials_per_frame=2, scale_frames=2, window_frames=3)
    cache = DenseTwoStreamCache(layout, max_frames=40)
    kv = DenseKV(1, 2, 4, cache.capacity_tokens, torch.float64, "cpu")
    full = (layout.scale_frames + layout.window_frames) * layout.patches_per_frame
    full_patch_tokens = (full, full + layout.patches_per_frame)
    split, dense = split_for(kv, full_patch_tokens), DenseAttention(kv)
    generator = torch.Generator().manual_seed(seed)
    for step in range(14):
        cache.append(defer_eviction=step % 3 == 1)
        kv.apply_moves(cache.take_moves(), cache)
        slots = torch.tensor(cache.token_slots(-1))
        kv.write(0, slots, *(torch.randn(len(slots), 2, 4, generator=generator, dtype=torch.float64) for _ in range(2)))
        q = torch.randn(rows or len(slots), 2, 4, generator=generator, dtype=torch.float64)
        split.plan(cache.visible(), len(q))
        dense.plan(cache.visible(), len(q))
        torch.testing.assert_close(split.attend(0, q), dense.attend(0, q), rtol=0, atol=1e-12)
        (cache.rollback if step % 3 == 1 and step % 2 else cache.commit)()
        kv.apply_moves(cache.take_moves(), cache)
    return full_patch_tokens
