"""The command line: both spellings of run, help and version, presets, and every bad input as one
sentence and a non-zero exit code (no traceback)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import typing
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import build_tiny_model
from media_helpers import (
    free_port,
    mjpeg_server,
    silent_server,
    truncate_file,
    write_image_folder,
    write_video,
)
from typer.testing import CliRunner

from stream_recon.app.cli import app, main, with_default_command
from stream_recon.app.commands._options import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_TERMINATED
from stream_recon.app.options import OptionsError, PresetError, RunOptions, flag
from stream_recon.app.run.presets import PRESET_DIR, available_presets, build_options
from stream_recon.models import ModelConfig
from stream_recon.models.checkpoint import convert_to_safetensors

runner = CliRunner()


def invoke(*args: str):
    """Run the CLI as `stream-recon ARGS` (through the default-command rule)."""
    return runner.invoke(app, with_default_command(list(args)))


def assert_user_error(result, *fragments: str, code: int = EXIT_BAD_INPUT) -> None:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    for fragment in fragments:
        assert fragment in result.output, result.output


# ------------------------------------------------------------------ command layout


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["clip.mp4"], ["run", "clip.mp4"]),
        (["clip.mp4", "--fps", "5"], ["run", "clip.mp4", "--fps", "5"]),
        (["--no-viewer", "clip.mp4"], ["run", "--no-viewer", "clip.mp4"]),
        (["run", "clip.mp4"], ["run", "clip.mp4"]),
        (["info"], ["info"]),
        (["--version"], ["--version"]),
        (["-h"], ["-h"]),
        ([], ["run"]),
        # an earlier version's flag, spelled as today's; not after `--`, where arguments are taken as they are
        (["clip.mp4", "--no-compile"], ["run", "clip.mp4", "--compile", "off"]),
        (["run", "--", "--no-compile"], ["run", "--", "--no-compile"]),
    ],
)
def test_run_is_the_default_command(argv: list[str], expected: list[str]) -> None:
    assert with_default_command(argv) == expected


def test_every_run_option_has_a_flag() -> None:
    from stream_recon.app.commands._options import RUN_OPTION_FLAGS

    assert set(RUN_OPTION_FLAGS) == set(RunOptions.field_names())


def shown_defaults() -> dict[str, str | None]:
    """What `[default: ...]` each run flag's help shows (None: none), as typer is given it."""
    from stream_recon.app.commands._options import RUN_OPTION_FLAGS

    shown = {}
    for field, annotated in RUN_OPTION_FLAGS.items():
        option = typing.get_args(annotated)[1]  # Annotated[Optional[kind], typer.Option(...)]
        match = re.search(r"\\\[default: ([^\]]*)\]", option.help)
        shown[field] = match.group(1) if match else None
    return shown


def test_every_run_option_shows_its_default() -> None:
    from stream_recon.models.checkpoint_names import DEFAULT_CHECKPOINT
    from stream_recon.models.stream.keyframes.flow import FLOW_THRESHOLD, MAX_GAP

    shown = shown_defaults()
    chosen_by_run = {"overwrite", "keep_viewer"}  # app.commands.run decides them when the flag is not given
    for field in dataclasses.fields(RunOptions):
        if field.default is None or field.name in chosen_by_run:
            continue
        value = shown[field.name].partition(",")[0]  # `320, the trained range`: the value, then a note
        if isinstance(field.default, bool):
            on = flag(field.name).removeprefix("--")
            assert value == (on if field.default else f"no-{on}"), field.name
        elif isinstance(field.default, int):
            assert int(value) == field.default, field.name
        elif isinstance(field.default, float):
            assert float(value) == field.default, field.name
        else:
            assert value == field.default, field.name
    # a None that stands for a value owned elsewhere shows that value
    assert shown["checkpoint"] == DEFAULT_CHECKPOINT
    assert float(shown["flow_threshold"]) == FLOW_THRESHOLD and int(shown["max_gap"]) == MAX_GAP
    assert shown["keep_viewer"].startswith("keep-viewer on a terminal")
    assert shown["overwrite"].startswith("no-overwrite")
    # and no default where None means no limit
    assert shown["fps"] is None and shown["max_frames"] is None


def test_version_and_help() -> None:
    version = invoke("--version")
    assert version.exit_code == 0 and version.output.startswith("stream-recon ")

    root_help = invoke("-h")
    assert root_help.exit_code == 0
    for command in ("run", "info", "download", "convert", "export"):
        assert command in root_help.output

    run_help = invoke("run", "-h")
    assert run_help.exit_code == 0 and "--keyframes" in run_help.output and "--config" in run_help.output
    # every command shows its examples
    for command in ("run", "info", "download", "convert", "export"):
        shown = invoke(command, "-h").output
        assert "Examples:" in shown and f"stream-recon {command if command != 'run' else ''}" in shown


@pytest.mark.slow
def test_installed_entry_point_takes_a_bare_source(tmp_path: Path) -> None:
    # the real console script, as a user types it: no `run`
    result = subprocess.run(
        [sys.executable, "-c", "from stream_recon.app.cli import main; main()", str(tmp_path / "missing.mp4")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == EXIT_BAD_INPUT
    assert "error: no such file or folder" in result.stderr and "Traceback" not in result.stderr


def test_main_accepts_an_argv_list(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exited:
        main([str(tmp_path / "missing.mp4"), "--no-viewer"])
    assert exited.value.code == EXIT_BAD_INPUT


# ------------------------------------------------------------------ bad input, one sentence each


def test_missing_file(tmp_path: Path) -> None:
    assert_user_error(invoke(str(tmp_path / "nope.mp4"), "--no-viewer"), "error: no such file or folder", "nope.mp4")


def test_non_video_named_mp4(tmp_path: Path) -> None:
    fake = tmp_path / "movie.mp4"
    fake.write_text("definitely not a video")
    assert_user_error(invoke(str(fake), "--no-viewer"), "movie.mp4 is not a video file", "looks like text")


def test_truncated_mp4_without_index(tmp_path: Path) -> None:
    video = write_video(tmp_path / "cut.mp4", 20)
    video.write_bytes(video.read_bytes()[:4000])
    assert_user_error(invoke(str(video), "--no-viewer"), "cut.mp4 looks like an MP4/MOV file", "truncated")


def test_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "frames").mkdir()
    assert_user_error(invoke(str(tmp_path / "frames"), "--no-viewer"), "frames contains no images")


def test_folder_of_mixed_sizes(tmp_path: Path) -> None:
    folder = write_image_folder(tmp_path / "frames", ["a.png"], width=64, height=48)
    write_image_folder(folder, ["b.png"], width=32, height=32)
    assert_user_error(invoke(str(folder), "--no-viewer"), "different sizes: a.png is 64x48 but b.png is 32x32")


@pytest.mark.slow
def test_unreachable_stream_times_out(tmp_path: Path) -> None:
    with silent_server() as port:
        result = invoke(f"rtsp://127.0.0.1:{port}/cam", "--open-timeout", "1", "--no-viewer",
                        "-o", str(tmp_path / "out"))
    assert_user_error(result, "could not", f"rtsp://127.0.0.1:{port}/cam")
    assert not (tmp_path / "out").exists()


def test_unwritable_output_directory(tmp_path: Path) -> None:
    video = write_video(tmp_path / "clip.mp4", 3)
    blocker = tmp_path / "taken"
    blocker.write_text("a file where the output folder should go")
    # the checkpoint does not exist either: the output error must come first, before any load
    result = invoke(str(video), "--no-viewer", "-o", str(blocker / "run"), "--checkpoint", str(tmp_path / "no.pt"))
    assert_user_error(result, "error: cannot write to the output directory", "choose a writable --output")


def test_existing_run_is_not_overwritten(tmp_path: Path) -> None:
    video = write_video(tmp_path / "clip.mp4", 3)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.json").write_text("{}")
    assert_user_error(invoke(str(video), "--no-viewer", "-o", str(run_dir)), "already holds a run", "--overwrite")


def test_single_image_instead_of_folder(tmp_path: Path) -> None:
    folder = write_image_folder(tmp_path / "frames", ["0001.png"])
    assert_user_error(invoke(str(folder / "0001.png"), "--no-viewer"), "is a single image; pass the folder")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--keyframes", "sometimes"], "--keyframes must be all, flow or interval:N"),
        (["--image-width", "500"], "--image-width must be a positive multiple of 14"),
        (["--stride", "0"], "--stride must be >= 1"),
        (["--open-timeout", "0"], "--open-timeout must be a number of seconds > 0"),  # spelled unlike its field
        (["--chunk-frames", "4", "--scale-frames", "4"], "--scale-frames (4) must be less than --chunk-frames (4)"),
        (["--port", "70000"], "--port must be between 1 and 65535"),
        (["--reconnect", "-1"], "--reconnect must be a number of seconds >= 0 (0: never reconnect), got -1.0"),
        # refused up front: not a writers.py traceback and exit 1, nor -1 accepted silently
        (["--voxel-size", "-1"], "--voxel-size must be a number > 0 in scene units"),
        (["--voxel-size", "0"], "--voxel-size must be a number > 0 in scene units"),
        (["--voxel-size", "nan"], "--voxel-size must be a number > 0 in scene units"),
        (["--voxel-size", "inf"], "--voxel-size must be a number > 0 in scene units"),
        (["--conf-threshold", "-1"], "--conf-threshold must be a number >= 1 (confidence is 1 + exp(logit)"),
        (["--conf-threshold", "nan"], "--conf-threshold must be a number >= 1"),
        (["--fps", "0"], "--fps must be a positive number"),
        (["--fps", "inf"], "--fps must be a positive number"),
        (["--max-frames", "0"], "--max-frames must be >= 1"),
        (["--start", "-1"], "--start must be >= 0"),
        (["--flow-threshold", "inf"], "--flow-threshold must be a number > 0"),
        (["--open-timeout", "nan"], "--open-timeout must be a number of seconds > 0"),
        (["--no-viewer", "--host", "203.0.113.7", "--viewer"], "the viewer cannot serve on 203.0.113.7:8080"),
        (["--device", "cuda:0"], "CUDA is not available"),
        (["--device", "tpu"], "--device must be auto, cpu, cuda or cuda:N"),
        (["--attention", "flashinfer", "--device", "cpu"], "flashinfer needs bf16/fp16 on a CUDA device"),
        (["--attention", "triton", "--device", "cpu"], "triton needs bf16/fp16 on a CUDA device"),
        (["--attention", "dense-triton", "--device", "cpu"], "--attention dense-triton was retired when the cache "
                                                              "kept one (paged) layout: use triton"),
    ],
)
def test_bad_options_are_named(tmp_path: Path, flags: list[str], message: str) -> None:
    video = write_video(tmp_path / "clip.mp4", 3)
    # the checkpoint does not exist: every option is checked before a model would load
    result = invoke(str(video), "--no-viewer", "-o", str(tmp_path / "out"), "--checkpoint", str(tmp_path / "no.pt"),
                    *flags)
    assert_user_error(result, message)
    assert result.output.startswith("error: ") and len(result.output.strip().splitlines()) == 1, result.output
    assert not (tmp_path / "out").exists()


def test_start_past_the_end_of_the_source_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    # Refused before the model loads: not "done: 0 frames", exit 0 and an empty run folder marked complete
    video = write_video(tmp_path / "clip.mp4", 5)
    result = invoke(str(video), "--start", "5", "--no-viewer", "-o", str(tmp_path / "out"),
                    "--checkpoint", str(tmp_path / "no.pt"))
    assert_user_error(result, f"error: --start 5 is past the end of video {video}", "use a smaller --start")
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["clip.mp4", "--voxel-sise", "1"], "error: No such option: --voxel-sise"),
        (["run", "clip.mp4", "--fps", "fast"], "error: Invalid value for '--fps'"),
        (["view"], "error: Missing argument 'run_dir'; `stream-recon view -h` shows the usage"),
        (["export", "run"], "error: Missing option '--format'"),
        (["eval", "run"], "error: Missing option '--gt'"),
        (["batch", "data"], "error: Missing option '--output'"),
        (["download", "a", "b"], "error: Got unexpected extra argument(s) (b)"),
        (["convert", "a.pt"], "error: Missing argument 'destination'"),
        (["info", "--yaml"], "error: No such option: --yaml"),
    ],
)
def test_usage_errors_of_every_command_are_one_line_and_exit_2(argv: list[str], message: str) -> None:
    # typer's own usage errors read like every other bad input: one line, no boxed panel
    result = invoke(*argv)
    assert_user_error(result, message)
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_unknown_preset(tmp_path: Path) -> None:
    video = write_video(tmp_path / "clip.mp4", 3)
    assert_user_error(invoke(str(video), "--config", "underwater"), "no preset 'underwater'", "indoor")


def test_preset_with_an_unknown_option(tmp_path: Path) -> None:
    video = write_video(tmp_path / "clip.mp4", 3)
    preset = tmp_path / "mine.yaml"
    preset.write_text("window: 16\nwindows: 32\n")
    assert_user_error(invoke(str(video), "--config", str(preset)), "sets unknown option(s) windows")


# ------------------------------------------------------------------ presets


def test_every_shipped_preset_builds_valid_options() -> None:
    assert {"indoor", "outdoor", "low-memory"} <= set(available_presets())
    for name in ("indoor", "outdoor", "low-memory"):
        values = yaml.safe_load((PRESET_DIR / f"{name}.yaml").read_text())
        options = build_options(name, {})
        for key, value in values.items():
            assert getattr(options, key) == value


def test_flags_override_the_preset_and_unset_flags_do_not() -> None:
    options = build_options("low-memory", {"window": 16, "image_width": None, "device": "cpu"})
    assert options.window == 16  # flag wins
    assert options.image_width == 392  # preset value kept: the flag was not given
    assert options.keyframes == "interval:2"
    assert options.scale_frames == RunOptions().scale_frames  # neither: the default


def test_preset_values_are_validated(tmp_path: Path) -> None:
    preset = tmp_path / "bad.yaml"
    preset.write_text("window: 0\n")
    with pytest.raises(OptionsError, match="--window must be >= 1"):
        build_options(str(preset), {})
    preset.write_text("- a list\n")
    with pytest.raises(PresetError, match="must be a mapping"):
        build_options(str(preset), {})


# ------------------------------------------------------------------ info, convert


def test_info_reports_the_environment(offline_hub: Path) -> None:
    result = invoke("info", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["packages"]["torch"]
    assert "sdpa" in report["attention_backends"] and "flashinfer" in report["attention_backends"]
    assert report["checkpoints"]["repository"].endswith("robbyant/lingbot-map")
    assert report["checkpoints"]["found"] == {"lingbot-map-long": None, "lingbot-map": None}
    assert str(offline_hub) in report["checkpoints"]["search_order"][0]

    human = invoke("info")
    assert human.exit_code == 0 and "Attention backends" in human.output


def test_convert_checks_its_paths(tmp_path: Path) -> None:
    source = tmp_path / "model.pt"
    assert_user_error(invoke("convert", str(source), str(tmp_path / "model.safetensors")), "checkpoint not found")
    source.write_bytes(b"\x80\x02}q\x00.")
    assert_user_error(invoke("convert", str(source), str(tmp_path / "model.bin")), "must end in .safetensors")
    existing = tmp_path / "done.safetensors"
    existing.write_bytes(b"")
    assert_user_error(invoke("convert", str(source), str(existing)), "already exists; pass --overwrite")


def test_default_output_names(tmp_path: Path) -> None:
    from stream_recon.app.sources.opening import source_name

    folder = write_image_folder(tmp_path / "kitchen", ["0.png"])
    assert source_name(str(folder)) == "kitchen"
    assert source_name(str(folder) + "/") == "kitchen"
    assert source_name("walk.mp4") == "walk"
    assert source_name("0") == "webcam0"
    assert source_name("rtsp://cam.local:554/live?x=1") == "cam.local_554_live"


# ------------------------------------------------------------------ end to end with a checkpoint file


# Small inputs keep the tiny model at a few ms per frame: 160x96 frames -> 56x42 model input.
FAST_FLAGS = ["--no-viewer", "--image-width", "56", "--scale-frames", "3", "--window", "4"]


@pytest.fixture
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No network, empty caches: what a fresh machine without the checkpoint looks like."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("STREAM_RECON_CHECKPOINTS", str(tmp_path / "checkpoints"))
    return tmp_path / "checkpoints"


def test_video_to_run_directory_through_the_cli(tmp_path: Path, tiny_checkpoint: Path) -> None:
    video = write_video(tmp_path / "clip.mp4", 6, fps=25)
    run_dir = tmp_path / "out"

    result = invoke(str(video), "--checkpoint", str(tiny_checkpoint), "-o", str(run_dir), *FAST_FLAGS)

    assert result.exit_code == 0, result.output
    assert "done: 6 frames" in result.output
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "complete" and record["summary"]["frames"] == 6
    assert record["summary"]["checkpoint_digest"] == hashlib.sha256(tiny_checkpoint.read_bytes()).hexdigest()
    assert record["settings"]["checkpoint"] == str(tiny_checkpoint)
    assert record["settings"]["compile"] is False and "compile_beside" not in record["summary"]  # a CPU run
    assert len(list((run_dir / "predictions").glob("*.npz"))) == 6
    helpers = record["summary"]["helpers"]  # a CPU run without a viewer: the reader, progress, writer and digest
    assert sorted(helpers) == ["checkpoint_digest", "progress", "reader", "writer"], helpers
    assert all(h["up"] for h in helpers.values()), helpers


def test_a_digest_that_fails_leaves_the_run_complete_and_says_why(tmp_path: Path, tiny_checkpoint: Path,
                                                                   monkeypatch) -> None:
    from stream_recon.app.run import loading

    def unreadable(path):
        raise OSError(f"[Errno 5] Input/output error: '{path}'")

    monkeypatch.setattr(loading, "checkpoint_digest", unreadable)
    run_dir = tmp_path / "out"
    result = invoke(str(write_video(tmp_path / "clip.mp4", 4, fps=25)), "--checkpoint", str(tiny_checkpoint),
                    "-o", str(run_dir), *FAST_FLAGS)
    assert result.exit_code == 0, result.output
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "complete" and record["summary"]["checkpoint_digest"] is None
    digest = record["summary"]["helpers"]["checkpoint_digest"]
    assert digest["up"] is False and digest["reason"].startswith("OSError: [Errno 5] Input/output error"), digest
    assert len(list((run_dir / "predictions").glob("*.npz"))) == 4
    assert result.output.count("the checkpoint's digest is off for the rest of the run: OSError") == 1, result.output


def test_a_gpu_memory_budget_is_planned_said_and_recorded(tmp_path: Path, tiny_checkpoint: Path) -> None:
    """--gpu-memory: the engine's plan before the first frame, printed, and in run.json."""
    video = write_video(tmp_path / "clip.mp4", 5, fps=25)
    run_dir = tmp_path / "out"

    result = invoke(str(video), "--checkpoint", str(tiny_checkpoint), "-o", str(run_dir), "--gpu-memory", "4GiB",
                    "--attention", "sdpa", *FAST_FLAGS)

    assert result.exit_code == 0, result.output
    assert "memory plan for 4.00 GiB" in result.output
    plan = json.loads((run_dir / "run.json").read_text())["summary"]["engine"]["memory_plan"]
    assert plan["budget"] == 4 * 2**30 and plan["window"] == 4 and not plan["changes_results"]
    assert plan["estimate"]["total"] <= plan["budget"]


def test_a_gpu_memory_budget_nothing_fits_is_refused_before_anything_is_written(tmp_path: Path,
                                                                               tiny_checkpoint: Path) -> None:
    video = write_video(tmp_path / "clip.mp4", 5, fps=25)
    result = invoke(str(video), "--checkpoint", str(tiny_checkpoint), "-o", str(tmp_path / "out"), "--gpu-memory",
                    "1MiB", *FAST_FLAGS)
    assert_user_error(result, "error:", "budget")
    assert not (tmp_path / "out").exists()


def test_an_fp8_cache_runs_on_the_cpu_and_a_backend_that_cannot_read_it_is_refused(tmp_path: Path,
                                                                                    tiny_checkpoint: Path) -> None:
    """The SDPA reference reads fp8 pages (dequantised); FlashInfer cannot (it has no per-token scales)."""
    video = write_video(tmp_path / "clip.mp4", 3, fps=25)
    result = invoke(str(video), "--checkpoint", str(tiny_checkpoint), "-o", str(tmp_path / "out"), "--kv-cache", "fp8",
                    "--attention", "sdpa", *FAST_FLAGS)
    assert result.exit_code == 0, result.output
    engine = json.loads((tmp_path / "out" / "run.json").read_text())["summary"]["engine"]
    assert engine["kv_cache"] == "fp8" and engine["attention"] == "sdpa"
    from stream_recon.cache import backends

    assert not backends.spec("flashinfer").reads_fp8


def test_default_output_folder_is_named_after_the_source(
    tmp_path: Path, tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = write_image_folder(tmp_path / "kitchen", [f"{index}.png" for index in range(4)], width=160, height=96)
    monkeypatch.chdir(tmp_path)

    result = invoke("run", str(folder), "--checkpoint", str(tiny_checkpoint), *FAST_FLAGS)

    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "outputs" / "kitchen" / "run.json").read_text())["status"] == "complete"


def test_no_source_runs_the_bundled_sample_and_a_rerun_replaces_it(
    tmp_path: Path, tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        result = invoke("--checkpoint", str(tiny_checkpoint), *FAST_FLAGS)

        assert result.exit_code == 0, result.output
        assert "bundled sample (14 frames" in result.output and "outputs/sample/" in result.output
    record = json.loads((tmp_path / "outputs" / "sample" / "run.json").read_text())
    assert record["status"] == "complete" and record["summary"]["frames"] == 14


def test_the_sample_never_replaces_a_run_in_a_folder_the_user_named(tmp_path: Path, tiny_checkpoint: Path) -> None:
    run_dir = tmp_path / "mine"
    (run_dir / "predictions").mkdir(parents=True)
    (run_dir / "run.json").write_text("{}")

    result = invoke("--checkpoint", str(tiny_checkpoint), "-o", str(run_dir), *FAST_FLAGS)

    assert_user_error(result, "already holds a run", "--overwrite")
    assert (run_dir / "run.json").read_text() == "{}"


def test_truncated_video_exits_non_zero_after_saving_what_decoded(tmp_path: Path, tiny_checkpoint: Path) -> None:
    video = truncate_file(write_video(tmp_path / "cut.avi", 30, fourcc="MJPG"), 0.5)
    run_dir = tmp_path / "out"

    result = invoke(str(video), "--checkpoint", str(tiny_checkpoint), "-o", str(run_dir), *FAST_FLAGS)

    assert_user_error(result, "failed", "truncated or damaged", code=EXIT_FAILED)
    saved = len(list((run_dir / "predictions").glob("*.npz")))
    assert saved > 5 and f"stopped decoding after {saved} of 30 frames" in result.output
    assert json.loads((run_dir / "run.json").read_text())["status"] == "failed"


def test_a_model_that_overflows_ends_the_run_as_failed_with_the_frame_named(tmp_path: Path) -> None:
    # NaN or infinity predictions must fail the run, not end it "complete" with exit 0. The weights here
    # pass the load checks (every value finite and below float16's maximum); the depth head's last bias
    # of 100 makes exp() overflow to infinity, as half precision can overflow on an unusual input.
    state = build_tiny_model().state_dict()
    state["depth_head.scratch.output_conv2.2.bias"][0] = 100.0
    torch.save(state, tmp_path / "overflow.pt")
    checkpoint = convert_to_safetensors(tmp_path / "overflow.pt", tmp_path / "overflow.safetensors",
                                        config=ModelConfig.tiny())
    video = write_video(tmp_path / "clip.mp4", 6)

    result = invoke(str(video), "--checkpoint", str(checkpoint), "-o", str(tmp_path / "out"), *FAST_FLAGS)

    assert_user_error(result, code=EXIT_FAILED)
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: frame 0: the model predicted NaN or infinity (depth); stopped there, keeping 0 frames before it; "
        "the model's weights or this input make it diverge: check the checkpoint and the frames"
    ], result.output
    assert json.loads((tmp_path / "out" / "run.json").read_text())["status"] == "failed"
    assert not list((tmp_path / "out" / "predictions").glob("*.npz"))


def test_one_frame_is_one_frame(tmp_path: Path, tiny_checkpoint: Path) -> None:
    video = write_video(tmp_path / "clip.mp4", 1)
    result = invoke(str(video), "--checkpoint", str(tiny_checkpoint), "-o", str(tmp_path / "out"), *FAST_FLAGS)
    assert result.exit_code == 0, result.output
    assert "done: 1 frame (1 keyframe) at" in result.output


@pytest.mark.slow  # a CLI process for over 10 s of progress
def test_progress_is_logged_when_stderr_is_a_file(tmp_path: Path, tiny_checkpoint: Path) -> None:
    # With stderr redirected (nohup, CI), progress must still be printed between the start and the end
    log = tmp_path / "run.log"
    video = write_video(tmp_path / "long.mp4", 3000, fps=30)
    run_dir = tmp_path / "out"
    command = [sys.executable, "-c", "from stream_recon.app.cli import main; main()", str(video),
               "--checkpoint", str(tiny_checkpoint), "-o", str(run_dir), *FAST_FLAGS]
    # one line a second instead of every 10 s, so that the test sees several in a few seconds
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "STREAM_RECON_PROGRESS_INTERVAL": "1"}
    with log.open("w") as stderr:
        child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=environment)
        try:
            deadline = time.monotonic() + 90
            while log.read_text().count("progress: ") < 4 and time.monotonic() < deadline and child.poll() is None:
                time.sleep(0.1)
            child.send_signal(signal.SIGINT)
            child.wait(timeout=60)
        finally:
            if child.poll() is None:
                child.kill()

    lines = [line for line in log.read_text().splitlines() if line.startswith("progress: ")]
    assert len(lines) >= 4, log.read_text()
    assert all(len(line) > 80 for line in lines)  # never cut at a terminal's width
    assert "━" not in log.read_text()  # no redrawn bar in a file
    last = lines[-1]
    assert re.match(r"progress: \d+/3000 frames \(\d+%\), ETA \d+:\d\d:\d\d, [\d.]+ FPS \(model [\d.]+\), \d+ keyframes, "
                    r"attention cache \d+ frames [\d.]+ (?:[KMG]i)?B, "
                    rf"elapsed 0:00:0\d: video {re.escape(str(video))}$", last), last
    elapsed = [int(line.split("elapsed 0:00:")[1][:2]) for line in lines]
    assert all(0 < later - earlier <= 2 for earlier, later in zip(elapsed, elapsed[1:], strict=False)), elapsed


def assert_says_where_to_put_the_checkpoint(output: str, folder: Path) -> None:
    """The file's URL for another machine and the folder to put it in, and not the download command, which
    cannot work here either."""
    assert "https://huggingface.co/robbyant/lingbot-map/resolve/main/lingbot-map-long.pt" in output
    assert f"put it in {folder}/" in output
    assert "stream-recon download" not in output


@pytest.fixture(params=["offline mode", "hub refusing connections"])
def no_hub(request: pytest.FixtureRequest, offline_hub: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """HF_HUB_OFFLINE=1, or a hub address on 127.0.0.1 where nothing listens (refused at once)."""
    if request.param == "hub refusing connections":
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    return request.param


def test_first_run_without_the_hub_says_where_to_put_the_checkpoint(tmp_path: Path, no_hub: str,
                                                                    offline_hub: Path) -> None:
    # Without the hub: at once, not after 25-30 s of retries, and not advice to run the download that failed
    video = write_video(tmp_path / "clip.mp4", 3)

    start = time.monotonic()
    result = invoke(str(video), "--no-viewer", "-o", str(tmp_path / "out"))

    assert time.monotonic() - start < 10
    expected = "offline mode is on" if no_hub == "offline mode" else "the Hugging Face hub at http://127.0.0.1:"
    assert_user_error(result, "lingbot-map-long", expected)
    assert_says_where_to_put_the_checkpoint(result.output, offline_hub)
    assert not (tmp_path / "out").exists()  # nothing is left to block the next attempt


def test_first_run_online_downloads_the_default_checkpoint_once(
    tmp_path: Path, tiny_checkpoint: Path, offline_hub: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stream_recon.app.run import loading

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    downloads = []

    def fake_download(name: str, on_start=None) -> Path:
        # stands in for the 4.6 GB Hugging Face download, which cannot run here
        downloads.append(name)
        on_start()
        offline_hub.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy(tiny_checkpoint, offline_hub / f"{name}.safetensors"))

    monkeypatch.setattr(loading, "download_checkpoint", fake_download)  # where a run reads it
    video = write_video(tmp_path / "clip.mp4", 4)

    first = invoke(str(video), "-o", str(tmp_path / "first"), *FAST_FLAGS)
    second = invoke(str(video), "-o", str(tmp_path / "second"), *FAST_FLAGS)

    assert first.exit_code == 0 and second.exit_code == 0, first.output + second.output
    assert "downloading it once" in first.output and "downloading" not in second.output
    assert downloads == ["lingbot-map-long"]


@pytest.mark.usefixtures("offline_hub")
def test_download_command_unknown_name() -> None:
    assert_user_error(invoke("download", "lingbot-map-xl"), "unknown checkpoint 'lingbot-map-xl'", "lingbot-map-long")


def test_download_command_without_the_hub_says_where_to_put_the_file(no_hub: str, offline_hub: Path) -> None:
    start = time.monotonic()
    result = invoke("download")

    assert time.monotonic() - start < 10
    expected = "offline mode is on (HF_HUB_OFFLINE)" if no_hub == "offline mode" else "cannot be reached"
    # nothing ran and nothing is left: exit 2, as a run that needs the checkpoint exits for the same cause
    assert_user_error(result, "cannot download 'lingbot-map-long'", expected)
    assert "downloading" not in result.output  # nothing is, offline or unreachable
    assert_says_where_to_put_the_checkpoint(result.output, offline_hub)


def test_corrupted_checkpoint_is_refused_before_the_run(tmp_path: Path, tiny_checkpoint: Path) -> None:
    # 64 KiB of random bytes over the data must be refused at the load, not make a "complete" run, all NaN
    from safetensors import safe_open

    damaged = Path(shutil.copy(tiny_checkpoint, tmp_path / "damaged.safetensors"))
    name = "camera_head.trunk.0.mlp.fc1.weight"
    with safe_open(damaged, framework="pt") as file:
        tensor_bytes = file.get_tensor(name).numpy().tobytes()
    data = bytearray(damaged.read_bytes())
    middle = data.find(tensor_bytes) + len(tensor_bytes) // 2
    data[middle:middle + (64 << 10)] = np.random.default_rng(0).bytes(64 << 10)
    damaged.write_bytes(bytes(data))
    video = write_video(tmp_path / "clip.mp4", 3)

    result = invoke(str(video), "--checkpoint", str(damaged), "-o", str(tmp_path / "out"), *FAST_FLAGS)

    assert_user_error(result, f"error: {damaged}: 1 of ", f"{name} (NaN)", f"Delete {damaged} and fetch it again")
    assert len([line for line in result.output.splitlines() if line.strip()]) == 1, result.output
    assert not (tmp_path / "out").exists()


def test_convert_refuses_a_checkpoint_of_another_architecture(tmp_path: Path, tiny_checkpoint: Path) -> None:
    # the tiny model's .pt is not the official architecture the converter expects
    source = tiny_checkpoint.with_suffix(".pt")
    result = invoke("convert", str(source), str(tmp_path / "out.safetensors"))
    assert_user_error(result, "error:", "the checkpoint does not match the model", "1056 missing",
                      "pass the checkpoint made for this model", "(--verbose shows the details)")
    assert "allow" not in result.output and len(result.output.splitlines()) == 1, result.output
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.slow  # CLI processes signalled mid-run: ~4 s each
@pytest.mark.parametrize(
    ("signum", "source_kind"),
    [(signal.SIGINT, "video"), (signal.SIGTERM, "video"), (signal.SIGINT, "live camera")],
)
def test_signal_through_the_cli_saves_completed_frames_and_exits_128_plus_the_signal(
    tmp_path: Path, tiny_checkpoint: Path, signum: int, source_kind: str
) -> None:
    run_dir = tmp_path / "out"
    with contextlib.ExitStack() as stack:
        if source_kind == "video":
            source = str(write_video(tmp_path / "long.mp4", 3000, fps=30))
        else:  # a camera never ends on its own: Ctrl-C is the only way out
            source = stack.enter_context(mjpeg_server(num_frames=10**6, interval_s=0.01))
        command = [sys.executable, "-c", "from stream_recon.app.cli import main; main()", source,
                   "--checkpoint", str(tiny_checkpoint), "-o", str(run_dir), *FAST_FLAGS]
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            wait_for_predictions(run_dir, at_least=5, child=child)
            child.send_signal(signum)
            output, _ = child.communicate(timeout=60)
        finally:
            if child.poll() is None:
                child.kill()

    # SIGTERM exits 143, not 130 like Ctrl-C: a supervisor that sent SIGTERM expects 143
    assert child.returncode == (EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_TERMINATED), output
    assert f"{signal.Signals(signum).name}: stopping after this frame" in output and "Traceback" not in output
    record = json.loads((run_dir / "run.json").read_text())
    saved = sorted((run_dir / "predictions").glob("*.npz"))
    assert record["status"] == "interrupted" and record["summary"]["frames"] == len(saved) >= 5
    for path in saved:  # every completed frame is whole
        with np.load(path) as frame:
            assert frame["depth"].shape == tuple(frame["image_size"])
    assert len((run_dir / "trajectory_tum.txt").read_text().splitlines()) == len(saved) + 1  # + header


def wait_for_predictions(run_dir: Path, at_least: int, child: subprocess.Popen, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise AssertionError(f"the run ended before it was interrupted:\n{child.stdout.read()}")
        predictions = run_dir / "predictions"
        if predictions.is_dir() and len(list(predictions.glob("*.npz"))) >= at_least:
            return
        time.sleep(0.05)
    raise AssertionError(f"fewer than {at_least} predictions after {timeout_s} s")


# ------------------------------------------------------------------ a new user's first hour, through the CLI


def cli_process(*args: str, cwd: Path | None = None, prefix: tuple[str, ...] = (), env: dict | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess:
    """`stream-recon ARGS` in a process of its own: what goes to the terminal, OpenCV's and FFmpeg's own
    lines included (they write to file descriptor 2, which CliRunner does not see)."""
    command = [*prefix, sys.executable, "-c", "from stream_recon.app.cli import main; main()", *args]
    # the library log levels an in-process CLI of an earlier test put in this process's environment
    inherited = {key: value for key, value in os.environ.items() if key not in QUIET_LIBRARY_LOGS}
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env={**inherited, "OMP_NUM_THREADS": "1", **(env or {})})


QUIET_LIBRARY_LOGS = ("OPENCV_LOG_LEVEL", "OPENCV_FFMPEG_LOGLEVEL")


def lines_of(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]


HEAVY_LIBRARIES = ("torch", "triton", "trimesh", "scipy", "viser", "cv2", "ray", "gtsam")
HELP_REQUESTS = [["-h"], ["run", "-h"], ["export", "-h"], ["view", "-h"], ["eval", "-h"], ["batch", "-h"],
                 ["convert", "-h"], ["download", "-h"], ["info", "-h"]]


def test_help_loads_none_of_the_heavy_libraries() -> None:
    # -h took 2.8-3.2 s because torch, trimesh and scipy loaded for every command
    script = textwrap.dedent(f"""
        import json, sys
        from stream_recon.app.cli import main
        loaded = {{}}
        for argv in {HELP_REQUESTS!r}:
            try:
                main(argv)
            except SystemExit as exit:
                assert exit.code == 0, (argv, exit.code)
            loaded[" ".join(argv)] = [name for name in {HEAVY_LIBRARIES!r} if name in sys.modules]
        print(json.dumps(loaded), file=sys.stderr)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stderr.strip().splitlines()[-1])
    assert loaded == {" ".join(argv): [] for argv in HELP_REQUESTS}



def test_a_bad_source_or_option_is_answered_before_torch_is_imported(tmp_path: Path) -> None:
    # a mistyped path was said only after the pipeline's 2-5 s import of torch
    not_a_video = tmp_path / "notes.mp4"
    not_a_video.write_text("shopping list\n")
    out = str(tmp_path / "out")
    cases = {
        ("run", "/no/such/file.mp4", "-o", out): "error: no such file or folder: /no/such/file.mp4",
        ("run", str(not_a_video), "-o", out): f"error: {not_a_video} is not a video file",
        ("run", "/no/such/file.mp4", "-o", out, "--gpu-memory", "banana"):
            "error: --gpu-memory: cannot read 'banana' as a memory size",
        ("run", "/no/such/file.mp4", "-o", out, "--attention", "bogus"):
            "error: --attention must be one of auto, flashinfer, sdpa, triton,",
    }
    script = textwrap.dedent(f"""
        import contextlib, io, json, sys
        from stream_recon.app.cli import main
        answers = []
        for argv in {[list(argv) for argv in cases]!r}:
            said = io.StringIO()
            with contextlib.redirect_stderr(said):
                try:
                    main(argv)
                except SystemExit as exit:
                    code = exit.code
            answers.append([said.getvalue(), code, sorted(m for m in ("torch", "trimesh") if m in sys.modules)])
        print(json.dumps(answers))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    answers = json.loads(result.stdout.strip().splitlines()[-1])
    for (said, code, loaded), expected in zip(answers, cases.values(), strict=True):
        assert said.startswith(expected) and said.count("\n") == 1, said
        assert (code, loaded) == (EXIT_BAD_INPUT, []), (expected, code, loaded)


def test_the_app_reaches_the_cache_only_through_the_models() -> None:
    # app -> models -> cache: what the app needs of the backend table is models.attention_backends
    app_dir = Path(__file__).resolve().parents[1] / "app"
    importing = [str(path.relative_to(app_dir)) for path in sorted(app_dir.rglob("*.py"))
                 if re.search(r"^\s*(from|import) stream_recon\.cache\b", path.read_text(), re.MULTILINE)]
    assert importing == []


def test_root_help_lists_every_export_format() -> None:
    result = invoke("-h")
    assert result.exit_code == 0
    words = result.output.replace("│", " ").split()  # the help's box wraps the line
    assert "PLY, GLB, COLMAP, TUM, nerfstudio or Gaussian splats" in " ".join(words)


def test_a_ctrl_c_a_library_swallows_is_raised_again_until_the_program_stops() -> None:
    # what a dependency's `try: import x / except BaseException: pass` does to a Ctrl-C landing in it
    script = textwrap.dedent("""
        import os, signal, time
        from stream_recon.app.stopping import PromptInterrupt
        with PromptInterrupt():
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
            except BaseException:
                pass
            started = time.monotonic()
            try:
                time.sleep(10)
            except KeyboardInterrupt:
                print(f"raised again after {time.monotonic() - started:.2f} s")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert float(re.search(r"raised again after ([\d.]+) s", result.stdout).group(1)) < 2.0


def test_a_ctrl_c_during_the_native_libraries_imports_is_raised_once_they_are_done() -> None:
    # a KeyboardInterrupt raised inside Triton's native set-up aborted the process (exit -6) instead of 130
    script = textwrap.dedent("""
        import os, signal, time
        from stream_recon.app.stopping import PromptInterrupt, interrupts_held
        with PromptInterrupt():
            try:
                with interrupts_held():
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(0.3)
                    print("held through the block")
            except KeyboardInterrupt:
                print("raised after it")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["held through the block", "raised after it"]


@pytest.mark.slow  # a calibration run, then one process per moment
def test_ctrl_c_from_the_start_to_the_first_frame_exits_130_at_once(tmp_path: Path, tiny_checkpoint: Path) -> None:
    # 4 of 4 times a Ctrl-C 1.5-2.2 s after the start was lost and the run went on to exit 0
    video = write_video(tmp_path / "long.mp4", 600, fps=30)  # never read to its end before the signal
    command = [sys.executable, "-c", "from stream_recon.app.cli import main; main()", str(video),
               "--checkpoint", str(tiny_checkpoint), *FAST_FLAGS]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    calibration = subprocess.Popen([*command, "-o", str(tmp_path / "calibration")], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, env=env)
    wait_for_predictions(tmp_path / "calibration", at_least=1, child=calibration)
    first_frame_s = time.monotonic() - started  # this machine's time from the start to the first frame
    calibration.kill()
    calibration.communicate()
    # A Ctrl-C inside the native libraries' imports is held until they are done (their set-up aborts the
    # process if interrupted), which on a busy machine can take most of the time to the first frame; the
    # other worker's load changes between the calibration and a moment (5.43 s seen against a 5.26 s
    # calibration), so the bound is half as long again. A lost Ctrl-C runs to exit 0, which the code catches.
    stop_limit_s = 1.5 * max(5.0, first_frame_s)
    # Python's own start-up (before any code of ours runs) takes the first ~0.1 s
    for moment in sorted({max(0.15, fraction * first_frame_s) for fraction in (0.1, 0.25, 0.4, 0.55, 0.7, 0.85)}):
        run_dir = tmp_path / f"at_{moment:.2f}"
        child = subprocess.Popen([*command, "-o", str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, env=env)
        time.sleep(moment)
        signalled = time.monotonic()
        child.send_signal(signal.SIGINT)
        output, _ = child.communicate(timeout=60)
        stopped_after = time.monotonic() - signalled
        assert child.returncode == EXIT_INTERRUPTED, f"at {moment:.2f} s: {child.returncode}\n{output}"
        assert "Traceback" not in output and "done:" not in output, output
        assert stopped_after < stop_limit_s, f"at {moment:.2f} s it took {stopped_after:.1f} s to stop"
        if run_dir.exists():  # the stream had begun: what was computed is kept and marked
            assert json.loads((run_dir / "run.json").read_text())["status"] == "interrupted"


def test_the_sample_never_replaces_a_run_of_the_users_own_sample_folder(
    tmp_path: Path, tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `stream-recon sample` (a folder of the user's), then `stream-recon`: the user's run was replaced
    monkeypatch.chdir(tmp_path)
    write_image_folder(tmp_path / "sample", ["0.png", "1.png"], width=160, height=96)
    mine = invoke("sample", "--checkpoint", str(tiny_checkpoint), *FAST_FLAGS)
    assert mine.exit_code == 0, mine.output

    result = invoke("--checkpoint", str(tiny_checkpoint), *FAST_FLAGS)

    assert_user_error(result, "outputs/sample already holds a run", "--overwrite")
    record = json.loads((tmp_path / "outputs" / "sample" / "run.json").read_text())
    assert record["summary"]["frames"] == 2 and record["settings"]["source_location"] == str(tmp_path / "sample")


def test_a_folder_named_like_a_webcam_index_is_that_folder(
    tmp_path: Path, tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `stream-recon 2024` with a folder 2024 of images: "could not open webcam 2024"
    monkeypatch.chdir(tmp_path)
    write_image_folder(tmp_path / "2024", ["a.png", "b.png", "c.png"], width=160, height=96)

    result = invoke("2024", "--checkpoint", str(tiny_checkpoint), *FAST_FLAGS)

    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "outputs" / "2024" / "run.json").read_text())
    assert record["settings"]["source_kind"] == "folder" and record["summary"]["frames"] == 3


@pytest.mark.parametrize("memory_check", ["--memory-check", "--no-memory-check"])
def test_frames_too_wide_for_one_patch_row_are_refused_naming_the_aspect_ratio(
    tmp_path: Path, tiny_checkpoint: Path, memory_check: str
) -> None:
    # 4000x100 images: a ZeroDivisionError traceback; with --no-memory-check a ValueError and a run dir of 0 frames
    folder = write_image_folder(tmp_path / "strips", ["0.png", "1.png", "2.png"], width=4000, height=100)

    result = invoke(str(folder), "--checkpoint", str(tiny_checkpoint), "--no-viewer", "--image-width", "224",
                    "-o", str(tmp_path / "out"), memory_check)

    assert_user_error(result, "4000x100, an aspect ratio of 40:1", "less than one 14-pixel patch row",
                      "at least 126 high")
    assert len(result.output.splitlines()) == 1, result.output
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_of_another_shape_is_advised_only_what_exists(tmp_path: Path, tiny_checkpoint: Path) -> None:
    # the error advised --allow-partial, which does not exist
    folder = write_image_folder(tmp_path / "frames", ["0.png", "1.png"], width=160, height=96)
    other_shape = tiny_checkpoint.with_suffix(".pt")  # read with the official configuration: shapes differ

    for verbose in ((), ("--verbose",)):
        result = invoke(str(folder), "--checkpoint", str(other_shape), "-o", str(tmp_path / "out"), *FAST_FLAGS,
                        *verbose)
        assert_user_error(result, "the checkpoint does not match the model", "pass the checkpoint made for this model")
        assert "allow" not in result.output, result.output
        assert not (tmp_path / "out").exists()
    assert len(result.output.splitlines()) > 3  # --verbose: the tensors by name


def test_paths_that_exist_are_named_for_what_they_are(tmp_path: Path) -> None:
    # "... does not exist" for paths that exist; `view --host` advised --no-viewer, which view lacks
    run_dir = tmp_path / "run"
    (run_dir / "predictions").mkdir(parents=True)
    (run_dir / "trajectory_tum.txt").write_text("# timestamp tx ty tz qx qy qz qw\n0 0 0 0 0 0 0 1\n")
    gt_folder = tmp_path / "tum_sequence"
    gt_folder.mkdir()
    (gt_folder / "groundtruth.txt").write_text("0 0 0 0 0 0 0 1\n")

    assert_user_error(invoke("eval", str(run_dir), "--gt", str(gt_folder)),
                      f"{gt_folder} is a folder, not a trajectory file", f"such as {gt_folder / 'groundtruth.txt'}")
    assert_user_error(invoke("view", str(run_dir / "trajectory_tum.txt")), "is a file, not a run directory")
    unreachable = invoke("view", str(run_dir), "--host", "203.0.113.7")  # TEST-NET-3: not this machine's
    assert_user_error(unreachable, "the viewer cannot serve on 203.0.113.7:8080", "--host 127.0.0.1")
    assert "--no-viewer" not in unreachable.output
    # view's --port is run's: the same range, the same message
    assert_user_error(invoke("view", str(run_dir), "--port", "70000"), "--port must be between 1 and 65535, got 70000")


class _FailingHttpHandler(BaseHTTPRequestHandler):
    """A camera server that fails every request at once."""

    def do_GET(self) -> None:
        self.send_response(500)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        """Keep test output clean."""


def test_a_stream_whose_server_fails_at_once_is_refused_with_the_real_reason(tmp_path: Path) -> None:
    # "sent no decodable frame within 10 s" after 3 s, for a server that had answered an error at once
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FailingHttpHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/camera.mjpg"
        started = time.monotonic()
        result = invoke(url, "--no-viewer", "-o", str(tmp_path / "out"))
        elapsed = time.monotonic() - started
    finally:
        server.shutdown()
        server.server_close()
    assert_user_error(result, f"could not open stream {url}", "the server answered 'HTTP/1.0 500 Internal Server Error'")
    assert "within" not in result.output and elapsed < 8, (elapsed, result.output)
    refused = invoke(f"rtsp://127.0.0.1:{free_port()}/cam", "--no-viewer", "-o", str(tmp_path / "out"))
    assert_user_error(refused, "refused the connection (no server listens there)")


def damaged_video(path: Path) -> Path:
    """An MPEG-4 video whose middle is overwritten with noise: FFmpeg complains about its headers."""
    write_video(path, 40, fourcc="mp4v")
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 4096] = np.random.default_rng(1).bytes(4096)
    path.write_bytes(bytes(data))
    return path


@pytest.mark.slow  # seven CLI processes
def test_bad_inputs_are_one_line_without_the_libraries_own_log(tmp_path: Path, tiny_checkpoint: Path) -> None:
    # bad checkpoints, YAML errors, a webcam, a URL: up to ~25 lines, OpenCV's and FFmpeg's before `error:`
    folder = write_image_folder(tmp_path / "frames", ["0.png", "1.png"], width=160, height=96)
    not_a_checkpoint = tmp_path / "notes.pt"
    not_a_checkpoint.write_text("not a checkpoint")
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("window: [1\nscale_frames: 3\n")
    out = ["-o", str(tmp_path / "out"), "--no-viewer"]
    cases = {
        "checkpoint": [str(folder), "--checkpoint", str(tiny_checkpoint.with_suffix(".pt")), *out],
        "text as a checkpoint": [str(folder), "--checkpoint", str(not_a_checkpoint), *out],
        "yaml": [str(folder), "--config", str(bad_yaml), *out],
        "webcam": ["7", *out],
        "url": [f"rtsp://127.0.0.1:{free_port()}/cam", *out],
    }
    results = {name: cli_process(*args) for name, args in cases.items()}
    for name, result in results.items():
        assert result.returncode == EXIT_BAD_INPUT, (name, result.stderr)
        assert len(lines_of(result)) == 1 and lines_of(result)[0].startswith("error: "), (name, lines_of(result))
    assert "line 2, column" in results["yaml"].stderr
    verbose = cli_process(*cases["url"], "--verbose")
    assert "Connection refused" in verbose.stderr and "[tcp @" in verbose.stderr  # FFmpeg's own line, on request

    damaged = cli_process(str(damaged_video(tmp_path / "damaged.avi")), "--checkpoint", str(tiny_checkpoint),
                          *FAST_FLAGS, "-o", str(tmp_path / "damaged_run"))
    assert not [line for line in lines_of(damaged) if re.match(r"\[\S+ @ 0x", line) or "[ WARN" in line], damaged.stderr


@pytest.fixture
def unprivileged(tmp_path: Path) -> Iterator[tuple[tuple[str, ...], Path]]:
    """(a command prefix that runs a process without the power to read or write any file, a folder that
    process can use). As root that is `setpriv` to the user nobody (root reads files of mode 000); as
    anyone else the process runs as is. The folder is outside pytest's tmp_path, which only its owner
    can enter."""
    prefix: tuple[str, ...] = ()
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: no way to make a file unreadable to the CLI")
        prefix = (setpriv, "--reuid=nobody", "--regid=nogroup", "--clear-groups")
        if subprocess.run([*prefix, sys.executable, "-c", "import stream_recon.app.cli"], capture_output=True,
                          timeout=60).returncode != 0:
            pytest.skip("setpriv cannot run this Python as nobody here")
    folder = Path(tempfile.mkdtemp(prefix="stream-recon-unprivileged-"))
    folder.chmod(0o777)
    try:
        yield prefix, folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def write_trajectory_pair(run_dir: Path, gt_file: Path, frames: int = 12) -> None:
    """A run directory's trajectory_tum.txt and a ground truth it matches up to a similarity and noise."""
    from stream_recon.app.outputs.trajectories import write_tum

    rng = np.random.default_rng(3)
    timestamps = np.arange(frames) * 0.1
    c2w = np.tile(np.eye(4), (frames, 1, 1))
    c2w[:, :3, 3] = np.column_stack([np.cos(timestamps), np.sin(timestamps), 0.2 * timestamps])
    (run_dir / "predictions").mkdir(parents=True)
    write_tum(run_dir / "trajectory_tum.txt", timestamps, c2w)
    c2w[:, :3, 3] = 2.0 * c2w[:, :3, 3] + rng.normal(scale=0.01, size=(frames, 3))
    write_tum(gt_file, timestamps, c2w)


@pytest.mark.slow
def test_eval_of_a_run_that_cannot_be_written_prints_the_metrics_first(unprivileged) -> None:
    # a run on a read-only mount: a 51-line traceback (EROFS on .eval.json.*.tmp), the metrics never shown
    prefix, folder = unprivileged
    run_dir, gt = folder / "run", folder / "groundtruth.txt"
    write_trajectory_pair(run_dir, gt)
    run_dir.chmod(0o555)  # the CLI cannot write in it (with setpriv: not root any more)

    result = cli_process("eval", str(run_dir), "--gt", str(gt), prefix=prefix, env={"HOME": str(folder)})

    assert result.returncode == EXIT_FAILED, result.stderr
    assert "ATE (m)" in result.stdout and "matched poses" in result.stdout  # the metrics, first
    assert result.stderr.strip().splitlines() == [
        f"error: could not write {run_dir / 'eval.json'}: Permission denied; -o FILE writes them elsewhere"
    ]
    elsewhere = cli_process("eval", str(run_dir), "--gt", str(gt), "-o", str(folder / "eval.json"), prefix=prefix,
                            env={"HOME": str(folder)})
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert json.loads((folder / "eval.json").read_text())["matched_poses"] == 12


@pytest.mark.slow
def test_unreadable_inputs_are_one_line_and_exit_2(unprivileged, tiny_checkpoint: Path) -> None:
    # an unreadable video, folder or --checkpoint: PermissionError tracebacks, exit 1
    prefix, folder = unprivileged
    video = write_video(folder / "clip.mp4", 3)
    frames = write_image_folder(folder / "frames", ["0.png", "1.png"], width=160, height=96)
    readable_frames = write_image_folder(folder / "readable", ["0.png", "1.png"], width=160, height=96)
    checkpoints = [Path(shutil.copy(tiny_checkpoint, folder / "tiny.safetensors")),
                   Path(shutil.copy(tiny_checkpoint.with_suffix(".pt"), folder / "tiny.pt"))]
    preset = folder / "mine.yaml"
    preset.write_text("window: 4\n")
    for path in (video, frames, *checkpoints, preset):
        path.chmod(0)
    out = ["-o", str(folder / "out"), "--no-viewer"]
    cases = {
        "video": ([str(video), *out], f"cannot read the file {video}: Permission denied"),
        "folder": ([str(frames), *out], f"cannot read the folder {frames}: Permission denied"),
        "safetensors": ([str(readable_frames), "--checkpoint", str(checkpoints[0]), *out],
                        f"cannot read the checkpoint {checkpoints[0]}: Permission denied"),
        "pt": ([str(readable_frames), "--checkpoint", str(checkpoints[1]), *FAST_FLAGS, *out],
               f"cannot read the checkpoint {checkpoints[1]}: Permission denied"),
        "preset": ([str(readable_frames), "--config", str(preset), *out],
                   f"cannot read the preset {preset}: Permission denied"),
    }
    for name, (args, message) in cases.items():
        result = cli_process(*args, prefix=prefix, env={"HOME": str(folder)})
        assert result.returncode == EXIT_BAD_INPUT, (name, result.stderr)
        assert lines_of(result) == [line for line in lines_of(result) if line.startswith("error: ")], (name, result.stderr)
        assert len(lines_of(result)) == 1 and message in result.stderr, (name, result.stderr)
        assert not (folder / "out").exists(), name


def test_eval_refuses_to_write_its_results_into_a_fifo(tmp_path: Path) -> None:
    run_dir, gt = tmp_path / "run", tmp_path / "groundtruth.txt"
    write_trajectory_pair(run_dir, gt)
    fifo = tmp_path / "results"
    os.mkfifo(fifo)

    result = invoke("eval", str(run_dir), "--gt", str(gt), "-o", str(fifo))

    assert_user_error(result, f"{fifo} is a FIFO (named pipe), not a regular file")
    assert stat.S_ISFIFO(fifo.lstat().st_mode) and not (run_dir / "eval.json").exists()


def test_a_refused_run_leaves_no_folder_it_created(tmp_path: Path, offline_hub: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # offline, `stream-recon` alone left an empty outputs/
    monkeypatch.chdir(tmp_path)
    result = invoke("--no-viewer")
    assert_user_error(result, "lingbot-map-long")
    assert not (tmp_path / "outputs").exists()


def test_a_run_never_mixes_its_files_into_a_folder_that_holds_others(tmp_path: Path, tiny_checkpoint: Path) -> None:
    # `run -o` into a non-empty folder that is not a run mixed its files in with the user's
    folder = write_image_folder(tmp_path / "frames", ["0.png", "1.png"], width=160, height=96)
    for overwrite in ((), ("--overwrite",)):
        result = invoke(str(folder), "--checkpoint", str(tiny_checkpoint), "-o", str(folder), *FAST_FLAGS, *overwrite)
        assert_user_error(result, f"output directory {folder} is not empty and holds no run (2 entries such as 0.png)",
                          "choose a new or empty --output")
    assert sorted(path.name for path in folder.iterdir()) == ["0.png", "1.png"]


def test_warnings_come_after_every_refusal_and_gpu_memory_on_the_cpu_is_said_to_do_nothing(
    tmp_path: Path, tiny_checkpoint: Path
) -> None:
    # --gpu-memory was silently ignored on the CPU; the slow-CPU warning came before option refusals
    folder = write_image_folder(tmp_path / "frames", ["0.png", "1.png", "2.png"], width=160, height=96)
    args = [str(folder), "--checkpoint", str(tiny_checkpoint), "--device", "cpu", "--gpu-memory", "8GiB", *FAST_FLAGS]
    done = invoke(*args, "-o", str(tmp_path / "run"))
    assert done.exit_code == 0, done.output
    assert ("warning: --gpu-memory 8GiB budgets a GPU's memory: on the CPU the run is planned as for a GPU of that "
            "size") in " ".join(done.output.split())

    refused = invoke(*args, "-o", str(tmp_path / "run"))  # a run is there already
    assert_user_error(refused, "already holds a run")
    assert refused.output.splitlines() == [line for line in refused.output.splitlines() if line.startswith("error:")]


def test_an_image_folders_timestamps_are_said_in_the_help() -> None:
    # an image folder gets 1 s timestamps unless --fps is given, and -h did not say so
    result = invoke("run", "-h")
    assert "without it, frames are 1 s apart" in " ".join(result.output.replace("│", " ").split())
