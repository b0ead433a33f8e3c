"""The pose graph as data: its edges (odometry, loop) with their uncertainties, the graph snapshot a solve
takes, the open chain, and what a solve is asked (`PoseGraphSettings`) and answers (`LoopVerdict`,
`PoseGraphResult`). The conventions of an edge and its error are pose_graph.py's docstring's.

Its own module because it is what the loop closer, the refine and the solver hand each other, and it needs
no GTSAM: the solver (pose_graph.py) and the conversions to GTSAM's types (gtsam_sim3.py) are apart.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..stream.similarity import Sim3
from . import sim3_batch as lie

TANGENT_DIM = lie.TANGENT_DIM  # rotation (3), translation (3), log scale (1): GTSAM's Similarity3 tangent order


# -- edges and the graph ---------------------------------------------------------------------------
def as_sigmas(sigmas: float | Sequence[float] | np.ndarray) -> np.ndarray:
    """A scalar (the same for all seven components) or seven standard deviations -> [7] float64, read-only."""
    values = np.broadcast_to(np.asarray(sigmas, np.float64), (TANGENT_DIM,)).copy()
    if not np.all(np.isfinite(values) & (values > 0)):
        raise ValueError(f"sigmas must be finite and positive, got {values.tolist()}")
    values.setflags(write=False)
    return values


# A covariance's eigenvalues are kept at least this fraction of its largest. One positive definite but for
# rounding (condition numbers past 1e15: a chunk alignment over frames that hardly moved) has eigenvalues
# whose sign rounding decides, and could pass in the process that made it and fail in the one that reads
# it from a saved map; lifted to 1e-12 of the largest, every process reads the same positive-definite
# matrix. An eigenvalue below minus this fraction (far past rounding's 1e-16) is a matrix that is not one.
MIN_EIGENVALUE_RATIO = 1e-12


def as_covariance(covariance: np.ndarray | None, sigmas: np.ndarray) -> np.ndarray | None:
    """None, or a [7, 7] symmetric positive-definite covariance whose diagonal is `sigmas` squared (but for
    eigenvalues lifted to MIN_EIGENVALUE_RATIO of the largest), read-only."""
    if covariance is None:
        return None
    values = np.array(covariance, np.float64)
    if values.shape != (TANGENT_DIM, TANGENT_DIM):
        raise ValueError(f"a covariance must be [7, 7], got shape {values.shape}")
    if not np.allclose(values, values.T, rtol=0, atol=1e-9 * np.abs(values).max()):
        raise ValueError("a covariance must be symmetric")
    if not np.allclose(np.sqrt(np.diag(values)), sigmas, rtol=1e-9, atol=0):
        raise ValueError("sigmas must be the square roots of the covariance's diagonal")
    values = 0.5 * (values + values.T)
    eigenvalues, vectors = np.linalg.eigh(values)
    floor = MIN_EIGENVALUE_RATIO * eigenvalues[-1]
    if eigenvalues[-1] <= 0 or eigenvalues[0] < -floor:
        raise ValueError("a covariance must be positive definite")
    if eigenvalues[0] < floor:
        values = (vectors * np.maximum(eigenvalues, floor)) @ vectors.T
        values = 0.5 * (values + values.T)
    values.setflags(write=False)
    return values


def _sigmas_and_covariance(edge: OdometryEdge | LoopEdge) -> None:
    """An edge's sigmas checked and its covariance with them (`as_covariance`); the sigmas then the square roots
    of the covariance's diagonal as kept (an eigenvalue lifted moves it past rounding)."""
    object.__setattr__(edge, "sigmas", as_sigmas(edge.sigmas))
    covariance = as_covariance(edge.covariance, edge.sigmas)
    object.__setattr__(edge, "covariance", covariance)
    if covariance is not None and not np.allclose(np.sqrt(np.diag(covariance)), edge.sigmas, rtol=1e-9, atol=0):
        object.__setattr__(edge, "sigmas", as_sigmas(np.sqrt(np.diag(covariance))))


@dataclass(frozen=True)
class OdometryEdge:
    """Chunk k+1 onto chunk k (the k-th odometry edge of a graph, counted from 0 as chunks are): the rollover's
    overlap alignment, which the stream records as ChunkLink index k+1 (links count the chunk they hang)."""

    previous_from_next: Sim3  # chunk k+1 coordinates -> chunk k coordinates
    sigmas: np.ndarray  # [7] (a scalar is accepted and broadcast), see the module docstring
    # [7, 7] the error's full covariance when known (then `sigmas` is its diagonal's square root); None: the
    # seven components are independent with `sigmas`.
    covariance: np.ndarray | None = None

    def __post_init__(self) -> None:
        _sigmas_and_covariance(self)


@dataclass(frozen=True)
class LoopEdge:
    """A loop closure between chunks `first` and `second` (any two different chunks)."""

    loop_id: Hashable
    first: int
    second: int
    first_from_second: Sim3  # chunk `second` coordinates -> chunk `first` coordinates
    sigmas: np.ndarray  # [7] (a scalar is accepted and broadcast)
    metadata: Mapping[str, Any] = field(default_factory=dict)  # the detector's, carried through untouched
    covariance: np.ndarray | None = None  # [7, 7] as OdometryEdge's

    def __post_init__(self) -> None:
        _sigmas_and_covariance(self)
        if self.first == self.second:
            raise ValueError(f"loop {self.loop_id!r} joins chunk {self.first} to itself")


@dataclass(frozen=True)
class PoseGraph:
    """An immutable snapshot: chunk k+1 hangs on chunk k by odometry[k]; loops join any two chunks.

    A graph with another edge is a new graph, so a snapshot handed to a worker never changes under it.
    """

    odometry: tuple[OdometryEdge, ...] = ()
    loops: tuple[LoopEdge, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "odometry", tuple(self.odometry))
        object.__setattr__(self, "loops", tuple(self.loops))
        ids = [loop.loop_id for loop in self.loops]
        if len(set(ids)) != len(ids):
            raise ValueError("loop ids must be unique")
        for loop in self.loops:
            if not (0 <= loop.first < self.num_chunks and 0 <= loop.second < self.num_chunks):
                raise ValueError(
                    f"loop {loop.loop_id!r} joins chunks {loop.first} and {loop.second}, "
                    f"but the graph has chunks 0..{self.num_chunks - 1}"
                )

    @property
    def num_chunks(self) -> int:
        return len(self.odometry) + 1


def open_chain(odometry: Sequence[OdometryEdge]) -> tuple[Sim3, ...]:
    """world_from_chunk of every chunk from the odometry alone: chunk 0 is the world, then each edge composed."""
    chain = [Sim3.identity()]
    for edge in odometry:
        chain.append(chain[-1] @ edge.previous_from_next)
    return tuple(chain)


# -- results ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PoseGraphSettings:
    # The chi-square quantile that bounds an accepted loop's squared, sigma-weighted residual at the
    # solution: 0.99 with 7 degrees of freedom is 18.48.
    inlier_probability: float = 0.99
    max_iterations: int = 100  # Levenberg-Marquardt iterations per solve (a chunk graph needs < 10)
    # Levenberg-Marquardt stops at this relative decrease of the cost (GTSAM's default 1e-5).
    relative_error_tol: float = 1e-5
    # Judge each loop against the odometry it closes (consistency.odometry_cycle_chi2) before anything else:
    # two false loops can agree with each other by chance, but each must also agree with the chain.
    odometry_check: bool = True
    # Keep only a largest set of loops that are pairwise consistent through the odometry (consistency.py,
    # PCM): a false loop must then agree with every kept one.
    pairwise_consistency: bool = True
    # The bound of both cycle tests (a loop against the chain, two loops against each other) and of the
    # chain's bending at the solution: 7 dof at 0.999 is 24.32. Looser than the inlier bound: with ~20 true
    # loops there are ~200 pairs, and at 0.99 two or three of them fail by chance, each costing a true loop
    # (KITTI 00: 107 of 110 kept at 0.99, 110 at 0.999); a false loop's cycles miss by far more.
    consistency_probability: float = 0.999
    # Pairs of loops tested for consistency only when their cycle runs through at most this many links of
    # the chain (None: every pair). Through more, the chain's drift swamps the pair's disagreement: the test
    # cannot refute a subtle false loop there, and a gross one the odometry check has refuted already. A
    # whole run's 3,000 loops are 4.5 million pairs; within 32 links, tens of thousands.
    pairwise_max_links: int | None = 32
    # Judge each kept edge at the solution against what all the other edges predict (leave_one_out.py)
    # rather than by its own residual, which the solution bends towards it: a look-alike place that is
    # its chunk pair's only loop fits its own solution. Graphs of more than leave_one_out.MAX_CHUNKS chunks
    # keep the own-residual test.
    leave_one_out: bool = True
    # Edges dropped a round while the worst is past its bounds (with the leave-one-out test): 1, the worst
    # alone (a stream's solves: a true loop that a false one bent fits again once the false one is gone);
    # more, every edge at least half as far past as the worst, this many at most, the worst first. Every drop
    # is a solve and a posterior (0.15 s at 167 segments, 2-core machine), and a whole run's refine of 3,113
    # loops took ~190 rounds (39 s) for a graph of a few hundred false ones. An edge held back joins again
    # at the end where it fits the solution, either way.
    drops_per_round: int = 1
    # Loops between the same two chunks solved as one edge, their information-weighted mean.
    combine_chunk_pairs: bool = True
    # Above this many candidate loops, a solve whose new loops do not simply join the last clique grows a
    # clique through each of them (cliques.clique_through, O(new loops x candidates)) instead of searching
    # the whole consistency graph again, and a whole search (the first, or after a link changed) keeps the
    # heuristic's clique without the exact search: the heuristic alone took 9 s at 2,450 candidates on the
    # 2-core machine, the exact search 0.7 s more for its 1,000 expansions.
    exact_clique_up_to: int = 500
    # Seconds a solve may take before it hands back what it has (None: no limit); see PoseGraphResult.complete.
    budget_s: float | None = None

    def __post_init__(self):
        if self.drops_per_round < 1:  # (none dropped a round: a solve that never ends)
            raise ValueError(f"drops_per_round must be at least 1, got {self.drops_per_round}")


@dataclass(frozen=True)
class LoopVerdict:
    loop_id: Hashable
    accepted: bool
    chi2: float  # the loop's squared residual in sigmas at the returned poses (chi-square with 7 dof if right)
    consistent: bool = True  # in the largest pairwise-consistent set (False: rejected before the solve)
    odometry_chi2: float = 0.0  # its cycle with the chain between its chunks, before any solve


@dataclass(frozen=True)
class PoseGraphResult:
    world_from_chunk: tuple[Sim3, ...]  # one per chunk; [0] is the identity
    loops: tuple[LoopVerdict, ...]  # one per loop edge, in the graph's order
    iterations: int  # Levenberg-Marquardt iterations in all
    initial_error: float  # 0.5 * sum of chi2 over all edges at the open chain
    final_error: float  # 0.5 * sum of chi2 over the odometry and the accepted loops at the result
    seconds: float  # wall time of the solve
    # False when the time budget ran out first: the poses are the solver's best so far and the verdicts
    # provisional; the next solve goes on from there.
    complete: bool = True

    @property
    def accepted_ids(self) -> tuple[Hashable, ...]:
        return tuple(verdict.loop_id for verdict in self.loops if verdict.accepted)

    @property
    def is_open_chain(self) -> bool:
        """True when no loop was accepted: the poses are then the odometry composed, exactly."""
        return not self.accepted_ids


def covariance_of(edge: OdometryEdge | LoopEdge) -> np.ndarray:
    return np.array(edge.covariance) if edge.covariance is not None else np.diag(np.square(edge.sigmas))


__all__ = ["TANGENT_DIM", "LoopEdge", "LoopVerdict", "OdometryEdge", "PoseGraph", "PoseGraphResult", "PoseGraphSettings",
           "as_covariance", "as_sigmas", "covariance_of", "open_chain"]
