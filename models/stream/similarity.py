"""Similarity transforms, Sim(3), and how two reconstructions of the same frames are aligned.

One module for the math that the chunked engine (a new chunk onto the previous one, spec MODEL.md
§14), the pose graph over chunks and evaluation (an estimate onto the ground truth) share:

- `Sim3`: x -> s R x + t, with composition, inverse and its action on points, c2w poses and the
  model's pose encodings.
- `umeyama` / `irls_umeyama`: the least-squares similarity between two point sets (Umeyama 1991),
  and its robust variant that re-weights the pairs by their residuals (Huber weights).
- The depth-ratio scale of two chunks' predictions of the same frames: the median of per-pixel
  depth ratios, `torch.median`'s lower middle as the reference takes it, quick at a rollover because
  each frame's ratios can be sorted beforehand (`FrameRatios`).
- `estimate_chunk_alignment`: the reference's chunk-to-chunk Sim(3) from the shared frames.

Everything is float64 NumPy except where the reference's float32 arithmetic is reproduced.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .pose import quat_xyzw_product, quat_xyzw_to_rotation, rotation_to_quat_xyzw

_DEPTH_EPS = float(np.finfo(np.float32).eps)  # the reference's "depth is not zero" threshold
_SCALE_RANGE = (1e-3, 1e3)  # the reference clamps a chunk's depth-ratio scale to this range
# The least disagreement an overlap is credited with, per tangent component: 1e-3 rad (0.06 degrees) of
# rotation, 1e-3 of the overlap's extent in translation and 1e-3 in log scale, about the model's own
# frame-to-frame noise on a still camera; without a floor a 1-frame overlap would be an infinitely sure edge.
MIN_OVERLAP_SIGMA = 1e-3
# Shared frames whose centres spread less than this (chunk units, where depths are ~1) are a still camera's:
# their floors are absolute. Taken relative to a spread of 1e-7 (a model predicting the same centre for every
# frame), the centre's floor fell to 1e-10 beside rotations' 1e-3 and the covariance's condition number
# passed 1e15: its smallest eigenvalues' sign was rounding's, and a saved map's link was refused on load.
STILL_EXTENT = 1e-2


class AlignmentError(ValueError):
    """Two point sets whose similarity is undetermined (too few points, all on one point or line)."""


@dataclass(frozen=True)
class Sim3:
    """x -> scale * rotation @ x + translation: maps one frame of coordinates into another."""

    scale: float
    rotation: np.ndarray  # [3, 3]
    translation: np.ndarray  # [3]

    @classmethod
    def identity(cls) -> Sim3:
        return cls(1.0, np.eye(3), np.zeros(3))

    @classmethod
    def from_matrix(cls, matrix: np.ndarray) -> Sim3:
        """The Sim(3) of a [4, 4] [sR | t] (`scaled_matrix`): the scale is the cube root of the block's determinant."""
        matrix = np.asarray(matrix, np.float64)
        scale = float(np.cbrt(np.linalg.det(matrix[:3, :3])))
        return cls(scale, matrix[:3, :3] / scale, matrix[:3, 3].copy())

    @property
    def matrix(self) -> np.ndarray:
        """[4, 4] [R | t] without the scale, as the reference's `chunk_transforms`."""
        out = np.eye(4)
        out[:3, :3] = self.rotation
        out[:3, 3] = self.translation
        return out

    @property
    def scaled_matrix(self) -> np.ndarray:
        """[4, 4] [sR | t]: the transform as one homogeneous matrix."""
        out = self.matrix
        out[:3, :3] *= self.scale
        return out

    @property
    def is_identity(self) -> bool:
        return self.scale == 1.0 and np.array_equal(self.rotation, np.eye(3)) and not self.translation.any()

    @property
    def rotation_deg(self) -> float:
        """The rotation's angle in degrees."""
        return float(np.degrees(rotation_angles(self.rotation)))

    def __matmul__(self, other: Sim3) -> Sim3:
        """(self @ other)(x) = self(other(x))."""
        return Sim3(self.scale * other.scale, self.rotation @ other.rotation,
                    self.scale * self.rotation @ other.translation + self.translation)

    def inverse(self) -> Sim3:
        rotation = self.rotation.T
        return Sim3(1.0 / self.scale, rotation, -(rotation @ self.translation) / self.scale)

    def apply_to_points(self, points: np.ndarray) -> np.ndarray:
        """[..., 3] -> [..., 3]."""
        return self.scale * np.asarray(points, np.float64) @ self.rotation.T + self.translation

    def apply_to_poses(self, c2w: np.ndarray) -> np.ndarray:
        """Camera-to-world poses [..., 3 or 4, 4] -> the same cameras in the target frame: the centre moves
        as a point, the orientation is left-multiplied by the rotation (the scale acts on positions
        only, as in evo)."""
        c2w = np.asarray(c2w, np.float64)
        out = c2w.copy()
        out[..., :3, :3] = self.rotation @ c2w[..., :3, :3]
        out[..., :3, 3] = self.apply_to_points(c2w[..., :3, 3])
        return out

    def apply_to_pose_enc(self, pose_enc: np.ndarray) -> np.ndarray:
        """[..., 9] camera-to-world pose encodings -> the same cameras in the target frame.

        The camera centre moves as a point; the orientation is left-multiplied by the rotation as
        a quaternion product with the rotation's unit quaternion, so the result keeps the model's
        quaternion norm (the model's quaternions are not unit; the decoder divides by |q|^2) and
        its rotation is R @ R(q); the field of view is unchanged. (The reference re-encodes a unit
        quaternion with w >= 0 instead: the same cameras, another encoding.)
        """
        pose_enc = np.asarray(pose_enc)
        out = pose_enc.astype(np.float64, copy=True)
        out[..., :3] = self.apply_to_points(pose_enc[..., :3])
        out[..., 3:7] = quat_xyzw_product(rotation_to_quat_xyzw(self.rotation), out[..., 3:7])
        return out.astype(pose_enc.dtype)


# -- point-set alignment ---------------------------------------------------------------------------
def umeyama(source: np.ndarray, target: np.ndarray, *, with_scale: bool = True,
            weights: np.ndarray | None = None) -> Sim3:
    """Least-squares similarity (Umeyama 1991) mapping source points [N, 3] onto target points [N, 3].

    Minimises sum_i w_i || target_i - (s R source_i + t) ||^2 over rotations R (det +1), translations t
    and, when `with_scale`, scales s > 0 (otherwise s = 1, i.e. SE(3)). `weights` [N] >= 0, default 1.
    """
    source = np.asarray(source, dtype=np.float64)
    target = np.asarray(target, dtype=np.float64)
    if source.shape != target.shape or source.ndim != 2 or source.shape[1] != 3:
        raise AlignmentError(f"alignment needs two [N, 3] point sets, got {source.shape} and {target.shape}")
    if weights is None:  # (the unweighted sums in evo's order: evaluation equals evo to the last digits)
        source_mean, target_mean = source.mean(axis=0), target.mean(axis=0)
        source_centred, target_centred = source - source_mean, target - target_mean
        covariance = target_centred.T @ source_centred / len(source)  # [3, 3], target x source
        source_variance = float((source_centred**2).sum() / len(source))
    else:
        weights = np.asarray(weights, np.float64) / np.sum(weights)
        source_mean, target_mean = weights @ source, weights @ target
        source_centred, target_centred = source - source_mean, target - target_mean
        covariance = (target_centred * weights[:, None]).T @ source_centred
        source_variance = float(weights @ (source_centred**2).sum(axis=1))
    u, singular_values, vt = np.linalg.svd(covariance)
    if np.count_nonzero(singular_values > np.finfo(np.float64).eps) < 2:
        raise AlignmentError(
            "the point sets are (nearly) all on one point or one line, so the rotation is undetermined"
        )
    # Flip the weakest axis when the best orthogonal fit is a reflection, so R stays a rotation.
    sign = np.ones(3)
    if np.linalg.det(u) * np.linalg.det(vt) < 0:
        sign[2] = -1.0
    rotation = u @ np.diag(sign) @ vt
    scale = 1.0
    if with_scale:
        scale = float((singular_values * sign).sum() / source_variance)
    return Sim3(scale, rotation, target_mean - scale * rotation @ source_mean)


def irls_umeyama(source: np.ndarray, target: np.ndarray, *, with_scale: bool = True, huber: float | None = None,
                 iterations: int = 10) -> tuple[Sim3, np.ndarray]:
    """A robust `umeyama`: iteratively re-weighted least squares with Huber weights on the residuals.

    `huber`: the residual (target units) beyond which a pair's weight falls as 1/r; default 1.5 times
    the median residual of the plain fit (scale-free). Returns the similarity and the final weights [N]
    (1 for inliers, < 1 for pairs the fit treats as outliers).
    """
    source = np.asarray(source, np.float64)
    target = np.asarray(target, np.float64)
    weights = np.ones(len(source))
    fit = umeyama(source, target, with_scale=with_scale)
    for _ in range(iterations):
        residuals = np.linalg.norm(fit.apply_to_points(source) - target, axis=1)
        threshold = huber if huber is not None else 1.5 * float(np.median(residuals))
        if threshold <= 0:
            break
        new_weights = np.minimum(1.0, threshold / np.maximum(residuals, 1e-300))
        if np.allclose(new_weights, weights, atol=1e-6):
            break
        weights = new_weights
        fit = umeyama(source, target, with_scale=with_scale, weights=weights)
    return fit, weights


# -- the depth-ratio scale of two chunks -----------------------------------------------------------
def depth_ratios(target_depth: np.ndarray, source_depth: np.ndarray) -> np.ndarray:
    """target / source [N] at the pixels where both are finite and the source is not ~0.

    One frame's (or several frames') depth as predicted by two chunks, any shape. The division is
    float32, as the reference divides (float32 tensors), so every ratio is the reference's to the bit.
    """
    target = np.asarray(target_depth, np.float32).ravel()
    source = np.asarray(source_depth, np.float32).ravel()
    valid = np.isfinite(target) & np.isfinite(source) & (np.abs(source) > _DEPTH_EPS)
    return target[valid] / source[valid]


@dataclass(frozen=True)
class FrameRatios:
    """One frame's depth ratios, sorted when the frame is known, so that a median over many frames is
    quick: a bisection that reads a few values of each frame instead of all of them.

    The median of ~3 million ratios (16 frames at the defaults) took 15-80 ms at a rollover on the GPU
    machine's host, where the stream waits for it; sorting one frame's 200k ratios takes ~0.6 ms.
    """

    values: np.ndarray  # [N] float32, ascending (finite or infinite, never NaN)

    @classmethod
    def of(cls, target_depth: np.ndarray, source_depth: np.ndarray) -> FrameRatios:
        return cls(np.sort(depth_ratios(target_depth, source_depth)))

    @property
    def size(self) -> int:
        return self.values.size


def _order_key(value: np.float32) -> int:
    """float32 -> an unsigned 32-bit key in the order of the values: negatives have every bit flipped
    (larger magnitude, smaller key), non-negatives get the sign bit set."""
    bits = int(np.float32(value).view(np.uint32))
    return bits ^ 0xFFFFFFFF if bits >> 31 else bits | 0x80000000


def _value_of_key(key: int) -> np.float32:
    bits = key & 0x7FFFFFFF if key >> 31 else key ^ 0xFFFFFFFF
    return np.uint32(bits).view(np.float32)


def _kth_of_sorted(arrays: list[np.ndarray], rank: int) -> np.float32:
    """The `rank`-th smallest value (from 0) of the union of ascending float32 arrays: the smallest
    value with more than `rank` values at or below it, bisected over the order keys (32 steps)."""
    low, high = _order_key(min(a[0] for a in arrays)), _order_key(max(a[-1] for a in arrays))
    while low < high:  # (keys between two non-NaN values are never NaN)
        middle = (low + high) // 2
        value = _value_of_key(middle)
        if sum(int(np.searchsorted(a, value, side="right")) for a in arrays) > rank:
            high = middle
        else:
            low = middle + 1
    return _value_of_key(low)


def median_ratio_scale(frames: Sequence[FrameRatios | np.ndarray]) -> float:
    """The lower middle value of all the frames' ratios (torch.median's rule, which the reference
    uses), clamped to [1e-3, 1e3] as float32 like the reference's; 1.0 when there is none.

    Each frame is a FrameRatios, or its depth_ratios as they are: with every frame a FrameRatios the
    median is bisected over the sorted frames; otherwise all the values are partitioned (what sorting
    them would cost first, when none is sorted yet).
    """
    frames = [frame for frame in frames if frame.size]
    if not frames:
        return 1.0
    rank = (sum(frame.size for frame in frames) - 1) // 2  # 0-based rank of the lower median
    if all(isinstance(frame, FrameRatios) for frame in frames):
        median = _kth_of_sorted([frame.values for frame in frames], rank)
    else:
        candidates = np.concatenate([frame.values if isinstance(frame, FrameRatios) else frame for frame in frames])
        median = np.partition(candidates, rank)[rank]
    return float(np.clip(median, np.float32(_SCALE_RANGE[0]), np.float32(_SCALE_RANGE[1])))


def alignment_frames(target_keyframe: np.ndarray, source_keyframe: np.ndarray) -> tuple[int, np.ndarray]:
    """Which shared frames `estimate_chunk_alignment` rests on: the anchor (rotation and translation: the
    last frame that is a keyframe in both chunks, else the first shared frame) and the rows whose depth
    ratios give the scale (those pairs, else the first frame)."""
    paired = np.flatnonzero(np.asarray(target_keyframe, bool) & np.asarray(source_keyframe, bool))
    anchor = int(paired[-1]) if paired.size else 0
    return anchor, (paired if paired.size else np.array([0]))


def estimate_chunk_alignment(target_pose_enc: np.ndarray, target_depth: Sequence[np.ndarray],
                             target_keyframe: np.ndarray, source_pose_enc: np.ndarray,
                             source_depth: Sequence[np.ndarray], source_keyframe: np.ndarray,
                             ratios: Mapping[int, FrameRatios] | None = None) -> Sim3:
    """The Sim(3) taking the source chunk's predictions of the shared frames onto the target's.

    Inputs are the K shared frames in stream order, as predicted by each chunk: pose_enc [K, 9],
    depth K x [H, W], keyframe [K] bool (scale frames count as keyframes). Frames that are keyframes
    in both chunks are paired; the last pair anchors rotation and translation (the first shared
    frame when there is no pair) and the depth of all pairs gives the scale (spec §14). `ratios`:
    the FrameRatios of some frames made beforehand, by position in the K.
    """
    anchor, depth_rows = alignment_frames(target_keyframe, source_keyframe)
    ratios = ratios or {}
    scale = median_ratio_scale([ratios[k] if k in ratios else depth_ratios(target_depth[k], source_depth[k])
                                for k in depth_rows.tolist()])
    target_rotation = quat_xyzw_to_rotation(target_pose_enc[anchor, 3:7])
    source_rotation = quat_xyzw_to_rotation(source_pose_enc[anchor, 3:7])
    rotation = target_rotation @ source_rotation.T
    target_centre = np.asarray(target_pose_enc[anchor, :3], np.float64)
    source_centre = np.asarray(source_pose_enc[anchor, :3], np.float64)
    return Sim3(scale, rotation, target_centre - scale * rotation @ source_centre)


def _skew_parts(rotations: np.ndarray) -> np.ndarray:
    """[..., 3, 3] -> [..., 3]: R - R^T's off-diagonal entries, 2 sin(angle) times the unit axis."""
    return np.stack([rotations[..., 2, 1] - rotations[..., 1, 2], rotations[..., 0, 2] - rotations[..., 2, 0],
                     rotations[..., 1, 0] - rotations[..., 0, 1]], axis=-1)


def rotation_angles(rotations: np.ndarray) -> np.ndarray:
    """Angle of each rotation [..., 3, 3] in rad, in [0, pi].

    atan2 of the sine (from the skew part) and cosine (from the trace) stays accurate near 0,
    where arccos of the trace alone loses half the digits.
    """
    sine = 0.5 * np.linalg.norm(_skew_parts(rotations), axis=-1)
    cosine = 0.5 * (np.trace(rotations, axis1=-2, axis2=-1) - 1.0)
    return np.arctan2(sine, cosine)


def _rotation_vectors(rotations: np.ndarray) -> np.ndarray:
    """[..., 3, 3] rotations -> [..., 3] axis-angle vectors (angle in rad times the unit axis)."""
    angle = rotation_angles(rotations)
    sin_angle = np.sin(angle)
    # angle / (2 sin angle) -> 1/2 as the angle -> 0 (the skew part is then 2 x the vector)
    factor = np.where(sin_angle > 1e-8, angle / (2 * np.where(sin_angle > 1e-8, sin_angle, 1.0)), 0.5)
    return _skew_parts(rotations) * factor[..., None]


# -- how sure a fit is: covariances in a Sim(3)'s tangent ------------------------------------------
# The tangent of a Sim(3) T at a point: T @ Exp(e) with e = [rotation x, y, z (rad), translation x, y, z
# (T's source units), log scale], GTSAM's Similarity3 order and the pose graph's. To first order
# Exp(e) x = x + w x x + u + l x, so a point x of the source moves by tangent_jacobian(x) @ e.
TANGENT_DIM = 7


def tangent_jacobian(points: np.ndarray) -> np.ndarray:
    """[N, 3] source points -> [N, 3, 7]: d(Exp(e) x)/de at e = 0, i.e. [-[x]_x | I | x]."""
    points = np.asarray(points, np.float64)
    jacobian = np.zeros((len(points), 3, TANGENT_DIM))
    x, y, z = points[:, 0], points[:, 1], points[:, 2]
    jacobian[:, 0, 1], jacobian[:, 0, 2] = z, -y
    jacobian[:, 1, 0], jacobian[:, 1, 2] = -z, x
    jacobian[:, 2, 0], jacobian[:, 2, 1] = y, -x
    jacobian[:, :, 3:6] = np.eye(3)
    jacobian[:, :, 6] = points
    return jacobian


def scaling_direction(centre: np.ndarray) -> np.ndarray:
    """[7] the tangent of a scaling about `centre` (source coordinates), per unit of log scale:
    x -> e^l (x - c) + c is, to first order, x + l x - l c, so u = -l c."""
    direction = np.zeros(TANGENT_DIM)
    direction[3:6] = -np.asarray(centre, np.float64)
    direction[6] = 1.0
    return direction


def fit_covariance(source: np.ndarray, residuals: np.ndarray, scale: float,
                   weights: np.ndarray | None = None) -> np.ndarray:
    """[7, 7] Gauss-Newton covariance of a least-squares Sim(3) fit target ~ T(source), in T's tangent.

    source [N, 3] in the coordinates whose tangent is wanted (T's source); residuals [N, 3] = target -
    T(source), in target units; scale: T's (target units per source unit); weights [N] the fit's (IRLS),
    default 1. The residuals are taken as independent and isotropic with one variance, estimated from
    them: sigma^2 = sum w |r|^2 / (3 N - 7). A point moves by scale * R @ J e in target units, and R drops
    out of J^T J, so the covariance is sigma^2 / scale^2 * (sum w J^T J)^-1.
    """
    source = np.asarray(source, np.float64)
    residuals = np.asarray(residuals, np.float64)
    weights = np.ones(len(source)) if weights is None else np.asarray(weights, np.float64)
    dof = 3 * len(source) - TANGENT_DIM
    if dof <= 0:
        raise AlignmentError(f"{len(source)} points leave no residual degrees of freedom for a Sim(3) fit")
    variance = float(np.sum(weights * np.sum(residuals**2, axis=1))) / dof
    jacobian = tangent_jacobian(source)
    information = np.einsum("n,nij,nik->jk", weights, jacobian, jacobian) * scale**2
    return variance * np.linalg.inv(information)


def overlap_covariance(target_pose_enc: np.ndarray, source_pose_enc: np.ndarray, transform: Sim3, anchor: int,
                       frame_ratios: Sequence[FrameRatios] = ()) -> np.ndarray:
    """[7, 7] covariance of a chunk alignment's error, transform @ Exp(e), in the tangent at the source
    chunk's origin (where the pose graph measures its odometry edge's error).

    The alignment (`estimate_chunk_alignment`) takes rotation and translation from one anchor frame and the
    scale from the depth ratios, so its error is the anchor's: each shared frame's pose as the two chunks
    predict it differs by an independent rotation w_k and centre shift c_k (source units), which the other
    frames measure: after the fit frame k's residual is w_k - w_anchor (likewise c), of variance twice a
    frame's, so a frame's variance per axis is half the residuals' mean square over the frames other than
    the anchor. The log scale's variance is the spread of the per-frame log median ratios over their count
    (`frame_ratios`: those sorted beforehand, whose medians are free), or, with fewer than two of them, the
    centres' disagreement relative to the overlap's extent. To the origin: an error (w, c, l) at the anchor
    centre a is e = [w, c + a x w - l a, l] (a rotation and a scaling about a). Each component of the
    anchor's error has the floor MIN_OVERLAP_SIGMA (of the extent, for the centre; absolute for a still camera).
    pose_enc [K, 9] camera-to-world, the same K frames in both.
    """
    target = np.asarray(target_pose_enc, np.float64)
    source = np.asarray(source_pose_enc, np.float64)
    source_rotation = quat_xyzw_to_rotation(source[:, 3:7])
    # R^T R_target R_source^T: each frame's rotation left over, in the source chunk's coordinates
    left_over = np.einsum("ji,kjl,kml->kim", transform.rotation, quat_xyzw_to_rotation(target[:, 3:7]),
                          source_rotation)
    rotation_residuals = _rotation_vectors(left_over)
    centre_residuals = (transform.apply_to_points(source[:, :3]) - target[:, :3]) / transform.scale
    others = np.arange(len(source)) != anchor
    rotation_variance = _half_mean_square(rotation_residuals[others])
    centre_variance = _half_mean_square(centre_residuals[others])
    centres = source[:, :3]
    extent = float(np.sqrt(np.mean(np.sum((centres - centres.mean(axis=0)) ** 2, axis=1))))
    # a still camera (centres within STILL_EXTENT): translation in absolute units
    extent = extent if extent >= STILL_EXTENT else 1.0
    log_scale_variance = _log_scale_variance(frame_ratios, float(np.sum(centre_variance)) / extent**2)
    floor = MIN_OVERLAP_SIGMA**2
    anchor_variance = np.concatenate([np.maximum(rotation_variance, floor),
                                      np.maximum(centre_variance, floor * extent**2),
                                      [max(log_scale_variance, floor)]])
    to_origin = _anchor_to_origin(centres[anchor])
    return to_origin @ np.diag(anchor_variance) @ to_origin.T


def _half_mean_square(residuals: np.ndarray) -> np.ndarray:
    """[3] half the mean square per axis of residuals [n, 3] (zeros when n = 0)."""
    return 0.5 * np.mean(residuals**2, axis=0) if len(residuals) else np.zeros(3)


def _log_scale_variance(frame_ratios: Sequence[FrameRatios], fallback: float) -> float:
    """The variance of the mean of the frames' log median ratios, or `fallback` with fewer than two frames."""
    medians = [float(ratios.values[(ratios.size - 1) // 2]) for ratios in frame_ratios if ratios.size]
    logs = np.log([median for median in medians if np.isfinite(median) and median > 0])
    return float(np.var(logs, ddof=1)) / len(logs) if len(logs) >= 2 else fallback


def _anchor_to_origin(anchor: np.ndarray) -> np.ndarray:
    """[7, 7] an error (w, c, l) at the anchor centre a -> the tangent at the origin: [w, c + a x w - l a, l]."""
    x, y, z = anchor
    jacobian = np.eye(TANGENT_DIM)
    jacobian[3:6, 0:3] = [[0.0, -z, y], [z, 0.0, -x], [-y, x, 0.0]]
    jacobian[3:6, 6] = -anchor
    return jacobian
