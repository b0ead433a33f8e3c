"""The loop closer's core: detection, 3D verification and the pose graph, synchronous.

Per keyframe: SIFT features and a retrieval descriptor, the earlier keyframes two or more chunks back
that look alike (retrieval.py), the geometric check of each (geometric_check.py), then the 3D agreement
of the two chunks' depths at the inlier matches (`align_loop`), whose Sim(3) becomes a loop edge of the
pose graph over chunks (pose_graph.py), solved at once. What comes out is corrections.py's
ChunkCorrections. No threads and no queues: the stream's process runs this core in a child of its own
(process.py), one message at a time.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..stream.chunks import ChunkLink
from ..stream.pose import back_project
from ..stream.prediction import EVEN_ODDS_CONFIDENCE, FramePrediction
from ..stream.similarity import (
    TANGENT_DIM,
    AlignmentError,
    Sim3,
    fit_covariance,
    irls_umeyama,
    scaling_direction,
    umeyama,
)
from .corrections import ChunkCorrections, LoopRecord
from .detection import CheckedCandidate, LoopDetectionConfig, LoopDetector
from .geometric_check import FeatureConfig, extract_features
from .pose_graph import PoseGraphSolver
from .pose_graph_data import LoopEdge, OdometryEdge, PoseGraph, PoseGraphResult, PoseGraphSettings, open_chain
from .retrieval import gradient_grid_descriptor
from .saved_map import MapManifest, MapRecorder

GRADIENT_GRID_DIM = 128  # gradient_grid_descriptor's length


@dataclass(frozen=True)
class LoopClosureConfig:
    detection: LoopDetectionConfig = LoopDetectionConfig()
    # Depth behind a keypoint counts when its confidence is at least this. A setting of its own, not the
    # app's --conf-threshold (a user thinning points.ply must not change which loops are accepted), but
    # the same rule by default: the model more sure than not.
    min_confidence: float = EVEN_ODDS_CONFIDENCE
    # The two chunks' 3D points at the inlier matches agree when, after the fitted Sim(3), a pair lies
    # within this fraction of the earlier keyframe's median depth: 5%, about twice the depth error the
    # model's chunks show against each other on their shared frames.
    agreement_distance: float = 0.05
    min_agreeing_points: int = 12  # a Sim(3) has 7 unknowns: 12 leave it over-determined
    min_agreeing_fraction: float = 0.5  # of the matches with confident depth on both sides
    # A pair that needs more than this scale change (either way) between its two chunks is not the same
    # place seen twice but a repeated structure at another size: drift is a few % per chunk.
    max_scale_change: float = 2.0
    # Errors of a keyframe that no number of its points averages away, added to the fit's own covariance
    # (`loop_covariance`): its whole depth map can be off by ~2% (the depth errors of one prediction are
    # correlated; two chunks' depths of their shared frames differ by about that), a scaling about its
    # camera; and its orientation within its chunk, a rotation of all its points about its camera. That
    # error is not the model's frame-to-frame noise (1e-3 rad, similarity.MIN_OVERLAP_SIGMA) but its
    # rotation error between frames a chunk apart, tenths of a degree for feed-forward models: 5e-3 rad
    # per axis is 0.5 degrees over all three. At the former 1e-3 rad, keyframes off by 0.4 degrees put true
    # loops at ~3 sigmas and a third of them were rejected; at 5e-3, 0.4 degrees sits inside the bound
    # (tests/test_models_loop_false_loops.py).
    keyframe_depth_scale_sigma: float = 0.02
    keyframe_rotation_sigma: float = 5e-3  # radians, per axis
    # Keyframes handed to the loop-closure process and not yet answered (~13 MB at 518 x 378); a keyframe
    # due for indexing that finds this many and `keyframes_waiting` waiting too is not sent (coverage.py),
    # so the stream never waits for detection.
    keyframes_in_flight: int = 8
    # Keyframes chosen for indexing that wait on the stream's side while `keyframes_in_flight` are unanswered:
    # a closed chunk's final emissions come at once (with flow keyframes, up to 320 frames' worth: 20 due at
    # a spacing of 16), a burst that is not slow detection. Only a due keyframe that finds these full too
    # lowers the density. ~2.2 MB each at 518 x 378 (picture, depth, confidence): 24 hold ~53 MB.
    keyframes_waiting: int = 24
    # Which keyframes are indexed (coverage.py): one when at least `index_spacing` frames have passed since
    # the last indexed one. 16 frames are 0.4 s at 40 FPS, 20 keyframes a 320-frame chunk: a revisit the
    # camera spends half a second in gets a query. Detection takes 60-95 ms a keyframe on the GPU machines'
    # CPU cores, so at 40 FPS the child is busy a quarter of the time on one core, where indexing every
    # keyframe it could take (1 in 3-5 of a 40-FPS stream's) kept it busy all the time.
    index_spacing: int = 16
    # Detection that cannot keep up (a due keyframe finds every place in flight and waiting taken) doubles the
    # spacing, up to 64: 64 frames plus the wait of one due keyframe for an answer (one detection, ~4
    # frames at 40 FPS) stay under 100 frames without an indexed keyframe.
    max_index_spacing: int = 64
    # The pose graph's solves: each hands back what it has after 0.1 s (the next solve goes on from there),
    # so the child answers a keyframe within its detection time plus 0.1 s however large the graph grows.
    pose_graph: PoseGraphSettings = PoseGraphSettings(budget_s=0.1)


@dataclass(frozen=True)
class Keyframe:
    """What detection needs of one keyframe."""

    frame_index: int
    chunk_index: int
    image: np.ndarray  # [H, W, 3] uint8
    depth: np.ndarray  # [H, W], in the emitted world's units
    depth_conf: np.ndarray  # [H, W]
    intrinsics: np.ndarray  # [3, 3]
    c2w: np.ndarray  # [3, 4] as emitted (the open chain's world)


def map_manifest(config: LoopClosureConfig, checkpoint: dict[str, Any], chunk_frames: int,
                 overlap: int) -> MapManifest:
    """The manifest of the map a loop closer with `config` writes (saved_map.py); `checkpoint`: name, bytes,
    sha256 (None until hashed)."""
    return MapManifest(checkpoint, f"gradient-grid/{GRADIENT_GRID_DIM}", features_name(config.detection.features),
                       chunk_frames, overlap)


def features_name(features: FeatureConfig) -> str:
    """The features a map's keyframes hold, as its manifest names them: "sift/<max features>/<contrast>"."""
    return f"sift/{features.max_features}/{features.contrast_threshold:g}"


def keyframe_of(pred: FramePrediction) -> Keyframe:
    return Keyframe(pred.frame_index, pred.chunk_index, pred.image, pred.depth, pred.depth_conf,
                     pred.intrinsics, pred.c2w)


class FirstFinalKeyframes:
    """Which emissions loop detection takes: a keyframe's first final emission with its picture. Not a
    provisional one (a closed chunk's, replaced later), and not a later chunk's re-emission of a shared
    frame: the frame belongs to the chunk that first emitted it, in whose coordinates its pose is."""

    def __init__(self) -> None:
        self._seen: set[int] = set()

    def admit(self, pred: FramePrediction) -> bool:
        if not pred.is_keyframe or pred.provisional or pred.frame_index in self._seen or pred.image is None:
            return False
        self._seen.add(pred.frame_index)
        return True


@dataclass(frozen=True)
class _KeyframePoints:
    points: np.ndarray  # [N, 3] float64, the emitted world point behind each keypoint; NaN where unsure
    median_depth: float
    # [3] the keyframe's camera in the emitted world: the keyframe's errors turn and scale about it, so it
    # has no default (a zero would silently put every keyframe's errors at the world's origin)
    camera_centre: np.ndarray


def keypoint_points(keypoints: np.ndarray, depth: np.ndarray, depth_conf: np.ndarray, intrinsics: np.ndarray,
                    c2w: np.ndarray, min_confidence: float) -> tuple[np.ndarray, float]:
    """The world point behind each keypoint [N, 2] (x, y pixels; nearest pixel's depth), NaN where the depth
    is not confident or not positive; and the frame's median confident depth."""
    height, width = depth.shape
    u = np.clip(np.rint(keypoints[:, 0]).astype(np.int64), 0, width - 1)
    v = np.clip(np.rint(keypoints[:, 1]).astype(np.int64), 0, height - 1)
    z = depth[v, u].astype(np.float64)
    sure = (depth_conf[v, u] >= min_confidence) & (z > 0) & np.isfinite(z)
    x, y = back_project(keypoints[:, 0], keypoints[:, 1], z, intrinsics, np.float64)  # sub-pixel rays
    camera = np.stack([x, y, z], axis=1)
    c2w = np.asarray(c2w, np.float64)
    world = camera @ c2w[:3, :3].T + c2w[:3, 3]
    world[~sure] = np.nan
    confident = depth[(depth_conf >= min_confidence) & (depth > 0)]
    median_depth = float(np.median(confident)) if confident.size else float("nan")
    return world, median_depth


@dataclass(frozen=True)
class LoopAlignment:
    """A checked pair's 3D agreement: the Sim(3) that maps the query's points onto the earlier keyframe's,
    and what its uncertainty is made of (`loop_covariance`)."""

    earlier_from_query: Sim3  # in the emitted world: query chunk's placement -> earlier chunk's placement
    points: int  # inlier matches with confident depth on both sides
    agreeing: int  # of them, within agreement_distance after the fit
    rms: float  # of the agreeing pairs' residuals, in units of the earlier keyframe's median depth
    sigmas_world: np.ndarray  # [7] loop_covariance's in the emitted world's tangent (chain identity)
    passed: bool
    query_points: np.ndarray = field(default_factory=lambda: np.zeros((0, 3)))  # [n, 3] agreeing, emitted world
    residuals: np.ndarray = field(default_factory=lambda: np.zeros((0, 3)))  # [n, 3] earlier - fit(query)
    query_centre: np.ndarray = field(default_factory=lambda: np.zeros(3))  # the keyframes' cameras, emitted
    earlier_centre: np.ndarray = field(default_factory=lambda: np.zeros(3))

    def figures(self) -> dict[str, Any]:
        rms = round(self.rms, 5) if np.isfinite(self.rms) else None
        return {"points": self.points, "agreeing": self.agreeing, "rms_relative": rms,
                "scale": round(self.earlier_from_query.scale, 5),
                "rotation_deg": round(self.earlier_from_query.rotation_deg, 3), "passed": self.passed}


def align_loop(query: _KeyframePoints, earlier: _KeyframePoints, inlier_matches: np.ndarray,
               config: LoopClosureConfig) -> LoopAlignment:
    """Fit earlier_from_query on the 3D points behind the pair's inlier matches ([M, 2]: query keypoint,
    earlier keypoint), robustly (IRLS), and judge the agreement."""
    source = query.points[inlier_matches[:, 0]]
    target = earlier.points[inlier_matches[:, 1]]
    both = np.isfinite(source).all(axis=1) & np.isfinite(target).all(axis=1)
    source, target = source[both], target[both]
    unit = earlier.median_depth
    failed = LoopAlignment(Sim3.identity(), len(source), 0, float("nan"), np.full(7, np.inf), False)
    if len(source) < config.min_agreeing_points or not np.isfinite(unit) or unit <= 0:
        return failed
    try:
        fit, _ = irls_umeyama(source, target)
        residuals = np.linalg.norm(fit.apply_to_points(source) - target, axis=1) / unit
        agree = residuals < config.agreement_distance
        if np.count_nonzero(agree) >= config.min_agreeing_points:
            fit = umeyama(source[agree], target[agree])
            residuals = np.linalg.norm(fit.apply_to_points(source) - target, axis=1) / unit
            agree = residuals < config.agreement_distance
    except AlignmentError:
        return failed
    agreeing = int(np.count_nonzero(agree))
    rms = float(np.sqrt(np.mean(residuals[agree] ** 2))) if agreeing else float("nan")
    scale_ok = 1.0 / config.max_scale_change <= fit.scale <= config.max_scale_change
    passed = (agreeing >= config.min_agreeing_points and agreeing >= config.min_agreeing_fraction * len(source)
              and scale_ok)
    alignment = LoopAlignment(fit, len(source), agreeing, rms, np.full(7, np.inf), passed, source[agree],
                              target[agree] - fit.apply_to_points(source[agree]), query.camera_centre,
                              earlier.camera_centre)
    if agreeing * 3 <= TANGENT_DIM:
        return alignment
    world_sigmas = np.sqrt(np.diag(loop_covariance(alignment, Sim3.identity(), config)))
    return replace(alignment, sigmas_world=world_sigmas)


def loop_covariance(alignment: LoopAlignment, world_from_second: Sim3, config: LoopClosureConfig) -> np.ndarray:
    """[7, 7] covariance of a loop edge's error in the tangent where the pose graph measures it: chunk
    `second`'s (the query's) coordinates, world_from_second its open-chain placement.

    The sum of independent parts, each a first-order error of the edge first_from_second @ Exp(e):
    - the fit's: Gauss-Newton at the agreeing query points in chunk `second`'s coordinates, with the residual
      variance estimated from the fit (similarity.fit_covariance). Only the second chunk's placement
      matters: the first chunk's scale divides the residuals and the edge's scale alike.
    - each keyframe's whole depth map scaled by e^d, d ~ N(0, keyframe_depth_scale_sigma^2): a scaling about
      its camera; the earlier keyframe's camera is taken back into the query's coordinates through the fit.
    - each keyframe's orientation off by a rotation r ~ N(0, keyframe_rotation_sigma^2 I) about its camera
      c: x -> x + r x (x - c), the tangent [r, c x r, 0].
    """
    second_from_world = world_from_second.inverse()
    source = second_from_world.apply_to_points(alignment.query_points)
    # Residuals in the emitted world's units per unit of chunk `second`: what the edge's scale is, once the
    # first chunk's placement divides both (the residuals are taken as isotropic, so rotations drop out).
    world_per_second_unit = alignment.earlier_from_query.scale * world_from_second.scale
    covariance = fit_covariance(source, alignment.residuals, world_per_second_unit)
    earlier_centre = alignment.earlier_from_query.inverse().apply_to_points(alignment.earlier_centre)
    for centre in (second_from_world.apply_to_points(alignment.query_centre),
                   second_from_world.apply_to_points(earlier_centre)):
        scaling = scaling_direction(centre)
        covariance += config.keyframe_depth_scale_sigma**2 * np.outer(scaling, scaling)
        turning = _rotation_about(centre)
        covariance += config.keyframe_rotation_sigma**2 * turning @ turning.T
    return covariance


def _rotation_about(centre: np.ndarray) -> np.ndarray:
    """[7, 3] the tangent of a small rotation r about `centre`: x -> x + r x (x - c) = x + r x x + c x r."""
    cross = np.array([[0.0, -centre[2], centre[1]], [centre[2], 0.0, -centre[0]], [-centre[1], centre[0], 0.0]])
    return np.concatenate([np.eye(3), cross, np.zeros((1, 3))])


def loop_edge(loop_id: Hashable, first: int, second: int, alignment: LoopAlignment,
              world_from_chunk: Sequence[Sim3], config: LoopClosureConfig) -> LoopEdge:
    """The pose graph's loop edge from a fit between two emitted keyframes: the earlier one of chunk `first`,
    the query of chunk `second` (chunk indices as the pose graph counts them: 0 is the first chunk).

    Emitted keyframes are in the open chain's world, chunk c placed by world_from_chunk[c] (the odometry
    composed), so the fit S gives first_from_second = world_from_chunk[first]^-1 S world_from_chunk[second],
    and its covariance is `loop_covariance` at chunk `second`'s placement.
    """
    placed_first, placed_second = world_from_chunk[first], world_from_chunk[second]
    first_from_second = placed_first.inverse() @ alignment.earlier_from_query @ placed_second
    covariance = loop_covariance(alignment, placed_second, config)
    return LoopEdge(loop_id, first, second, first_from_second, np.sqrt(np.diag(covariance)), covariance=covariance)


def graph_of(links: Sequence[ChunkLink], loops: Sequence[LoopEdge]) -> PoseGraph:
    """The pose graph over the chunks that `links` reach.

    One convention for chunks: the stream's index, from 0 (chunk 0 is the world). ChunkLink `index` hangs
    chunk index on chunk index - 1, so links start at 1 and link i is the graph's odometry edge i - 1; the
    links must come in chunk order, from chunk 1. A loop edge joining a chunk past the last link waits.
    """
    expected = list(range(1, len(links) + 1))
    if [link.index for link in links] != expected:
        raise ValueError(f"links must hang chunks {expected} in order, got {[link.index for link in links]}")
    odometry = [OdometryEdge(link.previous_from_next, link.sigmas, link.covariance) for link in links]
    return PoseGraph(odometry, [loop for loop in loops if max(loop.first, loop.second) <= len(odometry)])


def solve(links: Sequence[ChunkLink], loops: Sequence[LoopEdge], settings: PoseGraphSettings = PoseGraphSettings(),
          solver: PoseGraphSolver | None = None) -> tuple[PoseGraph, PoseGraphResult]:
    """The graph of `graph_of` and its solution; `solver`: the one kept between the solves of one stream
    (what they share is then not computed again), else a new one with `settings`."""
    graph = graph_of(links, loops)
    return graph, (solver or PoseGraphSolver(settings)).solve(graph)


def corrections_from_solve(graph: PoseGraph, result: PoseGraphResult, records: Sequence[LoopRecord] = (),
                           version: int = 1) -> ChunkCorrections:
    """A solve as moves of the emitted predictions: chunk c's emissions were placed by the open chain
    (the odometry composed, pose_graph_data.open_chain), so they move by result[c] @ open_chain[c]^-1; nothing
    moves when no loop was accepted. `records` (LoopRecord, keyed by loop_id as the loop edges are) get the
    graph's verdicts; records of loops the graph did not hold are kept as they are."""
    chain = open_chain(graph.odometry)
    by_chunk = {} if result.is_open_chain else {
        chunk: corrected @ chain[chunk].inverse() for chunk, corrected in enumerate(result.world_from_chunk)}
    verdicts = {verdict.loop_id: verdict.accepted for verdict in result.loops}
    return ChunkCorrections(by_chunk, tuple(_judged(record, verdicts, by_chunk) for record in records), version)


def _judged(loop: LoopRecord, verdicts: dict[Any, bool], by_chunk: dict[int, Sim3]) -> LoopRecord:
    if loop.loop_id not in verdicts:
        return loop
    if not verdicts[loop.loop_id]:
        return replace(loop, status="rejected_by_graph")
    move = by_chunk.get(loop.query_chunk, Sim3.identity())
    return replace(loop, status="accepted", correction={
        "scale": round(move.scale, 6), "rotation_deg": round(move.rotation_deg, 4),
        "translation": round(float(np.linalg.norm(move.translation)), 6)})


class LoopCloser:
    """Loop closure over a chunked stream's emissions, one call at a time (no threads, no queues).

    `add_link` takes each chunk's odometry (ChunkedEngine.chunk_links, in chunk order; a chunk aligned
    again replaces its link). `add_keyframe` takes a keyframe's first final emission (FirstFinalKeyframes
    picks them) in any order: descriptor, SIFT features, retrieval among keyframes two or more chunks
    back, the geometric check, the 3D agreement of the two chunks' depths at the inlier matches
    (`align_loop`); a pair that agrees becomes a loop edge and the graph (odometry and every loop so far)
    is solved at once. It returns the new ChunkCorrections when that solve changed them, else None.

    Everything is in the emitted world (chunk 0's coordinates as the open chain places each chunk):
    chunk c's emissions were placed by chain[c] = link_1 ... link_c, so a fit S between two emitted
    keyframes of chunks a and b is the edge chain[a]^-1 S chain[b].
    """

    def __init__(self, config: LoopClosureConfig = LoopClosureConfig(), extends: Any = None):
        """extends: an earlier run's map the stream's keyframes are looked up in too (an earlier_map.MapExtension,
        which builds on this module)."""
        self.config = config
        self._extends = extends
        self._detector = LoopDetector(GRADIENT_GRID_DIM, config.detection)
        self._links: list[ChunkLink] = []  # links[c - 1] hangs chunk c on chunk c - 1
        self._chain: list[Sim3] = [Sim3.identity()]
        self._points: dict[int, _KeyframePoints] = {}
        self._loops: list[LoopRecord] = []
        self._edges: list[LoopEdge] = []
        self._solver = PoseGraphSolver(config.pose_graph)  # what the stream's solves share
        self._unfinished = False  # the last solve ran out of its time budget: the next one goes on
        self.corrections = ChunkCorrections({})
        self.timings = _Timings()
        self._recorder: MapRecorder | None = None  # the saved map's files, written as they are made
        self._last_result: PoseGraphResult | None = None

    def record_map(self, recorder: MapRecorder) -> None:
        """Write the map's links, keyframes, loop edges and final solve through `recorder` from now on."""
        self._recorder = recorder

    def add_link(self, link: ChunkLink) -> None:
        """Chunk link.index's odometry (in chunk order; a chunk aligned again replaces its link)."""
        del self._links[link.index - 1:]
        del self._chain[link.index:]
        if len(self._links) != link.index - 1:
            raise ValueError(f"chunk {link.index}'s link came before chunk {len(self._links) + 1}'s")
        self._links.append(link)
        self._chain.append(self._chain[-1] @ link.previous_from_next)
        if self._recorder is not None:
            covariance = link.covariance if link.covariance is not None else np.diag(np.square(link.sigmas))
            self._recorder.link(link.index, link.previous_from_next.scaled_matrix, covariance)

    def add_keyframe(self, keyframe: Keyframe) -> ChunkCorrections | None:
        """Detect loops from `keyframe` and solve when one is new; the new corrections, else None."""
        if keyframe.chunk_index >= len(self._chain):
            raise ValueError(f"frame {keyframe.frame_index} of chunk {keyframe.chunk_index} came before that "
                             "chunk's link")
        with self.timings.time("features"):
            features = extract_features(keyframe.image, self.config.detection.features)
            descriptor = gradient_grid_descriptor(keyframe.image)
            points, median_depth = keypoint_points(features.keypoints, keyframe.depth, keyframe.depth_conf,
                                                   keyframe.intrinsics, keyframe.c2w, self.config.min_confidence)
        self._points[keyframe.frame_index] = _KeyframePoints(points, median_depth,
                                                             np.asarray(keyframe.c2w, np.float64)[:3, 3])
        if self._recorder is not None:
            self._recorder.keyframe(keyframe.frame_index, keyframe.chunk_index, keyframe.c2w, keyframe.intrinsics,
                                    keyframe.image.shape[:2], descriptor, features.keypoints, features.descriptors,
                                    points, median_depth)
        with self.timings.time("retrieval_and_check"):
            checked = self._detector.add_keyframe(keyframe.frame_index, keyframe.chunk_index, descriptor, features,
                                                  keyframe.intrinsics)
        new_edges = [self._verify(candidate) for candidate in checked]
        if self._extends is not None:
            with self.timings.time("map_retrieval_and_check"):
                to_map = self._extends.checked(keyframe.frame_index, keyframe.chunk_index, descriptor, features,
                                               keyframe.intrinsics)
            new_edges += [self._verify(candidate, in_map=True) for candidate in to_map]
        return self._solve() if any(new_edges) or self._unfinished else None

    def settle(self) -> ChunkCorrections:
        """The stream has ended: a solve its budget cut short goes on, budget by budget, until it finishes
        (the parent's end-of-run deadline bounds the whole)."""
        while self._unfinished:
            self._solve()
        if self._recorder is not None:
            result = self._last_result
            chain = np.stack([placed.scaled_matrix for placed in self._chain])
            if result is not None and self._extends is not None and self._extends.has_loops:
                result = self._extends.stream_result(result)
            solved = chain if result is None or result.is_open_chain or len(result.world_from_chunk) != len(chain) \
                else np.stack([placed.scaled_matrix for placed in result.world_from_chunk])
            self._recorder.solved(solved, [] if result is None else list(result.accepted_ids))
        return self.corrections

    @property
    def pairs_recorded(self) -> int:
        """Candidate pairs checked so far (whatever became of them)."""
        return len(self._loops)

    def summary(self) -> dict[str, Any]:
        """What run.json records: every pair that passed the geometric check (a loop, whatever became of
        it), how many retrieved pairs the check refused, and the costs."""
        corrections = self.corrections
        loops = corrections.loops if corrections.loops else tuple(self._loops)
        checked = [loop for loop in loops if loop.status != "rejected_by_check"]
        return {
            "keyframes_indexed": len(self._points),
            "chunks": len(self._chain),
            "candidates_checked": len(loops),
            "accepted": sum(loop.status == "accepted" for loop in loops),
            "rejected": sum(loop.status.startswith("rejected") for loop in checked),
            "loops": [loop.as_json() for loop in checked],
            "corrected_chunks": len(corrections.by_chunk),
            "costs_ms": self.timings.summary(),
            **({} if self._extends is None else {"map": self._extends.summary()}),
        }

    def _verify(self, checked: CheckedCandidate, in_map: bool = False) -> bool:
        """Record the candidate; when its check passed, align it in 3D and add a loop edge if it agrees
        (`in_map`: the earlier keyframe is the extended map's, in its frame)."""
        earlier = checked.candidate
        record = LoopRecord(len(self._loops), checked.query_frame, checked.query_chunk, earlier.frame_index,
                            earlier.chunk_index, earlier.similarity, checked.check.matches, checked.check.inliers,
                            "rejected_by_check", in_map=in_map)
        if not checked.accepted:
            self._loops.append(record)
            return False
        with self.timings.time("verification"):
            query, matches = self._points[checked.query_frame], checked.check.inlier_matches
            alignment = self._extends.align(query, self._extends.points(earlier), matches) if in_map else \
                align_loop(query, self._points[earlier.frame_index], matches, self.config)
        status = "pending" if alignment.passed else "rejected_by_verification"
        self._loops.append(replace(record, status=status, verification=alignment.figures()))
        if alignment.passed and in_map:
            self._extends.add_loop(record.loop_id, checked.query_frame, earlier.chunk_index, checked.query_chunk,
                                   alignment, self._chain)
        elif alignment.passed:
            edge = loop_edge(record.loop_id, earlier.chunk_index, checked.query_chunk, alignment, self._chain,
                             self.config)
            self._edges.append(edge)
            if self._recorder is not None:
                self._recorder.loop(record.loop_id, record.loop_id, edge.first, edge.second,
                                    edge.first_from_second.scaled_matrix, edge.covariance,
                                    (earlier.frame_index, checked.query_frame))
        return alignment.passed

    def _solve(self) -> ChunkCorrections:
        extended = self._extends is not None and self._extends.has_loops
        graph, result = (self._extends.solve if extended else functools.partial(solve, solver=self._solver))(
            self._links, self._edges)
        self._last_result = result
        self._unfinished = not result.complete
        self.timings.add("pose_graph", result.seconds * 1000.0)
        version = self.corrections.version + 1
        self.corrections = self._extends.corrections(graph, result, self._loops, version) if extended else \
            corrections_from_solve(graph, result, self._loops, version)
        return self.corrections


class _Timings:
    """Milliseconds per call of each stage of loop closure (count, mean, max), for run.json."""

    def __init__(self) -> None:
        self._calls: dict[str, list[float]] = {}  # stage -> [calls, total ms, max ms]: bounded however long

    @contextlib.contextmanager
    def time(self, stage: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, (time.perf_counter() - started) * 1000.0)

    def add(self, stage: str, milliseconds: float) -> None:
        totals = self._calls.setdefault(stage, [0, 0.0, 0.0])
        totals[0] += 1
        totals[1] += milliseconds
        totals[2] = max(totals[2], milliseconds)

    def summary(self) -> dict[str, dict[str, float]]:
        return {stage: {"calls": calls, "mean": round(total / calls, 3), "max": round(longest, 3)}
                for stage, (calls, total, longest) in list(self._calls.items())}
