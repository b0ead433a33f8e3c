"""`stream-recon export`: turn a run directory into a PLY cloud, a GLB scene, a COLMAP model, a TUM file,
a nerfstudio dataset or a Gaussian-splat map.

Examples:
    stream-recon export outputs/kitchen --format ply
    stream-recon export outputs/kitchen --format glb --output kitchen.glb
    stream-recon export outputs/kitchen --format colmap --output kitchen_colmap/   # sparse/0 + images/
    stream-recon export outputs/kitchen --format tum --output kitchen_tum.txt
    stream-recon export outputs/kitchen --format nerfstudio -o kitchen_ns/   # then: ns-train splatfacto --data kitchen_ns
    stream-recon export outputs/kitchen --format nerfstudio -o kitchen_full/ --full-resolution   # source frames
    stream-recon export outputs/kitchen --format splats   # exports/splats.ply: open it in a splat viewer
    stream-recon export outputs/street --format nerfstudio -o street_ns/ --mask-sky   # sky left out, masks/
    stream-recon export outputs/kitchen --format ply --conf-threshold 3 --voxel-size 0.01 --overwrite

An export never replaces anything without --overwrite, and never writes into a folder that holds other
files. Exit codes: 0 written; 2 bad input (nothing is left behind); 130 Ctrl-C; 143 SIGTERM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from stream_recon.app.commands._options import (
    bad_input,
    error_console,
    show_engine_log,
    stop_said,
    user_errors,
)
from stream_recon.app.options import point_cloud_problems
from stream_recon.app.outputs.abandoned import close_abandoned_run
from stream_recon.app.outputs.export_job import ExportError
from stream_recon.app.outputs.formats import ExportFormat, own_caps
from stream_recon.app.outputs.rundir import check_run_dir


def export(
    run_dir: Annotated[Path, typer.Argument(help="Run directory written by `stream-recon run`.")],
    format: Annotated[
        ExportFormat, typer.Option("--format", "-f", case_sensitive=False, metavar="FORMAT",
                                   help=f"What to write: {', '.join(fmt.value for fmt in ExportFormat)}.")
    ],
    output: Annotated[
        Optional[Path],
        typer.Option(
            "--output", "-o",
            help="File (ply, glb, tum, splats: the suffix is added when missing) or new or empty directory (colmap, "
            "nerfstudio). Default: RUN_DIR/exports/.",
        ),
    ] = None,
    conf_threshold: Annotated[
        Optional[float],
        typer.Option(help="Keep pixels with depth confidence >= this (>= 1). Default: the run's value."),
    ] = None,
    voxel_size: Annotated[
        Optional[float],
        typer.Option(help="Voxel edge (> 0) in scene units; one too fine for the scene (under about 1/16000 of the "
                     "first frame's median depth) is raised to it with a warning. Default: the run's value."),
    ] = None,
    max_points: Annotated[
        Optional[int],
        typer.Option(min=1, help="Cap on exported points; the voxel grows to respect it. Default: the run's value; "
                     f"{own_caps()} (what a browser renders smoothly)."),
    ] = None,
    full_resolution: Annotated[
        bool,
        typer.Option(
            "--full-resolution",
            help="colmap, nerfstudio: write the source frames at their own resolution (read again from the run's "
            "video or image folder), with the intrinsics scaled to them, instead of the model inputs (518 pixels "
            "wide by default): what Gaussian splatting and COLMAP's dense steps want.",
        ),
    ] = False,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace an earlier export at --output (as `run --overwrite` does).")
    ] = False,
    mask_sky: Annotated[
        bool,
        typer.Option("--mask-sky", help="Leave the sky out of a run that was not masked (as `run --mask-sky`; a "
                     "masked run's own masks apply either way)."),
    ] = False,
) -> None:
    """Export a run as a point cloud (ply), a scene with cameras (glb), a COLMAP text model, a TUM trajectory,
    a nerfstudio dataset (transforms.json, images, points.ply) or Gaussian splats (the 3D Gaussian splatting PLY
    that splat viewers open)."""
    # OpenCV loads with it (and trimesh with a GLB's writer): when the command runs, never for -h
    from stream_recon.app.outputs.export import export_run

    console = error_console()
    show_engine_log(console)  # a damaged file skipped, a voxel raised: `warning:` lines
    for problem in point_cloud_problems(conf_threshold, voxel_size):
        bad_input(console, problem)
    # a ValueError here is a damaged run directory read back, said in one sentence
    with user_errors(console, ExportError, ValueError), stop_said(console, "nothing was exported"):
        check_run_dir(run_dir)
        closed = close_abandoned_run(run_dir)
        if closed is not None:
            console.print(f"note: {closed}", highlight=False)
        result = export_run(
            run_dir,
            format,
            output,
            conf_threshold=conf_threshold,
            voxel_size=voxel_size,
            max_points=max_points,
            overwrite=overwrite,
            full_resolution=full_resolution,
            mask_sky=mask_sky,
        )
    frames = _count(result.num_frames, format.spec.frames_are)
    if format.spec.points_are is None:  # a trajectory: no points, nor a voxel
        console.print(f"wrote {frames} to {result.path}")
        return
    voxel = "none" if result.voxel_size is None else f"{result.voxel_size:.4g}"
    console.print(
        f"wrote {format.value} export ({frames}, {_count(result.num_points, format.spec.points_are)}, "
        f"voxel {voxel}) to {result.path}"
    )
    if result.grey_points is not None:
        console.print(f"[yellow]warning:[/yellow] {result.grey_points}")
    if result.empty_reason is not None:  # as a run warns of an empty points.ply
        console.print(f"[yellow]warning:[/yellow] the export holds no point: {escape(result.empty_reason)}")


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")
