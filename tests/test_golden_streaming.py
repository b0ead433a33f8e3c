"""The official model's outputs on deterministic weights (fixtures a-d), reproduced on CPU in float32.

Full-size model (1.16 B parameters): a few seconds a frame on one core of a 2-core machine. Each official
computation runs once in the suite: every scenario's predictions at the boundary, through `stream-recon`, with the
cache states and flow magnitudes of the same run (tests/test_golden_cli.py); the phase-1 intermediates (the first
step, the three scale frames, as in every scenario) from the windowed stream's first step
(tests/test_golden_chunked.py); here the cache states of the policies that decide by a frame's index (all,
interval) on the tiny model, whatever the weights. The flow stream through the engine at full size runs
with STREAM_RECON_GOLDEN=all: the page tables do not depend on the weights, and they are checked against one
reference on generated sequences of appends, rollbacks and evictions (tests/test_cache_paged.py,
tests/test_models_engine.py), the GPU's kernels over them at full size on the GPU (tests/test_gpu_fast_path.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import build_tiny_model
from golden_utils import (
    GOLDEN,
    TOLERANCE,
    assert_cache_states,
    assert_flow_magnitudes,
    cache_state,
    every_golden_check,
    golden_frames,
    prepared_full_size_model,
    relative_error,
)

from stream_recon.models import StreamConfig, StreamingEngine, prepare_for_inference

pytestmark = [pytest.mark.golden, pytest.mark.slow]

SCENARIOS = {
    "all_keyframes": StreamConfig(scale_frames=3, window=4, keyframes="all"),
    "interval_2": StreamConfig(scale_frames=3, window=4, keyframes="interval:2"),
    "flow": StreamConfig(scale_frames=3, window=4, keyframes="flow", flow_threshold=43.0, max_gap=3),
}


def run_scenario(config: StreamConfig, model=None):
    """The golden frames through an engine of `config` on `model` (the full-size one by default): the
    predictions and each push's cache state."""
    torch.use_deterministic_algorithms(True)
    model = prepared_full_size_model() if model is None else model
    engine = StreamingEngine(model, config)
    predictions, states = [], []
    for frame in golden_frames():
        time_before = engine.time_counter
        predictions += engine.push(frame)
        states.append(cache_state(engine, time_before))
    return predictions, states


def check_outputs(predictions, golden):
    assert [p.frame_index for p in predictions] == list(range(14))
    assert [p.frame_type for p in predictions] == golden["frame_type"].tolist()
    assert [p.is_keyframe for p in predictions] == golden["is_keyframe"].tolist()
    pose_err = relative_error(np.stack([p.pose_enc for p in predictions]), golden["pose_enc"], axis=0)
    assert pose_err.max() <= TOLERANCE, f"pose_enc per-component errors {pose_err}"
    for key in ("depth", "depth_conf", "c2w", "intrinsics"):
        err = relative_error(np.stack([getattr(p, key) for p in predictions]), golden[key])
        assert err <= TOLERANCE, f"{key}: error {err:.2e} > {TOLERANCE}"


@pytest.mark.parametrize("scenario", ["all_keyframes", "interval_2"])
def test_cache_states_follow_the_official_schedule(scenario):
    """A policy that decides by a frame's index caches the same frames whatever the weights: the tiny model's
    engine on the golden frames goes through the official cache states push by push."""
    tiny = prepare_for_inference(build_tiny_model(), "cpu", torch.float32)
    predictions, states = run_scenario(SCENARIOS[scenario], model=tiny)
    golden = np.load(GOLDEN / scenario / "outputs.npz")
    assert [p.frame_index for p in predictions] == list(range(14))
    assert [p.is_keyframe for p in predictions] == golden["is_keyframe"].tolist()
    assert_cache_states(states, golden)


@pytest.mark.skipif(not every_golden_check(), reason="the engine's flow stream at full size: STREAM_RECON_GOLDEN=all")
def test_the_flow_policy_through_the_engine():
    """The engine's flow stream (rollbacks, deferred evictions) against the fixture (the CLI's run of it, on the
    CPU, in tests/test_golden_cli.py)."""
    predictions, states = run_scenario(SCENARIOS["flow"])
    golden = np.load(GOLDEN / "flow" / "outputs.npz")
    check_outputs(predictions, golden)
    assert_cache_states(states, golden)
    assert_flow_magnitudes(predictions, golden)
