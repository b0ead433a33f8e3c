"""The reference crop rule: any picture in, a model input `[3, H, W]` float in [0, 1] out.

spec/MODEL.md §1 and the `preprocess` fixture define it. With the default width 518:

    1920x1080 -> 518x294      640x480 -> 518x392      480x640 (portrait) -> 518x690 -> rows 86..603 kept

The width is fixed, the height follows the aspect ratio rounded to whole 14-pixel patches, and a
portrait picture keeps only its middle `image_width` rows (the sizes alone: app.sources.input_size). Nothing
is normalised here; the model does that itself.

Every function works on uint8 until the very last step, because that is what PIL resizes in and
the reference divides by 255 only once, after the crop. The float input is therefore always
exactly `uint8 / 255`, which is what makes the fixture check an exact one.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from stream_recon.app.sources.input_size import DEFAULT_IMAGE_WIDTH, resized_size
from stream_recon.app.sources.input_size import (
    model_input_size as model_input_size,  # its home before input_size
)

_WHITE = 255


class ImageReadError(ValueError):
    """A file that should be a picture could not be decoded."""


def upright_rgb(image: Image.Image) -> Image.Image:
    """Turn a picture as stored into the RGB picture a person sees.

    EXIF orientation comes first (phones store portrait shots as landscape pixels plus a tag).
    Transparent pixels become white: the reference composites RGBA onto opaque white and lets
    every other mode (L, P, CMYK, ...) go through PIL's plain RGB conversion.
    """
    image = ImageOps.exif_transpose(image)
    if image.mode == "RGBA":
        white = Image.new("RGBA", image.size, (_WHITE, _WHITE, _WHITE, 255))
        image = Image.alpha_composite(white, image)
    return image.convert("RGB")


def preprocess_image_uint8(image: Image.Image, image_width: int = DEFAULT_IMAGE_WIDTH) -> np.ndarray:
    """PIL picture (any mode, EXIF tag honoured) -> model input as uint8 `[3, H, W]`."""
    rgb = upright_rgb(image)
    target = resized_size(rgb.width, rgb.height, image_width)
    if rgb.size != target:
        rgb = rgb.resize(target, Image.Resampling.BICUBIC)
    pixels = np.asarray(rgb, dtype=np.uint8)  # [H, W, 3]
    pixels = _crop_portrait_rows(pixels, image_width)
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))  # [3, H, W]


def preprocess_image(image: Image.Image, image_width: int = DEFAULT_IMAGE_WIDTH) -> np.ndarray:
    """PIL picture -> model input `[3, H, W]` float32 in [0, 1], exactly `uint8 / 255`."""
    return to_float(preprocess_image_uint8(image, image_width))


def load_image(path: str | Path) -> Image.Image:
    """Open a picture file, with an error that names it when it is not one."""
    path = Path(path)
    try:
        with Image.open(path) as opened:
            opened.load()
            # Image.open decodes lazily from an open handle; the copy (info and EXIF included)
            # lets the `with` close the file now instead of at garbage collection.
            return opened.copy()
    except FileNotFoundError:
        raise ImageReadError(f"image file not found: {path}") from None
    except (UnidentifiedImageError, OSError, SyntaxError) as error:
        raise ImageReadError(f"{path} is not a readable image ({error})") from None


def preprocess_path(path: str | Path, image_width: int = DEFAULT_IMAGE_WIDTH) -> np.ndarray:
    """Picture file -> model input `[3, H, W]` float32."""
    return preprocess_image(load_image(path), image_width)


def preprocess_frame_uint8(rgb: np.ndarray, image_width: int = DEFAULT_IMAGE_WIDTH) -> np.ndarray:
    """Decoded RGB frame (a video frame, or a picture already made upright) -> model input uint8 `[3, H, W]`.

    rgb: [H, W, 3] uint8, RGB order (OpenCV decodes BGR: convert before calling). The same pixels as
    `preprocess_image_uint8` (a frame has no EXIF tag and is RGB already, so it skips that function's
    conversions: three copies of a full-size frame). PIL resizes without holding the GIL, so frames can be
    preprocessed on several threads at once (app.sources does).
    Video frames skip the reference demo's JPEG round trip on purpose: it only adds compression
    noise, and streaming never writes frames to disk.
    """
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"expected an RGB frame [H, W, 3] uint8, got shape {rgb.shape} dtype {rgb.dtype}")
    height, width = rgb.shape[:2]
    target = resized_size(width, height, image_width)
    if target != (width, height):
        rgb = np.asarray(Image.fromarray(rgb, mode="RGB").resize(target, Image.Resampling.BICUBIC))
    pixels = _crop_portrait_rows(rgb, image_width)
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))  # [3, H, W]


def preprocess_frame(rgb: np.ndarray, image_width: int = DEFAULT_IMAGE_WIDTH) -> np.ndarray:
    """Decoded RGB frame [H, W, 3] uint8 -> `[3, H, W]` float32 in [0, 1], exactly `uint8 / 255`."""
    return to_float(preprocess_frame_uint8(rgb, image_width))


def pad_batch(images: Sequence[np.ndarray]) -> np.ndarray:
    """Stack model inputs of possibly different sizes, as the reference batches them.

    images: S arrays [3, H_i, W_i] -> [S, 3, max H, max W]. A smaller image is centred and the
    border filled with white (1.0); when the rows to add are odd, the extra one goes to the bottom.
    """
    if not images:
        raise ValueError("at least one image is needed to make a batch")
    max_height = max(image.shape[1] for image in images)
    max_width = max(image.shape[2] for image in images)
    padded = []
    for image in images:
        rows, cols = max_height - image.shape[1], max_width - image.shape[2]
        top, left = rows // 2, cols // 2
        padding = ((0, 0), (top, rows - top), (left, cols - left))
        padded.append(np.pad(image, padding, mode="constant", constant_values=1.0))
    return np.stack(padded)  # [S, 3, H, W]


def preprocess_paths(paths: Sequence[str | Path], image_width: int = DEFAULT_IMAGE_WIDTH) -> np.ndarray:
    """Picture files -> one batch `[S, 3, H, W]` (white-padded when sizes differ)."""
    return pad_batch([preprocess_path(path, image_width) for path in paths])


def to_float(pixels: np.ndarray) -> np.ndarray:
    """uint8 array -> float32 array in [0, 1], the same single (correctly rounded) division torchvision's
    ToTensor does."""
    return pixels.astype(np.float32) / np.float32(255)


def _crop_portrait_rows(pixels: np.ndarray, image_width: int) -> np.ndarray:
    """[H, W, 3] -> at most `image_width` rows, taken from the middle (extra row goes to the bottom)."""
    height = pixels.shape[0]
    if height <= image_width:
        return pixels
    first_row = (height - image_width) // 2
    return pixels[first_row : first_row + image_width]
