"""A pose graph over chunks: the drift of a long stream corrected where loops are found.

A long stream is cut into chunks; each new chunk is mapped onto the previous one by a Sim(3) fitted on
their shared frames (an odometry edge), so errors add up along the chain. A loop edge says how two
chunks far apart in the stream relate (the same place seen again). A solve finds the world-from-chunk
Sim(3) of every chunk that agrees best with the edges it believes, and decides which loop edges to
believe: one false loop would bend the whole map. A loop is accepted when it passes five checks:

1. against the odometry it closes: its cycle with the chain between its chunks (consistency.py);
2. against the other loops: it is in a largest pairwise-consistent set (PCM, consistency.py, cliques.py);
3. at the solution, its own residual stays under the inlier bound;
4. at the solution, the chain between its chunks is bent no more than the chain's own uncertainty allows;
5. at the solution, it agrees with what all the other edges together predict for its two chunks
   (leave_one_out.py): a false loop that alone holds its chunk pair fits the solution it bends, and each
   pairwise test, through the chain's slack, let it through.

Loops between the same two chunks are solved as one edge (their information-weighted mean), so the graph
grows with revisited chunk pairs, not with keyframe pairs. `PoseGraphSolver` keeps what a stream's solves
share (the chain's covariances, every pair's consistency, the last clique and the last solution): a new
loop costs O(chunks + loops) to judge, and a solve starts from the last solution under a time budget.

Conventions (docs/loop_closure.md says more):
- Chunk k's node is world_from_chunk[k]: chunk k coordinates -> the coordinates of chunk 0 (node 0 is
  the identity, fixed).
- An edge between chunks a and b measures a_from_b = world_from_chunk[a]^-1 @ world_from_chunk[b].
- Its error is the tangent vector of measured^-1 @ a_from_b (a small Sim(3) of chunk b's coordinates),
  in the order [rotation x, y, z (rad), translation x, y, z (chunk b units), log scale]; `sigmas` are
  the standard deviations of those seven numbers.
- A graph without loop edges, or whose loops are all rejected, yields the open chain exactly: the
  odometry measurements composed as given, not the optimiser's estimate of it.

The optimiser is GTSAM's (Similarity3, Levenberg-Marquardt). GTSAM's Similarity3(R, t, s) maps
x -> s (R x + t), where our Sim3 maps x -> s R x + t: the conversions (gtsam_sim3.py) divide or multiply
the translation by the scale. GTSAM holds the GIL through each iteration: the stream's loop closer solves in
its own child process (models/loops/process.py), never in the stream's.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import gtsam
import numpy as np

from ..stream.similarity import Sim3
from . import sim3_batch as lie
from .cliques import EXACT_BUDGET, clique_through, maximum_clique
from .consistency import (
    ChainCovariances,
    chi_square_quantile,
    combine_groups,
    odometry_cycle_chi2,
    pair_blocks,
    pairs_cycle_chi2,
)
from .gtsam_sim3 import between_factor, gtsam_poses, gtsam_values, matrices_of
from .leave_one_out import MAX_CHUNKS as LEAVE_ONE_OUT_MAX_CHUNKS
from .leave_one_out import Posterior
from .pose_graph_data import (
    TANGENT_DIM,
    LoopEdge,
    LoopVerdict,
    OdometryEdge,
    PoseGraph,
    PoseGraphResult,
    PoseGraphSettings,
    covariance_of,
    open_chain,
)

# Node 0's prior: a standard deviation of 1e-6 (odometry's are ~1e-3 and up) holds chunk 0 in place; the
# information ratio, ~1e6 squared, is far from float64's limits. The result is re-anchored exactly anyway.
_ANCHOR_SIGMA = 1e-6


def _same_edge(a: OdometryEdge, b: OdometryEdge) -> bool:
    if a is b:  # a stream hands the same edges back solve after solve
        return True
    if a.previous_from_next is b.previous_from_next and a.covariance is b.covariance:
        return np.array_equal(a.sigmas, b.sigmas)
    return (np.array_equal(a.previous_from_next.scaled_matrix, b.previous_from_next.scaled_matrix)
            and np.array_equal(covariance_of(a), covariance_of(b)))


@dataclass(frozen=True)
class _Group:
    """The accepted-so-far loops between chunks first < second, as one edge."""

    first: int
    second: int
    measured: np.ndarray  # [4, 4] first_from_second
    covariance: np.ndarray  # [7, 7] on the right
    members: tuple[int, ...]  # loop indices (the solver's)


# A whole run's solve (past check 5.'s bound) looks at the misfits after this many Levenberg-Marquardt
# iterations: an edge more than this many times past its bounds there is a gross false loop that the chain's
# slack let through (its own residual in the millions of its sigmas), dropped without converging with it.
_GROSS_CHECK_ITERATIONS = 3
_GROSS_MISFIT = 100.0


def _key(group: _Group) -> tuple[int, int, tuple[int, ...]]:
    return group.first, group.second, group.members


# -- the solver ------------------------------------------------------------------------------------
class PoseGraphSolver:
    """Solves a stream's pose graph again and again as it grows, keeping what the solves share.

    `solve(graph)` takes the whole graph each time (an immutable snapshot); what it saw before is found by
    comparing: odometry edges that are unchanged, loops by id (a loop id must always name the same loop).
    A new loop costs its cycle against the chain and one batched row of pairs; a changed link recomputes
    the loops that reach past it. Levenberg-Marquardt starts from the last solution.
    """

    def __init__(self, settings: PoseGraphSettings = PoseGraphSettings()):
        self.settings = settings
        self._odometry: list[OdometryEdge] = []
        self._chain = ChainCovariances(np.zeros((0, 4, 4)), np.zeros((0, TANGENT_DIM, TANGENT_DIM)))
        self._odometry_factors: list[gtsam.NonlinearFactor] = []
        self._loops: list[LoopEdge] = []
        self._index: dict[Hashable, int] = {}
        self._measured = np.zeros((0, 4, 4))  # [L] first_from_second
        self._covariance = np.zeros((0, TANGENT_DIM, TANGENT_DIM))
        self._ends = np.zeros((0, 2), np.int64)  # [L] (first, second)
        self._odometry_chi2 = np.zeros(0)  # [L] each loop's cycle with the chain
        self._chain_chi2 = np.zeros(0)  # [L] each loop's residual at the open chain
        # [capacity, capacity] bool: two loops' cycle within the consistency bound (symmetric; the diagonal
        # True). Bits, not figures: 9,000 loops take 81 MB so, 648 MB as float64.
        self._consistent_pairs = np.zeros((0, 0), bool)
        self._clique: list[int] = []  # the last solve's consistent set (loop indices)
        self._clique_over: set[int] = set()  # the candidates it was chosen from
        self._misfit_loops: set[int] = set()  # loops of the edges the last solve dropped as misfits
        self._joined: set[tuple[int, ...]] = set()  # edges (their loops) that joined since a solve last completed
        self._estimate: np.ndarray | None = None  # [K, 4, 4] the last solution; None: the open chain
        # the same solution as GTSAM handed it back (not re-anchored), the next solve's start: converting
        # [K, 4, 4] into GTSAM's values costs ~25 us a chunk, a copy of these far less
        self._estimate_values: gtsam.Values | None = None
        self._group_factors: dict[tuple, gtsam.NonlinearFactor] = {}
        # the odometry's and the last solve's kept groups' posterior (leave_one_out.py), changed solve by solve
        self._posterior: Posterior | None = None
        self._groups: dict[tuple, _Group] = {}
        self.pairs_computed = 0  # cycle tests of two loops so far (each pair once unless a link changed)

    # -- what changed ------------------------------------------------------------------------------
    def _take_odometry(self, odometry: Sequence[OdometryEdge]) -> None:
        known = min(len(odometry), len(self._odometry))
        unchanged = next((k for k in range(known) if not _same_edge(odometry[k], self._odometry[k])), known)
        if unchanged == len(self._odometry) == len(odometry):
            return
        self._odometry = list(odometry)
        self._chain = ChainCovariances(lie.matrices([edge.previous_from_next for edge in odometry]),
                                       np.stack([covariance_of(edge) for edge in odometry])
                                       if odometry else np.zeros((0, TANGENT_DIM, TANGENT_DIM)))
        del self._odometry_factors[unchanged:]
        for k in range(unchanged, len(odometry)):
            edge = odometry[k]
            self._odometry_factors.append(between_factor(k, k + 1, edge.previous_from_next.scaled_matrix,
                                                          covariance_of(edge)))
        if unchanged < len(odometry) and self._posterior is not None and unchanged < self._posterior.num_chunks - 1:
            self._posterior = None  # a link it holds changed: formed again at its next use
        if self._estimate is not None:
            for k in range(unchanged + 1, len(self._estimate)):
                self._estimate_values.erase(k)
            self._estimate = self._estimate[:unchanged + 1]
        reaching = [i for i, (a, b) in enumerate(self._ends) if max(a, b) > unchanged]
        if reaching:  # their cycles run through a changed link: judged again, the clique searched again
            self._judge_loops(np.array(reaching), against_all=True)
            self._clique = []  # its pairs' verdicts may have changed

    def _take_loops(self, loops: Sequence[LoopEdge]) -> np.ndarray:
        """The solver's indices of `loops`, new ones added and judged."""
        new = [loop for loop in loops if loop.loop_id not in self._index]
        if new:
            start = len(self._loops)
            for loop in new:
                self._index[loop.loop_id] = len(self._loops)
                self._loops.append(loop)
            self._measured = np.concatenate([self._measured, lie.matrices([loop.first_from_second for loop in new])])
            self._covariance = np.concatenate([self._covariance, np.stack([covariance_of(loop) for loop in new])])
            self._ends = np.concatenate([self._ends, np.array([(loop.first, loop.second) for loop in new])])
            self._odometry_chi2 = np.concatenate([self._odometry_chi2, np.zeros(len(new))])
            self._chain_chi2 = np.concatenate([self._chain_chi2, np.zeros(len(new))])
            self._grow_pairs(len(self._loops))
            self._judge_loops(np.arange(start, len(self._loops)), against_all=False)
        return np.array([self._index[loop.loop_id] for loop in loops], np.int64)

    def _grow_pairs(self, count: int) -> None:
        capacity = len(self._consistent_pairs)
        if count <= capacity:
            return
        size = max(count, 2 * capacity, 16)
        grown = np.zeros((size, size), bool)
        grown[:capacity, :capacity] = self._consistent_pairs
        np.fill_diagonal(grown, True)
        self._consistent_pairs = grown

    def _judge_loops(self, indices: np.ndarray, against_all: bool) -> None:
        """Each loop's cycle with the chain, and its pairs: with every other loop, or with the earlier ones."""
        first, second = self._ends[indices, 0], self._ends[indices, 1]
        self._chain_chi2[indices] = self._loop_chi2(indices, self._chain.world_from_chunk)
        self._odometry_chi2[indices] = odometry_cycle_chi2(self._chain, first, second, self._measured[indices],
                                                           self._covariance[indices])
        bound = chi_square_quantile(self.settings.consistency_probability)
        # a loop the chain refutes is never a candidate: its pairs are not worth testing (a link aligned again
        # judges it again, pairs and all)
        eligible = (self._odometry_chi2[:len(self._loops)] <= bound if self.settings.odometry_check
                    else np.ones(len(self._loops), bool))
        for block in pair_blocks(indices, len(self._loops), against_all, self._ends, eligible,
                                  self.settings.pairwise_max_links, self._consistent_pairs):
            loop, other = block[:, 0], block[:, 1]
            chi2 = pairs_cycle_chi2(self._chain, (self._measured[loop], self._covariance[loop]),
                                    (self._ends[loop, 0], self._ends[loop, 1]),
                                    (self._measured[other], self._covariance[other]),
                                    (self._ends[other, 0], self._ends[other, 1]))
            self._consistent_pairs[loop, other] = self._consistent_pairs[other, loop] = chi2 <= bound
            self.pairs_computed += len(block)

    # -- the verdicts ------------------------------------------------------------------------------
    def _consistent(self, active: np.ndarray, deadline: float = float("inf")) -> np.ndarray:
        """The loops (indices) the solve may accept: those that agree with the chain, then a largest
        pairwise-consistent set of them."""
        candidates = active
        if self.settings.odometry_check:
            bound = chi_square_quantile(self.settings.consistency_probability)
            candidates = candidates[self._odometry_chi2[candidates] <= bound]
        if not self.settings.pairwise_consistency or len(candidates) <= 1:
            return candidates
        grown = self._clique_grown_by(candidates)
        if grown is not None:
            clique, challengers = grown
            if not len(challengers):
                self._clique_over = set(candidates.tolist())
                return clique
            if len(candidates) > self.settings.exact_clique_up_to:
                through = self._clique_through(candidates, challengers, len(clique))
                self._clique_over = set(candidates.tolist())
                return clique if through is None else through
        adjacent = self._consistent_pairs[np.ix_(candidates, candidates)]
        position = {loop: n for n, loop in enumerate(candidates.tolist())}
        warm = [position[loop] for loop in self._clique if loop in position]
        # above exact_clique_up_to the heuristic's clique stands: the exact search's sets of neighbours
        # alone took GBs at 7,000 candidates
        exact_budget = EXACT_BUDGET if len(candidates) <= self.settings.exact_clique_up_to else 0
        found = maximum_clique(adjacent, warm_start=warm, exact_budget=exact_budget, deadline=deadline)
        self._clique_over = set(candidates.tolist())
        return candidates[np.array(found.members, np.int64)]

    def _clique_grown_by(self, candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """The last clique grown by the new candidates adjacent to all of it (and to each other), and the other
        new candidates that might still lie in a larger clique; None without a last clique over a subset of
        these candidates.

        Adding k nodes to a graph raises its largest clique by at most k, and a new node of degree d can be in
        no clique of more than d + 1 nodes: when no new candidate is left to challenge it, the grown clique is
        as large as the last one was (maximum if that was). O(k x candidates) where a search over thousands
        of loops costs tens of ms to seconds."""
        now = set(candidates.tolist())
        if not self._clique or not self._clique_over <= now:
            return None
        members = np.array(self._clique, np.int64)
        new = np.array(sorted(now - self._clique_over), np.int64)
        joining = [v for v in new.tolist() if self._consistent_pairs[v, members].all()]
        joining = [v for v in joining if self._consistent_pairs[v, joining].all()]
        left_out = np.setdiff1d(new, joining)
        grown = np.sort(np.concatenate([members, np.array(joining, np.int64)]))
        if len(left_out):
            degrees = self._consistent_pairs[np.ix_(left_out, candidates)].sum(axis=1) - 1
            left_out = left_out[degrees + 1 > len(grown)]
        return grown, left_out

    def _clique_through(self, candidates: np.ndarray, challengers: np.ndarray, beat: int) -> np.ndarray | None:
        """A clique of more than `beat` candidates through one of the challengers (cliques.clique_through), or
        None."""
        position = {loop: n for n, loop in enumerate(candidates.tolist())}
        found = clique_through(self._consistent_pairs[np.ix_(candidates, candidates)],
                               [position[loop] for loop in challengers.tolist()], beat)
        return None if found is None else candidates[np.array(found, np.int64)]

    def _group(self, members: Iterable[int]) -> list[_Group]:
        """The loops as edges first < second, one per chunk pair (or one per loop, without combining)."""
        by_pair: dict[tuple[int, int], list[int]] = {}
        for i in members:
            a, b = self._ends[i]
            key = (min(a, b), max(a, b)) if self.settings.combine_chunk_pairs else (min(a, b), max(a, b), i)
            by_pair.setdefault(key, []).append(int(i))
        keys = [(key[0], key[1], tuple(loops)) for key, loops in by_pair.items()]
        self._make_groups([key for key in keys if key not in self._groups])
        return [self._groups[key] for key in keys]

    def _make_groups(self, keys: Sequence[tuple[int, int, tuple[int, ...]]]) -> None:
        """The edges of new (first, second, members) keys, their loops turned to first_from_second and each
        pair's combined in one batch (consistency.combine_groups)."""
        if not keys:
            return
        loops = np.array([i for _, _, members in keys for i in members], np.int64)
        group = np.repeat(np.arange(len(keys)), [len(members) for _, _, members in keys])
        measured, covariance = self._measured[loops].copy(), self._covariance[loops].copy()
        flipped = self._ends[loops, 0] > np.array([first for first, _, _ in keys])[group]
        if flipped.any():  # (Z Exp(e))^-1 = Z^-1 Exp(-Ad_Z e)
            covariance[flipped] = lie.sandwich(lie.adjoint(measured[flipped]), covariance[flipped])
            measured[flipped] = lie.inverse(measured[flipped])
        single = np.bincount(group) == 1
        firsts = np.unique(group, return_index=True)[1]  # a single loop's edge is the loop itself
        means, covariances = measured[firsts], covariance[firsts]
        if not single.all():
            several = ~single[group]
            renumbered = np.cumsum(~single) - 1
            combined, combined_covariances = combine_groups(measured[several], covariance[several],
                                                            renumbered[group[several]])
            means[~single], covariances[~single] = combined, combined_covariances
        for (first, second, members), mean, mean_covariance in zip(keys, means, covariances, strict=True):
            key = (first, second, members)
            self._groups[key] = _Group(first, second, mean, mean_covariance, members)
            self._group_factors[key] = between_factor(first, second, mean, mean_covariance)

    def _misfits(self, groups: Sequence[_Group], estimate: np.ndarray) -> np.ndarray:
        """[G] how far each edge is past its bounds at `estimate` (> 1: past): its own residual against the
        inlier bound, and the chain between its chunks bent by the solution against the cycle bound."""
        ends = np.array([(group.first, group.second) for group in groups])
        first, second = ends[:, 0], ends[:, 1]
        solved = _between(estimate, ends)
        own = lie.residual_chi2(np.stack([group.measured for group in groups]), solved,
                                np.stack([group.covariance for group in groups]))
        bent = self._chain.bending_chi2(first, second, solved)
        return np.maximum(own / chi_square_quantile(self.settings.inlier_probability),
                          bent / chi_square_quantile(self.settings.consistency_probability))

    def _posterior_of(self, groups: Sequence[_Group]) -> Posterior | None:
        """The posterior of the odometry and `groups` (leave_one_out.py), kept between solves and changed by
        the groups that joined or left since; None when the leave-one-out test is off or the graph too
        large for it."""
        if not self.settings.leave_one_out or self._chain.num_chunks > LEAVE_ONE_OUT_MAX_CHUNKS:
            self._posterior = None
            return None
        wanted = {_key(group): group for group in groups}
        posterior = self._posterior
        if posterior is not None and posterior.num_chunks < self._chain.num_chunks:
            known = posterior.num_chunks - 1
            posterior.with_links(self._chain.links[known:], self._chain.link_covariances[known:])
        added = [(key, group.first, group.second, group.measured, group.covariance)
                 for key, group in wanted.items() if posterior is None or key not in posterior.edges]
        removed = [] if posterior is None else [key for key in posterior.edges if key not in wanted]
        if posterior is None or not posterior.change(added, removed):
            posterior = Posterior(self._chain.links, self._chain.link_covariances,
                                  {key: (group.first, group.second, group.measured, group.covariance)
                                   for key, group in wanted.items()})
        self._posterior = posterior
        return posterior

    def _posterior_at(self, groups: Sequence[_Group], solution: np.ndarray) -> Posterior:
        """The posterior of the odometry and `groups` with every edge linearised at their `solution`: where
        edges are several sigmas off (a false loop bending the graph), their Jacobians at their measurements
        sway the statistic by 20 % and the order of the drops with it (EuRoC V1_02's look-alikes got
        through)."""
        return Posterior(self._chain.links, self._chain.link_covariances,
                         {_key(group): (group.first, group.second, group.measured, group.covariance)
                          for group in groups}, at=solution)

    def _left_out_misfits(self, groups: Sequence[_Group], posterior: Posterior, solution: np.ndarray) -> np.ndarray:
        """[G] each of the posterior's `groups` against what the odometry and the other groups predict at their
        `solution`, over the cycle bound (> 1: a misfit)."""
        chi2 = posterior.left_out(solution, [_key(group) for group in groups])
        return chi2 / chi_square_quantile(self.settings.consistency_probability)

    def _fitting(self, groups: Sequence[_Group], estimate: np.ndarray, posterior: Posterior | None) -> np.ndarray:
        """[G] bool: edges outside the solution `estimate` that fit it: the chain between their chunks bent
        within its bound, and each edge against the solution's prediction of it (with `posterior`: its
        uncertainty and the prediction's, under the cycle bound; else its own alone, under the inlier
        bound)."""
        misfits = self._misfits(groups, estimate)
        if posterior is None:
            return misfits <= 1.0
        ends = np.array([(group.first, group.second) for group in groups])
        first, second = ends[:, 0], ends[:, 1]
        bound = chi_square_quantile(self.settings.consistency_probability)
        bent = self._chain.bending_chi2(first, second, _between(estimate, ends))
        predicted = posterior.predicting(estimate, ends, np.stack([group.measured for group in groups]),
                                         np.stack([group.covariance for group in groups]))
        return np.maximum(bent, predicted) <= bound

    # -- solving -----------------------------------------------------------------------------------
    def _initial(self) -> tuple[np.ndarray, gtsam.Values]:
        """The last solution, its chain extended by the odometry to chunks it did not have ([K, 4, 4], and
        as GTSAM's values)."""
        chain = self._chain.world_from_chunk
        if self._estimate is None:
            return chain.copy(), gtsam_values(chain)
        known = len(self._estimate)
        extended = self._estimate[known - 1] @ lie.inverse(chain[known - 1]) @ chain[known:]
        values = gtsam.Values(self._estimate_values)
        for k, pose in enumerate(gtsam_poses(extended), start=known):
            values.insert(k, pose)
        return np.concatenate([self._estimate, extended]), values

    def _levenberg_marquardt(self, groups: Sequence[_Group], initial: gtsam.Values, deadline: float,
                             pause_after: int | None = None) -> tuple[np.ndarray, gtsam.Values, int, bool]:
        """(estimate [K, 4, 4] anchored at chunk 0, GTSAM's, iterations, converged) over the odometry and
        `groups`; `pause_after`: hand back after that many iterations, converged or not."""
        factors = gtsam.NonlinearFactorGraph()
        factors.add(gtsam.PriorFactorSimilarity3(0, gtsam.Similarity3(), gtsam.noiseModel.Isotropic.Sigma(
            TANGENT_DIM, _ANCHOR_SIGMA)))
        for factor in self._odometry_factors:
            factors.add(factor)
        for group in groups:
            factors.add(self._group_factors[(group.first, group.second, group.members)])
        optimizer = gtsam.LevenbergMarquardtOptimizer(factors, initial, gtsam.LevenbergMarquardtParams())
        error, iterations, converged = optimizer.error(), 0, False
        while iterations < self.settings.max_iterations:
            optimizer.iterate()
            iterations += 1
            new_error = optimizer.error()
            # GTSAM's own test: a decrease under the relative or the absolute (1e-5) tolerance
            if error - new_error <= max(self.settings.relative_error_tol * error, 1e-5):
                converged = True
                break
            error = new_error
            if time.perf_counter() > deadline or iterations == pause_after:
                break
        values = optimizer.values()
        estimate = matrices_of(values, initial.size())
        return lie.normalised(lie.inverse(estimate[0])[None] @ estimate), values, iterations, converged

    def _solve_groups(self, groups: list[_Group], deadline: float
                      ) -> tuple[list[_Group], np.ndarray, gtsam.Values, int, bool]:
        """Solve, and while the worst edge is past its bounds, drop it and solve again. Edges with a loop the
        last solve dropped start out held back (a stream's next solve would drop them again, one solve each)
        and join when they fit the solution; an edge joins at most once until a solve completes. A solve the
        budget cuts short keeps what it dropped and what joined, so the next goes on from there: starting
        over, a graph needing more drops than one budget holds would never complete."""
        large = self._chain.num_chunks > LEAVE_ONE_OUT_MAX_CHUNKS
        max_links = self.settings.pairwise_max_links
        # A whole run solved from its open chain: loops longer than the pairs were tested over wait until the
        # loops the pairs checked are solved, then join all at once, judged as the others are (waves of spans
        # doubling cost more solves than they saved: 12 s against 6 at 1,000 chunks). Through thousands of links the chain's
        # covariance is a linearisation far past its validity, so the odometry check passes loops off by tens
        # of radians, and with them in, Levenberg-Marquardt stalls at its first steps (3,000 chunks: every
        # loop past its bound, none accepted).
        unchecked = large and self._estimate is None and max_links is not None
        long = [unchecked and group.second - group.first > max_links for group in groups]
        later = [group for group, wait in zip(groups, long, strict=True) if wait]
        groups = [group for group, wait in zip(groups, long, strict=True) if not wait]
        kept = [group for group in groups if not self._misfit_loops.intersection(group.members)]
        held_back = [group for group in groups if self._misfit_loops.intersection(group.members)]
        (estimate, values), iterations = self._initial(), 0

        def handed_back(complete: bool) -> tuple[list[_Group], np.ndarray, gtsam.Values, int, bool]:
            self._misfit_loops = {loop for group in held_back for loop in group.members}
            if complete:
                self._joined.clear()
            return kept, estimate, values, iterations, complete

        while True:
            if kept:
                # a whole run's first solves: a look after a few iterations for gross false loops, each of which
                # would cost ~20 iterations (~0.1 s each at 1,000 chunks) to converge with
                pause = _GROSS_CHECK_ITERATIONS if large else None
                estimate, values, steps, converged = self._levenberg_marquardt(kept, values, deadline, pause)
                iterations += steps
                if not converged and steps == pause and time.perf_counter() <= deadline:
                    misfits = self._misfits(kept, estimate)
                    if misfits.max() > _GROSS_MISFIT:
                        gross = set(np.flatnonzero(misfits >= max(_GROSS_MISFIT, 0.5 * misfits.max())).tolist())
                        held_back += [kept[n] for n in sorted(gross)]
                        kept = [group for n, group in enumerate(kept) if n not in gross]
                        continue
                    estimate, values, steps, converged = self._levenberg_marquardt(kept, values, deadline)
                    iterations += steps
                if not converged:
                    return handed_back(False)
            posterior = self._posterior_of(kept)
            if kept:
                misfits = self._misfits(kept, estimate)
                if posterior is not None:  # the worst by all the tests: a true loop bent by a false one that
                    # alone holds its chunk pair has the larger own residual, the false one the larger left out
                    cheap = misfits
                    misfits = np.maximum(cheap, self._left_out_misfits(kept, posterior, estimate))
                    if misfits.max() > 1.0:  # which to drop, decided on the posterior linearised at the solution
                        posterior = self._posterior_at(kept, estimate)
                        misfits = np.maximum(cheap, self._left_out_misfits(kept, posterior, estimate))
                worst = int(np.argmax(misfits))
                if misfits[worst] > 1.0:
                    # every edge at least half as far past its bounds as the worst, in index order
                    over = np.flatnonzero(misfits >= max(1.0, 0.5 * misfits[worst]))
                    if posterior is None:  # a graph past check 5.'s bound (each LM solve of a whole run ~0.1 s):
                        # all of them, those gross false loops that slipped through the chain's slack; one that
                        # a false one bent joins again
                        dropped = set(over.tolist())
                    else:  # the worst `drops_per_round` of them, the worst first (1: `worst` alone)
                        worst_first = over[np.argsort(-misfits[over], kind="stable")]
                        dropped = set(worst_first[:self.settings.drops_per_round].tolist())
                    held_back += [kept[n] for n in sorted(dropped)]
                    kept = [group for n, group in enumerate(kept) if n not in dropped]
                    if time.perf_counter() > deadline:
                        return handed_back(False)
                    continue
            if later:
                kept, later = kept + later, []
                continue
            fitting = self._fitting(held_back, estimate, posterior) if held_back else np.zeros(0, bool)
            joining = [group for group, fits in zip(held_back, fitting, strict=True)
                       if fits and group.members not in self._joined]
            if not joining:
                return handed_back(True)
            self._joined.update(group.members for group in joining)
            kept += joining
            joined = {group.members for group in joining}
            held_back = [group for group in held_back if group.members not in joined]

    def solve(self, graph: PoseGraph) -> PoseGraphResult:
        """The corrected world-from-chunk of every chunk of `graph` and a verdict on each of its loops."""
        start = time.perf_counter()
        budget = self.settings.budget_s
        deadline = start + budget if budget is not None else float("inf")
        self._take_odometry(graph.odometry)
        active = self._take_loops(graph.loops)
        consistent = self._consistent(active, deadline)
        self._clique = consistent.tolist()
        accepted, estimate, values, iterations, complete = self._solve_groups(self._group(consistent), deadline)
        self._estimate, self._estimate_values = (estimate, values) if accepted else (None, None)
        kept = {i for group in accepted for i in group.members}
        if accepted:
            poses = _anchored_poses(estimate)
            at_poses = estimate.copy()
            at_poses[0] = np.eye(4)
        else:
            poses = open_chain(graph.odometry)
            at_poses = lie.matrices(poses)
        chi2 = self._loop_chi2(active, at_poses)
        in_set = set(consistent.tolist())
        verdicts = tuple(LoopVerdict(loop.loop_id, int(i) in kept, float(chi2[n]), int(i) in in_set,
                                     float(self._odometry_chi2[i]))
                         for n, (loop, i) in enumerate(zip(graph.loops, active, strict=True)))
        chain_chi2 = self._chain_chi2[active] if len(active) else np.zeros(0)
        return PoseGraphResult(
            world_from_chunk=poses, loops=verdicts, iterations=iterations,
            initial_error=0.5 * float(chain_chi2.sum()),
            final_error=0.5 * float(self._chain.odometry_chi2(at_poses).sum() + chi2[[i in kept for i in active]].sum()),
            seconds=time.perf_counter() - start, complete=complete)

    def _loop_chi2(self, loops: np.ndarray, world_from_chunk: np.ndarray) -> np.ndarray:
        if not len(loops):
            return np.zeros(0)
        return lie.residual_chi2(self._measured[loops], _between(world_from_chunk, self._ends[loops]),
                                 self._covariance[loops])


def loop_chi2(loops: Sequence[LoopEdge], world_from_chunk: Sequence[Sim3]) -> np.ndarray:
    """[L] each loop's squared residual in its sigmas at the poses: |Log(measured^-1 @ a_from_b)|^2 in its
    covariance's metric."""
    if not loops:
        return np.zeros(0)
    ends = np.array([(loop.first, loop.second) for loop in loops])
    return lie.residual_chi2(lie.matrices([loop.first_from_second for loop in loops]),
                             _between(lie.matrices(world_from_chunk), ends),
                             np.stack([covariance_of(loop) for loop in loops]))


def _between(world_from_chunk: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """[E, 4, 4] first_from_second of each (first, second) row of `ends` [E, 2] at the poses [K, 4, 4]."""
    return lie.inverse(world_from_chunk[ends[:, 0]]) @ world_from_chunk[ends[:, 1]]


def _anchored_poses(estimate: np.ndarray) -> tuple[Sim3, ...]:
    """Chunk 0 exactly the identity."""
    return (Sim3.identity(),) + lie.to_sim3s(estimate[1:])


def optimize(graph: PoseGraph, settings: PoseGraphSettings = PoseGraphSettings()) -> PoseGraphResult:
    """One solve of `graph` from scratch (a stream keeps a PoseGraphSolver between its solves)."""
    return PoseGraphSolver(settings).solve(graph)


__all__ = ["PoseGraphSolver", "loop_chi2", "optimize"]
