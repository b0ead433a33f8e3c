"""The run writer: a sink that turns predictions into a run directory (app.outputs.rundir), and the run's provenance.

Per frame, `predictions/NNNNNN.npz` is written as the frame completes; at close, trajectory_tum.txt,
points.ply and the final run.json (settings, versions, memory, summary).

Memory stays bounded over any stream length: the writer keeps one pose per frame and a capped point
accumulator, never the depth maps; everything else is already on disk.
"""

from __future__ import annotations

import errno
import functools
import logging
import platform
import resource
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from stream_recon.app.outputs.abandoned import utc_now
from stream_recon.app.outputs.atomic_writes import atomic_write
from stream_recon.app.outputs.json_records import write_json_atomic
from stream_recon.app.outputs.masks import FrameMasker, MaskDirError
from stream_recon.app.outputs.npz_reading import stored_prediction
from stream_recon.app.outputs.npz_schema import SKY_MASK_FIELD, PredictionOutputs, prediction_arrays
from stream_recon.app.outputs.output_folder import (
    OutputDirError,
    prepare_output_dir,
    run_dir_locked_here,
    unlock_run_dir,
)
from stream_recon.app.outputs.pointcloud import (
    DEFAULT_CONF_THRESHOLD,
    DEFAULT_MAX_POINTS,
    PointAccumulator,
    write_ply,
)
from stream_recon.app.outputs.rundir import (
    FINAL_STATUSES,
    POINTS_PLY,
    PREDICTIONS_DIR,
    RUN_FORMAT,
    RUN_JSON,
    TRAJECTORY_OPEN_TUM,
    TRAJECTORY_TUM,
    holds_run,
    prediction_path,
    replace_run,
)
from stream_recon.app.outputs.trajectories import write_tum
from stream_recon.models import DaemonPool, FramePrediction
from stream_recon.models.loops.corrections import ChunkCorrections
from stream_recon.models.stream.similarity import Sim3
from stream_recon.models.supervision import (
    Deadline,
    HandOff,
    Helper,
    HelperDown,
    HelperPolicy,
    WhenDown,
    WhenFull,
    start_supervised_thread,
)

logger = logging.getLogger(__name__)

# Rewrite run.json with progress this often, so a killed run shows how far it got.
PROGRESS_INTERVAL_S = 10.0
# A disk that takes no frame for this long is stalled: a frame is a few MB, which any working disk
# (a network share included) takes in well under a second. The run then fails, keeping what was written.
WRITER_STALL_S = 60.0
_WORKER_POLL_S = 5.0  # the writer thread's longest wait in one take; the run's end wakes it at once
_WORKER_JOIN_S = 0.5  # the end waits this long for a thread that is mid-frame past the deadline
# The frames a loop closure moved are rewritten at the run's end, each npz read, moved and written whole:
# ~6.5 ms a 1.4 MB file on one thread (2,000 files took 13 s of a GPU host's end of a run). NumPy's and
# the file system's work release the GIL, so this many threads share them; each file gets at most
# CORRECTION_S_PER_FILE, after which the run's end goes on and run.json names the files left as they were.
CORRECTION_THREADS = 8
CORRECTION_S_PER_FILE = 1.0


@dataclass(frozen=True)
class PoseRecord:
    """What the writer remembers of a frame once its npz is on disk."""

    timestamp: float
    c2w: np.ndarray  # [3, 4]
    is_keyframe: bool
    chunk_index: int = 0  # the chunk whose emission is final: a loop closure's correction moves it


def corrected_prediction_file(path: Path, move: Sim3) -> dict[str, np.ndarray]:
    """The arrays of one npz with the frame moved by a loop closure's Sim(3): its camera (c2w and pose_enc)
    moved, its depth scaled (so that back-projection lands on the moved points), each in its stored dtype."""
    arrays = stored_prediction(path)
    arrays["c2w"] = move.apply_to_poses(arrays["c2w"]).astype(arrays["c2w"].dtype)
    arrays["pose_enc"] = move.apply_to_pose_enc(arrays["pose_enc"])
    arrays["depth"] = (arrays["depth"].astype(np.float32) * np.float32(move.scale)).astype(arrays["depth"].dtype)
    return arrays


def _move_prediction_file(path: Path, move: Sim3) -> None:
    if path.exists():
        corrected = corrected_prediction_file(path, move)
        atomic_write(path, lambda f: np.savez(f, **corrected), binary=True)


def _failure(future: Future, deadline: Deadline) -> str | None:
    """What a file's rewrite raised (None when it succeeded); TimeoutError once the deadline has passed."""
    try:
        future.result(timeout=deadline.remaining())
    except TimeoutError:
        raise
    except Exception as exc:  # one file's failure leaves the others to be rewritten
        return _said(exc)
    return None


def _said(error: Exception) -> str:
    """An output's failure in run.json and the error line: an OSError's own sentence names the file and the
    cause; any other error is a fault of ours, named by its type too."""
    return str(error) if isinstance(error, OSError) else f"{type(error).__name__}: {error}"


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


class RunWriter:
    """Sink that turns a stream of FramePrediction into a run directory.

    Construct it before loading the model: the constructor creates `output_dir/predictions/` and writes
    run.json with status "running", so an unwritable directory fails in a second rather than after a
    checkpoint load, and a killed run is recognisable afterwards.

    `on_frame` writes `predictions/NNNNNN.npz` atomically; a frame index emitted again (chunked streams)
    overwrites its file, pose and points. `close` writes trajectory_tum.txt, points.ply and the final
    run.json.

    With `background=True` (the default) the file writing and point accumulation run on a writer thread
    behind a hand-off of `queue_size` frames (models/supervision.py), so inference does not wait for the
    disk (numpy and file IO release the GIL). A full hand-off holds `on_frame` back (memory stays bounded
    when the disk is slower than the model, and no frame is dropped) for WRITER_STALL_S at most: a disk
    that takes nothing for that long fails the run with one line, every frame written before kept. 32
    frames (at most ~70 MB at 518x378) absorb the burst of frames a chunk rollover re-emits (16 by
    default) without holding inference up.

    `outputs` says what each npz holds and which frames get one (PredictionOutputs); the cloud is built
    from what is saved, as `export` rebuilds it. `flush()` waits until every frame handed over is on disk; `close()` flushes first. An error on
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
        queue_size: int = 32,
        outputs: PredictionOutputs = PredictionOutputs(),
        masker: FrameMasker | None = None,
        stall_s: float | None = None,
        progress_interval_s: float | None = None,
        correction_s_per_file: float | None = None,
    ) -> None:
        # (None: the module's constant as it is when the writer is made, which the fault harness may have set)
        self.output_dir = Path(output_dir)
        self.stall_s = WRITER_STALL_S if stall_s is None else stall_s  # how long the disk may take no frame
        # run.json rewritten with progress this often
        self.progress_interval_s = PROGRESS_INTERVAL_S if progress_interval_s is None else progress_interval_s
        # a moved frame's npz rewritten within this
        self.correction_s_per_file = CORRECTION_S_PER_FILE if correction_s_per_file is None else correction_s_per_file
        self.masker = masker  # a frame's dropped pixels (app.outputs.masks), made on the writer thread: off the stream
        self.predictions_dir = self.output_dir / PREDICTIONS_DIR
        self.settings = dict(settings)
        self.outputs = outputs
        self.points = PointAccumulator(
            conf_threshold=conf_threshold, voxel_size=voxel_size, max_points=max_points
        )
        self.points_written: int | None = None  # the points points.ply holds, once it is written
        self.poses: dict[int, PoseRecord] = {}
        self.last_stats: dict = {}
        self.status = "running"
        self.started_at = utc_now()
        self._start_time = time.monotonic()
        self._last_progress = self._start_time
        self.replaced = False  # whether this run's files have taken the folder (an earlier run's are gone)
        self._prepare_output_dir(overwrite)
        self._worker_error: BaseException | None = None
        self.helper = Helper(HelperPolicy("the run writer", WhenFull.PUSH_BACK, WhenDown.FAIL_RUN,
                                          stall_s=self.stall_s, push_back_s=self.stall_s))
        self._handoff: HandOff | None = None
        self._worker: threading.Thread | None = None
        if background:
            self._handoff = HandOff(self.helper, queue_size)
            self._worker = start_supervised_thread(self.helper, self._write_handed_frames, "run-writer")

    def helpers(self) -> dict[str, Helper]:
        """The writer's helper, by run.json's name (models/supervision.py's HelperOwner)."""
        return {"writer": self.helper}

    # ---- sink interface

    def on_frame(self, pred: FramePrediction, stats: dict) -> None:
        if self.status != "running":
            raise RuntimeError(f"RunWriter for {self.output_dir} is closed ({self.status}); no more frames")
        self._raise_worker_error()
        if self._handoff is None:
            self._write_frame(pred, dict(stats))
            return
        try:
            self._handoff.offer((pred, dict(stats)))
        except HelperDown:
            raise OutputDirError(self._stalled_message()) from None

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

    def flush(self, deadline: Deadline | None = None) -> None:
        """Wait until every frame passed to on_frame is written (no-op without a writer thread), until
        `deadline` at most (default WRITER_STALL_S from now); a disk that has not taken them by then fails."""
        if self._handoff is not None and not self._handoff.drain(deadline or Deadline(self.stall_s)):
            raise OutputDirError(self._stalled_message())
        self._raise_worker_error()

    def _write_handed_frames(self) -> None:
        """The writer thread: every frame handed over, until the run's end; after a failure it goes on
        taking frames without writing them, so that the stream is never held back."""
        while not self._handoff.closed:
            taken, item = self._handoff.take(timeout=_WORKER_POLL_S)
            if not taken:
                continue
            try:
                if self._worker_error is None:
                    self._write_frame(*item)
            except BaseException as exc:  # handed to the producer thread, never swallowed
                self._worker_error = exc
            finally:
                self._handoff.done()

    def _stalled_message(self) -> str:
        written = f"{len(self.poses)} frames" + (f", the last frame {max(self.poses)}" if self.poses else "")
        return (f"the disk took no frame for {self.stall_s:g} s (writing to {self.predictions_dir}); every "
                f"frame written before it ({written}) is kept; check the disk, or choose another --output")

    def _raise_worker_error(self) -> None:
        error = self._worker_error
        if error is not None:
            self._worker_error = None
            if isinstance(error, OSError):
                raise OutputDirError(self._write_error_message(error)) from error
            if isinstance(error, MaskDirError):  # the user's masks, said in their own sentence
                raise HelperDown(str(error)) from error
            # a FAIL_RUN helper: the run ends "failed" with this one line
            raise HelperDown(f"the run writer failed on a frame: {type(error).__name__}: {error}") from error

    def _write_error_message(self, error: OSError) -> str:
        message = f"writing frames to {self.predictions_dir} failed: {error.strerror or error}"
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            last = f", the last frame {max(self.poses)}" if self.poses else ""
            message += (
                f"; the disk is full. Every frame written before it ({len(self.poses)} frames{last}) is kept; "
                "free some space or choose another --output, and save less per frame with --no-save-images "
                "or --save-predictions keyframes (and --save-depth float16 if float32 was asked for)"
            )
        return message

    def _stop_worker(self, deadline: Deadline) -> BaseException | None:
        """Let the writer thread write what it was handed (until `deadline`) and end it."""
        if self._worker is None:
            return None
        drained = self._handoff.drain(deadline)
        self._handoff.close()  # wakes the thread's take: it ends with what is left, not at its next poll
        self._worker.join(timeout=max(deadline.remaining(), _WORKER_JOIN_S))
        self._worker = None
        if not drained and self._worker_error is None:
            return OutputDirError(self._stalled_message())
        return self._worker_error

    def _write_frame(self, pred: FramePrediction, stats: dict) -> None:
        self._take_the_folder()  # (on the writer's thread: no signal cuts the replacement short)
        arrays = prediction_arrays(pred)
        path = prediction_path(self.output_dir, pred.frame_index)
        stored = dropped = None
        if self.outputs.writes(pred):
            if self.masker is not None:
                dropped = self.masker.dropped(pred.frame_index, arrays.get("image"), arrays["depth"].shape)
                if dropped is not None:
                    arrays["sky_mask"] = SKY_MASK_FIELD.array(dropped)
            stored = self.outputs.stored(arrays)
            atomic_write(path, functools.partial(np.savez, **stored), binary=True)  # (a partial: no frame of ours)
        else:
            path.unlink(missing_ok=True)  # re-emitted as a non-keyframe: the earlier emission is not final
        # only now that the file is on disk: the trajectory never names a frame whose write failed
        if pred.frame_index in self.poses:
            self.points.remove_frame(pred.frame_index)  # a re-emission replaces the frame's points
        self.poses[pred.frame_index] = PoseRecord(
            float(pred.timestamp), arrays["c2w"].astype(np.float64), bool(pred.is_keyframe), int(pred.chunk_index)
        )
        if stored is not None:
            # The cloud is built from the saved values, so that `export` rebuilds points.ply from the files;
            # colours come from the image even when it is not saved.
            self.points.add_frame(
                pred.frame_index,
                stored["depth"].astype(np.float32, copy=False),
                stored["depth_conf"].astype(np.float32, copy=False),
                arrays["intrinsics"],
                arrays["c2w"],
                arrays.get("image"),
                dropped,
            )
        self.last_stats = stats
        now = time.monotonic()
        if now - self._last_progress >= self.progress_interval_s:
            self._last_progress = now
            self._write_run_json("running", {})

    def close(self, status: str, summary: dict | None = None, corrections: ChunkCorrections | None = None,
              deadline: Deadline | None = None) -> None:
        """Write trajectory, cloud and the final run.json. status: complete | interrupted | failed.
        `deadline`: how long the frames still being written may take (default WRITER_STALL_S).

        `corrections` (loop closure's, models/loops/corrections.py): when they move any chunk, the uncorrected
        trajectory goes to trajectory_open_tum.txt, and the npz files, trajectory_tum.txt and points.ply
        hold the corrected poses. Without (or when they move nothing) every file is as the stream made it.
        """
        if status not in FINAL_STATUSES:
            raise ValueError(f"status must be one of {', '.join(FINAL_STATUSES)}; got {status!r}")
        if self.status != "running":
            return  # already closed: the first final status stands
        self.status = status
        worker_error = self._stop_worker(deadline or Deadline(self.stall_s))  # every frame handed over is on disk
        self._worker_error = None
        if not self.replaced and status == "interrupted" and worker_error is None:
            self._let_go()  # stopped before its first frame: the earlier run stays as it was
            return
        self._take_the_folder()
        errors = [] if worker_error is None else [f"frame writer: {worker_error!r}"]
        moves = [] if corrections is None else self._chunk_moves(corrections)
        writes = [(TRAJECTORY_TUM, self._write_trajectory), (POINTS_PLY, lambda: self._write_points(moves))]
        if moves:
            writes[:0] = [(TRAJECTORY_OPEN_TUM, lambda: self._write_trajectory(TRAJECTORY_OPEN_TUM)),
                          (PREDICTIONS_DIR, lambda: self._correct_predictions(moves))]
        for name, write in writes:
            try:
                write()
            except Exception as exc:
                # Keep going, whatever failed: run.json must still say how the run ended, the other files must
                # still be written, and the npz files are intact.
                errors.append(f"{name}: {_said(exc)}")
        self._write_run_json(status, summary or {}, errors)
        self._let_go()
        if errors:
            raise OutputDirError(f"could not write outputs in {self.output_dir}: {'; '.join(errors)}") from (
                worker_error
            )

    # ---- internals

    def _let_go(self) -> None:
        if self._holds_folder:
            unlock_run_dir(self.output_dir)

    def _prepare_output_dir(self, overwrite: bool) -> None:
        """The folder checked and held; a new run's run.json written now, while an earlier run there stays
        until this one writes its first frame (or closes having done something: complete or failed), so
        that a run stopped before its first frame leaves the earlier one as it was."""
        # a writer made alone (not by run_sequence, which holds the folder for the whole run) holds it until
        # it closes
        self._holds_folder = not run_dir_locked_here(self.output_dir)
        prepare_output_dir(self.output_dir, overwrite=overwrite)
        if not holds_run(self.output_dir):
            self._take_the_folder()

    def _take_the_folder(self) -> None:
        """This run's files in place of an earlier run's (replace_run), run.json first; once."""
        if self.replaced:
            return
        try:
            replace_run(self.output_dir)
            self.predictions_dir.mkdir(exist_ok=True)
        except OSError as exc:
            raise OutputDirError(
                f"cannot write to the output directory {self.output_dir}: {exc.strerror or exc}; "
                "choose a writable --output"
            ) from None
        self.replaced = True
        self._write_run_json("running", {})

    def _write_trajectory(self, name: str = TRAJECTORY_TUM) -> None:
        frames = sorted(self.poses)
        c2w = np.array([self.poses[i].c2w for i in frames]).reshape(-1, 3, 4)
        write_tum(self.output_dir / name, [self.poses[i].timestamp for i in frames], c2w)

    def _write_points(self, moves: list[tuple[np.ndarray, Sim3]]) -> None:
        cloud = self.points.moved_cloud(moves) if moves else self.points.cloud()
        write_ply(self.output_dir / POINTS_PLY, cloud.xyz, cloud.rgb)
        self.points_written = len(cloud)  # fewer than accumulated where a correction brought points together

    def empty_cloud(self) -> str | None:
        """Why points.ply holds no point, once written (PointAccumulator.empty_reason, naming the run's masks where
        they emptied it); None when it holds some, or was not written."""
        if self.points_written != 0:
            return None
        return self.points.empty_reason(self.masker.describe() if self.masker is not None else "the masks")

    def _chunk_moves(self, corrections: ChunkCorrections) -> list[tuple[np.ndarray, Sim3]]:
        """(frames [F], Sim3) for each chunk that the corrections move, by the chunk of each frame's final
        emission."""
        by_chunk: dict[int, list[int]] = {}
        for frame, pose in self.poses.items():
            by_chunk.setdefault(pose.chunk_index, []).append(frame)
        moves = [(np.array(frames), corrections.for_chunk(chunk)) for chunk, frames in sorted(by_chunk.items())]
        return [(frames, move) for frames, move in moves if not move.is_identity]

    def _correct_predictions(self, moves: list[tuple[np.ndarray, Sim3]]) -> None:
        """Move each corrected frame's pose (self.poses and its npz: c2w, pose_enc, depth scaled), the files on
        CORRECTION_THREADS threads."""
        files = []
        for frames, move in moves:
            for frame in frames.tolist():
                record = self.poses[frame]
                self.poses[frame] = replace(record, c2w=move.apply_to_poses(record.c2w))
                files.append((prediction_path(self.output_dir, frame), move))
        pool = DaemonPool(CORRECTION_THREADS, "correct-predictions", self.helper)  # (its failures are listed here)
        deadline = Deadline(self.correction_s_per_file * max(1, len(files)))
        failures = []
        try:
            for path, future in [(path, pool.submit(_move_prediction_file, path, move)) for path, move in files]:
                failure = _failure(future, deadline)
                if failure:
                    failures.append(f"{path.name}: {failure}")
        except TimeoutError:
            raise OSError(f"moving the frames' files a loop closure corrected took over {deadline.seconds:.0f} s: "
                          "the files not yet written keep their uncorrected poses") from None
        finally:
            pool.shutdown()  # unbounded-ok: a DaemonPool's shutdown returns at once
        if failures:
            raise OSError(f"{len(failures)} of the {len(files)} files a loop closure moved keep their uncorrected "
                          f"poses, the first {failures[0]}")

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
            "ended_at": None if status == "running" else utc_now(),
            "elapsed_s": round(elapsed, 3),
            "versions": software_versions(),
            "frames": len(self.poses),
            "keyframes": sum(1 for p in self.poses.values() if p.is_keyframe),
            "last_frame_index": max(self.poses) if self.poses else None,
            "peak_host_memory_bytes": peak_host_memory_bytes(),
            "points": {
                "count": len(self.points) if self.points_written is None else self.points_written,
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
