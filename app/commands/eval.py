"""`stream-recon eval RUN_DIR --gt FILE`: score a finished run against ground truth.

Examples:

    stream-recon eval outputs/fr1_xyz --gt data/rgbd_dataset_freiburg1_xyz/groundtruth.txt
    stream-recon eval outputs/fr1_xyz --gt gt.txt --alignment se3 --max-diff 0.01
    stream-recon eval outputs/fr1_xyz --gt data/fr1_xyz/groundtruth.txt --depth-dir data/fr1_xyz

Trajectory: timestamps are associated one-to-one within --max-diff seconds, the estimate is aligned
to the ground truth (Umeyama Sim(3), or SE(3)), then ATE, RPE (consecutive matched poses, evo's
`--delta 1 --delta_unit f`) and pose AUC@5/15/30 are computed. Depth (with --depth-dir, a TUM folder
with depth.txt or PNGs named by timestamp, 5000 units per metre): AbsRel and delta<1.25 after
per-frame median scaling. Results are printed and written to RUN_DIR/eval.json.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from stream_recon.app.evaluation import EvaluationError, evaluate_run

RunDirArg = Annotated[
    Path, typer.Argument(help="Run directory written by `stream-recon run` (holds trajectory_tum.txt).")
]
GtOpt = Annotated[
    Path, typer.Option("--gt", help="Ground-truth trajectory, TUM format (timestamp tx ty tz qx qy qz qw).")
]
AlignmentOpt = Annotated[
    str, typer.Option("--alignment", help="sim3 (scale too, for monocular runs) or se3.")
]
MaxDiffOpt = Annotated[
    float, typer.Option("--max-diff", help="Largest timestamp difference (s) for a matched pair.")
]
DepthDirOpt = Annotated[
    Path | None,
    typer.Option("--depth-dir", help="Ground-truth depth: a folder with depth.txt (TUM RGB-D layout)."),
]

# (label, eval.json key, format); rows whose key is absent are left out.
TABLE_ROWS = (
    ("alignment", "alignment", "{}"),
    ("scale", "scale", "{:.6g}"),
    ("matched poses", "matched_poses", "{}"),
    ("ATE RMSE", "ate_rmse", "{:.6f}"),
    ("ATE mean", "ate_mean", "{:.6f}"),
    ("ATE median", "ate_median", "{:.6f}"),
    ("ATE max", "ate_max", "{:.6f}"),
    ("RPE trans RMSE", "rpe_trans_rmse", "{:.6f}"),
    ("RPE rot RMSE (deg)", "rpe_rot_rmse_deg", "{:.4f}"),
    ("AUC@5", "auc_5", "{:.4f}"),
    ("AUC@15", "auc_15", "{:.4f}"),
    ("AUC@30", "auc_30", "{:.4f}"),
    ("depth AbsRel", "depth_abs_rel", "{:.4f}"),
    ("depth delta<1.25", "depth_delta1", "{:.4f}"),
    ("depth frames", "depth_frames", "{}"),
)


def results_table(results: dict, title: str) -> Table:
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, key, template in TABLE_ROWS:
        if key in results:
            table.add_row(label, template.format(results[key]))
    return table


def eval_command(
    run_dir: RunDirArg,
    gt: GtOpt,
    alignment: AlignmentOpt = "sim3",
    max_diff: MaxDiffOpt = 0.02,
    depth_dir: DepthDirOpt = None,
) -> None:
    """Evaluate a run against a ground-truth trajectory (and depth); writes RUN_DIR/eval.json."""
    console = Console()
    if alignment not in ("sim3", "se3"):
        console.print(f"[red]error:[/] --alignment must be sim3 or se3, not {alignment!r}")
        raise typer.Exit(code=2)
    try:
        results = evaluate_run(run_dir, gt, alignment=alignment, max_diff=max_diff, depth_dir=depth_dir)
    except EvaluationError as error:
        console.print(f"[red]error:[/] {error}")
        raise typer.Exit(code=1) from None
    console.print(results_table(results, title=f"{run_dir} vs {gt}"))
    console.print(f"written {Path(run_dir) / 'eval.json'}")
