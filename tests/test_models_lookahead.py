"""The spare engine's pacing (models/lookahead.py, models/pacing.py) on the CPU: a turn lets through
stages worth its budget, a scale step spreads over as many turns as it has stages, and what the
spare predicts is what a plain engine predicts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stream_recon.models import StreamConfig, StreamingEngine
from stream_recon.models.lookahead import SpareEngine
from stream_recon.models.pacing import at_stage_boundaries, stage_boundary

SCALE_FRAMES = 3


@pytest.fixture(scope="module")
def model(prepared_tiny_model):
    return prepared_tiny_model


@pytest.fixture(scope="module")
def frames():
    return torch.rand(8, 3, 28, 42, generator=torch.Generator().manual_seed(3))


def stages_of_a_step(model, num_frames: int) -> int:
    """DINO blocks, aggregator blocks, and one per frame of the DPT head, each a stage."""
    c = model.config
    return c.dino_depth + c.depth + num_frames


def test_boundaries_call_back_only_inside_their_context(model, frames):
    calls = []
    stage_boundary()  # nothing to call
    with at_stage_boundaries(lambda: calls.append(1)):
        engine = StreamingEngine(model, StreamConfig(scale_frames=SCALE_FRAMES, window=4))
        for frame in frames[:SCALE_FRAMES]:
            engine.push(frame)
    assert len(calls) == stages_of_a_step(model, SCALE_FRAMES) - 1


def test_a_tiny_budget_issues_one_stage_a_turn_and_a_large_one_everything(model, frames):
    config = StreamConfig(scale_frames=SCALE_FRAMES, window=4)
    spare = SpareEngine(StreamingEngine(model, config))
    spare.warm([(frame, float(i)) for i, frame in enumerate(frames[:SCALE_FRAMES + 2])])
    assert spare.collect() == []  # the warm-up's predictions are not the stream's
    scale_stages = stages_of_a_step(model, SCALE_FRAMES)
    assert {index for kind, index in spare.stage_costs if kind == SCALE_FRAMES - 1} == set(range(scale_stages))
    for i, frame in enumerate(frames[:SCALE_FRAMES + 1]):
        spare.push(frame, float(i))
    turns = 0
    while not spare.idle:
        spare.advance(1e-9)
        turns += 1
    # the buffered scale frames one each, the scale step stage by stage, the streaming step stage by
    # stage (its embedding one more)
    assert turns == (SCALE_FRAMES - 1) + scale_stages + stages_of_a_step(model, 1) + 1
    paced = spare.collect()

    spare.engine.reset()
    for i, frame in enumerate(frames[:SCALE_FRAMES + 1]):
        spare.push(frame, float(i))
    spare.advance(1e9)
    assert spare.idle
    unpaced = spare.collect()
    spare.close()

    plain = StreamingEngine(model, config)
    expected = [p for i, frame in enumerate(frames[:SCALE_FRAMES + 1]) for p in plain.push(frame, float(i))]
    assert len(paced) == len(expected) == SCALE_FRAMES + 1
    for ours in (paced, unpaced):
        for a, b in zip(ours, expected, strict=True):
            assert a.frame_index == b.frame_index
            np.testing.assert_array_equal(a.depth, b.depth)
            np.testing.assert_array_equal(a.pose_enc, b.pose_enc)
