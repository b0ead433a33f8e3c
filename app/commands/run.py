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
from typing import Annotated, Any

import typer

from stream_recon.app.commands._options import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    RUN_OPTION_FLAGS,
    ConfigOpt,
    OutputOpt,
    error_console,
    show_engine_log,
    takes_run_options,
    user_errors,
)

DEFAULT_OUTPUT_ROOT = Path("outputs")


@takes_run_options(*RUN_OPTION_FLAGS)
def run(
    source: Annotated[
        str,
        typer.Argument(help="Video file, image folder, webcam index (0) or stream URL (rtsp://, http://).",
                       show_default=False),
    ],
    output: OutputOpt = None,
    config: ConfigOpt = None,
    *,
    overrides: dict[str, Any],
) -> None:
    """Reconstruct SOURCE frame by frame: poses and depth on disk as they come, live in the browser."""
    from stream_recon.app.pipeline import run_sequence
    from stream_recon.app.presets import build_options
    from stream_recon.app.sources import source_name

    console = error_console()
    show_engine_log(console)
    with user_errors(console):
        options = build_options(config, overrides)
        output_dir = output if output is not None else DEFAULT_OUTPUT_ROOT / source_name(source)
        summary = run_sequence(source, output_dir, options, console=console)
    if summary.status == "interrupted":
        raise typer.Exit(code=EXIT_INTERRUPTED)
    if summary.status == "failed":
        raise typer.Exit(code=EXIT_FAILED)
