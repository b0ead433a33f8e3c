"""Parity at the product's boundary: `stream-recon` run on the golden frames, as a user runs it,
writes predictions/*.npz equal to the official outputs (fixtures a-c) in every key.

The model comes from a real checkpoint file (the fixtures' deterministic weights saved as .pt) and
the frames from a real image folder, through the CLI's own loading, preprocessing and writers.
Full-size model on the CPU: minutes (marked golden and slow). The GPU suite runs the same check
in float32 and bf16 (tests/test_gpu_fast_path.py).
"""

from __future__ import annotations

import pytest
from golden_utils import (
    SCENARIO_OPTIONS,
    compare_run_with_golden,
    run_cli_on_golden_frames,
    scenarios_to_check,
)

pytestmark = [pytest.mark.golden, pytest.mark.slow]

# interval_2 caches every other frame of all_keyframes' stream: test_golden_streaming.py checks that schedule
# against the fixtures' cache states
@pytest.mark.parametrize("scenario", scenarios_to_check(list(SCENARIO_OPTIONS), ("all_keyframes", "flow")))
def test_cli_run_directory_equals_the_official_outputs_on_the_cpu(golden_checkpoint, golden_frame_folder, tmp_path,
                                                                  scenario):
    run_dir = run_cli_on_golden_frames(golden_checkpoint, golden_frame_folder, tmp_path / scenario, scenario,
                                       "--device", "cpu", "--dtype", "float32")
    compare_run_with_golden(run_dir, scenario)
