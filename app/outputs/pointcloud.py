"""The run's point cloud: voxel-downsampled world points from a stream of depth maps, and its PLY file.

The writer feeds it every frame of a run (points.ply) and the exporter rebuilds it from the npz files with
other thresholds; both write the result with `write_ply`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from plyfile import PlyData, PlyElement

from stream_recon.app.options import DEFAULT_CONF_THRESHOLD as DEFAULT_CONF_THRESHOLD
from stream_recon.app.outputs.atomic_writes import atomic_write
from stream_recon.app.outputs.voxel_keys import (
    KEY_OFFSET,
    first_in_runs,
    first_of_each,
    in_sorted,
    voxel_keys,
)
from stream_recon.models.stream.pose import back_project

logger = logging.getLogger(__name__)

# About 40 bytes per kept point (xyz, colour, key, source frame and pixel): 1M points is ~40 MB.
DEFAULT_MAX_POINTS = 1_000_000
# The model's scale is unknown, so an automatic voxel is relative: 1/200 of the first frame's median
# depth is about two pixels' footprint at that depth for a 518-pixel-wide input with a 60 degree FOV.
AUTO_VOXEL_FRACTION = 1.0 / 200.0

# The grid holds 2**20 voxels on each side of the origin per axis, so a voxel under this fraction of the first
# frame's median depth leaves points 64 median depths away outside it (dropped), and a fine enough one every
# point: a voxel asked for below it is raised to it, with a warning.
MIN_VOXEL_FRACTION = 64.0 / KEY_OFFSET


@dataclass(frozen=True)
class PointCloud:
    """A coloured cloud with the pixel each point was back-projected from.

    xyz [N, 3] float32 world, rgb [N, 3] uint8, frame_index [N] int64 and pixel [N, 2] int32 (u, v) name the
    source observation, so exporters can write a track for every point.
    """

    xyz: np.ndarray
    rgb: np.ndarray
    frame_index: np.ndarray
    pixel: np.ndarray

    def __len__(self) -> int:
        return int(self.xyz.shape[0])


def _back_project_pixels(
    u: np.ndarray, v: np.ndarray, z: np.ndarray, intrinsics: np.ndarray, c2w: np.ndarray
) -> np.ndarray:
    """Pixels (u [M], v [M]) at z-depth z [M] -> world points [M, 3] float32 through K^-1
    (models.stream.pose.back_project), then c2w.

    The camera-to-world step is nine multiply-adds rather than a [M, 3] @ [3, 3] matmul: BLAS runs
    that shape on all threads and, on a busy machine, takes tens of ms instead of one. The result is a
    [3, M] array seen as [M, 3], so that every pass runs over contiguous memory (a 518 x 378 frame in
    ~1 ms).
    """
    z = np.asarray(z, dtype=np.float32)
    x, y = back_project(u, v, z, intrinsics, np.float32)
    c2w = np.asarray(c2w, dtype=np.float32)
    world = np.empty((3, len(z)), dtype=np.float32)  # [3, M]
    term = np.empty(len(z), dtype=np.float32)
    for row in range(3):
        np.multiply(x, c2w[row, 0], out=world[row])
        world[row] += np.multiply(y, c2w[row, 1], out=term)
        world[row] += np.multiply(z, c2w[row, 2], out=term)
        world[row] += c2w[row, 3]
    return world.T  # [M, 3]


def _pixel_step(intrinsics: np.ndarray, voxel_size: float | None, reference_depth: float | None) -> int:
    """PointAccumulator.pixel_step on the grid (voxel_size, reference_depth)."""
    focal = float(min(intrinsics[0, 0], intrinsics[1, 1]))
    if reference_depth is None or not (np.isfinite(focal) and focal > 0):
        return 1
    return max(1, int(voxel_size * focal / reference_depth))


@dataclass(frozen=True)
class FramePoints:
    """One frame's candidate points (PointAccumulator.frame_points): the first sampled pixel of each voxel it
    reaches, keys [K] sorted, xyz [K, 3], pixel [K, 2] (u, v), on the grid (voxel size, the first frame's median
    depth) they were computed on; before the grid exists, only the frame's median confident depth, which sets
    it. Their colours are read from the picture at the merge, for the points it keeps only."""

    grid: tuple[float | None, float | None]
    saw_confident: bool
    saw_kept: bool
    median_depth: float | None
    out_of_range: int
    keys: np.ndarray
    xyz: np.ndarray
    pixel: np.ndarray

    @staticmethod
    def empty(grid: tuple[float | None, float | None], saw_confident: bool, saw_kept: bool,
              median_depth: float | None = None) -> FramePoints:
        return FramePoints(grid, saw_confident, saw_kept, median_depth, 0, np.empty(0, np.int64),
                           np.empty((0, 3), np.float32), np.empty((0, 2), np.int32))


@dataclass(frozen=True)
class FrameDepth:
    """What the cloud takes of one frame: depth, depth_conf [H, W]; image [H, W, 3] uint8 or None; dropped
    [H, W] bool or None (pixels left out whatever their confidence)."""

    frame_index: int
    depth: np.ndarray
    depth_conf: np.ndarray
    intrinsics: np.ndarray
    c2w: np.ndarray
    image: np.ndarray | None = None
    dropped: np.ndarray | None = None


@dataclass(frozen=True)
class BatchPoints:
    """Consecutive frames' candidate points as add_frame would take them one after the other, merged ahead
    (PointAccumulator.batch_points): each voxel's point from the earliest frame reaching it, rows in (frame,
    key) order; keys [K], xyz [K, 3], rgb [K, 3] uint8, frame [K], pixel [K, 2]; on the grid they were
    computed on; the frames' flags and counts."""

    grid: tuple[float | None, float | None]
    frames: int
    saw_confident: bool
    saw_kept: bool
    out_of_range: int
    keys: np.ndarray
    xyz: np.ndarray
    rgb: np.ndarray
    frame: np.ndarray
    pixel: np.ndarray


def _colours(image: np.ndarray | None, pixel: np.ndarray) -> np.ndarray:
    """[K, 3] uint8: the picture's colour at each pixel [K, 2] (u, v); a light grey for a frame without one."""
    if image is None:
        return np.full((len(pixel), 3), 200, dtype=np.uint8)
    return image[pixel[:, 1], pixel[:, 0]]


class PointAccumulator:
    """Voxel-downsampled world points from a stream of depth maps, capped at `max_points`.

    One point per occupied voxel: the first one to arrive is kept (its exact back-projection, not a voxel
    centre, so it still reprojects onto its source pixel). When the cap is exceeded the voxel size doubles
    and the cloud is re-downsampled, so memory is bounded however long the stream runs; the resolution is
    what gives way.

    Rows are append-only (amortised growth). Voxel membership is looked up in two sorted key arrays, a
    large merged one and a small recent one, like a two-level LSM tree: a frame costs a sort of its own
    keys, a binary search per distinct voxel and a merge into the small level, and the full merge runs only
    when the small level has grown to a quarter of the large one, so the per-frame cost does not grow with
    the cloud (about 10 ms for a 518 x 378 frame on one core of a busy machine; `scripts/bench_e2e.py`).

        merged: keys [K] sorted, rows [K]    recent: keys [R] sorted, rows [R]    R <= max(K / 4, 64k)
    """

    _MIN_RECENT = 1 << 16

    def __init__(
        self,
        *,
        conf_threshold: float = DEFAULT_CONF_THRESHOLD,
        voxel_size: float | None = None,
        max_points: int = DEFAULT_MAX_POINTS,
    ) -> None:
        if max_points < 1:
            raise ValueError(f"max points must be at least 1, got {max_points}")
        if voxel_size is not None and not (np.isfinite(voxel_size) and voxel_size > 0):
            raise ValueError(f"voxel size must be a positive number of scene units, got {voxel_size}")
        self.conf_threshold = float(conf_threshold)
        self.max_points = int(max_points)
        self.voxel_size: float | None = None if voxel_size is None else float(voxel_size)
        self.reference_depth: float | None = None  # median confident depth of the first frame
        self.num_coarsenings = 0
        self.num_out_of_range = 0
        self.voxel_raised_from: float | None = None  # a voxel asked for too fine for the scene (then raised)
        # what the frames held, for a cloud that ends empty (empty_reason): frames, confident pixels, kept ones
        self.frames_added = 0
        self._saw_confident = self._saw_kept = False
        self._count = 0
        self._keys = np.empty(0, dtype=np.int64)  # per row
        self._xyz = np.empty((0, 3), dtype=np.float32)
        self._rgb = np.empty((0, 3), dtype=np.uint8)
        self._frame = np.empty(0, dtype=np.int64)
        self._pixel = np.empty((0, 2), dtype=np.int32)
        self._merged_keys = np.empty(0, dtype=np.int64)
        self._merged_rows = np.empty(0, dtype=np.int64)
        self._recent_keys = np.empty(0, dtype=np.int64)
        self._recent_rows = np.empty(0, dtype=np.int64)
        self._merged_rows_below = 0  # every row the merged level indexes is below this
        self._publish()

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        arrays = (
            self._keys,
            self._xyz,
            self._rgb,
            self._frame,
            self._pixel,
            self._merged_keys,
            self._merged_rows,
            self._recent_keys,
            self._recent_rows,
        )
        return sum(a.nbytes for a in arrays)

    def add_frame(
        self,
        frame_index: int,
        depth: np.ndarray,
        depth_conf: np.ndarray,
        intrinsics: np.ndarray,
        c2w: np.ndarray,
        image: np.ndarray | None = None,
        dropped: np.ndarray | None = None,
        *,
        points: FramePoints | None = None,
    ) -> None:
        """Merge one frame's confident pixels. depth, depth_conf [H, W]; image [H, W, 3] uint8 or None;
        dropped [H, W] bool or None: pixels left out whatever their confidence (app.outputs.masks).
        `points`: this frame's `frame_points`, computed ahead (on another thread); taken where the grid is still
        the one they were computed on, else computed again."""
        if image is not None and image.shape[:2] != depth.shape:
            raise ValueError(
                f"image {image.shape[:2]} and depth {depth.shape} of frame {frame_index} differ in size"
            )
        if points is None or points.grid != (self.voxel_size, self.reference_depth):
            points = self.frame_points(depth, depth_conf, intrinsics, c2w, dropped)
        self.frames_added += 1
        self._saw_confident = self._saw_confident or points.saw_confident
        self._saw_kept = self._saw_kept or points.saw_kept
        if self.reference_depth is None:  # the first frame with confident depth sets the grid
            if points.median_depth is None:
                return
            self.reference_depth = points.median_depth
            if self.voxel_size is None:
                self.voxel_size = self.reference_depth * AUTO_VOXEL_FRACTION
            self._fit_the_grid_to_the_scene()
            self._publish()
            points = self.frame_points(depth, depth_conf, intrinsics, c2w, dropped)
        self.num_out_of_range += points.out_of_range
        fresh = ~self._occupied(points.keys)
        pixel = points.pixel[fresh]
        rgb = _colours(image, pixel)
        self._append(points.keys[fresh], points.xyz[fresh], rgb, np.full(len(pixel), frame_index, dtype=np.int64),
                     pixel)
        while len(self) > self.max_points:
            self._coarsen()

    def batch_points(self, frames: Sequence[FrameDepth],
                     published: tuple[tuple[float | None, float | None], np.ndarray] | None = None
                     ) -> BatchPoints | None:
        """Consecutive frames' points merged ahead (on another thread, while the accumulator takes an earlier
        batch): one lookup and one append for the batch at `add_batch` instead of one a frame, where
        consecutive frames reach mostly the same voxels. None where the grid is not set yet or changed while
        they were computed: the frames are then added one by one. The voxels the merged level held when they
        were computed are left out here (its keys and grid are published together, and within one grid the
        cloud only grows), so that the merge looks up the others only. `published`: another accumulator's
        `published`, for a batch computed where that one does not live (another process)."""
        grid, held = self._published if published is None else published
        if None in grid:
            return None
        found = [(frame, self.frame_points(frame.depth, frame.depth_conf, frame.intrinsics, frame.c2w,
                                           frame.dropped, grid)) for frame in frames]
        keys = np.concatenate([points.keys for _, points in found])  # each frame's sorted, frames in order
        rows = first_in_runs(keys)  # the earliest frame's point of each voxel, in (frame, key) order
        rows = rows[~in_sorted(held, keys[rows])]
        rgb = [_colours(frame.image, points.pixel) for frame, points in found]
        index = [np.full(len(points.keys), frame.frame_index, np.int64) for frame, points in found]
        return BatchPoints(grid, len(found), any(points.saw_confident for _, points in found),
                           any(points.saw_kept for _, points in found), sum(points.out_of_range for _, points in found),
                           keys[rows], np.concatenate([points.xyz for _, points in found])[rows],
                           np.concatenate(rgb)[rows], np.concatenate(index)[rows],
                           np.concatenate([points.pixel for _, points in found])[rows])

    @property
    def grid(self) -> tuple[float | None, float | None]:
        """(voxel size, reference depth): the grid the cloud is on now (None where no frame has set it yet)."""
        return self.voxel_size, self.reference_depth

    @property
    def published(self) -> tuple[tuple[float | None, float | None], np.ndarray]:
        """(grid, keys [K] sorted): a grid and voxels the cloud held together, read at once (one value), for
        batches computed elsewhere (`batch_points(published=)`); within one grid the cloud only grows."""
        return self._published

    def fits(self, batch: BatchPoints) -> bool:
        """Whether `batch` was computed on the grid as it is now (add_batch takes it)."""
        return batch.grid == self.grid

    def add_batch(self, batch: BatchPoints) -> None:
        """Merge a batch of frames (batch_points) that `fits`: the points of voxels the cloud does not hold yet.
        The cap is kept after the batch's last frame rather than after each (a batch over max_points coarsens
        once more at most)."""
        if not self.fits(batch):
            raise ValueError(f"a batch computed on grid {batch.grid} merged on {(self.voxel_size, self.reference_depth)}")
        self.frames_added += batch.frames
        self._saw_confident = self._saw_confident or batch.saw_confident
        self._saw_kept = self._saw_kept or batch.saw_kept
        self.num_out_of_range += batch.out_of_range
        fresh = ~self._occupied(batch.keys)
        self._append(batch.keys[fresh], batch.xyz[fresh], batch.rgb[fresh], batch.frame[fresh], batch.pixel[fresh])
        while len(self) > self.max_points:
            self._coarsen()

    def frame_points(
        self,
        depth: np.ndarray,
        depth_conf: np.ndarray,
        intrinsics: np.ndarray,
        c2w: np.ndarray,
        dropped: np.ndarray | None = None,
        grid: tuple[float | None, float | None] | None = None,
    ) -> FramePoints:
        """One frame's candidate points on the grid as it is now (or on `grid`, (voxel size, reference depth)),
        not merged: each voxel's first sampled pixel back-projected. Changes nothing, so that a thread may
        compute a later frame's while the accumulator merges an earlier one (`add_frame(points=...)`)."""
        # (read once: the grid it is computed on)
        voxel_size, reference = grid if grid is not None else (self.voxel_size, self.reference_depth)
        valid = depth_conf >= self.conf_threshold
        valid &= depth > 0
        valid &= depth < np.inf  # NaN fails both comparisons
        saw_confident = bool(valid.any())
        if dropped is not None:
            valid &= ~dropped
        saw_kept = bool(valid.any())
        if reference is None:
            median = float(np.median(depth[valid])) if saw_kept else None
            return FramePoints.empty((voxel_size, reference), saw_confident, saw_kept, median)
        step = _pixel_step(intrinsics, voxel_size, reference)
        grid = valid[::step, ::step]
        pixels = np.flatnonzero(grid)  # raster order, so "first in the frame" is deterministic
        if len(pixels) == 0:
            return FramePoints.empty((voxel_size, reference), saw_confident, saw_kept)
        v, u = np.divmod(pixels, grid.shape[1])
        v *= step
        u *= step
        xyz = _back_project_pixels(u, v, depth[v, u], intrinsics, c2w)
        keys, in_range = voxel_keys(xyz, voxel_size)
        out_of_range = 0 if in_range.all() else int(np.isfinite(xyz[~in_range]).all(axis=1).sum())
        candidates = np.flatnonzero(in_range)
        frame_keys, first = first_of_each(keys[candidates])
        sel = candidates[first]
        return FramePoints((voxel_size, reference), saw_confident, saw_kept, None, out_of_range, frame_keys,
                           xyz[sel], np.stack([u[sel], v[sel]], axis=1).astype(np.int32))

    def _fit_the_grid_to_the_scene(self) -> None:
        least = self.reference_depth * MIN_VOXEL_FRACTION
        if self.voxel_size >= least:
            return
        self.voxel_raised_from = self.voxel_size
        logger.warning("--voxel-size %.3g is too fine for this scene: the cloud's grid, %d voxels on each side of the "
                       "origin, would reach %.3g from it where the first frame's median depth is %.3g, and leave the "
                       "points beyond out; the cloud uses voxels of %.3g instead, whose grid reaches 64 such depths",
                       self.voxel_size, KEY_OFFSET, self.voxel_size * KEY_OFFSET, self.reference_depth, least)
        self.voxel_size = least
        self._publish()

    def empty_reason(self, masks: str) -> str | None:
        """Why the cloud holds no point, in a sentence that says what to change; None when it holds some.
        `masks`: what left pixels out (`--mask-dir DIR`, the run's masks), named where they emptied it."""
        if len(self):
            return None
        if not self.frames_added:
            return "no frame was saved"
        if not self._saw_confident:
            return (f"no pixel has depth confidence >= {self.conf_threshold:g}: pass a lower --conf-threshold "
                    "(1 keeps every pixel)")
        if not self._saw_kept:
            return (f"{masks} left out every pixel with depth confidence >= {self.conf_threshold:g}: check the masks "
                    "(0 leaves a pixel out)")
        return f"every point lies outside the cloud's grid (voxels of {self.voxel_size:.3g}): pass a larger --voxel-size"

    def pixel_step(self, intrinsics: np.ndarray) -> int:
        """A frame is sampled every `step` rows and columns: about one voxel apart at the first frame's
        median depth d, where a voxel spans voxel_size * focal / d pixels.

        The automatic voxel is two pixels wide there at a 518-pixel width (step 2: a quarter of the work,
        and still a sample in every voxel at that depth); a voxel smaller than a pixel gives step 1; each
        coarsening doubles the step. Nearer surfaces lose nothing (several pixels per voxel); farther ones
        are filled in by the frames that follow.
        """
        return _pixel_step(intrinsics, self.voxel_size, self.reference_depth)

    def remove_frame(self, frame_index: int) -> None:
        """Drop the points a frame contributed (before its re-emission is added).

        A frame's rows are contiguous (appended together; removals and coarsening keep the order), so
        the rows after them move down and only index entries that point at or past them change. The
        16 frames a chunk rollover re-emits are the newest: their rows are near the end and their
        keys in the recent level, so the large merged level is left alone and a removal costs about
        the frame's own size, not the cloud's (a pass over millions of rows per frame held the writer,
        and through its full queue the stream, after every rollover).
        """
        n = self._count
        rows = np.flatnonzero(self._frame[:n] == frame_index)
        if len(rows) == 0:
            return
        first, end = int(rows[0]), int(rows[-1]) + 1
        if end - first != len(rows):  # not contiguous (never expected): the general pass
            self._remove_rows(self._frame[:n] != frame_index)
            return
        count = end - first
        for name in ("_keys", "_xyz", "_rgb", "_frame", "_pixel"):
            array = getattr(self, name)
            array[first: n - count] = array[end:n].copy()
        self._count = n - count
        for level in ("_merged", "_recent"):
            keys, level_rows = getattr(self, f"{level}_keys"), getattr(self, f"{level}_rows")
            if level == "_merged" and self._merged_rows_below <= first:
                continue  # every row it indexes comes before the frame's
            kept = (level_rows < first) | (level_rows >= end)
            level_rows = level_rows[kept]
            level_rows[level_rows >= end] -= count
            setattr(self, f"{level}_keys", keys[kept])
            setattr(self, f"{level}_rows", level_rows)

    def _remove_rows(self, keep: np.ndarray) -> None:
        """Keep the rows where keep [count] is True, in order; both levels filtered and re-indexed."""
        new_row = np.cumsum(keep) - 1  # [n] where each kept row moves to
        for name in ("_keys", "_xyz", "_rgb", "_frame", "_pixel"):
            array = getattr(self, name)
            kept = array[: self._count][keep]
            array[: len(kept)] = kept
        self._count = len(kept)
        for level in ("_merged", "_recent"):
            keys, rows = getattr(self, f"{level}_keys"), getattr(self, f"{level}_rows")
            still = keep[rows]
            setattr(self, f"{level}_keys", keys[still])
            setattr(self, f"{level}_rows", new_row[rows[still]])

    def cloud(self) -> PointCloud:
        n = self._count
        return PointCloud(
            self._xyz[:n].copy(), self._rgb[:n].copy(), self._frame[:n].copy(), self._pixel[:n].copy()
        )

    def moved_cloud(self, moves: list[tuple[np.ndarray, Any]]) -> PointCloud:
        """The cloud with the points of each group of frames moved: `moves` holds (frame indices [F], a
        Sim3) pairs; other frames' points stay. Then one point per voxel again, the earliest frame's
        (two chunks that disagreed before a loop closure may agree after it)."""
        cloud = self.cloud()
        xyz = cloud.xyz.astype(np.float64)
        for frames, move in moves:
            rows = np.isin(cloud.frame_index, frames)
            xyz[rows] = move.apply_to_points(xyz[rows])
        xyz = xyz.astype(np.float32)
        if self.voxel_size is None or not len(xyz):
            return PointCloud(xyz, cloud.rgb, cloud.frame_index, cloud.pixel)
        keys, in_range = self._voxel_keys(xyz)
        order = np.argsort(cloud.frame_index, kind="stable")
        _, first = first_of_each(keys[order][in_range[order]])
        rows = np.sort(order[in_range[order]][first])
        return PointCloud(xyz[rows], cloud.rgb[rows], cloud.frame_index[rows], cloud.pixel[rows])

    def _voxel_keys(self, xyz: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return voxel_keys(xyz, self.voxel_size)

    def _occupied(self, keys: np.ndarray) -> np.ndarray:
        return in_sorted(self._merged_keys, keys) | in_sorted(self._recent_keys, keys)

    def _publish(self) -> None:
        """The grid and the merged level's keys, as one value a thread computing a batch reads at once."""
        self._published = ((self.voxel_size, self.reference_depth), self._merged_keys)

    def _append(self, keys, xyz, rgb, frame, pixel) -> None:
        start, end = self._count, self._count + len(keys)
        if end > len(self._keys):
            self._grow(end)
        self._keys[start:end] = keys
        self._xyz[start:end] = xyz
        self._rgb[start:end] = rgb
        self._frame[start:end] = frame
        self._pixel[start:end] = pixel
        self._count = end
        # a frame's keys come sorted (a batch's in a few sorted runs), so the stable sort is a merge of runs.
        recent_keys = np.concatenate([self._recent_keys, keys])
        recent_rows = np.concatenate([self._recent_rows, np.arange(start, end, dtype=np.int64)])
        order = np.argsort(recent_keys, kind="stable")
        self._recent_keys, self._recent_rows = recent_keys[order], recent_rows[order]
        if len(self._recent_keys) > max(self._MIN_RECENT, len(self._merged_keys) // 4):
            self._merge_levels()

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * len(self._keys), 1024)
        for name in ("_keys", "_xyz", "_rgb", "_frame", "_pixel"):
            old = getattr(self, name)
            new = np.empty((capacity, *old.shape[1:]), dtype=old.dtype)
            new[: self._count] = old[: self._count]
            setattr(self, name, new)

    def _merge_levels(self) -> None:
        keys = np.concatenate([self._merged_keys, self._recent_keys])
        rows = np.concatenate([self._merged_rows, self._recent_rows])
        order = np.argsort(keys, kind="stable")
        self._merged_keys, self._merged_rows = keys[order], rows[order]
        self._publish()
        self._merged_rows_below = self._count
        self._recent_keys = np.empty(0, dtype=np.int64)
        self._recent_rows = np.empty(0, dtype=np.int64)

    def _coarsen(self) -> None:
        xyz = self._xyz[: self._count]
        if self.voxel_size > float(np.abs(xyz).max()):
            # every point lies in the 8 cells around the origin, which no doubling merges (a cap under 8 doubled
            # the voxel to infinity): the earliest points are kept
            self._rebuild(np.arange(self.max_points))
            return
        self.voxel_size *= 2.0
        self.num_coarsenings += 1
        keys, _ = self._voxel_keys(xyz)  # coarser cells of in-range points stay in range
        self._keys[: self._count] = keys
        _, rows = np.unique(keys, return_index=True)  # the earliest row of each voxel survives
        self._rebuild(rows)

    def _rebuild(self, rows: np.ndarray) -> None:
        """Keep `rows` (ascending, so arrival order is preserved) and re-index them as one merged level."""
        rows = np.sort(rows)
        for name in ("_keys", "_xyz", "_rgb", "_frame", "_pixel"):
            setattr(self, name, getattr(self, name)[rows])
        self._count = len(rows)
        order = np.argsort(self._keys, kind="stable")
        self._merged_keys, self._merged_rows = self._keys[order], order.astype(np.int64)
        self._publish()
        self._merged_rows_below = self._count
        self._recent_keys = np.empty(0, dtype=np.int64)
        self._recent_rows = np.empty(0, dtype=np.int64)


def write_ply(path: Path, xyz: np.ndarray, rgb: np.ndarray) -> None:
    """Binary little-endian PLY with float x, y, z and uchar red, green, blue, atomically. xyz [N, 3], rgb [N, 3]."""
    vertex = np.empty(
        len(xyz),
        dtype=[("x", "<f4"), ("y", "<f4"), ("z", "<f4"), ("red", "u1"), ("green", "u1"), ("blue", "u1")],
    )
    for axis, name in enumerate("xyz"):
        vertex[name] = xyz[:, axis]
    for channel, name in enumerate(("red", "green", "blue")):
        vertex[name] = rgb[:, channel]
    ply = PlyData([PlyElement.describe(vertex, "vertex")], text=False, byte_order="<")
    atomic_write(Path(path), ply.write, binary=True)


def read_ply(path: Path, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """A cloud `write_ply` wrote: xyz [N, 3] float32 and rgb [N, 3] uint8, every k-th point so that at most
    `max_points` are kept."""
    vertex = PlyData.read(str(path))["vertex"].data
    step = max(1, -(-len(vertex) // max(max_points, 1)))
    vertex = vertex[::step]
    xyz = np.stack([vertex[name] for name in "xyz"], axis=1).astype(np.float32)
    return xyz, np.stack([vertex[name] for name in ("red", "green", "blue")], axis=1).astype(np.uint8)
