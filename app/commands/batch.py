"""Reconstruct every sequence under a dataset folder, resumably, on one machine or a Ray cluster.

Examples:

    stream-recon batch data/tum --output out/tum                      # TUM RGB-D folders: evaluated too
    stream-recon batch drives/ --output out/drives --fps 10 --keyframes flow
    stream-recon batch data --output out --ray auto                   # a local Ray instance, 1 GPU per sequence
    stream-recon batch data --output out --ray ray://head:10001 --gpus-per-task 0.5

Sequences: each video file, each folder of images, each TUM RGB-D folder (rgb.txt + groundtruth.txt),
or the list in ROOT/sequences.txt (`path [name]` per line). Writes OUTPUT/<name>/ per sequence and
OUTPUT/summary.json + summary.csv. Run it again to resume: finished sequences are skipped, partial
ones redone. Exit code 1 when any sequence failed (the others are still done).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from stream_recon.app.commands._options import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    RUN_OPTION_FLAGS,
    ConfigOpt,
    error_console,
    takes_run_options,
    user_errors,
)
from stream_recon.app.evaluation import DEFAULT_MAX_DIFF

_BATCH = "Batch"

RootArg = Annotated[
    Path,
    typer.Argument(help="Dataset folder (or sequences.txt's folder, or one sequence).", show_default=False),
]
BatchOutputOpt = Annotated[
    Path,
    typer.Option(
        "--output", "-o", help="Folder for the run directories and the summary.", show_default=False
    ),
]
RayOpt = Annotated[
    Optional[str],
    typer.Option(
        "--ray",
        help="Spread sequences over a Ray cluster: its address, or auto (join a running one, else start one here).",
        rich_help_panel=_BATCH,
        show_default=False,
    ),
]
GpusPerTaskOpt = Annotated[
    float,
    typer.Option(
        "--gpus-per-task", help="GPUs per sequence with --ray; 0 runs on CPUs.", rich_help_panel=_BATCH
    ),
]
AlignmentOpt = Annotated[
    str, typer.Option("--alignment", help="Evaluation alignment: sim3 or se3.", rich_help_panel=_BATCH)
]
MaxDiffOpt = Annotated[
    float,
    typer.Option(
        "--max-diff",
        min=0.0,
        help="Evaluation: largest timestamp difference (s) of a matched pose (evo's --t_max_diff).",
        rich_help_panel=_BATCH,
    ),
]


# A batch never opens the viewer, reads files rather than streams, and its resume rule (not
# --overwrite) decides what is redone: those run options are not offered.
NOT_FOR_BATCH = ("open_timeout_s", "overwrite", "viewer", "keep_viewer", "host", "port")


@takes_run_options(*(field for field in RUN_OPTION_FLAGS if field not in NOT_FOR_BATCH))
def batch(
    root: RootArg,
    output: BatchOutputOpt,
    config: ConfigOpt = None,
    ray: RayOpt = None,
    gpus_per_task: GpusPerTaskOpt = 1.0,
    alignment: AlignmentOpt = "sim3",
    max_diff: MaxDiffOpt = DEFAULT_MAX_DIFF,
    *,
    overrides: dict[str, Any],
) -> None:
    """Run every sequence under ROOT into OUTPUT/<name>/, evaluate those with ground truth, write a summary."""
    from stream_recon.app.batch import BatchError, BatchInterrupted, EvalSettings, run_batch
    from stream_recon.app.datasets import DatasetError, discover_sequences
    from stream_recon.app.presets import build_options

    console = error_console()
    if alignment not in ("sim3", "se3"):
        console.print(f"[red]error:[/red] --alignment must be sim3 or se3, not {alignment!r}")
        raise typer.Exit(code=EXIT_BAD_INPUT)
    if gpus_per_task < 0:
        console.print(f"[red]error:[/red] --gpus-per-task must be >= 0, not {gpus_per_task}")
        raise typer.Exit(code=EXIT_BAD_INPUT)
    with user_errors(console):
        try:
            options = build_options(config, {**overrides, "viewer": False})
            sequences = discover_sequences(root, exclude=(output,))
            rows = run_batch(
                sequences,
                output,
                options,
                evaluation=EvalSettings(alignment=alignment, max_diff=max_diff),
                ray_address=ray,
                gpus_per_task=gpus_per_task,
                console=console,
            )
        except (DatasetError, BatchError) as error:
            console.print(f"[red]error:[/red] {error}")
            raise typer.Exit(code=EXIT_BAD_INPUT) from None
        except BatchInterrupted as interrupted:
            console.print(summary_table(interrupted.rows, title=f"{output}/summary.json (interrupted)"))
            console.print("[yellow]batch interrupted[/yellow]: run the same command again to resume")
            raise typer.Exit(code=EXIT_INTERRUPTED) from None
    console.print(summary_table(rows, title=f"{output}/summary.json"))
    if any(row["status"] == "failed" for row in rows):
        raise typer.Exit(code=EXIT_FAILED)


def summary_table(rows: list[dict], title: str) -> Table:
    table = Table(title=title)
    for column, justify in (
        ("sequence", "left"),
        ("status", "left"),
        ("frames", "right"),
        ("FPS", "right"),
        ("ATE RMSE", "right"),
        ("error", "left"),
    ):
        table.add_column(column, justify=justify)
    colours = {"ok": "green", "skipped": "cyan", "failed": "red"}
    for row in rows:
        table.add_row(
            row["name"],
            f"[{colours[row['status']]}]{row['status']}[/]",
            _cell(row.get("frames")),
            _cell(row.get("fps"), "{:.1f}"),
            _cell(row.get("ate_rmse"), "{:.4f}"),
            row.get("error") or "",
        )
    return table


def _cell(value, template: str = "{}") -> str:
    return "" if value is None else template.format(value)
