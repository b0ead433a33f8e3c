"""What a new user meets through `stream-recon` in processes of its own, on real files: the camera head's count,
mask folders and the sky network checked before torch is imported, the sky network offline in one line, a run
or an export that ends with no point said so, damaged prediction files named, exports beside other exports."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import cv2
import numpy as np
import pytest
from helpers import read_run, wait_until
from media_helpers import free_port, mjpeg_server, write_image_folder, write_video
from test_app_cli_process import FAST_FLAGS, command, environment, lines_of, stream_recon

from stream_recon.app.commands._options import EXIT_BAD_INPUT
from stream_recon.app.outputs.sky import SKYSEG_URL

FAULTS = Path(__file__).parent / "faults"  # its sitecustomize records what a process imported
FRAMES = 20


def refused_before_loading(tmp_path: Path, *args: str, python_path: tuple[Path, ...] = (),
                           **env: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """`stream-recon ARGS` run to its end, and the top-level modules it imported (tests/faults/sitecustomize.py)."""
    record = tmp_path / "imported.json"
    record.unlink(missing_ok=True)
    paths = os.pathsep.join(str(path) for path in (*python_path, FAULTS))
    result = subprocess.run(command(*args), capture_output=True, text=True, timeout=120,
                            env=environment(PYTHONPATH=paths, STREAM_RECON_TEST_IMPORTED=str(record), **env))
    return result, set(json.loads(record.read_text()))


def help_text(command_name: str) -> str:
    """`stream-recon COMMAND -h` as words, whatever its box wrapped."""
    shown = subprocess.run(command(command_name, "-h"), capture_output=True, text=True, timeout=120,
                           env=environment())
    assert shown.returncode == 0, shown.stderr
    return " ".join(shown.stdout.replace("│", " ").split())


def assert_one_error_line(result: subprocess.CompletedProcess, *parts: str) -> str:
    lines = lines_of(result)
    assert result.returncode == EXIT_BAD_INPUT and len(lines) == 1, lines
    assert lines[0].startswith("error: ") and all(part in lines[0] for part in parts), lines
    return lines[0]


@pytest.fixture
def frames(tmp_path: Path) -> Path:
    """An image folder of FRAMES frames, 160x96 (the tiny model's input: 56x28 at --image-width 56)."""
    return write_image_folder(tmp_path / "frames", [f"{index}.png" for index in range(FRAMES)], width=160, height=96)


def write_masks(folder: Path, names: list[str], draw) -> Path:
    """One mask per name, `draw(k)` the k-th one's pixels (uint8 [H, W])."""
    folder.mkdir(parents=True, exist_ok=True)
    for index, name in enumerate(names):
        assert cv2.imwrite(str(folder / name), draw(index))
    return folder


# ------------------------------------------------------------------ the camera head


@pytest.mark.slow
def test_camera_iterations_beyond_the_checkpoints_are_one_line_naming_its_count(tmp_path: Path,
                                                                                 tiny_checkpoint: Path) -> None:
    # with a checkpoint whose camera head refines twice: `--camera-iterations 4` (the documented default, "all")
    # or 3 ended in a ValueError's traceback, exit 1
    video = write_video(tmp_path / "clip.mp4", 4)
    for asked in ("4", "3"):
        result = stream_recon(str(video), "--checkpoint", str(tiny_checkpoint), *FAST_FLAGS, "--camera-iterations",
                              asked, "-o", str(tmp_path / "run"))
        assert_one_error_line(result, f"--camera-iterations {asked} is more than this checkpoint's camera head has: "
                                      "it refines its poses 2 times; give 1 to 2")
        assert not (tmp_path / "run").exists()
    assert "[default: all, the checkpoint's count]" in help_text("run")


# ------------------------------------------------------------------ mask folders


@pytest.mark.slow
def test_masks_named_as_numbers_go_to_frames_in_natural_order(tmp_path: Path, frames: Path,
                                                             tiny_checkpoint: Path) -> None:
    # mask_0 ... mask_19 were matched in string order: frame 2 got mask_10, frame 11 got mask_19
    def band(index: int) -> np.ndarray:  # the k-th mask leaves out a band 8 (k + 1) columns wide
        mask = np.full((96, 160), 255, np.uint8)
        mask[:, : 8 * (index + 1)] = 0
        return mask

    masks = write_masks(tmp_path / "masks", [f"mask_{index}.png" for index in range(FRAMES)], band)
    result = stream_recon(str(frames), "--checkpoint", str(tiny_checkpoint), *FAST_FLAGS, "--mask-dir", str(masks),
                          "-o", str(tmp_path / "run"))

    assert result.returncode == 0, result.stderr
    dropped = {record["frame_index"]: int(record["sky_mask"][0].sum()) for record in read_run(tmp_path / "run")}
    assert sorted(dropped) == list(range(FRAMES))
    widths = [dropped[index] for index in range(FRAMES)]
    assert widths == sorted(widths) and widths[0] < widths[9] < widths[FRAMES - 1] == 56, widths


@pytest.mark.slow
def test_masks_of_another_size_are_refused_before_torch_and_leave_nothing(tmp_path: Path, frames: Path) -> None:
    # 300x40 masks for 160x96 frames were stretched to fit without a word
    masks = write_masks(tmp_path / "masks", [f"{index:06d}.png" for index in range(FRAMES)],
                        lambda index: np.zeros((40, 300), np.uint8))
    result, imported = refused_before_loading(tmp_path, str(frames), "--no-viewer", "--mask-dir", str(masks),
                                              "-o", str(tmp_path / "run"))

    assert_one_error_line(result, "000000.png is 300x40, neither the frames' 160x96 nor the model input's 518x308")
    assert "torch" not in imported and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_masks_drawn_on_the_turned_frames_are_turned_no_more(tmp_path: Path, frames: Path,
                                                           tiny_checkpoint: Path) -> None:
    # --rotate 90 with masks drawn on the upright frame (96 wide, 160 high) turned each a second time: the right
    # columns were left out instead of the top rows
    def top_half(index: int) -> np.ndarray:
        mask = np.full((160, 96), 255, np.uint8)
        mask[:80] = 0
        return mask

    masks = write_masks(tmp_path / "masks", [f"m{index}.png" for index in range(FRAMES)], top_half)
    result = stream_recon(str(frames), "--checkpoint", str(tiny_checkpoint), *FAST_FLAGS, "--rotate", "90",
                          "--mask-dir", str(masks), "-o", str(tmp_path / "run"))

    assert result.returncode == 0, result.stderr
    for record in read_run(tmp_path / "run"):
        dropped = record["sky_mask"]  # 56x56: the turned frame's middle rows
        assert dropped.shape == (56, 56) and dropped[:25].all() and not dropped[-25:].any()


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["too few", "not images", "a frame's name missing"])
def test_a_mask_folder_that_cannot_serve_the_run_is_refused_before_torch(tmp_path: Path, frames: Path,
                                                                         fault: str) -> None:
    # found mid-run: failed after 10 frames (exit 1, a run folder left), or "kept 0 frames", in words of the
    # internals ("the run writer failed on a frame: MaskDirError: ... nor a 11-th image")
    keep_all = lambda index: np.full((96, 160), 255, np.uint8)  # noqa: E731
    if fault == "too few":
        masks = write_masks(tmp_path / "masks", [f"mask_{index}.png" for index in range(10)], keep_all)
        expected = f"--mask-dir {masks} holds 10 masks for the 20 frames this run takes"
    elif fault == "not images":
        masks = tmp_path / "masks"
        masks.mkdir()
        for index in range(FRAMES):
            (masks / f"mask_{index}.png").write_text("a mask, they said\n")
        expected = f"--mask-dir: {masks / 'mask_0.png'} is not a readable image"
    else:
        masks = write_masks(tmp_path / "masks", [f"{index:06d}.png" for index in range(FRAMES) if index != 7],
                            keep_all)
        expected = f"--mask-dir {masks} has no mask for 1 frame of the 20 this run takes (000007)"
    result, imported = refused_before_loading(tmp_path, str(frames), "--no-viewer", "--mask-dir", str(masks),
                                              "-o", str(tmp_path / "run"))

    line = assert_one_error_line(result, expected)
    assert "Error" not in line and "run writer" not in line
    assert "torch" not in imported and not (tmp_path / "run").exists()


# ------------------------------------------------------------------ the sky network


def offline_environment(tmp_path: Path) -> dict[str, str]:
    """A machine whose caches hold no skyseg.onnx, with a hub address where nothing listens (what no network
    does to a download: the connection fails)."""
    return {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}", "HF_HOME": str(tmp_path / "hf"),
            "STREAM_RECON_CHECKPOINTS": str(tmp_path / "checkpoints")}


@pytest.mark.slow
@pytest.mark.parametrize("how", ["download skyseg", "run --mask-sky"])
def test_the_sky_network_without_the_hub_is_one_line_at_once(tmp_path: Path, frames: Path, how: str) -> None:
    # 26-28 s of Hugging Face's retries, 11 lines "... thrown while requesting HEAD ... Retrying in 8s [Retry 5/5]",
    # then its generic sentence
    args = ["download", "skyseg"] if how == "download skyseg" else [str(frames), "--no-viewer", "--mask-sky",
                                                                    "-o", str(tmp_path / "run")]
    start = time.monotonic()
    result, imported = refused_before_loading(tmp_path, *args, **offline_environment(tmp_path))

    assert time.monotonic() - start < 10
    assert_one_error_line(result, "skyseg.onnx", "cannot be reached", SKYSEG_URL,
                          f"put it in {tmp_path / 'checkpoints'}")
    assert "torch" not in imported
    assert not (tmp_path / "run").exists() and not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
def test_onnxruntime_and_the_sky_network_missing_are_said_at_once_before_torch(tmp_path: Path, frames: Path) -> None:
    # only the network was said (after the hub's retries); onnxruntime only once the file was there, with the
    # advice `pip install 'stream-recon[sky]'`, no package on PyPI
    missing = tmp_path / "without" / "onnxruntime"
    missing.mkdir(parents=True)
    (missing / "__init__.py").write_text('raise ModuleNotFoundError("No module named \'onnxruntime\'", '
                                         'name="onnxruntime")\n')
    result, imported = refused_before_loading(tmp_path, str(frames), "--no-viewer", "--mask-sky", "-o",
                                              str(tmp_path / "run"), python_path=(missing.parent,),
                                              **offline_environment(tmp_path))

    line = assert_one_error_line(result, "onnxruntime, which is not installed here", "scripts/setup-env sky`",
                                 "skyseg.onnx, which is not on this machine either", SKYSEG_URL)
    assert "stream-recon[sky]" not in line
    assert "torch" not in imported and not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("command_name", ["run", "batch"])
def test_help_shows_the_sky_extra(command_name: str) -> None:
    # rich took `[sky]` for markup: the help said `pip install 'stream-recon'`
    assert "the [sky] extra of a wheel" in help_text(command_name)


def test_no_run_options_help_holds_a_bracket_rich_would_take_for_markup() -> None:
    from stream_recon.app.commands._options import _RUN_OPTION_HELP

    unescaped = [field for helps in _RUN_OPTION_HELP.values() for field, text in helps.items()
                 if any(text[index - 1: index] != "\\" for index, char in enumerate(text) if char == "[")]
    assert unescaped == []


# ------------------------------------------------------------------ an empty cloud


def warnings_of(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in lines_of(result) if line.startswith("warning: ")]


@pytest.mark.slow
@pytest.mark.parametrize("emptied_by", ["--conf-threshold", "--mask-dir", "the sample's confidence"])
def test_a_run_whose_cloud_ends_empty_says_what_emptied_it(tmp_path: Path, frames: Path, tiny_checkpoint: Path,
                                                         emptied_by: str) -> None:
    # points.ply with 0 vertices, `done:`, exit 0 and no word (`export` of the same run warned)
    run_dir = tmp_path / "run"
    if emptied_by == "--conf-threshold":
        args, expected = [str(frames), "--conf-threshold", "100"], (
            "warning: points.ply holds no point: no pixel has depth confidence >= 100: pass a lower --conf-threshold")
    elif emptied_by == "--mask-dir":
        masks = write_masks(tmp_path / "masks", [f"{index:06d}.png" for index in range(FRAMES)],
                            lambda index: np.zeros((96, 160), np.uint8))
        args, expected = [str(frames), "--conf-threshold", "1", "--mask-dir", str(masks)], (
            f"warning: points.ply holds no point: --mask-dir {masks} left out every pixel with depth confidence >= 1")
    else:  # the bundled sample's confidence, under the tiny model, never reaches the default threshold
        args, expected = [], "warning: points.ply holds no point: no pixel has depth confidence >= 2"
    result = stream_recon(*args, "--checkpoint", str(tiny_checkpoint), *FAST_FLAGS, "-o", str(run_dir))

    assert result.returncode == 0, result.stderr
    assert [line.startswith(expected) for line in warnings_of(result)] == [True], lines_of(result)
    assert any(line.startswith("done: ") for line in lines_of(result))
    assert json.loads((run_dir / "run.json").read_text())["summary"]["points"]["count"] == 0
    if emptied_by == "--mask-dir":  # the export of it names the masks too, not the confidence
        exported = stream_recon("export", str(run_dir), "-f", "ply", "-o", str(tmp_path / "points.ply"),
                                "--conf-threshold", "1")
        assert exported.returncode == 0, exported.stderr
        assert warnings_of(exported) == ["warning: the export holds no point: the run's masks (sky_mask in its npz "
                                         "files) left out every pixel with depth confidence >= 1: check the masks (0 "
                                         "leaves a pixel out)"], lines_of(exported)


# ------------------------------------------------------------------ damaged prediction files


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> Path:
    """A complete run of 8 frames of the tiny model, with its images (copy it to change it)."""
    folder = tmp_path_factory.mktemp("finished")
    video = write_video(folder / "clip.mp4", 8)
    result = stream_recon(str(video), "--checkpoint", str(tiny_checkpoint), *FAST_FLAGS, "-o", str(folder / "run"))
    assert result.returncode == 0, result.stderr
    return folder / "run"


def damage(run_dir: Path, how: str) -> Path:
    """Frame 3's npz replaced by one with a depth of the wrong shape, or one holding an array of Python objects."""
    path = run_dir / "predictions" / "000003.npz"
    with np.load(path) as data:
        arrays = {key: data[key] for key in data.files}
    arrays["depth"] = arrays["depth"][:10] if how == "depth of another shape" else np.array([None, 1], dtype=object)
    np.savez(path, **arrays)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("how", ["depth of another shape", "an object array"])
def test_a_damaged_prediction_file_is_named_and_skipped_by_every_export(tmp_path: Path, finished_run: Path,
                                                                       how: str) -> None:
    # `error: operands could not be broadcast together with shapes (112,140) (10,140)`, exit 2, no file named;
    # numpy's "Object arrays cannot be loaded when allow_pickle=False"
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    damaged = damage(run_dir, how)
    (run_dir / "trajectory_tum.txt").unlink()  # as a killed run's: `tum` reads the poses from the npz files
    said = ("its depth has the shape 10x56, not 28x56 (its image_size is 28x56)" if how == "depth of another shape"
            else "holds an array of Python objects, which is never loaded")
    for fmt, name in [("ply", "p.ply"), ("glb", "s.glb"), ("colmap", "colmap"), ("nerfstudio", "ns"),
                      ("splats", "g.ply")]:
        result = stream_recon("export", str(run_dir), "-f", fmt, "-o", str(tmp_path / name))

        assert result.returncode == 0, (fmt, result.stderr)
        skipped = [line for line in warnings_of(result) if "skipping" in line]
        assert len(skipped) == 1 and f"skipping frame 3: cannot read {damaged}: 000003.npz " in skipped[0], skipped
        assert said in skipped[0] and "broadcast" not in result.stderr and "allow_pickle" not in result.stderr
        assert (tmp_path / name).exists()
    # the poses alone are whole: a trajectory read from the npz files keeps frame 3's
    result = stream_recon("export", str(run_dir), "-f", "tum", "-o", str(tmp_path / "t.txt"))
    assert lines_of(result) == [f"wrote 8 poses to {tmp_path / 't.txt'}"], lines_of(result)


# ------------------------------------------------------------------ exports beside exports


@pytest.mark.slow
def test_a_file_export_is_never_written_into_another_exports_folder(tmp_path: Path, finished_run: Path) -> None:
    # `export -f ply -o exp/col` wrote points.ply into the COLMAP export there, which `-f colmap --overwrite`
    # then refused ("not empty ... choose a new or empty --output")
    folder = tmp_path / "exp" / "col"
    assert stream_recon("export", str(finished_run), "-f", "colmap", "-o", str(folder)).returncode == 0
    before = sorted(path.relative_to(folder) for path in folder.rglob("*"))

    result = stream_recon("export", str(finished_run), "-f", "ply", "-o", str(folder))

    assert_one_error_line(result, f"{folder} holds a COLMAP export, which a PLY file is not written into; name the "
                                  f"file (-o {folder}.ply)")
    assert sorted(path.relative_to(folder) for path in folder.rglob("*")) == before
    replaced = stream_recon("export", str(finished_run), "-f", "colmap", "-o", str(folder), "--overwrite")
    assert replaced.returncode == 0, replaced.stderr


# ------------------------------------------------------------------ a run killed before its first frame


@pytest.mark.slow
def test_an_export_of_a_run_killed_before_its_first_frame_says_it_has_no_frames(tmp_path: Path,
                                                                               tiny_checkpoint: Path) -> None:
    # after kill -9 before any frame, `export` said "trajectory_tum.txt holds no poses"
    run_dir = tmp_path / "run"
    with mjpeg_server(num_frames=21, stall_after=20) as camera:  # fewer frames than the scale frames: no prediction
        child = subprocess.Popen(command(camera, "--checkpoint", str(tiny_checkpoint), *FAST_FLAGS, "--scale-frames",
                                         "40", "-o", str(run_dir)), env=environment(), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        try:
            wait_until(lambda: (run_dir / "run.json").exists(), 90, process=child, what="run.json")
            child.kill()
            child.wait(timeout=60)
        finally:
            if child.poll() is None:
                child.kill()
    for fmt in ("tum", "ply"):
        result = stream_recon("export", str(run_dir), "-f", fmt, "-o", str(tmp_path / f"out.{fmt}"))

        assert result.returncode == EXIT_BAD_INPUT, result.stderr
        assert lines_of(result)[-1] == (f"error: {run_dir} has no frames: its run (interrupted) ended before its first "
                                        "frame was written, so there is nothing to export"), lines_of(result)


# ------------------------------------------------------------------ a stop, said


@pytest.mark.slow
@pytest.mark.parametrize("loaded", ["cv2", "libtorch_cpu"])
def test_a_run_stopped_in_its_first_seconds_says_so(tmp_path: Path, tiny_checkpoint: Path, loaded: str) -> None:
    # Ctrl-C in a run's first ~2 s (OpenCV's or torch's import) ended it silently, exit 130; at 3 s it said
    # "interrupted before the first frame"
    video = write_video(tmp_path / "clip.mp4", 4)
    child = subprocess.Popen(command(str(video), "--checkpoint", str(tiny_checkpoint), *FAST_FLAGS, "-o",
                                     str(tmp_path / "run")), env=environment(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        maps = Path(f"/proc/{child.pid}/maps")
        wait_until(lambda: loaded in maps.read_text(), 90, process=child, what=f"{loaded} loaded")
        child.send_signal(signal.SIGINT)
        printed, _ = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()

    assert child.returncode == 130, printed
    said = [line for line in printed.splitlines() if line.startswith("interrupted")]
    # (the folder is named once the command knows it: after OpenCV's import)
    assert said in (["interrupted before the first frame: nothing was written"],
                    [f"interrupted before the first frame: nothing was written to {tmp_path / 'run'}"]), printed
    assert "Traceback" not in printed and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_an_export_or_a_conversion_stopped_says_what_it_left(tmp_path: Path, finished_run: Path,
                                                            tiny_checkpoint: Path) -> None:
    # an interrupted `export` or `convert` printed nothing: the exit code alone
    def stopped(fault: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(command(*args), capture_output=True, text=True, timeout=120,
                              env=environment(PYTHONPATH=str(FAULTS), STREAM_RECON_TEST_FAULT=fault))

    export = stopped("stream_recon.app.outputs.export_images:write_png:term:2", "export", str(finished_run), "-f", "colmap",
                     "-o", str(tmp_path / "colmap"))
    assert export.returncode == 143 and lines_of(export)[-1] == (
        f"interrupted: nothing of the export was kept at {tmp_path / 'colmap'}"), lines_of(export)
    assert not (tmp_path / "colmap").exists()

    converted = stopped("stream_recon.models.checkpoint:convert_to_safetensors:term:1", "convert",
                        str(tiny_checkpoint.with_name("tiny.pt")), str(tmp_path / "tiny.safetensors"))
    assert converted.returncode == 143 and lines_of(converted)[-1] == (
        f"interrupted: nothing was written to {tmp_path / 'tiny.safetensors'}"), lines_of(converted)
    assert "Traceback" not in export.stderr + converted.stderr


# ------------------------------------------------------------------ what the lines say


@pytest.mark.slow
def test_the_progress_counts_the_runs_keyframes_across_chunks(tmp_path: Path, tiny_checkpoint: Path) -> None:
    # the keyframes began again from 0 at each chunk ("20/20 frames ... 0 keyframes"), and a `chunk rollover`
    # INFO line came without --verbose
    video = write_video(tmp_path / "clip.mp4", 20)
    result = subprocess.run(command(str(video), "--checkpoint", str(tiny_checkpoint), *FAST_FLAGS, "--chunk-frames",
                                    "6", "--overlap", "2", "-o", str(tmp_path / "run")), capture_output=True,
                            text=True, timeout=120, env=environment(STREAM_RECON_PROGRESS_INTERVAL="0.02"))

    assert result.returncode == 0, result.stderr
    counts = [int(count) for count in re.findall(r"progress: .*?, (\d+) keyframes, ", result.stderr)]
    assert len(counts) >= 3 and counts == sorted(counts) and counts[-1] > 6, result.stderr
    assert "chunk 3" in result.stderr and "INFO" not in result.stderr and "rollover" not in result.stderr


def test_a_chunk_too_short_for_the_default_overlap_says_it_is_the_default(tmp_path: Path) -> None:
    # `--chunk-frames 9`: "--overlap must be ... (8), got 16", which the user never typed
    video = write_video(tmp_path / "clip.mp4", 2)
    result = subprocess.run(command(str(video), "--chunk-frames", "9", "--no-viewer", "-o", str(tmp_path / "run")),
                            capture_output=True, text=True, timeout=120, env=environment())
    assert_one_error_line(result, "--overlap must be between 1 and --chunk-frames - 1 (8), got 16, its default: "
                                  "with --chunk-frames 9 give a smaller --overlap too")


@pytest.mark.slow
def test_info_says_whether_the_sky_network_runs_here(tmp_path: Path) -> None:
    # `info` said nothing of onnxruntime or skyseg.onnx
    missing = tmp_path / "without" / "onnxruntime"
    missing.mkdir(parents=True)
    (missing / "__init__.py").write_text('raise ModuleNotFoundError("No module named \'onnxruntime\'", '
                                         'name="onnxruntime")\n')
    shown = subprocess.run(command("info"), capture_output=True, text=True, timeout=120,
                           env=environment(PYTHONPATH=str(missing.parent),
                                           STREAM_RECON_CHECKPOINTS=str(tmp_path / "checkpoints")))
    report = json.loads(subprocess.run(command("info", "--json"), capture_output=True, text=True, timeout=120,
                                       env=environment(STREAM_RECON_CHECKPOINTS=str(tmp_path))).stdout)

    assert shown.returncode == 0, shown.stderr
    said = " ".join(shown.stdout.split())
    assert "Sky masking (--mask-sky): not ready: onnxruntime is not installed here: run `" in said
    assert f"skyseg.onnx is not on this machine (`stream-recon download skyseg`, or put it in {tmp_path}" in said
    assert report["sky_masking"] == {"available": False, "onnxruntime": None, "skyseg": None, "folder": str(tmp_path)}


@pytest.mark.slow
@pytest.mark.parametrize("command_name", ["run", "export", "batch"])
def test_help_shows_no_type_beside_a_flag_and_the_formats_whole(command_name: str) -> None:
    # `<bool>` beside every flag; `<ply|glb|colmap|tum|ne rfstudio|splats>` broken mid-word in its column
    shown = help_text(command_name)
    assert "<bool>" not in shown and "--help -h Show this message" in shown
    if command_name == "export":
        assert "FORMAT What to write: ply, glb, colmap, tum, nerfstudio, splats." in shown
