"""Points computed ahead (PointAccumulator.frame_points, as refine's workers compute them for later frames while
the cloud merges earlier ones) give the cloud that computing them in place gives: a frame whose grid changed
since (the first frame set it, or a coarsening doubled it) is computed again, never merged on the old grid."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from stream_recon.app.outputs.pointcloud import PointAccumulator


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
