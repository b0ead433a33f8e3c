"""The dense layout against the same dense reference as the paged cache (hypothesis).

A fake store holds a (frame, token) label per position; the harness writes through token_slots,
performs the cache's moves, and reads the visible range. Key order does not matter to attention,
so the visible multiset must equal the reference's, with nothing outside the range counted.
"""

from __future__ import annotations

import dataclasses

import pytest
from cache_reference import OPS, LabelHarness, drive, exact_attention, layouts, stream_split_beside_dense
from hypothesis import given, settings
from hypothesis import strategies as st

from stream_recon.cache import CacheLayout
from stream_recon.cache.dense import DenseTwoStreamCache
from stream_recon.cache.layout import CacheCapacityError


class Harness(LabelHarness):
    def __init__(self, layout: CacheLayout, max_frames: int = 200):
        super().__init__(layout, DenseTwoStreamCache(layout, max_frames))

    def apply_moves(self):
        for move in self.cache.take_moves():
            source, target = self.cache.slot_tokens(move.source), self.cache.slot_tokens(move.target)
            for s, t in zip(source, target, strict=True):
                if s in self.store:
                    self.store[t] = self.store[s]

    def check(self):
        visible = self.cache.visible()
        assert 0 <= visible.start <= visible.end <= self.cache.capacity_tokens
        keys = sorted(self.store[i] for i in range(visible.start, visible.end))
        assert keys == sorted(self.reference.visible_tokens())
        assert self.cache.num_patch_frames == len(self.reference.visible_patch_frames())
        assert self.cache.num_committed_frames == len(self.reference.committed)
        assert self.cache.num_special_tokens == len(self.reference.live) * self.layout.specials_per_frame


@settings(max_examples=300, deadline=None)
@given(layout=layouts(), data=st.data(), ops=st.lists(OPS, max_size=25))
def test_contiguous_cache_matches_dense_reference(layout, data, ops):
    # Phase 1 appends up to scale_frames frames together (the dense layout's restriction).
    scale_batch = data.draw(st.integers(1, layout.scale_frames))
    drive(Harness(layout), scale_batch, ops)


@settings(max_examples=200, deadline=None)
@given(layout=layouts(), data=st.data(), ops=st.lists(OPS, max_size=25))
def test_a_cache_with_fewer_window_slots_hands_its_frames_over_to_a_full_one(layout, data, ops):
    """A spare engine's cache: it allocates fewer window slots than its window, computes as the full
    one until they are all in use (the next window frame is refused, nothing changed), and a full
    cache that takes its frames over goes on as if it had held them all along."""
    slots = data.draw(st.integers(1, layout.window_frames))
    small = Harness(dataclasses.replace(layout, window_slots=slots))
    assert small.cache.num_frame_slots == layout.scale_frames + slots + 1
    scale_batch = data.draw(st.integers(1, layout.scale_frames))
    drive(small, scale_batch, [])
    handed_over_at = data.draw(st.integers(0, len(ops)))
    for op in ops[:handed_over_at]:
        if len(small.cache._window) == slots < layout.window_frames:
            with pytest.raises(CacheCapacityError, match="frame slots"):
                small.cache.append()
            small.check()
            break
        drive_one(small, op)
    full = Harness(layout)
    full.cache.take_over(small.cache)
    visible = full.cache.visible()
    full.store = {i: small.store[i] for i in range(visible.start, visible.end)}
    full.reference, full.next_frame = small.reference, small.next_frame
    full.check()
    for op in ops[handed_over_at:]:
        drive_one(full, op)


def drive_one(h, op: str) -> None:
    h.append(defer=op.startswith("defer"))
    h.check()
    (h.commit if op in ("key", "defer_commit") else h.rollback)()
    h.check()


def test_a_cache_takes_over_only_committed_frames_of_its_geometry():
    layout = CacheLayout(patches_per_frame=2, specials_per_frame=1, scale_frames=1, window_frames=3)
    small = DenseTwoStreamCache(dataclasses.replace(layout, window_slots=1), max_frames=10)
    small.append()
    with pytest.raises(ValueError, match="committed frames only"):
        DenseTwoStreamCache(layout, max_frames=10).take_over(small)
    with pytest.raises(ValueError, match="geometry"):
        DenseTwoStreamCache(dataclasses.replace(layout, patches_per_frame=3), max_frames=10).take_over(small)
    with pytest.raises(ValueError, match="window_slots"):
        CacheLayout(patches_per_frame=2, specials_per_frame=6, scale_frames=8, window_frames=3, window_slots=4)


def test_moves_keep_the_window_compact():
    layout = CacheLayout(patches_per_frame=2, specials_per_frame=1, scale_frames=1, window_frames=2)
    cache = DenseTwoStreamCache(layout, max_frames=10)
    for _ in range(3):  # scale f0, window f1 f2
        cache.append()
        cache.commit()
    assert cache.take_moves() == []
    cache.append(defer_eviction=True)  # f3 takes the spare slot: 1 + 3 patch frames visible
    assert cache.token_slots(-1)[-2:] == list(cache.slot_tokens(cache.spare_slot))
    assert cache.visible().num_tokens == 4 * 1 + 4 * 2
    cache.commit()  # f1 leaves; f3 moves from the spare into f1's slot
    [move] = cache.take_moves()
    assert (move.source, move.target) == (cache.spare_slot, 1)
    assert cache.visible().num_tokens == 4 * 1 + 3 * 2


def test_capacity_error_names_the_remedy():
    layout = CacheLayout(patches_per_frame=2, specials_per_frame=1, scale_frames=1, window_frames=2)
    cache = DenseTwoStreamCache(layout, max_frames=3)
    for _ in range(3):
        cache.append()
        cache.commit()
    with pytest.raises(ValueError, match="chunked streaming"):
        cache.append()


def test_scale_and_window_frames_cannot_share_a_step():
    layout = CacheLayout(patches_per_frame=2, specials_per_frame=1, scale_frames=1, window_frames=2)
    cache = DenseTwoStreamCache(layout, max_frames=10)
    cache.append()
    with pytest.raises(ValueError, match="scale frames"):
        cache.append()
    assert cache.num_special_tokens == 1 and cache.num_pending_frames == 1  # the refused append changed nothing


def test_partial_attentions_merge_into_the_full_one():
    import torch

    from stream_recon.cache import merge_partial_attention

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 3, 5, 8, generator=generator, dtype=torch.float64) for _ in range(3))
    k, v = torch.cat([k, 3 * torch.randn(1, 3, 7, 8, generator=generator, dtype=torch.float64)], 2), torch.cat(
        [v, torch.randn(1, 3, 7, 8, generator=generator, dtype=torch.float64)], 2)

    def partial(keys, values):
        scores = q @ keys.transpose(-1, -2) / 8**0.5
        return torch.softmax(scores, -1) @ values, torch.logsumexp(scores, -1)

    merged = merge_partial_attention(*partial(k[:, :, :4], v[:, :, :4]), *partial(k[:, :, 4:], v[:, :, 4:]))
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(merged, full, rtol=0, atol=1e-12)


def test_split_attention_equals_dense_attention_through_a_stream():
    """dense-cudnn's bookkeeping (which keys go to which kernel, when the fixed-shape path is
    taken, the merge) on the CPU, with exact float64 kernels standing in for cuDNN and flash."""
    from stream_recon.cache import SplitCudnnAttention

    fixed_calls = []

    def fixed(q, k, v):
        fixed_calls.append(k.shape[2])
        return exact_attention(q, k, v)

    full_patch_tokens = stream_split_beside_dense(lambda kv, full: SplitCudnnAttention(kv, full, fixed, exact_attention),
                                                  seed=1)
    assert set(fixed_calls) == set(full_patch_tokens)  # both full-window shapes, nothing else
