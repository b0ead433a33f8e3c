"""Evaluation against evo (the reference implementation, dev extra only) and hand computations."""

import copy
import json

import cv2
import numpy as np
import pytest
from evo.core import metrics, sync
from evo.core.trajectory import PoseTrajectory3D
from evo.tools import file_interface
from hypothesis import given, settings
from hypothesis import strategies as st

from stream_recon.app.evaluation import (
    EvaluationError,
    Trajectory,
    associate_timestamps,
    depth_errors,
    evaluate_run,
    evaluate_trajectories,
    match_ground_truth_to_prediction,
    pairwise_pose_errors,
    pose_auc,
    read_tum_trajectory,
    umeyama_alignment,
)
from stream_recon.app.rundir import write_tum


def random_rotation(rng, max_angle=np.pi):
    axis = rng.normal(size=3)
    axis /= np.linalg.norm(axis)
    angle = rng.uniform(0, max_angle)
    skew = np.array([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]])
    return np.eye(3) + np.sin(angle) * skew + (1 - np.cos(angle)) * skew @ skew


def random_walk_c2w(rng, count):
    """A wandering camera: [count, 4, 4] camera-to-world poses."""
    poses = np.tile(np.eye(4), (count, 1, 1))
    for i in range(1, count):
        step = np.eye(4)
        step[:3, :3] = random_rotation(rng, max_angle=0.2)
        step[:3, 3] = rng.normal(scale=0.1, size=3)
        poses[i] = poses[i - 1] @ step
    return poses


def apply_sim3(c2w, rotation, translation, scale):
    moved = c2w.copy()
    moved[:, :3, :3] = rotation @ c2w[:, :3, :3]
    moved[:, :3, 3] = scale * c2w[:, :3, 3] @ rotation.T + translation
    return moved


def perturb(rng, c2w, position_noise, angle_noise):
    noisy = c2w.copy()
    for pose in noisy:
        pose[:3, :3] = pose[:3, :3] @ random_rotation(rng, max_angle=angle_noise)
        pose[:3, 3] += rng.normal(scale=position_noise, size=3)
    return noisy


def evo_metrics(reference_traj, estimated_traj, *, correct_scale, max_diff):
    """What evo_ape / evo_rpe report: associate, Umeyama-align the estimate, then APE and RPE (delta 1 f)."""
    reference_traj, estimated_traj = sync.associate_trajectories(
        reference_traj, estimated_traj, max_diff=max_diff
    )
    estimated_traj = copy.deepcopy(estimated_traj)
    rotation, translation, scale = estimated_traj.align(reference_traj, correct_scale=correct_scale)
    ape = metrics.APE(metrics.PoseRelation.translation_part)
    ape.process_data((reference_traj, estimated_traj))
    results = {
        "matched_poses": reference_traj.num_poses,
        "scale": scale,
        "rotation": rotation,
        "translation": translation,
    }
    for statistic in ("rmse", "mean", "median", "max"):
        results[f"ate_{statistic}"] = ape.get_statistic(metrics.StatisticsType[statistic])
    for relation, key in (
        (metrics.PoseRelation.translation_part, "rpe_trans"),
        (metrics.PoseRelation.rotation_angle_deg, "rpe_rot"),
    ):
        rpe = metrics.RPE(relation, delta=1, delta_unit=metrics.Unit.frames, all_pairs=False)
        rpe.process_data((reference_traj, estimated_traj))
        results[f"{key}_rmse"] = rpe.get_statistic(metrics.StatisticsType.rmse)
        results[f"{key}_mean"] = rpe.get_statistic(metrics.StatisticsType.mean)
    return results


def assert_matches_evo(ours, theirs):
    assert ours["matched_poses"] == theirs["matched_poses"]
    for key in ("ate_rmse", "ate_mean", "ate_median", "ate_max", "rpe_trans_rmse", "rpe_trans_mean", "scale"):
        assert ours[key] == pytest.approx(theirs[key], abs=1e-6, rel=1e-9), key
    assert ours["rpe_rot_rmse_deg"] == pytest.approx(theirs["rpe_rot_rmse"], abs=1e-6)
    assert ours["rpe_rot_mean_deg"] == pytest.approx(theirs["rpe_rot_mean"], abs=1e-6)
    np.testing.assert_allclose(ours["rotation"], theirs["rotation"], atol=1e-6)
    np.testing.assert_allclose(ours["translation"], theirs["translation"], atol=1e-6)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("alignment", ["sim3", "se3"])
def test_random_trajectories_match_evo(seed, alignment):
    rng = np.random.default_rng(seed)
    count = int(rng.integers(5, 80))
    reference = random_walk_c2w(rng, count)
    estimated = perturb(rng, reference, position_noise=0.05, angle_noise=0.05)
    estimated = apply_sim3(estimated, random_rotation(rng), rng.normal(size=3), float(rng.uniform(0.2, 5.0)))
    timestamps = 1000.0 + np.arange(count) / 30.0
    ours = evaluate_trajectories(
        Trajectory(timestamps, estimated),
        Trajectory(timestamps, reference),
        alignment=alignment,
        max_diff=0.01,
    )
    theirs = evo_metrics(
        PoseTrajectory3D(poses_se3=list(reference), timestamps=timestamps),
        PoseTrajectory3D(poses_se3=list(estimated), timestamps=timestamps),
        correct_scale=alignment == "sim3",
        max_diff=0.01,
    )
    assert_matches_evo(ours, theirs)
    assert ours["alignment"] == alignment
    if alignment == "se3":
        assert ours["scale"] == 1.0


def write_known_pair(tmp_path, rng, *, noise):
    """Ground truth at 30 Hz and an estimate on every other frame, jittered by a few ms, in another Sim(3)."""
    reference = random_walk_c2w(rng, 120)
    stamps = 1305031102.175304 + np.arange(120) / 30.0
    rotation, translation, scale = random_rotation(rng), np.array([1.5, -2.0, 0.3]), 0.37
    # The estimate lives in a frame where ground truth = scale * rotation @ estimate + translation.
    inverse_rotation, inverse_scale = rotation.T, 1.0 / scale
    inverse_translation = -inverse_scale * inverse_rotation @ translation
    estimated = apply_sim3(reference[::2], inverse_rotation, inverse_translation, inverse_scale)
    estimated = perturb(rng, estimated, position_noise=noise, angle_noise=noise)
    estimated_stamps = stamps[::2] + rng.uniform(-0.004, 0.004, size=60)
    gt_file, est_file = tmp_path / "groundtruth.txt", tmp_path / "trajectory_tum.txt"
    write_tum(gt_file, stamps, reference)
    write_tum(est_file, estimated_stamps, estimated)
    gt_file.write_text("# timestamp tx ty tz qx qy qz qw\n" + gt_file.read_text())
    return gt_file, est_file, (rotation, translation, scale)


def test_tum_files_match_evo_and_alignment_recovers_the_transform(tmp_path):
    gt_file, est_file, (rotation, translation, scale) = write_known_pair(
        tmp_path, np.random.default_rng(7), noise=0.01
    )
    ours = evaluate_run(tmp_path, gt_file, max_diff=0.02)
    theirs = evo_metrics(
        file_interface.read_tum_trajectory_file(str(gt_file)),
        file_interface.read_tum_trajectory_file(str(est_file)),
        correct_scale=True,
        max_diff=0.02,
    )
    assert ours["matched_poses"] == 60
    assert_matches_evo(ours, theirs)
    assert ours["scale"] == pytest.approx(scale, rel=0.05)
    np.testing.assert_allclose(ours["rotation"], rotation, atol=0.05)
    np.testing.assert_allclose(ours["translation"], translation, atol=0.05)
    written = json.loads((tmp_path / "eval.json").read_text())
    assert written == json.loads(json.dumps(ours))  # every metric, as exact as JSON keeps floats
    assert "depth_abs_rel" not in written


def test_noise_free_alignment_is_exact(tmp_path):
    gt_file, est_file, (rotation, translation, scale) = write_known_pair(
        tmp_path, np.random.default_rng(3), noise=0.0
    )
    result = evaluate_run(tmp_path, gt_file)
    assert result["scale"] == pytest.approx(scale, rel=1e-6)
    np.testing.assert_allclose(result["rotation"], rotation, atol=1e-6)
    np.testing.assert_allclose(result["translation"], translation, atol=1e-6)
    assert result["ate_rmse"] < 1e-6 and result["rpe_rot_rmse_deg"] < 1e-4
    assert result["auc_5"] == result["auc_30"] == 1.0


def test_umeyama_se3_keeps_unit_scale_and_fits_rigid_motion():
    rng = np.random.default_rng(0)
    points = rng.normal(size=(30, 3))
    rotation = random_rotation(rng)
    moved = points @ rotation.T + np.array([0.1, 0.2, 0.3])
    fit = umeyama_alignment(points, moved, with_scale=False)
    assert fit.scale == 1.0
    np.testing.assert_allclose(fit.rotation, rotation, atol=1e-10)
    assert np.linalg.det(fit.rotation) == pytest.approx(1.0)


def test_collinear_positions_cannot_be_aligned():
    line = np.outer(np.arange(5.0), [1.0, 0.0, 0.0])
    with pytest.raises(EvaluationError, match="one line"):
        umeyama_alignment(line, line)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=30),
    st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=30),
    st.floats(0, 0.5),
)
def test_association_is_one_to_one_and_within_max_diff(estimated, reference, max_diff):
    est_indices, ref_indices = associate_timestamps(np.array(estimated), np.array(reference), max_diff)
    assert len(set(est_indices.tolist())) == len(est_indices)
    assert len(set(ref_indices.tolist())) == len(ref_indices)
    assert list(est_indices) == sorted(est_indices)
    differences = (
        np.abs(np.array(estimated)[est_indices] - np.array(reference)[ref_indices])
        if len(est_indices)
        else []
    )
    assert np.all(np.asarray(differences) <= max_diff)
    # Maximal: no unmatched pair is left that could still be matched.
    free_est = set(range(len(estimated))) - set(est_indices.tolist())
    free_ref = set(range(len(reference))) - set(ref_indices.tolist())
    assert not any(abs(estimated[i] - reference[j]) <= max_diff for i in free_est for j in free_ref)


def test_association_agrees_with_evo_on_jittered_stamps():
    rng = np.random.default_rng(1)
    reference = np.arange(200) / 30.0
    estimated = reference[::3] + rng.uniform(-0.01, 0.01, size=67)
    ours = associate_timestamps(estimated, reference, 0.02)
    theirs = sync.matching_time_indices(estimated, reference, 0.02)
    assert ours[0].tolist() == theirs[0] and ours[1].tolist() == theirs[1]


def test_one_to_one_gives_a_shared_neighbour_to_the_closer_estimate():
    # 0.01 is within reach of both 0.0 and 0.011; the closer one takes it, and 0.0 stays unmatched.
    est_indices, ref_indices = associate_timestamps(
        np.array([0.0, 0.011, 0.04]), np.array([0.01, 0.035]), 0.02
    )
    assert est_indices.tolist() == [1, 2] and ref_indices.tolist() == [0, 1]


def test_nothing_associates_names_both_time_ranges(tmp_path):
    poses = random_walk_c2w(np.random.default_rng(0), 5)
    write_tum(tmp_path / "trajectory_tum.txt", np.arange(5.0), poses)
    write_tum(tmp_path / "gt.txt", 100 + np.arange(5.0), poses)
    with pytest.raises(EvaluationError) as error:
        evaluate_run(tmp_path, tmp_path / "gt.txt")
    message = str(error.value)
    assert "0.000000 .. 4.000000 s (5 poses)" in message
    assert "100.000000 .. 104.000000 s (5 poses)" in message
    assert not (tmp_path / "eval.json").exists()


def test_fewer_than_three_matches_is_an_error(tmp_path):
    poses = random_walk_c2w(np.random.default_rng(0), 5)
    write_tum(tmp_path / "trajectory_tum.txt", np.arange(5.0), poses)
    write_tum(tmp_path / "gt.txt", np.arange(3.0, 8.0), poses)
    with pytest.raises(EvaluationError, match="only 2 pose"):
        evaluate_run(tmp_path, tmp_path / "gt.txt")


@pytest.mark.parametrize(
    ("bad_line", "reason"),
    [
        ("1.0 0 0 0 0 0 0", "expected 8 values"),
        ("1.0 0 0 x 0 0 0 1", "not a number"),
        ("1.0 0 0 0 0 0 0 0", "zero quaternion"),
    ],
)
def test_malformed_line_is_reported_with_its_number(tmp_path, bad_line, reason):
    path = tmp_path / "gt.txt"
    path.write_text("# header\n0.0 0 0 0 0 0 0 1\n\n" + bad_line + "\n")
    with pytest.raises(EvaluationError, match=f"line 4: {reason}"):
        read_tum_trajectory(path)


def test_auc_by_hand():
    # Three cameras on a line; the estimate turns camera 2 by 10.5 degrees about its optical axis. Its centre
    # does not move, so pairs (0, 2) and (1, 2) get 10.5 degrees of rotation error and no direction error.
    reference = np.tile(np.eye(4), (3, 1, 1))
    reference[:, 0, 3] = [0.0, 1.0, 2.5]
    estimated = reference.copy()
    angle = np.radians(10.5)
    estimated[2, :3, :3] = [[np.cos(angle), -np.sin(angle), 0], [np.sin(angle), np.cos(angle), 0], [0, 0, 1]]
    rotation_errors, translation_errors = pairwise_pose_errors(estimated, reference)
    np.testing.assert_allclose(rotation_errors, [0.0, 10.5, 10.5], atol=1e-9)
    np.testing.assert_allclose(translation_errors, [0.0, 0.0, 0.0], atol=1e-9)
    # AUC@T = mean over k = 1..T of the share of pairs with error < k.
    assert pose_auc(rotation_errors, translation_errors, 5) == pytest.approx(1 / 3)
    assert pose_auc(rotation_errors, translation_errors, 15) == pytest.approx((10 * (1 / 3) + 5) / 15)
    assert pose_auc(rotation_errors, translation_errors, 30) == pytest.approx((10 * (1 / 3) + 20) / 30)


def test_translation_direction_error_folds_sign_flips():
    reference = np.tile(np.eye(4), (2, 1, 1))
    reference[1, :3, 3] = [1.0, 0.0, 0.0]
    estimated = reference.copy()
    estimated[1, :3, 3] = [-2.0, 0.0, 0.0]
    _, translation_errors = pairwise_pose_errors(estimated, reference)
    assert translation_errors[0] == pytest.approx(0.0)
    estimated[1, :3, 3] = [1.0, 1.0, 0.0]
    _, translation_errors = pairwise_pose_errors(estimated, reference)
    assert translation_errors[0] == pytest.approx(45.0)


def test_depth_errors_by_hand():
    ground_truth = np.array([[1.0, 2.0], [4.0, 0.0]])
    predicted = np.array([[0.5, 1.5], [1.5, 3.0]])
    # Valid: the three pixels with gt > 0. Median scale = median(1, 2, 4) / median(0.5, 1.5, 1.5) = 2 / 1.5.
    # Scaled predictions: 2/3, 2, 2. AbsRel = (1/3 + 0 + 1/2) / 3 = 5/18. Ratios max(p/g, g/p): 1.5, 1, 2.
    abs_rel, delta1, count = depth_errors(predicted, ground_truth)
    assert count == 3
    assert abs_rel == pytest.approx(5 / 18)
    assert delta1 == pytest.approx(1 / 3)


def test_ground_truth_depth_is_cropped_only_when_the_aspect_really_differs():
    ground_truth = np.arange(480 * 640, dtype=np.float32).reshape(480, 640)
    # 640 x 480 resized to 518 wide rounds 388.5 rows to 392: a rounding effect, so resize only.
    resized = match_ground_truth_to_prediction(ground_truth, (392, 518))
    assert resized.shape == (392, 518)
    # Nothing is cropped: the corners come from the corners (nearest neighbour, within a pixel).
    last_row, last_column = divmod(int(resized[-1, -1]), 640)
    assert resized[0, 0] == 0 and last_row >= 478 and last_column >= 638
    square = match_ground_truth_to_prediction(ground_truth, (480, 480))
    np.testing.assert_array_equal(square, ground_truth[:, 80:560])


def write_run_with_depth(tmp_path, rng):
    """A run directory whose predicted depth is the ground truth times 0.5 with a known outlier pixel."""
    run_dir, depth_dir = tmp_path / "run", tmp_path / "seq"
    (run_dir / "predictions").mkdir(parents=True)
    (depth_dir / "depth").mkdir(parents=True)
    poses = random_walk_c2w(rng, 6)
    stamps = 10.0 + np.arange(6) / 30.0
    write_tum(run_dir / "trajectory_tum.txt", stamps, poses)
    write_tum(tmp_path / "gt.txt", stamps, poses)
    listing = []
    for index, stamp in enumerate(stamps):
        depth_m = rng.uniform(0.5, 4.0, size=(24, 32)).astype(np.float32)
        depth_m[0, :4] = 0.0  # no measurement
        depth_m[5, 5] = 4.5  # the farthest pixel, so doubling it below leaves the median where it was
        raw = np.round(depth_m * 5000).astype(np.uint16)
        name = f"depth/{stamp + 0.003:.6f}.png"
        cv2.imwrite(str(depth_dir / name), raw)
        listing.append(f"{stamp + 0.003:.6f} {name}")
        predicted = 0.5 * raw.astype(np.float32) / 5000
        predicted[5, 5] *= 2.0  # exactly 100 % off after scaling
        np.savez(
            run_dir / "predictions" / f"{index:06d}.npz", frame_index=index, timestamp=stamp, depth=predicted
        )
    (depth_dir / "depth.txt").write_text("# timestamp filename\n" + "\n".join(listing) + "\n")
    return run_dir, depth_dir


def test_evaluate_run_with_tum_depth(tmp_path):
    run_dir, depth_dir = write_run_with_depth(tmp_path, np.random.default_rng(5))
    result = evaluate_run(run_dir, tmp_path / "gt.txt", depth_dir=depth_dir)
    valid_pixels = 24 * 32 - 4
    # One pixel in each frame is off by a factor 2 (AbsRel 1, outside delta 1.25); the median is unaffected.
    assert result["depth_abs_rel"] == pytest.approx(1.0 / valid_pixels, rel=1e-5)
    assert result["depth_delta1"] == pytest.approx(1.0 - 1.0 / valid_pixels)
    assert result["depth_frames"] == 6
    written = json.loads((run_dir / "eval.json").read_text())
    assert written["depth_abs_rel"] == result["depth_abs_rel"]
    assert written["depth_delta1"] == result["depth_delta1"]


def test_eval_command_prints_the_table_and_writes_eval_json(tmp_path):
    from typer.testing import CliRunner

    from stream_recon.app.cli import app

    gt_file, _, _ = write_known_pair(tmp_path, np.random.default_rng(11), noise=0.01)
    result = CliRunner().invoke(app, ["eval", str(tmp_path), "--gt", str(gt_file), "--alignment", "se3"])
    assert result.exit_code == 0, result.output
    assert "ATE RMSE" in result.output and "AUC@30" in result.output
    written = json.loads((tmp_path / "eval.json").read_text())
    assert written["alignment"] == "se3" and written["scale"] == 1.0
    failed = CliRunner().invoke(app, ["eval", str(tmp_path), "--gt", str(tmp_path / "missing.txt")])
    assert failed.exit_code == 1
    assert "missing.txt does not exist" in " ".join(failed.output.split())
