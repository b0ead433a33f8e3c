"""Closing a run its process left "running" (kill -9, a power cut, a signal no handler catches): `export` and
`view` close it from its npz files, as its writer would have when stopped. Free of the libraries a run loads
(OpenCV, torch), so that a command imports it at its top.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from stream_recon.app.outputs.json_records import write_json_atomic
from stream_recon.app.outputs.output_folder import lock_run_dir, run_dir_in_use, unlock_run_dir
from stream_recon.app.outputs.pointcloud import (
    DEFAULT_CONF_THRESHOLD,
    DEFAULT_MAX_POINTS,
    PointAccumulator,
    write_ply,
)
from stream_recon.app.outputs.rundir import POINTS_PLY, RUN_JSON, TRAJECTORY_TUM, iter_run, read_run_info
from stream_recon.app.outputs.trajectories import write_tum


def utc_now() -> str:
    """Now, as run.json records its times (UTC, to the second)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# A run whose process ended without closing it (kill -9, a power cut, a signal no handler catches) stays
# "running" for good, with its npz files and nothing else; `export` and `view` close it from them.
ABANDONED_END_REASON = "the process ended without closing the run; closed later from its prediction files"


def close_abandoned_run(run_dir: Path) -> str | None:
    """Close a run left "running" by a process that no longer runs, from its npz files, as its writer would
    have closed it when stopped: trajectory_tum.txt, points.ply at the run's recorded point settings, and
    run.json "interrupted" with why. Returns a line that says so; None when there is nothing to close (the
    run is closed, or a live process is writing it: its lock is held)."""
    run_dir = Path(run_dir)
    if read_run_info(run_dir).get("status") != "running" or run_dir_in_use(run_dir):
        return None
    lock_run_dir(run_dir)  # (another command closing it at the same instant is refused here)
    try:
        info = read_run_info(run_dir)
        if info.get("status") != "running":
            return None
        frames = _close_from_predictions(run_dir, info)
    except OSError as error:  # a read-only run directory, a full disk: it is still read as it is
        return (f"{run_dir} was left running by a process that ended without closing it, and could not be closed "
                f"here ({error.strerror or error}); it is read from its prediction files as it is")
    finally:
        unlock_run_dir(run_dir)
    return (f"{run_dir} was left running by a process that ended without closing it: closed it from its "
            f"{frames} prediction files (trajectory_tum.txt, points.ply; run.json: interrupted)")


def _close_from_predictions(run_dir: Path, info: dict) -> int:
    summary = info.setdefault("summary", {})
    recorded = summary.get("points", {})
    points = PointAccumulator(conf_threshold=recorded.get("conf_threshold", DEFAULT_CONF_THRESHOLD),
                              voxel_size=recorded.get("voxel_size"),
                              max_points=recorded.get("max_points", DEFAULT_MAX_POINTS))
    timestamps, c2w, keyframes, last = [], [], 0, None
    for record in iter_run(run_dir):
        timestamps.append(record["timestamp"])
        c2w.append(record["c2w"])
        keyframes += bool(record["is_keyframe"])
        last = record["frame_index"]
        points.add_frame(record["frame_index"], record["depth"], record["depth_conf"], record["intrinsics"],
                         record["c2w"], record["image"], record["sky_mask"])
    write_tum(run_dir / TRAJECTORY_TUM, timestamps, np.array(c2w, dtype=np.float64).reshape(-1, 3, 4))
    cloud = points.cloud()
    write_ply(run_dir / POINTS_PLY, cloud.xyz, cloud.rgb)
    summary.update(ended_at=utc_now(), frames=len(timestamps), keyframes=keyframes, last_frame_index=last,
                   end_reason=ABANDONED_END_REASON, error=None, stop_signal=None)
    summary["points"] = {**recorded, "count": len(cloud)}
    info["status"] = "interrupted"
    write_json_atomic(run_dir / RUN_JSON, info)
    return len(timestamps)
