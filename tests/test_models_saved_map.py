"""The saved map (models/loops/saved_map.py): written file by file as a run goes, read back up to its last
complete chunk, refused in one line when it cannot serve a run; and a real run's loop closer writing it
(the run loop on the `loop` fixture's stand-in, tests/loop_standin.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from stream_recon.models.loops.saved_map import (
    MAP_DIR,
    MAP_FORMAT,
    MapError,
    MapManifest,
    MapRecorder,
    checkpoint_refusal,
    read_map,
    refusal,
    write_manifest,
)

MANIFEST = MapManifest({"name": "tiny.pt", "bytes": 1000, "sha256": "ab" * 32}, "gradient-grid/128",
                       "sift/2000/0.02", 20, 4)


def recorded(run_dir: Path, chunks: int, solved: bool) -> MapRecorder:
    """A map of `chunks` chunks linked in a row, two keyframes a chunk, a loop from each chunk to chunk 0."""
    recorder = MapRecorder(run_dir / MAP_DIR)
    write_manifest(run_dir / MAP_DIR, MANIFEST)
    rng = np.random.default_rng(0)
    for chunk in range(chunks):
        if chunk:
            recorder.link(chunk, np.eye(4), np.eye(7) * 1e-4)
        for n in range(2):
            frame = 10 * chunk + n
            recorder.keyframe(frame, chunk, np.eye(4)[:3], np.eye(3), (48, 64), rng.normal(size=128),
                              rng.uniform(0, 60, (30, 2)).astype(np.float32),
                              rng.integers(0, 255, (30, 128), dtype=np.uint8), rng.normal(size=(30, 3)), 2.0)
        if chunk >= 2:
            recorder.loop(chunk, chunk, 0, chunk, np.eye(4), np.eye(7) * 1e-4, (0, 10 * chunk))
    if solved:
        recorder.solved(np.tile(np.eye(4), (chunks, 1, 1)), [3])
    return recorder


def test_a_finished_map_reads_back_whole(tmp_path: Path) -> None:
    recorded(tmp_path, 5, solved=True)
    saved = read_map(tmp_path)
    assert saved.complete and saved.num_chunks == 5 and len(saved.keyframes) == 10 and len(saved.loops) == 3
    assert saved.manifest == MANIFEST and saved.accepted == ("3",) and saved.solved.shape == (5, 4, 4)
    assert [k.frame_index for k in saved.keyframes] == sorted(k.frame_index for k in saved.keyframes)
    assert saved.keyframes[0].descriptors.dtype == np.uint8 and saved.keyframes[0].points.shape == (30, 3)


def test_a_killed_runs_map_reads_back_to_its_last_closed_chunk(tmp_path: Path) -> None:
    """No final solve: chunk c counts once chunk c + 2 has its link (its last keyframes come up to the next
    chunk's start); keyframes and loops past it are left out; a temporary file of a write cut short is
    not read."""
    recorded(tmp_path, 5, solved=False)
    (tmp_path / MAP_DIR / "keyframes" / ".000041.npz.x.tmp").write_bytes(b"cut short")
    saved = read_map(tmp_path)
    assert not saved.complete and saved.solved is None
    assert saved.num_chunks == 3  # links 1..4: chunks 0..2 closed and their emissions done; 3 and 4 perhaps not
    assert {k.chunk_index for k in saved.keyframes} == {0, 1, 2} and len(saved.links) == 2
    assert [loop.second for loop in saved.loops] == [2]


def test_a_map_killed_in_its_second_chunk_reads_as_none_yet(tmp_path: Path) -> None:
    recorded(tmp_path, 2, solved=False)
    saved = read_map(tmp_path)
    assert saved.num_chunks == 0 and not saved.keyframes and not saved.loops and not saved.links
    recorded(tmp_path, 3, solved=False)
    saved = read_map(tmp_path)
    assert saved.num_chunks == 1 and {k.chunk_index for k in saved.keyframes} == {0} and not saved.links


def test_a_missing_or_damaged_map_is_one_sentence(tmp_path: Path) -> None:
    with pytest.raises(MapError, match="holds no map") as missing:
        read_map(tmp_path)
    assert "\n" not in str(missing.value)
    recorded(tmp_path, 3, solved=True)
    (tmp_path / MAP_DIR / "keyframes" / "000000.npz").write_bytes(b"not a zip")
    with pytest.raises(MapError, match="cannot be read") as damaged:
        read_map(tmp_path)
    assert "\n" not in str(damaged.value)


def test_a_map_of_another_checkpoint_or_descriptor_is_refused_in_one_line(tmp_path: Path) -> None:
    assert refusal(MANIFEST, MANIFEST, tmp_path) is None
    other = MapManifest({**MANIFEST.checkpoint, "sha256": "cd" * 32}, *list(MANIFEST.as_json().values())[2:6])
    line = refusal(MANIFEST, other, tmp_path)
    assert "checkpoint" in line and "\n" not in line and line.endswith("give the same --checkpoint")
    # a run killed before its checkpoint was hashed: its name and size decide
    unhashed = MapManifest({**MANIFEST.checkpoint, "sha256": None}, *list(MANIFEST.as_json().values())[2:6])
    assert refusal(unhashed, MANIFEST, tmp_path) is None
    assert "descriptor" in refusal(MANIFEST, MapManifest(MANIFEST.checkpoint, "model", MANIFEST.features, 20, 4),
                                   tmp_path)
    newer = MapManifest(MANIFEST.checkpoint, MANIFEST.descriptor, MANIFEST.features, 20, 4, "stream-recon-map/9")
    assert MAP_FORMAT in refusal(newer, MANIFEST, tmp_path)


@pytest.mark.slow
def test_a_runs_loop_closer_writes_its_map_as_it_goes(tmp_path: Path, monkeypatch) -> None:
    """The `loop` fixture's stand-in through the real run loop: the map holds a link per chunk after the
    first, every indexed keyframe with its features and points, every verified loop edge, and the final
    solve, whose accepted loops are run.json's."""
    pytest.importorskip("gtsam")
    from test_app_loop_closure import run_loop_scene

    run_dir, engine = run_loop_scene(tmp_path, monkeypatch, loop_closure="on")
    saved = read_map(run_dir)
    summary = json.loads((run_dir / "run.json").read_text())["summary"]["loop_closure"]
    assert saved.complete and saved.num_chunks == summary["chunks"]
    assert len(saved.keyframes) == summary["keyframes_indexed"]
    verified = [loop for loop in summary["loops"] if loop["status"] in ("accepted", "rejected_by_graph")]
    assert len(saved.loops) == len(verified) >= 2
    assert set(saved.accepted) == {str(loop["loop_id"]) for loop in summary["loops"] if loop["status"] == "accepted"}
    assert saved.manifest.checkpoint["name"] is None  # a caller's model: no checkpoint file
    keyframe = saved.keyframes[0]
    assert len(keyframe.keypoints) == len(keyframe.descriptors) == len(keyframe.points) > 50
    # the stand-in is sure of its depth near the reference's triangulated points only (a quarter of keypoints)
    assert np.isfinite(keyframe.points).all(axis=1).mean() > 0.1 and keyframe.descriptor.shape == (128,)


def test_a_checkpoint_is_refused_by_its_digest_else_by_what_both_sides_know_of_its_name_and_size(tmp_path: Path) -> None:
    made = {"name": "lingbot-map.pt", "bytes": 4_600_000_000, "sha256": "ab" * 32}
    assert checkpoint_refusal(made, dict(made), tmp_path) is None
    assert "sha256 cdcd" in checkpoint_refusal(made, {**made, "sha256": "cd" * 32}, tmp_path)
    assert checkpoint_refusal(made, {**made, "name": "renamed.pt"}, tmp_path) is None  # the digests agree
    unhashed = {**made, "sha256": None}
    assert checkpoint_refusal(unhashed, {"name": "lingbot-map.pt", "bytes": None}, tmp_path) is None
    smaller = checkpoint_refusal(unhashed, {"name": "lingbot-map.pt", "bytes": 1_000}, tmp_path)
    assert "bytes 1000" in smaller and smaller.endswith("give the same --checkpoint") and "\n" not in smaller
    assert "not other.pt" in checkpoint_refusal(unhashed, {"name": "other.pt", "bytes": None}, tmp_path)
