"""Refine's last stage on its workers (app/outputs/refined.py): the frames moved in order with a bounded number
ahead, the first failure raised where the points take it, and a stage left early waits for the writes it began,
so that none lands in a staging folder the caller is removing."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from stream_recon.app.outputs import refined
from stream_recon.app.outputs.atomic_writes import remove_detached
from stream_recon.app.outputs.npz_reading import load_prediction, stored_prediction
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


def test_moved_frames_give_what_reading_their_files_gives(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    sources = {}
    for index in (3, 4):
        frame = FramePrediction(index, 0.1 * index, FRAME_KEY, rng.standard_normal(9).astype(np.float32),
                                np.eye(4, dtype=np.float32)[:3], np.eye(3, dtype=np.float32),
                                rng.uniform(1, 3, (6, 8)).astype(np.float32), np.full((6, 8), 4.0, np.float32),
                                rng.integers(0, 255, (6, 8, 3), dtype=np.uint8))
        sources[index] = tmp_path / f"frame_{index}.npz"
        np.savez(sources[index], **PredictionOutputs().stored(prediction_arrays(frame)))
    move = Sim3(1.5, np.eye(3), np.array([0.0, 1.0, 0.0]))
    accumulator = PointAccumulator()
    batch = [(index, sources[index], tmp_path / f"staged_{index}.npz", move) for index in (3, 4)]
    voxels = refined.PublishedVoxels(tmp_path)
    taken, merged = refined._moved_frames(batch, *voxels.current(accumulator), accumulator.conf_threshold)
    assert merged is None  # the grid is not set yet: the frames are added one by one
    for (timestamp, c2w), (_, _, staged, _) in zip(taken, batch, strict=True):
        read = load_prediction(staged)
        assert timestamp == read["timestamp"]
        np.testing.assert_array_equal(c2w, read["c2w"])
    np.testing.assert_array_equal(corrected_prediction_file(sources[3], move)["depth"],
                                  stored_prediction(batch[0][2])["depth"])
    first = refined._frame_depth(3, load_prediction(batch[0][2]))
    accumulator.add_frame(3, first.depth, first.depth_conf, first.intrinsics, first.c2w, first.image, first.dropped)
    again = (4, sources[4], tmp_path / "staged_4_again.npz", move)
    _, merged = refined._moved_frames([again], *voxels.current(accumulator), accumulator.conf_threshold)
    expected = accumulator.batch_points([refined._frame_depth(4, load_prediction(again[2]))])
    assert merged is not None and accumulator.fits(merged) and merged.frames == 1
    for field in ("keys", "xyz", "rgb", "frame", "pixel"):
        np.testing.assert_array_equal(getattr(merged, field), getattr(expected, field), err_msg=field)


def gone_within(path: Path, seconds: float) -> bool:
    """Whether `path` is gone within `seconds` (a detached remover's work)."""
    deadline = time.monotonic() + seconds
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not path.exists()


REMOVING = """
import signal, sys
from pathlib import Path
from stream_recon.app.outputs.atomic_writes import remove_retired
signal.signal(signal.SIGTERM, signal.default_int_handler)  # a stop, as the CLI's handlers raise it
print("removing", flush=True)
remove_retired(Path(sys.argv[1]))
print("removed", flush=True)
"""


def test_a_stop_while_the_earlier_files_are_removed_exits_at_once_and_they_go_all_the_same(tmp_path: Path) -> None:
    """An earlier export's entries, like a refined run's earlier predictions (14 GB at 10,000 frames), can take
    seconds to remove after the swap: a SIGTERM meanwhile ends the command at once and a remover of its own
    finishes them."""
    retired = tmp_path / ".stream-recon-old.1"
    for group in range(40):
        (retired / str(group)).mkdir(parents=True)
        for n in range(500):
            (retired / str(group) / f"{n}.npz").write_bytes(b"x")
    child = subprocess.Popen([sys.executable, "-c", REMOVING, str(retired)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "removing\n"
    underway = time.monotonic() + 30
    while len(list(retired.iterdir())) == 40 and time.monotonic() < underway:  # (until its first group is gone)
        time.sleep(0.001)
    child.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    output, _ = child.communicate(timeout=30)
    assert "removed" not in output  # (the stop came while it removed)
    assert child.returncode != 0 and time.monotonic() - signalled < 2.0
    assert gone_within(retired, 120)  # (20,000 files: seconds on a busy machine)


def test_a_folder_no_remover_can_be_started_for_is_removed_here(tmp_path: Path, monkeypatch) -> None:
    retired = tmp_path / ".stream-recon-old.1"
    (retired / "predictions").mkdir(parents=True)
    (retired / "predictions" / "000000.npz").write_bytes(b"x")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python-here"))
    remove_detached(retired)
    assert not retired.exists()


def test_the_remover_takes_what_a_late_writer_adds_too(tmp_path: Path) -> None:
    """A stopped refine's workers may write into its staging folder for a moment after the folder is handed to
    the remover: what they add is removed as well."""
    staging = tmp_path / ".stream-recon-new.1"
    staging.mkdir()
    for n in range(5000):  # (a pass takes long enough for the writer to add files behind it)
        (staging / f"{n}.npz").write_bytes(b"x")
    writing = threading.Event()

    def late_writer() -> None:
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):  # (the folder gone under it)
                (staging / f"{time.monotonic_ns()}.npz").write_bytes(b"x")
                writing.set()
            time.sleep(0.002)

    writer = threading.Thread(target=late_writer)
    writer.start()
    writing.wait(5)
    remove_detached(staging)
    writer.join()
    assert gone_within(staging, 30)
