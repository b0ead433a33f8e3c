"""Evaluation against evo (the reference implementation, dev extra only) and hand computations."""

import copy
import json
import shutil

import cv2
import numpy as np
import pytest
from evo.core import metrics, sync
from evo.core.trajectory import PoseTrajectory3D
from evo.tools import file_interface
from evo_data import evo_data_dir
from hypothesis import given, settings
from hypothesis import strategies as st

from stream_recon.app.evaluation.metrics import (
    ERROR_METRICS,
    OPEN_CHAIN,
    STATISTICS,
    EvaluationError,
    Trajectory,
    associate_timestamps,
    depth_errors,
    evaluate_run,
    evaluate_trajectories,
    evaluation_path,
    match_ground_truth_to_prediction,
    pairwise_pose_errors,
    pose_auc,
    read_tum_trajectory,
    statistic_key,
    umeyama_alignment,
    write_evaluation,
)
from stream_recon.app.outputs.rundir import TRAJECTORY_OPEN_TUM, TRAJECTORY_TUM
from stream_recon.app.outputs.trajectories import read_tum, write_tum
from stream_recon.app.outputs.writers import RunWriter
from stream_recon.models.stream.pose import rotation_to_quat_xyzw
from stream_recon.models.stream.prediction import FRAME_KEY, FramePrediction


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


def evo_metrics(reference_traj, estimated_traj, *, correct_scale, max_diff=0.01):
    """What evo_ape / evo_rpe print with -a (-as when correct_scale), under eval.json's keys.

    The same steps as evo's command line: nearest-time sync with --t_max_diff, Umeyama alignment of the
    estimate, then APE (translation part) and RPE (translation part; angle_deg) with delta 1 frame.
    """
    reference_traj, estimated_traj = sync.associate_trajectories(
        reference_traj, estimated_traj, max_diff=max_diff
    )
    estimated_traj = copy.deepcopy(estimated_traj)
    rotation, translation, scale = estimated_traj.align(reference_traj, correct_scale=correct_scale)
    results = {
        "matched_poses": reference_traj.num_poses,
        "scale": scale,
        "rotation": rotation,
        "translation": translation,
    }
    evo_metric_objects = {
        "ate": metrics.APE(metrics.PoseRelation.translation_part),
        "rpe_trans": metrics.RPE(metrics.PoseRelation.translation_part, delta=1, delta_unit=metrics.Unit.frames),
        "rpe_rot": metrics.RPE(metrics.PoseRelation.rotation_angle_deg, delta=1, delta_unit=metrics.Unit.frames),
    }
    for metric, unit in ERROR_METRICS:
        evo_metric = evo_metric_objects[metric]
        evo_metric.process_data((reference_traj, estimated_traj))
        for statistic, value in evo_metric.get_all_statistics().items():
            results[statistic_key(metric, statistic, unit)] = value
    results["rpe_pairs"] = len(evo_metric_objects["rpe_trans"].error)
    return results


def assert_matches_evo(ours, theirs):
    """Every statistic evo prints, to 1e-6 (relative, or absolute for values below 1), and the pose count."""
    assert ours["matched_poses"] == theirs["matched_poses"]
    assert ours["rpe_pairs"] == theirs["rpe_pairs"]
    statistic_keys = [statistic_key(m, s, u) for m, u in ERROR_METRICS for s in STATISTICS]
    assert len(statistic_keys) == 21 and set(statistic_keys) <= theirs.keys()
    for key in [*statistic_keys, "scale"]:
        assert ours[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-6), key
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
    write_evaluation(ours, evaluation_path(tmp_path))
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


def evo_association(estimated_stamps, reference_stamps, max_diff):
    """evo's pairing, read back from trajectories whose x coordinate is each pose's index."""

    def indexed(stamps):
        count = len(stamps)
        positions = np.zeros((count, 3))
        positions[:, 0] = np.arange(count)
        quaternions = np.tile([1.0, 0.0, 0.0, 0.0], (count, 1))
        return PoseTrajectory3D(positions_xyz=positions, orientations_quat_wxyz=quaternions, timestamps=stamps)

    reference_synced, estimated_synced = sync.associate_trajectories(
        indexed(np.asarray(reference_stamps, dtype=np.float64)),
        indexed(np.asarray(estimated_stamps, dtype=np.float64)),
        max_diff=max_diff,
    )
    as_indices = lambda trajectory: trajectory.positions_xyz[:, 0].astype(int).tolist()  # noqa: E731
    return as_indices(estimated_synced), as_indices(reference_synced)


# Stamps on a 5 ms grid, so exact repeats and stamps halfway between two others occur often.
grid_stamps = st.lists(st.integers(0, 60).map(lambda k: 1305031102.0 + 0.005 * k), min_size=1, max_size=25)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    grid_stamps,
    grid_stamps,
    st.sampled_from([0.0, 0.005, 0.01, 0.02]) | st.floats(0, 0.1),
    st.booleans(),
    st.booleans(),
)
def test_association_equals_evo(estimated, reference, max_diff, sort_estimated, sort_reference):
    estimated = sorted(estimated) if sort_estimated else estimated
    reference = sorted(reference) if sort_reference else reference
    try:
        theirs = evo_association(estimated, reference, max_diff)
    except sync.SyncException:  # evo refuses to pair nothing; we return empty pairs
        theirs = ([], [])
    est_indices, ref_indices = associate_timestamps(np.array(estimated), np.array(reference), max_diff)
    assert (est_indices.tolist(), ref_indices.tolist()) == theirs


def test_the_shorter_trajectory_is_searched_and_may_share_a_neighbour():
    # Two estimates, three ground-truth poses: each estimate takes its nearest ground-truth stamp, and
    # both take the same one (0.005 is 5 and 6 ms away); 0.5 and 1.0 are nobody's nearest.
    est_indices, ref_indices = associate_timestamps(np.array([0.0, 0.011]), np.array([0.005, 0.5, 1.0]), 0.01)
    assert est_indices.tolist() == [0, 1] and ref_indices.tolist() == [0, 0]
    # Four estimates, two ground-truth poses: now the ground truth is searched, in its own order.
    est_indices, ref_indices = associate_timestamps(
        np.array([0.0, 0.004, 0.3, 0.6]), np.array([0.6, 0.003]), 0.01
    )
    assert est_indices.tolist() == [3, 1] and ref_indices.tolist() == [0, 1]


def test_equal_lengths_search_the_estimate_and_halfway_takes_the_earlier_stamp():
    # 0.5 lies exactly halfway between 0.25 and 0.75 (all exact in binary): the earlier one wins.
    est_indices, ref_indices = associate_timestamps(np.array([0.5, 2.0]), np.array([0.25, 0.75]), 0.25)
    assert est_indices.tolist() == [0] and ref_indices.tolist() == [0]
    # With as many poses on each side the estimate is the searched side: 0.0 and 0.004 both pick 0.003.
    est_indices, ref_indices = associate_timestamps(np.array([0.0, 0.004]), np.array([0.003, 0.5]), 0.01)
    assert est_indices.tolist() == [0, 1] and ref_indices.tolist() == [0, 0]


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
    write_evaluation(result, evaluation_path(run_dir))
    written = json.loads((run_dir / "eval.json").read_text())
    assert written["depth_abs_rel"] == result["depth_abs_rel"]
    assert written["depth_delta1"] == result["depth_delta1"]


def test_eval_command_prints_the_table_and_writes_eval_json(tmp_path):
    from typer.testing import CliRunner

    from stream_recon.app.cli import app

    gt_file, _, _ = write_known_pair(tmp_path, np.random.default_rng(11), noise=0.01)
    result = CliRunner().invoke(app, ["eval", str(tmp_path), "--gt", str(gt_file), "--alignment", "se3"])
    assert result.exit_code == 0, result.output
    assert "ATE (m)" in result.output and "RPE rot (deg)" in result.output and "AUC@30" in result.output
    written = json.loads((tmp_path / "eval.json").read_text())
    assert written["alignment"] == "se3" and written["scale"] == 1.0
    failed = CliRunner().invoke(app, ["eval", str(tmp_path), "--gt", str(tmp_path / "missing.txt")])
    assert failed.exit_code == 2  # bad input, as for every command
    assert "missing.txt does not exist" in " ".join(failed.output.split())


def test_a_run_killed_before_its_trajectory_file_is_evaluated_from_its_npz_files(tmp_path):
    # eval refused a killed run without trajectory_tum.txt although the poses are in the npz files
    from typer.testing import CliRunner

    from stream_recon.app.cli import app

    (tmp_path / "gt").mkdir()
    gt_file, est_file, _ = write_known_pair(tmp_path / "gt", np.random.default_rng(11), noise=0.01)
    stamps, c2w = read_tum(est_file)
    writer = RunWriter(tmp_path / "killed", {})
    for index, (stamp, pose) in enumerate(zip(stamps, c2w, strict=True)):
        writer.on_frame(FramePrediction(
            frame_index=index, timestamp=float(stamp), frame_type=FRAME_KEY, pose_enc=np.zeros(9, np.float32),
            c2w=pose[:3].astype(np.float32), intrinsics=np.eye(3, dtype=np.float32),
            depth=np.ones((2, 2), np.float32), depth_conf=np.full((2, 2), 5.0, np.float32),
        ), {})
    writer.flush()  # and never closed: no trajectory_tum.txt, run.json still says running
    assert not (tmp_path / "killed" / "trajectory_tum.txt").exists()

    result = CliRunner().invoke(app, ["eval", str(tmp_path / "killed"), "--gt", str(gt_file)])

    assert result.exit_code == 0, result.output
    from_files = json.loads((tmp_path / "killed" / "eval.json").read_text())
    (tmp_path / "finished" / "predictions").mkdir(parents=True)
    write_tum(tmp_path / "finished" / "trajectory_tum.txt", stamps, c2w)
    finished = evaluate_run(tmp_path / "finished", gt_file)
    assert from_files["matched_poses"] == finished["matched_poses"] == len(stamps)
    assert from_files["ate_rmse"] == pytest.approx(finished["ate_rmse"], rel=1e-5)  # float32 poses in the npz


@pytest.mark.parametrize("content", [bytes(range(256)) * 4, b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", b"1.0 0 0 0\x00"])
def test_eval_of_a_binary_ground_truth_file_is_one_line_and_exit_2(tmp_path, content):
    # `eval RUN --gt <a binary file>` must give one line and exit 2, not a UnicodeDecodeError traceback
    from typer.testing import CliRunner

    from stream_recon.app.cli import app

    write_known_pair(tmp_path, np.random.default_rng(11), noise=0.01)
    binary = tmp_path / "groundtruth.png"
    binary.write_bytes(content)
    result = CliRunner().invoke(app, ["eval", str(tmp_path), "--gt", str(binary)])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {binary} is not a text file"), result.output
    assert not (tmp_path / "eval.json").exists()


# --------------------------------------------------------------------------------------------------
# Real TUM trajectories (evo's own test data): equal to evo, statistic by statistic

# (ground truth, estimate, alignment): monocular keyframes need Sim(3) (evo -as), RGB-D SLAM is metric (-a).
REAL_PAIRS = [
    ("freiburg1_xyz-rgbdslam.txt", "freiburg1_xyz-ORB_kf_mono.txt", "sim3"),  # printed by evo_ape: below
    ("freiburg1_xyz-groundtruth.txt", "freiburg1_xyz-ORB_kf_mono.txt", "sim3"),
    ("fr2_desk_groundtruth.txt", "fr2_desk_ORB_kf_mono.txt", "sim3"),
    ("freiburg1_xyz-groundtruth.txt", "freiburg1_xyz-rgbdslam.txt", "se3"),
    ("fr2_desk_groundtruth.txt", "fr2_desk_ORB.txt", "se3"),
    # The estimate has more poses than the ground truth, so the ground truth is the searched side.
    ("freiburg1_xyz-ORB_kf_mono.txt", "freiburg1_xyz-rgbdslam.txt", "sim3"),
]


@pytest.fixture(scope="module")
def evo_data():
    return evo_data_dir()


def evo_on_files(gt_file, est_file, alignment, max_diff=0.01):
    return evo_metrics(
        file_interface.read_tum_trajectory_file(str(gt_file)),
        file_interface.read_tum_trajectory_file(str(est_file)),
        correct_scale=alignment == "sim3",
        max_diff=max_diff,
    )


@pytest.mark.parametrize(("gt_name", "est_name", "alignment"), REAL_PAIRS)
@pytest.mark.slow
def test_real_trajectories_equal_evo(evo_data, gt_name, est_name, alignment):
    gt_file, est_file = evo_data / gt_name, evo_data / est_name
    ours = evaluate_trajectories(read_tum_trajectory(est_file), read_tum_trajectory(gt_file), alignment=alignment)
    assert ours["max_diff"] == 0.01
    assert_matches_evo(ours, evo_on_files(gt_file, est_file, alignment))


def test_rgbdslam_against_orb_keyframes_gives_evos_published_numbers(evo_data):
    # What `evo_ape tum freiburg1_xyz-rgbdslam.txt freiburg1_xyz-ORB_kf_mono.txt -as` prints.
    ours = evaluate_trajectories(
        read_tum_trajectory(evo_data / "freiburg1_xyz-ORB_kf_mono.txt"),
        read_tum_trajectory(evo_data / "freiburg1_xyz-rgbdslam.txt"),
    )
    assert ours["matched_poses"] == 29 and ours["estimated_poses"] == 32
    assert f"{ours['ate_rmse']:.6f}" == "0.014075"


@pytest.mark.parametrize("max_diff", [0.003, 0.005, 0.02, 0.1])
@pytest.mark.slow
def test_max_diff_changes_the_pairing_as_in_evo(evo_data, max_diff):
    gt_file, est_file = evo_data / "fr2_desk_groundtruth.txt", evo_data / "fr2_desk_ORB_kf_mono.txt"
    ours = evaluate_trajectories(
        read_tum_trajectory(est_file), read_tum_trajectory(gt_file), alignment="sim3", max_diff=max_diff
    )
    assert ours["max_diff"] == max_diff
    assert_matches_evo(ours, evo_on_files(gt_file, est_file, "sim3", max_diff))


def write_run_of_trajectory(run_dir, trajectory):
    """A run directory, written by the project's RunWriter, whose frames carry a real trajectory."""
    writer = RunWriter(run_dir, {"source": "real TUM trajectory"}, background=False)
    intrinsics = np.array([[2.0, 0.0, 0.5], [0.0, 2.0, 0.5], [0.0, 0.0, 1.0]], dtype=np.float32)
    for index, (timestamp, c2w) in enumerate(zip(trajectory.timestamps, trajectory.c2w, strict=True)):
        qx, qy, qz, qw = rotation_to_quat_xyzw(c2w[:3, :3])
        frame = FramePrediction(
            frame_index=index,
            timestamp=float(timestamp),
            frame_type=FRAME_KEY,
            pose_enc=np.array([*c2w[:3, 3], qx, qy, qz, qw, 1.0, 1.0], dtype=np.float32),
            c2w=c2w[:3].astype(np.float32),
            intrinsics=intrinsics,
            depth=np.ones((2, 2), dtype=np.float32),
            depth_conf=np.full((2, 2), 5.0, dtype=np.float32),
        )
        writer.on_frame(frame, {})
    writer.close("complete")


@pytest.mark.parametrize(
    ("gt_name", "est_name", "alignment"),
    [REAL_PAIRS[0], ("freiburg1_xyz-groundtruth.txt", "freiburg1_xyz-rgbdslam.txt", "se3")],
)
@pytest.mark.slow
def test_eval_command_on_a_run_of_a_real_trajectory_equals_evo(tmp_path, evo_data, gt_name, est_name, alignment):
    from typer.testing import CliRunner

    from stream_recon.app.cli import app

    gt_file, est_file = evo_data / gt_name, evo_data / est_name
    run_dir = tmp_path / "run"
    write_run_of_trajectory(run_dir, read_tum_trajectory(est_file))
    result = CliRunner().invoke(app, ["eval", str(run_dir), "--gt", str(gt_file), "--alignment", alignment])
    assert result.exit_code == 0, result.output
    written = json.loads((run_dir / "eval.json").read_text())
    assert written["max_diff"] == 0.01 and written["alignment"] == alignment
    # The run stores poses in float32, so evo is run on the trajectory the run wrote; the timestamps
    # survive unchanged, so the pairing is the one of the original files.
    assert_matches_evo(written, evo_on_files(gt_file, run_dir / "trajectory_tum.txt", alignment))
    assert written["matched_poses"] == evo_on_files(gt_file, est_file, alignment)["matched_poses"]


# --------------------------------------------------------------------------------------------------
# A run that loop closure corrected: its open chain is scored beside it

# What eval.json holds for a trajectory without depth: the keys older readers know, and nothing else.
TRAJECTORY_KEYS = {
    "run_dir", "gt_file", "alignment", "scale", "rotation", "translation", "max_diff", "matched_poses",
    "estimated_poses", "gt_poses", "rpe_pairs", "auc_5", "auc_15", "auc_30",
    *(statistic_key(metric, statistic, unit) for metric, unit in ERROR_METRICS for statistic in STATISTICS),
}


def drifted(c2w, metres_per_pose):
    """The poses with a drift that grows along the trajectory, as an open chain of chunks accumulates."""
    moved = c2w.copy()
    moved[:, :3, 3] += np.arange(len(c2w))[:, None] * np.array([metres_per_pose, 0.0, 0.5 * metres_per_pose])
    return moved


def run_dir_holding(run_dir, trajectory_file):
    """A run directory whose only trajectory is a copy of this file, byte for byte."""
    run_dir.mkdir()
    shutil.copyfile(trajectory_file, run_dir / TRAJECTORY_TUM)
    return run_dir


def trajectory_metrics(result):
    return {key: value for key, value in result.items() if key not in ("run_dir", "gt_file")}


def test_a_corrected_run_is_scored_beside_its_open_chain(tmp_path):
    from typer.testing import CliRunner

    from stream_recon.app.cli import app

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    gt_file, est_file, _ = write_known_pair(run_dir, np.random.default_rng(13), noise=0.005)
    stamps, corrected = read_tum(est_file)
    open_chain = drifted(corrected, metres_per_pose=0.01)
    write_tum(run_dir / TRAJECTORY_OPEN_TUM, stamps, open_chain)

    result = CliRunner().invoke(app, ["eval", str(run_dir), "--gt", str(gt_file), "--max-diff", "0.02"])

    assert result.exit_code == 0, result.output
    written = json.loads((run_dir / "eval.json").read_text())
    corrected_alone = evaluate_run(run_dir_holding(tmp_path / "corrected", est_file), gt_file, max_diff=0.02)
    open_alone = evaluate_run(run_dir_holding(tmp_path / "open", run_dir / TRAJECTORY_OPEN_TUM), gt_file, max_diff=0.02)
    assert set(written) == TRAJECTORY_KEYS | {OPEN_CHAIN}
    assert trajectory_metrics(written) == {**json.loads(json.dumps(trajectory_metrics(corrected_alone))),
                                           OPEN_CHAIN: json.loads(json.dumps(trajectory_metrics(open_alone)))}
    assert written[OPEN_CHAIN]["max_diff"] == 0.02 and written[OPEN_CHAIN]["alignment"] == "sim3"
    assert written["ate_rmse"] < 0.1 * written[OPEN_CHAIN]["ate_rmse"]
    comparison = result.output.split("ATE (m): corrected vs open chain")[1]
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in comparison.splitlines() if "│" in line]
    assert "┃ statistic ┃ corrected ┃ open chain ┃" in comparison
    assert rows[0] == ["rmse", f"{written['ate_rmse']:.6f}", f"{written[OPEN_CHAIN]['ate_rmse']:.6f}"]


def test_a_run_without_an_open_chain_keeps_eval_json_as_it_was(tmp_path):
    from typer.testing import CliRunner

    from stream_recon.app.cli import app

    gt_file, _, _ = write_known_pair(tmp_path, np.random.default_rng(13), noise=0.005)

    result = CliRunner().invoke(app, ["eval", str(tmp_path), "--gt", str(gt_file)])

    assert result.exit_code == 0, result.output
    written = json.loads((tmp_path / "eval.json").read_text())
    assert set(written) == TRAJECTORY_KEYS  # no "open_chain" key at all
    assert written == json.loads(json.dumps(evaluate_run(tmp_path, gt_file)))
    assert "open chain" not in result.output


def test_an_unreadable_open_chain_is_bad_input_naming_the_file(tmp_path):
    from typer.testing import CliRunner

    from stream_recon.app.cli import app

    gt_file, _, _ = write_known_pair(tmp_path, np.random.default_rng(13), noise=0.005)
    (tmp_path / TRAJECTORY_OPEN_TUM).write_text("1.0 0 0 0 0 0 0\n")

    result = CliRunner().invoke(app, ["eval", str(tmp_path), "--gt", str(gt_file)])

    assert result.exit_code == 2, result.output
    assert f"{tmp_path / TRAJECTORY_OPEN_TUM}, line 1: expected 8 values" in " ".join(result.output.split())
    assert not (tmp_path / "eval.json").exists()
