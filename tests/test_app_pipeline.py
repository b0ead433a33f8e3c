"""End to end on the tiny model: real sources in, complete run directories out, and every way a run fails.

Interruption by SIGINT and SIGTERM is tested through the real CLI, in test_app_cli.py.
"""

from __future__ import annotations

import errno
import gc
import json
from pathlib import Path

import numpy as np
import pytest
import trimesh
from media_helpers import (
    frame_bgr,
    mjpeg_server,
    rss_bytes,
    truncate_file,
    write_image_folder,
    write_video,
)
from plyfile import PlyData
from rich.console import Console

from stream_recon.app.options import OptionsError, RunOptions
from stream_recon.app.pipeline import run_sequence
from stream_recon.app.progress import RunProgress
from stream_recon.app.rundir import PREDICTION_FIELDS, OutputDirError
from stream_recon.models import GCTStream

# Small inputs keep the tiny model at a few ms per frame: 160x96 frames -> 56x42 model input.
# The synthetic weights' confidence sits just under 2, so points.ply keeps every pixel.
FAST = dict(image_width=56, scale_frames=3, window=4, viewer=False, conf_threshold=1.0)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def read_tum(path: Path) -> np.ndarray:
    """An independent TUM reader: 8 floats per non-comment line."""
    rows = []
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            values = [float(value) for value in line.split()]
            assert len(values) == 8, line
            rows.append(values)
    return np.array(rows)


def check_run_dir(run_dir: Path, num_frames: int, status: str) -> dict:
    """Everything DESIGN.md §5 promises, read back with readers that are not ours."""
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == status
    npz_files = sorted((run_dir / "predictions").glob("*.npz"))
    assert [path.name for path in npz_files] == [f"{index:06d}.npz" for index in range(num_frames)]
    timestamps = []
    for index, path in enumerate(npz_files):
        with np.load(path) as frame:
            assert set(PREDICTION_FIELDS) <= set(frame.files)
            assert int(frame["frame_index"]) == index
            assert frame["c2w"].shape == (3, 4) and frame["depth"].shape == tuple(frame["image_size"])
            timestamps.append(float(frame["timestamp"]))
            c2w = frame["c2w"]
    tum = read_tum(run_dir / "trajectory_tum.txt")
    assert tum.shape == (num_frames, 8)
    np.testing.assert_allclose(tum[:, 0], timestamps, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(tum[:, 4:8], axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(tum[-1, 1:4], c2w[:, 3], atol=1e-5)
    ply = PlyData.read(str(run_dir / "points.ply"))
    mesh = trimesh.load(run_dir / "points.ply")
    assert len(mesh.vertices) == ply["vertex"].count
    return record


def test_video_run_writes_a_complete_run_directory(tmp_path: Path, tiny_model: GCTStream) -> None:
    video = write_video(tmp_path / "clip.mp4", 8, fps=20)

    summary = run_sequence(str(video), tmp_path / "run", RunOptions(**FAST), model=tiny_model)

    assert summary.status == "complete" and summary.ok and summary.error is None
    assert summary.frames == 8 and summary.keyframes == 8 and summary.frames_read == 8
    assert summary.fps > 0 and summary.model_fps > 0
    record = check_run_dir(tmp_path / "run", 8, "complete")
    np.testing.assert_allclose(read_tum(tmp_path / "run" / "trajectory_tum.txt")[:, 0], np.arange(8) / 20, atol=1e-6)
    assert record["settings"]["image_width"] == 56 and record["settings"]["source_kind"] == "video"
    assert record["summary"]["frames_read"] == 8 and record["summary"]["device"] == "cpu"
    assert record["summary"]["engine"]["frames"] == 8


def test_image_folder_run_uses_file_order_timestamps(tmp_path: Path, tiny_model: GCTStream) -> None:
    folder = write_image_folder(tmp_path / "seq", [f"img{index}.png" for index in range(1, 6)], width=160, height=96)

    summary = run_sequence(folder, tmp_path / "run", RunOptions(fps=5, **FAST), model=tiny_model)

    assert summary.status == "complete" and summary.frames == 5
    check_run_dir(tmp_path / "run", 5, "complete")
    np.testing.assert_allclose(read_tum(tmp_path / "run" / "trajectory_tum.txt")[:, 0], np.arange(5) / 5)


def test_live_mjpeg_camera_run(tmp_path: Path, tiny_model: GCTStream) -> None:
    with mjpeg_server(num_frames=1000, interval_s=0.005) as url:
        summary = run_sequence(url, tmp_path / "run", RunOptions(max_frames=6, **FAST), model=tiny_model)

    assert summary.status == "complete" and summary.end_reason == "max_frames"
    check_run_dir(tmp_path / "run", 6, "complete")


def test_generator_source_keeps_its_timestamps(tmp_path: Path, tiny_model: GCTStream) -> None:
    def camera():
        for index in range(5):
            yield frame_bgr(index, 160, 96)[:, :, ::-1].copy(), 100.0 + 0.5 * index

    summary = run_sequence(camera(), tmp_path / "run", RunOptions(**FAST), model=tiny_model)

    assert summary.status == "complete"
    check_run_dir(tmp_path / "run", 5, "complete")
    np.testing.assert_allclose(read_tum(tmp_path / "run" / "trajectory_tum.txt")[:, 0], 100 + 0.5 * np.arange(5))


def test_stream_shorter_than_the_scale_frames_is_flushed(tmp_path: Path, tiny_model: GCTStream) -> None:
    video = write_video(tmp_path / "short.mp4", 2)

    summary = run_sequence(str(video), tmp_path / "run", RunOptions(**FAST), model=tiny_model)

    assert summary.status == "complete" and summary.frames == 2


def test_long_stream_rolls_over_to_new_windows_and_keeps_one_file_per_frame(
    tmp_path: Path, tiny_model: GCTStream
) -> None:
    video = write_video(tmp_path / "long.mp4", 14, fps=20)
    options = RunOptions(**{**FAST, "window_frames": 5, "overlap": 3})

    summary = run_sequence(str(video), tmp_path / "run", options, model=tiny_model)

    assert summary.status == "complete" and summary.frames == 14 and summary.frames_read == 14
    record = check_run_dir(tmp_path / "run", 14, "complete")
    assert record["summary"]["engine"]["rollovers"] >= 2
    windows = []
    for index in range(14):
        with np.load(tmp_path / "run" / "predictions" / f"{index:06d}.npz") as frame:
            windows.append(int(frame["window_index"]))
    # the overlap frames were re-predicted by the later window, whose emission is the final one
    assert windows == sorted(windows) and windows[-1] >= 2


def test_window_options_are_checked_before_anything_runs() -> None:
    with pytest.raises(OptionsError, match="window_frames must be more than scale_frames"):
        RunOptions(scale_frames=8, window_frames=8)
    with pytest.raises(OptionsError, match="overlap must be between 1 and window_frames - 1"):
        RunOptions(window_frames=20, overlap=20)


def test_truncated_video_keeps_the_frames_before_the_damage(tmp_path: Path, tiny_model: GCTStream) -> None:
    video = truncate_file(write_video(tmp_path / "cut.avi", 30, fourcc="MJPG"), 0.5)

    summary = run_sequence(str(video), tmp_path / "run", RunOptions(**FAST), model=tiny_model)

    assert summary.status == "failed"
    assert "truncated or damaged" in summary.error
    assert 5 < summary.frames < 30 and summary.frames == summary.frames_read
    record = check_run_dir(tmp_path / "run", summary.frames, "failed")
    assert "truncated" in record["summary"]["error"]


def test_frame_of_another_size_mid_stream_fails_and_keeps_earlier_frames(
    tmp_path: Path, tiny_model: GCTStream
) -> None:
    def camera():
        for index in range(6):
            height = 96 if index < 4 else 160  # the camera switches resolution
            yield np.zeros((height, 160, 3), dtype=np.uint8), float(index)

    summary = run_sequence(camera(), tmp_path / "run", RunOptions(**FAST), model=tiny_model)

    assert summary.status == "failed" and "size" in summary.error
    check_run_dir(tmp_path / "run", 4, "failed")


def test_disk_failure_mid_stream_ends_the_run_as_failed(tmp_path: Path, tiny_model: GCTStream) -> None:
    video = write_video(tmp_path / "clip.mp4", 12)
    run_dir = tmp_path / "run"

    class DiskFails:
        """From frame 5 on, the predictions folder is a file: every later write fails."""

        def on_frame(self, pred, stats) -> None:
            if pred.frame_index == 5:
                # a rename, not a delete: the writer thread may be writing into the folder right now
                (run_dir / "predictions").rename(run_dir / "gone")
                (run_dir / "predictions").write_text("not a folder any more")

        def close(self, status: str) -> None:
            """Nothing to release."""

    summary = run_sequence(str(video), run_dir, RunOptions(**FAST), model=tiny_model, extra_sinks=[DiskFails()])

    assert summary.status == "failed"
    assert "writing frames to" in summary.error and "predictions" in summary.error
    assert json.loads((run_dir / "run.json").read_text())["status"] == "failed"


def test_a_disk_that_fills_mid_run_ends_it_clearly_and_keeps_every_frame_written(
    tmp_path: Path, tiny_model: GCTStream, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A real full disk needs a filesystem of its own (mounting one needs privileges this test does not
    # have): from the 7th frame on, writing a frame fails as a full disk makes it fail.
    real_savez, calls = np.savez, []

    def savez_until_full(file, **arrays):
        calls.append(1)
        if len(calls) > 6:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_savez(file, **arrays)

    monkeypatch.setattr(np, "savez", savez_until_full)
    video = write_video(tmp_path / "clip.mp4", 20)

    summary = run_sequence(str(video), tmp_path / "run", RunOptions(**FAST), model=tiny_model)

    assert summary.status == "failed" and summary.frames == 6
    assert "No space left on device; the disk is full. Every frame written before it (6 frames, the last frame 5) is kept" \
        in summary.error and "--no-save-images" in summary.error
    record = check_run_dir(tmp_path / "run", 6, "failed")  # frames 0-5, their trajectory, run.json, points.ply
    assert "disk is full" in record["summary"]["error"]
    assert not list((tmp_path / "run" / "predictions").glob(".*.tmp"))  # no half-written file left behind


def test_objects_from_before_the_stream_are_kept_out_of_full_collections_while_it_runs(
    tmp_path: Path, tiny_model: GCTStream
) -> None:
    video = write_video(tmp_path / "clip.mp4", 6)
    frozen_while_streaming: list[int] = []

    class FreezeProbe:
        def on_frame(self, pred, stats) -> None:
            frozen_while_streaming.append(gc.get_freeze_count())

        def close(self, status: str) -> None:
            """Nothing to release."""

    run_sequence(str(video), tmp_path / "run", RunOptions(**FAST), model=tiny_model, extra_sinks=[FreezeProbe()])

    assert len(frozen_while_streaming) == 6 and min(frozen_while_streaming) > 1000  # the model's objects, at least
    assert gc.get_freeze_count() == 0  # and collectable again afterwards


def test_output_dir_is_checked_before_the_model_loads(tmp_path: Path) -> None:
    video = write_video(tmp_path / "clip.mp4", 3)
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    # a checkpoint that does not exist: loading it would raise CheckpointError, so the
    # OutputDirError proves the order
    options = RunOptions(checkpoint=str(tmp_path / "missing.pt"), **FAST)

    with pytest.raises(OutputDirError, match="exists and is not a directory"):
        run_sequence(str(video), blocker, options)
    with pytest.raises(OutputDirError, match="cannot write to the output directory"):
        run_sequence(str(video), blocker / "run", options)


def test_existing_run_needs_overwrite(tmp_path: Path, tiny_model: GCTStream) -> None:
    video = write_video(tmp_path / "clip.mp4", 3)
    run_sequence(str(video), tmp_path / "run", RunOptions(**FAST), model=tiny_model)

    with pytest.raises(OutputDirError, match="already holds a run.*--overwrite"):
        run_sequence(str(video), tmp_path / "run", RunOptions(**FAST), model=tiny_model)
    summary = run_sequence(str(video), tmp_path / "run", RunOptions(overwrite=True, **FAST), model=tiny_model)
    assert summary.status == "complete"


def test_unusable_attention_backend_is_refused_before_anything_is_made(tmp_path: Path) -> None:
    video = write_video(tmp_path / "clip.mp4", 3)

    with pytest.raises(OptionsError, match="flashinfer needs bf16/fp16 on a CUDA device"):
        run_sequence(str(video), tmp_path / "run", RunOptions(**{**FAST, "attention": "flashinfer"}))

    assert not (tmp_path / "run").exists()


def test_options_are_validated_with_every_problem_named(tmp_path: Path) -> None:
    with pytest.raises(OptionsError, match="keyframes must be .*; image_width must be a positive multiple of 14"):
        RunOptions(keyframes="sometimes", image_width=500)
    video = write_video(tmp_path / "clip.mp4", 3)
    with pytest.raises(OptionsError, match="CUDA is not available"):
        run_sequence(str(video), tmp_path / "run", RunOptions(device="cuda"))
    assert not (tmp_path / "run").exists()


def test_host_memory_stays_flat_over_a_long_video(tmp_path: Path, tiny_model: GCTStream) -> None:
    # 60 decoded 1280x720 frames are 166 MB; the run must hold a bounded number of them
    video = write_video(tmp_path / "long.mp4", 60, width=1280, height=720)
    gc.collect()
    samples: dict[int, int] = {}

    class MemoryProbe:
        def on_frame(self, pred, stats) -> None:
            if pred.frame_index in (20, 59):
                samples[pred.frame_index] = rss_bytes()

        def close(self, status: str) -> None:
            """Nothing to release."""

    options = RunOptions(image_width=28, scale_frames=2, window=4, viewer=False)
    summary = run_sequence(str(video), tmp_path / "run", options, model=tiny_model, extra_sinks=[MemoryProbe()])

    assert summary.frames == 60
    growth = samples[59] - samples[20]
    assert growth < 40 * 2**20, f"host memory grew by {growth / 2**20:.0f} MB over 40 frames"


def test_progress_line_shows_rates_keyframes_cache_and_drops() -> None:
    console = Console(record=True, width=160, force_terminal=True)
    with RunProgress(console, "video clip.mp4", total=10) as progress:
        progress.update({"frames_read": 3, "model_fps": 12.0, "fps": 10.5, "keyframes": 3, "cached_frames": 5,
                         "cache_bytes": 3 * 2**20, "frames_dropped": 0})
    bar = console.export_text().splitlines()[-1]
    assert "3/10" in bar and "model 12.0 FPS  e2e 10.5 FPS  kf 3" in bar and "cache 5 fr 3.0 MB" in bar

    console = Console(record=True, width=160, force_terminal=True)
    with RunProgress(console, "stream http://cam", total=None) as progress:  # live: no length, no bar
        progress.update({"frames_read": 7, "model_fps": None, "fps": None, "keyframes": 2, "frames_dropped": 4})
    line = console.export_text().splitlines()[-1]
    assert "7 frames" in line and "model -" in line and "dropped 4" in line and "━" not in line


def test_flashinfer_compile_is_announced():
    from rich.console import Console

    from stream_recon.app.loading import announce_backend

    console = Console(record=True, width=200)
    announce_backend("flashinfer-fa2", console)
    announce_backend("sdpa", console)
    text = console.export_text()
    assert "kernels compile on first use" in text and "about 30 s" in text
    assert "attention: sdpa" in text
