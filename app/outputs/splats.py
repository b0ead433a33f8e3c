"""A map of 3D Gaussians made from the run's points, and its file in the 3D Gaussian splatting PLY layout.

Each kept pixel becomes one Gaussian, without any training:
- centre: the pixel's back-projected point (the point cloud's);
- colour: its pixel's, as the degree-0 spherical-harmonic coefficient (higher degrees zero);
- opacity: the model's depth confidence c = 1 + exp(x) read as odds, so opacity = sigmoid(x) =
  (c - 1) / c: an even-odds pixel (c = 2) is half transparent, a sure one nearly opaque;
- shape: a flat disc lying on the surface (its normal from the depth map's neighbours), as wide as the
  patch it stands for: a pixel's footprint at its depth (depth / focal, times the pixels between samples,
  divided by how obliquely the camera sees the surface) or the voxel, whichever is larger.

The file is what the reference implementation (graphdeco-inria/gaussian-splatting) saves and loads and
what web splat viewers read: binary little-endian float32 x y z, nx ny nz, f_dc_0..2, f_rest_0..44
(degree 3, all zero), opacity (a logit), scale_0..2 (natural logarithms of the standard deviations),
rot_0..3 (a unit quaternion w x y z, rotating the Gaussian's axes into the world).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from plyfile import PlyData, PlyElement

from stream_recon.app.outputs.atomic_writes import atomic_write
from stream_recon.app.outputs.pointcloud import PointAccumulator, PointCloud
from stream_recon.app.outputs.rundir import RunDirError, iter_run
from stream_recon.models.stream.pose import back_project, rotation_to_quat_xyzw

# Y_0^0 = 1 / (2 sqrt(pi)): colour = 0.5 + SH_C0 * f_dc, the renderers' degree-0 term.
SH_C0 = 0.28209479177387814
# Degree 3, as the reference trains and loads by default: its loader asserts 3 * (3 + 1)**2 - 3 = 45 of them.
NUM_SH_REST = 45
# Opacity logits stay within +-LOGIT_LIMIT (opacity 0.001 .. 0.999): a pixel at the confidence floor
# (c = 1, odds 0) would otherwise be log(0).
LOGIT_LIMIT = 6.9
# A disc's thickness along its normal, as a share of its radius: thin enough to read as a surface, thick
# enough that a normal off by a few degrees does not make it vanish edge-on.
THICKNESS_FRACTION = 0.2
# A surface seen this obliquely (cosine between its normal and the viewing ray) or worse widens a pixel's
# footprint no further: near-grazing normals are the least reliable.
MIN_VIEW_COSINE = 0.2
# A neighbour whose depth differs from the pixel's by more than this share lies across a depth edge, and
# the normal there falls back to facing the camera.
EDGE_DEPTH_JUMP = 0.1

PLY_PROPERTIES = (
    ["x", "y", "z", "nx", "ny", "nz", "f_dc_0", "f_dc_1", "f_dc_2"]
    + [f"f_rest_{k}" for k in range(NUM_SH_REST)]
    + ["opacity", "scale_0", "scale_1", "scale_2", "rot_0", "rot_1", "rot_2", "rot_3"]
)


@dataclass(frozen=True)
class GaussianSplats:
    """N Gaussians in the world frame.

    xyz [N, 3] float32 centres; rgb [N, 3] uint8; opacity [N] float32 in (0, 1); scales [N, 3] float32
    standard deviations along the Gaussian's own axes (the third along its normal); wxyz [N, 4] float32
    unit quaternions rotating those axes into the world; normals [N, 3] float32 (the third axis).
    """

    xyz: np.ndarray
    rgb: np.ndarray
    opacity: np.ndarray
    scales: np.ndarray
    wxyz: np.ndarray
    normals: np.ndarray

    FIELDS = ("xyz", "rgb", "opacity", "scales", "wxyz", "normals")

    def __len__(self) -> int:
        return int(self.xyz.shape[0])

    def covariances(self) -> np.ndarray:
        """[N, 3, 3] world covariances R diag(s^2) R^T, as viser's Gaussian splats take them."""
        rotation = quat_wxyz_to_matrix(self.wxyz.astype(np.float64))  # [N, 3, 3]
        scaled = rotation * self.scales.astype(np.float64)[:, None, :]  # columns times their sigma
        return (scaled @ scaled.transpose(0, 2, 1)).astype(np.float32)

    @classmethod
    def concatenate(cls, parts: list[GaussianSplats]) -> GaussianSplats:
        if not parts:
            return empty_splats()
        return cls(*(np.concatenate([getattr(part, name) for part in parts]) for name in cls.FIELDS))


def empty_splats() -> GaussianSplats:
    return GaussianSplats(np.empty((0, 3), np.float32), np.empty((0, 3), np.uint8), np.empty(0, np.float32),
                          np.empty((0, 3), np.float32), np.empty((0, 4), np.float32), np.empty((0, 3), np.float32))


def opacity_from_confidence(conf: np.ndarray) -> np.ndarray:
    """Depth confidence c = 1 + exp(x) [...] -> opacity sigmoid(x) = (c - 1) / c [...], float32."""
    return 1.0 / (1.0 + np.exp(-opacity_logit_from_confidence(conf)))


def opacity_logit_from_confidence(conf: np.ndarray) -> np.ndarray:
    """Depth confidence c [...] -> the opacity's logit x = log(c - 1), within +-LOGIT_LIMIT, float32."""
    with np.errstate(divide="ignore", invalid="ignore"):
        logit = np.log(np.asarray(conf, dtype=np.float64) - 1.0)
    return np.clip(np.nan_to_num(logit, nan=-LOGIT_LIMIT), -LOGIT_LIMIT, LOGIT_LIMIT).astype(np.float32)


def quat_wxyz_to_matrix(wxyz: np.ndarray) -> np.ndarray:
    """Unit quaternions [..., 4] (w, x, y, z) -> rotation matrices [..., 3, 3]."""
    w, x, y, z = np.moveaxis(np.asarray(wxyz, dtype=np.float64), -1, 0)
    rows = [
        [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
        [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
        [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
    ]
    return np.stack([np.stack(row, -1) for row in rows], -2)


def surface_normals(depth: np.ndarray, intrinsics: np.ndarray, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Camera-frame unit normals [M, 3] at pixels (u [M], v [M]) of a depth map [H, W], facing the camera.

    From the cross product of the back-projected neighbours' differences (left-right, up-down; one-sided
    at the border). Where a neighbour is invalid or across a depth edge, the normal faces the camera along
    the pixel's ray.
    """
    h, w = depth.shape
    z = depth[v, u].astype(np.float64)
    ray = np.stack(back_project(u, v, np.ones_like(z), intrinsics, np.float64) + (np.ones_like(z),), -1)
    corners = []
    ok = np.ones(len(u), dtype=bool)
    for du, dv in ((-1, 0), (1, 0), (0, -1), (0, 1)):
        nu, nv = np.clip(u + du, 0, w - 1), np.clip(v + dv, 0, h - 1)
        nz = depth[nv, nu].astype(np.float64)
        ok &= np.isfinite(nz) & (nz > 0) & (np.abs(nz - z) <= EDGE_DEPTH_JUMP * z)
        x, y = back_project(nu, nv, nz, intrinsics, np.float64)
        corners.append(np.stack([x, y, nz], -1))
    across = corners[1] - corners[0]  # [M, 3]
    down = corners[3] - corners[2]
    normal = np.cross(across, down)
    length = np.linalg.norm(normal, axis=-1)
    ok &= length > 0
    facing = -ray / np.linalg.norm(ray, axis=-1, keepdims=True)
    normal = np.where(ok[:, None], normal / np.where(length > 0, length, 1.0)[:, None], facing)
    flip = np.sum(normal * ray, axis=-1) > 0  # pointing away from the camera
    normal[flip] *= -1
    return normal


def disc_axes(normals: np.ndarray) -> np.ndarray:
    """Unit normals [M, 3] -> rotations [M, 3, 3] whose third column is the normal (right-handed)."""
    helper = np.where((np.abs(normals[:, 0]) < 0.9)[:, None], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0])
    first = np.cross(helper, normals)
    first /= np.linalg.norm(first, axis=-1, keepdims=True)
    second = np.cross(normals, first)
    return np.stack([first, second, normals], -1)


def frame_splats(xyz: np.ndarray, rgb: np.ndarray, pixel: np.ndarray, depth: np.ndarray, conf: np.ndarray,
                 intrinsics: np.ndarray, c2w: np.ndarray, *, pixel_step: int, voxel_size: float) -> GaussianSplats:
    """The Gaussians of one frame's points: xyz [M, 3] world, rgb [M, 3], pixel [M, 2] (u, v) where each
    was back-projected from that frame's depth [H, W] and confidence [H, W], camera K [3, 3], c2w [3, 4].

    `pixel_step`: the pixels between two samples of the frame; `voxel_size`: the cloud's voxel edge.
    """
    u, v = pixel[:, 0].astype(np.int64), pixel[:, 1].astype(np.int64)
    z = depth[v, u].astype(np.float64)
    normals_cam = surface_normals(depth, intrinsics, u, v)  # [M, 3]
    ray = np.stack(back_project(u, v, np.ones_like(z), intrinsics, np.float64) + (np.ones_like(z),), -1)
    cosine = np.abs(np.sum(normals_cam * ray, -1)) / np.linalg.norm(ray, axis=-1)
    focal = float(min(intrinsics[0, 0], intrinsics[1, 1]))
    footprint = pixel_step * z / focal / np.maximum(cosine, MIN_VIEW_COSINE)
    radius = 0.5 * np.maximum(footprint, voxel_size)  # [M]
    scales = np.stack([radius, radius, THICKNESS_FRACTION * radius], -1)
    rotation_c2w = np.asarray(c2w, dtype=np.float64)[:3, :3]
    axes = rotation_c2w @ disc_axes(normals_cam)  # [M, 3, 3] world
    wxyz = np.roll(rotation_to_quat_xyzw(axes), 1, axis=-1)
    return GaussianSplats(
        xyz=np.asarray(xyz, dtype=np.float32),
        rgb=np.asarray(rgb, dtype=np.uint8),
        opacity=opacity_from_confidence(conf[v, u]),
        scales=scales.astype(np.float32),
        wxyz=wxyz.astype(np.float32),
        normals=axes[:, :, 2].astype(np.float32),
    )


def write_splat_ply(path: Path, splats: GaussianSplats) -> None:
    """The splats in the reference 3D Gaussian splatting PLY layout (see the module docstring), atomically."""
    vertex = np.zeros(len(splats), dtype=[(name, "<f4") for name in PLY_PROPERTIES])
    columns = {
        "x": splats.xyz[:, 0], "y": splats.xyz[:, 1], "z": splats.xyz[:, 2],
        "nx": splats.normals[:, 0], "ny": splats.normals[:, 1], "nz": splats.normals[:, 2],
        "opacity": opacity_logit(splats.opacity),
    }
    dc = (splats.rgb.astype(np.float32) / 255.0 - 0.5) / SH_C0
    scales = np.log(np.maximum(splats.scales, np.finfo(np.float32).tiny))
    for k in range(3):
        columns[f"f_dc_{k}"] = dc[:, k]
        columns[f"scale_{k}"] = scales[:, k]
    for k in range(4):
        columns[f"rot_{k}"] = splats.wxyz[:, k]
    for name, values in columns.items():
        vertex[name] = values
    ply = PlyData([PlyElement.describe(vertex, "vertex")], text=False, byte_order="<")
    atomic_write(Path(path), ply.write, binary=True)


def opacity_logit(opacity: np.ndarray) -> np.ndarray:
    """Opacity in (0, 1) [...] -> its logit, within +-LOGIT_LIMIT."""
    p = np.clip(np.asarray(opacity, dtype=np.float64), 1e-12, 1 - 1e-12)
    return np.clip(np.log(p / (1 - p)), -LOGIT_LIMIT, LOGIT_LIMIT).astype(np.float32)


def gaussian_splats(run_dir: Path, cloud: PointCloud, accumulator: PointAccumulator) -> GaussianSplats:
    """The cloud's points as Gaussians, in the cloud's order: a second pass over the npz files reads each
    point's confidence and depth neighbourhood from the frame it was back-projected from."""
    order = np.argsort(cloud.frame_index, kind="stable")
    frames = cloud.frame_index[order]
    parts, rows = [], []
    for record in iter_run(run_dir, frames=set(np.unique(frames).tolist())):  # (the frames the cloud came from)
        these = order[np.searchsorted(frames, record["frame_index"]):
                      np.searchsorted(frames, record["frame_index"], side="right")]
        if not len(these):
            continue
        intrinsics = record["intrinsics"]
        parts.append(frame_splats(cloud.xyz[these], cloud.rgb[these], cloud.pixel[these], record["depth"],
                                  record["depth_conf"], intrinsics, record["c2w"],
                                  pixel_step=accumulator.pixel_step(intrinsics), voxel_size=accumulator.voxel_size))
        rows.append(these)
    found = np.concatenate(rows) if rows else np.empty(0, dtype=np.int64)
    if len(found) != len(cloud):
        raise RunDirError(f"{run_dir} changed while it was exported (a prediction file went missing); export it again")
    position = np.empty(len(cloud), dtype=np.int64)
    position[found] = np.arange(len(found))  # back in the cloud's order
    splats = GaussianSplats.concatenate(parts)
    return GaussianSplats(*(getattr(splats, name)[position] for name in GaussianSplats.FIELDS))
