"""nerfstudio: a dataset (transforms.json, images/, masks/ of a masked run, points.ply) that `ns-train` reads.

transform_matrix is camera-to-world with OpenGL camera axes (x right, y up, z backward): our c2w with its y and
z columns negated. Its points.ply (for Gaussian-splatting initialisation) is in the same world frame, which
`applied_transform` (identity) declares. Pixel centres at +0.5, as COLMAP's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from stream_recon.app.outputs.atomic_writes import atomic_write
from stream_recon.app.outputs.export_job import (
    OPENCV_TO_GLTF,
    CameraRecord,
    ExportJob,
    ExportResult,
    FormatSpec,
)
from stream_recon.app.outputs.formats.colmap import colmap_pinhole
from stream_recon.app.outputs.pointcloud import PointCloud, write_ply


def write_nerfstudio_export(job: ExportJob) -> ExportResult:
    contents = job.read_frames()
    write_nerfstudio(job.target, contents.cameras, contents.cloud)
    return job.result(contents)


def write_nerfstudio(folder: Path, cameras: list[CameraRecord], cloud: PointCloud) -> None:
    """transforms.json and points.ply in `folder`, next to the images/ already written there.

    transforms.json follows nerfstudio's dataparser: per-frame intrinsics (fl_x, fl_y, cx, cy, w, h;
    pinhole, so no distortion terms), file_path relative to the folder, transform_matrix camera-to-world
    [4, 4] in OpenGL camera axes, and ply_file_path for the points that seed Gaussian splatting.
    nerfstudio re-centres, orients and scales the poses itself and applies the same to those points.
    """
    frames = []
    for camera in cameras:
        fx, fy, cx, cy = colmap_pinhole(camera.intrinsics)
        c2w_opengl = np.eye(4)
        c2w_opengl[:3] = camera.c2w
        c2w_opengl = c2w_opengl @ OPENCV_TO_GLTF  # y and z columns negated: same centre, OpenGL axes
        h, w = camera.image_size
        frame = {
            "file_path": f"images/{camera.image_name}",
            "transform_matrix": c2w_opengl.tolist(),
            "fl_x": fx, "fl_y": fy, "cx": cx, "cy": cy, "w": w, "h": h,
        }
        if camera.mask_name is not None:  # nerfstudio's per-image mask: 0 leaves a pixel out of training
            frame["mask_path"] = f"masks/{camera.mask_name}"
        frames.append(frame)
    transforms = {
        "camera_model": "OPENCV",
        # the points are in the poses' frame: nothing was applied to one and not the other
        "applied_transform": np.eye(4)[:3].tolist(),
        "ply_file_path": "points.ply",
        "frames": frames,
    }
    write_ply(folder / "points.ply", cloud.xyz, cloud.rgb)
    text = json.dumps(transforms, indent=2) + "\n"
    atomic_write(folder / "transforms.json", lambda f: f.write(text), binary=False)


SPEC = FormatSpec(name="nerfstudio", label="nerfstudio", listed=4, default_name="nerfstudio",
                  folder_contents=("images", "masks", "transforms.json", "points.ply"),  # masks/: a masked run's
                  folder_marker="transforms.json", write=write_nerfstudio_export)
