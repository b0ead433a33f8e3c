"""Reconstruct a video, an image folder, a webcam or a stream, live.

Examples:

    stream-recon                                           # the bundled sample: 14 frames, outputs/sample/
    stream-recon clip.mp4                                  # same as `stream-recon run clip.mp4`
    stream-recon frames/ --fps 10 --no-viewer -o out/frames
    stream-recon 0 --config indoor                         # webcam 0, indoor preset; Ctrl-C to stop
    stream-recon rtsp://192.168.1.20:554/stream --max-frames 2000
    stream-recon clip.mp4 --checkpoint lingbot-map.pt --keyframes flow --flow-threshold 20
    stream-recon walk2.mp4 --map outputs/walk -o outputs/walk2   # placed in the map of an earlier run

Outputs (in --output, default outputs/<source name>/, a new or empty folder or one holding a run to
replace with --overwrite; a folder another run is writing is refused): predictions/NNNNNN.npz per frame as it completes, then trajectory_tum.txt,
points.ply and run.json. Ctrl-C (or SIGTERM) stops after the current frame and saves everything done
so far (before the first frame: nothing is left); a second Ctrl-C skips the final flush. From a
terminal the live viewer keeps serving the result after the last frame until Ctrl-C; otherwise (or
with --no-keep-viewer) it closes, and the last line names the `view` command that replays the run.

Exit codes: 0 done; 1 the run failed part-way (a damaged video, a camera gone, NaN predictions, a
full disk, or no frame at all; what was computed is kept and run.json says why); 2 bad input or
options, nothing ran; 130 Ctrl-C (also when it closes the viewer kept serving the result); 143 SIGTERM;
129 SIGHUP (the terminal closed), 138 SIGUSR1, 140 SIGUSR2: stopped and saved as at SIGTERM.

Without a SOURCE it runs the bundled sample (frames 0-13 of the official example scene
`courthouse`, 224x126, package data of stream_recon.app) so that a first run needs nothing but the
checkpoint. It replaces an earlier run of the sample in outputs/sample/ (never a run of anything else
there) unless --output or --no-overwrite is given.
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
    import_held,
    show_engine_log,
    takes_run_options,
    user_errors,
)
from stream_recon.app.outputs.rundir import read_run_info
from stream_recon.app.stopping import interrupted_exit_code, interrupts_held

if TYPE_CHECKING:
    from stream_recon.app.options import RunOptions

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
    console = error_console()
    show_engine_log(console)
    output_dir: list[Path] = []  # where the run goes, once known
    try:
        summary = _reconstruct(source, output, config, overrides, console, output_dir)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM before the stream began, from the command's first import on
        with interrupts_held():
            where = f" to {output_dir[0]}" if output_dir else ""
            console.print(f"[yellow]interrupted[/yellow] before the first frame: nothing was written{where}")
        raise
    if summary.status == "failed":
        raise typer.Exit(code=EXIT_FAILED)
    if summary.ended_by_signal is not None:  # stopped, or its viewer closed, by Ctrl-C or SIGTERM
        raise typer.Exit(code=interrupted_exit_code(summary.ended_by_signal))


def _reconstruct(source: str | None, output: Path | None, config: str | None, overrides: dict[str, Any],
                 console: Console, output_dir: list[Path]) -> Any:
    """The run's checks, before torch is imported, then the run; its RunSummary. `output_dir` gets the run's
    folder as soon as it is known."""
    # yaml, OpenCV and onnxruntime load with these: when the command runs, never for -h
    from stream_recon.app.outputs.masks import check_frame_masks
    from stream_recon.app.run.loops import check_extended_map
    from stream_recon.app.run.presets import build_options
    from stream_recon.app.sources.opening import check_source, source_name

    with user_errors(console):
        is_sample = source is None
        if is_sample:
            source = str(SAMPLE_DIR)
        output_dir.append(output if output is not None else DEFAULT_OUTPUT_ROOT / source_name(source))
        defaults = {"keep_viewer": on_a_terminal()}
        if is_sample:
            defaults["overwrite"] = output is None and holds_sample_run(output_dir[0])
        options = build_options(config, overrides, defaults)
        # a mistyped path or a file that is no video is said before torch's 2-5 s import (the pipeline's); the
        # source is opened there, once (a file source twice with --mask-dir: its length and size for the masks)
        check_source(source)
        check_frame_masks(source, options)
        check_extended_map(options, output_dir[0])
        run_sequence = import_held("stream_recon.app.run.pipeline").run_sequence
        if is_sample:
            announce_sample(output_dir[0], options, console)
        return run_sequence(source, output_dir[0], options, console=console)


def on_a_terminal() -> bool:
    """A person at a terminal: the viewer then keeps serving the result after the last frame (a GPU
    streams the 14 sample frames in about a second, too fast to watch), until Ctrl-C."""
    return sys.stdin.isatty() and sys.stderr.isatty()


def holds_sample_run(output_dir: Path) -> bool:
    """Whether `output_dir` holds a run of the bundled sample, which a new sample run replaces; a run of
    anything else there (the user's own folder named `sample`) is refused as any existing run is."""
    location = read_run_info(output_dir).get("settings", {}).get("source_location")
    return location is not None and Path(location) == Path(str(SAMPLE_DIR)).resolve()


def announce_sample(output_dir: Path, options: RunOptions, console: Console) -> None:
    frames = sum(1 for entry in SAMPLE_DIR.iterdir() if entry.name.endswith(".png"))
    console.print(f"no SOURCE given: reconstructing the bundled sample ({frames} frames of the official "
                  f"example scene courthouse) into {output_dir}/; `stream-recon -h` shows how to run your own")
    if options.viewer and options.keep_viewer:
        console.print("the viewer keeps serving the result after the last frame; Ctrl-C to exit")
