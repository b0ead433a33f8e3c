"""Refine's last stage on its workers (app/outputs/refined.py): the frames moved in order with a bounded number
ahead, the first failure raised where the points take it, and a stage left early waits for the writes it began,
so that none lands in a staging folder the caller is removing."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from stream_recon.app.outputs import refined
from stream_recon.app.outputs.npz_reading import load_prediction, prediction_record, stored_prediction
from stream_recon.app.outputs.npz_schema import PredictionOutputs, prediction_arrays
from stream_recon.app.outputs.pointcloud import PointAccumulator
from stream_recon.app.outputs.writers import corrected_prediction_file
from stream_recon.models import DaemonPool
from stream_recon.models.stream.prediction import FRAME_KEY, FramePrediction
from stream_recon.models.stream.similarity import Sim3
from stream_recon.models.supervision import Helper


def pool(workers: int = 2) -> DaemonPool:
    return DaemonPool(workers, "test-refine-write", Helper(refined._WORKER_POLICY))


def test_results_come_in_order_with_few_jobs_ahead() -> None:
    begun, lock = [], threading.Lock()

    def job(n: int) -> int:
        with lock:
            begun.append(n)
        time.sleep(0.002 * (n % 3))  # later jobs may end first
        return n

    workers = 2
    taken = []
    for result in refined._in_order(pool(workers), [lambda n=n: job(n) for n in range(40)]):
        with lock:
            assert len(begun) <= len(taken) + 1 + refined.JOBS_AHEAD_PER_WORKER * workers
        taken.append(result)
    assert taken == list(range(40))


def test_the_first_failure_is_raised_where_its_result_is_taken() -> None:
    def job(n: int) -> int:
        if n == 5:
            raise OSError("disk full")
        return n

    taken = []
    with pytest.raises(OSError, match="disk full"):
        for result in refined._in_order(pool(), [lambda n=n: job(n) for n in range(20)]):
            taken.append(result)
    assert taken == [0, 1, 2, 3, 4]


def test_a_stage_left_early_waits_for_the_writes_it_began() -> None:
    running, ended = threading.Event(), []

    def slow(n: int) -> int:
        running.set()
        time.sleep(0.3)
        ended.append(n)
        return n

    records = refined._in_order(pool(1), [lambda n=n: slow(n) for n in range(10)])
    assert next(records) == 0
    running.wait(5)
    records.close()  # as a stop in the points' loop closes it
    # the job running when it closed has ended; the ones queued behind it never began
    assert ended in ([0, 1], [0, 1, 2]) and len(ended) < 10


def test_a_moved_frames_record_is_what_reading_its_file_gives(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    frame = FramePrediction(3, 0.1, FRAME_KEY, rng.standard_normal(9).astype(np.float32), np.eye(4, dtype=np.float32)[:3],
                            np.eye(3, dtype=np.float32), rng.uniform(1, 3, (6, 8)).astype(np.float32),
                            np.full((6, 8), 4.0, np.float32), rng.integers(0, 255, (6, 8, 3), dtype=np.uint8))
    source, staged = tmp_path / "frame.npz", tmp_path / "staged.npz"
    np.savez(source, **PredictionOutputs().stored(prediction_arrays(frame)))
    move = Sim3(1.5, np.eye(3), np.array([0.0, 1.0, 0.0]))
    accumulator = PointAccumulator()
    record, points = refined._moved_frame(source, staged, move, accumulator)
    read = load_prediction(staged)
    assert points.median_depth == pytest.approx(float(np.median(read["depth"])))  # the grid is not set yet
    assert record.keys() == read.keys()
    for key, value in read.items():
        np.testing.assert_array_equal(record[key], value, err_msg=key)
    assert prediction_record(staged, stored_prediction(staged)).keys() == read.keys()
    np.testing.assert_array_equal(corrected_prediction_file(source, move)["depth"], stored_prediction(staged)["depth"])
