"""False loops rejected as a set, on real trajectories (tests/loop_scenarios.py), with loop edges made as the
stream makes them: fits of two keyframes' points with the fit's own covariance (closer.loop_edge).

Subtle false loops: a revisited chunk pair's query keyframe saw the place shifted by 10-20 % of the
scene's depth, a fit as clean as a true one. The rates asked of the pose graph (docs/loop_closure.md):
>= 99 % of false loops rejected, >= 98 % of true ones accepted, the corrected ATE with the false loops
within 5 % of the one without them, the median corrected / open ATE <= 0.2.
"""

from __future__ import annotations

import numpy as np
import pytest
from evo_data import evo_data_dir
from loop_scenarios import TRAJECTORIES, make_scenario, rejection_rates

from stream_recon.models.loops.pose_graph_data import PoseGraphSettings

SEEDS = range(3)


def rates(name: str, seeds: range, settings: PoseGraphSettings = PoseGraphSettings(), repeats: int = 1,
          subtle: bool = True, keyframe_rotation_error: float | None = None) -> dict:
    trajectory = TRAJECTORIES[name]
    found = rejection_rates(trajectory, trajectory.poses(evo_data_dir()), seeds, settings, subtle, repeats,
                            keyframe_rotation_error)
    return {"false_rejected": found.false_rejected / found.false_total,
            "true_accepted": found.true_accepted / found.true_total,
            "median_ratio": float(np.median(found.ratios)), "with_over_without": max(found.with_over_without)}


@pytest.mark.parametrize("name", TRAJECTORIES)
@pytest.mark.slow
def test_subtle_false_loops_are_rejected_at_the_stated_rates(name: str) -> None:
    figures = rates(name, SEEDS)
    assert figures["false_rejected"] >= 0.99, figures
    assert figures["true_accepted"] >= 0.98, figures
    assert figures["with_over_without"] <= 1.05, figures
    assert figures["median_ratio"] <= 0.2, figures


@pytest.mark.slow
def test_a_wrong_place_seen_from_two_keyframes_is_rejected_too() -> None:
    """Two keyframe pairs of one revisit agree on one wrong shift: the pair's true loops still outvote it."""
    figures = rates("KITTI 00", range(2), repeats=2)
    # 44 true loops here: one missed is 2.3 % (scripts/bench_loop_consistency.py has the rates over more seeds)
    assert figures["false_rejected"] >= 0.99 and figures["true_accepted"] >= 0.95, figures
    assert figures["with_over_without"] <= 1.05, figures


def test_false_loops_far_from_the_truth_are_removed_before_the_solve() -> None:
    """A frame said to see what one >= 50 m away sees: its fit's covariance puts it thousands of sigmas off
    the chain it closes and off every true loop, so both checks remove it before a solve could be pulled
    by it (a robust solve alone, started from the drifted chain, turned most true loops away with it)."""
    figures = rates("KITTI 00", range(2), subtle=False)
    assert figures["false_rejected"] >= 0.99 and figures["true_accepted"] >= 0.98, figures
    assert figures["with_over_without"] <= 1.05 and figures["median_ratio"] <= 0.2, figures


def test_the_scenarios_loop_edges_carry_the_fits_own_covariance() -> None:
    """Each loop edge is a fit: a full covariance, not fixed sigmas, and its rotation sigma the two keyframes'
    orientation errors within their chunks (5e-3 rad each, ~7e-3 together) with the fit's own (~1e-3 rad on
    ~80 points) beside them."""
    trajectory = TRAJECTORIES["TUM fr1_xyz"]
    scenario = make_scenario(trajectory.poses(evo_data_dir()), 0, revisit_radius=trajectory.revisit_radius,
                             false_min_distance=trajectory.false_min_distance, scene_depth=trajectory.scene_depth)
    for loop in scenario.graph.loops:
        off_diagonal = loop.covariance - np.diag(np.diag(loop.covariance))
        assert np.abs(off_diagonal).max() > 0, loop.loop_id
        assert np.all((loop.sigmas[:3] > 7e-3) & (loop.sigmas[:3] < 9e-3)), (loop.loop_id, loop.sigmas)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["KITTI 00", "TUM fr1_xyz"])
def test_keyframes_turned_by_0_4_degrees_in_their_chunk_keep_true_loops_inside_their_bound(name: str) -> None:
    """Each keyframe's orientation off by 0.4 degrees (over all axes) within its chunk: the loops' declared
    rotation sigma (LoopClosureConfig.keyframe_rotation_sigma) covers it, so true loops are accepted and
    subtle false loops still rejected. At a frame-to-frame 1e-3 rad, 66-72 % of true loops were."""
    figures = rates(name, range(2), keyframe_rotation_error=np.radians(0.4) / np.sqrt(3))
    assert figures["true_accepted"] >= 0.95 and figures["false_rejected"] >= 0.99, figures
