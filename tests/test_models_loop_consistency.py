"""Loops judged as a set (models/loops/consistency.py, PCM): the cycle's covariance, the chi-square bound,
the maximum clique, and the false loops it turns away on real trajectories before GNC sees them."""

from __future__ import annotations

import gtsam
import numpy as np
import pytest
from evo_data import evo_data_dir
from loop_scenarios import TRAJECTORIES, make_scenario

from stream_recon.models.loops.consistency import chi_square_quantile, compose, invert, maximum_clique
from stream_recon.models.loops.pose_graph import PoseGraphSettings, from_gtsam, optimize, to_gtsam
from stream_recon.models.stream.similarity import Sim3


def random_sim3(rng: np.random.Generator) -> Sim3:
    rotation = np.asarray(gtsam.Rot3.Expmap(rng.normal(0, 1, 3)).matrix())
    return Sim3(float(np.exp(rng.normal(0, 0.5))), rotation, rng.normal(0, 3, 3))


def perturbed(transform: Sim3, covariance: np.ndarray, rng: np.random.Generator) -> Sim3:
    return transform @ from_gtsam(gtsam.Similarity3.Expmap(rng.multivariate_normal(np.zeros(7), covariance)))


def test_the_chi_square_quantile_is_the_tables() -> None:
    assert chi_square_quantile(0.99, 7) == pytest.approx(18.4753, abs=1e-3)
    assert chi_square_quantile(0.95, 2) == pytest.approx(5.9915, abs=1e-3)


def test_a_products_covariance_is_the_spread_of_perturbed_products() -> None:
    rng = np.random.default_rng(0)
    factors = [(random_sim3(rng), np.diag(rng.uniform(1e-4, 4e-4, 7))) for _ in range(3)]
    factors.append(invert(factors[0]))
    product, covariance = compose(factors)
    errors = []
    for _ in range(3000):
        moved = Sim3.identity()
        for transform, transform_covariance in factors:
            moved = moved @ perturbed(transform, transform_covariance, rng)
        errors.append(np.asarray(gtsam.Similarity3.Logmap(to_gtsam(product.inverse() @ moved))))
    spread = np.sqrt(np.diag(np.cov(np.array(errors).T)))
    np.testing.assert_allclose(spread, np.sqrt(np.diag(covariance)), rtol=0.1)


def test_the_maximum_clique_is_the_largest_mutually_adjacent_set() -> None:
    adjacent = np.ones((6, 6), bool)
    for i, j in [(0, 3), (1, 3), (4, 5), (2, 4)]:
        adjacent[i, j] = adjacent[j, i] = False
    assert maximum_clique(adjacent) == [0, 1, 2, 5]
    assert maximum_clique(np.eye(3, dtype=bool)) == [0]


def judged(name: str, seeds: range, settings: PoseGraphSettings) -> tuple[float, float]:
    """(false loops rejected, true loops accepted) over the seeds' scenarios with subtle false loops."""
    false_rejected = false_total = true_accepted = true_total = 0
    for seed in seeds:
        scenario = subtle_scenario(name, seed)
        accepted = set(optimize(scenario.graph, settings).accepted_ids)
        false_rejected += len(scenario.false_loops - accepted)
        true_accepted += len(scenario.true_loops & accepted)
        false_total += len(scenario.false_loops)
        true_total += len(scenario.true_loops)
    return false_rejected / false_total, true_accepted / true_total


SCENARIOS = ("KITTI 00", "TUM fr1_xyz")


def subtle_scenario(name: str, seed: int):
    trajectory = TRAJECTORIES[name]
    return make_scenario(trajectory.poses(evo_data_dir()), seed, revisit_radius=trajectory.revisit_radius,
                         false_min_distance=0.0, scene_depth=trajectory.scene_depth,
                         subtle_false=trajectory.subtle_shift)


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_consistent_set_turns_away_subtle_false_loops_and_keeps_the_true_ones(name: str) -> None:
    """PCM alone, before GNC, at the inlier bound's quantile: over 5 seeds it drops most subtle false
    loops and hardly any true loop."""
    from stream_recon.models.loops.consistency import consistent_loops

    false_dropped = false_total = true_dropped = true_total = 0
    for seed in range(5):
        scenario = subtle_scenario(name, seed)
        kept = {scenario.graph.loops[i].loop_id for i in consistent_loops(scenario.graph, 0.99)}
        false_dropped += len(scenario.false_loops - kept)
        true_dropped += len(scenario.true_loops - kept)
        false_total += len(scenario.false_loops)
        true_total += len(scenario.true_loops)
    assert false_dropped >= 0.6 * false_total, (false_dropped, false_total)
    assert true_dropped <= 0.03 * true_total, (true_dropped, true_total)


def test_with_pairwise_consistency_the_graph_still_rejects_subtle_false_loops_and_keeps_true_ones() -> None:
    """PCM in front of GNC (PoseGraphSettings.pairwise_consistency) on fr1_xyz: GNC starts from the consistent
    set's solution; every subtle false loop is rejected and the true ones are accepted."""
    false_rejected, true_accepted = judged("TUM fr1_xyz", range(3), PoseGraphSettings(pairwise_consistency=True))
    assert false_rejected == 1.0 and true_accepted >= 0.95, (false_rejected, true_accepted)


def test_a_streams_solves_reuse_the_pairs_already_judged(monkeypatch) -> None:
    """The closer solves after every new loop: the cycle chi2 of the pairs judged before are kept (by loop
    id), so a solve with one loop more computes only that loop's pairs, with the same verdicts."""
    from stream_recon.models.loops import consistency

    scenario = subtle_scenario("TUM fr1_xyz", 0)
    loops = scenario.graph.loops
    earlier = type(scenario.graph)(scenario.graph.odometry, loops[:-1])
    known: dict = {}
    optimize(earlier, PoseGraphSettings(), known)
    assert len(known) == len(earlier.loops) * (len(earlier.loops) - 1) // 2
    computed = []
    real_cycle_chi2 = consistency.cycle_chi2
    monkeypatch.setattr(consistency, "cycle_chi2", lambda *args: computed.append(1) or real_cycle_chi2(*args))
    reused = optimize(scenario.graph, PoseGraphSettings(), known)
    assert len(computed) == len(loops) - 1  # the new loop against each earlier one
    assert reused.accepted_ids == optimize(scenario.graph, PoseGraphSettings()).accepted_ids
