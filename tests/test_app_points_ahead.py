"""Points computed ahead (PointAccumulator.frame_points, as refine's workers compute them for later frames while
the cloud merges earlier ones) give the cloud that computing them in place gives: a frame whose grid changed
since (the first frame set it, or a coarsening doubled it) is computed again, never merged on the old grid; and
batches of frames merged ahead (batch_points) give what the frames added one by one give."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from stream_recon.app.outputs.pointcloud import BatchPoints, FrameDepth, PointAccumulator


def frames(seed: int, count: int, height: int = 24, width: int = 32) -> list[tuple]:
    rng = np.random.default_rng(seed)
    intrinsics = np.array([[30.0, 0, width / 2], [0, 30.0, height / 2], [0, 0, 1]], np.float32)
    out = []
    for index in range(count):
        c2w = np.eye(4, dtype=np.float32)[:3]
        c2w[:, 3] = rng.normal(0, 0.3, 3)
        depth = rng.uniform(0.5, 4.0, (height, width)).astype(np.float32)
        depth[rng.random((height, width)) < 0.05] = np.nan
        conf = rng.uniform(0.5, 6.0, (height, width)).astype(np.float32)
        if index == 0 and seed % 3 == 0:
            conf[:] = 0.1  # a first frame with no confident pixel: the grid waits for the next
        image = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
        dropped = rng.random((height, width)) < 0.1 if seed % 2 else None
        out.append((index, depth, conf, intrinsics, c2w, image, dropped))
    return out


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), ahead=st.integers(1, 4), max_points=st.sampled_from([80, 400, 100_000]))
def test_points_computed_ahead_merge_as_points_computed_in_place(seed: int, ahead: int, max_points: int) -> None:
    stream = frames(seed, 12)
    in_place = PointAccumulator(max_points=max_points)
    for index, *arrays in stream:
        in_place.add_frame(index, *arrays)
    computed_ahead = PointAccumulator(max_points=max_points)
    early = {}
    for index, *arrays in stream:
        for later in range(index, min(len(stream), index + ahead)):
            early.setdefault(later, computed_ahead.frame_points(*stream[later][1:5], stream[later][6]))
        computed_ahead.add_frame(index, *arrays, points=early.pop(index))
    a, b = in_place.cloud(), computed_ahead.cloud()
    for field in ("xyz", "rgb", "frame_index", "pixel"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
    assert (in_place.voxel_size, in_place.num_coarsenings, in_place.num_out_of_range, in_place.frames_added) == \
        (computed_ahead.voxel_size, computed_ahead.num_coarsenings, computed_ahead.num_out_of_range,
         computed_ahead.frames_added)
    assert in_place.empty_reason("masks") == computed_ahead.empty_reason("masks")


def test_frame_points_change_nothing() -> None:
    stream = frames(1, 3)
    accumulator = PointAccumulator()
    accumulator.add_frame(*stream[0])
    before = (accumulator.cloud().xyz.copy(), accumulator.voxel_size, accumulator.frames_added)
    points = accumulator.frame_points(*stream[1][1:5], stream[1][6])
    assert len(points.keys) > 0 and points.grid == (accumulator.voxel_size, accumulator.reference_depth)
    after = (accumulator.cloud().xyz, accumulator.voxel_size, accumulator.frames_added)
    np.testing.assert_array_equal(before[0], after[0])
    assert before[1:] == after[1:]


class SmallLevels(PointAccumulator):
    """Its recent level merged into the large one from 16 keys on: the lookups of a long run's cloud, at once."""

    _MIN_RECENT = 16


def merged_in_batches(stream: list[tuple], size: int, ahead: int, accumulator: PointAccumulator) -> int:
    """The frames into `accumulator` in batches of `size`, each batch's points computed `ahead` batches before its
    merge (as refine's workers compute them), a batch that cannot be merged (grid not set, or changed) added
    frame by frame; returns the batches merged whole."""
    whole = 0
    batches = [stream[start:start + size] for start in range(0, len(stream), size)]
    early: dict[int, BatchPoints | None] = {}
    for number, batch in enumerate(batches):
        for later in range(number, min(len(batches), number + ahead)):
            if later not in early:
                early[later] = accumulator.batch_points([FrameDepth(*frame) for frame in batches[later]])
        merged = early.pop(number)
        if merged is not None and accumulator.fits(merged):
            accumulator.add_batch(merged)
            whole += 1
        else:
            for frame in batch:
                accumulator.add_frame(*frame)
    return whole


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), size=st.integers(1, 5), ahead=st.integers(1, 3),
       max_points=st.sampled_from([80, 400, 100_000]), small_levels=st.booleans())
def test_batches_merged_ahead_give_the_cloud_frames_added_one_by_one_give(seed: int, size: int, ahead: int,
                                                                          max_points: int, small_levels: bool) -> None:
    stream = frames(seed, 12)
    kind = SmallLevels if small_levels else PointAccumulator
    one_by_one, batched = kind(max_points=max_points), kind(max_points=max_points)
    for frame in stream:
        one_by_one.add_frame(*frame)
    whole = merged_in_batches(stream, size, ahead, batched)
    assert len(batched) <= max_points and batched.frames_added == len(stream)
    if ahead == 1 and size <= 4 and max_points == 100_000 and len(one_by_one):
        assert whole > 0  # (computed once the grid is set, every batch after the first is merged whole)
    assert batched.empty_reason("masks") == one_by_one.empty_reason("masks")
    if one_by_one.num_coarsenings or batched.num_coarsenings:
        return  # a batch keeps the cap after its last frame, not after each: the same cap, other points
    a, b = one_by_one.cloud(), batched.cloud()
    for field in ("xyz", "rgb", "frame_index", "pixel"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
    assert (one_by_one.voxel_size, one_by_one.num_out_of_range) == (batched.voxel_size, batched.num_out_of_range)
