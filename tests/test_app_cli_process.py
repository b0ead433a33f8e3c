"""`stream-recon` as a user meets it: the installed command in a process of its own, on real files, real
folders, a real full disk and real signals; what reaches the terminal (or a log file) and what is left
on disk is checked, not what a function returns.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import FAULT_INSTANTS, wait_until
from media_helpers import free_port, mjpeg_server, write_image_folder, write_noise_video, write_video
from plyfile import PlyData

from stream_recon.app.commands._options import EXIT_BAD_INPUT, EXIT_TERMINATED
from stream_recon.models import GCTStream, ModelConfig
from stream_recon.models.checkpoint import CONFIG_METADATA_KEY

# Every test here starts stream-recon processes (2-5 s each to import torch on a busy 2-core machine): none is in
# the quick run
pytestmark = pytest.mark.slow

# the run flags that make the tiny model's runs take a moment (tests/test_app_cli.py uses the same)
FAST_FLAGS = ("--no-viewer", "--image-width", "56", "--scale-frames", "3", "--window", "4")
# what earlier tests may have left in this process's environment: the library log levels an in-process CLI
# sets, and Hugging Face cache folders that would override a test's own HF_HOME
NOT_INHERITED = ("OPENCV_LOG_LEVEL", "OPENCV_FFMPEG_LOGLEVEL", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")
# the console script pip installed beside this Python (a checkout without it: the same entry point by module)
STREAM_RECON = Path(sys.executable).with_name("stream-recon")


def command(*args: str) -> list[str]:
    entry = [str(STREAM_RECON)] if STREAM_RECON.exists() else [sys.executable, "-m", "stream_recon.app.cli"]
    return [*entry, *args]


def environment(**extra: str) -> dict[str, str]:
    inherited = {key: value for key, value in os.environ.items() if key not in NOT_INHERITED}
    return {**inherited, "OMP_NUM_THREADS": "1", **extra}


def stream_recon(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`stream-recon ARGS` run to its end; stdout and stderr as the terminal would get them."""
    return subprocess.run(command(*args), capture_output=True, text=True, timeout=timeout, env=environment())


def lines_of(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]


CAMERA_FRAMES = 20  # enough for the stream to open (FFmpeg reads a few to know it), with room to spare
BEYOND_THE_CAMERA = ("--scale-frames", str(2 * CAMERA_FRAMES))  # the first prediction waits for the scale frames


@pytest.fixture
def stalled_camera() -> Iterator[str]:
    """A live camera that sends CAMERA_FRAMES frames and then nothing: a run on it with BEYOND_THE_CAMERA
    never gets a prediction to keep, whenever it is stopped."""
    with mjpeg_server(num_frames=CAMERA_FRAMES + 1, stall_after=CAMERA_FRAMES) as url:
        yield url


# ------------------------------------------------------------------ signals


@pytest.mark.parametrize("named_output", [True, False], ids=["-o", "outputs/NAME"])
def test_sigterm_before_the_first_frame_leaves_nothing_and_exits_143(
    tmp_path: Path, tiny_checkpoint: Path, stalled_camera: str, named_output: bool
) -> None:
    # SIGTERM while the model loaded ended the process by the signal's default action: exit 143 as a shell
    # reports it, but the output folder the run had made was left behind, empty
    run_dir = tmp_path / "out"
    output = ("-o", str(run_dir)) if named_output else ()  # else outputs/<the camera's name>, in the current folder

    def made_its_folder() -> bool:
        return run_dir.exists() if named_output else any((tmp_path / "outputs").glob("*"))

    child = subprocess.Popen(command(stalled_camera, "--checkpoint", str(tiny_checkpoint), *FAST_FLAGS,
                                     *BEYOND_THE_CAMERA, *output),
                             cwd=tmp_path, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        wait_until(made_its_folder, 90, process=child, what="output folder")  # made before the model loads
        child.send_signal(signal.SIGTERM)
        printed, _ = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()

    assert child.returncode == EXIT_TERMINATED, printed
    assert "Traceback" not in printed
    assert not run_dir.exists() and not (tmp_path / "outputs").exists(), sorted(tmp_path.rglob("*"))
    # and it says so: a run stopped before its first frame printed nothing at all
    assert sum(line.startswith("interrupted before the first frame: nothing was written to ")
               for line in printed.splitlines()) == 1, printed


# ------------------------------------------------------------------ presets


def test_a_presets_on_and_off_are_read_as_written(tmp_path: Path, tiny_checkpoint: Path) -> None:
    # YAML reads on/off as booleans: `loop_closure: off` was refused as "must be text, got False"
    folder = write_image_folder(tmp_path / "frames", ["0.png", "1.png"], width=160, height=96)
    preset = tmp_path / "mine.yaml"
    preset.write_text("loop_closure: off\nwarm_up: on\ncompile: off\n")

    result = stream_recon(str(folder), "--config", str(preset), "--checkpoint", str(tiny_checkpoint), *FAST_FLAGS,
                          "-o", str(tmp_path / "run"))

    assert result.returncode == 0, result.stderr
    settings = json.loads((tmp_path / "run" / "run.json").read_text())["settings"]
    assert (settings["loop_closure"], settings["warm_up"], settings["compile"]) == ("off", "on", False)


# ------------------------------------------------------------------ what a run states about its files

# The tiny model never closes a loop, so this stands in for what loop closure hands the writer when it has
# accepted one: every chunk from 1 on moved, here shrunk by half towards the origin, so that many of their
# points fall into voxels of others (a correction that brings two passes over a place together does that).
CORRECTED_RUN = """
import numpy as np
from stream_recon.app.outputs import writers
from stream_recon.app.cli import main
from stream_recon.models.loops.corrections import ChunkCorrections
from stream_recon.models.stream.similarity import Sim3

shrunk = ChunkCorrections({0: Sim3.identity(), 1: Sim3(0.5, np.eye(3), np.zeros(3))})
close = writers.RunWriter.close
writers.RunWriter.close = lambda self, status, summary=None, corrections=None, **rest: close(
    self, status, summary, shrunk, **rest)
main()
"""


def test_run_json_counts_the_points_that_points_ply_holds_after_a_correction(tmp_path: Path,
                                                                            tiny_checkpoint: Path) -> None:
    # run.json said 16,412 points of a loop-corrected run whose points.ply held 14,061
    video = write_video(tmp_path / "clip.mp4", 14)
    run_dir = tmp_path / "run"
    chunks = ("--chunk-frames", "8", "--overlap", "2", "--conf-threshold", "1")  # two chunks; every pixel a point
    run = subprocess.run([sys.executable, "-c", CORRECTED_RUN, str(video), "--checkpoint", str(tiny_checkpoint),
                          *FAST_FLAGS, *chunks, "-o", str(run_dir)],
                         capture_output=True, text=True, timeout=120, env=environment())
    assert run.returncode == 0, run.stderr
    assert (run_dir / "trajectory_open_tum.txt").exists()  # the correction moved chunk 1

    stated = json.loads((run_dir / "run.json").read_text())["summary"]["points"]["count"]
    assert stated == len(PlyData.read(str(run_dir / "points.ply"))["vertex"]) > 0


# ------------------------------------------------------------------ the viewer's library


def test_the_viewers_library_prints_its_banner_only_with_verbose(tmp_path: Path, tiny_checkpoint: Path) -> None:
    # viser's box (HTTP, Websocket) and "(viser) Server stopped" came on stdout of every run with the viewer
    folder = write_image_folder(tmp_path / "frames", ["0.png", "1.png", "2.png"], width=160, height=96)
    viewer_flags = ("--checkpoint", str(tiny_checkpoint), "--image-width", "56", "--scale-frames", "3", "--window",
                    "4", "--no-keep-viewer")

    quiet = stream_recon(str(folder), *viewer_flags, "--port", str(free_port()), "-o", str(tmp_path / "quiet"))
    verbose = stream_recon(str(folder), *viewer_flags, "--port", str(free_port()), "-o", str(tmp_path / "verbose"),
                           "--verbose")

    assert quiet.returncode == 0 and verbose.returncode == 0, quiet.stderr + verbose.stderr
    assert "viser" not in quiet.stdout + quiet.stderr, quiet.stdout
    assert "Server stopped" in verbose.stdout, verbose.stdout  # the library's own lines, asked for


# ------------------------------------------------------------------ a full disk


SMALL_DISK_BYTES = 200 * 1024
# frames of noise at the model input's size: PNG cannot compress them, so three take more than the small disk
NOISE_WIDTH, NOISE_HEIGHT = 224, 168


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A folder on a real filesystem of SMALL_DISK_BYTES: a tmpfs (mounting one needs root)."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL_DISK_BYTES}", "tmpfs", str(mount_point)],
                             capture_output=True, text=True, timeout=30)
    if mounted.returncode != 0:
        # /dev/full stands in for a full file only, and a folder export is refused on a device anyway
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip() or 'mount failed'})")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True, timeout=30)


def test_an_export_that_fills_the_disk_is_one_line_that_says_so(tmp_path: Path, tiny_checkpoint: Path,
                                                                small_disk: Path) -> None:
    # "libpng error: Write Error" from the library, then "could not write .../000001.png" with no reason
    video = write_noise_video(tmp_path / "noise.mp4", 3, NOISE_WIDTH, NOISE_HEIGHT)
    run_dir = tmp_path / "run"
    run = stream_recon(str(video), "--checkpoint", str(tiny_checkpoint), "--no-viewer", "--image-width",
                       str(NOISE_WIDTH), "--scale-frames", "3", "--window", "4", "-o", str(run_dir))
    assert run.returncode == 0, run.stderr
    export = small_disk / "colmap"

    result = stream_recon("export", str(run_dir), "--format", "colmap", "-o", str(export))

    assert result.returncode == EXIT_BAD_INPUT, result.stderr
    assert lines_of(result) == [f"error: cannot write {export}: the disk is full (No space left on device); "
                                "nothing of the export is left there: free some space or choose another --output"]
    assert not any(small_disk.iterdir())


# ------------------------------------------------------------------ the libraries' own lines


@pytest.mark.slow  # starts a Ray instance: 10-20 s on a busy machine
def test_a_ray_batch_refused_for_want_of_gpus_is_one_line_without_rays_own_log(tmp_path: Path) -> None:
    # a Ray "WARNING ... Token authentication is enabled" line came before the error; and the refused batch
    # left summary.json [] and summary.csv behind
    pytest.importorskip("ray", reason="the ray extra is not installed")
    write_image_folder(tmp_path / "data" / "a", ["0.png", "1.png"], width=160, height=96)

    result = stream_recon("batch", str(tmp_path / "data"), "-o", str(tmp_path / "out"), "--ray", "auto",
                          "--device", "cpu", "--checkpoint", str(tmp_path / "none.safetensors"))

    if "the Ray cluster has 0 GPU(s)" not in result.stderr:
        pytest.skip(f"this machine's Ray cluster has a GPU: {result.stderr.strip()}")
    assert result.returncode == EXIT_BAD_INPUT
    assert lines_of(result) == ["error: the Ray cluster has 0 GPU(s) but each sequence asks for 1; add GPU nodes, "
                                "or pass --gpus-per-task 0 to run on CPUs"]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # two batches, each loading the model: 30 s or more on a busy machine
def test_a_failed_sequence_is_one_sentence_and_a_few_lines_of_the_batch_summary(tmp_path: Path,
                                                                              tiny_checkpoint: Path) -> None:
    # the summary table wrapped one error over twenty lines of an 80-column terminal; in a log the heading of
    # each sequence was a rule as wide as the console
    (tmp_path / "data" / "videos").mkdir(parents=True)
    (tmp_path / "data" / "videos" / "broken.mp4").write_text("not a video at all")
    batch = ("batch", str(tmp_path / "data"), "--checkpoint", str(tiny_checkpoint), "--image-width", "56")
    on_a_terminal = subprocess.run(command(*batch, "-o", str(tmp_path / "narrow")), capture_output=True, text=True,
                                   timeout=120, env=environment(COLUMNS="80"))
    settings = {key: value for key, value in environment().items() if key != "COLUMNS"}
    in_a_log = subprocess.run(command(*batch, "-o", str(tmp_path / "log")), capture_output=True, text=True,
                              timeout=120, env=settings)

    for result, table_rows in ((on_a_terminal, 5), (in_a_log, 1)):
        assert result.returncode == 1, result.stderr
        lines = result.stderr.splitlines()
        error = json.loads(next(tmp_path.glob("*/summary.json")).read_text())[0]["error"]
        assert "SourceError" not in result.stderr and lines.count(f"failed videos_broken: {error}") == 1, lines
        body = lines[lines.index(next(line for line in lines if line.startswith("┡"))) + 1:
                     lines.index(next(line for line in lines if line.startswith("└")))]
        assert len(body) <= table_rows, lines
        assert all(len(line) < 300 for line in lines), lines


# ------------------------------------------------------------------ checkpoints


def test_convert_names_the_one_tensor_of_the_wrong_shape_and_both_shapes(tmp_path: Path) -> None:
    # "1 with the wrong shape ... (--verbose shows the details)": which tensor, and how, only with --verbose
    with torch.device("meta"):  # the official architecture's names and shapes, without its 4.6 GB of values
        state_dict = GCTStream(ModelConfig()).state_dict()
    name = "aggregator.patch_embed.mask_token"
    state_dict[name] = torch.empty(2, *state_dict[name].shape[1:], device="meta")
    torch.save(state_dict, tmp_path / "one_wrong.pt")

    result = stream_recon("convert", str(tmp_path / "one_wrong.pt"), str(tmp_path / "out.safetensors"))

    assert result.returncode == EXIT_BAD_INPUT, result.stderr
    assert len(lines_of(result)) == 1, result.stderr
    assert f"1 with the wrong shape ({name}: checkpoint [2, 1024], model [1, 1024])" in result.stderr
    assert not (tmp_path / "out.safetensors").exists()


def test_what_a_conversion_killed_part_way_leaves_is_removed_by_the_next_one_there(tmp_path: Path,
                                                                                   tiny_checkpoint: Path) -> None:
    # after a SIGKILL mid-conversion a hidden temporary file of the checkpoint's size stayed for good
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    # what is not recognisably a conversion's remains stays: a user's hidden file, a running conversion's folder
    (folder / ".tmp1234").write_text("a user's")
    running = folder / f".stream-recon-convert.{os.getpid()}"
    running.mkdir()

    killed = subprocess.run(command("convert", str(tiny_checkpoint), str(folder / "first.safetensors")),
                            env=fault_environment("stream_recon.models.checkpoint:save_file:kill:1"),
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert len(list(folder.glob(".stream-recon-convert.*"))) == 2  # what the killed one left beside the others

    done = stream_recon("convert", str(tiny_checkpoint), str(folder / "second.safetensors"))

    assert done.returncode == 0, done.stderr
    assert sorted(entry.name for entry in folder.iterdir()) == sorted([".tmp1234", running.name, "second.safetensors"])


# A checkpoint of the official width cut to 4 + 4 blocks: 1.6 GB, whose write takes seconds on a busy
# 2-core machine, as the official 4.6 GB one's took 13 s
WIDE_CONFIG = ModelConfig(dino_depth=4, depth=4, output_layers=(0, 1, 2, 3))


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """WIDE_CONFIG's checkpoint, zeros, carrying its config (so convert reads it with that config). Its data
    is one hole of a sparse file: made in an instant, where writing 1.6 GB of zeros took longer than the test."""
    with torch.device("meta"):
        shapes = {name: list(tensor.shape) for name, tensor in GCTStream(WIDE_CONFIG).state_dict().items()}
    header: dict = {"__metadata__": {CONFIG_METADATA_KEY: WIDE_CONFIG.to_json()}}
    offset = 0
    for name, shape in shapes.items():  # float32 throughout (the model's state dict is)
        size = 4 * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format aligns the data to 8 bytes
    path = tmp_path_factory.mktemp("wide") / "wide.safetensors"
    with open(path, "wb") as file:
        file.write(len(encoded).to_bytes(8, "little") + encoded)
        file.truncate(file.tell() + offset)
    return path


def writers_temporary_file(folder: Path) -> Path | None:
    """The file safetensors writes the checkpoint into, inside convert's hidden folder, once it has begun."""
    return next((entry for entry in folder.glob(".stream-recon-convert.*/.tmp*")), None)


@pytest.mark.slow  # a 1.6 GB conversion's start in a process of its own: 10 s or more on a busy machine
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_conversion_stopped_while_it_writes_ends_at_once_and_leaves_nothing(tmp_path: Path, wide_checkpoint: Path,
                                                                              stop: signal.Signals) -> None:
    # safetensors writes in native code, where no signal handler runs: a conversion stopped while it wrote
    # ended only with the write, 13 s for the official checkpoint (README: a stop takes 10 s at most)
    child = subprocess.Popen(command("convert", str(wide_checkpoint), str(tmp_path / "out.safetensors")),
                             env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: writers_temporary_file(tmp_path) is not None, 90, process=child, what="the write")
        # held open, the file tells how much had been written when the process ended, after it is removed
        written = os.open(writers_temporary_file(tmp_path), os.O_RDONLY)
        child.send_signal(stop)
        stopped_at = time.monotonic()
        printed, _ = child.communicate(timeout=60)
        took_s = time.monotonic() - stopped_at
    finally:
        if child.poll() is None:
            child.kill()

    try:
        allocated, size = os.fstat(written).st_blocks * 512, os.fstat(written).st_size
    finally:
        os.close(written)
    assert child.returncode == 128 + stop, printed
    assert "Traceback" not in printed
    assert allocated < size, "the conversion ended only once its write had"  # (the file is sparse until written)
    assert took_s < 10
    assert list(tmp_path.iterdir()) == []  # neither the checkpoint nor the hidden folder it was written in


# ------------------------------------------------------------------ options


def test_a_bad_chunk_frames_is_said_of_chunk_frames(tmp_path: Path) -> None:
    # `--chunk-frames -5` was reported as "--scale-frames (8) must be less than --chunk-frames (-5)"
    folder = write_image_folder(tmp_path / "frames", ["0.png", "1.png"], width=160, height=96)
    # and "must be >= 2 (more than --scale-frames, 2)" was said of -5, then 2 was refused as not more than 2: the
    # bound said is the one held to
    for typed, said in ((["--chunk-frames", "-5"], "error: --chunk-frames must be >= 9 (more than --scale-frames, 8), "
                                                    "got -5"),
                        (["--chunk-frames", "5"], "error: --chunk-frames (5) must be more than --scale-frames (8)"),
                        (["--chunk-frames", "-5", "--scale-frames", "2"],
                         "error: --chunk-frames must be >= 3 (more than --scale-frames, 2), got -5"),
                        (["--chunk-frames", "2", "--overlap", "1", "--scale-frames", "2"],
                         "error: --scale-frames (2) must be less than --chunk-frames (2)")):
        result = stream_recon(str(folder), *typed, "--no-viewer", "-o", str(tmp_path / "run"))
        assert result.returncode == EXIT_BAD_INPUT, result.stderr
        assert len(lines_of(result)) == 1 and lines_of(result)[0].startswith(said), result.stderr
    assert not (tmp_path / "run").exists()


def test_an_output_that_is_a_dangling_link_is_said_to_be_one(tmp_path: Path) -> None:
    # `-o LINK` to a folder that does not exist: "cannot write to the output directory LINK: File exists"
    folder = write_image_folder(tmp_path / "frames", ["0.png", "1.png"], width=160, height=96)
    link = tmp_path / "latest"
    link.symlink_to(tmp_path / "runs" / "today")

    for output, named in ((link, f"{link}"), (link / "run", f"{link / 'run'}: {link}")):
        result = stream_recon(str(folder), "--no-viewer", "-o", str(output))
        assert result.returncode == EXIT_BAD_INPUT, result.stderr
        assert lines_of(result) == [f"error: output path {named} is a symbolic link to {tmp_path}/runs/today, which "
                                    "does not exist; create the folder it points to, or choose another --output"]
    assert link.is_symlink() and not (tmp_path / "runs").exists()


# ------------------------------------------------------------------ warnings before a run


# the tiny model's confidence stays under the default threshold: a run that keeps every pixel has points, and no
# warning of an empty points.ply among the ones a test expects
EVERY_PIXEL = ("--conf-threshold", "1")


def warning_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in lines_of(result) if line.startswith("warning: ")]


def test_frames_too_small_to_reconstruct_are_warned_of(tmp_path: Path, tiny_checkpoint: Path) -> None:
    # a folder of 1x1 pictures was blown up to the model's input size without a word
    folder = write_image_folder(tmp_path / "dots", ["0.png", "1.png", "2.png"], width=1, height=1)

    result = stream_recon(str(folder), "--checkpoint", str(tiny_checkpoint), *FAST_FLAGS, *EVERY_PIXEL,
                          "-o", str(tmp_path / "run"))

    assert result.returncode == 0, result.stderr
    assert warning_lines(result) == [
        "warning: the source's frames are 1x1: at --image-width 56 each 14-pixel patch the model reads is 0.25 of "
        "their pixels across, too little detail to reconstruct anything; use frames at least 4 pixels wide, or a "
        "smaller --image-width"]


def test_loop_closure_on_for_a_stream_too_short_for_a_third_chunk_is_warned_of(tmp_path: Path,
                                                                              tiny_checkpoint: Path) -> None:
    # `--loop-closure on` on a short stream ran loop detection silently, with nothing it could ever close
    pytest.importorskip("gtsam", reason="--loop-closure on needs gtsam")
    folder = write_image_folder(tmp_path / "frames", ["0.png", "1.png", "2.png"], width=160, height=96)

    result = stream_recon(str(folder), "--checkpoint", str(tiny_checkpoint), *FAST_FLAGS, "--loop-closure", "on",
                          "--chunk-frames", "8", "--overlap", "2", *EVERY_PIXEL, "-o", str(tmp_path / "run"))

    assert result.returncode == 0, result.stderr
    assert warning_lines(result) == [
        "warning: --loop-closure on: the stream's 3 frames never reach a third chunk (frame 12 at --chunk-frames 8), "
        "and a loop joins chunks two or more apart, so loop closure cannot correct this stream; --loop-closure off "
        "skips it"]


def test_options_that_serve_a_gpu_say_once_on_the_cpu_that_they_do_nothing_there(tmp_path: Path,
                                                                                   tiny_checkpoint: Path) -> None:
    # --gpu-memory: "does nothing on the CPU", then a memory plan for 8 GiB (it plans the run there); --compile
    # on: not a word; --warm-up on: "the streaming step is recorded", which nothing is on the CPU
    folder = write_image_folder(tmp_path / "frames", ["0.png", "1.png", "2.png", "3.png"], width=160, height=96)

    result = stream_recon(str(folder), "--checkpoint", str(tiny_checkpoint), *FAST_FLAGS, "--device", "cpu",
                          "--gpu-memory", "8GiB", "--compile", "on", "--warm-up", "on", *EVERY_PIXEL,
                          "-o", str(tmp_path / "run"))

    assert result.returncode == 0, result.stderr
    printed = lines_of(result)
    assert warning_lines(result) == [
        "warning: --gpu-memory 8GiB budgets a GPU's memory: on the CPU the run is planned as for a GPU of that size "
        "(the memory plan below), and this machine's memory is checked besides (--no-memory-check turns that check "
        "off)",
        "warning: --compile on compiles the GPU's streaming step and does nothing on the CPU: the run is not compiled"]
    assert len([line for line in printed if line.startswith("memory plan for 8.00 GiB")]) == 1, printed
    assert "warming up for 56x28 frames: the streaming step runs once before the stream starts" in printed, printed


def test_a_flow_threshold_without_flow_keyframes_is_warned_of(tmp_path: Path, tiny_checkpoint: Path) -> None:
    # `--flow-threshold 5` beside `--keyframes all` was ignored without a word
    folder = write_image_folder(tmp_path / "frames", ["0.png", "1.png", "2.png"], width=160, height=96)

    result = stream_recon(str(folder), "--checkpoint", str(tiny_checkpoint), *FAST_FLAGS, "--flow-threshold", "5",
                          *EVERY_PIXEL, "-o", str(tmp_path / "run"))

    assert result.returncode == 0, result.stderr
    assert warning_lines(result) == ["warning: --flow-threshold 5 sets the flow keyframe policy's threshold and does "
                                   "nothing with --keyframes all: pass --keyframes flow to use it"]


def test_a_folder_of_videos_given_to_run_points_to_batch(tmp_path: Path) -> None:
    # "contains no images" and nothing on what to do with a folder of videos
    (tmp_path / "videos").mkdir()
    for name in ("a.mp4", "b.mp4"):
        write_video(tmp_path / "videos" / name, 2)

    result = stream_recon(str(tmp_path / "videos"), "--no-viewer", "-o", str(tmp_path / "run"))

    assert result.returncode == EXIT_BAD_INPUT, result.stderr
    assert lines_of(result)[0].endswith(f"it holds 2 videos (a.mp4...): pass one of them, or reconstruct each with "
                                        f"`stream-recon batch {tmp_path / 'videos'} --output DIR`"), result.stderr


# ------------------------------------------------------------------ info


def test_info_says_whether_loop_closure_runs_here(tmp_path: Path) -> None:
    # `info` said nothing of gtsam, without which loop closure is off
    pytest.importorskip("gtsam", reason="this checks the report of an installation that has it")
    broken = tmp_path / "broken" / "gtsam"  # a gtsam whose native library is gone, found before the real one
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise ImportError("libgtsam.so.4: cannot open shared object file")\n')

    shown = stream_recon("info")
    report = json.loads(stream_recon("info", "--json").stdout)
    without = subprocess.run(command("info"), capture_output=True, text=True, timeout=120,
                             env=environment(PYTHONPATH=str(broken.parent)))

    assert shown.returncode == 0 and without.returncode == 0, shown.stderr + without.stderr
    assert ("Loop closure: available (gtsam imports): `--loop-closure auto` closes loops in streams that "
            "reach a third chunk") in " ".join(shown.stdout.split())
    assert report["loop_closure"] == {"available": True, "problem": None}
    assert report["packages"]["gtsam"] is not None
    assert ("Loop closure: not available (gtsam does not import (ImportError: libgtsam.so.4: cannot open shared "
            "object file)), runs go on without it") in " ".join(without.stdout.split())
    assert without.stderr == ""


def test_info_says_when_the_checkpoint_folder_named_by_the_environment_does_not_exist(tmp_path: Path) -> None:
    # STREAM_RECON_CHECKPOINTS naming a folder that is not there (a typo) was listed as if it were
    # and in a pipe or a file each line was wrapped at 80 columns, the folder's long name split over two
    missing = tmp_path / "a-folder-whose-name-is-long-enough-to-be-cut-at-80-columns" / "chekpoints"
    settings = {key: value for key, value in environment(STREAM_RECON_CHECKPOINTS=str(missing)).items()
                if key != "COLUMNS"}
    result = subprocess.run(command("info"), capture_output=True, text=True, timeout=120, env=settings)
    assert result.returncode == 0, result.stderr
    lines = [line.strip() for line in result.stdout.splitlines()]
    assert f"{missing} ($STREAM_RECON_CHECKPOINTS, which does not exist)" in lines
    # a table's row stays one line too
    rows = [line for line in lines if line.startswith("│ triton")]
    assert len(rows) == 1 and "on a CUDA device (got float32 on cpu)" in rows[0], lines


# ------------------------------------------------------------------ units


def test_the_checkpoints_size_is_said_in_one_unit_and_no_download_announced_that_never_starts(tmp_path: Path) -> None:
    # "downloading it once (about 4.3 GiB)", then "(about 4.6 GB)" on the next line, for the same file; and that
    # "downloading" line came before the error that said the hub could not be reached
    folder = write_image_folder(tmp_path / "frames", ["0.png", "1.png"], width=160, height=96)
    hub_refusing = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}",
                    "HF_HOME": str(tmp_path / "hf"), "STREAM_RECON_CHECKPOINTS": str(tmp_path / "checkpoints")}
    for args in ([str(folder), "--no-viewer", "-o", str(tmp_path / "run")], ["download"]):
        result = subprocess.run(command(*args), capture_output=True, text=True, timeout=120,
                                env=environment(**hub_refusing))
        printed = result.stdout + result.stderr
        assert result.returncode != 0 and "cannot be reached" in printed and "about 4.3 GiB" in printed, printed
        assert not re.search(r"\d GB\b", printed), printed
        assert "downloading" not in printed


# ------------------------------------------------------------------ folder names that are not UTF-8


def test_a_folder_whose_name_is_not_utf8_is_printed_as_its_bytes_and_run_json_stays_strict_utf8(
        tmp_path: Path, tiny_checkpoint: Path) -> None:
    # the byte 0xff in a folder's name was printed "\\udcff", and run.json held a lone surrogate ("\\udcff"),
    # which strict JSON readers refuse
    frames = tmp_path / os.fsdecode(b"fr\xffames")  # OpenCV crashes writing there: the folder is renamed to it
    write_image_folder(tmp_path / "frames", [f"{index}.png" for index in range(6)]).rename(frames)
    run_dir = tmp_path / os.fsdecode(b"ru\xffn")
    result = stream_recon(str(frames), "--checkpoint", str(tiny_checkpoint), *FAST_FLAGS, "-o", str(run_dir))

    assert result.returncode == 0, result.stderr
    assert lines_of(result)[-1].endswith(f"-> {tmp_path}/ru\\xffn") and "udc" not in result.stderr, result.stderr
    text = (run_dir / "run.json").read_bytes().decode("utf-8")  # strict: no surrogate, escaped or not
    assert "\\udc" not in text
    assert json.loads(text)["settings"]["source_location"] == f"{tmp_path}/fr\\xffames"  # as it reads
    # and exactly, for what reads the source again: an export at the source's own resolution
    exported = stream_recon("export", str(run_dir), "-f", "colmap", "-o", str(tmp_path / "colmap"), "--full-resolution")
    assert exported.returncode == 0, exported.stderr
    assert len(list((tmp_path / "colmap" / "images").iterdir())) == 6


# ------------------------------------------------------------------ a log file


def test_a_log_file_gets_one_line_per_record(tmp_path: Path, tiny_checkpoint: Path) -> None:
    # with stderr redirected, each log record was wrapped at 80 columns and padded with spaces
    video = write_video(tmp_path / "clip.mp4", 12)
    log = tmp_path / "run.log"
    with log.open("w") as stderr:
        run = subprocess.run(command(str(video), "--checkpoint", str(tiny_checkpoint), *FAST_FLAGS, "--chunk-frames",
                                     "6", "--overlap", "2", "-o", str(tmp_path / "run"), "--verbose"),
                             stdout=subprocess.DEVNULL, stderr=stderr, timeout=120, env=environment())

    lines = log.read_text().splitlines()
    assert run.returncode == 0, lines
    rollovers = [line for line in lines if line.startswith("INFO     chunk rollover: ")]
    assert len(rollovers) == 2, lines  # chunks start at frames 4 and 8
    assert all(re.fullmatch(r".* chunk \d starts at frame \d and re-predicts 2 frames", line) for line in rollovers)
    assert [line for line in lines if line != line.strip() or not line] == []  # no padding, no blank lines


# ------------------------------------------------------------------ the docs that say how to run the tests


def test_readme_and_scripts_test_spell_the_quick_run_alike() -> None:
    # README once said `-m "not slow"` and scripts/test `-m "not golden and not slow"`
    repository = Path(__file__).resolve().parent.parent
    spellings = [set(re.findall(r'scripts/test (--quick|-m "[^"]+")', (repository / name).read_text()))
                 for name in ("README.md", "scripts/test")]
    assert spellings == [{"--quick"}, {"--quick"}]


# ------------------------------------------------------------------ a finished run, read back


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> Path:
    """A complete run of 8 frames of the tiny model, with its images: read, never changed, by the tests
    that use it (copy it first to change it)."""
    folder = tmp_path_factory.mktemp("finished")
    video = write_video(folder / "clip.mp4", 8)
    result = stream_recon(str(video), "--checkpoint", str(tiny_checkpoint), *FAST_FLAGS, "-o", str(folder / "run"))
    assert result.returncode == 0, result.stderr
    return folder / "run"


def copy_of(run_dir: Path, where: Path) -> Path:
    shutil.copytree(run_dir, where)
    return where


def test_a_prediction_that_is_not_an_npz_is_said_in_our_words_never_numpys(tmp_path: Path,
                                                                             finished_run: Path) -> None:
    # a text file in place of 000003.npz: numpy's "contains pickled (object) data ... load it unsafely using
    # allow_pickle", advice to run whatever a planted file holds
    run_dir = copy_of(finished_run, tmp_path / "run")
    (run_dir / "predictions" / "000003.npz").write_text("not a prediction\n")
    trajectory = tmp_path / "gt.txt"
    trajectory.write_text((run_dir / "trajectory_tum.txt").read_text())
    (run_dir / "trajectory_tum.txt").unlink()  # as a run killed before its end: the poses come from the npz files

    exported = stream_recon("export", str(run_dir), "-f", "ply", "-o", str(tmp_path / "points.ply"))
    evaluated = stream_recon("eval", str(run_dir), "--gt", str(trajectory), "-o", str(tmp_path / "eval.json"))

    for result in (exported, evaluated):
        printed = result.stdout + result.stderr
        assert "pickle" not in printed and "unsafe" not in printed, printed
        assert "000003.npz is not an npz file (it does not start as a zip archive does)" in printed, printed
    assert exported.returncode == 0 and (tmp_path / "points.ply").exists(), exported.stderr


def test_a_voxel_too_fine_for_the_scene_is_raised_with_a_warning_never_an_empty_cloud(tmp_path: Path,
                                                                                    finished_run: Path) -> None:
    # `export --voxel-size 1e-7` wrote an empty cloud and blamed --conf-threshold (every point fell outside the
    # voxel grid)
    result = stream_recon("export", str(finished_run), "-f", "ply", "-o", str(tmp_path / "points.ply"),
                          "--voxel-size", "1e-7", "--conf-threshold", "1")

    assert result.returncode == 0, result.stderr
    warnings = [line for line in lines_of(result) if "--voxel-size 1e-07 is too fine for this scene" in line]
    assert len(warnings) == 1, result.stderr
    points = PlyData.read(str(tmp_path / "points.ply"))["vertex"].count
    assert points > 0 and "no pixel has depth confidence" not in result.stderr


def test_a_cap_of_fewer_points_than_the_grid_can_merge_keeps_the_earliest_ones(tmp_path: Path,
                                                                             finished_run: Path) -> None:
    # `export --max-points 1` doubled the voxel to infinity (points on both sides of the origin never share a
    # voxel) and ended in an OverflowError's traceback
    for cap in (1, 3):
        result = stream_recon("export", str(finished_run), "-f", "ply", "-o", str(tmp_path / f"{cap}.ply"),
                              "--max-points", str(cap), "--conf-threshold", "1")

        assert result.returncode == 0, result.stderr
        assert PlyData.read(str(tmp_path / f"{cap}.ply"))["vertex"].count == cap
        assert f"{cap} point{'s' if cap > 1 else ''}," in result.stderr + result.stdout


# ------------------------------------------------------------------ an export replaced


def tree_of(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (hidden ones too) by its relative path, with its bytes."""
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def fault_environment(fault: str) -> dict[str, str]:
    """The fault harness of tests/test_app_faults.py (tests/faults/sitecustomize.py) in a CLI process."""
    return environment(PYTHONPATH=str(Path(__file__).parent / "faults"), STREAM_RECON_TEST_FAULT=fault)


@pytest.mark.parametrize("fmt", ["colmap", "nerfstudio"])
def test_an_export_stopped_while_it_replaces_another_keeps_the_earlier_one(tmp_path: Path, finished_run: Path,
                                                                          fmt: str) -> None:
    # Ctrl-C during `export --overwrite` left an empty folder, or part of the new export, where a complete
    # one had been
    export = tmp_path / fmt
    # every pixel's point (the tiny model's confidence is low); the exports that replace it have none
    first = stream_recon("export", str(finished_run), "-f", fmt, "-o", str(export), "--conf-threshold", "1")
    assert first.returncode == 0, first.stderr
    earlier = tree_of(export)
    written_before = time.time()

    # the third image's write never returns: the export is stopped with two new images written
    child = subprocess.Popen(command("export", str(finished_run), "-f", fmt, "-o", str(export), "--overwrite"),
                             env=fault_environment("stream_recon.app.outputs.export_images:write_png:block:3"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: len([path for path in export.rglob("*.png") if path.stat().st_mtime > written_before])
                   >= 2, 90, process=child, what="two new images")
        child.send_signal(signal.SIGINT)
        printed, _ = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()

    assert child.returncode == 130, printed
    assert "Traceback" not in printed
    assert tree_of(export) == earlier

    replaced = stream_recon("export", str(finished_run), "-f", fmt, "-o", str(export), "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert sorted(entry.name for entry in export.iterdir()) == sorted(earlier_names(earlier))
    assert tree_of(export) != earlier  # the new export, without points


def test_an_export_stopped_while_it_swaps_in_keeps_the_new_one_complete(tmp_path: Path, finished_run: Path) -> None:
    # a SIGTERM held across the swap's renames was raised as the hold ended, and the clean-up of a stopped
    # export then removed the new export just swapped in: neither the earlier nor the new one was left
    export, new = tmp_path / "colmap", tmp_path / "reference"
    assert stream_recon("export", str(finished_run), "-f", "colmap", "-o", str(export), "--conf-threshold",
                        "1").returncode == 0
    assert stream_recon("export", str(finished_run), "-f", "colmap", "-o", str(new)).returncode == 0

    stopped = subprocess.run(command("export", str(finished_run), "-f", "colmap", "-o", str(export), "--overwrite"),
                             env=fault_environment("stream_recon.app.outputs.export:move_in_staged:term:1"),
                             capture_output=True, text=True, timeout=120)
    assert stopped.returncode == 143, stopped.stderr
    assert "Traceback" not in stopped.stdout + stopped.stderr
    assert tree_of(export) == tree_of(new)  # nothing hidden left either


def earlier_names(tree: dict[str, bytes]) -> set[str]:
    return {name.split("/")[0] for name in tree}


def test_an_export_killed_part_way_leaves_the_earlier_one_and_the_next_export_clears_its_remains(
        tmp_path: Path, finished_run: Path) -> None:
    export = tmp_path / "colmap"
    assert stream_recon("export", str(finished_run), "-f", "colmap", "-o", str(export)).returncode == 0
    earlier = tree_of(export)

    killed = subprocess.run(command("export", str(finished_run), "-f", "colmap", "-o", str(export), "--overwrite"),
                            env=fault_environment("stream_recon.app.outputs.export_images:write_png:kill:4"), capture_output=True,
                            text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL
    visible = {name: data for name, data in tree_of(export).items() if not name.startswith(".")}
    assert visible == earlier

    again = stream_recon("export", str(finished_run), "-f", "colmap", "-o", str(export), "--overwrite")
    assert again.returncode == 0, again.stderr
    assert sorted(entry.name for entry in export.iterdir()) == ["images", "sparse"]  # nothing hidden stays


# ------------------------------------------------------------------ one folder, one run


@pytest.fixture
def endless_camera() -> Iterator[str]:
    """A live camera that sends 20 frames a second until the test ends: a run on it goes on until stopped."""
    with mjpeg_server(num_frames=10**6, interval_s=0.05) as url:
        yield url


def start_run(*args: str) -> subprocess.Popen:
    return subprocess.Popen(command(*args), env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def npz_frames(run_dir: Path) -> list[int]:
    return sorted(int(path.stem) for path in (run_dir / "predictions").glob("*.npz"))


def test_a_second_run_into_a_folder_a_run_writes_is_refused_and_touches_nothing(
        tmp_path: Path, tiny_checkpoint: Path, endless_camera: str) -> None:
    # two runs started into one folder 0.5 s apart both exited 0 and mixed their files: run.json and the
    # trajectory of the second, the npz files of both
    run_dir = tmp_path / "same"
    folder = write_image_folder(tmp_path / "frames", ["0.png", "1.png", "2.png"], width=160, height=96)
    first = start_run(endless_camera, "--checkpoint", str(tiny_checkpoint), *FAST_FLAGS, "-o", str(run_dir))
    try:
        wait_until(lambda: len(npz_frames(run_dir)) >= 2, 90, process=first, what="the first run's frames")
        second = stream_recon(str(folder), "--checkpoint", str(tiny_checkpoint), *FAST_FLAGS, "-o", str(run_dir),
                              "--overwrite")
        first.send_signal(signal.SIGTERM)
        printed, _ = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()

    assert second.returncode == EXIT_BAD_INPUT, second.stderr
    assert lines_of(second) == [f"error: output directory {run_dir} is in use by another stream-recon run; wait for "
                                "it to end, or choose another --output"]
    assert first.returncode == EXIT_TERMINATED, printed
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "interrupted" and record["settings"]["source"] == f"stream {endless_camera}"
    assert npz_frames(run_dir) == list(range(record["summary"]["frames"]))
    # once the first has ended, the folder is free
    third = stream_recon(str(folder), "--checkpoint", str(tiny_checkpoint), *FAST_FLAGS, "-o", str(run_dir),
                         "--overwrite")
    assert third.returncode == 0, third.stderr
    assert npz_frames(run_dir) == [0, 1, 2]


def test_a_run_replacing_another_stopped_before_its_first_frame_leaves_the_earlier_one(
        tmp_path: Path, tiny_checkpoint: Path, stalled_camera: str) -> None:
    # `run --overwrite` stopped after its model loaded but before its first frame had already removed the
    # earlier run, and then removed its own run.json: the folder was left empty
    folder = write_image_folder(tmp_path / "frames", ["0.png", "1.png", "2.png"], width=160, height=96)
    run_dir = tmp_path / "run"
    assert stream_recon(str(folder), "--checkpoint", str(tiny_checkpoint), *FAST_FLAGS, "-o", str(run_dir)
                        ).returncode == 0
    earlier = tree_of(run_dir)
    child = subprocess.Popen(command(stalled_camera, "--checkpoint", str(tiny_checkpoint), *FAST_FLAGS,
                                     *BEYOND_THE_CAMERA, "-o", str(run_dir), "--overwrite"),
                             env=environment(STREAM_RECON_PROGRESS_INTERVAL="0.2"), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    printed: list[str] = []
    reader = threading.Thread(target=lambda: [printed.append(line) for line in child.stdout], daemon=True)
    reader.start()
    try:  # the stream has begun (its progress lines come from the loop over the frames): the writer is made
        wait_until(lambda: any(line.startswith("progress: ") for line in printed), 90, process=child,
                   what="the stream's progress")
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    reader.join(timeout=10)

    assert child.returncode == EXIT_TERMINATED, "".join(printed)
    assert tree_of(run_dir) == earlier
    assert "Traceback" not in "".join(printed)


# ------------------------------------------------------------------ every way a run ends leaves a true record


@pytest.mark.parametrize("stop", [signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2], ids=lambda stop: stop.name)
def test_a_closed_terminal_or_a_users_signal_stops_and_saves_a_run_as_sigterm_does(
        tmp_path: Path, tiny_checkpoint: Path, endless_camera: str, stop: signal.Signals) -> None:
    # SIGHUP, SIGUSR1 and SIGUSR2 ended the process at once (exit 129, 138, 140 as the signal's default action)
    # with run.json left "running", no trajectory_tum.txt and no points.ply
    run_dir = tmp_path / "run"
    child = start_run(endless_camera, "--checkpoint", str(tiny_checkpoint), *FAST_FLAGS, "-o", str(run_dir))
    try:
        wait_until(lambda: len(npz_frames(run_dir)) >= 2, 90, process=child, what="two frames")
        child.send_signal(stop)
        printed, _ = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()

    assert child.returncode == 128 + stop, printed
    assert "Traceback" not in printed
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "interrupted" and record["summary"]["stop_signal"] == stop.name
    assert npz_frames(run_dir) == list(range(record["summary"]["frames"]))
    trajectory = (run_dir / "trajectory_tum.txt").read_text().splitlines()
    assert len(trajectory) == record["summary"]["frames"] + 1  # + the header
    assert (run_dir / "points.ply").exists()
    assert printed.splitlines()[-1].startswith(f"interrupted: {record['summary']['frames']} frames"), printed


# ------------------------------------------------------------------ eval


def test_an_eval_output_that_cannot_be_written_is_refused_before_the_evaluation(tmp_path: Path,
                                                                              finished_run: Path) -> None:
    # `eval RUN --gt GT -o /missing/e.json` printed its tables, then failed on -o
    trajectory = tmp_path / "gt.txt"
    trajectory.write_text((finished_run / "trajectory_tum.txt").read_text())
    missing = tmp_path / "missing" / "e.json"

    result = stream_recon("eval", str(finished_run), "--gt", str(trajectory), "-o", str(missing))

    assert result.returncode == EXIT_BAD_INPUT, result.stdout + result.stderr
    assert lines_of(result) == [f"error: -o {missing}: the folder {missing.parent} does not exist; create it, or "
                                "choose another -o"]
    assert not missing.parent.exists()


def test_a_run_left_running_by_a_killed_process_is_closed_by_the_next_export(tmp_path: Path, tiny_checkpoint: Path,
                                                                             endless_camera: str) -> None:
    # after kill -9 (or SIGUSR1, or anything without a handler) run.json stayed "running" for good, with no
    # trajectory_tum.txt and no points.ply beside the npz files
    run_dir = tmp_path / "run"
    child = start_run(endless_camera, "--checkpoint", str(tiny_checkpoint), *FAST_FLAGS, "-o", str(run_dir))
    try:
        wait_until(lambda: len(npz_frames(run_dir)) >= 3, 90, process=child, what="three frames")
        # a run still going is left to its process
        while_running = stream_recon("export", str(run_dir), "-f", "tum", "-o", str(tmp_path / "early.txt"))
        assert json.loads((run_dir / "run.json").read_text())["status"] == "running"
        child.kill()
        child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    assert while_running.returncode == 0 and "note:" not in while_running.stderr, while_running.stderr
    assert not (run_dir / "trajectory_tum.txt").exists()
    frames = npz_frames(run_dir)

    result = stream_recon("export", str(run_dir), "-f", "tum", "-o", str(tmp_path / "trajectory.txt"))

    assert result.returncode == 0, result.stderr
    assert lines_of(result)[0] == (f"note: {run_dir} was left running by a process that ended without closing it: "
                                   f"closed it from its {len(frames)} prediction files (trajectory_tum.txt, "
                                   "points.ply; run.json: interrupted)")
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "interrupted" and record["summary"]["frames"] == len(frames)
    assert "the process ended without closing the run" in record["summary"]["end_reason"]
    assert len((run_dir / "trajectory_tum.txt").read_text().splitlines()) == len(frames) + 1  # + the header
    assert PlyData.read(str(run_dir / "points.ply"))["vertex"].count == record["summary"]["points"]["count"]
    again = stream_recon("export", str(run_dir), "-f", "tum", "-o", str(tmp_path / "again.txt"))
    assert again.returncode == 0 and "note:" not in again.stderr


# ------------------------------------------------------------------ stopped at random instants

INSTANTS = FAULT_INSTANTS
STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)


def visible_tree(folder: Path) -> dict[str, bytes]:
    """tree_of without hidden entries (what a killed export may leave for the next one to clear)."""
    return {name: data for name, data in tree_of(folder).items() if not any(part.startswith(".")
                                                                                 for part in name.split("/"))}


def no_traceback_of_ours(printed: str) -> bool:
    """No traceback, but for Python's own when a signal lands while the interpreter starts, before any code
    of ours runs ("Fatal Python error: init_import_site")."""
    return "Traceback" not in printed or "Fatal Python error: init_import_site" in printed


def stopped_after(args: list[str], delay_s: float, signum: int) -> subprocess.CompletedProcess:
    """`stream-recon ARGS` sent `signum` `delay_s` after its start (or run to its end, if it ends first)."""
    child = subprocess.Popen(command(*args), env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        try:
            printed, _ = child.communicate(timeout=delay_s)
        except subprocess.TimeoutExpired:
            child.send_signal(signum)
            printed, _ = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    return subprocess.CompletedProcess(args, child.returncode, printed, "")


@pytest.mark.slow  # 20 export processes: a minute or two
def test_an_export_replacing_another_stopped_at_any_instant_leaves_one_of_them_whole(tmp_path: Path,
                                                                                    finished_run: Path) -> None:
    export, new = tmp_path / "colmap", tmp_path / "reference"
    assert stream_recon("export", str(finished_run), "-f", "colmap", "-o", str(export), "--conf-threshold",
                        "1").returncode == 0
    started = time.monotonic()
    assert stream_recon("export", str(finished_run), "-f", "colmap", "-o", str(new)).returncode == 0
    duration_s = time.monotonic() - started
    earlier, replacement = tree_of(export), tree_of(new)
    assert earlier != replacement
    random = np.random.default_rng(7)

    for instant in range(INSTANTS):
        delay_s, signum = random.uniform(0.0, 1.2 * duration_s), STOPS[instant % len(STOPS)]
        result = stopped_after(["export", str(finished_run), "-f", "colmap", "-o", str(export), "--overwrite"],
                               delay_s, signum)
        now = visible_tree(export)
        assert now in (earlier, replacement), (instant, delay_s, signum, result.stdout)
        assert no_traceback_of_ours(result.stdout), result.stdout
        if result.returncode == 0:
            assert now == replacement
        if now == replacement:  # the next instant replaces the earlier one again
            assert stream_recon("export", str(finished_run), "-f", "colmap", "-o", str(export), "--overwrite",
                                "--conf-threshold", "1").returncode == 0
    # what killed exports left is cleared by the next one there
    assert stream_recon("export", str(finished_run), "-f", "colmap", "-o", str(export), "--overwrite").returncode == 0
    assert sorted(entry.name for entry in export.iterdir()) == ["images", "sparse"]


def predictions_of(run_dir: Path) -> dict[int, tuple[int, int]]:
    """Each npz's frame index -> its image size: which run wrote it (the two runs' frames differ in size)."""
    sizes = {}
    for frame in npz_frames(run_dir):
        with np.load(run_dir / "predictions" / f"{frame:06d}.npz") as data:
            sizes[frame] = tuple(int(size) for size in data["image_size"])
    return sizes


@pytest.mark.slow  # 20 run processes: two or three minutes
def test_a_run_replacing_another_stopped_at_any_instant_leaves_one_of_them_with_a_true_record(
        tmp_path: Path, tiny_checkpoint: Path) -> None:
    earlier_source = write_image_folder(tmp_path / "frames", ["0.png", "1.png", "2.png"], width=160, height=96)
    video = write_video(tmp_path / "clip.mp4", 12, width=96, height=96)  # another image size than the folder's
    run_dir = tmp_path / "run"
    flags = ["--checkpoint", str(tiny_checkpoint), *FAST_FLAGS, "-o", str(run_dir)]
    started = time.monotonic()
    assert stream_recon(str(earlier_source), *flags).returncode == 0
    duration_s = 1.5 * (time.monotonic() - started)
    earlier = tree_of(run_dir)
    earlier_size = set(predictions_of(run_dir).values())
    random = np.random.default_rng(11)

    for instant in range(INSTANTS):
        delay_s, signum = random.uniform(0.0, 1.5 * duration_s), STOPS[instant % len(STOPS)]
        result = stopped_after([str(video), *flags, "--overwrite"], delay_s, signum)
        assert no_traceback_of_ours(result.stdout), result.stdout
        if visible_tree(run_dir) == earlier:  # stopped before it began to replace the earlier run
            assert result.returncode != 0
            continue
        record = json.loads((run_dir / "run.json").read_text())
        sizes = predictions_of(run_dir)
        assert record["settings"]["source"].endswith("clip.mp4"), (instant, record["settings"]["source"])
        assert not set(sizes.values()) & earlier_size, (instant, sizes)  # never a mix of the two runs
        if record["status"] == "running":  # killed mid-run: the next export closes it (and exports its frames)
            assert result.returncode == -signal.SIGKILL, (instant, result.stdout)
            closing = stream_recon("export", str(run_dir), "-f", "tum", "-o", str(tmp_path / f"t{instant}.txt"))
            assert closing.returncode in (0, EXIT_BAD_INPUT) and "note:" in closing.stderr, closing.stderr
            record = json.loads((run_dir / "run.json").read_text())
            assert record["status"] == "interrupted"
        elif result.returncode == 0:
            assert record["status"] == "complete" and record["summary"]["stop_signal"] is None
        elif result.returncode > 128:  # stopped, or (a signal after the last frame) complete: the record names it
            assert record["status"] in ("interrupted", "complete"), (instant, result.stdout)
            assert record["summary"]["stop_signal"] == signal.Signals(result.returncode - 128).name
        else:  # the signal landed once the run had ended and its handlers were gone: its record is final
            assert record["status"] in ("complete", "interrupted"), (instant, result.stdout)
        if record["status"] != "running":
            assert list(sizes) == list(range(record["summary"]["frames"])), (instant, record["summary"])
            lines = (run_dir / "trajectory_tum.txt").read_text().splitlines()
            assert len(lines) == record["summary"]["frames"] + 1
        # the earlier run back for the next instant
        assert stream_recon(str(earlier_source), *flags, "--overwrite").returncode == 0
        earlier = tree_of(run_dir)
