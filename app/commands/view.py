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

from stream_recon.app.commands._options import RUN_OPTION_FLAGS, error_console, user_errors
from stream_recon.app.options import RunOptions

# run's --host and --port: the same help, defaults and checks
HostOpt = RUN_OPTION_FLAGS["host"]
PortOpt = RUN_OPTION_FLAGS["port"]


def view(
    run_dir: Annotated[Path, typer.Argument(help="Run directory written by `stream-recon SOURCE`.")],
    host: HostOpt = None,
    port: PortOpt = None,
) -> None:
    """Replay a finished run in the browser, with a timeline. Ctrl-C (exit code 130) or SIGTERM (143) stops it."""
    from stream_recon.app.options import check_viewer_address
    from stream_recon.app.replay import start_replay
    from stream_recon.app.rundir import check_run_dir
    from stream_recon.app.stopping import interrupted_exit_code, wait_for_stop_signal
    from stream_recon.app.writers import close_abandoned_run

    host = RunOptions.host if host is None else host
    port = RunOptions.port if port is None else port
    console = error_console()
    with user_errors(console):
        check_run_dir(run_dir)
        check_viewer_address(host, port, optional=False)
        closed = close_abandoned_run(run_dir)
        if closed is not None:
            console.print(f"note: {closed}", highlight=False)
        replay = start_replay(run_dir, host, port)
    announce = f"Replaying {replay.index.num_frames} frames at {replay.viewer.url} (Ctrl+C to stop)"
    try:
        signum = wait_for_stop_signal(on_ready=lambda: console.print(announce))
    finally:
        replay.stop()
        replay.viewer.close("complete")
        replay.viewer.stop()
    raise typer.Exit(code=interrupted_exit_code(signum))
