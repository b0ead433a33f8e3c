"""Reconstruct a video, an image folder, a webcam or a stream, live.

Examples:

    stream-recon clip.mp4                                  # same as `stream-recon run clip.mp4`
    stream-recon frames/ --fps 10 --no-viewer -o out/frames
    stream-recon 0 --config indoor                         # webcam 0, indoor preset; Ctrl-C to stop
    stream-recon rtsp://192.168.1.20:554/stream --max-frames 2000
    stream-recon clip.mp4 --checkpoint lingbot-map.pt --keyframes flow --flow-threshold 20

Outputs (in --output, default outputs/<source name>/): predictions/NNNNNN.npz per frame as it
completes, then trajectory_tum.txt, points.ply and run.json. Ctrl-C (or SIGTERM) stops after the
current frame and saves everything done so far; a second Ctrl-C skips the final flush.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from stream_recon.app.commands._options import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    AttentionOpt,
    CheckpointOpt,
    CompileOpt,
    ConfigOpt,
    ConfThresholdOpt,
    DeviceOpt,
    DtypeOpt,
    FlowThresholdOpt,
    FpsOpt,
    HostOpt,
    ImageWidthOpt,
    KeepViewerOpt,
    KeyframesOpt,
    MaxFramesOpt,
    MaxGapOpt,
    OpenTimeoutOpt,
    OutputOpt,
    OverlapOpt,
    OverwriteOpt,
    PortOpt,
    ReconnectOpt,
    ScaleFramesOpt,
    StartOpt,
    StrideOpt,
    ViewerOpt,
    VoxelSizeOpt,
    WindowFramesOpt,
    WindowOpt,
    error_console,
    show_engine_log,
    user_errors,
)

DEFAULT_OUTPUT_ROOT = Path("outputs")


def run(
    source: Annotated[
        str,
        typer.Argument(help="Video file, image folder, webcam index (0) or stream URL (rtsp://, http://).",
                       show_default=False),
    ],
    output: OutputOpt = None,
    config: ConfigOpt = None,
    checkpoint: CheckpointOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    attention: AttentionOpt = None,
    compile: CompileOpt = None,
    scale_frames: ScaleFramesOpt = None,
    window: WindowOpt = None,
    window_frames: WindowFramesOpt = None,
    overlap: OverlapOpt = None,
    keyframes: KeyframesOpt = None,
    flow_threshold: FlowThresholdOpt = None,
    max_gap: MaxGapOpt = None,
    image_width: ImageWidthOpt = None,
    fps: FpsOpt = None,
    max_frames: MaxFramesOpt = None,
    start: StartOpt = None,
    stride: StrideOpt = None,
    open_timeout: OpenTimeoutOpt = None,
    reconnect: ReconnectOpt = None,
    conf_threshold: ConfThresholdOpt = None,
    voxel_size: VoxelSizeOpt = None,
    overwrite: OverwriteOpt = None,
    viewer: ViewerOpt = None,
    keep_viewer: KeepViewerOpt = None,
    host: HostOpt = None,
    port: PortOpt = None,
) -> None:
    """Reconstruct SOURCE frame by frame: poses and depth on disk as they come, live in the browser."""
    from stream_recon.app.pipeline import run_sequence
    from stream_recon.app.presets import build_options
    from stream_recon.app.sources import source_name

    console = error_console()
    show_engine_log(console)
    overrides = dict(
        checkpoint=checkpoint, device=device, dtype=dtype, attention=attention, compile=compile,
        scale_frames=scale_frames, window=window, window_frames=window_frames, overlap=overlap, keyframes=keyframes,
        flow_threshold=flow_threshold, max_gap=max_gap,
        image_width=image_width, fps=fps, max_frames=max_frames, start=start, stride=stride,
        open_timeout_s=open_timeout, reconnect_s=reconnect, conf_threshold=conf_threshold, voxel_size=voxel_size,
        overwrite=overwrite,
        viewer=viewer, keep_viewer=keep_viewer, host=host, port=port,
    )
    with user_errors(console):
        options = build_options(config, overrides)
        output_dir = output if output is not None else DEFAULT_OUTPUT_ROOT / source_name(source)
        summary = run_sequence(source, output_dir, options, console=console)
    if summary.status == "interrupted":
        raise typer.Exit(code=EXIT_INTERRUPTED)
    if summary.status == "failed":
        raise typer.Exit(code=EXIT_FAILED)
