"""One run: a source streamed through the engine into the run directory and any other sinks.

This module holds what runs once: the checks and refusals before anything is loaded (`RunPlan`), the set-up
of the run's pieces, and what follows its end (the report, the viewer kept serving). The loop over the
frames and the run's end are app.run.streaming's (`Run`). The other parts have their own homes: options
(app.options), the output folder (app.outputs.output_folder), the model and engine (app.run.loading), the
clock (app.run.clock), Ctrl-C and SIGTERM (app.stopping), the files (app.outputs.writers).

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
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from stream_recon.app.outputs.output_folder import (
    prepare_output_dir,
    remove_if_empty,
    unlock_run_dir,
)
from stream_recon.app.outputs.rundir import remove_run
from stream_recon.app.outputs.sky import SKY_NETWORK_SMS, SkyModelError, SkySegmenter, sky_network_path
from stream_recon.app.outputs.writers import RunWriter
from stream_recon.app.run.clock import RunClock
from stream_recon.app.run.finite_check import FiniteCheck, plural
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
from stream_recon.app.run.resources import check_cpu_run
from stream_recon.app.run.streaming import Run, RunSummary, Sink
from stream_recon.app.sources.frames import SourceError
from stream_recon.app.sources.input_size import model_input_size, too_small_warning
from stream_recon.app.sources.opening import open_source
from stream_recon.app.sources.reader import FrameSource
from stream_recon.app.sources.readers import frames_source
from stream_recon.app.stopping import (
    interrupts_held,
    signal_name,
    signals_noted,
    wait_for_stop_signal,
)
from stream_recon.models import DEFAULT_CHECKPOINT, MAP_DIR, parse_keyframes, partitioned_stream
from stream_recon.models.builds.plan import Builder, BuildSettings
from stream_recon.models.hub_paths import resolve_checkpoint


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
