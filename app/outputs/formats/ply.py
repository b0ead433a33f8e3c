"""PLY: the run's point cloud alone (no cameras), in the run's world frame."""

from __future__ import annotations

from stream_recon.app.outputs.export_job import ExportJob, ExportResult, FormatSpec
from stream_recon.app.outputs.pointcloud import write_ply


def write_ply_export(job: ExportJob) -> ExportResult:
    contents = job.read_frames()
    write_ply(job.target, contents.cloud.xyz, contents.cloud.rgb)
    return job.result(contents)


SPEC = FormatSpec(name="ply", label="PLY", listed=0, default_name="points.ply", suffixes=(".ply",),
                  write=write_ply_export, frames_are="frame")  # a cloud: no cameras
