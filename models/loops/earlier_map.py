"""An earlier recording's map that a new stream extends (`stream-recon run VIDEO --map RUN`).

The earlier map is fixed: its keyframes (retrieval descriptor, SIFT features, the world point behind each
keypoint) are taken in the map's frame, the frame of the earlier run's outputs (each chunk's points moved
by that run's last solve where it corrected its files, `SavedMap.placement`). The new stream's keyframes are
looked up among them as well as among the stream's own (`MapExtension.checked`); a pair that passes the
geometric check and agrees in 3D (closer.align_loop, query in the stream's emitted world, earlier keyframe
in the map's frame) is a loop to the map.

The pose graph then gets one node more, in front: node 0 is the map's frame (the anchor, fixed as node 0
always is), node c + 1 the stream's chunk c. A loop to the map is an edge from node 0; the stream's own
links and loops shift by one. Node 0 and the stream's first chunk are joined by the placement the first
loop to the map measured (the Sim(3) from the stream's world to the map's), with sigmas so loose
(`PLACEMENT_SIGMA`) that it only starts the solver: where the stream lies in the map is what the loops to
the map say, together with its odometry. Until a loop to the map is accepted the stream stays in a frame of
its own (`ChunkCorrections` relative to its first chunk, as without a map).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..stream.chunks import ChunkLink
from ..stream.similarity import Sim3
from .closer import LoopAlignment, LoopClosureConfig, _judged, _KeyframePoints, graph_of, loop_edge
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
    """An earlier run's map, fixed: where it was read from and its keyframes in its frame."""

    path: str
    keyframes: tuple[MapKeyframe, ...]


def earlier_map_of(saved: SavedMap, placement: Sequence[Sim3]) -> EarlierMap:
    """The keyframes of `saved` in the map's frame: chunk c's emitted points moved by placement[c] (chunk c in
    the earlier run's outputs) over its open-chain placement."""
    chain = saved.open_chain()
    keyframes = []
    for keyframe in saved.keyframes:
        move = placement[keyframe.chunk_index] @ chain[keyframe.chunk_index].inverse()
        points = _KeyframePoints(move.apply_to_points(keyframe.points), keyframe.median_depth * move.scale,
                                 move.apply_to_points(np.asarray(keyframe.c2w, np.float64)[:3, 3][None])[0])
        keyframes.append(MapKeyframe(keyframe.frame_index, keyframe.chunk_index, keyframe.descriptor,
                                     ImageFeatures(keyframe.keypoints, keyframe.descriptors),
                                     np.asarray(keyframe.intrinsics, np.float64), points))
    return EarlierMap(str(saved.path), tuple(keyframes))


@dataclass(frozen=True)
class _MapLoop:
    edge: LoopEdge  # from node 0 (the map's frame) to the stream's chunk + 1
    query_frame: int


class MapExtension:
    """A new stream's loops to an earlier map and the pose graph that places the stream in it (see the module
    docstring). The loop closer (closer.py) asks it for candidates, hands it each verified loop to the map,
    and solves through it."""

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
        self._loops: list[_MapLoop] = []
        self._placement: Sim3 | None = None  # the first loop's: the stream's world -> the map's frame
        self._solver: PoseGraphSolver | None = None
        self._accepted: tuple[Any, ...] = ()

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

    def add_loop(self, loop_id: Any, query_frame: int, query_chunk: int, alignment: LoopAlignment,
                 chain: Sequence[Sim3], links: Sequence[ChunkLink]) -> LoopEdge:
        """A verified loop to the map (`alignment`: the map's frame from the stream's emitted world near chunk
        `query_chunk`, placed by chain[query_chunk]); the first one places the stream.

        The map is fixed but not exact: where it put the keyframe is off by about what one chunk's link
        leaves uncertain (its own solve's error between loops), which the edge's covariance takes on as the
        query chunk's link declares it (the stream's chunks drift as the map's did); without it, loops to
        two parts of the map disagree by the map's error and the pose graph rejects the stream's first ones."""
        if self._placement is None:
            self._placement = alignment.earlier_from_query
        edge = loop_edge(loop_id, 0, query_chunk + 1, alignment, [Sim3.identity(), *chain], self.config)
        link = links[max(query_chunk, 1) - 1] if links else None
        if link is not None:
            covariance = edge.covariance + (link.covariance if link.covariance is not None
                                            else np.diag(np.square(link.sigmas)))
            edge = replace(edge, sigmas=np.sqrt(np.diag(covariance)), covariance=covariance)
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
        """The stream's graph (closer.graph_of) with the map's frame in front as node 0."""
        own = graph_of(links, loops)
        placement = OdometryEdge(self._placement, PLACEMENT_SIGMA)
        shifted = [replace(loop, first=loop.first + 1, second=loop.second + 1) for loop in own.loops]
        to_map = [loop.edge for loop in self._loops if loop.edge.second <= len(own.odometry) + 1]
        return PoseGraph((placement, *own.odometry), (*shifted, *to_map))

    def solve(self, links: Sequence[ChunkLink], loops: Sequence[LoopEdge],
              ) -> tuple[PoseGraph, PoseGraphResult]:
        """The graph with the map solved; its own solver, kept between the solves as the stream's is."""
        if self._solver is None:
            self._solver = PoseGraphSolver(self.config.pose_graph)
        graph = self.graph(links, loops)
        result = self._solver.solve(graph)
        to_map = {loop.edge.loop_id for loop in self._loops}
        self._accepted = tuple(i for i in result.accepted_ids if i in to_map)
        return graph, result

    def corrections(self, graph: PoseGraph, result: PoseGraphResult, records: Sequence[LoopRecord],
                    version: int) -> ChunkCorrections:
        """The moves of the stream's emissions: into the map's frame once a loop to it is accepted, else into
        the stream's own solved frame (its first chunk's, as without a map); nothing moves while no loop at
        all is accepted."""
        stream_chain = open_chain(graph.odometry[1:])
        solved = result.world_from_chunk
        if result.is_open_chain:
            by_chunk: dict[int, Sim3] = {}
        else:
            frame = Sim3.identity() if self.placed else solved[1].inverse()
            by_chunk = {chunk: frame @ solved[chunk + 1] @ placed.inverse()
                        for chunk, placed in enumerate(stream_chain)}
        verdicts = {verdict.loop_id: verdict.accepted for verdict in result.loops}
        return ChunkCorrections(by_chunk, tuple(_judged(record, verdicts, by_chunk) for record in records), version)

    def world_from_chunk(self, result: PoseGraphResult) -> list[Sim3]:
        """The stream's chunks as the solve places them (the map's frame once placed), for the saved map."""
        solved = list(result.world_from_chunk[1:])
        return solved if self.placed else [solved[0].inverse() @ placed for placed in solved]

    def summary(self) -> dict[str, Any]:
        """run.json's account of the map: where it is, whether the stream was placed in it, when, and how."""
        accepted = [loop for loop in self._loops if loop.edge.loop_id in self._accepted]
        summary: dict[str, Any] = {"path": self.earlier.path, "keyframes": len(self.earlier.keyframes),
                                   "loops_verified": len(self._loops), "loops_accepted": len(accepted),
                                   "placed": self.placed}
        if accepted:
            summary["placed_at_frame"] = min(loop.query_frame for loop in accepted)
        else:
            summary["note"] = never_placed_line(self.earlier.path, len(self._loops))
        return summary


def never_placed_line(path: str, verified: int) -> str:
    """The one line a stream that never matched its map gets."""
    found = "no keyframe of this stream matched it" if verified == 0 else \
        f"the pose graph accepted none of the {verified} loops verified to it"
    return f"the stream was never placed in the map {path}: {found}; its outputs are in a frame of their own"


__all__ = ["EarlierMap", "MapExtension", "MapKeyframe", "earlier_map_of", "never_placed_line"]
