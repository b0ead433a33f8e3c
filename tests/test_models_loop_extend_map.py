"""A stream extending an earlier map (models/loops/earlier_map.py), simulated on real trajectories with drift
as tests/loop_scenarios.py builds them: a trajectory split into two recordings, each with drift and chunk
coordinates of its own; the first solved alone (its map, fixed, in its outputs' frame), the second solved
with its loops to the map as the loop closer makes them (closer.align_loop on both keyframes' points: the
second's in its emitted world, the map's moved into the map's frame as earlier_map_of moves them)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np
import pytest
from evo_data import evo_data_dir
from loop_scenarios import (
    FIT_POINTS,
    LOOP_CONFIG,
    ODOMETRY_NOISE,
    TRAJECTORIES,
    Scenario,
    keyframe_pairs,
    make_scenario,
    observed,
    perturbed,
    revisits,
    rigid,
    without_false_loops,
)

from stream_recon.models.loops.closer import LoopAlignment, _KeyframePoints
from stream_recon.models.loops.earlier_map import EarlierMap, MapExtension
from stream_recon.models.loops.pose_graph import OdometryEdge, PoseGraph, open_chain, optimize
from stream_recon.models.stream.chunks import ChunkLink
from stream_recon.models.stream.similarity import Sim3, umeyama

SEEDS = range(3)
# The second recording in the map's frame against the same recording solved alone: at most this.
IN_MAP_OVER_ALONE = 1.2


@functools.cache
def truth_of(name: str) -> np.ndarray:
    return TRAJECTORIES[name].poses(evo_data_dir())


def recording(truth: np.ndarray, name: str, seed: int) -> tuple[Scenario, PoseGraph]:
    """A recording of `truth`: drifting odometry and its true loops (its false ones are the pose graph's tests')."""
    trajectory = TRAJECTORIES[name]
    scenario = make_scenario(truth, seed, revisit_radius=trajectory.revisit_radius,
                             false_min_distance=trajectory.false_min_distance, scene_depth=trajectory.scene_depth,
                             false_fraction=0.0, false_loops=0)
    return scenario, without_false_loops(scenario)


def links_of(graph: PoseGraph) -> list[ChunkLink]:
    return [ChunkLink(k + 1, edge.previous_from_next, edge.sigmas, 0, edge.covariance)
            for k, edge in enumerate(graph.odometry)]


def map_alignment(rng: np.random.Generator, first: Scenario, map_from_emitted: Sim3, first_chain: tuple[Sim3, ...],
                  keyframe_a: tuple[int, int], second: Scenario, second_chain: tuple[Sim3, ...],
                  keyframe_b: tuple[int, int], depth: float, extension: MapExtension,
                  same_place: bool = True) -> LoopAlignment:
    """The 3D agreement of a keyframe of the second recording (its frame_b) with the map's keyframe frame_a:
    FIT_POINTS points before the map keyframe's camera, seen by both (or, not `same_place`, the query's points
    of a place of its own), each through the depth model of loop_scenarios.observed."""
    (a, frame_a), (b, frame_b) = keyframe_a, keyframe_b
    camera = rigid(first.truth[frame_a])
    rays = np.stack([rng.uniform(-0.6, 0.6, FIT_POINTS), rng.uniform(-0.4, 0.4, FIT_POINTS), np.ones(FIT_POINTS)], 1)
    points = camera.apply_to_points(rays * rng.uniform(0.5, 1.5, (FIT_POINTS, 1)) * depth)
    seen = points if same_place else rigid(second.truth[frame_b]).apply_to_points(
        rays[rng.permutation(FIT_POINTS)] * rng.uniform(0.5, 1.5, (FIT_POINTS, 1)) * depth)
    emitted_a = map_from_emitted @ first_chain[a] @ first.true_world_from_chunk[a].inverse()
    emitted_b = second_chain[b] @ second.true_world_from_chunk[b].inverse()
    centre_a = emitted_a.apply_to_points(first.truth[frame_a, :3, 3][None])[0]
    centre_b = emitted_b.apply_to_points(second.truth[frame_b, :3, 3][None])[0]
    earlier = observed(rng, emitted_a.apply_to_points(points), centre_a)
    query = observed(rng, emitted_b.apply_to_points(seen), centre_b)
    median_depth = float(np.median(np.linalg.norm(earlier - centre_a, axis=1)))
    matches = np.stack([np.arange(FIT_POINTS)] * 2, axis=1)
    return extension.align(_KeyframePoints(query, median_depth * emitted_b.scale / emitted_a.scale, centre_b),
                           _KeyframePoints(earlier, median_depth, centre_a), matches)


def chunk_of(scenario: Scenario, frame: int) -> int:
    """The chunk that emits `frame` last (the later one where two share it), as Scenario.positions places it."""
    return max(k for k, (start, end) in enumerate(scenario.ranges) if start <= frame < end)


@dataclass(frozen=True)
class Joined:
    """What extending a map did, in ground-truth units (RMSE of camera centres)."""

    in_map: float  # the second recording in the map's frame, taken to the truth as the map's outputs are
    alone: float  # the same second recording solved alone, aligned on its own
    whole: float  # both recordings as the joint solve places them, aligned together
    single: float  # the whole trajectory recorded as one, solved
    summary: dict


def revisiting_pairs(first: Scenario, second: Scenario, radius: float) -> list[tuple[int, int, int, int]]:
    """(map chunk, stream chunk, map frame, stream frame) of the loops the second recording makes to the
    first, as make_scenario picks a recording's own: up to two keyframe pairs per revisited chunk pair."""
    shift = len(first.truth)
    truth = np.concatenate([first.truth, second.truth])
    ranges = [*first.ranges, *((start + shift, end + shift) for start, end in second.ranges)]
    found = []
    for a, b in revisits(truth, ranges, radius):
        if a < len(first.ranges) <= b:
            found += [(a, b - len(first.ranges), frame_a, frame_b - shift)
                      for frame_a, frame_b in keyframe_pairs(truth, ranges, (a, b), radius, 2)]
    return found


@functools.cache
def joined(name: str, seed: int, other: str | None = None) -> Joined:
    """The first half of `name`'s trajectory recorded and solved alone (the map, its outputs where that
    solve put them), the second half (or, with `other`, the second half of another trajectory) recorded and
    extending it (its loops to the map as the loop closer makes them), solved jointly with the map."""
    trajectory = TRAJECTORIES[name]
    truth = truth_of(name)
    half = len(truth) // 2
    first, first_graph = recording(truth[:half], name, 2 * seed)
    solved_alone = optimize(first_graph)
    map_placement = solved_alone.world_from_chunk
    accepted = set(solved_alone.accepted_ids)
    earlier = EarlierMap("the first recording", (), map_placement, first_graph.odometry,
                         tuple(replace(loop, loop_id=("map", loop.loop_id)) for loop in first_graph.loops
                               if loop.loop_id in accepted))
    first_chain = open_chain(first_graph.odometry)
    second_truth = truth[half:] if other is None else truth_of(other)[len(truth_of(other)) // 2:]
    second, second_graph = recording(second_truth, other or name, 2 * seed + 1)
    second_chain = open_chain(second_graph.odometry)
    extension = MapExtension(earlier, LOOP_CONFIG)
    rng = np.random.default_rng(1000 + seed)
    pairs = [] if other is not None else revisiting_pairs(first, second, trajectory.revisit_radius)
    if other is not None:  # look-alikes checked now and then: each query's points of a place of its own
        map_keyframes = np.arange(0, half, LOOP_CONFIG.index_spacing)
        pairs = [(chunk_of(first, int(frame_a)), chunk_of(second, frame_b), int(frame_a), frame_b)
                 for frame_b in range(0, len(second_truth), LOOP_CONFIG.index_spacing) if rng.uniform() < 0.1
                 for frame_a in [rng.choice(map_keyframes)]]
    for a, b, frame_a, frame_b in pairs:
        move = map_placement[a] @ first_chain[a].inverse()  # the map keyframe's points, as earlier_map_of moves them
        alignment = map_alignment(rng, first, move, first_chain, (a, frame_a), second, second_chain, (b, frame_b),
                                  trajectory.scene_depth, extension, same_place=other is None)
        if alignment.passed:
            extension.add_loop(f"map-{a}-{b}-{frame_a}-{frame_b}", frame_b, a, b, alignment, second_chain)
    links = links_of(second_graph)
    second_placed, first_placed = second_chain, map_placement
    if extension.has_loops:
        graph, result = extension.solve(links, second_graph.loops)
        while not result.complete:  # as the loop closer settles at the stream's end
            graph, result = extension.solve(links, second_graph.loops)
        second_placed = tuple(extension.stream_world_from_chunk(result))
        first_placed = tuple(map_placement[0] @ placed for placed in result.world_from_chunk[:len(map_placement)])
    map_to_truth = umeyama(first.positions(map_placement), truth[:half, :3, 3], with_scale=True)
    in_map = rmse(map_to_truth.apply_to_points(second.positions(second_placed)), second_truth[:, :3, 3])
    both = np.concatenate([first.positions(first_placed), second.positions(second_placed)])
    whole_truth = np.concatenate([truth[:half, :3, 3], second_truth[:, :3, 3]])
    single, single_graph = recording(truth, name, 2 * seed)
    extra = {}
    if extension.has_loops:
        M = len(map_placement)
        exact = first.true_world_from_chunk[-1].inverse() @ second.true_world_from_chunk[0]
        sigmas = ODOMETRY_NOISE.sigmas(second.path_length(0))
        link = OdometryEdge(perturbed(exact, sigmas, rng), sigmas)
        as_one_graph = PoseGraph((*graph.odometry[:M - 1], link, *graph.odometry[M:]), graph.loops)
        as_one = optimize(as_one_graph).world_from_chunk
        extra["as_one"] = ate(np.concatenate([first.positions(as_one[:M]), second.positions(as_one[M:])]), whole_truth)
        joint_to_truth = umeyama(first.positions(first_placed), truth[:half, :3, 3], with_scale=True)
        extra["in_joint"] = rmse(joint_to_truth.apply_to_points(second.positions(second_placed)), second_truth[:, :3, 3])
        extra["first_alone"] = first.ate(map_placement)
        extra["first_joint"] = first.ate(first_placed)
    return Joined(in_map, second.ate(optimize(second_graph).world_from_chunk), ate(both, whole_truth),
                  single.ate(optimize(single_graph).world_from_chunk), {**extension.summary(), **extra})


def rmse(positions: np.ndarray, truth: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.sum((positions - truth) ** 2, axis=1))))


def ate(positions: np.ndarray, truth: np.ndarray) -> float:
    """Sim(3) ATE as Scenario.ate takes it: the positions aligned onto the truth by Umeyama, then the RMSE."""
    return rmse(umeyama(positions, truth, with_scale=True).apply_to_points(positions), truth)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["KITTI 00", "EuRoC V1_02"])
def test_a_second_recording_is_placed_in_an_exact_map_as_well_as_it_is_solved_alone(name: str) -> None:
    """The placement and the extended graph on their own: with a map without error, the second recording in
    the map's frame is within 1.2x of its own solve's ATE (TUM's desks reach 1.3x at some seeds: their
    recordings' own loops are as precise as the loops to the map). A map solved from its own drifting
    recording is not asserted: its errors are the map's, fixed, and the second recording inherits them."""
    for seed in SEEDS:
        in_map, alone, summary = extended(name, seed, exact_map=True)
        assert summary["placed"] and summary["loops_accepted"] >= 1, summary
        assert in_map <= IN_MAP_OVER_ALONE * alone, (seed, in_map, alone)


@pytest.mark.slow
def test_a_recording_of_another_place_is_never_placed_and_says_so() -> None:
    for seed in SEEDS:
        _, _, summary = extended("KITTI 00", seed, other="TUM fr2_desk")
        assert not summary["placed"] and summary["loops_verified"] == 0, summary
        assert summary["note"].startswith("the stream was never placed in the map the first recording")
