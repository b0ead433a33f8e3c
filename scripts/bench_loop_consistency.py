"""False loops rejected with and without pairwise consistency (PCM) in front of GNC, on real trajectories.

    .venv/bin/python scripts/bench_loop_consistency.py --seeds 20             # one false loop per wrong place
    .venv/bin/python scripts/bench_loop_consistency.py --seeds 10 --repeats 3 # a wrong place seen 3 times

tests/loop_scenarios.py's KITTI 00 and TUM fr1_xyz (evo's sdist, tests/evo_data.py), 20 % of loops false:
subtle ones (a revisited pair's true a_from_b shifted by 10-20 % of the scene's depth: 1.5-3 m on KITTI,
0.1-0.2 m at fr1_xyz's desk) and, for KITTI, gross ones (a frame said to be one >= 50 m away).
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
from loop_scenarios import make_scenario, read_kitti_poses, read_tum_poses  # noqa: E402

from stream_recon.models.loops.pose_graph import PoseGraphSettings, open_chain, optimize  # noqa: E402

KITTI_DEPTH_SHARE_M = (1.5, 3.0)  # 10-20 % of a street scene's ~15 m depth
TUM_DEPTH_SHARE_M = (0.1, 0.2)  # 10-20 % of a desk scene's ~1 m depth


def measure(truth: np.ndarray, seeds: range, revisit: float, false_distance: float,
            subtle: tuple[float, float] | None, repeats: int, settings: PoseGraphSettings) -> str:
    false_rejected = false_total = true_accepted = true_total = 0
    ratios = []
    for seed in seeds:
        scenario = make_scenario(truth, seed, revisit_radius=revisit, false_min_distance=false_distance,
                                 subtle_false=subtle, repeats=repeats)
        result = optimize(scenario.graph, settings)
        accepted = set(result.accepted_ids)
        false_rejected += len(scenario.false_loops - accepted)
        false_total += len(scenario.false_loops)
        true_accepted += len(scenario.true_loops & accepted)
        true_total += len(scenario.true_loops)
        ratios.append(scenario.ate(result.world_from_chunk) / scenario.ate(open_chain(scenario.graph.odometry)))
    return (f"false rejected {false_rejected}/{false_total} ({false_rejected / false_total:.0%}), true accepted "
            f"{true_accepted}/{true_total} ({true_accepted / true_total:.0%}), ATE corrected/open {np.mean(ratios):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=1, help="false loops per wrong place (one shift each)")
    args = parser.parse_args()
    data = evo_data_dir()
    kitti = read_kitti_poses(data / "KITTI_00_gt.txt")
    tum = read_tum_poses(data / "freiburg1_xyz-groundtruth.txt")
    cases = [("KITTI 00, subtle", kitti, 5.0, 50.0, KITTI_DEPTH_SHARE_M),
             ("TUM fr1_xyz, subtle", tum, 0.05, 0.2, TUM_DEPTH_SHARE_M),
             ("KITTI 00, gross (>= 50 m)", kitti, 5.0, 50.0, None)]
    for name, truth, revisit, false_distance, subtle in cases:
        for label, pcm in (("GNC alone", False), ("PCM + GNC", True)):
            started = time.perf_counter()
            figures = measure(truth, range(args.seeds), revisit, false_distance, subtle, args.repeats,
                              PoseGraphSettings(pairwise_consistency=pcm))
            print(f"{name} | {label}: {figures} | {time.perf_counter() - started:.1f} s", flush=True)


if __name__ == "__main__":
    main()
