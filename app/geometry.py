"""Small camera-geometry helpers shared by the writers, exporters, viewer and evaluation.

Conventions (DESIGN.md §4): OpenCV camera axes (x right, y down, z forward), `c2w` [3, 4] maps camera
to world, intrinsics in pixels with integer pixel coordinates (u = column, v = row, no half-pixel shift),
depth is z-depth. Quaternions are named by their order: `wxyz` (viser, trimesh) or `xyzw` (TUM, the model).
"""

from __future__ import annotations

import numpy as np


def depth_to_camera_points(depth: np.ndarray, intrinsics: np.ndarray) -> np.ndarray:
    """Back-project a depth map into its own camera frame.

    depth [H, W] z-depth, intrinsics [3, 3] -> points [H, W, 3] in OpenCV camera axes.
    """
    h, w = depth.shape
    fx, fy = intrinsics[0, 0], intrinsics[1, 1]
    cx, cy = intrinsics[0, 2], intrinsics[1, 2]
    v, u = np.meshgrid(np.arange(h, dtype=np.float32), np.arange(w, dtype=np.float32), indexing="ij")
    x = (u - cx) * depth / fx
    y = (v - cy) * depth / fy
    return np.stack([x, y, depth], axis=-1).astype(np.float32)


def transform_points(c2w: np.ndarray, points: np.ndarray) -> np.ndarray:
    """Apply [R | t] (shape [3, 4]) to points [..., 3]."""
    # A contiguous R^T keeps the matrix product on the fast BLAS path for [N, 3] inputs.
    return points @ np.ascontiguousarray(c2w[:3, :3].T) + c2w[:3, 3]


def depth_to_world_points(depth: np.ndarray, intrinsics: np.ndarray, c2w: np.ndarray) -> np.ndarray:
    """depth [H, W] -> world points [H, W, 3] through the camera-to-world pose."""
    return transform_points(c2w, depth_to_camera_points(depth, intrinsics))


def rotation_to_quat_wxyz(rotation: np.ndarray) -> np.ndarray:
    """Rotation matrix [3, 3] -> unit quaternion (w, x, y, z) with w >= 0."""
    m = np.asarray(rotation, dtype=np.float64)
    trace = m[0, 0] + m[1, 1] + m[2, 2]
    # Pick the largest of (w, x, y, z) to divide by, so the square root never sees a tiny number.
    candidates = np.array([trace, m[0, 0], m[1, 1], m[2, 2]])
    k = int(np.argmax(candidates))
    if k == 0:
        s = 2.0 * np.sqrt(1.0 + trace)
        q = [0.25 * s, (m[2, 1] - m[1, 2]) / s, (m[0, 2] - m[2, 0]) / s, (m[1, 0] - m[0, 1]) / s]
    elif k == 1:
        s = 2.0 * np.sqrt(1.0 + m[0, 0] - m[1, 1] - m[2, 2])
        q = [(m[2, 1] - m[1, 2]) / s, 0.25 * s, (m[0, 1] + m[1, 0]) / s, (m[0, 2] + m[2, 0]) / s]
    elif k == 2:
        s = 2.0 * np.sqrt(1.0 + m[1, 1] - m[0, 0] - m[2, 2])
        q = [(m[0, 2] - m[2, 0]) / s, (m[0, 1] + m[1, 0]) / s, 0.25 * s, (m[1, 2] + m[2, 1]) / s]
    else:
        s = 2.0 * np.sqrt(1.0 + m[2, 2] - m[0, 0] - m[1, 1])
        q = [(m[1, 0] - m[0, 1]) / s, (m[0, 2] + m[2, 0]) / s, (m[1, 2] + m[2, 1]) / s, 0.25 * s]
    q = np.asarray(q)
    q /= np.linalg.norm(q)
    return q if q[0] >= 0 else -q


def quat_wxyz_to_rotation(q: np.ndarray) -> np.ndarray:
    """Quaternion (w, x, y, z), any norm -> rotation matrix [3, 3]."""
    w, x, y, z = np.asarray(q, dtype=np.float64) / np.linalg.norm(q)
    return np.array(
        [
            [1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
            [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
            [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)],
        ]
    )
