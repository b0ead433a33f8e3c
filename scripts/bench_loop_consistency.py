"""False loops rejected, per real trajectory: pairwise consistency (PCM) alone, and with each loop checked
against the odometry it closes first (the default).

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
from loop_scenarios import TRAJECTORIES, Trajectory, rejection_rates  # noqa: E402

from stream_recon.models.loops.pose_graph import PoseGraphSettings  # noqa: E402

CASES = {"subtle": (True, 1), "subtle x2": (True, 2), "gross": (False, 1)}  # name: (subtle, repeats)
SETTINGS = {"PCM alone": PoseGraphSettings(odometry_check=False), "odometry check + PCM (default)": PoseGraphSettings()}


def measure(trajectory: Trajectory, truth: np.ndarray, seeds: range, subtle: bool, repeats: int,
            settings: PoseGraphSettings, keyframe_rotation_error: float | None) -> str:
    found = rejection_rates(trajectory, truth, seeds, settings, subtle, repeats, keyframe_rotation_error)
    return (f"false rejected {found.false_rejected}/{found.false_total} "
            f"({found.false_rejected / found.false_total:.1%}), true accepted {found.true_accepted}/"
            f"{found.true_total} ({found.true_accepted / found.true_total:.1%}), ATE corrected/open median "
            f"{np.median(found.ratios):.3f} max {np.max(found.ratios):.3f}, with/without false loops max "
            f"{max(found.with_over_without):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--trajectories", nargs="*", default=list(TRAJECTORIES), choices=list(TRAJECTORIES))
    parser.add_argument("--keyframe-rotation-deg", type=float, default=None,
                        help="each keyframe's orientation error in its chunk, degrees over all axes (default: what "
                             "the loop covariance declares)")
    args = parser.parse_args()
    rotation_error = None if args.keyframe_rotation_deg is None else np.radians(args.keyframe_rotation_deg) / np.sqrt(3)
    data = evo_data_dir()
    for name in args.trajectories:
        trajectory = TRAJECTORIES[name]
        truth = trajectory.poses(data)
        for case in args.cases:
            subtle, repeats = CASES[case]
            for label, settings in SETTINGS.items():
                started = time.perf_counter()
                figures = measure(trajectory, truth, range(args.seeds), subtle, repeats, settings, rotation_error)
                print(f"{name}, {case} | {label}: {figures} | {time.perf_counter() - started:.1f} s", flush=True)


if __name__ == "__main__":
    main()
