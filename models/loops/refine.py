"""A finished run refined offline: every keyframe indexed, its loops verified as the stream verifies them, and
a pose graph finer than the stream's chunks solved from scratch.

The stream's graph has a node per chunk: a chunk is rigid, so the model's own drift inside a chunk (tenths
of a degree over its 320 frames) stays, and a loop at one end of a chunk moves the other end alike. Here a
chunk is cut into segments of `segment_frames` frames, each a node in its chunk's coordinates:

- odometry between two segments of one chunk: the identity (the chunk placed both), uncertain by the model's
  drift over a segment (`segment_*_sigma`, a rotation and a scaling about the later segment's first camera);
- odometry from a chunk's last segment to the next chunk's first: the stream's link (the map's), unchanged;
- loops: every keyframe of the run (not one in 16) queried against the earlier ones (retrieval, the geometric
  check, the 3D agreement: closer.py's), each verified pair an edge between the two keyframes' segments,
  weighed as the stream weighs its loop edges (`loop_edge`), beside the stream's own verified loops (the
  map's) where they join other keyframe pairs; all checked and solved by `PoseGraphSolver`.

A frame's move is its segment's solved pose over its chunk's placement in the run's files, blended between
the two nearest segments of its chunk (in the tangent) so that the corrected trajectory has no step at a
segment's edge. No model runs: everything comes from what the run kept (its predictions and its map).
"""

from __future__ import annotations

import functools
import os
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..stream.similarity import Sim3, scaling_direction
from . import sim3_batch as lie
from .closer import (
    Keyframe,
    LoopClosureConfig,
    _KeyframePoints,
    _rotation_about,
    align_loop,
    features_name,
    keypoint_points,
    loop_edge,
)
from .geometric_check import ImageFeatures, check_pair, extract_features
from .pose_graph import PoseGraphSolver
from .pose_graph_data import LoopEdge, OdometryEdge, PoseGraph, PoseGraphResult, PoseGraphSettings
from .retrieval import KeyframeIndex, RetrievalConfig, gradient_grid_descriptor
from .saved_map import SavedMap


@dataclass(frozen=True)
class RefineConfig:
    # Frames a node of the fine graph spans: 5 to a 320-frame chunk, each holding ~4 keyframes indexed at the
    # stream's spacing and every keyframe of its stretch here.
    segment_frames: int = 64
    # The model's drift from one segment of a chunk to the next, per axis: 2e-3 rad is 0.45 degrees over the
    # five segments of a chunk, the keyframe orientation error a loop edge already declares
    # (LoopClosureConfig.keyframe_rotation_sigma, 5e-3 rad a chunk apart); the camera's shift over a segment
    # 0.5 % of the segment's path, its depth scale 0.5 %.
    segment_rotation_sigma: float = 2e-3
    segment_translation_fraction: float = 5e-3
    segment_log_scale_sigma: float = 5e-3
    # Verified loops wanted between two segments, and earlier segments a segment is joined to at most (its most
    # alike first, by their pairs' most alike candidates; a pair that verifies nothing replaced by the next).
    # More loops average their noise, each at a check (~24 ms of a busy worker) and often a keyframe's SIFT
    # (~116 ms). In the refine scenario (tests/loop_scenarios.py, which draws each loop's error on its own),
    # refined / stream ATE over 20 seeds, mean (seeds over 0.5), EuRoC V1_02 and TUM fr1_xyz: one loop and 8
    # partners 0.51 (11) and 0.61 (17); four and 8 0.39 (1) and 0.49 (8); four and 16 0.39 and 0.48; every loop
    # 0.35 and 0.43. Where a pair's loops share their segments' depth error, the second to fourth add less than
    # drawn there. A revisit-heavy 10,000-frame run (flow keyframes, 167 segments, a 16-core GPU host):
    # one and 8 37.6 s, 1,649 checks and 1,730 keyframes' features; four and 8 57.3-58.1 s, 5,456 and 3,864;
    # two and 16 60.3 s; four and 16 72.2 s, 8,267 and 4,866.
    loops_per_segment_pair: int = 4
    partners_per_segment: int = 8
    closure: LoopClosureConfig = LoopClosureConfig()
    # Up to 32 edges dropped a round of the solve from scratch: 167 segments and 3,113 loops (half of them off by
    # 0.02 rad and 5 units, synthetic, 2-core machine) solved in 7.2 s instead of 111 (1,044 LM iterations
    # over ~500 rounds), accepting the same 1,428 loops.
    pose_graph: PoseGraphSettings = PoseGraphSettings(drops_per_round=32)
    # the caller's threads for features, checks and the frames' files
    workers: int = max(1, min(16, os.cpu_count() or 1))

    def __post_init__(self):
        if min(self.segment_frames, self.loops_per_segment_pair, self.partners_per_segment, self.workers) < 1:
            raise ValueError(f"invalid refine config {self}")


@dataclass(frozen=True)
class RunFrame:
    """One frame of a finished run as its files hold it."""

    frame_index: int
    chunk_index: int  # the chunk of its final emission
    c2w: np.ndarray  # [3, 4] in the run's world (its files': the stream's correction applied, if any)
    is_keyframe: bool


@dataclass(frozen=True)
class FrameLoop:
    """A verified loop between two keyframes, as an edge between their chunks (chunk coordinates)."""

    loop_id: int
    earlier_frame: int
    query_frame: int
    edge: LoopEdge  # first = the earlier keyframe's chunk, second = the query's


@dataclass
class RefineFigures:
    keyframes_indexed: int = 0
    keyframes_matched: int = 0  # those whose features a check needed
    pairs_retrieved: int = 0
    pairs_checked: int = 0  # the rest left: their segments had loops_per_segment_pair verified
    loops_verified: int = 0  # found here
    stream_loops: int = 0  # the stream's own verified loops (the map's), on other keyframe pairs
    loops_accepted: int = 0
    nodes: int = 0
    chunks: int = 0
    seconds: dict[str, float] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"keyframes_indexed": self.keyframes_indexed, "keyframes_matched": self.keyframes_matched,
                "pairs_retrieved": self.pairs_retrieved, "pairs_checked": self.pairs_checked,
                "loops_verified": self.loops_verified, "stream_loops": self.stream_loops,
                "loops_accepted": self.loops_accepted, "nodes": self.nodes,
                "chunks": self.chunks, "seconds": {k: round(v, 3) for k, v in self.seconds.items()}}


Progress = Callable[[str, int, int], None]  # (stage, done, total)
# Starts a job (a function of no argument) and returns its future; the caller's: a pool of its threads (OpenCV's
# SIFT and matching free the GIL), or `at_once`.
Submit = Callable[[Callable[[], Any]], Future]
# A job not done this long after the last one (a job takes tens of milliseconds) is a hung library.
JOB_STALL_S = 120.0
# Keyframes described in one job: a descriptor takes ~1 ms with its picture's read, a job's hand-over to a worker
# and its child a fraction of that.
DESCRIBED_TOGETHER = 16


def at_once(job: Callable[[], Any]) -> Future:
    """`job` run now, on the caller's thread: its future, done."""
    future: Future = Future()
    try:
        future.set_result(job())
    except Exception as error:  # noqa: BLE001 - raised where its result is taken
        future.set_exception(error)
    return future


# -- segments ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Segments:
    """The fine graph's nodes: (chunk, segment) in chunk order, and each frame's node."""

    nodes: tuple[tuple[int, int], ...]
    node_of: dict[int, int]  # frame index -> node
    first_frame: tuple[int, ...]  # [N] each node's first frame
    centre: tuple[float, ...]  # [N] each node's middle frame (for blending moves)
    segment_frames: int = 64
    chunk_start: tuple[int, ...] = ()  # [K] each chunk's first frame

    def node_at(self, chunk: int, frame: int) -> int:
        """The node of `frame` as chunk `chunk` placed it (a frame two chunks share is the later one's in
        node_of; a loop the stream found at its first emission is the earlier chunk's): its segment, or the
        chunk's last when the chunk holds no final frame there."""
        wanted = (frame - self.chunk_start[chunk]) // self.segment_frames
        held = [n for n, (c, _) in enumerate(self.nodes) if c == chunk]
        return next((n for n in held if self.nodes[n][1] == wanted), held[-1] if wanted > 0 else held[0])


def segments_of(frames: Sequence[RunFrame], segment_frames: int) -> Segments:
    """Each chunk's frames (by their final emission's chunk) cut into runs of `segment_frames` from the chunk's
    first frame."""
    by_chunk: dict[int, list[int]] = {}
    for frame in frames:
        by_chunk.setdefault(frame.chunk_index, []).append(frame.frame_index)
    chunks = sorted(by_chunk)
    if chunks != list(range(len(chunks))):
        raise ValueError(f"the run's frames come from chunks {chunks}: every chunk from 0 on must hold frames")
    nodes, node_of, first, centre = [], {}, [], []
    for chunk in chunks:
        members = sorted(by_chunk[chunk])
        start = members[0]
        by_segment: dict[int, list[int]] = {}
        for frame in members:
            by_segment.setdefault((frame - start) // segment_frames, []).append(frame)
        for segment in sorted(by_segment):
            held = by_segment[segment]
            for frame in held:
                node_of[frame] = len(nodes)
            nodes.append((chunk, segment))
            first.append(held[0])
            centre.append(0.5 * (held[0] + held[-1]))
    starts = tuple(min(by_chunk[chunk]) for chunk in chunks)
    return Segments(tuple(nodes), node_of, tuple(first), tuple(centre), segment_frames, starts)


# -- the fine graph -----------------------------------------------------------------------------------------
def fine_graph(frames: Sequence[RunFrame], placement: Sequence[Sim3], links: Sequence[tuple[np.ndarray, np.ndarray]],
               loops: Iterable[FrameLoop], config: RefineConfig = RefineConfig()) -> tuple[PoseGraph, Segments]:
    """The segment graph of a run: its frames (the run's world), each chunk's placement in that world
    (`placement[c]`: chunk c's coordinates -> the run's world), the map's links (links[c - 1]: chunk c on c - 1,
    previous_from_next [4, 4] and covariance [7, 7]) and the loops between keyframes."""
    parts = segments_of(frames, config.segment_frames)
    by_frame = {frame.frame_index: frame for frame in frames}
    odometry = []
    for node in range(1, len(parts.nodes)):
        (chunk, _), (previous_chunk, _) = parts.nodes[node], parts.nodes[node - 1]
        if chunk != previous_chunk:
            measured, covariance = links[chunk - 1]
            odometry.append(OdometryEdge(lie.to_sim3(measured), np.sqrt(np.diag(covariance)), covariance))
            continue
        covariance = _segment_covariance(parts, node, by_frame, placement[chunk], config)
        odometry.append(OdometryEdge(Sim3.identity(), np.sqrt(np.diag(covariance)), covariance))
    edges = []
    for loop in loops:
        first = parts.node_at(loop.edge.first, loop.earlier_frame)
        second = parts.node_at(loop.edge.second, loop.query_frame)
        if first != second:
            edges.append(LoopEdge(loop.loop_id, first, second, loop.edge.first_from_second, loop.edge.sigmas,
                                  {"frames": (loop.earlier_frame, loop.query_frame)}, loop.edge.covariance))
    return PoseGraph(odometry, edges), parts


def _segment_covariance(parts: Segments, node: int, by_frame: dict[int, RunFrame], placed: Sim3,
                        config: RefineConfig) -> np.ndarray:
    """[7, 7] the model's drift from segment node - 1 to segment node of one chunk, at the chunk's origin: a
    rotation and a scaling about the later segment's first camera, and a shift of a fraction of the earlier
    segment's path."""
    from_world = placed.inverse()
    centre = from_world.apply_to_points(by_frame[parts.first_frame[node]].c2w[:3, 3][None])[0]
    held = [f for f in range(parts.first_frame[node - 1], parts.first_frame[node] + 1) if f in by_frame]
    path = from_world.apply_to_points(np.stack([by_frame[f].c2w[:3, 3] for f in held]))
    length = float(np.linalg.norm(np.diff(path, axis=0), axis=1).sum()) if len(path) > 1 else 0.0
    turning = _rotation_about(centre)
    scaling = scaling_direction(centre)
    covariance = config.segment_rotation_sigma**2 * turning @ turning.T
    covariance += config.segment_log_scale_sigma**2 * np.outer(scaling, scaling)
    # a floor of 1e-3 of the segment's distance from the origin: a still camera has drift too
    shift = max(config.segment_translation_fraction * length, 1e-3 * max(float(np.linalg.norm(centre)), 1e-3))
    covariance[3:6, 3:6] += shift**2 / 3 * np.eye(3)
    return covariance


def with_stream_loops(found: Sequence[FrameLoop], stream: Iterable[tuple[int, int, LoopEdge]]) -> list[FrameLoop]:
    """The stream's loops ((earlier frame, query frame, edge): the map's) and those of `found` whose keyframe
    pairs are not among them (a pair measured twice would count twice), renumbered. The stream's are kept: a
    keyframe two chunks share is the earlier chunk's there (its first emission) and the later one's in the
    run's files, and an edge to each tells of a different chunk."""
    stream = [FrameLoop(0, earlier, query, edge) for earlier, query, edge in stream]
    pairs = {(loop.earlier_frame, loop.query_frame) for loop in stream}
    merged = stream + [loop for loop in found if (loop.earlier_frame, loop.query_frame) not in pairs]
    return [FrameLoop(n, loop.earlier_frame, loop.query_frame,
                      LoopEdge(n, loop.edge.first, loop.edge.second, loop.edge.first_from_second, loop.edge.sigmas,
                               loop.edge.metadata, loop.edge.covariance))
            for n, loop in enumerate(merged)]


def solve_fine(graph: PoseGraph, config: RefineConfig = RefineConfig()) -> PoseGraphResult:
    """The segment graph solved from scratch."""
    return PoseGraphSolver(config.pose_graph).solve(graph)


def frame_moves(frames: Sequence[RunFrame], parts: Segments, world_from_node: Sequence[Sim3],
                placement: Sequence[Sim3]) -> dict[int, Sim3]:
    """Each frame's move from the run's world to the refined one: its segment's solved pose over its chunk's
    placement, blended in the tangent between the two segments of its chunk whose middles it lies between."""
    moves = [solved @ placement[chunk].inverse() for solved, (chunk, _) in zip(world_from_node, parts.nodes,
                                                                                  strict=True)]
    matrices = lie.matrices(moves)  # [N, 4, 4]
    # each node to the next, in the tangent (used where both are of one chunk)
    steps = lie.logmap(lie.inverse(matrices[:-1]) @ matrices[1:]) if len(moves) > 1 else np.zeros((0, 7))
    indices = np.array([frame.frame_index for frame in frames], np.int64)
    node = np.array([parts.node_of[index] for index in indices], np.int64)
    chunk_of = np.array([chunk for chunk, _ in parts.nodes], np.int64)
    centre = np.asarray(parts.centre, np.float64)
    other = np.where(indices >= centre[node], node + 1, node - 1)
    inside = (other >= 0) & (other < len(moves))
    inside[inside] &= chunk_of[other[inside]] == chunk_of[node[inside]]
    low = np.minimum(node, other)[inside]
    span = np.maximum(centre[low + 1] - centre[low], 1e-9)
    weight = np.clip((indices[inside] - centre[low]) / span, 0.0, 1.0)
    blended = lie.to_sim3s(matrices[low] @ lie.expmap(weight[:, None] * steps[low]))
    out = {int(index): moves[n] for index, n in zip(indices[~inside], node[~inside], strict=True)}
    out.update(zip(indices[inside].tolist(), blended, strict=True))
    return out


# -- every keyframe indexed and checked -------------------------------------------------------------------
@dataclass(frozen=True)
class IndexedKeyframe:
    """A keyframe as retrieval and the checks take it: its features, descriptor and points."""

    frame_index: int
    chunk_index: int
    features: ImageFeatures
    descriptor: np.ndarray
    points: _KeyframePoints
    intrinsics: np.ndarray


@dataclass(frozen=True)
class CandidatePair:
    """A query keyframe and an earlier one retrieval found like it, and the segments each lies in."""

    query: int
    earlier: int
    similarity: float
    segments: tuple[int, int]  # (the query's, the earlier keyframe's)


def detect_loops(keyframes: Sequence[RunFrame], describe: Callable[[Sequence[int]], Sequence[np.ndarray]],
                 prepare: Callable[[int], IndexedKeyframe], segment_of: Mapping[int, int], placement: Sequence[Sim3],
                 config: RefineConfig = RefineConfig(), progress: Progress | None = None,
                 figures: RefineFigures | None = None, submit: Submit = at_once,
                 check: Callable[[IndexedKeyframe, IndexedKeyframe], Any] | None = None,
                 known: Collection[int] = (), streamed: Iterable[tuple[int, int]] = ()) -> list[FrameLoop]:
    """Every keyframe indexed (its picture's retrieval descriptor, keyframe_descriptor: `describe(frames)`, the
    descriptors of up to DESCRIBED_TOGETHER frames in a job), each
    one's retrieval among the earlier ones (chunks two or more back, as on the stream), and the candidates
    checked (geometric check, 3D agreement: closer.py's) segment pair by segment pair (`segment_of[frame]`), in
    shared_keyframes_first's order (`known`: the keyframes whose features the map keeps), until
    `config.loops_per_segment_pair` are verified, counting the stream's (`streamed`: the (earlier, query)
    keyframes of the map's verified loops, checked as these are), each segment joined to
    `config.partners_per_segment` earlier ones at most (_LoopChecks): each verified pair a loop edge in
    chunk coordinates (`placement[c]`: chunk c in the run's world). Features and points (`prepare(frame)`:
    indexed_keyframe of the keyframe in the run's world) are made once for each keyframe a check needs; the
    descriptors, those and the checks (`check(query, earlier)`, default verified_alignment here) are started
    through `submit`. Raises TimeoutError when no job has ended for JOB_STALL_S. figures.seconds gets, beside
    each stage's, the seconds the workers spent on preparing keyframes and on checks ("prepare_jobs",
    "check_jobs"): their sum over the stage's seconds is how many workers were busy on the average."""
    progress = progress or (lambda stage, done, total: None)
    figures = figures or RefineFigures()
    started = time.perf_counter()
    frames = [frame.frame_index for frame in keyframes]
    described = [submit(functools.partial(describe, frames[start:start + DESCRIBED_TOGETHER]))
                 for start in range(0, len(frames), DESCRIBED_TOGETHER)]
    descriptors = []
    for future in described:
        descriptors.extend(future.result(timeout=JOB_STALL_S))
        progress("keyframes", len(descriptors), len(keyframes))
    figures.keyframes_indexed = len(keyframes)
    figures.seconds["index"] = time.perf_counter() - started
    started = time.perf_counter()
    queues = shared_keyframes_first(candidate_pairs(keyframes, descriptors, segment_of,
                                                    config.closure.detection.retrieval), known)
    total = sum(len(queue) for queue in queues.values())
    check = check or functools.partial(verified_alignment, config=config.closure)
    before = Counter((segment_of[query], segment_of[earlier]) for earlier, query in streamed
                     if earlier in segment_of and query in segment_of)
    checks = _LoopChecks(queues, prepare, check, submit, config, lambda done: progress("loops", done, total), before)
    verified = checks.run()
    figures.seconds.update(prepare_jobs=checks.busy["prepared"], check_jobs=checks.busy["checked"])
    progress("loops", total, total)
    figures.pairs_retrieved, figures.pairs_checked, figures.keyframes_matched = total, checks.checked, len(checks.indexed)
    found = sorted((item for items in verified.values() for item in items),
                   key=lambda item: (item[0].query, item[0].earlier))
    indexed = checks.indexed
    loops = [FrameLoop(n, pair.earlier, pair.query,
                       loop_edge(n, indexed[pair.earlier].chunk_index, indexed[pair.query].chunk_index, alignment,
                                 placement, config.closure))
             for n, (pair, alignment) in enumerate(found)]
    figures.loops_verified = len(loops)
    figures.seconds["loops"] = time.perf_counter() - started
    return loops


class _LoopChecks:
    """The checks of every segment pair's candidates, each pair's in order of likeness and as many at a time as
    it lacks verified loops, the pairs side by side: a check starts once its two keyframes are prepared, and a
    pair's next candidate once one of its checks fails, so the workers never wait for the slowest job of a
    round (a round of every pair's next candidates took 47 s of a 10,000-frame refine, mostly its tail). Each
    pair checks the same candidates as it would alone, whatever the order jobs end in. A segment's pairs with
    earlier segments start most alike first, `partners_per_segment` at a time at most, the next once one ends
    without a loop: the pairs started are the shortest run of its partners holding that many verified ones,
    whatever the order jobs end in too. The bookkeeping is the caller's thread's alone; the workers only say
    what has ended (`_ended`)."""

    def __init__(self, queues: Mapping[tuple[int, int], deque[CandidatePair]], prepare: Callable[[int], IndexedKeyframe],
                 check: Callable[[IndexedKeyframe, IndexedKeyframe], Any], submit: Submit, config: RefineConfig,
                 checked_so_far: Callable[[int], None], verified_before: Mapping[tuple[int, int], int]) -> None:
        self.queues, self.prepare, self.check, self.submit, self.config = queues, prepare, check, submit, config
        self.verified_before = verified_before  # segment pair -> the stream's verified loops there
        self.checked_so_far = checked_so_far
        self.indexed: dict[int, IndexedKeyframe] = {}
        self.verified: dict[tuple[int, int], list[tuple[CandidatePair, Any]]] = {group: [] for group in queues}
        self.checked = 0
        self._preparing: dict[int, Future] = {}
        self._waiting: dict[int, list[CandidatePair]] = {}  # keyframe being prepared -> the pairs that need it
        self._running = {group: 0 for group in queues}  # candidates of a pair started, not yet checked
        self._ended: queue.SimpleQueue = queue.SimpleQueue()  # (kind, key, future) as jobs end, in any thread
        self.busy = {"prepared": 0.0, "checked": 0.0}  # seconds of the workers' on each kind of job
        self._busy_lock = threading.Lock()
        self.partners = _partners_in_order(queues)  # query segment -> its pairs, most alike first
        self._partners_started = Counter()  # query segment -> its pairs started
        self._joined = Counter()  # query segment -> its pairs ended with a loop (the stream's too)
        self._open = Counter()  # query segment -> its pairs started, not ended

    def run(self) -> dict[tuple[int, int], list[tuple[CandidatePair, Any]]]:
        for segment in self.partners:
            self._start_partners(segment)
        while any(self._running.values()):
            try:
                kind, key, future = self._ended.get(timeout=JOB_STALL_S)
            except queue.Empty:
                raise TimeoutError(f"no loop check of refine's ended in {JOB_STALL_S:.0f} s") from None
            if kind == "prepared":
                self._prepared(key, future.result())
            else:
                self._checked(key, future.result())
        return self.verified

    def _start_partners(self, segment: int) -> None:
        groups = self.partners[segment]
        while (self._partners_started[segment] < len(groups)
               and self._joined[segment] + self._open[segment] < self.config.partners_per_segment):
            group = groups[self._partners_started[segment]]
            self._partners_started[segment] += 1
            if self._wanted(group) <= 0:  # the stream's loops join it already
                self._joined[segment] += 1
                continue
            self._open[segment] += 1
            self._start_next(group)

    def _wanted(self, group: tuple[int, int]) -> int:
        return self.config.loops_per_segment_pair - self.verified_before.get(group, 0)

    def _start_next(self, group: tuple[int, int]) -> None:
        wanted = self._wanted(group)
        while self.queues[group] and len(self.verified[group]) + self._running[group] < wanted:
            pair = self.queues[group].popleft()
            self._running[group] += 1
            missing = [frame for frame in (pair.query, pair.earlier) if frame not in self.indexed]
            for frame in missing:
                self._waiting.setdefault(frame, []).append(pair)
                if frame not in self._preparing:
                    self._preparing[frame] = self._watched("prepared", frame, functools.partial(self.prepare, frame))
            if not missing:
                self._check(pair)

    def _prepared(self, frame: int, keyframe: IndexedKeyframe) -> None:
        self.indexed[frame] = keyframe
        for pair in self._waiting.pop(frame, []):
            if pair.query in self.indexed and pair.earlier in self.indexed:
                self._check(pair)

    def _check(self, pair: CandidatePair) -> None:
        self._watched("checked", pair, functools.partial(self.check, self.indexed[pair.query],
                                                         self.indexed[pair.earlier]))

    def _checked(self, pair: CandidatePair, alignment: Any) -> None:
        self.checked += 1
        self._running[pair.segments] -= 1
        if alignment is not None:
            self.verified[pair.segments].append((pair, alignment))
        self.checked_so_far(self.checked)
        group = pair.segments
        self._start_next(group)
        verified = len(self.verified[group])
        if self._running[group] == 0 and (verified >= self._wanted(group) or not self.queues[group]):
            self._open[group[0]] -= 1  # (once: nothing of the pair runs or is left to start)
            self._joined[group[0]] += int(verified > 0)
            self._start_partners(group[0])

    def _watched(self, kind: str, key: Any, job: Callable[[], Any]) -> Future:
        future = self.submit(functools.partial(self._timed, kind, job))
        future.add_done_callback(lambda done: self._ended.put((kind, key, done)))  # unbounded-ok: never waits
        return future

    def _timed(self, kind: str, job: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        try:
            return job()
        finally:
            with self._busy_lock:
                self.busy[kind] += time.perf_counter() - started


def _partners_in_order(queues: Mapping[tuple[int, int], deque[CandidatePair]]) -> dict[int, list[tuple[int, int]]]:
    """Each query segment's pairs with earlier segments, by their most alike candidate, the most alike first."""
    partners: dict[int, list[tuple[int, int]]] = {}
    best = {group: max((pair.similarity for pair in pairs), default=-1.0) for group, pairs in queues.items()}
    for group in sorted(queues, key=lambda group: (-best[group], group)):
        partners.setdefault(group[0], []).append(group)
    return partners


def candidate_pairs(keyframes: Sequence[RunFrame], descriptors: Sequence[np.ndarray], segment_of: Mapping[int, int],
                    retrieval: RetrievalConfig) -> dict[tuple[int, int], deque[CandidatePair]]:
    """Each keyframe's retrieval among the earlier ones, as it would have been on the stream, the pairs gathered
    by segment pair (query's, earlier's), the most alike first."""
    index = KeyframeIndex(len(descriptors[0]) if descriptors else 128)
    pairs = []
    for frame, descriptor in sorted(zip(keyframes, descriptors, strict=True), key=lambda item: item[0].frame_index):
        for candidate in index.candidates(descriptor, frame.chunk_index, retrieval):
            segments = (segment_of[frame.frame_index], segment_of[candidate.frame_index])
            pairs.append(CandidatePair(frame.frame_index, candidate.frame_index, candidate.similarity, segments))
        index.add(descriptor, frame.frame_index, frame.chunk_index)
    queues: dict[tuple[int, int], deque[CandidatePair]] = {}
    for pair in sorted(pairs, key=lambda pair: (-pair.similarity, pair.query, pair.earlier)):
        queues.setdefault(pair.segments, deque()).append(pair)
    return queues


# Candidates of a segment pair within this much of its most alike one's similarity count as alike: the
# descriptor only ranks, the check decides (a fixture's true loops scored 0.51-0.77 and two thirds of its unrelated
# pairs >= 0.4), so among them the one whose keyframes other pairs check too goes first. A keyframe's SIFT is
# ~120 ms of a core and a check ~13 ms: a 10,000-frame refine computed 3,561 SIFTs for its 3,617 checks, and
# 3,442 for 4,060 in this order (its near-equals share few keyframes; the less alike fail more).
SHARED_MARGIN = 0.1


def shared_keyframes_first(queues: Mapping[tuple[int, int], deque[CandidatePair]], known: Collection[int] = (),
                           margin: float = SHARED_MARGIN) -> dict[tuple[int, int], deque[CandidatePair]]:
    """Each segment pair's candidates (most alike first) reordered so that the pairs check fewer keyframes in
    all: the candidates within `margin` of the pair's most alike go first, those whose two keyframes are
    planned (`known`, or chosen first by a pair before) ahead, each group most alike first; the rest after, as
    they were. A pair's first candidate is chosen greedily, the pairs with fewest alike candidates first: the
    one with most keyframes planned, then whose keyframes most pairs could share, then the most alike."""
    alike = {group: [pair for pair in pairs if pair.similarity >= pairs[0].similarity - margin]
             for group, pairs in queues.items() if pairs}
    demand = Counter(frame for pairs in alike.values() for pair in pairs for frame in (pair.query, pair.earlier))
    planned = set(known)

    def held(pair: CandidatePair) -> int:
        return (pair.query in planned) + (pair.earlier in planned)

    for group in sorted(alike, key=lambda group: (len(alike[group]), group)):
        first = max(alike[group], key=lambda pair: (held(pair), demand[pair.query] + demand[pair.earlier],
                                                    pair.similarity, -pair.query, -pair.earlier))
        planned.update((first.query, first.earlier))
    ordered = {}
    for group, pairs in queues.items():
        head = sorted(alike.get(group, []), key=lambda pair: (-held(pair), -pair.similarity, pair.query, pair.earlier))
        ordered[group] = deque(head + list(pairs)[len(head):])
    return ordered


def saved_features(saved: SavedMap, config: LoopClosureConfig) -> dict[int, ImageFeatures]:
    """The SIFT features of the keyframes the stream indexed, by frame, as its map keeps them, where the map's
    features are `config`'s: the same picture's, so the same (a SIFT of a 518 x 392 picture: ~120 ms of a
    core); none from a map of other features."""
    if saved.manifest.features != features_name(config.detection.features):
        return {}
    return {keyframe.frame_index: ImageFeatures(keyframe.keypoints, keyframe.descriptors) for keyframe in saved.keyframes}


def keyframe_descriptor(image: np.ndarray) -> np.ndarray:
    """[128] the retrieval descriptor of a keyframe's picture [H, W, 3] (the stream's weight-free one)."""
    return gradient_grid_descriptor(image)


def indexed_keyframe(keyframe: Keyframe, config: LoopClosureConfig,
                     features: ImageFeatures | None = None) -> IndexedKeyframe:
    """Its SIFT features (`features` where they are known already: `saved_features`), the weight-free
    descriptor of its picture and the points behind its keypoints."""
    features = features if features is not None else extract_features(keyframe.image, config.detection.features)
    points, median_depth = keypoint_points(features.keypoints, keyframe.depth, keyframe.depth_conf,
                                           keyframe.intrinsics, keyframe.c2w, config.min_confidence)
    centre = np.asarray(keyframe.c2w, np.float64)[:3, 3]
    return IndexedKeyframe(keyframe.frame_index, keyframe.chunk_index, features, keyframe_descriptor(keyframe.image),
                           _KeyframePoints(points, median_depth, centre), np.asarray(keyframe.intrinsics, np.float64))


def verified_alignment(query: IndexedKeyframe, earlier: IndexedKeyframe, config: LoopClosureConfig) -> Any:
    """The pair's 3D alignment when it passes the geometric check and agrees in 3D, else None."""
    check = check_pair(query.features, earlier.features, query.intrinsics, earlier.intrinsics, config.detection.check)
    if not check.passed:
        return None
    alignment = align_loop(query.points, earlier.points, check.inlier_matches, config)
    return alignment if alignment.passed else None


__all__ = ["CandidatePair", "FrameLoop", "ImageFeatures", "IndexedKeyframe", "candidate_pairs", "indexed_keyframe", "keyframe_descriptor", "saved_features", "shared_keyframes_first", "verified_alignment", "RefineConfig", "JOB_STALL_S", "Submit", "at_once", "RefineFigures", "RunFrame", "Segments", "detect_loops", "fine_graph",
           "frame_moves", "segments_of", "solve_fine", "with_stream_loops"]
