"""Gaussian splats from a run: the reference 3D Gaussian splatting PLY layout, values that follow from the
run's geometry and confidence, and the export command's answers to bad input."""

import re

import numpy as np
import pytest
import typer
from hypothesis import given, settings
from hypothesis import strategies as st
from plyfile import PlyData
from synthetic_run import CONF_HIGH, LOW_CONF_COLUMNS, PLANE_Z, plane_frame
from test_app_export import make_run
from typer.testing import CliRunner

from stream_recon.app.commands.export import export as export_command
from stream_recon.app.outputs.export import export_run
from stream_recon.app.outputs.formats.splats import DEFAULT_MAX_SPLATS
from stream_recon.app.outputs.npz_schema import PredictionOutputs
from stream_recon.app.outputs.splats import (
    SH_C0,
    GaussianSplats,
    opacity_from_confidence,
    quat_wxyz_to_matrix,
    surface_normals,
)
from stream_recon.models.stream.pose import rotation_to_quat_xyzw

# The vertex properties, in order, that graphdeco-inria/gaussian-splatting's save_ply writes for a degree-3
# model; its load_ply finds f_rest_*, scale_* and rot_* by prefix and asserts 45 f_rest for degree 3.
REFERENCE_PROPERTIES = (
    ["x", "y", "z", "nx", "ny", "nz", "f_dc_0", "f_dc_1", "f_dc_2"]
    + [f"f_rest_{k}" for k in range(45)]
    + ["opacity", "scale_0", "scale_1", "scale_2", "rot_0", "rot_1", "rot_2", "rot_3"]
)


@pytest.fixture
def run(tmp_path):
    frames = [plane_frame(i) for i in range(6)]
    make_run(tmp_path / "run", frames, voxel_size=0.04, outputs=PredictionOutputs(depth="float32"))
    return tmp_path / "run"


def columns(vertex, prefix: str) -> np.ndarray:
    """The properties starting with `prefix`, ordered by their number, as the reference loader reads them."""
    names = sorted((p.name for p in vertex.properties if p.name.startswith(prefix)), key=lambda n: int(n.split("_")[-1]))
    return np.stack([np.asarray(vertex[name]) for name in names], axis=1)


def test_the_splat_file_has_the_reference_layout_and_sane_values(run):
    result = export_run(run, "splats")
    assert result.path == run / "exports" / "splats.ply" and result.num_points > 0
    with open(result.path, "rb") as f:
        header = f.read(4096).split(b"end_header\n")[0].decode("ascii").splitlines()
    assert header[:3] == ["ply", "format binary_little_endian 1.0", f"element vertex {result.num_points}"]
    assert header[3:] == [f"property float {name}" for name in REFERENCE_PROPERTIES]

    vertex = PlyData.read(str(result.path))["vertex"]
    xyz = np.stack([vertex["x"], vertex["y"], vertex["z"]], axis=1)
    np.testing.assert_allclose(xyz[:, 2], PLANE_Z, atol=1e-4)  # the points.ply positions
    assert not columns(vertex, "f_rest_").any()
    # colour: the pixel's, through the degree-0 term; the synthetic image's red channel is 8 * u
    rgb = 255 * (0.5 + SH_C0 * columns(vertex, "f_dc_"))
    assert np.all((rgb > -0.5) & (rgb < 255.5)) and np.allclose(rgb, np.round(rgb), atol=1e-3)
    assert np.all(np.round(rgb[:, 0]) % 8 == 0)
    # every kept pixel had confidence CONF_HIGH: opacity (c - 1) / c through its logit
    opacity = 1 / (1 + np.exp(-np.asarray(vertex["opacity"], dtype=np.float64)))
    np.testing.assert_allclose(opacity, (CONF_HIGH - 1) / CONF_HIGH, rtol=1e-5)
    # discs on the plane z = PLANE_Z: the third axis is the plane's normal, facing the cameras (-z)
    rotation = quat_wxyz_to_matrix(columns(vertex, "rot_"))
    np.testing.assert_allclose(np.linalg.norm(columns(vertex, "rot_"), axis=1), 1, atol=1e-5)
    np.testing.assert_allclose(rotation[:, :, 2], np.tile([0.0, 0.0, -1.0], (len(xyz), 1)), atol=1e-3)
    normals = np.stack([vertex["nx"], vertex["ny"], vertex["nz"]], axis=1)
    np.testing.assert_allclose(normals, rotation[:, :, 2], atol=1e-5)
    # as wide as a voxel or a sample's footprint at depth ~4 (focal 30): a radius of 0.02 .. 0.2
    sigma = np.exp(columns(vertex, "scale_"))
    assert np.all((sigma[:, 0] >= 0.02 - 1e-6) & (sigma[:, 0] < 0.2))
    np.testing.assert_allclose(sigma[:, 1], sigma[:, 0], rtol=1e-5)
    np.testing.assert_allclose(sigma[:, 2], 0.2 * sigma[:, 0], rtol=1e-5)


def test_low_confidence_pixels_are_dropped_and_the_cap_holds(run, tmp_path):
    full = export_run(run, "splats", tmp_path / "full.ply")
    points = export_run(run, "ply", tmp_path / "points.ply")
    assert full.num_points == points.num_points  # the same pixels as the cloud, nothing more
    vertex = PlyData.read(str(tmp_path / "full.ply"))["vertex"]
    # no splat comes from the low-confidence columns: the synthetic image's red channel is 8 * u
    red = np.round(255 * (0.5 + SH_C0 * np.asarray(vertex["f_dc_0"], dtype=np.float64)))
    assert full.num_points > 0 and red.min() >= 8 * LOW_CONF_COLUMNS
    none = export_run(run, "splats", tmp_path / "none.ply", conf_threshold=CONF_HIGH + 1)
    assert none.num_points == 0 and len(PlyData.read(str(tmp_path / "none.ply"))["vertex"]) == 0
    capped = export_run(run, "splats", tmp_path / "capped.ply", max_points=50)
    assert 0 < capped.num_points <= 50 and capped.voxel_size > full.voxel_size


def test_a_splat_export_is_capped_by_its_own_default_not_the_runs(tmp_path):
    frames = [plane_frame(i) for i in range(3)]
    make_run(tmp_path / "run", frames, voxel_size=0.01, max_points=20)  # the run kept only 20 points
    result = export_run(tmp_path / "run", "splats")
    assert DEFAULT_MAX_SPLATS > result.num_points > 20


def test_opacity_reads_the_confidence_as_odds():
    np.testing.assert_allclose(opacity_from_confidence(np.array([2.0, 5.0, 11.0])), [0.5, 0.8, 10 / 11], rtol=1e-5)
    low = opacity_from_confidence(np.array([1.0, 0.0, np.nan]))
    assert np.all(np.isfinite(low)) and np.all(low < 0.01)


def test_normals_of_a_tilted_plane_and_a_depth_edge():
    height, width, focal = 20, 30, 25.0
    intrinsics = np.array([[focal, 0, 14.5], [0, focal, 9.5], [0, 0, 1]])
    v, u = np.mgrid[0:height, 0:width].astype(np.float64)
    rays = np.stack([(u - 14.5) / focal, (v - 9.5) / focal, np.ones_like(u)], -1)
    normal = np.array([0.3, -0.2, -1.0]) / np.linalg.norm([0.3, -0.2, -1.0])
    depth = (-3.0 / (rays @ normal)).astype(np.float32)  # the plane n . p = 3, seen from the origin
    depth[:, 25:] *= 2  # a step: the pixels beside it face the camera instead
    us, vs = np.array([5, 10, 24, 27]), np.array([5, 12, 8, 3])
    normals = surface_normals(depth, intrinsics, us, vs)
    np.testing.assert_allclose(normals[:2], np.tile(normal, (2, 1)), atol=1e-3)
    ray = rays[vs[2], us[2]]
    np.testing.assert_allclose(normals[2], -ray / np.linalg.norm(ray), atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(normals, axis=1), 1, atol=1e-9)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-3, 3), min_size=3, max_size=3), st.floats(0.01, 2))
def test_covariances_are_rotation_scaled_by_the_sigmas(axis, sigma):
    angle = float(np.linalg.norm(axis))
    k = np.array(axis) / angle if angle > 0 else np.array([1.0, 0.0, 0.0])
    cross = np.array([[0, -k[2], k[1]], [k[2], 0, -k[0]], [-k[1], k[0], 0]])
    rotation = np.eye(3) + np.sin(angle) * cross + (1 - np.cos(angle)) * cross @ cross
    wxyz = np.roll(rotation_to_quat_xyzw(rotation), 1)
    np.testing.assert_allclose(quat_wxyz_to_matrix(wxyz), rotation, atol=1e-9)
    splats = GaussianSplats(np.zeros((1, 3), np.float32), np.zeros((1, 3), np.uint8), np.ones(1, np.float32),
                            np.array([[sigma, 2 * sigma, 0.5 * sigma]], np.float32),
                            wxyz[None].astype(np.float32), rotation[None, :, 2].astype(np.float32))
    expected = rotation @ np.diag([sigma, 2 * sigma, 0.5 * sigma]) ** 2 @ rotation.T
    np.testing.assert_allclose(splats.covariances()[0], expected, rtol=1e-4, atol=1e-6 * sigma**2)


@pytest.fixture
def cli():
    app = typer.Typer()
    app.command()(export_command)
    app.command("noop")(lambda: None)
    return app


def test_cli_splats_of_a_folder_that_is_no_run_is_one_line_exit_2(cli, tmp_path):
    outcome = CliRunner().invoke(cli, ["export", str(tmp_path), "-f", "splats"])
    assert outcome.exit_code == 2 and outcome.output.startswith("error: ")
    assert len(outcome.output.strip().splitlines()) == 1 and not (tmp_path / "exports").exists()


def test_cli_writes_splats_and_says_so(run, cli, tmp_path):
    outcome = CliRunner().invoke(cli, ["export", str(run), "--format", "splats", "-o", str(tmp_path / "map")])
    assert outcome.exit_code == 0, outcome.output
    assert re.search(r"wrote splats export \(6 cameras, \d+ splats, voxel 0.04\) to .*map\.ply", outcome.output)
    assert (tmp_path / "map.ply").is_file()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["-o", "OUT/map.glb"], r"ends in \.glb, the GLB format's suffix, but --format splats writes a Gaussian splats"),
        (["--full-resolution"], r"--full-resolution writes the source frames"),
        (["--voxel-size", "-1"], r"voxel"),
    ],
)
def test_cli_bad_splat_input_is_one_line_exit_2_and_leaves_nothing(run, cli, tmp_path, extra, message):
    out = tmp_path / "out"
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    extra = [arg.replace("OUT", str(out)) for arg in extra]
    outcome = CliRunner().invoke(cli, ["export", str(run), "-f", "splats", *extra])
    assert outcome.exit_code == 2, outcome.output
    lines = outcome.output.strip().splitlines()
    assert "Traceback" not in outcome.output and re.search(message, outcome.output)
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert not out.exists() and sorted(p.relative_to(run) for p in run.rglob("*")) == before
