"""The reference crop rule against the official outputs (fixture `preprocess`, fixtures README §3.6).

The comparison is exact: the official float input is `uint8 / 255`, so `round(x * 255)` must give
back the fixture's uint8 tensor bit for bit.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import pad_batch, preprocess_frame, preprocess_image, preprocess_path
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from stream_recon.app.sources.input_size import input_size_problem, model_input_size, resized_size
from stream_recon.app.sources.preprocess import (
    ImageReadError,
)

GOLDEN = Path(__file__).parent / "golden" / "preprocess"
INPUTS = GOLDEN / "inputs"
BATCH_STEMS = ["a_landscape_16x9", "b_landscape_4x3", "c_portrait", "d_rgba_transparent", "e_grayscale"]
ALL_STEMS = [*BATCH_STEMS, "f_exif_orientation6"]


@pytest.fixture(scope="module")
def expected() -> dict[str, np.ndarray]:
    with np.load(GOLDEN / "expected.npz") as archive:
        return {key: archive[key] for key in archive.files}


def preprocess_paths(paths, image_width: int = 518) -> np.ndarray:
    """Picture files -> one batch [S, 3, H, W] (white-padded when sizes differ), as the reference batches them."""
    return pad_batch([preprocess_path(path, image_width) for path in paths])


def as_uint8(images: np.ndarray) -> np.ndarray:
    return np.round(images * 255).astype(np.uint8)


@pytest.mark.parametrize("stem", ALL_STEMS)
def test_single_image_matches_official_output_exactly(stem: str, expected: dict[str, np.ndarray]) -> None:
    image = preprocess_path(INPUTS / f"{stem}.png")

    assert image.dtype == np.float32
    golden = expected[f"single_{stem}"]
    assert tuple(image.shape) == golden.shape
    np.testing.assert_array_equal(as_uint8(image), golden)
    # the float input is uint8 / 255 with no other rounding on the way, as torchvision's ToTensor divides
    np.testing.assert_array_equal(image, (torch.from_numpy(golden).float() / 255).numpy())


def test_batch_of_mixed_sizes_is_white_padded_and_centred(expected: dict[str, np.ndarray]) -> None:
    batch = preprocess_paths([INPUTS / f"{stem}.png" for stem in BATCH_STEMS])

    assert tuple(batch.shape) == (5, 3, 518, 518)
    np.testing.assert_array_equal(as_uint8(batch), expected["batch5"])


def test_rgb_frame_path_equals_file_path_for_an_rgb_picture(expected: dict[str, np.ndarray]) -> None:
    # video frames enter as decoded arrays; they must take the same road as a file
    rgb = np.asarray(Image.open(INPUTS / "b_landscape_4x3.png").convert("RGB"))
    np.testing.assert_array_equal(as_uint8(preprocess_frame(rgb)), expected["single_b_landscape_4x3"])


def test_exif_orientation_is_applied_before_the_resize() -> None:
    image = Image.open(INPUTS / "f_exif_orientation6.png")
    assert image.size == (518, 294)  # stored landscape, shown portrait

    assert tuple(preprocess_image(image).shape) == (3, 518, 518)


def test_matching_size_is_not_resampled() -> None:
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, size=(294, 518, 3), dtype=np.uint8)

    np.testing.assert_array_equal(as_uint8(preprocess_frame(rgb)), rgb.transpose(2, 0, 1))


@pytest.mark.parametrize(
    ("width", "height", "expected_hw"),
    [(1920, 1080, (294, 518)), (640, 480, (392, 518)), (480, 640, (518, 518)), (518, 518, (518, 518))],
)
def test_model_input_size_examples_from_the_spec(width: int, height: int, expected_hw: tuple[int, int]) -> None:
    assert model_input_size(width, height) == expected_hw


def test_height_rounds_half_to_even_on_the_patch_count() -> None:
    # 518 x 259: 259 * (518 / 518) / 14 = 18.5 patch rows -> 18 (half-to-even), not 19
    assert resized_size(518, 259) == (518, 252)
    # 518 x 273: 19.5 -> 20
    assert resized_size(518, 273) == (518, 280)


@settings(deadline=None)  # a busy CI machine must not turn a slow example into a failure
@given(st.integers(1, 4000), st.integers(1, 4000), st.sampled_from([224, 364, 518]))
def test_model_input_is_patch_aligned_and_never_taller_than_wide(width: int, height: int, image_width: int) -> None:
    problem = input_size_problem(width, height, image_width)
    if problem is not None:  # less than one patch row: refused, with the smallest height that works
        smallest = int(re.search(r"at least (\d+) high", problem).group(1))
        with pytest.raises(ValueError, match="less than one 14-pixel patch row"):
            model_input_size(width, height, image_width)
        assert input_size_problem(width, smallest, image_width) is None
        assert input_size_problem(width, smallest - 1, image_width) is not None
        return
    out_h, out_w = model_input_size(width, height, image_width)
    assert out_w == image_width
    assert out_h % 14 == 0 and out_h <= image_width


def test_configurable_width_changes_the_output() -> None:
    rgb = np.zeros((480, 640, 3), dtype=np.uint8)
    assert tuple(preprocess_frame(rgb, image_width=280).shape) == (3, 210, 280)


def test_image_width_must_be_a_patch_multiple() -> None:
    with pytest.raises(ValueError, match="multiple of 14"):
        preprocess_frame(np.zeros((48, 64, 3), dtype=np.uint8), image_width=500)


def test_frame_must_be_rgb_uint8() -> None:
    with pytest.raises(ValueError, match=r"\[H, W, 3\] uint8"):
        preprocess_frame(np.zeros((48, 64), dtype=np.uint8))


def test_unreadable_file_names_the_file(tmp_path: Path) -> None:
    fake = tmp_path / "notes.png"
    fake.write_text("not a picture")
    with pytest.raises(ImageReadError, match="notes.png is not a readable image"):
        preprocess_path(fake)
    with pytest.raises(ImageReadError, match="not found"):
        preprocess_path(tmp_path / "missing.png")


def test_pad_batch_puts_the_odd_row_at_the_bottom() -> None:
    small = np.zeros((3, 1, 2), dtype=np.float32)
    big = np.zeros((3, 4, 2), dtype=np.float32)

    batch = pad_batch([small, big])

    # rows: white, black, white, white
    assert batch[0, 0, :, 0].tolist() == [1.0, 0.0, 1.0, 1.0]
    np.testing.assert_array_equal(batch[1], big)
