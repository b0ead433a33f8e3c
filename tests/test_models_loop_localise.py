"""Query frames placed in a finished run's map (models/loops/localise.py), on maps of real trajectories with
drift (tests/localise_scenarios.py over tests/loop_scenarios.py's chunked streams, several seeds).

A query of the trajectory is placed, and within the loop noise: the errors loop closure declares of one fit
(LoopClosureConfig's keyframe sigmas: each of the two frames' depth scale and orientation), at three sigmas.
A query of another trajectory is not placed, even when retrieval hands every one of them the map's nearest
keyframes (its threshold off): the geometric check and the 3D agreement refuse them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest
from evo_data import evo_data_dir
from localise_scenarios import MappedRun, landmarks_along, mapped_run, placement_error, query_at
from loop_scenarios import LOOP_CONFIG, TRAJECTORIES

from stream_recon.models.loops.geometric_check import ImageFeatures
from stream_recon.models.loops.localise import (
    LOOK_ALIKE,
    NOT_RETRIEVED,
    PLACED,
    POINTS_DISAGREE,
    LocaliseConfig,
    MapLocaliser,
    QueryFrame,
    keyframe_in_world,
    keyframe_moved,
)
from stream_recon.models.loops.saved_map import MapKeyframe
from stream_recon.models.stream.similarity import Sim3

SEEDS = range(3)
QUERIES = 60  # a seed's queries of each kind
# A fit's rotation is off by both frames' orientation errors (3 axes each); its camera centre by that turn
# and both depth scales, over the scene's depth: three sigmas of each.
ROTATION_BOUND_DEG = float(np.degrees(3 * np.sqrt(6) * LOOP_CONFIG.keyframe_rotation_sigma))
POSITION_BOUND = 3 * (np.sqrt(2) * LOOP_CONFIG.keyframe_depth_scale_sigma + np.sqrt(6) * LOOP_CONFIG.keyframe_rotation_sigma)
# queries of another trajectory, which the map is not of
OTHER = {"KITTI 00": "TUM fr2_desk", "TUM fr2_desk": "EuRoC V1_02", "EuRoC V1_02": "KITTI 00",
         "TUM fr1_xyz": "KITTI 00"}


@pytest.fixture(scope="module")
def run_of() -> Callable[[str, int], MappedRun]:
    """A trajectory's mapped run for a seed, made once for the module's tests: mapped_run draws from its seed
    alone, and three tests read each seed's (TUM fr2_desk's takes 2.5 s)."""
    made: dict[tuple[str, int], MappedRun] = {}

    def run(name: str, seed: int) -> MappedRun:
        if (name, seed) not in made:
            trajectory = TRAJECTORIES[name]
            made[name, seed] = mapped_run(trajectory, trajectory.poses(evo_data_dir()), seed)
        return made[name, seed]

    return run


def any_retrieved() -> LocaliseConfig:
    config = LocaliseConfig()
    retrieval = replace(config.closure.detection.retrieval, min_similarity=-1.0)
    return replace(config, closure=replace(config.closure, detection=replace(config.closure.detection,
                                                                               retrieval=retrieval)))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["KITTI 00", "TUM fr2_desk", "EuRoC V1_02"])
def test_frames_of_the_trajectory_are_placed_within_the_loop_noise(name: str, run_of) -> None:
    trajectory = TRAJECTORIES[name]
    truth = trajectory.poses(evo_data_dir())
    placed, errors = 0, []
    for seed in SEEDS:
        run = run_of(name, seed)
        localiser = MapLocaliser(run.keyframes)
        rng = np.random.default_rng(seed + 2000)
        for frame in rng.choice(len(truth), QUERIES, replace=False):
            verdict = localiser.place(query_at(truth[frame], run.landmarks, trajectory.scene_depth, rng))
            if verdict.placed:
                assert verdict.reason == PLACED and verdict.c2w.shape == (3, 4)
                placed += 1
                errors.append(placement_error(run, int(frame), verdict.keyframe, verdict.c2w))
    total = len(SEEDS) * QUERIES
    assert placed >= 0.95 * total, (placed, total)
    rotation, position = np.array(errors).T
    position = position / trajectory.scene_depth
    within = (rotation <= ROTATION_BOUND_DEG) & (position <= POSITION_BOUND)
    assert within.mean() >= 0.99, (np.percentile(rotation, [50, 99, 100]), np.percentile(position, [50, 99, 100]))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["KITTI 00", "TUM fr2_desk", "EuRoC V1_02"])
def test_frames_of_another_trajectory_are_not_placed(name: str, run_of) -> None:
    other = TRAJECTORIES[OTHER[name]]
    elsewhere = other.poses(evo_data_dir())
    refused, reasons = 0, set()
    for seed in SEEDS:
        run = run_of(name, seed)
        localiser = MapLocaliser(run.keyframes, any_retrieved())
        rng = np.random.default_rng(seed + 3000)
        landmarks = landmarks_along(elsewhere, other.scene_depth, rng)
        for frame in rng.choice(len(elsewhere), QUERIES, replace=False):
            verdict = localiser.place(query_at(elsewhere[frame], landmarks, other.scene_depth, rng))
            refused += not verdict.placed
            reasons.add(verdict.reason)
            assert verdict.placed or (verdict.c2w is None and verdict.retrieved > 0)
    assert refused >= 0.99 * len(SEEDS) * QUERIES, (refused, reasons)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["KITTI 00", "TUM fr2_desk", "EuRoC V1_02"])
def test_a_picture_of_a_place_is_not_the_place(name: str, run_of) -> None:
    """A query that sees every feature as a keyframe of the map does, pixel for pixel, but on a plane at the
    keyframe's median depth (a poster of the place): retrieval and the geometric check pass it, the 3D
    agreement does not."""
    run = run_of(name, 0)
    localiser = MapLocaliser(run.keyframes)
    rng = np.random.default_rng(4000)
    reasons = []
    for keyframe in run.keyframes:
        keypoints = keyframe.keypoints + rng.normal(0, 0.5, keyframe.keypoints.shape).astype(np.float32)
        rays = np.linalg.solve(keyframe.intrinsics, np.concatenate([keypoints, np.ones((len(keypoints), 1))], 1).T).T
        poster = rays / rays[:, 2:] * keyframe.median_depth
        poster[~np.isfinite(keyframe.points).all(axis=1)] = np.nan
        query = QueryFrame(keyframe.descriptor, ImageFeatures(keypoints, keyframe.descriptors), keyframe.intrinsics,
                           poster, keyframe.median_depth, np.eye(4)[:3])
        reasons.append(localiser.place(query).reason)
    assert reasons.count(POINTS_DISAGREE) >= 0.99 * len(reasons), sorted(set(reasons))


def test_a_place_the_map_holds_twice_is_a_look_alike_and_an_unknown_one_is_not_retrieved(run_of) -> None:
    """The map's keyframes around one place copied a hundred scene depths away (a second building of the
    same make): a query there verifies against both copies and is not placed; a query whose retrieval
    descriptor matches nothing of the map gets no candidate."""
    trajectory = TRAJECTORIES["EuRoC V1_02"]
    run = run_of("EuRoC V1_02", 0)
    truth = run.truth
    rng = np.random.default_rng(7)
    query = query_at(truth[400], run.landmarks, trajectory.scene_depth, rng)
    assert MapLocaliser(run.keyframes).place(query).placed
    away = Sim3(1.0, np.eye(3), np.array([100.0 * trajectory.scene_depth, 0.0, 0.0]))
    copies = [replace(keyframe_moved(keyframe, away), frame_index=keyframe.frame_index + 100_000)
              for keyframe in run.keyframes if abs(keyframe.frame_index - 400) <= 32]
    verdict = MapLocaliser(run.keyframes + copies).place(query)
    assert not verdict.placed and verdict.reason.startswith(LOOK_ALIKE) and verdict.c2w is None
    unrelated = replace(query, descriptor=-np.asarray(query.descriptor))
    assert MapLocaliser(run.keyframes).place(unrelated).reason == NOT_RETRIEVED


def test_a_keyframe_is_carried_into_the_world_its_run_files_show() -> None:
    """A run's files moved by a Sim(3) (a solve, a refine: the pose moved, the depth scaled): the keyframe's
    pose there and its depth's median give back that Sim(3), points and all; no confident depth, no keyframe."""
    rng = np.random.default_rng(1)
    c2w = np.eye(4)[:3]
    c2w[:, 3] = rng.normal(size=3)
    keyframe = MapKeyframe(16, 1, c2w, np.eye(3), (48, 64), rng.normal(size=128).astype(np.float32),
                           np.zeros((30, 2), np.float32), np.zeros((30, 128), np.uint8), rng.normal(size=(30, 3)), 2.5)
    move = Sim3(1.7, np.linalg.qr(rng.normal(size=(3, 3)))[0], rng.normal(size=3))
    if np.linalg.det(move.rotation) < 0:
        move = Sim3(move.scale, -move.rotation, move.translation)
    carried = keyframe_in_world(keyframe, move.apply_to_poses(keyframe.c2w), keyframe.median_depth * move.scale)
    expected = keyframe_moved(keyframe, move)
    np.testing.assert_allclose(carried.points, expected.points, atol=1e-9)
    np.testing.assert_allclose(carried.c2w, expected.c2w, atol=1e-9)
    assert carried.median_depth == pytest.approx(expected.median_depth)
    assert keyframe_in_world(keyframe, keyframe.c2w, float("nan")) is None
