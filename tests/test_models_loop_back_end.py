"""The loop closer's public back end, from an emitted fit to chunk corrections: loop_edge, solve and
corrections_from_solve, on a chain of four chunks that drifted and a loop from chunk 3 back to chunk 0.
Chunks are counted from 0 as the pose graph counts them; ChunkLink k hangs chunk k on chunk k - 1."""

from __future__ import annotations

import gtsam
import numpy as np
import pytest

from stream_recon.models.loops.closer import (
    LoopClosureConfig,
    _KeyframePoints,
    align_loop,
    corrections_from_solve,
    graph_of,
    loop_edge,
    solve,
)
from stream_recon.models.loops.corrections import LoopRecord
from stream_recon.models.loops.gtsam_sim3 import from_gtsam
from stream_recon.models.loops.pose_graph_data import open_chain
from stream_recon.models.stream.chunks import ChunkLink
from stream_recon.models.stream.similarity import Sim3

ODOMETRY_SIGMAS = np.array([0.03, 0.03, 0.03, 0.1, 0.1, 0.1, 0.03])  # rad, chunk units, log scale
CHUNKS = 4


def drifted_links(rng: np.random.Generator) -> tuple[list[Sim3], list[ChunkLink]]:
    """The true world_from_chunk of a square loop (chunk 3 back beside chunk 0) and links with noise drawn
    from the sigmas they declare."""
    truth = [Sim3.identity()]
    quarter_turn = np.asarray(gtsam.Rot3.Rz(np.pi / 2).matrix())
    for _ in range(1, CHUNKS):
        step = Sim3(float(np.exp(rng.normal(0, 0.2))), quarter_turn, np.array([3.0, 0.0, 0.0]))
        truth.append(truth[-1] @ step)
    links = []
    for k in range(1, CHUNKS):
        noise = from_gtsam(gtsam.Similarity3.Expmap(rng.normal(0, ODOMETRY_SIGMAS)))
        links.append(ChunkLink(k, truth[k - 1].inverse() @ truth[k] @ noise, ODOMETRY_SIGMAS, 16))
    return truth, links


def emitted_loop(rng: np.random.Generator, truth: list[Sim3], chain: tuple[Sim3, ...]):
    """Keyframes of chunks 0 and 3 seeing the same 60 points near chunk 0's origin, as each chunk's
    emissions place them (the open chain's world), and their inlier matches."""
    points = rng.uniform([-1, -1, 3], [1, 1, 6], (60, 3))  # the true world
    centre = np.zeros(3)
    earlier = _KeyframePoints(chain[0].apply_to_points(points) + rng.normal(0, 0.005, points.shape), 4.5, centre)
    emitted_from_true = chain[3] @ truth[3].inverse()  # how chunk 3's emissions misplace the world
    query = _KeyframePoints(emitted_from_true.apply_to_points(points), 4.5, emitted_from_true.apply_to_points(centre))
    return points, query, earlier, np.stack([np.arange(60)] * 2, axis=1)


def test_a_loop_from_an_emitted_fit_corrects_the_chunks_that_drifted() -> None:
    rng = np.random.default_rng(0)
    truth, links = drifted_links(rng)
    graph = graph_of(links, [])
    chain = open_chain(graph.odometry)
    points, query, earlier, matches = emitted_loop(rng, truth, chain)
    config = LoopClosureConfig()
    alignment = align_loop(query, earlier, matches, config)
    assert alignment.passed
    edge = loop_edge(7, 0, 3, alignment, chain, config)
    true_edge = truth[0].inverse() @ truth[3]
    np.testing.assert_allclose(edge.first_from_second.scaled_matrix, true_edge.scaled_matrix, atol=0.05)

    record = LoopRecord(7, 100, 3, 1, 0, 0.9, 80, 60, "pending")
    graph, result = solve(links, [edge])
    assert result.accepted_ids == (7,)
    corrections = corrections_from_solve(graph, result, [record], version=3)
    assert corrections.version == 3 and corrections.loops[0].status == "accepted"
    open_error = np.abs(query.points - earlier.points).max()
    corrected = corrections.for_chunk(3).apply_to_points(query.points)
    assert np.abs(corrected - earlier.points).max() < 0.1 * open_error  # chunk 3 moved back onto chunk 0
    assert corrections.for_chunk(0).is_identity or np.allclose(corrections.for_chunk(0).scaled_matrix, np.eye(4))


def test_a_solve_without_an_accepted_loop_moves_nothing_and_says_so() -> None:
    rng = np.random.default_rng(1)
    truth, links = drifted_links(rng)
    wrong = loop_edge_from(Sim3(1.0, np.eye(3), np.array([50.0, 0.0, 0.0])), links)
    record = LoopRecord(wrong.loop_id, 100, 3, 1, 0, 0.9, 80, 60, "pending")
    untouched = LoopRecord(8, 101, 3, 2, 0, 0.8, 10, 2, "rejected_by_check")
    graph, result = solve(links, [wrong])
    corrections = corrections_from_solve(graph, result, [record, untouched])
    assert corrections.is_identity
    assert [loop.status for loop in corrections.loops] == ["rejected_by_graph", "rejected_by_check"]


def loop_edge_from(first_from_second: Sim3, links: list[ChunkLink]):
    from stream_recon.models.loops.pose_graph_data import LoopEdge

    return LoopEdge(9, 0, 3, first_from_second, 0.01)


def test_the_graph_counts_chunks_from_zero_and_links_from_one() -> None:
    rng = np.random.default_rng(2)
    _, links = drifted_links(rng)
    graph = graph_of(links, [loop_edge_from(Sim3.identity(), links)])
    assert graph.num_chunks == CHUNKS and len(graph.odometry) == len(links)
    assert graph.odometry[0].previous_from_next is links[0].previous_from_next  # link 1: edge 0, chunks 0-1
    assert not graph_of(links[:2], [loop_edge_from(Sim3.identity(), links)]).loops  # chunk 3 not linked yet
    with pytest.raises(ValueError, match="in order"):
        graph_of(links[1:], [])
