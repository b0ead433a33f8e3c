"""A batch's summary: its columns (each sequence's row: the run's figures, the loops it accepted, its
evaluation's scores), summary.json and summary.csv, and the mean ATE with and without loop closure's
correction that the command prints under its table.

Its own module because it is the batch's one output beside the run directories, read by the command's table
as well as written by the batch, and free of the run's heavy libraries.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from stream_recon.app.evaluation.settings import OPEN_CHAIN
from stream_recon.app.outputs.atomic_writes import atomic_write
from stream_recon.app.outputs.json_records import utf8_record

SUMMARY_JSON = "summary.json"


SUMMARY_CSV = "summary.csv"


BASE_COLUMNS = ("name", "source", "kind", "status", "error", "frames", "keyframes", "fps", "seconds")


LOOP_COLUMNS = ("loops_accepted",)  # run.json's summary.loop_closure.accepted, when the run reports it


OPEN_CHAIN_ATE_RMSE = f"{OPEN_CHAIN}_ate_rmse"  # eval.json's open_chain.ate_rmse: ATE before loop closure


EVAL_COLUMNS = (
    "alignment",
    "scale",
    "matched_poses",
    "ate_rmse",
    OPEN_CHAIN_ATE_RMSE,
    "ate_mean",
    "ate_median",
    "rpe_trans_rmse",
    "rpe_rot_rmse_deg",
    "auc_5",
    "auc_15",
    "auc_30",
    "depth_abs_rel",
    "depth_delta1",
)


SUMMARY_COLUMNS = BASE_COLUMNS + LOOP_COLUMNS + EVAL_COLUMNS


def write_summary(output_dir: Path, rows: Iterable[dict]) -> None:
    """summary.json (rows as given, eval keys only where evaluated) and summary.csv (every column)."""
    rows = list(rows)
    output_dir = Path(output_dir)
    # a sequence folder's name need not be UTF-8: each row strict UTF-8, the exact name kept beside it
    json_rows = [
        utf8_record({key: row.get(key) for key in SUMMARY_COLUMNS if key in BASE_COLUMNS or key in row})
        for row in rows
    ]
    text = json.dumps(json_rows, indent=2) + "\n"
    atomic_write(output_dir / SUMMARY_JSON, lambda file: file.write(text), binary=False)

    def write_csv(file) -> None:
        writer = csv.DictWriter(file, fieldnames=SUMMARY_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            readable = utf8_record({key: row.get(key) for key in SUMMARY_COLUMNS})
            writer.writerow({key: "" if readable[key] is None else readable[key] for key in SUMMARY_COLUMNS})

    atomic_write(output_dir / SUMMARY_CSV, write_csv, binary=False)


@dataclass(frozen=True)
class OpenChainMeans:
    """Mean ATE RMSE with and without loop closure's correction, over the sequences that have both."""

    sequences: int
    ate_rmse: float
    open_chain_ate_rmse: float


def open_chain_means(rows: Iterable[dict]) -> OpenChainMeans | None:
    """The means over the rows with both ATEs (the same sequences on both sides, so they compare);
    None when no row has an open chain."""
    pairs = [(row["ate_rmse"], row[OPEN_CHAIN_ATE_RMSE]) for row in rows
             if row.get("ate_rmse") is not None and row.get(OPEN_CHAIN_ATE_RMSE) is not None]
    if not pairs:
        return None
    corrected, open_chain = zip(*pairs, strict=True)
    return OpenChainMeans(len(pairs), sum(corrected) / len(pairs), sum(open_chain) / len(pairs))
