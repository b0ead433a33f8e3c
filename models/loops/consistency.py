"""Loops judged as a set before the pose graph sees them: pairwise consistency maximisation (PCM; Mangelson
et al. 2018, as Kimera-RPGO uses it).

Two loops a_from_b and c_from_d close a cycle with the odometry: a_from_b @ b_from_d @ (c_from_d)^-1 @
c_from_a, the identity if both are true. Its error, with a covariance propagated from every edge in the
cycle (each loop's own and the odometry's between its chunks, first order), is chi-square with 7 degrees
of freedom; two loops are consistent when it stays under the same quantile as the pose graph's inlier
bound. The loops kept are a largest set of mutually consistent ones (a maximum clique of the consistency
graph). A false loop can agree with the chain within its sigmas, but to survive it must agree with every
true loop of the set through the odometry that joins them: each true loop is one more witness against it.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import gtsam
import numpy as np

from ..stream.similarity import Sim3
from .pose_graph import TANGENT_DIM, LoopEdge, OdometryEdge, PoseGraph, to_gtsam

Uncertain = tuple[Sim3, np.ndarray]  # a transform T and the covariance [7, 7] of e in T @ Exp(e)


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

    low, high = 0.0, 10.0 * dof + 100.0
    for _ in range(200):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if cdf(middle) < probability else (low, middle)
    return 0.5 * (low + high)


def covariance_of(edge: OdometryEdge | LoopEdge) -> np.ndarray:
    return np.array(edge.covariance) if edge.covariance is not None else np.diag(np.square(edge.sigmas))


def adjoint(transform: Sim3) -> np.ndarray:
    """[7, 7] Ad_T: T @ Exp(e) @ T^-1 = Exp(Ad_T e)."""
    return np.asarray(to_gtsam(transform).AdjointMap())


def compose(factors: Sequence[Uncertain]) -> Uncertain:
    """The product T_1 @ ... @ T_n and its covariance: T_i Exp(e_i) moves the product by
    Exp(Ad_(T_i+1 ... T_n)^-1 e_i) on the right."""
    product, covariance = Sim3.identity(), np.zeros((TANGENT_DIM, TANGENT_DIM))
    for transform, transform_covariance in reversed(factors):
        to_right = adjoint(product.inverse())
        covariance = covariance + to_right @ transform_covariance @ to_right.T
        product = transform @ product
    return product, covariance


def invert(factor: Uncertain) -> Uncertain:
    """(T Exp(e))^-1 = T^-1 Exp(-Ad_T e)."""
    transform, covariance = factor
    to_inverse = adjoint(transform)
    return transform.inverse(), to_inverse @ covariance @ to_inverse.T


def odometry_between(graph: PoseGraph, x: int, y: int) -> Uncertain:
    """x_from_y through the odometry (odometry[k] is k_from_k+1), with its covariance."""
    if x > y:
        return invert(odometry_between(graph, y, x))
    return compose([(edge.previous_from_next, covariance_of(edge)) for edge in graph.odometry[x:y]])


def cycle_chi2(graph: PoseGraph, first: LoopEdge, second: LoopEdge) -> float:
    """The squared Mahalanobis norm of first @ b_from_d @ second^-1 @ c_from_a (first: a_from_b, second:
    c_from_d), whose error is chi-square with 7 dof when both loops are true."""
    cycle = compose([(first.first_from_second, covariance_of(first)),
                     odometry_between(graph, first.second, second.second),
                     invert((second.first_from_second, covariance_of(second))),
                     odometry_between(graph, second.first, first.first)])
    transform, covariance = cycle
    error = np.asarray(gtsam.Similarity3.Logmap(to_gtsam(transform)))
    return float(error @ np.linalg.solve(covariance, error))


# Two loops' cycle chi2, by their ids: a cycle runs through the odometry between their chunks, which never
# changes once those chunks are linked, so a stream's closer keeps these between solves and computes only a
# new loop's pairs (a pair costs ~1.5 ms; 100 loops have 4,950 pairs).
CycleChi2Cache = dict[tuple[Hashable, Hashable], float]


def consistency(graph: PoseGraph, bound: float, known: CycleChi2Cache | None = None) -> np.ndarray:
    """[L, L] bool: loops i and j are pairwise consistent (the diagonal is True). `known`: the cycle chi2 of
    pairs computed before for a graph with the same odometry up to their chunks; filled in."""
    known = {} if known is None else known
    count = len(graph.loops)
    consistent = np.eye(count, dtype=bool)
    for i in range(count):
        for j in range(i + 1, count):
            first, second = graph.loops[i], graph.loops[j]
            key = (first.loop_id, second.loop_id)
            if key not in known:
                known[key] = cycle_chi2(graph, first, second)
            consistent[i, j] = consistent[j, i] = known[key] <= bound
    return consistent


def maximum_clique(adjacent: np.ndarray) -> list[int]:
    """A largest set of mutually adjacent nodes (Bron-Kerbosch with a pivot; ties: the first found, in node
    order), ascending."""
    neighbours = [set(np.flatnonzero(row).tolist()) - {node} for node, row in enumerate(adjacent)]
    best: list[int] = []

    def expand(clique: list[int], candidates: set[int], excluded: set[int]) -> None:
        nonlocal best
        if len(clique) + len(candidates) <= len(best):
            return
        if not candidates and not excluded:
            best = sorted(clique)
            return
        pivot = max(candidates | excluded, key=lambda node: len(neighbours[node] & candidates))
        for node in sorted(candidates - neighbours[pivot]):
            expand(clique + [node], candidates & neighbours[node], excluded & neighbours[node])
            candidates = candidates - {node}
            excluded = excluded | {node}

    expand([], set(range(len(adjacent))), set())
    return best


def consistent_loops(graph: PoseGraph, probability: float, known: CycleChi2Cache | None = None) -> list[int]:
    """Indices (ascending) of a largest set of pairwise consistent loops of `graph` (`known`: as `consistency`)."""
    if len(graph.loops) <= 1:
        return list(range(len(graph.loops)))
    return maximum_clique(consistency(graph, chi_square_quantile(probability), known))


__all__ = ["chi_square_quantile", "compose", "consistent_loops", "cycle_chi2", "invert", "maximum_clique",
           "odometry_between"]
