"""A finished run refined in place (`stream-recon refine`): what it reads, what it writes, and how it swaps.

From the run's files and its saved map (models/loops/saved_map.py), models/loops/refine.py indexes every
keyframe, verifies its loops and solves a graph of chunk segments from scratch; each frame then moves by its
segment's correction. The refined files are written beside the run's into a hidden staging folder
(atomic_writes.staging_folder): every prediction moved (c2w, pose_enc, depth scaled), trajectory_tum.txt and
points.ply rebuilt from them, run.json with `summary.refine`, and, the first time, the stream's own
trajectory kept as trajectory_stream_tum.txt. Only once all of it is written are they swapped in, the
earlier files moved out in a few renames while signals are held (atomic_writes.move_in_staged) and removed by
a process of their own (remove_detached: 14 GB at 10,000 frames took 11 s), the command ending meanwhile. A
refine stopped before the renames (Ctrl-C, SIGTERM, an error) hands its staging folder to the same: the run stays
exactly as it was.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import threadpoolctl

from stream_recon.app.outputs.atomic_writes import (
    atomic_write,
    move_in_staged,
    remove_detached,
    staging_folder,
)
from stream_recon.app.outputs.json_records import write_json_atomic
from stream_recon.app.outputs.npz_reading import (
    load_prediction,
    mapped_array,
    prediction_fields,
    prediction_record,
)
from stream_recon.app.outputs.output_folder import lock_run_dir, run_dir_in_use, unlock_run_dir
from stream_recon.app.outputs.pointcloud import (
    DEFAULT_CONF_THRESHOLD,
    DEFAULT_MAX_POINTS,
    BatchPoints,
    FrameDepth,
    PointAccumulator,
    write_ply,
)
from stream_recon.app.outputs.rundir import (
    POINTS_PLY,
    PREDICTIONS_DIR,
    RUN_JSON,
    TRAJECTORY_OPEN_TUM,
    TRAJECTORY_TUM,
    check_run_dir,
    prediction_files,
    read_run_info,
)
from stream_recon.app.outputs.trajectories import read_tum, write_tum
from stream_recon.app.outputs.writers import corrected_prediction_file
from stream_recon.app.stopping import interrupts_held
from stream_recon.models import (
    ChildCalls,
    ChildDied,
    DaemonPool,
    MapError,
    SavedMap,
    keep_freed_memory,
    read_map,
)
from stream_recon.models.loops.refine import (
    JOB_STALL_S,
    ImageFeatures,
    IndexedKeyframe,
    Keyframe,
    LoopEdge,
    RefineConfig,
    RefineFigures,
    RunFrame,
    detect_loops,
    fine_graph,
    frame_moves,
    indexed_keyframe,
    keyframe_descriptor,
    saved_features,
    segments_of,
    solve_fine,
    verified_alignment,
    with_stream_loops,
)
from stream_recon.models.stream.similarity import Sim3
from stream_recon.models.supervision import Helper, HelperPolicy, WhenDown, WhenFull

TRAJECTORY_STREAM_TUM = "trajectory_stream_tum.txt"  # the stream's trajectory, kept by the first refine
# Refine's threads and their child processes are its helpers; one job takes tens of milliseconds, so one that
# has not ended in two minutes is a hung library: the refine fails, the run stays.
_WORKER_POLICY = HelperPolicy("refine's workers", WhenFull.DROP, WhenDown.FAIL_RUN, stall_s=JOB_STALL_S)
# The work that holds the interpreter's lock (an npz read and write, a frame's points, a keyframe's loading) runs
# in a child process a worker thread: on a 16-core host, 16 threads wrote the frames at 9.2 ms a frame
# where one thread took 12.5 and 4 threads 7.0 (the lock, not the cores, was the limit), while OpenCV's SIFT
# and the checks, which free it, ran 18 and 8 times faster on 16 threads than on one (on micro-benchmarks; in a
# 10,000-frame refine the checks on threads left its loops at 47-50 s, with or without the map's features). So
# the checks run there too: a check's two keyframes (~0.6 MB) cross the pipe in a fraction of a millisecond.
# Jobs handed to the workers ahead of the one whose result is taken next, per worker: a job's result is small
# (a batch's points, not its frames' 1.4 MB arrays at 518x392), and a worker holds one batch's arrays at a time.
JOBS_AHEAD_PER_WORKER = 2
# Frames moved in one job, their points merged there: the cloud's merge is the stage's one thread, and a lookup
# and append a batch instead of a frame costs it ~1/4 (consecutive frames reach mostly the same voxels).
BATCH_FRAMES = 8
# Frames whose three fields a job reads before the refine starts: 10,000 frames in 40 jobs, two or three a worker,
# so that every worker's child has started before the keyframes' descriptors.
READ_BATCH_FRAMES = 250
# A stopped refine waits this long for the jobs its workers are running (a batch written, ~0.1-0.3 s), before
# the staging folder goes; a worker stalled on the disk past it is left behind, its write failing then.
STOP_WAIT_S = 5.0


class RefineError(ValueError):
    """A run that cannot be refined, in one sentence that says what to do."""


@dataclass(frozen=True)
class RefineResult:
    frames: int
    figures: RefineFigures
    swap_seconds: float  # the refined files swapped in (their renames), after summary.refine
    seconds: float = 0.0  # the whole refine, its workers ended (refine_run's)
    end_seconds: float = 0.0  # the workers and their children ended (refine_run's)


Progress = Callable[[str, int, int], None]


def refine_run(run_dir: Path, config: RefineConfig = RefineConfig(), progress: Progress | None = None) -> RefineResult:
    """Refine `run_dir` in place (see the module docstring); RefineError for a run that cannot be."""
    run_dir = Path(run_dir)
    progress = progress or (lambda stage, done, total: None)
    started = time.perf_counter()
    try:
        check_run_dir(run_dir)
    except ValueError as error:
        raise RefineError(str(error)) from None
    if run_dir_in_use(run_dir):
        raise RefineError(f"{run_dir} is in use by a running stream-recon command: wait for it to end")
    info = read_run_info(run_dir)
    if info.get("status") == "running":
        raise RefineError(f"{run_dir} was left running: `stream-recon export` or `view` of it closes it first")
    if "refine" in info.get("summary", {}):
        raise RefineError(f"{run_dir} is refined already (run.json's summary.refine): its files no longer hold the "
                          "stream's chunks; refine a copy of the stream's run instead")
    try:
        saved = read_map(run_dir)
    except MapError as error:
        raise RefineError(str(error)) from None
    lock_run_dir(run_dir)
    helper = Helper(_WORKER_POLICY)
    pool = DaemonPool(config.workers, "refine", helper)  # (its threads start with its first job)
    children = ChildCalls(helper, setup=f"{__name__}.set_up_worker_child")  # (a child a thread, at its first call)
    try:
        with _one_thread_a_call():
            result = _refine_held(Workers(pool, children), run_dir, info, saved, config, progress, started)
    except ChildDied as died:
        raise RefineError(f"refine failed, the run is as it was: {died}") from None
    except TimeoutError:  # (_in_order's wait for a job, past the policy's stall)
        raise RefineError(f"refine failed, the run is as it was: one of its workers ran a job past "
                          f"{_WORKER_POLICY.stall_s:.0f} s (a hung library)") from None
    finally:
        ending = time.perf_counter()
        pool.shutdown()  # unbounded-ok: a DaemonPool's shutdown returns at once
        children.close()
        unlock_run_dir(run_dir)
    ended = time.perf_counter()
    return replace(result, seconds=ended - started, end_seconds=ended - ending)


@dataclass(frozen=True)
class Workers:
    """Refine's worker threads, and the child process each calls for the work that holds the interpreter's lock."""

    pool: DaemonPool
    children: ChildCalls


def set_up_worker_child() -> None:
    """In a child of refine's: OpenCV and BLAS on one thread, as in the refining process (_one_thread_a_call),
    and the memory its jobs free kept for the next (keep_freed_memory)."""
    cv2.setNumThreads(1)
    threadpoolctl.threadpool_limits(limits=1)
    keep_freed_memory()


@contextlib.contextmanager
def _one_thread_a_call() -> Iterator[None]:
    """OpenCV and BLAS on one thread a call while refine runs (but in its solve, while the workers idle): its
    workers are the parallelism. Their own threads on top (16 workers, each SIFT, RootSIFT product and RANSAC
    spreading over 16 threads of its own) made a check take ~240 ms of the 16-core host's time where one core
    takes 13 ms (15,543 checks: 237 s)."""
    threads = cv2.getNumThreads()
    cv2.setNumThreads(1)
    try:
        with threadpoolctl.threadpool_limits(limits=1):
            yield
    finally:
        cv2.setNumThreads(threads)


def _refine_held(workers: Workers, run_dir: Path, info: dict, saved: SavedMap, config: RefineConfig,
                 progress: Progress, started: float) -> RefineResult:
    """The refine of a run it holds, its features, loop checks and frames' files on `workers`."""
    files = dict(prediction_files(run_dir))
    frames = _run_frames(workers, files)
    if saved.num_chunks == 0:
        raise RefineError(f"{run_dir}'s map holds no complete chunk yet (the run was stopped in its second "
                          "chunk): nothing to refine")
    covered = [frame for frame in frames if frame.chunk_index < saved.num_chunks]
    placement = _placement(run_dir, saved)
    keyframes = [frame for frame in covered if frame.is_keyframe]
    if keyframes:
        _require_images(files[keyframes[0].frame_index], run_dir)
    figures = RefineFigures(chunks=saved.num_chunks, seconds={"read": time.perf_counter() - started})
    segment_of = segments_of(covered, config.segment_frames).node_of
    call, known, streamed = workers.children.call, saved_features(saved, config.closure), _stream_loops(saved)
    loops = detect_loops(keyframes, lambda frames: call(_descriptors, [files[frame] for frame in frames]),
                         lambda frame: call(_prepared_keyframe, files[frame], config, known.get(frame)), segment_of, placement,
                         config, progress, figures, workers.pool.submit,
                         lambda query, earlier: call(verified_alignment, query, earlier, config.closure),
                         known=known, streamed=[(earlier, query) for earlier, query, _ in streamed])
    merged = with_stream_loops(loops, streamed)
    figures.stream_loops = len(merged) - len(loops)
    loops = merged
    solve_started = time.perf_counter()
    graph, parts = fine_graph(covered, placement, saved.links, loops, config)
    with threadpoolctl.threadpool_limits(limits=config.workers):  # the workers idle meanwhile
        result = solve_fine(graph, config)
    figures.seconds["solve"] = time.perf_counter() - solve_started
    figures.nodes, figures.loops_accepted = len(parts.nodes), len(result.accepted_ids)
    moves_started = time.perf_counter()
    moves = frame_moves(covered, parts, result.world_from_chunk, placement)
    last = moves[max(moves)] if moves else Sim3.identity()  # frames of a chunk not closed: moved with the last
    moves.update({frame.frame_index: last for frame in frames if frame.frame_index not in moves})
    figures.seconds["moves"] = time.perf_counter() - moves_started
    staging = staging_folder(run_dir)
    try:
        _write_refined(workers, run_dir, staging, files, moves, info, figures, progress, started, config)
        swapping = time.perf_counter()
        with interrupts_held():
            earlier = [run_dir / name for name in (PREDICTIONS_DIR, TRAJECTORY_TUM, POINTS_PLY, RUN_JSON)]
            # handed to the remover inside the hold: a stop held across the renames is raised after both
            remove_detached(move_in_staged(staging, [path for path in earlier if path.exists()]))
    except BaseException:
        with interrupts_held():  # a second Ctrl-C must not cut the hand-off short
            remove_detached(staging)  # (a stop in the write stage: up to the run's size written there)
        raise
    return RefineResult(len(frames), figures, time.perf_counter() - swapping)


def _in_order(pool: DaemonPool, jobs: Sequence[Callable[[], Any]]) -> Iterator[Any]:
    """Each job's result in order, at most JOBS_AHEAD_PER_WORKER a worker handed over ahead of the one taken;
    the first that raises (or stalls past the policy's limit) raises here. Closed early (an error, a stop: close
    it where it is left, not when a traceback lets it go), the jobs not begun are cancelled and those running get
    STOP_WAIT_S to end: their files land before the caller may remove the folder they write into."""
    ahead: deque[concurrent.futures.Future] = deque()
    try:
        for job in jobs:
            ahead.append(pool.submit(job))
            if len(ahead) >= JOBS_AHEAD_PER_WORKER * pool.workers:
                yield ahead.popleft().result(timeout=_WORKER_POLICY.stall_s)
        while ahead:
            yield ahead.popleft().result(timeout=_WORKER_POLICY.stall_s)
    finally:
        concurrent.futures.wait([future for future in ahead if not future.cancel()], timeout=STOP_WAIT_S)


class PublishedVoxels:
    """The cloud's published voxels (PointAccumulator.published) as files a child maps, a file each time they
    change (the cloud's merged level, which grows by a quarter at least: tens of files over 10,000 frames), so
    that a batch moved in a child leaves out the voxels the cloud held when its job began, as a thread of this
    process does, and the merge looks up the others only (a batch of 8 frames: ~300 k voxels where the cloud
    held ~50 k of them, the merge 34 ms)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._lock = threading.Lock()
        self._keys: np.ndarray | None = None
        self._path: Path | None = None
        self._written = 0

    def current(self, points: PointAccumulator) -> tuple[tuple[float | None, float | None], Path]:
        """The grid `points` is on and the file of the voxels it holds there."""
        grid, keys = points.published
        with self._lock:  # (workers ask at once)
            if keys is not self._keys:
                path = self.folder / f"voxels_{self._written}.npy"
                self._written += 1
                atomic_write(path, lambda file, keys=keys: np.save(file, keys), binary=True)
                self._keys, self._path = keys, path
            return grid, self._path


def _moved_in_child(children: ChildCalls, frames: Sequence[tuple[int, Path, Path, Sim3]], voxels: PublishedVoxels,
                    points: PointAccumulator) -> tuple[list[tuple[float, np.ndarray]], BatchPoints | None]:
    return children.call(_moved_frames, frames, *voxels.current(points), points.conf_threshold)


# In a child of refine's: the voxels file it mapped last (PublishedVoxels), by path.
_MAPPED_VOXELS: dict[Path, np.ndarray] = {}


def _mapped_voxels(path: Path) -> np.ndarray:
    if path not in _MAPPED_VOXELS:
        _MAPPED_VOXELS.clear()
        _MAPPED_VOXELS[path] = mapped_array(path)
    return _MAPPED_VOXELS[path]


def _moved_frames(frames: Sequence[tuple[int, Path, Path, Sim3]], grid: tuple[float | None, float | None],
                  voxels: Path, conf_threshold: float) -> tuple[list[tuple[float, np.ndarray]], BatchPoints | None]:
    """A batch of consecutive frames' npz files moved into the staging folder ((index, path, staged, move)),
    in a child of refine's: each frame's timestamp and moved c2w, from the arrays written (the files are not
    read back), and the batch's points merged on the cloud's `grid` less the `voxels` it held there
    (PointAccumulator.batch_points: None where the grid is not set yet, the frames then read back and added one
    by one)."""
    taken, depths = [], []
    for index, path, staged, move in frames:
        arrays = corrected_prediction_file(path, move)
        atomic_write(staged, lambda f, arrays=arrays: np.savez(f, **arrays), binary=True)
        record = prediction_record(staged, arrays)
        taken.append((record["timestamp"], record["c2w"]))
        depths.append(_frame_depth(index, record))
    return taken, PointAccumulator(conf_threshold=conf_threshold).batch_points(depths, (grid, _mapped_voxels(voxels)))


def _merge(points: PointAccumulator, batch: Sequence[tuple[int, Path, Path, Sim3]], merged: BatchPoints | None) -> None:
    """A batch's points into the cloud: merged ahead where they fit its grid, else (no grid yet, or a grid
    coarsened since) frame by frame, read back, as the stream adds them."""
    if merged is not None and points.fits(merged):
        points.add_batch(merged)
        return
    for index, _, staged, _ in batch:
        depth = _frame_depth(index, load_prediction(staged))
        points.add_frame(index, depth.depth, depth.depth_conf, depth.intrinsics, depth.c2w, depth.image, depth.dropped)


def _frame_depth(index: int, record: dict[str, Any]) -> FrameDepth:
    return FrameDepth(index, record["depth"], record["depth_conf"], record["intrinsics"], record["c2w"],
                      record["image"], record["sky_mask"])


def _run_frames(workers: Workers, files: dict[int, Path]) -> list[RunFrame]:
    """Every frame of the run as its file holds it, read in batches by `workers`' children (a file's three
    fields: ~0.3 ms, 3 s of a 10,000-frame run on one thread), which start meanwhile."""
    listed = list(files.items())
    jobs = [functools.partial(workers.children.call, _read_frames, listed[start:start + READ_BATCH_FRAMES])
            for start in range(0, len(listed), READ_BATCH_FRAMES)]
    with contextlib.closing(_in_order(workers.pool, jobs)) as batches:
        return [frame for batch in batches for frame in batch]


def _read_frames(listed: Sequence[tuple[int, Path]]) -> list[RunFrame]:
    """(frame index, path) -> the frame as its file holds it, in a child of refine's."""
    return [_run_frame(index, path) for index, path in listed]


def _run_frame(index: int, path: Path) -> RunFrame:
    fields = prediction_fields(path, "chunk_index", "c2w", "is_keyframe")
    return RunFrame(index, int(fields["chunk_index"]), np.asarray(fields["c2w"], np.float64), bool(fields["is_keyframe"]))


def _require_images(path: Path, run_dir: Path) -> None:
    if load_prediction(path)["image"] is None:
        raise RefineError(f"{run_dir} was run with --no-save-images: refine finds loops in the pictures; run the "
                          "video again without it")


def _descriptors(paths: Sequence[Path]) -> list[np.ndarray]:
    """[128] each frame's retrieval descriptor, in a child of refine's."""
    return [keyframe_descriptor(prediction_fields(path, "image")["image"]) for path in paths]


def _prepared_keyframe(path: Path, config: RefineConfig, features: ImageFeatures | None) -> IndexedKeyframe:
    """A keyframe's features (`features` where the map keeps them) and points, from its file, in a child of
    refine's."""
    record = load_prediction(path)
    return indexed_keyframe(Keyframe(record["frame_index"], record["chunk_index"], record["image"], record["depth"],
                                     record["depth_conf"], record["intrinsics"], record["c2w"]), config.closure,
                            features)


def _stream_loops(saved: SavedMap) -> list[tuple[int, int, LoopEdge]]:
    """The stream's verified loops (the map's), as (earlier frame, query frame, edge in chunk coordinates)."""
    return [(loop.frames[0], loop.frames[1],
             LoopEdge(loop.loop_id, loop.first, loop.second, Sim3.from_matrix(loop.first_from_second),
                      np.sqrt(np.diag(loop.covariance)), covariance=loop.covariance))
            for loop in saved.loops]


def _placement(run_dir: Path, saved: SavedMap) -> list[Sim3]:
    """Each chunk's placement in the run's files (SavedMap.placement)."""
    return saved.placement(corrected=(run_dir / TRAJECTORY_OPEN_TUM).is_file())


def _write_refined(workers: Workers, run_dir: Path, staging: Path, files: dict[int, Path], moves: dict[int, Sim3],
                   info: dict, figures: RefineFigures, progress: Progress, started: float, config: RefineConfig) -> None:
    """Every refined file into `staging`, the frames moved on `workers`' children: the moved predictions, the
    trajectory and points rebuilt from them, the stream's trajectory kept, run.json with summary.refine."""
    (staging / PREDICTIONS_DIR).mkdir()
    summary = info.setdefault("summary", {})
    recorded = summary.get("points", {})
    points = PointAccumulator(conf_threshold=recorded.get("conf_threshold", DEFAULT_CONF_THRESHOLD),
                              voxel_size=recorded.get("voxel_size"),
                              max_points=recorded.get("max_points", DEFAULT_MAX_POINTS))
    timestamps, poses = [], []
    writing = time.perf_counter()
    ordered = [(index, path, staging / PREDICTIONS_DIR / path.name, moves[index]) for index, path in sorted(files.items())]
    batches = [ordered[start:start + BATCH_FRAMES] for start in range(0, len(ordered), BATCH_FRAMES)]
    done = 0
    with tempfile.TemporaryDirectory(prefix="stream-recon-voxels-") as folder:
        voxels = PublishedVoxels(Path(folder))
        for group in (batches[:1], batches[1:]):  # the first alone: it sets the cloud's grid, which the others use
            # (a job reads the cloud's voxels when a worker takes it, not when it is made)
            jobs = [functools.partial(_moved_in_child, workers.children, batch, voxels, points) for batch in group]
            with contextlib.closing(_in_order(workers.pool, jobs)) as moved:
                for batch, (taken, merged) in zip(group, moved, strict=True):
                    timestamps.extend(timestamp for timestamp, _ in taken)
                    poses.extend(c2w for _, c2w in taken)
                    _merge(points, batch, merged)
                    done += len(batch)
                    progress("frames", done, len(files))
    write_tum(staging / TRAJECTORY_TUM, timestamps, np.array(poses, np.float64).reshape(-1, 3, 4))
    cloud = points.cloud()
    write_ply(staging / POINTS_PLY, cloud.xyz, cloud.rgb)
    if (run_dir / TRAJECTORY_TUM).is_file() and not (run_dir / TRAJECTORY_STREAM_TUM).exists():
        write_tum(staging / TRAJECTORY_STREAM_TUM, *read_tum(run_dir / TRAJECTORY_TUM))
    figures.seconds["write"] = time.perf_counter() - writing
    summary["refine"] = {**figures.as_json(), "frames": len(files), "points": len(cloud),
                         "segment_frames": config.segment_frames,
                         "seconds_total": round(time.perf_counter() - started, 3)}
    summary["points"] = {**recorded, "count": len(cloud)}
    write_json_atomic(staging / RUN_JSON, info)
