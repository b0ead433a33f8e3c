"""Every helper of a run under the supervision contract (models/supervision.py): one that raises, stalls or
is killed is noticed within its deadline, and either turns its feature off (one warning line, a record) or
fails the run with one error line; the caller never waits past its deadline.

The helpers are real (threads, pools, child processes, a viser server and a websocket client); a fault is
injected where the helper does its work: a call that raises, a wait on an Event that is never set (set at the
test's end, to let the thread go), SIGSTOP or SIGKILL for a process, or one that ignores SIGTERM. A thread
cannot be killed: one that raises stands for one that dies. Deadlines are shortened by patching the modules'
constants; no test sleeps to let something happen (waits are on events, or polls bounded by a deadline).
"""

from __future__ import annotations

import base64
import dataclasses
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import termios
import textwrap
import threading
import time
import types
from collections.abc import Iterator
from concurrent.futures import CancelledError

import msgspec
import numpy as np
import pytest
import torch
from helpers import warnings_of
from media_helpers import free_port

from stream_recon.models import ChunkedEngine, ModelConfig, StreamConfig, StreamingEngine
from stream_recon.models.daemon_pool import DaemonPool
from stream_recon.models.stream.prediction import FRAME_KEY, FramePrediction
from stream_recon.models.supervision import Deadline, Helper, HelperPolicy, WhenDown, WhenFull

HEIGHT, WIDTH = 28, 42  # the tiny model's frames: 2 x 3 patches


class Fault:
    """What a helper's work does once `active`: raise `error`, or stall (`stalled` is set, then it waits on
    `release`, set at the test's end)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error
        self.active = threading.Event()
        self.stalled = threading.Event()
        self.release = threading.Event()

    def strike(self) -> None:
        if not self.active.is_set():
            return
        if self.error is not None:
            raise self.error
        self.stalled.set()
        self.release.wait()


@pytest.fixture
def faults() -> Iterator[list[Fault]]:
    """Faults made by a test, every stalled thread let go at its end."""
    made: list[Fault] = []
    yield made
    for fault in made:
        fault.release.set()


def fault(faults: list[Fault], error: BaseException | None = None) -> Fault:
    made = Fault(error)
    faults.append(made)
    return made


# -- the daemon pool: no helper's thread holds a wait, nor the process's exit ---------------------------
def test_a_daemon_pool_cancels_what_has_not_started_and_its_join_ends_at_the_deadline(faults):
    stuck = fault(faults)
    stuck.active.set()
    pool = DaemonPool(1, "test-pool", Helper(HelperPolicy("a test's pool", WhenFull.DROP, WhenDown.TURN_OFF, 5.0)))
    running, queued = pool.submit(stuck.strike), pool.submit(lambda: "never")
    assert stuck.stalled.wait(timeout=10)
    pool.shutdown()
    with pytest.raises(CancelledError):
        queued.result(timeout=0)
    started = time.monotonic()
    assert pool.join(Deadline(0.2)) is False
    assert 0.2 <= time.monotonic() - started < 2.0 and not running.done()
    stuck.release.set()
    assert pool.join(Deadline(10.0)) and running.result(timeout=0) is None
    with pytest.raises(RuntimeError, match="no job after shutdown"):
        pool.submit(print)


def test_a_worker_stalled_in_a_daemon_pool_holds_no_process_exit():
    """A ThreadPoolExecutor's worker stalled the same way holds the interpreter's exit forever."""
    script = textwrap.dedent("""
        import threading
        from stream_recon.models.daemon_pool import DaemonPool
        from stream_recon.models.supervision import Helper, HelperPolicy, WhenDown, WhenFull
        pool = DaemonPool(2, "stalled", Helper(HelperPolicy("a test's pool", WhenFull.DROP, WhenDown.TURN_OFF, 5.0)))
        pool.submit(threading.Event().wait)
        pool.shutdown()
        print("exiting", flush=True)
    """)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=15)
    assert done.returncode == 0 and done.stdout == "exiting\n", done.stderr
    assert time.monotonic() - started < 15


# -- the spare engine (models/stream/lookahead.py) and the chunked stream's rollover in place ----------
class StandInEngine:
    """What SpareEngine drives, on the CPU: each push runs `fault.strike()` first."""

    device = torch.device("cpu")

    def __init__(self, fault_: Fault) -> None:
        self.fault, self.finished, self.pushed = fault_, 0, []

    def push_checked(self, image, timestamp):
        self.fault.strike()
        self.pushed.append(timestamp)
        return [timestamp]

    def finish(self):
        self.finished += 1
        return []

    def reset(self):
        pass


def test_a_spare_that_stalls_ends_take_next_collect_and_discard_at_their_deadline(faults, caplog):
    from stream_recon.models.stream.lookahead import SpareEngine, SpareStalled

    stuck = fault(faults)
    spare = SpareEngine(StandInEngine(stuck))
    spare.push(None, 0.0)
    assert spare.take_next(Deadline(5.0)) == [0.0]  # a step that answers
    stuck.active.set()
    spare.push(None, 1.0)
    spare.push(None, 2.0)
    assert stuck.stalled.wait(timeout=10)
    started = time.monotonic()
    with pytest.raises(SpareStalled, match="made no progress for 0.2 s"):
        spare.take_next(Deadline(0.2))
    assert 0.2 <= time.monotonic() - started < 2.0
    assert not spare.helper.is_up and spare.helper.down_reason == "it made no progress for 0.2 s"
    for wait in (spare.collect, spare.discard):
        started = time.monotonic()
        spare.push(None, 3.0)
        with pytest.raises(SpareStalled):
            wait(Deadline(0.1))
        assert time.monotonic() - started < 2.0
    assert spare.engine.finished == 0  # a stalled spare's engine is not touched: its worker is in it
    started = time.monotonic()
    spare.close()  # down: no wait for the stalled worker
    assert time.monotonic() - started < 0.5
    assert warnings_of(caplog) == ["the next chunk's lookahead is off for the rest of the run: it made no progress "
                                   "for 0.2 s"]


def test_closing_a_spare_waits_for_the_step_under_way_at_most_spare_wait_s(faults, monkeypatch):
    from stream_recon.models.stream import lookahead

    stuck = fault(faults)
    stuck.active.set()
    spare = lookahead.SpareEngine(StandInEngine(stuck), lookahead.SpareLimits(wait_s=0.3))
    spare.push(None, 0.0)
    queued = spare._jobs[-1]
    spare.push(None, 1.0)
    assert stuck.stalled.wait(timeout=10)
    started = time.monotonic()
    spare.close()
    assert 0.3 <= time.monotonic() - started < 2.0
    assert spare._jobs[-1].cancelled() and not queued.done()  # the queued frame never runs


def test_a_spare_that_takes_no_frame_pushes_back_its_wait_at_most_then_is_off(faults, caplog):
    """Its frames go through a bounded hand-off that pushes back: a push with no room waits `wait_s` at most,
    then the spare is off (one warning line, the frame counted dropped) and the frame's job fails where the
    stream waits for it."""
    from stream_recon.models.stream.lookahead import SpareEngine, SpareLimits, SpareStalled

    stuck = fault(faults)
    stuck.active.set()
    spare = SpareEngine(StandInEngine(stuck), SpareLimits(wait_s=1.0), capacity=1)
    spare.push(None, 0.0)  # taken: its step stalls
    assert stuck.stalled.wait(timeout=10)
    spare.push(None, 1.0)  # waits in the hand-off's one place
    started = time.monotonic()
    spare.push(None, 2.0)  # no room
    assert 1.0 <= time.monotonic() - started < 3.0
    assert spare.helper.down_reason == "it took nothing for 1 s" and spare.helper.dropped == 1
    with pytest.raises(SpareStalled):
        spare.collect(Deadline(0.1))
    started = time.monotonic()
    spare.close()  # down: no wait for the stalled worker
    assert time.monotonic() - started < 0.5
    assert warnings_of(caplog) == ["the next chunk's lookahead is off for the rest of the run: it took nothing for 1 s"]


def test_a_spare_step_that_raises_surfaces_in_collect_and_take_next_passes_it_by(faults):
    from stream_recon.models.stream.lookahead import SpareEngine

    broken = fault(faults, RuntimeError("the spare's step broke"))
    broken.active.set()
    spare = SpareEngine(StandInEngine(broken))
    spare.push(None, 0.0)
    started = time.monotonic()
    assert spare.take_next(Deadline(5.0)) is None
    with pytest.raises(RuntimeError, match="the spare's step broke"):
        spare.collect(Deadline(5.0))
    assert time.monotonic() - started < 2.0 and spare.helper.is_up  # (its owner decides: ChunkedEngine)
    spare.close()


@pytest.fixture(scope="module")
def tiny_frames() -> torch.Tensor:
    return torch.rand(24, 3, HEIGHT, WIDTH, generator=torch.Generator().manual_seed(1))


def fault_the_spare_steps(monkeypatch, fault_: Fault) -> None:
    """The spare's steps (its worker's StreamingEngine.push_checked) strike `fault_` first."""
    push = StreamingEngine.push_checked

    def spare_push(engine, *args, **kwargs):
        if threading.current_thread().name.startswith("stream-recon-next-chunk"):
            fault_.strike()
        return push(engine, *args, **kwargs)

    monkeypatch.setattr(StreamingEngine, "push_checked", spare_push)


SPARE_CASE = dict(config=StreamConfig(scale_frames=3, window=4), chunk_frames=10, overlap=3)


def stream(engine: ChunkedEngine, frames: torch.Tensor, on_push=None) -> tuple[dict, list[float]]:
    """The last emission of every frame, and each push's seconds (the end's last)."""
    final, seconds = {}, []
    for index, frame in enumerate(frames):
        if on_push is not None:
            on_push(index)
        started = time.monotonic()
        final.update({p.frame_index: p for p in engine.push(frame)})
        seconds.append(time.monotonic() - started)
    started = time.monotonic()
    final.update({p.frame_index: p for p in engine.finish()})
    seconds.append(time.monotonic() - started)
    return final, seconds


def assert_same_final_emissions(final: dict, reference: dict) -> None:
    assert final.keys() == reference.keys()
    for index, prediction in final.items():
        assert prediction.chunk_index == reference[index].chunk_index
        np.testing.assert_array_equal(prediction.depth, reference[index].depth)
        np.testing.assert_array_equal(prediction.pose_enc, reference[index].pose_enc)


@pytest.mark.parametrize("kind", ["stalls", "raises"])
@pytest.mark.slow
def test_a_spare_that_fails_at_a_rollover_is_turned_off_and_the_chunk_rolls_over_in_place(
        prepared_tiny_model, tiny_frames, monkeypatch, faults, caplog, kind):
    """Chunk 0 closes at frame 10; the spare, which took frames 7-9 ahead, stalls or raises from frame 7 on:
    the closed chunk predicts frames provisionally, then the switch waits SPARE_WAIT_S at most and the next
    chunk is made in place; the stream ends with what rollovers in place emit, and the engine's stats (run.json's
    summary.engine) say why the spare went."""
    from stream_recon.models.stream import lookahead

    frames = tiny_frames[:20]
    reference, _ = stream(ChunkedEngine(prepared_tiny_model, lookahead=False, **SPARE_CASE), frames)
    spare_fault = fault(faults, RuntimeError("the spare's step broke") if kind == "raises" else None)
    fault_the_spare_steps(monkeypatch, spare_fault)
    engine = ChunkedEngine(prepared_tiny_model, lookahead=True, spare_limits=lookahead.SpareLimits(wait_s=0.5),
                           **SPARE_CASE)

    def strike_from_frame_7(index: int) -> None:
        if index == 7:
            engine._rollover.spare.wait_until(time.perf_counter() + 30)  # warmed, idle
            spare_fault.active.set()

    final, seconds = stream(engine, frames, strike_from_frame_7)
    stats = engine.stats()
    started = time.monotonic()
    engine.close()
    assert time.monotonic() - started < 1.0
    assert_same_final_emissions(final, reference)
    assert stats["lookahead"] is False and stats["rollovers"] >= 2 and stats["rollovers_ahead"] == 0
    reason = "it made no progress for 0.5 s" if kind == "stalls" else "RuntimeError: the spare's step broke"
    assert stats["spare_off"] == reason
    # run.json's helpers keep the spare that went (the engine dropped the spare itself)
    assert engine.helpers()["spare_engine"].record() == {"up": False, "reason": reason, "dropped": 0,
                                                         "when_down": "turn off"}
    assert warnings_of(caplog) == [f"the next chunk's lookahead is off for the rest of the run: {reason}"]
    assert max(seconds) < 0.5 + 5.0  # the switch's wait, and the in-place replay of the shared frames
    if kind == "stalls":
        assert spare_fault.stalled.is_set()


def test_a_spare_whose_warm_up_stalls_is_turned_off_before_the_stream(prepared_tiny_model, tiny_frames, monkeypatch,
                                                                         faults, caplog):
    from stream_recon.models.stream import lookahead

    stuck = fault(faults)
    stuck.active.set()
    monkeypatch.setattr(lookahead.SpareEngine, "_warm", lambda spare, image: stuck.strike())
    frames = tiny_frames[:14]
    reference, _ = stream(ChunkedEngine(prepared_tiny_model, lookahead=False, **SPARE_CASE), frames)
    engine = ChunkedEngine(prepared_tiny_model, lookahead=True, spare_limits=lookahead.SpareLimits(warm_up_s=0.3),
                           **SPARE_CASE)
    seconds = engine.warm_up(frames[0])
    assert 0.3 <= seconds["spare_s"] < 3.0 and engine._rollover is None and engine.lookahead is False
    assert engine.stats()["spare_off"] == "it made no progress for 0.3 s"
    assert engine.helpers()["spare_engine"].down_reason == "it made no progress for 0.3 s"
    final, _ = stream(engine, frames)
    engine.close()
    assert_same_final_emissions(final, reference)
    assert warnings_of(caplog) == ["the next chunk's lookahead is off for the rest of the run: it made no progress "
                                   "for 0.3 s"]


# -- the warm-up's kernel builds (models/builds/kernel_builds.py, models/builds/ahead.py,
# cache/triton_attention.py) --
@pytest.fixture
def builds_helper(monkeypatch):
    """A fresh process-wide helper of the builds ahead, for this test."""
    from stream_recon.models.builds import kernel_builds

    helper = Helper(kernel_builds.BUILDS_AHEAD)
    monkeypatch.setattr(kernel_builds.PROCESS, "ahead", helper)
    return helper


class StandInKernel:
    """Stands where Triton's JITFunction stands for `kernel_builds._build`: `preload` strikes `fault_`."""

    def __init__(self, name: str, fault_: Fault | None = None) -> None:
        self.fn = types.SimpleNamespace(__name__=name)
        self.fault = fault_

    def preload(self, specialization: str):
        if self.fault is not None:
            self.fault.strike()
        return types.SimpleNamespace(_init_handles=lambda: None)


def launch(kernel: StandInKernel, key: str):
    """What Triton does on a launch of a specialization not built (tests/test_models_kernel_builds.py)."""
    from triton.runtime.jit import JitFunctionInfo

    from stream_recon.models.builds import kernel_builds

    return kernel_builds._hook(key=key, repr=key, fn=JitFunctionInfo("tests", kernel.fn.__name__, kernel),
                               compile={"key": key, "specialization_data": key}, is_manual_warmup=False,
                               already_compiled=False)


def test_a_kernel_build_that_stalls_ends_the_dry_step_at_its_deadline_and_turns_builds_ahead_off(
        builds_helper, prepared_tiny_model, monkeypatch, faults, caplog):
    from stream_recon.models.builds import kernel_builds

    if not kernel_builds.available():
        pytest.skip("this Triton cannot list builds")
    monkeypatch.setattr(kernel_builds, "BUILDS_WAIT_S", 0.3)
    stuck = fault(faults)
    stuck.active.set()
    started = time.monotonic()
    with kernel_builds.dry_launches(torch.device("cpu")) as report:
        launch(StandInKernel("stuck_kernel", stuck), "a")
        launch(StandInKernel("quick_kernel"), "b")
    assert 0.3 <= time.monotonic() - started < 3.0 and 0.3 <= report.wait_s < 3.0 and report.builds == 2
    assert builds_helper.down_reason == "1 of 2 builds (stuck_kernel) did not finish within 0.3 s"
    assert not kernel_builds.dry_pass_pays("cuda", compiled=False)
    assert warnings_of(caplog) == ["building kernels ahead is off for the rest of the run: 1 of 2 builds "
                                   "(stuck_kernel) did not finish within 0.3 s"]


def test_a_dry_pass_beside_the_load_that_stalls_is_given_up_at_its_deadline(builds_helper, monkeypatch, faults,
                                                                             caplog):
    """The run's first frame waits AHEAD_WAIT_S at most (every later wait returns at once); the warm-up then
    makes no dry pass of its own: the builds ahead are off."""
    from stream_recon.models.builds import ahead as builds_ahead
    from stream_recon.models.builds import kernel_builds

    monkeypatch.setattr(builds_ahead, "AHEAD_WAIT_S", 0.3)
    stuck = fault(faults)
    stuck.active.set()
    monkeypatch.setattr(builds_ahead, "prepare_without_weights", lambda *args: stuck.strike())
    ahead = builds_ahead.BuildsAhead(ModelConfig.tiny(), StreamConfig(scale_frames=3, window=4), (28, 42), "cpu",
                                     torch.float32)
    assert stuck.stalled.wait(timeout=10)
    started = time.monotonic()
    assert ahead.wait() is None
    assert 0.3 <= time.monotonic() - started < 2.0
    started = time.monotonic()
    assert ahead.wait() is None and not ahead.covers((28, 42)) and time.monotonic() - started < 0.1
    assert builds_helper.down_reason == "the dry pass beside the checkpoint's load did not finish within 0.3 s"
    assert not kernel_builds.dry_pass_pays("cuda", compiled=False)
    assert warnings_of(caplog) == ["building kernels ahead is off for the rest of the run: the dry pass beside the "
                                   "checkpoint's load did not finish within 0.3 s"]
    stuck.release.set()  # (what the thread says once let go is this test's)
    ahead._thread.join(timeout=10)


def test_an_early_build_that_raises_turns_builds_ahead_off(builds_helper, monkeypatch, caplog):
    """start_early_builds' thread (CUDA only: its device calls stood in for on the CPU)."""
    from stream_recon.cache import triton_attention
    from stream_recon.models.builds import kernel_builds

    def no_build(*args, **kwargs):
        raise RuntimeError("ptxas died")

    monkeypatch.setattr(kernel_builds, "available", lambda: True)
    monkeypatch.setattr(kernel_builds, "device_with_index", lambda device: device)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(triton_attention, "measure_resident_programs", no_build)
    early = []
    start = kernel_builds.start_supervised_thread

    def started_thread(*args):
        early.append(start(*args))
        return early[-1]

    monkeypatch.setattr(kernel_builds, "start_supervised_thread", started_thread)
    kernel_builds.start_early_builds("cuda", torch.bfloat16, 2, 8)
    early[0].join(timeout=10)
    assert early[0].name == "kernel-build-early" and not early[0].is_alive()
    assert builds_helper.down_reason == "RuntimeError: ptxas died"
    assert warnings_of(caplog) == ["building kernels ahead is off for the rest of the run: RuntimeError: ptxas died"]


def test_a_step_waits_for_another_threads_stalled_build_of_its_kernel_at_most_its_limit(monkeypatch, faults, caplog):
    """resident_programs: the first asker builds; a second waits RESIDENT_PROGRAMS_WAIT_S at most for it, then
    builds its own (plain threading in the cache room, which knows nothing of the models' helpers)."""
    from stream_recon.cache import triton_attention

    monkeypatch.setattr(triton_attention, "RESIDENT_PROGRAMS_WAIT_S", 0.3)
    monkeypatch.setattr(triton_attention, "_resident_programs", {})
    monkeypatch.setattr(triton_attention, "_resident_programs_locks", {})
    stuck = fault(faults)
    stuck.active.set()
    builders = []

    def measure(q, keys, values, num_stages, tma):
        builders.append(threading.current_thread().name)
        if threading.current_thread().name == "early":
            stuck.strike()
        return 132 * num_stages

    monkeypatch.setattr(triton_attention, "_measure_resident_programs", measure)
    q = torch.empty(4, 2, 8)
    threading.Thread(target=triton_attention.resident_programs, args=(q, q, q, 3, True), name="early",
                     daemon=True).start()
    assert stuck.stalled.wait(timeout=10)
    started = time.monotonic()
    assert triton_attention.resident_programs(q, q, q, 3, True) == 396
    assert 0.3 <= time.monotonic() - started < 2.0 and builders == ["early", threading.current_thread().name]
    assert len(warnings_of(caplog)) == 1 and "did not finish within 0.3 s" in warnings_of(caplog)[0]


def plain_thread(target, name: str) -> threading.Thread:
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


def test_measuring_both_uses_waits_for_the_frame_attentions_stalled_build_at_most_its_limit(monkeypatch, faults):
    from stream_recon.cache import triton_attention

    monkeypatch.setattr(triton_attention, "RESIDENT_PROGRAMS_WAIT_S", 0.3)
    stuck = fault(faults)
    stuck.active.set()
    monkeypatch.setattr(triton_attention, "key_stages", lambda q, keys, values: 3)
    monkeypatch.setattr(triton_attention, "_frame_resident_programs", lambda q, keys, failed: stuck.strike())
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="frame attention's build did not finish within 0.3 s"):
        triton_attention.measure_resident_programs(torch.device("cpu"), torch.float32, 2, 8, start_thread=plain_thread)
    assert 0.3 <= time.monotonic() - started < 2.0 and stuck.stalled.is_set()


def test_the_early_builds_second_thread_is_the_builds_helpers(builds_helper, monkeypatch):
    """measure_resident_programs builds the frame attention's kernel on a thread of its own; started by the
    early builds, it is started their way (kernel_builds.build_thread) and so is the builds' helper's."""
    from stream_recon.cache import triton_attention
    from stream_recon.models.builds import kernel_builds
    from stream_recon.models.supervision import helper_of_thread

    started = []

    def starter(target, name):
        started.append(thread := kernel_builds.build_thread(target, name))
        return thread

    monkeypatch.setattr(triton_attention, "key_stages", lambda q, keys, values: 3)
    monkeypatch.setattr(triton_attention, "_frame_resident_programs", lambda q, keys, failed: None)
    triton_attention.measure_resident_programs(torch.device("cpu"), torch.float32, 2, 8, start_thread=starter)
    assert len(started) == 1 and helper_of_thread(started[0]) is builds_helper
    assert started[0].name == threading.current_thread().name


# -- the background compile's child process (models/builds/compile_child.py) -----------------------------------
SIZE = (56, 70)


@pytest.fixture
def compiled_sizes(prepared_tiny_model, tmp_path, monkeypatch):
    """A CompiledSizes whose child (a real process) is started and not yet far: each test's own records."""
    from stream_recon.app.options import RunOptions
    from stream_recon.app.run.loading import chunk_engine_config
    from stream_recon.models.builds.compile_child import CompiledSizes

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    options = RunOptions(scale_frames=2, window=4, chunk_frames=16, overlap=4, viewer=False, image_width=SIZE[1])
    sizes = CompiledSizes(None, prepared_tiny_model, "cpu", torch.float32,
                          chunk_engine_config(options, prepared_tiny_model.config), beside=True)
    yield sizes
    if sizes.process is not None and sizes.process.poll() is None:
        os.killpg(sizes.process.pid, signal.SIGKILL)
        sizes.process.wait(10)


# A child that ignores SIGTERM and never ends: the compile child has no SIGTERM handler of its own (a stopped
# one, SIGSTOP, may still end on it: Linux can end a stopped process on a signal whose default action is to
# end it), so a child that takes SIGTERM and hangs stands in for one whose libraries took it over.
CHILD_THAT_IGNORES_SIGTERM = ("import signal, threading; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                              "print('ready', flush=True); threading.Event().wait()")


def test_a_stopped_child_that_ignores_its_stop_is_killed_within_the_runs_bound(compiled_sizes, monkeypatch):
    from stream_recon.models.builds import compile_child as background_compile

    monkeypatch.setattr(background_compile, "STOP_WAIT_S", 0.3)
    popen = subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", lambda args, **kwargs: popen(
        [sys.executable, "-c", CHILD_THAT_IGNORES_SIGTERM], **kwargs))
    compiled_sizes.warmed_up(SIZE)
    ready = Deadline(15.0)
    while "ready" not in compiled_sizes.log.read_text() and not ready.expired:
        threading.Event().wait(0.05)  # (the child says when its handler is in place)
    assert "ready" in compiled_sizes.log.read_text()
    started = time.monotonic()
    assert compiled_sizes.finish(stop=True) is None
    assert 0.3 <= time.monotonic() - started < 0.3 + background_compile.KILL_WAIT_S + 1.0
    assert compiled_sizes.process.returncode == -signal.SIGKILL
    assert compiled_sizes.summary()["status"] == "stopped with the run"
    assert compiled_sizes.helper.record()["reason"] == "stopped with the run"  # (run.json's helpers.compile_child)


def test_a_stopped_child_does_not_hold_the_runs_end(compiled_sizes, monkeypatch):
    from stream_recon.models.builds import compile_child as background_compile

    monkeypatch.setattr(background_compile, "STOP_WAIT_S", 0.3)
    compiled_sizes.warmed_up(SIZE)
    os.kill(compiled_sizes.process.pid, signal.SIGSTOP)
    started = time.monotonic()  # (ended by SIGTERM at once, or by SIGKILL after STOP_WAIT_S)
    assert compiled_sizes.finish(stop=True) is None
    assert time.monotonic() - started < 0.3 + background_compile.KILL_WAIT_S + 1.0
    assert compiled_sizes.process.returncode is not None
    assert compiled_sizes.summary()["status"] == "stopped with the run"


def test_a_child_killed_mid_run_is_recorded_and_the_next_run_compiles_first(compiled_sizes):
    from stream_recon.models.builds.compilation import recorded
    from stream_recon.models.builds.plan import compile_choice

    compiled_sizes.warmed_up(SIZE)
    os.kill(compiled_sizes.process.pid, signal.SIGKILL)
    compiled_sizes.process.wait(10)
    summary = compiled_sizes.summary()  # (run.json's compile_beside)
    assert summary["status"].startswith("failed (exit -9; its log: ") and summary["key"] == compiled_sizes.key
    assert recorded(compiled_sizes.key, "compile-first") and compile_choice("auto", "cuda", compiled_sizes.key).compile
    assert "the next run of this size compiles first" in compiled_sizes.finish(stop=False)
    assert compiled_sizes.helper.down_reason == summary["status"]


def test_a_child_that_stalls_past_its_limit_is_killed_and_recorded(compiled_sizes, monkeypatch):
    from stream_recon.models.builds import compile_child as background_compile
    from stream_recon.models.builds.compilation import recorded

    compiled_sizes.warmed_up(SIZE)
    os.kill(compiled_sizes.process.pid, signal.SIGSTOP)
    monkeypatch.setattr(background_compile, "CHILD_LIMIT_S", 0)  # it has run longer than that already
    started = time.monotonic()
    summary = compiled_sizes.summary()
    assert time.monotonic() - started < background_compile.KILL_WAIT_S + 1.0
    assert summary["status"].startswith("stalled (still compiling after 0 s: killed")
    assert compiled_sizes.process.returncode == -signal.SIGKILL
    assert recorded(compiled_sizes.key, "compile-first")
    note = compiled_sizes.finish(stop=False)  # the run's end: nothing left to wait for
    assert note.startswith("the background compile for the next run stalled")
    assert compiled_sizes.helper.down_reason == summary["status"]


# -- the live viewer (app/viewer/)---------------------------------------------------------------------------
def keyframe(index: int, size: tuple[int, int] = (42, 56)) -> FramePrediction:
    h, w = size
    c2w = np.eye(4, dtype=np.float32)[:3]
    c2w[0, 3] = 0.1 * index
    rng = np.random.default_rng(index)
    return FramePrediction(frame_index=index, timestamp=index / 30, frame_type=FRAME_KEY,
                           pose_enc=np.zeros(9, np.float32), c2w=c2w,
                           intrinsics=np.array([[w, 0, w / 2], [0, w, h / 2], [0, 0, 1]], np.float32),
                           depth=(1 + rng.random((h, w))).astype(np.float32),
                           depth_conf=(1 + rng.random((h, w))).astype(np.float32),
                           image=rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


def test_a_viewer_whose_thread_raises_is_off_and_lets_the_run_go_on(faults, monkeypatch, caplog):
    from stream_recon.app.viewer import LiveViewer

    live = LiveViewer(port=free_port(), update_hz=50.0)
    try:
        def refused(pred, **options):
            raise RuntimeError("a scene node refused")

        monkeypatch.setattr(live.scene.keyframes, "apply_prediction", refused)
        live.set_paused(True)  # (a browser paused the run)
        live.on_frame(keyframe(0), {})
        live.state._thread.join(timeout=10)
        assert not live.state._thread.is_alive() and not live.is_up
        assert live.helper.record() == {"up": False, "reason": "RuntimeError: a scene node refused", "dropped": 0,
                                 "when_down": "turn off"}
        started = time.monotonic()
        for index in range(1, 200):
            live.on_frame(keyframe(index), {})
        assert live.wait_if_paused(timeout=None)  # a viewer that is off holds no run paused
        assert time.monotonic() - started < 1.0 and live.num_pending <= 1
    finally:
        started = time.monotonic()
        live.close("complete")
        assert time.monotonic() - started < 3.0
    assert warnings_of(caplog) == ["the live viewer is off for the rest of the run: RuntimeError: a scene node refused"]


def test_a_viewer_update_that_stalls_turns_the_viewer_off_and_its_close_does_not_wait(faults, monkeypatch, caplog):
    from stream_recon.app import viewer

    stuck = fault(faults)
    stuck.active.set()
    live = viewer.LiveViewer(port=free_port(), update_hz=50.0,
                             policy=dataclasses.replace(viewer.VIEWER_POLICY, stall_s=0.3))
    try:
        monkeypatch.setattr(live.scene.keyframes, "apply_prediction", lambda pred, **options: stuck.strike())
        live.on_frame(keyframe(0), {})
        assert stuck.stalled.wait(timeout=10)
        deadline = Deadline(10.0)
        while live.is_up and not deadline.expired:  # (each frame's check is the stall's watch)
            live.on_frame(keyframe(1), {})
            stuck.release.wait(0.05)
        assert live.helper.down_reason == "it made no progress for 0.3 s"
    finally:
        started = time.monotonic()
        live.close("complete")
        assert time.monotonic() - started < 3.0  # (viser's own stop joins its thread for 1 s at most)
    assert warnings_of(caplog) == ["the live viewer is off for the rest of the run: it made no progress for 0.3 s"]


def test_closing_a_viewer_whose_last_update_hangs_waits_viewer_close_s_at_most(faults, monkeypatch, caplog):
    from stream_recon.app import viewer

    stuck = fault(faults)
    live = viewer.LiveViewer(port=free_port(), update_hz=50.0, close_s=0.3)
    monkeypatch.setattr(live.scene.keyframes, "apply_prediction", lambda pred, **options: stuck.strike())
    live.on_frame(keyframe(0), {})
    assert live.flush(timeout=10)
    stuck.active.set()
    live.on_frame(keyframe(1), {})
    assert stuck.stalled.wait(timeout=10)
    started = time.monotonic()
    live.close("complete")
    assert 0.3 <= time.monotonic() - started < 3.0
    assert live.helper.down_reason == "its last update did not finish within 0.3 s"
    assert len(warnings_of(caplog)) == 1


def stalled_websocket_client(port: int) -> socket.socket:
    """A browser that connects to viser, says where its camera is (viser counts it as a client from then on)
    and never reads again: a raw socket with a small receive buffer, so the server's sends back up soon."""
    import viser

    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect(("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16)).decode()
    client.sendall((f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                    f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                    f"Sec-WebSocket-Protocol: viser-v{viser.__version__}\r\n\r\n").encode())
    response = b""
    while b"\r\n\r\n" not in response:
        response += client.recv(1)  # (byte by byte: nothing after the handshake is read)
    assert response.startswith(b"HTTP/1.1 101"), response
    camera = msgspec.msgpack.encode({
        "type": "ViewerCameraMessage", "wxyz": [1.0, 0.0, 0.0, 0.0], "position": [0.0, 0.0, -3.0], "fov": 1.2,
        "near": 0.01, "far": 100.0, "image_height": 480, "image_width": 640, "look_at": [0.0, 0.0, 0.0],
        "up_direction": [0.0, -1.0, 0.0]})
    mask = os.urandom(4)  # a binary frame, masked as a client's must be; its length in the 16-bit form
    assert 126 <= len(camera) < 1 << 16
    header = bytes([0x82, 0x80 | 126]) + len(camera).to_bytes(2, "big") + mask
    client.sendall(header + bytes(b ^ mask[i % 4] for i, b in enumerate(camera)))
    return client


@pytest.mark.slow
def test_a_browser_that_stops_reading_stalls_neither_the_viewer_nor_the_run():
    """viser queues every message in a buffer of its own and sends it from its event loop, a task per client:
    a client that stops reading holds that task's send, never the viewer thread's scene calls (which only
    queue) nor `on_frame`. Checked with a real server and a real websocket client: the server's send to it
    backs up, and the viewer still draws every keyframe. viser's own stop then waits 6 s for that client's
    close handshake: the viewer's close waits VIEWER_STOP_S of it at most."""
    from stream_recon.app.viewer import VIEWER_STOP_S, LiveViewer

    def hand_over_60(viewer) -> float:  # ~11 MB of points: far more than the socket buffers hold
        started = time.monotonic()
        for index in range(60):
            viewer.on_frame(keyframe(index, size=(378, 518)), {"frames": index + 1})
        return time.monotonic() - started

    # The same hand-overs to a viewer no browser reads, on this machine as loaded as it is now: a hand-over
    # that waited for the stalled client would never end, one that does not takes about as long.
    alone = LiveViewer(port=free_port(), update_hz=20.0, max_points_per_keyframe=20_000)
    try:
        baseline = hand_over_60(alone)
        assert alone.flush(timeout=60)
    finally:
        alone.close("complete")
    live = LiveViewer(port=free_port(), update_hz=20.0, max_points_per_keyframe=20_000)
    client = stalled_websocket_client(live.port)
    try:
        deadline = Deadline(10.0)
        while not live.server.get_clients() and not deadline.expired:
            client.recv(0)  # (reads nothing)
            threading.Event().wait(0.01)
        assert live.server.get_clients(), "viser never counted the client"
        assert hand_over_60(live) < max(2.0, 3 * baseline)
        assert live.flush(timeout=60), "the viewer thread did not draw what the run handed it"
        assert live.scene_summary()["keyframes"] == 60 and live.is_up
        connection = next(iter(live.server._websock_server._live_connections.values()))
        backed_up = Deadline(10.0)
        while connection.transport.get_write_buffer_size() == 0 and not backed_up.expired:
            threading.Event().wait(0.05)
        assert connection.transport.get_write_buffer_size() > 0  # the server waits on this client
        unread = fcntl.ioctl(client, termios.FIONREAD, b"\0\0\0\0")
        assert int.from_bytes(unread, sys.byteorder) > 0  # what it sent, never read
    finally:
        started = time.monotonic()
        live.close("complete")
        assert time.monotonic() - started < VIEWER_STOP_S + 1.0
        client.close()


@pytest.mark.slow
def test_a_run_whose_viewer_fails_writes_every_file_and_completes(tmp_path, tiny_model, monkeypatch, caplog):
    from stream_recon.app.options import RunOptions
    from stream_recon.app.run.pipeline import run_sequence
    from stream_recon.app.viewer import LiveViewer

    def broken_update(viewer, pending, arrival_fps):
        raise RuntimeError("a scene node refused")

    monkeypatch.setattr(LiveViewer, "_draw", broken_update)
    options = RunOptions(image_width=56, scale_frames=3, window=4, conf_threshold=1.0, viewer=True,
                         host="127.0.0.1", port=free_port())
    summary = run_sequence(camera(8), tmp_path / "run", options, model=tiny_model)
    assert summary.status == "complete" and summary.frames == 8
    assert len(list((tmp_path / "run" / "predictions").glob("*.npz"))) == 8
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "complete"
    assert [line for line in warnings_of(caplog) if "viewer" in line] == [
        "the live viewer is off for the rest of the run: RuntimeError: a scene node refused"]


# -- the source's reader thread and its preprocessing pool (app/sources/reader.py) ----------------------------------
def camera(count: int, fault_at: int | None = None, fault_: Fault | None = None):
    """A generator source of `count` frames (rgb, timestamp) that strikes `fault_` before frame `fault_at`."""
    for index in range(count):
        if index == fault_at:
            fault_.active.set()
            fault_.strike()
        yield np.full((48, 64, 3), 10 * index, dtype=np.uint8), 0.1 * index


def test_a_reader_that_raises_ends_the_iteration_with_one_source_error_after_its_frames(faults):
    from stream_recon.app.sources.frames import SourceError
    from stream_recon.app.sources.readers import frames_source

    broken = fault(faults, RuntimeError("camera unplugged"))
    frames = []
    with frames_source(camera(6, fault_at=4, fault_=broken), name="cam") as source:
        with pytest.raises(SourceError) as raised:
            for frame in source:
                frames.append(frame)
    assert str(raised.value) == "reading frame sequence cam failed: RuntimeError: camera unplugged"
    assert len(frames) == 4 and isinstance(raised.value.__cause__, RuntimeError)


@pytest.mark.slow
def test_a_reader_that_stalls_ends_the_iteration_at_the_frame_timeout(faults):
    from stream_recon.app.sources import reader
    from stream_recon.app.sources.frames import SourceError
    from stream_recon.app.sources.readers import frames_source

    stuck = fault(faults)
    frames = []
    started = None
    with frames_source(camera(6, fault_at=3, fault_=stuck), name="cam", frame_timeout_s=0.3) as source:
        with pytest.raises(SourceError, match="no frame from frame sequence cam for 0.3 s: the source stalled"):
            for frame in source:
                frames.append(frame)
                if len(frames) == 3:
                    assert stuck.stalled.wait(timeout=10)
                    started = time.monotonic()
    # the stall seen when it comes (the wait ends then); the stalled reader then gets its close's bounded join
    assert len(frames) == 3 and time.monotonic() - started < 0.3 + reader._JOIN_TIMEOUT_S + 1.0


@pytest.mark.parametrize("where", ["pool", "reader"])  # a frame over pool_from_pixels, and one made by the reader
@pytest.mark.parametrize("kind", ["raises", "stalls"])
@pytest.mark.slow
def test_a_preprocessing_worker_that_fails_ends_the_iteration_with_one_source_error(faults, monkeypatch, kind,
                                                                                   where):
    from stream_recon.app.sources import preprocessing_pool, reader, readers
    from stream_recon.app.sources.frames import SourceError

    failing = fault(faults, ValueError("resize refused") if kind == "raises" else None)
    preprocess = reader.preprocess_frame_uint8
    calls = []

    def preprocess_frame(rgb, width):
        calls.append(width)
        if len(calls) == 3:
            failing.active.set()
            failing.strike()
        return preprocess(rgb, width)

    monkeypatch.setattr(reader, "preprocess_frame_uint8", preprocess_frame)
    frames = []
    started = time.monotonic()
    with readers.frames_source(camera(6), name="cam", image_width=56, frame_timeout_s=0.3, preprocess_workers=1,
                               pool_from_pixels=0 if where == "pool" else preprocessing_pool.POOL_FROM_PIXELS) as source:
        with pytest.raises(SourceError) as raised:
            for frame in source:
                frames.append(frame)
    assert len(frames) == 2 and time.monotonic() - started < 0.3 + 5.0
    if kind == "raises":
        assert str(raised.value) == "preparing frame 2 of frame sequence cam failed: ValueError: resize refused"
    elif where == "reader":  # the reader stopped advancing
        assert str(raised.value) == "no frame from frame sequence cam for 0.3 s: the source stalled"
        failing.release.set()  # let go, it ends before a later test patches what it calls at its end
        source._thread.join(timeout=10)
    else:
        assert str(raised.value) == ("preparing frame 2 of frame sequence cam took more than 0.3 s: the "
                                     "preprocessing stalled")


def test_a_reader_whose_release_raises_still_ends_its_stream(monkeypatch, caplog):
    from stream_recon.app.sources import readers

    def release(reader):
        raise OSError("device busy")

    monkeypatch.setattr(readers.IterableReader, "release", release, raising=False)
    with readers.frames_source(camera(3), name="cam") as source:
        started = time.monotonic()
        frames = list(source)
    assert len(frames) == 3 and source.end_reason == "end" and time.monotonic() - started < 2.0
    assert warnings_of(caplog) == ["releasing frame sequence cam failed: OSError: device busy"]


@pytest.mark.slow
def test_a_run_whose_reader_raises_ends_failed_with_one_error_line_and_keeps_its_frames(tmp_path, tiny_model,
                                                                                       faults):
    from stream_recon.app.options import RunOptions
    from stream_recon.app.run.pipeline import run_sequence

    broken = fault(faults, RuntimeError("camera unplugged"))
    options = RunOptions(image_width=56, scale_frames=3, window=4, conf_threshold=1.0, viewer=False)
    summary = run_sequence(camera(8, fault_at=5, fault_=broken), tmp_path / "run", options, model=tiny_model)
    assert summary.status == "failed" and summary.frames == 5
    assert summary.error.endswith("failed: RuntimeError: camera unplugged") and "\n" not in summary.error
    assert len(list((tmp_path / "run" / "predictions").glob("*.npz"))) == 5
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "failed"


@pytest.mark.slow
def test_a_run_whose_preprocessing_raises_ends_failed_with_one_error_line(tmp_path, tiny_model, monkeypatch):
    from stream_recon.app.options import RunOptions
    from stream_recon.app.run.pipeline import run_sequence
    from stream_recon.app.sources import reader

    preprocess, calls = reader.preprocess_frame_uint8, []

    def preprocess_frame(rgb, width):
        calls.append(width)
        if len(calls) == 6:
            raise ValueError("resize refused")
        return preprocess(rgb, width)

    monkeypatch.setattr(reader, "preprocess_frame_uint8", preprocess_frame)
    options = RunOptions(image_width=56, scale_frames=3, window=4, conf_threshold=1.0, viewer=False)
    summary = run_sequence(camera(8), tmp_path / "run", options, model=tiny_model)
    assert summary.status == "failed" and summary.frames == 5
    assert summary.error.startswith("preparing frame 5 of ") and summary.error.endswith(
        "failed: ValueError: resize refused")
