"""Fault injection through the CLI: real `stream-recon` processes on a real video that keeps revisiting
its places, with faults put into the helpers by tests/faults/sitecustomize.py (raise, SIGKILL, SIGSTOP,
a thread blocked for good) at a seeded call. Every case ends within its deadline, with the frames it
emitted on disk, run.json saying what failed, and the documented exit code.

The deadlines are shortened (STREAM_RECON_TEST_DEADLINES) so that a stall is seen in seconds; no test
sleeps to "let it happen": each waits on files and the process with a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import pytest
from helpers import FAULT_INSTANTS

pytest.importorskip("gtsam")
pytestmark = pytest.mark.slow  # each case is a CLI process with a loop-closure child: ~5-15 s

FAULTS = Path(__file__).parent / "faults"
LOOP_FIXTURE = Path(__file__).parent / "data" / "loop"
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143
# every frame a keyframe and chunks of 8 frames with 4 shared: a rollover every 4 frames, the third chunk
# from frame 8 (the tiny model's flow keyframes are too few to fill a chunk in a short video)
RUN_FLAGS = ["--no-viewer", "--image-width", "56", "--scale-frames", "3", "--window", "4", "--chunk-frames", "8",
             "--overlap", "4", "--keyframes", "all", "--loop-closure", "on"]
SHORT_DEADLINES = ("stream_recon.models.loops.process:STALL_S=2,stream_recon.models.loops.process:FINISH_S=3,"
                   "stream_recon.app.outputs.writers:WRITER_STALL_S=2")
# Each case on an idle 2-core machine, the process's start (torch's import) included. On a busy machine a
# run is slower but not hung: there a case may take BUSY_FACTOR times what the same run without a fault
# took just before (`case_limit`); a hang never ends, so it still fails.
CASE_LIMIT_S = 20.0
BUSY_FACTOR = 3.0
_limit_s = [CASE_LIMIT_S]  # this module's limit on this machine now (case_limit sets it)


def revisiting_video(path: Path, frames: int) -> Path:
    """A short walk of the loop fixture's pictures played forwards, then backwards, over and over."""
    names = sorted(LOOP_FIXTURE.glob("*.jpg"))[:10]
    walk = names + names[::-1]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 10.0, (160, 96))
    for index in range(frames):
        writer.write(cv2.resize(cv2.imread(str(walk[index % len(walk)])), (160, 96)))
    writer.release()
    return path


@pytest.fixture(scope="module")
def short_video(tmp_path_factory) -> Path:
    return revisiting_video(tmp_path_factory.mktemp("video") / "revisits.mp4", 24)


@pytest.fixture(scope="module")
def long_video(tmp_path_factory) -> Path:
    return revisiting_video(tmp_path_factory.mktemp("video") / "revisits_long.mp4", 600)


@pytest.fixture(scope="module", autouse=True)
def case_limit(short_video: Path, tiny_checkpoint: Path, tmp_path_factory) -> float:
    """CASE_LIMIT_S, or BUSY_FACTOR times a run of the short video without a fault where the machine is
    busier than that now."""
    started = time.monotonic()
    child = start_run(short_video, tiny_checkpoint, tmp_path_factory.mktemp("baseline") / "run")
    child.communicate(timeout=600)
    _limit_s[0] = max(CASE_LIMIT_S, BUSY_FACTOR * (time.monotonic() - started))
    yield _limit_s[0]
    _limit_s[0] = CASE_LIMIT_S


@dataclass
class Outcome:
    code: int
    output: str
    run_dir: Path
    seconds: float

    @property
    def record(self) -> dict:
        return json.loads((self.run_dir / "run.json").read_text())

    @property
    def npz_frames(self) -> list[int]:
        return sorted(int(path.stem) for path in (self.run_dir / "predictions").glob("*.npz"))


def start_run(video: Path, checkpoint: Path, run_dir: Path, fault: str = "", *extra: str,
              deadlines: str = SHORT_DEADLINES, pythonpath: Path = FAULTS) -> subprocess.Popen:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(pythonpath),
                   "STREAM_RECON_TEST_FAULT": fault, "STREAM_RECON_TEST_DEADLINES": deadlines}
    command = [sys.executable, "-c", "from stream_recon.app.cli import main; main()", str(video),
               "--checkpoint", str(checkpoint), "-o", str(run_dir), *RUN_FLAGS, *extra]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment)


def finish(child: subprocess.Popen, run_dir: Path, started: float, limit_s: float | None = None) -> Outcome:
    limit_s = _limit_s[0] if limit_s is None else limit_s
    try:
        output, _ = child.communicate(timeout=max(0.1, limit_s - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        child.kill()  # (its loop-closure child dies with it: PR_SET_PDEATHSIG)
        output, _ = child.communicate(timeout=30)
        raise AssertionError(f"the run was still going {limit_s} s after its start:\n{output}") from None
    return Outcome(child.returncode, output, run_dir, time.monotonic() - started)


def run(video: Path, checkpoint: Path, run_dir: Path, fault: str = "", *extra: str, **options) -> Outcome:
    started = time.monotonic()
    return finish(start_run(video, checkpoint, run_dir, fault, *extra, **options), run_dir, started)


def wait_for(condition, child: subprocess.Popen, limit_s: float | None = None) -> None:
    deadline = time.monotonic() + (_limit_s[0] if limit_s is None else limit_s)
    while not condition():
        if child.poll() is not None:
            raise AssertionError(f"the run ended first:\n{child.stdout.read()}")
        assert time.monotonic() < deadline, "the condition did not come"
        time.sleep(0.02)


def assert_complete_with_the_open_chain(outcome: Outcome, reason: str) -> None:
    """Loop closure went off with `reason`; the run is complete, every file written, one warning line."""
    assert outcome.code == EXIT_OK, outcome.output
    assert "Traceback" not in outcome.output, outcome.output
    record = outcome.record
    assert record["status"] == "complete", record["summary"]
    loops = record["summary"]["loop_closure"]
    assert reason in (loops["error"] or ""), loops
    helpers = record["summary"]["helpers"]  # each helper that ran, the child among them, down with its reason
    assert helpers["loop_closure"]["up"] is False and reason in helpers["loop_closure"]["reason"], helpers
    assert helpers["writer"]["up"] and helpers["loop_closure"]["when_down"] == "turn off", helpers
    assert outcome.npz_frames == list(range(record["summary"]["frames"])) and outcome.npz_frames
    lines = (outcome.run_dir / "trajectory_tum.txt").read_text().splitlines()
    assert len(lines) == len(outcome.npz_frames) + 1  # + the header
    assert (outcome.run_dir / "points.ply").stat().st_size > 0
    warnings = [line for line in outcome.output.splitlines() if "loop closure is off for the rest of the run" in line]
    assert len(warnings) == 1, outcome.output
    assert "loop closure went off" in outcome.output  # the done line says so


LOOP_CHILD = "stream_recon.models.loops.closer:LoopCloser"


@pytest.mark.parametrize(("fault", "reason"), [
    (f"{LOOP_CHILD}.add_keyframe:raise:2", "it failed: InjectedFault"),
    (f"{LOOP_CHILD}.add_link:raise:1", "it failed: InjectedFault"),
    (f"{LOOP_CHILD}.add_keyframe:kill:2", "its process ended (exit status -9)"),
    (f"{LOOP_CHILD}.add_keyframe:stop:1", "it made no progress for 2 s"),
    (f"{LOOP_CHILD}.add_link:stop:2", "it made no progress for 2 s"),
])
def test_a_loop_closure_child_that_fails_dies_or_stalls_turns_loop_closure_off(
        tmp_path: Path, short_video: Path, tiny_checkpoint: Path, fault: str, reason: str) -> None:
    outcome = run(short_video, tiny_checkpoint, tmp_path / "run", fault)
    assert_complete_with_the_open_chain(outcome, reason)


def test_the_end_of_a_run_waits_for_a_stopped_child_only_until_its_deadline(
        tmp_path: Path, short_video: Path, tiny_checkpoint: Path) -> None:
    # a stall limit longer than the run: only the end-of-run deadline can end the wait
    deadlines = "stream_recon.models.loops.process:STALL_S=60,stream_recon.models.loops.process:FINISH_S=3"
    outcome = run(short_video, tiny_checkpoint, tmp_path / "run", f"{LOOP_CHILD}.add_keyframe:stop:2",
                  deadlines=deadlines)
    assert_complete_with_the_open_chain(outcome, "3 s passed after the stream's end")
    # run.json says how long the end of the run waited: the deadline at least (a child still starting gets
    # its start-up time first), within the run's time
    assert 3.0 <= outcome.record["summary"]["loop_closure"]["end_wait_s"] < outcome.seconds


def test_run_json_says_how_long_the_end_of_the_run_waited_for_loop_closure(tmp_path: Path, short_video: Path,
                                                                          tiny_checkpoint: Path) -> None:
    outcome = run(short_video, tiny_checkpoint, tmp_path / "run")
    assert outcome.code == EXIT_OK, outcome.output
    waited = outcome.record["summary"]["loop_closure"]["end_wait_s"]
    assert isinstance(waited, float) and 0.0 <= waited < 3.0 and waited == round(waited, 3)


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, EXIT_INTERRUPTED), (signal.SIGTERM, EXIT_TERMINATED)])
def test_a_signal_in_the_end_of_run_wait_ends_it_at_once_keeping_every_file(
        tmp_path: Path, short_video: Path, tiny_checkpoint: Path, signum: int, code: int) -> None:
    # the exit code said 130 or 143 while run.json said "complete" with no stop_signal and the last line "done:"
    deadlines = "stream_recon.models.loops.process:STALL_S=60,stream_recon.models.loops.process:FINISH_S=60"
    started = time.monotonic()
    child = start_run(short_video, tiny_checkpoint, tmp_path / "run", f"{LOOP_CHILD}.add_keyframe:stop:2",
                      deadlines=deadlines)
    # the stream has ended (its last frame is on disk) and the run waits for the stopped child
    wait_for(lambda: (tmp_path / "run" / "predictions" / "000023.npz").exists(), child)
    signalled = time.monotonic()
    child.send_signal(signum)
    outcome = finish(child, tmp_path / "run", started)
    assert time.monotonic() - signalled < 10.0
    assert outcome.code == code, outcome.output
    assert "Traceback" not in outcome.output
    record = outcome.record
    assert record["status"] == "interrupted" and record["summary"]["frames"] == 24
    assert record["summary"]["stop_signal"] == signal.Signals(signum).name
    assert outcome.output.splitlines()[-1].startswith("interrupted: 24 frames"), outcome.output
    loops = record["summary"]["loop_closure"]
    assert "the run was stopped" in loops["error"]
    assert 0.0 < loops["end_wait_s"] < outcome.seconds
    assert outcome.npz_frames == list(range(24))
    assert (tmp_path / "run" / "trajectory_tum.txt").exists() and (tmp_path / "run" / "points.ply").exists()


def test_a_signal_at_any_instant_of_a_runs_end_leaves_its_record_last_line_and_exit_code_agreeing(
        tmp_path: Path, short_video: Path, tiny_checkpoint: Path) -> None:
    # FAULT_INSTANTS instants from the stream's last frame on: during the end-of-run wait for the loop-closure child (held
    # up by the fault: stopped), while the files are written, or once the run is over
    deadlines = "stream_recon.models.loops.process:STALL_S=60,stream_recon.models.loops.process:FINISH_S=2"
    random = np.random.default_rng(5)
    for instant in range(FAULT_INSTANTS):
        run_dir = tmp_path / f"run{instant}"
        signum = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)[instant % 3]
        started = time.monotonic()
        child = start_run(short_video, tiny_checkpoint, run_dir, f"{LOOP_CHILD}.add_keyframe:stop:2",
                          deadlines=deadlines)
        wait_for(lambda run_dir=run_dir: (run_dir / "predictions" / "000023.npz").exists(), child)
        time.sleep(random.uniform(0.0, 3.0))  # the instant itself: somewhere in or after the 2 s wait
        if child.poll() is None:
            child.send_signal(signum)
        outcome = finish(child, run_dir, started)
        record, last = outcome.record, outcome.output.splitlines()[-1]
        where = (instant, outcome.code, record["status"], record["summary"]["stop_signal"], last)
        if outcome.code == EXIT_OK:
            assert record["status"] == "complete" and record["summary"]["stop_signal"] is None, where
            assert last.startswith("done: ") and "stopped nothing" not in last, where
        elif outcome.code > 128:
            name = signal.Signals(outcome.code - 128).name
            assert record["summary"]["stop_signal"] == name, where
            if record["status"] == "interrupted":
                assert last.startswith("interrupted: 24 frames"), where
            else:
                assert record["status"] == "complete" and last.endswith(f"{name} came after the last frame and "
                                                                          "stopped nothing"), where
        else:  # the signal came once the program had ended its work and its handlers were gone
            assert outcome.code == -signum and record["status"] == "complete", where
        assert outcome.npz_frames == list(range(24)), where


def test_one_sigterm_ends_a_run_whose_loop_closure_child_is_stopped_within_10_s(
        tmp_path: Path, long_video: Path, tiny_checkpoint: Path) -> None:
    deadlines = "stream_recon.models.loops.process:STALL_S=60,stream_recon.models.loops.process:FINISH_S=60"
    started = time.monotonic()
    child = start_run(long_video, tiny_checkpoint, tmp_path / "run", f"{LOOP_CHILD}.add_keyframe:stop:2",
                      deadlines=deadlines)
    predictions = tmp_path / "run" / "predictions"
    wait_for(lambda: predictions.is_dir() and len(list(predictions.glob("*.npz"))) >= 20, child,
             limit_s=2 * _limit_s[0])
    signalled = time.monotonic()
    child.send_signal(signal.SIGTERM)
    outcome = finish(child, tmp_path / "run", started, limit_s=signalled - started + 10.0)
    assert outcome.code == EXIT_TERMINATED, outcome.output
    assert time.monotonic() - signalled < 10.0
    record = outcome.record
    assert record["status"] == "interrupted" and "Traceback" not in outcome.output
    assert outcome.npz_frames == list(range(record["summary"]["frames"]))  # every emitted frame is on disk
    lines = (tmp_path / "run" / "trajectory_tum.txt").read_text().splitlines()
    assert len(lines) == len(outcome.npz_frames) + 1


def test_a_frame_writer_that_raises_fails_the_run_keeping_the_frames_before(
        tmp_path: Path, short_video: Path, tiny_checkpoint: Path) -> None:
    outcome = run(short_video, tiny_checkpoint, tmp_path / "run",
                  "stream_recon.app.outputs.writers:RunWriter._write_frame:raise:6")
    assert outcome.code == EXIT_FAILED, outcome.output
    record = outcome.record
    assert record["status"] == "failed" and "InjectedFault" in record["summary"]["error"]
    assert outcome.npz_frames == list(range(5))
    error_lines = [line for line in outcome.output.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and "Traceback" not in outcome.output, outcome.output


def test_a_disk_that_stops_answering_fails_the_run_at_its_deadline(
        tmp_path: Path, short_video: Path, tiny_checkpoint: Path) -> None:
    outcome = run(short_video, tiny_checkpoint, tmp_path / "run",
                  "stream_recon.app.outputs.writers:RunWriter._write_frame:block:6", "--loop-closure", "off")
    assert outcome.code == EXIT_FAILED, outcome.output
    assert "the disk took no frame for 2 s" in outcome.output and "Traceback" not in outcome.output
    record = outcome.record
    assert record["status"] == "failed" and outcome.npz_frames == list(range(5))


# -- a pose-graph library that does not import -----------------------------------------------------------
@pytest.fixture
def broken_gtsam(tmp_path: Path) -> Path:
    """A path whose gtsam fails to import, as a wheel built for another platform does."""
    folder = tmp_path / "broken"
    (folder / "gtsam").mkdir(parents=True)
    (folder / "gtsam" / "__init__.py").write_text(
        "raise ImportError('libgtsam.so.4: cannot open shared object file')\n")
    (folder / "sitecustomize.py").write_text((FAULTS / "sitecustomize.py").read_text())
    return folder


def test_auto_with_a_broken_gtsam_runs_without_loop_closure_and_says_why(
        tmp_path: Path, short_video: Path, tiny_checkpoint: Path, broken_gtsam: Path) -> None:
    outcome = run(short_video, tiny_checkpoint, tmp_path / "run", "", "--loop-closure", "auto",
                  pythonpath=broken_gtsam)
    assert outcome.code == EXIT_OK and "Traceback" not in outcome.output, outcome.output
    record = outcome.record
    assert record["status"] == "complete"
    assert "gtsam does not import" in record["summary"]["loop_closure"]["mode"]
    assert sum("gtsam does not import" in line for line in outcome.output.splitlines()) == 1, outcome.output


def test_on_with_a_broken_gtsam_is_one_error_line_and_writes_nothing(
        tmp_path: Path, short_video: Path, tiny_checkpoint: Path, broken_gtsam: Path) -> None:
    outcome = run(short_video, tiny_checkpoint, tmp_path / "run", "", pythonpath=broken_gtsam)
    assert outcome.code == EXIT_BAD_INPUT, outcome.output
    lines = [line for line in outcome.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --loop-closure on needs gtsam"), outcome.output
    # a plain `pip install gtsam` does nothing where gtsam is installed already
    assert lines[0].endswith("pip install --force-reinstall gtsam (or --loop-closure off)"), outcome.output
    assert not (tmp_path / "run").exists()


def test_the_fault_harness_reaches_the_loop_closure_child(tmp_path: Path) -> None:
    """The harness itself: a fault named for the child's core fires in the child, not in this process."""
    script = ("import os; from stream_recon.models.loops.closer import LoopCloser; "
              "LoopCloser().add_link(None)")
    environment = {**os.environ, "PYTHONPATH": str(FAULTS),
                   "STREAM_RECON_TEST_FAULT": f"{LOOP_CHILD}.add_link:raise:1"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environment,
                            timeout=60)
    assert "InjectedFault: injected into LoopCloser.add_link" in result.stderr
