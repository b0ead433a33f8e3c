"""PCM's maximum clique (models/loops/cliques.py): the heuristic and the bounded exact search, timed on
consistency-like graphs and on one built to be hard for the exact search.

    .venv/bin/python scripts/probes/probe_cliques.py
    .venv/bin/python scripts/probes/probe_cliques.py --sizes 100 300 --repeats 5

A consistency-like graph of n loops: a fraction (`--true-fraction`, 0.8) are true and pairwise consistent
(one clique); every other pair is consistent with probability `--edge-probability` (0.05), the false
loops' chance agreements; node order shuffled (loops arrive in time, true and false mixed). The hard
graphs: 300 nodes, 40 overlapping cliques of 10-15 nodes over random edges at 0.05 (the exact search
finishes), and random graphs of 100, 300 and 1,000 nodes at 0.5 (it runs out of budget). Each figure is
the median of `--repeats` runs, in ms.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from clique_graphs import consistency_like, overlapping_cliques, random_graph  # noqa: E402

from stream_recon.models.loops.cliques import (  # noqa: E402
    EXACT_BUDGET,
    exact_maximum_clique,
    heuristic_maximum_clique,
    maximum_clique,
)


def median_ms(run, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times), result


def report(name: str, adjacent: np.ndarray, repeats: int) -> None:
    heuristic_ms, found = median_ms(lambda: heuristic_maximum_clique(adjacent), repeats)
    bounded_ms, bounded = median_ms(lambda: maximum_clique(adjacent), repeats)
    print(f"{name}: heuristic {heuristic_ms:.2f} ms ({len(found)} nodes); bounded (heuristic + exact, budget "
          f"{EXACT_BUDGET}) {bounded_ms:.2f} ms ({len(bounded.members)} nodes, exact {bounded.exact}, "
          f"{bounded.expansions} expansions)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 300, 1000, 3000])
    parser.add_argument("--true-fraction", type=float, default=0.8)
    parser.add_argument("--edge-probability", type=float, default=0.05)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for n in args.sizes:
        adjacent = consistency_like(n, args.true_fraction, args.edge_probability, seed=n)
        report(f"consistency-like, {n} nodes", adjacent, args.repeats)
    hard = overlapping_cliques()
    report("overlapping cliques, 300 nodes", hard, args.repeats)
    unbounded_ms, exact = median_ms(lambda: exact_maximum_clique(hard), 1)
    print(f"overlapping cliques, 300 nodes: exact search unbounded {unbounded_ms:.2f} ms ({len(exact)} nodes)")
    for n in (100, 300, 1000):  # random graphs at 0.5: the budget runs out
        report(f"random at 0.5, {n} nodes", random_graph(np.random.default_rng(n), n, 0.5), args.repeats)


if __name__ == "__main__":
    main()
