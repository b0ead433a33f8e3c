"""The pixels a run leaves out of every point it makes: the sky (`--mask-sky`, app.outputs.sky) and the user's masks
(`--mask-dir DIR`), one boolean map per frame at the model input's size, True where a pixel is dropped.

The writer stores it as `sky_mask` in the frame's npz (uint8, 1 = dropped) and leaves those pixels out of
points.ply; every export reads it back from there (points, GLB, COLMAP points, splats, nerfstudio's masks/),
and the viewer drops them from its clouds.

A user's mask folder holds one image per frame, nerfstudio's convention: 0 drops a pixel, anything else keeps
it. A frame's mask is the file named as the frame's exported image (`NNNNNN.png`, its frame index), else the
folder's images in name order, the k-th for frame k. A mask of the model input's size is taken as it is; any
other is a source frame's: turned (`--rotate`), resized and cropped as the frame was (nearest neighbour: a mask
stays a mask).
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

from stream_recon.app.outputs.sky import SkySegmenter
from stream_recon.app.sources.input_size import model_input_size, resized_size
from stream_recon.app.sources.reader import turned_clockwise

MASK_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp")


class MaskDirError(ValueError):
    """A --mask-dir that cannot serve the run's frames (one sentence: what to do)."""


class UserMasks:
    """The masks of a --mask-dir folder, by frame index."""

    def __init__(self, folder: Path | str) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise MaskDirError(f"--mask-dir {self.folder} is not a folder; give the folder of one mask image per frame")
        self.files = sorted(p for p in self.folder.iterdir() if p.suffix.lower() in MASK_SUFFIXES)
        if not self.files:
            raise MaskDirError(f"--mask-dir {self.folder} holds no mask images ({', '.join(MASK_SUFFIXES)}); "
                               "put one per frame there, 0 where a pixel is dropped")
        self._by_name = {p.stem: p for p in self.files}

    def file_for(self, frame_index: int) -> Path:
        named = self._by_name.get(f"{frame_index:06d}")
        if named is not None:
            return named
        if frame_index < len(self.files):
            return self.files[frame_index]
        raise MaskDirError(f"--mask-dir {self.folder} has no mask for frame {frame_index} (neither "
                           f"{frame_index:06d}.png nor a {frame_index + 1}-th image); give every frame one")

    def dropped(self, frame_index: int, size: tuple[int, int], image_width: int, rotate: int = 0) -> np.ndarray:
        """bool [H, W] at the model input's `size` (H, W): True where the frame's mask is 0; `rotate`: the
        degrees the run turned its frames clockwise."""
        path = self.file_for(frame_index)
        mask = cv2.imread(str(path), cv2.IMREAD_GRAYSCALE)
        if mask is None:
            raise MaskDirError(f"cannot read the mask {path}: not an image; replace it")
        if mask.shape != tuple(size):
            mask = turned_clockwise(mask, rotate)
        return _to_model_input(mask, size, image_width) == 0


def _to_model_input(mask: np.ndarray, size: tuple[int, int], image_width: int) -> np.ndarray:
    """A source-sized mask [h, w] -> the model input's [H, W], resized and cropped as the frame was."""
    if mask.shape == tuple(size):
        return mask
    height, width = mask.shape
    if model_input_size(width, height, image_width) != tuple(size):  # another aspect: stretched to fit
        return cv2.resize(mask, (size[1], size[0]), interpolation=cv2.INTER_NEAREST)
    new_width, new_height = resized_size(width, height, image_width)
    resized = cv2.resize(mask, (new_width, new_height), interpolation=cv2.INTER_NEAREST)
    first_row = (new_height - size[0]) // 2  # the crop rule's middle rows
    return resized[first_row: first_row + size[0]]


class FrameMasker:
    """A frame's dropped pixels: the sky (a SkySegmenter) and/or the user's masks; either may be None."""

    def __init__(self, sky: SkySegmenter | None, user: UserMasks | None, image_width: int, rotate: int = 0) -> None:
        self.sky, self.user, self.image_width, self.rotate = sky, user, image_width, rotate

    def dropped(self, frame_index: int, image: np.ndarray | None, size: tuple[int, int]) -> np.ndarray | None:
        """bool [H, W] for a frame whose model input is `image` [H, W, 3] uint8 (None: no sky mask can be
        made), of model-input `size`; None when nothing is dropped."""
        dropped = None
        if self.sky is not None and image is not None:
            dropped = self.sky.sky_pixels(np.ascontiguousarray(image))
        if self.user is not None:
            user = self.user.dropped(frame_index, size, self.image_width, self.rotate)
            dropped = user if dropped is None else dropped | user
        return dropped
