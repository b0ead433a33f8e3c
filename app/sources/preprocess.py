"""The reference crop rule: any picture in, a model input `[3, H, W]` uint8 out (the engine divides by 255 on
the device).

spec/MODEL.md §1 and the `preprocess` fixture define it. With the default width 518:

    1920x1080 -> 518x294      640x480 -> 518x392      480x640 (portrait) -> 518x690 -> rows 86..603 kept

The width is fixed, the height follows the aspect ratio rounded to whole 14-pixel patches, and a
portrait picture keeps only its middle `image_width` rows (the sizes alone: app.sources.input_size). Nothing
is normalised here; the model does that itself.

Every function works on uint8, because that is what PIL resizes in and the reference divides by 255 only
once, after the crop: the float input is therefore always exactly `uint8 / 255`, which is what makes the
fixture check an exact one.
"""

from __future__ import annotations

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


def preprocess_frame_uint8(rgb: np.ndarray, image_width: int = DEFAULT_IMAGE_WIDTH) -> np.ndarray:
    """Decoded RGB frame (a video frame, or a picture already made upright) -> model input uint8 `[3, H, W]`.

    rgb: [H, W, 3] uint8, RGB order (OpenCV decodes BGR: convert before calling); a picture file's pixels
    once made upright (`upright_rgb`: its EXIF turn, RGB, transparency on white), as a folder's reader does. PIL resizes without holding the GIL, so frames can be
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


def _crop_portrait_rows(pixels: np.ndarray, image_width: int) -> np.ndarray:
    """[H, W, 3] -> at most `image_width` rows, taken from the middle (extra row goes to the bottom)."""
    height = pixels.shape[0]
    if height <= image_width:
        return pixels
    first_row = (height - image_width) // 2
    return pixels[first_row : first_row + image_width]
