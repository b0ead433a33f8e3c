"""Loop closure beside a chunked stream: what the stream's consumers see of it (NumPy only; the closer
that makes them, with OpenCV and GTSAM, is models/loop_closer.py).

`ChunkCorrections` is what a solved pose graph means for the outputs: for each chunk, the Sim(3) that
moves its emitted predictions (chunk 0's coordinates as the open chain placed them) to where the
graph puts them. `LoopRecord` is one loop candidate's story, from retrieval to the graph's verdict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..stream.similarity import Sim3

# What became of a candidate pair: the geometric check refused it, the 3D agreement of the two chunks'
# depths refused it, the pose graph rejected it, or the pose graph accepted it (pending: not solved yet).
LOOP_STATUSES = ("rejected_by_check", "rejected_by_verification", "pending", "rejected_by_graph", "accepted")


@dataclass(frozen=True)
class LoopRecord:
    """One retrieved pair (query keyframe, earlier keyframe) and what became of it."""

    loop_id: int
    query_frame: int
    query_chunk: int
    candidate_frame: int
    candidate_chunk: int
    similarity: float  # the retrieval descriptors' cosine
    matches: int  # mutual ratio-test feature matches
    inliers: int  # of them, consistent with the epipolar geometry
    status: str  # one of LOOP_STATUSES
    verification: dict[str, Any] = field(default_factory=dict)  # the 3D agreement's figures, when it ran
    correction: dict[str, float] = field(default_factory=dict)  # the graph's move of the query's chunk
    # the earlier keyframe is an earlier run's, in the map the stream extends (earlier_map.py): candidate_frame
    # and candidate_chunk are that run's
    in_map: bool = False

    def as_json(self) -> dict[str, Any]:
        return {
            "loop_id": self.loop_id, "query_frame": self.query_frame, "query_chunk": self.query_chunk,
            "candidate_frame": self.candidate_frame, "candidate_chunk": self.candidate_chunk,
            "similarity": round(float(self.similarity), 4), "matches": self.matches, "inliers": self.inliers,
            "status": self.status, "verification": self.verification, "correction": self.correction,
            **({"in_map": True} if self.in_map else {}),
        }


@dataclass(frozen=True)
class ChunkCorrections:
    """A solved pose graph as moves of the emitted predictions.

    `by_chunk[c]` maps chunk c's emitted world coordinates (the open chain's) to the corrected world;
    chunks past the last solved one hang on it by their odometry, so they move with it (`for_chunk`).
    Empty `by_chunk`: no loop accepted, nothing moves (the open chain stands, bit for bit).
    """

    by_chunk: dict[int, Sim3]
    loops: tuple[LoopRecord, ...] = ()
    version: int = 0  # increases with every solve that changed anything

    @property
    def is_identity(self) -> bool:
        return not self.by_chunk

    def for_chunk(self, chunk_index: int) -> Sim3:
        if not self.by_chunk:
            return Sim3.identity()
        last = max(self.by_chunk)
        return self.by_chunk[min(chunk_index, last)]

    @property
    def accepted_loops(self) -> tuple[LoopRecord, ...]:
        return tuple(loop for loop in self.loops if loop.status == "accepted")

    def corrected_c2w(self, chunk_index: int, c2w: np.ndarray) -> np.ndarray:
        """[..., 3, 4] camera-to-world of chunk `chunk_index`'s emissions -> corrected."""
        return self.for_chunk(chunk_index).apply_to_poses(c2w)
