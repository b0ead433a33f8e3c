"""A run once it is set up: the `Run` (what it streams with), its loop over the source's frames into the
engine and the sinks, and its end (the sinks closed in order, run.json's summary, the helpers' records);
`RunSummary`, how it ended.

Its own module because it is the stream's path (docs/ARCHITECTURE.md, "One frame's path"): what runs per
frame and at the end, apart from pipeline.py's checks and set-up, which run once before it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from rich.console import Console
from rich.markup import escape

from stream_recon.app.options import RunOptions
from stream_recon.app.outputs.output_folder import OutputDirError
from stream_recon.app.outputs.writers import RunWriter
from stream_recon.app.run.clock import RunClock
from stream_recon.app.run.finite_check import NonFinitePrediction
from stream_recon.app.run.loading import CheckpointDigest
from stream_recon.app.run.loops import LoopClosureSink
from stream_recon.app.run.progress import RunProgress
from stream_recon.app.sources.frames import SourceError
from stream_recon.app.sources.preprocess import preprocess_frame_uint8
from stream_recon.app.sources.reader import FrameSource
from stream_recon.app.stopping import STOP_CLOSE_S, StopOnSignal, signal_name
from stream_recon.models import FrameError
from stream_recon.models.builds.plan import Builder
from stream_recon.models.supervision import Deadline, Helper, HelperDown, HelperOwner

logger = logging.getLogger(__name__)


RunStatus = Literal["complete", "interrupted", "failed"]


@dataclass(frozen=True)
class RunSummary:
    """How a run ended. `frames` counts predictions on disk (distinct frame indices)."""

    status: RunStatus
    frames: int
    keyframes: int
    fps: float  # end to end: frames / wall time from the first frame read to the last prediction
    output_dir: Path
    error: str | None = None
    model_fps: float = float("nan")  # frames / time spent inside the engine
    frames_read: int = 0
    end_reason: str | None = None  # end | max_frames | stopped | error
    stop_signal: int | None = None  # the signal that stopped an interrupted run (SIGINT, SIGTERM)
    viewer_closed_by: int | None = None  # the signal that closed a viewer kept serving after the run
    late_signal: int | None = None  # one that came once run.json was written: it stopped nothing (a batch stops)
    loop_closure_off: str | None = None  # why loop closure went off during the run, if it did
    empty_cloud: str | None = None  # why points.ply holds no point, where it holds none

    @property
    def ended_by_signal(self) -> int | None:
        """The signal the process should report in its exit code (128 + it), if one ended it."""
        return self.stop_signal or self.viewer_closed_by

    @property
    def ok(self) -> bool:
        return self.status == "complete"


class Sink(Protocol):
    def on_frame(self, pred: Any, stats: dict) -> None: ...

    def close(self, status: str) -> None: ...


@dataclass
class Run:
    """What one run streams with, from its first frame until its sinks are closed."""

    source: FrameSource
    engine: Any
    writer: RunWriter
    sinks: list[Sink]  # each frame reaches them in this order, and they are closed in it
    viewer: Any  # the live viewer, or None
    options: RunOptions
    console: Console
    digest: CheckpointDigest
    clock: RunClock
    builds: Builder | None = None  # compiled code and kernels: the work ahead, the warm-up, the compile beside
    created_dir: Path | None = None  # the output folder this run made (removed where nothing is kept)
    stopped_by_signal: bool = True  # until the stream ends without a signal (a failure stops the child too)
    recorded_signal: int | None = None  # the stop signal run.json names
    noted_signals: list[int] | None = None  # signals_noted's list, which the stream's StopOnSignal takes over from
    signal_after_record: int | None = None  # one that came while the run closed, once run.json was written
    progress: RunProgress | None = None  # while the frames stream: its drawing thread is a helper of the run

    def stream(self) -> RunSummary:
        """Every frame through the engine into the sinks, then the sinks closed; how the run ended."""
        source = self.source
        with _long_lived_objects_frozen(), _gil_handed_back_sooner(), \
                StopOnSignal(source.request_stop, self.console, self.noted_signals) as stop:
            with RunProgress(self.console, source.description, source.estimated_length) as progress:
                self.progress = progress
                try:
                    with stop.streaming():
                        status, error = self._push_frames(progress, stop)
                except BaseException as unexpected:
                    self.close_sinks("failed", f"internal error: {unexpected!r}", lambda: stop.signum)
                    raise
            # a signal after the source's last frame stops nothing: the run is complete
            if stop.requested and status == "complete" and source.end_reason not in ("end", "max_frames"):
                status = "interrupted"
            if status == "complete" and self.clock.frames_done == 0:
                status, error = "failed", _no_frames_message(source, self.options)
            status, writer_error = self.close_sinks(status, error, lambda: stop.signum)
        if writer_error is not None and error is None:
            status, error = "failed", writer_error
        self.stopped_by_signal = stop.signum is not None
        if stop.signum != self.recorded_signal:
            self.signal_after_record = stop.signum
        return self._summary(status, error, stop)

    def end(self, stopped_late: bool = False) -> None:
        """After the stream, its sinks closed: the engine's helpers ended, and the builds' (the work ahead,
        the compile child: stopped after a signal, one that came after the record too)."""
        self.engine.close()  # the next chunk's worker thread, when the engine has one
        if self.builds is not None:
            stopped = self.stopped_by_signal or stopped_late or self.signal_after_record is not None
            note = self.builds.finish(stopped_by_signal=stopped)
            if note:
                self.console.print(f"[dim]{escape(note)}[/dim]", highlight=False)

    def _push_frames(self, progress: RunProgress, stop: StopOnSignal) -> tuple[RunStatus, str | None]:
        """The source's frames, then what the engine still buffers (phase 1), into the sinks.

        A source, frame or disk problem mid-stream ends the run "failed": the frames before it are
        worth keeping. What the engine buffers is completed on every path but a second Ctrl-C, which
        ends the run "interrupted".
        """
        error: str | None = None
        try:
            error = self._stream_frames(progress, stop)
            finish_error = self._finish_frames(progress)
            error = error or finish_error
        except KeyboardInterrupt:
            return "interrupted", error
        return ("complete" if error is None else "failed"), error

    def _stream_frames(self, progress: RunProgress, stop: StopOnSignal) -> str | None:
        """Every frame of the source through the engine into the sinks; the error that ended the stream
        early, if one did. A frame's whole way on this thread is this loop's body (docs/ARCHITECTURE.md,
        "One frame's path"): taken from the source, pushed, its predictions handed to the sinks."""
        try:
            for frame in self.source:
                if self.viewer is not None:
                    _wait_while_paused(self.viewer, stop)
                image = frame.image
                if image is None:  # a FrameSource opened without preprocessing
                    image = preprocess_frame_uint8(frame.rgb, self.options.image_width)
                if self.clock.frames_read == 0 and self.builds is not None:
                    warmed = self.builds.before_stream(self.engine, image, self.source.estimated_length)
                    if warmed is not None:
                        self.clock.warm_up_s, self.clock.warm_up_parts = warmed
                with self.clock.in_engine():
                    preds = self.engine.push(image, timestamp=frame.timestamp)
                self.clock.frames_read += 1
                if self.builds is not None:
                    self.builds.after_frame(self.engine, self.clock.frames_read)
                progress.update(self._emit(preds))
        except _STREAM_ERRORS as failure:
            return str(failure)
        except torch.OutOfMemoryError as failure:
            return self._out_of_memory_message(failure)
        return None

    def _finish_frames(self, progress: RunProgress) -> str | None:
        """What the engine still buffers, into the sinks; the error that kept it from finishing, if one did."""
        try:
            for part in self._finish_in_parts():
                progress.update(self._emit(part))
        except _STREAM_ERRORS as failure:
            return str(failure)
        except torch.OutOfMemoryError as failure:  # the buffered frames could not be finished either
            return self._out_of_memory_message(failure)
        return None

    def _finish_in_parts(self) -> Iterator[list]:
        """What the engine still buffers, a part as soon as it is ready (ChunkedEngine.finish_in_parts:
        the stream's last frame need not wait for a rollover's catch-up), each part timed as engine
        time; an engine without parts (the bench's and the tests' stand-ins) delivers it at once."""
        parts = getattr(self.engine, "finish_in_parts", None)
        if parts is None:
            with self.clock.in_engine():
                finished = self.engine.finish()
            yield finished
            return
        parts = parts()
        while True:
            with self.clock.in_engine():
                part = next(parts, None)
            if part is None:
                return
            yield part

    def _out_of_memory_message(self, failure: torch.OutOfMemoryError) -> str:
        """One line: where the GPU ran out, what is kept, and what to change."""
        what = ". ".join(str(failure).split(". ")[:2])  # "CUDA out of memory. Tried to allocate 66.00 MiB"
        budget = self.options.gpu_memory
        remedy = (f"give --gpu-memory less than {budget}" if budget is not None
                  else "plan the run for this GPU with --gpu-memory (e.g. --gpu-memory 8GiB)")
        return (f"the GPU ran out of memory at frame {self.clock.frames_read} ({what}); the predictions before it "
                f"are kept: {remedy}, or a smaller --image-width")

    def _emit(self, preds: list) -> dict:
        clock, source = self.clock, self.source
        clock.count_done(preds)
        stats = dict(self.engine.stats())
        stats.update(
            clock.rates(), frames_read=clock.frames_read, frames_done=clock.frames_done,
            frames_dropped=source.frames_dropped, keyframes=len(clock.keyframe_indices),
        )
        for pred in preds:
            for sink in self.sinks:
                sink.on_frame(pred, stats)
        return stats

    def _summary(self, status: RunStatus, error: str | None, stop: StopOnSignal) -> RunSummary:
        poses = self.writer.poses
        return RunSummary(
            status=status,
            frames=len(poses),
            keyframes=sum(1 for pose in poses.values() if pose.is_keyframe),
            fps=self.clock.end_to_end_fps,
            output_dir=self.writer.output_dir,
            error=error,
            model_fps=self.clock.model_fps,
            frames_read=self.clock.frames_read,
            end_reason=self.source.end_reason or ("stopped" if stop.requested else None),
            stop_signal=self.recorded_signal,
            loop_closure_off=next((sink.failure for sink in self.sinks if isinstance(sink, LoopClosureSink)), None),
            empty_cloud=self.writer.empty_cloud(),
        )

    def close_sinks(self, status: RunStatus, error: str | None,
                    stop_signal: Callable[[], int | None] = lambda: None) -> tuple[RunStatus, str | None]:
        """Close every sink in order, the writer with run.json's summary. Returns the run's status as
        recorded and the writer's error, if any.

        The loop closer finishes first: its last corrections go into the writer's files. Every wait here
        has a deadline; an interrupted run's fit in STOP_CLOSE_S, and a signal (`stop_signal()` says which
        came) ends loop closure's at once. A signal that cut that wait short leaves loop closure's last
        solve undone: the run is then "interrupted", so that run.json, the last line and the exit code
        agree. A signal that came after the source's last frame and cut nothing short stopped nothing:
        the run is complete, and run.json, the done line and the exit code name the signal.
        """
        self.clock.stop()
        loops = next((sink for sink in self.sinks if isinstance(sink, LoopClosureSink)), None)
        corrections = None
        if loops is not None:
            corrections = loops.finish(status, stop_now=lambda: stop_signal() is not None)
            if loops.wait_cut_short and status == "complete":
                status = "interrupted"
        # the checkpoint's digest is hashed beside the run: an interrupted run does not wait it out
        self.recorded_signal = stop_signal()
        summary = self._run_json_summary(error, self.recorded_signal,
                                         digest_wait_s=1.0 if status == "interrupted" else 60.0)
        if loops is not None:
            summary["loop_closure"] = loops.summary()
        if self.builds is not None:
            summary.update(self.builds.summary())
        summary["helpers"] = {name: helper.record() for name, helper in self.helpers().items()}
        writes_by = Deadline(STOP_CLOSE_S) if status == "interrupted" else None
        writer_error = None
        for sink in self.sinks:
            try:
                if sink is self.writer:
                    self.writer.close(status, summary, corrections, deadline=writes_by)
                else:
                    sink.close(status)
            except OutputDirError as failure:
                writer_error = str(failure)
            except Exception as failure:  # noqa: BLE001 - one sink failing must not stop the others closing
                logger.warning("closing %s failed: %s", type(sink).__name__, failure)
        return status, writer_error

    def helpers(self) -> dict[str, Helper]:
        """Each helper that ran beside the stream (models/supervision.py) by run.json's name, as its owner says
        (HelperOwner); its record says whether it is up, or why it went down, what it dropped, and what its
        going down does."""
        loops = next((sink for sink in self.sinks if isinstance(sink, LoopClosureSink)), None)
        owners: list[HelperOwner | None] = [self.source, self.writer, self.viewer, self.progress, loops, self.engine,
                                            self.builds, self.digest]
        return {name: helper for owner in owners if owner is not None for name, helper in owner.helpers().items()}

    def _run_json_summary(self, error: str | None, stop_signal: int | None, digest_wait_s: float) -> dict[str, Any]:
        """The summary holds each value once: status, settings (device, source) and versions are the
        writer's; the rates and timings are the clock's, stopped by then."""
        source, clock = self.source, self.clock
        return {
            "checkpoint_digest": self.digest.result(timeout_s=digest_wait_s),
            "error": error,
            "end_reason": source.end_reason,
            "stop_signal": signal_name(stop_signal),
            "frames_read": clock.frames_read,
            "frames_dropped": source.frames_dropped,
            "reconnects": source.reconnects,
            "reconnect_attempts": source.reconnect_attempts,
            "disconnected_s": round(source.disconnected_s, 3),
            **clock.rates(),
            "timings": clock.timings(),
            "engine": self.engine.stats(),
            "peak_gpu_memory_bytes": _peak_gpu_memory(self.writer.settings.get("device", "cpu")),
        }


@contextlib.contextmanager
def _long_lived_objects_frozen() -> Iterator[None]:
    """Keep what exists before the stream (the model, the engine, the viewer's scene) out of the cyclic
    garbage collector's full collections while frames flow.

    Every few hundred frames a full collection walks every object of the process, holding the GIL: 30 to
    80 ms with the viewer's scene alone (scripts/bench_e2e.py), more with a model's modules, a stall of the
    stream each time. Frozen objects are skipped; the freeze ends with the stream, so that a process that
    runs many sequences (batch) reclaims each run's cycles.
    """
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


GIL_SWITCH_INTERVAL_S = 0.0005  # Python's default is 0.005


@contextlib.contextmanager
def _gil_handed_back_sooner() -> Iterator[None]:
    """While frames flow, make a thread that holds the GIL give it up after 0.5 ms instead of 5 ms when
    another waits for it.

    The stream's thread lets the GIL go at every CUDA wait and every large numpy operation, and the
    viewer's and the writer's threads (and the next chunk's worker) take it meanwhile; each time, the
    stream's thread then waits up to 5 ms (Python's default interval) to get it back. At a chunk rollover,
    whose alignment is a few dozen numpy calls, that makes 3 ms of work take 20-80 ms.
    """
    previous = sys.getswitchinterval()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def _wait_while_paused(viewer: Any, stop: StopOnSignal) -> None:
    # short waits, so that Ctrl-C still stops a run paused from the browser
    while not viewer.wait_if_paused(timeout=0.2):
        if stop.requested:
            return


def _no_frames_message(source: FrameSource, options: RunOptions) -> str:
    """A run that ended without one frame is a failure, whatever the reason: say which selection was asked."""
    defaults = RunOptions()
    selected = [f"--{name} {getattr(options, name)}" for name in ("start", "stride", "fps")
                if getattr(options, name) != getattr(defaults, name)]
    asked = f" with {' '.join(selected)}" if selected else ""
    return f"{source.description} delivered no frame{asked}; nothing was reconstructed"


# A source, frame or disk problem mid-stream: the run ends "failed", keeping the frames before it.
_STREAM_ERRORS = (SourceError, FrameError, OutputDirError, NonFinitePrediction, HelperDown)


def _peak_gpu_memory(device: str) -> int | None:
    if not device.startswith("cuda"):
        return None
    return int(torch.cuda.max_memory_allocated(device))
