"""`stream-recon run VIDEO --map RUN` in real processes: a second run extends the map of a first one (the
same revisiting video, so that its keyframes find the map's), the first run's folder is never written, and
a map that cannot serve the run is refused in one line before the model loads.

The tiny model with its test weights (test_app_maps_process's runs): a map of little worth (no depth it is
sure of, so no loop is ever verified), but every file a user meets is real.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_app_faults import RUN_FLAGS
from test_app_maps_process import (  # noqa: F401 - the module's fixtures
    EXIT_BAD_INPUT,
    EXIT_OK,
    contents,
    copy_of,
    extended_run,
    lines,
    mapped_run,
    stream_recon,
    video,
)

from stream_recon.models.loops.saved_map import MAP_DIR, read_map

pytest.importorskip("gtsam")
pytestmark = pytest.mark.slow  # stream-recon processes, each importing torch: seconds each


def test_a_second_run_extends_the_first_runs_map_and_leaves_it_as_it_was(
        mapped_run: Path, video: Path, tiny_checkpoint: Path, tmp_path: Path) -> None:  # noqa: F811
    earlier, before, extended, result = extended_run(mapped_run, video, tmp_path, "--checkpoint", str(tiny_checkpoint),
                                                     *RUN_FLAGS, "--start", "3")
    assert contents(earlier) == before
    record = json.loads((extended / "run.json").read_text())
    assert record["settings"]["extend_map"] == str(earlier)
    account = record["summary"]["loop_closure"]["map"]
    # the tiny model's depth is never confident: its loops to the map are checked and never verified, so the
    # run stays in its own frame and says so in one line (placement itself: test_models_loop_extend_map.py)
    assert not account["placed"] and account["note"] in " ".join(lines(result)), account
    manifest = read_map(extended).manifest
    assert manifest.extends == str(earlier.resolve())


def test_a_map_that_cannot_serve_the_run_is_refused_in_one_line_before_the_model(
        mapped_run: Path, video: Path, tiny_checkpoint: Path, tmp_path: Path) -> None:  # noqa: F811
    earlier = copy_of(mapped_run, tmp_path / "earlier")
    other_checkpoint = tmp_path / "other.safetensors"
    other_checkpoint.write_bytes(tiny_checkpoint.read_bytes())
    refused = stream_recon(str(video), "-o", str(tmp_path / "new"), *RUN_FLAGS, "--checkpoint", str(other_checkpoint),
                           "--map", str(earlier))
    assert refused.returncode == EXIT_BAD_INPUT and len(lines(refused)) == 1, refused.stdout + refused.stderr
    assert lines(refused)[0].startswith("error: ") and "made with checkpoint" in lines(refused)[0]
    (earlier / MAP_DIR / "map.json").unlink()
    without = stream_recon(str(video), "-o", str(tmp_path / "new"), *RUN_FLAGS, "--checkpoint", str(tiny_checkpoint),
                           "--map", str(earlier))
    assert without.returncode == EXIT_BAD_INPUT and len(lines(without)) == 1 and "holds no map" in lines(without)[0]
    same = stream_recon(str(video), "-o", str(earlier), "--overwrite", *RUN_FLAGS, "--checkpoint",
                        str(tiny_checkpoint), "--map", str(earlier))
    assert same.returncode == EXIT_BAD_INPUT and len(lines(same)) == 1 and "output folder too" in lines(same)[0]
    off = [flag if flag != "on" else "off" for flag in RUN_FLAGS]
    closed = stream_recon(str(video), "-o", str(tmp_path / "new"), *off, "--checkpoint", str(tiny_checkpoint),
                          "--map", str(mapped_run))
    assert closed.returncode == EXIT_BAD_INPUT and len(lines(closed)) == 1 and "--loop-closure off" in lines(closed)[0]
    assert not (tmp_path / "new").exists()
