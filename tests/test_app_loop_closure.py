"""Loop closure end to end on the CPU: the real run loop, real images of the `loop` fixture, and a
stand-in predictor (tests/loop_standin.py: the reference poses with each chunk's alignment drifted).

The run directory is checked as users get it: trajectory_tum.txt corrected towards the reference,
trajectory_open_tum.txt the drifted chain, every npz and points.ply agreeing with the corrected poses,
run.json listing the loop; and a stream without a loop writes exactly what it writes with loop closure
off.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from loop_standin import (
    LoopSceneEngine,
    StandInModel,
    load_loop_scene,
    registered_frames_folder,
    runs_stream_the_loop_scene,
    spread_depth,
    trajectory_error,
)
from plyfile import PlyData

from stream_recon.app.options import RunOptions
from stream_recon.app.outputs.pointcloud import PointAccumulator
from stream_recon.app.outputs.rundir import (
    POINTS_PLY,
    RUN_JSON,
    TRAJECTORY_OPEN_TUM,
    TRAJECTORY_TUM,
    iter_run,
)
from stream_recon.app.outputs.trajectories import read_tum
from stream_recon.app.run import pipeline
from stream_recon.app.run.loops import loop_closure_wanted
from stream_recon.models.stream.pose import decode_pose

pytest.importorskip("gtsam")

CHUNK_FRAMES, OVERLAP = 20, 4
PUSH_PERIOD_S = 0.12  # each push takes as long as a fast model's would on this machine


def run_loop_scene(tmp_path: Path, monkeypatch, *, loop_closure: str, frames: int | None = None,
                   name: str = "run", index_spacing: int = 1) -> tuple[Path, LoopSceneEngine]:
    scene = load_loop_scene()
    engines = runs_stream_the_loop_scene(monkeypatch, scene, chunk_frames=CHUNK_FRAMES, overlap=OVERLAP,
                                         period_s=PUSH_PERIOD_S, index_spacing=index_spacing)
    source = tmp_path / "frames"
    if not source.exists():
        registered_frames_folder(scene, source)
    options = RunOptions(device="cpu", viewer=False, chunk_frames=CHUNK_FRAMES, overlap=OVERLAP,
                         loop_closure=loop_closure, fps=10.0, max_frames=frames)
    summary = pipeline.run_sequence(source, tmp_path / name, options, model=StandInModel())
    assert summary.ok, summary.error
    return tmp_path / name, engines[0]


@pytest.fixture(scope="module")
def closed_run(tmp_path_factory) -> tuple[Path, LoopSceneEngine]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        return run_loop_scene(tmp_path_factory.mktemp("loop"), monkeypatch, loop_closure="on")


@pytest.mark.slow
def test_the_run_directory_holds_the_corrected_trajectory_and_keeps_the_open_one(closed_run) -> None:
    run_dir, engine = closed_run
    reference = load_loop_scene().c2w
    _, corrected = read_tum(run_dir / TRAJECTORY_TUM)
    _, open_chain = read_tum(run_dir / TRAJECTORY_OPEN_TUM)
    open_error, corrected_error = trajectory_error(open_chain, reference), trajectory_error(corrected, reference)
    # the open chain is the stand-in's drifted emission, as without loop closure
    expected_open = np.stack([engine.chain[chunk].apply_to_poses(reference[i])
                              for i, chunk in enumerate(final_chunks(engine))])
    np.testing.assert_allclose(open_chain[:, :3, 3], expected_open[:, :3, 3], atol=1e-4)
    assert corrected_error < 0.5 * open_error, (corrected_error, open_error)
    # within the stand-in's noise: less than one rollover's translation error (its standard deviation)
    assert corrected_error < engine.sigmas[3], (corrected_error, engine.sigmas[3])


def final_chunks(engine: LoopSceneEngine) -> list[int]:
    """The chunk of each frame's final emission: the later chunk for frames two chunks share."""
    step = CHUNK_FRAMES - OVERLAP  # chunk c starts at frame c * step
    return [min(frame // step, engine.chunk_index) for frame in range(engine.num_frames)]


def test_run_json_lists_the_loop_and_its_correction(closed_run) -> None:
    run_dir, _ = closed_run
    loops = json.loads((run_dir / RUN_JSON).read_text())["summary"]["loop_closure"]
    assert loops["mode"] == "on" and loops["error"] is None
    accepted = [loop for loop in loops["loops"] if loop["status"] == "accepted"]
    assert accepted and loops["accepted"] == len(accepted)
    covisible = reference_covisible_pairs()
    scene = load_loop_scene()
    for loop in accepted:
        assert loop["query_chunk"] - loop["candidate_chunk"] >= 2
        pair = tuple(sorted((scene.frames[loop["query_frame"]], scene.frames[loop["candidate_frame"]])))
        assert pair in covisible, pair  # the two views see the same place
        assert loop["inliers"] >= 20 and loop["verification"]["passed"]
        assert loop["correction"]["rotation_deg"] > 0
    for stage in ("features", "retrieval_and_check", "verification", "pose_graph"):
        assert loops["costs_ms"][stage]["calls"] >= 1
    # every helper that ran beside the stream, up to the end (a run on the CPU builds nothing ahead, and
    # this one shows no viewer)
    helpers = json.loads((run_dir / RUN_JSON).read_text())["summary"]["helpers"]
    assert sorted(helpers) == ["child_monitor", "loop_closure", "progress", "reader", "writer"], helpers
    assert all(h["up"] for h in helpers.values()), helpers


def reference_covisible_pairs() -> set[tuple[int, int]]:
    table = json.loads((Path(__file__).parent / "data" / "loop" / "reference_covisibility.json").read_text())
    return {(a, b) for a, b, shared in table["shared_points"] if shared >= 10}


@pytest.mark.slow
def test_every_npz_agrees_with_the_corrected_trajectory(closed_run) -> None:
    run_dir, engine = closed_run
    _, corrected = read_tum(run_dir / TRAJECTORY_TUM)
    scene = load_loop_scene()
    for stored in iter_run(run_dir):
        frame = stored["frame_index"]
        np.testing.assert_allclose(stored["c2w"], corrected[frame][:3], atol=2e-5)
        height, width = stored["depth"].shape
        c2w, _ = decode_pose(torch.from_numpy(stored["pose_enc"]), height, width)
        np.testing.assert_allclose(c2w.numpy(), stored["c2w"], atol=2e-5)
        # depth scaled with the camera: the correction's scale times the chain's, over the true depth
        true_depth, _ = spread_depth(scene.samples[scene.frames[frame]], height, width)
        depth_scale = np.median(stored["depth"] / true_depth)
        expected = corrected_scale(run_dir, engine, frame)
        assert depth_scale == pytest.approx(expected, rel=2e-3)


def corrected_scale(run_dir: Path, engine: LoopSceneEngine, frame: int) -> float:
    """The scale the stand-in's chain and the closure's correction give a frame's chunk."""
    chunk = final_chunks(engine)[frame]
    loops = json.loads((run_dir / RUN_JSON).read_text())["summary"]["loop_closure"]
    assert loops["corrected_chunks"] >= 1
    _, open_chain = read_tum(run_dir / TRAJECTORY_OPEN_TUM)
    _, corrected = read_tum(run_dir / TRAJECTORY_TUM)
    # the correction of the frame's chunk, from two of its frames' camera centres' spread
    frames = [f for f, c in enumerate(final_chunks(engine)) if c == chunk]
    spread = np.linalg.norm(corrected[frames[0], :3, 3] - corrected[frames[-1], :3, 3])
    open_spread = np.linalg.norm(open_chain[frames[0], :3, 3] - open_chain[frames[-1], :3, 3])
    return engine.chain[chunk].scale * spread / open_spread


def test_points_ply_is_the_cloud_of_the_corrected_predictions(closed_run) -> None:
    run_dir, _ = closed_run
    ply = PlyData.read(str(run_dir / POINTS_PLY))["vertex"]
    written = np.stack([ply["x"], ply["y"], ply["z"]], axis=1)
    rebuilt = PointAccumulator()
    for stored in iter_run(run_dir):
        rebuilt.add_frame(stored["frame_index"], stored["depth"], stored["depth_conf"], stored["intrinsics"],
                          stored["c2w"], stored.get("image"))
    from scipy.spatial import cKDTree

    distance, _ = cKDTree(rebuilt.cloud().xyz).query(written)
    # one point per voxel, chosen before (the run) or after (here) the correction: within a voxel's diagonal
    assert np.quantile(distance, 0.99) <= 2 * np.sqrt(3) * rebuilt.voxel_size


@pytest.mark.slow
def test_a_stream_without_a_loop_writes_exactly_what_loop_closure_off_writes_and_its_map(tmp_path: Path, monkeypatch) -> None:
    # 50 frames reach a third chunk (frame 32 on) but the walk has not come back yet
    closing, _ = run_loop_scene(tmp_path, monkeypatch, loop_closure="on", frames=50, name="on")
    plain, _ = run_loop_scene(tmp_path, monkeypatch, loop_closure="off", frames=50, name="off")
    loops = json.loads((closing / RUN_JSON).read_text())["summary"]["loop_closure"]
    assert loops["mode"] == "on" and loops["accepted"] == 0 and loops["keyframes_indexed"] == 50
    assert json.loads((plain / RUN_JSON).read_text())["summary"]["loop_closure"]["mode"] == "off (--loop-closure off)"
    assert not (closing / TRAJECTORY_OPEN_TUM).exists()
    names = sorted(p.relative_to(plain) for p in plain.rglob("*") if p.is_file() and p.name != RUN_JSON)
    # the same files, and the saved map beside them (models/loops/saved_map.py)
    assert (closing / "map" / "map.json").is_file() and not (plain / "map").exists()
    assert names == sorted(p.relative_to(closing) for p in closing.rglob("*")
                           if p.is_file() and p.name != RUN_JSON and p.relative_to(closing).parts[0] != "map")
    for name in names:
        assert (plain / name).read_bytes() == (closing / name).read_bytes(), name


@pytest.mark.slow
def test_run_json_records_which_keyframes_were_indexed(tmp_path: Path, monkeypatch) -> None:
    # every frame is a keyframe; one in 8 is indexed: frames 0, 8, ..., 48 of 50
    run_dir, _ = run_loop_scene(tmp_path, monkeypatch, loop_closure="on", frames=50, index_spacing=8)
    loops = json.loads((run_dir / RUN_JSON).read_text())["summary"]["loop_closure"]
    assert loops["keyframes_indexed"] == 7 and loops["keyframes_deferred"] == 0
    assert loops["index_spacing"] == {"start": 8, "end": 8}
    assert loops["indexed_per_100_frames"] == pytest.approx(14.0)
    assert loops["longest_unindexed_stretch"] == 7


def test_auto_closes_loops_only_where_a_third_chunk_can_come() -> None:
    options = RunOptions(chunk_frames=20, overlap=4)
    assert loop_closure_wanted(options, None) == (True, "on (auto)")  # a live camera: no known end
    assert loop_closure_wanted(options, 33) == (True, "on (auto)")
    wanted, reason = loop_closure_wanted(options, 32)
    assert not wanted and "third chunk" in reason
    assert loop_closure_wanted(RunOptions(loop_closure="on", chunk_frames=20, overlap=4), 10) == (True, "on")
    assert loop_closure_wanted(RunOptions(loop_closure="off"), None) == (False, "off (--loop-closure off)")
