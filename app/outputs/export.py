"""Export a finished (or interrupted) run directory: PLY cloud, GLB scene, COLMAP text model, TUM trajectory,
nerfstudio dataset, Gaussian splats.

Everything is rebuilt from `predictions/*.npz` in one streaming pass (one frame in memory at a time), so
the confidence threshold and voxel size can differ from the ones the run used. A run saved without its
images (`--no-save-images`) gets them back from its source, a video or folder read again in step.

Conventions of the outputs:
- PLY, TUM, COLMAP, nerfstudio keep the run's world frame (OpenCV axes, the model's scale).
- GLB follows glTF (y up, cameras looking down -z): the world is turned 180 degrees about x, so the first
  camera sits upright in any glTF viewer. Each camera is a node whose transform is its pose.
- COLMAP and nerfstudio put pixel centres at +0.5 (their convention; ours is integer centres), so cx, cy
  and every 2D point are shifted by half a pixel. COLMAP poses are world-to-camera, quaternion
  (qw qx qy qz).
- nerfstudio's transform_matrix is camera-to-world with OpenGL camera axes (x right, y up, z backward):
  our c2w with its y and z columns negated. Its points.ply (for Gaussian-splatting initialisation)
  is in the same world frame, which `applied_transform` (identity) declares.
- Gaussian splats (app.outputs.splats) keep the run's world frame, in the reference 3D Gaussian splatting PLY layout;
  their cap is DEFAULT_MAX_SPLATS unless --max-points says otherwise (a run's own cap is for points).

Each format is one entry of app.export_formats.ExportFormat, which names its writer here: a function of the
`ExportJob` (the run, the target, the point settings, the images) that returns the `ExportResult`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cv2
import numpy as np

from stream_recon.app.outputs.export_formats import ExportFormat, folder_export_in
from stream_recon.app.outputs.pointcloud import (
    DEFAULT_CONF_THRESHOLD,
    DEFAULT_MAX_POINTS,
    PointAccumulator,
    PointCloud,
    write_ply,
)
from stream_recon.app.outputs.rundir import (
    EXPORTS_DIR,
    PREDICTIONS_DIR,
    OutputPathError,
    RunDirError,
    atomic_write,
    check_run_dir,
    file_to_write,
    is_staging,
    iter_run,
    outermost_missing,
    prediction_files,
    read_run_info,
    remove_if_empty,
    remove_stale_staging,
    remove_tree,
    run_trajectory,
    staging_folder,
    swap_in_staged,
    write_tum,
)
from stream_recon.app.outputs.sky import SkyModelError, SkySegmenter, sky_network_path
from stream_recon.app.outputs.splats import GaussianSplats, frame_splats, write_splat_ply
from stream_recon.app.sources.input_size import model_input_size, resized_size
from stream_recon.app.sources.opening import open_source
from stream_recon.app.sources.preprocess import ImageReadError, preprocess_frame_uint8
from stream_recon.app.sources.reader import SourceError
from stream_recon.app.sources.settings import FrameSelection
from stream_recon.app.stopping import interrupts_held
from stream_recon.models.stream.pose import rotation_to_quat_xyzw

if TYPE_CHECKING:
    import trimesh
    from trimesh.path import Path3D

# OpenCV camera axes (y down, z forward) to glTF's and OpenGL's (y up, z backward): a half turn about x.
OPENCV_TO_GLTF = np.diag([1.0, -1.0, -1.0, 1.0])
# Frustum depth as a fraction of the median scene depth: visible, but not covering the cloud.
FRUSTUM_DEPTH_FRACTION = 0.1


class ExportError(ValueError):
    """An export cannot be written where it was asked to go, or not from what the run kept."""


class ExportStopped(KeyboardInterrupt):
    """A stop signal ended an export; `outcome`: what is left at its target (the command prints it)."""

    def __init__(self, outcome: str) -> None:
        super().__init__(outcome)
        self.outcome = outcome


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
class ExportResult:
    path: Path
    num_frames: int
    num_points: int
    conf_threshold: float
    voxel_size: float | None  # what the cloud ended with (it doubles when max_points is reached)
    grey_points: str | None = None  # why the points have no colours (no image was saved or can be read back)
    empty_reason: str | None = None  # why a points format's export holds no point (PointAccumulator.empty_reason)


@dataclass(frozen=True)
class _RunContents:
    cameras: list[CameraRecord]
    cloud: PointCloud
    accumulator: PointAccumulator  # what made the cloud (its voxel as it ended)


def export_run(
    run_dir: Path,
    fmt: ExportFormat | str,
    output: Path | None = None,
    *,
    conf_threshold: float | None = None,
    voxel_size: float | None = None,
    max_points: int | None = None,
    overwrite: bool = False,
    full_resolution: bool = False,
    mask_sky: bool = False,
) -> ExportResult:
    """Write one export of `run_dir`; options left as None take the run's own values (run.json).

    An existing output is replaced only with `overwrite` (a folder only when it holds an earlier export of
    the same format); `full_resolution` (COLMAP, nerfstudio) writes the source frames at their own size,
    read back from the run's video or folder, with the intrinsics scaled to them; `mask_sky` leaves the sky
    out of a run that was not masked (app.outputs.sky; a masked run's own masks are used either way). Nothing is left
    behind when an export fails.
    """
    fmt = ExportFormat(fmt)
    run_dir = Path(run_dir)
    check_run_dir(run_dir)  # before anything is created under it
    info = read_run_info(run_dir)
    if not prediction_files(run_dir):  # a run stopped (or killed) before its first frame: nothing to export
        how = (f"its run ({info['status']}) ended before its first frame was written" if info.get("status")
               else f"its {PREDICTIONS_DIR}/ holds no prediction file")
        raise RunDirError(f"{run_dir} has no frames: {how}, so there is nothing to export")
    recorded = info.get("summary", {}).get("points", {})
    conf_threshold = _pick(conf_threshold, recorded.get("conf_threshold"), DEFAULT_CONF_THRESHOLD)
    if fmt.spec.max_points is not None:  # its own cap, from the run's voxel before the run's cap coarsened it
        max_points = _pick(max_points, None, fmt.spec.max_points)
        if voxel_size is None and recorded.get("voxel_size") is not None:
            voxel_size = recorded["voxel_size"] / 2.0 ** recorded.get("coarsenings", 0)
    voxel_size = _pick(voxel_size, recorded.get("voxel_size"), None)
    max_points = _pick(max_points, recorded.get("max_points"), DEFAULT_MAX_POINTS)
    images = _image_supply(run_dir, info.get("settings", {}), fmt, full_resolution)
    if mask_sky:

        try:
            images.sky = SkySegmenter(sky_network_path(download=True))
        except SkyModelError as error:
            raise ExportError(str(error)) from None
    target = ExportTarget(run_dir, fmt, output, overwrite=overwrite)
    try:
        result = fmt.writer()(ExportJob(run_dir, target.writes_to, images, conf_threshold, voxel_size, max_points))
        target.commit()
    except BaseException as error:
        with interrupts_held():  # a repeated Ctrl-C must not cut the clean-up short
            target.discard()
        if isinstance(error, OSError):  # the folder could be made but not written (read-only, full, no permission)
            raise ExportError(_write_failure(target.path, error, target.replaces)) from None
        if isinstance(error, KeyboardInterrupt):
            raise ExportStopped(target.outcome_when_stopped()) from None
        raise
    finally:
        if images.source is not None:
            images.source.close()
    return dataclasses.replace(result, path=target.path)


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


def _write_failure(target: Path, error: OSError, replaced: bool) -> str:
    """Why an export could not be written, in one sentence, and what to do (nothing of it is left; an earlier
    export it was to replace is kept)."""
    reason = error.strerror or str(error)
    kept = "the earlier export there is kept" if replaced else "nothing of the export is left there"
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"cannot write {target}: the disk is full ({reason}); {kept}: free some space or choose another --output"
    return f"cannot write {target}: {reason}; choose a writable --output"


def write_png(path: Path, rgb: np.ndarray) -> None:
    """An RGB image [H, W, 3] uint8 as a PNG file. Encoded in memory and written as any other file, so that a
    full disk is an OSError with its errno: cv2.imwrite only returned False, after libpng printed its own
    "Write Error" on the terminal."""
    encoded, png = cv2.imencode(".png", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
    if not encoded:
        raise ExportError(f"could not encode {path.name} as a PNG image ({rgb.shape[1]}x{rgb.shape[0]})")
    atomic_write(path, lambda f: f.write(png.tobytes()), binary=True)


@dataclass(frozen=True)
class ExportJob:
    """One export being written, as its format's writer sees it: the run, where to write (a file, or the
    folder of a folder format), the point settings and where the frames' images come from."""

    run_dir: Path
    target: Path
    images: _ImageSupply
    conf_threshold: float
    voxel_size: float | None
    max_points: int

    def read_frames(self) -> _RunContents:
        """One pass over the run's predictions: the cameras and the cloud (a folder format's images written
        under its images/ as they come)."""
        accumulator = PointAccumulator(conf_threshold=self.conf_threshold, voxel_size=self.voxel_size,
                                       max_points=self.max_points)
        images_dir = self.target / "images" if self.images.fmt.needs_images else None
        return _read_contents(self.run_dir, accumulator, images_dir, self.images)

    def result(self, contents: _RunContents) -> ExportResult:
        """What an export of the frames wrote: their cameras and points, the voxel the cloud ended with."""
        masks = "the run's masks (sky_mask in its npz files)" + (" and --mask-sky" if self.images.sky else "")
        return ExportResult(self.target, len(contents.cameras), len(contents.cloud), self.conf_threshold,
                            contents.accumulator.voxel_size, self.images.grey_reason,
                            contents.accumulator.empty_reason(masks))


# -- the writers, one a format (named by its entry in app.export_formats) -------------------------------------
def write_ply_export(job: ExportJob) -> ExportResult:
    contents = job.read_frames()
    write_ply(job.target, contents.cloud.xyz, contents.cloud.rgb)
    return job.result(contents)


def write_glb_export(job: ExportJob) -> ExportResult:
    contents = job.read_frames()
    glb = build_glb_scene(contents.cameras, contents.cloud).export(file_type="glb")
    atomic_write(job.target, lambda f: f.write(glb), binary=True)
    return job.result(contents)


def write_colmap_export(job: ExportJob) -> ExportResult:
    contents = job.read_frames()
    write_colmap_text(job.target / "sparse" / "0", contents.cameras, contents.cloud)
    return job.result(contents)


def write_tum_export(job: ExportJob) -> ExportResult:
    """The run's whole trajectory, also the frames saved without an npz; no points."""
    timestamps, c2w = run_trajectory(job.run_dir)
    write_tum(job.target, timestamps, c2w)
    return ExportResult(job.target, len(timestamps), 0, job.conf_threshold, job.voxel_size)


def write_nerfstudio_export(job: ExportJob) -> ExportResult:
    contents = job.read_frames()
    write_nerfstudio(job.target, contents.cameras, contents.cloud)
    return job.result(contents)


def write_splats_export(job: ExportJob) -> ExportResult:
    contents = job.read_frames()
    write_splat_ply(job.target, gaussian_splats(job.run_dir, contents.cloud, contents.accumulator))
    return job.result(contents)


def _pick(explicit, recorded, default):
    if explicit is not None:
        return explicit
    return recorded if recorded is not None else default


class ExportTarget:
    """Where an export goes, checked before anything is read, and what it created there (discard()
    removes it again when the export fails).

    A file format: RUN_DIR/exports/<name> by default; an existing folder gets <name> inside it (never a folder
    that holds a folder format's export: mixed with it, the file would keep --overwrite from replacing it); a
    name without a suffix gets the format's (scene -> scene.glb); a name with another suffix is refused, so a
    GLB is never named .ply; a symlink is written through to its target; a FIFO, a device or a socket is
    refused, never replaced. A folder format: a new or empty folder, or (with overwrite) one that holds an
    earlier export of the same format and nothing else. An existing export is replaced only with
    overwrite, as `run` replaces a run only with --overwrite, and only once the new one is complete: a file
    by atomic_write's rename; a folder's export is written into a hidden folder beside the old entries
    (`writes_to`) and swapped in by commit(), so that an export stopped or failing part-way leaves the old
    one as it was.
    """

    def __init__(self, run_dir: Path, fmt: ExportFormat, output: Path | None, *, overwrite: bool) -> None:
        self.fmt = fmt
        name = fmt.spec.default_name
        path = Path(run_dir) / EXPORTS_DIR / name if output is None else Path(output)
        self._earlier: list[Path] = []  # a folder format's entries of the export it replaces
        self.path = self._folder(path, overwrite) if fmt.is_folder else self._file(path, name, overwrite)
        folder = self.path if fmt.is_folder else self.path.parent
        self._created = outermost_missing(folder)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if fmt.is_folder:
                remove_stale_staging(folder)
            # the new export beside an earlier one, on the same filesystem (renamed in by commit)
            self.writes_to = staging_folder(self.path) if self._earlier else self.path
        except OSError as exc:
            raise ExportError(f"cannot create {folder}: {exc.strerror or exc}; choose a writable --output") from None
        self._replaced_file_existed = not fmt.is_folder and self.path.exists()
        self._committed = False

    @property
    def replaces(self) -> bool:
        """An earlier export is at the path, kept until this one is complete."""
        return bool(self._earlier) or self._replaced_file_existed

    def commit(self) -> None:
        """A folder format's new export in place of the earlier one, in a few renames with signals held
        (a SIGKILL between two of them is the one way to a mix); a new export is in place already. A signal
        held across the renames is raised as the hold ends, when the export is complete: discard() keeps it."""
        with interrupts_held():
            if self.writes_to != self.path:
                swap_in_staged(self.writes_to, self._earlier)
                self.writes_to = self.path
            self._committed = True

    def _file(self, path: Path, name: str, overwrite: bool) -> Path:
        fmt = self.fmt
        if path.is_dir():
            holder = folder_export_in({entry.name for entry in path.iterdir() if not is_staging(entry)})
            if holder is not None:  # written into it, the file would keep --overwrite from replacing that export
                raise ExportError(f"{path} holds a {holder.label} export, which a {fmt.label} file is not written "
                                  f"into; name the file (-o {path.with_name(path.name + fmt.suffix)}) or choose "
                                  "another folder")
            path = path / name
        try:
            path = file_to_write(path)  # a symlink's target, which is what gets written
        except OutputPathError as error:
            raise ExportError(str(error)) from None
        if path.suffix and not fmt.accepts_suffix(path.suffix):
            owner = next((other for other in ExportFormat if other.accepts_suffix(path.suffix)), None)
            whose = f", the {owner.label} format's suffix," if owner else ""
            instead = f", or use --format {owner.value}" if owner else ""
            raise ExportError(
                f"--output {path} ends in {path.suffix}{whose} but --format {fmt.value} writes a {fmt.label} file: "
                f"name it {path.with_suffix(fmt.suffix).name}{instead}"
            )
        if not path.suffix and not path.exists():  # a new name: the format's suffix is added
            path = path.with_name(path.name + fmt.suffix)
        if path.exists() and not overwrite:
            raise ExportError(f"{path} already exists; pass --overwrite to replace it, or choose another --output")
        return path

    def _folder(self, path: Path, overwrite: bool) -> Path:
        fmt = self.fmt
        if path.is_symlink():
            path = path.resolve()
        if path.exists() and not path.is_dir():
            raise ExportError(f"{fmt.label} export goes to a directory, but {path} is a file; choose another --output")
        # (the hidden folders of an export in progress, or killed part-way, are ours, not the user's)
        entries = sorted(entry for entry in path.iterdir() if not is_staging(entry)) if path.is_dir() else []
        others = [entry for entry in entries if entry.name not in fmt.spec.folder_contents]
        if others:
            raise ExportError(
                f"{path} is not empty ({len(entries)} entries such as {others[0].name}): a {fmt.label} export "
                f"writes {' and '.join(fmt.spec.folder_contents)} into its folder and would mix them with other "
                "files; choose a new or empty --output"
            )
        if entries and not overwrite:
            raise ExportError(
                f"{path} already holds a {fmt.label} export; pass --overwrite to replace it, or choose another --output"
            )
        self._earlier = entries  # an earlier export of this format, replaced once the new one is complete
        return path

    def outcome_when_stopped(self) -> str:
        """What a stop left at the target, once discard() has run: the new export (complete, when the stop came
        as it was swapped in), the earlier one, or nothing."""
        if self._committed:
            return f"the new export at {self.path} is complete (the stop came as it was put in place)"
        if self.replaces:
            return f"nothing of the new export was kept; the earlier export at {self.path} is as it was"
        return f"nothing of the export was kept at {self.path}"

    def discard(self) -> None:
        """Remove what this export wrote (its hidden folder, or a new export's contents and file, the folders
        it made); an earlier export stays as it was. A committed export is complete and stays."""
        if self._committed:
            return
        with contextlib.suppress(OSError):
            if self.writes_to != self.path:
                remove_tree(self.writes_to)
            elif self.fmt.is_folder:
                for name in self.fmt.spec.folder_contents:
                    remove_tree(self.path / name)
            elif not self._replaced_file_existed:
                self.path.unlink(missing_ok=True)
        folder = self.path if self.fmt.is_folder else self.path.parent
        remove_if_empty(folder, self._created)


@dataclass
class _ImageSupply:
    """Where the frames' images come from: the npz files, or (saved without them, or at full resolution)
    the run's source read again. grey_reason: why the points will have no colour (None: they will)."""

    fmt: ExportFormat
    source: SourceImages | None = None
    grey_reason: str | None = None
    sky: Any = None  # an app.outputs.sky.SkySegmenter for frames the run did not mask (export --mask-sky)


def _image_supply(run_dir: Path, settings: dict, fmt: ExportFormat, full_resolution: bool) -> _ImageSupply:
    """Decided before anything is written: a format that needs the images (COLMAP, nerfstudio) is refused
    when there are none to be had; the others are exported with grey points and say so."""
    if full_resolution and not fmt.needs_images:
        raise ExportError(
            f"--full-resolution writes the source frames beside a COLMAP model or a nerfstudio dataset; a {fmt.label} "
            "export has no images"
        )
    if not fmt.spec.reads_frames:
        return _ImageSupply(fmt)
    supply = _ImageSupply(fmt)
    if full_resolution or settings.get("save_images") is False:
        supply.source = SourceImages(settings, full_resolution=full_resolution)
        if supply.source.unavailable is not None:
            why = ("--full-resolution reads the frames again from the run's source"
                   if full_resolution else f"{run_dir} was saved without its images (--no-save-images)")
            if fmt.needs_images:
                raise ExportError(
                    f"{why}, and {supply.source.unavailable}; a {fmt.label} export needs the images: put the source "
                    f"back where it was, or export as {_formats_without_images()}"
                )
            supply.grey_reason = f"{why}, and {supply.source.unavailable}: the points are grey"
    return supply


def _formats_without_images() -> str:
    return ", ".join(fmt.value for fmt in ExportFormat if not fmt.needs_images)


def _read_contents(run_dir: Path, accumulator: PointAccumulator, images_dir: Path | None,
                   images: _ImageSupply) -> _RunContents:
    """One pass over the npz files: cameras, the cloud, and (COLMAP, nerfstudio) the images as PNG."""
    if images_dir is not None:
        images_dir.mkdir(parents=True, exist_ok=True)
    cameras = []
    for record in iter_run(run_dir):
        depth, conf = record["depth"], record["depth_conf"]
        confident = depth[(conf >= accumulator.conf_threshold) & (depth > 0)]
        model_size = tuple(int(size) for size in record["image_size"])
        written, scale = record["image"], PixelScale()
        if images.source is not None:
            written, scale, model_image = images.source.images(record["frame_index"], model_size)
            if record["image"] is None:
                record["image"] = model_image
        if record["image"] is None and images.grey_reason is None:
            unavailable = f" ({images.source.unavailable})" if images.source and images.source.unavailable else ""
            images.grey_reason = (f"frame {record['frame_index']} of {run_dir} was saved without its image{unavailable}: "
                                  "its points are grey")
        if images.sky is not None and record["sky_mask"] is None:
            if record["image"] is None:
                raise ExportError(f"--mask-sky reads each frame's image, and frame {record['frame_index']} of {run_dir} "
                                  "has none that can be had; export without --mask-sky")
            record["sky_mask"] = images.sky.sky_pixels(record["image"])
        if images_dir is not None and written is None:
            unavailable = images.source.unavailable if images.source is not None else None
            raise ExportError(
                f"frame {record['frame_index']} of {run_dir} was saved without its image"
                f"{f' ({unavailable})' if unavailable else ''}, and a {images.fmt.label} export needs the images; "
                f"export this run as {_formats_without_images()}, or run the sequence again with --save-images"
            )
        image_name = mask_name = None
        if images_dir is not None:
            image_name = f"{record['frame_index']:06d}.png"
            write_png(images_dir / image_name, written)
            if images.fmt.writes_masks and record["sky_mask"] is not None:
                mask_name = image_name
                write_mask_png(images_dir.parent / "masks" / mask_name,
                               written_mask(record["sky_mask"], scale, written.shape[:2]))
        cameras.append(
            CameraRecord(
                frame_index=record["frame_index"],
                timestamp=record["timestamp"],
                c2w=record["c2w"].astype(np.float64),
                intrinsics=scale.intrinsics(record["intrinsics"]),
                image_size=model_size if written is None else tuple(written.shape[:2]),
                is_keyframe=record["is_keyframe"],
                median_depth=float(np.median(confident)) if confident.size else float("nan"),
                image_name=image_name,
                pixel_scale=scale,
                mask_name=mask_name,
            )
        )
        accumulator.add_frame(record["frame_index"], depth, conf, record["intrinsics"], record["c2w"], record["image"],
                              record["sky_mask"])
    if not cameras:
        raise RunDirError(f"{run_dir} has no readable predictions to export")
    return _RunContents(cameras, accumulator.cloud(), accumulator)


def gaussian_splats(run_dir: Path, cloud: PointCloud, accumulator: PointAccumulator) -> GaussianSplats:
    """The cloud's points as Gaussians, in the cloud's order: a second pass over the npz files reads each
    point's confidence and depth neighbourhood from the frame it was back-projected from."""
    order = np.argsort(cloud.frame_index, kind="stable")
    frames = cloud.frame_index[order]
    parts, rows = [], []
    for record in iter_run(run_dir, frames=set(np.unique(frames).tolist())):  # (the frames the cloud came from)
        these = order[np.searchsorted(frames, record["frame_index"]):
                      np.searchsorted(frames, record["frame_index"], side="right")]
        if not len(these):
            continue
        intrinsics = record["intrinsics"]
        parts.append(frame_splats(cloud.xyz[these], cloud.rgb[these], cloud.pixel[these], record["depth"],
                                  record["depth_conf"], intrinsics, record["c2w"],
                                  pixel_step=accumulator.pixel_step(intrinsics), voxel_size=accumulator.voxel_size))
        rows.append(these)
    found = np.concatenate(rows) if rows else np.empty(0, dtype=np.int64)
    if len(found) != len(cloud):
        raise RunDirError(f"{run_dir} changed while it was exported (a prediction file went missing); export it again")
    position = np.empty(len(cloud), dtype=np.int64)
    position[found] = np.arange(len(found))  # back in the cloud's order
    splats = GaussianSplats.concatenate(parts)
    return GaussianSplats(*(getattr(splats, name)[position] for name in GaussianSplats.FIELDS))


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


# --------------------------------------------------------------------------------------------------
# GLB


def frustum_lines(intrinsics: np.ndarray, image_size: tuple[int, int], depth: float) -> Path3D:
    """Camera-local wireframe: apex at the origin, the image rectangle at z = depth (OpenCV axes).

    Eight segments: four from the apex to the image corners, four around the image; plus a short tick
    above the top edge's centre that shows which way is up.
    """
    # trimesh takes about 1 s to import and only GLB needs it: every other format exports without it
    import trimesh

    h, w = image_size
    fx, fy, cx, cy = intrinsics[0, 0], intrinsics[1, 1], intrinsics[0, 2], intrinsics[1, 2]
    # Pixel centres are integers, so the image edges are half a pixel outside them.
    corners_uv = np.array([[-0.5, -0.5], [w - 0.5, -0.5], [w - 0.5, h - 0.5], [-0.5, h - 0.5]])
    corners = np.column_stack(
        [(corners_uv[:, 0] - cx) / fx * depth, (corners_uv[:, 1] - cy) / fy * depth, np.full(4, depth)]
    )
    top_mid = (corners[0] + corners[1]) / 2
    up_tick = top_mid - np.array([0.0, 0.15 * (corners[3, 1] - corners[0, 1]), 0.0])
    vertices = np.vstack([np.zeros(3), corners, top_mid, up_tick])
    line = trimesh.path.entities.Line
    entities = [line([0, k]) for k in range(1, 5)] + [line([1, 2, 3, 4, 1]), line([5, 6])]
    return trimesh.path.Path3D(entities=entities, vertices=vertices)


def build_glb_scene(cameras: list[CameraRecord], cloud: PointCloud) -> trimesh.Scene:
    """Point cloud ("points"), one frustum node per camera ("camera_NNNNNN") and the trajectory line."""
    # trimesh: for GLB only (frustum_lines says why)
    import trimesh

    scene = trimesh.Scene()
    flip = OPENCV_TO_GLTF[:3, :3]
    if len(cloud):
        colors = np.column_stack([cloud.rgb, np.full(len(cloud), 255, dtype=np.uint8)])
        scene.add_geometry(
            trimesh.PointCloud(cloud.xyz @ flip, colors=colors), node_name="points", geom_name="points"
        )
    depths = np.array([c.median_depth for c in cameras])
    scene_depth = float(np.nanmedian(depths)) if np.isfinite(depths).any() else 1.0
    frustum_depth = FRUSTUM_DEPTH_FRACTION * scene_depth
    for camera in cameras:
        pose = np.eye(4)
        pose[:3] = camera.c2w
        name = f"camera_{camera.frame_index:06d}"
        scene.add_geometry(
            frustum_lines(camera.intrinsics, camera.image_size, frustum_depth),
            node_name=name,
            geom_name=name,
            transform=OPENCV_TO_GLTF @ pose,
        )
    if len(cameras) > 1:
        centres = np.array([c.c2w[:, 3] for c in cameras]) @ flip
        trajectory = trimesh.path.Path3D(entities=[trimesh.path.entities.Line(np.arange(len(centres)))],
                                         vertices=centres)
        scene.add_geometry(trajectory, node_name="trajectory", geom_name="trajectory")
    return scene


# --------------------------------------------------------------------------------------------------
# COLMAP text model


def colmap_pinhole(intrinsics: np.ndarray) -> tuple[float, float, float, float]:
    """fx, fy, cx, cy with COLMAP's half-pixel shift (its first pixel's centre is at 0.5).

    nerfstudio shares the convention (its rays start from pixel coordinates + 0.5).
    """
    return (
        float(intrinsics[0, 0]),
        float(intrinsics[1, 1]),
        float(intrinsics[0, 2]) + 0.5,
        float(intrinsics[1, 2]) + 0.5,
    )


def world_to_camera_qt(c2w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """c2w [3, 4] -> (quaternion (qw, qx, qy, qz) of R_w2c, t_w2c [3]), as COLMAP's images.txt wants."""
    rotation_w2c = c2w[:3, :3].T
    return np.roll(rotation_to_quat_xyzw(rotation_w2c), 1), -rotation_w2c @ c2w[:3, 3]


@dataclass(frozen=True)
class _Observations:
    """Where each 3D point is seen: its source pixel, plus one fallback per image that owns no point.

    image_row [N] is the image (row in `cameras`) each point came from, point2d_index [N] its position in
    that image's POINTS2D list, and by_image [I + 1] the CSR offsets into `order` (points grouped by image).
    """

    image_row: np.ndarray
    point2d_index: np.ndarray
    order: np.ndarray
    by_image: np.ndarray
    fallback: dict[int, tuple[float, float, int]]  # image row -> (x, y, point row)


def _observations(cameras: list[CameraRecord], cloud: PointCloud) -> _Observations:
    """Group the points by source image without a Python loop over points.

    Some COLMAP readers (gsplat's SceneManager) stop at the first blank line, so an image whose POINTS2D
    line would be empty gets the visible point nearest its centre instead.
    """
    frames = np.array([c.frame_index for c in cameras])  # ascending: iter_run yields frames in order
    image_row = np.searchsorted(frames, cloud.frame_index)
    order = np.argsort(image_row, kind="stable")
    counts = np.bincount(image_row, minlength=len(cameras))
    by_image = np.concatenate([[0], np.cumsum(counts)])
    point2d_index = np.empty(len(cloud), dtype=np.int64)
    point2d_index[order] = np.arange(len(cloud)) - by_image[image_row[order]]
    fallback = {}
    for row in np.flatnonzero(counts == 0).tolist():
        if len(cloud):
            nearest = _nearest_visible_point(cameras[row], cloud.xyz)
            if nearest is not None:
                fallback[row] = nearest
    return _Observations(image_row, point2d_index, order, by_image, fallback)


def _nearest_visible_point(camera: CameraRecord, xyz: np.ndarray) -> tuple[float, float, int] | None:
    rotation_w2c = np.ascontiguousarray(camera.c2w[:3, :3].T)
    local = (xyz - camera.c2w[:3, 3]) @ rotation_w2c.T  # [N, 3] camera frame
    fx, fy, cx, cy = colmap_pinhole(camera.intrinsics)
    h, w = camera.image_size
    with np.errstate(divide="ignore", invalid="ignore"):
        x = fx * local[:, 0] / local[:, 2] + cx
        y = fy * local[:, 1] / local[:, 2] + cy
    inside = (local[:, 2] > 0) & (x >= 0) & (x < w) & (y >= 0) & (y < h)
    if not inside.any():
        return None
    candidates = np.flatnonzero(inside)
    best = candidates[np.argmin((x[candidates] - w / 2) ** 2 + (y[candidates] - h / 2) ** 2)]
    return float(x[best]), float(y[best]), int(best)


def write_colmap_text(model_dir: Path, cameras: list[CameraRecord], cloud: PointCloud) -> None:
    """cameras.txt (one PINHOLE per distinct intrinsics), images.txt, points3D.txt in `model_dir`.

    IDs start at 1: image id = row + 1 in frame order, point id = cloud row + 1. Each point's track holds
    the observation it was back-projected from (reprojection error ~0 by construction); tracks are
    minimal, not matched across frames. Coordinates use %.9g, exact for the float32 they come from.
    """
    model_dir.mkdir(parents=True, exist_ok=True)
    camera_ids: dict[tuple, int] = {}
    camera_lines = []
    image_camera = []
    for camera in cameras:
        key = (camera.image_size, colmap_pinhole(camera.intrinsics))
        if key not in camera_ids:
            camera_ids[key] = len(camera_ids) + 1
            (h, w), params = key
            camera_lines.append(f"{camera_ids[key]} PINHOLE {w} {h} " + " ".join(repr(p) for p in params))
        image_camera.append(camera_ids[key])

    seen = _observations(cameras, cloud)
    num_observations = len(cloud) + len(seen.fallback)
    _write_lines(
        model_dir / "cameras.txt",
        [
            "# Camera list with one line of data per camera:",
            "#   CAMERA_ID, MODEL, WIDTH, HEIGHT, PARAMS[]",
            f"# Number of cameras: {len(camera_lines)}",
        ],
        camera_lines,
    )
    _write_lines(
        model_dir / "images.txt",
        [
            "# Image list with two lines of data per image:",
            "#   IMAGE_ID, QW, QX, QY, QZ, TX, TY, TZ, CAMERA_ID, NAME",
            "#   POINTS2D[] as (X, Y, POINT3D_ID)",
            f"# Number of images: {len(cameras)}, mean observations per image: "
            f"{num_observations / len(cameras):.3f}",
        ],
        _image_lines(cameras, image_camera, cloud, seen),
    )
    _write_lines(
        model_dir / "points3D.txt",
        [
            "# 3D point list with one line of data per point:",
            "#   POINT3D_ID, X, Y, Z, R, G, B, ERROR, TRACK[] as (IMAGE_ID, POINT2D_IDX)",
            f"# Number of points: {len(cloud)}, mean track length: "
            f"{num_observations / len(cloud) if len(cloud) else 0.0:.3f}",
        ],
        _point_lines(cloud, seen),
    )


def _image_lines(cameras, image_camera, cloud: PointCloud, seen: _Observations) -> Iterator[str]:
    for row, camera in enumerate(cameras):
        q, t = world_to_camera_qt(camera.c2w)
        name = camera.image_name or f"{camera.frame_index:06d}.png"
        pose = " ".join(repr(float(value)) for value in (*q, *t))
        yield f"{row + 1} {pose} {image_camera[row]} {name}"
        points = seen.order[seen.by_image[row] : seen.by_image[row + 1]]
        # COLMAP's first pixel centre is at (0.5, 0.5), ours at (0, 0).
        table = np.column_stack([camera.pixel_scale.pixels(cloud.pixel[points]) + 0.5, points + 1]).ravel().tolist()
        line = " ".join(["%.9g %.9g %d"] * len(points)) % tuple(table)
        if row in seen.fallback:
            x, y, point = seen.fallback[row]
            line = f"{x:.9g} {y:.9g} {point + 1}"
        yield line


def _point_lines(cloud: PointCloud, seen: _Observations, chunk: int = 65536) -> Iterator[str]:
    extra: dict[int, str] = {}
    for row, (_, _, point) in seen.fallback.items():
        extra[point] = extra.get(point, "") + f" {row + 1} 0"
    # Formatted in chunks so that only one chunk's Python objects are alive at a time.
    for start in range(0, len(cloud), chunk):
        stop = min(start + chunk, len(cloud))
        ids = np.arange(start + 1, stop + 1)
        columns = zip(
            ids.tolist(),
            cloud.xyz[start:stop].tolist(),
            cloud.rgb[start:stop].tolist(),
            (seen.image_row[start:stop] + 1).tolist(),
            seen.point2d_index[start:stop].tolist(),
            strict=True,
        )
        for point_id, (x, y, z), (r, g, b), image_id, index in columns:
            yield f"{point_id} {x:.9g} {y:.9g} {z:.9g} {r} {g} {b} 0 {image_id} {index}" + extra.get(
                point_id - 1, ""
            )


def _write_lines(path: Path, header: list[str], lines) -> None:
    def write(f) -> None:
        f.write("\n".join(header) + "\n")
        for line in lines:
            f.write(line + "\n")

    atomic_write(path, write, binary=False)


# --------------------------------------------------------------------------------------------------
# nerfstudio dataset


def write_nerfstudio(folder: Path, cameras: list[CameraRecord], cloud: PointCloud) -> None:
    """transforms.json and points.ply in `folder`, next to the images/ already written there.

    transforms.json follows nerfstudio's dataparser: per-frame intrinsics (fl_x, fl_y, cx, cy, w, h;
    pinhole, so no distortion terms), file_path relative to the folder, transform_matrix camera-to-world
    [4, 4] in OpenGL camera axes, and ply_file_path for the points that seed Gaussian splatting.
    nerfstudio re-centres, orients and scales the poses itself and applies the same to those points.
    """
    frames = []
    for camera in cameras:
        fx, fy, cx, cy = colmap_pinhole(camera.intrinsics)
        c2w_opengl = np.eye(4)
        c2w_opengl[:3] = camera.c2w
        c2w_opengl = c2w_opengl @ OPENCV_TO_GLTF  # y and z columns negated: same centre, OpenGL axes
        h, w = camera.image_size
        frame = {
            "file_path": f"images/{camera.image_name}",
            "transform_matrix": c2w_opengl.tolist(),
            "fl_x": fx, "fl_y": fy, "cx": cx, "cy": cy, "w": w, "h": h,
        }
        if camera.mask_name is not None:  # nerfstudio's per-image mask: 0 leaves a pixel out of training
            frame["mask_path"] = f"masks/{camera.mask_name}"
        frames.append(frame)
    transforms = {
        "camera_model": "OPENCV",
        # the points are in the poses' frame: nothing was applied to one and not the other
        "applied_transform": np.eye(4)[:3].tolist(),
        "ply_file_path": "points.ply",
        "frames": frames,
    }
    write_ply(folder / "points.ply", cloud.xyz, cloud.rgb)
    text = json.dumps(transforms, indent=2) + "\n"
    atomic_write(folder / "transforms.json", lambda f: f.write(text), binary=False)
