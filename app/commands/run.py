"""Reconstruct a video, an image folder, a webcam or a stream, live.

Examples:

    stream-recon                                           # the bundled sample: 14 frames, outputs/sample/
    stream-recon clip.mp4                                  # same as `stream-recon run clip.mp4`
    stream-recon frames/ --fps 10 --no-viewer -o out/frames
    stream-recon 0 --config indoor                         # webcam 0, indoor preset; Ctrl-C to stop
    stream-recon rtsp://192.168.1.20:554/stream --max-frames 2000
    stream-recon clip.mp4 --checkpoint lingbot-map.pt --keyframes flow --flow-threshold 20

Outputs (in --output, default outputs/<source name>/): predictions/NNNNNN.npz per frame as it
completes, then trajectory_tum.txt, points.ply and run.json. Ctrl-C (or SIGTERM) stops after the
current frame and saves everything done so far; a second Ctrl-C skips the final flush.

Exit codes: 0 done; 1 the run failed part-way (a damaged video, a camera gone, NaN predictions, a
full disk, or no frame at all; what was computed is kept and run.json says why); 2 bad input or
options, nothing ran; 130 Ctrl-C; 143 SIGTERM.

Without a SOURCE it runs the bundled sample (frames 0-13 of the official example scene
`courthouse`, 224x126, package data of stream_recon.app) so that a first run needs nothing but the
checkpoint. It replaces the previous sample run in outputs/sample/ unless --output or --no-overwrite
is given, and from a terminal the viewer keeps serving the result until Ctrl-C.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from rich.console import Console

from stream_recon.app.commands._options import (
    EXIT_FAILED,
    RUN_OPTION_FLAGS,
    ConfigOpt,
    OutputOpt,
    error_console,
    show_engine_log,
    takes_run_options,
    user_errors,
)

if TYPE_CHECKING:
    from stream_recon.app.pipeline import RunOptions

DEFAULT_OUTPUT_ROOT = Path("outputs")
SAMPLE_DIR = resources.files("stream_recon.app").joinpath("sample")


@takes_run_options(*RUN_OPTION_FLAGS)
def run(
    source: Annotated[
        Optional[str],
        typer.Argument(help="Video file, image folder, webcam index (0) or stream URL (rtsp://, http://). "
                       "\\[default: the bundled 14-frame sample]", show_default=False),
    ] = None,
    output: OutputOpt = None,
    config: ConfigOpt = None,
    *,
    overrides: dict[str, Any],
) -> None:
    """Reconstruct SOURCE frame by frame: poses and depth on disk as they come, live in the browser."""
    from stream_recon.app.pipeline import run_sequence
    from stream_recon.app.presets import build_options
    from stream_recon.app.sources import source_name
    from stream_recon.app.stopping import interrupted_exit_code

    console = error_console()
    show_engine_log(console)
    with user_errors(console):
        defaults = None
        if source is None:
            source, defaults = str(SAMPLE_DIR), sample_defaults(output_given=output is not None)
        options = build_options(config, overrides, defaults)
        output_dir = output if output is not None else DEFAULT_OUTPUT_ROOT / source_name(source)
        if defaults is not None:
            announce_sample(output_dir, options, console)
        summary = run_sequence(source, output_dir, options, console=console)
    if summary.status == "interrupted":
        raise typer.Exit(code=interrupted_exit_code(summary.stop_signal))
    if summary.status == "failed":
        raise typer.Exit(code=EXIT_FAILED)


def sample_defaults(*, output_given: bool) -> dict[str, Any]:
    """Defaults for a first look. Re-running the sample replaces its last result (never a folder the
    user named). From a terminal the viewer stays up after the last frame: a GPU streams all 14 in
    about a second, too fast to watch."""
    return {"overwrite": not output_given, "keep_viewer": sys.stdin.isatty()}


def announce_sample(output_dir: Path, options: RunOptions, console: Console) -> None:
    frames = sum(1 for entry in SAMPLE_DIR.iterdir() if entry.name.endswith(".png"))
    console.print(f"no SOURCE given: reconstructing the bundled sample ({frames} frames of the official "
                  f"example scene courthouse) into {output_dir}/; `stream-recon -h` shows how to run your own")
    if options.viewer and options.keep_viewer:
        console.print("the viewer keeps serving the result after the last frame; Ctrl-C to exit")
