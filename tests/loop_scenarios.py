"""A chunked stream over a real ground-truth trajectory, with drift, true loops and false loops.

The pose graph's test bed (tests/test_models_pose_graph.py and scripts/bench_pose_graph.py): the trajectory
is cut into chunks as the engine cuts a stream (320 frames, 16 shared with the previous chunk); each chunk
sees its frames in coordinates of its own (its first camera, at a scale of its own, as a model's chunk
does); odometry edges are the true chunk-to-chunk Sim(3) with noise drawn from the sigmas they declare,
so the open chain drifts; loop edges join chunks that really revisit a place (from the ground truth), and
false loops claim that two places far apart are one.

A loop edge is made as the stream makes one (models/loops/closer.py): two keyframes' points, each seen
through the depth model that `loop_covariance` states (per point 0.5 % of the depth along the ray and 0.2 %
across it; per keyframe its whole depth map scaled by ~2 % and its orientation off by what
the loop covariance declares), placed
in the open chain's world, fitted by `align_loop` and turned into an edge with the fit's own covariance by
`loop_edge`. A revisit gives up to `keyframe_pairs` independent keyframe pairs (query keyframes
INDEX_SPACING frames apart, as the stream indexes them); a false loop is a fit as clean as a true one,
of points that the query saw elsewhere.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gtsam
import numpy as np

from stream_recon.app.outputs.trajectories import read_tum
from stream_recon.models.loops.closer import (
    LoopClosureConfig,
    _KeyframePoints,
    _rotation_about,
    align_loop,
    loop_edge,
)
from stream_recon.models.loops.gtsam_sim3 import from_gtsam
from stream_recon.models.loops.pose_graph import PoseGraphSolver, optimize
from stream_recon.models.loops.pose_graph_data import (
    LoopEdge,
    OdometryEdge,
    PoseGraph,
    PoseGraphSettings,
    open_chain,
)
from stream_recon.models.loops.refine import (
    FrameLoop,
    RefineConfig,
    RunFrame,
    fine_graph,
    frame_moves,
    segments_of,
    solve_fine,
    with_stream_loops,
)
from stream_recon.models.stream.similarity import Sim3, scaling_direction, umeyama

CHUNK_FRAMES = 320  # the engine's window
OVERLAP_FRAMES = 16  # frames a chunk shares with the previous one


def with_odometry(graph: PoseGraph, edge: OdometryEdge) -> PoseGraph:
    """The graph with one more chunk, hung on its last one."""
    return PoseGraph((*graph.odometry, edge), graph.loops)


def with_loop(graph: PoseGraph, edge: LoopEdge) -> PoseGraph:
    return PoseGraph(graph.odometry, (*graph.loops, edge))


def pair_consistency(graph: PoseGraph) -> np.ndarray:
    """[L, L] bool: which of `graph`'s loops a solver finds pairwise consistent (the diagonal True)."""
    solver = PoseGraphSolver()
    solver._take_odometry(graph.odometry)
    loops = solver._take_loops(graph.loops)
    return solver._consistent_pairs[np.ix_(loops, loops)]


def read_kitti_poses(path: Path) -> np.ndarray:
    """KITTI odometry poses (12 numbers a line, a row-major [3, 4] camera-to-world) -> c2w [N, 4, 4]."""
    rows = np.loadtxt(path, dtype=np.float64).reshape(-1, 3, 4)
    c2w = np.tile(np.eye(4), (len(rows), 1, 1))
    c2w[:, :3, :] = rows
    return c2w


def read_tum_poses(path: Path) -> np.ndarray:
    return read_tum(path)[1]


def read_euroc_poses(path: Path) -> np.ndarray:
    """EuRoC's ground-truth CSV (time ns, position, quaternion w x y z, then velocities and biases) -> c2w
    [N, 4, 4] (the body's pose: a camera rigidly on it moves the same way)."""
    rows = np.loadtxt(path, delimiter=",", comments="#", dtype=np.float64)
    c2w = np.tile(np.eye(4), (len(rows), 1, 1))
    w, x, y, z = (rows[:, 4:8] / np.linalg.norm(rows[:, 4:8], axis=1, keepdims=True)).T
    c2w[:, :3, :3] = np.stack([
        np.stack([1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)], axis=-1),
        np.stack([2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)], axis=-1),
        np.stack([2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)], axis=-1)], axis=1)
    c2w[:, :3, 3] = rows[:, 1:4]
    return c2w


@dataclass(frozen=True)
class Trajectory:
    """A real trajectory of evo's test data and how its scenarios are set up, in its units."""

    file: str
    step: int  # every step-th pose: about a camera's rate
    revisit_radius: float  # two chunks revisit a place when frames of each come this close
    scene_depth: float  # the depth of what the camera sees
    false_min_distance: float  # a gross false loop joins frames at least this far apart

    @property
    def subtle_shift(self) -> tuple[float, float]:
        """A subtle false loop's error: 10-20 % of the scene's depth."""
        return 0.1 * self.scene_depth, 0.2 * self.scene_depth

    def poses(self, data_dir: Path) -> np.ndarray:
        path = data_dir / self.file
        readers = {"KITTI": read_kitti_poses, "V1": read_euroc_poses}
        reader = next((read for prefix, read in readers.items() if self.file.startswith(prefix)), read_tum_poses)
        poses = reader(path)
        return poses[:: self.step]


TRAJECTORIES = {
    # a car in streets ~15 m deep, driving past the same places several times (15 chunks, 12 revisited pairs)
    "KITTI 00": Trajectory("KITTI_00_gt.txt", 1, revisit_radius=5.0, scene_depth=15.0, false_min_distance=50.0),
    # a hand-held camera over a desk ~1 m away, moving back and forth (10 chunks of its 100 Hz ground truth,
    # 29 revisited pairs)
    "TUM fr1_xyz": Trajectory("freiburg1_xyz-groundtruth.txt", 1, revisit_radius=0.05, scene_depth=1.0,
                              false_min_distance=0.2),
    # a camera circling a desk ~1.5 m away (its ground truth at ~70 Hz: 23 chunks, 22 revisited pairs)
    "TUM fr2_desk": Trajectory("fr2_desk_groundtruth.txt", 3, revisit_radius=0.5, scene_depth=1.5,
                               false_min_distance=1.0),
    # a drone flying about a room ~3 m deep (its 200 Hz ground truth at the cameras' 20 Hz: 6 chunks, 10
    # revisited pairs)
    "EuRoC V1_02": Trajectory("V102_groundtruth.csv", 10, revisit_radius=0.5, scene_depth=3.0,
                              false_min_distance=1.0),
}


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
LOOP_NOISE = Noise(rotation_deg=0.25, log_scale=0.005, translation_fraction=0.0025)  # the synthetic chains' loops

LOOP_CONFIG = LoopClosureConfig()  # the stream's verification and covariance
INDEX_SPACING = LOOP_CONFIG.index_spacing  # frames between two indexed keyframes of the stream
FIT_POINTS = 80  # agreeing points behind a typical loop's inlier matches
POINT_DEPTH_NOISE = 0.005  # of a point's depth, along its ray
POINT_LATERAL_NOISE = 0.002  # of a point's depth, across its ray: about a pixel at a 500 px focal length


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


def pairwise_distances(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """[len(p), len(q)] distances between positions p [n, 3] and q [m, 3]: np.linalg.norm(p[:, None] - q[None],
    axis=2) bit for bit (the same differences, squared and summed in the same order), five times faster (numpy's sum
    over an axis of three elements is slow)."""
    return np.sqrt(sum((p[:, None, axis] - q[None, :, axis]) ** 2 for axis in range(3)))


def revisits(truth: np.ndarray, ranges: list[tuple[int, int]], radius: float) -> dict[tuple[int, int], tuple[int, int]]:
    """Non-adjacent chunk pairs (a < b - 1) with a frame of each within `radius` of each other -> the
    closest such frame pair (a's frame, b's frame). A pair whose chunks' bounding spheres are further apart than
    `radius` (with a margin for rounding) has no such frames: its distances are not computed."""
    positions = truth[:, :3, 3]
    centres = np.array([positions[start:end].mean(axis=0) for start, end in ranges])
    spans = np.array([np.linalg.norm(positions[start:end] - centre, axis=1).max()
                      for (start, end), centre in zip(ranges, centres, strict=True)])
    found = {}
    for a, (start_a, end_a) in enumerate(ranges):
        for b in range(a + 2, len(ranges)):
            start_b, end_b = ranges[b]
            gap = np.linalg.norm(centres[a] - centres[b]) - spans[a] - spans[b]
            if gap > radius + 1e-9 * (radius + spans[a] + spans[b] + abs(gap)):
                continue
            distances = pairwise_distances(positions[start_a:end_a], positions[start_b:end_b])
            i, j = np.unravel_index(np.argmin(distances), distances.shape)
            if distances[i, j] <= radius:
                found[(a, b)] = (start_a + int(i), start_b + int(j))
    return found


def keyframe_pairs(truth: np.ndarray, ranges: list[tuple[int, int]], pair: tuple[int, int], radius: float,
                   count: int) -> list[tuple[int, int]]:
    """Up to `count` (a's frame, b's frame) pairs of a revisit, closest first, within `radius` of each other:
    b's frames at least INDEX_SPACING apart (keyframes the stream indexes), a's frames all different."""
    a, b = pair
    return _nearest_pairs(truth, np.arange(*ranges[a]), np.arange(*ranges[b]), radius, count,
                          lambda frame_a, frame_b, chosen: all(abs(frame_b - other_b) >= INDEX_SPACING and
                                                               frame_a != other_a for other_a, other_b in chosen))


def _nearest_pairs(truth: np.ndarray, frames_a: np.ndarray, frames_b: np.ndarray, radius: float, count: int,
                   keep: Callable[[int, int, list[tuple[int, int]]], bool]) -> list[tuple[int, int]]:
    """Each of `frames_b` with its nearest of `frames_a`, closest pairs first, within `radius`: up to `count` of
    them that `keep(frame_a, frame_b, chosen so far)` admits."""
    positions = truth[:, :3, 3]
    distances = pairwise_distances(positions[frames_b], positions[frames_a])
    nearest = np.argmin(distances, axis=1)
    chosen: list[tuple[int, int]] = []
    for i in np.argsort(distances[np.arange(len(frames_b)), nearest], kind="stable"):
        if len(chosen) == count or distances[i, nearest[i]] > radius:
            break
        frame_a, frame_b = int(frames_a[nearest[i]]), int(frames_b[i])
        if keep(frame_a, frame_b, chosen):
            chosen.append((frame_a, frame_b))
    return chosen


def observed(rng: np.random.Generator, points: np.ndarray, centre: np.ndarray,
             config: LoopClosureConfig = LOOP_CONFIG, rotation_error: float | None = None) -> np.ndarray:
    """What a keyframe at `centre` puts at `points` [n, 3]: per-point depth and ray errors, then its whole
    view scaled and turned about its camera, as `loop_covariance` states; `rotation_error`: the turn's
    standard deviation per axis (rad), by default the one the loop covariance declares."""
    rotation_error = config.keyframe_rotation_sigma if rotation_error is None else rotation_error
    offsets = points - centre
    distance = np.linalg.norm(offsets, axis=1, keepdims=True)
    ray = offsets / distance
    lateral = rng.normal(0, POINT_LATERAL_NOISE, points.shape) * distance
    lateral -= np.sum(lateral * ray, axis=1, keepdims=True) * ray
    noisy = offsets * (1 + rng.normal(0, POINT_DEPTH_NOISE, (len(points), 1))) + lateral
    turn = from_gtsam(gtsam.Similarity3.Expmap(np.concatenate([rng.normal(0, rotation_error, 3),
                                                               np.zeros(4)]))).rotation
    return centre + np.exp(rng.normal(0, config.keyframe_depth_scale_sigma)) * noisy @ turn.T


def fitted_loop(loop_id: str, truth: np.ndarray, pair: tuple[int, int], frames: tuple[int, int],
                true_world_from_chunk: tuple[Sim3, ...], chain: tuple[Sim3, ...], scene_depth: float,
                rng: np.random.Generator, seen_instead: Sim3 = Sim3.identity(),
                rotation_error: float | None = None) -> LoopEdge:
    """The loop edge the stream makes from keyframes `frames` (a's, b's) of chunks `pair`: FIT_POINTS points
    in front of a's camera (depths 0.5-1.5 x `scene_depth`), seen by both keyframes, each in its chunk's
    coordinates placed by the open chain `chain`; fitted and weighed by closer.align_loop and loop_edge.
    A false loop's query saw `seen_instead` applied to the points (a world transform): a place elsewhere
    that looks the same, a fit as clean as a true one."""
    (a, b), (frame_a, frame_b) = pair, frames
    camera = rigid(truth[frame_a])
    rays = np.stack([rng.uniform(-0.6, 0.6, FIT_POINTS), rng.uniform(-0.4, 0.4, FIT_POINTS), np.ones(FIT_POINTS)], 1)
    points = camera.apply_to_points(rays * rng.uniform(0.5, 1.5, (FIT_POINTS, 1)) * scene_depth)
    emitted_a = chain[a] @ true_world_from_chunk[a].inverse()  # true world -> the emitted world, chunk a
    emitted_b = chain[b] @ true_world_from_chunk[b].inverse()
    centre_a, centre_b = emitted_a.apply_to_points(truth[frame_a, :3, 3]), emitted_b.apply_to_points(truth[frame_b, :3, 3])
    earlier_points = observed(rng, emitted_a.apply_to_points(points), centre_a, rotation_error=rotation_error)
    query_points = observed(rng, emitted_b.apply_to_points(seen_instead.apply_to_points(points)), centre_b,
                            rotation_error=rotation_error)
    median_depth = float(np.median(np.linalg.norm(earlier_points - centre_a, axis=1)))
    earlier = _KeyframePoints(earlier_points, median_depth, centre_a)
    query = _KeyframePoints(query_points, median_depth * emitted_b.scale / emitted_a.scale, centre_b)
    matches = np.stack([np.arange(FIT_POINTS)] * 2, axis=1)
    alignment = align_loop(query, earlier, matches, LOOP_CONFIG)
    if not alignment.passed:
        raise ValueError(f"loop {loop_id}'s simulated fit did not pass verification: {alignment.figures()}")
    edge = loop_edge(loop_id, a, b, alignment, chain, LOOP_CONFIG)
    return LoopEdge(edge.loop_id, a, b, edge.first_from_second, edge.sigmas, {"frames": frames}, edge.covariance)


def _far_frames(truth: np.ndarray, ranges: list[tuple[int, int]], pair: tuple[int, int], min_distance: float,
                rng: np.random.Generator) -> tuple[int, int]:
    """A random frame of a and one of b at least `min_distance` apart."""
    a, b = pair
    positions = truth[:, :3, 3]
    for _ in range(1000):
        frame_a, frame_b = int(rng.integers(*ranges[a])), int(rng.integers(*ranges[b]))
        if np.linalg.norm(positions[frame_a] - positions[frame_b]) >= min_distance:
            return frame_a, frame_b
    raise ValueError(f"chunks {a} and {b} have no frames {min_distance} apart")


def _random_shift(offset: tuple[float, float], rng: np.random.Generator) -> Sim3:
    """A world shift of length uniform in `offset` (ground-truth units), any direction."""
    direction = rng.normal(size=3)
    return Sim3(1.0, np.eye(3), direction / np.linalg.norm(direction) * rng.uniform(*offset))


def make_scenario(truth: np.ndarray, seed: int, *, revisit_radius: float, false_min_distance: float,
                  scene_depth: float, false_fraction: float = 0.2, false_loops: int | None = None,
                  with_true_loops: bool = True, subtle_false: tuple[float, float] | None = None,
                  repeats: int = 1, keyframe_pairs_per_revisit: int = 2,
                  keyframe_rotation_error: float | None = None, false_alone: bool = False) -> Scenario:
    """The chunked stream over `truth`: odometry with ODOMETRY_NOISE; at every revisit (chunk pairs within
    `revisit_radius`) up to `keyframe_pairs_per_revisit` true loops, each a fit of its own keyframe pair
    (`fitted_loop`, points at ~`scene_depth`); and false loops: `false_fraction` of all loops (or
    `false_loops` of them) on non-adjacent chunk pairs that are not revisits (any non-adjacent pair if all
    are), a frame of b said to see what a frame of a at least `false_min_distance` away sees. With
    `subtle_false` (a shift range in ground-truth units) the false loops are on revisited pairs instead:
    the query saw the place shifted by that much, in groups of `repeats` keyframe pairs of one revisit with
    one shift: one wrong place recognised on consecutive keyframes, so that the group agrees with itself.
    `false_alone`: a revisit that got a false loop keeps none of its true ones (the place recognised only
    through a look-alike of it nearby: the false loop is its chunk pair's only loop, which its own solution
    bends to fit). `keyframe_rotation_error`: each keyframe's orientation error within its chunk (rad per
    axis; default: what the loop covariance declares)."""
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
        graph = with_odometry(graph, OdometryEdge(perturbed(exact, sigmas, rng), sigmas))
    chain = open_chain(graph.odometry)

    def fit(loop_id: str, pair: tuple[int, int], frames: tuple[int, int], seen_instead: Sim3 = Sim3.identity()):
        return fitted_loop(loop_id, truth, pair, frames, world_from_chunk, chain, scene_depth, rng, seen_instead,
                           keyframe_rotation_error)

    revisited = revisits(truth, ranges, revisit_radius) if with_true_loops else {}
    true_ids = []
    for pair in revisited:
        for frames in keyframe_pairs(truth, ranges, pair, revisit_radius, keyframe_pairs_per_revisit):
            true_ids.append(f"true-{pair[0]}-{pair[1]}-{frames[1]}")
            graph = with_loop(graph, fit(true_ids[-1], pair, frames))
    candidates = [(a, b) for a in range(len(ranges)) for b in range(a + 2, len(ranges))]
    candidates = [pair for pair in candidates if pair not in revisited] or candidates
    if subtle_false is not None:
        candidates = list(revisits(truth, ranges, revisit_radius))
    if false_loops is None:
        false_loops = max(1, round(len(true_ids) * false_fraction / (1 - false_fraction)))
    false_ids = []
    groups = -(-false_loops // repeats)
    for n in rng.choice(len(candidates), groups, replace=groups > len(candidates)):
        pair = candidates[n]
        if subtle_false is None:
            frames = _far_frames(truth, ranges, pair, false_min_distance, rng)
            # the query's camera saw, about itself, what a's camera sees about itself
            group = [(frames, rigid(truth[frames[1]]) @ rigid(truth[frames[0]]).inverse())]
        else:
            shift = _random_shift(subtle_false, rng)
            group = [(frames, shift) for frames in keyframe_pairs(truth, ranges, pair, revisit_radius, repeats)]
        for frames, seen_instead in group:
            false_ids.append(f"false-{pair[0]}-{pair[1]}-{len(false_ids)}")
            graph = with_loop(graph, fit(false_ids[-1], pair, frames, seen_instead))
    if false_alone:
        looked_alike = {(loop.first, loop.second) for loop in graph.loops if loop.loop_id in false_ids}
        graph = PoseGraph(graph.odometry, [loop for loop in graph.loops if loop.loop_id in false_ids
                                           or (loop.first, loop.second) not in looked_alike])
        true_ids = [loop.loop_id for loop in graph.loops if loop.loop_id in true_ids]
    return Scenario(truth, tuple(ranges), world_from_chunk, graph, frozenset(true_ids), frozenset(false_ids))


def synthetic_graph(num_chunks: int, seed: int, loops_per_chunk: float = 0.125) -> tuple[PoseGraph, tuple[Sim3, ...]]:
    """A random walk of chunks (250 units of path each, turning ~20 degrees, each at a scale of its own in
    [0.5, 2]), odometry and loops with the real-trajectory noise, `loops_per_chunk` loops a chunk of which
    20 % are false: true ones to a chunk 2 to 50 before, false ones between any two chunks."""
    rng = np.random.default_rng(seed)
    rotation, position, truth = np.eye(3), np.zeros(3), []
    for _ in range(num_chunks):
        truth.append(Sim3(float(np.exp(rng.uniform(np.log(0.5), np.log(2.0)))), rotation, position))
        turn = from_gtsam(gtsam.Similarity3.Expmap(np.concatenate([rng.normal(0, 0.2, 3), np.zeros(4)])))
        position = position + rotation @ np.array([250.0, 0, 0])
        rotation = rotation @ turn.rotation
    graph = PoseGraph()
    for k in range(num_chunks - 1):
        sigmas = ODOMETRY_NOISE.sigmas(250.0 / truth[k + 1].scale)
        graph = with_odometry(graph, OdometryEdge(perturbed(truth[k].inverse() @ truth[k + 1], sigmas, rng), sigmas))
    true_loops = max(1, round(0.8 * loops_per_chunk * num_chunks))
    for n in range(true_loops + max(1, true_loops // 4)):
        if n < true_loops:  # a place passed up to 50 chunks before (an open chain of 10,000 chunks drifts
            # by ~100 degrees end to end: a loop across all of it is beyond any local optimiser's reach)
            first = int(rng.integers(0, num_chunks - 2))
            second = int(min(num_chunks - 1, first + rng.integers(2, 51)))
        else:
            first, second = (int(k) for k in rng.choice(num_chunks, 2, replace=False))
        sigmas = LOOP_NOISE.sigmas(250.0 / truth[second].scale)
        measured = truth[first].inverse() @ truth[second]
        if n >= true_loops:  # false: a wrong place, ~hundreds of units off
            measured = measured @ from_gtsam(gtsam.Similarity3.Expmap(
                np.concatenate([rng.normal(0, 0.5, 3), rng.normal(0, 300, 3), [0.0]])))
        graph = with_loop(graph, LoopEdge(f"{'true' if n < true_loops else 'false'}-{n}", first, second,
                                         perturbed(measured, sigmas, rng), sigmas))
    return graph, tuple(truth)


@dataclass
class RejectionRates:
    """What the pose graph made of a trajectory's scenarios over several seeds."""

    false_rejected: int = 0
    false_total: int = 0
    true_accepted: int = 0
    true_total: int = 0
    ratios: list[float] = field(default_factory=list)  # corrected / open ATE, a seed each
    with_over_without: list[float] = field(default_factory=list)  # corrected ATE with / without the false loops


def without_false_loops(scenario: Scenario) -> PoseGraph:
    return PoseGraph(scenario.graph.odometry, [loop for loop in scenario.graph.loops
                                               if loop.loop_id in scenario.true_loops])


def rejection_rates(trajectory: Trajectory, truth: np.ndarray, seeds: range, settings: PoseGraphSettings,
                    subtle: bool = True, repeats: int = 1, keyframe_rotation_error: float | None = None,
                    shift: tuple[float, float] | None = None, false_alone: bool = False) -> RejectionRates:
    """Each seed's scenario of `truth` solved with `settings`: the false loops rejected, the true ones
    accepted, and the corrected ATE against the open chain's and against a solve without the false loops.
    `shift`: the subtle false loops' error (ground-truth units; default the trajectory's subtle_shift);
    `false_alone`: as make_scenario's."""
    rates = RejectionRates()
    for seed in seeds:
        scenario = make_scenario(truth, seed, revisit_radius=trajectory.revisit_radius,
                                 false_min_distance=trajectory.false_min_distance, scene_depth=trajectory.scene_depth,
                                 subtle_false=(shift or trajectory.subtle_shift) if subtle else None,
                                 repeats=repeats, keyframe_rotation_error=keyframe_rotation_error,
                                 false_alone=false_alone)
        result = optimize(scenario.graph, settings)
        accepted = set(result.accepted_ids)
        rates.false_rejected += len(scenario.false_loops - accepted)
        rates.false_total += len(scenario.false_loops)
        rates.true_accepted += len(scenario.true_loops & accepted)
        rates.true_total += len(scenario.true_loops)
        corrected = scenario.ate(result.world_from_chunk)
        rates.ratios.append(corrected / scenario.ate(open_chain(scenario.graph.odometry)))
        without = optimize(without_false_loops(scenario), settings).world_from_chunk
        rates.with_over_without.append(corrected / scenario.ate(without))
    return rates


# -- a run refined offline: chunks that drift inside themselves --------------------------------------------
@dataclass(frozen=True)
class RefineOutcome:
    open_ate: float  # the open chain's Sim(3) ATE
    stream_ate: float  # the stream's chunk graph, solved with the loops of its indexed keyframes
    refined_ate: float  # models/loops/refine.py's segment graph over the keyframe loops it keeps
    stream_accepted: int
    refined_accepted: int


def refine_scenario(truth: np.ndarray, seed: int, *, revisit_radius: float, refine_config: Any = None,
                    stream_spacing: int = INDEX_SPACING, keyframe_spacing: int = 4) -> RefineOutcome:
    """A chunked stream over `truth` whose chunks also drift inside themselves, as refine.py's segments declare:
    within a chunk, each segment of `segment_frames` frames is placed by the one before with an error drawn from
    RefineConfig's segment sigmas (the chunk's prediction of a later frame is off by the errors of the
    segments before it); the links have ODOMETRY_NOISE as in make_scenario. Loops between revisiting
    keyframes measure the true relation of the two keyframes' segments, with LOOP_NOISE: the stream's at its
    indexed keyframes (`stream_spacing`) solved on its chunk graph, refine's among every keyframe's
    (`keyframe_spacing`) those its checks keep (loops_refine_keeps) on the segment graph, starting from the
    run's files as the stream corrected them."""
    config = refine_config or RefineConfig()
    rng = np.random.default_rng(seed)
    ranges = chunk_ranges(len(truth))
    true_chunk = [Sim3(float(np.exp(rng.uniform(np.log(0.5), np.log(2.0)))), truth[start, :3, :3], truth[start, :3, 3])
                  for start, _ in ranges]
    chunk_of = np.zeros(len(truth), np.int64)
    for k, (start, end) in enumerate(ranges):
        chunk_of[start:end] = k  # the later chunk's, where two share a frame
    frames = [RunFrame(f, int(chunk_of[f]), truth[f, :3], True) for f in range(len(truth))]
    parts = segments_of(frames, config.segment_frames)
    # each segment's true placement: the chunk's, then each segment's drift composed (in chunk coordinates)
    true_node, drift = [], None
    for node, (chunk, segment) in enumerate(parts.nodes):
        if segment == 0:
            drift = Sim3.identity()
        else:
            from_world = true_chunk[chunk].inverse()
            centre = from_world.apply_to_points(truth[parts.first_frame[node], :3, 3][None])[0]
            held = truth[parts.first_frame[node - 1]:parts.first_frame[node] + 1, :3, 3]
            covariance = _segment_covariance_of(from_world.apply_to_points(held), centre, config)
            drift = drift @ from_gtsam(gtsam.Similarity3.Expmap(rng.multivariate_normal(np.zeros(7), covariance)))
        true_node.append(true_chunk[chunk] @ drift)
    predicted = np.stack([true_node[parts.node_of[f]].inverse().apply_to_poses(truth[f]) for f in range(len(truth))])
    links = []
    for k in range(1, len(ranges)):
        last = max(n for n, (chunk, _) in enumerate(parts.nodes) if chunk == k - 1)
        first = parts.nodes.index((k, 0))
        sigmas = ODOMETRY_NOISE.sigmas(float(np.linalg.norm(np.diff(predicted[ranges[k][0]:ranges[k][1], :3, 3], axis=0),
                                                            axis=1).sum()))
        exact = true_node[last].inverse() @ true_node[first]
        links.append((perturbed(exact, sigmas, rng).scaled_matrix, np.diag(sigmas**2)))
    revisited = revisits(truth, ranges, revisit_radius)

    def loops_at(spacing: int, count: int) -> list[tuple[int, int, LoopEdge]]:
        found = []
        for pair in revisited:
            for frame_a, frame_b in _spaced_pairs(truth, ranges, pair, revisit_radius, count, spacing):
                # the segments as the edge's chunks placed the frames (fine_graph's node_at): a frame two chunks
                # share is the later one's in node_of, which would measure another chunk's segment
                node_a, node_b = parts.node_at(pair[0], frame_a), parts.node_at(pair[1], frame_b)
                sigmas = LOOP_NOISE.sigmas(float(np.linalg.norm(np.diff(predicted[ranges[pair[1]][0]:ranges[pair[1]][1],
                                                                                   :3, 3], axis=0), axis=1).sum()))
                measured = perturbed(true_node[node_a].inverse() @ true_node[node_b], sigmas, rng)
                found.append((frame_a, frame_b, LoopEdge(len(found), pair[0], pair[1], measured, sigmas)))
        return found

    chain_graph = PoseGraph([OdometryEdge(lie_to_sim3(z), np.sqrt(np.diag(c)), c) for z, c in links])
    stream_loops = loops_at(stream_spacing, 2)
    stream = optimize(PoseGraph(chain_graph.odometry, [edge for _, _, edge in stream_loops]))
    placement = stream.world_from_chunk
    stored = [RunFrame(f, int(chunk_of[f]), placement[chunk_of[f]].apply_to_poses(predicted[f])[:3], True)
              for f in range(len(truth))]
    kept = loops_refine_keeps(loops_at(keyframe_spacing, 10_000), parts, truth, config, stream_loops)
    refine_loops = with_stream_loops([FrameLoop(edge.loop_id, a, b, edge) for a, b, edge in kept], stream_loops)
    graph, fine_parts = fine_graph(stored, placement, links, refine_loops, config)
    refined = solve_fine(graph, config)
    moves = frame_moves(stored, fine_parts, refined.world_from_chunk, placement)
    open_placement = open_chain(chain_graph.odometry)

    def ate(positions: np.ndarray) -> float:
        aligned = umeyama(positions, truth[:, :3, 3], with_scale=True).apply_to_points(positions)
        return float(np.sqrt(np.mean(np.sum((aligned - truth[:, :3, 3]) ** 2, axis=1))))

    open_positions = np.stack([open_placement[chunk_of[f]].apply_to_points(predicted[f, :3, 3][None])[0]
                               for f in range(len(truth))])
    stream_positions = np.stack([frame.c2w[:3, 3] for frame in stored])
    refined_positions = np.stack([moves[frame.frame_index].apply_to_points(frame.c2w[:3, 3][None])[0]
                                  for frame in stored])
    return RefineOutcome(ate(open_positions), ate(stream_positions), ate(refined_positions),
                         len(stream.accepted_ids), len(refined.accepted_ids))


def loops_refine_keeps(loops: list[tuple[int, int, LoopEdge]], parts: Any, truth: np.ndarray, config: Any,
                       streamed: list[tuple[int, int, LoopEdge]] = ()) -> list[tuple[int, int, LoopEdge]]:
    """The loops at which refine.py's checks stop (_LoopChecks), every candidate here verifying: a query
    segment's pairs with earlier segments in order of their most alike candidate, `partners_per_segment` of
    them, each with its `loops_per_segment_pair` most alike; the keyframes nearest in truth stand for the most
    alike. A pair is that of the keyframes' segments (refine's segment_of: a frame two chunks share is the later
    one's), not of the segments the loop's measurement joins. The stream's loops (`streamed`) count towards a
    pair's, as refine's checks count them."""
    def apart(loop: tuple[int, int, LoopEdge]) -> float:
        return float(np.linalg.norm(truth[loop[0], :3, 3] - truth[loop[1], :3, 3]))

    by_pair: dict[tuple[int, int], list[tuple[int, int, LoopEdge]]] = {}
    for loop in sorted(loops, key=lambda loop: (apart(loop), loop[1], loop[0])):
        by_pair.setdefault((parts.node_of[loop[1]], parts.node_of[loop[0]]), []).append(loop)  # (query's, earlier's)
    before = Counter((parts.node_of[query], parts.node_of[earlier]) for earlier, query, _ in streamed)
    partners: Counter = Counter()
    kept = []
    for pair, found in sorted(by_pair.items(), key=lambda item: (apart(item[1][0]), item[0])):
        if partners[pair[0]] < config.partners_per_segment:
            partners[pair[0]] += 1
            kept += found[:max(0, config.loops_per_segment_pair - before[pair])]
    return sorted(kept, key=lambda loop: loop[2].loop_id)


def lie_to_sim3(matrix: np.ndarray) -> Sim3:
    return Sim3.from_matrix(matrix)


def _segment_covariance_of(path: np.ndarray, centre: np.ndarray, config: Any) -> np.ndarray:
    """refine.py's segment covariance for a segment's path [n, 3] and later camera (chunk coordinates)."""
    turning, scaling = _rotation_about(centre), scaling_direction(centre)
    covariance = config.segment_rotation_sigma**2 * turning @ turning.T
    covariance += config.segment_log_scale_sigma**2 * np.outer(scaling, scaling)
    length = float(np.linalg.norm(np.diff(path, axis=0), axis=1).sum()) if len(path) > 1 else 0.0
    shift = max(config.segment_translation_fraction * length, 1e-3 * max(float(np.linalg.norm(centre)), 1e-3))
    covariance[3:6, 3:6] += shift**2 / 3 * np.eye(3)
    return covariance


def _spaced_pairs(truth: np.ndarray, ranges: list[tuple[int, int]], pair: tuple[int, int], radius: float,
                  count: int, spacing: int) -> list[tuple[int, int]]:
    """keyframe_pairs with query frames `spacing` apart (keyframes every `spacing` frames) instead of the
    stream's index spacing."""
    a, b = pair
    frames_a = np.arange(*ranges[a])
    frames_b = np.arange(*ranges[b])
    frames_b = frames_b[frames_b % spacing == 0]
    frames_a = frames_a[frames_a % min(spacing, INDEX_SPACING) == 0]
    if not len(frames_a) or not len(frames_b):
        return []
    return _nearest_pairs(truth, frames_a, frames_b, radius, count, lambda frame_a, frame_b, chosen: True)
