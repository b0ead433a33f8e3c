"""False loops rejected as a set, per real trajectory: GNC alone and pairwise consistency (PCM) + GNC.

    .venv/bin/python scripts/bench_loop_consistency.py --seeds 20            # the rates in docs/loop_closure.md
    .venv/bin/python scripts/bench_loop_consistency.py --seeds 2 --cases subtle

tests/loop_scenarios.py's TRAJECTORIES (KITTI 00, TUM fr1_xyz, TUM fr2_desk from evo's sdist,
tests/evo_data.py), each loop edge a fit with its own covariance as the stream makes it, 20 % of loops
false. Cases: `subtle` (a revisited pair's query saw the place shifted by 10-20 % of the scene's depth),
`subtle x2` (the same wrong shift seen from two keyframe pairs of one revisit) and `gross` (a frame said to
see what a frame far away sees). Per case and settings: false loops rejected, true loops accepted, the
corrected / open ATE (median, max) and the corrected ATE with the false loops over the one without them
(max over the seeds).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from evo_data import evo_data_dir  # noqa: E402
from loop_scenarios import TRAJECTORIES, Trajectory, make_scenario  # noqa: E402

from stream_recon.models.loops.pose_graph import PoseGraph, PoseGraphSettings, open_chain, optimize  # noqa: E402

CASES = {"subtle": (True, 1), "subtle x2": (True, 2), "gross": (False, 1)}  # name: (subtle, repeats)
SETTINGS = {"GNC alone": PoseGraphSettings(pairwise_consistency=False), "PCM + GNC": PoseGraphSettings()}


def measure(trajectory: Trajectory, truth: np.ndarray, seeds: range, subtle: bool, repeats: int,
            settings: PoseGraphSettings) -> str:
    false_rejected = false_total = true_accepted = true_total = 0
    ratios, with_over_without = [], []
    for seed in seeds:
        scenario = make_scenario(truth, seed, revisit_radius=trajectory.revisit_radius,
                                 false_min_distance=trajectory.false_min_distance, scene_depth=trajectory.scene_depth,
                                 subtle_false=trajectory.subtle_shift if subtle else None, repeats=repeats)
        result = optimize(scenario.graph, settings)
        accepted = set(result.accepted_ids)
        false_rejected += len(scenario.false_loops - accepted)
        false_total += len(scenario.false_loops)
        true_accepted += len(scenario.true_loops & accepted)
        true_total += len(scenario.true_loops)
        corrected = scenario.ate(result.world_from_chunk)
        ratios.append(corrected / scenario.ate(open_chain(scenario.graph.odometry)))
        true_only = PoseGraph(scenario.graph.odometry,
                              [loop for loop in scenario.graph.loops if loop.loop_id in scenario.true_loops])
        with_over_without.append(corrected / scenario.ate(optimize(true_only, settings).world_from_chunk))
    return (f"false rejected {false_rejected}/{false_total} ({false_rejected / false_total:.1%}), true accepted "
            f"{true_accepted}/{true_total} ({true_accepted / true_total:.1%}), ATE corrected/open median "
            f"{np.median(ratios):.3f} max {np.max(ratios):.3f}, with/without false loops max {max(with_over_without):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--trajectories", nargs="*", default=list(TRAJECTORIES), choices=list(TRAJECTORIES))
    args = parser.parse_args()
    data = evo_data_dir()
    for name in args.trajectories:
        trajectory = TRAJECTORIES[name]
        truth = trajectory.poses(data)
        for case in args.cases:
            subtle, repeats = CASES[case]
            for label, settings in SETTINGS.items():
                started = time.perf_counter()
                figures = measure(trajectory, truth, range(args.seeds), subtle, repeats, settings)
                print(f"{name}, {case} | {label}: {figures} | {time.perf_counter() - started:.1f} s", flush=True)


if __name__ == "__main__":
    main()
