"""Parity at the product's boundary: `stream-recon` run on the golden frames, as a user runs it,
writes predictions/*.npz equal to the official outputs (fixtures a-c) in every key.

The model comes from a real checkpoint file (the fixtures' deterministic weights saved as .pt) and
the frames from a real image folder, through the CLI's own loading, preprocessing and writers.
What only the engine shows is read from the same run (EngineSteps): its cache state frame by frame
and the flow magnitudes behind its keyframe decisions. Full-size model on the CPU: minutes (marked
golden and slow). The GPU suite runs the same check in float32 and bf16 (tests/test_gpu_fast_path.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from golden_utils import (
    GOLDEN,
    SCENARIO_OPTIONS,
    EngineSteps,
    assert_cache_states,
    assert_flow_magnitudes,
    compare_run_with_golden,
    run_cli_on_golden_frames,
)

pytestmark = [pytest.mark.golden, pytest.mark.slow]


# Every scenario on each run: 40-50 s of the full-size model on one core each (14 frames at 224 pixels wide); the
# GPU suite runs the CLI on all_keyframes in float32 and every scenario through the engine
# (tests/test_gpu_fast_path.py).
@pytest.mark.parametrize("scenario", sorted(SCENARIO_OPTIONS))
def test_cli_run_directory_equals_the_official_outputs_on_the_cpu(golden_checkpoint, golden_frame_folder, tmp_path,
                                                                  scenario, monkeypatch):
    steps = EngineSteps(monkeypatch)
    run_dir = run_cli_on_golden_frames(golden_checkpoint, golden_frame_folder, tmp_path / scenario, scenario,
                                       "--device", "cpu", "--dtype", "float32")
    compare_run_with_golden(run_dir, scenario)
    golden = np.load(GOLDEN / scenario / "outputs.npz")
    states, predictions = steps.stream(frames=14)
    assert_cache_states(states, golden)
    if "flow_magnitude" in golden.files:  # the flow scenario's fixture lists them, the others none
        assert_flow_magnitudes(predictions, golden)
