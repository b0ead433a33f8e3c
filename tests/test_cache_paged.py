"""The two-stream cache's page tables against a reference of the visible key set (hypothesis), the runs of
rows the range kernel reads, a spare's cache handing its frames over, plus worked examples."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from cache_reference import OPS, LabelHarness, drive, layouts
from hypothesis import given, settings
from hypothesis import strategies as st

from stream_recon.cache import CacheCapacityError, CacheLayout, PagedTwoStreamCache, PagePool


def free_ids(pool: PagePool) -> list[int]:
    return pool.free_in_order()


class Harness(LabelHarness):
    """Pages never move; the check also audits the page pool."""

    def __init__(self, layout: CacheLayout, initial_pages: int, max_pages: int | None = None, first_id: int = 0):
        pool = PagePool(initial_pages, grow_by=2, max_pages=max_pages, first_id=first_id)
        super().__init__(layout, PagedTwoStreamCache(layout, pool))

    def read_visible(self) -> list[tuple[int, int]]:
        visible = self.cache.visible_pages()
        size = visible.page_size
        slots = [page * size + offset for page in visible.page_ids for offset in range(size)][: visible.num_tokens]
        return [self.store[slot] for slot in slots]

    def read_runs(self) -> list[tuple[int, int]]:
        """What the range kernel reads: every row of every run (their order does not matter to attention)."""
        return [self.store[row] for start, rows in self.cache.visible_pages().runs() for row in range(start, start + rows)]

    def check(self):
        cache, reference = self.cache, self.reference
        assert self.read_visible() == reference.visible_tokens()
        assert sorted(self.read_runs()) == sorted(reference.visible_tokens())
        specials = len(reference.live) * self.layout.specials_per_frame
        special_pages = math.ceil(specials / self.layout.page_size)
        assert len(cache.special_pages) == special_pages
        assert cache.num_patch_frames == len(reference.visible_patch_frames())
        assert cache.num_committed_frames == len(reference.committed)
        held = len(set(cache.scale_pages) | set(cache.window_pages) | set(cache.special_pages))
        # Pages pushed out of the window by a pending frame stay allocated until it is committed.
        pending_evicted = sum(len(p.evicted) for p in cache._pending)
        assert held == len(cache.scale_pages) + len(cache.window_pages) + len(cache.special_pages)
        assert (cache.pool.num_pages - cache.pool.num_free) == held + pending_evicted, "leaked or double-used pages"
        free = free_ids(cache.pool)
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
                  h.cache.num_special_tokens, sorted(free_ids(h.cache.pool)), h.cache.pool.num_pages)
        h.append(defer=op.startswith("defer"))
        h.rollback()
        after = (list(h.cache.scale_pages), list(h.cache.window_pages), list(h.cache.special_pages),
                 h.cache.num_special_tokens, sorted(free_ids(h.cache.pool)), h.cache.pool.num_pages)
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
              sorted(free_ids(cache.pool)), cache.pool.num_pages)
    # f3 needs a patch page and a third special page: 6 pages, one over the limit
    with pytest.raises(CacheCapacityError, match="needs 2 more pages but is at its limit of 5"):
        cache.append(defer_eviction=True)
    after = (list(cache.scale_pages), list(cache.window_pages), list(cache.special_pages), cache.num_special_tokens,
             sorted(free_ids(cache.pool)), cache.pool.num_pages)
    assert after == before and cache.num_pending_frames == 0 and cache.num_committed_frames == 3


# -- the runs of rows the range kernel reads ---------------------------------------------------------
def test_runs_worked_example():
    from stream_recon.cache import VisiblePages

    visible = VisiblePages(page_ids=(7, 8, 2, 3, 4, 9), last_page_len=2, page_size=4, num_scale_pages=2,
                           num_window_pages=3, num_special_pages=1, num_special_tokens=2)
    assert visible.runs() == ((8, 12), (28, 10))
    # the last page in key order is the partial one, wherever it lies in the storage; it ends its run
    assert dataclasses.replace(visible, page_ids=(3, 2)).runs() == ((8, 2), (12, 4))
    assert dataclasses.replace(visible, page_ids=(2, 1)).runs() == ((4, 2), (8, 4))
    assert dataclasses.replace(visible, page_ids=()).runs() == ()


@pytest.mark.parametrize(("height", "keyframe_share"), [(378, 1.0), (392, 0.5), (294, 0.15)])
def test_a_long_stream_reads_its_keys_as_a_few_runs(height, keyframe_share):
    """The product's layout (8 scale frames, a window of 64, 1 special page per 172 frames) over 3 chunks of a
    stream whose frames are each appended deferred and kept or rolled back at random: the window is a ring
    over its pages and the pool hands out the page after the newest, so the 75-odd visible pages read as a
    handful of runs (each run costs the kernel one partial key block)."""
    patches = (height // 14) * 37
    layout = CacheLayout(patches_per_frame=patches, specials_per_frame=6, scale_frames=8, window_frames=64)
    limit = PagedTwoStreamCache.pages_needed(layout, 321)
    cache = PagedTwoStreamCache(layout, PagePool(limit, max_pages=limit))
    generator = random.Random(height)
    most = 0
    for _chunk in range(3):
        for _ in range(8):
            cache.append()
        cache.commit()
        while cache.num_committed_frames < 320:
            cache.append(defer_eviction=True)
            most = max(most, len(cache.visible_pages().runs()))
            (cache.commit if generator.random() < keyframe_share else cache.rollback)()
        cache.reset()
        assert (cache.pool.num_pages - cache.pool.num_free) == 0
    assert most <= 4


# -- a spare's cache: fewer window pages, its frames handed over ------------------------------------
def drive_one(h, op: str) -> None:
    h.append(defer=op.startswith("defer"))
    h.check()
    (h.commit if op in ("key", "defer_commit") else h.rollback)()
    h.check()


@settings(max_examples=200, deadline=None)
@given(layout=layouts(), data=st.data(), ops=st.lists(OPS, max_size=25))
def test_a_cache_with_fewer_window_pages_hands_its_frames_over_to_a_full_one(layout, data, ops):
    """A spare engine's cache: its pool holds pages for fewer window frames than its window, it computes as
    the full one until they are all in use (the next window frame is refused, nothing changed), and a full
    cache that takes its frames over (page for page, into its own pool) goes on as if it had held them all
    along."""
    slots = data.draw(st.integers(1, layout.window_frames))
    small_layout = dataclasses.replace(layout, window_slots=slots)
    small_limit = PagedTwoStreamCache.pages_needed(small_layout, 40)
    small = Harness(small_layout, small_limit, max_pages=small_limit)
    drive(small, data.draw(st.integers(1, layout.scale_frames)), [])
    handed_over_at = data.draw(st.integers(0, len(ops)))
    for op in ops[:handed_over_at]:
        if len(small.cache.window_pages) == slots < layout.window_frames:
            with pytest.raises(CacheCapacityError, match="pages for"):
                small.cache.append()
            small.check()
            break
        drive_one(small, op)
    full = Harness(layout, 2)
    copies = full.cache.take_over(small.cache)
    full.store = {target * layout.page_size + offset: small.store[source * layout.page_size + offset]
                  for source, target in copies for offset in range(layout.page_size)
                  if source * layout.page_size + offset in small.store}
    full.reference, full.next_frame = small.reference, small.next_frame
    full.check()
    for op in ops[handed_over_at:]:
        drive_one(full, op)


def test_a_cache_takes_over_only_committed_frames_of_its_geometry():
    layout = CacheLayout(patches_per_frame=2, specials_per_frame=1, scale_frames=1, window_frames=3)
    small = PagedTwoStreamCache(dataclasses.replace(layout, window_slots=1), PagePool(4))
    small.append()
    with pytest.raises(ValueError, match="committed frames only"):
        PagedTwoStreamCache(layout).take_over(small)
    with pytest.raises(ValueError, match="geometry"):
        PagedTwoStreamCache(dataclasses.replace(layout, patches_per_frame=3)).take_over(small)
    with pytest.raises(ValueError, match="window_slots"):
        CacheLayout(patches_per_frame=2, specials_per_frame=6, scale_frames=8, window_frames=3, window_slots=4)


# -- the pool's order ----------------------------------------------------------------------------------
def test_the_pool_hands_out_the_page_after_and_takes_freed_pages_back_first():
    pool = PagePool(6)
    assert [pool.allocate(), pool.allocate(last=True), pool.allocate(after=0)] == [0, 5, 1]
    assert pool.allocate(after=5) == 2  # (no page 6: the front of the free list)
    pool.free(1)
    assert pool.allocate(after=4) == 1  # a freed page comes back first
    pool.free(5, last=True)
    assert pool.allocate(last=True) == 5
    with pytest.raises(ValueError, match="not in use"):
        pool.free(3)
    for page in (0, 2):
        pool.free(page)
    pool.sort_free()
    assert free_ids(pool) == [0, 2, 3, 4]


class CountingPool(PagePool):
    """A pool that counts every page it hands out and takes back."""

    taken = freed = 0

    def allocate(self, after=None, last=False):
        self.taken += 1
        return super().allocate(after, last)

    def free(self, page_id, last=False):
        self.freed += 1
        super().free(page_id, last)

    def take(self, page_ids, free_first):
        self.taken += len(page_ids)
        super().take(page_ids, free_first)


def test_every_page_taken_is_freed_over_10000_frames_of_flow_keyframes_and_rollovers():
    """The page tables as a chunked stream drives them at the product's sizes: 10,000 frames, each appended
    deferred and kept (a keyframe) or rolled back, a chunk of 320 keyframes then a rollover, where a spare's
    cache (pages for 16 + 6 window frames, past the stream's in one storage) took the next chunk's first frames
    and the stream's cache takes them over and the spare starts afresh. Every page taken is freed, by either
    cache, no pool grows, and the two never hold one page."""
    layout = CacheLayout(patches_per_frame=1036, specials_per_frame=6, scale_frames=8, window_frames=64)
    spare_layout = dataclasses.replace(layout, window_slots=22)
    pools, first_id = {}, 0
    for name, shape in (("stream", layout), ("spare", spare_layout)):
        limit = PagedTwoStreamCache.pages_needed(shape, 321)
        pools[name] = CountingPool(limit, max_pages=limit, first_id=first_id)
        first_id += limit
    stream = PagedTwoStreamCache(layout, pools["stream"])
    spare = PagedTwoStreamCache(spare_layout, pools["spare"])
    generator = random.Random(10_000)
    frames = 0
    while frames < 10_000:
        for cache in (stream, spare):  # the spare takes the overlap's frames, as the stream's cache does
            for _ in range(8):
                cache.append()
            cache.commit()
        for _ in range(16 - 8):
            for cache in (stream, spare):
                cache.append(defer_eviction=True)
                cache.commit()
        copies = stream.take_over(spare)
        assert all(source >= pools["spare"].first_id > target for source, target in copies)
        spare.reset()
        while stream.num_committed_frames < 320 and frames < 10_000:
            stream.append(defer_eviction=True)
            (stream.commit if generator.random() < 0.4 else stream.rollback)()
            frames += 1
        stream.reset()  # the rollover: the chunk's pages back to the pool
        for pool in pools.values():
            assert pool.num_pages == pool.num_free and pool.taken == pool.freed
    for pool in pools.values():
        assert pool.num_pages == pool.max_pages
    assert pools["stream"].taken > 10_000


@settings(max_examples=300, deadline=None)
@given(layout=layouts(), data=st.data(), before=st.lists(OPS, max_size=12), ops=st.lists(OPS, max_size=30))
def test_a_cache_taking_over_reads_its_keys_as_a_rollover_in_place_would(layout, data, before, ops):
    """In place: one cache (a pool of the whole window), emptied at the rollover, then the new chunk's frames.
    Ahead: a spare's cache (a pool of its own over the pages past the stream's in one storage, maybe of fewer
    window pages) takes the chunk's first frames, and a cache of the whole window, emptied, takes them over. For
    every later frame the two read the same keys in the same runs of rows, in the same order: what the range
    kernel sums the same way, bit for bit."""
    slots = data.draw(st.integers(1, layout.window_frames))
    spare_layout = dataclasses.replace(layout, window_slots=slots)
    limit, spare_limit = (PagedTwoStreamCache.pages_needed(shape, 40) for shape in (layout, spare_layout))
    in_place, current = (Harness(layout, limit, max_pages=limit) for _ in range(2))
    for h in (in_place, current):  # the chunk before: pools used in another order, then emptied
        drive(h, 1, before)
        h.cache.reset()
        h.reference, h.next_frame = type(h.reference)(layout), 0
    spare = Harness(spare_layout, spare_limit, max_pages=spare_limit, first_id=limit)
    scale_batch = data.draw(st.integers(1, layout.scale_frames))
    for h in (in_place, spare):
        drive(h, scale_batch, [])
    handed_over_at = 0
    for op in ops:
        if len(spare.cache.window_pages) == slots < layout.window_frames:
            break  # the spare has no page left for another window frame: the stream takes over here
        for h in (in_place, spare):
            drive_one(h, op)
        handed_over_at += 1
    copies = current.cache.take_over(spare.cache)
    size = layout.page_size
    current.store = {target * size + offset: spare.store[source * size + offset]
                     for source, target in copies for offset in range(size) if source * size + offset in spare.store}
    current.reference, current.next_frame = spare.reference, spare.next_frame
    in_place.next_frame = spare.next_frame
    for op in ops[handed_over_at:]:
        assert current.read_runs() == in_place.read_runs()
        assert [rows for _, rows in current.cache.visible_pages().runs()] == [
            rows for _, rows in in_place.cache.visible_pages().runs()]
        for h in (in_place, current):
            drive_one(h, op)
    assert current.read_runs() == in_place.read_runs()


def test_a_pool_over_a_block_past_another_hands_out_frees_and_takes_its_own_ids_only():
    pool = PagePool(4, max_pages=4, first_id=10)
    assert (pool.first_id, pool.end_id, pool.whole) == (10, 14, True)
    assert [pool.allocate() for _ in range(2)] == [10, 11]
    assert pool.allocate(after=11) == 12 and pool.allocate(last=True) == 13
    with pytest.raises(CacheCapacityError):
        pool.allocate()
    for page in (12, 10):
        pool.free(page)
    assert pool.free_in_order() == [10, 12]
    with pytest.raises(ValueError, match="not in use"):
        pool.free(3)  # another pool's id
    pool.free(11)
    pool.free(13)
    pool.sort_free()
    pool.take([12, 13], free_first=[11])
    assert pool.free_in_order() == [11, 10]
    with pytest.raises(CacheCapacityError, match="page 14"):
        pool.take([14], free_first=[])
