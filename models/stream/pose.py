"""Pose encoding <-> camera matrices, and the camera-motion flow used to pick keyframes (spec §5.5, §7).

Conventions: the 9-D pose is (t_xyz, quat_xyzw, fov_h, fov_w); it decodes to **camera-to-world**
[R | t] in OpenCV axes (x right, y down, z forward), t being the camera centre in the world. The
quaternion is not normalised: the rotation uses the 2/|q|^2 form. Intrinsics are in pixels for an
image of H x W with the principal point at (W/2, H/2) and integer pixel coordinates.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


def _torch():
    """torch, for a tensor argument (which means torch is imported already). This module imports no torch of
    its own: the run directory's readers use its numpy half, and `export`, `eval` and `view` start without
    torch's import (2.5 s of CPU on a 2-core machine)."""
    return sys.modules["torch"]


def quat_xyzw_to_rotation(quat: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """[..., 4] (x, y, z, w), any norm -> [..., 3, 3].

    A numpy quaternion gives a float64 numpy rotation through the same formula, so that the app's
    files (TUM trajectories, viewer poses) and the decoder agree on what a quaternion means.
    """
    if isinstance(quat, np.ndarray):
        return _rotation(quat.astype(np.float64), np.stack)
    return _rotation(quat, _torch().stack)


def _rotation(quat, stack):
    """quat_xyzw_to_rotation in the quaternion's own dtype, for numpy or torch (`stack` of either). Host
    arrays stay in numpy: the chunk alignment decodes each emitted frame on the stream's thread, where
    the same formula as ~30 small torch calls take 1.6-20 ms beside the sinks' and the spare's threads
    (0.15-0.35 ms on a quiet host)."""
    i, j, k, r = (quat[..., n] for n in range(4))
    two_s = 2.0 / (quat * quat).sum(-1)
    rotation = stack(
        (
            1 - two_s * (j * j + k * k), two_s * (i * j - k * r), two_s * (i * k + j * r),
            two_s * (i * j + k * r), 1 - two_s * (i * i + k * k), two_s * (j * k - i * r),
            two_s * (i * k - j * r), two_s * (j * k + i * r), 1 - two_s * (i * i + j * j),
        ),
        -1,
    )
    return rotation.reshape(quat.shape[:-1] + (3, 3))


def rotation_to_quat_xyzw(rotation: np.ndarray) -> np.ndarray:
    """[..., 3, 3] rotation -> unit quaternion [..., 4] (x, y, z, w) with w >= 0, float64 numpy.

    Each of the four components can be recovered from the diagonal; dividing by the largest one
    keeps the result accurate for every rotation, 180-degree turns included (where w -> 0 and the
    trace formula alone would divide by zero). wxyz users (viser, COLMAP) roll the result by one.
    """
    m = np.asarray(rotation, dtype=np.float64)
    m00, m11, m22 = m[..., 0, 0], m[..., 1, 1], m[..., 2, 2]
    # 4 * (w^2, x^2, y^2, z^2)
    four_sq = np.stack([1 + m00 + m11 + m22, 1 + m00 - m11 - m22, 1 - m00 + m11 - m22, 1 - m00 - m11 + m22], -1)
    zy, yz = m[..., 2, 1], m[..., 1, 2]
    xz, zx = m[..., 0, 2], m[..., 2, 0]
    yx, xy = m[..., 1, 0], m[..., 0, 1]
    # Row i: 4 * q_i * (w, x, y, z); the component i itself is 4 q_i^2.
    scaled = np.stack(
        [
            np.stack([four_sq[..., 0], zy - yz, xz - zx, yx - xy], -1),
            np.stack([zy - yz, four_sq[..., 1], xy + yx, xz + zx], -1),
            np.stack([xz - zx, xy + yx, four_sq[..., 2], yz + zy], -1),
            np.stack([yx - xy, xz + zx, yz + zy, four_sq[..., 3]], -1),
        ],
        -2,
    )  # [..., 4, 4]
    best = np.argmax(four_sq, axis=-1)
    wxyz = np.take_along_axis(scaled, best[..., None, None], axis=-2)[..., 0, :]
    wxyz = wxyz / np.linalg.norm(wxyz, axis=-1, keepdims=True)
    wxyz = np.where(wxyz[..., :1] < 0, -wxyz, wxyz)
    return np.concatenate([wxyz[..., 1:], wxyz[..., :1]], -1)


def quat_xyzw_product(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Hamilton product first * second of (x, y, z, w) quaternions [..., 4] (broadcast): the
    rotation of the product is R(first) @ R(second), and |product| = |first| |second|."""
    x1, y1, z1, w1 = np.moveaxis(np.asarray(first, np.float64), -1, 0)
    x2, y2, z2, w2 = np.moveaxis(np.asarray(second, np.float64), -1, 0)
    return np.stack([w1 * x2 + x1 * w2 + y1 * z2 - z1 * y2,
                     w1 * y2 - x1 * z2 + y1 * w2 + z1 * x2,
                     w1 * z2 + x1 * y2 - y1 * x2 + z1 * w2,
                     w1 * w2 - x1 * x2 - y1 * y2 - z1 * z2], axis=-1)


def decode_pose(pose_enc: torch.Tensor | np.ndarray, height: int, width: int
                ) -> tuple[torch.Tensor, torch.Tensor] | tuple[np.ndarray, np.ndarray]:
    """pose_enc [..., 9] -> c2w [..., 3, 4], intrinsics [..., 3, 3] for an H x W image, in pose_enc's
    dtype and kind (a numpy pose_enc, e.g. a chunk's emissions on the host, decodes in numpy)."""
    host = isinstance(pose_enc, np.ndarray)
    torch = None if host else _torch()
    rotation = _rotation(pose_enc[..., 3:7], np.stack if host else torch.stack)
    translation = pose_enc[..., :3, None]
    c2w = np.concatenate([rotation, translation], -1) if host else torch.cat([rotation, translation], dim=-1)
    tan = np.tan if host else torch.tan
    fy = (height / 2.0) / tan(pose_enc[..., 7] / 2.0)
    fx = (width / 2.0) / tan(pose_enc[..., 8] / 2.0)
    shape = pose_enc.shape[:-1] + (3, 3)
    intrinsics = (np.zeros(shape, pose_enc.dtype) if host
                  else torch.zeros(shape, dtype=pose_enc.dtype, device=pose_enc.device))
    intrinsics[..., 0, 0] = fx
    intrinsics[..., 1, 1] = fy
    intrinsics[..., 0, 2] = width / 2
    intrinsics[..., 1, 2] = height / 2
    intrinsics[..., 2, 2] = 1.0
    return c2w, intrinsics


def back_project(u: np.ndarray, v: np.ndarray, z: np.ndarray, intrinsics: np.ndarray,
                 dtype: type[np.floating] = np.float32) -> tuple[np.ndarray, np.ndarray]:
    """Camera coordinates (x, y) of the pixels at column u, row v and z-depth z (arrays of one shape),
    in `dtype`; the point is (x, y, z) in OpenCV camera axes (x right, y down, z forward).

    The package's one back-projection, so that the point cloud, the viewer and the keyframe flow agree
    on the pixel convention: integer pixel coordinates, no half-pixel shift, x = (u - cx) * (z / fx).
    x and y come back as two new arrays rather than stacked: the point cloud lays them out as [3, M]
    for speed, the others stack them as [..., 3].
    """
    z = np.asarray(z, dtype)
    x = np.asarray(u).astype(dtype)  # astype copies: the updates below stay off the caller's array
    x -= dtype(intrinsics[0, 2])
    x *= z / dtype(intrinsics[0, 0])
    y = np.asarray(v).astype(dtype)
    y -= dtype(intrinsics[1, 2])
    y *= z / dtype(intrinsics[1, 1])
    return x, y


def camera_motion_flow(c2w: np.ndarray, intrinsics: np.ndarray, depth: np.ndarray, reference_c2w: np.ndarray,
                       reference_intrinsics: np.ndarray, stride: int = 8) -> float:
    """Mean pixel motion between a frame and a reference keyframe induced by the frame's own
    depth and both predicted cameras (host arrays: the engine decides keyframes from the
    predictions it has already copied out, so the decision needs no extra device work).

    c2w [3, 4], intrinsics [3, 3], depth [H, W] of the frame; the reference's c2w and intrinsics.
    Pixels on a stride-8 grid are lifted with the frame's depth, moved into the reference camera
    and projected; the result is the mean distance to where they started, over pixels in front of
    both cameras (0 when none are). Float64 throughout.
    """
    height, width = depth.shape
    d = np.asarray(depth, np.float64)[::stride, ::stride]
    v, u = np.meshgrid(np.arange(0, height, stride, dtype=np.float64), np.arange(0, width, stride, dtype=np.float64),
                       indexing="ij")
    camera = np.stack([*back_project(u, v, d, intrinsics, np.float64), d], axis=-1)  # [h, w, 3]
    c2w, reference_c2w = np.asarray(c2w, np.float64), np.asarray(reference_c2w, np.float64)
    world = camera @ c2w[:, :3].T + c2w[:, 3]
    in_reference = (world - reference_c2w[:, 3]) @ reference_c2w[:, :3]  # R^T (x - t), row-wise
    z = np.maximum(in_reference[..., 2], 1e-6)
    k_ref = np.asarray(reference_intrinsics, np.float64)
    projected_u = k_ref[0, 0] * in_reference[..., 0] / z + k_ref[0, 2]
    projected_v = k_ref[1, 1] * in_reference[..., 1] / z + k_ref[1, 2]
    flow = np.hypot(projected_u - u, projected_v - v)
    valid = (d > 1e-6) & (in_reference[..., 2] > 1e-6)
    return float(flow[valid].mean()) if valid.any() else 0.0
