"""A run's signals (docs/ARCHITECTURE.md, "Signals"; app/stopping.py's StopOnSignal): the first SIGINT or
SIGTERM lets the frame under way finish; a stream still running STOP_STREAM_S later stops as at a second
signal; a second one stops the stream at once; while the run closes, a signal raises nothing.

Real signals sent to this process, handled in the main thread (pytest's); STOP_STREAM_S is shortened.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import time
from collections.abc import Iterator

import pytest
from rich.console import Console

from stream_recon.app import stopping
from stream_recon.app.stopping import StopOnSignal

SHORT_STOP_S = 0.3


def a_frame_that_takes(seconds: float) -> None:
    """Work of the stream that the signal lands in (a bounded busy wait: the handlers run between its steps)."""
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        time.sleep(0.01)


@contextlib.contextmanager
def raising_nothing() -> Iterator[None]:
    """A KeyboardInterrupt here is this test's failure, not the end of the test session."""
    try:
        yield
    except KeyboardInterrupt:
        pytest.fail("a signal raised KeyboardInterrupt where the run must go on")


@pytest.fixture
def stop():
    firsts: list[int] = []
    with StopOnSignal(on_first=lambda: firsts.append(1), console=Console(file=io.StringIO()),
                      stop_stream_s=SHORT_STOP_S) as handler:
        handler.firsts = firsts
        yield handler


def test_the_first_signal_lets_the_frame_finish(stop: StopOnSignal) -> None:
    with raising_nothing():
        with stop.streaming():
            os.kill(os.getpid(), signal.SIGTERM)
            a_frame_that_takes(SHORT_STOP_S / 3)
        a_frame_that_takes(2 * SHORT_STOP_S)  # its deadline went with the stream: nothing raises after it
    assert stop.firsts == [1] and stop.count == 1 and stop.signum == signal.SIGTERM


def test_a_stream_still_running_stop_stream_s_after_the_first_signal_stops_as_at_a_second(stop: StopOnSignal) -> None:
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt), stop.streaming():
        os.kill(os.getpid(), signal.SIGINT)
        a_frame_that_takes(20 * SHORT_STOP_S)
    assert SHORT_STOP_S <= time.monotonic() - started < 10 * SHORT_STOP_S
    assert stop.count == 2 and stop.firsts == [1]


def test_a_second_signal_stops_the_stream_at_once(stop: StopOnSignal) -> None:
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt), stop.streaming():
        os.kill(os.getpid(), signal.SIGINT)
        a_frame_that_takes(SHORT_STOP_S / 10)
        os.kill(os.getpid(), signal.SIGINT)
        a_frame_that_takes(20 * SHORT_STOP_S)
    assert time.monotonic() - started < SHORT_STOP_S and stop.count == 2


def test_signals_while_the_run_closes_raise_nothing(stop: StopOnSignal) -> None:
    with raising_nothing():
        os.kill(os.getpid(), signal.SIGINT)
        a_frame_that_takes(SHORT_STOP_S / 10)
        os.kill(os.getpid(), signal.SIGTERM)
        a_frame_that_takes(2 * SHORT_STOP_S)  # and no deadline was set for a stream that is not running
    assert stop.requested and stop.count == 2 and stop.signum == signal.SIGINT


@pytest.mark.slow
def test_a_signal_held_by_nested_blocks_is_raised_when_the_outermost_ends() -> None:
    """A clean-up held inside another held block (the output folder made, then removed on a failure) must
    finish: the signal that came meanwhile is raised once, at the outermost block's end, even though the
    CLI redelivers it every REDELIVERY_INTERVAL_S until it is answered."""
    steps = []
    with stopping.PromptInterrupt() as prompt, pytest.raises(KeyboardInterrupt):
        with stopping.interrupts_held():
            with stopping.interrupts_held():
                os.kill(os.getpid(), signal.SIGTERM)
                a_frame_that_takes(2 * stopping.REDELIVERY_INTERVAL_S)  # redelivered meanwhile: still held
                steps.append("inner ended")
            a_frame_that_takes(2 * stopping.REDELIVERY_INTERVAL_S)
            steps.append("outer ended")
    assert steps == ["inner ended", "outer ended"] and prompt.signum == signal.SIGTERM


def test_waiting_for_a_stop_signal_off_the_main_thread_fails_at_once_instead_of_waiting_forever():
    import threading

    raised: list[BaseException] = []

    def wait() -> None:
        try:
            stopping.wait_for_stop_signal()
        except RuntimeError as error:
            raised.append(error)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(timeout=10)
    assert not waiter.is_alive() and [str(e) for e in raised] == [
        "waiting for Ctrl-C or SIGTERM needs the main thread: signals reach it only"]


def test_a_run_that_keeps_its_viewer_is_refused_off_the_main_thread_before_anything_is_written(tmp_path):
    """Ray workers and embedding applications call run_sequence on threads: --keep-viewer would serve forever."""
    import threading

    import cv2
    import numpy as np

    from stream_recon.app.options import OptionsError, RunOptions
    from stream_recon.app.run.pipeline import run_sequence

    folder = tmp_path / "frames"
    folder.mkdir()
    cv2.imwrite(str(folder / "000000.png"), np.zeros((28, 42, 3), np.uint8))
    raised: list[BaseException] = []

    def run() -> None:
        try:
            run_sequence(str(folder), tmp_path / "run", RunOptions(viewer=True, keep_viewer=True, port=18743))
        except Exception as error:  # noqa: BLE001 - which one is the test's
            raised.append(error)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(timeout=60)
    assert not runner.is_alive() and len(raised) == 1 and isinstance(raised[0], OptionsError)
    assert str(raised[0]).startswith("--keep-viewer serves until Ctrl-C or SIGTERM")
    assert not (tmp_path / "run").exists()


def test_a_signal_that_torch_turns_into_a_read_error_during_the_load_stops_the_run_instead(tmp_path, monkeypatch):
    """Under load a Ctrl-C landed inside torch's reading of the checkpoint, which turned its KeyboardInterrupt
    into a ValueError: the run ended "truncated or corrupt" with exit 2 for a file that was fine."""
    import stream_recon.models as models
    from stream_recon.app.options import RunOptions
    from stream_recon.app.run.loading import load_model_for
    from stream_recon.models import CheckpointError

    checkpoint = tmp_path / "tiny.safetensors"
    checkpoint.write_bytes(b"fine")

    def read_interrupted(path, device="cpu"):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            a_frame_that_takes(5.0)
        except KeyboardInterrupt:  # what torch's converter does with it
            raise CheckpointError(f"{path} is truncated or corrupt and cannot be read (ValueError: could not "
                                  "determine the shape of object type 'torch.storage.UntypedStorage')") from None

    monkeypatch.setattr(models, "load_model", read_interrupted)
    with stopping.PromptInterrupt() as prompt, pytest.raises(KeyboardInterrupt):
        load_model_for(RunOptions(checkpoint=str(checkpoint), device="cpu"), console=Console(file=io.StringIO()))
    assert prompt.signum == signal.SIGINT
    # without a signal the same error is the user's one line
    monkeypatch.setattr(models, "load_model", lambda path, device="cpu": (_ for _ in ()).throw(
        CheckpointError(f"{path} is truncated or corrupt")))
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_model_for(RunOptions(checkpoint=str(checkpoint), device="cpu"), console=Console(file=io.StringIO()))


SWALLOWING_COMMAND = """
import os, signal, sys, time
from stream_recon.app import cli

@cli.app.command(name="swallowing")
def swallowing() -> None:
    try:  # a library's import that keeps the KeyboardInterrupt as a stand-in (trimesh's path module)
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
        time.sleep(5.0)
    except KeyboardInterrupt as interrupt:
        stand_in = interrupt
    stand_in | None  # its next annotation: TypeError

cli.main(["swallowing"])
"""


@pytest.mark.parametrize("name, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_an_error_raised_after_a_stop_signal_ends_as_the_stop_without_a_traceback(name: str, code: int) -> None:
    """An export stopped while trimesh imported printed trimesh's TypeError as a traceback instead of stopping."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", SWALLOWING_COMMAND, name], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == code, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr


LINGERING_COMMAND = """
import threading, time
from stream_recon.app import cli

@cli.app.command(name="lingering")
def lingering() -> None:
    threading.Thread(target=time.sleep, args=(5.0,)).start()  # joined by the interpreter at exit
    print("done: the work", flush=True)

cli.main()
"""


def test_a_signal_after_the_work_is_done_ends_the_process_by_that_signal_without_a_traceback() -> None:
    """A Ctrl-C while the interpreter joined a thread at exit printed `KeyboardInterrupt` after `done:`, and the
    process exited 0."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", LINGERING_COMMAND, "lingering"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        assert child.stdout.readline().startswith("done: ")
        time.sleep(0.5)  # main() has returned; the interpreter waits for the thread
        child.send_signal(signal.SIGINT)
        printed, _ = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGINT, printed
    assert "KeyboardInterrupt" not in printed and "Traceback" not in printed, printed


BUSY_IN_OPENCV_COMMAND = """
import atexit, sys, threading
import cv2, numpy as np, torch  # (torch: a finalization as long as a run's)
from stream_recon.app import cli

IMAGE = np.zeros((2000, 2000), np.float32)

def blur_forever() -> None:  # each call leaves the GIL for tens of ms inside OpenCV's C++
    while True:
        cv2.GaussianBlur(IMAGE, (31, 31), 0)

@cli.app.command(name="busy")
def busy(code: int) -> None:
    threading.Thread(target=blur_forever, daemon=True).start()
    atexit.register(lambda: print("exit handlers ran", flush=True))
    print("done: the work", end="\\n" if code else "")  # (the last line left in the buffer)
    if code:
        sys.exit(code)

cli.main()
"""


@pytest.mark.slow
@pytest.mark.parametrize("code", [0, 2])
def test_a_daemon_thread_inside_a_native_library_at_exit_does_not_abort_the_process(code: int) -> None:
    """The reader of a stalled camera was inside OpenCV's read when a stopped run ended: the read came back while
    the interpreter finalized, Python 3.11 ended the thread by unwinding its C++ frames, and the process aborted
    ("terminate called without an active exception", exit -6 instead of 143, the buffered last lines lost)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", BUSY_IN_OPENCV_COMMAND, "busy", str(code)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == code, done.stdout + done.stderr
    assert "terminate called" not in done.stderr and "Fatal Python error" not in done.stderr, done.stderr
    assert done.stdout.startswith("done: the work") and done.stdout.rstrip().endswith("exit handlers ran")
