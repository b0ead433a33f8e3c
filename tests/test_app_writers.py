import contextlib
import errno
import json
import logging
import math
import os
import stat
import threading
import time
import tracemalloc

import numpy as np
import pytest
import trimesh
from conftest import symlink_and_fifo
from helpers import read_run, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st
from plyfile import PlyData
from synthetic_run import CONF_HIGH, LOW_CONF_COLUMNS, PLANE_Z, STEP_X, plane_frame, quat_xyzw_to_matrix

from stream_recon.app.options import OptionsError, RunOptions
from stream_recon.app.outputs import writers
from stream_recon.app.outputs.atomic_writes import OutputPathError
from stream_recon.app.outputs.json_records import write_json_atomic
from stream_recon.app.outputs.npz_reading import load_prediction
from stream_recon.app.outputs.npz_schema import PREDICTION_FIELDS, PredictionOutputs
from stream_recon.app.outputs.output_folder import OutputDirError
from stream_recon.app.outputs.pointcloud import PointAccumulator, _back_project_pixels
from stream_recon.app.outputs.rundir import RunDirError, iter_run, prediction_path
from stream_recon.app.outputs.writers import RunWriter
from stream_recon.models.loops.corrections import ChunkCorrections
from stream_recon.models.stream.prediction import FRAME_NON_KEY
from stream_recon.models.stream.similarity import Sim3

NPZ_KEYS = set(PREDICTION_FIELDS)


def write_run(run_dir, frames, *, status="complete", **kwargs):
    writer = RunWriter(run_dir, {"source": "synthetic", "checkpoint_digest": "sha256:abc123"}, **kwargs)
    for i, frame in enumerate(frames):
        writer.on_frame(frame, {"frames": i + 1, "cache_bytes": 1024 * (i + 1)})
    writer.close(status, {"device": "cpu", "fps": 12.5})
    return writer


def parse_tum_strictly(path):
    """Independent TUM reader: '#' comments, otherwise exactly 8 finite floats per row."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("#"):
            continue
        fields = line.split(" ")
        assert len(fields) == 8, f"line {number}: {len(fields)} fields"
        values = [float(field) for field in fields]
        assert all(math.isfinite(value) for value in values), f"line {number}"
        rows.append(values)
    return np.array(rows)


def test_complete_run_directory(tmp_path):
    frames = [plane_frame(i) for i in range(7)]
    write_run(tmp_path / "run", frames)

    names = sorted(p.name for p in (tmp_path / "run" / "predictions").iterdir())
    assert names == [f"{i:06d}.npz" for i in range(7)]
    with np.load(prediction_path(tmp_path / "run", 3)) as data:
        assert set(data.files) == NPZ_KEYS | {"image"}
        assert data["pose_enc"].shape == (9,) and data["c2w"].shape == (3, 4)
        assert data["intrinsics"].shape == (3, 3) and data["depth"].shape == (24, 32)
        assert data["depth_conf"].shape == (24, 32) and data["image"].shape == (24, 32, 3)
        assert data["image"].dtype == np.uint8
        assert data["image_size"].tolist() == [24, 32]
        assert int(data["frame_index"]) == 3 and float(data["timestamp"]) == frames[3].timestamp
        # by default depth and confidence are stored in half precision; everything else as computed
        assert data["depth"].dtype == data["depth_conf"].dtype == np.float16
        np.testing.assert_array_equal(data["depth"], frames[3].depth.astype(np.float16))
        np.testing.assert_array_equal(data["c2w"], frames[3].c2w)

    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["status"] == "complete"
    assert info["settings"]["source"] == "synthetic"
    summary = info["summary"]
    assert summary["frames"] == 7
    assert summary["keyframes"] == sum(f.is_keyframe for f in frames) == 5
    assert summary["checkpoint_digest"] == "sha256:abc123"
    assert summary["device"] == "cpu" and summary["fps"] == 12.5
    assert set(summary["versions"]) == {"python", "torch", "numpy", "stream-recon"}
    assert summary["started_at"] <= summary["ended_at"]
    assert summary["peak_host_memory_bytes"] > 0
    assert summary["engine"] == {"frames": 7, "cache_bytes": 7 * 1024}


def test_frames_without_image_are_written_without_the_key(tmp_path):
    write_run(tmp_path / "run", [plane_frame(i, with_image=False) for i in range(2)])
    with np.load(prediction_path(tmp_path / "run", 1)) as data:
        assert set(data.files) == NPZ_KEYS
    cloud = PlyData.read(str(tmp_path / "run" / "points.ply"))["vertex"]
    assert len(cloud) > 0 and (cloud["red"] == 200).all()


@pytest.mark.parametrize("depth", ["float16", "float32"])
@pytest.mark.parametrize("images", [True, False])
def test_output_options_round_trip_through_the_reader(tmp_path, depth, images):
    frames = [plane_frame(i) for i in range(4)]
    frames[2].depth[0, 0] = 1e6  # beyond float16: stored as its largest value
    frames[2].depth_conf[0, 1] = np.nan
    write_run(tmp_path / "run", frames, outputs=PredictionOutputs(depth=depth, images=images))

    for frame in frames:
        path = prediction_path(tmp_path / "run", frame.frame_index)
        with np.load(path) as data:
            assert data["depth"].dtype == data["depth_conf"].dtype == np.dtype(depth)
            assert ("image" in data.files) == images
        record = load_prediction(path)
        assert record["depth"].dtype == record["depth_conf"].dtype == np.float32  # either way
        assert (record["image"] is not None) == images
        if images:
            np.testing.assert_array_equal(record["image"], frame.image)
        np.testing.assert_array_equal(record["c2w"], frame.c2w)
        for key in ("depth", "depth_conf"):
            written, computed = record[key], getattr(frame, key)
            np.testing.assert_array_equal(np.isnan(written), np.isnan(computed))
            if depth == "float32":
                np.testing.assert_array_equal(written, computed)
            else:
                clipped = np.minimum(computed, np.finfo(np.float16).max)
                np.testing.assert_allclose(written, clipped, rtol=2.0**-11, atol=0)
    assert load_prediction(prediction_path(tmp_path / "run", 2))["depth"][0, 0] == {"float16": 65504, "float32": 1e6}[depth]


def test_float16_storage_error_on_the_golden_outputs_is_within_its_bound():
    """The official fp32 outputs (fixtures a-c) stored as --save-depth float16 and read back: every value
    within 2**-11 relative; the error in the fixtures' own unit (max |error| / std) is what docs quote."""
    from golden_utils import GOLDEN, relative_error

    for scenario in ("all_keyframes", "interval_2", "flow"):
        golden = np.load(GOLDEN / scenario / "outputs.npz")
        computed = {key: golden[key].astype(np.float32) for key in ("depth", "depth_conf")}
        stored = PredictionOutputs(depth="float16").stored(computed)
        for key in ("depth", "depth_conf"):
            assert stored[key].dtype == np.float16
            read_back, computed_values = stored[key].astype(np.float32), computed[key]
            np.testing.assert_allclose(read_back, computed_values, rtol=2.0**-11, atol=0)
            # In the fixtures' unit this is 0.30 sigma (depth) and 0.40 (confidence): the synthetic weights
            # give nearly flat maps (std 0.16% of the mean), so 0.049% of rounding is a large share of
            # it. A real scene's depth varies by tens of percent: there it is ~0.002 sigma.
            error = relative_error(read_back, computed_values)
            print(f"{scenario} {key}: float16 storage error {error:.2e} sigma")
            assert error < 0.45


def test_keyframes_only_run_keeps_every_pose_and_removes_a_demoted_frame(tmp_path):
    frames = [plane_frame(i) for i in range(7)]  # frames 2 and 5 are not keyframes
    writer = RunWriter(tmp_path / "run", {}, outputs=PredictionOutputs(frames="keyframes"))
    for frame in frames:
        writer.on_frame(frame, {})
    # a windowed stream re-emits frame 3, no longer a keyframe: its earlier file must go
    writer.on_frame(plane_frame(3, frame_type=FRAME_NON_KEY), {})
    writer.close("complete")

    written = [record["frame_index"] for record in read_run(tmp_path / "run")]
    assert written == [0, 1, 4, 6]
    tum = parse_tum_strictly(tmp_path / "run" / "trajectory_tum.txt")
    assert len(tum) == 7  # every frame's pose
    assert len(PlyData.read(str(tmp_path / "run" / "points.ply"))["vertex"]) == len(writer.points) > 0


def test_output_options_are_checked():
    with pytest.raises(ValueError, match="--save-depth must be one of float16, float32, got 'float8'"):
        PredictionOutputs(depth="float8")
    with pytest.raises(ValueError, match="--save-predictions must be one of all, keyframes, got 'some'"):
        PredictionOutputs(frames="some")
    # as run options (flags, presets), with every other problem named at once, before anything runs
    with pytest.raises(OptionsError, match="--stride must be >= 1, got 0; --save-depth must be one of float16, float32"):
        RunOptions(save_depth="half", stride=0)
    options = RunOptions(save_depth="float32", save_images=False, save_predictions="keyframes")
    assert options.prediction_outputs() == PredictionOutputs(depth="float32", images=False, frames="keyframes")
    assert RunOptions().prediction_outputs() == PredictionOutputs()  # one default, in one place


def test_tum_trajectory_is_camera_to_world_sorted_by_frame(tmp_path):
    frames = [plane_frame(i) for i in range(6)]
    # Emitted out of order (as a windowed stream may): the file is still sorted by frame index.
    write_run(tmp_path / "run", [frames[i] for i in (0, 1, 4, 2, 5, 3)])

    rows = parse_tum_strictly(tmp_path / "run" / "trajectory_tum.txt")
    loaded = np.loadtxt(tmp_path / "run" / "trajectory_tum.txt")  # numpy's reader agrees
    np.testing.assert_allclose(loaded, rows)
    np.testing.assert_allclose(rows[:, 0], [f.timestamp for f in frames], atol=1e-6)
    for row, frame in zip(rows, frames, strict=True):
        np.testing.assert_allclose(row[1:4], frame.c2w[:, 3], atol=1e-6)
        np.testing.assert_allclose(quat_xyzw_to_matrix(row[4:8]), frame.c2w[:, :3], atol=1e-6)


def test_points_are_confident_on_the_plane_and_one_per_voxel(tmp_path):
    voxel = 0.05
    # depth as computed: float16 storage would move points off the plane by up to 2**-11 of their depth
    write_run(tmp_path / "run", [plane_frame(i) for i in range(5)], voxel_size=voxel,
              outputs=PredictionOutputs(depth="float32"))
    path = tmp_path / "run" / "points.ply"

    ply = PlyData.read(str(path))
    assert not ply.text and ply.byte_order == "<"
    vertex = ply["vertex"]
    xyz = np.stack([vertex["x"], vertex["y"], vertex["z"]], axis=1)
    np.testing.assert_allclose(xyz[:, 2], PLANE_Z, atol=1e-4)
    # Red encodes the source column: the low-confidence columns never make it into the cloud.
    assert vertex["red"].min() >= 8 * LOW_CONF_COLUMNS
    cells = np.floor(xyz.astype(np.float64) / voxel).astype(np.int64)
    assert len(np.unique(cells, axis=0)) == len(xyz)

    mesh = trimesh.load(path)  # a second, independent reader
    assert isinstance(mesh, trimesh.PointCloud)
    np.testing.assert_allclose(mesh.vertices, xyz, atol=1e-6)
    np.testing.assert_array_equal(
        mesh.colors[:, :3], np.stack([vertex[c] for c in ("red", "green", "blue")], 1)
    )


def test_run_json_says_running_until_closed_and_frames_stay_readable(tmp_path):
    writer = RunWriter(tmp_path / "run", {"source": "live"})
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "running"
    for i in range(3):
        writer.on_frame(plane_frame(i), {})
    writer.flush()
    # The process "dies" here: nothing closes the writer.
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["status"] == "running" and info["summary"]["ended_at"] is None
    assert [r["frame_index"] for r in read_run(tmp_path / "run")] == [0, 1, 2]
    assert not (tmp_path / "run" / "trajectory_tum.txt").exists()


def test_progress_is_recorded_in_run_json_while_running(tmp_path, monkeypatch):
    writer = RunWriter(tmp_path / "run", {}, progress_interval_s=0.0)
    writer.on_frame(plane_frame(0), {})
    writer.on_frame(plane_frame(1), {})
    writer.flush()
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["status"] == "running" and info["summary"]["frames"] == 2


@pytest.mark.parametrize("status", ["interrupted", "failed"])
def test_interrupted_and_failed_runs_still_write_outputs(tmp_path, status):
    write_run(tmp_path / "run", [plane_frame(i) for i in range(3)], status=status)
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == status
    assert len(parse_tum_strictly(tmp_path / "run" / "trajectory_tum.txt")) == 3
    assert len(PlyData.read(str(tmp_path / "run" / "points.ply"))["vertex"]) > 0


def test_close_checks_status_and_keeps_the_first_final_status(tmp_path):
    writer = RunWriter(tmp_path / "run", {})
    with pytest.raises(ValueError, match="status must be one of complete, interrupted, failed; got 'done'"):
        writer.close("done")
    writer.close("interrupted")
    writer.close("complete")
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "interrupted"
    with pytest.raises(RuntimeError, match="closed"):
        writer.on_frame(plane_frame(0), {})


def test_empty_run_writes_empty_trajectory_and_cloud(tmp_path):
    write_run(tmp_path / "run", [])
    assert parse_tum_strictly(tmp_path / "run" / "trajectory_tum.txt").shape == (0,)
    assert len(PlyData.read(str(tmp_path / "run" / "points.ply"))["vertex"]) == 0
    assert json.loads((tmp_path / "run" / "run.json").read_text())["summary"]["frames"] == 0


def test_reemitted_frame_overwrites_file_pose_and_points(tmp_path):
    shifted = np.array([0.0, 50.0, 0.0])
    frames = [plane_frame(i) for i in range(4)]
    frames.append(plane_frame(2, offset=shifted, chunk_index=1))
    writer = write_run(tmp_path / "run", frames, voxel_size=0.05)

    records = read_run(tmp_path / "run")
    assert [r["frame_index"] for r in records] == [0, 1, 2, 3]
    assert records[2]["chunk_index"] == 1
    np.testing.assert_allclose(records[2]["c2w"][:, 3], [2 * STEP_X, 50.0, 0.0], atol=1e-6)
    rows = parse_tum_strictly(tmp_path / "run" / "trajectory_tum.txt")
    np.testing.assert_allclose(rows[:, 2], [0.0, 0.0, 50.0, 0.0], atol=1e-6)
    cloud = writer.points.cloud()
    from_frame_2 = cloud.xyz[cloud.frame_index == 2]
    assert len(from_frame_2) > 0 and (from_frame_2[:, 1] > 40).all()
    assert (cloud.xyz[cloud.frame_index != 2][:, 1] < 10).all()


def test_crash_during_write_leaves_previous_file_and_no_temp(tmp_path, monkeypatch):
    writer = RunWriter(tmp_path / "run", {}, background=False)
    writer.on_frame(plane_frame(0), {})
    before = prediction_path(tmp_path / "run", 0).read_bytes()

    def dying_savez(file, **arrays):
        file.write(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez", dying_savez)
    with pytest.raises(KeyboardInterrupt):
        writer.on_frame(plane_frame(0, offset=np.array([1.0, 0, 0])), {})
    with pytest.raises(KeyboardInterrupt):
        writer.on_frame(plane_frame(1), {})
    assert prediction_path(tmp_path / "run", 0).read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "run" / "predictions").iterdir()) == ["000000.npz"]


def test_read_run_ignores_leftover_temp_files(tmp_path, caplog):
    write_run(tmp_path / "run", [plane_frame(i) for i in range(3)])
    # What a process killed between mkstemp and os.replace leaves behind.
    (tmp_path / "run" / "predictions" / ".000003.npz.k2j4_x.tmp").write_bytes(b"PK\x03\x04 partial")
    with caplog.at_level(logging.WARNING):
        assert [r["frame_index"] for r in read_run(tmp_path / "run")] == [0, 1, 2]
    assert caplog.records == []


def test_read_run_skips_a_truncated_last_file_with_a_warning(tmp_path, caplog):
    write_run(tmp_path / "run", [plane_frame(i) for i in range(4)])
    last = prediction_path(tmp_path / "run", 3)
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="stream_recon.app.outputs.writers"):
        records = read_run(tmp_path / "run")
    assert [r["frame_index"] for r in records] == [0, 1, 2]
    assert "skipping frame 3" in caplog.text and "000003.npz" in caplog.text


def test_read_run_skips_an_npz_without_the_required_keys(tmp_path, caplog):
    write_run(tmp_path / "run", [plane_frame(0)])
    np.savez(prediction_path(tmp_path / "run", 1), depth=np.zeros((2, 2)))
    with caplog.at_level(logging.WARNING, logger="stream_recon.app.outputs.writers"):
        records = list(iter_run(tmp_path / "run"))
    assert [r["frame_index"] for r in records] == [0]
    assert "lacks frame_index" in caplog.text


def test_read_run_round_trips_types(tmp_path):
    frame = plane_frame(5)
    write_run(tmp_path / "run", [frame])
    (record,) = read_run(tmp_path / "run")
    assert record["frame_index"] == 5 and isinstance(record["frame_index"], int)
    assert record["is_keyframe"] is frame.is_keyframe
    assert record["timestamp"] == pytest.approx(frame.timestamp)
    np.testing.assert_array_equal(record["image"], frame.image)


def test_read_run_on_a_missing_or_foreign_directory(tmp_path):
    with pytest.raises(RunDirError, match="does not exist"):
        read_run(tmp_path / "nope")
    with pytest.raises(RunDirError, match="has no predictions/ folder"):
        read_run(tmp_path)


def test_unwritable_output_dir_fails_at_construction(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(OutputDirError, match=r"cannot write to the output directory .*a_file/run"):
        RunWriter(blocker / "run", {})
    with pytest.raises(OutputDirError, match="exists and is not a directory"):
        RunWriter(blocker, {})
    assert blocker.read_text() == "not a directory"


def test_existing_run_is_not_mixed_with_a_new_one(tmp_path):
    write_run(tmp_path / "run", [plane_frame(i) for i in range(5)])
    with pytest.raises(OutputDirError, match="already holds a run .* pass --overwrite"):
        RunWriter(tmp_path / "run", {})
    assert len(read_run(tmp_path / "run")) == 5  # the refusal deleted nothing
    write_run(tmp_path / "run", [plane_frame(i) for i in range(2)], overwrite=True)
    assert [r["frame_index"] for r in read_run(tmp_path / "run")] == [0, 1]
    assert json.loads((tmp_path / "run" / "run.json").read_text())["summary"]["frames"] == 2


def test_accumulator_points_reproject_onto_their_source_pixels():
    acc = PointAccumulator(voxel_size=0.02)
    frames = [plane_frame(i) for i in range(3)]
    for f in frames:
        acc.add_frame(f.frame_index, f.depth, f.depth_conf, f.intrinsics, f.c2w, f.image)
    cloud = acc.cloud()
    assert len(cloud) > 0 and set(np.unique(cloud.frame_index)) == {0, 1, 2}
    for f in frames:
        mine = cloud.frame_index == f.frame_index
        rotation, centre = f.c2w[:, :3].astype(np.float64), f.c2w[:, 3].astype(np.float64)
        camera = (cloud.xyz[mine] - centre) @ rotation  # world -> camera: R^T (x - c)
        uv = camera @ f.intrinsics.T.astype(np.float64)
        np.testing.assert_allclose(uv[:, :2] / uv[:, 2:], cloud.pixel[mine], atol=2e-3)
        np.testing.assert_array_equal(cloud.rgb[mine][:, 0], 8 * cloud.pixel[mine][:, 0])


def test_accumulator_automatic_voxel_follows_the_first_frame_depth():
    acc = PointAccumulator()
    f = plane_frame(0, yaw=0.0)
    acc.add_frame(0, f.depth, f.depth_conf, f.intrinsics, f.c2w, f.image)
    assert acc.voxel_size == pytest.approx(float(np.median(f.depth)) / 200)


def test_accumulator_samples_pixels_about_one_voxel_apart_and_misses_no_voxel_there():
    # the model's input size and a 60-degree lens: the automatic voxel is ~2.2 pixels at the median depth
    frame = plane_frame(0, height=378, width=518, focal=448.0, yaw=0.0)
    acc = PointAccumulator()
    acc.add_frame(0, frame.depth, frame.depth_conf, frame.intrinsics, frame.c2w, frame.image)
    assert acc.pixel_step(frame.intrinsics) == 2
    # every confident pixel's voxel, as a step of 1 would fill them
    v, u = np.nonzero(frame.depth_conf >= acc.conf_threshold)
    every, _ = acc._voxel_keys(_back_project_pixels(u, v, frame.depth[v, u], frame.intrinsics, frame.c2w))
    sampled = set(acc._keys[: len(acc)].tolist())
    assert sampled <= set(every.tolist())
    assert len(sampled) >= 0.95 * len(set(every.tolist()))  # the border voxels of the sampled grid differ
    # a voxel smaller than a pixel samples every pixel; coarsening doubles the step
    fine = PointAccumulator(voxel_size=0.001)
    fine.add_frame(0, frame.depth, frame.depth_conf, frame.intrinsics, frame.c2w, frame.image)
    assert fine.pixel_step(frame.intrinsics) == 1
    acc.voxel_size *= 2
    assert acc.pixel_step(frame.intrinsics) == 4


def test_accumulator_ignores_frames_without_confident_pixels():
    acc = PointAccumulator(conf_threshold=CONF_HIGH + 1)
    f = plane_frame(0)
    acc.add_frame(0, f.depth, f.depth_conf, f.intrinsics, f.c2w, f.image)
    assert len(acc) == 0 and acc.voxel_size is None


def test_accumulator_is_capped_by_coarsening():
    acc = PointAccumulator(voxel_size=0.001, max_points=300)
    for i in range(60):
        f = plane_frame(i, offset=np.array([0.0, 3.0 * i, 0.0]))  # no two frames overlap
        acc.add_frame(i, f.depth, f.depth_conf, f.intrinsics, f.c2w, f.image)
        assert len(acc) <= 300
    assert acc.num_coarsenings > 0 and acc.voxel_size == pytest.approx(0.001 * 2**acc.num_coarsenings)
    cells = np.floor(acc.cloud().xyz.astype(np.float64) / acc.voxel_size).astype(np.int64)
    assert len(np.unique(cells, axis=0)) == len(acc)
    # Coarsening thins old frames too, but keeps some of them: memory is bounded, history is not dropped.
    assert len(np.unique(acc.cloud().frame_index)) > 30


def test_accumulator_rejects_bad_settings():
    with pytest.raises(ValueError, match="max points must be at least 1, got 0"):
        PointAccumulator(max_points=0)
    with pytest.raises(ValueError, match="voxel size must be a positive number of scene units, got -1.0"):
        PointAccumulator(voxel_size=-1.0)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.floats(-2, 2), st.floats(-0.3, 0.3)), min_size=1, max_size=12),
    st.integers(20, 400),
)
def test_accumulator_invariants_under_random_streams(events, max_points):
    """Any mix of new frames and re-emissions: capped, one point per voxel, keys sorted and consistent."""
    acc = PointAccumulator(voxel_size=0.01, max_points=max_points)
    for frame_index, shift, yaw in events:
        f = plane_frame(frame_index, height=8, width=10, yaw=yaw, offset=np.array([shift, 0, 0]))
        acc.remove_frame(frame_index)
        acc.add_frame(frame_index, f.depth, f.depth_conf, f.intrinsics, f.c2w, f.image)
        n = len(acc)
        assert n <= max_points
        keys, in_range = acc._voxel_keys(acc.cloud().xyz)
        assert in_range.all()
        np.testing.assert_array_equal(keys, acc._keys[:n])
        assert len(np.unique(keys)) == n  # one point per voxel
        for level_keys, level_rows in (
            (acc._merged_keys, acc._merged_rows),
            (acc._recent_keys, acc._recent_rows),
        ):
            assert (np.diff(level_keys) > 0).all()
            np.testing.assert_array_equal(keys[level_rows], level_keys)
        rows = np.sort(np.concatenate([acc._merged_rows, acc._recent_rows]))
        np.testing.assert_array_equal(rows, np.arange(n))  # every row indexed exactly once


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 7), st.floats(-2, 2), st.floats(-0.3, 0.3)), min_size=1, max_size=16),
    st.integers(20, 400),
)
def test_removing_a_frames_contiguous_rows_equals_the_general_pass(events, max_points):
    """The fast removal (shift the rows after the frame's, touch only index entries at or past them)
    leaves exactly what filtering every row does, through merges and coarsenings."""
    fast = PointAccumulator(voxel_size=0.01, max_points=max_points)
    general = PointAccumulator(voxel_size=0.01, max_points=max_points)
    fast._MIN_RECENT = general._MIN_RECENT = 8  # merges happen within a few frames
    for frame_index, shift, yaw in events:
        f = plane_frame(frame_index, height=8, width=10, yaw=yaw, offset=np.array([shift, 0, 0]))
        fast.remove_frame(frame_index)
        general._remove_rows(general._frame[: len(general)] != frame_index)
        for acc in (fast, general):
            acc.add_frame(frame_index, f.depth, f.depth_conf, f.intrinsics, f.c2w, f.image)
        n = len(fast)
        assert n == len(general)
        for name in ("_keys", "_xyz", "_rgb", "_frame", "_pixel"):
            np.testing.assert_array_equal(getattr(fast, name)[:n], getattr(general, name)[:n])
        for name in ("_merged_keys", "_merged_rows", "_recent_keys", "_recent_rows"):
            np.testing.assert_array_equal(getattr(fast, name), getattr(general, name))


def test_writer_memory_stays_bounded_over_a_long_stream(tmp_path):
    """The writer holds poses and the capped cloud, never the depth maps (~50 KB per frame here)."""
    writer = RunWriter(tmp_path / "run", {}, voxel_size=0.001, max_points=2000)
    frames = 150
    tracemalloc.start()
    try:
        for i in range(frames):
            writer.on_frame(plane_frame(i, height=72, width=96, offset=np.array([0, 5.0 * i, 0])), {})
            if i == 20:
                writer.flush()  # measure with an empty queue, at both ends
                baseline = tracemalloc.get_traced_memory()[0]
        writer.flush()
        growth = tracemalloc.get_traced_memory()[0] - baseline
    finally:
        tracemalloc.stop()
    writer.close("complete")
    assert len(writer.points) <= 2000
    # 130 frames of depth + confidence + image would be ~6 MB; poses and the cloud are well under 0.5 MB.
    assert growth < 500_000, growth
    assert len(read_run(tmp_path / "run")) == frames


def test_writer_thread_errors_reach_the_caller(tmp_path, monkeypatch):
    writer = RunWriter(tmp_path / "run", {})
    writer.on_frame(plane_frame(0), {})
    writer.flush()

    def full_disk(file, **arrays):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "savez", full_disk)
    writer.on_frame(plane_frame(1), {})
    with pytest.raises(
        OutputDirError, match="writing frames to .*predictions failed: No space left on device"
    ):
        writer.flush()
    writer.on_frame(plane_frame(2), {})  # fails on the writer thread again; nobody has asked yet
    with pytest.raises(OutputDirError, match="could not write outputs .*frame writer: .*No space left"):
        writer.close("failed")
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["status"] == "failed" and "No space left" in info["output_errors"][0]
    assert [r["frame_index"] for r in read_run(tmp_path / "run")] == [0]
    assert len(parse_tum_strictly(tmp_path / "run" / "trajectory_tum.txt")) == 1


def test_a_slow_disk_blocks_on_frame_instead_of_queueing_without_bound(tmp_path, monkeypatch):
    writer = RunWriter(tmp_path / "run", {}, queue_size=3)
    disk_free = threading.Event()
    real_savez = np.savez

    def slow_savez(file, **arrays):
        disk_free.wait(timeout=30)
        real_savez(file, **arrays)

    monkeypatch.setattr(np, "savez", slow_savez)
    handed_over = []

    def produce() -> None:
        for i in range(8):
            writer.on_frame(plane_frame(i), {})
            handed_over.append(i)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    # One frame is being written and three wait in the hand-off: on_frame has returned four times...
    # (the backlog counts the fifth frame too, from the moment on_frame is called with it)
    wait_until(lambda: len(handed_over) == 4 and writer._handoff.backlog == 5)
    producer.join(timeout=0.2)
    # ...and the fifth call waits for the disk instead of queueing more.
    assert producer.is_alive() and handed_over == [0, 1, 2, 3] and writer._handoff.backlog == 5
    disk_free.set()
    producer.join(timeout=30)
    assert not producer.is_alive()
    writer.close("complete")
    assert [r["frame_index"] for r in read_run(tmp_path / "run")] == list(range(8))


def test_a_disk_that_stalls_fails_the_run_at_its_deadline_keeping_what_was_written(tmp_path, monkeypatch):
    writer = RunWriter(tmp_path / "run", {}, queue_size=2, stall_s=0.5)
    never = threading.Event()
    real_savez = np.savez
    calls = []

    def stalling_savez(file, **arrays):
        calls.append(1)
        if len(calls) > 1:  # the first frame reaches the disk, then the disk stops answering
            never.wait()
        real_savez(file, **arrays)

    monkeypatch.setattr(np, "savez", stalling_savez)
    started = time.monotonic()
    with pytest.raises(OutputDirError, match="the disk took no frame for 0.5 s"):
        for i in range(8):
            writer.on_frame(plane_frame(i), {})
    with pytest.raises(OutputDirError):
        writer.close("failed", {"error": "stalled"})
    assert time.monotonic() - started < 5.0
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["status"] == "failed" and [r["frame_index"] for r in read_run(tmp_path / "run")] == [0]
    never.set()


def test_outputs_get_ordinary_permissions(tmp_path):
    old_umask = os.umask(0o022)
    try:
        write_run(tmp_path / "run", [plane_frame(0)])
    finally:
        os.umask(old_umask)
    for path in (
        prediction_path(tmp_path / "run", 0),
        tmp_path / "run" / "run.json",
        tmp_path / "run" / "points.ply",
    ):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


@pytest.mark.parametrize(
    ("raised", "status"),
    [(None, "complete"), (KeyboardInterrupt, "interrupted"), (FileNotFoundError, "failed")],
)
def test_context_manager_closes_with_the_matching_status(tmp_path, raised, status):
    with pytest.raises(raised) if raised else contextlib.nullcontext():
        with RunWriter(tmp_path / "run", {}) as writer:
            writer.on_frame(plane_frame(0), {})
            writer.on_frame(plane_frame(1), {})
            if raised:
                raise raised("camera unplugged")
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["status"] == status and info["summary"]["frames"] == 2
    assert ("camera unplugged" in info["summary"].get("error", "")) == (raised is FileNotFoundError)
    assert len(parse_tum_strictly(tmp_path / "run" / "trajectory_tum.txt")) == 2


def test_an_explicit_close_inside_the_block_wins(tmp_path):
    with RunWriter(tmp_path / "run", {}) as writer:
        writer.on_frame(plane_frame(0), {})
        writer.close("complete", {"fps": 3.0})
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["status"] == "complete" and info["summary"]["fps"] == 3.0


def test_points_beyond_the_voxel_key_range_are_dropped_and_counted(tmp_path):
    near, far = plane_frame(0), plane_frame(1)
    far.depth[:, 20:] = 1e6  # 2**20 voxels of 0.01 end at ~10 km
    write_run(tmp_path / "run", [near, far], voxel_size=0.01)
    points = json.loads((tmp_path / "run" / "run.json").read_text())["summary"]["points"]
    assert points["dropped_out_of_range"] == 24 * 12
    assert np.abs(trimesh.load(tmp_path / "run" / "points.ply").vertices).max() < 100


def test_atomic_writes_follow_a_symlink_and_never_replace_a_fifo(tmp_path):
    # the atomic rename replaced whatever the path was: a symlink, a FIFO, as root even /dev/full
    target, link, fifo = symlink_and_fifo(tmp_path, "elsewhere.json", "run.json", "eval.json", "{}")

    write_json_atomic(link, {"status": "complete"})
    with pytest.raises(OutputPathError, match=r"eval.json is a FIFO \(named pipe\), not a regular file; nothing"):
        write_json_atomic(fifo, {"ate_rmse": 0.1})
    with pytest.raises(OutputPathError, match="is a folder, not a regular file"):
        write_json_atomic(tmp_path, {})

    assert link.is_symlink() and json.loads(target.read_text()) == {"status": "complete"}
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["elsewhere.json", "eval.json", "run.json"]  # no temp


def test_the_run_writer_ends_its_thread_at_once_not_at_its_next_poll(tmp_path):
    writer = RunWriter(tmp_path / "run", {})
    writer.on_frame(plane_frame(0), {})
    writer.flush()
    thread = writer._worker
    started = time.monotonic()
    writer.close("complete")
    assert not thread.is_alive() and time.monotonic() - started < writers._WORKER_POLL_S / 2


def corrections_moving_chunk_0() -> ChunkCorrections:
    return ChunkCorrections({0: Sim3(1.5, np.eye(3), np.array([0.5, 0.0, 0.0]))})


def test_the_files_a_loop_closure_moved_are_rewritten_on_several_threads(tmp_path, monkeypatch):
    frames = [plane_frame(i) for i in range(24)]
    writer = RunWriter(tmp_path / "run", {"source": "synthetic"})
    for i, frame in enumerate(frames):
        writer.on_frame(frame, {"frames": i + 1})
    threads, move_file = set(), writers._move_prediction_file

    def recorded(path, move):
        threads.add(threading.current_thread().name)
        time.sleep(0.02)  # a file's read and write, long enough for the workers to overlap
        move_file(path, move)

    monkeypatch.setattr(writers, "_move_prediction_file", recorded)
    writer.close("complete", {}, corrections_moving_chunk_0())
    assert len(threads) > 1 and all(name.startswith("correct-predictions_") for name in threads)
    with np.load(prediction_path(tmp_path / "run", 5)) as data:
        np.testing.assert_allclose(data["c2w"][:, 3], 1.5 * frames[5].c2w[:, 3] + [0.5, 0.0, 0.0], rtol=1e-5)


def test_moving_the_files_past_its_deadline_ends_the_run_with_one_line_naming_it(tmp_path, monkeypatch):
    writer = RunWriter(tmp_path / "run", {"source": "synthetic"}, correction_s_per_file=0.01)
    for i in range(4):
        writer.on_frame(plane_frame(i), {"frames": i + 1})
    monkeypatch.setattr(writers, "_move_prediction_file", lambda path, move: time.sleep(0.5))
    with pytest.raises(OutputDirError, match="took over 0 s: the files not yet written keep their uncorrected"):
        writer.close("complete", {}, corrections_moving_chunk_0())
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["status"] == "complete" and "took over" in record["output_errors"][0]


def test_a_file_whose_rewrite_fails_is_named_and_the_rest_of_the_run_is_still_written(tmp_path, monkeypatch):
    # Any exception (here a SystemError, as CPython raises from concurrent AST conversions) in one file's
    # rewrite: the other files are moved, the trajectory and cloud written, run.json names the file.
    frames = [plane_frame(i) for i in range(6)]
    writer = RunWriter(tmp_path / "run", {"source": "synthetic"})
    for i, frame in enumerate(frames):
        writer.on_frame(frame, {"frames": i + 1})
    move_file = writers._move_prediction_file

    def failing_on_frame_2(path, move):
        if path == prediction_path(tmp_path / "run", 2):
            raise SystemError("AST constructor recursion depth mismatch (before=42, after=41)")
        move_file(path, move)

    monkeypatch.setattr(writers, "_move_prediction_file", failing_on_frame_2)
    with pytest.raises(OutputDirError, match="1 of the 6 files a loop closure moved keep their uncorrected poses"):
        writer.close("complete", {}, corrections_moving_chunk_0())
    run = tmp_path / "run"
    record = json.loads((run / "run.json").read_text())
    assert record["status"] == "complete" and "000002.npz: SystemError" in record["output_errors"][0]
    assert (run / "trajectory_tum.txt").is_file() and (run / "points.ply").is_file()
    with np.load(prediction_path(run, 5)) as moved, np.load(prediction_path(run, 2)) as kept:
        np.testing.assert_allclose(moved["c2w"][:, 3], 1.5 * frames[5].c2w[:, 3] + [0.5, 0.0, 0.0], rtol=1e-5)
        np.testing.assert_allclose(kept["c2w"], frames[2].c2w, rtol=1e-6)


def test_a_writer_that_raises_anything_leaves_the_other_outputs_written(tmp_path, monkeypatch):
    writer = RunWriter(tmp_path / "run", {"source": "synthetic"})
    writer.on_frame(plane_frame(0), {"frames": 1})
    monkeypatch.setattr(writer, "_write_points", lambda moves: (_ for _ in ()).throw(ValueError("bad cloud")))
    with pytest.raises(OutputDirError, match="points.ply: ValueError: bad cloud"):
        writer.close("complete")
    assert (tmp_path / "run" / "trajectory_tum.txt").is_file()
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "complete"
