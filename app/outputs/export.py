"""Export a finished (or interrupted) run directory in one of the formats of formats/ (PLY, GLB, COLMAP, TUM,
nerfstudio, Gaussian splats: a file each, holding its spec and its writer).

Here: where an export goes (`ExportTarget`: checked before anything is read, staged beside an earlier export
and swapped in once complete, removed when it fails) and the one pass over the run's predictions a writer
reads (`read_frames`: one frame in memory at a time, so that the confidence threshold and voxel size can
differ from the run's; the images from export_images.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
from pathlib import Path

import numpy as np

from stream_recon.app.outputs.atomic_writes import (
    move_in_staged,
    remove_retired,
    remove_stale_staging,
    remove_tree,
    staging_folder,
)
from stream_recon.app.outputs.export_images import ImageSupply, image_supply
from stream_recon.app.outputs.export_job import (
    CameraRecord,
    ExportError,
    ExportJob,
    ExportResult,
    RunContents,
)
from stream_recon.app.outputs.formats import ExportFormat
from stream_recon.app.outputs.output_folder import outermost_missing, remove_if_empty
from stream_recon.app.outputs.pointcloud import DEFAULT_CONF_THRESHOLD, DEFAULT_MAX_POINTS, PointAccumulator
from stream_recon.app.outputs.rundir import (
    EXPORTS_DIR,
    PREDICTIONS_DIR,
    RunDirError,
    check_run_dir,
    iter_run,
    prediction_files,
    read_run_info,
)
from stream_recon.app.stopping import interrupts_held


class ExportStopped(KeyboardInterrupt):
    """A stop signal ended an export; `outcome`: what is left at its target (the command prints it)."""

    def __init__(self, outcome: str) -> None:
        super().__init__(outcome)
        self.outcome = outcome


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
    images = image_supply(run_dir, info.get("settings", {}), fmt, full_resolution, mask_sky)
    target = ExportTarget(run_dir, fmt, output, overwrite=overwrite)
    try:
        job = ExportJob(run_dir, target.writes_to, conf_threshold, voxel_size, max_points,
                        read_frames=lambda: read_frames(job, images))
        result = fmt.spec.write(job)
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
        images.close()
    return dataclasses.replace(result, path=target.path)


def read_frames(job: ExportJob, images: ImageSupply) -> RunContents:
    """One pass over the npz files: cameras, the cloud, and (a format that needs them: COLMAP, nerfstudio) the
    images as PNG under its images/."""
    run_dir = job.run_dir
    accumulator = PointAccumulator(conf_threshold=job.conf_threshold, voxel_size=job.voxel_size,
                                   max_points=job.max_points)
    images_dir = job.target / "images" if images.fmt.needs_images else None
    if images_dir is not None:
        images_dir.mkdir(parents=True, exist_ok=True)
    cameras = []
    for record in iter_run(run_dir):
        depth, conf = record["depth"], record["depth_conf"]
        confident = depth[(conf >= accumulator.conf_threshold) & (depth > 0)]
        image = images.frame(run_dir, record, images_dir)
        cameras.append(CameraRecord(
            record["frame_index"], record["timestamp"], record["c2w"].astype(np.float64),
            image.scale.intrinsics(record["intrinsics"]), image.size, record["is_keyframe"],
            float(np.median(confident)) if confident.size else float("nan"), image.image_name, image.scale,
            image.mask_name))
        accumulator.add_frame(record["frame_index"], depth, conf, record["intrinsics"], record["c2w"], record["image"],
                              record["sky_mask"])
    if not cameras:
        raise RunDirError(f"{run_dir} has no readable predictions to export")
    return RunContents(cameras, accumulator.cloud(), accumulator, images.grey_reason, images.masks())


def _write_failure(target: Path, error: OSError, replaced: bool) -> str:
    """Why an export could not be written, in one sentence, and what to do (nothing of it is left; an earlier
    export it was to replace is kept)."""
    reason = error.strerror or str(error)
    kept = "the earlier export there is kept" if replaced else "nothing of the export is left there"
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"cannot write {target}: the disk is full ({reason}); {kept}: free some space or choose another --output"
    return f"cannot write {target}: {reason}; choose a writable --output"


def _pick(explicit, recorded, default):
    if explicit is not None:
        return explicit
    return recorded if recorded is not None else default


class ExportTarget:
    """Where an export goes (RUN_DIR/exports/<name> by default; what a format accepts there, its
    `file_target` or `folder_target`), checked before anything is read, and what it created there (discard()
    removes it again when the export fails).

    An existing export is replaced only with overwrite, as `run` replaces a run only with --overwrite, and only
    once the new one is complete: a file by atomic_write's rename; a folder's export is written into a hidden
    folder beside the old entries (`writes_to`) and swapped in by commit(), so that an export stopped or failing
    part-way leaves the old one as it was.
    """

    def __init__(self, run_dir: Path, fmt: ExportFormat, output: Path | None, *, overwrite: bool) -> None:
        self.fmt = fmt
        path = Path(run_dir) / EXPORTS_DIR / fmt.spec.default_name if output is None else Path(output)
        # a folder format's entries of the export it replaces
        self.path, self._earlier = fmt.folder_target(path, overwrite) if fmt.is_folder else \
            (fmt.file_target(path, overwrite), [])
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
        held across the renames is raised as the hold ends, when the export is complete: discard() keeps it. The
        earlier entries are removed after the hold (remove_retired: a stop meanwhile hands them on)."""
        retired = None
        try:
            with interrupts_held():
                if self.writes_to != self.path:
                    retired = move_in_staged(self.writes_to, self._earlier)
                    self.writes_to = self.path
                self._committed = True
        finally:  # (also when the held signal is raised as the hold ends)
            if retired is not None:
                remove_retired(retired)

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

