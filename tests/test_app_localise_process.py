"""`stream-recon localise` in real processes: frames of a run's own video placed in its map, frames of an
unrelated scene not placed, and a run that cannot serve refused in one line with exit code 2; the run itself
never changed but for the output folder.

The tiny model with its test weights on the `loop` fixture's pictures (test_app_faults' revisiting_video, at
a width SIFT finds features in): what it predicts is not a good map, but the retrieval, the checks and the
files are the real ones.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from conftest import build_tiny_model
from test_app_faults import RUN_FLAGS, revisiting_video
from test_app_maps_process import (
    EXIT_BAD_INPUT,
    EXIT_OK,
    EXIT_TERMINATED,
    cli,
    contents,
    copy_of,
    environment,
    extended_run,
    lines,
    stream_recon,
)

from stream_recon.app.outputs.trajectories import read_tum
from stream_recon.models import ModelConfig
from stream_recon.models.checkpoint import convert_to_safetensors
from stream_recon.models.loops.saved_map import MAP_DIR, read_map

pytest.importorskip("gtsam")
pytestmark = pytest.mark.slow  # stream-recon processes, each importing torch: seconds each

WIDTH = 224  # the model input's width: SIFT finds a few hundred keypoints in the fixture's pictures there
FLAGS = [flag if flag != "56" else str(WIDTH) for flag in RUN_FLAGS]
# The tiny test weights are unsure of every pixel (confidence ~1.99, below the even odds loop closure takes
# depth at): their confidence logit raised by this much (confidence ~21) lets the checks use their depth.
SURE_LOGIT = 3.0


@pytest.fixture(scope="module")
def sure_checkpoint(tmp_path_factory) -> Path:
    """The tiny model's weights with its depth head sure of itself (SURE_LOGIT), as a .safetensors checkpoint."""
    folder = tmp_path_factory.mktemp("checkpoint")
    weights = build_tiny_model().state_dict()
    weights["depth_head.scratch.output_conv2.2.bias"][1] += SURE_LOGIT
    torch.save(weights, folder / "sure.pt")
    return convert_to_safetensors(folder / "sure.pt", folder / "sure.safetensors", config=ModelConfig.tiny())


@pytest.fixture(scope="module")
def video(tmp_path_factory) -> Path:
    return revisiting_video(tmp_path_factory.mktemp("video") / "revisits.mp4", 40)


@pytest.fixture(scope="module")
def mapped_run(video: Path, sure_checkpoint: Path, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("mapped") / "run"
    result = stream_recon(str(video), "--checkpoint", str(sure_checkpoint), "-o", str(run_dir), *FLAGS)
    assert result.returncode == EXIT_OK, result.stdout + result.stderr
    return run_dir


def pictures_of(video: Path, folder: Path, frames: list[int]) -> Path:
    folder.mkdir()
    capture = cv2.VideoCapture(str(video))
    index = 0
    while True:
        ok, picture = capture.read()
        if not ok:
            break
        if index in frames:
            cv2.imwrite(str(folder / f"query_{index:03d}.png"), picture)
        index += 1
    capture.release()
    return folder


def unrelated_scene(folder: Path, count: int) -> Path:
    """Pictures of a scene the run never saw: random rectangles on a gradient, a new layout each."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    for n in range(count):
        picture = np.tile(np.linspace(40, 200, 160, dtype=np.uint8), (96, 1))[..., None].repeat(3, axis=2)
        for _ in range(25):
            x, y = rng.integers(0, 150), rng.integers(0, 86)
            cv2.rectangle(picture, (int(x), int(y)), (int(x + rng.integers(4, 30)), int(y + rng.integers(4, 30))),
                          tuple(int(v) for v in rng.integers(0, 255, 3)), -1)
        cv2.imwrite(str(folder / f"other_{n:02d}.png"), picture)
    return folder


def verdicts(folder: Path) -> list[dict]:
    return json.loads((folder / "verdicts.json").read_text())["queries"]


def test_frames_of_the_runs_video_are_placed_in_its_world(mapped_run: Path, video: Path, tmp_path: Path) -> None:
    run_dir = copy_of(mapped_run, tmp_path / "run")
    before = contents(run_dir)
    queries = pictures_of(video, tmp_path / "queries", [2, 5, 13, 22, 31])
    result = stream_recon("localise", str(run_dir), str(queries))
    assert result.returncode == EXIT_OK, result.stdout + result.stderr
    said = lines(result)
    assert said[-1].startswith("placed ") and " of 5 frames" in said[-1], said
    out = run_dir / "localised"
    found = verdicts(out)
    assert [entry["name"] for entry in found] == sorted(path.name for path in queries.iterdir())
    placed = [entry for entry in found if entry["placed"]]
    assert len(placed) >= 3, found
    timestamps, poses = read_tum(out / "poses_tum.txt")
    assert len(poses) == len(placed) and np.isfinite(poses).all()
    # each placed frame sits by the run's own camera of that frame (the query is a frame of the run): the tiny
    # model's depth hardly depends on the picture, so "by" is within half the scene's depth
    run_poses = read_tum(run_dir / "trajectory_tum.txt")[1]
    scene_depth = np.median([keyframe.median_depth for keyframe in read_map(run_dir).keyframes])
    for entry, pose in zip(placed, poses, strict=True):
        frame = int(entry["name"][6:9])
        assert np.linalg.norm(pose[:3, 3] - run_poses[frame, :3, 3]) <= 0.5 * scene_depth, entry
        assert entry["inliers"] >= 20 and entry["agreeing"] >= 12 and entry["keyframe"] is not None
    assert {key: value for key, value in contents(run_dir).items() if not key.startswith("localised/")} == before


def test_frames_are_placed_in_a_refined_run(mapped_run: Path, video: Path, tmp_path: Path) -> None:
    """Localise reads a refined run as it reads a streamed one: the map's keyframes carried to the refined
    poses (the run's files), each placed frame by the refined camera of its frame."""
    run_dir = copy_of(mapped_run, tmp_path / "run")
    refined = stream_recon("refine", str(run_dir))
    assert refined.returncode == EXIT_OK, refined.stdout + refined.stderr
    queries = pictures_of(video, tmp_path / "queries", [2, 13, 31])
    result = stream_recon("localise", str(run_dir), str(queries))
    assert result.returncode == EXIT_OK, result.stdout + result.stderr
    placed = [entry for entry in verdicts(run_dir / "localised") if entry["placed"]]
    assert len(placed) >= 2, verdicts(run_dir / "localised")
    poses = read_tum(run_dir / "localised" / "poses_tum.txt")[1]
    run_poses = read_tum(run_dir / "trajectory_tum.txt")[1]
    scene_depth = np.median([keyframe.median_depth for keyframe in read_map(run_dir).keyframes])
    for entry, pose in zip(placed, poses, strict=True):
        assert np.linalg.norm(pose[:3, 3] - run_poses[int(entry["name"][6:9]), :3, 3]) <= 0.5 * scene_depth, entry


def test_a_second_recording_of_the_place_is_placed_in_the_map(mapped_run: Path, video: Path, sure_checkpoint: Path,
                                                              tmp_path: Path) -> None:
    """`--map` with a model sure of its depth: the second recording's keyframes verified against the map's, the
    stream placed (its first placing frame recorded) and the earlier run never written."""
    earlier, before, extended, result = extended_run(mapped_run, video, tmp_path, "--checkpoint", str(sure_checkpoint),
                                                     *FLAGS, "--start", "3")
    account = json.loads((extended / "run.json").read_text())["summary"]["loop_closure"]["map"]
    assert account["placed"] and account["loops_accepted"] >= 1, account
    assert 0 <= account["placed_at_frame"] < 37 and "never placed" not in result.stdout + result.stderr
    assert np.isfinite(read_tum(extended / "trajectory_tum.txt")[1]).all()
    assert contents(earlier) == before


def test_a_run_that_extended_a_map_places_frames_of_either_recording(mapped_run: Path, video: Path,
                                                                     sure_checkpoint: Path, tmp_path: Path) -> None:
    """A `--map` run of the video's second half, placed in the first run's map, localises frames whose place only
    the first run's map holds (the walk's 8th picture, a keyframe of the first run and none of the second's): the
    earlier run's keyframes serve (verdicts.json names that run), in the world both now share."""
    earlier, _, extended, _ = extended_run(mapped_run, video, tmp_path, "--checkpoint", str(sure_checkpoint), *FLAGS,
                                           "--start", "20")
    assert json.loads((extended / "run.json").read_text())["summary"]["loop_closure"]["map"]["placed"]
    queries = pictures_of(video, tmp_path / "queries", [7, 12])
    result = stream_recon("localise", str(extended), str(queries))
    assert result.returncode == EXIT_OK, result.stdout + result.stderr
    found = verdicts(extended / "localised")
    placed = [entry for entry in found if entry["placed"]]
    assert placed and all(entry.get("keyframe_run") == str(earlier) for entry in placed), found
    earlier_poses = read_tum(earlier / "trajectory_tum.txt")[1]
    scene_depth = np.median([keyframe.median_depth for keyframe in read_map(earlier).keyframes])
    for entry, pose in zip(placed, read_tum(extended / "localised" / "poses_tum.txt")[1], strict=True):
        # at the camera of the earlier keyframe it was placed against (the same picture)
        assert np.linalg.norm(pose[:3, 3] - earlier_poses[entry["keyframe"], :3, 3]) <= 0.5 * scene_depth, entry


@pytest.fixture(scope="module")
def whole_video_localise_s(mapped_run: Path, video: Path, tmp_path_factory) -> float:
    """How long a localise of the whole video takes, start to end: the span the stop's instants are drawn in
    (one reference for all of them: each instant's own run of it measured the same command again)."""
    started = time.monotonic()
    timed = tmp_path_factory.mktemp("reference") / "timed"
    reference = stream_recon("localise", str(mapped_run), str(video), "-o", str(timed))
    assert reference.returncode == EXIT_OK, reference.stderr
    return time.monotonic() - started


@pytest.mark.parametrize("instant", range(2))
def test_a_stopped_localise_ends_within_seconds_and_leaves_the_run_as_it_was(mapped_run: Path, video: Path,
                                                                             whole_video_localise_s: float,
                                                                             tmp_path: Path, instant: int) -> None:
    """SIGTERM at a seeded instant of a localise of the whole video: the command ends within 10 s of the
    signal, exit 143 with nothing written (or 0 where it had finished), the run's own files untouched."""
    run_dir = copy_of(mapped_run, tmp_path / "run")
    before = contents(run_dir)
    delay = np.random.default_rng(instant).uniform(0.3, 0.9) * whole_video_localise_s
    child = subprocess.Popen(cli("localise", str(run_dir), str(video)), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=environment())
    time.sleep(delay)
    child.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    output, _ = child.communicate(timeout=60)
    assert time.monotonic() - signalled <= 10.0, output
    assert "Traceback" not in output and child.returncode in (EXIT_OK, EXIT_TERMINATED), output
    left = {key: value for key, value in contents(run_dir).items() if not key.startswith("localised/")}
    assert left == before
    assert (run_dir / "localised").exists() == (child.returncode == EXIT_OK)


def test_frames_of_an_unrelated_scene_are_not_placed(mapped_run: Path, tmp_path: Path) -> None:
    queries = unrelated_scene(tmp_path / "elsewhere", 6)
    out = tmp_path / "out"
    result = stream_recon("localise", str(mapped_run), str(queries), "-o", str(out))
    assert result.returncode == EXIT_OK, result.stdout + result.stderr
    found = verdicts(out)
    assert len(found) == 6 and not any(entry["placed"] for entry in found), found
    assert all(entry["reason"] != "placed" for entry in found)
    assert lines(result)[-1].startswith("placed 0 of 6 frames; 6 not placed: "), lines(result)
    written = (out / "poses_tum.txt").read_text().splitlines()
    assert written and all(line.startswith("#") for line in written)  # the header alone


def test_a_run_without_its_pictures_runs_each_query_alone_and_says_so(video: Path, sure_checkpoint: Path,
                                                                       tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    made = stream_recon(str(video), "--checkpoint", str(sure_checkpoint), "-o", str(run_dir), *FLAGS,
                        "--no-save-images")
    assert made.returncode == EXIT_OK, made.stdout + made.stderr
    queries = pictures_of(video, tmp_path / "queries", [5, 13])
    result = stream_recon("localise", str(run_dir), str(queries))
    assert result.returncode == EXIT_OK, result.stdout + result.stderr
    said = lines(result)
    assert len(said) == 2 and "kept no pictures (--no-save-images): each query ran alone" in said[0], said
    assert said[1].startswith("placed ") and " of 2 frames" in said[1]
    record = json.loads((run_dir / "localised" / "verdicts.json").read_text())
    assert "ran alone" in record["context"] and len(record["queries"]) == 2


def test_a_run_that_cannot_serve_is_refused_in_one_line(mapped_run: Path, video: Path, tmp_path: Path,
                                                       sure_checkpoint: Path) -> None:
    queries = pictures_of(video, tmp_path / "queries", [3])
    run_dir = copy_of(mapped_run, tmp_path / "run")
    other = tmp_path / "other.safetensors"
    other.write_bytes(sure_checkpoint.read_bytes()[:-8] + b"        ")
    for args, said in (([str(run_dir), str(tmp_path / "missing.mp4")], "no such file"),
                       ([str(run_dir), str(queries), "--checkpoint", str(other)], "give the same --checkpoint"),
                       ([str(run_dir), str(queries), "-o", str(other)], "give -o a folder")):
        refused = stream_recon("localise", *args)
        assert refused.returncode == EXIT_BAD_INPUT and len(lines(refused)) == 1, refused.stdout + refused.stderr
        assert lines(refused)[0].startswith("error: ") and said in lines(refused)[0], lines(refused)
    assert not (run_dir / "localised").exists()
    (run_dir / MAP_DIR / "map.json").unlink()
    missing = stream_recon("localise", str(run_dir), str(queries))
    assert missing.returncode == EXIT_BAD_INPUT and len(lines(missing)) == 1 and "holds no map" in lines(missing)[0]
    assert not (run_dir / "localised").exists()


def test_localise_is_a_command_with_its_examples() -> None:
    shown = stream_recon("localise", "-h")
    assert shown.returncode == EXIT_OK and "stream-recon localise outputs/kitchen photos/" in shown.stdout


def test_bad_input_is_refused_before_torch_loads(mapped_run: Path, tmp_path: Path) -> None:
    """The run, its map, the checkpoint and the frames are checked with what loads in a fraction of a second;
    torch loads with the model, after them."""
    code = ("import sys\nfrom stream_recon.app.run.localise import localise_run\n"
            "try:\n    localise_run(sys.argv[1], [sys.argv[2]])\n"
            "except Exception as error:\n    print('torch' in sys.modules, error)\n")
    refused = subprocess.run([sys.executable, "-c", code, str(mapped_run), str(tmp_path / "missing.mp4")],
                             capture_output=True, text=True, timeout=120, env=environment())
    assert refused.stdout.startswith("False ") and "no such file" in refused.stdout, refused.stdout + refused.stderr
