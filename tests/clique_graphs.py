"""Graphs for PCM's maximum clique (models/loops/cliques.py): its tests and scripts/probes/probe_cliques.py."""

from __future__ import annotations

import numpy as np


def symmetric(upper: np.ndarray) -> np.ndarray:
    """[n, n] bool: `upper`'s pairs above the diagonal, both ways; no self-loops."""
    upper = np.triu(upper, 1)
    return upper | upper.T


def random_graph(rng: np.random.Generator, n: int, edge_probability: float) -> np.ndarray:
    return symmetric(rng.random((n, n)) < edge_probability)


def consistency_like(n: int, true_fraction: float = 0.8, edge_probability: float = 0.05, seed: int = 0) -> np.ndarray:
    """[n, n] bool: a consistency graph's shape. round(true_fraction * n) true loops, pairwise consistent
    (one clique); every other pair consistent with `edge_probability` (a false loop's chance agreements);
    the nodes in a random order (loops arrive in time, true and false mixed)."""
    rng = np.random.default_rng(seed)
    adjacent = rng.random((n, n)) < edge_probability
    true_nodes = rng.permutation(n)[: round(true_fraction * n)]
    adjacent[np.ix_(true_nodes, true_nodes)] = True
    return symmetric(adjacent)


def overlapping_cliques(n: int = 300, cliques: int = 40, sizes: tuple[int, int] = (10, 16),
                        edge_probability: float = 0.05, seed: int = 0) -> np.ndarray:
    """[n, n] bool: `cliques` cliques of sizes in [sizes[0], sizes[1]) on random nodes (so they share nodes),
    over random edges: many near-largest cliques for an exact search to tell apart."""
    rng = np.random.default_rng(seed)
    adjacent = rng.random((n, n)) < edge_probability
    for _ in range(cliques):
        members = rng.choice(n, int(rng.integers(*sizes)), replace=False)
        adjacent[np.ix_(members, members)] = True
    return symmetric(adjacent)


def set_based_maximum_clique(adjacent: np.ndarray) -> list[int]:
    """The plain Bron-Kerbosch search with a pivot on Python sets, whose results (ties included: the first
    found, the pivot taken in a set's order) the exact search keeps; ascending."""
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
