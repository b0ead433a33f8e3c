"""The loop-closure process's side of the indexing rule (models/loops/coverage.py), against a real child
that has started and then answers nothing (stopped with SIGSTOP: the slowest detection there is)."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest

pytest.importorskip("gtsam")

from stream_recon.models.loops.closer import LoopClosureConfig  # noqa: E402
from stream_recon.models.loops.process import LoopClosureProcess  # noqa: E402
from stream_recon.models.stream.prediction import FRAME_KEY, FramePrediction  # noqa: E402
from stream_recon.models.supervision import Deadline  # noqa: E402


def keyframe(frame: int) -> FramePrediction:
    return FramePrediction(frame, frame / 30.0, FRAME_KEY, np.zeros(9, np.float32), np.eye(3, 4, dtype=np.float32),
                           np.eye(3, dtype=np.float32), np.ones((8, 8), np.float32), np.ones((8, 8), np.float32),
                           image=np.zeros((8, 8, 3), np.uint8))


def wait_for_answers(closer: LoopClosureProcess, timeout: float) -> None:
    """Until the child's pipe has something to read, `timeout` s at most, then take it (a test's wait: the
    stream never waits on the child but in `finish`)."""
    closer._wait_for_pipes(timeout)
    closer._exchange()


@pytest.mark.slow
def test_a_closer_that_does_not_answer_lowers_the_density_once_with_one_warning(caplog) -> None:
    closer = LoopClosureProcess(LoopClosureConfig(keyframes_in_flight=2, keyframes_waiting=0, index_spacing=4,
                                                  max_index_spacing=16))
    try:
        started = Deadline(60.0)
        while not closer.started and not started.expired:
            wait_for_answers(closer, started.remaining())
        assert closer.started, "the loop-closure child did not start within 60 s"
        os.kill(closer._child.process.pid, signal.SIGSTOP)  # from now on nothing is answered
        with caplog.at_level(logging.WARNING):
            sent = [frame for frame in range(100) if closer.add_prediction(keyframe(frame))]
        assert closer.helper.is_up
    finally:
        closer.close()
    # 0 and 4 fill the two places; 8 is due and finds none: the spacing doubles to 8, counted from frame 4;
    # every frame from 12 on is then due and waits, and the spacing doubles no further until one is indexed
    assert sent == [0, 4]
    summary = closer.summary()
    assert summary["index_spacing"] == {"start": 4, "end": 8}
    assert summary["keyframes_deferred"] == 1 + len(range(12, 100))
    assert summary["longest_unindexed_stretch"] == 95  # frames 5-99
    warnings = [record.getMessage() for record in caplog.records if "cannot keep up" in record.getMessage()]
    assert len(warnings) == 1 and "one keyframe in 8 frames" in warnings[0], warnings


def started_closer(config: LoopClosureConfig) -> LoopClosureProcess:
    closer = LoopClosureProcess(config)
    started = Deadline(60.0)
    while not closer.started and not started.expired:
        wait_for_answers(closer, started.remaining())
    assert closer.started, "the loop-closure child did not start within 60 s"
    return closer


@pytest.mark.slow
def test_due_keyframes_wait_for_room_before_the_density_is_lowered() -> None:
    """A child that answers nothing: 2 keyframes in flight and 3 waiting are chosen, and only the next due
    one, finding both full, lowers the density."""
    closer = started_closer(LoopClosureConfig(keyframes_in_flight=2, keyframes_waiting=3, index_spacing=4,
                                              max_index_spacing=16))
    try:
        os.kill(closer._child.process.pid, signal.SIGSTOP)
        chosen = [frame for frame in range(100) if closer.add_prediction(keyframe(frame))]
    finally:
        closer.close()
    assert chosen == [0, 4, 8, 12, 16]
    assert closer.summary()["index_spacing"] == {"start": 4, "end": 8}


@pytest.mark.slow
def test_a_burst_of_due_keyframes_keeps_the_density_when_detection_keeps_up() -> None:
    """A closed chunk's final keyframes come at once: 20 due keyframes in one burst against 2 places in
    flight wait their turn and are all answered; the spacing stays."""
    closer = started_closer(LoopClosureConfig(keyframes_in_flight=2, keyframes_waiting=24, index_spacing=4,
                                              max_index_spacing=16))
    try:
        chosen = [frame for frame in range(80) if closer.add_prediction(keyframe(frame))]
        closer.finish(Deadline(60.0))
    finally:
        closer.close()
    assert chosen == list(range(0, 80, 4))
    summary = closer.summary()
    assert summary["index_spacing"] == {"start": 4, "end": 4} and summary["keyframes_deferred"] == 0
    assert summary["keyframes_indexed"] == 20


def heap_mib(pid: int) -> float:
    """The [heap] mapping's size of process `pid`, from /proc."""
    spans = [line.split()[0].split("-") for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
             if line.endswith("[heap]")]
    return sum(int(end, 16) - int(start, 16) for start, end in spans) / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt, /proc")
def test_the_child_keeps_a_keyframes_temporaries_for_the_next_one() -> None:
    """keep_freed_memory in the child: after one 518 x 392 keyframe's features its heap still holds the SIFT's
    temporaries (56 MiB, against 16 in a child that returns them: the stream's features then took 54-56 ms a
    keyframe against 74-75 on the 2-core sandbox)."""
    picture = cv2.resize(cv2.imread(str(Path(__file__).parents[1] / "app" / "sample" / "000000.png")), (518, 392))
    intrinsics = np.array([[414.0, 0, 259], [0, 414, 196], [0, 0, 1]], np.float32)
    frame = FramePrediction(0, 0.0, FRAME_KEY, np.zeros(9, np.float32), np.eye(3, 4, dtype=np.float32), intrinsics,
                            np.full((392, 518), 2.0, np.float32), np.full((392, 518), 10.0, np.float32), image=picture)
    closer = started_closer(LoopClosureConfig(index_spacing=1, max_index_spacing=1))
    try:
        assert closer.add_prediction(frame)
        answered = Deadline(60.0)
        while closer._unanswered and not answered.expired:
            wait_for_answers(closer, answered.remaining())
        assert not closer._unanswered and closer.helper.is_up
        assert heap_mib(closer._child.process.pid) > 32
    finally:
        closer.close()
