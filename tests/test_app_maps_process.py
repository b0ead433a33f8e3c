"""Maps that outlive a run, through `stream-recon` in real processes: a run with loop closure leaves its map
(killed or not), `refine` rebuilds the run from a finer graph, a stopped refine leaves the run as it was, and a
map that cannot serve a command is refused in one line.

The tiny model with its test weights on a short video that keeps coming back to its places (the `loop`
fixture's pictures, test_app_faults' revisiting_video): what it predicts is not a good map, but every file a
user meets is real.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import FAULT_INSTANTS
from test_app_faults import RUN_FLAGS, revisiting_video

from stream_recon.app.outputs.npz_reading import load_prediction
from stream_recon.app.outputs.rundir import prediction_path
from stream_recon.models.loops.closer import LoopClosureConfig
from stream_recon.models.loops.geometric_check import extract_features
from stream_recon.models.loops.refine import saved_features
from stream_recon.models.loops.saved_map import MAP_DIR, read_map

pytest.importorskip("gtsam")
pytestmark = pytest.mark.slow  # stream-recon processes, each importing torch: seconds each

EXIT_OK, EXIT_BAD_INPUT, EXIT_TERMINATED = 0, 2, 143


def cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "from stream_recon.app.cli import main; main()", *args]


def environment() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def stream_recon(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cli(*args), capture_output=True, text=True, timeout=timeout, env=environment())


def lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]


def contents(folder: Path) -> dict[str, str]:
    """Every file under `folder` (hidden ones too) by its path, as a digest of its bytes."""
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.fixture(scope="module")
def video(tmp_path_factory) -> Path:
    return revisiting_video(tmp_path_factory.mktemp("video") / "revisits.mp4", 48)


@pytest.fixture(scope="module")
def mapped_run(video: Path, tiny_checkpoint: Path, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("mapped") / "run"
    result = stream_recon(str(video), "--checkpoint", str(tiny_checkpoint), "-o", str(run_dir), *RUN_FLAGS)
    assert result.returncode == EXIT_OK, result.stdout + result.stderr
    return run_dir


def copy_of(run_dir: Path, where: Path) -> Path:
    subprocess.run(["cp", "-a", str(run_dir), str(where)], check=True)
    return where


def extended_run(run_dir: Path, video: Path, where: Path, *flags: str) -> tuple[Path, dict[str, str], Path,
                                                                                  subprocess.CompletedProcess]:
    """A copy of `run_dir` (where/earlier: its files' digests as copied) and a run of `video` with `flags` that
    extends its map (`--map`) into where/extended, which must succeed: (earlier, its digests, extended, result)."""
    earlier = copy_of(run_dir, where / "earlier")
    before = contents(earlier)
    extended = where / "extended"
    result = stream_recon(str(video), "-o", str(extended), *flags, "--map", str(earlier))
    assert result.returncode == EXIT_OK, result.stdout + result.stderr
    return earlier, before, extended, result


def test_a_run_with_loop_closure_leaves_its_map(mapped_run: Path, tiny_checkpoint: Path) -> None:
    saved = read_map(mapped_run)
    record = json.loads((mapped_run / "run.json").read_text())
    loops = record["summary"]["loop_closure"]
    assert saved.complete and saved.num_chunks == loops["chunks"] and len(saved.keyframes) == loops["keyframes_indexed"]
    checkpoint = saved.manifest.checkpoint
    assert checkpoint["name"] == tiny_checkpoint.name and checkpoint["bytes"] == tiny_checkpoint.stat().st_size
    assert checkpoint["sha256"] == record["summary"]["checkpoint_digest"]


def test_a_killed_runs_map_reads_back_to_a_complete_chunk(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """SIGKILL in the middle of a long stream: no final solve, and the map reads back to the chunks closed
    by then, each keyframe and link in them whole."""
    run_dir = tmp_path / "run"
    video = revisiting_video(tmp_path / "long.mp4", 600)
    child = subprocess.Popen(cli(str(video), "--checkpoint", str(tiny_checkpoint), "-o", str(run_dir), *RUN_FLAGS),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=environment())
    deadline = time.monotonic() + 240
    links = run_dir / MAP_DIR / "links"
    while not links.is_dir() or len(list(links.glob("*.npz"))) < 5:
        assert child.poll() is None and time.monotonic() < deadline, "the run ended before its fifth link"
        time.sleep(0.02)
    child.kill()
    child.wait(timeout=30)
    saved = read_map(run_dir)
    assert not saved.complete and saved.num_chunks >= 3
    assert all(keyframe.chunk_index < saved.num_chunks for keyframe in saved.keyframes) and saved.keyframes
    assert len(saved.links) == saved.num_chunks - 1


def hidden_entries_after_their_remover(run_dir: Path, wait_s: float = 10.0) -> list[Path]:
    """The hidden entries of `run_dir` once the process removing a refine's earlier files (its own, detached)
    has had `wait_s` to end."""
    deadline = time.monotonic() + wait_s
    while (hidden := [path for path in run_dir.iterdir() if path.name.startswith(".")]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return hidden


def test_refine_rebuilds_the_run_and_records_it(mapped_run: Path, tmp_path: Path) -> None:
    run_dir = copy_of(mapped_run, tmp_path / "run")
    frames_before = sorted(path.name for path in (run_dir / "predictions").glob("*.npz"))
    stream_trajectory = (run_dir / "trajectory_tum.txt").read_bytes()
    result = stream_recon("refine", str(run_dir))
    assert result.returncode == EXIT_OK, result.stdout + result.stderr
    said = lines(result)
    assert len(said) == 1 and said[0].startswith(f"refined {run_dir}:"), said
    record = json.loads((run_dir / "run.json").read_text())
    refine = record["summary"]["refine"]
    assert refine["frames"] == len(frames_before) and refine["keyframes_indexed"] == len(frames_before)
    assert refine["chunks"] == read_map(run_dir).num_chunks and refine["nodes"] >= refine["chunks"]
    assert sorted(path.name for path in (run_dir / "predictions").glob("*.npz")) == frames_before
    assert (run_dir / "trajectory_stream_tum.txt").read_bytes() == stream_trajectory
    assert not hidden_entries_after_their_remover(run_dir)  # no staging left, the earlier files removed
    again = stream_recon("refine", str(run_dir))  # a run is refined once
    assert again.returncode == EXIT_BAD_INPUT and len(lines(again)) == 1 and "refined already" in lines(again)[0]
    exported = stream_recon("export", str(run_dir), "--format", "tum", "-o", str(tmp_path / "refined.txt"))
    assert exported.returncode == EXIT_OK, exported.stderr
    assert (tmp_path / "refined.txt").read_text().splitlines()[1:] == \
        (run_dir / "trajectory_tum.txt").read_text().splitlines()[1:]


@pytest.mark.parametrize("instant", range(FAULT_INSTANTS))
def test_a_refine_stopped_at_any_instant_leaves_the_run_whole(mapped_run: Path, tmp_path: Path, instant: int) -> None:
    """SIGTERM at a seeded instant of the refine (from its start to its last write): the run is exactly as
    it was (exit 143), or refined whole when the signal came after the swap (exit 0 or 143 with the
    refine recorded): never a mix, never a hidden folder left for good."""
    run_dir = copy_of(mapped_run, tmp_path / "run")
    before = contents(run_dir)
    started = time.monotonic()
    reference = stream_recon("refine", str(copy_of(mapped_run, tmp_path / "timed")))
    assert reference.returncode == EXIT_OK, reference.stderr
    whole = time.monotonic() - started
    delay = np.random.default_rng(instant).uniform(0.2, 1.0) * whole
    child = subprocess.Popen(cli("refine", str(run_dir)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=environment())
    time.sleep(delay)
    child.send_signal(signal.SIGTERM)
    output, _ = child.communicate(timeout=60)
    assert "Traceback" not in output, output
    assert child.returncode in (EXIT_OK, EXIT_TERMINATED), output
    assert not hidden_entries_after_their_remover(run_dir)
    record = json.loads((run_dir / "run.json").read_text())
    if "refine" in record["summary"]:
        assert len(list((run_dir / "predictions").glob("*.npz"))) == record["summary"]["refine"]["frames"]
    else:
        assert contents(run_dir) == before


def test_the_maps_keyframe_features_are_those_of_the_runs_pictures(mapped_run: Path) -> None:
    """Refine takes the SIFT features of the keyframes the stream indexed from the map (saved_features) instead
    of computing them again: they must be what the run's saved pictures give."""
    saved = read_map(mapped_run)
    known = saved_features(saved, LoopClosureConfig())
    assert known and set(known) == {keyframe.frame_index for keyframe in saved.keyframes}
    for frame, features in known.items():
        again = extract_features(load_prediction(prediction_path(mapped_run, frame))["image"])
        np.testing.assert_array_equal(features.keypoints, again.keypoints)
        np.testing.assert_array_equal(features.descriptors, again.descriptors)


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid`, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):  # (gone meanwhile)
            continue
    return found


def test_a_refine_whose_worker_process_is_killed_fails_in_one_line_and_leaves_the_run(mapped_run: Path,
                                                                                    tmp_path: Path) -> None:
    """Refine's workers run the frames' files and keyframes' loading in child processes: one killed as soon as
    it starts fails the refine at that child's next call, exit 2 with one line, the run exactly as it was."""
    run_dir = copy_of(mapped_run, tmp_path / "run")
    before = contents(run_dir)
    refine = subprocess.Popen(cli("refine", str(run_dir), "--workers", "2"), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=environment())
    deadline = time.monotonic() + 60
    while not (workers := children_of(refine.pid)) and refine.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert workers, "refine started no child process"
    os.kill(workers[0], signal.SIGKILL)
    output, _ = refine.communicate(timeout=60)
    said = [line for line in output.splitlines() if line.strip()]
    assert refine.returncode == EXIT_BAD_INPUT, output
    assert len(said) == 1 and said[0].startswith("error: refine failed, the run is as it was: a child process of "
                                                 "refine's workers"), said
    assert not hidden_entries_after_their_remover(run_dir)
    assert contents(run_dir) == before


def test_a_run_without_a_map_or_with_an_unknown_one_is_refused_in_one_line(mapped_run: Path, tmp_path: Path) -> None:
    run_dir = copy_of(mapped_run, tmp_path / "run")
    manifest = run_dir / MAP_DIR / "map.json"
    data = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**data, "format": "stream-recon-map/99"}))
    before = contents(run_dir)
    refused = stream_recon("refine", str(run_dir))
    assert refused.returncode == EXIT_BAD_INPUT and len(lines(refused)) == 1, refused.stderr
    assert lines(refused)[0].startswith("error: ") and "stream-recon-map/99" in lines(refused)[0]
    assert contents(run_dir) == before
    (run_dir / MAP_DIR / "map.json").unlink()
    missing = stream_recon("refine", str(run_dir))
    assert missing.returncode == EXIT_BAD_INPUT and len(lines(missing)) == 1 and "holds no map" in lines(missing)[0]
