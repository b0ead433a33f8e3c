"""The reference demo's remaining options: frames turned clockwise before the model (--rotate) and fewer
camera-head refinement iterations (--camera-iterations); each with its bad input."""

from __future__ import annotations

import json

import cv2
import numpy as np
import pytest
import torch
from engine_helpers import DenseCache, frames
from media_helpers import write_image_folder, write_video
from PIL import Image
from typer.testing import CliRunner

from stream_recon.app.cli import app, with_default_command
from stream_recon.app.options import RunOptions
from stream_recon.app.outputs.export import export_run
from stream_recon.app.run.pipeline import run_sequence
from stream_recon.app.sources.opening import open_source
from stream_recon.app.sources.preprocess import load_image, upright_rgb
from stream_recon.app.sources.reader import turned_clockwise
from stream_recon.cache import TokenCache
from stream_recon.models import StreamConfig, StreamingEngine

# PIL's transpose for each clockwise turn: the reference demo turns a frame 90 degrees clockwise with ROTATE_270
PIL_TURNS = {90: Image.Transpose.ROTATE_270, 180: Image.Transpose.ROTATE_180, 270: Image.Transpose.ROTATE_90}


@pytest.mark.parametrize("degrees", [90, 180, 270])
def test_a_turn_is_the_reference_demos_lossless_transpose(degrees):
    rgb = np.random.default_rng(degrees).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    expected = np.asarray(Image.fromarray(rgb).transpose(PIL_TURNS[degrees]))
    turned = turned_clockwise(rgb, degrees)
    np.testing.assert_array_equal(turned, expected)
    assert turned.flags.c_contiguous and turned_clockwise(rgb, 0) is rgb


def test_a_turned_folder_delivers_turned_frames_of_the_turned_size(tmp_path):
    folder = write_image_folder(tmp_path / "frames", ["a.png", "b.png"], width=64, height=48)
    with open_source(folder, rotate=90) as source:
        assert source.frame_size == (48, 64)
        delivered = [frame.rgb for frame in source]
    originals = [np.asarray(upright_rgb(load_image(folder / name))) for name in ("a.png", "b.png")]
    for rgb, original in zip(delivered, originals, strict=True):
        np.testing.assert_array_equal(rgb, np.rot90(original, k=-1))


def test_a_turned_run_records_it_and_its_exports_read_the_source_turned(tmp_path, tiny_model):
    video = write_video(tmp_path / "clip.mp4", 6, width=160, height=96)
    options = RunOptions(image_width=56, scale_frames=3, window=4, viewer=False, conf_threshold=1.0, rotate=270,
                         save_images=False)
    summary = run_sequence(str(video), tmp_path / "run", options, model=tiny_model)
    assert summary.status == "complete"
    settings = json.loads((tmp_path / "run" / "run.json").read_text())["settings"]
    assert settings["rotate"] == 270
    with np.load(tmp_path / "run" / "predictions" / "000000.npz") as npz:
        height, width = npz["image_size"]
    assert height == width == 56  # a landscape video turned a quarter: portrait, cropped to the width (crop rule)
    # saved without images: the COLMAP export reads the video again, turned as the run turned it
    result = export_run(tmp_path / "run", "colmap", tmp_path / "colmap", full_resolution=True)
    assert result.num_frames == 6
    assert cv2.imread(str(tmp_path / "colmap" / "images" / "000000.png")).shape == (160, 96, 3)


def run_engine(model, config, images):
    engine = StreamingEngine(model, config)
    predictions = []
    for i, image in enumerate(images):
        predictions += engine.push(image, timestamp=0.5 * i)
    return predictions + engine.finish(), engine


def first_refinements(model, images, scale_frames: int, window: int) -> list[np.ndarray]:
    """The first refinement's pose [9] of every frame, the model stepped with all its iterations over the
    list-based visible set (every frame a keyframe)."""
    config = model.config
    dense = DenseCache(scale_frames, window, config.num_special_tokens)
    camera = TokenCache(model.camera_head.num_cache_layers, config.camera_heads,
                        config.head_in_dim // config.camera_heads, torch.float32, "cpu")
    assert model.camera_head.iterations_for(camera) == model.camera_head.num_iterations > 1
    poses, start = [], 0
    with torch.inference_mode():
        for batch in [torch.stack(images[:scale_frames])] + [image[None] for image in images[scale_frames:]]:
            n = dense.num_new = batch.shape[0]
            camera.begin(n)
            indices = torch.arange(start, start + n)
            out = model.step(batch, dense, camera, indices, indices, scale_frames)
            camera.commit()
            assert len(out["pose_enc_list"]) == model.camera_head.num_iterations
            poses += list(out["pose_enc_list"][0].numpy())
            start += n
    return poses


def test_fewer_camera_iterations_give_the_first_refinements_poses(prepared_tiny_model):
    """A causal camera head's first iteration never reads a later one's cache, so a stream that runs one
    iteration predicts the first refinement of a stream that runs them all; depth is unchanged."""
    model = prepared_tiny_model
    images = frames(7, seed=3)
    one, engine = run_engine(model, StreamConfig(scale_frames=2, window=3, camera_iterations=1), images)
    full, _ = run_engine(model, StreamConfig(scale_frames=2, window=3), images)
    assert engine.camera_cache.num_layers == model.camera_head.depth
    for pred_one, pred_full, first in zip(one, full, first_refinements(model, images, 2, 3), strict=True):
        np.testing.assert_allclose(pred_one.pose_enc, first, rtol=0, atol=2e-6)
        np.testing.assert_array_equal(pred_one.depth, pred_full.depth)
    assert not np.allclose(np.stack([p.pose_enc for p in one]), np.stack([p.pose_enc for p in full]), atol=1e-4)
    full_again, _ = run_engine(model, StreamConfig(scale_frames=2, window=3, camera_iterations=2), images)
    for a, b in zip(full, full_again, strict=True):  # naming the model's own count changes nothing
        np.testing.assert_array_equal(a.pose_enc, b.pose_enc)


def test_more_camera_iterations_than_the_model_has_are_refused(prepared_tiny_model):
    with pytest.raises(ValueError, match="between 1 and the model's 2 refinement iterations, got 3"):
        StreamingEngine(prepared_tiny_model, StreamConfig(camera_iterations=3))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--rotate", "45"], "error: --rotate must be one of 0, 90, 180, 270 (degrees clockwise), got 45"),
        (["--camera-iterations", "0"], "error: --camera-iterations must be between 1 and 4"),
        (["--camera-iterations", "5"], "error: --camera-iterations must be between 1 and 4"),
        (["--show", "voxels"], "error: --show must be one of points, splats, got 'voxels'"),
    ],
)
def test_bad_demo_options_are_one_line_exit_2_and_leave_nothing(tmp_path, flags, message):
    video = write_video(tmp_path / "clip.mp4", 3)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, with_default_command([str(video), "-o", str(out), "--no-viewer", *flags]))
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), result.output
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["clip.mp4"]
