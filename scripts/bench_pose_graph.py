"""The pose graph's figures: drift corrected and false loops rejected on real trajectories, and solve times.

    .venv/bin/python scripts/bench_pose_graph.py                  # everything (the 10,000-chunk solves: minutes)
    .venv/bin/python scripts/bench_pose_graph.py --sizes 100      # real trajectories and 100 chunks only
    .venv/bin/python scripts/bench_pose_graph.py --pypose         # also pypose's Levenberg-Marquardt, to compare
    .venv/bin/python scripts/bench_pose_graph.py --scratch 100 300 1000 3000   # a whole run's solve, how it grows
    .venv/bin/python scripts/bench_pose_graph.py --stream 100 --budget 0.1       # a stream's incremental solves
    .venv/bin/python scripts/bench_pose_graph.py --map 30 300 3000 --stream 30   # a --map stream's, by the map's size

Real trajectories (tests/loop_scenarios.py, the same set-up as tests/test_models_pose_graph.py): KITTI 00
and TUM fr1_xyz from evo's sdist (tests/evo_data.py fetches it, or STREAM_RECON_EVO_DATA names it), cut into
chunks of 320 frames (16 shared), odometry with ~1 degree / 2 % / 1 % of path noise, loops at every revisit
(fits with their own covariances, as the stream makes them), 20 % false loops; several seeds. Timings: synthetic chunk chains (a random walk, a loop per ten chunks to a chunk
up to 50 before it, 20 % of loops false) solved by `optimize` (GNC and the check) and by plain Levenberg-Marquardt in GTSAM, and,
with --pypose, by pypose's dense Levenberg-Marquardt.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import gtsam
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from evo_data import evo_data_dir  # noqa: E402
from loop_scenarios import (  # noqa: E402
    chunk_ranges,
    make_scenario,
    read_kitti_poses,
    read_tum_poses,
    revisits,
    synthetic_graph,
)

from stream_recon.models.loops.gtsam_sim3 import to_gtsam  # noqa: E402
from stream_recon.models.loops.pose_graph import PoseGraphSolver, optimize  # noqa: E402
from stream_recon.models.loops.pose_graph_data import (  # noqa: E402
    OdometryEdge,
    PoseGraph,
    PoseGraphSettings,
    covariance_of,
    open_chain,
)
from stream_recon.models.stream.similarity import Sim3  # noqa: E402

KITTI_NO_REVISITS = slice(620, 3240)  # as in tests/test_models_pose_graph.py


def real_trajectory(name: str, truth: np.ndarray, seeds: int, revisit: float, false_distance: float,
                    scene_depth: float) -> None:
    ratios, opens, corrected, times = [], [], [], []
    false_rejected = false_total = true_accepted = true_total = 0
    for seed in range(seeds):
        scenario = make_scenario(truth, seed, revisit_radius=revisit, false_min_distance=false_distance,
                                 scene_depth=scene_depth)
        result = optimize(scenario.graph)
        accepted = set(result.accepted_ids)
        opens.append(scenario.ate(open_chain(scenario.graph.odometry)))
        corrected.append(scenario.ate(result.world_from_chunk))
        ratios.append(corrected[-1] / opens[-1])
        times.append(result.seconds)
        false_rejected += len(scenario.false_loops - accepted)
        false_total += len(scenario.false_loops)
        true_accepted += len(scenario.true_loops & accepted)
        true_total += len(scenario.true_loops)
    chunks = scenario.graph.num_chunks
    print(f"{name}: {len(truth)} frames, {chunks} chunks, {len(scenario.true_loops)} true and "
          f"{len(scenario.false_loops)} false loops a seed, {seeds} seeds")
    print(f"  Sim(3) ATE open chain: mean {np.mean(opens):.4g}, corrected: mean {np.mean(corrected):.4g}")
    print(f"  corrected / open: mean {np.mean(ratios):.3f}, median {np.median(ratios):.3f}, "
          f"min {np.min(ratios):.3f}, max {np.max(ratios):.3f}, seeds above 0.25: {np.sum(np.array(ratios) > 0.25)}")
    print(f"  false loops rejected {false_rejected}/{false_total}, true loops accepted {true_accepted}/{true_total}")
    print(f"  optimize: median {1e3 * statistics.median(times):.1f} ms, max {1e3 * max(times):.1f} ms")


def no_revisit_stretch(kitti: np.ndarray, seeds: int) -> None:
    stretch = kitti[KITTI_NO_REVISITS]
    ranges = chunk_ranges(len(stretch))
    assert revisits(stretch, ranges, 20.0) == {}
    offered = sum(len(range(a + 2, len(ranges))) for a in range(len(ranges)))
    accepted = identical = 0
    for seed in range(seeds):
        scenario = make_scenario(stretch, seed, revisit_radius=5.0, false_min_distance=50.0, scene_depth=15.0,
                                 false_loops=offered)
        result = optimize(scenario.graph)
        accepted += len(result.accepted_ids)
        chain = open_chain(scenario.graph.odometry)
        identical += all(np.array_equal(a.scaled_matrix, b.scaled_matrix) and a.scale == b.scale
                         for a, b in zip(result.world_from_chunk, chain, strict=True))
    print(f"KITTI 00 frames {KITTI_NO_REVISITS.start}-{KITTI_NO_REVISITS.stop} (no revisits, {len(ranges)} chunks), "
          f"{offered} false loops a seed, {seeds} seeds: {accepted} accepted, open chain bit-identical in "
          f"{identical}/{seeds}")


# -- timings on synthetic chains -------------------------------------------------------------------
def plain_lm_seconds(graph: PoseGraph) -> tuple[float, int]:
    """GTSAM's Levenberg-Marquardt over the odometry and the true loops, no robustness: the floor of what a
    solve costs (with the false loops too it stalls at once on a long chain)."""
    factors = gtsam.NonlinearFactorGraph()
    factors.add(gtsam.PriorFactorSimilarity3(0, gtsam.Similarity3(), gtsam.noiseModel.Isotropic.Sigma(7, 1e-6)))
    edges = [(k, k + 1, edge) for k, edge in enumerate(graph.odometry)]
    edges += [(loop.first, loop.second, loop) for loop in graph.loops if loop.loop_id.startswith("true")]
    for first, second, edge in edges:
        measured = edge.previous_from_next if isinstance(edge, OdometryEdge) else edge.first_from_second
        factors.add(gtsam.BetweenFactorSimilarity3(first, second, to_gtsam(measured),
                                                   gtsam.noiseModel.Gaussian.Covariance(covariance_of(edge))))
    values = gtsam.Values()
    for k, transform in enumerate(open_chain(graph.odometry)):
        values.insert(k, to_gtsam(transform))
    start = time.perf_counter()
    optimizer = gtsam.LevenbergMarquardtOptimizer(factors, values, gtsam.LevenbergMarquardtParams())
    optimizer.optimize()
    return time.perf_counter() - start, optimizer.iterations()


def pypose_lm_seconds(graph: PoseGraph, max_steps: int = 20) -> tuple[float, int] | str:
    """pypose 0.9.5's Levenberg-Marquardt over all edges (dense Jacobian on the CPU; its sparse mode needs
    the `bae` backend and CUDA). Our tangent [rotation, translation, log s] is pypose's [translation,
    rotation, log s]: the sigmas are reordered."""
    try:
        import pypose as pp
        import torch
    except ImportError:
        return "not installed (pip install pypose==0.9.5)"
    edges = [(k, k + 1, edge.previous_from_next, edge.sigmas) for k, edge in enumerate(graph.odometry)]
    edges += [(loop.first, loop.second, loop.first_from_second, loop.sigmas) for loop in graph.loops]
    jacobian_bytes = 8 * 7 * len(edges) * 7 * (graph.num_chunks - 1)
    if jacobian_bytes > 4e9:
        return f"not run: its dense Jacobian would take {jacobian_bytes / 1e9:.0f} GB"

    def lie(transform: Sim3) -> torch.Tensor:  # pypose's Sim3 layout: t (3), quaternion xyzw (4), s
        quat = gtsam.Rot3(transform.rotation).toQuaternion()
        return torch.tensor([*transform.translation, quat.x(), quat.y(), quat.z(), quat.w(), transform.scale],
                            dtype=torch.float64)

    chain = open_chain(graph.odometry)
    index = torch.tensor([[a, b] for a, b, _, _ in edges])
    measured = pp.Sim3(torch.stack([lie(z) for _, _, z, _ in edges]))
    weights = torch.tensor(np.array([1 / np.concatenate([s[3:6], s[0:3], s[6:]]) for *_, s in edges]))

    class Chain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("root", pp.Sim3(lie(chain[0])[None]))
            self.nodes = pp.Parameter(pp.Sim3(torch.stack([lie(pose) for pose in chain[1:]])))

        def forward(self, pairs: torch.Tensor) -> torch.Tensor:
            nodes = torch.cat([self.root, self.nodes])
            return (measured.Inv() @ nodes[pairs[:, 0]].Inv() @ nodes[pairs[:, 1]]).Log().tensor() * weights

    model = Chain()
    optimizer = pp.optim.LM(model, strategy=pp.optim.strategy.TrustRegion())
    start, losses = time.perf_counter(), [float("inf")]
    while len(losses) <= max_steps and losses[-1] - (loss := float(optimizer.step(input=(index,)))) >= 1e-5 * loss:
        losses.append(loss)
    return time.perf_counter() - start, len(losses)


def timings(sizes: list[int], with_pypose: bool) -> None:
    for size in sizes:
        graph, _ = synthetic_graph(size, seed=0)
        result = optimize(graph)
        false = [verdict for verdict in result.loops if str(verdict.loop_id).startswith("false")]
        lm_seconds, lm_iterations = plain_lm_seconds(graph)
        print(f"{size} chunks, {len(graph.loops)} loops ({len(false)} false): optimize {result.seconds:.3f} s "
              f"({result.iterations} LM iterations, {sum(not v.accepted for v in false)}/{len(false)} false rejected, "
              f"{sum(v.accepted for v in result.loops if v not in false)}/{len(graph.loops) - len(false)} true "
              f"accepted); GTSAM LM, true loops only: {lm_seconds:.3f} s ({lm_iterations} iterations)")
        if with_pypose:
            outcome = pypose_lm_seconds(graph)
            text = outcome if isinstance(outcome, str) else f"{outcome[0]:.3f} s ({outcome[1]} steps)"
            print(f"  pypose LM, all loops: {text}")


def stream_solves(sizes: list[int], loops_per_chunk: float, budget_s: float | None, seed: int = 0,
                  timed_solves: int | None = None) -> None:
    """A stream's solves, as the loop closer makes them: the synthetic graph's loops arrive in the order of
    their later chunk, one to three at a time (a keyframe's candidates), and one PoseGraphSolver solves the
    graph so far after each arrival. Per size: the solve times (median, p99, max), the solves the budget cut
    short, the final verdicts, and one solve of the whole graph from scratch. `timed_solves`: only the last
    so many arrivals are solved one by one (the solver first takes everything before them in one solve, not
    timed, and no solve from scratch follows): a large graph's cost a solve without its whole stream."""
    rng = np.random.default_rng(seed)
    for size in sizes:
        graph, _ = synthetic_graph(size, seed, loops_per_chunk)
        loops = sorted(graph.loops, key=lambda loop: max(loop.first, loop.second))
        solver = PoseGraphSolver(PoseGraphSettings(budget_s=budget_s))
        seconds, cut_short, arrived = [], 0, 0
        if timed_solves is not None:
            arrived = max(1, len(loops) - 2 * timed_solves)  # arrivals are 2 loops on average
            linked = max(max(loop.first, loop.second) for loop in loops[:arrived])
            head = time.perf_counter()
            solver.solve(PoseGraph(graph.odometry[:linked], loops[:arrived]))
            print(f"{size} chunks: the first {arrived} loops taken in one solve in {time.perf_counter() - head:.1f} s",
                  flush=True)
        started = time.perf_counter()
        while arrived < len(loops):
            arrived += int(rng.integers(1, 4))
            so_far = loops[:arrived]
            linked = max(max(loop.first, loop.second) for loop in so_far)
            result = solver.solve(PoseGraph(graph.odometry[:linked], so_far))
            seconds.append(result.seconds)
            cut_short += not result.complete
        wall = time.perf_counter() - started
        while not result.complete:  # what the stream's end does: solve on until done
            result = solver.solve(PoseGraph(graph.odometry, loops))
        false = {loop.loop_id for loop in loops if str(loop.loop_id).startswith("false")}
        accepted = set(result.accepted_ids)
        scratch = optimize(graph) if timed_solves is None else None
        times = np.array(seconds) * 1e3
        print(f"{size} chunks, {len(loops)} loops ({len(false)} false), budget {budget_s} s: {len(times)} solves, "
              f"median {np.median(times):.1f} ms, p99 {np.percentile(times, 99):.1f} ms, max {times.max():.1f} ms, "
              f"{cut_short} cut short; {wall:.1f} s in all; final: {len(false - accepted)}/{len(false)} false "
              f"rejected, {len(accepted - false)}/{len(loops) - len(false)} true accepted"
              + ("" if scratch is None else f"; from scratch {scratch.seconds * 1e3:.0f} ms (same verdicts: "
                                            f"{set(scratch.accepted_ids) == accepted})"), flush=True)


def map_solves(map_sizes: list[int], stream_chunks: int, loops_per_chunk: float, seed: int = 0) -> None:
    """A `--map` stream's solves (models/loops/earlier_map.py): the earlier run's chunks and loops lead every
    solve of the joint graph. One synthetic chain of map + stream chunks; the map's part (its chunks' odometry
    and the loops among them) solved first, untimed, as the earlier run left it; then the stream's loops
    (among its chunks or back into the map) arrive one to three at a time, each arrival a solve of the whole
    graph so far. Per map size: the solve times and how the median grows with the map's size."""
    rng = np.random.default_rng(seed)
    previous: tuple[int, float] | None = None
    for size in map_sizes:
        graph, _ = synthetic_graph(size + stream_chunks, seed, loops_per_chunk)
        in_map = [loop for loop in graph.loops if max(loop.first, loop.second) < size]
        streamed = sorted((loop for loop in graph.loops if max(loop.first, loop.second) >= size),
                          key=lambda loop: max(loop.first, loop.second))
        solver = PoseGraphSolver()
        head = time.perf_counter()
        solver.solve(PoseGraph(graph.odometry[:size - 1], in_map))
        head = time.perf_counter() - head
        seconds, arrived = [], 0
        while arrived < len(streamed):
            arrived += int(rng.integers(1, 4))
            so_far = streamed[:arrived]
            linked = max(max(loop.first, loop.second) for loop in so_far)
            seconds.append(solver.solve(PoseGraph(graph.odometry[:linked], [*in_map, *so_far])).seconds)
        times = np.array(seconds) * 1e3
        median = float(np.median(times))
        growth = "" if previous is None else \
            f", median grows as map size^{np.log(median / previous[1]) / np.log(size / previous[0]):.2f}"
        print(f"map of {size} chunks ({len(in_map)} loops, solved in {head:.1f} s), stream of {stream_chunks} "
              f"({len(streamed)} loops): {len(times)} solves, median {median:.0f} ms, p99 "
              f"{np.percentile(times, 99):.0f} ms, max {times.max():.0f} ms{growth}", flush=True)
        previous = (size, median)


def scratch_solves(sizes: list[int], seeds: int, loops_per_chunk: float) -> None:
    """A whole run's solve from scratch (one `optimize`, the default settings) on the synthetic chains: per
    size the seconds (median and max over the seeds), the loop pairs tested, LM iterations and the verdicts,
    and how the time grows from the size before (the exponent of size)."""
    previous: tuple[int, float] | None = None
    for size in sizes:
        seconds, pairs, iterations, false_rejected, true_accepted, false_total, true_total = [], [], [], 0, 0, 0, 0
        for seed in range(seeds):
            graph, _ = synthetic_graph(size, seed, loops_per_chunk)
            solver = PoseGraphSolver()
            started = time.perf_counter()
            result = solver.solve(graph)
            seconds.append(time.perf_counter() - started)
            pairs.append(solver.pairs_computed)
            iterations.append(result.iterations)
            false = {loop.loop_id for loop in graph.loops if str(loop.loop_id).startswith("false")}
            accepted = set(result.accepted_ids)
            false_rejected += len(false - accepted)
            false_total += len(false)
            true_accepted += len(accepted - false)
            true_total += len(graph.loops) - len(false)
        median = statistics.median(seconds)
        growth = "" if previous is None else \
            f", grows as size^{np.log(median / previous[1]) / np.log(size / previous[0]):.2f} from {previous[0]}"
        print(f"{size} chunks, {len(graph.loops)} loops: from scratch median {median:.2f} s, max {max(seconds):.2f} s "
              f"({seeds} seeds){growth}; {statistics.median(pairs):.0f} pairs tested, "
              f"{statistics.median(iterations):.0f} LM iterations; false rejected {false_rejected}/{false_total}, "
              f"true accepted {true_accepted}/{true_total}", flush=True)
        previous = (size, median)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=40, help="seeds a real trajectory (default 40; 0: timings only)")
    parser.add_argument("--sizes", type=int, nargs="*", default=[100, 10_000], help="chunks of the timed graphs")
    parser.add_argument("--pypose", action="store_true", help="also time pypose's LM (needs pypose installed)")
    parser.add_argument("--stream", type=int, nargs="*", metavar="CHUNKS",
                        help="only a stream's incremental solves on synthetic graphs of these sizes (e.g. 100 300 1000 3000)")
    parser.add_argument("--loops-per-chunk", type=float, default=3.0,
                        help="with --stream or --scratch (default 3, 20 %% false)")
    parser.add_argument("--budget", type=float, default=None, help="with --stream: each solve's budget in s")
    parser.add_argument("--timed-solves", type=int, default=None,
                        help="with --stream: time only the last N arrivals (the rest taken in one solve first)")
    parser.add_argument("--scratch", type=int, nargs="*", metavar="CHUNKS",
                        help="only solves from scratch of synthetic graphs of these sizes (e.g. 100 300 1000 3000), "
                             "--loops-per-chunk loops a chunk, 20 %% false")
    parser.add_argument("--scratch-seeds", type=int, default=3, help="with --scratch: graphs a size (default 3)")
    parser.add_argument("--map", type=int, nargs="*", metavar="CHUNKS",
                        help="a --map stream's solves beside an earlier map of these sizes (e.g. 30 300 3000); the "
                             "stream's chunks: the first --stream size (default 30)")
    args = parser.parse_args()
    if args.map:
        return map_solves(args.map, (args.stream or [30])[0], args.loops_per_chunk)
    if args.scratch:
        return scratch_solves(args.scratch, args.scratch_seeds, args.loops_per_chunk)
    if args.stream:
        return stream_solves(args.stream, args.loops_per_chunk, args.budget, timed_solves=args.timed_solves)
    import pytest  # evo_data_dir skips through pytest when the data cannot be had

    try:
        data = evo_data_dir()
    except pytest.skip.Exception as reason:
        sys.exit(f"no real trajectories: {reason}")
    kitti = read_kitti_poses(data / "KITTI_00_gt.txt")
    if args.seeds == 0:
        return timings(args.sizes, args.pypose)
    real_trajectory("KITTI 00", kitti, args.seeds, revisit=5.0, false_distance=50.0, scene_depth=15.0)
    real_trajectory("TUM fr1_xyz", read_tum_poses(data / "freiburg1_xyz-groundtruth.txt"), max(1, args.seeds // 4),
                    revisit=0.05, false_distance=0.2, scene_depth=1.0)
    no_revisit_stretch(kitti, max(1, args.seeds // 4))
    timings(args.sizes, args.pypose)


if __name__ == "__main__":
    main()
