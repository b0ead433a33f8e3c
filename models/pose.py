"""Pose encoding <-> camera matrices, and the camera-motion flow used to pick keyframes (spec §5.5, §7).

Conventions: the 9-D pose is (t_xyz, quat_xyzw, fov_h, fov_w); it decodes to **camera-to-world**
[R | t] in OpenCV axes (x right, y down, z forward), t being the camera centre in the world. The
quaternion is not normalised: the rotation uses the 2/|q|^2 form. Intrinsics are in pixels for an
image of H x W with the principal point at (W/2, H/2) and integer pixel coordinates.
"""

from __future__ import annotations

import numpy as np
import torch


def quat_xyzw_to_rotation(quat: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """[..., 4] (x, y, z, w), any norm -> [..., 3, 3].

    A numpy quaternion gives a float64 numpy rotation through the same formula, so that the app's
    files (TUM trajectories, viewer poses) and the decoder agree on what a quaternion means.
    """
    if isinstance(quat, np.ndarray):
        return quat_xyzw_to_rotation(torch.from_numpy(quat.astype(np.float64))).numpy()
    i, j, k, r = quat.unbind(-1)
    two_s = 2.0 / (quat * quat).sum(-1)
    rotation = torch.stack(
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


def decode_pose(pose_enc: torch.Tensor, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pose_enc [..., 9] -> c2w [..., 3, 4], intrinsics [..., 3, 3] for an H x W image."""
    rotation = quat_xyzw_to_rotation(pose_enc[..., 3:7])
    c2w = torch.cat([rotation, pose_enc[..., :3, None]], dim=-1)
    fy = (height / 2.0) / torch.tan(pose_enc[..., 7] / 2.0)
    fx = (width / 2.0) / torch.tan(pose_enc[..., 8] / 2.0)
    intrinsics = torch.zeros(pose_enc.shape[:-1] + (3, 3), dtype=pose_enc.dtype, device=pose_enc.device)
    intrinsics[..., 0, 0] = fx
    intrinsics[..., 1, 1] = fy
    intrinsics[..., 0, 2] = width / 2
    intrinsics[..., 1, 2] = height / 2
    intrinsics[..., 2, 2] = 1.0
    return c2w, intrinsics


def invert_c2w(c2w: torch.Tensor) -> torch.Tensor:
    """[..., 3, 4] rigid transform -> its inverse [..., 3, 4] (R^T, -R^T t)."""
    rotation_t = c2w[..., :3, :3].transpose(-1, -2)
    return torch.cat([rotation_t, -rotation_t @ c2w[..., :3, 3:]], dim=-1)


def camera_motion_flow(pose_enc: torch.Tensor, reference_pose_enc: torch.Tensor, depth: torch.Tensor,
                       stride: int = 8) -> float:
    """Mean pixel motion between a frame and a reference keyframe induced by the frame's own
    depth and both predicted poses.

    pose_enc, reference_pose_enc [9]; depth [H, W]. Pixels on a stride-8 grid are lifted with the
    frame's depth, moved into the reference camera and projected; the result is the mean distance
    to where they started, over pixels in front of both cameras (0 when none are).
    """
    height, width = depth.shape
    c2w, intrinsics = decode_pose(pose_enc, height, width)
    ref_c2w, ref_intrinsics = decode_pose(reference_pose_enc, height, width)
    d = depth[::stride, ::stride]
    v = torch.arange(0, height, stride, dtype=depth.dtype, device=depth.device)
    u = torch.arange(0, width, stride, dtype=depth.dtype, device=depth.device)
    vv, uu = torch.meshgrid(v, u, indexing="ij")
    pixels = torch.stack([uu, vv, torch.ones_like(uu)], dim=-1)  # [h, w, 3]
    rays = torch.einsum("ij,hwj->hwi", torch.inverse(intrinsics), pixels)
    cam_points = rays * d[..., None]
    world = cam_points @ c2w[:, :3].T + c2w[:, 3]
    ref_w2c = invert_c2w(ref_c2w)
    ref_points = world @ ref_w2c[:, :3].T + ref_w2c[:, 3]
    z = ref_points[..., 2:3].clamp(min=1e-6)
    projected = (ref_points / z) @ ref_intrinsics.T
    flow = (projected[..., :2] - torch.stack([uu, vv], dim=-1)).norm(dim=-1)
    valid = (d > 1e-6) & (ref_points[..., 2] > 1e-6)
    count = valid.float().sum()
    if count < 1:
        return 0.0
    return float((flow * valid.float()).sum() / count)
