"""Gaussian splats: the cloud's points as Gaussians in the reference 3D Gaussian splatting PLY layout, in the
run's world frame; a second pass over the npz files gives each point its confidence and its surface normal
(app/outputs/splats.py makes the Gaussians and writes the PLY). Its cap is DEFAULT_MAX_SPLATS unless
--max-points says otherwise (a run's own cap is for points).
"""

from __future__ import annotations

from stream_recon.app.outputs.export_job import ExportJob, ExportResult, FormatSpec
from stream_recon.app.outputs.splats import gaussian_splats, write_splat_ply

# A splat export's cap when --max-points is not given: a browser renders about half a million splats
# smoothly, and at 248 bytes each (the reference layout, degree-3 colours) the file is ~124 MB.
DEFAULT_MAX_SPLATS = 500_000


def write_splats_export(job: ExportJob) -> ExportResult:
    contents = job.read_frames()
    write_splat_ply(job.target, gaussian_splats(job.run_dir, contents.cloud, contents.accumulator))
    return job.result(contents)


# the 3D Gaussian splatting layout is a PLY file too
SPEC = FormatSpec(name="splats", label="Gaussian splats", listed=5, default_name="splats.ply", suffixes=(".ply",),
                  write=write_splats_export, max_points=DEFAULT_MAX_SPLATS, points_are="splat")
