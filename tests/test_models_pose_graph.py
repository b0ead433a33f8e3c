"""The pose graph over chunks: GTSAM's conventions against Sim3, the open chain, loops corrected and
false loops rejected (on synthetic rings and on real trajectories: KITTI 00 and TUM fr1_xyz), the worker."""

from __future__ import annotations

import time

import gtsam
import numpy as np
import pytest
from evo_data import evo_data_dir
from helpers import random_sim3
from loop_scenarios import (
    LOOP_NOISE,
    ODOMETRY_NOISE,
    Scenario,
    chunk_ranges,
    make_scenario,
    pair_consistency,
    perturbed,
    read_kitti_poses,
    read_tum_poses,
    revisits,
    synthetic_graph,
    with_loop,
    with_odometry,
)

from stream_recon.models.loops import pose_graph
from stream_recon.models.loops.consistency import compose
from stream_recon.models.loops.gtsam_sim3 import from_gtsam, to_gtsam
from stream_recon.models.loops.pose_graph import PoseGraphSolver, optimize
from stream_recon.models.loops.pose_graph_data import (
    LoopEdge,
    OdometryEdge,
    PoseGraph,
    PoseGraphSettings,
    as_sigmas,
    covariance_of,
    open_chain,
)
from stream_recon.models.stream.similarity import Sim3


def rejected_ids(result) -> tuple:
    return tuple(verdict.loop_id for verdict in result.loops if not verdict.accepted)


def exp_sim3(tangent: np.ndarray) -> Sim3:
    return from_gtsam(gtsam.Similarity3.Expmap(np.asarray(tangent, np.float64)))


def assert_same_sim3(first: Sim3, second: Sim3, atol: float = 1e-10) -> None:
    np.testing.assert_allclose(first.scaled_matrix, second.scaled_matrix, atol=atol)


def assert_identical(first: tuple[Sim3, ...], second: tuple[Sim3, ...]) -> None:
    """Bit for bit: the same scale, rotation and translation."""
    assert len(first) == len(second)
    for a, b in zip(first, second, strict=True):
        assert a.scale == b.scale and np.array_equal(a.rotation, b.rotation)
        assert np.array_equal(a.translation, b.translation)


# -- GTSAM's conventions against Sim3 --------------------------------------------------------------
def test_gtsam_similarity3_is_our_sim3_with_the_translation_divided_by_the_scale() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        first, second = random_sim3(rng), random_sim3(rng)
        points = rng.normal(size=(5, 3))
        ours = np.asarray([to_gtsam(first).transformFrom(point) for point in points])
        np.testing.assert_allclose(ours, first.apply_to_points(points), atol=1e-10)
        assert_same_sim3(from_gtsam(to_gtsam(first)), first)
        assert_same_sim3(from_gtsam(to_gtsam(first) * to_gtsam(second)), first @ second)
        assert_same_sim3(from_gtsam(to_gtsam(first).inverse()), first.inverse())
        assert_same_sim3(from_gtsam(to_gtsam(first).between(to_gtsam(second))), first.inverse() @ second)
    # GTSAM maps x -> s (R x + t): the Sim3 that maps x -> s R x + t needs t / s in GTSAM.
    assert np.allclose(gtsam.Similarity3(gtsam.Rot3(), np.array([1.0, 0, 0]), 2.0).transformFrom(np.zeros(3)),
                       [2.0, 0, 0])


def test_the_tangent_is_rotation_translation_log_scale() -> None:
    """The order that `sigmas` follow: [rotation (rad), translation, log scale]."""
    turn = exp_sim3([0, 0, 0.3, 0, 0, 0, 0])
    assert turn.scale == pytest.approx(1) and turn.rotation_deg == pytest.approx(np.degrees(0.3))
    np.testing.assert_allclose(turn.rotation @ [1, 0, 0], [np.cos(0.3), np.sin(0.3), 0], atol=1e-12)
    shift = exp_sim3([0, 0, 0, 1.0, 2.0, 3.0, 0])
    assert shift.rotation_deg == pytest.approx(0) and shift.scale == pytest.approx(1)
    np.testing.assert_allclose(shift.translation, [1, 2, 3], atol=1e-12)
    grow = exp_sim3([0, 0, 0, 0, 0, 0, 0.2])
    assert grow.scale == pytest.approx(np.exp(0.2)) and not grow.translation.any()


def test_an_edge_error_is_the_perturbation_of_the_measurement_in_the_second_chunk_over_its_sigmas() -> None:
    """measured = a_from_b @ Exp(e) gives chi2 = |e / sigmas|^2 at the true poses: what `sigmas` mean."""
    rng = np.random.default_rng(1)
    a_from_b = random_sim3(rng)
    sigmas = as_sigmas([0.01, 0.02, 0.03, 0.1, 0.2, 0.3, 0.05])
    for _ in range(5):
        error = rng.normal(0, sigmas)
        loop = LoopEdge("x", 0, 1, a_from_b @ exp_sim3(error), sigmas)
        chi2 = pose_graph.loop_chi2([loop], (Sim3.identity(), a_from_b))[0]
        assert chi2 == pytest.approx(float(np.sum((error / sigmas) ** 2)), rel=1e-6)


def test_sigmas_broadcast_a_scalar_and_refuse_non_positive_values() -> None:
    np.testing.assert_array_equal(as_sigmas(0.1), np.full(7, 0.1))
    assert not as_sigmas(np.ones(7)).flags.writeable
    for bad in (0.0, -1.0, np.nan, [1.0] * 6):
        with pytest.raises(ValueError):
            as_sigmas(bad)


def test_a_graph_refuses_loops_to_unknown_chunks_and_repeated_ids() -> None:
    graph = with_odometry(PoseGraph(), OdometryEdge(Sim3.identity(), 0.1))
    with pytest.raises(ValueError, match="chunks 0..1"):
        with_loop(graph, LoopEdge("a", 0, 2, Sim3.identity(), 0.1))
    with pytest.raises(ValueError, match="itself"):
        LoopEdge("a", 1, 1, Sim3.identity(), 0.1)
    graph = with_loop(graph, LoopEdge("a", 0, 1, Sim3.identity(), 0.1))
    with pytest.raises(ValueError, match="unique"):
        with_loop(graph, LoopEdge("a", 1, 0, Sim3.identity(), 0.1))


# -- synthetic rings -------------------------------------------------------------------------------
RING_SIGMAS = as_sigmas([0.01] * 3 + [0.05] * 3 + [0.01])  # rad, chunk units, log scale


def ring(num_chunks: int = 12, radius: float = 10.0) -> tuple[Sim3, ...]:
    """True world_from_chunk of chunks around a circle, each looking along it, at scales of their own; the
    world is chunk 0's coordinates, as in a pose graph."""
    poses = []
    for k in range(num_chunks):
        angle = 2 * np.pi * k / num_chunks
        rotation = np.array([[np.cos(angle), -np.sin(angle), 0], [np.sin(angle), np.cos(angle), 0], [0, 0, 1]])
        poses.append(Sim3(1.0 + 0.1 * (k % 3), rotation, radius * np.array([np.cos(angle), np.sin(angle), 0.0])))
    return tuple(poses[0].inverse() @ pose for pose in poses)


def ring_graph(truth: tuple[Sim3, ...], seed: int, drift: float = 3.0) -> PoseGraph:
    """Odometry with noise `drift` times its sigmas, so that the chain visibly fails to close."""
    rng = np.random.default_rng(seed)
    edges = [OdometryEdge(truth[k].inverse() @ truth[k + 1] @ exp_sim3(rng.normal(0, drift * RING_SIGMAS)),
                          drift * RING_SIGMAS) for k in range(len(truth) - 1)]
    return PoseGraph(tuple(edges))


def pose_errors(poses: tuple[Sim3, ...], truth: tuple[Sim3, ...]) -> np.ndarray:
    """Per chunk: the distance between where its origin is and where it should be [K]."""
    return np.array([np.linalg.norm(pose.translation - true.translation) for pose, true in zip(poses, truth,
                                                                                              strict=True)])


def true_loop(truth: tuple[Sim3, ...], first: int, second: int, loop_id: str = "true") -> LoopEdge:
    return LoopEdge(loop_id, first, second, truth[first].inverse() @ truth[second], RING_SIGMAS)


def test_without_loops_the_result_is_the_open_chain_exactly() -> None:
    graph = ring_graph(ring(), seed=2)
    result = optimize(graph)
    assert_identical(result.world_from_chunk, open_chain(graph.odometry))
    chain = with_odometry(with_odometry(PoseGraph(), graph.odometry[0]), graph.odometry[1])
    assert_identical(open_chain(chain.odometry), (Sim3.identity(), graph.odometry[0].previous_from_next,
                                                  graph.odometry[0].previous_from_next @ graph.odometry[1].previous_from_next))
    assert result.is_open_chain and result.loops == () and result.iterations == 0
    assert result.final_error == pytest.approx(result.initial_error)


def test_a_loop_closes_the_ring() -> None:
    truth = ring()
    graph = with_loop(ring_graph(truth, seed=3), true_loop(truth, 0, len(truth) - 1))
    graph = with_loop(graph, true_loop(truth, 3, 8, "across"))
    result = optimize(graph)
    assert result.accepted_ids == ("true", "across") and not result.is_open_chain
    open_errors, closed_errors = pose_errors(open_chain(graph.odometry), truth), pose_errors(result.world_from_chunk,
                                                                                           truth)
    assert open_errors.max() > 2.0  # the drifted chain ends metres away from its start
    assert closed_errors.max() < 0.35 * open_errors.max()
    assert result.world_from_chunk[0].is_identity
    assert result.final_error < result.initial_error and result.iterations > 0 and result.seconds > 0


def test_a_gross_false_loop_is_rejected_and_bends_nothing() -> None:
    truth = ring()
    base = with_loop(ring_graph(truth, seed=4), true_loop(truth, 0, len(truth) - 1))
    # A place recognised wrongly: chunks 2 and 7, on opposite sides of the ring, said to be one place.
    false = LoopEdge("false", 2, 7, Sim3.identity(), RING_SIGMAS, {"score": 0.9})
    with_false = optimize(with_loop(base, false))
    without = optimize(base)
    verdicts = {verdict.loop_id: verdict for verdict in with_false.loops}
    assert not verdicts["false"].accepted and verdicts["true"].accepted
    assert verdicts["false"].chi2 > 1e3 and verdicts["true"].chi2 < 18.5
    for bent, straight in zip(with_false.world_from_chunk, without.world_from_chunk, strict=True):
        assert_same_sim3(bent, straight, atol=1e-6)


def test_when_every_loop_is_rejected_the_result_is_the_open_chain_exactly() -> None:
    graph = ring_graph(ring(), seed=5)
    graph = with_loop(graph, LoopEdge("false", 2, 7, Sim3.identity(), RING_SIGMAS))
    result = optimize(graph)
    assert rejected_ids(result) == ("false",) and result.is_open_chain
    assert_identical(result.world_from_chunk, open_chain(graph.odometry))


# -- real trajectories -----------------------------------------------------------------------------
KITTI_SEEDS = range(10)
KITTI_REVISIT_M = 5.0  # "a few metres": frames of two chunks this close are the same place
KITTI_FALSE_M = 50.0  # a false loop joins frames at least this far apart
TUM_REVISIT_M = 0.05  # fr1_xyz stays within ~0.5 m of a desk: every chunk revisits every other
TUM_FALSE_M = 0.2
KITTI_DEPTH_M = 15.0  # a street scene's depth: the loops' fitted points lie about this far away
TUM_DEPTH_M = 1.0  # a desk's
# KITTI 00 frames 620-3240 (2,620 frames, 9 chunks): the drive from the first loop's end out to the
# far side of the map and back, no frame of it within 20 m of a frame of a non-adjacent chunk.
KITTI_NO_REVISITS = slice(620, 3240)


@pytest.fixture(scope="module")
def kitti() -> np.ndarray:
    return read_kitti_poses(evo_data_dir() / "KITTI_00_gt.txt")


@pytest.fixture(scope="module")
def tum() -> np.ndarray:
    return read_tum_poses(evo_data_dir() / "freiburg1_xyz-groundtruth.txt")


def run_scenarios(truth: np.ndarray, seeds: range, revisit: float, false_distance: float,
                  scene_depth: float) -> dict[str, np.ndarray]:
    ratios, false_rejected, true_accepted = [], 0, 0
    false_total = true_total = 0
    for seed in seeds:
        scenario = make_scenario(truth, seed, revisit_radius=revisit, false_min_distance=false_distance,
                                 scene_depth=scene_depth)
        result = optimize(scenario.graph)
        accepted = set(result.accepted_ids)
        ratios.append(scenario.ate(result.world_from_chunk) / scenario.ate(open_chain(scenario.graph.odometry)))
        false_rejected += len(scenario.false_loops - accepted)
        true_accepted += len(scenario.true_loops & accepted)
        false_total += len(scenario.false_loops)
        true_total += len(scenario.true_loops)
    return {"ratios": np.array(ratios), "false_rejected": false_rejected / false_total,
            "true_accepted": true_accepted / true_total}


@pytest.mark.slow
def test_kitti_00_drift_is_corrected_and_false_loops_rejected(kitti: np.ndarray) -> None:
    """15 chunks, 12 revisited chunk pairs (22 true loops, fits of their keyframe pairs), 6 false loops a
    seed. Chunks without a loop of their own keep their odometry error (~1 degree, 1 %), which bounds what
    loops can do here: the corrected ATE is 0.13 of the open chain's in the median over 10 seeds, 0.17 at
    most (scripts/bench_loop_consistency.py, gross), so the mean over ten seeds is held to 25 %."""
    figures = run_scenarios(kitti, KITTI_SEEDS, KITTI_REVISIT_M, KITTI_FALSE_M, KITTI_DEPTH_M)
    assert figures["ratios"].mean() <= 0.25, figures
    assert figures["ratios"].max() <= 0.35, figures
    assert figures["false_rejected"] >= 0.95, figures
    assert figures["true_accepted"] >= 0.95, figures


@pytest.mark.slow
def test_tum_fr1_xyz_drift_is_corrected_and_false_loops_rejected(tum: np.ndarray) -> None:
    figures = run_scenarios(tum, range(3), TUM_REVISIT_M, TUM_FALSE_M, TUM_DEPTH_M)
    assert figures["ratios"].max() <= 0.25, figures
    assert figures["false_rejected"] >= 0.95, figures
    assert figures["true_accepted"] >= 0.95, figures


def test_kitti_00_without_revisits_offered_only_false_loops_stays_the_open_chain(kitti: np.ndarray) -> None:
    stretch = kitti[KITTI_NO_REVISITS]
    assert revisits(stretch, chunk_ranges(len(stretch)), radius=20.0) == {}  # the stretch is as described
    non_adjacent = sum(len(range(a + 2, 9)) for a in range(9))
    for seed in range(3):
        scenario: Scenario = make_scenario(stretch, seed, revisit_radius=KITTI_REVISIT_M,
                                           false_min_distance=KITTI_FALSE_M, scene_depth=KITTI_DEPTH_M,
                                           false_loops=non_adjacent)
        assert len(scenario.ranges) == 9 and not scenario.true_loops
        result = optimize(scenario.graph)
        assert result.accepted_ids == () and len(rejected_ids(result)) == non_adjacent
        assert_identical(result.world_from_chunk, open_chain(scenario.graph.odometry))


# -- false loops that agree with each other, and a stream's solves ----------------------------------
def chain_between(graph: PoseGraph, first: int, second: int) -> tuple[Sim3, np.ndarray]:
    """first_from_second through the odometry and its covariance (the links composed one by one)."""
    links = [(edge.previous_from_next.scaled_matrix, covariance_of(edge))
             for edge in graph.odometry[first:second]]
    transform, covariance = compose(links)
    return Sim3.from_matrix(transform), covariance


def with_two_agreeing_false_loops(graph: PoseGraph, seed: int, chi2: float = 300.0) -> PoseGraph:
    """Two tight loops between chunks 0 and 8 that agree with each other (one wrong place recognised from two
    keyframe pairs) and miss the chain between those chunks by `chi2` in its own uncertainty: far tighter
    than eight links of odometry, so a solve that believes them bends the links instead."""
    rng = np.random.default_rng(seed)
    chained, covariance = chain_between(graph, 0, 8)
    direction = rng.normal(size=7)
    wrong = chained @ exp_sim3(np.linalg.cholesky(covariance) @ (direction * np.sqrt(chi2) / np.linalg.norm(direction)))
    tight = as_sigmas([1e-3] * 3 + [0.02] * 3 + [1e-3])
    for n in range(2):
        graph = with_loop(graph, LoopEdge(f"false-{n}", 0, 8, wrong @ exp_sim3(rng.normal(0, tight)), tight))
    return graph


@pytest.mark.parametrize("settings", [PoseGraphSettings(), PoseGraphSettings(odometry_check=False)],
                         ids=["defaults", "the bending check alone"])
def test_false_loops_that_agree_by_chance_leave_a_stream_without_revisits_its_open_chain(
        kitti: np.ndarray, settings: PoseGraphSettings) -> None:
    """Pairwise consistent, so PCM keeps both; each misses the chain it closes by chi2 300 against a bound of
    24: rejected by the check against the odometry, and, without it, by the chain's bending at the solution."""
    stretch = kitti[KITTI_NO_REVISITS]
    for seed in range(3):
        scenario = make_scenario(stretch, seed, revisit_radius=KITTI_REVISIT_M, false_min_distance=KITTI_FALSE_M,
                                 scene_depth=KITTI_DEPTH_M, false_loops=0)
        graph = with_two_agreeing_false_loops(scenario.graph, seed)
        result = optimize(graph, settings)
        assert pair_consistency(graph).all()  # they agree with each other
        assert result.accepted_ids == ()
        assert_identical(result.world_from_chunk, open_chain(graph.odometry))


def stream_of(graph: PoseGraph, seed: int) -> list[PoseGraph]:
    """The graph as a stream grows it: loops in the order of their later chunk, one to three at a time, each
    snapshot holding the chunks linked so far."""
    rng = np.random.default_rng(seed)
    loops = sorted(graph.loops, key=lambda loop: max(loop.first, loop.second))
    snapshots, arrived = [], 0
    while arrived < len(loops):
        arrived = min(len(loops), arrived + int(rng.integers(1, 4)))
        linked = max(max(loop.first, loop.second) for loop in loops[:arrived])
        snapshots.append(PoseGraph(graph.odometry[:linked], loops[:arrived]))
    return snapshots


def test_a_streams_solves_judge_each_pair_once_and_end_where_one_solve_would(tum: np.ndarray) -> None:
    """One PoseGraphSolver over a growing graph computes each pair's cycle once (as many as one solve of the
    whole graph) and ends with the verdicts of a solve from scratch, its poses within the solver's tolerance
    of them."""
    scenario = make_scenario(tum, 0, revisit_radius=TUM_REVISIT_M, false_min_distance=TUM_FALSE_M,
                             scene_depth=TUM_DEPTH_M)
    solver = PoseGraphSolver()
    for snapshot in stream_of(scenario.graph, seed=0):
        result = solver.solve(snapshot)
        assert result.complete
    loops = len(scenario.graph.loops)
    once = PoseGraphSolver()
    scratch = once.solve(PoseGraph(scenario.graph.odometry, sorted(scenario.graph.loops,
                                                                   key=lambda loop: max(loop.first, loop.second))))
    # the pairs worth testing (both loops agree with the chain, their cycle within pairwise_max_links), each once
    assert solver.pairs_computed == once.pairs_computed <= loops * (loops - 1) // 2
    assert result.accepted_ids == scratch.accepted_ids
    for streamed, once in zip(result.world_from_chunk, scratch.world_from_chunk, strict=True):
        assert_same_sim3(streamed, once, atol=1e-3 * max(1.0, np.abs(once.translation).max()))


@pytest.mark.parametrize("trajectory", ["tum", "kitti"])
@pytest.mark.slow
def test_a_stream_growing_its_clique_through_new_loops_ends_with_the_exact_searchs_verdicts(
        trajectory: str, request: pytest.FixtureRequest) -> None:
    """Above `exact_clique_up_to` candidates a solve grows the last clique through its new loops instead of
    searching again; forced on from the first loop (0), a stream's solves still end with the verdicts of
    the exact search's solver on the real trajectories."""
    truth = request.getfixturevalue(trajectory)
    revisit, false_distance, depth = ((TUM_REVISIT_M, TUM_FALSE_M, TUM_DEPTH_M) if trajectory == "tum"
                                      else (KITTI_REVISIT_M, KITTI_FALSE_M, KITTI_DEPTH_M))
    scenario = make_scenario(truth, 2, revisit_radius=revisit, false_min_distance=false_distance, scene_depth=depth)
    incremental, exact = PoseGraphSolver(PoseGraphSettings(exact_clique_up_to=0)), PoseGraphSolver()
    for snapshot in stream_of(scenario.graph, seed=2):
        grown, searched = incremental.solve(snapshot), exact.solve(snapshot)
    assert grown.accepted_ids == searched.accepted_ids
    assert set(scenario.false_loops).isdisjoint(grown.accepted_ids)


def test_a_solve_out_of_time_hands_back_what_it_has_and_the_next_goes_on(tum: np.ndarray) -> None:
    scenario = make_scenario(tum, 1, revisit_radius=TUM_REVISIT_M, false_min_distance=TUM_FALSE_M,
                             scene_depth=TUM_DEPTH_M)
    solver = PoseGraphSolver(PoseGraphSettings(budget_s=0.0))  # one iteration at a time
    results = [solver.solve(scenario.graph)]
    while not results[-1].complete:
        results.append(solver.solve(scenario.graph))
        assert len(results) < 100
    assert len(results) > 1 and not results[0].complete
    assert results[-1].accepted_ids == optimize(scenario.graph).accepted_ids


class _SomeLoopsNeverFit(PoseGraphSolver):
    """A solver for which the edges holding one of `misfit_ids` never fit the solution (a real graph's
    misfits depend on the solution; these stand for a graph that needs many drops)."""

    def __init__(self, settings: PoseGraphSettings, misfit_ids: set) -> None:
        super().__init__(settings)
        self.misfit_ids = misfit_ids

    def _misfits(self, groups, estimate):
        return np.where(self._holding_misfits(groups), 2.0, super()._misfits(groups, estimate))

    def _fitting(self, groups, estimate, posterior):
        return super()._fitting(groups, estimate, posterior) & ~self._holding_misfits(groups)

    def _holding_misfits(self, groups) -> np.ndarray:
        ids = [{self._loops[i].loop_id for i in group.members} for group in groups]
        return np.array([bool(members & self.misfit_ids) for members in ids], bool)


def test_solves_cut_short_while_dropping_misfits_go_on_where_the_last_stopped(tum: np.ndarray) -> None:
    """Each solve's budget holds one drop here; a graph needing six completes in a few more solves than six
    (starting over each time, it never did: a stream's end then waited for it until loop closure went off)."""
    scenario = make_scenario(tum, 0, revisit_radius=TUM_REVISIT_M, false_min_distance=TUM_FALSE_M,
                             scene_depth=TUM_DEPTH_M)
    misfit_ids = set(sorted(scenario.true_loops)[:6])
    solver = _SomeLoopsNeverFit(PoseGraphSettings(budget_s=0.0, combine_chunk_pairs=False), misfit_ids)
    results = [solver.solve(scenario.graph)]
    while not results[-1].complete and len(results) < 60:
        results.append(solver.solve(scenario.graph))
    assert results[-1].complete and len(results) <= 30
    assert misfit_ids.isdisjoint(results[-1].accepted_ids)
    unbudgeted = _SomeLoopsNeverFit(PoseGraphSettings(combine_chunk_pairs=False), misfit_ids).solve(scenario.graph)
    assert results[-1].accepted_ids == unbudgeted.accepted_ids


def test_a_link_aligned_again_is_judged_again(tum: np.ndarray) -> None:
    """A chunk's link replaced (the rollover aligned it again): the loops reaching past it are judged anew,
    as a new solver would judge them."""
    scenario = make_scenario(tum, 2, revisit_radius=TUM_REVISIT_M, false_min_distance=TUM_FALSE_M,
                             scene_depth=TUM_DEPTH_M)
    graph = scenario.graph
    last = graph.odometry[-1]
    moved = OdometryEdge(last.previous_from_next @ exp_sim3(np.full(7, 0.05)), last.sigmas, last.covariance)
    realigned = PoseGraph(graph.odometry[:-1] + (moved,), graph.loops)
    solver = PoseGraphSolver()
    solver.solve(graph)
    again = solver.solve(realigned)
    fresh = optimize(realigned)
    assert [v.odometry_chi2 for v in again.loops] == pytest.approx([v.odometry_chi2 for v in fresh.loops], rel=1e-9)
    assert again.accepted_ids == fresh.accepted_ids


@pytest.mark.slow
def test_a_whole_runs_graph_is_solved_from_scratch_in_seconds() -> None:
    """300 chunks, 900 loops (3 a chunk, 20 % false, ~hundreds of units off): one solve from scratch sorts
    them on the 2-core machine in ~1 s (scripts/bench_pose_graph.py --scratch; the bound here allows a busy
    machine twice over), every false loop rejected, true ones kept."""
    graph, _ = synthetic_graph(300, 0, 3.0)
    started = time.perf_counter()
    result = optimize(graph)
    seconds = time.perf_counter() - started
    accepted = set(result.accepted_ids)
    false = {loop.loop_id for loop in graph.loops if loop.loop_id.startswith("false")}
    assert not accepted & false and len(accepted) >= 0.97 * (len(graph.loops) - len(false))
    assert seconds <= 6.0, seconds


def test_a_covariance_positive_definite_but_for_rounding_is_lifted_and_an_indefinite_one_refused():
    """as_covariance: eigenvalues within MIN_EIGENVALUE_RATIO of the largest (rounding's, either sign) lifted to it,
    the same matrix then in every process; a clearly indefinite matrix refused; a well-conditioned one untouched."""
    from stream_recon.models.loops.pose_graph_data import MIN_EIGENVALUE_RATIO, as_covariance
    from stream_recon.models.stream.similarity import _anchor_to_origin

    to_origin = _anchor_to_origin(np.array([2.0, 1.0, 0.5]))
    for tiny in (1e-20, 0.0):
        singular = to_origin @ np.diag([1e-6] * 3 + [tiny] * 3 + [1e-6]) @ to_origin.T
        lifted = as_covariance(singular, np.sqrt(np.diag(singular)))
        eigenvalues = np.linalg.eigvalsh(lifted)
        assert eigenvalues[0] >= 0.99 * MIN_EIGENVALUE_RATIO * eigenvalues[-1]
        assert np.allclose(lifted, singular, rtol=0, atol=1e-15) and np.array_equal(lifted, lifted.T)
        edge = OdometryEdge(Sim3.identity(), np.sqrt(np.diag(singular)), singular)
        assert np.allclose(edge.sigmas ** 2, np.diag(edge.covariance), rtol=1e-9, atol=0)
    indefinite = np.diag([1.0] * 6 + [1.0])
    indefinite[0, 1] = indefinite[1, 0] = 1.01  # eigenvalue -0.01
    with pytest.raises(ValueError, match="positive definite"):
        as_covariance(indefinite, np.ones(7))
    healthy = to_origin @ np.diag([1e-6] * 7) @ to_origin.T
    healthy = 0.5 * (healthy + healthy.T)
    assert np.array_equal(as_covariance(healthy, np.sqrt(np.diag(healthy))), healthy)


def test_a_nearly_still_overlap_is_a_still_one_and_its_covariance_well_conditioned():
    """overlap_covariance over shared frames whose centres spread less than STILL_EXTENT: the centre's floor in
    absolute units, as for a camera that did not move at all, not 1e-3 of a spread of 1e-7."""
    from stream_recon.models.stream.similarity import MIN_OVERLAP_SIGMA, overlap_covariance

    rng = np.random.default_rng(0)
    source = np.zeros((16, 9))
    source[:, :3] = np.array([2.0, 1.0, 0.5]) + rng.normal(0, 1e-7, (16, 3))
    source[:, 6] = 1.0  # identity quaternions (xyzw)
    for spread in (1e-7, 0.0):
        frames = source.copy()
        if spread == 0.0:
            frames[:, :3] = frames[0, :3]
        covariance = overlap_covariance(frames, frames, Sim3.identity(), anchor=0)
        assert np.linalg.cond(covariance) < 1e9
        assert np.all(np.sqrt(np.diag(covariance))[3:6] >= MIN_OVERLAP_SIGMA)


def near_miss_graph(num_chunks: int, num_loops: int, seed: int) -> PoseGraph:
    """synthetic_graph's walk with half its loops off by ~0.02 rad and ~5 units (250 a chunk): near misses that
    pass the cycle tests and fail at the solution, one at a time (a refine's graph of thousands of loops)."""
    rng = np.random.default_rng(seed)
    rotation, position, truth = np.eye(3), np.zeros(3), []
    for _ in range(num_chunks):
        truth.append(Sim3(float(np.exp(rng.uniform(np.log(0.5), np.log(2.0)))), rotation, position))
        position = position + rotation @ np.array([250.0, 0, 0])
        rotation = rotation @ gtsam.Rot3.Expmap(rng.normal(0, 0.2, 3)).matrix()
    odometry = [OdometryEdge(perturbed(truth[k].inverse() @ truth[k + 1], sigmas, rng), sigmas)
                for k in range(num_chunks - 1) for sigmas in [ODOMETRY_NOISE.sigmas(250.0 / truth[k + 1].scale)]]
    loops = []
    for n in range(num_loops):
        first = int(rng.integers(0, num_chunks - 2))
        second = int(min(num_chunks - 1, first + rng.integers(2, 51)))
        measured = truth[first].inverse() @ truth[second]
        if n % 2:
            off = gtsam.Similarity3.Expmap(np.concatenate([rng.normal(0, 0.02, 3), rng.normal(0, 5.0, 3), [0.0]]))
            measured = measured @ Sim3(1.0, off.rotation().matrix(), off.translation())
        sigmas = LOOP_NOISE.sigmas(250.0 / truth[second].scale)
        loops.append(LoopEdge(f"{'false' if n % 2 else 'true'}-{n}", first, second, perturbed(measured, sigmas, rng),
                              sigmas))
    return PoseGraph(tuple(odometry), tuple(loops))


def test_several_drops_a_round_accept_what_one_a_round_accepts_in_fewer_solves():
    """drops_per_round (refine's 32): on 60 chunks and 600 loops, half of them near misses, the same loops
    accepted as dropping the worst alone, with a tenth of the Levenberg-Marquardt iterations."""
    graph = near_miss_graph(60, 600, seed=0)
    one = pose_graph.PoseGraphSolver(PoseGraphSettings()).solve(graph)
    several = pose_graph.PoseGraphSolver(PoseGraphSettings(drops_per_round=32)).solve(graph)
    assert set(several.accepted_ids) == set(one.accepted_ids)
    assert sum(str(loop).startswith("true") for loop in one.accepted_ids) >= 0.95 * 300
    assert several.iterations * 5 < one.iterations
    with pytest.raises(ValueError, match="drops_per_round"):
        PoseGraphSettings(drops_per_round=0)
