"""The official model's outputs on deterministic weights (fixtures a-d), reproduced on CPU in float32.

Full-size model (1.16 B parameters): a few seconds a frame on one core of a 2-core machine. Each official
computation runs once in the suite: every scenario's predictions at the boundary, through `stream-recon`, with the
cache states and flow magnitudes of the same run (tests/test_golden_cli.py); here the phase-1 intermediates (the
first step, the three scale frames, as in every scenario), and the cache states of the policies that decide by a
frame's index (all, interval) on the tiny model, whatever the weights. The flow stream through the engine at full size runs
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


class Capture:
    """Keeps the first output of a module (the phase-1 step) without changing it."""

    def __init__(self, module):
        self.value = None
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        if self.value is None:
            self.value = [o.detach().clone() for o in output] if isinstance(output, (list, tuple)) else output.detach().clone()


def run_scenario(config: StreamConfig, capture: bool = False, model=None, frames: int | None = None):
    """The golden frames (the first `frames` of them) through an engine of `config` on `model` (the full-size
    one by default): the predictions, each push's cache state, the phase-1 captures."""
    torch.use_deterministic_algorithms(True)
    model = prepared_full_size_model() if model is None else model
    captures = {}
    if capture:
        captures = {
            "dino": Capture(model.aggregator.patch_embed),
            "aggregator": Capture(model.aggregator),
            "camera": Capture(model.camera_head),
        }
    engine = StreamingEngine(model, config)
    predictions, states = [], []
    try:
        for frame in golden_frames()[:frames]:
            time_before = engine.time_counter
            predictions += engine.push(frame)
            states.append(cache_state(engine, time_before))
    finally:
        for c in captures.values():
            c.handle.remove()
    return predictions, states, {k: c.value for k, c in captures.items()}


def flow_engine_run(frames: int | None = None):
    """The flow policy's stream (its first `frames` frames) through the engine, the first step's (phase 1's)
    intermediates captured."""
    return run_scenario(SCENARIOS["flow"], capture=True, frames=frames)


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
    predictions, states, _ = run_scenario(SCENARIOS[scenario], model=tiny)
    golden = np.load(GOLDEN / scenario / "outputs.npz")
    assert [p.frame_index for p in predictions] == list(range(14))
    assert [p.is_keyframe for p in predictions] == golden["is_keyframe"].tolist()
    assert_cache_states(states, golden)


def test_phase1_intermediates():
    _, _, captured = flow_engine_run(frames=3)  # the scale frames: phase 1 alone
    golden = np.load(GOLDEN / "phase1_intermediates" / "intermediates.npz")
    checks = {
        "dino_patch_tokens_f0": captured["dino"][0],
        "agg_layers_f0": torch.stack([layer[0] for layer in captured["aggregator"]]),
        "pose_enc_list": torch.stack(captured["camera"]),
    }
    for key, ours in checks.items():
        err = relative_error(ours.numpy(), golden[key])
        assert err <= TOLERANCE, f"{key}: error {err:.2e}"


@pytest.mark.skipif(not every_golden_check(), reason="the engine's flow stream at full size: STREAM_RECON_GOLDEN=all")
def test_the_flow_policy_through_the_engine():
    """The engine's flow stream (rollbacks, deferred evictions) against the fixture, with its intermediates
    captured (the CLI's run of it, on the CPU, in tests/test_golden_cli.py)."""
    predictions, states, _ = flow_engine_run()
    golden = np.load(GOLDEN / "flow" / "outputs.npz")
    check_outputs(predictions, golden)
    assert_cache_states(states, golden)
    assert_flow_magnitudes(predictions, golden)
