"""Where an export's frame images come from and how they are written: the npz files' model inputs, or the
run's source read again (a run saved without its images, `--full-resolution`); the sky left out
(`--mask-sky`); each frame's image (and nerfstudio's mask) written as a PNG under the export's images/.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from stream_recon.app.outputs.atomic_writes import atomic_write
from stream_recon.app.outputs.export_job import ExportError, PixelScale
from stream_recon.app.outputs.formats import ExportFormat
from stream_recon.app.outputs.sky import SkyModelError, SkySegmenter, sky_network_path
from stream_recon.app.sources.frames import SourceError
from stream_recon.app.sources.input_size import model_input_size, resized_size
from stream_recon.app.sources.opening import open_source
from stream_recon.app.sources.preprocess import ImageReadError, preprocess_frame_uint8
from stream_recon.app.sources.settings import FrameSelection


@dataclass(frozen=True)
class FrameImage:
    """What was written of one frame's image: its file names (None: none written), its size, and how model
    pixels map into it."""

    image_name: str | None
    mask_name: str | None
    size: tuple[int, int]  # (H, W)
    scale: PixelScale


@dataclass
class ImageSupply:
    """Where the frames' images come from: the npz files, or (saved without them, or at full resolution)
    the run's source read again. grey_reason: why the points will have no colour (None: they will)."""

    fmt: ExportFormat
    source: SourceImages | None = None
    grey_reason: str | None = None
    sky: Any = None  # an app.outputs.sky.SkySegmenter for frames the run did not mask (export --mask-sky)

    def masks(self) -> str:
        """What masked the frames' pixels, for an empty cloud's reason."""
        return "the run's masks (sky_mask in its npz files)" + (" and --mask-sky" if self.sky else "")

    def frame(self, run_dir: Path, record: dict, images_dir: Path | None) -> FrameImage:
        """One frame of the run's predictions: its model input and sky mask filled in where the source or
        --mask-sky give them, its image (and mask) written under `images_dir` (a folder format's)."""
        model_size = tuple(int(size) for size in record["image_size"])
        written, scale = record["image"], PixelScale()
        if self.source is not None:
            written, scale, model_image = self.source.images(record["frame_index"], model_size)
            if record["image"] is None:
                record["image"] = model_image
        unavailable = self.source.unavailable if self.source is not None else None
        if record["image"] is None and self.grey_reason is None:
            self.grey_reason = (f"frame {record['frame_index']} of {run_dir} was saved without its image"
                                f"{f' ({unavailable})' if unavailable else ''}: its points are grey")
        if self.sky is not None and record["sky_mask"] is None:
            if record["image"] is None:
                raise ExportError(f"--mask-sky reads each frame's image, and frame {record['frame_index']} of {run_dir} "
                                  "has none that can be had; export without --mask-sky")
            record["sky_mask"] = self.sky.sky_pixels(record["image"])
        if images_dir is None:
            return FrameImage(None, None, model_size if written is None else tuple(written.shape[:2]), scale)
        if written is None:
            raise ExportError(
                f"frame {record['frame_index']} of {run_dir} was saved without its image"
                f"{f' ({unavailable})' if unavailable else ''}, and a {self.fmt.label} export needs the images; "
                f"export this run as {formats_without_images()}, or run the sequence again with --save-images"
            )
        image_name = mask_name = f"{record['frame_index']:06d}.png"
        write_png(images_dir / image_name, written)
        if self.fmt.writes_masks and record["sky_mask"] is not None:
            write_mask_png(images_dir.parent / "masks" / mask_name,
                           written_mask(record["sky_mask"], scale, written.shape[:2]))
        else:
            mask_name = None
        return FrameImage(image_name, mask_name, tuple(written.shape[:2]), scale)

    def close(self) -> None:
        if self.source is not None:
            self.source.close()


def image_supply(run_dir: Path, settings: dict, fmt: ExportFormat, full_resolution: bool,
                 mask_sky: bool) -> ImageSupply:
    """Decided before anything is written: a format that needs the images (COLMAP, nerfstudio) is refused
    when there are none to be had; the others are exported with grey points and say so."""
    if full_resolution and not fmt.needs_images:
        raise ExportError(
            f"--full-resolution writes the source frames beside a COLMAP model or a nerfstudio dataset; a {fmt.label} "
            "export has no images"
        )
    supply = ImageSupply(fmt)
    if fmt.spec.reads_frames and (full_resolution or settings.get("save_images") is False):
        supply.source = SourceImages(settings, full_resolution=full_resolution)
        if supply.source.unavailable is not None:
            why = ("--full-resolution reads the frames again from the run's source"
                   if full_resolution else f"{run_dir} was saved without its images (--no-save-images)")
            if fmt.needs_images:
                raise ExportError(
                    f"{why}, and {supply.source.unavailable}; a {fmt.label} export needs the images: put the source "
                    f"back where it was, or export as {formats_without_images()}"
                )
            supply.grey_reason = f"{why}, and {supply.source.unavailable}: the points are grey"
    if mask_sky:
        try:
            supply.sky = SkySegmenter(sky_network_path(download=True))
        except SkyModelError as error:
            raise ExportError(str(error)) from None
    return supply


def formats_without_images() -> str:
    return ", ".join(fmt.value for fmt in ExportFormat if not fmt.needs_images)


def written_mask(dropped: np.ndarray, scale: PixelScale, size: tuple[int, int]) -> np.ndarray:
    """A frame's dropped pixels [H, W] (model input) -> nerfstudio's mask for the written image of `size`:
    uint8, 0 where a pixel is left out, 255 elsewhere; each written pixel takes its model pixel's value
    (nearest), and rows the portrait crop cut (nothing was predicted there) are kept."""
    keep = np.where(dropped, 0, 255).astype(np.uint8)
    if keep.shape == tuple(size):
        return keep
    v, u = np.mgrid[0:size[0], 0:size[1]].astype(np.float32)
    map_u = (u + 0.5) / scale.sx - 0.5
    map_v = (v + 0.5) / scale.sy - 0.5 - scale.row_offset
    return cv2.remap(keep, map_u, map_v, cv2.INTER_NEAREST, borderMode=cv2.BORDER_CONSTANT, borderValue=255)


def write_mask_png(path: Path, mask: np.ndarray) -> None:
    """A single-channel uint8 mask [H, W] as a PNG file (as write_png: an OSError with its errno on a full disk)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    encoded, png = cv2.imencode(".png", mask)
    if not encoded:
        raise ExportError(f"could not encode {path.name} as a PNG image ({mask.shape[1]}x{mask.shape[0]})")
    atomic_write(path, lambda f: f.write(png.tobytes()), binary=True)


def write_png(path: Path, rgb: np.ndarray) -> None:
    """An RGB image [H, W, 3] uint8 as a PNG file. Encoded in memory and written as any other file, so that a
    full disk is an OSError with its errno: cv2.imwrite only returned False, after libpng printed its own
    "Write Error" on the terminal."""
    encoded, png = cv2.imencode(".png", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
    if not encoded:
        raise ExportError(f"could not encode {path.name} as a PNG image ({rgb.shape[1]}x{rgb.shape[0]})")
    atomic_write(path, lambda f: f.write(png.tobytes()), binary=True)


class SourceImages:
    """The frames of a run read back from its source: for a run saved without its model inputs, or for an
    export at the source's full resolution.

    run.json's settings name the source (a video file or an image folder: a camera cannot be read
    twice), the frames the run took from it and the input width; the same frames through the same
    preprocessing are the same images, frame i of the run being the i-th frame delivered. The export
    asks for frames in increasing order, so the source is read once, forwards.
    """

    def __init__(self, settings: dict, *, full_resolution: bool = False) -> None:
        self._settings = settings
        self._full_resolution = full_resolution
        self._source = None
        self._frames: Iterator | None = None
        location, kind = settings.get("source_location"), settings.get("source_kind")
        self.unavailable: str | None = None  # why no image can come from the source
        if kind not in ("video", "folder") or not location:
            self.unavailable = f"its source, {settings.get('source', 'not recorded')}, cannot be read again"
        elif not Path(location).exists():
            self.unavailable = f"its source {location} no longer exists"

    def images(self, frame_index: int, model_size: tuple[int, int]) -> tuple[np.ndarray | None, PixelScale, np.ndarray | None]:
        """Frame `frame_index` as (the image to write, how model pixels map into it, the model input
        [H, W, 3] uint8 of size `model_size`); Nones when it cannot be had (see `unavailable`)."""
        rgb = self._frame(frame_index)
        if rgb is None:
            return None, PixelScale(), None
        image_width = self._settings["image_width"]
        height, width = rgb.shape[:2]
        if model_input_size(width, height, image_width) != model_size:
            self.unavailable = (f"its source {self._settings['source_location']} gives {width}x{height} frames now, "
                                f"which do not make the run's {model_size[1]}x{model_size[0]} inputs: it changed")
            return None, PixelScale(), None
        model_image = preprocess_frame_uint8(rgb, image_width).transpose(1, 2, 0)
        if not self._full_resolution:
            return model_image, PixelScale(), model_image
        resized_width, resized_height = resized_size(width, height, image_width)
        scale = PixelScale(width / resized_width, height / resized_height,
                           max(0, (resized_height - image_width) // 2))
        return rgb, scale, model_image

    def _frame(self, frame_index: int) -> np.ndarray | None:
        if self.unavailable is not None:
            return None
        try:
            for frame in self._read():
                if frame.index == frame_index:
                    return frame.rgb
                if frame.index > frame_index:
                    break
        except (SourceError, ImageReadError) as error:
            self.unavailable = f"its source cannot be read again: {error}"
            return None
        self.unavailable = f"its source {self._settings['source_location']} has no frame {frame_index} any more"
        return None

    def _read(self) -> Iterator:
        if self._frames is None:
            settings = self._settings
            selection = FrameSelection(start=settings.get("start", 0), stride=settings.get("stride", 1),
                                       fps=settings.get("fps"), max_frames=settings.get("max_frames"))
            # full frames (resized here), turned as the run turned them
            self._source = open_source(settings["source_location"], selection, rotate=settings.get("rotate", 0))
            self._frames = iter(self._source)
        return self._frames

    def close(self) -> None:
        if self._source is not None:
            self._source.close()

