"""Reconstruct every sequence under a dataset folder, resumably, on one machine or a Ray cluster.

Examples:

    stream-recon batch data/tum --output out/tum                      # TUM RGB-D folders: evaluated too
    stream-recon batch drives/ --output out/drives --fps 10 --keyframes flow
    stream-recon batch data --output out --ray auto                   # a local Ray instance, 1 GPU per sequence
    stream-recon batch data --output out --ray ray://head:10001 --gpus-per-task 0.5

Sequences: each video file, each folder of images, each TUM RGB-D folder (rgb.txt + groundtruth.txt),
or the list in ROOT/sequences.txt (`path [name]` per line). Writes OUTPUT/<name>/ per sequence and
OUTPUT/summary.json + summary.csv. Run it again to resume: finished sequences are skipped, partial
ones redone. A rerun with settings that change results (--image-width, --scale-frames, --keyframes,
...) stops before loading the model and names what changed; --overwrite redoes the sequences that
ran with other settings. Exit code 1 when any sequence failed (the others are still done).
The summary table shows the loops each run accepted (when its run.json reports loop closure) and, for
a run that loop closure corrected, the ATE RMSE of its open chain (before the correction) beside the
corrected one ("-": no open chain), with their means over the sequences that have both.

    stream-recon batch data/tum --output out/tum --image-width 392 --overwrite   # redo with a new width
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from stream_recon.app.commands._options import (
    EXIT_FAILED,
    RUN_OPTION_FLAGS,
    ConfigOpt,
    bad_input,
    check_alignment,
    error_console,
    evaluation_flags,
    given,
    import_held,
    library_log_level,
    show_engine_log,
    takes_run_options,
    user_errors,
)
from stream_recon.app.evaluation.batch_summary import OPEN_CHAIN_ATE_RMSE, open_chain_means
from stream_recon.app.stopping import interrupted_exit_code

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
OverwriteOpt = Annotated[
    bool,
    typer.Option(
        "--overwrite",
        help="Redo the sequences finished with other settings (without it the batch refuses to mix them); "
        "sequences finished with these settings are still skipped.",
        rich_help_panel=_BATCH,
    ),
]
AlignmentOpt, MaxDiffOpt = evaluation_flags(_BATCH)


# A batch never opens the viewer, reads files rather than streams, and has its own --overwrite
# (OverwriteOpt): those run options are not offered.
# mask_dir: one folder of masks is one sequence's, not every sequence's
NOT_FOR_BATCH = ("open_timeout_s", "overwrite", "viewer", "keep_viewer", "host", "port", "show", "mask_dir")


@takes_run_options(*(field for field in RUN_OPTION_FLAGS if field not in NOT_FOR_BATCH))
def batch(
    root: RootArg,
    output: BatchOutputOpt,
    config: ConfigOpt = None,
    ray: RayOpt = None,
    gpus_per_task: GpusPerTaskOpt = 1.0,
    alignment: AlignmentOpt = "sim3",
    max_diff: MaxDiffOpt = None,
    overwrite: OverwriteOpt = False,
    *,
    overrides: dict[str, Any],
) -> None:
    """Run every sequence under ROOT into OUTPUT/<name>/, evaluate those with ground truth, write a summary."""
    batch = import_held("stream_recon.app.evaluation.batch")  # torch, OpenCV and yaml: never for -h
    # OpenCV and yaml load with these: when the command runs, never for -h
    from stream_recon.app.evaluation.datasets import DatasetError, discover_sequences
    from stream_recon.app.run.presets import build_options

    console = error_console()
    show_engine_log(console)  # a damaged file skipped, a voxel raised: `warning:` lines
    check_alignment(console, alignment)
    if gpus_per_task < 0:
        bad_input(console, f"--gpus-per-task must be >= 0, not {gpus_per_task}")
    with user_errors(console, DatasetError, batch.BatchError):
        try:
            options = build_options(config, {**overrides, "viewer": False})
            sequences = discover_sequences(root, exclude=(output,))
            rows = batch.run_batch(
                sequences,
                output,
                options,
                evaluation=batch.EvalSettings(alignment=alignment, **given(max_diff=max_diff)),
                ray_address=ray,
                gpus_per_task=gpus_per_task,
                overwrite=overwrite,
                console=console,
                ray_log_level=library_log_level(),
            )
        except batch.BatchInterrupted as interrupted:
            console.print(summary_table(interrupted.rows, f"{output}/summary.json (interrupted)"))
            console.print("[yellow]batch interrupted[/yellow]: run the same command again to resume")
            raise typer.Exit(code=interrupted_exit_code(interrupted.signum)) from None
    console.print(summary_table(rows, f"{output}/summary.json"))
    if any(row["status"] == "failed" for row in rows):
        raise typer.Exit(code=EXIT_FAILED)


# An error's first characters in the summary table: a whole one, wrapped in a narrow column, took twenty lines
# (each is printed whole as its sequence ends, `failed NAME: ...`, and kept in summary.json)
ERROR_CELL_CHARS = 40


def summary_table(rows: list[dict], title: str) -> Table:
    """The batch's rows as a table."""
    table = Table(title=title)
    for column, justify in (
        ("sequence", "left"),
        ("status", "left"),
        ("frames", "right"),
        ("FPS", "right"),
        ("loops", "right"),
        ("ATE RMSE", "right"),
        ("ATE open chain", "right"),
        ("error", "left"),
    ):
        table.add_column(column, justify=justify)
    if any(len(row.get("error") or "") > ERROR_CELL_CHARS for row in rows):
        table.caption = "errors in full: printed as each sequence ended, and in summary.json"
    colours = {"ok": "green", "skipped": "cyan", "failed": "red", "interrupted": "yellow"}
    for row in rows:
        evaluated = row.get("ate_rmse") is not None
        table.add_row(
            row["name"],
            f"[{colours[row['status']]}]{row['status']}[/]",
            _cell(row.get("frames")),
            _cell(row.get("fps"), "{:.1f}"),
            _cell(row.get("loops_accepted")),
            _cell(row.get("ate_rmse"), "{:.4f}"),
            _cell(row.get(OPEN_CHAIN_ATE_RMSE), "{:.4f}", missing="-" if evaluated else ""),
            _shortened(row.get("error") or ""),
        )
    means = open_chain_means(rows)
    if means is not None:
        table.add_section()
        table.add_row(f"mean of {means.sequences} with an open chain", "", "", "", "",
                      f"{means.ate_rmse:.4f}", f"{means.open_chain_ate_rmse:.4f}", "")
    return table


def _shortened(error: str) -> str:
    return error if len(error) <= ERROR_CELL_CHARS else error[: ERROR_CELL_CHARS - 1].rstrip() + "…"


def _cell(value, template: str = "{}", missing: str = "") -> str:
    return missing if value is None else template.format(value)
