"""PCM's maximum clique at a bounded cost (models/loops/cliques.py): the exact search against brute force and
against the set-based search (tests/clique_graphs.py), ties included, the heuristic on the real trajectories' consistency graphs, the budget,
and the warm start."""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest
from clique_graphs import (
    consistency_like,
    overlapping_cliques,
    random_graph,
    set_based_maximum_clique,
    symmetric,
)
from evo_data import evo_data_dir
from loop_scenarios import TRAJECTORIES, make_scenario, pair_consistency

from stream_recon.models.loops.cliques import (
    EXACT_BUDGET,
    CliqueResult,
    clique_through,
    complement_clique,
    exact_maximum_clique,
    heuristic_maximum_clique,
    maximum_clique,
)


def is_clique(adjacent: np.ndarray, nodes: list[int] | tuple[int, ...]) -> bool:
    return all(adjacent[i, j] for i in nodes for j in nodes if i != j)


def all_maximum_cliques(adjacent: np.ndarray) -> list[list[int]]:
    """Every largest clique, by trying every subset of the nodes (n <= 16)."""
    n = len(adjacent)
    subsets = np.arange(2 ** n)
    clique = np.ones(2 ** n, dtype=bool)
    for i, j in np.argwhere(np.triu(~adjacent, 1)):
        clique &= ~((subsets >> i) & (subsets >> j) & 1).astype(bool)
    sizes = np.array([int(subset).bit_count() for subset in subsets])
    largest = sizes[clique].max()
    return [[node for node in range(n) if subset >> node & 1] for subset in subsets[clique & (sizes == largest)]]


def graphs(seed: int, count: int, max_nodes: int) -> list[np.ndarray]:
    """Random graphs of 0 to max_nodes nodes at densities from 0.05 to 0.95, a third with self-loops."""
    rng = np.random.default_rng(seed)
    found = []
    for _ in range(count):
        adjacent = random_graph(rng, int(rng.integers(0, max_nodes + 1)), rng.uniform(0.05, 0.95))
        if rng.random() < 1 / 3:
            np.fill_diagonal(adjacent, True)  # the diagonal is ignored
        found.append(adjacent)
    return found


def cocktail_party(pairs: int) -> np.ndarray:
    """All edges but a perfect matching: 2**pairs largest cliques, every one a tie."""
    adjacent = ~np.eye(2 * pairs, dtype=bool)
    for k in range(pairs):
        adjacent[2 * k, 2 * k + 1] = adjacent[2 * k + 1, 2 * k] = False
    return adjacent


# -- (a) the exact search finds a largest clique: brute force -------------------------------------------------
def test_the_exact_search_finds_a_largest_clique_as_brute_force_does() -> None:
    for adjacent in graphs(seed=0, count=150, max_nodes=14):
        exact = exact_maximum_clique(adjacent)
        if len(adjacent) == 0:
            assert exact == []
            continue
        assert exact in all_maximum_cliques(adjacent), adjacent.astype(int)
        heuristic = heuristic_maximum_clique(adjacent)
        assert is_clique(adjacent, heuristic) and heuristic == sorted(heuristic) and 0 < len(heuristic) <= len(exact)
        bounded = maximum_clique(adjacent)
        assert bounded.exact and list(bounded.members) == exact


# -- (b) ... and the very one the set-based search finds ------------------------------------------------------
def test_the_exact_search_returns_what_the_set_based_search_returns() -> None:
    """The set-based search, ties included (it takes its pivot in a Python set's order): random graphs
    of up to 32 nodes and cocktail-party graphs, where every largest clique ties, give the same clique."""
    cases = graphs(seed=1, count=250, max_nodes=32) + [cocktail_party(pairs) for pairs in (2, 5, 9)]
    for adjacent in cases:
        set_based = set_based_maximum_clique(adjacent)
        assert exact_maximum_clique(adjacent) == set_based, adjacent.astype(int)
        assert exact_maximum_clique(adjacent, at_least=len(set_based)) == set_based
        assert exact_maximum_clique(adjacent, at_least=len(set_based) + 1) == []  # none that large
        bounded = maximum_clique(adjacent, exact_budget=10**6)
        assert bounded.exact and list(bounded.members) == set_based


# -- (c) the heuristic on the real trajectories' consistency graphs ------------------------------------------
@functools.cache
def scenario_consistency(name: str, seed: int) -> np.ndarray:
    trajectory = TRAJECTORIES[name]
    scenario = make_scenario(trajectory.poses(evo_data_dir()), seed, revisit_radius=trajectory.revisit_radius,
                             false_min_distance=0.0, scene_depth=trajectory.scene_depth,
                             subtle_false=trajectory.subtle_shift)
    return pair_consistency(scenario.graph)


def check_the_heuristic_finds_the_exact_clique(name: str, seed: int) -> None:
    adjacent = scenario_consistency(name, seed)
    exact = exact_maximum_clique(adjacent)
    assert heuristic_maximum_clique(adjacent) == exact == set_based_maximum_clique(adjacent)
    bounded = maximum_clique(adjacent)
    assert bounded.exact and list(bounded.members) == exact
    assert bounded.expansions <= EXACT_BUDGET // 10  # seen: 2-58


SCENARIO_NAMES = ("KITTI 00", "TUM fr1_xyz", "TUM fr2_desk")
QUICK_SCENARIOS = [("KITTI 00", 0), ("TUM fr1_xyz", 0)]  # 3-6 s each: the scenario and its pairs' chi2
MORE_SCENARIOS = [(name, seed) for name in SCENARIO_NAMES for seed in range(4) if (name, seed) not in QUICK_SCENARIOS]


@pytest.mark.parametrize(("name", "seed"), QUICK_SCENARIOS)
@pytest.mark.slow
def test_the_heuristic_finds_the_exact_clique_on_a_real_trajectorys_consistency_graph(name: str, seed: int) -> None:
    check_the_heuristic_finds_the_exact_clique(name, seed)


@pytest.mark.slow  # 3-12 s each (fr2_desk's 23 chunks take the longest)
@pytest.mark.parametrize(("name", "seed"), MORE_SCENARIOS)
def test_the_heuristic_finds_the_exact_clique_on_more_scenarios(name: str, seed: int) -> None:
    check_the_heuristic_finds_the_exact_clique(name, seed)


# -- (d) the budget --------------------------------------------------------------------------------------------
def test_a_spent_budget_leaves_the_heuristics_clique() -> None:
    adjacent = random_graph(np.random.default_rng(2), 300, 0.5)  # ~10^5 expansions to finish
    assert exact_maximum_clique(adjacent, budget=50) is None
    heuristic = heuristic_maximum_clique(adjacent)
    assert maximum_clique(adjacent, exact_budget=50) == CliqueResult(tuple(heuristic), exact=False, expansions=50)
    bounded = maximum_clique(adjacent)
    assert bounded == CliqueResult(tuple(heuristic), exact=False, expansions=EXACT_BUDGET)
    assert is_clique(adjacent, bounded.members)
    # a solve's deadline passed: the exact search stops at its first expansion, the heuristic's clique stands
    late = maximum_clique(adjacent, deadline=time.perf_counter())
    assert late == CliqueResult(tuple(heuristic), exact=False, expansions=1)


def test_many_overlapping_cliques_finish_within_the_budget() -> None:
    """A graph built to be hard for the exact search: 300 nodes, 40 overlapping cliques of 10-15 nodes."""
    for seed in range(3):
        adjacent = overlapping_cliques(seed=seed)
        bounded = maximum_clique(adjacent)
        assert bounded.exact and bounded.expansions <= EXACT_BUDGET // 2, bounded.expansions  # seen: 262-302
        assert list(bounded.members) == exact_maximum_clique(adjacent)


def test_a_clique_deeper_than_the_recursion_limit_is_searched() -> None:
    """1,100 true loops and one false loop consistent with all but one: the search goes ~1,100 levels
    deep, past Python's recursion limit (1,000), and finds a clique of 1,100."""
    adjacent = symmetric(np.ones((1101, 1101), dtype=bool))
    adjacent[1100, 0] = adjacent[0, 1100] = False
    exact = exact_maximum_clique(adjacent)
    assert len(exact) == 1100 and is_clique(adjacent, exact)
    assert len(heuristic_maximum_clique(adjacent)) == 1100


def test_a_consistency_like_graph_of_1000_loops_is_solved_exactly() -> None:
    adjacent = consistency_like(1000, seed=1)
    bounded = maximum_clique(adjacent)
    assert bounded.exact and len(bounded.members) == 800 and bounded.expansions <= EXACT_BUDGET // 10
    assert list(bounded.members) == heuristic_maximum_clique(adjacent)


# -- (e) the warm start ----------------------------------------------------------------------------------------
def two_equal_cliques() -> np.ndarray:
    """Nodes 0-4 and 5-9: two cliques of 5, joined by one edge (4-5)."""
    adjacent = np.zeros((12, 12), dtype=bool)
    adjacent[:5, :5] = adjacent[5:10, 5:10] = True
    adjacent[4, 5] = True
    return symmetric(adjacent)


def test_a_warm_start_clique_stands_against_an_equal_one() -> None:
    adjacent = two_equal_cliques()
    assert heuristic_maximum_clique(adjacent) == [0, 1, 2, 3, 4]  # highest degree first: node 4
    assert heuristic_maximum_clique(adjacent, warm_start=[9, 5, 6, 7, 8]) == [5, 6, 7, 8, 9]


def test_a_warm_start_is_cut_to_a_clique_and_extended() -> None:
    adjacent = two_equal_cliques()
    adjacent[10, 5:10] = adjacent[5:10, 10] = True  # a new loop consistent with the previous clique
    assert heuristic_maximum_clique(adjacent, warm_start=[5, 6]) == [5, 6, 7, 8, 9, 10]
    assert heuristic_maximum_clique(adjacent, warm_start=[5, 0, 6, 5, 11]) == [5, 6, 7, 8, 9, 10]
    assert heuristic_maximum_clique(adjacent, warm_start=np.array([7])) == [5, 6, 7, 8, 9, 10]


def test_a_warm_start_clique_is_what_a_spent_budget_leaves() -> None:
    adjacent = two_equal_cliques()
    warm_start = [5, 6]  # [5] alone would grow by node 4 (the highest degree) to [4, 5]
    assert maximum_clique(adjacent, warm_start=warm_start, exact_budget=0) == CliqueResult((5, 6, 7, 8, 9), False, 0)
    finished = maximum_clique(adjacent, warm_start=warm_start)  # a tie: the set-based search's clique
    assert finished.exact and finished.members == (0, 1, 2, 3, 4)


def test_a_bad_adjacency_or_warm_start_is_refused_in_one_sentence() -> None:
    with pytest.raises(ValueError, match=r"square \[n, n\] matrix, got shape \(3, 4\)"):
        maximum_clique(np.ones((3, 4), dtype=bool))
    with pytest.raises(ValueError, match="warm start node 12 is not a node of this 12-node graph"):
        heuristic_maximum_clique(two_equal_cliques(), warm_start=[3, 12])


def test_a_clique_through_new_nodes_is_found_when_it_beats_the_old_one() -> None:
    """Nodes 0-5 a clique; nodes 6-9 added, 6 adjacent to 0-3 and to 7-9, which are adjacent to each other and
    to 0-3: the clique 0-3 + 6-9 (8 nodes) holds node 6; growing from 6 finds it. From a node that cannot
    beat six, nothing."""
    adjacent = np.zeros((11, 11), bool)
    adjacent[:6, :6] = True
    members = [0, 1, 2, 3, 6, 7, 8, 9]
    adjacent[np.ix_(members, members)] = True
    adjacent[10, 0] = adjacent[0, 10] = True  # degree 1
    np.fill_diagonal(adjacent, False)
    assert clique_through(adjacent, [6], beat=6) == members
    assert clique_through(adjacent, [10], beat=6) is None
    assert clique_through(adjacent, [10, 6], beat=6) == members
    assert clique_through(adjacent, [6], beat=8) is None  # not larger than eight
    assert exact_maximum_clique(adjacent) == members


def test_a_dense_graphs_clique_comes_from_covering_its_few_missing_edges() -> None:
    """A whole run's consistency graph is nearly complete (pairs beyond the chain's reach count as
    consistent): the complement's greedy cover finds the planted clique of 2,000 among 2,400 nodes, each
    outsider missing edges to a few dozen, in well under a second, and maximum_clique takes it there."""
    rng = np.random.default_rng(0)
    size, planted = 2400, 2000
    adjacent = np.ones((size, size), bool)
    for outsider in range(planted, size):
        missing = rng.choice(size, 40, replace=False)
        adjacent[outsider, missing] = adjacent[missing, outsider] = False
    np.fill_diagonal(adjacent, True)
    started = time.perf_counter()
    found = complement_clique(adjacent)
    seconds = time.perf_counter() - started
    assert adjacent[np.ix_(found, found)].all() and len(found) >= planted
    assert all(not adjacent[node, found].all() for node in set(range(size)) - set(found))  # maximal
    assert seconds < 1.0
    assert list(maximum_clique(adjacent, exact_budget=0).members) == found
