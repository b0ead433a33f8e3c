"""The pixels a run leaves out of every point it makes: the sky (`--mask-sky`, app.outputs.sky) and the user's masks
(`--mask-dir DIR`), one boolean map per frame at the model input's size, True where a pixel is dropped.

The writer stores it as `sky_mask` in the frame's npz (uint8, 1 = dropped) and leaves those pixels out of
points.ply; every export reads it back from there (points, GLB, COLMAP points, splats, nerfstudio's masks/),
and the viewer drops them from its clouds.

A user's mask folder holds one image per frame, nerfstudio's convention: 0 drops a pixel, anything else keeps
it. Which mask is a frame's: when every mask is named as a frame index (`NNNNNN.png`, six digits, as `export`
names the frame's image), the one of its index; otherwise the folder's images in natural order (as an image
folder's frames: mask_2 before mask_10), the k-th for frame k.

Masks are drawn on the frames as the model sees them, turned by `--rotate`: a mask of the model input's size is
taken as it is, one of the turned frame's size is resized and cropped as the frame was (nearest neighbour: a
mask stays a mask). Under a quarter turn of a frame that is not square, a mask of the frame's size before the
turn (drawn on the file as stored) is turned with it, once. Any other size is refused. `UserMasks.check` reads
the masks' headers before the model loads: one for every frame the run takes, each an image, each of a size
the run takes.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from stream_recon.app.options import OptionsError, RunOptions
from stream_recon.app.outputs.sky import SkyModelError, SkySegmenter, sky_network_path
from stream_recon.app.sources.frames import SourceError
from stream_recon.app.sources.input_size import model_input_size, resized_size
from stream_recon.app.sources.opening import (
    IMAGE_SUFFIXES,
    classify_source,
    list_images,
    open_source,
    upright_size,
)
from stream_recon.app.sources.reader import turned_clockwise

MASK_SUFFIXES = IMAGE_SUFFIXES
# A mask named as a frame index: six digits, as `export` names a frame's image
FRAME_INDEX_NAME = re.compile(r"\d{6}")
# Mask headers read before a run, spread evenly and the last one among them (an image folder's frames: the same
# bound); the writer reads every mask whole as its frame comes
MAX_HEADER_CHECKS = 200


class MaskDirError(ValueError):
    """A --mask-dir that cannot serve the run's frames (one sentence: what to do)."""


class UserMasks:
    """The masks of a --mask-dir folder, by frame index."""

    def __init__(self, folder: Path | str) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise MaskDirError(f"--mask-dir {self.folder} is not a folder; give the folder of one mask image per frame")
        self.files = list_images(self.folder)
        if not self.files:
            raise MaskDirError(f"--mask-dir {self.folder} holds no mask images ({', '.join(MASK_SUFFIXES)}); "
                               "put one per frame there, 0 where a pixel is dropped")
        named = all(FRAME_INDEX_NAME.fullmatch(path.stem) for path in self.files)
        self._by_name = {int(path.stem): path for path in self.files} if named else None

    def file_for(self, frame_index: int) -> Path:
        if self._by_name is not None:
            path = self._by_name.get(frame_index)
            if path is None:
                raise MaskDirError(f"--mask-dir {self.folder} has no mask for frame {frame_index}: its masks are named "
                                   f"by frame index and {frame_index:06d} is not among them; give every frame one")
            return path
        if frame_index < len(self.files):
            return self.files[frame_index]
        raise MaskDirError(f"--mask-dir {self.folder} holds {_masks(len(self.files))}, none for frame {frame_index} "
                           "(the k-th in natural order is frame k's); give every frame one")

    def check(self, frames: int | None, frame_size: tuple[int, int] | None, rotate: int, image_width: int) -> None:
        """Before the model loads: a mask for each of `frames` frames (None: not known before the stream), and
        the masks' headers (MAX_HEADER_CHECKS of them at most) those of images of a size a run of `frame_size`
        (width, height, as the run turns them; None: not known) takes. MaskDirError says what is wrong."""
        if frames is not None:
            self._check_count(frames)
        step = max(1, math.ceil((len(self.files) - 1) / (MAX_HEADER_CHECKS - 1)))
        for index in sorted({*range(0, len(self.files), step), len(self.files) - 1}):
            path = self.files[index]
            try:
                width, height = upright_size(path)
            except SourceError as error:
                raise MaskDirError(f"--mask-dir: {error}") from None
            if frame_size is not None:
                model_size = model_input_size(*frame_size, image_width)
                _turn_for(path, (height, width), model_size, frame_size, rotate, image_width)

    def _check_count(self, frames: int) -> None:
        if self._by_name is not None:
            missing = [index for index in range(frames) if index not in self._by_name]
            if missing:
                listed = ", ".join(f"{index:06d}" for index in missing[:3]) + (", ..." if len(missing) > 3 else "")
                raise MaskDirError(f"--mask-dir {self.folder} has no mask for {_frames(len(missing))} of the "
                                   f"{frames} this run takes ({listed}): its masks are named by frame index; give "
                                   "every frame one")
        elif len(self.files) < frames:
            raise MaskDirError(f"--mask-dir {self.folder} holds {_masks(len(self.files))} for the {frames} frames this "
                               "run takes (the k-th in natural order is frame k's): give every frame one, or take "
                               f"fewer frames (--max-frames {len(self.files)})")

    def dropped(self, frame_index: int, size: tuple[int, int], image_width: int, rotate: int = 0,
                frame_size: tuple[int, int] | None = None) -> np.ndarray:
        """bool [H, W] at the model input's `size` (H, W): True where the frame's mask is 0; `rotate`: the
        degrees the run turned its frames clockwise; `frame_size`: their (width, height) after the turn
        (None: not known, and a mask must then resize to the model input as a frame does)."""
        path = self.file_for(frame_index)
        mask = cv2.imread(str(path), cv2.IMREAD_GRAYSCALE)
        if mask is None:
            raise MaskDirError(f"--mask-dir: cannot read the mask {path}: not an image; replace it")
        mask = turned_clockwise(mask, _turn_for(path, mask.shape, size, frame_size, rotate, image_width))
        return _to_model_input(mask, size, image_width) == 0


def _turn_for(path: Path, shape: tuple[int, ...], model_size: tuple[int, int], frame_size: tuple[int, int] | None,
              rotate: int, image_width: int) -> int:
    """The degrees clockwise a mask of `shape` (h, w) is turned to lie on its frame as the model sees it: 0 for
    one of the model input's size or the turned frame's, `rotate` for one of the frame's size before a quarter
    turn (a square frame's masks are the turned frame's); MaskDirError for any other size."""
    shape = tuple(shape[:2])
    if shape == tuple(model_size):
        return 0
    if frame_size is None:  # a source whose size is known only once its frames come: what resizes to the input
        if model_input_size(shape[1], shape[0], image_width) == tuple(model_size):
            return 0
        raise MaskDirError(f"--mask-dir: {path} is {_size(shape)}, neither the model input's {_size(model_size)} "
                           "nor a size of the frames' aspect; draw the masks on the frames")
    width, height = frame_size
    if shape == (height, width):
        return 0
    stored = (width, height)  # the file's frames before a quarter turn
    if rotate % 180 and shape == stored:
        return rotate
    before = f" ({_size(stored)} before --rotate {rotate})" if rotate % 180 else ""
    raise MaskDirError(f"--mask-dir: {path} is {_size(shape)}, neither the frames' {width}x{height}{before} nor "
                       f"the model input's {_size(model_size)}; draw the masks at one of those sizes, 0 where a pixel "
                       "is left out")


def _to_model_input(mask: np.ndarray, size: tuple[int, int], image_width: int) -> np.ndarray:
    """A frame-sized mask [h, w] -> the model input's [H, W], resized and cropped as the frame was."""
    if mask.shape == tuple(size):
        return mask
    height, width = mask.shape
    new_width, new_height = resized_size(width, height, image_width)
    resized = cv2.resize(mask, (new_width, new_height), interpolation=cv2.INTER_NEAREST)
    first_row = (new_height - size[0]) // 2  # the crop rule's middle rows
    return resized[first_row: first_row + size[0]]


def _size(shape: tuple[int, ...]) -> str:
    return f"{shape[1]}x{shape[0]}"


def _masks(count: int) -> str:
    return f"{count} mask" + ("" if count == 1 else "s")


def _frames(count: int) -> str:
    return f"{count} frame" + ("" if count == 1 else "s")


def user_masks_for(folder: Path | str, source: Any, image_width: int) -> UserMasks:
    """The masks of `folder` for the frames of `source` (an opened FrameSource), checked before the model loads
    (UserMasks.check): their count where the source's length is exact (an image folder's, a video's without
    --fps, which keeps frames by their timestamps), their sizes where its frames' size is known."""
    masks = UserMasks(folder)
    exact = source.kind == "folder" or (source.kind == "video" and source.selection.fps is None)
    masks.check(source.estimated_length if exact else None, source.frame_size, source.rotate, image_width)
    return masks


def check_frame_masks(spec: str, options: RunOptions) -> None:
    """What a run's masks would refuse (app.run.pipeline's frame_masker), said before the run imports torch, as
    OptionsError: the mask folder against the frames of `spec` where it is a file (a video or an image folder,
    opened for its length and frame size, then closed; a camera or a stream is connected to once, by the run),
    and the sky network (onnxruntime and skyseg.onnx at once, the file fetched where the hub answers)."""
    try:
        if options.mask_dir is not None and classify_source(spec)[0] in ("folder", "video"):
            source = open_source(spec, options.selection(), rotate=options.rotate)
            try:
                user_masks_for(options.mask_dir, source, options.image_width)
            finally:
                source.close()
        elif options.mask_dir is not None:
            UserMasks(options.mask_dir).check(None, None, options.rotate, options.image_width)
        if options.mask_sky:
            sky_network_path(download=True)
    except (MaskDirError, SkyModelError) as error:
        raise OptionsError(str(error)) from None


def sky_masker(image_width: int) -> FrameMasker:
    """A masker of the sky alone, for frames of `image_width` (`view --mask-sky`): OptionsError when the sky network
    cannot be had (sky_network_path fetches it where the hub answers)."""
    try:
        return FrameMasker(SkySegmenter(sky_network_path(download=True)), None, image_width)
    except SkyModelError as error:
        raise OptionsError(str(error)) from None


class FrameMasker:
    """A frame's dropped pixels: the sky (a SkySegmenter) and/or the user's masks; either may be None.
    `frame_size`: the (width, height) of the run's frames as it turns them, where known before the stream."""

    def __init__(self, sky: SkySegmenter | None, user: UserMasks | None, image_width: int, rotate: int = 0,
                 frame_size: tuple[int, int] | None = None) -> None:
        self.sky, self.user, self.image_width, self.rotate = sky, user, image_width, rotate
        self.frame_size = frame_size

    def dropped(self, frame_index: int, image: np.ndarray | None, size: tuple[int, int]) -> np.ndarray | None:
        """bool [H, W] for a frame whose model input is `image` [H, W, 3] uint8 (None: no sky mask can be
        made), of model-input `size`; None when nothing is dropped."""
        dropped = None
        if self.sky is not None and image is not None:
            dropped = self.sky.sky_pixels(np.ascontiguousarray(image))
        if self.user is not None:
            user = self.user.dropped(frame_index, size, self.image_width, self.rotate, self.frame_size)
            dropped = user if dropped is None else dropped | user
        return dropped

    def describe(self) -> str:
        """What leaves pixels out, as the flags say it: `--mask-sky`, `--mask-dir DIR`, or both."""
        parts = (["--mask-sky"] if self.sky is not None else []) + (
            [f"--mask-dir {self.user.folder}"] if self.user is not None else [])
        return " and ".join(parts)
