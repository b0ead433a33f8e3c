"""Synthetic predictions with known geometry: a camera sliding along world x, looking at the plane z = PLANE_Z.

Every confident pixel back-projects onto the plane, so tests can check where points land. Columns left of
LOW_CONF_COLUMNS have confidence 1 (below any sensible threshold); the rest CONF_HIGH. The image encodes the
source pixel in its colour: red = 8 * u, green = 8 * v, blue = 10 * frame_index (mod 256).
"""

from __future__ import annotations

import numpy as np

from stream_recon.models.stream.prediction import FRAME_KEY, FRAME_NON_KEY, FRAME_SCALE, FramePrediction

PLANE_Z = 4.0
STEP_X = 0.1
LOW_CONF_COLUMNS = 4
CONF_HIGH = 5.0


def rotation_about_y(angle: float) -> np.ndarray:
    c, s = np.cos(angle), np.sin(angle)
    return np.array([[c, 0.0, s], [0.0, 1.0, 0.0], [-s, 0.0, c]])


def quat_xyzw(rotation: np.ndarray) -> np.ndarray:
    """Rotation about y only (what these scenes use) -> (x, y, z, w)."""
    angle = np.arctan2(rotation[0, 2], rotation[0, 0])
    return np.array([0.0, np.sin(angle / 2), 0.0, np.cos(angle / 2)])


def plane_frame(
    frame_index: int,
    *,
    height: int = 24,
    width: int = 32,
    focal: float = 30.0,
    yaw: float | None = None,
    offset: np.ndarray | None = None,
    with_image: bool = True,
    frame_type: int | None = None,
    chunk_index: int = 0,
) -> FramePrediction:
    """One frame of the plane scene; the camera centre is (STEP_X * i, 0, 0) + offset."""
    yaw = 0.02 * np.sin(frame_index) if yaw is None else yaw
    rotation = rotation_about_y(yaw)
    centre = np.array([STEP_X * frame_index, 0.0, 0.0]) + (0.0 if offset is None else offset)
    intrinsics = np.array([[focal, 0, (width - 1) / 2], [0, focal * 1.05, (height - 1) / 2], [0, 0, 1]])
    v, u = np.mgrid[0:height, 0:width].astype(np.float64)
    rays_camera = np.stack(
        [
            (u - intrinsics[0, 2]) / intrinsics[0, 0],
            (v - intrinsics[1, 2]) / intrinsics[1, 1],
            np.ones_like(u),
        ],
        axis=-1,
    )
    # z-depth s along a ray with camera z = 1 hits the plane where centre_z + s * (R r)_z = PLANE_Z.
    depth = (PLANE_Z - centre[2]) / (rays_camera @ rotation.T)[..., 2]
    depth_conf = np.full((height, width), CONF_HIGH, dtype=np.float32)
    depth_conf[:, :LOW_CONF_COLUMNS] = 1.0
    image = None
    if with_image:
        image = np.stack([8 * u, 8 * v, np.full_like(u, (10 * frame_index) % 256)], axis=-1).astype(np.uint8)
    if frame_type is None:
        frame_type = (
            FRAME_SCALE if frame_index < 2 else (FRAME_NON_KEY if frame_index % 3 == 2 else FRAME_KEY)
        )
    fov_h = 2 * np.arctan(height / (2 * intrinsics[1, 1]))
    fov_w = 2 * np.arctan(width / (2 * intrinsics[0, 0]))
    pose_enc = np.concatenate([centre, quat_xyzw(rotation), [fov_h, fov_w]]).astype(np.float32)
    return FramePrediction(
        frame_index=frame_index,
        timestamp=1000.0 + frame_index / 30.0,
        frame_type=frame_type,
        pose_enc=pose_enc,
        c2w=np.hstack([rotation, centre[:, None]]).astype(np.float32),
        intrinsics=intrinsics.astype(np.float32),
        depth=depth.astype(np.float32),
        depth_conf=depth_conf,
        image=image,
        chunk_index=chunk_index,
    )


def quat_xyzw_to_matrix(q) -> np.ndarray:
    """Independent of stream_recon.models.stream.pose: Hamilton quaternion (x, y, z, w) -> rotation [3, 3]."""
    x, y, z, w = np.asarray(q, dtype=np.float64) / np.linalg.norm(q)
    return np.array(
        [
            [w * w + x * x - y * y - z * z, 2 * (x * y - w * z), 2 * (x * z + w * y)],
            [2 * (x * y + w * z), w * w - x * x + y * y - z * z, 2 * (y * z - w * x)],
            [2 * (x * z - w * y), 2 * (y * z + w * x), w * w - x * x - y * y + z * z],
        ]
    )
