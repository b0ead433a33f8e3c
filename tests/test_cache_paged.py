"""The two-stream cache bookkeeping against a dense reference (hypothesis), plus worked examples."""

from __future__ import annotations

import math

import pytest
from cache_reference import OPS, LabelHarness, drive, layouts
from hypothesis import given, settings
from hypothesis import strategies as st

from stream_recon.cache import CacheLayout, PagedTwoStreamCache, PagePool


class Harness(LabelHarness):
    """The paged layout: pages never move; the check also audits the page pool."""

    def __init__(self, layout: CacheLayout, initial_pages: int):
        super().__init__(layout, PagedTwoStreamCache(layout, PagePool(initial_pages, grow_by=2)))

    def read_visible(self) -> list[tuple[int, int]]:
        visible = self.cache.visible_pages()
        size = visible.page_size
        slots = [page * size + offset for page in visible.page_ids for offset in range(size)][: visible.num_tokens]
        return [self.store[slot] for slot in slots]

    def check(self):
        cache, reference = self.cache, self.reference
        assert self.read_visible() == reference.visible_tokens()
        specials = len(reference.live) * self.layout.specials_per_frame
        special_pages = math.ceil(specials / self.layout.page_size)
        assert len(cache.special_pages) == special_pages
        assert cache.num_patch_frames == len(reference.visible_patch_frames())
        assert cache.num_committed_frames == len(reference.committed)
        held = len(set(cache.scale_pages) | set(cache.window_pages) | set(cache.special_pages))
        # Pages pushed out of the window by a pending frame stay allocated until it is committed.
        pending_evicted = sum(len(p.evicted) for p in cache._pending)
        assert held == len(cache.scale_pages) + len(cache.window_pages) + len(cache.special_pages)
        assert cache.pool.num_used == held + pending_evicted, "leaked or double-used pages"
        free = cache.pool.free_ids()
        assert len(set(free)) == len(free)
        assert not set(free) & (set(cache.scale_pages) | set(cache.window_pages) | set(cache.special_pages))


@settings(max_examples=300, deadline=None)
@given(layout=layouts(), scale_batch=st.integers(1, 3), ops=st.lists(OPS, max_size=25), initial=st.integers(1, 4))
def test_cache_matches_dense_reference(layout, scale_batch, ops, initial):
    drive(Harness(layout, initial), scale_batch, ops)


@settings(max_examples=100, deadline=None)
@given(layout=layouts(), ops=st.lists(OPS, min_size=1, max_size=20))
def test_rollback_restores_everything(layout, ops):
    h = Harness(layout, 2)
    h.append(defer=False)
    h.commit()
    for op in ops:
        before = (list(h.cache.scale_pages), list(h.cache.window_pages), list(h.cache.special_pages),
                  h.cache.num_special_tokens, sorted(h.cache.pool.free_ids()), h.cache.pool.num_pages)
        h.append(defer=op.startswith("defer"))
        h.rollback()
        after = (list(h.cache.scale_pages), list(h.cache.window_pages), list(h.cache.special_pages),
                 h.cache.num_special_tokens, sorted(h.cache.pool.free_ids()), h.cache.pool.num_pages)
        # The pool may have grown, but every page the append took is free again.
        assert after[:4] == before[:4]
        assert set(before[4]) <= set(after[4])
        assert set(after[4]) - set(before[4]) == set(range(before[5], after[5]))
        h.append(defer=False)
        h.commit()


def test_worked_example_window_and_specials():
    # page_size 3, 2 specials per frame, 1 scale frame, window 2.
    layout = CacheLayout(patches_per_frame=3, specials_per_frame=2, scale_frames=1, window_frames=2)
    cache = PagedTwoStreamCache(layout, PagePool(4, grow_by=1))
    for _ in range(4):
        cache.append()
        cache.commit()
    # frames f0..f3: scale [f0], window [f2 f3] (f1 evicted), specials f0 f0 f1 | f1 f2 f2 | f3 f3
    visible = cache.visible_pages()
    assert visible.num_scale_pages == 1 and visible.num_window_pages == 2
    assert visible.num_special_pages == 3 and visible.last_page_len == 2
    assert visible.num_tokens == 3 * 3 + 8
    assert cache.num_committed_frames == 4


def test_page_pool_grows_instead_of_failing():
    pool = PagePool(1, grow_by=3)
    assert [pool.allocate() for _ in range(5)] == [0, 1, 2, 3, 4]
    assert pool.num_pages == 7 and pool.num_free == 2


def test_special_pool_never_runs_out_over_a_long_stream():
    layout = CacheLayout(patches_per_frame=5, specials_per_frame=6, scale_frames=2, window_frames=3)
    cache = PagedTwoStreamCache(layout)
    for _ in range(3000):
        cache.append()
        cache.commit()
    assert cache.num_committed_frames == 3000
    assert len(cache.special_pages) == math.ceil(3000 * 6 / 5)
    assert cache.num_patch_frames == 5


def test_layout_rejects_nonsense():
    with pytest.raises(ValueError, match="scale_frames and window_frames must be >= 1"):
        CacheLayout(patches_per_frame=4, specials_per_frame=6, scale_frames=8, window_frames=0)


def test_budget_page_pool_grows_up_to_its_limit_and_no_further():
    from stream_recon.cache import CacheCapacityError

    pool = PagePool(2, grow_by=3, max_pages=4)
    assert [pool.allocate() for _ in range(4)] == [0, 1, 2, 3]
    assert pool.num_pages == 4  # the second growth step was cut to the limit
    advice = r"needs 1 more pages but is at its limit of 4; start a fresh cache \(chunked streaming\)"
    with pytest.raises(CacheCapacityError, match=advice):
        pool.allocate()
    pool.free(2)
    pool.require(1)
    assert pool.allocate() == 2


def test_budget_paged_append_at_the_limit_changes_nothing():
    from stream_recon.cache import CacheCapacityError

    # page_size 3, 2 specials per frame, 1 scale frame, window 1: at most 3 patch pages in use
    layout = CacheLayout(patches_per_frame=3, specials_per_frame=2, scale_frames=1, window_frames=1)
    limit = PagedTwoStreamCache.pages_needed(layout, max_frames=3)
    assert limit == 3 + 2  # 3 patch pages + ceil(3 frames x 2 specials / 3)
    cache = PagedTwoStreamCache(layout, PagePool(1, grow_by=1, max_pages=limit))
    for _ in range(3):  # frames f0..f2: scale [f0], window [f2], specials f0 f0 f1 | f1 f2 f2
        cache.append(defer_eviction=True)
        cache.commit()
    # f2 pending kept f1's page until its commit: the pool reached its limit and f1's page is free
    assert cache.pool.num_pages == limit and cache.pool.num_free == 1
    before = (list(cache.scale_pages), list(cache.window_pages), list(cache.special_pages), cache.num_special_tokens,
              sorted(cache.pool.free_ids()), cache.pool.num_pages)
    # f3 needs a patch page and a third special page: 6 pages, one over the limit
    with pytest.raises(CacheCapacityError, match="needs 2 more pages but is at its limit of 5"):
        cache.append(defer_eviction=True)
    after = (list(cache.scale_pages), list(cache.window_pages), list(cache.special_pages), cache.num_special_tokens,
             sorted(cache.pool.free_ids()), cache.pool.num_pages)
    assert after == before and cache.num_pending_frames == 0 and cache.num_committed_frames == 3
