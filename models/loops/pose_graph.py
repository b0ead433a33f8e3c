"""A pose graph over chunks: the drift of a long stream corrected where loops are found.

A long stream is cut into chunks; each new chunk is mapped onto the previous one by a Sim(3) fitted on
their shared frames (an odometry edge), so errors add up along the chain. A loop edge says how two
chunks far apart in the stream relate (the same place seen again). `optimize` finds the world-from-chunk
Sim(3) of every chunk that agrees best with all edges, and decides which loop edges to believe: one
false loop would bend the whole map, so loops are robustly weighted (GNC with a truncated least-squares
cost, odometry known to be right) and then checked once more against a chi-square bound.

Conventions (docs/loop_closure.md says more):
- Chunk k's node is world_from_chunk[k]: chunk k coordinates -> the coordinates of chunk 0 (node 0 is
  the identity, fixed).
- An edge between chunks a and b measures a_from_b = world_from_chunk[a]^-1 @ world_from_chunk[b].
- Its error is the tangent vector of measured^-1 @ a_from_b (a small Sim(3) of chunk b's coordinates),
  in the order [rotation x, y, z (rad), translation x, y, z (chunk b units), log scale]; `sigmas` are
  the standard deviations of those seven numbers.
- A graph without loop edges, or whose loops are all rejected, yields the open chain exactly: the
  odometry measurements composed as given, not the optimiser's estimate of it.

The optimiser is GTSAM's (Similarity3, Levenberg-Marquardt, GncOptimizer). GTSAM's Similarity3(R, t, s)
maps x -> s (R x + t), where our Sim3 maps x -> s R x + t: the conversions below divide or multiply the
translation by the scale. GTSAM holds the GIL through each iteration: the stream's loop closer solves in
its own child process (models/loops/process.py), never in the stream's.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import gtsam
import numpy as np

from ..stream.similarity import Sim3

TANGENT_DIM = 7  # rotation (3), translation (3), log scale (1): GTSAM's Similarity3 tangent order
# Node 0's prior: a standard deviation of 1e-6 (odometry's are ~1e-3 and up) holds chunk 0 in place; the
# information ratio, ~1e6 squared, is far from float64's limits. The result is re-anchored exactly anyway.
_ANCHOR_SIGMA = 1e-6
# GNC's weight of a loop is 0 or 1 at convergence with a truncated least-squares cost; in between it means
# the schedule stopped early, and only a loop weighted more than half is taken as an inlier.
_INLIER_WEIGHT = 0.5


# -- edges and the graph ---------------------------------------------------------------------------
def as_sigmas(sigmas: float | Sequence[float] | np.ndarray) -> np.ndarray:
    """A scalar (the same for all seven components) or seven standard deviations -> [7] float64, read-only."""
    values = np.broadcast_to(np.asarray(sigmas, np.float64), (TANGENT_DIM,)).copy()
    if not np.all(np.isfinite(values) & (values > 0)):
        raise ValueError(f"sigmas must be finite and positive, got {values.tolist()}")
    values.setflags(write=False)
    return values


def as_covariance(covariance: np.ndarray | None, sigmas: np.ndarray) -> np.ndarray | None:
    """None, or a [7, 7] symmetric positive-definite covariance whose diagonal is `sigmas` squared, read-only."""
    if covariance is None:
        return None
    values = np.array(covariance, np.float64)
    if values.shape != (TANGENT_DIM, TANGENT_DIM):
        raise ValueError(f"a covariance must be [7, 7], got shape {values.shape}")
    if not np.allclose(values, values.T, rtol=0, atol=1e-9 * np.abs(values).max()):
        raise ValueError("a covariance must be symmetric")
    if not np.allclose(np.sqrt(np.diag(values)), sigmas, rtol=1e-9, atol=0):
        raise ValueError("sigmas must be the square roots of the covariance's diagonal")
    if np.linalg.eigvalsh(values)[0] <= 0:
        raise ValueError("a covariance must be positive definite")
    values = 0.5 * (values + values.T)
    values.setflags(write=False)
    return values


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
        object.__setattr__(self, "sigmas", as_sigmas(self.sigmas))
        object.__setattr__(self, "covariance", as_covariance(self.covariance, self.sigmas))


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
        object.__setattr__(self, "sigmas", as_sigmas(self.sigmas))
        object.__setattr__(self, "covariance", as_covariance(self.covariance, self.sigmas))
        if self.first == self.second:
            raise ValueError(f"loop {self.loop_id!r} joins chunk {self.first} to itself")


@dataclass(frozen=True)
class PoseGraph:
    """An immutable snapshot: chunk k+1 hangs on chunk k by odometry[k]; loops join any two chunks.

    Adding an edge returns a new graph, so a snapshot handed to a worker never changes under it.
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

    def with_odometry(self, edge: OdometryEdge) -> PoseGraph:
        """The graph with one more chunk, hung on the last one."""
        return PoseGraph(self.odometry + (edge,), self.loops)

    def with_loop(self, edge: LoopEdge) -> PoseGraph:
        return PoseGraph(self.odometry, self.loops + (edge,))


def open_chain(odometry: Sequence[OdometryEdge]) -> tuple[Sim3, ...]:
    """world_from_chunk of every chunk from the odometry alone: chunk 0 is the world, then each edge composed."""
    chain = [Sim3.identity()]
    for edge in odometry:
        chain.append(chain[-1] @ edge.previous_from_next)
    return tuple(chain)


# -- results ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PoseGraphSettings:
    # The chi-square quantile that bounds an inlier loop's squared, sigma-weighted residual, both for GNC's
    # truncation and for the final check: 0.99 with 7 degrees of freedom is 18.48.
    inlier_probability: float = 0.99
    max_iterations: int = 100  # Levenberg-Marquardt iterations per solve (a chunk graph needs < 10)
    # Each GNC step solves to this relative decrease of the cost; the next step changes the weights anyway,
    # so GTSAM's 1e-5 buys nothing: 1e-3 halved a 1,000-chunk solve here with the same verdicts.
    relative_error_tol: float = 1e-3
    # GNC's factor between steps of its continuation (GTSAM's default 1.4): 2.0 halves the steps again with
    # the same verdicts on KITTI 00, fr1_xyz and synthetic chains of 100 and 1,000 chunks (docs/loop_closure.md).
    gnc_step: float = 2.0
    # Before GNC, keep only a largest set of loops that are pairwise consistent through the odometry
    # (consistency.py, PCM): a false loop must then agree with every kept one. On, since loop edges carry
    # their fits' covariances (docs/loop_closure.md): a false loop far from the truth (>= 50 m on KITTI 00)
    # is then so far outside its sigmas that GNC alone, started from the drifted chain, turned away 70 % of
    # the true loops with it (10 seeds); PCM removes it first.
    pairwise_consistency: bool = True
    # Two loops are consistent while their cycle's chi2 stays under this quantile (7 dof: 0.999 is 24.32).
    # Looser than the inlier bound: with ~20 true loops there are ~200 pairs, and at 0.99 two or three of them
    # fail by chance, each costing a true loop before GNC can weigh it (KITTI 00: 107 of 110 kept at 0.99,
    # 110 at 0.999); a false loop's cycles miss by far more than the difference.
    consistency_probability: float = 0.999


@dataclass(frozen=True)
class LoopVerdict:
    loop_id: Hashable
    accepted: bool
    gnc_weight: float  # GNC's final weight of the loop: 1 inlier, 0 outlier
    chi2: float  # the loop's squared residual in sigmas at the returned poses (chi-square with 7 dof if right)
    consistent: bool = True  # in the largest pairwise-consistent set (False: rejected before GNC)


@dataclass(frozen=True)
class PoseGraphResult:
    world_from_chunk: tuple[Sim3, ...]  # one per chunk; [0] is the identity
    loops: tuple[LoopVerdict, ...]  # one per loop edge, in the graph's order
    iterations: int  # Levenberg-Marquardt iterations in all (GNC's inner solves and the checks)
    initial_error: float  # 0.5 * sum of chi2 over all edges at the open chain
    final_error: float  # 0.5 * sum of chi2 over the odometry and the accepted loops at the result
    seconds: float  # wall time of `optimize`

    @property
    def accepted_ids(self) -> tuple[Hashable, ...]:
        return tuple(verdict.loop_id for verdict in self.loops if verdict.accepted)

    @property
    def rejected_ids(self) -> tuple[Hashable, ...]:
        return tuple(verdict.loop_id for verdict in self.loops if not verdict.accepted)

    @property
    def is_open_chain(self) -> bool:
        """True when no loop was accepted: the poses are then the odometry composed, exactly."""
        return not self.accepted_ids


# -- GTSAM conversions -----------------------------------------------------------------------------
def to_gtsam(transform: Sim3) -> gtsam.Similarity3:
    """Our x -> s R x + t as GTSAM's x -> s (R x + t'), so t' = t / s."""
    return gtsam.Similarity3(gtsam.Rot3(transform.rotation), transform.translation / transform.scale,
                             transform.scale)


def from_gtsam(transform: gtsam.Similarity3) -> Sim3:
    scale = float(transform.scale())
    return Sim3(scale, np.asarray(transform.rotation().matrix(), np.float64),
                scale * np.asarray(transform.translation(), np.float64))


def _noise(edge: OdometryEdge | LoopEdge) -> gtsam.noiseModel.Base:
    """The edge's full covariance when it has one, else its independent sigmas."""
    if edge.covariance is not None:
        return gtsam.noiseModel.Gaussian.Covariance(np.array(edge.covariance))
    return gtsam.noiseModel.Diagonal.Sigmas(np.asarray(edge.sigmas, np.float64))


def _loop_factor(loop: LoopEdge) -> gtsam.BetweenFactorSimilarity3:
    return gtsam.BetweenFactorSimilarity3(loop.first, loop.second, to_gtsam(loop.first_from_second),
                                          _noise(loop))


def _factor_graph(graph: PoseGraph, loops: Sequence[LoopEdge]) -> gtsam.NonlinearFactorGraph:
    """Factor 0 anchors chunk 0, factors 1..K are the odometry edges, then `loops` in order."""
    factors = gtsam.NonlinearFactorGraph()
    factors.add(gtsam.PriorFactorSimilarity3(0, gtsam.Similarity3(), gtsam.noiseModel.Isotropic.Sigma(
        TANGENT_DIM, _ANCHOR_SIGMA)))
    for k, edge in enumerate(graph.odometry):
        factors.add(gtsam.BetweenFactorSimilarity3(k, k + 1, to_gtsam(edge.previous_from_next), _noise(edge)))
    for loop in loops:
        factors.add(_loop_factor(loop))
    return factors


def _values(world_from_chunk: Sequence[Sim3]) -> gtsam.Values:
    values = gtsam.Values()
    for k, transform in enumerate(world_from_chunk):
        values.insert(k, to_gtsam(transform))
    return values


def _anchored(values: gtsam.Values, num_chunks: int) -> tuple[Sim3, ...]:
    """The estimate re-expressed in chunk 0's coordinates, so that node 0 is exactly the identity."""
    chunk0_from_world = from_gtsam(values.atSimilarity3(0)).inverse()
    return (Sim3.identity(),) + tuple(chunk0_from_world @ from_gtsam(values.atSimilarity3(k))
                                      for k in range(1, num_chunks))


def _lm_params(settings: PoseGraphSettings, counter: list[int]) -> gtsam.LevenbergMarquardtParams:
    params = gtsam.LevenbergMarquardtParams()
    params.setMaxIterations(settings.max_iterations)
    params.setRelativeErrorTol(settings.relative_error_tol)
    params.iterationHook = lambda *_: counter.__setitem__(0, counter[0] + 1)
    return params


# -- the optimisation ------------------------------------------------------------------------------
def _robust_weights(graph: PoseGraph, initial: gtsam.Values, settings: PoseGraphSettings,
                    counter: list[int]) -> tuple[gtsam.Values, np.ndarray, float]:
    """GNC (truncated least squares) over all edges, odometry known to be right.

    Returns the estimate, each loop's weight [L] and the cost bound of an inlier (0.5 * chi2 quantile).
    """
    params = gtsam.GncLMParams(_lm_params(settings, counter))
    params.setLossType(gtsam.GncLossType.TLS)
    params.setLambdaStep(settings.gnc_step)
    params.setKnownInliers(list(range(graph.num_chunks)))  # the anchor and the odometry edges
    optimizer = gtsam.GncLMOptimizer(_factor_graph(graph, graph.loops), initial, params)
    optimizer.setInlierCostThresholdsAtProbability(settings.inlier_probability)
    estimate = optimizer.optimize()
    weights = np.asarray(optimizer.getWeights(), np.float64)[graph.num_chunks:]
    bound = float(np.asarray(optimizer.getInlierCostThresholds())[-1])
    return estimate, weights, bound


def _verified(graph: PoseGraph, estimate: gtsam.Values, accepted: list[int], bound: float,
              settings: PoseGraphSettings, counter: list[int]) -> tuple[gtsam.Values, list[int]]:
    """Solve with the odometry and the accepted loops only; while the worst accepted loop's cost stays above
    `bound`, reject it and solve again. Returns the estimate and the loops (indices) that passed."""
    accepted = list(accepted)
    while accepted:
        factors = _factor_graph(graph, [graph.loops[i] for i in accepted])
        estimate = gtsam.LevenbergMarquardtOptimizer(factors, estimate, _lm_params(settings, counter)).optimize()
        costs = [factors.at(graph.num_chunks + n).error(estimate) for n in range(len(accepted))]
        worst = int(np.argmax(costs))
        if costs[worst] <= bound:
            break
        del accepted[worst]
    return estimate, accepted


def _total_error(graph: PoseGraph, loops: Sequence[LoopEdge], world_from_chunk: Sequence[Sim3]) -> float:
    """0.5 * sum of chi2 over the odometry and `loops` (the anchor excluded: it is zero at an anchored pose)."""
    factors = _factor_graph(graph, loops)
    values = _values(world_from_chunk)
    return float(sum(factors.at(i).error(values) for i in range(1, factors.size())))


def _loop_chi2(loops: Sequence[LoopEdge], world_from_chunk: Sequence[Sim3]) -> list[float]:
    values = _values(world_from_chunk)
    return [2.0 * _loop_factor(loop).error(values) for loop in loops]


def _pairwise_consistent(graph: PoseGraph, settings: PoseGraphSettings, known: dict | None) -> list[int]:
    """The loops (indices) that GNC is to judge: a largest pairwise-consistent set, or all of them."""
    if not settings.pairwise_consistency:
        return list(range(len(graph.loops)))
    from .consistency import consistent_loops  # (consistency.py builds on this module's edges)

    return consistent_loops(graph, settings.consistency_probability, known)


def optimize(graph: PoseGraph, settings: PoseGraphSettings = PoseGraphSettings(),
             cycle_chi2: dict | None = None) -> PoseGraphResult:
    """The corrected world-from-chunk of every chunk and a verdict on every loop edge. `cycle_chi2`: the
    pairwise-consistency figures of an earlier solve of a graph that this one extends (consistency.py's
    CycleChi2Cache), reused and filled in; loop ids must then name the same loops."""
    start = time.perf_counter()
    chain = open_chain(graph.odometry)
    counter = [0]  # Levenberg-Marquardt iterations, counted by GTSAM's iteration hook
    weights = np.zeros(len(graph.loops))
    accepted: list[int] = []
    consistent = _pairwise_consistent(graph, settings, cycle_chi2)
    poses = chain
    if consistent:
        judged = PoseGraph(graph.odometry, [graph.loops[i] for i in consistent])
        initial = _values(chain)
        if settings.pairwise_consistency:  # the set agrees with itself: GNC starts from its solution
            initial = gtsam.LevenbergMarquardtOptimizer(_factor_graph(judged, judged.loops), initial,
                                                        _lm_params(settings, counter)).optimize()
        estimate, judged_weights, bound = _robust_weights(judged, initial, settings, counter)
        weights[consistent] = judged_weights
        candidates = [i for i, weight in enumerate(weights) if weight > _INLIER_WEIGHT]
        estimate, accepted = _verified(graph, estimate, candidates, bound, settings, counter)
        if accepted:
            poses = _anchored(estimate, graph.num_chunks)
    chi2 = _loop_chi2(graph.loops, poses)
    kept, in_set = set(accepted), set(consistent)
    verdicts = tuple(LoopVerdict(loop.loop_id, i in kept, float(weights[i]), chi2[i], i in in_set)
                     for i, loop in enumerate(graph.loops))
    return PoseGraphResult(
        world_from_chunk=poses,
        loops=verdicts,
        iterations=counter[0],
        initial_error=_total_error(graph, graph.loops, chain),
        final_error=_total_error(graph, [graph.loops[i] for i in accepted], poses),
        seconds=time.perf_counter() - start,
    )


__all__ = [
    "LoopEdge", "LoopVerdict", "OdometryEdge", "PoseGraph", "PoseGraphResult", "PoseGraphSettings", "as_covariance",
    "as_sigmas",
    "from_gtsam", "open_chain", "optimize", "to_gtsam",
]
