"""Loops judged against the odometry and against each other before the pose graph solves with them.

Two tests, both a cycle's error against a covariance propagated to first order from every edge in the
cycle, chi-square with 7 degrees of freedom when the loops are true:

- **A loop against the odometry it closes** (`odometry_cycle_chi2`): a_from_b @ b_from_a, the second
  through the chain between its chunks. A false loop that happens to agree with another false loop still
  has to agree with the drift the chain can have had between its chunks (Kimera-RPGO's odometry check).
- **Two loops against each other** (`pair_cycle_chi2`, pairwise consistency maximisation, PCM; Mangelson
  et al. 2018, as Kimera-RPGO uses it): a_from_b @ b_from_d @ (c_from_d)^-1 @ c_from_a. The loops kept
  are a largest set of mutually consistent ones (a maximum clique of the consistency graph, cliques.py).

The chain's part of a cycle is the odometry between two chunks. Composed link by link it costs a 7 x 7
adjoint per link and pair: O(loops^2 x chunks) for a solve's pairs. Here it costs O(1) a pair:
`ChainCovariances.anchored(x)` carries every link's covariance into chunk x's frame once (one batched
product over the chain) and sums them outward from x, so the covariance of x_from_z for every z is one
lookup. The new loop's two chunks are the anchors of all its pairs (a pair's cycle leaves and re-enters
the chain at them), so a new loop costs two anchored sums, O(chunks), and its pairs one batched NumPy
computation, O(loops). Summing outward from the anchor adds positive terms only: no difference of large
prefix sums, whose rounding grows with the square of the distance from the world's origin. `pair_blocks`
picks a solve's pairs to test (within `pairwise_max_links` of the chain) in batches of bounded memory.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence

import numpy as np

from . import sim3_batch as lie
from .sim3_batch import TANGENT_DIM, adjoint, inverse, logmap, mahalanobis2, residual_chi2, sandwich

_ANCHORS_KEPT = 8  # anchored sums kept: a few new loops' chunks (~0.4 MB each at 1,000 chunks)
# Chunks a block anchor serves (between_covariance): a whole run's 1,000 chunks need 32 anchored sums where
# one a chunk cost 1,000; a pair's sums are then differences over at most 31 links more than the pair spans.
_BLOCK = 32
_BLOCKS_KEPT = 128  # ~50 MB at 1,000 chunks: every block of a 4,096-chunk graph
Uncertain = tuple[np.ndarray, np.ndarray]  # a transform [4, 4] and the covariance [7, 7] of e in T @ Exp(e)


@functools.lru_cache(maxsize=256)
def chi_square_quantile(probability: float, dof: int = TANGENT_DIM) -> float:
    """The chi-square quantile, by bisection on the regularised lower incomplete gamma function (series)."""
    def cdf(x: float) -> float:
        half, s = x / 2.0, dof / 2.0
        term = total = 1.0 / s
        n = 0
        while term > 1e-15 * total:
            n += 1
            term *= half / (s + n)
            total += term
        return math.exp(s * math.log(half) - half - math.lgamma(s)) * total

    low, high = 0.0, 10.0 * dof + 100.0 + 10.0 * math.sqrt(dof)
    for _ in range(200):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if cdf(middle) < probability else (low, middle)
    return 0.5 * (low + high)


# -- the reference: products composed factor by factor ---------------------------------------------
def compose(factors: Sequence[Uncertain]) -> Uncertain:
    """The product T_1 @ ... @ T_n and its covariance: T_i Exp(e_i) moves the product by
    Exp(Ad_(T_i+1 ... T_n)^-1 e_i) on the right. Link by link: the reference the batched forms are
    tested against."""
    product, covariance = np.eye(4), np.zeros((TANGENT_DIM, TANGENT_DIM))
    for transform, transform_covariance in reversed(factors):
        covariance = covariance + sandwich(adjoint(inverse(product)), transform_covariance)
        product = transform @ product
    return product, covariance


def invert(factor: Uncertain) -> Uncertain:
    """(T Exp(e))^-1 = T^-1 Exp(-Ad_T e)."""
    transform, covariance = factor
    return inverse(transform), sandwich(adjoint(transform), covariance)


# -- the chain ---------------------------------------------------------------------------------------
class ChainCovariances:
    """The open chain (odometry[k] is k_from_k+1) and its link covariances, for the odometry between any
    two chunks.

    `world_from_chunk` [K, 4, 4]: the links composed. Link i's error, on the right of chunk i+1's placement,
    is carried into chunk x's frame by Ad(W_x^-1 W_i+1); the sum over the links between x and z is then
    the covariance of x_from_z as a perturbation on the left (in chunk x's frame), whichever of x and z
    comes first (an inverted link's error sits on its left, at the same chunk)."""

    def __init__(self, links: np.ndarray, link_covariances: np.ndarray):
        self.links = np.asarray(links, np.float64).reshape(-1, 4, 4)  # [K-1, 4, 4] k_from_k+1
        self.link_covariances = np.asarray(link_covariances, np.float64).reshape(-1, TANGENT_DIM, TANGENT_DIM)
        chain = [np.eye(4)]
        for link in self.links:
            chain.append(chain[-1] @ link)
        self.world_from_chunk = np.stack(chain)
        self._world_sums: np.ndarray | None = None
        # the last anchors' sums: a new loop's chunks are the anchors of its check against the chain and of
        # all its pairs, asked for one after the other (each O(chunks) to make)
        self._anchored: dict[int, np.ndarray] = {}
        self._blocks: dict[int, np.ndarray] = {}  # block anchors' sums (between_covariance)

    @property
    def num_chunks(self) -> int:
        return len(self.world_from_chunk)

    def between(self, x: np.ndarray | int, z: np.ndarray | int) -> np.ndarray:
        """[..., 4, 4] x_from_z through the open chain."""
        return inverse(self.world_from_chunk[x]) @ self.world_from_chunk[z]

    def anchored(self, x: int) -> np.ndarray:
        """[K, 7, 7] (read-only): row z is the covariance of x_from_z through the chain, on its left (chunk x's
        frame); row x is zero. Summed outward from x."""
        if x in self._anchored:
            return self._anchored[x]
        carried = sandwich(adjoint(inverse(self.world_from_chunk[x]) @ self.world_from_chunk[1:]),
                           self.link_covariances)  # [K-1]: link i into chunk x's frame
        out = np.zeros((self.num_chunks, TANGENT_DIM, TANGENT_DIM))
        out[x + 1:] = np.cumsum(carried[x:], axis=0)
        if x > 0:
            out[:x] = np.cumsum(carried[:x][::-1], axis=0)[::-1]
        out.setflags(write=False)
        if len(self._anchored) >= _ANCHORS_KEPT:
            del self._anchored[next(iter(self._anchored))]
        self._anchored[x] = out
        return out


    def between_covariance(self, x: np.ndarray, z: np.ndarray) -> np.ndarray:
        """[N, 7, 7] row z[n] of anchored(x[n]) (the covariance of x_from_z through the chain, on its left),
        from sums anchored at every _BLOCK-th chunk: O(chunks) a block anchor, then O(1) a pair, where
        anchored(x) costs O(chunks) for each distinct x (1,000 distinct chunks of a whole run: 1,000 sums).
        Chunk x's anchor A is the block's first chunk at or before it; the links between x and z are summed
        outward from A (never a difference of sums reaching past A's block by more than its 31 links), then
        carried from A's frame into x's."""
        x, z = np.atleast_1d(x).astype(np.int64), np.atleast_1d(z).astype(np.int64)
        out = np.empty((len(x), TANGENT_DIM, TANGENT_DIM))
        anchors = (x // _BLOCK) * _BLOCK
        for anchor in np.unique(anchors).tolist():
            chosen = np.flatnonzero(anchors == anchor)
            sums = self._block_sums(anchor)
            near, far = x[chosen], z[chosen]
            between = sums[near] + sums[far]  # far before the anchor: anchor..near and far..anchor
            after, before = (far >= near), (far >= anchor) & (far < near)
            between[after] = sums[far[after]] - sums[near[after]]
            between[before] = sums[near[before]] - sums[far[before]]
            carry = adjoint(inverse(self.world_from_chunk[near]) @ self.world_from_chunk[anchor])
            out[chosen] = sandwich(carry, between)
        return out

    def _block_sums(self, anchor: int) -> np.ndarray:
        """[K, 7, 7] row k: the links between chunk `anchor` and chunk k carried into the anchor's frame and
        summed outward from it (row `anchor` zero)."""
        if anchor not in self._blocks:
            if len(self._blocks) >= _BLOCKS_KEPT:
                del self._blocks[next(iter(self._blocks))]
            self._blocks[anchor] = self.anchored(anchor)
        return self._blocks[anchor]

    def world_sums(self) -> np.ndarray:
        """[K, 7, 7] S_k: links 0..k-1 carried into the world's frame and summed, so that the covariance of
        x_from_z (x < z) on its left is Ad(W_x^-1) (S_z - S_x) Ad(W_x^-1)^T in O(1). The difference of two
        sums loses ~1e-16 x (distance from the origin / the span's extent)^2 of its value: kept for the
        bending test at a solution, a bound of ~24 against misfits in the hundreds; the cycle tests above
        use the exact `anchored` sums."""
        if self._world_sums is None:
            carried = sandwich(adjoint(self.world_from_chunk[1:]), self.link_covariances)
            self._world_sums = np.concatenate([np.zeros((1, TANGENT_DIM, TANGENT_DIM)), np.cumsum(carried, axis=0)])
        return self._world_sums

    def bending_chi2(self, first: np.ndarray, second: np.ndarray, solved: np.ndarray) -> np.ndarray:
        """[G] how far a solution's first_from_second [G, 4, 4] (first < second) moved from the chain's, in
        the chain's own uncertainty between the two chunks: chi-square with 7 dof when the chain only
        gave up the drift it can have had."""
        sums = self.world_sums()
        chained = self.between(first, second)
        left = sandwich(adjoint(inverse(self.world_from_chunk[first])), sums[second] - sums[first])
        right = sandwich(adjoint(inverse(chained)), left)
        return residual_chi2(chained, solved, right)

    def odometry_chi2(self, world_from_chunk: np.ndarray) -> np.ndarray:
        """[K-1] each link's squared residual in its sigmas at the poses [K, 4, 4]."""
        if not len(self.links):
            return np.zeros(0)
        solved = inverse(world_from_chunk[:-1]) @ world_from_chunk[1:]
        return residual_chi2(self.links, solved, self.link_covariances)


def odometry_between(chain: ChainCovariances, x: int, z: int) -> Uncertain:
    """x_from_z through the chain and its covariance on the right (chunk z's frame)."""
    transform = chain.between(x, z)
    return transform, sandwich(adjoint(inverse(transform)), chain.anchored(x)[z])


# -- cycles ------------------------------------------------------------------------------------------
def _right_chi2(cycle: np.ndarray, left_terms: Sequence[tuple[np.ndarray, np.ndarray]],
                right_term: np.ndarray) -> np.ndarray:
    """chi2 of the cycles [N, 4, 4] (product P = X_1 ... X_n), their covariance on the right: each
    (prefix, covariance) a factor's left perturbation carried by Ad(P^-1 prefix), plus `right_term`
    (already at P's right end)."""
    back = inverse(cycle)
    covariance = right_term.copy()
    for prefix, term in left_terms:
        covariance += sandwich(adjoint(back @ prefix), term)
    return mahalanobis2(logmap(cycle), covariance)


def odometry_cycle_chi2(chain: ChainCovariances, first: np.ndarray, second: np.ndarray, measured: np.ndarray,
                        covariance: np.ndarray) -> np.ndarray:
    """[N] each loop against the chain: first_from_second (its measurement [N, 4, 4], covariance [N, 7, 7]
    on the right) composed with second_from_first through the odometry."""
    first, second = np.atleast_1d(first), np.atleast_1d(second)
    cycle = measured @ chain.between(second, first)
    # the measurement's left perturbation is Ad(Z) C Ad(Z)^T at prefix I; the chain's is at `first`, the right end
    return _right_chi2(cycle, [(measured, covariance)], chain.between_covariance(first, second))


def pair_cycle_chi2(chain: ChainCovariances, loop: Uncertain, chunks: tuple[int, int], others: Uncertain,
                    other_chunks: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """[N] one loop a_from_b against N others c_from_d (`pairs_cycle_chi2` with the one loop repeated)."""
    (measured, covariance), (a, b) = loop, chunks
    count = len(other_chunks[0])
    repeat = np.zeros(count, np.int64)
    return pairs_cycle_chi2(chain, (measured[None][repeat], covariance[None][repeat]),
                            (np.full(count, a), np.full(count, b)), others, other_chunks)


def _anchored_rows(chain: ChainCovariances, anchors: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """[P, 7, 7] row rows[p] of chain.anchored(anchors[p])."""
    return chain.between_covariance(anchors, rows)


def pairs_cycle_chi2(chain: ChainCovariances, loops: Uncertain, chunks: tuple[np.ndarray, np.ndarray],
                     others: Uncertain, other_chunks: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """[P] P pairs of loops, a_from_b [P] against c_from_d [P]: the cycle a_from_b @ b_from_d @ (c_from_d)^-1
    @ c_from_a, the chain's parts through `chain`. With the other loop first it is the same cycle conjugated
    and inverted, equal to first order (the covariance is linearised at other products: a few % apart). The
    chain's covariances come from the anchored sums of the loops' own chunks (a and b): a few loops' pairs
    with all others cost a few O(chunks) sums and O(P) batched products."""
    (measured, covariance), (a, b) = loops, chunks
    (other_measured, other_covariance), (c, d) = others, other_chunks
    through_b = measured @ chain.between(b, d)  # a_from_d
    through_d = through_b @ inverse(other_measured)  # a_from_c
    cycle = through_d @ chain.between(c, a)
    # a_from_b's right error and b_from_d's left one (chunk b's sum) both sit after the prefix a_from_b;
    # (c_from_d)^-1's left error is the other loop's right one, after a_from_d; c_from_a's right end is the
    # cycle's (chunk a's sum)
    terms = [(measured, covariance + _anchored_rows(chain, b, d)), (through_b, other_covariance)]
    return _right_chi2(cycle, terms, _anchored_rows(chain, a, c))


# -- loops of one chunk pair, combined --------------------------------------------------------------
def combine(measured: np.ndarray, covariance: np.ndarray, max_iterations: int = 20) -> Uncertain:
    """One edge from N measurements [N, 4, 4] of the same first_from_second with covariances [N, 7, 7] on
    the right: the information-weighted mean on the manifold (Gauss-Newton from the first, each
    measurement's error taken in the mean's tangent, until a step moves it by less than 1e-12) and the
    covariance of that mean."""
    means, covariances = combine_groups(measured, covariance, np.zeros(len(measured), np.int64), max_iterations)
    return means[0], covariances[0]


def combine_groups(measured: np.ndarray, covariance: np.ndarray, group: np.ndarray,
                   max_iterations: int = 20) -> tuple[np.ndarray, np.ndarray]:
    """`combine` for G groups at once: measurement n [N, 4, 4] (covariance [N, 7, 7]) belongs to group
    group[n] (0..G-1, each non-empty) -> the means [G, 4, 4] and their covariances [G, 7, 7]. A solve's few
    changed chunk pairs cost one batched Gauss-Newton instead of ~1 ms of NumPy calls a step and pair."""
    count = int(group.max()) + 1
    information = np.linalg.inv(covariance)
    total = np.zeros((count, TANGENT_DIM, TANGENT_DIM))
    np.add.at(total, group, information)
    first = np.unique(group, return_index=True)[1]  # each group's first measurement
    means = measured[first].copy()
    moving = np.ones(count, bool)
    for _ in range(max_iterations):
        errors = logmap(inverse(means)[group] @ measured)  # Z_n = mean Exp(e_n)
        pulled = np.zeros((count, TANGENT_DIM))
        np.add.at(pulled, group, np.einsum("nij,nj->ni", information, errors))
        steps = np.linalg.solve(total, pulled[..., None])[..., 0]
        steps[~moving] = 0.0
        means = means @ lie.expmap(steps)
        moving &= np.abs(steps).max(axis=1) >= 1e-12
        if not moving.any():
            break
    combined = np.linalg.inv(total)
    return means, 0.5 * (combined + np.swapaxes(combined, -1, -2))


# -- which pairs a solve tests, in blocks ------------------------------------------------------------
# Pairs judged in one batched computation: ~1.5 KB of temporaries a pair, so 4,096 pairs keep them near 6 MB
# while a solve's few new loops against a few hundred others still go in one call.
_PAIRS_A_BATCH = 4096


def pair_blocks(indices: np.ndarray, count: int, against_all: bool, ends: np.ndarray, eligible: np.ndarray,
                 max_links: int | None, consistent: np.ndarray) -> Iterable[np.ndarray]:
    """[P, 2] (loop, other) index pairs to test, in blocks of about _PAIRS_A_BATCH: each loop of `indices`
    with every other of the `count` loops, or only with the loops before it; both eligible, and (with
    `max_links`) their cycle through no more than that many links of the chain. The pairs left untested are
    marked consistent in `consistent` here."""
    pending: list[np.ndarray] = []
    size = 0
    for i in indices.tolist():
        others = np.arange(count if against_all else i)
        others = others[others != i]
        consistent[i, others] = consistent[others, i] = True
        if not eligible[i]:
            continue
        others = others[eligible[others]]
        if max_links is not None:  # the cycle runs through the chain between b and d and between c and a
            links = np.abs(ends[others, 1] - ends[i, 1]) + np.abs(ends[others, 0] - ends[i, 0])
            others = others[links <= max_links]
        if not len(others):
            continue
        pending.append(np.stack([np.full(len(others), i), others], axis=1))
        size += len(others)
        if size >= _PAIRS_A_BATCH:
            yield np.concatenate(pending)
            pending, size = [], 0
    if pending:
        yield np.concatenate(pending)

__all__ = ["ChainCovariances", "chi_square_quantile", "combine", "combine_groups", "compose", "invert", "odometry_between",
           "odometry_cycle_chi2", "pair_blocks", "pair_cycle_chi2", "pairs_cycle_chi2"]
