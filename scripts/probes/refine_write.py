"""Refine's last stage at the scale of long runs: every frame's npz moved into the staging folder, the trajectory
and points.ply rebuilt from them (app/outputs/refined.py `_write_refined`, the product's function), on synthetic
frames of a run's size. The frames of a 10,000-frame run are 14 GB at 518x392, so the growth is measured on
fewer and stated per frame.

    python3 scripts/probes/refine_write.py --frames 100 1000 --height 392 --width 518 --workers 2

Each size: N frames written as a run writes them (float16 depth and confidence, the picture), one Sim(3) a
64-frame segment, then the stage timed alone; prints seconds and milliseconds a frame.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from stream_recon.app.outputs.atomic_writes import atomic_write
from stream_recon.app.outputs.npz_schema import PredictionOutputs, prediction_arrays
from stream_recon.app.outputs.refined import _WORKER_POLICY, Workers, _write_refined
from stream_recon.app.outputs.rundir import PREDICTIONS_DIR, prediction_path
from stream_recon.models import ChildCalls, DaemonPool
from stream_recon.models.loops.refine import RefineConfig, RefineFigures
from stream_recon.models.stream.prediction import FRAME_KEY, FramePrediction
from stream_recon.models.stream.similarity import Sim3
from stream_recon.models.supervision import Helper


def synthetic_frame(index: int, height: int, width: int, rng: np.random.Generator) -> FramePrediction:
    """A camera walking along x over a wall 3 m away, with a little relief: every pixel confident."""
    focal = 0.8 * width
    intrinsics = np.array([[focal, 0, width / 2], [0, focal, height / 2], [0, 0, 1]], np.float32)
    c2w = np.eye(4, dtype=np.float32)[:3]
    c2w[0, 3] = 0.01 * index
    depth = (3.0 + 0.05 * rng.standard_normal((height, width))).astype(np.float32)
    return FramePrediction(index, index / 30.0, FRAME_KEY, np.zeros(9, np.float32), c2w, intrinsics, depth,
                           np.full((height, width), 5.0, np.float32),
                           rng.integers(0, 255, (height, width, 3), dtype=np.uint8))


def write_run(folder: Path, frames: int, height: int, width: int) -> dict[int, Path]:
    (folder / PREDICTIONS_DIR).mkdir(parents=True)
    outputs, rng, files = PredictionOutputs(), np.random.default_rng(0), {}
    for index in range(frames):
        stored = outputs.stored(prediction_arrays(synthetic_frame(index, height, width, rng)))
        files[index] = prediction_path(folder, index)
        atomic_write(files[index], lambda f, stored=stored: np.savez(f, **stored), binary=True)
    return files


def timed_stage(folder: Path, files: dict[int, Path], workers: int) -> float:
    moves = {index: Sim3(1.0 + 1e-3 * (index // 64), np.eye(3), np.array([0.0, 0.001 * (index // 64), 0.0]))
             for index in files}
    staging = folder / ".staging"
    staging.mkdir()
    started = time.perf_counter()
    helper = Helper(_WORKER_POLICY)
    pool = DaemonPool(workers, "refine", helper)
    children = ChildCalls(helper, setup="stream_recon.app.outputs.refined.set_up_worker_child")
    try:
        _write_refined(Workers(pool, children), folder, staging, files, moves, {"summary": {}}, RefineFigures(),
                       lambda stage, done, total: None, started, replace(RefineConfig(), workers=workers))
    finally:
        pool.shutdown()
        children.close()
    seconds = time.perf_counter() - started
    shutil.rmtree(staging)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--height", type=int, default=392)
    parser.add_argument("--width", type=int, default=518)
    parser.add_argument("--workers", type=int, default=RefineConfig().workers)
    parser.add_argument("--folder", default=tempfile.gettempdir(), help="where the synthetic runs are written")
    args = parser.parse_args()
    for frames in args.frames:
        folder = Path(tempfile.mkdtemp(prefix="refine_write_", dir=args.folder))
        try:
            files = write_run(folder, frames, args.height, args.width)
            seconds = timed_stage(folder, files, args.workers)
            print(f"{frames:6d} frames at {args.width}x{args.height}, {args.workers} workers: {seconds:7.2f} s, "
                  f"{1000 * seconds / frames:6.1f} ms a frame", flush=True)
        finally:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
