"""A finished run's map over a real trajectory with drift, and query frames to place in it
(models/loops/localise.py's test bed).

The run is tests/loop_scenarios.py's chunked stream (make_scenario: each chunk in coordinates of its own,
odometry with ODOMETRY_NOISE, true loops fitted as the stream fits them) solved by the pose graph: the
run's world is the solved one, chunk k placed by solved[k], so a true point x of chunk k is at
run_from_truth[k](x) there (what the run's files hold; its drift between chunks is what the solve left).

No pictures: the scene is landmarks spread in front of the cameras along the path (`LANDMARKS_PER_SPAWN`
every `SPAWN_EVERY` frames, depths 0.5-1.5 x the trajectory's scene depth), each with a SIFT-like
descriptor of its own (uint8, 128) and a retrieval word. A camera sees the landmarks that project into
its 640 x 480 picture, keeps its `FEATURES` most salient ones (a landmark's salience is its own, as a
corner is as strong from any nearby view), each keypoint off by half a pixel and its descriptor by a few
grey levels, among `CLUTTER` features of nothing (a random descriptor at a random place). Its retrieval
descriptor is the sum of its landmarks' words. The point behind each keypoint is the landmark in the
view's world seen through loop_scenarios.observed (the depth model the loop covariance states), a fifth
of them unsure (NaN), as a model's confidence leaves them.

A map keyframe is every INDEX_SPACING-th frame, in its chunk's placement in the run's world; a query is
any frame, in a world of its own (its camera at the origin, at a random scale, as a model run on it
alone predicts it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from loop_scenarios import INDEX_SPACING, Trajectory, make_scenario, observed, without_false_loops

from stream_recon.models.loops.geometric_check import ImageFeatures
from stream_recon.models.loops.localise import QueryFrame
from stream_recon.models.loops.pose_graph import optimize
from stream_recon.models.loops.saved_map import MapKeyframe
from stream_recon.models.stream.similarity import Sim3

WIDTH, HEIGHT, FOCAL = 640, 480, 500.0
INTRINSICS = np.array([[FOCAL, 0, WIDTH / 2], [0, FOCAL, HEIGHT / 2], [0, 0, 1]])
SPAWN_EVERY, LANDMARKS_PER_SPAWN = 4, 60
FEATURES, CLUTTER = 300, 100
KEYPOINT_NOISE_PX = 0.5
DESCRIPTOR_NOISE = 6.0  # grey levels
WORD_DIM = 128
UNSURE_SHARE = 0.2


@dataclass(frozen=True)
class Landmarks:
    """The scene's landmarks, the most salient first (a view keeps the first it sees: most_salient_seen)."""

    points: np.ndarray  # [L, 3] in the true world
    descriptors: np.ndarray  # [L, 128] uint8
    salience: np.ndarray  # [L]
    words: np.ndarray  # [L, WORD_DIM]


def landmarks_along(truth: np.ndarray, scene_depth: float, rng: np.random.Generator) -> Landmarks:
    spawns = truth[::SPAWN_EVERY]
    count = len(spawns) * LANDMARKS_PER_SPAWN
    rays = np.stack([rng.uniform(-0.6, 0.6, count), rng.uniform(-0.45, 0.45, count), np.ones(count)], axis=1)
    camera = rays * rng.uniform(0.5, 1.5, (count, 1)) * scene_depth
    owner = np.repeat(np.arange(len(spawns)), LANDMARKS_PER_SPAWN)
    points = np.einsum("nij,nj->ni", spawns[owner, :3, :3], camera) + spawns[owner, :3, 3]
    descriptors, salience = rng.integers(0, 256, (count, 128)).astype(np.uint8), rng.uniform(size=count)
    words = rng.normal(size=(count, WORD_DIM))
    order = np.argsort(-salience)
    return Landmarks(points[order], descriptors[order], salience[order], words[order])


@dataclass(frozen=True)
class View:
    """What one camera makes of the landmarks: its features, the landmark behind each, its descriptor."""

    features: ImageFeatures
    landmark: np.ndarray  # [N] the landmark behind each keypoint, -1 for clutter
    descriptor: np.ndarray  # [WORD_DIM]


def most_salient_seen(c2w: np.ndarray, landmarks: Landmarks, scene_depth: float) -> tuple[np.ndarray, np.ndarray]:
    """The FEATURES most salient landmarks that project into the camera's picture, most salient first, and their
    pixels [N, 2]: the landmarks (most salient first) projected a block at a time until FEATURES are seen. A view of
    TUM fr2_desk sees 70 % of its 105,000 landmarks: projecting them all, then partitioning those seen by salience,
    took 3 ms a view, the first block takes a tenth of that."""
    w2c_rotation = c2w[:3, :3].T
    kept, pixels, found, start, block = [], [], 0, 0, 4096
    while found < FEATURES and start < len(landmarks.points):
        camera = (landmarks.points[start:start + block] - c2w[:3, 3]) @ w2c_rotation.T
        z = camera[:, 2]
        seen = (z > 0.2 * scene_depth) & (z < 2.5 * scene_depth)
        u = np.where(seen, FOCAL * camera[:, 0] / np.where(seen, z, 1) + WIDTH / 2, -1)
        v = np.where(seen, FOCAL * camera[:, 1] / np.where(seen, z, 1) + HEIGHT / 2, -1)
        seen &= (u >= 0) & (u < WIDTH) & (v >= 0) & (v < HEIGHT)
        kept.append(start + np.flatnonzero(seen))
        pixels.append(np.stack([u[seen], v[seen]], axis=1))
        found, start, block = found + len(kept[-1]), start + block, 4 * block
    return np.concatenate(kept)[:FEATURES], np.concatenate(pixels)[:FEATURES]


def view_of(c2w: np.ndarray, landmarks: Landmarks, scene_depth: float, rng: np.random.Generator) -> View:
    kept, seen_at = most_salient_seen(c2w, landmarks, scene_depth)
    pixels = seen_at + rng.normal(0, KEYPOINT_NOISE_PX, (len(kept), 2))
    descriptors = np.clip(landmarks.descriptors[kept] + rng.normal(0, DESCRIPTOR_NOISE, (len(kept), 128)), 0, 255)
    clutter_pixels = np.stack([rng.uniform(0, WIDTH, CLUTTER), rng.uniform(0, HEIGHT, CLUTTER)], axis=1)
    keypoints = np.concatenate([pixels, clutter_pixels]).astype(np.float32)
    all_descriptors = np.concatenate([descriptors, rng.integers(0, 256, (CLUTTER, 128))]).astype(np.uint8)
    word = landmarks.words[kept].sum(axis=0) if len(kept) else rng.normal(size=WORD_DIM)
    return View(ImageFeatures(keypoints, all_descriptors), np.concatenate([kept, np.full(CLUTTER, -1)]),
                word.astype(np.float32))


def points_of(view: View, landmarks: Landmarks, view_from_truth: Sim3, centre: np.ndarray,
              scene_depth: float, rng: np.random.Generator) -> tuple[np.ndarray, float]:
    """The point behind each keypoint in the view's world (NaN for clutter and the unsure fifth), and the
    view's median depth there."""
    behind = view.landmark >= 0
    out = np.full((len(view.landmark), 3), np.nan)
    if behind.any():
        seen = view_from_truth.apply_to_points(landmarks.points[view.landmark[behind]])
        out[behind] = observed(rng, seen, centre)
    out[rng.uniform(size=len(out)) < UNSURE_SHARE] = np.nan
    return out, scene_depth * view_from_truth.scale


@dataclass(frozen=True)
class MappedRun:
    truth: np.ndarray  # [N, 4, 4]
    landmarks: Landmarks
    keyframes: list[MapKeyframe]  # in the run's world
    run_from_truth: tuple[Sim3, ...]  # per chunk
    chunk_of: np.ndarray  # [N] each frame's (first) chunk


def mapped_run(trajectory: Trajectory, truth: np.ndarray, seed: int) -> MappedRun:
    scenario = make_scenario(truth, seed, revisit_radius=trajectory.revisit_radius,
                             false_min_distance=trajectory.false_min_distance, scene_depth=trajectory.scene_depth)
    solved = optimize(without_false_loops(scenario)).world_from_chunk
    run_from_truth = tuple(placed @ true.inverse() for placed, true in zip(solved, scenario.true_world_from_chunk,
                                                                            strict=True))
    chunk_of = np.zeros(len(truth), np.int64)
    for k, (start, end) in reversed(list(enumerate(scenario.ranges))):
        chunk_of[start:end] = k  # a frame two chunks share: the earlier one's (its first emission)
    rng = np.random.default_rng(seed + 1000)
    landmarks = landmarks_along(truth, trajectory.scene_depth, rng)
    keyframes = []
    for frame in range(0, len(truth), INDEX_SPACING):
        chunk = int(chunk_of[frame])
        move = run_from_truth[chunk]
        c2w = move.apply_to_poses(truth[frame])[:3]
        view = view_of(truth[frame], landmarks, trajectory.scene_depth, rng)
        points, median_depth = points_of(view, landmarks, move, c2w[:, 3], trajectory.scene_depth, rng)
        keyframes.append(MapKeyframe(frame, chunk, c2w, INTRINSICS, (HEIGHT, WIDTH), view.descriptor,
                                     view.features.keypoints, view.features.descriptors, points, median_depth))
    return MappedRun(truth, landmarks, keyframes, run_from_truth, chunk_of)


def query_at(c2w: np.ndarray, landmarks: Landmarks, scene_depth: float, rng: np.random.Generator) -> QueryFrame:
    """A query frame at the true pose `c2w`, in its own world: its camera at the origin at a random scale."""
    own_from_truth = Sim3(float(np.exp(rng.uniform(np.log(0.5), np.log(2.0)))), np.eye(3), np.zeros(3)) @ \
        Sim3(1.0, c2w[:3, :3], c2w[:3, 3]).inverse()
    view = view_of(c2w, landmarks, scene_depth, rng)
    points, median_depth = points_of(view, landmarks, own_from_truth, np.zeros(3), scene_depth, rng)
    return QueryFrame(view.descriptor, view.features, INTRINSICS, points, median_depth, np.eye(4)[:3])


def placement_error(run: MappedRun, frame: int, keyframe: int, c2w: np.ndarray) -> tuple[float, float]:
    """(rotation error in degrees, camera-centre error in the ground truth's units) of a query of `frame`
    placed at `c2w`, against where the run's world has it: its true pose through the chunk of the keyframe
    it was placed against (the run's world is one chunk's or another's, as far apart as the solve left them)."""
    move = run.run_from_truth[int(run.chunk_of[keyframe])]
    expected = move.apply_to_poses(run.truth[frame])
    turn = expected[:3, :3].T @ c2w[:3, :3]
    angle = float(np.degrees(np.arccos(np.clip((np.trace(turn) - 1) / 2, -1, 1))))
    return angle, float(np.linalg.norm(expected[:3, 3] - c2w[:3, 3])) / move.scale
