"""A stream extending an earlier map (models/loops/earlier_map.py), simulated on real trajectories with drift
as tests/loop_scenarios.py builds them: a trajectory split into two recordings, each with drift and chunk
coordinates of its own; the first solved alone (its map, fixed, in its outputs' frame), the second solved
with its loops to the map as the loop closer makes them (closer.align_loop on both keyframes' points: the
second's in its emitted world, the map's moved into the map's frame as earlier_map_of moves them)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from evo_data import evo_data_dir
from loop_scenarios import (
    FIT_POINTS,
    LOOP_CONFIG,
    TRAJECTORIES,
    Scenario,
    make_scenario,
    observed,
    rigid,
    without_false_loops,
)

from stream_recon.models.loops.closer import _KeyframePoints, align_loop
from stream_recon.models.loops.earlier_map import EarlierMap, MapExtension
from stream_recon.models.loops.pose_graph import PoseGraph, open_chain, optimize
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
                  frame_a: int, second: Scenario, second_chain: tuple[Sim3, ...], frame_b: int, depth: float,
                  same_place: bool = True):
    """The 3D agreement of a keyframe of the second recording (its frame_b) with the map's keyframe frame_a:
    FIT_POINTS points before the map keyframe's camera, seen by both (or, not `same_place`, the query's points
    of a place of its own), each through the depth model of loop_scenarios.observed."""
    a, b = chunk_of(first, frame_a), chunk_of(second, frame_b)
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
    return b, align_loop(_KeyframePoints(query, median_depth * emitted_b.scale / emitted_a.scale, centre_b),
                         _KeyframePoints(earlier, median_depth, centre_a), matches, LOOP_CONFIG)


def chunk_of(scenario: Scenario, frame: int) -> int:
    """The chunk that emits `frame` last (the later one where two share it), as Scenario.positions places it."""
    return max(k for k, (start, end) in enumerate(scenario.ranges) if start <= frame < end)


@functools.cache
def extended(name: str, seed: int, other: str | None = None, exact_map: bool = False) -> tuple[float, float, dict]:
    """The first half of `name`'s trajectory recorded and solved (the map; `exact_map`: its chunks where they
    truly are, a map without error), the second half (or, with `other`, the second half of another
    trajectory) extending it: the second recording's ATE in the map's frame (its positions taken to the ground
    truth by the Sim(3) that takes the map's there), its ATE recorded and solved alone (its own Sim(3)), and
    the extension's summary."""
    trajectory = TRAJECTORIES[name]
    truth = truth_of(name)
    half = len(truth) // 2
    first, first_graph = recording(truth[:half], name, 2 * seed)
    map_placement = optimize(first_graph).world_from_chunk
    if exact_map:
        map_placement = tuple(first.true_world_from_chunk[0].inverse() @ placed for placed in first.true_world_from_chunk)
    first_chain = open_chain(first_graph.odometry)
    second_truth = truth[half:] if other is None else truth_of(other)[len(truth_of(other)) // 2:]
    second, second_graph = recording(second_truth, other or name, 2 * seed + 1)
    second_chain = open_chain(second_graph.odometry)
    extension = MapExtension(EarlierMap("the first recording", ()), LOOP_CONFIG)
    rng = np.random.default_rng(1000 + seed)
    map_keyframes = list(range(0, half, LOOP_CONFIG.index_spacing))
    links = links_of(second_graph)
    for frame_b in range(0, len(second_truth), LOOP_CONFIG.index_spacing):  # the stream's keyframes, in order
        distances = np.linalg.norm(truth[map_keyframes, :3, 3] - second_truth[frame_b, :3, 3], axis=1)
        nearest = map_keyframes[int(np.argmin(distances))]
        revisit = other is None and distances.min() <= trajectory.revisit_radius
        if not revisit and rng.uniform() > 0.1:  # a look-alike checked now and then: a place of its own
            continue
        # the map keyframe's points in the map's frame, as earlier_map_of moves them
        move = map_placement[chunk_of(first, nearest)] @ first_chain[chunk_of(first, nearest)].inverse()
        chunk, alignment = map_alignment(rng, first, move, first_chain, nearest, second, second_chain, frame_b,
                                         trajectory.scene_depth, same_place=revisit)
        if alignment.passed:
            extension.add_loop(f"map-{frame_b}", frame_b, chunk, alignment, second_chain, links)
    moves = {}
    if extension.has_loops:
        graph, result = extension.solve(links, second_graph.loops)
        while not result.complete:  # as the loop closer settles at the stream's end
            graph, result = extension.solve(links, second_graph.loops)
        moves = extension.corrections(graph, result, (), 1).by_chunk
    second_placed = tuple(moves.get(k, Sim3.identity()) @ placed for k, placed in enumerate(second_chain))
    map_to_truth = umeyama(first.positions(map_placement), truth[:half, :3, 3], with_scale=True)
    in_map = map_to_truth.apply_to_points(second.positions(second_placed)) - second_truth[:, :3, 3]
    alone = second.ate(optimize(second_graph).world_from_chunk)
    return float(np.sqrt(np.mean(np.sum(in_map**2, axis=1)))), alone, extension.summary()


def ate(positions: np.ndarray, truth: np.ndarray) -> float:
    aligned = umeyama(positions, truth, with_scale=True).apply_to_points(positions)
    return float(np.sqrt(np.mean(np.sum((aligned - truth) ** 2, axis=1))))


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
