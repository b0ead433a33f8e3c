"""The loop closer on the `loop` fixture's real images (tests/loop_standin.py drifts the reference chunk by
chunk): its synchronous core, the same core in its child process, and its 3D verification on its own."""

from __future__ import annotations

import functools

import cv2
import numpy as np
import pytest
from loop_standin import LoopSceneEngine, load_loop_scene, trajectory_error

pytest.importorskip("gtsam")

from stream_recon.models.loops.closer import (  # noqa: E402
    FirstFinalKeyframes,
    LoopCloser,
    LoopClosureConfig,
    _KeyframePoints,
    align_loop,
    keyframe_of,
)
from stream_recon.models.loops.process import LoopClosureProcess  # noqa: E402
from stream_recon.models.stream.similarity import Sim3  # noqa: E402
from stream_recon.models.supervision import Deadline  # noqa: E402

# every keyframe of the 69-frame stream is indexed, all in flight at once if need be: the outcome does not
# depend on timing
ALL_KEYFRAMES = LoopClosureConfig(keyframes_in_flight=100, index_spacing=1)


class CoreFeed:
    """The synchronous core fed as the child feeds it: a keyframe's first final emission, in emission order."""

    def __init__(self, closer: LoopCloser) -> None:
        self.closer = closer
        self.admitted = FirstFinalKeyframes()
        self.add_link = closer.add_link

    def add_prediction(self, prediction) -> None:
        if self.admitted.admit(prediction):
            self.closer.add_keyframe(keyframe_of(prediction))


def stream_through(closer, seed: int = 0) -> tuple[dict, LoopSceneEngine]:
    scene = load_loop_scene()
    engine = LoopSceneEngine(scene, seed=seed)
    final, links_sent = {}, 0
    for frame in scene.frames:
        image = cv2.cvtColor(cv2.imread(str(scene.image_path(frame))), cv2.COLOR_BGR2RGB).transpose(2, 0, 1)
        predictions = engine.push(image)
        for link in engine.chunk_links[links_sent:]:  # a chunk's odometry before its first emission
            closer.add_link(link)
        links_sent = len(engine.chunk_links)
        for prediction in predictions:
            closer.add_prediction(prediction)
            final[prediction.frame_index] = prediction
    return final, engine


@functools.cache
def core_run(seed: int) -> tuple[LoopCloser, dict]:
    """The synchronous core fed the stream drifted with `seed`, and the stream's final emissions, settled as
    the child settles at the stream's end: one run per seed, which the child's run is compared with too."""
    closer = LoopCloser(ALL_KEYFRAMES)
    final, _ = stream_through(CoreFeed(closer), seed)
    closer.settle()
    return closer, final


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.slow
def test_the_walk_back_to_its_start_is_closed_and_the_drift_corrected(seed: int) -> None:
    closer, final = core_run(seed)
    corrections = closer.corrections
    reference = load_loop_scene().c2w
    open_c2w = np.stack([final[i].c2w for i in range(len(final))])
    corrected = np.stack([corrections.corrected_c2w(final[i].chunk_index, final[i].c2w) for i in range(len(final))])
    assert trajectory_error(corrected, reference) < 0.5 * trajectory_error(open_c2w, reference)
    accepted = corrections.accepted_loops
    assert accepted and all(loop.query_chunk - loop.candidate_chunk >= 2 for loop in accepted)
    assert all(loop.candidate_frame <= 10 and loop.query_frame >= 60 for loop in accepted)


@pytest.mark.slow
def test_the_child_process_closes_the_same_loops_as_the_core() -> None:
    """The child closes the core's loops; and before its last word (`finish`), which an interrupted run (or
    a child lost mid-run) never gets, the pairs it has checked are known: it sends its summary whenever a
    pair was recorded, not only at its end."""
    core, _ = core_run(0)
    in_child = LoopClosureProcess(ALL_KEYFRAMES)
    try:
        stream_through(in_child)
        deadline = Deadline(60.0)
        while in_child.summary().get("candidates_checked", 0) == 0 and not deadline.expired:
            in_child._wait_for_pipes(0.1)
            in_child.take_corrections()
        before_the_last_word = in_child.summary()
        core_result, child_result = core.corrections, in_child.finish(Deadline(60.0))
    finally:
        in_child.close()
    assert before_the_last_word["candidates_checked"] > 0, before_the_last_word
    assert before_the_last_word["keyframes_indexed"] > 0, before_the_last_word
    assert in_child.helper.is_up, in_child.helper.down_reason
    assert [loop.loop_id for loop in child_result.accepted_loops] == [
        loop.loop_id for loop in core_result.accepted_loops]
    assert sorted(child_result.by_chunk) == sorted(core_result.by_chunk)
    # each solve starts from the last and may be cut short by its time budget at different points in the two
    # processes: their solutions agree to the solver's tolerance, not bit for bit
    for chunk, move in core_result.by_chunk.items():
        np.testing.assert_allclose(child_result.by_chunk[chunk].scaled_matrix, move.scaled_matrix, atol=5e-3)
    summary = in_child.summary()
    assert summary["accepted"] == len(core_result.accepted_loops) and summary["keyframes_indexed"] == 69
    assert summary["keyframes_deferred"] == 0 and summary["index_spacing"] == {"start": 1, "end": 1}


def keyframe_points(points: np.ndarray) -> _KeyframePoints:
    """A keyframe whose camera is at the origin of `points`."""
    return _KeyframePoints(points, median_depth=float(np.median(np.linalg.norm(points, axis=1))),
                           camera_centre=np.zeros(3))


def test_verification_fits_points_that_agree_and_refuses_those_that_do_not() -> None:
    rng = np.random.default_rng(0)
    earlier = rng.uniform([-2, -1, 3], [2, 1, 6], size=(40, 3))
    move = Sim3(1.1, cv2.Rodrigues(np.array([0.0, 0.05, 0.0]))[0], np.array([0.2, 0.0, -0.1]))
    query = move.inverse().apply_to_points(earlier) + rng.normal(0, 0.002, size=earlier.shape)
    matches = np.stack([np.arange(40), np.arange(40)], axis=1)
    fit = align_loop(keyframe_points(query), keyframe_points(earlier), matches, LoopClosureConfig())
    assert fit.passed and fit.agreeing == 40
    np.testing.assert_allclose(fit.earlier_from_query.scaled_matrix, move.scaled_matrix, atol=5e-3)
    assert np.all(np.isfinite(fit.sigmas_world)) and np.all(fit.sigmas_world > 0)

    shuffled = rng.permutation(40)  # the same points, matched wrongly: nothing agrees
    wrong = align_loop(keyframe_points(query[shuffled]), keyframe_points(earlier), matches, LoopClosureConfig())
    assert not wrong.passed

    few = align_loop(keyframe_points(query), keyframe_points(earlier), matches[:8], LoopClosureConfig())
    assert not few.passed and few.points == 8  # fewer than min_agreeing_points

    unsure = query.copy()
    unsure[:30] = np.nan  # depth not confident there
    assert not align_loop(keyframe_points(unsure), keyframe_points(earlier), matches, LoopClosureConfig()).passed

    far = Sim3(3.0, np.eye(3), np.zeros(3))  # agrees, but at a scale no drift explains
    scaled = far.inverse().apply_to_points(earlier)
    assert not align_loop(keyframe_points(scaled), keyframe_points(earlier), matches, LoopClosureConfig()).passed


def test_a_flow_chunks_rollover_feeds_the_index_out_of_frame_order_and_detection_takes_it(tiny_model) -> None:
    """Around a flow chunk's rollover the closed chunk's last keyframes come after the next chunk's first
    ones; detection indexes every one of them instead of failing."""
    import torch
    from engine_helpers import frames

    from stream_recon.models import ChunkedEngine, StreamConfig, prepare_for_inference

    model = prepare_for_inference(tiny_model, "cpu", torch.float32)
    config = StreamConfig(scale_frames=3, window=4, keyframes="flow", flow_threshold=0.8, max_gap=3)
    engine = ChunkedEngine(model, config, chunk_frames=6, overlap=3)
    closer = LoopCloser()
    feed, admitted, links_sent = CoreFeed(closer), FirstFinalKeyframes(), 0
    order = []
    for frame in frames(24):
        predictions = engine.push(frame)
        for link in engine.chunk_links[links_sent:]:
            feed.add_link(link)
        links_sent = len(engine.chunk_links)
        for prediction in predictions:
            if admitted.admit(prediction):
                order.append(prediction.frame_index)
            feed.add_prediction(prediction)
    assert any(later < earlier for earlier, later in zip(order, order[1:], strict=False)), order  # the case arose
    assert closer.summary()["keyframes_indexed"] == len(order) == len(set(order))


def test_a_solve_cut_short_by_its_budget_goes_on_until_it_settles() -> None:
    """The closer's solves hand back what they have after their budget; at the stream's end `settle` solves on
    until the graph's verdicts are final: those of a solve without a budget."""
    from evo_data import evo_data_dir
    from loop_scenarios import TRAJECTORIES, make_scenario

    from stream_recon.models.loops.closer import LoopCloser
    from stream_recon.models.loops.pose_graph import optimize
    from stream_recon.models.loops.pose_graph_data import PoseGraphSettings
    from stream_recon.models.stream.chunks import ChunkLink

    trajectory = TRAJECTORIES["TUM fr1_xyz"]
    scenario = make_scenario(trajectory.poses(evo_data_dir()), 0, revisit_radius=trajectory.revisit_radius,
                             false_min_distance=trajectory.false_min_distance, scene_depth=trajectory.scene_depth)
    closer = LoopCloser(LoopClosureConfig(pose_graph=PoseGraphSettings(budget_s=0.0)))
    for k, edge in enumerate(scenario.graph.odometry):
        closer.add_link(ChunkLink(k + 1, edge.previous_from_next, edge.sigmas, 16, edge.covariance))
    closer._edges.extend(scenario.graph.loops)  # the loops as verification would have added them
    closer._solve()
    assert closer._unfinished
    settled = closer.settle()
    assert not closer._unfinished
    assert not settled.is_identity and settled.version > 1
    final = closer._solver.solve(scenario.graph)
    assert final.complete and final.accepted_ids == optimize(scenario.graph).accepted_ids
