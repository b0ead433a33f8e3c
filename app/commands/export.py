"""`stream-recon export`: turn a run directory into a PLY cloud, a GLB scene, a COLMAP model or a TUM file.

Examples:
    stream-recon export outputs/kitchen --format ply
    stream-recon export outputs/kitchen --format glb --output kitchen.glb
    stream-recon export outputs/kitchen --format colmap --output kitchen_colmap/   # sparse/0 + images/
    stream-recon export outputs/kitchen --format tum --output kitchen_tum.txt
    stream-recon export outputs/kitchen --format ply --conf-threshold 3 --voxel-size 0.01
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from stream_recon.app.export import ExportError, ExportFormat, export_run
from stream_recon.app.rundir import RunDirError


def export(
    run_dir: Annotated[Path, typer.Argument(help="Run directory written by `stream-recon run`.")],
    format: Annotated[
        ExportFormat, typer.Option("--format", "-f", case_sensitive=False, help="What to write.")
    ],
    output: Annotated[
        Optional[Path],
        typer.Option(
            "--output", "-o", help="File (ply, glb, tum) or directory (colmap). Default: RUN_DIR/exports/."
        ),
    ] = None,
    conf_threshold: Annotated[
        Optional[float],
        typer.Option(help="Keep pixels with depth confidence >= this (>= 1). Default: the run's value."),
    ] = None,
    voxel_size: Annotated[
        Optional[float],
        typer.Option(help="Voxel edge (> 0) in scene units. Default: the run's value."),
    ] = None,
    max_points: Annotated[
        Optional[int], typer.Option(min=1, help="Cap on exported points; the voxel grows to respect it.")
    ] = None,
) -> None:
    """Export a run as a point cloud (ply), a scene with cameras (glb), a COLMAP text model or a TUM trajectory."""
    console = Console(stderr=True, soft_wrap=True)  # paths in messages stay on one line
    try:
        result = export_run(
            run_dir,
            format,
            output,
            conf_threshold=conf_threshold,
            voxel_size=voxel_size,
            max_points=max_points,
        )
    except (RunDirError, ExportError, ValueError) as exc:  # bad input, said in one sentence
        console.print(f"[red]Error:[/red] {escape(str(exc))}")
        raise typer.Exit(code=1) from None
    if format is ExportFormat.TUM:
        console.print(f"Wrote {result.num_frames} poses to {result.path}")
        return
    voxel = "none" if result.voxel_size is None else f"{result.voxel_size:.4g}"
    console.print(
        f"Wrote {format.value} export ({result.num_frames} cameras, {result.num_points} points, "
        f"voxel {voxel}) to {result.path}"
    )
    if result.num_points == 0:
        console.print(
            f"[yellow]Warning:[/yellow] no pixel has depth confidence >= {result.conf_threshold:g}; "
            "pass a lower --conf-threshold to get points"
        )
