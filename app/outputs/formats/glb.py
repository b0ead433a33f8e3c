"""GLB: a glTF scene of the cloud ("points"), one camera frustum node per frame ("camera_NNNNNN") and the
trajectory line.

It follows glTF (y up, cameras looking down -z): the world is turned 180 degrees about x, so the first camera
sits upright in any glTF viewer. Each camera is a node whose transform is its pose.
"""

from __future__ import annotations

import numpy as np

from stream_recon.app.outputs.atomic_writes import atomic_write
from stream_recon.app.outputs.export_job import (
    OPENCV_TO_GLTF,
    CameraRecord,
    ExportJob,
    ExportResult,
    FormatSpec,
)
from stream_recon.app.outputs.pointcloud import PointCloud

# Frustum depth as a fraction of the median scene depth: visible, but not covering the cloud.
FRUSTUM_DEPTH_FRACTION = 0.1


def write_glb_export(job: ExportJob) -> ExportResult:
    contents = job.read_frames()
    glb = glb_scene(contents.cameras, contents.cloud)
    atomic_write(job.target, lambda f: f.write(glb), binary=True)
    return job.result(contents)


def frustum_lines(intrinsics: np.ndarray, image_size: tuple[int, int], depth: float) -> tuple[np.ndarray, list]:
    """A camera-local wireframe as (vertices [7, 3], polylines of vertex indices): the apex at the origin, the
    image rectangle at z = depth (OpenCV axes); four segments from the apex to the image corners, the image's
    outline, and a short tick above the top edge's centre that shows which way is up."""
    h, w = image_size
    fx, fy, cx, cy = intrinsics[0, 0], intrinsics[1, 1], intrinsics[0, 2], intrinsics[1, 2]
    # Pixel centres are integers, so the image edges are half a pixel outside them.
    corners_uv = np.array([[-0.5, -0.5], [w - 0.5, -0.5], [w - 0.5, h - 0.5], [-0.5, h - 0.5]])
    corners = np.column_stack(
        [(corners_uv[:, 0] - cx) / fx * depth, (corners_uv[:, 1] - cy) / fy * depth, np.full(4, depth)]
    )
    top_mid = (corners[0] + corners[1]) / 2
    up_tick = top_mid - np.array([0.0, 0.15 * (corners[3, 1] - corners[0, 1]), 0.0])
    vertices = np.vstack([np.zeros(3), corners, top_mid, up_tick])
    return vertices, [[0, k] for k in range(1, 5)] + [[1, 2, 3, 4, 1], [5, 6]]


def glb_scene(cameras: list[CameraRecord], cloud: PointCloud) -> bytes:
    """The scene as a GLB file's bytes."""
    # trimesh takes about 1 s to import and only GLB needs it: every other format exports without it
    import trimesh

    def lines(vertices: np.ndarray, polylines: list) -> trimesh.path.Path3D:
        return trimesh.path.Path3D(entities=[trimesh.path.entities.Line(indices) for indices in polylines],
                                   vertices=vertices)

    scene = trimesh.Scene()
    flip = OPENCV_TO_GLTF[:3, :3]
    if len(cloud):
        colors = np.column_stack([cloud.rgb, np.full(len(cloud), 255, dtype=np.uint8)])
        scene.add_geometry(
            trimesh.PointCloud(cloud.xyz @ flip, colors=colors), node_name="points", geom_name="points"
        )
    depths = np.array([c.median_depth for c in cameras])
    scene_depth = float(np.nanmedian(depths)) if np.isfinite(depths).any() else 1.0
    frustum_depth = FRUSTUM_DEPTH_FRACTION * scene_depth
    for camera in cameras:
        pose = np.eye(4)
        pose[:3] = camera.c2w
        name = f"camera_{camera.frame_index:06d}"
        scene.add_geometry(lines(*frustum_lines(camera.intrinsics, camera.image_size, frustum_depth)),
                           node_name=name, geom_name=name, transform=OPENCV_TO_GLTF @ pose)
    if len(cameras) > 1:
        centres = np.array([c.c2w[:, 3] for c in cameras]) @ flip
        scene.add_geometry(lines(centres, [list(range(len(centres)))]), node_name="trajectory",
                           geom_name="trajectory")
    return scene.export(file_type="glb")


SPEC = FormatSpec(name="glb", label="GLB", listed=1, default_name="scene.glb", suffixes=(".glb",),
                  write=write_glb_export)
