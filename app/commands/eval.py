"""`stream-recon eval RUN_DIR --gt FILE`: score a finished run against ground truth.

Examples:

    stream-recon eval outputs/fr1_xyz --gt data/rgbd_dataset_freiburg1_xyz/groundtruth.txt
    stream-recon eval outputs/fr1_xyz --gt gt.txt --alignment se3 --max-diff 0.02
    stream-recon eval outputs/fr1_xyz --gt data/fr1_xyz/groundtruth.txt --depth-dir data/fr1_xyz

What equals evo (to 1e-6; the tests check it on real TUM trajectories): `matched_poses` and every
statistic (rmse, mean, median, std, min, max, sse) of
- ate_*: `evo_ape tum GT RUN_DIR/trajectory_tum.txt -as` (`-a` with --alignment se3);
- rpe_trans_*: `evo_rpe tum GT RUN_DIR/trajectory_tum.txt -as`;
- rpe_rot_*_deg: `evo_rpe tum GT RUN_DIR/trajectory_tum.txt -as -r angle_deg`.
That is evo's association (each pose of the shorter trajectory takes its nearest stamp in the other,
at most --max-diff seconds away; the default 0.01 s is evo's --t_max_diff), Umeyama alignment of the
estimate onto the ground truth (Sim(3), or SE(3)) before both ATE and RPE, and RPE over consecutive
matched poses (evo's --delta 1 --delta_unit f).

Ours alone: pose AUC@5/15/30 (VGGT style, alignment-free, over all pairs of matched poses) and, with
--depth-dir (a TUM folder with depth.txt or PNGs named by timestamp, 5000 units per metre), AbsRel
and delta<1.25 after per-frame median scaling, each prediction paired with its nearest depth frame
within --depth-max-diff seconds. Results are printed and written to RUN_DIR/eval.json (-o: elsewhere).

A run that loop closure corrected also holds its open chain (trajectory_open_tum.txt, the poses before
the correction): it is scored the same way, aligned on its own, under eval.json's "open_chain" (the same
keys as the run's trajectory metrics), and the ATE of both is printed side by side. Without that file
eval.json has no "open_chain" key.

Exit codes: 0 evaluated and written; 1 evaluated and printed, but the results file could not be written
(a read-only run directory: pass -o); 2 bad input, nothing computed; 130 Ctrl-C; 143 SIGTERM.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from stream_recon.app.commands._options import (
    EXIT_FAILED,
    check_alignment,
    error_console,
    evaluation_flags,
    given,
    output_console,
    user_errors,
)
from stream_recon.app.evaluation.settings import (
    DEPTH_MAX_DIFF,
    ERROR_METRICS,
    OPEN_CHAIN,
    STATISTICS,
    statistic_key,
)
from stream_recon.app.outputs.atomic_writes import file_to_write

RunDirArg = Annotated[
    Path, typer.Argument(help="Run directory written by `stream-recon run` (trajectory_tum.txt, or the npz files "
                         "of a run killed before writing it).")
]
GtOpt = Annotated[
    Path, typer.Option("--gt", help="Ground-truth trajectory, TUM format (timestamp tx ty tz qx qy qz qw).")
]
AlignmentOpt, MaxDiffOpt = evaluation_flags()
DepthDirOpt = Annotated[
    Optional[Path],
    typer.Option("--depth-dir", help="Ground-truth depth: a folder with depth.txt (TUM RGB-D layout)."),
]
DepthMaxDiffOpt = Annotated[
    Optional[float],
    typer.Option(
        "--depth-max-diff", min=0.0,
        help=f"Largest timestamp difference (s) of a prediction and a depth frame. \\[default: {DEPTH_MAX_DIFF}]",
        show_default=False,
    ),
]
EvalOutputOpt = Annotated[
    Optional[Path],
    typer.Option("--output", "-o", help="Where to write the results as JSON. \\[default: RUN_DIR/eval.json]",
                 show_default=False),
]

# (label, eval.json key, format); rows whose key is absent are left out.
SUMMARY_ROWS = (
    ("alignment", "alignment", "{}"),
    ("scale", "scale", "{:.6g}"),
    ("matched poses", "matched_poses", "{}"),
    ("AUC@5", "auc_5", "{:.4f}"),
    ("AUC@15", "auc_15", "{:.4f}"),
    ("AUC@30", "auc_30", "{:.4f}"),
    ("depth AbsRel", "depth_abs_rel", "{:.4f}"),
    ("depth delta<1.25", "depth_delta1", "{:.4f}"),
    ("depth frames", "depth_frames", "{}"),
)
ERROR_LABELS = {"ate": "ATE (m)", "rpe_trans": "RPE trans (m)", "rpe_rot": "RPE rot (deg)"}


def results_table(results: dict, title: str) -> Table:
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, key, template in SUMMARY_ROWS:
        if key in results:
            table.add_row(label, template.format(results[key]))
    return table


def errors_table(results: dict) -> Table:
    """ATE and RPE, one column each, one row per statistic evo prints (an sse of degrees is in deg^2)."""
    table = Table(title="trajectory errors, as evo_ape / evo_rpe print them")
    table.add_column("statistic")
    for metric, _ in ERROR_METRICS:
        table.add_column(ERROR_LABELS[metric], justify="right")
    for statistic in STATISTICS:
        values = [results[statistic_key(metric, statistic, unit)] for metric, unit in ERROR_METRICS]
        table.add_row(statistic, *(f"{value:.6f}" for value in values))
    return table


def open_chain_table(results: dict) -> Table:
    """ATE of the corrected trajectory beside the open chain's, one row per statistic evo prints."""
    table = Table(title="ATE (m): corrected vs open chain")
    table.add_column("statistic")
    table.add_column("corrected", justify="right")
    table.add_column("open chain", justify="right")
    for statistic in STATISTICS:
        key = statistic_key("ate", statistic)
        table.add_row(statistic, f"{results[key]:.6f}", f"{results[OPEN_CHAIN][key]:.6f}")
    return table


def check_output_folder(target: Path, error: type[Exception]) -> None:
    """An -o whose folder is missing or cannot be written is refused before the evaluation, not after its
    tables are printed (the run directory's own eval.json, when it cannot be written, still comes after:
    exit 1, with the results shown)."""

    folder = target.parent
    if not folder.is_dir():
        raise error(f"-o {target}: the folder {folder} does not exist; create it, or choose another -o")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise error(f"-o {target}: the folder {folder} cannot be written; choose another -o")


def eval_command(
    run_dir: RunDirArg,
    gt: GtOpt,
    alignment: AlignmentOpt = "sim3",
    max_diff: MaxDiffOpt = None,
    depth_dir: DepthDirOpt = None,
    depth_max_diff: DepthMaxDiffOpt = None,
    output: EvalOutputOpt = None,
) -> None:
    """Evaluate a run against a ground-truth trajectory (and depth), as evo does; writes RUN_DIR/eval.json."""
    # OpenCV loads with it: when the command runs, never for -h
    from stream_recon.app.evaluation.metrics import (
        EvaluationError,
        evaluate_run,
        evaluation_path,
        write_evaluation,
    )

    errors = error_console()
    check_alignment(errors, alignment)
    with user_errors(errors, EvaluationError):
        target = file_to_write(output if output is not None else evaluation_path(run_dir))  # a FIFO: refused now
        if output is not None:
            check_output_folder(target, EvaluationError)
        results = evaluate_run(
            run_dir,
            gt,
            alignment=alignment,
            depth_dir=depth_dir,
            # what was typed; evaluate_run's defaults (app.evaluation.settings) stand for the rest
            **given(max_diff=max_diff, depth_max_diff=depth_max_diff),
        )
    console = output_console()  # the results are the command's output: stdout, for a pipe or a file
    console.print(results_table(results, title=f"{run_dir} vs {gt}"))
    console.print(errors_table(results))
    if OPEN_CHAIN in results:
        console.print(open_chain_table(results))
    try:
        write_evaluation(results, target)
    except OSError as error:  # a read-only run directory, a full disk: the results above still stand
        elsewhere = "" if output is not None else "; -o FILE writes them elsewhere"
        errors.print(f"[red]error:[/red] could not write {target}: {error.strerror or error}{elsewhere}")
        raise typer.Exit(code=EXIT_FAILED) from None
    console.print(f"written {target}")
