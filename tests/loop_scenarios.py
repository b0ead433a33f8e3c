"""A chunked stream over a real ground-truth trajectory, with drift, true loops and false loops.

The pose graph's test bed (tests/test_models_pose_graph.py and scripts/bench_pose_graph.py): the trajectory
is cut into chunks as the engine cuts a stream (320 frames, 16 shared with the previous chunk); each chunk
sees its frames in coordinates of its own (its first camera, at a scale of its own, as a model's chunk
does); odometry edges are the true chunk-to-chunk Sim(3) with noise drawn from the sigmas they declare,
so the open chain drifts; loop edges join chunks that really revisit a place (from the ground truth), and
false loops claim that two places far apart are one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gtsam
import numpy as np

from stream_recon.app.rundir import read_tum
from stream_recon.models.loops.pose_graph import LoopEdge, OdometryEdge, PoseGraph, from_gtsam
from stream_recon.models.stream.similarity import Sim3, umeyama

CHUNK_FRAMES = 320  # the engine's window
OVERLAP_FRAMES = 16  # frames a chunk shares with the previous one


def read_kitti_poses(path: Path) -> np.ndarray:
    """KITTI odometry poses (12 numbers a line, a row-major [3, 4] camera-to-world) -> c2w [N, 4, 4]."""
    rows = np.loadtxt(path, dtype=np.float64).reshape(-1, 3, 4)
    c2w = np.tile(np.eye(4), (len(rows), 1, 1))
    c2w[:, :3, :] = rows
    return c2w


def read_tum_poses(path: Path) -> np.ndarray:
    return read_tum(path)[1]


def chunk_ranges(num_frames: int, size: int = CHUNK_FRAMES, overlap: int = OVERLAP_FRAMES) -> list[tuple[int, int]]:
    """[start, end) of each chunk; the last one ends at the last frame and has frames of its own."""
    stride = size - overlap
    return [(start, min(start + size, num_frames)) for start in range(0, num_frames - overlap, stride)]


@dataclass(frozen=True)
class Noise:
    """Standard deviations of an edge's error: rotation angle (deg, all axes together), log scale, and
    translation as a fraction of the later chunk's path length (all axes together)."""

    rotation_deg: float
    log_scale: float
    translation_fraction: float

    def sigmas(self, path_length: float) -> np.ndarray:
        """[7] per component, in the pose graph's order (rotation, translation, log scale)."""
        per_axis = 1 / np.sqrt(3)
        rotation = np.full(3, np.radians(self.rotation_deg) * per_axis)
        translation = np.full(3, self.translation_fraction * path_length * per_axis)
        return np.concatenate([rotation, translation, [self.log_scale]])


ODOMETRY_NOISE = Noise(rotation_deg=1.0, log_scale=0.02, translation_fraction=0.01)  # the brief's drift per chunk
LOOP_NOISE = Noise(rotation_deg=0.25, log_scale=0.005, translation_fraction=0.0025)  # a quarter of it


def perturbed(transform: Sim3, sigmas: np.ndarray, rng: np.random.Generator) -> Sim3:
    """transform @ Exp(e), e ~ N(0, diag(sigmas^2)) in the pose graph's tangent: what its edges' sigmas mean."""
    return transform @ from_gtsam(gtsam.Similarity3.Expmap(rng.normal(0.0, sigmas)))


def rigid(c2w: np.ndarray) -> Sim3:
    return Sim3(1.0, c2w[:3, :3], c2w[:3, 3])


@dataclass(frozen=True)
class Scenario:
    truth: np.ndarray  # [N, 4, 4] ground-truth c2w
    ranges: tuple[tuple[int, int], ...]  # each chunk's [start, end)
    true_world_from_chunk: tuple[Sim3, ...]
    graph: PoseGraph
    true_loops: frozenset[str]  # loop ids
    false_loops: frozenset[str]

    def chunk_poses(self, k: int) -> np.ndarray:
        """Chunk k's frames in its own coordinates [n, 4, 4] (what its model would predict, exactly)."""
        start, end = self.ranges[k]
        return self.true_world_from_chunk[k].inverse().apply_to_poses(self.truth[start:end])

    def path_length(self, k: int) -> float:
        """Chunk k's path in its own units."""
        return float(np.linalg.norm(np.diff(self.chunk_poses(k)[:, :3, 3], axis=0), axis=1).sum())

    def positions(self, world_from_chunk: tuple[Sim3, ...]) -> np.ndarray:
        """[N, 3] camera centres: each frame through its chunk's world_from_chunk, the later chunk's where two
        chunks share a frame (as the engine emits them)."""
        out = np.empty((len(self.truth), 3))
        for k, (start, end) in enumerate(self.ranges):
            out[start:end] = world_from_chunk[k].apply_to_points(self.chunk_poses(k)[:, :3, 3])
        return out

    def ate(self, world_from_chunk: tuple[Sim3, ...]) -> float:
        """Sim(3) ATE: the positions aligned onto the ground truth by Umeyama, RMSE in ground-truth units."""
        positions, truth = self.positions(world_from_chunk), self.truth[:, :3, 3]
        aligned = umeyama(positions, truth, with_scale=True).apply_to_points(positions)
        return float(np.sqrt(np.mean(np.sum((aligned - truth) ** 2, axis=1))))


def revisits(truth: np.ndarray, ranges: list[tuple[int, int]], radius: float) -> dict[tuple[int, int], tuple[int, int]]:
    """Non-adjacent chunk pairs (a < b - 1) with a frame of each within `radius` of each other -> the
    closest such frame pair (a's frame, b's frame)."""
    positions = truth[:, :3, 3]
    found = {}
    for a, (start_a, end_a) in enumerate(ranges):
        for b in range(a + 2, len(ranges)):
            start_b, end_b = ranges[b]
            distances = np.linalg.norm(positions[start_a:end_a, None] - positions[None, start_b:end_b], axis=2)
            i, j = np.unravel_index(np.argmin(distances), distances.shape)
            if distances[i, j] <= radius:
                found[(a, b)] = (start_a + int(i), start_b + int(j))
    return found


def _false_loop(truth: np.ndarray, ranges: list[tuple[int, int]], world_from_chunk: tuple[Sim3, ...],
                pair: tuple[int, int], min_distance: float, rng: np.random.Generator) -> Sim3:
    """a_from_b that takes a random frame of b onto a random frame of a at least `min_distance` away,
    as a place recognised wrongly would: both cameras put at one place with one orientation."""
    a, b = pair
    positions = truth[:, :3, 3]
    for _ in range(1000):
        frame_a, frame_b = rng.integers(*ranges[a]), rng.integers(*ranges[b])
        if np.linalg.norm(positions[frame_a] - positions[frame_b]) >= min_distance:
            a_from_camera = world_from_chunk[a].inverse() @ rigid(truth[frame_a])
            b_from_camera = world_from_chunk[b].inverse() @ rigid(truth[frame_b])
            return a_from_camera @ b_from_camera.inverse()
    raise ValueError(f"chunks {a} and {b} have no frames {min_distance} apart")


def _subtle_false_loop(world_from_chunk: tuple[Sim3, ...], pair: tuple[int, int], offset: tuple[float, float],
                       rng: np.random.Generator) -> Sim3:
    """a_from_b of a revisited pair, wrong by a shift of the place (ground-truth units, uniform in `offset`,
    any direction): a loop whose depths were off by that much, clean in every other way."""
    a, b = pair
    direction = rng.normal(size=3)
    shift = direction / np.linalg.norm(direction) * rng.uniform(*offset) / world_from_chunk[b].scale
    return world_from_chunk[a].inverse() @ world_from_chunk[b] @ Sim3(1.0, np.eye(3), shift)


def make_scenario(truth: np.ndarray, seed: int, *, revisit_radius: float, false_min_distance: float,
                  false_fraction: float = 0.2, false_loops: int | None = None,
                  with_true_loops: bool = True, subtle_false: tuple[float, float] | None = None,
                  repeats: int = 1) -> Scenario:
    """The chunked stream over `truth`: odometry with ODOMETRY_NOISE, a loop with LOOP_NOISE at every
    revisit (within `revisit_radius`), and false loops: `false_fraction` of all loops (or `false_loops`
    of them) on non-adjacent chunk pairs that are not revisits (any non-adjacent pair if all are). With
    `subtle_false` (a shift range in ground-truth units) the false loops are revisited pairs instead, their
    true a_from_b shifted by that much (`_subtle_false_loop`), in groups of `repeats` on one pair with one
    shift: one wrong place recognised on consecutive keyframes, so that the group agrees with itself."""
    rng = np.random.default_rng(seed)
    ranges = chunk_ranges(len(truth))
    # Each chunk's coordinates: its first camera, at a scale of its own (a model's depth normalisation).
    world_from_chunk = tuple(Sim3(float(np.exp(rng.uniform(np.log(0.5), np.log(2.0)))), truth[start, :3, :3],
                                  truth[start, :3, 3]) for start, _ in ranges)
    scenario = Scenario(truth, tuple(ranges), world_from_chunk, PoseGraph(), frozenset(), frozenset())
    graph = PoseGraph()
    for k in range(len(ranges) - 1):
        sigmas = ODOMETRY_NOISE.sigmas(scenario.path_length(k + 1))
        exact = world_from_chunk[k].inverse() @ world_from_chunk[k + 1]
        graph = graph.with_odometry(OdometryEdge(perturbed(exact, sigmas, rng), sigmas))
    revisited = revisits(truth, ranges, revisit_radius) if with_true_loops else {}
    true_ids = []
    for (a, b), frames in revisited.items():
        sigmas = LOOP_NOISE.sigmas(scenario.path_length(b))
        exact = world_from_chunk[a].inverse() @ world_from_chunk[b]
        true_ids.append(f"true-{a}-{b}")
        graph = graph.with_loop(LoopEdge(true_ids[-1], a, b, perturbed(exact, sigmas, rng), sigmas,
                                         {"frames": frames}))
    candidates = [(a, b) for a in range(len(ranges)) for b in range(a + 2, len(ranges))]
    candidates = [pair for pair in candidates if pair not in revisited] or candidates
    if subtle_false is not None:
        candidates = list(revisits(truth, ranges, revisit_radius))
    if false_loops is None:
        false_loops = max(1, round(len(true_ids) * false_fraction / (1 - false_fraction)))
    false_ids = []
    groups = -(-false_loops // repeats)
    for n in rng.choice(len(candidates), groups, replace=groups > len(candidates)):
        a, b = candidates[n]
        sigmas = LOOP_NOISE.sigmas(scenario.path_length(b))
        if subtle_false is None:
            wrong = _false_loop(truth, ranges, world_from_chunk, (a, b), false_min_distance, rng)
        else:
            wrong = _subtle_false_loop(world_from_chunk, (a, b), subtle_false, rng)
        for _ in range(repeats):
            false_ids.append(f"false-{a}-{b}-{len(false_ids)}")
            graph = graph.with_loop(LoopEdge(false_ids[-1], a, b, perturbed(wrong, sigmas, rng), sigmas))
    return Scenario(truth, tuple(ranges), world_from_chunk, graph, frozenset(true_ids), frozenset(false_ids))
