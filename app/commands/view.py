"""`stream-recon view RUN_DIR`: replay a finished run in the browser, with a timeline and play/pause.

Examples:
    stream-recon view outputs/office
    stream-recon view outputs/office --port 8090
    stream-recon view outputs/office --show splats   # a Gaussian splat per point instead of points
    stream-recon view outputs/street --mask-sky      # the sky left out of a run that was not masked

The replay itself (indexing, the timeline, loading keyframes behind a seek, how it was measured):
app/viewer/replay.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from stream_recon.app.commands._options import (
    RUN_OPTION_FLAGS,
    bad_input,
    error_console,
    show_engine_log,
    user_errors,
)
from stream_recon.app.options import SHOW_CHOICES, RunOptions, check_viewer_address
from stream_recon.app.outputs.abandoned import close_abandoned_run
from stream_recon.app.outputs.rundir import check_run_dir
from stream_recon.app.stopping import interrupted_exit_code, wait_for_stop_signal

# run's --host and --port: the same help, defaults and checks
HostOpt = RUN_OPTION_FLAGS["host"]
PortOpt = RUN_OPTION_FLAGS["port"]
ShowOpt = RUN_OPTION_FLAGS["show"]


def view(
    run_dir: Annotated[Path, typer.Argument(help="Run directory written by `stream-recon SOURCE`.")],
    host: HostOpt = None,
    port: PortOpt = None,
    show: ShowOpt = None,
    mask_sky: Annotated[
        bool, typer.Option("--mask-sky", help="Leave the sky out of a run that was not masked (as `run --mask-sky`).")
    ] = False,
) -> None:
    """Replay a finished run in the browser, with a timeline. Ctrl-C (exit code 130) or SIGTERM (143) stops it."""
    # viser and OpenCV load with it: when the command runs, never for -h
    from stream_recon.app.viewer.replay import start_replay

    host = RunOptions.host if host is None else host
    port = RunOptions.port if port is None else port
    show = RunOptions.show if show is None else show
    console = error_console()
    show_engine_log(console)  # a damaged file skipped, a voxel raised: `warning:` lines
    with user_errors(console):
        if show not in SHOW_CHOICES:
            bad_input(console, f"--show must be one of {', '.join(SHOW_CHOICES)}, got {show!r}")
        check_run_dir(run_dir)
        check_viewer_address(host, port, optional=False)
        closed = close_abandoned_run(run_dir)
        if closed is not None:
            console.print(f"note: {closed}", highlight=False)
        masker = sky_masker(mask_sky)
        replay = start_replay(run_dir, host, port, show=show, masker=masker)
    announce = f"Replaying {replay.index.num_frames} frames at {replay.viewer.url} (Ctrl+C to stop)"
    try:
        signum = wait_for_stop_signal(on_ready=lambda: console.print(announce))
    finally:
        replay.stop()
        replay.viewer.close("complete")
        replay.viewer.stop()
    raise typer.Exit(code=interrupted_exit_code(signum))


def sky_masker(mask_sky: bool):
    """The live viewer's masker of `view --mask-sky` (app.outputs.masks), None without it; OptionsError when the sky
    network cannot be had."""
    if not mask_sky:
        return None
    # OpenCV (onnxruntime for the sky): only when a replay masks its frames
    from stream_recon.app.outputs.masks import sky_masker as masker_of_the_sky

    return masker_of_the_sky(RunOptions.image_width)
