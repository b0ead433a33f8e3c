"""`stream-recon view RUN_DIR`: replay a finished run in the browser, with a timeline and play/pause.

Examples:
    stream-recon view outputs/office
    stream-recon view outputs/office --port 8090

The replay itself (indexing, the timeline, loading keyframes behind a seek, how it was measured):
app/replay.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from stream_recon.app.commands._options import error_console, user_errors


def view(
    run_dir: Annotated[Path, typer.Argument(help="Run directory written by `stream-recon SOURCE`.")],
    host: Annotated[
        str, typer.Option(help="Address to serve on; 0.0.0.0 exposes it to the network.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to serve on (the next free one if taken).")] = 8080,
) -> None:
    """Replay a finished run in the browser, with a timeline. Ctrl-C (exit code 130) or SIGTERM (143) stops it."""
    from stream_recon.app.options import check_viewer_address
    from stream_recon.app.replay import start_replay
    from stream_recon.app.rundir import check_run_dir
    from stream_recon.app.stopping import interrupted_exit_code, wait_for_stop_signal

    console = error_console()
    with user_errors(console):
        check_run_dir(run_dir)
        check_viewer_address(host, port, optional=False)
        replay = start_replay(run_dir, host, port)
    announce = f"Replaying {replay.index.num_frames} frames at {replay.viewer.url} (Ctrl+C to stop)"
    try:
        signum = wait_for_stop_signal(on_ready=lambda: console.print(announce))
    finally:
        replay.stop()
        replay.viewer.close("complete")
        replay.viewer.stop()
    raise typer.Exit(code=interrupted_exit_code(signum))
