"""A run refined offline (models/loops/refine.py) on drift simulated over real trajectories
(tests/loop_scenarios.py's refine_scenario): chunks that also drift inside themselves, the stream's chunk graph
with the loops of its indexed keyframes against refine's segment graph with every keyframe's loops.

Where the trajectory revisits most of itself (EuRoC V1_02, TUM fr1_xyz) the refined ATE is at most half the
stream's corrected one. Where long stretches are never revisited (KITTI 00's streets, parts of fr2_desk) their
chunks keep the odometry's error whatever the graph, and it bounds both: there refine is never worse.
"""

from __future__ import annotations

import numpy as np
import pytest
from evo_data import evo_data_dir
from loop_scenarios import TRAJECTORIES, refine_scenario

from stream_recon.models.loops.refine import RefineConfig, RunFrame, frame_moves, segments_of
from stream_recon.models.stream.similarity import Sim3


def outcomes(name: str, seeds: range) -> list:
    trajectory = TRAJECTORIES[name]
    truth = trajectory.poses(evo_data_dir())
    return [refine_scenario(truth, seed, revisit_radius=trajectory.revisit_radius) for seed in seeds]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["EuRoC V1_02", "TUM fr1_xyz"])
def test_refine_halves_the_streams_error_where_the_camera_comes_back(name: str) -> None:
    found = outcomes(name, range(3))
    ratios = [outcome.refined_ate / outcome.stream_ate for outcome in found]
    assert max(ratios) <= 0.5, ratios
    assert all(outcome.refined_accepted > 5 * outcome.stream_accepted for outcome in found)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["KITTI 00", "TUM fr2_desk"])
def test_refine_is_never_worse_where_stretches_are_never_revisited(name: str) -> None:
    found = outcomes(name, range(3))
    ratios = [outcome.refined_ate / outcome.stream_ate for outcome in found]
    assert max(ratios) <= 1.05 and np.median(ratios) < 1.0, ratios


def test_segments_cut_each_chunk_from_its_first_frame() -> None:
    """A chunk's frames (by their final emission) in runs of segment_frames; a frame shared by two chunks
    belongs to the later one, whose first segment starts there."""
    frames = [RunFrame(f, 0 if f < 100 else 1, np.eye(4)[:3], True) for f in range(250)]
    parts = segments_of(frames, 40)
    assert parts.nodes == ((0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (1, 3))
    assert parts.node_of[99] == 2 and parts.node_of[100] == 3 and parts.node_of[139] == 3 and parts.node_of[140] == 4
    assert parts.first_frame[3] == 100


def test_moves_blend_between_segments_of_one_chunk_and_never_across_chunks() -> None:
    frames = [RunFrame(f, 0 if f < 80 else 1, np.eye(4)[:3], True) for f in range(160)]
    parts = segments_of(frames, 40)
    shifted = [Sim3(1.0, np.eye(3), np.array([float(n), 0.0, 0.0])) for n in range(len(parts.nodes))]
    moves = frame_moves(frames, parts, shifted, [Sim3.identity(), Sim3.identity()])
    middle = [moves[f].translation[0] for f in range(0, 80)]
    assert np.all(np.diff(middle) >= -1e-12) and middle[0] == 0.0 and middle[-1] == 1.0  # no step inside chunk 0
    assert moves[80].translation[0] == 2.0  # chunk 1 starts from its own first segment
    assert RefineConfig().segment_frames == 64
