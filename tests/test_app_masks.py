"""Sky masking and user masks: the reference demo's sky-segmentation arithmetic pixel for pixel (on a tiny
stand-in network made here, tests/sky_standin.py), a masked run end to end on the CPU (the npz, points.ply,
GLB, COLMAP points, splats, nerfstudio's masks/, the viewer's cloud), and the bad input of each option."""

from __future__ import annotations

import json
import sys

import cv2
import numpy as np
import pytest
from helpers import read_run
from plyfile import PlyData
from sky_standin import sky_and_ground, write_tiny_skyseg
from typer.testing import CliRunner

from stream_recon.app.cli import app, with_default_command
from stream_recon.app.options import RunOptions
from stream_recon.app.outputs import sky as sky_module
from stream_recon.app.outputs.export import export_run
from stream_recon.app.outputs.masks import MaskDirError, UserMasks
from stream_recon.app.outputs.sky import SKYSEG_URL, SkyModelError, SkySegmenter
from stream_recon.app.run.pipeline import run_sequence, sky_stream
from stream_recon.app.viewer.geometry import sample_keyframe_points

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def skyseg(tmp_path_factory):
    return write_tiny_skyseg(tmp_path_factory.mktemp("skyseg") / "skyseg.onnx")


@pytest.fixture
def checkpoints_with_skyseg(skyseg, monkeypatch):
    """The checkpoints' folder, where `download skyseg` puts the network and runs find it, holding the stand-in."""
    monkeypatch.setenv("STREAM_RECON_CHECKPOINTS", str(skyseg.parent))
    return skyseg.parent


def reference_non_sky(image_rgb: np.ndarray, session) -> np.ndarray:
    """The reference demo's sky segmentation of a model input (its segment_sky_from_array and run_skyseg,
    re-implemented step by step as the test's reference; the product has its own code): a non-sky
    confidence map in [0, 1]."""
    image_bgr = cv2.cvtColor(image_rgb, cv2.COLOR_RGB2BGR)
    resized = cv2.resize(image_bgr, dsize=(320, 320))
    x = cv2.cvtColor(resized, cv2.COLOR_BGR2RGB).astype(np.float32)
    x = (x / 255.0 - np.array([0.485, 0.456, 0.406], dtype=np.float32)) / np.array([0.229, 0.224, 0.225],
                                                                                     dtype=np.float32)
    x = x.transpose(2, 0, 1).reshape(-1, 3, 320, 320).astype("float32")
    result = session.run([session.get_outputs()[0].name], {session.get_inputs()[0].name: x})
    result = np.array(result).squeeze()
    low, high = np.min(result), np.max(result)
    result = (result - low) / max(high - low, 1e-8)
    result *= 255.0
    score = result.astype(np.uint8)
    score = cv2.resize(score, (image_rgb.shape[1], image_rgb.shape[0]), interpolation=cv2.INTER_LINEAR)
    return 1.0 - np.clip(score.astype(np.float32), 0.0, 1.0)


@pytest.mark.parametrize("size, seed", [((378, 518), 0), ((518, 518), 1), ((294, 518), 2), ((33, 56), 3)])
def test_masks_equal_the_reference_demos_pixel_for_pixel(skyseg, size, seed):
    import onnxruntime

    reference_session = onnxruntime.InferenceSession(str(skyseg), providers=["CPUExecutionProvider"])
    segmenter = SkySegmenter(skyseg)
    # a sky with a bright cloud and a ground of noise: the stand-in's map has a range of values, not two
    image = sky_and_ground(*size, horizon=0.35 + 0.1 * seed, seed=seed)
    image[: size[0] // 5, size[1] // 3: size[1] // 2] = 235
    kept = reference_non_sky(image, reference_session) > 0.1  # the reference's _SKYSEG_SOFT_THRESHOLD
    sky = segmenter.sky_pixels(image)
    np.testing.assert_array_equal(sky, ~kept)
    assert 0.2 < sky.mean() < 0.8  # both kinds of pixel are there to compare


def test_the_float16_network_masks_as_the_float32_one_behind_float32_input_and_output(skyseg):
    import onnx

    half = SkySegmenter(skyseg, half_precision=True)
    full = SkySegmenter(skyseg, half_precision=False)
    for seed, size in enumerate([(378, 518), (518, 518), (33, 56)]):
        image = sky_and_ground(*size, horizon=0.3 + 0.1 * seed, seed=seed)
        np.testing.assert_array_equal(half.sky_pixels(image), full.sky_pixels(image))
    assert [io.type for io in (*half.session.get_inputs(), *half.session.get_outputs())] == ["tensor(float)"] * 2
    weights = onnx.load_from_string(sky_module._half_precision_model(skyseg)).graph.initializer
    assert {w.data_type for w in weights} == {onnx.TensorProto.FLOAT16}


def test_the_network_is_float16_on_the_gpu_alone(skyseg, monkeypatch):
    import onnxruntime

    assert sky_stream("cpu") is None
    assert not SkySegmenter(skyseg).half_precision  # this machine's provider is the CPU's
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    models = []

    def session_without_a_gpu(model, **_):
        models.append(model)
        raise RuntimeError("no CUDA device here")

    monkeypatch.setattr(onnxruntime, "InferenceSession", session_without_a_gpu)
    with pytest.raises(SkyModelError, match="no CUDA device here"):
        SkySegmenter(skyseg)
    assert len(models) == 1 and isinstance(models[0], bytes)  # the float16 model, serialised


def test_a_float16_network_without_onnx_is_one_sentence_naming_the_install(skyseg, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx", None)  # import onnx raises ImportError
    with pytest.raises(SkyModelError, match=r"float16, which needs onnx: run `\S+/scripts/setup-env sky`"):
        SkySegmenter(skyseg, half_precision=True)


def write_frames(folder, count: int, size=(96, 160)):
    folder.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        cv2.imwrite(str(folder / f"{index:04d}.png"), cv2.cvtColor(sky_and_ground(*size, seed=index), cv2.COLOR_RGB2BGR))
    return folder


def masked_run(tmp_path, tiny_model, **extra):
    frames = write_frames(tmp_path / "frames", 6)
    options = RunOptions(image_width=56, scale_frames=3, window=4, viewer=False, conf_threshold=1.0, voxel_size=1e-4,
                         save_depth="float32", **extra)
    summary = run_sequence(str(frames), tmp_path / "run", options, model=tiny_model)
    assert summary.status == "complete"
    return tmp_path / "run"


@pytest.mark.slow
def test_a_masked_run_leaves_the_sky_out_of_every_output(tmp_path, tiny_model, checkpoints_with_skyseg):
    run = masked_run(tmp_path, tiny_model, mask_sky=True)
    assert json.loads((run / "run.json").read_text())["settings"]["mask_sky"] is True
    records = read_run(run)
    masks = {r["frame_index"]: r["sky_mask"] for r in records}
    assert all(m is not None and m.dtype == bool for m in masks.values())
    assert all(0.2 < m.mean() < 0.6 and m[0].all() and not m[-1].any() for m in masks.values())  # sky on top
    for record in records:  # the same mask the segmenter gives the frame's model input
        np.testing.assert_array_equal(masks[record["frame_index"]], SkySegmenter(
            checkpoints_with_skyseg / "skyseg.onnx").sky_pixels(record["image"]))

    # COLMAP: every point's observation lies on a kept pixel of its image
    export_run(run, "colmap", tmp_path / "colmap")
    lines = (tmp_path / "colmap" / "sparse" / "0" / "images.txt").read_text().splitlines()
    data = [line for line in lines if not line.startswith("#")]
    num_points = 0
    for header, points in zip(data[0::2], data[1::2], strict=True):
        frame = int(header.split()[-1].removesuffix(".png"))
        xy = np.array(points.split(), dtype=float).reshape(-1, 3)[:, :2] - 0.5  # COLMAP centres at +0.5
        uv = np.round(xy).astype(int)
        assert not masks[frame][uv[:, 1], uv[:, 0]].any()
        num_points += len(uv)
    ply = len(PlyData.read(str(run / "points.ply"))["vertex"])
    assert ply > 0
    unmasked = masked_run(tmp_path / "plain", tiny_model)
    assert ply < 0.8 * len(PlyData.read(str(unmasked / "points.ply"))["vertex"])
    # the GLB, the exported PLY and the splats hold the same masked cloud
    assert export_run(run, "glb", tmp_path / "s.glb").num_points == ply
    assert export_run(run, "ply", tmp_path / "p.ply").num_points == ply
    assert export_run(run, "splats", tmp_path / "g.ply").num_points == ply

    # nerfstudio: masks/ beside images/, named in transforms.json, 0 exactly where the run dropped pixels
    export_run(run, "nerfstudio", tmp_path / "ns")
    transforms = json.loads((tmp_path / "ns" / "transforms.json").read_text())
    for frame in transforms["frames"]:
        mask = cv2.imread(str(tmp_path / "ns" / frame["mask_path"]), cv2.IMREAD_UNCHANGED)
        index = int(frame["file_path"].split("/")[-1].removesuffix(".png"))
        assert mask.dtype == np.uint8 and mask.ndim == 2
        np.testing.assert_array_equal(mask == 0, masks[index])
        assert set(np.unique(mask)) <= {0, 255}

    # the viewer's cloud leaves the masked pixels out (live: the same mask; a replay reads it from the npz)
    from stream_recon.app.viewer.replay import load_frame

    pred = load_frame(run / "predictions" / "000003.npz")
    sample = sample_keyframe_points(pred, 10_000)
    v = np.round(sample.points[:, 1].astype(np.float64) / sample.points[:, 2] * pred.intrinsics[1, 1]
                 + pred.intrinsics[1, 2]).astype(int)
    assert sample.num_points == int((~masks[3]).sum()) and v.min() >= int(masks[3].all(axis=1).sum()) - 1


def test_a_full_resolution_nerfstudio_mask_follows_the_written_image(tmp_path, tiny_model, checkpoints_with_skyseg):
    run = masked_run(tmp_path, tiny_model, mask_sky=True)
    export_run(run, "nerfstudio", tmp_path / "ns", full_resolution=True)
    frame = json.loads((tmp_path / "ns" / "transforms.json").read_text())["frames"][0]
    mask = cv2.imread(str(tmp_path / "ns" / frame["mask_path"]), cv2.IMREAD_UNCHANGED)
    assert mask.shape == (frame["h"], frame["w"]) == (96, 160)
    assert (mask[:20] == 0).all() and (mask[-20:] == 255).all()


def test_user_masks_drop_their_zero_pixels(tmp_path, tiny_model):
    masks = tmp_path / "masks"
    masks.mkdir()
    for index in range(6):  # source-sized masks in name order: the left half is left out
        mask = np.full((96, 160), 255, np.uint8)
        mask[:, :80] = 0
        cv2.imwrite(str(masks / f"m{index:02d}.png"), mask)
    run = masked_run(tmp_path, tiny_model, mask_dir=str(masks))
    for record in read_run(run):
        dropped = record["sky_mask"]
        assert dropped[:, : dropped.shape[1] // 2 - 1].all() and not dropped[:, dropped.shape[1] // 2 + 1:].any()
    # masks named as frame indices are matched by name; any other name puts the folder in natural order
    assert UserMasks(masks).file_for(4).name == "m04.png"
    for index in range(6):
        (masks / f"m{index:02d}.png").rename(masks / f"{5 - index:06d}.png")
    assert UserMasks(masks).file_for(4).name == "000004.png"
    (masks / "000004.png").unlink()
    with pytest.raises(MaskDirError, match="has no mask for frame 4: its masks are named by frame index"):
        UserMasks(masks).file_for(4)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--mask-sky"], "error: --mask-sky needs skyseg.onnx"),
        (["--mask-dir", "NOWHERE"], "error: --mask-dir"),
    ],
)
def test_bad_mask_options_are_one_line_exit_2_and_leave_nothing(tmp_path, monkeypatch, flags, message):
    monkeypatch.setenv("STREAM_RECON_CHECKPOINTS", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    frames = write_frames(tmp_path / "frames", 2)
    out = tmp_path / "out"
    flags = [str(tmp_path / "nowhere") if flag == "NOWHERE" else flag for flag in flags]
    result = CliRunner().invoke(app, with_default_command([str(frames), "-o", str(out), "--no-viewer", *flags]))
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), result.output
    if flags[0] == "--mask-sky":  # offline: the URL to fetch and the folder to put it in
        assert SKYSEG_URL in lines[0] and str(tmp_path / "empty") in lines[0]
    assert not out.exists()


def test_download_skyseg_offline_names_the_url_and_the_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("STREAM_RECON_CHECKPOINTS", str(tmp_path / "checkpoints"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = CliRunner().invoke(app, ["download", "skyseg"])
    assert result.exit_code == 2  # as a run with --mask-sky exits for the same cause
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot download skyseg.onnx")
    assert SKYSEG_URL in lines[0] and str(tmp_path / "checkpoints") in lines[0]
    assert not (tmp_path / "checkpoints").exists()


def test_download_skyseg_finds_one_already_there(checkpoints_with_skyseg):
    result = CliRunner().invoke(app, ["download", "skyseg"])
    assert result.exit_code == 0 and "already here" in result.output


def test_export_mask_sky_masks_a_run_that_was_not(tmp_path, tiny_model, checkpoints_with_skyseg):
    masked = masked_run(tmp_path / "a", tiny_model, mask_sky=True)
    plain = masked_run(tmp_path / "b", tiny_model)
    expected = len(PlyData.read(str(masked / "points.ply"))["vertex"])
    assert export_run(plain, "ply", tmp_path / "p.ply", mask_sky=True).num_points == expected
    export_run(plain, "nerfstudio", tmp_path / "ns", mask_sky=True)
    assert len(list((tmp_path / "ns" / "masks").glob("*.png"))) == 6


def test_the_live_viewer_leaves_masked_pixels_out_of_its_clouds(skyseg):
    from media_helpers import free_port

    from stream_recon.app.outputs.masks import FrameMasker
    from stream_recon.app.viewer import LiveViewer
    from stream_recon.models.stream.prediction import FRAME_KEY, FramePrediction

    height, width = 42, 56
    image = sky_and_ground(height, width)
    sky = SkySegmenter(skyseg).sky_pixels(image)
    pred = FramePrediction(frame_index=0, timestamp=0.0, frame_type=FRAME_KEY, pose_enc=np.zeros(9, np.float32),
                           c2w=np.eye(3, 4, dtype=np.float32),
                           intrinsics=np.array([[50, 0, 28], [0, 50, 21], [0, 0, 1]], np.float32),
                           depth=np.full((height, width), 2.0, np.float32),
                           depth_conf=np.full((height, width), 3.0, np.float32), image=image)
    viewer = LiveViewer(port=free_port(), max_points_per_keyframe=5000, masker=FrameMasker(SkySegmenter(skyseg), None, 56))
    try:
        viewer.on_frame(pred, {})
        assert viewer.flush()
        sample = viewer.scene.keyframes.shown[0].sample
        assert sample.num_points == int((~sky).sum()) < height * width
    finally:
        viewer.close()


def test_view_mask_sky_without_the_network_is_one_line_exit_2(tmp_path, monkeypatch):
    from stream_recon.app.commands.view import view

    run = offline_run_without_skyseg(tmp_path, monkeypatch)
    result = invoke_command(view, "view", [str(run), "--mask-sky"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --mask-sky needs skyseg.onnx") and SKYSEG_URL in lines[0]


def offline_run_without_skyseg(tmp_path, monkeypatch):
    """A finished run of three frames, on a machine offline whose caches hold no skyseg.onnx."""
    from synthetic_run import plane_frame
    from test_app_export import make_run

    monkeypatch.setenv("STREAM_RECON_CHECKPOINTS", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    make_run(tmp_path / "run", [plane_frame(i) for i in range(3)])
    return tmp_path / "run"


def invoke_command(command, name: str, args: list[str]):
    """One command of the CLI as typer runs it (beside a second command, so that its name is asked for)."""
    from typer import Typer

    app = Typer()
    app.command(name=name)(command)
    app.command(name="other")(lambda: None)
    return CliRunner().invoke(app, [name, *args])


def test_a_turned_runs_source_masks_are_turned_with_its_frames(tmp_path, tiny_model):
    masks = tmp_path / "masks"
    masks.mkdir()
    for index in range(6):  # the source's left half left out: after a quarter turn clockwise, its top half
        mask = np.full((96, 160), 255, np.uint8)
        mask[:, :80] = 0
        cv2.imwrite(str(masks / f"{index:06d}.png"), mask)
    run = masked_run(tmp_path, tiny_model, mask_dir=str(masks), rotate=90)
    for record in read_run(run):
        dropped = record["sky_mask"]
        assert dropped.shape == (56, 56) and dropped[:20].all() and not dropped[-20:].any()


def test_export_mask_sky_without_the_network_is_one_line_exit_2_and_leaves_nothing(tmp_path, monkeypatch):
    from stream_recon.app.commands.export import export as export_command

    run = offline_run_without_skyseg(tmp_path, monkeypatch)
    result = invoke_command(export_command, "export", [str(run), "-f", "ply", "--mask-sky"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --mask-sky needs skyseg.onnx") and SKYSEG_URL in lines[0]
    assert not (tmp_path / "run" / "exports").exists()
