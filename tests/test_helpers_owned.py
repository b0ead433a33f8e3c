"""Every thread and child process a run starts belongs to a `Helper` that run.json's `summary.helpers` lists
(models/supervision.py: `helper_of_thread`, `helper_of_child`), and the latest-wins state the live viewer
hands its updates through waits on its Condition, never by polling.

The run is real: the tiny model on the CPU through `run_sequence`, a frame source whose every frame goes
through the preprocessing pool, the live viewer (a real viser server) and loop closure on (its real child
process), the checkpoint's digest hashed beside it. Every thread started and child process made meanwhile is
recorded as it starts, with its helper then; and a thread of the test samples the process every few ms from
before the first frame to after run.json is written (a library's thread is listed by its helper once the
library has it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from media_helpers import free_port

from stream_recon.models.daemon_pool import DaemonPool
from stream_recon.models.supervision import (
    CHILDREN,
    Deadline,
    Helper,
    HelperPolicy,
    LatestState,
    WhenDown,
    WhenFull,
    helper_of_child,
    helper_of_thread,
    start_supervised_thread,
    supervise_child,
)

POLICY = HelperPolicy("a test's helper", WhenFull.LATEST, WhenDown.TURN_OFF, stall_s=5.0)


def child_pids() -> set[int]:
    """This process's child processes now (/proc: every thread's children)."""
    pids = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            pids.update(int(pid) for pid in (task / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError):  # (a thread that ended meanwhile)
            continue
    return pids


class Sampler:
    """Samples the threads and children that were not there before `start`, every `period_s`, with the
    helper each one belongs to at that moment."""

    def __init__(self, period_s: float = 0.005) -> None:
        self.period_s = period_s
        self.threads: dict[threading.Thread, Helper | None] = {}
        self.children: dict[int, Helper | None] = {}
        self._stop = threading.Event()

    def __enter__(self) -> Sampler:
        self._before = set(threading.enumerate())
        self._children_before = child_pids()
        self._thread = threading.Thread(target=self._sample, name="test-sampler", daemon=True)
        self._before.add(self._thread)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.sample()

    def _sample(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def sample(self) -> None:
        for thread in threading.enumerate():
            if thread not in self._before and self.threads.get(thread) is None:
                self.threads[thread] = helper_of_thread(thread)
        for pid in child_pids() - self._children_before:
            if self.children.get(pid) is None:
                self.children[pid] = helper_of_child(pid)


class Starts:
    """Every thread started and child process made while it is entered, each with the helper it belonged to as
    it started (a thread: once started; a library's may be listed by its helper a moment later, and `Sampler`
    sees it then)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.threads: dict[threading.Thread, Helper | None] = {}
        self.children: list[subprocess.Popen] = []
        start, popen_init = threading.Thread.start, subprocess.Popen.__init__

        def started(thread: threading.Thread) -> None:
            start(thread)
            self.threads[thread] = helper_of_thread(thread)

        def made(process: subprocess.Popen, *args, **kwargs) -> None:
            popen_init(process, *args, **kwargs)
            self.children.append(process)

        monkeypatch.setattr(threading.Thread, "start", started)
        monkeypatch.setattr(subprocess.Popen, "__init__", made)


# -- the registry --------------------------------------------------------------------------------------------
def test_a_supervised_thread_a_pool_worker_and_a_child_are_known_by_their_helper():
    helper, other = Helper(POLICY), Helper(POLICY)
    release = threading.Event()
    thread = start_supervised_thread(helper, lambda: release.wait(10), "test-helper")
    pool = DaemonPool(2, "test-pool", other)
    try:
        pool.submit(release.wait, 10)
        workers = [found for found in threading.enumerate() if found.name.startswith("test-pool_")]
        assert helper_of_thread(thread) is helper and workers and all(helper_of_thread(w) is other for w in workers)
        assert helper_of_thread(threading.current_thread()) is None
        supervise_child(other, 999_999_999)
        assert helper_of_child(999_999_999) is other and helper_of_child(999_999_998) is None
        supervise_child(helper, os.getpid())  # the record of a child that has gone is dropped
        assert helper_of_child(999_999_999) is None and helper_of_child(os.getpid()) is helper
    finally:
        release.set()
        pool.shutdown()
        pool.join(Deadline(10))
        thread.join(timeout=10)


def test_a_library_s_threads_belong_to_the_helper_that_lists_them():
    release = threading.Event()
    library = threading.Thread(target=release.wait, args=(10,), daemon=True)  # as a library names it
    helper = Helper(POLICY, library_threads=lambda: [library])
    library.start()
    try:
        assert helper_of_thread(library) is helper
    finally:
        release.set()
        library.join(timeout=10)


# -- a child's death, noticed when it happens ----------------------------------------------------------------
def idle_child(helper: Helper, died=None):
    from stream_recon.models.child_process import start_child

    return start_child("helpers", "idle_child", helper=helper, died=died,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)})


def test_a_killed_child_is_noticed_within_a_second_without_any_check_calling_it():
    """The monitor of children waits on every child's sentinel: its helper is down when it dies, though
    nothing of its owner's (a pump, a check) runs meanwhile; a child its parent ends is no death."""
    helper, ended_helper = Helper(POLICY), Helper(POLICY)
    child = idle_child(helper, died=lambda code: f"it died (exit status {code})")
    ended = idle_child(ended_helper)
    try:
        os.kill(child.process.pid, signal.SIGKILL)
        killed = time.monotonic()
        while helper.is_up and time.monotonic() - killed < 10:
            time.sleep(0.005)
        assert time.monotonic() - killed < 1.0 and helper.down_reason == "it died (exit status -9)"
        assert CHILDREN.helpers() == {"child_monitor": CHILDREN.helper} and CHILDREN.helper.is_up
        assert helper_of_thread(next(t for t in threading.enumerate() if t.name == "child-monitor")) is CHILDREN.helper
        ended.close()
        time.sleep(0.5)
        assert ended_helper.is_up
    finally:
        child.close()
        ended.close()


# -- the latest-wins state -----------------------------------------------------------------------------------
def latest_of_lists(helper: Helper) -> LatestState[list]:
    return LatestState(helper, lambda taken: [], lambda pending: not pending)


def test_a_newer_update_replaces_the_one_waiting_and_the_worker_takes_it_whole():
    state = latest_of_lists(Helper(POLICY))
    state.update(lambda pending: pending.append("frame 1"))
    state.update(lambda pending: pending.__setitem__(slice(None), ["frame 2"]))  # latest wins
    assert state.take(timeout=0) == ["frame 2"] and state.read(len) == 0 and state.working
    state.done(more_due=False)
    assert state.idle and state.updates == 1


def test_wait_idle_returns_once_the_worker_has_run_again_and_finished():
    """`wait_idle` wakes the worker and returns when its `done` says it finished (the Condition's notify); a
    state nobody works on holds it to its deadline."""
    state = latest_of_lists(Helper(POLICY))
    taken: list[list] = []

    def worker() -> None:
        while not state.closed:
            taken.append(state.take(timeout=10))
            state.done(more_due=False)

    state.update(lambda pending: pending.append("a frame"))
    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    try:
        assert state.wait_idle(Deadline(10)) and ["a frame"] in taken and state.idle
        runs = state.updates
        assert state.wait_idle(Deadline(10)) and state.updates > runs  # nothing pending: woken all the same
    finally:
        state.close()
        thread.join(timeout=10)
    assert not latest_of_lists(Helper(POLICY)).wait_idle(Deadline(0.05))  # no worker: the deadline ends it


def test_wait_idle_marks_a_worker_that_works_past_its_stall_limit_down():
    helper = Helper(HelperPolicy("a test's helper", WhenFull.LATEST, WhenDown.TURN_OFF, stall_s=0.1))
    state = latest_of_lists(helper)
    state.update(lambda pending: pending.append("a frame"))
    state.take(timeout=0)  # taken and never done
    assert not state.wait_idle(Deadline(10))
    assert helper.down_reason == "it made no progress for 0.1 s"


# -- a real run ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_every_thread_and_child_a_run_starts_belongs_to_a_helper_run_json_lists(tmp_path, tiny_model,
                                                                             tiny_checkpoint, monkeypatch):
    pytest.importorskip("gtsam")
    from stream_recon.app.options import RunOptions
    from stream_recon.app.run import pipeline, streaming
    from stream_recon.app.sources.readers import frames_source

    listed: list[dict[str, Helper]] = []
    helpers_of_run = streaming.Run.helpers

    def recorded(run):  # what the run asks its owners for, kept for the test
        found = helpers_of_run(run)
        listed.append(found)
        return found

    monkeypatch.setattr(streaming.Run, "helpers", recorded)
    frames = [(np.full((48, 64, 3), 10 * index, dtype=np.uint8), 0.1 * index) for index in range(12)]
    # every frame through the preprocessing pool (pool_from_pixels=0)
    source = frames_source(frames, name="cam", image_width=56, pool_from_pixels=0, preprocess_workers=2)
    options = RunOptions(image_width=56, scale_frames=3, window=4, chunk_frames=6, overlap=2, conf_threshold=1.0,
                         viewer=True, host="127.0.0.1", port=free_port(), loop_closure="on",
                         checkpoint=str(tiny_checkpoint))
    starts = Starts(monkeypatch)
    with Sampler() as sampled:
        summary = pipeline.run_sequence(source, tmp_path / "run", options, model=tiny_model)
    monkeypatch.undo()
    assert summary.status == "complete", summary.error
    helpers = listed[-1]
    in_run_json = json.loads((tmp_path / "run" / "run.json").read_text())["summary"]["helpers"]
    assert set(in_run_json) == set(helpers)
    assert {"reader", "preprocessing", "writer", "viewer", "progress", "loop_closure",
            "checkpoint_digest"} <= set(helpers)
    names = {id(helper): name for name, helper in helpers.items()}
    unowned = [thread.name for thread, helper in sampled.threads.items() if id(helper) not in names]
    assert not unowned, f"threads no listed helper owns: {unowned}"
    assert sampled.children and not [pid for pid, helper in sampled.children.items() if id(helper) not in names]
    # every thread and child the run started, each seen as it started (or, a library's, by the sampler later)
    started = [thread for thread in starts.threads if thread is not sampled._thread]
    assert {"reader:cam", "run-writer", "viewer"} <= {thread.name for thread in started}
    unowned = [thread.name for thread in started if id(starts.threads[thread]) not in names
               and id(sampled.threads.get(thread)) not in names]
    assert not unowned, f"threads started that no listed helper owns: {unowned}"
    assert starts.children and [id(helper_of_child(child.pid)) in names for child in starts.children] == \
        [True] * len(starts.children)
    owners = {names[id(helper)] for helper in [*sampled.threads.values(), *sampled.children.values()]}
    assert {"reader", "preprocessing", "writer", "viewer", "loop_closure"} <= owners, owners


# -- the source's reader and preprocessing pool as helpers ----------------------------------------------------
def raising_camera(count: int, fails_at: int):
    for index in range(count):
        if index == fails_at:
            raise RuntimeError("camera unplugged")
        yield np.full((48, 64, 3), 10 * index, dtype=np.uint8), 0.1 * index


def test_a_reader_that_raises_is_down_with_the_run_s_error_line_and_its_pool_is_listed():
    from stream_recon.app.sources.frames import SourceError
    from stream_recon.app.sources.readers import frames_source

    with frames_source(raising_camera(6, fails_at=4), name="cam", image_width=56, pool_from_pixels=0) as source:
        with pytest.raises(SourceError) as raised:
            for _ in source:
                pass
        helpers = source.helpers()
    assert set(helpers) == {"reader", "preprocessing"}
    assert helpers["reader"].record() == {"up": False, "reason": str(raised.value), "dropped": 0,
                                          "when_down": "fail the run"}
    assert str(raised.value) == "reading frame sequence cam failed: RuntimeError: camera unplugged"
    assert helpers["preprocessing"].is_up


@pytest.mark.parametrize("live", [True, False])
def test_the_reader_does_what_its_policy_says(live):
    """The reader's hand-off runs its helper's policy: a live source's reader is latest-wins (the run loop behind,
    its oldest frames are dropped and counted, the newest delivered), a file's pushes back (it waits for the run
    loop: every frame delivered in order, none dropped)."""
    from stream_recon.app.sources.readers import frames_source

    frames = [(np.full((48, 64, 3), index, dtype=np.uint8), 0.1 * index) for index in range(20)]
    with frames_source(frames, name="cam", live=live, queue_size=2) as source:
        source.start()
        source._thread.join(timeout=10 if live else 0.5)  # the run loop behind: the reader has read them all, or waits
        assert source._thread.is_alive() != live
        delivered = [frame.index for frame in source]
        helper = source.helpers()["reader"]
    if live:
        assert helper.policy.when_full is WhenFull.LATEST
        assert delivered == [18, 19] and helper.dropped == source.frames_dropped == 18
    else:
        assert helper.policy.when_full is WhenFull.PUSH_BACK
        assert delivered == list(range(20)) and helper.dropped == source.frames_dropped == 0


def test_a_source_made_without_the_pool_lists_its_reader_alone():
    from stream_recon.app.sources.readers import frames_source

    frames = [(np.zeros((48, 64, 3), dtype=np.uint8), 0.0)]
    with frames_source(frames, name="cam", image_width=56) as source:  # small frames: made on the reader
        assert len(list(source)) == 1
        assert list(source.helpers()) == ["reader"] and source.helpers()["reader"].is_up


def test_a_stream_opener_a_reconnecting_reader_starts_is_the_reader_s():
    from stream_recon.app.sources.opening import OPENER_POLICY, _call_with_deadline

    helper = Helper(POLICY)
    seen: list = []

    def open_capture() -> str:  # runs on the opener's thread
        seen.append(helper_of_thread(threading.current_thread()))
        return "a capture"

    reader = start_supervised_thread(helper, lambda: seen.append(_call_with_deadline(open_capture, 10.0, "x")),
                                     "test-reader")
    reader.join(timeout=10)
    assert seen == [helper, "a capture"]
    # before the run (the run loop's call): the opener's own helper
    opener = _call_with_deadline(lambda: helper_of_thread(threading.current_thread()), 10.0, "x")
    assert opener is not None and opener.policy is OPENER_POLICY


def test_a_latest_state_refuses_a_helper_whose_policy_is_not_latest_wins():
    with pytest.raises(ValueError, match="a LatestState is for a latest-wins helper, not push back"):
        latest_of_lists(Helper(HelperPolicy("a test's helper", WhenFull.PUSH_BACK, WhenDown.TURN_OFF, stall_s=1.0)))
