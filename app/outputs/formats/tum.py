"""TUM: the run's whole trajectory (also the frames saved without an npz), one pose a line; no points."""

from __future__ import annotations

from stream_recon.app.outputs.export_job import ExportJob, ExportResult, FormatSpec
from stream_recon.app.outputs.trajectories import run_trajectory, write_tum


def write_tum_export(job: ExportJob) -> ExportResult:
    timestamps, c2w = run_trajectory(job.run_dir)
    write_tum(job.target, timestamps, c2w)
    return ExportResult(job.target, len(timestamps), 0, job.conf_threshold, job.voxel_size)


SPEC = FormatSpec(name="tum", label="TUM", listed=3, default_name="trajectory_tum.txt", suffixes=(".txt", ".tum"),
                  write=write_tum_export, reads_frames=False, frames_are="pose", points_are=None)
