"""End to end on the tiny model: real sources in, complete run directories out, and every way a run fails.

Interruption by SIGINT and SIGTERM is tested through the real CLI, in test_app_cli.py.
"""

from __future__ import annotations

import errno
import gc
import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import trimesh
from conftest import build_tiny_model
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

import stream_recon.models
from stream_recon.app.options import OptionsError, RunOptions
from stream_recon.app.outputs.npz_schema import PREDICTION_FIELDS
from stream_recon.app.outputs.output_folder import OutputDirError
from stream_recon.app.run import pipeline
from stream_recon.app.run.loading import build_engine
from stream_recon.app.run.pipeline import run_sequence
from stream_recon.app.run.progress import RunProgress
from stream_recon.app.run.streaming import GIL_SWITCH_INTERVAL_S
from stream_recon.app.sources.frames import SourceError
from stream_recon.models import GCTStream, prepare_for_inference

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
    assert record["summary"]["frames_read"] == 8
    assert record["summary"]["engine"]["frames"] == 8


def test_a_model_handed_in_is_prepared_once_and_left_as_it_was(tmp_path: Path, tiny_model: GCTStream,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    prepared: list[GCTStream] = []
    engine_models: list[GCTStream] = []
    prepare = stream_recon.models.prepare_for_inference

    def prepare_counted(*args, **kwargs) -> GCTStream:
        prepared.append(prepare(*args, **kwargs))
        return prepared[-1]

    def build_engine_seen(model, options, device, dtype, console, lookahead=None):
        engine_models.append(model)
        return build_engine(model, options, device, dtype, console, lookahead)

    monkeypatch.setattr(stream_recon.models, "prepare_for_inference", prepare_counted)
    monkeypatch.setattr(pipeline, "build_engine", build_engine_seen)
    video = write_video(tmp_path / "clip.mp4", 4, fps=20)

    summary = run_sequence(str(video), tmp_path / "run", RunOptions(**FAST), model=tiny_model)

    assert summary.ok, summary.error
    assert len(prepared) == 1 and engine_models == prepared
    assert getattr(tiny_model, "inference_spec", None) is None


def test_a_run_parses_its_keyframe_policy_and_plans_its_memory_once(tmp_path: Path, tiny_model: GCTStream,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The options check parses the keyframe spelling the engines then use; the budget's plan made
    for the source's frame size before the run is the one its first frame uses."""
    import stream_recon.models.stream.engine as engine_module
    from stream_recon.models.stream import keyframes

    planned: list[str] = []  # by whom: before the run (plan_memory_for), or at the first frame (_plan_memory)
    plan_memory = engine_module.plan_memory

    def plan_counted(model, config, image_size, budget):
        planned.append(sys._getframe(1).f_code.co_name)
        return plan_memory(model, config, image_size, budget)

    monkeypatch.setattr(engine_module, "plan_memory", plan_counted)
    keyframes._parse_spelling.cache_clear()
    options = RunOptions(**FAST, keyframes="interval:2", gpu_memory="64GiB")
    video = write_video(tmp_path / "clip.mp4", 6, fps=20)

    summary = run_sequence(str(video), tmp_path / "run", options, model=tiny_model)

    assert summary.ok, summary.error
    assert planned == ["plan_memory_for"]
    assert keyframes._parse_spelling.cache_info().misses == 1
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["summary"]["engine"]["memory_plan"]["budget"] == 64 * 2**30


def test_the_engine_takes_a_prepared_model_and_prepares_none(tiny_model: GCTStream) -> None:
    with pytest.raises(ValueError, match="the engine takes a prepared model"):
        build_engine(tiny_model, RunOptions(**FAST), "cpu", torch.float32, Console(quiet=True))


def test_a_prepared_model_is_streamed_as_it_is(tmp_path: Path, prepared_tiny_model: GCTStream,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    engine_models: list[GCTStream] = []

    def build_engine_seen(model, options, device, dtype, console, lookahead=None):
        engine_models.append(model)
        return build_engine(model, options, device, dtype, console, lookahead)

    monkeypatch.setattr(pipeline, "build_engine", build_engine_seen)
    video = write_video(tmp_path / "clip.mp4", 4, fps=20)

    summary = run_sequence(str(video), tmp_path / "run", RunOptions(**FAST), model=prepared_tiny_model)

    assert summary.ok, summary.error
    assert engine_models == [prepared_tiny_model]


def test_run_json_holds_each_value_once_as_the_run_used_it(tmp_path: Path, tiny_model: GCTStream) -> None:
    # Each of status, fps, model_fps and frames_read once (one fps), compile as it ran (false on the
    # CPU), one device as resolved (not `auto` beside it), and the model load among the timings.
    video = write_video(tmp_path / "clip.mp4", 5, fps=20)

    summary = run_sequence(str(video), tmp_path / "run", RunOptions(**FAST), model=tiny_model)

    record = json.loads((tmp_path / "run" / "run.json").read_text())
    settings, recorded = record["settings"], record["summary"]
    assert (settings["device"], settings["dtype"], settings["attention"], settings["compile"]) == (
        "cpu", "float32", "sdpa", False)
    assert "device_resolved" not in settings
    assert not {"status", "device", "source"} & set(recorded)  # top level and settings hold them
    assert not {"fps", "model_fps", "frames_read", "frames_done", "frames_dropped"} & set(recorded["engine"])
    assert recorded["fps"] == summary.fps and recorded["model_fps"] == summary.model_fps
    timings = recorded["timings"]
    assert 0 <= timings["model_load_s"] <= timings["until_first_frame_s"] <= timings["total_s"]


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


@pytest.mark.slow
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


@pytest.mark.slow
def test_long_stream_rolls_over_to_new_windows_and_keeps_one_file_per_frame(
    tmp_path: Path, tiny_model: GCTStream
) -> None:
    video = write_video(tmp_path / "long.mp4", 14, fps=20)
    options = RunOptions(**{**FAST, "chunk_frames": 5, "overlap": 3})

    summary = run_sequence(str(video), tmp_path / "run", options, model=tiny_model)

    assert summary.status == "complete" and summary.frames == 14 and summary.frames_read == 14
    record = check_run_dir(tmp_path / "run", 14, "complete")
    assert record["summary"]["engine"]["rollovers"] >= 2
    windows = []
    for index in range(14):
        with np.load(tmp_path / "run" / "predictions" / f"{index:06d}.npz") as frame:
            windows.append(int(frame["chunk_index"]))
    # the overlap frames were re-predicted by the later window, whose emission is the final one
    assert windows == sorted(windows) and windows[-1] >= 2


@pytest.mark.slow
def test_a_warm_up_before_the_first_frame_leaves_the_run_directory_as_it_is(
    tmp_path: Path, tiny_model: GCTStream
) -> None:
    # --warm-up on: the streaming step runs on copies of the first frame before the stream (auto does that
    # where it compiles or records CUDA graphs, not in this CPU run), and nothing the run writes changes:
    # every prediction file and the trajectory byte for byte; run.json says how long the warm-up took, and
    # the run's rate starts after it.
    video = write_video(tmp_path / "long.mp4", 14, fps=20)
    runs = {}
    for choice in ("auto", "on"):
        options = RunOptions(**{**FAST, "chunk_frames": 5, "overlap": 3, "keyframes": "flow", "max_gap": 1,
                                "warm_up": choice})
        summary = run_sequence(str(video), tmp_path / choice, options, model=tiny_model)
        assert summary.status == "complete" and summary.frames == 14
        runs[choice] = check_run_dir(tmp_path / choice, 14, "complete")["summary"]
    assert runs["auto"]["timings"]["warm_up_s"] is None and runs["auto"]["timings"]["warm_up_parts_s"] is None
    timings = runs["on"]["timings"]
    assert timings["warm_up_s"] > 0 and set(timings["warm_up_parts_s"]) == {"scale_step_s", "streaming_steps_s"}
    assert timings["model_load_s"] + timings["warm_up_s"] <= timings["until_first_frame_s"]
    assert runs["on"]["engine"]["rollovers"] == runs["auto"]["engine"]["rollovers"] >= 2
    assert runs["on"]["engine"]["keyframes"] == runs["auto"]["engine"]["keyframes"]
    for name in ["trajectory_tum.txt"] + [f"predictions/{index:06d}.npz" for index in range(14)]:
        assert (tmp_path / "on" / name).read_bytes() == (tmp_path / "auto" / name).read_bytes(), name


def test_auto_warms_up_where_the_first_streaming_step_is_slow_and_the_stream_has_one(
    tmp_path: Path, tiny_model: GCTStream, monkeypatch: pytest.MonkeyPatch
) -> None:
    # auto follows the engine's slow_first_step (CUDA: compiled or recorded; here made true, as a CPU does
    # not compile), and skips a stream of scale frames only, which never takes a streaming step
    from stream_recon.models.stream.chunked import ChunkedEngine

    monkeypatch.setattr(ChunkedEngine, "slow_first_step", property(lambda engine: True))
    warm_ups = {}
    for frames in (3, 5):
        video = write_video(tmp_path / f"clip{frames}.mp4", frames, fps=20)
        run_sequence(str(video), tmp_path / f"run{frames}", RunOptions(**FAST), model=tiny_model)
        record = json.loads((tmp_path / f"run{frames}" / "run.json").read_text())
        warm_ups[frames] = record["summary"]["timings"]["warm_up_s"]
    assert warm_ups[3] is None and warm_ups[5] > 0


@pytest.mark.slow
def test_a_run_builds_its_kernels_while_its_checkpoint_loads_and_writes_what_it_writes_without(
    tmp_path: Path, tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On CUDA, uncompiled, the warm-up's dry pass runs on a zero model while the checkpoint loads
    # (models/builds/ahead.py) and the warm-up makes none of its own. Forced here (a CPU run builds no
    # Triton kernel): the pass ran on its thread for the run's model input, run.json says so, and every
    # file the run writes is the one a run with the warm-up's own dry pass writes.
    import dataclasses
    import types

    from stream_recon.models import StreamingEngine
    from stream_recon.models.builds import kernel_builds, plan

    passes = []
    run_dry = StreamingEngine.run_dry

    def recorded(engine, image, dry_pass):
        seconds = run_dry(engine, image, dry_pass)
        passes.append((threading.current_thread().name, engine.image_size))
        return seconds

    monkeypatch.setattr(StreamingEngine, "run_dry", recorded)
    monkeypatch.setattr(kernel_builds, "dry_pass_pays", lambda device, compiled: not compiled)
    monkeypatch.setattr(kernel_builds, "start_builders", lambda device: None)  # (no CUDA runtime for a child)
    video = write_video(tmp_path / "clip.mp4", 9, fps=20)
    parts = {}
    for name in ("ahead", "in_the_warm_up"):
        if name == "in_the_warm_up":  # the table's row for the pass ahead says no
            row = dataclasses.replace(plan.STAGE["dry_pass_ahead"], runs=lambda facts: False)
            monkeypatch.setattr(plan, "STAGE", types.MappingProxyType({**plan.STAGE, "dry_pass_ahead": row}))
        options = RunOptions(**{**FAST, "checkpoint": str(tiny_checkpoint), "warm_up": "on", "keyframes": "flow"})
        assert run_sequence(str(video), tmp_path / name, options).status == "complete"
        parts[name] = check_run_dir(tmp_path / name, 9, "complete")["summary"]["timings"]["warm_up_parts_s"]
    assert passes == [("kernel-build-ahead", (28, 56)), ("MainThread", (28, 56))]
    assert parts["ahead"]["kernel_builds"] == 0 and "kernel_builds_ahead_wait_s" in parts["ahead"]
    assert parts["ahead"]["kernel_builds_ahead_s"] > 0 and "kernel_builds_ahead_s" not in parts["in_the_warm_up"]
    for name in ["trajectory_tum.txt"] + [f"predictions/{index:06d}.npz" for index in range(9)]:
        assert (tmp_path / "ahead" / name).read_bytes() == (tmp_path / "in_the_warm_up" / name).read_bytes(), name


def test_a_run_builds_nothing_ahead_where_it_has_no_load_to_hide_it_or_a_memory_budget(monkeypatch) -> None:
    from stream_recon.models import ModelConfig, StreamConfig
    from stream_recon.models.builds import kernel_builds, plan

    monkeypatch.setattr(kernel_builds, "dry_pass_pays", lambda device, compiled: not compiled)  # as on a GPU
    monkeypatch.setattr(plan, "run_key", lambda settings: "a size not compiled here")

    def ahead(loading_checkpoint: bool = True, **changes) -> bool:
        settings = {"compile": "off", "warm_up": "auto", "gpu_memory": None, "scale_frames": 3, "device": "cuda",
                    "dtype": torch.bfloat16, "model_config": ModelConfig.tiny(),
                    "engine_config": StreamConfig(scale_frames=3, window=4), "input_size": (28, 56), **changes}
        builder = plan.Builder(plan.BuildSettings(**settings), say=lambda line: None)
        builder.facts.loading_checkpoint = loading_checkpoint
        return builder.runs("dry_pass_ahead")

    assert ahead()  # uncompiled on CUDA, the input size known, a checkpoint to load
    assert not ahead(compile="on")  # compiled steps build through Inductor
    assert not ahead(gpu_memory="8G")  # one copy of the weights at a time
    assert not ahead(warm_up="off")
    assert not ahead(input_size=None)  # a camera's size comes with its frames
    assert not ahead(loading_checkpoint=False)  # a caller's model: no load to hide the pass behind


def test_window_options_are_checked_before_anything_runs() -> None:
    with pytest.raises(OptionsError, match=r"--scale-frames \(9\) must be less than --chunk-frames \(8\)"):
        RunOptions(scale_frames=9, chunk_frames=8)
    with pytest.raises(OptionsError, match=r"--chunk-frames \(8\) must be more than --scale-frames \(8\)"):
        RunOptions(chunk_frames=8)  # only the chunk was changed: it is named first
    with pytest.raises(OptionsError, match="--overlap must be between 1 and --chunk-frames - 1"):
        RunOptions(chunk_frames=20, overlap=20)


def test_truncated_video_keeps_the_frames_before_the_damage(tmp_path: Path, tiny_model: GCTStream) -> None:
    video = truncate_file(write_video(tmp_path / "cut.avi", 30, fourcc="MJPG"), 0.5)

    summary = run_sequence(str(video), tmp_path / "run", RunOptions(**FAST), model=tiny_model)

    assert summary.status == "failed"
    assert "truncated or damaged" in summary.error
    assert 5 < summary.frames < 30 and summary.frames == summary.frames_read
    record = check_run_dir(tmp_path / "run", summary.frames, "failed")
    assert "truncated" in record["summary"]["error"]


@pytest.mark.slow
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


def test_the_gil_is_handed_back_sooner_while_frames_flow(tmp_path: Path, tiny_model: GCTStream) -> None:
    video = write_video(tmp_path / "clip.mp4", 4)
    before = sys.getswitchinterval()
    seen: list[float] = []

    class SwitchIntervalProbe:
        def on_frame(self, pred, stats) -> None:
            seen.append(sys.getswitchinterval())

        def close(self, status: str) -> None:
            """Nothing to release."""

    run_sequence(str(video), tmp_path / "run", RunOptions(**FAST), model=tiny_model,
                 extra_sinks=[SwitchIntervalProbe()])

    assert seen == [GIL_SWITCH_INTERVAL_S] * 4 and GIL_SWITCH_INTERVAL_S < before
    assert sys.getswitchinterval() == before  # the process's own setting again afterwards


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


def test_overwrite_removes_the_old_runs_exports_and_evaluation(tmp_path: Path, tiny_model: GCTStream) -> None:
    # --overwrite must remove the old run's exports (exports/scene.glb) and eval.json with its predictions
    from stream_recon.app.outputs.export import export_run

    run_dir = tmp_path / "run"
    run_sequence(str(write_video(tmp_path / "old.mp4", 6)), run_dir, RunOptions(**FAST), model=tiny_model)
    export_run(run_dir, "glb")
    (run_dir / "eval.json").write_text("{}")
    (run_dir / "notes.txt").write_text("the user's own file")

    summary = run_sequence(str(write_video(tmp_path / "new.mp4", 4)), run_dir, RunOptions(overwrite=True, **FAST),
                           model=tiny_model)

    assert summary.status == "complete"
    check_run_dir(run_dir, 4, "complete")  # frames 4 and 5 of the old run are gone too
    assert not (run_dir / "exports").exists() and not (run_dir / "eval.json").exists()
    assert (run_dir / "notes.txt").read_text() == "the user's own file"


def nan_model() -> GCTStream:
    """A tiny model whose patch embedding is NaN: every prediction it makes is NaN."""
    model = build_tiny_model()
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    return model


def test_non_finite_predictions_end_the_run_as_failed(tmp_path: Path) -> None:
    # A model passed in with NaN weights makes all-NaN predictions: the run must end "failed", not "complete"
    video = write_video(tmp_path / "clip.mp4", 6)

    summary = run_sequence(str(video), tmp_path / "run", RunOptions(**FAST), model=nan_model())

    assert summary.status == "failed" and summary.frames == 0
    assert summary.error.startswith("frame 0: the model predicted NaN or infinity (pose and camera and depth)")
    assert "check the checkpoint" in summary.error
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["status"] == "failed" and record["summary"]["error"] == summary.error
    assert not list((tmp_path / "run" / "predictions").glob("*.npz"))


def test_non_finite_prediction_mid_run_keeps_the_frames_before_it(tmp_path: Path) -> None:
    # NaN can start mid-stream (half precision overflowing on one input): what came before is good
    model = prepare_for_inference(build_tiny_model())  # its own weights: this test poisons them

    class PoisonAfterFrame4:
        def on_frame(self, pred, stats) -> None:
            if pred.frame_index == 4:
                with torch.no_grad():
                    next(model.parameters()).fill_(float("nan"))

        def close(self, status: str) -> None:
            """Nothing to release."""

    summary = run_sequence(str(write_video(tmp_path / "clip.mp4", 10)), tmp_path / "run", RunOptions(**FAST),
                           model=model, extra_sinks=[PoisonAfterFrame4()])

    assert summary.status == "failed" and summary.error.startswith("frame 5: the model predicted NaN")
    assert "keeping 5 frames before it" in summary.error
    check_run_dir(tmp_path / "run", 5, "failed")  # frames 0-4, whole and finite; nothing after frame 4
    for path in sorted((tmp_path / "run" / "predictions").glob("*.npz")):
        with np.load(path) as frame:
            assert np.isfinite(frame["depth"]).all() and np.isfinite(frame["c2w"]).all()


def test_the_gpu_running_out_of_memory_mid_run_is_one_line_and_keeps_the_frames_before_it(tmp_path: Path) -> None:
    # The allocator's error (here raised by the model's first layer from frame 5's step on, as torch raises it on
    # a GPU) ends the run "failed" with one line saying where and what to change; frames 0-4 stay on disk.
    model = prepare_for_inference(build_tiny_model())  # its own: this test hooks it
    out_of_memory = threading.Event()

    def allocator_refuses(module, inputs):
        if out_of_memory.is_set():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 66.00 MiB. GPU 0 has a total "
                                         "capacity of 7.63 GiB of which 20.00 MiB is free.")

    next(module for module in model.modules() if list(module.parameters(recurse=False))).register_forward_pre_hook(
        allocator_refuses)

    class OutOfMemoryAfterFrame4:
        def on_frame(self, pred, stats) -> None:
            if pred.frame_index == 4:
                out_of_memory.set()

        def close(self, status: str) -> None:
            """Nothing to release."""

    summary = run_sequence(str(write_video(tmp_path / "clip.mp4", 10)), tmp_path / "run",
                           RunOptions(**FAST, gpu_memory="8GiB"), model=model, extra_sinks=[OutOfMemoryAfterFrame4()])

    assert summary.status == "failed" and summary.frames == 5
    assert summary.error == ("the GPU ran out of memory at frame 5 (CUDA out of memory. Tried to allocate 66.00 MiB); "
                             "the predictions before it are kept: give --gpu-memory less than 8GiB, or a smaller "
                             "--image-width")
    record = check_run_dir(tmp_path / "run", 5, "failed")
    assert record["summary"]["error"] == summary.error


def test_start_past_the_end_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    # Refused before the model loads: not "done: 0 frames", exit 0 and an empty run folder marked complete
    folder = write_image_folder(tmp_path / "seq", [f"{index}.png" for index in range(5)], width=160, height=96)
    # a checkpoint that does not exist: loading it would raise CheckpointError, so the SourceError proves the order
    options = RunOptions(start=5, checkpoint=str(tmp_path / "missing.pt"), **FAST)

    with pytest.raises(SourceError, match=r"--start 5 is past the end of image folder .*seq: no frame is left"):
        run_sequence(folder, tmp_path / "run", options)

    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_source_that_delivers_no_frame_is_a_failed_run(tmp_path: Path, tiny_model: GCTStream) -> None:
    # a source whose length is not known up front (a generator, a camera) can still deliver nothing
    summary = run_sequence(iter([]), tmp_path / "run", RunOptions(**FAST), model=tiny_model)

    assert summary.status == "failed" and summary.frames == 0
    assert summary.error == "frame sequence list_iterator delivered no frame; nothing was reconstructed"
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "failed"


def test_unusable_attention_backend_is_refused_before_anything_is_made(tmp_path: Path) -> None:
    video = write_video(tmp_path / "clip.mp4", 3)

    with pytest.raises(OptionsError, match="flashinfer needs bf16/fp16 on a CUDA device"):
        run_sequence(str(video), tmp_path / "run", RunOptions(**{**FAST, "attention": "flashinfer"}))

    assert not (tmp_path / "run").exists()


def test_options_are_validated_with_every_problem_named(tmp_path: Path) -> None:
    with pytest.raises(OptionsError, match="--image-width must be a positive multiple of 14.*; --warm-up must be one "
                                           "of auto, on, off, got 'sometimes'; --keyframes must be "):
        RunOptions(keyframes="sometimes", image_width=500, warm_up="sometimes")
    video = write_video(tmp_path / "clip.mp4", 3)
    with pytest.raises(OptionsError, match="CUDA is not available"):
        run_sequence(str(video), tmp_path / "run", RunOptions(device="cuda"))
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
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


@pytest.mark.parametrize("width", [80, 100, 160])
def test_progress_bar_keeps_the_count_the_eta_and_the_rate_on_a_narrow_terminal(width: int) -> None:
    # on an 80- or 100-column terminal the bar, the frame count and the ETA were lost
    console = Console(record=True, width=width, force_terminal=True)
    with RunProgress(console, f"video {'/long/folder' * 6}/clip.mp4", total=1200) as progress:
        for read in range(410, 413):
            progress.update({"frames_read": read, "model_fps": 38.2, "fps": 35.9, "keyframes": read,
                             "cached_frames": 300, "patch_frames": 72, "cache_bytes": 1.9 * 2**30, "frames_dropped": 0})
            time.sleep(0.2)  # the ETA needs a rate of progress
    text = console.export_text()
    last = text[text.rindex(" 412/1200 "):][:width]  # the final redraw, one terminal line
    assert re.match(r" 412/1200 \d\d:\d\d left [━╸╺]+ 35.9 FPS  412 kf cache 1.90 GiB video /", last), last
    assert last.rstrip().endswith("…" if width < 160 else "/clip.mp4"), last  # only the source's name is shortened

    console = Console(record=True, width=80, force_terminal=True)
    with RunProgress(console, "stream http://cam", total=None) as progress:  # live: no length, no bar
        progress.update({"frames_read": 7, "model_fps": None, "fps": None, "keyframes": 2, "frames_dropped": 4})
    text = console.export_text()
    line = text[text.rindex("7 frames"):]
    assert re.match(r"7 frames 0:00:0\d . -  2 kf  4 dropped", line) and "━" not in line, line


def test_the_backend_is_announced_with_its_cache_what_it_is_and_its_first_use():
    from rich.console import Console

    from stream_recon.app.run.loading import announce_backend

    console = Console(record=True, width=400)
    announce_backend("flashinfer-fa2", None, console)
    announce_backend("sdpa", None, console)
    announce_backend("flashinfer-fa3", "--attention triton needs the triton package (it comes with CUDA builds of "
                                       "torch)", console)
    lines = console.export_text().splitlines()
    assert lines[0].startswith("attention: flashinfer-fa2 over the paged K/V cache; FlashInfer's paged prefill")
    assert "kernels compile on first use" in lines[0] and "about 30 s" in lines[0]
    assert lines[1].startswith("attention: sdpa over the paged K/V cache; PyTorch SDPA over the gathered pages")
    assert "auto did not take its first choice: --attention triton needs the triton package" in lines[2]


class SignalAtFrame:
    """A sink that sends this process `signum` when frame `index` arrives: a Ctrl-C at that moment."""

    def __init__(self, index: int, signum: int = signal.SIGINT) -> None:
        self.index, self.signum = index, signum

    def on_frame(self, pred, stats: dict) -> None:
        if pred.frame_index == self.index:
            os.kill(os.getpid(), self.signum)

    def close(self, status: str) -> None:
        pass


def test_a_ctrl_c_after_the_sources_last_frame_leaves_a_complete_run(tmp_path: Path, tiny_model: GCTStream) -> None:
    # a batch sequence interrupted after all its frames were written was redone
    video = write_video(tmp_path / "clip.mp4", 6)

    summary = run_sequence(str(video), tmp_path / "run", RunOptions(**FAST), model=tiny_model,
                           extra_sinks=[SignalAtFrame(5)])

    assert (summary.status, summary.frames, summary.stop_signal) == ("complete", 6, signal.SIGINT)
    assert summary.ended_by_signal == signal.SIGINT  # the CLI still exits 130: the signal was seen
    check_run_dir(tmp_path / "run", 6, "complete")
    # and run.json names it, as the exit code does
    assert json.loads((tmp_path / "run" / "run.json").read_text())["summary"]["stop_signal"] == "SIGINT"


def test_a_ctrl_c_mid_stream_still_interrupts_the_run(tmp_path: Path, tiny_model: GCTStream) -> None:
    frames = ((frame_bgr(index, 160, 96)[..., ::-1].copy(), index / 10) for index in range(10_000))

    summary = run_sequence(frames, tmp_path / "run", RunOptions(**FAST), model=tiny_model,
                           extra_sinks=[SignalAtFrame(5)])

    assert summary.status == "interrupted" and 6 <= summary.frames < 10_000
