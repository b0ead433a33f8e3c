"""Each edge of a solved pose graph against what all its other edges say about the edge's two chunks.

An edge's residual at a solution that includes it is not a fair test of it: the solution bends towards the
edge, most where nothing else holds its two chunks. A false loop that is the only one between its chunks
pulls them onto itself and fits its own solution. The fair test is the edge against the others: the
solution of the graph without it predicts the edge's measurement, and the two differ by no more than their
summed uncertainties when the edge is true (Baarda's data snooping; the normalised residual of least
squares).

With e_i the edge's error at the solution, C_i its covariance, and M_i the covariance of its chunks' relative
pose under the posterior of the whole graph (the edge included), the prediction without the edge misses by
d_i with

    d_i^T cov(d_i)^-1 d_i = e_i^T (C_i - M_i)^-1 e_i,

chi-square with 7 degrees of freedom when the edge is true: one posterior of the whole graph instead of one
solve per edge (tests/test_models_loop_leave_one_out.py checks it against solving without each edge). The
same posterior judges an edge outside the graph (a loop held back) against the solution: e^T (C + M)^-1 e.

Each edge is linearised at its own measurement: e(first Exp(a), second Exp(b)) ~ e + b - Ad(measured^-1) a.
At a solution an edge's error is a few of its sigmas (thousandths of a radian for a loop, a degree for a
link), so this differs from linearising at the solution by that much of the statistic, and it makes the
posterior a function of the edges alone, not of the poses: a stream's solves keep it, and each edge that
joins or leaves the graph is a rank-7 update of it (Woodbury), O(chunks^2), where forming it again costs
O(chunks^3). It is dense ([7 (K - 1)]^2, chunk 0 fixed), which bounds the graphs it is kept for
(`MAX_CHUNKS`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from . import sim3_batch as lie
from .sim3_batch import TANGENT_DIM

# The dense posterior is [7 (K - 1)]^2: at 200 chunks 1,393^2 (15 MB), formed in 0.05-0.15 s on the 2-core
# machine (shared), and cubic beyond (1,000 chunks: 5 s and more). Larger graphs are not tested this way.
MAX_CHUNKS = 200
# An eigenvalue of I - H (H = C^-1/2 M C^-T/2) is the share of the information along its direction that
# the other edges hold. Below this the edge alone determines the direction: nothing predicts it there, the
# solver's last steps along it would be amplified a millionfold, and removing the edge cannot be an update.
_UNPREDICTED = 1e-6
# Edges added or removed by updates before the posterior is formed again from its edges: each update's
# rounding (~1e-16 of the largest entries, amplified by the updates' conditioning) stays far below the
# statistic's own precision.
_UPDATES_BEFORE_FORMING = 256


class Posterior:
    """The covariance of chunks 1..K-1's poses (chunk 0 is fixed) under a chain of links and a set of
    keyed edges between any chunks, each linearised at its measurement.

    `links` [K-1, 4, 4] k_from_k+1 and their covariances [K-1, 7, 7]; `with_links` grows the chain,
    `change` adds and removes edges (refused when an edge's removal would leave a direction of its chunks
    to nothing else, or when the posterior is due to be formed again: the caller forms a new one)."""

    def __init__(self, links: np.ndarray, link_covariances: np.ndarray,
                 edges: dict[Hashable, tuple[int, int, np.ndarray, np.ndarray]] | None = None,
                 at: np.ndarray | None = None):
        self.links = np.asarray(links, np.float64).reshape(-1, 4, 4)
        self.link_covariances = np.asarray(link_covariances, np.float64).reshape(-1, TANGENT_DIM, TANGENT_DIM)
        if len(self.links) + 1 > MAX_CHUNKS:
            raise ValueError(f"{len(self.links) + 1} chunks: above {MAX_CHUNKS} the posterior is not formed")
        self.edges: dict[Hashable, tuple[int, int, np.ndarray, np.ndarray]] = dict(edges or {})
        self.updates = 0
        # [K, 4, 4] the poses every edge is linearised at, when not at its measurement (a posterior formed once,
        # for decisions that bends of several sigmas would sway: see the solver's drops)
        self.at = at
        self._covariance = _formed(self.links, self.link_covariances, list(self.edges.values()), at)

    @property
    def num_chunks(self) -> int:
        return len(self.links) + 1

    def with_links(self, links: np.ndarray, link_covariances: np.ndarray) -> None:
        """Chunks hung on the last one by more links (each new chunk = the one before, through its link)."""
        if self.at is not None:
            raise ValueError("a posterior linearised at given poses is not updated")
        for link, covariance in zip(links, link_covariances, strict=True):
            if self.num_chunks + 1 > MAX_CHUNKS:
                raise ValueError(f"{self.num_chunks + 1} chunks: above {MAX_CHUNKS} the posterior is not formed")
            self._covariance = _hung(self._covariance, link, covariance)
            self.links = np.concatenate([self.links, link[None]])
            self.link_covariances = np.concatenate([self.link_covariances, covariance[None]])

    def change(self, added: Sequence[tuple[Hashable, int, int, np.ndarray, np.ndarray]],
               removed: Sequence[Hashable]) -> bool:
        """Edges in (key, first, second, first_from_second [4, 4], its error's covariance [7, 7] on the right)
        and out (keys), in one update of rank 7 an edge; False (and unchanged) when an update cannot do it
        (see the class)."""
        if not added and not removed:
            return True
        if self.at is not None:
            raise ValueError("a posterior linearised at given poses is not updated")
        if self.updates + len(added) + len(removed) > _UPDATES_BEFORE_FORMING:
            return False
        covariance = self._covariance
        if removed:
            ends, measured, edge_covariance = _stacked([self.edges[key] for key in removed])
            covariance = _updated(covariance, ends, measured, edge_covariance, -1.0)
            if covariance is None:
                return False
        if added:
            ends, measured, edge_covariance = _stacked([edge[1:] for edge in added])
            covariance = _updated(covariance, ends, measured, edge_covariance, 1.0)
        self._covariance = covariance
        for key in removed:
            del self.edges[key]
        self.edges.update((key, tuple(edge)) for key, *edge in added)
        self.updates += len(added) + len(removed)
        return True

    def left_out(self, world_from_chunk: np.ndarray, keys: Sequence[Hashable]) -> np.ndarray:
        """[T] each of these edges' chi2 against what the chain and the other edges predict at the solution
        `world_from_chunk` [K, 4, 4]: e^T (C - M)^-1 e."""
        ends, measured, covariance = _stacked([self.edges[key] for key in keys])
        return _chi2_over_predicted(_errors(world_from_chunk, ends, measured), covariance,
                                    self.relative_covariance(ends, measured), -1.0)

    def predicting(self, world_from_chunk: np.ndarray, ends: np.ndarray, measured: np.ndarray,
                   covariance: np.ndarray) -> np.ndarray:
        """[N] edges outside the graph against its solution `world_from_chunk`: e^T (C + M)^-1 e."""
        return _chi2_over_predicted(_errors(world_from_chunk, ends, measured), covariance,
                                    self.relative_covariance(ends, measured), 1.0)

    def relative_covariance(self, ends: np.ndarray, measured: np.ndarray) -> np.ndarray:
        """[N, 7, 7] the covariance of first_from_second's error under the posterior, at second: J P J^T with
        J = [-Ad(measured^-1), I] (nothing for chunk 0)."""
        toward_first = _toward_first(ends, measured, self.at)
        first, second = ends[:, 0], ends[:, 1]
        blocks = self._covariance.reshape(self.num_chunks - 1, TANGENT_DIM, self.num_chunks - 1, TANGENT_DIM)
        at = np.swapaxes(toward_first, -1, -2)
        return (toward_first @ _blocks(blocks, first, first) @ at + toward_first @ _blocks(blocks, first, second)
                + _blocks(blocks, second, first) @ at + _blocks(blocks, second, second))


def _blocks(blocks: np.ndarray, rows: np.ndarray, columns: np.ndarray) -> np.ndarray:
    """[N, 7, 7] the posterior's block of each (row, column) chunk pair; zero where either is chunk 0."""
    out = np.zeros((len(rows), TANGENT_DIM, TANGENT_DIM))
    free = (rows > 0) & (columns > 0)
    out[free] = blocks[rows[free] - 1, :, columns[free] - 1, :]
    return out


def _stacked(edges: Sequence[tuple[int, int, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ends = np.array([(first, second) for first, second, _, _ in edges], np.int64).reshape(-1, 2)
    measured = np.stack([edge[2] for edge in edges]) if edges else np.zeros((0, 4, 4))
    covariance = np.stack([edge[3] for edge in edges]) if edges else np.zeros((0, TANGENT_DIM, TANGENT_DIM))
    return ends, measured, covariance


def _toward_first(ends: np.ndarray, measured: np.ndarray, at: np.ndarray | None) -> np.ndarray:
    """[E, 7, 7] each edge's error's Jacobian toward its first chunk's perturbation: -Ad(relative^-1), the
    relative pose its measurement, or the one the poses `at` make."""
    relative = measured if at is None else lie.inverse(at[ends[:, 0]]) @ at[ends[:, 1]]
    return -lie.adjoint(lie.inverse(relative))


def _errors(world_from_chunk: np.ndarray, ends: np.ndarray, measured: np.ndarray) -> np.ndarray:
    """[E, 7] each edge's error Log(measured^-1 first_from_second) at the poses."""
    relative = lie.inverse(world_from_chunk[ends[:, 0]]) @ world_from_chunk[ends[:, 1]]
    return lie.logmap(lie.inverse(measured) @ relative)


def _chain_covariance(links: np.ndarray, link_covariances: np.ndarray) -> np.ndarray:
    """[7 (K - 1)]^2 the chain's alone: chunk k+1's perturbation is Ad(link^-1) times chunk k's plus the
    link's own error."""
    covariance = np.zeros((0, 0))
    for link, link_covariance in zip(links, link_covariances, strict=True):
        covariance = _hung(covariance, link, link_covariance)
    return covariance


def _hung(covariance: np.ndarray, link: np.ndarray, link_covariance: np.ndarray) -> np.ndarray:
    """The posterior with one more chunk hung on the last one by `link` (no other edge reaches it)."""
    size = len(covariance)
    carried = lie.adjoint(lie.inverse(link))
    out = np.zeros((size + TANGENT_DIM, size + TANGENT_DIM))
    out[:size, :size] = covariance
    if size:
        row = carried @ covariance[size - TANGENT_DIM:]  # [7, size]: the last chunk's rows, carried
        out[size:, :size] = row
        out[:size, size:] = row.T
        out[size:, size:] = row[:, size - TANGENT_DIM:] @ carried.T + link_covariance
    else:
        out[:, :] = link_covariance
    return out


def _updated(covariance: np.ndarray, ends: np.ndarray, measured: np.ndarray, edge_covariance: np.ndarray,
             sign: float) -> np.ndarray | None:
    """The posterior with edges added (sign 1) or removed (sign -1): P -/+ P J^T (C +/- J P J^T)^-1 J P, J the
    edges' Jacobians stacked ([7 E, n], two blocks a row); None for a removal that leaves a direction
    predicted by nothing (I - H singular: see _UNPREDICTED)."""
    size = len(covariance)
    toward_first = -lie.adjoint(lie.inverse(measured))
    gain = np.zeros((size, TANGENT_DIM * len(ends)))  # P J^T
    for n, (first, second) in enumerate(ends.tolist()):
        columns = slice(TANGENT_DIM * n, TANGENT_DIM * (n + 1))
        if first:
            gain[:, columns] += covariance[:, TANGENT_DIM * (first - 1):TANGENT_DIM * first] @ toward_first[n].T
        if second:
            gain[:, columns] += covariance[:, TANGENT_DIM * (second - 1):TANGENT_DIM * second]
    projected = np.zeros((TANGENT_DIM * len(ends), TANGENT_DIM * len(ends)))  # J P J^T
    for n, (first, second) in enumerate(ends.tolist()):
        rows = slice(TANGENT_DIM * n, TANGENT_DIM * (n + 1))
        if first:
            projected[rows] += toward_first[n] @ gain[TANGENT_DIM * (first - 1):TANGENT_DIM * first]
        if second:
            projected[rows] += gain[TANGENT_DIM * (second - 1):TANGENT_DIM * second]
    innovation = sign * projected
    for n in range(len(ends)):
        innovation[TANGENT_DIM * n:TANGENT_DIM * (n + 1), TANGENT_DIM * n:TANGENT_DIM * (n + 1)] += edge_covariance[n]
    innovation = 0.5 * (innovation + innovation.T)
    if sign < 0:  # C - J P J^T whitened by C: its eigenvalues are those of I - H, the edges' shares left
        lower = np.linalg.cholesky(_block_diagonal(edge_covariance))
        whitening = np.linalg.inv(lower)
        if np.linalg.eigvalsh(whitening @ innovation @ whitening.T)[0] <= _UNPREDICTED:
            return None
    out = np.dot(gain, np.linalg.solve(sign * innovation, gain.T))  # (one n x n temporary, subtracted in place)
    np.subtract(covariance, out, out=out)
    return out


def _block_diagonal(blocks: np.ndarray) -> np.ndarray:
    size = TANGENT_DIM * len(blocks)
    out = np.zeros((size, size))
    for n, block in enumerate(blocks):
        out[TANGENT_DIM * n:TANGENT_DIM * (n + 1), TANGENT_DIM * n:TANGENT_DIM * (n + 1)] = block
    return out


def _formed(links: np.ndarray, link_covariances: np.ndarray,
            edges: Sequence[tuple[int, int, np.ndarray, np.ndarray]], at: np.ndarray | None) -> np.ndarray:
    """[7 (K - 1)]^2 the posterior formed from scratch: the information matrix J^T W J over the links and
    the edges (linearised at their measurements or at the poses `at`), inverted (the chain's own closed
    form when there are no edges and no poses)."""
    if not edges and at is None:
        return _chain_covariance(links, link_covariances)
    chunks = np.arange(len(links))
    link_ends = np.stack([chunks, chunks + 1], axis=1)
    ends, measured, covariance = _stacked(edges)
    all_ends, all_measured = np.concatenate([link_ends, ends]), np.concatenate([links, measured])
    information = np.linalg.inv(np.concatenate([link_covariances, covariance]))
    toward_first = _toward_first(all_ends, all_measured, at)
    free = len(links)
    weighted = np.swapaxes(toward_first, -1, -2) @ information  # J_first^T W
    first, second = all_ends[:, 0], all_ends[:, 1]
    total = np.zeros((free * free, TANGENT_DIM, TANGENT_DIM))
    for rows, columns, values in ((first, first, weighted @ toward_first), (first, second, weighted),
                                  (second, first, np.swapaxes(weighted, -1, -2)), (second, second, information)):
        kept = (rows > 0) & (columns > 0)
        flat = (rows[kept] - 1) * free + columns[kept] - 1
        for axis in range(TANGENT_DIM * TANGENT_DIM):  # np.add.at over [n, 7, 7] is ~10x slower than 49 bincounts
            i, j = divmod(axis, TANGENT_DIM)
            total[:, i, j] += np.bincount(flat, values[kept][:, i, j], free * free)
    size = TANGENT_DIM * free
    dense = total.reshape(free, free, TANGENT_DIM, TANGENT_DIM).transpose(0, 2, 1, 3).reshape(size, size)
    return np.linalg.inv(dense) if size else dense


def _chi2_over_predicted(errors: np.ndarray, covariance: np.ndarray, predicted: np.ndarray,
                         sign: float) -> np.ndarray:
    """[N] e^T (C + sign M)^-1 e, whitened by C = L L^T; with sign -1 (an edge left out of the posterior it
    is part of) over the directions the other edges predict."""
    lower_inverse = np.linalg.inv(np.linalg.cholesky(covariance))
    whitened = np.einsum("tij,tj->ti", lower_inverse, errors)
    leverage = lower_inverse @ predicted @ np.swapaxes(lower_inverse, -1, -2)
    combined = np.eye(TANGENT_DIM) + sign * 0.5 * (leverage + np.swapaxes(leverage, -1, -2))
    eigenvalues, vectors = np.linalg.eigh(combined)
    projected = np.einsum("tji,tj->ti", vectors, whitened)
    kept = eigenvalues > _UNPREDICTED
    return np.sum(np.where(kept, projected**2 / np.where(kept, eigenvalues, 1.0), 0.0), axis=-1)


__all__ = ["MAX_CHUNKS", "Posterior"]
