"""What an export format's file (formats/<name>.py) fills in and what its writer is handed.

A format's file holds its `SPEC` (a FormatSpec: its name, label, where it goes, what it reads, its writer)
and its writer, a function of an `ExportJob` returning an `ExportResult`. The job reads the run for it
(`read_frames`: one pass over the predictions, made by export.py, which stages and swaps the export in);
the writer writes through `atomic_writes.atomic_write` and says a user's problem with one `ExportError` line.

Plain values and NumPy, free of the libraries that write the formats (trimesh, OpenCV): the `export`
command's flags read the specs without loading them.

Conventions every format keeps: the run's world frame (OpenCV axes, the model's scale), pixel centres at
integers in `CameraRecord.intrinsics` (a format with another convention shifts them itself).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stream_recon.app.outputs.pointcloud import PointAccumulator, PointCloud


class ExportError(ValueError):
    """An export cannot be written where it was asked to go, or not from what the run kept."""


@dataclass(frozen=True, kw_only=True)
class FormatSpec:
    """What the export and its command read of one format."""

    name: str  # --format's word, the name of its file in formats/
    label: str  # how messages and help texts name it
    listed: int  # its place in --format's list and the help texts (the cloud first)
    default_name: str  # the file or folder under RUN_DIR/exports/ when no --output is given
    write: Callable[[ExportJob], ExportResult]
    # A file format: the suffixes it is written under, the usual one first (a GLB is never named .ply).
    suffixes: tuple[str, ...] = ()
    # A folder format: what it writes in its folder (images/ among them: the frames, which it needs). A
    # folder holding these and nothing else is an earlier export of the format (replaced with --overwrite);
    # one holding anything else is someone's folder.
    folder_contents: tuple[str, ...] = ()
    # A folder format: the entry of its contents no other export writes (COLMAP's sparse/, nerfstudio's
    # transforms.json): a folder holding it and nothing but the format's contents holds one of its exports, into
    # which no file export writes.
    folder_marker: str = ""
    # Reads the frames' predictions (points, cameras, images); False: the run's trajectory alone.
    reads_frames: bool = True
    # Its own cap on points in place of the run's (None: the run's).
    max_points: int | None = None
    # What its summary line counts: the frames, as what they are to the format; the points (None: none).
    frames_are: str = "camera"
    points_are: str | None = "point"


@dataclass(frozen=True)
class PixelScale:
    """How a model-input pixel maps into the image written beside a camera (the source frame at full
    resolution): u' = (u + 0.5) sx - 0.5, v' = (v + row_offset + 0.5) sy - 0.5 (integer pixel centres).
    The identity when the model input itself is written."""

    sx: float = 1.0
    sy: float = 1.0
    row_offset: float = 0.0  # rows the portrait crop cut from the top of the resized picture

    def intrinsics(self, intrinsics: np.ndarray) -> np.ndarray:
        scaled = np.array(intrinsics, dtype=np.float64)
        scaled[0, 0] *= self.sx
        scaled[1, 1] *= self.sy
        scaled[0, 2] = (scaled[0, 2] + 0.5) * self.sx - 0.5
        scaled[1, 2] = (scaled[1, 2] + self.row_offset + 0.5) * self.sy - 0.5
        return scaled

    def pixels(self, uv: np.ndarray) -> np.ndarray:
        """Model-input pixels [N, 2] (u, v) -> pixels of the written image, integer centres."""
        return (np.asarray(uv, dtype=np.float64) + [0.5, self.row_offset + 0.5]) * [self.sx, self.sy] - 0.5


@dataclass(frozen=True)
class CameraRecord:
    """One frame's camera, kept for the whole run (a few hundred bytes each)."""

    frame_index: int
    timestamp: float
    c2w: np.ndarray  # [3, 4]
    intrinsics: np.ndarray  # [3, 3] pixels of the written image (the model input's without one), integer centres
    image_size: tuple[int, int]  # (H, W) of the written image
    is_keyframe: bool
    median_depth: float  # of the confident pixels, nan when none
    image_name: str | None  # file written under images/ (COLMAP, nerfstudio), when the frame carried its image
    pixel_scale: PixelScale = PixelScale()  # model-input pixels -> the written image's
    mask_name: str | None = None  # file written under masks/ (nerfstudio), when the run masked the frame


@dataclass(frozen=True)
class RunContents:
    """What one pass over a run's predictions read: the cameras, the cloud and what made it (its voxel as it
    ended), why the points are grey (None: they have colours) and what masked its pixels (for an empty
    cloud's reason)."""

    cameras: list[CameraRecord]
    cloud: PointCloud
    accumulator: PointAccumulator
    grey_points: str | None
    masks: str


@dataclass(frozen=True)
class ExportResult:
    path: Path
    num_frames: int
    num_points: int
    conf_threshold: float
    voxel_size: float | None  # what the cloud ended with (it doubles when max_points is reached)
    grey_points: str | None = None  # why the points have no colours (no image was saved or can be read back)
    empty_reason: str | None = None  # why a points format's export holds no point (PointAccumulator.empty_reason)


@dataclass(frozen=True)
class ExportJob:
    """One export being written, as its format's writer sees it: the run, where to write (a file, or the
    folder of a folder format), the point settings, and the one pass over the run's predictions (a folder
    format's images written under its images/ as they come)."""

    run_dir: Path
    target: Path
    conf_threshold: float
    voxel_size: float | None
    max_points: int
    read_frames: Callable[[], RunContents]

    def result(self, contents: RunContents) -> ExportResult:
        """What an export of the frames wrote: their cameras and points, the voxel the cloud ended with."""
        return ExportResult(self.target, len(contents.cameras), len(contents.cloud), self.conf_threshold,
                            contents.accumulator.voxel_size, contents.grey_points,
                            contents.accumulator.empty_reason(contents.masks))


# OpenCV camera axes (y down, z forward) to glTF's and OpenGL's (y up, z backward): a half turn about x.
OPENCV_TO_GLTF = np.diag([1.0, -1.0, -1.0, 1.0])
