"""Evaluate a run directory against ground truth: trajectory (ATE, RPE, pose AUC) and depth.

Conventions (DESIGN.md §4): poses are camera-to-world (`c2w`) in OpenCV axes; TUM files hold
`timestamp tx ty tz qx qy qz qw` per line, camera-to-world, as TUM RGB-D's `groundtruth.txt` does.

The trajectory metrics reproduce what `evo_ape tum GT EST -a` / `-as` and
`evo_rpe tum GT EST -a` / `-as` (also with `-r angle_deg`) print, with evo's defaults, so numbers are
comparable with published tables, which are evo's:

- association (evo's `--t_max_diff 0.01`, nearest-time sync): the trajectory with fewer poses (the
  estimate when both have as many) keeps, in its own order, each pose whose nearest timestamp in the
  other trajectory is at most `max_diff` seconds away, paired with that pose. A pose of the longer
  trajectory may serve several pairs; nothing else is paired;
- alignment (`-a`: SE(3), `-as`: Sim(3)): Umeyama's least squares from the matched estimated positions
  onto the ground-truth positions; the aligned estimate is `R_a R_i`, `s R_a t_i + t_a`;
- ATE (evo_ape, translation part): `|| p_gt_i - (s R_a p_est_i + t_a) ||` per matched pose;
- RPE (evo_rpe, `--delta 1 --delta_unit f`, on the aligned estimate; with a delta of one frame, consecutive
  and `--all_pairs` give the same pairs): for consecutive matched poses i, i+1,
  `E_i = (Q_i^-1 Q_{i+1})^-1 (P_i^-1 P_{i+1})` with Q ground truth and P the aligned estimate; the
  translation error is `|| trans(E_i) ||`, the rotation error (`-r angle_deg`) the angle of `rot(E_i)` in
  degrees;
- each error series is summarised by evo's seven statistics: rmse, mean, median, std (population), min,
  max, sse.

Everything here is our own code; `evo` is used only by the tests, as a reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from stream_recon.app.evaluation.settings import DEFAULT_MAX_DIFF as DEFAULT_MAX_DIFF
from stream_recon.app.evaluation.settings import DEPTH_MAX_DIFF as DEPTH_MAX_DIFF
from stream_recon.app.evaluation.settings import ERROR_METRICS as ERROR_METRICS
from stream_recon.app.evaluation.settings import OPEN_CHAIN as OPEN_CHAIN
from stream_recon.app.evaluation.settings import STATISTICS as STATISTICS
from stream_recon.app.evaluation.settings import statistic_key as statistic_key
from stream_recon.app.outputs.json_records import write_json_atomic
from stream_recon.app.outputs.npz_reading import prediction_fields
from stream_recon.app.outputs.rundir import EVAL_JSON, PREDICTIONS_DIR, RunDirError, prediction_files
from stream_recon.app.outputs.trajectories import (
    TumFileError,
    read_tum,
    read_tum_list,
    run_open_trajectory,
    run_trajectory,
)
from stream_recon.models.stream.similarity import AlignmentError, Sim3, rotation_angles, umeyama

TUM_DEPTH_FACTOR = 5000.0  # TUM RGB-D depth PNGs: uint16, 5000 units per metre
AUC_THRESHOLDS_DEG = (5, 15, 30)
DELTA1_THRESHOLD = 1.25


class EvaluationError(ValueError):
    """Inputs that cannot be evaluated: malformed files, nothing to compare, degenerate motion."""


@dataclass(frozen=True)
class Trajectory:
    """Timestamped camera-to-world poses. timestamps [N] seconds, c2w [N, 4, 4]."""

    timestamps: np.ndarray
    c2w: np.ndarray

    def __len__(self) -> int:
        return len(self.timestamps)

    @property
    def positions(self) -> np.ndarray:
        """Camera centres [N, 3]."""
        return self.c2w[:, :3, 3]

    def subset(self, indices: np.ndarray) -> Trajectory:
        return Trajectory(self.timestamps[indices], self.c2w[indices])

    def time_range(self) -> str:
        if len(self) == 0:
            return "no poses"
        return f"{self.timestamps.min():.6f} .. {self.timestamps.max():.6f} s ({len(self)} poses)"


# --------------------------------------------------------------------------------------------------
# TUM files


def read_tum_trajectory(path: str | Path) -> Trajectory:
    """Read a TUM trajectory file (`timestamp tx ty tz qx qy qz qw`, `#` comments) into c2w poses."""
    try:
        return Trajectory(*read_tum(Path(path)))
    except TumFileError as error:
        raise EvaluationError(str(error)) from None


# --------------------------------------------------------------------------------------------------
# Association and alignment


def nearest_stamps(queries: np.ndarray, stamps: np.ndarray, max_diff: float) -> tuple[np.ndarray, np.ndarray]:
    """For each query time [Q], its nearest stamp [M] when that is at most `max_diff` seconds away.

    Returns (query indices [K], stamp indices [K]) in query order; queries without a stamp in reach are
    left out. Ties and boundaries follow evo's `matching_time_indices`, so the same pairs come out: on
    sorted stamps, a query exactly halfway between two stamps takes the earlier one; on unsorted stamps,
    the first of the nearest.
    """
    queries = np.asarray(queries, dtype=np.float64)
    stamps = np.asarray(stamps, dtype=np.float64)
    if len(queries) == 0 or len(stamps) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    if np.all(np.diff(stamps) >= 0):
        # The first stamp after each query, or the last stamp when none is after it.
        after = np.minimum(np.searchsorted(stamps, queries, side="right"), len(stamps) - 1)
        before = np.maximum(after - 1, 0)
        gap_after = stamps[after] - queries  # negative only past the last stamp, where `after` is the nearest
        gap_before = np.where(after > 0, queries - stamps[before], np.inf)
        take_after = (gap_after <= max_diff) & (gap_after < gap_before)
        take_before = ~take_after & (gap_before <= max_diff) & (gap_before <= gap_after)
        in_reach = (queries >= stamps[0] - max_diff) & (queries <= stamps[-1] + max_diff)
        keep = in_reach & (take_after | take_before)
        nearest = np.where(take_after, after, before)
    else:
        nearest = np.array([np.argmin(np.abs(stamps - query)) for query in queries], dtype=np.int64)
        keep = np.abs(stamps[nearest] - queries) <= max_diff
    return np.flatnonzero(keep).astype(np.int64), nearest[keep].astype(np.int64)


def associate_timestamps(
    estimated: np.ndarray, reference: np.ndarray, max_diff: float = DEFAULT_MAX_DIFF
) -> tuple[np.ndarray, np.ndarray]:
    """Pair estimated [N] and reference [M] timestamps as evo's nearest-time synchronisation does.

    The side with fewer stamps (the estimate when N == M) is searched in the other: each of its stamps,
    in its own order, is paired with its nearest stamp on the other side when that is at most `max_diff`
    seconds away. Searching from the shorter side loses none of its poses to a denser neighbour; a stamp
    of the longer side may be used by more than one pair. Returns (estimated indices [K], reference
    indices [K]), in the order of the shorter side.
    """
    if len(estimated) <= len(reference):
        return nearest_stamps(estimated, reference, max_diff)
    reference_indices, estimated_indices = nearest_stamps(reference, estimated, max_diff)
    return estimated_indices, reference_indices


def check_max_diff(max_diff: float) -> None:
    if not max_diff >= 0:  # also refuses NaN, which would silently match nothing
        raise EvaluationError(f"the largest timestamp difference must be >= 0 seconds, got {max_diff}")


def umeyama_alignment(source: np.ndarray, target: np.ndarray, *, with_scale: bool = True) -> Sim3:
    """The least-squares similarity (SE(3) without `with_scale`) mapping estimated positions [N, 3] onto
    the ground truth's [N, 3], as evo aligns (models/stream/similarity.py's `umeyama`)."""
    try:
        return umeyama(source, target, with_scale=with_scale)
    except AlignmentError as error:
        raise EvaluationError(
            f"cannot align the trajectories: {error} (the matched camera positions); evaluate a sequence with "
            "more camera motion"
        ) from None


def rotation_angle_deg(rotations: np.ndarray) -> np.ndarray:
    """Angle of each rotation [..., 3, 3] in degrees, in [0, 180] (models/stream/similarity.py's rotation_angles)."""
    return np.degrees(rotation_angles(rotations))


def error_statistics(errors: np.ndarray) -> dict[str, float]:
    """evo's summary of an error series [N]: rmse, mean, median, std (population), min, max, sse."""
    errors = np.asarray(errors, dtype=np.float64)
    squared = errors**2
    return {
        "rmse": float(np.sqrt(np.mean(squared))),
        "mean": float(np.mean(errors)),
        "median": float(np.median(errors)),
        "std": float(np.std(errors)),
        "min": float(np.min(errors)),
        "max": float(np.max(errors)),
        "sse": float(np.sum(squared)),
    }


def absolute_trajectory_errors(estimated_aligned: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Per-pose position error [N] between aligned estimated and reference c2w poses [N, 4, 4]."""
    return np.linalg.norm(estimated_aligned[:, :3, 3] - reference[:, :3, 3], axis=-1)


def invert_rigid(c2w: np.ndarray) -> np.ndarray:
    """Inverse of rigid transforms [..., 4, 4]: [R^T | -R^T t], exact where a general inverse rounds."""
    rotation_t = np.swapaxes(c2w[..., :3, :3], -1, -2)
    inverse = np.zeros_like(c2w)
    inverse[..., :3, :3] = rotation_t
    inverse[..., :3, 3] = -(rotation_t @ c2w[..., :3, 3:4])[..., 0]
    inverse[..., 3, 3] = 1.0
    return inverse


def relative_pose_errors(
    estimated_aligned: np.ndarray, reference: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """RPE over consecutive poses (evo: delta 1 frame): translation errors [N-1], rotation errors [N-1] (deg).

    E_i = (Q_i^-1 Q_{i+1})^-1 (P_i^-1 P_{i+1}), Q reference, P estimate, both c2w [N, 4, 4].
    """
    reference_relative = invert_rigid(reference[:-1]) @ reference[1:]
    estimated_relative = invert_rigid(estimated_aligned[:-1]) @ estimated_aligned[1:]
    error_poses = invert_rigid(reference_relative) @ estimated_relative
    return np.linalg.norm(error_poses[:, :3, 3], axis=-1), rotation_angle_deg(error_poses[:, :3, :3])


def _direction_angle_deg(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Angle in degrees between vectors [K, 3] and [K, 3]; 0 where either vector has no length."""
    norms = np.linalg.norm(first, axis=-1) * np.linalg.norm(second, axis=-1)
    cross = np.linalg.norm(np.cross(first, second), axis=-1)
    dot = np.einsum("kc,kc->k", first, second)
    return np.where(norms > 1e-12, np.degrees(np.arctan2(cross, dot)), 0.0)


def pairwise_pose_errors(estimated: np.ndarray, reference: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Relative rotation and translation-direction errors (deg) over all frame pairs i < j.

    estimated, reference: c2w [N, 4, 4] (alignment-free: every quantity here is invariant to a global
    Sim(3) of either trajectory). For each pair, the relative pose of camera j in camera i is
    T_i^-1 T_j; the rotation error is the angle of R_ref^T R_est, the translation error the angle
    between the two relative translation directions, folded to min(e, 180 - e) because a direction's
    sign is what monocular methods most often flip (VGGT's convention). Returns two arrays [N(N-1)/2].
    """
    rotation_errors, translation_errors = [], []
    reference_inverse, estimated_inverse = invert_rigid(reference), invert_rigid(estimated)
    # One camera i against all later ones at a time: memory stays O(N) while numpy does the inner loop.
    for i in range(len(reference) - 1):
        reference_relative = reference_inverse[i] @ reference[i + 1 :]  # [N-1-i, 4, 4]
        estimated_relative = estimated_inverse[i] @ estimated[i + 1 :]
        rotation_errors.append(
            rotation_angle_deg(
                np.swapaxes(reference_relative[:, :3, :3], -1, -2) @ estimated_relative[:, :3, :3]
            )
        )
        angle = _direction_angle_deg(reference_relative[:, :3, 3], estimated_relative[:, :3, 3])
        translation_errors.append(np.minimum(angle, 180.0 - angle))
    return np.concatenate(rotation_errors), np.concatenate(translation_errors)


def pose_auc(rotation_errors: np.ndarray, translation_errors: np.ndarray, threshold_deg: int) -> float:
    """VGGT-style pose AUC@threshold over frame pairs, in [0, 1].

    Each pair's error is max(rotation error, translation-direction error) in degrees. With thresholds
    k = 1, 2, ..., threshold_deg (1 degree steps), AUC = mean over k of the fraction of pairs whose
    error is below k (the last step, k = threshold_deg, also counts errors equal to it). This is the
    normalised cumulative histogram that VGGT's `calculate_auc_np` averages.
    """
    errors = np.maximum(rotation_errors, translation_errors)
    histogram, _ = np.histogram(errors, bins=np.arange(threshold_deg + 1))
    return float(np.mean(np.cumsum(histogram) / len(errors)))


# --------------------------------------------------------------------------------------------------
# Trajectory evaluation


def evaluate_trajectories(
    estimated: Trajectory,
    reference: Trajectory,
    *,
    alignment: str = "sim3",
    max_diff: float = DEFAULT_MAX_DIFF,
) -> dict:
    """Associate, align and score an estimated trajectory against a reference one (see module docstring)."""
    if alignment not in ("sim3", "se3"):
        raise EvaluationError(f"alignment must be 'sim3' or 'se3', got {alignment!r}")
    check_max_diff(max_diff)
    est_indices, ref_indices = associate_timestamps(estimated.timestamps, reference.timestamps, max_diff)
    if len(est_indices) == 0:
        raise EvaluationError(
            f"no estimated pose lies within {max_diff} s of a ground-truth pose: the estimate spans "
            f"{estimated.time_range()}, the ground truth spans {reference.time_range()}. Both must use the "
            "same clock (for TUM, the rgb.txt timestamps); otherwise raise --max-diff"
        )
    if len(est_indices) < 3:
        raise EvaluationError(
            f"only {len(est_indices)} pose(s) matched within {max_diff} s (the estimate spans "
            f"{estimated.time_range()}, the ground truth {reference.time_range()}); at least 3 are needed "
            "to align and evaluate"
        )
    matched_est = estimated.subset(est_indices)
    matched_ref = reference.subset(ref_indices)
    fit = umeyama_alignment(matched_est.positions, matched_ref.positions, with_scale=alignment == "sim3")
    aligned = fit.apply_to_poses(matched_est.c2w)
    rpe_translation, rpe_rotation = relative_pose_errors(aligned, matched_ref.c2w)
    pair_rotation, pair_translation = pairwise_pose_errors(matched_est.c2w, matched_ref.c2w)
    result = {
        "alignment": alignment,
        "scale": fit.scale,
        "rotation": fit.rotation.tolist(),
        "translation": fit.translation.tolist(),
        "max_diff": max_diff,
        "matched_poses": int(len(est_indices)),
        "estimated_poses": len(estimated),
        "gt_poses": len(reference),
        "rpe_pairs": len(rpe_translation),
    }
    error_series = {
        "ate": absolute_trajectory_errors(aligned, matched_ref.c2w),
        "rpe_trans": rpe_translation,
        "rpe_rot": rpe_rotation,
    }
    for metric, unit in ERROR_METRICS:
        for statistic, value in error_statistics(error_series[metric]).items():
            result[statistic_key(metric, statistic, unit)] = value
    for threshold in AUC_THRESHOLDS_DEG:
        result[f"auc_{threshold}"] = pose_auc(pair_rotation, pair_translation, threshold)
    return result


# --------------------------------------------------------------------------------------------------
# Depth


def depth_errors(predicted: np.ndarray, ground_truth: np.ndarray) -> tuple[float, float, int]:
    """AbsRel and delta<1.25 of one frame after median scaling.

    predicted, ground_truth [H, W] (same size; ground truth in metres, 0 = no measurement). The
    prediction is scaled by median(gt) / median(pred) over pixels valid in both, as monocular depth is
    only known up to scale. Returns (abs_rel, delta1, valid pixel count); NaNs when nothing is valid.
    """
    valid = (ground_truth > 0) & np.isfinite(ground_truth) & (predicted > 0) & np.isfinite(predicted)
    count = int(valid.sum())
    if count == 0:
        return float("nan"), float("nan"), 0
    gt = ground_truth[valid].astype(np.float64)
    pred = predicted[valid].astype(np.float64)
    pred = pred * (np.median(gt) / np.median(pred))
    abs_rel = float(np.mean(np.abs(pred - gt) / gt))
    delta1 = float(np.mean(np.maximum(pred / gt, gt / pred) < DELTA1_THRESHOLD))
    return abs_rel, delta1, count


def read_tum_depth(path: str | Path) -> np.ndarray:
    """A TUM depth PNG (uint16, 5000 per metre) -> depth [H, W] float32 metres, 0 where missing."""
    raw = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
    if raw is None:
        raise EvaluationError(f"cannot read depth image {path}")
    if raw.ndim != 2:
        raise EvaluationError(
            f"depth image {path} has {raw.shape[2]} channels; expected a single-channel PNG"
        )
    return raw.astype(np.float32) / TUM_DEPTH_FACTOR


def match_ground_truth_to_prediction(ground_truth: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Bring ground-truth depth [h, w] to the prediction's (H, W) the way preprocessing maps the image.

    Preprocessing resizes the frame and rounds each side to the 14-pixel grid, then centre-crops what
    is still too long. So: when the aspect ratios differ by less than one grid cell's worth (a rounding
    effect), resize only; otherwise centre-crop the ground truth to the prediction's aspect first.
    Nearest-neighbour, so holes (0) stay holes and depths are never blended across edges.
    """
    height, width = size
    gt_height, gt_width = ground_truth.shape
    target_aspect, gt_aspect = width / height, gt_width / gt_height
    if abs(target_aspect - gt_aspect) > gt_aspect * 14.0 / min(height, width):
        if gt_aspect > target_aspect:
            crop_width = int(round(gt_height * target_aspect))
            start = (gt_width - crop_width) // 2
            ground_truth = ground_truth[:, start : start + crop_width]
        else:
            crop_height = int(round(gt_width / target_aspect))
            start = (gt_height - crop_height) // 2
            ground_truth = ground_truth[start : start + crop_height]
    return cv2.resize(ground_truth, (width, height), interpolation=cv2.INTER_NEAREST)


def read_depth_list(depth_dir: str | Path) -> tuple[np.ndarray, list[Path]]:
    """Ground-truth depth frames of a folder: timestamps [N] and PNG paths, sorted by time.

    Uses `depth.txt` (`timestamp path` per line, paths relative to the folder) when present, as in the
    TUM RGB-D layout; otherwise every PNG whose file name is its timestamp (`1305031102.160407.png`).
    """
    depth_dir = Path(depth_dir)
    if not depth_dir.is_dir():
        raise EvaluationError(f"depth folder {depth_dir} does not exist")
    entries: list[tuple[float, Path]] = []
    listing = depth_dir / "depth.txt"
    if listing.is_file():
        try:
            entries = read_tum_list(listing)
        except TumFileError as error:
            raise EvaluationError(str(error)) from None
    else:
        for png in depth_dir.glob("*.png"):
            try:
                entries.append((float(png.stem), png))
            except ValueError:
                continue
    if not entries:
        raise EvaluationError(
            f"no ground-truth depth in {depth_dir}: expected depth.txt or PNGs named by their timestamp"
        )
    entries.sort(key=lambda entry: entry[0])
    return np.array([e[0] for e in entries]), [e[1] for e in entries]


def evaluate_depth(run_dir: str | Path, depth_dir: str | Path, *, max_diff: float = DEPTH_MAX_DIFF) -> dict:
    """Per-frame median-scaled depth metrics over the predictions that associate with a depth frame.

    Predictions and depth frames are paired by `associate_timestamps` (the trajectory rule), within
    `max_diff` seconds. Reads the run's `predictions/*.npz` (`timestamp`, `depth` [H, W]); averages the
    per-frame AbsRel and delta<1.25 over frames (each frame weighs the same, whatever its valid pixel count).
    """
    check_max_diff(max_diff)
    try:
        paths = [path for _, path in prediction_files(Path(run_dir))]
    except RunDirError as error:
        raise EvaluationError(str(error)) from None
    if not paths:
        raise EvaluationError(f"no per-frame predictions (*.npz) in {Path(run_dir) / PREDICTIONS_DIR}")
    timestamps = []
    for file in paths:
        timestamps.append(float(prediction_fields(file, "timestamp")["timestamp"]))
    depth_timestamps, depth_paths = read_depth_list(depth_dir)
    pred_indices, depth_indices = associate_timestamps(np.array(timestamps), depth_timestamps, max_diff)
    if len(pred_indices) == 0:
        raise EvaluationError(
            f"no prediction lies within {max_diff} s of a ground-truth depth frame: predictions span "
            f"{min(timestamps):.6f} .. {max(timestamps):.6f} s, depth frames span "
            f"{depth_timestamps[0]:.6f} .. {depth_timestamps[-1]:.6f} s"
        )
    abs_rels, delta1s = [], []
    for pred_index, depth_index in zip(pred_indices, depth_indices, strict=True):
        predicted = prediction_fields(paths[pred_index], "depth")["depth"]
        ground_truth = match_ground_truth_to_prediction(
            read_tum_depth(depth_paths[depth_index]), predicted.shape
        )
        abs_rel, delta1, count = depth_errors(predicted, ground_truth)
        if count:
            abs_rels.append(abs_rel)
            delta1s.append(delta1)
    if not abs_rels:
        raise EvaluationError(f"none of the {len(pred_indices)} matched depth frames has a valid pixel")
    return {
        "depth_abs_rel": float(np.mean(abs_rels)),
        "depth_delta1": float(np.mean(delta1s)),
        "depth_frames": len(abs_rels),
    }


# --------------------------------------------------------------------------------------------------
# Run directories


def evaluate_run(
    run_dir: str | Path,
    gt_file: str | Path,
    *,
    alignment: str = "sim3",
    max_diff: float = DEFAULT_MAX_DIFF,
    depth_dir: str | Path | None = None,
    depth_max_diff: float = DEPTH_MAX_DIFF,
) -> dict:
    """Evaluate a run's trajectory (and predictions/*.npz depth); write_evaluation stores the result.

    The trajectory is trajectory_tum.txt, or, for a run killed before writing it, the poses in its npz
    files (trajectories.run_trajectory). `max_diff` pairs estimated with ground-truth poses, `depth_max_diff`
    predictions with depth frames. When loop closure corrected the run, its open chain
    (trajectory_open_tum.txt) is scored the same way, aligned on its own, under OPEN_CHAIN: the
    trajectory metrics' keys, values equal to evaluating that file alone.
    """
    run_dir = Path(run_dir)
    gt = read_tum_trajectory(gt_file)  # first: a wrong --gt is the likelier mistake, and cheap to find
    try:
        estimate = Trajectory(*run_trajectory(run_dir))
        open_chain = run_open_trajectory(run_dir)
    except TumFileError as error:
        raise EvaluationError(str(error)) from None
    result = {"run_dir": str(run_dir), "gt_file": str(gt_file)}
    result.update(evaluate_trajectories(estimate, gt, alignment=alignment, max_diff=max_diff))
    if depth_dir is not None:
        result.update(depth_dir=str(depth_dir), depth_max_diff=depth_max_diff)
        result.update(evaluate_depth(run_dir, depth_dir, max_diff=depth_max_diff))
    if open_chain is not None:
        result[OPEN_CHAIN] = evaluate_trajectories(
            Trajectory(*open_chain), gt, alignment=alignment, max_diff=max_diff
        )
    return result


def evaluation_path(run_dir: str | Path) -> Path:
    """Where a run's evaluation is kept unless told otherwise: RUN_DIR/eval.json."""
    return Path(run_dir) / EVAL_JSON


def write_evaluation(result: dict, path: str | Path) -> None:
    """Store an evaluation (atomically; a symlink is written through, a FIFO or device refused). Raises OSError."""
    write_json_atomic(Path(path), result)
