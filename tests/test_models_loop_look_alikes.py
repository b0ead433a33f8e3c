"""Look-alike places: loops 30-50 cm off on drift simulated over real trajectories (tests/loop_scenarios.py,
evo's KITTI 00, TUM fr1_xyz, TUM fr2_desk and EuRoC V1_02), each loop edge a fit with its own covariance as
the stream makes it, 20 % of the loops false.

A revisit's query keyframe saw a place shifted by 30-50 cm (a look-alike nearby), a fit as clean as a true
one, placed two ways: beside the revisit's true loops, or alone (the revisit recognised only through the
look-alike, so that the false loop is its chunk pair's only loop and its own solution bends to fit it). The
second is what the four checks before the leave-one-out test let through (6 % on EuRoC V1_02, the
corrected ATE up to 6x the one without them); each kept loop against what all the others predict
(models/loops/leave_one_out.py) rejects them.
"""

from __future__ import annotations

import numpy as np
import pytest
from evo_data import evo_data_dir
from loop_scenarios import TRAJECTORIES, rejection_rates

from stream_recon.models.loops.pose_graph_data import PoseGraphSettings

LOOK_ALIKE_M = (0.3, 0.5)  # the false loops' error: a place 30-50 cm from the one the query saw
SEEDS = {"EuRoC V1_02": range(10), "TUM fr1_xyz": range(4), "TUM fr2_desk": range(4), "KITTI 00": range(4)}


def figures(name: str, alone: bool, settings: PoseGraphSettings = PoseGraphSettings(),
            seeds: range | None = None) -> dict:
    trajectory = TRAJECTORIES[name]
    found = rejection_rates(trajectory, trajectory.poses(evo_data_dir()), seeds or SEEDS[name], settings,
                            shift=LOOK_ALIKE_M, false_alone=alone)
    return {"false_rejected": found.false_rejected / found.false_total,
            "true_accepted": found.true_accepted / found.true_total,
            "with_over_without": max(found.with_over_without), "false_loops": found.false_total}


@pytest.mark.slow
@pytest.mark.parametrize("alone", [False, True], ids=["beside the true loops", "alone"])
@pytest.mark.parametrize("name", ["EuRoC V1_02", "TUM fr1_xyz", "TUM fr2_desk"])
def test_look_alike_loops_are_rejected_indoors(name: str, alone: bool) -> None:
    found = figures(name, alone)
    assert found["false_rejected"] >= 0.99, found
    assert found["true_accepted"] >= 0.95, found
    assert found["with_over_without"] <= 1.2, found


@pytest.mark.slow
def test_look_alike_loops_beside_a_streets_true_loops_are_rejected() -> None:
    found = figures("KITTI 00", alone=False)
    assert found["false_rejected"] >= 0.99 and found["true_accepted"] >= 0.95, found
    assert found["with_over_without"] <= 1.2, found


@pytest.mark.slow
def test_a_look_alike_alone_in_a_street_is_within_the_drift_and_bends_the_map_by_little() -> None:
    """KITTI 00's chain drifts by metres a chunk (1 % of ~300 m): 30-50 cm on a pair no other loop holds is
    inside what the chain and the other loops allow, and a set of loops that keeps such look-alikes is as
    consistent as the true one (docs/loop_closure.md). Most are accepted; the map they bend stays within
    1.2x the error without them (the limit, stated rather than hidden)."""
    found = figures("KITTI 00", alone=True)
    assert found["with_over_without"] <= 1.2, found


@pytest.mark.slow
def test_without_the_leave_one_out_test_look_alikes_alone_get_through() -> None:
    """The reason for the test: with the four checks alone, EuRoC V1_02's lone look-alikes are accepted (3
    of 50 over ten seeds) and bend the map; with it, none are."""
    before = figures("EuRoC V1_02", alone=True, settings=PoseGraphSettings(leave_one_out=False))
    assert before["false_rejected"] < 0.99 and before["with_over_without"] > 2.0, before
    after = figures("EuRoC V1_02", alone=True)
    assert after["false_rejected"] == 1.0 and after["with_over_without"] == pytest.approx(1.0, abs=1e-3), after


def test_euroc_poses_are_read_as_rotations_about_their_positions() -> None:
    """EuRoC's quaternion is w x y z: the body's frames are rotations, and the first pose's rotation turns
    its x axis where the file's first row (w 0.162, x 0.790, y -0.205, z 0.555) puts it."""
    poses = TRAJECTORIES["EuRoC V1_02"].poses(evo_data_dir())
    rotations = poses[:, :3, :3]
    np.testing.assert_allclose(rotations @ np.swapaxes(rotations, 1, 2), np.broadcast_to(np.eye(3), rotations.shape),
                               atol=1e-9)
    w, x, y, z = np.array([0.161996, 0.789985, -0.205376, 0.554528]) / np.linalg.norm([0.161996, 0.789985,
                                                                                        -0.205376, 0.554528])
    np.testing.assert_allclose(rotations[0][:, 0], [1 - 2 * (y * y + z * z), 2 * (x * y + w * z),
                                                    2 * (x * z - w * y)], atol=1e-9)
    np.testing.assert_allclose(poses[0, :3, 3], [0.515356, 1.996773, 0.971104])
