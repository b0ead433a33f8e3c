"""The run directory: per-frame predictions written as they complete, then trajectory, cloud and run record.

Layout (DESIGN.md §5)::

    RUN_DIR/
      run.json                  status running -> complete | interrupted | failed, settings, summary
      predictions/000000.npz    one per frame, written atomically as the frame becomes final
      trajectory_tum.txt        timestamp tx ty tz qx qy qz qw (camera-to-world), written at close
      points.ply                confidence-filtered, voxel-downsampled cloud, written at close

Memory stays bounded over any stream length: the writer keeps one pose per frame and a capped point
accumulator, never the depth maps; everything else is already on disk.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import queue
import re
import resource
import sys
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from itertools import count
from pathlib import Path
from typing import Any

import numpy as np
from plyfile import PlyData, PlyElement

from stream_recon.app.geometry import rotation_to_quat_wxyz
from stream_recon.models.prediction import FramePrediction

logger = logging.getLogger(__name__)

RUN_FORMAT = "stream-recon-run/1"
RUN_STATUSES = ("running", "complete", "interrupted", "failed")
FINAL_STATUSES = ("complete", "interrupted", "failed")

# depth_conf is 1 + exp(logit): 2.0 keeps the pixels whose logit is positive, i.e. the model is more
# sure than not.
DEFAULT_CONF_THRESHOLD = 2.0
# About 40 bytes per kept point (xyz, colour, key, source frame and pixel): 1M points is ~40 MB.
DEFAULT_MAX_POINTS = 1_000_000
# The model's scale is unknown, so an automatic voxel is relative: 1/200 of the first frame's median
# depth is about two pixels' footprint at that depth for a 518-pixel-wide input with a 60 degree FOV.
AUTO_VOXEL_FRACTION = 1.0 / 200.0
# Rewrite run.json with progress this often, so a killed run shows how far it got.
PROGRESS_INTERVAL_S = 10.0

PREDICTIONS_DIR = "predictions"
RUN_JSON = "run.json"
TRAJECTORY_TUM = "trajectory_tum.txt"
POINTS_PLY = "points.ply"
TUM_HEADER = "# timestamp tx ty tz qx qy qz qw"

# Only these names are predictions; temp files (".000012.npz.<pid>.<thread>.<n>.tmp") and the rest are ignored.
_PREDICTION_NAME = re.compile(r"^(\d{6,})\.npz$")
_REQUIRED_KEYS = (
    "frame_index",
    "timestamp",
    "is_keyframe",
    "frame_type",
    "pose_enc",
    "c2w",
    "intrinsics",
    "depth",
    "depth_conf",
    "image_size",
    "window_index",
)
_SCALAR_TYPES = {
    "frame_index": int,
    "timestamp": float,
    "is_keyframe": bool,
    "frame_type": int,
    "window_index": int,
}


class OutputDirError(ValueError):
    """The output directory cannot be created, written, or already holds another run."""


class RunDirError(ValueError):
    """A run directory to read is missing or holds no predictions."""


# --------------------------------------------------------------------------------------------------
# Atomic file writes


_temp_counter = count()


def _atomic_write(path: Path, write: Callable[[Any], None], *, binary: bool) -> None:
    """Write through a temp file in the same folder, then rename over `path`.

    os.replace within one filesystem is atomic, so a reader (or a process killed mid-write) sees the old
    file or the new one, never half of one. No fsync: this guards against a killed process, not power loss,
    and an fsync per frame would stall the stream on slow disks.
    """
    path = Path(path)
    # Not tempfile.mkstemp: its 0600 mode would survive the rename. O_EXCL with 0666 lets the umask decide,
    # as for any other file the user creates; pid, thread and a counter keep concurrent writers apart.
    tmp_name = path.parent / f".{path.name}.{os.getpid()}.{threading.get_ident()}.{next(_temp_counter)}.tmp"
    fd = os.open(tmp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            write(f)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data: dict) -> None:
    text = json.dumps(data, indent=2, default=_json_default) + "\n"
    _atomic_write(path, lambda f: f.write(text), binary=False)


def _json_default(value: Any) -> Any:
    # Settings carry Paths, numpy scalars and small arrays; everything else is written as its repr.
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return repr(value)


# --------------------------------------------------------------------------------------------------
# Point accumulator

# Voxel coordinates are packed into one int64 key, 21 bits per axis (signed, offset by 2**20), so that
# membership is a sorted-array search instead of a Python set of tuples.
_KEY_BITS = 21
_KEY_OFFSET = 1 << (_KEY_BITS - 1)
_KEY_LIMIT = 1 << _KEY_BITS


@dataclass(frozen=True)
class PointCloud:
    """A coloured cloud with the pixel each point was back-projected from.

    xyz [N, 3] float32 world, rgb [N, 3] uint8, frame_index [N] int64 and pixel [N, 2] int32 (u, v) name the
    source observation, so exporters can write a track for every point.
    """

    xyz: np.ndarray
    rgb: np.ndarray
    frame_index: np.ndarray
    pixel: np.ndarray

    def __len__(self) -> int:
        return int(self.xyz.shape[0])


def _back_project_pixels(
    u: np.ndarray, v: np.ndarray, z: np.ndarray, intrinsics: np.ndarray, c2w: np.ndarray
) -> np.ndarray:
    """Pixels (u [M], v [M]) at z-depth z [M] -> world points [M, 3] float32 through K^-1, then c2w.

    Written as nine multiply-adds rather than a [M, 3] @ [3, 3] matmul: BLAS runs that shape on all
    threads and, on a busy machine, takes tens of ms instead of one.
    """
    z = z.astype(np.float32)
    x = (u - np.float32(intrinsics[0, 2])) * (z / np.float32(intrinsics[0, 0]))
    y = (v - np.float32(intrinsics[1, 2])) * (z / np.float32(intrinsics[1, 1]))
    c2w = np.asarray(c2w, dtype=np.float32)
    world = np.empty((len(z), 3), dtype=np.float32)
    for row in range(3):
        world[:, row] = c2w[row, 0] * x + c2w[row, 1] * y + c2w[row, 2] * z + c2w[row, 3]
    return world


class PointAccumulator:
    """Voxel-downsampled world points from a stream of depth maps, capped at `max_points`.

    One point per occupied voxel: the first one to arrive is kept (its exact back-projection, not a voxel
    centre, so it still reprojects onto its source pixel). When the cap is exceeded the voxel size doubles
    and the cloud is re-downsampled, so memory is bounded however long the stream runs; the resolution is
    what gives way.

    Rows are append-only (amortised growth). Voxel membership is looked up in two sorted key arrays, a
    large merged one and a small recent one, like a two-level LSM tree: a frame costs a binary search per
    pixel and a sort of the small level, and the full merge runs only when the small level has grown to a
    quarter of the large one, so the per-frame cost does not grow with the cloud.

        merged: keys [K] sorted, rows [K]    recent: keys [R] sorted, rows [R]    R <= max(K / 4, 64k)
    """

    _MIN_RECENT = 1 << 16

    def __init__(
        self,
        *,
        conf_threshold: float = DEFAULT_CONF_THRESHOLD,
        voxel_size: float | None = None,
        max_points: int = DEFAULT_MAX_POINTS,
    ) -> None:
        if max_points < 1:
            raise ValueError(f"max points must be at least 1, got {max_points}")
        if voxel_size is not None and not (np.isfinite(voxel_size) and voxel_size > 0):
            raise ValueError(f"voxel size must be a positive number of scene units, got {voxel_size}")
        self.conf_threshold = float(conf_threshold)
        self.max_points = int(max_points)
        self.voxel_size: float | None = None if voxel_size is None else float(voxel_size)
        self.num_coarsenings = 0
        self.num_out_of_range = 0
        self._count = 0
        self._keys = np.empty(0, dtype=np.int64)  # per row
        self._xyz = np.empty((0, 3), dtype=np.float32)
        self._rgb = np.empty((0, 3), dtype=np.uint8)
        self._frame = np.empty(0, dtype=np.int64)
        self._pixel = np.empty((0, 2), dtype=np.int32)
        self._merged_keys = np.empty(0, dtype=np.int64)
        self._merged_rows = np.empty(0, dtype=np.int64)
        self._recent_keys = np.empty(0, dtype=np.int64)
        self._recent_rows = np.empty(0, dtype=np.int64)

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        arrays = (
            self._keys,
            self._xyz,
            self._rgb,
            self._frame,
            self._pixel,
            self._merged_keys,
            self._merged_rows,
            self._recent_keys,
            self._recent_rows,
        )
        return sum(a.nbytes for a in arrays)

    def add_frame(
        self,
        frame_index: int,
        depth: np.ndarray,
        depth_conf: np.ndarray,
        intrinsics: np.ndarray,
        c2w: np.ndarray,
        image: np.ndarray | None = None,
    ) -> None:
        """Merge one frame's confident pixels. depth, depth_conf [H, W]; image [H, W, 3] uint8 or None."""
        if image is not None and image.shape[:2] != depth.shape:
            raise ValueError(
                f"image {image.shape[:2]} and depth {depth.shape} of frame {frame_index} differ in size"
            )
        valid = (depth_conf >= self.conf_threshold) & np.isfinite(depth) & (depth > 0)
        v, u = np.nonzero(valid)  # raster order, so "first in the frame" is deterministic
        if len(v) == 0:
            return
        if self.voxel_size is None:
            self.voxel_size = float(np.median(depth[v, u])) * AUTO_VOXEL_FRACTION
        xyz = _back_project_pixels(u, v, depth[v, u], intrinsics, c2w)
        finite = np.isfinite(xyz).all(axis=1)
        keys, in_range = self._voxel_keys(xyz)
        keep = finite & in_range
        self.num_out_of_range += int((finite & ~in_range).sum())
        keys, first = np.unique(keys[keep], return_index=True)
        sel = np.flatnonzero(keep)[first]
        fresh = ~self._occupied(keys)
        sel = sel[fresh]
        rgb = image[v[sel], u[sel]] if image is not None else np.full((len(sel), 3), 200, dtype=np.uint8)
        self._append(
            keys[fresh],
            xyz[sel],
            rgb,
            np.full(len(sel), frame_index, dtype=np.int64),
            np.stack([u[sel], v[sel]], axis=1).astype(np.int32),
        )
        while len(self) > self.max_points:
            self._coarsen()

    def remove_frame(self, frame_index: int) -> None:
        """Drop the points a frame contributed (before its re-emission is added)."""
        drop = self._frame[: self._count] == frame_index
        if drop.any():
            self._rebuild(np.flatnonzero(~drop))

    def cloud(self) -> PointCloud:
        n = self._count
        return PointCloud(
            self._xyz[:n].copy(), self._rgb[:n].copy(), self._frame[:n].copy(), self._pixel[:n].copy()
        )

    def _voxel_keys(self, xyz: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """xyz [M, 3] -> keys [M] int64 and in_range [M] bool (keys of out-of-range points are junk)."""
        with np.errstate(invalid="ignore", over="ignore"):
            cells = np.floor(xyz.astype(np.float64) / self.voxel_size) + _KEY_OFFSET
            in_range = ((cells >= 0) & (cells < _KEY_LIMIT)).all(axis=1)
        cells = np.where(in_range[:, None], cells, 0).astype(np.int64)
        keys = (cells[:, 0] << (2 * _KEY_BITS)) | (cells[:, 1] << _KEY_BITS) | cells[:, 2]
        return keys, in_range

    def _occupied(self, keys: np.ndarray) -> np.ndarray:
        occupied = np.zeros(len(keys), dtype=bool)
        for level in (self._merged_keys, self._recent_keys):
            if len(level):
                pos = np.minimum(np.searchsorted(level, keys), len(level) - 1)
                occupied |= level[pos] == keys
        return occupied

    def _append(self, keys, xyz, rgb, frame, pixel) -> None:
        start, end = self._count, self._count + len(keys)
        if end > len(self._keys):
            self._grow(end)
        self._keys[start:end] = keys
        self._xyz[start:end] = xyz
        self._rgb[start:end] = rgb
        self._frame[start:end] = frame
        self._pixel[start:end] = pixel
        self._count = end
        # keys come sorted from np.unique, so the recent level stays sorted with one merge-sort pass.
        recent_keys = np.concatenate([self._recent_keys, keys])
        recent_rows = np.concatenate([self._recent_rows, np.arange(start, end, dtype=np.int64)])
        order = np.argsort(recent_keys, kind="stable")
        self._recent_keys, self._recent_rows = recent_keys[order], recent_rows[order]
        if len(self._recent_keys) > max(self._MIN_RECENT, len(self._merged_keys) // 4):
            self._merge_levels()

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * len(self._keys), 1024)
        for name in ("_keys", "_xyz", "_rgb", "_frame", "_pixel"):
            old = getattr(self, name)
            new = np.empty((capacity, *old.shape[1:]), dtype=old.dtype)
            new[: self._count] = old[: self._count]
            setattr(self, name, new)

    def _merge_levels(self) -> None:
        keys = np.concatenate([self._merged_keys, self._recent_keys])
        rows = np.concatenate([self._merged_rows, self._recent_rows])
        order = np.argsort(keys, kind="stable")
        self._merged_keys, self._merged_rows = keys[order], rows[order]
        self._recent_keys = np.empty(0, dtype=np.int64)
        self._recent_rows = np.empty(0, dtype=np.int64)

    def _coarsen(self) -> None:
        self.voxel_size *= 2.0
        self.num_coarsenings += 1
        keys, _ = self._voxel_keys(self._xyz[: self._count])  # coarser cells of in-range points stay in range
        self._keys[: self._count] = keys
        _, rows = np.unique(keys, return_index=True)  # the earliest row of each voxel survives
        self._rebuild(rows)

    def _rebuild(self, rows: np.ndarray) -> None:
        """Keep `rows` (ascending, so arrival order is preserved) and re-index them as one merged level."""
        rows = np.sort(rows)
        for name in ("_keys", "_xyz", "_rgb", "_frame", "_pixel"):
            setattr(self, name, getattr(self, name)[rows])
        self._count = len(rows)
        order = np.argsort(self._keys, kind="stable")
        self._merged_keys, self._merged_rows = self._keys[order], order.astype(np.int64)
        self._recent_keys = np.empty(0, dtype=np.int64)
        self._recent_rows = np.empty(0, dtype=np.int64)


# --------------------------------------------------------------------------------------------------
# Trajectory and cloud files


@dataclass(frozen=True)
class PoseRecord:
    """What the writer remembers of a frame once its npz is on disk."""

    timestamp: float
    c2w: np.ndarray  # [3, 4]
    is_keyframe: bool


def tum_line(timestamp: float, c2w: np.ndarray) -> str:
    """One TUM row: timestamp tx ty tz qx qy qz qw of the camera-to-world pose."""
    w, x, y, z = rotation_to_quat_wxyz(c2w[:3, :3])
    values = [*np.asarray(c2w[:3, 3], dtype=np.float64), x, y, z, w]
    return f"{timestamp:.6f} " + " ".join(f"{value:.9g}" for value in values)


def write_tum(path: Path, poses: dict[int, PoseRecord]) -> None:
    """Write poses {frame_index: PoseRecord} sorted by frame index, atomically."""
    lines = [TUM_HEADER] + [tum_line(poses[i].timestamp, poses[i].c2w) for i in sorted(poses)]
    text = "\n".join(lines) + "\n"
    _atomic_write(Path(path), lambda f: f.write(text), binary=False)


def write_ply(path: Path, xyz: np.ndarray, rgb: np.ndarray) -> None:
    """Binary little-endian PLY with float x, y, z and uchar red, green, blue. xyz [N, 3], rgb [N, 3]."""
    vertex = np.empty(
        len(xyz),
        dtype=[("x", "<f4"), ("y", "<f4"), ("z", "<f4"), ("red", "u1"), ("green", "u1"), ("blue", "u1")],
    )
    for axis, name in enumerate("xyz"):
        vertex[name] = xyz[:, axis]
    for channel, name in enumerate(("red", "green", "blue")):
        vertex[name] = rgb[:, channel]
    ply = PlyData([PlyElement.describe(vertex, "vertex")], text=False, byte_order="<")
    _atomic_write(Path(path), ply.write, binary=True)


# --------------------------------------------------------------------------------------------------
# Writer sink


def prediction_path(run_dir: Path, frame_index: int) -> Path:
    return Path(run_dir) / PREDICTIONS_DIR / f"{frame_index:06d}.npz"


def prediction_arrays(pred: FramePrediction) -> dict[str, np.ndarray]:
    """The npz payload of one frame (DESIGN.md §5), plus `image` when the prediction carries it."""
    arrays = {
        "frame_index": np.int64(pred.frame_index),
        "timestamp": np.float64(pred.timestamp),
        "is_keyframe": np.bool_(pred.is_keyframe),
        "frame_type": np.int64(pred.frame_type),
        "pose_enc": np.asarray(pred.pose_enc, dtype=np.float32).reshape(9),
        "c2w": np.asarray(pred.c2w, dtype=np.float32).reshape(3, 4),
        "intrinsics": np.asarray(pred.intrinsics, dtype=np.float32).reshape(3, 3),
        "depth": np.asarray(pred.depth, dtype=np.float32),
        "depth_conf": np.asarray(pred.depth_conf, dtype=np.float32),
        "image_size": np.asarray(pred.image_size, dtype=np.int64),
        "window_index": np.int64(pred.window_index),
    }
    if pred.image is not None:
        arrays["image"] = np.asarray(pred.image, dtype=np.uint8)
    return arrays


def software_versions() -> dict[str, str]:
    # importlib.metadata, so that recording the torch version does not import torch.
    versions = {"python": platform.python_version(), "numpy": np.__version__}
    for dist in ("torch", "stream-recon"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = "not installed"
    return versions


def peak_host_memory_bytes() -> int:
    # ru_maxrss is KiB on Linux and bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class RunWriter:
    """Sink that turns a stream of FramePrediction into a run directory.

    Construct it before loading the model: the constructor creates `output_dir/predictions/` and writes
    run.json with status "running", so an unwritable directory fails in a second rather than after a
    checkpoint load, and a killed run is recognisable afterwards.

    `on_frame` writes `predictions/NNNNNN.npz` atomically; a frame index emitted again (windowed streams)
    overwrites its file, pose and points. `close` writes trajectory_tum.txt, points.ply and the final
    run.json.

    With `background=True` (the default) the file writing and point accumulation run on a writer thread
    behind a queue of `queue_size` frames, so inference does not wait for the disk (numpy and file IO
    release the GIL). A full queue blocks `on_frame`: memory stays bounded when the disk is slower than the
    model. `flush()` waits until every frame handed over is on disk; `close()` flushes first. An error on
    the writer thread is raised by the next `on_frame`, `flush` or `close`. The writer holds a reference
    to each prediction until it is written; the engine's arrays are fresh per frame, so nothing is copied.
    """

    def __init__(
        self,
        output_dir: Path,
        settings: dict,
        *,
        conf_threshold: float = DEFAULT_CONF_THRESHOLD,
        voxel_size: float | None = None,
        max_points: int = DEFAULT_MAX_POINTS,
        overwrite: bool = False,
        background: bool = True,
        queue_size: int = 8,
    ) -> None:
        self.output_dir = Path(output_dir)
        self.predictions_dir = self.output_dir / PREDICTIONS_DIR
        self.settings = dict(settings)
        self.points = PointAccumulator(
            conf_threshold=conf_threshold, voxel_size=voxel_size, max_points=max_points
        )
        self.poses: dict[int, PoseRecord] = {}
        self.last_stats: dict = {}
        self.status = "running"
        self.started_at = _utc_now()
        self._start_time = time.monotonic()
        self._last_progress = self._start_time
        self._prepare_output_dir(overwrite)
        self._write_run_json("running", {})
        self._worker_error: BaseException | None = None
        self._queue: queue.Queue | None = None
        self._worker: threading.Thread | None = None
        if background:
            self._queue = queue.Queue(maxsize=queue_size)
            # Daemon: a process that dies without close() must not hang on this thread at exit.
            self._worker = threading.Thread(target=self._drain_queue, name="run-writer", daemon=True)
            self._worker.start()

    # ---- sink interface

    def on_frame(self, pred: FramePrediction, stats: dict) -> None:
        if self.status != "running":
            raise RuntimeError(f"RunWriter for {self.output_dir} is closed ({self.status}); no more frames")
        self._raise_worker_error()
        if self._queue is None:
            self._write_frame(pred, dict(stats))
        else:
            self._queue.put((pred, dict(stats)))

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Close with the status the exit implies, unless the caller already closed with a summary."""
        if exc_type is None:
            self.close("complete")
        elif issubclass(exc_type, KeyboardInterrupt):
            self.close("interrupted", {"error": "interrupted by the user"})
        else:
            self.close("failed", {"error": f"{exc_type.__name__}: {exc}"})

    def flush(self) -> None:
        """Block until every frame passed to on_frame is written (no-op without a writer thread)."""
        if self._queue is not None:
            self._queue.join()
        self._raise_worker_error()

    def _drain_queue(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._worker_error is None:  # after a failure, keep consuming so producers never block
                    self._write_frame(*item)
            except BaseException as exc:  # handed to the producer thread, never swallowed
                self._worker_error = exc
            finally:
                self._queue.task_done()

    def _raise_worker_error(self) -> None:
        error = self._worker_error
        if error is not None:
            self._worker_error = None
            if isinstance(error, OSError):
                raise OutputDirError(
                    f"writing frames to {self.predictions_dir} failed: {error.strerror or error}"
                ) from error
            raise error

    def _stop_worker(self) -> BaseException | None:
        if self._worker is None:
            return None
        self._queue.put(None)
        self._worker.join()
        self._worker = None
        return self._worker_error

    def _write_frame(self, pred: FramePrediction, stats: dict) -> None:
        arrays = prediction_arrays(pred)
        _atomic_write(
            prediction_path(self.output_dir, pred.frame_index), lambda f: np.savez(f, **arrays), binary=True
        )
        if pred.frame_index in self.poses:
            self.points.remove_frame(pred.frame_index)
        self.poses[pred.frame_index] = PoseRecord(
            float(pred.timestamp), arrays["c2w"].astype(np.float64), bool(pred.is_keyframe)
        )
        self.points.add_frame(
            pred.frame_index,
            arrays["depth"],
            arrays["depth_conf"],
            arrays["intrinsics"],
            arrays["c2w"],
            arrays.get("image"),
        )
        self.last_stats = stats
        now = time.monotonic()
        if now - self._last_progress >= PROGRESS_INTERVAL_S:
            self._last_progress = now
            self._write_run_json("running", {})

    def close(self, status: str, summary: dict | None = None) -> None:
        """Write trajectory, cloud and the final run.json. status: complete | interrupted | failed."""
        if status not in FINAL_STATUSES:
            raise ValueError(f"status must be one of {', '.join(FINAL_STATUSES)}; got {status!r}")
        if self.status != "running":
            return  # already closed: the first final status stands
        self.status = status
        worker_error = self._stop_worker()  # every frame handed over is on disk after this
        self._worker_error = None
        errors = [] if worker_error is None else [f"frame writer: {worker_error!r}"]
        for name, write in (
            (TRAJECTORY_TUM, lambda: write_tum(self.output_dir / TRAJECTORY_TUM, self.poses)),
            (POINTS_PLY, self._write_points),
        ):
            try:
                write()
            except OSError as exc:
                # Keep going: run.json must still say how the run ended, and the npz files are intact.
                errors.append(f"{name}: {exc}")
        self._write_run_json(status, summary or {}, errors)
        if errors:
            raise OutputDirError(f"could not write outputs in {self.output_dir}: {'; '.join(errors)}") from (
                worker_error
            )

    # ---- internals

    def _prepare_output_dir(self, overwrite: bool) -> None:
        out = self.output_dir
        try:
            if out.exists() and not out.is_dir():
                raise OutputDirError(
                    f"output path {out} exists and is not a directory; choose another --output"
                )
            previous = [p for p in (out / RUN_JSON, out / TRAJECTORY_TUM, out / POINTS_PLY) if p.exists()]
            if self.predictions_dir.is_dir():
                previous += [p for p in self.predictions_dir.iterdir() if _PREDICTION_NAME.match(p.name)]
            if previous and not overwrite:
                raise OutputDirError(
                    f"output directory {out} already holds a run ({len(previous)} files such as "
                    f"{previous[0].name}); choose another --output or pass --overwrite to replace it"
                )
            self.predictions_dir.mkdir(parents=True, exist_ok=True)
            for path in previous:
                path.unlink()
        except OutputDirError:
            raise
        except OSError as exc:
            raise OutputDirError(
                f"cannot create or write the output directory {out}: {exc.strerror or exc}; "
                "choose a writable --output"
            ) from None

    def _write_points(self) -> None:
        cloud = self.points.cloud()
        write_ply(self.output_dir / POINTS_PLY, cloud.xyz, cloud.rgb)

    def _write_run_json(self, status: str, summary: dict, errors: list[str] | None = None) -> None:
        elapsed = time.monotonic() - self._start_time
        record = {
            "format": RUN_FORMAT,
            "status": status,
            "settings": self.settings,
            "summary": self._summary(status, elapsed, summary),
        }
        if errors:
            record["output_errors"] = errors
        try:
            write_json_atomic(self.output_dir / RUN_JSON, record)
        except OSError as exc:
            raise OutputDirError(
                f"cannot write {self.output_dir / RUN_JSON}: {exc.strerror or exc}; choose a writable --output"
            ) from None

    def _summary(self, status: str, elapsed: float, extra: dict) -> dict:
        summary: dict[str, Any] = {
            "started_at": self.started_at,
            "ended_at": None if status == "running" else _utc_now(),
            "elapsed_s": round(elapsed, 3),
            "versions": software_versions(),
            "frames": len(self.poses),
            "keyframes": sum(1 for p in self.poses.values() if p.is_keyframe),
            "last_frame_index": max(self.poses) if self.poses else None,
            "peak_host_memory_bytes": peak_host_memory_bytes(),
            "points": {
                "count": len(self.points),
                "conf_threshold": self.points.conf_threshold,
                "voxel_size": self.points.voxel_size,
                "max_points": self.points.max_points,
                "coarsenings": self.points.num_coarsenings,
                "dropped_out_of_range": self.points.num_out_of_range,
            },
            "engine": self.last_stats,
        }
        digest = self.settings.get("checkpoint_digest") or self.settings.get("checkpoint_sha256")
        if digest:
            summary["checkpoint_digest"] = digest
        summary.update(extra)  # the pipeline knows device, timings, FPS and GPU memory; its values win
        return summary


# --------------------------------------------------------------------------------------------------
# Reading a run back


def check_run_dir(run_dir: Path) -> Path:
    """Raise RunDirError unless `run_dir` looks like a run directory; returns its predictions folder."""
    run_dir = Path(run_dir)
    predictions = run_dir / PREDICTIONS_DIR
    if not run_dir.is_dir():
        raise RunDirError(f"run directory {run_dir} does not exist")
    if not predictions.is_dir():
        raise RunDirError(f"{run_dir} is not a run directory: it has no {PREDICTIONS_DIR}/ folder")
    return predictions


def _prediction_files(run_dir: Path) -> list[tuple[int, Path]]:
    predictions = check_run_dir(run_dir)
    found = []
    for path in predictions.iterdir():
        match = _PREDICTION_NAME.match(path.name)
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


def load_prediction(path: Path) -> dict[str, Any]:
    """One npz as a dict: scalars as Python values, arrays as numpy; `image` is None when absent.

    Raises ValueError (or OSError) when the file is truncated, not an npz, or lacks a key.
    """
    try:
        with np.load(path, allow_pickle=False) as data:
            missing = [key for key in _REQUIRED_KEYS if key not in data.files]
            if missing:
                raise ValueError(f"{path.name} lacks {', '.join(missing)}")
            record: dict[str, Any] = {key: data[key] for key in data.files}
    except (zipfile.BadZipFile, EOFError) as exc:
        raise ValueError(f"{path.name} is truncated or not an npz file ({exc})") from None
    for key, cast in _SCALAR_TYPES.items():
        record[key] = cast(record[key])
    record.setdefault("image", None)
    return record


def iter_run(run_dir: Path) -> Iterator[dict[str, Any]]:
    """Yield the predictions of a run in frame order, one npz in memory at a time.

    A file that cannot be read (typically the last one of a run killed by the OS mid-write on a filesystem
    without atomic rename, or one damaged afterwards) is skipped with a warning instead of failing the
    whole run.
    """
    for frame_index, path in _prediction_files(run_dir):
        try:
            record = load_prediction(path)
        except FileNotFoundError:
            logger.warning("skipping frame %d: %s disappeared while reading", frame_index, path)
            continue
        except (OSError, ValueError) as exc:
            logger.warning("skipping frame %d: cannot read %s: %s", frame_index, path, exc)
            continue
        yield record


def read_run(run_dir: Path) -> list[dict[str, Any]]:
    """All predictions of a run (see iter_run); holds every depth map in memory, so prefer iter_run."""
    return list(iter_run(run_dir))


def read_run_info(run_dir: Path) -> dict[str, Any]:
    """run.json as a dict, or {} when it is missing or unreadable (the predictions are still usable)."""
    path = Path(run_dir) / RUN_JSON
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("ignoring %s: %s", path, exc)
        return {}
