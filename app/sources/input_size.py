"""The model input's size: the reference crop rule's arithmetic, without touching a pixel.

spec/MODEL.md §1: the width is fixed (`image_width`, 518 by default), the height follows the aspect
ratio rounded to whole 14-pixel patches, and a portrait picture keeps only its middle `image_width`
rows. app.sources.preprocess applies the rule to pixels; the options, the memory estimate and the checks
before a run only need the sizes, which is why they live here, free of the imaging libraries.
"""

from __future__ import annotations

import math

PATCH_SIZE = 14
DEFAULT_IMAGE_WIDTH = 518
# A source so small that each patch of the model input is made of less than one of its pixels across holds no
# detail for the model to match from frame to frame: it sees smooth colour (a 1x1 picture is one colour over
# the whole input). At the default width that is a source under 37 pixels wide; such a source is warned about.
MIN_SOURCE_PIXELS_PER_PATCH = 1.0


def resized_size(width: int, height: int, image_width: int = DEFAULT_IMAGE_WIDTH) -> tuple[int, int]:
    """(width, height) a picture is resized to, before any crop.

    The expression mirrors the reference operation by operation (`height * (new_w / w) / 14`, then
    Python's half-to-even `round`), so that borderline heights round the same way. A picture so wide
    that it would be less than one patch row high raises ValueError (input_size_problem says so first).
    """
    check_image_width(image_width)
    if width <= 0 or height <= 0:
        raise ValueError(f"an image must have a positive size, got {width}x{height}")
    num_patch_rows = round(height * (image_width / width) / PATCH_SIZE)
    if num_patch_rows < 1:
        raise ValueError(input_size_problem(width, height, image_width))
    return image_width, num_patch_rows * PATCH_SIZE


def model_input_size(width: int, height: int, image_width: int = DEFAULT_IMAGE_WIDTH) -> tuple[int, int]:
    """(H, W) of the model input made from a `width` x `height` picture (after the portrait crop)."""
    new_width, new_height = resized_size(width, height, image_width)
    return min(new_height, image_width), new_width


def input_size_problem(width: int, height: int, image_width: int = DEFAULT_IMAGE_WIDTH) -> str | None:
    """What keeps a `width` x `height` source from becoming a model input at `image_width`, or None.

    At width `image_width` the picture must be at least half a patch high to keep one row of patches:
    a 4000x100 panorama strip at 518 would be 13 pixels high, 0 patch rows."""
    if width <= 0 or height <= 0:
        return f"the source's frames are {width}x{height}: not a picture size"
    if round(height * (image_width / width) / PATCH_SIZE) >= 1:
        return None
    # round() keeps one patch row above half a patch (exactly half rounds to even: none)
    smallest_height = math.floor(PATCH_SIZE / 2 * width / image_width) + 1
    return (
        f"the source's frames are {width}x{height}, an aspect ratio of {width / height:.0f}:1: at --image-width "
        f"{image_width} they would be {height * image_width / width:.1f} pixels high, less than one "
        f"{PATCH_SIZE}-pixel patch row; frames {width} pixels wide need to be at least {smallest_height} high: "
        "crop them to a less extreme aspect ratio"
    )


def too_small_warning(width: int, height: int, image_width: int = DEFAULT_IMAGE_WIDTH) -> str | None:
    """A warning for a `width` x `height` source that the model input would blow up beyond
    MIN_SOURCE_PIXELS_PER_PATCH, or None. The height is scaled as the width is, so the width decides."""
    pixels_per_patch = width * PATCH_SIZE / image_width
    if pixels_per_patch >= MIN_SOURCE_PIXELS_PER_PATCH:
        return None
    smallest_width = math.ceil(MIN_SOURCE_PIXELS_PER_PATCH * image_width / PATCH_SIZE)
    return (f"the source's frames are {width}x{height}: at --image-width {image_width} each {PATCH_SIZE}-pixel patch "
            f"the model reads is {pixels_per_patch:.2g} of their pixels across, too little detail to reconstruct "
            f"anything; use frames at least {smallest_width} pixels wide, or a smaller --image-width")


def check_image_width(image_width: int) -> None:
    if image_width <= 0 or image_width % PATCH_SIZE:
        raise ValueError(
            f"image width must be a positive multiple of {PATCH_SIZE} (the patch size), got {image_width}; "
            f"try {max(PATCH_SIZE, round(image_width / PATCH_SIZE) * PATCH_SIZE)}"
        )
