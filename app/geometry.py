"""Small camera-geometry helpers shared by the exporters, viewer and evaluation.

Conventions (DESIGN.md §4): OpenCV camera axes (x right, y down, z forward), `c2w` [3, 4] maps camera
to world, intrinsics in pixels with integer pixel coordinates (u = column, v = row, no half-pixel shift),
depth is z-depth. Rotation matrix <-> quaternion is models.pose's pair (`rotation_to_quat_xyzw`,
`quat_xyzw_to_rotation`), in the model's and TUM's order (x, y, z, w); viser and COLMAP want
(w, x, y, z), i.e. the same quaternion rolled by one.
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
