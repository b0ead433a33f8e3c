"""An earlier recording's map that a new stream extends (`stream-recon run VIDEO --map RUN`).

The earlier map's keyframes (retrieval descriptor, SIFT features, the world point behind each keypoint) are
taken in the map's frame, the frame of the earlier run's outputs (each chunk's points moved by that run's
last solve where it corrected its files, `SavedMap.placement`). The new stream's keyframes are looked up
among them as well as among the stream's own (`MapExtension.checked`); a pair that passes the geometric
check and agrees in 3D (closer.align_loop, query in the stream's emitted world, earlier keyframe in the
map's frame) is a loop to the map.

Once the stream has a loop to the map, both recordings are solved as one pose graph: nodes 0 .. M - 1 are
the map's M chunks, with the earlier run's own links (odometry, with their covariances) and its loops
(those its last solve accepted; all it verified when it never finished), node M + c the stream's chunk c,
with its links and loops. A loop to the map joins the map's chunk that holds the matched keyframe to the
stream's chunk. The map is not fixed: a map's solve is only as good as its loops, and a map drifted
between two places it visited (a desk circled once: its ends ~0.2 m and 5 % of scale apart) makes the
stream's loops to both places disagree, so that a fixed map has the graph reject the stream's first ones.
No prior holds the map's chunks at its last solve: that solve is the solution of the same links and
loops, which hold its chunks there as firmly as its evidence allows, and new loops move them where they
say. The map's last chunk and the stream's first are joined by the placement the first loop to the map
measured, with sigmas so loose (`PLACEMENT_SIGMA`) that it only starts the solver: where the stream lies
in the map is what the loops to the map say, together with the two recordings' odometry and loops.

Node 0 is the map's chunk 0, at `placement[0]` in the map's frame. Once a loop to the map is accepted the
stream's outputs are in the map's frame; until then in a frame of their own (`ChunkCorrections` relative
to its first chunk, as without a map). The earlier run's files are never written: how far the joint solve
moved its chunks from where its outputs put them is in the summary (`map_moved`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..stream.chunks import ChunkLink
from ..stream.similarity import Sim3
from .closer import (
    LoopAlignment,
    LoopClosureConfig,
    _judged,
    _KeyframePoints,
    align_loop,
    graph_of,
    loop_edge,
)
from .corrections import ChunkCorrections, LoopRecord
from .detection import CheckedCandidate
from .geometric_check import ImageFeatures, check_pair
from .pose_graph import LoopEdge, OdometryEdge, PoseGraph, PoseGraphResult, PoseGraphSolver, open_chain
from .retrieval import KeyframeIndex, LoopCandidate
from .saved_map import SavedMap

# The placement edge's sigmas (rotation rad, translation in the stream's first chunk's units, log scale):
# a thousand times any drift a chunk has, so that no solve is pulled towards the first loop's placement.
PLACEMENT_SIGMA = 1e3


@dataclass(frozen=True)
class MapKeyframe:
    """One keyframe of the earlier map as the new stream checks against it, in the map's frame."""

    frame_index: int  # the earlier run's numbering
    chunk_index: int
    descriptor: np.ndarray  # [D] float32
    features: ImageFeatures
    intrinsics: np.ndarray  # [3, 3]
    points: _KeyframePoints  # the map's frame


@dataclass(frozen=True)
class EarlierMap:
    """An earlier run's map: where it was read from, its keyframes in its frame, and its pose graph."""

    path: str
    keyframes: tuple[MapKeyframe, ...]
    placement: tuple[Sim3, ...]  # each chunk in the map's frame (the earlier run's outputs)
    links: tuple[OdometryEdge, ...]  # links[c - 1]: its chunk c on chunk c - 1, as its stream measured it
    loops: tuple[LoopEdge, ...]  # between its chunks, ids ("map", its loop id)


def earlier_map_of(saved: SavedMap, placement: Sequence[Sim3]) -> EarlierMap:
    """The keyframes of `saved` in the map's frame (chunk c's emitted points moved by placement[c], chunk c in
    the earlier run's outputs, over its open-chain placement), its links, and the loops its last solve
    accepted (every verified one where it never finished)."""
    chain = saved.open_chain()
    keyframes = []
    for keyframe in saved.keyframes:
        move = placement[keyframe.chunk_index] @ chain[keyframe.chunk_index].inverse()
        points = _KeyframePoints(move.apply_to_points(keyframe.points), keyframe.median_depth * move.scale,
                                 move.apply_to_points(np.asarray(keyframe.c2w, np.float64)[:3, 3][None])[0])
        keyframes.append(MapKeyframe(keyframe.frame_index, keyframe.chunk_index, keyframe.descriptor,
                                     ImageFeatures(keyframe.keypoints, keyframe.descriptors),
                                     np.asarray(keyframe.intrinsics, np.float64), points))
    links = tuple(OdometryEdge(Sim3.from_matrix(previous_from_next), np.sqrt(np.diag(covariance)), covariance)
                  for previous_from_next, covariance in saved.links[:saved.num_chunks - 1])
    kept = [loop for loop in saved.loops if not saved.complete or loop.loop_id in saved.accepted]
    loops = tuple(LoopEdge(("map", loop.loop_id), loop.first, loop.second, Sim3.from_matrix(loop.first_from_second),
                           np.sqrt(np.diag(loop.covariance)), covariance=loop.covariance) for loop in kept)
    return EarlierMap(str(saved.path), tuple(keyframes), tuple(placement[:saved.num_chunks]), links, loops)


@dataclass(frozen=True)
class _MapLoop:
    edge: LoopEdge  # from the map's chunk to the stream's chunk, numbered as the joint graph numbers them
    query_frame: int


class MapExtension:
    """A new stream's loops to an earlier map and the pose graph of both recordings that places the stream in
    it (see the module docstring). The loop closer (closer.py) asks it for candidates, hands it each verified
    loop to the map, and solves through it."""

    def __init__(self, earlier: EarlierMap, config: LoopClosureConfig = LoopClosureConfig()):
        self.earlier = earlier
        self.config = config
        self._by_frame = {keyframe.frame_index: keyframe for keyframe in earlier.keyframes}
        dim = len(earlier.keyframes[0].descriptor) if earlier.keyframes else 128
        self._index = KeyframeIndex(dim)
        for keyframe in earlier.keyframes:
            self._index.add(keyframe.descriptor, keyframe.frame_index, keyframe.chunk_index)
        # a query counts as this many chunks after every map keyframe: the whole map is eligible
        self._after_every_chunk = max((k.chunk_index for k in earlier.keyframes), default=0) + \
            config.detection.retrieval.excluded_chunks
        self._map_chunks = len(earlier.placement)  # the stream's chunk c is the joint graph's node M + c
        self._loops: list[_MapLoop] = []
        self._placement: OdometryEdge | None = None  # the map's last chunk -> the stream's first, loose
        self._first_scale = 1.0  # the first loop's: the map's frame per unit of the stream's world
        self._solver: PoseGraphSolver | None = None
        self._accepted: tuple[Any, ...] = ()
        self._moved: dict[str, float] = {}

    def checked(self, query_frame: int, query_chunk: int, descriptor: np.ndarray, features: ImageFeatures,
                intrinsics: np.ndarray | None) -> list[CheckedCandidate]:
        """The map's keyframes that look like the query, each with its geometric check (best retrieval first)."""
        candidates = self._index.candidates(descriptor, self._after_every_chunk, self.config.detection.retrieval)
        return [CheckedCandidate(query_frame, query_chunk, candidate,
                                 check_pair(features, self._by_frame[candidate.frame_index].features, intrinsics,
                                            self._by_frame[candidate.frame_index].intrinsics,
                                            self.config.detection.check))
                for candidate in candidates]

    def points(self, candidate: LoopCandidate) -> _KeyframePoints:
        return self._by_frame[candidate.frame_index].points

    def align(self, query: _KeyframePoints, earlier: _KeyframePoints, inlier_matches: np.ndarray) -> LoopAlignment:
        """closer.align_loop for a query and a map keyframe, its scale judged against the stream's placement.

        Each recording's world has its first chunk's depth normalisation, so the two worlds differ in scale
        by any amount: the first loop to the map is taken at the scale it fits, and each later one must be
        within the loop closer's `max_scale_change` of the first one's (the stream's drift and the map's
        are a few % per chunk; a repeated structure at another size is not)."""
        unbounded = replace(self.config, max_scale_change=np.inf)
        alignment = align_loop(query, earlier, inlier_matches, unbounded)
        if alignment.passed and self._placement is not None:
            change = alignment.earlier_from_query.scale / self._first_scale
            bound = self.config.max_scale_change
            alignment = replace(alignment, passed=1.0 / bound <= change <= bound)
        return alignment

    def add_loop(self, loop_id: Any, query_frame: int, map_chunk: int, query_chunk: int, alignment: LoopAlignment,
                 chain: Sequence[Sim3]) -> LoopEdge:
        """A verified loop to the map (`alignment`: the map's frame from the stream's emitted world, the map's
        keyframe in its chunk `map_chunk`, the query in the stream's chunk `query_chunk`, placed by
        chain[query_chunk]); the first one places the stream's first chunk for the solver to start from."""
        placement = self.earlier.placement
        if self._placement is None:
            # the stream's first chunk where this loop puts it, relative to the map's last chunk as its open
            # chain places both (the solver starts from the open chain)
            map_chain = open_chain(self.earlier.links)
            last_from_stream = map_chain[-1].inverse() @ map_chain[map_chunk] @ placement[map_chunk].inverse() @ \
                alignment.earlier_from_query
            self._placement = OdometryEdge(last_from_stream, PLACEMENT_SIGMA)
            self._first_scale = alignment.earlier_from_query.scale
        edge = loop_edge(loop_id, map_chunk, self._map_chunks + query_chunk, alignment, [*placement, *chain],
                         self.config)
        self._loops.append(_MapLoop(edge, query_frame))
        return edge

    @property
    def has_loops(self) -> bool:
        return bool(self._loops)

    @property
    def placed(self) -> bool:
        """Whether the last solve accepted a loop to the map: the stream is then in the map's frame."""
        return bool(self._accepted)

    def graph(self, links: Sequence[ChunkLink], loops: Sequence[LoopEdge]) -> PoseGraph:
        """Both recordings' graph: the map's chunks, then the stream's (closer.graph_of) shifted behind them."""
        own = graph_of(links, loops)
        shift = self._map_chunks
        shifted = [replace(loop, first=loop.first + shift, second=loop.second + shift) for loop in own.loops]
        to_map = [loop.edge for loop in self._loops if loop.edge.second < shift + own.num_chunks]
        return PoseGraph((*self.earlier.links, self._placement, *own.odometry),
                         (*self.earlier.loops, *shifted, *to_map))

    def solve(self, links: Sequence[ChunkLink], loops: Sequence[LoopEdge],
              ) -> tuple[PoseGraph, PoseGraphResult]:
        """The joint graph solved; its own solver, kept between the solves as the stream's is."""
        if self._solver is None:
            self._solver = PoseGraphSolver(self.config.pose_graph)
        graph = self.graph(links, loops)
        result = self._solver.solve(graph)
        to_map = {loop.edge.loop_id for loop in self._loops}
        self._accepted = tuple(i for i in result.accepted_ids if i in to_map)
        if not result.is_open_chain:
            self._moved = self._map_moved(result.world_from_chunk[:self._map_chunks])
        return graph, result

    def _map_moved(self, solved: Sequence[Sim3]) -> dict[str, float]:
        """How far the joint solve puts the map's chunks from where the earlier run's outputs have them."""
        frame = self.earlier.placement[0]
        moves = [(frame @ now) @ before.inverse() for now, before in zip(solved, self.earlier.placement, strict=True)]
        return {"max_translation": round(max(float(np.linalg.norm(move.translation)) for move in moves), 6),
                "max_rotation_deg": round(max(move.rotation_deg for move in moves), 4),
                "max_log_scale": round(max(abs(float(np.log(move.scale))) for move in moves), 6)}

    def stream_world_from_chunk(self, result: PoseGraphResult) -> list[Sim3]:
        """The stream's chunks as the solve places them: in the map's frame once placed, else in the stream's
        own (its first chunk's)."""
        solved = result.world_from_chunk[self._map_chunks:]
        frame = self.earlier.placement[0] if self.placed else solved[0].inverse()
        return [frame @ placed for placed in solved]

    def stream_result(self, result: PoseGraphResult) -> PoseGraphResult:
        """`result` as the stream's saved map records it: its chunks only, the map's own loops left out."""
        own = {loop.loop_id for loop in self.earlier.loops}
        return replace(result, world_from_chunk=tuple(self.stream_world_from_chunk(result)),
                       loops=tuple(verdict for verdict in result.loops if verdict.loop_id not in own))

    def corrections(self, graph: PoseGraph, result: PoseGraphResult, records: Sequence[LoopRecord],
                    version: int) -> ChunkCorrections:
        """The moves of the stream's emissions (see `stream_world_from_chunk`); nothing moves while no loop of
        the stream's, to the map or its own, is accepted."""
        stream_chain = open_chain(graph.odometry[self._map_chunks:])
        own = {loop.loop_id for loop in self.earlier.loops}
        by_chunk: dict[int, Sim3] = {}
        if any(loop_id not in own for loop_id in result.accepted_ids):
            by_chunk = {chunk: placed @ stream_chain[chunk].inverse()
                        for chunk, placed in enumerate(self.stream_world_from_chunk(result))}
        verdicts = {verdict.loop_id: verdict.accepted for verdict in result.loops}
        return ChunkCorrections(by_chunk, tuple(_judged(record, verdicts, by_chunk) for record in records), version)

    def summary(self) -> dict[str, Any]:
        """run.json's account of the map: where it is, whether the stream was placed in it, when, and how far
        the joint solve moved the map's chunks from its outputs."""
        accepted = [loop for loop in self._loops if loop.edge.loop_id in self._accepted]
        summary: dict[str, Any] = {"path": self.earlier.path, "keyframes": len(self.earlier.keyframes),
                                   "loops_verified": len(self._loops), "loops_accepted": len(accepted),
                                   "placed": self.placed}
        if accepted:
            summary["placed_at_frame"] = min(loop.query_frame for loop in accepted)
            summary["map_moved"] = dict(self._moved)
        else:
            summary["note"] = never_placed_line(self.earlier.path, len(self._loops))
        return summary


def never_placed_line(path: str, verified: int) -> str:
    """The one line a stream that never matched its map gets."""
    found = "no keyframe of this stream matched it" if verified == 0 else \
        f"the pose graph accepted none of the {verified} loops verified to it"
    return f"the stream was never placed in the map {path}: {found}; its outputs are in a frame of their own"


__all__ = ["EarlierMap", "MapExtension", "MapKeyframe", "earlier_map_of", "never_placed_line"]
