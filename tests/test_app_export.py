import json
import re
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
import trimesh
import typer
from conftest import symlink_and_fifo
from helpers import read_run
from plyfile import PlyData
from synthetic_run import CONF_HIGH, PLANE_Z, plane_frame, quat_xyzw_to_matrix
from typer.testing import CliRunner

from stream_recon.app.commands.export import export as export_command
from stream_recon.app.outputs import formats
from stream_recon.app.outputs.export import export_run
from stream_recon.app.outputs.export_job import ExportError
from stream_recon.app.outputs.formats import ExportFormat
from stream_recon.app.outputs.npz_schema import PredictionOutputs
from stream_recon.app.outputs.rundir import RunDirError
from stream_recon.app.outputs.writers import RunWriter
from stream_recon.models import StreamConfig, StreamingEngine, prepare_for_inference

OPENCV_TO_GLTF = np.diag([1.0, -1.0, -1.0])


def make_run(run_dir, frames, **kwargs):
    writer = RunWriter(run_dir, {"source": "synthetic"}, **kwargs)
    for frame in frames:
        writer.on_frame(frame, {})
    writer.close("complete")
    return frames


@pytest.fixture
def run(tmp_path):
    frames = [plane_frame(i) for i in range(6)]
    # One frame with a different focal length: COLMAP needs a second camera.
    frames.append(plane_frame(6, focal=36.0))
    # depth as computed, so that points land on the plane exactly (float16 storage: tested below)
    make_run(tmp_path / "run", frames, voxel_size=0.04, outputs=PredictionOutputs(depth="float32"))
    return tmp_path / "run", frames


def read_ply_points(path):
    vertex = PlyData.read(str(path))["vertex"]
    xyz = np.stack([vertex["x"], vertex["y"], vertex["z"]], axis=1)
    rgb = np.stack([vertex["red"], vertex["green"], vertex["blue"]], axis=1)
    return xyz, rgb


def test_ply_export_uses_the_run_settings_by_default(run):
    run_dir, _ = run
    result = export_run(run_dir, "ply")
    assert result.path == run_dir / "exports" / "points.ply"
    xyz, rgb = read_ply_points(result.path)
    original_xyz, original_rgb = read_ply_points(run_dir / "points.ply")
    np.testing.assert_array_equal(np.sort(xyz, axis=0), np.sort(original_xyz, axis=0))
    assert result.num_points == len(xyz) > 0 and result.num_frames == 7
    np.testing.assert_allclose(xyz[:, 2], PLANE_Z, atol=1e-4)
    cloud = trimesh.load(result.path)
    assert isinstance(cloud, trimesh.PointCloud) and len(cloud.vertices) == len(xyz)


def test_ply_export_threshold_and_voxel_overrides(run, tmp_path):
    run_dir, _ = run
    coarse = export_run(run_dir, "ply", tmp_path / "coarse.ply", voxel_size=0.2)
    fine = export_run(run_dir, "ply", tmp_path / "fine.ply", voxel_size=0.02)
    assert 0 < coarse.num_points < fine.num_points
    xyz, _ = read_ply_points(tmp_path / "coarse.ply")
    assert len(np.unique(np.floor(xyz.astype(np.float64) / 0.2), axis=0)) == len(xyz)
    strict = export_run(run_dir, "ply", tmp_path / "none.ply", conf_threshold=CONF_HIGH + 1)
    assert strict.num_points == 0 and len(PlyData.read(str(tmp_path / "none.ply"))["vertex"]) == 0


def test_export_into_an_existing_directory_uses_the_default_name(run, tmp_path):
    run_dir, _ = run
    (tmp_path / "out").mkdir()
    assert export_run(run_dir, "tum", tmp_path / "out").path == tmp_path / "out" / "trajectory_tum.txt"


def test_tum_export_matches_the_poses(run, tmp_path):
    run_dir, frames = run
    result = export_run(run_dir, "tum", tmp_path / "traj.txt")
    rows = np.loadtxt(result.path)
    assert rows.shape == (7, 8)
    assert result.path.read_text() == (run_dir / "trajectory_tum.txt").read_text()
    for row, frame in zip(rows, frames, strict=True):
        assert row[0] == pytest.approx(frame.timestamp, abs=1e-6)
        np.testing.assert_allclose(row[1:4], frame.c2w[:, 3], atol=1e-6)
        np.testing.assert_allclose(quat_xyzw_to_matrix(row[4:]), frame.c2w[:, :3], atol=1e-6)


def test_glb_holds_the_cloud_and_one_frustum_per_camera(run, tmp_path):
    run_dir, frames = run
    result = export_run(run_dir, "glb", tmp_path / "scene.glb")
    scene = trimesh.load(result.path)
    assert isinstance(scene, trimesh.Scene)

    points = scene.geometry["points"]
    assert isinstance(points, trimesh.PointCloud)
    xyz, rgb = read_ply_points(export_run(run_dir, "ply", tmp_path / "same.ply").path)
    np.testing.assert_allclose(points.vertices, xyz @ OPENCV_TO_GLTF, atol=1e-5)
    np.testing.assert_array_equal(points.colors[:, :3], rgb)
    # glTF is y-up: the plane in front of the cameras (OpenCV +z) is now at -z.
    np.testing.assert_allclose(points.vertices[:, 2], -PLANE_Z, atol=1e-4)

    for frame in frames:
        name = f"camera_{frame.frame_index:06d}"
        transform, geometry_name = scene.graph[name]
        frustum = scene.geometry[geometry_name]
        assert isinstance(frustum, trimesh.path.Path3D)
        expected = np.eye(4)
        expected[:3] = frame.c2w
        np.testing.assert_allclose(transform, np.diag([1.0, -1, -1, 1]) @ expected, atol=1e-6)
        world = trimesh.transform_points(frustum.vertices, transform)
        # The apex is the camera centre; the image plane lies in front of the camera.
        centre = frame.c2w[:, 3] @ OPENCV_TO_GLTF
        assert np.isclose(np.linalg.norm(world - centre, axis=1), 0, atol=1e-6).any()
        assert frustum.vertices[:, 2].max() > 0
    assert "trajectory" in scene.geometry


def parse_colmap_strictly(model_dir):
    """The text-model rules that COLMAP's and gsplat's readers rely on."""
    cameras = {}
    for line in (model_dir / "cameras.txt").read_text().splitlines():
        if line.startswith("#"):
            continue
        fields = line.split()
        assert fields[1] == "PINHOLE" and len(fields) == 8, line
        cameras[int(fields[0])] = (int(fields[2]), int(fields[3]), *map(float, fields[4:]))

    lines = [line for line in (model_dir / "images.txt").read_text().splitlines() if not line.startswith("#")]
    assert len(lines) % 2 == 0
    images = {}
    for header, points_line in zip(lines[0::2], lines[1::2], strict=True):
        fields = header.split()
        assert len(fields) == 10 and int(fields[8]) in cameras, header
        quaternion = np.array(list(map(float, fields[1:5])))
        assert np.isclose(np.linalg.norm(quaternion), 1.0)
        # gsplat's reader stops at the first blank line, so no image may have an empty POINTS2D line.
        assert points_line.strip(), f"image {fields[0]} has no 2D points"
        values = points_line.split()
        assert len(values) % 3 == 0
        observations = [
            (float(values[i]), float(values[i + 1]), int(values[i + 2])) for i in range(0, len(values), 3)
        ]
        images[int(fields[0])] = (
            quaternion,
            np.array(list(map(float, fields[5:8]))),
            int(fields[8]),
            fields[9],
            observations,
        )

    points = {}
    for line in (model_dir / "points3D.txt").read_text().splitlines():
        if line.startswith("#"):
            continue
        fields = line.split()
        assert len(fields) >= 10 and (len(fields) - 8) % 2 == 0, line
        assert all(0 <= int(c) <= 255 for c in fields[4:7])
        track = [(int(fields[i]), int(fields[i + 1])) for i in range(8, len(fields), 2)]
        points[int(fields[0])] = (np.array(list(map(float, fields[1:4]))), track)
    # Every track entry points at an observation that points back at the same 3D point.
    for point_id, (_, track) in points.items():
        for image_id, index in track:
            assert images[image_id][4][index][2] == point_id
    return cameras, images, points


def test_colmap_model_round_trips_through_a_strict_parser(run, tmp_path):
    run_dir, frames = run
    result = export_run(run_dir, "colmap", tmp_path / "colmap")
    cameras, images, points = parse_colmap_strictly(result.path / "sparse" / "0")
    assert len(cameras) == 2 and len(images) == 7 and len(points) == result.num_points
    for image_id, frame in enumerate(frames, 1):
        quaternion_wxyz, translation, camera_id, name, observations = images[image_id]
        assert name == f"{frame.frame_index:06d}.png"
        rotation_w2c = quat_xyzw_to_matrix(np.roll(quaternion_wxyz, -1))
        np.testing.assert_allclose(rotation_w2c, frame.c2w[:, :3].T, atol=1e-6)
        np.testing.assert_allclose(translation, -frame.c2w[:, :3].T @ frame.c2w[:, 3], atol=1e-6)
        w, h, fx, fy, cx, cy = cameras[camera_id]
        assert (w, h) == (32, 24) and fx == pytest.approx(frame.intrinsics[0, 0])
        for x, y, point_id in observations:
            local = rotation_w2c @ points[point_id][0] + translation
            np.testing.assert_allclose(
                [fx * local[0] / local[2] + cx, fy * local[1] / local[2] + cy], [x, y], atol=2e-3
            )
        saved = cv2.cvtColor(cv2.imread(str(result.path / "images" / name)), cv2.COLOR_BGR2RGB)
        np.testing.assert_array_equal(saved, frame.image)


def test_colmap_model_reads_back_with_pycolmap(run, tmp_path):
    pycolmap = pytest.importorskip("pycolmap", reason="pycolmap is not installed (pip install pycolmap)")
    run_dir, frames = run
    result = export_run(run_dir, "colmap", tmp_path / "colmap")
    model = pycolmap.Reconstruction(str(result.path / "sparse" / "0"))
    assert len(model.cameras) == 2 and len(model.images) == 7 and len(model.points3D) == result.num_points
    for image_id, frame in enumerate(frames, 1):
        image = model.images[image_id]
        np.testing.assert_allclose(image.projection_center(), frame.c2w[:, 3], atol=1e-5)
        camera = model.cameras[image.camera_id]
        assert camera.model.name == "PINHOLE"
        # COLMAP's first pixel centre is at (0.5, 0.5); ours at (0, 0).
        np.testing.assert_allclose(camera.params[2:], frame.intrinsics[:2, 2] + 0.5, atol=1e-6)
        observed = [p for p in image.points2D if p.has_point3D()]
        assert observed
        for point2d in observed[::25]:
            projected = image.project_point(model.points3D[point2d.point3D_id].xyz)
            np.testing.assert_allclose(projected, point2d.xy, atol=2e-3)


def test_colmap_gives_every_image_an_observation(tmp_path):
    # Frame 1 repeats frame 0's view, so all of its voxels are taken: it owns no point, and the export
    # falls back to the visible point nearest its centre.
    frames = [plane_frame(0, yaw=0.0), plane_frame(1, yaw=0.0, offset=np.array([-0.1, 0, 0]))]
    make_run(tmp_path / "run", frames, voxel_size=0.04)
    result = export_run(tmp_path / "run", "colmap")
    assert result.path == tmp_path / "run" / "exports" / "colmap"
    _, images, points = parse_colmap_strictly(result.path / "sparse" / "0")
    (x, y, point_id), *rest = images[2][4]
    assert rest == []
    assert abs(x - 16) < 2 and abs(y - 12) < 2
    assert (2, 0) in points[point_id][1]


def test_colmap_export_without_images_is_refused_and_leaves_nothing(tmp_path):
    # a COLMAP model names its images: written without them (an empty images/), it was a model of nothing
    make_run(tmp_path / "run", [plane_frame(i, with_image=False) for i in range(2)])
    with pytest.raises(ExportError, match="frame 0 of .*run was saved without its image, and a COLMAP export "
                                          "needs the images; export this run as ply, glb, tum"):
        export_run(tmp_path / "run", "colmap")
    assert not (tmp_path / "run" / "exports").exists()
    result = export_run(tmp_path / "run", "ply")  # a format that only takes colours from them: said, grey
    assert "frame 0 of" in result.grey_points and "saved without its image" in result.grey_points
    assert (read_ply_points(result.path)[1] == 200).all()  # the accumulator's grey


# nerfstudio's camera model, written from its documentation ("data conventions") and
# nerfstudio/cameras/cameras.py: pixel (row, col) has its centre at (col + 0.5, row + 0.5), and a camera
# looks down its -z axis with +y up (OpenGL), transform_matrix taking camera to world coordinates.
NERFSTUDIO_CAMERA_MODELS = {"SIMPLE_PINHOLE", "PINHOLE", "SIMPLE_RADIAL", "RADIAL", "OPENCV"}


def nerfstudio_project(frame: dict, points: np.ndarray) -> np.ndarray:
    """World points [N, 3] -> nerfstudio pixel coordinates (x, y) [N, 2] in one frame of transforms.json."""
    c2w = np.array(frame["transform_matrix"])
    local = (points - c2w[:3, 3]) @ c2w[:3, :3]  # [N, 3] camera frame, OpenGL axes
    forward = -local[:, 2]
    return np.column_stack([
        frame["fl_x"] * local[:, 0] / forward + frame["cx"],
        -frame["fl_y"] * local[:, 1] / forward + frame["cy"],
    ])


def test_nerfstudio_export_follows_nerfstudios_conventions(run, tmp_path):
    run_dir, frames = run
    result = export_run(run_dir, "nerfstudio", tmp_path / "ns")
    assert result.path == tmp_path / "ns" and result.num_frames == 7
    meta = json.loads((result.path / "transforms.json").read_text())

    assert meta["camera_model"] in NERFSTUDIO_CAMERA_MODELS
    np.testing.assert_array_equal(meta["applied_transform"], np.eye(4)[:3])
    assert len(meta["frames"]) == 7
    for frame, entry in zip(frames, meta["frames"], strict=True):
        image_path = result.path / entry["file_path"]
        assert not Path(entry["file_path"]).is_absolute() and image_path.is_file()
        saved = cv2.cvtColor(cv2.imread(str(image_path)), cv2.COLOR_BGR2RGB)
        np.testing.assert_array_equal(saved, frame.image)
        assert (entry["w"], entry["h"]) == (32, 24) == (saved.shape[1], saved.shape[0])
        assert entry["fl_x"] == pytest.approx(frame.intrinsics[0, 0])
        assert (entry["cx"], entry["cy"]) == pytest.approx(tuple(frame.intrinsics[:2, 2] + 0.5))
        c2w = np.array(entry["transform_matrix"])
        np.testing.assert_array_equal(c2w[3], [0, 0, 0, 1])
        np.testing.assert_allclose(c2w[:3, 3], frame.c2w[:, 3], atol=1e-6)  # the same world frame
        np.testing.assert_allclose(c2w[:3, :3].T @ c2w[:3, :3], np.eye(3), atol=1e-6)
        assert np.linalg.det(c2w[:3, :3]) == pytest.approx(1.0)
        # the camera looks at the plane in front of it (world +z): OpenGL's -z axis points there
        assert (c2w[:3, :3] @ [0, 0, -1])[2] > 0.99

    # Gaussian-splatting seeds: each point, projected by nerfstudio's model, lands on the centre of the pixel
    # it was back-projected from (the synthetic image spells that pixel in its colour).
    xyz, rgb = read_ply_points(result.path / meta["ply_file_path"])
    np.testing.assert_array_equal(np.sort(xyz, axis=0), np.sort(read_ply_points(run_dir / "points.ply")[0], axis=0))
    frame_of_point = rgb[:, 2].astype(int) // 10
    for row, entry in enumerate(meta["frames"]):
        mine = frame_of_point == row
        expected = rgb[mine, :2].astype(np.float64) / 8 + 0.5
        np.testing.assert_allclose(nerfstudio_project(entry, xyz[mine].astype(np.float64)), expected, atol=2e-3)
    assert len(xyz) == result.num_points > 0


def test_nerfstudio_export_loads_with_nerfstudios_own_dataparser(run, tmp_path):
    dataparser = pytest.importorskip(
        "nerfstudio.data.dataparsers.nerfstudio_dataparser", reason="nerfstudio is not installed (pip install nerfstudio)"
    )
    run_dir, frames = run
    result = export_run(run_dir, "nerfstudio", tmp_path / "ns")
    # nerfstudio's defaults (orient "up", centre on the poses, scale into the unit box) except that every
    # frame goes to training and images are read at full size; splatfacto loads the points, as here
    config = dataparser.NerfstudioDataParserConfig(
        data=result.path, eval_mode="all", downscale_factor=1, load_3D_points=True
    )
    outputs = config.setup().get_dataparser_outputs(split="train")

    assert [path.name for path in outputs.image_filenames] == [f"{f.frame_index:06d}.png" for f in frames]
    cameras = outputs.cameras
    assert cameras.width.flatten().tolist() == [32] * 7 and cameras.height.flatten().tolist() == [24] * 7
    torch.testing.assert_close(cameras.fx.flatten(), torch.tensor([f.intrinsics[0, 0] for f in frames]))
    points = outputs.metadata["points3D_xyz"]  # moved with the poses by nerfstudio's transform and scale
    _, rgb = read_ply_points(result.path / "points.ply")
    assert len(points) == len(rgb) == result.num_points
    # the ray nerfstudio casts through each point's source pixel passes through the point
    frame_of_point = torch.from_numpy(rgb[:, 2].astype(np.int64) // 10)
    coords = torch.from_numpy(rgb[:, [1, 0]].astype(np.float32) / 8 + 0.5)  # (row, col) pixel centres
    rays = cameras.generate_rays(camera_indices=frame_of_point[:, None], coords=coords)
    to_point = points - rays.origins
    along = (to_point * rays.directions).sum(-1)
    off_ray = torch.linalg.norm(to_point - along[:, None] * rays.directions, dim=-1)
    assert (along > 0).all() and off_ray.max() < 1e-3 * along.max()


def test_nerfstudio_export_needs_the_images(tmp_path):
    make_run(tmp_path / "run", [plane_frame(0), plane_frame(1, with_image=False)])
    with pytest.raises(ExportError, match="frame 1 of .*run was saved without its image, and a nerfstudio export "
                                          "needs the images"):
        export_run(tmp_path / "run", "nerfstudio")
    # frame 0's image was written before frame 1 was found wanting: taken back, nothing is left
    assert not (tmp_path / "run" / "exports").exists()


def test_export_errors_are_specific(run, tmp_path):
    run_dir, _ = run
    with pytest.raises(RunDirError, match="does not exist"):
        export_run(tmp_path / "missing", "ply")
    (tmp_path / "empty" / "predictions").mkdir(parents=True)
    with pytest.raises(RunDirError, match="has no frames: its predictions/ holds no prediction file"):
        export_run(tmp_path / "empty", "ply")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ExportError, match="COLMAP export goes to a directory"):
        export_run(run_dir, "colmap", blocker)
    with pytest.raises(ExportError, match="nerfstudio export goes to a directory"):
        export_run(run_dir, "nerfstudio", blocker)
    with pytest.raises(ExportError, match="cannot create .*file"):
        export_run(run_dir, "ply", blocker / "sub" / "points.ply")
    with pytest.raises(ValueError, match="'obj' is not a valid ExportFormat"):
        export_run(run_dir, "obj")


def test_the_folder_of_formats_is_the_table():
    """Adding a format is one file in app/outputs/formats/: its name is the file's, its spec the member's, and
    the help lists the formats in the order their specs give."""
    files = sorted(path.stem for path in formats.FOLDER.glob("*.py") if path.stem != "__init__")
    assert len(files) >= 6 and formats.names() == tuple(files) == tuple(sorted(fmt.value for fmt in ExportFormat))
    for fmt in ExportFormat:
        assert sys.modules[f"stream_recon.app.outputs.formats.{fmt.value}"].SPEC is fmt.spec
    assert [fmt.value for fmt in ExportFormat] == ["ply", "glb", "colmap", "tum", "nerfstudio", "splats"]
    assert formats.format_summary() == "PLY, GLB, COLMAP, TUM, nerfstudio or Gaussian splats"


def test_the_table_of_formats_loads_no_writers_library():
    """A format's heavy library (trimesh, OpenCV) is imported by its writer when it runs: the table, which
    `export -h` reads, loads none of them."""
    probe = ("import sys; import stream_recon.app.outputs.formats; "
             "print(sorted({'cv2', 'trimesh', 'torch', 'scipy'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]", result.stderr


@pytest.mark.parametrize("fmt", list(ExportFormat), ids=str)
def test_every_format_is_one_whole_entry(fmt):
    """Its member carries everything the export reads of it: a name that finds it, its file's writer, a file's
    suffixes (its default name one of them) or a folder's contents, never both."""
    spec = fmt.spec
    assert ExportFormat(spec.name) is fmt and fmt.value == spec.name
    assert callable(spec.write) and spec.write.__module__ == f"stream_recon.app.outputs.formats.{fmt.value}"
    assert bool(spec.suffixes) != fmt.is_folder
    assert fmt.is_folder or fmt.accepts_suffix(Path(spec.default_name).suffix)
    assert not fmt.needs_images or fmt.is_folder


def test_export_reads_an_interrupted_run_with_a_truncated_last_frame(tmp_path):
    writer = RunWriter(tmp_path / "run", {})
    for i in range(4):
        writer.on_frame(plane_frame(i), {})
    writer.flush()
    last = tmp_path / "run" / "predictions" / "000003.npz"
    last.write_bytes(last.read_bytes()[:100])
    # No close(): the run was killed. Export still works from the npz files that are whole.
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "running"
    rows = np.loadtxt(export_run(tmp_path / "run", "tum").path)
    assert rows.shape == (3, 8)


@pytest.fixture
def cli():
    app = typer.Typer()
    app.command()(export_command)
    app.command("noop")(lambda: None)  # a second command, so typer keeps `export` as a subcommand
    return app


def test_cli_export_writes_and_reports(run, cli, tmp_path):
    run_dir, _ = run
    outcome = CliRunner().invoke(
        cli, ["export", str(run_dir), "--format", "GLB", "-o", str(tmp_path / "s.glb")]
    )
    assert outcome.exit_code == 0, outcome.output
    assert re.search(r"wrote glb export \(7 cameras, \d+ points, voxel 0.04\) to", outcome.output)
    assert isinstance(trimesh.load(tmp_path / "s.glb"), trimesh.Scene)



def test_only_a_glb_export_imports_trimesh(run, tmp_path):
    # trimesh took 1.1 s of every export's start, whatever the format
    run_dir, _ = run
    formats = [fmt.value for fmt in ExportFormat if fmt.value != "glb"] + ["glb"]  # GLB last: it loads trimesh
    script = textwrap.dedent(f"""
        import json, sys
        from stream_recon.app.cli import main
        loaded = {{}}
        for fmt in {formats!r}:
            try:
                main(["export", {str(run_dir)!r}, "-f", fmt, "-o", {str(tmp_path)!r} + "/" + fmt])
            except SystemExit as exit:
                assert exit.code == 0, (fmt, exit.code)
            loaded[fmt] = [name for name in ("trimesh", "torch") if name in sys.modules]
        print(json.dumps(loaded))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert loaded == {**{fmt: [] for fmt in formats[:-1]}, "glb": ["trimesh"]}


def test_cli_export_errors_exit_2_without_traceback(cli, tmp_path):
    outcome = CliRunner().invoke(cli, ["export", str(tmp_path / "missing"), "--format", "ply"])
    assert outcome.exit_code == 2 and outcome.output.startswith("error: ")
    assert "does not exist" in outcome.output and "Traceback" not in outcome.output
    outcome = CliRunner().invoke(cli, ["export", str(tmp_path), "--format", "obj"])
    assert outcome.exit_code == 2 and "obj" in outcome.output


# sysfs lets nobody, root included, create a file: a place that cannot be written, wherever tests run as
SYSFS = Path("/sys/kernel")


@pytest.mark.parametrize("fmt", ["ply", "glb", "tum", "colmap", "nerfstudio", "splats"])
def test_cli_export_to_a_place_that_cannot_be_written_is_one_line_and_exit_2(run, cli, fmt):
    if not SYSFS.is_dir():
        pytest.skip("needs Linux's sysfs (/sys), where no file can be created")
    run_dir, _ = run
    target = SYSFS / f"stream-recon-export{ExportFormat(fmt).suffix or '.' + fmt}"
    outcome = CliRunner().invoke(cli, ["export", str(run_dir), "-f", fmt, "-o", str(target)])
    assert outcome.exit_code == 2, outcome.output
    assert isinstance(outcome.exception, SystemExit) and "Traceback" not in outcome.output
    lines = outcome.output.strip().splitlines()
    assert len(lines) == 1 and re.match(rf"error: cannot (write|create) {re.escape(str(target))}", lines[0])
    assert lines[0].endswith("; choose a writable --output")


def test_tiny_model_stream_to_run_directory_and_every_export(tmp_path, tiny_model):
    """End to end on the real engine: tiny model with the synthetic weights, frames pushed one at a time."""
    engine = StreamingEngine(prepare_for_inference(tiny_model), StreamConfig(scale_frames=2, window=4,
                                                                              keyframes="interval:2"))
    # The untrained model's confidence sits just under 2, so keep every pixel.
    writer = RunWriter(tmp_path / "run", {"model": "tiny"}, conf_threshold=1.0, max_points=500)
    generator = torch.Generator().manual_seed(0)
    for i in range(7):
        for pred in engine.push(torch.rand(3, 28, 42, generator=generator), timestamp=0.5 * i):
            writer.on_frame(pred, engine.stats())
    for pred in engine.finish():
        writer.on_frame(pred, engine.stats())
    writer.close("complete", {"device": "cpu"})

    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["status"] == "complete" and info["summary"]["frames"] == 7
    assert info["summary"]["keyframes"] == engine.stats()["keyframes"]
    assert info["summary"]["engine"]["frames"] == 7
    rows = np.loadtxt(tmp_path / "run" / "trajectory_tum.txt")
    np.testing.assert_allclose(rows[:, 0], 0.5 * np.arange(7))
    assert 0 < len(PlyData.read(str(tmp_path / "run" / "points.ply"))["vertex"]) <= 500

    for fmt in ("ply", "glb", "colmap", "tum", "nerfstudio"):
        assert export_run(tmp_path / "run", fmt).num_frames == 7
    _, images, points = parse_colmap_strictly(tmp_path / "run" / "exports" / "colmap" / "sparse" / "0")
    assert len(images) == 7 and len(points) > 0
    saved = cv2.imread(str(tmp_path / "run" / "exports" / "colmap" / "images" / "000006.png"))
    assert saved.shape == (28, 42, 3)


def test_cli_warns_when_the_threshold_leaves_no_points(run, cli):
    run_dir, _ = run
    outcome = CliRunner().invoke(cli, ["export", str(run_dir), "-f", "ply", "--conf-threshold", "50"])
    assert outcome.exit_code == 0
    assert "(7 frames, 0 points" in outcome.output and "no pixel has depth confidence >= 50" in outcome.output
    outcome = CliRunner().invoke(cli, ["export", str(run_dir), "-f", "tum"])
    assert outcome.exit_code == 0 and "wrote 7 poses to" in outcome.output
    # a cloud has no cameras (a scene with frusta has)
    outcome = CliRunner().invoke(cli, ["export", str(run_dir), "-f", "glb", "--conf-threshold", "50"])
    assert outcome.exit_code == 0 and "(7 cameras, 0 points, voxel" in outcome.output, outcome.output


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--voxel-size", "-1"], "--voxel-size must be a number > 0 in scene units"),
        (["--voxel-size", "nan"], "--voxel-size must be a number > 0 in scene units"),
        (["--conf-threshold", "-1"], "--conf-threshold must be a number >= 1"),  # was accepted silently
    ],
)
def test_cli_rejects_a_bad_voxel_size_or_threshold_in_one_sentence(run, cli, flags, message):
    run_dir, _ = run
    outcome = CliRunner().invoke(cli, ["export", str(run_dir), "-f", "ply", *flags])
    assert outcome.exit_code == 2 and "Traceback" not in outcome.output
    assert outcome.output.startswith(f"error: {message}") and len(outcome.output.strip().splitlines()) == 1
    assert not (run_dir / "exports").exists()


# ------------------------------------------------------------------------------- smaller run outputs


def run_video(tmp_path, tiny_model, name, **outputs):
    """A tiny-model run on a real video (12 frames 160x96, one keyframe in three after the scale frames)."""
    from media_helpers import write_video

    from stream_recon.app.options import RunOptions
    from stream_recon.app.run.pipeline import run_sequence

    video = tmp_path / "clip.mp4"
    if not video.exists():
        write_video(video, 12, width=160, height=96)
    options = RunOptions(image_width=56, scale_frames=3, window=4, viewer=False, conf_threshold=1.0,
                         keyframes="interval:3", **outputs)
    summary = run_sequence(str(video), tmp_path / name, options, model=tiny_model)
    assert summary.status == "complete"
    return tmp_path / name, video


def test_a_run_saved_without_images_gets_them_back_from_its_video(tmp_path, tiny_model):
    full, _ = run_video(tmp_path, tiny_model, "full", save_depth="float32")
    small, video = run_video(tmp_path, tiny_model, "small", save_images=False, save_predictions="keyframes")

    small_files = sorted(path.name for path in (small / "predictions").glob("*.npz"))
    keyframes = [f"{r['frame_index']:06d}.npz" for r in read_run(full) if r["is_keyframe"]]
    assert small_files == keyframes and len(keyframes) < 12  # the non-keyframes have no file
    assert len(np.loadtxt(small / "trajectory_tum.txt")) == 12  # but every pose
    for fmt in ("colmap", "nerfstudio", "ply"):
        export_run(small, fmt)
    export_run(full, "colmap")
    for name in small_files:  # the same model inputs as the run that saved them
        from_source = cv2.imread(str(small / "exports" / "colmap" / "images" / name.replace(".npz", ".png")))
        saved = cv2.imread(str(full / "exports" / "colmap" / "images" / name.replace(".npz", ".png")))
        np.testing.assert_array_equal(from_source, saved)
    transforms = json.loads((small / "exports" / "nerfstudio" / "transforms.json").read_text())
    assert len(transforms["frames"]) == len(small_files)
    # the export's cloud is the run's own (geometry from the float16 files; colours from the images)
    np.testing.assert_array_equal(*(np.sort(read_ply_points(small / p)[1], axis=0)
                                    for p in ("points.ply", "exports/points.ply")))

    video.unlink()  # a source that is gone: the formats that need images refuse before writing anything ...
    for fmt in ("colmap", "nerfstudio"):
        with pytest.raises(ExportError, match=r"saved without its images \(--no-save-images\), and its source "
                                              r".*clip.mp4 no longer exists; a \w+ export needs the images"):
            export_run(small, fmt, tmp_path / fmt)
        assert not (tmp_path / fmt).exists()
    grey = export_run(small, "ply", tmp_path / "grey.ply")  # ... and the others say their points are grey
    assert "clip.mp4 no longer exists: the points are grey" in grey.grey_points
    assert (read_ply_points(grey.path)[1] == 200).all()


def test_float16_run_reads_back_within_its_bound_everywhere(tmp_path, tiny_model):
    exact, _ = run_video(tmp_path, tiny_model, "exact", save_depth="float32")
    half, _ = run_video(tmp_path, tiny_model, "half")  # the default

    for ours, reference in zip(read_run(half), read_run(exact), strict=True):
        for key in ("depth", "depth_conf"):
            assert ours[key].dtype == np.float32
            np.testing.assert_allclose(ours[key], reference[key], rtol=2.0**-11, atol=0)
        np.testing.assert_array_equal(ours["c2w"], reference["c2w"])
        np.testing.assert_array_equal(ours["image"], reference["image"])
    ours, reference = export_run(half, "glb"), export_run(exact, "glb")
    assert ours.num_frames == reference.num_frames == 12
    assert abs(ours.num_points - reference.num_points) <= 0.02 * reference.num_points


# ------------------------------------------------------------------------------- where an export goes


def test_an_export_writes_through_a_symlink_and_never_replaces_a_fifo(run, cli, tmp_path):
    # -o l (a symlink) and -o f (a FIFO): exit 0, both replaced by regular files, the link's target untouched
    run_dir, frames = run
    target, link, fifo = symlink_and_fifo(tmp_path, "target.txt", "l", "f", "old")

    through_link = CliRunner().invoke(cli, ["export", str(run_dir), "--format", "tum", "-o", str(link), "--overwrite"])

    assert through_link.exit_code == 0, through_link.output
    assert link.is_symlink() and link.resolve() == target
    assert len(np.loadtxt(target)) == len(frames)  # the poses went to the link's target
    for fmt in ("tum", "ply", "glb"):
        into_fifo = CliRunner().invoke(cli, ["export", str(run_dir), "--format", fmt, "-o", str(fifo), "--overwrite"])
        assert into_fifo.exit_code == 2, into_fifo.output
        assert f"{fifo} is a FIFO (named pipe), not a regular file" in into_fifo.output
        assert stat.S_ISFIFO(fifo.lstat().st_mode)  # still the FIFO it was


def test_an_export_adds_its_suffix_and_never_writes_under_another(run, cli, tmp_path):
    # `-o out/noext` with glb: "unsupported export format"; `--format glb -o x.ply`: a GLB named .ply
    run_dir, _ = run
    added = CliRunner().invoke(cli, ["export", str(run_dir), "-f", "glb", "-o", str(tmp_path / "out" / "noext")])
    assert added.exit_code == 0, added.output
    assert (tmp_path / "out" / "noext.glb").read_bytes()[:4] == b"glTF"
    assert f"to {tmp_path / 'out' / 'noext.glb'}" in " ".join(added.output.split())

    other = CliRunner().invoke(cli, ["export", str(run_dir), "-f", "glb", "-o", str(tmp_path / "x.ply")])
    assert other.exit_code == 2
    assert "ends in .ply, the PLY format's suffix, but --format glb writes a GLB file: name it x.glb, or use " \
           "--format ply" in " ".join(other.output.split())
    assert not (tmp_path / "x.ply").exists()
    assert export_run(run_dir, "tum", tmp_path / "poses").path == tmp_path / "poses.txt"


def test_an_export_replaces_only_with_overwrite_and_never_mixes_into_a_folder(run, tmp_path):
    # export overwrote silently (colmap wrote images/ and sparse/ into a source image folder) where run
    # needs --overwrite
    run_dir, _ = run
    first = export_run(run_dir, "ply")
    with pytest.raises(ExportError, match="points.ply already exists; pass --overwrite"):
        export_run(run_dir, "ply")
    assert export_run(run_dir, "ply", overwrite=True).path == first.path

    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "IMG_0001.jpg").write_bytes(b"a photo")
    for overwrite in (False, True):
        with pytest.raises(ExportError, match=r"photos is not empty \(1 entries such as IMG_0001.jpg\): a COLMAP "
                                              r"export writes images and sparse into its folder"):
            export_run(run_dir, "colmap", photos, overwrite=overwrite)
    assert sorted(path.name for path in photos.iterdir()) == ["IMG_0001.jpg"]

    export_run(run_dir, "colmap", tmp_path / "model")
    with pytest.raises(ExportError, match="already holds a COLMAP export; pass --overwrite"):
        export_run(run_dir, "colmap", tmp_path / "model")
    (tmp_path / "model" / "images" / "stale.png").write_bytes(b"from an earlier export")
    export_run(run_dir, "colmap", tmp_path / "model", overwrite=True)
    assert not (tmp_path / "model" / "images" / "stale.png").exists()  # replaced, not mixed


@pytest.mark.slow
def test_full_resolution_exports_carry_the_source_frames_with_scaled_intrinsics(tmp_path, tiny_model):
    # COLMAP and nerfstudio carried the model inputs (518x294 by default), too small for splatting
    run_dir, video = run_video(tmp_path, tiny_model, "run")  # 160x96 frames, 56x28 model inputs
    model = export_run(run_dir, "colmap", tmp_path / "model")
    full = export_run(run_dir, "colmap", tmp_path / "full", full_resolution=True)

    capture = cv2.VideoCapture(str(video))
    for index in range(12):
        ok, source_bgr = capture.read()
        assert ok
        written = cv2.imread(str(tmp_path / "full" / "images" / f"{index:06d}.png"))
        np.testing.assert_array_equal(written, source_bgr)  # the decoded frame itself, 160x96
        assert cv2.imread(str(tmp_path / "model" / "images" / f"{index:06d}.png")).shape == (28, 56, 3)
    capture.release()
    # every observation still projects onto its own pixel through the scaled camera
    cameras, images, points = parse_colmap_strictly(full.path / "sparse" / "0")
    small_cameras, _, _ = parse_colmap_strictly(model.path / "sparse" / "0")
    assert len(observations_of(images)) > 0
    for camera_id, (width, height, *params) in cameras.items():
        small_width, small_height, *small_params = small_cameras[camera_id]
        assert (width, height) == (160, 96) and (small_width, small_height) == (56, 28)
        # COLMAP's pixel centres are at +0.5: a scale of the image is a scale of every parameter
        np.testing.assert_allclose(params, np.multiply(small_params, [160 / 56, 96 / 28, 160 / 56, 96 / 28]))
    for qvec, tvec, camera_id, _, observations in images.values():
        rotation = quat_xyzw_to_matrix(np.roll(qvec, -1))
        _, _, fx, fy, cx, cy = cameras[camera_id]
        for x, y, point_id in observations:
            local = rotation @ points[point_id][0] + tvec
            projected = np.array([fx * local[0] / local[2] + cx, fy * local[1] / local[2] + cy])
            np.testing.assert_allclose(projected, [x, y], atol=2e-3 * 160 / 56)
    with pytest.raises(ExportError, match="--full-resolution writes the source frames beside a COLMAP model"):
        export_run(run_dir, "ply", tmp_path / "cloud.ply", full_resolution=True)
    video.unlink()
    with pytest.raises(ExportError, match="--full-resolution reads the frames again from the run's source, and its "
                                          "source .*clip.mp4 no longer exists"):
        export_run(run_dir, "nerfstudio", tmp_path / "ns", full_resolution=True)
    assert not (tmp_path / "ns").exists()


def observations_of(images: dict) -> list:
    return [observation for image in images.values() for observation in image[4]]


def test_a_tum_export_has_every_pose_of_the_run(tmp_path, tiny_model):
    # after --save-predictions keyframes, `export --format tum` wrote only the keyframes
    run_dir, _ = run_video(tmp_path, tiny_model, "keyframes", save_predictions="keyframes")
    assert len(list((run_dir / "predictions").glob("*.npz"))) < 12
    exported = np.loadtxt(export_run(run_dir, "tum", tmp_path / "poses.txt").path)
    np.testing.assert_array_equal(exported, np.loadtxt(run_dir / "trajectory_tum.txt"))
    assert len(exported) == 12


def test_cli_says_when_an_export_has_grey_points_and_refuses_a_model_without_images(cli, tmp_path):
    # --no-save-images and the source moved: `export --format colmap` said "wrote colmap export", every point grey
    make_run(tmp_path / "run", [plane_frame(i, with_image=False) for i in range(2)])
    cloud = CliRunner().invoke(cli, ["export", str(tmp_path / "run"), "-f", "ply"])
    assert cloud.exit_code == 0, cloud.output
    assert "warning: frame 0 of" in cloud.output and "saved without its image: its points are grey" in cloud.output
    model = CliRunner().invoke(cli, ["export", str(tmp_path / "run"), "-f", "colmap"])
    assert model.exit_code == 2 and "a COLMAP export needs the images" in " ".join(model.output.split())
