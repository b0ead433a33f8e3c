"""A voxel grid's cells as int64 keys, and the sorted-array set operations the point cloud runs on them
(app/outputs/pointcloud.py): membership is a binary search in a sorted array, not a Python set of tuples."""

from __future__ import annotations

import numpy as np

# Voxel coordinates are packed into one int64 key, 21 bits per axis (signed, offset by 2**20), so that
# membership is a sorted-array search instead of a Python set of tuples.
KEY_BITS = 21
KEY_OFFSET = 1 << (KEY_BITS - 1)
KEY_LIMIT = 1 << KEY_BITS


def in_sorted(level: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """[M] bool: which of `keys` the sorted `level` holds."""
    if not len(level):
        return np.zeros(len(keys), dtype=bool)
    pos = np.minimum(np.searchsorted(level, keys), len(level) - 1)
    return level[pos] == keys


def first_in_runs(keys: np.ndarray) -> np.ndarray:
    """keys [M], a few sorted runs one after the other -> the position of each distinct key's first occurrence,
    ascending. A stable sort merges the runs (timsort finds them: a 5th of the time of sorting the whole
    again for 8 frames' keys) and keeps equal keys in position order, so each key's first is its earliest.

        keys [3, 7, 2, 3, 9] -> [0, 1, 2, 4]
    """
    if len(keys) == 0:
        return np.empty(0, np.int64)
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    head = np.empty(len(keys), bool)
    head[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=head[1:])
    keep = np.zeros(len(keys), bool)
    keep[order[head]] = True
    return np.flatnonzero(keep)


def first_of_each(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """keys [M] -> (the distinct keys, sorted [K]; the position of each one's first occurrence [K]).

    np.unique(return_index=True) does this with a stable sort; an unstable sort (SIMD quicksort) and
    the smallest position in each run of equal keys give the same answer in about half the time.

        keys [7, 3, 7, 3, 5] -> order [1, 3, 4, 0, 2] -> ([3, 5, 7], [1, 4, 0])
    """
    if len(keys) == 0:
        return keys, np.empty(0, dtype=np.int64)
    order = np.argsort(keys)
    ordered = keys[order]
    starts = np.flatnonzero(np.concatenate([[True], ordered[1:] != ordered[:-1]]))
    return ordered[starts], np.minimum.reduceat(order, starts)


def voxel_keys(xyz: np.ndarray, voxel_size: float) -> tuple[np.ndarray, np.ndarray]:
    """xyz [M, 3] -> keys [M] int64 and in_range [M] bool (keys of out-of-range points are 0).

    One axis at a time, in place: floor(x / voxel) + offset in float64, 21 bits of the key each.
    """
    keys = np.zeros(len(xyz), dtype=np.int64)
    in_range = np.ones(len(xyz), dtype=bool)
    with np.errstate(invalid="ignore", over="ignore"):
        for axis in range(3):
            cells = xyz[:, axis].astype(np.float64)
            cells /= voxel_size
            np.floor(cells, out=cells)
            cells += KEY_OFFSET
            # the usual case, every cell in range, costs two reductions instead of two masks
            if len(cells) and not (cells.min() >= 0 and cells.max() < KEY_LIMIT):
                in_range &= (cells >= 0) & (cells < KEY_LIMIT)
                cells[~in_range] = 0
            keys <<= KEY_BITS
            keys |= cells.astype(np.int64)
    if not in_range.all():
        keys[~in_range] = 0
    return keys, in_range
