"""False loops rejected, per real trajectory, by the pose graph's checks with and without some of them.

    .venv/bin/python scripts/bench_loop_consistency.py --seeds 20            # the rates in docs/loop_closure.md
    .venv/bin/python scripts/bench_loop_consistency.py --seeds 10 --cases "look-alike alone" \
        --settings default "without leave-one-out"

tests/loop_scenarios.py's TRAJECTORIES (KITTI 00, TUM fr1_xyz, TUM fr2_desk, EuRoC V1_02 from evo's sdist,
tests/evo_data.py), each loop edge a fit with its own covariance as the stream makes it, 20 % of loops
false. Cases: `subtle` (a revisited pair's query saw the place shifted by 10-20 % of the scene's depth),
`subtle x2` (the same wrong shift seen from two keyframe pairs of one revisit), `gross` (a frame said to
see what a frame far away sees), `look-alike beside` (a revisit's query saw a place 30-50 cm off, beside the
revisit's true loops) and `look-alike alone` (the same, the revisit's only loop). Settings: PCM alone, the
odometry check and PCM without the leave-one-out test, and the default (all checks). Per case and
settings: false loops rejected, true loops accepted, the corrected / open ATE (median, max) and the
corrected ATE with the false loops over the one without them (max over the seeds).
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

from stream_recon.models.loops.pose_graph_data import PoseGraphSettings  # noqa: E402

LOOK_ALIKE_M = (0.3, 0.5)
CASES = {  # name: rejection_rates' arguments
    "subtle": {}, "subtle x2": {"repeats": 2}, "gross": {"subtle": False},
    "look-alike beside": {"shift": LOOK_ALIKE_M}, "look-alike alone": {"shift": LOOK_ALIKE_M, "false_alone": True},
}
SETTINGS = {"PCM alone": PoseGraphSettings(odometry_check=False, leave_one_out=False),
            "without leave-one-out": PoseGraphSettings(leave_one_out=False), "default": PoseGraphSettings()}


def measure(trajectory: Trajectory, truth: np.ndarray, seeds: range, case: dict, settings: PoseGraphSettings,
            keyframe_rotation_error: float | None) -> str:
    found = rejection_rates(trajectory, truth, seeds, settings, keyframe_rotation_error=keyframe_rotation_error,
                            **case)
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
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
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
            for label in args.settings:
                started = time.perf_counter()
                figures = measure(trajectory, truth, range(args.seeds), CASES[case], SETTINGS[label], rotation_error)
                print(f"{name}, {case} | {label}: {figures} | {time.perf_counter() - started:.1f} s", flush=True)


if __name__ == "__main__":
    main()
