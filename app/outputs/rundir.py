"""The run directory: its file names, when a folder holds a run (and clearing one for a new run), and reading
one back: its prediction files in frame order, run.json, a batch's marker.

Layout (DESIGN.md §5)::

    RUN_DIR/
      run.json                  status running -> complete | interrupted | failed, settings, summary
      predictions/000000.npz    one per frame, written atomically as the frame becomes final
      trajectory_tum.txt        timestamp tx ty tz qx qy qz qw (camera-to-world), written at close
      trajectory_open_tum.txt   the same before loop closure corrected it, when a correction moved anything
      points.ply                confidence-filtered, voxel-downsampled cloud, written at close
      map/                      the saved map, written as the run goes by its loop closer (models/loops/saved_map.py)
      eval.json                 `stream-recon eval` (and batch) scores, when evaluated

Beside it, each its own concern: how a file is written (atomic_writes.py), JSON records (json_records.py), a
run's claim on its folder (output_folder.py), one npz read (npz_reading.py), the TUM text files
(trajectories.py).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from stream_recon.app.outputs.atomic_writes import RETIRED_PREFIX, remove_stale_staging, remove_tree
from stream_recon.app.outputs.json_records import exact_strings, write_json_atomic
from stream_recon.app.outputs.npz_reading import load_prediction
from stream_recon.models import MAP_DIR

logger = logging.getLogger(__name__)

RUN_FORMAT = "stream-recon-run/1"
FINAL_STATUSES = ("complete", "interrupted", "failed")

PREDICTIONS_DIR = "predictions"
RUN_JSON = "run.json"
TRAJECTORY_TUM = "trajectory_tum.txt"
# Written when loop closure moved any chunk: the trajectory as the open chain of chunks placed it, before
# the correction (trajectory_tum.txt, the npz files and points.ply are corrected).
TRAJECTORY_OPEN_TUM = "trajectory_open_tum.txt"
POINTS_PLY = "points.ply"
EVAL_JSON = "eval.json"
EXPORTS_DIR = "exports"  # `stream-recon export` writes here unless told otherwise
BATCH_MARKER = ".complete"  # `batch` marks a finished sequence's run directory with it

# Only these names are predictions; temp files (".000012.npz.<pid>.<thread>.<n>.tmp") and the rest are ignored.
_PREDICTION_NAME = re.compile(r"^(\d{6,})\.npz$")


class RunDirError(ValueError):
    """A run directory to read is missing or holds no predictions."""


def prediction_path(run_dir: Path, frame_index: int) -> Path:
    return Path(run_dir) / PREDICTIONS_DIR / f"{frame_index:06d}.npz"


# --------------------------------------------------------------------------------------------------
# Does a folder hold a run? (checked before a model loads, and again by the writer)


def run_files(output_dir: Path) -> list[Path]:
    """The files of a run already in `output_dir`: what a new run there would replace."""
    output_dir = Path(output_dir)
    found = [path for path in (output_dir / name for name in (RUN_JSON, TRAJECTORY_TUM, TRAJECTORY_OPEN_TUM, POINTS_PLY))
             if path.exists()]
    predictions = output_dir / PREDICTIONS_DIR
    if predictions.is_dir():
        found += [path for path in predictions.iterdir() if _PREDICTION_NAME.match(path.name)]
    return found


def remove_run(output_dir: Path) -> None:
    """Delete what a run in `output_dir` wrote and what was derived from it (eval.json, exports/, a batch's
    marker), so that a replacing run leaves nothing of the old one beside its own files. Other files
    in the folder are the user's and stay. Raises OSError."""
    output_dir = Path(output_dir)
    for path in run_files(output_dir):
        path.unlink()
    for name in (EVAL_JSON, BATCH_MARKER):
        (output_dir / name).unlink(missing_ok=True)
    for folder in (EXPORTS_DIR, MAP_DIR):  # what was derived from the run, and its saved map
        path = output_dir / folder
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)


def replace_run(output_dir: Path) -> None:
    """Clear an earlier run out of `output_dir` for a new one (remove_run), its predictions first moved
    aside in one rename, so that a process killed part-way never leaves some of the earlier npz files
    under a new run.json; what was moved aside is removed then, or by the next run there (remove_stale_staging).
    Raises OSError."""
    output_dir = Path(output_dir)
    remove_stale_staging(output_dir)
    predictions = output_dir / PREDICTIONS_DIR
    if predictions.is_dir() and not predictions.is_symlink():
        retired = output_dir / f"{RETIRED_PREFIX}{os.getpid()}"
        os.replace(predictions, retired)
        predictions.mkdir()
        remove_tree(retired)
    remove_run(output_dir)


def holds_run(output_dir: Path) -> bool:
    return bool(run_files(output_dir))


# What a run directory holds besides the run's own files (run_files): a folder holding only these (or
# hidden files) is not someone else's folder.
_RUN_DIR_NAMES = {PREDICTIONS_DIR, RUN_JSON, TRAJECTORY_TUM, TRAJECTORY_OPEN_TUM, POINTS_PLY, EVAL_JSON, EXPORTS_DIR,
                  BATCH_MARKER, MAP_DIR}


def foreign_entries(output_dir: Path) -> list[Path]:
    """What a folder holds that no run wrote (hidden files aside): a run there would mix its files in."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    return sorted(entry for entry in output_dir.iterdir()
                  if entry.name not in _RUN_DIR_NAMES and not entry.name.startswith("."))


# --------------------------------------------------------------------------------------------------
# Reading a run back


def check_run_dir(run_dir: Path) -> Path:
    """Raise RunDirError unless `run_dir` looks like a run directory; returns its predictions folder."""
    run_dir = Path(run_dir)
    predictions = run_dir / PREDICTIONS_DIR
    if not run_dir.exists():
        raise RunDirError(f"run directory {run_dir} does not exist")
    if not run_dir.is_dir():
        raise RunDirError(
            f"{run_dir} is a file, not a run directory: give the folder a run wrote (it holds {PREDICTIONS_DIR}/)"
        )
    if not predictions.is_dir():
        raise RunDirError(f"{run_dir} is not a run directory: it has no {PREDICTIONS_DIR}/ folder")
    return predictions


def prediction_files(run_dir: Path) -> list[tuple[int, Path]]:
    """(frame index, path) of every prediction file of a run, in frame order."""
    predictions = check_run_dir(run_dir)
    found = []
    for path in predictions.iterdir():
        match = _PREDICTION_NAME.match(path.name)
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


def iter_run(run_dir: Path, frames: Collection[int] | None = None) -> Iterator[dict[str, Any]]:
    """Yield the predictions of a run in frame order, one npz in memory at a time; `frames`: only these frame
    indices (a second pass over frames read before: a file skipped then is not read, nor warned of, again).

    A file that cannot be read (typically the last one of a run killed by the OS mid-write on a filesystem
    without atomic rename, or one damaged afterwards: arrays of another shape, of Python objects) is skipped
    with a warning naming it instead of failing the whole run.
    """
    for frame_index, path in prediction_files(run_dir):
        if frames is not None and frame_index not in frames:
            continue
        try:
            record = load_prediction(path)
        except FileNotFoundError:
            logger.warning("skipping frame %d: %s disappeared while reading", frame_index, path)
            continue
        except (OSError, ValueError) as exc:
            logger.warning("skipping frame %d: cannot read %s: %s", frame_index, path, exc)
            continue
        yield record


def loop_closure_summary(run_info: Any) -> dict[str, Any]:
    """run.json's `summary.loop_closure` (read_run_info's record): what loop closure did in the run; {} for
    a run without it (loop closure off, or a run written before it existed)."""
    summary = run_info.get("summary") if isinstance(run_info, dict) else None
    closure = summary.get("loop_closure") if isinstance(summary, dict) else None
    return closure if isinstance(closure, dict) else {}


def run_accepted_loops(run_dir: Path) -> int | None:
    """How many loops the run's pose graph used (run.json's summary.loop_closure.accepted); None when
    run.json does not say (a run without loop closure, or one written before it existed)."""
    accepted = loop_closure_summary(read_run_info(run_dir)).get("accepted")
    return accepted if isinstance(accepted, int) and not isinstance(accepted, bool) else None


def read_run_info(run_dir: Path) -> dict[str, Any]:
    """run.json as a dict, or {} when it is missing or unreadable (the predictions are still usable)."""
    path = Path(run_dir) / RUN_JSON
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return exact_strings(data) if isinstance(data, dict) else data
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("ignoring %s: %s", path, exc)
        return {}


def read_batch_marker(run_dir: Path) -> dict | None:
    """The batch's marker of a finished sequence (BATCH_MARKER) as a dict; None when it is missing or
    unreadable."""
    try:
        marker = json.loads((Path(run_dir) / BATCH_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def write_batch_marker(run_dir: Path, marker: dict) -> None:
    """Mark a run directory finished for `batch`, atomically: the marker is there whole or not at all."""
    write_json_atomic(Path(run_dir) / BATCH_MARKER, marker)
