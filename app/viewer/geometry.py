"""What the viewer draws, worked out without viser: a keyframe's points (sampled once, coloured by its
frame), how many of them each keyframe shows under the total-point cap, its thumbnail, its pose as a viser
node takes it, the corrected camera centres of the trajectory and the loops, and where a browser's camera
goes. Pure functions and small records, shared by the scene, the control panel and the hand-off to the
viewer thread.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import cv2
import numpy as np

from stream_recon.app.outputs.splats import opacity_from_confidence
from stream_recon.models import FramePrediction
from stream_recon.models.loops.corrections import ChunkCorrections
from stream_recon.models.stream.pose import back_project, rotation_to_quat_xyzw
from stream_recon.models.stream.similarity import Sim3

# An old keyframe over the total-point cap keeps this share of its points before it is removed.
THINNED_FRACTION = 4
# A chunk scale within 1e-4 of 1 is drawn unscaled: 0.1 mm at 1 m, far below the points' spacing, and
# not worth re-sending every cloud of the chunk.
SCALE_TOLERANCE = 1e-4


def allocate_point_budget(full_counts: list[int], max_total_points: int) -> list[int]:
    """Points to show per keyframe, oldest first, so that the sum stays within `max_total_points`.

    Each keyframe has two levels, full and thinned (full // THINNED_FRACTION, at least 1), and 0 means
    removed.
    Only two levels, so that a keyframe is re-sent at most once (smaller) before it disappears. Older
    keyframes are thinned first, then removed oldest first; the newest keyframe always stays whole.

        full_counts = [8, 8, 8, 8], max_total_points = 20  ->  [2, 2, 8, 8]
        full_counts = [8, 8, 8, 8], max_total_points = 12  ->  [0, 2, 2, 8]
    """
    counts = list(full_counts)
    excess = sum(counts) - max_total_points
    older = range(len(counts) - 1)
    for i in older:
        if excess <= 0:
            return counts
        thinned = max(1, counts[i] // THINNED_FRACTION)
        excess -= counts[i] - thinned
        counts[i] = thinned
    for i in older:
        if excess <= 0:
            break
        excess -= counts[i]
        counts[i] = 0
    return counts


@dataclass(frozen=True)
class KeyframeSample:
    """A keyframe's points, drawn once in random order so that any prefix is a uniform subsample.

    points [N, 3] float16 in the keyframe's camera frame; colors [N, 3] uint8; confidence [N] float32;
    focal: the frame's focal length in pixels; num_valid: the pixels they were drawn from (a splat's width).
    """

    points: np.ndarray
    colors: np.ndarray
    confidence: np.ndarray
    focal: float = 1.0
    num_valid: int = 0

    @property
    def num_points(self) -> int:
        return int(self.points.shape[0])


def sample_keyframe_points(pred: FramePrediction, max_points: int, dropped: np.ndarray | None = None
                           ) -> KeyframeSample:
    """Back-project up to `max_points` random valid pixels of a keyframe into its own camera frame; `dropped`
    [H, W] bool: pixels left out (app.outputs.masks).

    Only the sampled pixels are lifted (models.stream.pose.back_project, in float64 before the float16 the
    viewer sends): a full back-projection costs ~20x more at 518 x 378.
    """
    depth = np.asarray(pred.depth, dtype=np.float32)
    valid = np.isfinite(depth) & (depth > 0)
    if dropped is not None:
        valid &= ~dropped
    valid = np.flatnonzero(valid)
    # Seeded by the frame index, so the same frame always shows the same points (stable re-emissions).
    rng = np.random.default_rng(pred.frame_index)
    if valid.size > max_points:
        chosen = rng.choice(valid, size=max_points, replace=False)
    else:
        chosen = rng.permutation(valid)
    h, w = depth.shape
    v, u = np.divmod(chosen, w)
    z = depth.reshape(-1)[chosen]
    x, y = back_project(u, v, z, pred.intrinsics, np.float64)
    points = np.stack([x, y, z], axis=-1).astype(np.float16)  # [N, 3]
    colors = _pixel_colors(pred, depth)[v, u]  # [N, 3]
    confidence = np.asarray(pred.depth_conf, dtype=np.float32).reshape(-1)[chosen]
    focal = float(min(pred.intrinsics[0, 0], pred.intrinsics[1, 1]))
    return KeyframeSample(points, np.ascontiguousarray(colors), confidence, focal, int(valid.size))


def _pixel_colors(pred: FramePrediction, depth: np.ndarray) -> np.ndarray:
    """[H, W, 3] uint8: the frame itself, or a depth colour map when the prediction carries no image."""
    if pred.image is not None and pred.image.shape[:2] == depth.shape:
        return np.asarray(pred.image, dtype=np.uint8)
    finite = depth[np.isfinite(depth) & (depth > 0)]
    near, far = np.percentile(finite, [2, 98]) if finite.size else (0.0, 1.0)
    scaled = np.clip((depth - near) / max(far - near, 1e-6), 0, 1)
    gray = (255 * (1 - np.nan_to_num(scaled))).astype(np.uint8)
    return cv2.cvtColor(cv2.applyColorMap(gray, cv2.COLORMAP_TURBO), cv2.COLOR_BGR2RGB)


def thumbnail(image: np.ndarray, max_side: int) -> np.ndarray:
    """Shrink [H, W, 3] uint8 so its longer side is at most `max_side` pixels."""
    h, w = image.shape[:2]
    factor = max_side / max(h, w)
    if factor >= 1:
        return np.ascontiguousarray(image)
    size = (max(1, round(w * factor)), max(1, round(h * factor)))
    return cv2.resize(image, size, interpolation=cv2.INTER_AREA)


def depth_fingerprint(pred: FramePrediction) -> int:
    """Cheap identity of a prediction's geometry, to tell a pure pose correction from new depth."""
    crc = zlib.crc32(np.ascontiguousarray(pred.depth, dtype=np.float32).tobytes())
    return zlib.crc32(np.ascontiguousarray(pred.intrinsics, dtype=np.float32).tobytes(), crc)


def field_of_view(pred: FramePrediction) -> tuple[float, float]:
    """(vertical field of view in radians, width / height) of the model input, for a viser frustum."""
    h, w = pred.image_size
    return 2 * math.atan2(h / 2, float(pred.intrinsics[1, 1])), w / h


def node_pose(c2w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """c2w [3, 4] -> (wxyz [4], position [3]) for a viser node whose children live in camera axes."""
    c2w = np.asarray(c2w, dtype=np.float64)
    return np.roll(rotation_to_quat_xyzw(c2w[:3, :3]), 1), c2w[:3, 3].copy()


@dataclass(frozen=True)
class ChainCentre:
    """A camera centre [3] as its latest emission placed it in the open chain, and the emitting chunk."""

    chunk_index: int
    centre: np.ndarray

    @classmethod
    def of(cls, c2w: np.ndarray, chunk_index: int) -> ChainCentre:
        """The centre of a camera-to-world pose c2w [3, 4] emitted by chunk `chunk_index`."""
        return cls(chunk_index, np.array(c2w, dtype=np.float32)[:3, 3])


def cloud_arrays(sample: KeyframeSample, count: int, min_confidence: float, scale: float
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(points [M, 3] float16, colors [M, 3] uint8) of the first `count` sampled points whose confidence
    reaches `min_confidence`, in the coordinates of a chunk node whose scale is `scale`."""
    points = sample.points[:count]
    colors = sample.colors[:count]
    confidence = sample.confidence[:count]
    if min_confidence > 1.0:  # the rule of --conf-threshold and points.ply, not a percentile
        keep = confidence >= min_confidence
        points, colors = points[keep], colors[keep]
    if scale != 1.0:
        points = (scale * points.astype(np.float32)).astype(np.float16)
    return points, colors


def splat_arrays(sample: KeyframeSample, count: int, min_confidence: float, scale: float, size_factor: float
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The first `count` sampled points as Gaussian splats, filtered and scaled as cloud_arrays does:
    (centres [M, 3] float32, covariances [M, 3, 3] float32, colours [M, 3] uint8, opacities [M, 1] float32).

    Isotropic, sigma = half the spacing of `count` samples among the frame's valid pixels at each point's
    depth (a pixel spans depth / focal), times `size_factor`; opacity from the depth confidence as the
    splat export reads it (app.outputs.splats.opacity_from_confidence).
    """
    points, colors = cloud_arrays(sample, count, min_confidence, scale)
    confidence = sample.confidence[:count]
    if min_confidence > 1.0:
        confidence = confidence[confidence >= min_confidence]
    centres = points.astype(np.float32)
    spacing_px = math.sqrt(max(sample.num_valid, 1) / max(count, 1))  # pixels between two samples
    sigma = 0.5 * size_factor * spacing_px * centres[:, 2] / max(sample.focal, 1e-6)  # [M], in the node's units
    covariances = (sigma**2)[:, None, None] * np.eye(3, dtype=np.float32)
    return centres, covariances.astype(np.float32), colors, opacity_from_confidence(confidence)[:, None]


def node_scale(transform: Sim3) -> float:
    """The factor between a chunk node's local coordinates and the chain's: the correction's scale, or 1
    within SCALE_TOLERANCE."""
    return float(transform.scale) if abs(transform.scale - 1.0) > SCALE_TOLERANCE else 1.0


def corrected_centres(centres: dict[int, ChainCentre], indices: list[int], corrections: ChunkCorrections
                      ) -> np.ndarray:
    """[S, 3] float32: the camera centres of these frames, each moved by its chunk's correction."""
    moved_centres = np.stack([centres[i].centre for i in indices]).astype(np.float64)
    if corrections.is_identity:
        return moved_centres.astype(np.float32)
    chunks = np.array([centres[i].chunk_index for i in indices])
    for chunk_index in np.unique(chunks):
        moved = chunks == chunk_index
        moved_centres[moved] = corrections.for_chunk(int(chunk_index)).apply_to_points(moved_centres[moved])
    return moved_centres.astype(np.float32)


def loop_segments(centres: dict[int, ChainCentre], corrections: ChunkCorrections) -> np.ndarray:
    """[L, 2, 3] float32: one segment per accepted loop whose two frames are in `centres`, between their
    corrected camera centres."""
    pairs = [(loop.query_frame, loop.candidate_frame) for loop in corrections.accepted_loops
             if loop.query_frame in centres and loop.candidate_frame in centres]
    if not pairs:
        return np.zeros((0, 2, 3), np.float32)
    ends = corrected_centres(centres, [frame for pair in pairs for frame in pair], corrections)
    return ends.reshape(len(pairs), 2, 3)


@dataclass(frozen=True)
class ViewPose:
    """Where a browser's camera goes: its position, the point it looks at and its up direction, each [3]."""

    position: np.ndarray
    look_at: np.ndarray
    up: np.ndarray

    @classmethod
    def start(cls, scene_scale: float) -> ViewPose:
        """Behind and above the first camera, looking at the start of the reconstruction."""
        # OpenCV world: -y is up, +z is forward
        return cls(np.array([0.0, -0.8, -1.2]) * scene_scale, np.array([0.0, 0.0, 1.0]) * scene_scale,
                   np.array([0.0, -1.0, 0.0]))

    @classmethod
    def following(cls, c2w: np.ndarray, scene_scale: float) -> ViewPose:
        """A little behind and above the camera c2w [3, 4], looking along it."""
        rotation, centre = c2w[:3, :3], c2w[:3, 3]
        forward, down = rotation[:, 2], rotation[:, 1]
        position = centre - 0.5 * scene_scale * forward - 0.2 * scene_scale * down
        return cls(position, centre + scene_scale * forward, -down)
