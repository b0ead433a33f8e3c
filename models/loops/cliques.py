"""PCM's maximum clique at a bounded cost: a fast heuristic, then an exact search on a budget.

Pairwise consistency keeps a largest set of mutually consistent loops, a maximum clique of the consistency
graph (models/loops/consistency.py). Finding one is NP-hard: Bron-Kerbosch is exponential in the worst case,
and the closer solves after every new loop, so one unlucky graph must not stall it. `maximum_clique` runs:

1. the heuristic of Pattabiraman, Patwary, Gebremedhin, Liao and Choudhary, "Fast algorithms for the
   maximum clique problem on massive graphs with applications to overlapping community detection" (2015;
   the one Kimera-RPGO runs): from each node in order of decreasing degree, a clique grown greedily, always
   by its candidate of highest degree, nodes of degree below the best size so far never considered. At
   most O(n d^2) (d the largest degree); a previous solve's clique can seed it (`warm_start`);
2. Bron-Kerbosch with a pivot, pruned to cliques at least as large as the heuristic's and stopped after
   `EXACT_BUDGET` expansions. When it finishes, its clique is the answer (a maximum one, ties as below);
   when it does not, the heuristic's is, and `CliqueResult.exact` says so.

Consistency graphs are easy for both: the true loops form one large clique that the heuristic finds from
its first node, and the exact search then proves it in a few expansions, because a node whose candidates
already form a clique is settled without branching.

Ties: the exact search returns the first largest clique it reaches, branching in node order, its pivot the
first node of highest score in the iteration order of the Python set `candidates | excluded` (CPython's
hash-table order, not node order) built by the set operations of a set-based Bron-Kerbosch. That is the
rule consistency.maximum_clique's set-based search follows, so both return the same clique for every graph
(tests/test_models_loop_cliques.py); the search keeps those sets for that choice alone and does all else
on bitsets (a Python int per node, bit j set when it is adjacent to j).

Cost on this 2-core machine (shared and busy; scripts/probes/probe_cliques.py, medians of 5): the
heuristic takes 0.3 ms at 100 nodes, 1.0 ms at 300, 8 ms at 1,000 and 35 ms at 3,000 on consistency-like
graphs (80 % of the nodes in one clique, every other pair consistent at 0.05). The exact search then needs
9, 13, 46 and 100 expansions (0.6, 5.5, 30 and 310 ms), and 2-58 on the real trajectories' consistency
graphs. An expansion costs up to |candidates| + |excluded| popcounts of n-bit ints plus its branches' set
operations: 50-80 us on random graphs of 100-1,000 nodes at 0.5, which spend `EXACT_BUDGET` in 50-80 ms,
but ~3 ms at 3,000 nodes in a clique of 2,400, whose candidates lose one node an expansion.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Expansions of the exact search before the heuristic's clique stands: 50-80 ms on random graphs of 100 to
# 1,000 nodes at 0.5 on this machine (they spend it); consistency graphs need 2-100 (module docstring).
EXACT_BUDGET = 1_000


@dataclass(frozen=True)
class CliqueResult:
    """The clique a bounded search kept: `members` ascending; `exact` when the exact search finished within
    its budget (a maximum clique), else the heuristic's; `expansions` the exact search ran (<= its budget)."""

    members: tuple[int, ...]
    exact: bool
    expansions: int


class _Graph:
    """An [n, n] bool symmetric adjacency as bitsets, with the degree order the heuristic walks."""

    def __init__(self, adjacent: np.ndarray) -> None:
        adjacent = np.asarray(adjacent, dtype=bool)
        if adjacent.ndim != 2 or adjacent.shape[0] != adjacent.shape[1]:
            raise ValueError(f"an adjacency must be a square [n, n] matrix, got shape {adjacent.shape}")
        self.adjacent = adjacent
        self.size = n = len(adjacent)
        packed = np.packbits(adjacent, axis=1, bitorder="little")  # [n, ceil(n / 8)]
        nodes = np.arange(n)
        packed[nodes, nodes >> 3] &= ~(1 << (nodes & 7)).astype(np.uint8)  # the diagonal is no edge
        self.bits = [int.from_bytes(row.tobytes(), "little") for row in packed]
        self.degree = [bits.bit_count() for bits in self.bits]
        self.by_degree = sorted(range(n), key=lambda node: -self.degree[node])  # ties: node order
        self._rank_prefix: list[int] | None = None
        self._neighbour_sets: dict[int, set[int]] = {}

    @property
    def rank_prefix(self) -> list[int]:
        """[n + 1] bitsets: rank_prefix[k] holds the k nodes of highest degree (by_degree[:k])."""
        if self._rank_prefix is None:
            prefix = [0]
            for node in self.by_degree:
                prefix.append(prefix[-1] | 1 << node)
            self._rank_prefix = prefix
        return self._rank_prefix

    def neighbour_set(self, node: int) -> set[int]:
        """Node's neighbours as a set-based search's set, built as it builds it (its iteration order matters)."""
        if node not in self._neighbour_sets:
            self._neighbour_sets[node] = set(np.flatnonzero(self.adjacent[node]).tolist()) - {node}
        return self._neighbour_sets[node]


def _members(bits: int) -> list[int]:
    """The set bits of `bits`, ascending."""
    found = []
    while bits:
        lowest = bits & -bits
        found.append(lowest.bit_length() - 1)
        bits ^= lowest
    return found


# -- the heuristic -----------------------------------------------------------------------------------------
def _first_by_degree(graph: _Graph, candidates: int, rank: int) -> int:
    """The lowest rank >= `rank` (rank: place in by_degree) of a node in `candidates` (not 0, and none of
    lower rank in it): a gallop, then bisection, over the rank prefixes, O(log gap) big-int ANDs."""
    prefix, step = graph.rank_prefix, 1
    low, high = rank, min(rank + 1, graph.size)
    while not candidates & prefix[high]:
        low, high, step = high, min(high + step, graph.size), 2 * step
    while high - low > 1:  # candidates & prefix[low] == 0 and candidates & prefix[high] != 0
        middle = (low + high) // 2
        low, high = (low, middle) if candidates & prefix[middle] else (middle, high)
    return low


def _grow(graph: _Graph, clique: list[int], candidates: int, beat: int) -> list[int] | None:
    """`clique` extended greedily, each time by its candidate of highest degree (candidates: the common
    neighbours, as bits); None as soon as it cannot grow past `beat` nodes."""
    rank = 0
    while candidates:
        if len(clique) + candidates.bit_count() <= beat:
            return None
        rank = _first_by_degree(graph, candidates, rank)
        node = graph.by_degree[rank]
        clique.append(node)
        candidates &= graph.bits[node]
        rank += 1  # the candidates left are common neighbours of `node`: all of lower degree rank
    return clique if len(clique) > beat else None


def _warm_clique(graph: _Graph, warm_start: Sequence[int]) -> list[int]:
    """The warm start's nodes that are adjacent to every earlier one kept, in its order, then grown."""
    kept: list[int] = []
    common = (1 << graph.size) - 1
    for node in warm_start:
        node = int(node)
        if not 0 <= node < graph.size:
            raise ValueError(f"warm start node {node} is not a node of this {graph.size}-node graph")
        if common >> node & 1:  # adjacent to every node kept (so not one of them: no self-loops)
            kept.append(node)
            common &= graph.bits[node]
    return (_grow(graph, kept, common, 0) or []) if kept else []


def _heuristic(graph: _Graph, warm_start: Sequence[int]) -> list[int]:
    best = _warm_clique(graph, warm_start)
    degrees = [graph.degree[node] for node in graph.by_degree]  # descending
    eligible_count = graph.size  # nodes of degree >= len(best) are ranks [0, eligible_count)
    for node in graph.by_degree:
        if graph.degree[node] < len(best):
            break  # and so are all nodes after it
        while eligible_count and degrees[eligible_count - 1] < len(best):
            eligible_count -= 1
        candidates = graph.bits[node] & graph.rank_prefix[eligible_count]
        grown = _grow(graph, [node], candidates, len(best))
        if grown is not None:
            best = grown
    return sorted(best)


def clique_through(adjacent: np.ndarray, nodes: Sequence[int], beat: int) -> list[int] | None:
    """The heuristic's step from `nodes` alone: from each (highest degree first), a clique grown greedily by
    its candidate of highest degree; the largest of more than `beat` nodes, ascending, or None. When a graph
    whose largest clique had `beat` nodes gains a few nodes, a larger clique must hold one of them: growing
    from those costs O(k d) big-int steps where the whole heuristic costs O(n d) (n nodes, d the degree)."""
    graph = _Graph(adjacent)
    best: list[int] | None = None
    for node in sorted((int(node) for node in nodes), key=lambda node: -graph.degree[node]):
        if graph.degree[node] < beat:  # its clique has at most degree + 1 nodes
            continue
        grown = _grow(graph, [node], graph.bits[node], beat)
        if grown is not None:
            best, beat = grown, len(grown)
    return None if best is None else sorted(best)


def heuristic_maximum_clique(adjacent: np.ndarray, *, warm_start: Sequence[int] = ()) -> list[int]:
    """A large clique of `adjacent` ([n, n] bool, symmetric; the diagonal is ignored), ascending, by
    Pattabiraman et al.'s heuristic (the module's docstring). `warm_start`: node indices (a previous
    solve's clique), cut to a clique in their order and grown: it stands unless a larger one is found."""
    return _heuristic(_Graph(adjacent), warm_start)


# -- the exact search --------------------------------------------------------------------------------------
class _BudgetSpent(Exception):
    """The search's budget of expansions is spent: it unwinds the whole stack at once."""


class _ExactSearch:
    """Bron-Kerbosch with a pivot, depth first on an explicit stack (a clique of ~1,000 nodes is deeper
    than Python's recursion limit). A frame: [clique, candidates, excluded, candidate set, excluded set,
    branches left]; the sets are a set-based search's, kept only for the pivot's order among ties."""

    def __init__(self, graph: _Graph, at_least: int, budget: int | None, deadline: float | None = None) -> None:
        self.graph, self.at_least, self.budget, self.deadline = graph, at_least, budget, deadline
        self.best: list[int] = []
        self.expansions = 0

    def can_beat(self, clique_size: int, candidates: int) -> bool:
        """Whether a node can reach a clique larger than the best so far (so the first largest one found
        stands) and not smaller than `at_least` (so a clique of exactly that size is still found)."""
        reach = clique_size + candidates.bit_count()
        return reach > len(self.best) and reach >= self.at_least

    def run(self) -> list[int] | None:
        everything = (1 << self.graph.size) - 1
        stack: list[list] = []
        try:
            if self.can_beat(0, everything):
                self.expand(stack, (), everything, 0, set(range(self.graph.size)), set())
            while stack:
                self.step(stack)
        except _BudgetSpent:
            return None
        return self.best

    def step(self, stack: list[list]) -> None:
        """The next branch of the top frame: its node joins the clique in a child frame, then moves from the
        frame's candidates to its excluded."""
        frame = stack[-1]
        clique, candidates, excluded, candidate_set, excluded_set, branches = frame
        if not branches:
            stack.pop()
            return
        lowest = branches & -branches
        node = lowest.bit_length() - 1
        frame[1:] = [candidates & ~lowest, excluded | lowest, candidate_set - {node}, excluded_set | {node},
                     branches ^ lowest]
        neighbours = self.graph.bits[node]
        if self.can_beat(len(clique) + 1, candidates & neighbours):
            neighbour_set = self.graph.neighbour_set(node)
            self.expand(stack, clique + (node,), candidates & neighbours, excluded & neighbours,
                        candidate_set & neighbour_set, excluded_set & neighbour_set)

    def expand(self, stack: list[list], clique: tuple[int, ...], candidates: int, excluded: int,
               candidate_set: set[int], excluded_set: set[int]) -> None:
        """A node of the search that can beat the best: settled at once when its candidates are a clique
        (the only maximal clique below it is clique + candidates), else pushed with its branches."""
        self.expansions += 1
        if self.budget is not None and self.expansions > self.budget:
            self.expansions = self.budget
            raise _BudgetSpent
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise _BudgetSpent
        bits, count = self.graph.bits, candidates.bit_count()
        if all((bits[node] & candidates).bit_count() == count - 1 for node in candidate_set):
            if not any((bits[node] & candidates).bit_count() == count for node in excluded_set):
                self.best = sorted(clique + tuple(_members(candidates)))
            return
        pivot = self.pivot(candidates, candidate_set, excluded_set)
        stack.append([clique, candidates, excluded, candidate_set, excluded_set, candidates & ~bits[pivot]])

    def pivot(self, candidates: int, candidate_set: set[int], excluded_set: set[int]) -> int:
        """A set-based search's pivot, max(candidate_set | excluded_set, key=neighbours among the candidates):
        the first node of that set's order with the highest score. No candidate scores more than
        |candidates| - 1, so once the excluded nodes' best is known, the first node that reaches the highest
        score possible is it, usually after a few nodes where the candidates are nearly a clique."""
        bits = self.graph.bits
        ceiling = max(candidates.bit_count() - 1,
                      max(((bits[node] & candidates).bit_count() for node in excluded_set), default=0))
        pivot, top_score = -1, -1
        for node in candidate_set | excluded_set:
            score = (bits[node] & candidates).bit_count()
            if score == ceiling:
                return node
            if score > top_score:
                pivot, top_score = node, score
        return pivot


def _exact(graph: _Graph, at_least: int, budget: int | None, deadline: float | None = None
           ) -> tuple[list[int] | None, int]:
    search = _ExactSearch(graph, at_least, budget, deadline)
    return search.run(), search.expansions


def exact_maximum_clique(adjacent: np.ndarray, *, at_least: int = 0, budget: int | None = None) -> list[int] | None:
    """A maximum clique of `adjacent` ([n, n] bool, symmetric; the diagonal is ignored), ascending, ties as
    the module's docstring says (consistency.maximum_clique's for every graph).
    `at_least`: only cliques of at least that many nodes are searched for ([] when there is none);
    `budget`: None when that many expansions did not finish the search."""
    return _exact(_Graph(adjacent), at_least, budget)[0]


def complement_clique(adjacent: np.ndarray) -> list[int]:
    """A large clique of a dense graph, ascending: its complement's edges (the inconsistent pairs, few) are
    covered greedily, each time by the node on most of them (ties: the later node), and the nodes left are
    a clique; then each removed node adjacent to all of them joins back, in node order. O(removed x n),
    where the heuristic's growth from node after node costs O(n d^2): 1.3 s at 720 nodes of a whole run's
    consistency graph (density 0.98 once pairs beyond the chain's reach count as consistent), 20 s at 2,400."""
    adjacent = np.asarray(adjacent, dtype=bool)
    conflicts = ~adjacent
    np.fill_diagonal(conflicts, False)
    degree = conflicts.sum(axis=1)
    alive = np.ones(len(adjacent), bool)
    while degree.max(initial=0) > 0:
        worst = len(degree) - 1 - int(np.argmax(degree[::-1]))
        alive[worst] = False
        degree -= conflicts[:, worst]
        degree[worst] = 0
    for node in np.flatnonzero(~alive).tolist():
        if not conflicts[node, alive].any():
            alive[node] = True
    return np.flatnonzero(alive).tolist()


# the heuristic's growth is O(n d^2): above this many nodes at this density the complement's cover is used
_DENSE_NODES, _DENSE_FRACTION = 300, 0.9


def maximum_clique(adjacent: np.ndarray, *, warm_start: Sequence[int] = (),
                   exact_budget: int = EXACT_BUDGET, deadline: float | None = None) -> CliqueResult:
    """The bounded step: the heuristic (seeded by `warm_start`; a dense graph of more than 300 nodes: the
    complement's greedy cover, `complement_clique`, or the warm start when larger), then the exact search for
    a clique at least as large within `exact_budget` expansions and before `deadline` (time.perf_counter's
    clock; None: no limit); its clique when it finishes, else the heuristic's."""
    size = len(adjacent)
    if size > _DENSE_NODES and np.count_nonzero(adjacent) >= _DENSE_FRACTION * size * size:
        found = complement_clique(adjacent)
        warm = sorted(warm_start)
        if len(warm) > len(found) and np.asarray(adjacent)[np.ix_(warm, warm)].all():
            found = warm
        if exact_budget == 0:
            return CliqueResult(tuple(found), exact=False, expansions=0)
        graph = _Graph(adjacent)
        exact, expansions = _exact(graph, len(found), exact_budget, deadline)
        return CliqueResult(tuple(found if exact is None else exact), exact=exact is not None, expansions=expansions)
    graph = _Graph(adjacent)
    found = _heuristic(graph, warm_start)
    exact, expansions = _exact(graph, len(found), exact_budget, deadline)
    if exact is None:
        return CliqueResult(tuple(found), exact=False, expansions=expansions)
    return CliqueResult(tuple(exact), exact=True, expansions=expansions)


__all__ = ["EXACT_BUDGET", "CliqueResult", "clique_through", "complement_clique", "exact_maximum_clique",
           "heuristic_maximum_clique", "maximum_clique"]
