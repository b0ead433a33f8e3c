"""COLMAP: a text model (sparse/0: cameras.txt, images.txt, points3D.txt) beside the frames in images/.

The run's world frame; COLMAP puts pixel centres at +0.5 (ours are integers), so cx, cy and every 2D point are
shifted by half a pixel; poses are world-to-camera, quaternion (qw qx qy qz).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stream_recon.app.outputs.atomic_writes import atomic_write
from stream_recon.app.outputs.export_job import CameraRecord, ExportJob, ExportResult, FormatSpec
from stream_recon.app.outputs.pointcloud import PointCloud
from stream_recon.models.stream.pose import rotation_to_quat_xyzw


def write_colmap_export(job: ExportJob) -> ExportResult:
    contents = job.read_frames()
    write_colmap_text(job.target / "sparse" / "0", contents.cameras, contents.cloud)
    return job.result(contents)


def colmap_pinhole(intrinsics: np.ndarray) -> tuple[float, float, float, float]:
    """fx, fy, cx, cy with COLMAP's half-pixel shift (its first pixel's centre is at 0.5).

    nerfstudio shares the convention (its rays start from pixel coordinates + 0.5).
    """
    return (
        float(intrinsics[0, 0]),
        float(intrinsics[1, 1]),
        float(intrinsics[0, 2]) + 0.5,
        float(intrinsics[1, 2]) + 0.5,
    )


def world_to_camera_qt(c2w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """c2w [3, 4] -> (quaternion (qw, qx, qy, qz) of R_w2c, t_w2c [3]), as COLMAP's images.txt wants."""
    rotation_w2c = c2w[:3, :3].T
    return np.roll(rotation_to_quat_xyzw(rotation_w2c), 1), -rotation_w2c @ c2w[:3, 3]


@dataclass(frozen=True)
class _Observations:
    """Where each 3D point is seen: its source pixel, plus one fallback per image that owns no point.

    image_row [N] is the image (row in `cameras`) each point came from, point2d_index [N] its position in
    that image's POINTS2D list, and by_image [I + 1] the CSR offsets into `order` (points grouped by image).
    """

    image_row: np.ndarray
    point2d_index: np.ndarray
    order: np.ndarray
    by_image: np.ndarray
    fallback: dict[int, tuple[float, float, int]]  # image row -> (x, y, point row)


def _observations(cameras: list[CameraRecord], cloud: PointCloud) -> _Observations:
    """Group the points by source image without a Python loop over points.

    Some COLMAP readers (gsplat's SceneManager) stop at the first blank line, so an image whose POINTS2D
    line would be empty gets the visible point nearest its centre instead.
    """
    frames = np.array([c.frame_index for c in cameras])  # ascending: iter_run yields frames in order
    image_row = np.searchsorted(frames, cloud.frame_index)
    order = np.argsort(image_row, kind="stable")
    counts = np.bincount(image_row, minlength=len(cameras))
    by_image = np.concatenate([[0], np.cumsum(counts)])
    point2d_index = np.empty(len(cloud), dtype=np.int64)
    point2d_index[order] = np.arange(len(cloud)) - by_image[image_row[order]]
    fallback = {}
    for row in np.flatnonzero(counts == 0).tolist():
        if len(cloud):
            nearest = _nearest_visible_point(cameras[row], cloud.xyz)
            if nearest is not None:
                fallback[row] = nearest
    return _Observations(image_row, point2d_index, order, by_image, fallback)


def _nearest_visible_point(camera: CameraRecord, xyz: np.ndarray) -> tuple[float, float, int] | None:
    rotation_w2c = np.ascontiguousarray(camera.c2w[:3, :3].T)
    local = (xyz - camera.c2w[:3, 3]) @ rotation_w2c.T  # [N, 3] camera frame
    fx, fy, cx, cy = colmap_pinhole(camera.intrinsics)
    h, w = camera.image_size
    with np.errstate(divide="ignore", invalid="ignore"):
        x = fx * local[:, 0] / local[:, 2] + cx
        y = fy * local[:, 1] / local[:, 2] + cy
    inside = (local[:, 2] > 0) & (x >= 0) & (x < w) & (y >= 0) & (y < h)
    if not inside.any():
        return None
    candidates = np.flatnonzero(inside)
    best = candidates[np.argmin((x[candidates] - w / 2) ** 2 + (y[candidates] - h / 2) ** 2)]
    return float(x[best]), float(y[best]), int(best)


def write_colmap_text(model_dir: Path, cameras: list[CameraRecord], cloud: PointCloud) -> None:
    """cameras.txt (one PINHOLE per distinct intrinsics), images.txt, points3D.txt in `model_dir`.

    IDs start at 1: image id = row + 1 in frame order, point id = cloud row + 1. Each point's track holds
    the observation it was back-projected from (reprojection error ~0 by construction); tracks are
    minimal, not matched across frames. Coordinates use %.9g, exact for the float32 they come from.
    """
    model_dir.mkdir(parents=True, exist_ok=True)
    camera_ids: dict[tuple, int] = {}
    camera_lines = []
    image_camera = []
    for camera in cameras:
        key = (camera.image_size, colmap_pinhole(camera.intrinsics))
        if key not in camera_ids:
            camera_ids[key] = len(camera_ids) + 1
            (h, w), params = key
            camera_lines.append(f"{camera_ids[key]} PINHOLE {w} {h} " + " ".join(repr(p) for p in params))
        image_camera.append(camera_ids[key])

    seen = _observations(cameras, cloud)
    num_observations = len(cloud) + len(seen.fallback)
    _write_lines(
        model_dir / "cameras.txt",
        [
            "# Camera list with one line of data per camera:",
            "#   CAMERA_ID, MODEL, WIDTH, HEIGHT, PARAMS[]",
            f"# Number of cameras: {len(camera_lines)}",
        ],
        camera_lines,
    )
    _write_lines(
        model_dir / "images.txt",
        [
            "# Image list with two lines of data per image:",
            "#   IMAGE_ID, QW, QX, QY, QZ, TX, TY, TZ, CAMERA_ID, NAME",
            "#   POINTS2D[] as (X, Y, POINT3D_ID)",
            f"# Number of images: {len(cameras)}, mean observations per image: "
            f"{num_observations / len(cameras):.3f}",
        ],
        _image_lines(cameras, image_camera, cloud, seen),
    )
    _write_lines(
        model_dir / "points3D.txt",
        [
            "# 3D point list with one line of data per point:",
            "#   POINT3D_ID, X, Y, Z, R, G, B, ERROR, TRACK[] as (IMAGE_ID, POINT2D_IDX)",
            f"# Number of points: {len(cloud)}, mean track length: "
            f"{num_observations / len(cloud) if len(cloud) else 0.0:.3f}",
        ],
        _point_lines(cloud, seen),
    )


def _image_lines(cameras, image_camera, cloud: PointCloud, seen: _Observations) -> Iterator[str]:
    for row, camera in enumerate(cameras):
        q, t = world_to_camera_qt(camera.c2w)
        name = camera.image_name or f"{camera.frame_index:06d}.png"
        pose = " ".join(repr(float(value)) for value in (*q, *t))
        yield f"{row + 1} {pose} {image_camera[row]} {name}"
        points = seen.order[seen.by_image[row] : seen.by_image[row + 1]]
        # COLMAP's first pixel centre is at (0.5, 0.5), ours at (0, 0).
        table = np.column_stack([camera.pixel_scale.pixels(cloud.pixel[points]) + 0.5, points + 1]).ravel().tolist()
        line = " ".join(["%.9g %.9g %d"] * len(points)) % tuple(table)
        if row in seen.fallback:
            x, y, point = seen.fallback[row]
            line = f"{x:.9g} {y:.9g} {point + 1}"
        yield line


def _point_lines(cloud: PointCloud, seen: _Observations, chunk: int = 65536) -> Iterator[str]:
    extra: dict[int, str] = {}
    for row, (_, _, point) in seen.fallback.items():
        extra[point] = extra.get(point, "") + f" {row + 1} 0"
    # Formatted in chunks so that only one chunk's Python objects are alive at a time.
    for start in range(0, len(cloud), chunk):
        stop = min(start + chunk, len(cloud))
        ids = np.arange(start + 1, stop + 1)
        columns = zip(
            ids.tolist(),
            cloud.xyz[start:stop].tolist(),
            cloud.rgb[start:stop].tolist(),
            (seen.image_row[start:stop] + 1).tolist(),
            seen.point2d_index[start:stop].tolist(),
            strict=True,
        )
        for point_id, (x, y, z), (r, g, b), image_id, index in columns:
            yield f"{point_id} {x:.9g} {y:.9g} {z:.9g} {r} {g} {b} 0 {image_id} {index}" + extra.get(
                point_id - 1, ""
            )


def _write_lines(path: Path, header: list[str], lines) -> None:
    def write(f) -> None:
        f.write("\n".join(header) + "\n")
        for line in lines:
            f.write(line + "\n")

    atomic_write(path, write, binary=False)


SPEC = FormatSpec(name="colmap", label="COLMAP", listed=2, default_name="colmap", folder_contents=("images", "sparse"),
                  folder_marker="sparse", write=write_colmap_export)
