"""The 320-frame unit of a long stream is a chunk: what was written under its earlier name (`window`)
still works, from the command line, from a preset and from the files of earlier runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from synthetic_run import plane_frame

from stream_recon.app.options import RunOptions, changed_settings
from stream_recon.app.outputs.npz_reading import load_prediction
from stream_recon.app.outputs.npz_schema import PREDICTION_FIELDS, prediction_arrays
from stream_recon.app.run.presets import build_options


def test_a_preset_that_says_window_frames_sets_chunk_frames(tmp_path: Path) -> None:
    preset = tmp_path / "old.yaml"
    preset.write_text("window_frames: 100\noverlap: 8\n")
    options = build_options(str(preset), {})
    assert options.chunk_frames == 100 and options.overlap == 8


def test_settings_recorded_under_the_earlier_name_are_the_same_settings() -> None:
    now = RunOptions(chunk_frames=100).result_settings()
    before = {**{key: value for key, value in now.items() if key != "chunk_frames"}, "window_frames": 100}
    assert changed_settings(before, now) == []
    assert changed_settings({**before, "window_frames": 200}, now) == ["chunk_frames 200 -> 100"]


def test_a_prediction_file_with_window_index_reads_as_chunk_index(tmp_path: Path) -> None:
    arrays = prediction_arrays(plane_frame(3, chunk_index=2))
    arrays["window_index"] = arrays.pop("chunk_index")
    path = tmp_path / "000003.npz"
    np.savez(path, **arrays)
    record = load_prediction(path)
    assert record["chunk_index"] == 2 and "window_index" not in record
    assert set(PREDICTION_FIELDS) <= set(record)


def test_both_spellings_of_the_flag_reach_the_same_option() -> None:
    from typer.testing import CliRunner

    from stream_recon.app.cli import app

    runner = CliRunner()
    for flag in ("--chunk-frames", "--window-frames"):
        result = runner.invoke(app, ["run", "frames/", flag, "4", "--scale-frames", "4", "--no-viewer"])
        assert result.exit_code == 2, result.output
        assert "--scale-frames (4) must be less than --chunk-frames (4)" in result.output
