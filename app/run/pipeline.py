"""One run: a source streamed through the engine into the run directory and any other sinks.

Its parts have their own homes: options (app.options), the output folder (app.outputs.rundir), the model and
engine (app.run.loading), the clock (app.run.clock), Ctrl-C and SIGTERM (app.stopping), the files (app.outputs.writers).

    open source ─▶ check options ─▶ check output dir ─▶ load model ─▶ RunWriter ─▶ per frame: push ─▶ sinks
        │               │                 │                  │                                  │
        SourceError     OptionsError      OutputDirError     CheckpointError       SIGINT / SIGTERM / a source,
        (before the     (e.g. no CUDA)    (before the load)  (no folder left)      frame or disk error: stop,
         model loads)                                                              flush, close the sinks

Every failure before the first frame leaves nothing behind but a clear error. Once frames flow,
every completed prediction is already on disk (the writer flushes per frame), so stopping early
only has to flush what the engine still buffers and write run.json with how the run ended.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import torch
from rich.console import Console
from rich.markup import escape

from stream_recon.app.options import (
    OptionsError,
    RunOptions,
    check_attention,
    check_viewer_address,
    resolve_device,
    resolve_dtype,
)
from stream_recon.app.outputs.masks import FrameMasker, MaskDirError, user_masks_for
from stream_recon.app.outputs.rundir import (
    OutputDirError,
    prepare_output_dir,
    remove_if_empty,
    remove_run,
    unlock_run_dir,
)
from stream_recon.app.outputs.sky import SKY_NETWORK_SMS, SkyModelError, SkySegmenter, sky_network_path
from stream_recon.app.outputs.writers import RunWriter
from stream_recon.app.run.clock import RunClock
from stream_recon.app.run.loading import (
    CheckpointDigest,
    build_engine,
    check_gpu_memory,
    chunk_engine_config,
    load_model_for,
    model_config_for,
    prepared_for_run,
)
from stream_recon.app.run.loops import (
    LoopClosureSink,
    MapPlan,
    loop_closure_cannot_help,
    loop_closure_wanted,
)
from stream_recon.app.run.progress import RunProgress
from stream_recon.app.run.resources import check_cpu_run
from stream_recon.app.sources.frames import SourceError
from stream_recon.app.sources.input_size import model_input_size, too_small_warning
from stream_recon.app.sources.opening import open_source
from stream_recon.app.sources.preprocess import preprocess_frame_uint8
from stream_recon.app.sources.reader import FrameSource
from stream_recon.app.sources.readers import frames_source
from stream_recon.app.stopping import (
    STOP_CLOSE_S,
    StopOnSignal,
    interrupts_held,
    signal_name,
    signals_noted,
    wait_for_stop_signal,
)
from stream_recon.models import DEFAULT_CHECKPOINT, MAP_DIR, FrameError, parse_keyframes, partitioned_stream
from stream_recon.models.builds.plan import Builder, BuildSettings
from stream_recon.models.checkpoint import resolve_checkpoint
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


# ----------------------------------------------------------------------------------------------


def _input_size(source: FrameSource, options: RunOptions) -> tuple[int, int] | None:
    """(height, width) of the model input the source's frames will make, where their size is known
    before the first is read."""
    if source.frame_size is None:
        return None
    try:
        return model_input_size(*source.frame_size, options.image_width)
    except ValueError:  # a size no frame can be made of: the source's own check says so
        return None


def run_sequence(
    source: str | Path | FrameSource | Iterable[tuple[np.ndarray, float]],
    output_dir: str | Path,
    options: RunOptions,
    *,
    model: Any = None,
    extra_sinks: Sequence[Sink] = (),
    console: Console | None = None,
) -> RunSummary:
    """Stream `source` through the model into `output_dir`; returns how the run ended.

    source: what the user typed (video, folder, webcam index, URL), an opened FrameSource, or any
    iterable of (rgb [H, W, 3] uint8, timestamp) pairs. model: an already loaded model (batch runs
    share one); when None it is loaded from options.checkpoint after the output folder is checked.

    Errors before the first frame (a bad source, an unwritable folder, a missing checkpoint) are
    raised; the user gets them as one sentence from the CLI. Errors while streaming (a truncated
    video, a stalled camera, a frame of another size) end the run as "failed": what was computed is
    kept and RunSummary.error says why. Ctrl-C or SIGTERM ends it as "interrupted" the same way.
    """
    console = console or Console(stderr=True)
    clock = RunClock()  # from here: the model load is part of the run's timings
    frame_source = _as_frame_source(source, options)  # first: a mistyped path fails before the model loads
    try:
        plan = _plan(frame_source, options, model)
        run = _set_up(plan, frame_source, Path(output_dir), options, model, extra_sinks, console, clock)
        # from the stream's end on, a signal stops nothing more than the record says (signals_noted), and
        # the batch is told of one (RunSummary.late_signal)
        with signals_noted() as late:
            run.noted_signals = late
            try:
                summary = run.stream()
            finally:
                run.end(stopped_late=bool(late))
            summary = _after(run, summary)
        return dataclasses.replace(summary, late_signal=next(iter(late), run.signal_after_record))
    finally:
        frame_source.close()
        unlock_run_dir(output_dir)  # (held from prepare_output_dir: one run per folder)


@dataclass(frozen=True)
class RunPlan:
    """What a run will use, decided before anything is loaded or written (each check's refusal first)."""

    device: str
    dtype: Any
    attention: str
    model_config: Any  # None for a caller's model without one
    engine_config: Any  # the settings each chunk's engine streams with (None without a model config)
    input_size: tuple[int, int] | None  # the model input's (height, width), where known before the first frame
    closes_loops: bool
    loop_closure_reason: str | None
    masker: Any  # app.outputs.masks.FrameMasker of --mask-sky / --mask-dir, or None
    warnings: list[str]  # given once every refusal has had its turn: a refused run shows only its error


def _plan(frame_source: FrameSource, options: RunOptions, model: Any) -> RunPlan:
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device)
    attention = check_attention(options.attention, device, dtype, options.kv_cache)
    _check_selection(frame_source, options)
    closes_loops, loop_closure_reason = loop_closure_wanted(options, frame_source.estimated_length)
    if options.viewer:
        check_viewer_address(options.host, options.port)
        if options.keep_viewer and threading.current_thread() is not threading.main_thread():
            raise OptionsError("--keep-viewer serves until Ctrl-C or SIGTERM, which reach the main thread only: "
                               "run it there, or without --keep-viewer")
    config = model_config_for(options, model)
    _check_camera_iterations(options, config)
    warnings = []
    if device == "cpu" and config is not None:  # a GPU's memory is the engine's to budget (models/)
        warnings += check_cpu_run(options, config, frame_source.frame_size, frame_source.estimated_length,
                                  model_loaded=model is not None)
    if device == "cpu" and options.gpu_memory is not None:
        # it acts here too (the plan is made and printed, and a budget nothing fits is refused): said as such
        warnings.append(f"--gpu-memory {options.gpu_memory} budgets a GPU's memory: on the CPU the run is planned as "
                        "for a GPU of that size (the memory plan below), and this machine's memory is checked besides "
                        "(--no-memory-check turns that check off)")
    if device == "cpu" and options.compile == "on":
        warnings.append("--compile on compiles the GPU's streaming step and does nothing on the CPU: the run is not "
                        "compiled")
    warnings += _source_warnings(frame_source, options)
    engine_config = None if config is None else chunk_engine_config(options, config)
    return RunPlan(device, dtype, attention, config, engine_config, _input_size(frame_source, options),
                   closes_loops, loop_closure_reason, frame_masker(options, device, frame_source), warnings)


def _check_camera_iterations(options: RunOptions, config: Any) -> None:
    """--camera-iterations at most the checkpoint's camera head refines (the tiny test model's 2; the released
    models' 4), refused before anything is loaded; without the flag a run takes all of them."""
    asked, most = options.camera_iterations, getattr(config, "camera_iterations", None)
    if asked is not None and most is not None and asked > most:
        raise OptionsError(f"--camera-iterations {asked} is more than this checkpoint's camera head has: it refines "
                           f"its poses {most} times; give 1 to {most}, or leave the flag out for all of them")


def frame_masker(options: RunOptions, device: str, source: FrameSource) -> Any:
    """The masks a run leaves out of its points (app.outputs.masks), checked before anything is written: a sky
    network that cannot run here (onnxruntime, skyseg.onnx: fetched when the hub answers), a mask folder that
    cannot serve the source's frames are bad input. None when neither is asked for."""
    if not options.mask_sky and options.mask_dir is None:
        return None

    try:
        user = user_masks_for(options.mask_dir, source, options.image_width) if options.mask_dir is not None else None
        sky = SkySegmenter(sky_network_path(download=True), sky_stream(device)) if options.mask_sky else None
    except (SkyModelError, MaskDirError) as error:
        raise OptionsError(str(error)) from None
    return FrameMasker(sky, user, options.image_width, options.rotate, source.frame_size)


def sky_stream(device: str) -> int | None:
    """The handle of the stream the sky network runs on: on SKY_NETWORK_SMS of the GPU's SMs where the driver
    can confine one (None on the CPU, or where it cannot: the CUDA provider's own stream)."""
    if SKY_NETWORK_SMS is None or not device.startswith("cuda"):
        return None
    stream = partitioned_stream(torch.device(device), SKY_NETWORK_SMS)
    return None if stream is None else stream.cuda_stream


def _set_up(plan: RunPlan, frame_source: FrameSource, output_dir: Path, options: RunOptions, model: Any,
            extra_sinks: Sequence[Sink], console: Console, clock: RunClock) -> Run:
    """The output folder, the model (loaded or received, prepared once: compiled or not as the Builder says
    for the source's input size), the engine, the viewer and the sinks. A failure or a signal here removes
    the folders made for the run."""
    viewer = writer = builds = created_dir = None
    try:
        with interrupts_held():  # the folders made and known to the clean-up below as one step
            created_dir = prepare_output_dir(output_dir, overwrite=options.overwrite)
        if frame_source.live:
            frame_source.start()  # keep a camera's connection drained while the model loads
        # a caller's own model is described by options.checkpoint only when that is set
        checkpoint = options.checkpoint or (DEFAULT_CHECKPOINT if model is None else None)
        builds = Builder(BuildSettings(options.compile, options.warm_up, options.gpu_memory, options.scale_frames,
                                       plan.device, plan.dtype, plan.model_config, plan.engine_config, plan.input_size),
                         say=lambda line: console.print(f"[dim]{escape(line)}[/dim]", highlight=False))
        model = builds.model(_model_loader(model, options, plan.device, console), loading_checkpoint=model is None)
        digest = CheckpointDigest(checkpoint)
        engine = build_engine(model, options, plan.device, plan.dtype, console)
        check_gpu_memory(engine, options, plan.input_size)
        for warning in plan.warnings:
            console.print(f"[yellow]warning:[/yellow] {escape(warning)}")
        clock.model_loaded()
        viewer = _start_viewer(options, console, plan.masker)
        used = {"device": plan.device, "dtype": str(plan.dtype).removeprefix("torch."), "attention": plan.attention,
                "compile": bool(model.inference_spec.compiled)}
        writer = RunWriter(
            output_dir,
            _settings(options, frame_source, used, checkpoint),
            conf_threshold=options.conf_threshold,
            voxel_size=options.voxel_size,
            overwrite=True,  # prepare_output_dir already refused an existing run without --overwrite
            outputs=options.prediction_outputs(),
            masker=plan.masker,
        )
        loops = LoopClosureSink(engine, viewer, enabled=plan.closes_loops, reason=plan.loop_closure_reason,
                                saved_map=map_plan(output_dir, options, checkpoint, digest))
    except BaseException:
        # held: the CLI redelivers an unanswered signal every 0.5 s (PromptInterrupt), and one landing in here
        # on a busy machine would leave the folders behind
        with interrupts_held():
            if viewer is not None:
                viewer.close("failed")
            if builds is not None:
                builds.abandon()
            if writer is not None and writer.replaced:  # stopped before the first frame: not even run.json is kept
                remove_run(output_dir)
            remove_if_empty(output_dir, created_dir)
        raise
    # the finiteness check comes first: a frame that fails it reaches no other sink
    sinks: list[Sink] = [FiniteCheck(half_precision=used["dtype"] != "float32"), writer, *extra_sinks, loops]
    if viewer is not None:
        sinks.append(viewer)
    return Run(frame_source, engine, writer, sinks, viewer, options, console, digest, clock, builds, created_dir)


def map_plan(output_dir: Path, options: RunOptions, checkpoint: str | None, digest: Any) -> MapPlan:
    """The saved map of a run into `output_dir` (digest: app.run.loading.CheckpointDigest)."""
    path = None
    if checkpoint is not None:
        with contextlib.suppress(Exception):  # a caller's model named by a checkpoint that is not a file: no size
            path = resolve_checkpoint(checkpoint)
    return MapPlan(Path(output_dir) / MAP_DIR, None if checkpoint is None else Path(str(checkpoint)).name, path,
                   options.chunk_frames, options.overlap, lambda: digest.result(timeout_s=0.0),
                   None if options.extend_map is None else Path(options.extend_map))


def _model_loader(given: Any, options: RunOptions, device: str, console: Console) -> Any:
    """How the builder gets the run's model, compiled or not: the checkpoint's, loaded, or the caller's `given`,
    prepared here unless it was."""
    if given is None:
        return lambda compile: load_model_for(options, device, console, compile=compile)
    return lambda compile: prepared_for_run(given, options, device, compile=compile)


def _after(run: Run, summary: RunSummary) -> RunSummary:
    """A run that streamed: nothing kept where it was stopped before its first frame; the report; the viewer
    kept serving where asked."""
    output_dir, viewer, console = run.writer.output_dir, run.viewer, run.console
    if summary.status == "interrupted" and summary.frames == 0:
        # stopped before its first frame: nothing was computed, so nothing is kept (not even run.json), and an
        # earlier run there is left as it was (RunWriter replaces it at the first frame)
        with interrupts_held():
            if run.writer.replaced:
                remove_run(output_dir)
            remove_if_empty(output_dir, run.created_dir)
    _report(summary, console)
    if viewer is not None and run.options.keep_viewer and summary.stop_signal is None:
        summary = dataclasses.replace(summary, viewer_closed_by=_serve_until_stopped(viewer, console))
    elif viewer is not None and summary.frames:
        console.print(f"the live viewer has closed; `stream-recon view {output_dir}` replays the run")
    return summary


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


def _serve_until_stopped(viewer: Any, console: Console) -> int:
    """Keep the viewer up after the run until Ctrl-C or SIGTERM; returns which came."""
    announce = f"viewer still serving the result at [bold]{viewer.url}[/bold]; Ctrl-C to exit"
    try:
        return wait_for_stop_signal(on_ready=lambda: console.print(announce))
    finally:
        viewer.stop()


def _report(summary: RunSummary, console: Console) -> None:
    if summary.empty_cloud is not None:  # as `export` warns of an empty export; the run's own line comes last
        console.print(f"[yellow]warning:[/yellow] points.ply holds no point: {escape(summary.empty_cloud)}")
    line = (
        f"{plural(summary.frames, 'frame')} ({plural(summary.keyframes, 'keyframe')}) at "
        f"{_rate(summary.fps)} end to end, {_rate(summary.model_fps)} in the model -> {summary.output_dir}"
    )
    if summary.loop_closure_off is not None:
        line += (f"; loop closure went off ({summary.loop_closure_off}): the trajectory keeps the corrections "
                 "accepted before, the open chain after")
    if summary.status == "complete" and summary.stop_signal is not None:
        console.print(f"[green]done[/green]: {escape(line)}; {signal_name(summary.stop_signal)} came after the last "
                      "frame and stopped nothing")
    elif summary.status == "complete":
        console.print(f"[green]done[/green]: {escape(line)}")
    elif summary.status == "interrupted" and summary.frames == 0:
        console.print(f"[yellow]interrupted[/yellow] before the first frame: nothing was written to {summary.output_dir}")
    elif summary.status == "interrupted":
        console.print(f"[yellow]interrupted[/yellow]: {escape(line)}")
    else:  # the reason on one line, as every error is given; what was kept below it
        console.print(f"[red]error:[/red] {escape(summary.error or 'the run failed')}")
        console.print(f"[red]failed[/red], kept {escape(line)}")


def _rate(fps: float) -> str:
    return f"{fps:.1f} FPS" if np.isfinite(fps) else "- FPS"


def _no_frames_message(source: FrameSource, options: RunOptions) -> str:
    """A run that ended without one frame is a failure, whatever the reason: say which selection was asked."""
    defaults = RunOptions()
    selected = [f"--{name} {getattr(options, name)}" for name in ("start", "stride", "fps")
                if getattr(options, name) != getattr(defaults, name)]
    asked = f" with {' '.join(selected)}" if selected else ""
    return f"{source.description} delivered no frame{asked}; nothing was reconstructed"


class NonFinitePrediction(ValueError):
    """The model predicted NaN or infinity for a frame: that frame and everything after it would be garbage."""


# A source, frame or disk problem mid-stream: the run ends "failed", keeping the frames before it.
_STREAM_ERRORS = (SourceError, FrameError, OutputDirError, NonFinitePrediction, HelperDown)


class FiniteCheck:
    """The first sink: a frame whose pose or depth is not finite stops the run before any sink sees it.

    NaN needs no bad checkpoint (those are refused at load): a model passed in by a caller, or half
    precision overflowing on an unusual input, produce it too, and it would poison the cache, so every
    later frame would be NaN as well. The predictions are on the host already; one sum per array is
    the whole cost (NaN and infinity survive a sum). Once tripped, it refuses every later frame too,
    so nothing after the bad frame is written.
    """

    def __init__(self, *, half_precision: bool) -> None:
        self.half_precision = half_precision
        self.failure: NonFinitePrediction | None = None

    def on_frame(self, pred: Any, stats: dict) -> None:
        if self.failure is None:
            bad = [name for name, values in (("pose", pred.pose_enc), ("camera", pred.c2w), ("depth", pred.depth))
                   if not np.isfinite(np.sum(values))]
            if bad:
                self.failure = NonFinitePrediction(self._message(pred.frame_index, " and ".join(bad)))
        if self.failure is not None:
            raise self.failure

    def close(self, status: str) -> None:
        pass

    def _message(self, frame_index: int, what: str) -> str:
        advice = (
            "try --dtype float32 (half precision overflowed)" if self.half_precision
            else "the model's weights or this input make it diverge: check the checkpoint and the frames"
        )
        return (
            f"frame {frame_index}: the model predicted NaN or infinity ({what}); stopped there, keeping "
            f"{plural(frame_index, 'frame')} before it; {advice}"
        )


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


# ----------------------------------------------------------------------------------------------
# Setup


def _as_frame_source(source: Any, options: RunOptions) -> FrameSource:
    if isinstance(source, FrameSource):
        return source
    if isinstance(source, (str, Path)):
        return open_source(
            source, options.selection(), image_width=options.image_width, open_timeout_s=options.open_timeout_s,
            reconnect_s=options.reconnect_s, rotate=options.rotate,
        )
    name = getattr(source, "name", None) or type(source).__name__
    frames = frames_source(source, options.selection(), name=str(name), image_width=options.image_width)
    frames.turn_clockwise(options.rotate)
    return frames


LIVE_CLOUDS_PER_SECOND = 8.0


def _start_viewer(options: RunOptions, console: Console, masker: Any = None) -> Any:
    if not options.viewer:
        return None
    from stream_recon.app.viewer import LiveViewer  # viser is heavy: only imported when asked for

    # A live run draws at most LIVE_CLOUDS_PER_SECOND new keyframe clouds a second (LiveViewer says why).
    viewer = LiveViewer(options.host, options.port, keep_serving=options.keep_viewer,
                        max_new_clouds_per_second=LIVE_CLOUDS_PER_SECOND, min_confidence=options.conf_threshold,
                        show=options.show, masker=masker)
    console.print(f"live viewer: [bold]{viewer.url}[/bold]")
    return viewer


def _check_selection(source: FrameSource, options: RunOptions) -> None:
    """A selection that takes no frame of a source whose length is known is refused before the model loads."""
    if source.estimated_length == 0:
        raise SourceError(
            f"--start {options.start} is past the end of {source.description}: no frame is left to reconstruct; "
            "use a smaller --start"
        )


def _source_warnings(source: FrameSource, options: RunOptions) -> list[str]:
    """What a run of `source` with `options` is warned of before it starts: a loop closure asked for that
    cannot help it, frames too small to reconstruct."""
    warnings = [loop_closure_cannot_help(options, source.estimated_length)]
    if options.flow_threshold is not None and not parse_keyframes(options.keyframes).reads_flow_threshold:
        warnings.append(f"--flow-threshold {options.flow_threshold:g} sets the flow keyframe policy's threshold and "
                        f"does nothing with --keyframes {options.keyframes}: pass --keyframes flow to use it")
    if source.frame_size is not None:
        warnings.append(too_small_warning(*source.frame_size, options.image_width))
    return [warning for warning in warnings if warning is not None]


def _settings(options: RunOptions, source: FrameSource, used: dict[str, Any], checkpoint: str | None) -> dict[str, Any]:
    """The options as the run used them: `auto` device, precision and attention resolved, compile as
    applied (never on the CPU), one value per key."""
    settings = options.as_settings()
    settings.update(
        used,
        source=source.description,
        source_kind=source.kind,
        source_location=source.location,  # export reads frames back from it when they were not saved
        checkpoint=checkpoint or "model passed in by the caller",
    )
    return settings


def _peak_gpu_memory(device: str) -> int | None:
    if not device.startswith("cuda"):
        return None
    return int(torch.cuda.max_memory_allocated(device))
