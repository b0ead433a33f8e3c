"""An edge against the other edges of a solved pose graph (models/loops/leave_one_out.py): the statistic from
one posterior of the whole graph equals the one from solving the graph again without the edge."""

from __future__ import annotations

import gtsam
import numpy as np
import pytest
from evo_data import evo_data_dir
from loop_scenarios import TRAJECTORIES, make_scenario

from stream_recon.models.loops import sim3_batch as lie
from stream_recon.models.loops.consistency import chi_square_quantile
from stream_recon.models.loops.gtsam_sim3 import to_gtsam
from stream_recon.models.loops.leave_one_out import MAX_CHUNKS, Posterior
from stream_recon.models.loops.pose_graph_data import LoopEdge, PoseGraph, covariance_of, open_chain


def _posterior(graph, loops) -> Posterior:
    links = lie.matrices([edge.previous_from_next for edge in graph.odometry])
    return Posterior(links, np.stack([covariance_of(edge) for edge in graph.odometry]),
                     {loop.loop_id: (loop.first, loop.second, loop.first_from_second.scaled_matrix,
                                     covariance_of(loop)) for loop in loops})


def _edges(graph, loops) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    odometry = np.arange(len(graph.odometry))
    ends = np.concatenate([np.stack([odometry, odometry + 1], axis=1),
                           np.array([(loop.first, loop.second) for loop in loops]).reshape(-1, 2)])
    measured = lie.matrices([edge.previous_from_next for edge in graph.odometry]
                            + [loop.first_from_second for loop in loops])
    covariance = np.stack([covariance_of(edge) for edge in list(graph.odometry) + list(loops)])
    return ends, measured, covariance


def _solve(graph, loops) -> np.ndarray:
    """[K, 4, 4] the odometry and `loops` solved to convergence (chunk 0 fixed)."""
    ends, measured, covariance = _edges(graph, loops)
    factors = gtsam.NonlinearFactorGraph()
    factors.add(gtsam.PriorFactorSimilarity3(0, gtsam.Similarity3(), gtsam.noiseModel.Isotropic.Sigma(7, 1e-9)))
    for (a, b), z, c in zip(ends, measured, covariance, strict=True):
        factors.add(gtsam.BetweenFactorSimilarity3(int(a), int(b), to_gtsam(lie.to_sim3(z)),
                                                   gtsam.noiseModel.Gaussian.Covariance(c)))
    values = gtsam.Values()
    for k, pose in enumerate(open_chain(graph.odometry)):
        values.insert(k, to_gtsam(pose))
    params = gtsam.LevenbergMarquardtParams()
    params.setRelativeErrorTol(1e-14)
    params.setAbsoluteErrorTol(1e-14)
    params.setMaxIterations(200)
    solved = gtsam.LevenbergMarquardtOptimizer(factors, values, params).optimize()
    poses = np.stack([solved.atSimilarity3(k).matrix() for k in range(len(graph.odometry) + 1)])
    poses = poses / poses[:, 3:, 3:]
    poses[:, 3, :3] = 0.0
    poses[:, 3, 3] = 1.0
    return lie.inverse(poses[0])[None] @ poses


@pytest.fixture(scope="module")
def scenario():
    trajectory = TRAJECTORIES["EuRoC V1_02"]
    return make_scenario(trajectory.poses(evo_data_dir()), 3, revisit_radius=trajectory.revisit_radius,
                         false_min_distance=trajectory.false_min_distance, scene_depth=trajectory.scene_depth,
                         subtle_false=(0.3, 0.5), false_alone=True)


@pytest.mark.parametrize("which", ["true loops", "all loops"])
def test_an_edge_left_out_equals_the_graph_solved_again_without_it(scenario, which: str) -> None:
    """For every loop: e^T (C - M)^-1 e at the full solution against e^T (C + M')^-1 e at the solution without
    it (M' its chunks' relative covariance there), from one factorisation instead of a solve an edge. The
    true loops alone sit near the bound (chi-square, 7 dof): equal to 5 %; with the look-alikes too, loops
    hundreds to thousands of chi2 off (the solution moves by metres without one): to 25 %, each on the same
    side of the bound."""
    graph = scenario.graph
    loops = [loop for loop in graph.loops if which == "all loops" or loop.loop_id in scenario.true_loops]
    left_out = _posterior(graph, loops).left_out(_solve(graph, loops), [loop.loop_id for loop in loops])
    again = []
    for n, loop in enumerate(loops):
        rest = loops[:n] + loops[n + 1:]
        again.append(_posterior(graph, rest).predicting(_solve(graph, rest), np.array([(loop.first, loop.second)]),
                                                        lie.matrices([loop.first_from_second]),
                                                        covariance_of(loop)[None])[0])
    again = np.array(again)
    if which == "true loops":
        assert again.max() < 40.0
        np.testing.assert_allclose(left_out, again, rtol=0.05, atol=0.05)
    else:  # far past the bound both ways, where the linearisations differ most
        assert again.max() > 1000.0
        np.testing.assert_allclose(left_out, again, rtol=0.25)
        bound = chi_square_quantile(0.999)
        np.testing.assert_array_equal(left_out > bound, again > bound)


def test_the_left_out_chi2_is_never_below_the_residual_at_the_solution(scenario) -> None:
    """(C - M)^-1 >= C^-1: the solution's own residual understates how far the others put an edge."""
    graph, loops = scenario.graph, list(scenario.graph.loops)
    poses = _solve(graph, loops)
    ends, measured, covariance = _edges(graph, loops)
    tested = np.arange(len(loops)) + len(graph.odometry)
    own = lie.residual_chi2(measured[tested], lie.inverse(poses[ends[tested, 0]]) @ poses[ends[tested, 1]],
                            covariance[tested])
    left_out = _posterior(graph, loops).left_out(poses, [loop.loop_id for loop in loops])
    assert np.all(left_out >= own * (1 - 1e-6))


def test_edges_that_come_and_go_keep_the_posterior_one_formed_afresh_would_be(scenario) -> None:
    """A stream's solves change the posterior by rank-7 updates (edges in, edges out, chunks hung on): the
    same as forming it from the edges it then holds."""
    graph, loops = scenario.graph, list(scenario.graph.loops)
    split = sorted(max(loop.first, loop.second) for loop in loops)[2]  # 3 loops within chunks 0..split
    early = [loop for loop in loops if max(loop.first, loop.second) <= split]
    kept = _posterior(PoseGraph(graph.odometry[:split], []), early)
    kept.with_links(lie.matrices([edge.previous_from_next for edge in graph.odometry[split:]]),
                    np.stack([covariance_of(edge) for edge in graph.odometry[split:]]))
    assert kept.change([(loop.loop_id, loop.first, loop.second, loop.first_from_second.scaled_matrix,
                         covariance_of(loop)) for loop in loops if loop.loop_id not in kept.edges],
                       [early[1].loop_id])
    expected = _posterior(graph, [loop for loop in loops if loop.loop_id != early[1].loop_id])
    ends = np.array([(loop.first, loop.second) for loop in loops])
    measured = lie.matrices([loop.first_from_second for loop in loops])
    np.testing.assert_allclose(kept.relative_covariance(ends, measured), expected.relative_covariance(ends, measured),
                               rtol=1e-6, atol=1e-12)


def test_a_removal_that_leaves_a_direction_to_nothing_is_refused(scenario) -> None:
    """An edge whose chunks nothing else relates along some direction cannot be updated away (its share
    there is all): the caller forms the posterior again."""
    graph = scenario.graph
    lone = LoopEdge("lone", 0, 1, graph.odometry[0].previous_from_next, 1e-9)
    posterior = _posterior(PoseGraph(graph.odometry[:1], []), [])
    posterior.change([("lone", 0, 1, lone.first_from_second.scaled_matrix, covariance_of(lone))], [])
    edges = dict(posterior.edges)
    assert not posterior.change([], ["lone"]) and posterior.edges == edges


def test_a_graph_past_the_dense_bound_is_refused() -> None:
    with pytest.raises(ValueError, match=f"above {MAX_CHUNKS}"):
        Posterior(np.tile(np.eye(4), (MAX_CHUNKS, 1, 1)), np.tile(np.eye(7), (MAX_CHUNKS, 1, 1)))
