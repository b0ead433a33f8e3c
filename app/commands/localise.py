"""`stream-recon localise`: frames placed in a finished run's map.

Each query frame (a picture, a folder of them, or a video) is placed in the run's world: the run's keyframes
that look alike are retrieved from its map, the run's model runs on their pictures and then the query's, and
the query is checked against them and fitted by a Sim(3) as loop closure checks and fits a revisit. Written
into the output folder (RUN/localised/ by default; nothing else of the run changes): poses_tum.txt, the
placed frames in the run's world (TUM format, as trajectory_tum.txt), and verdicts.json, every frame placed
or not and why (no keyframe looks alike, too few matches, the geometric check, 3D disagreement, a look-alike).
Needs the run's map (a run with loop closure); the run's checkpoint, read from its run.json unless given.
A run placed in an earlier run's map (`run --map`) serves that run's keyframes too.

Examples:
    stream-recon localise outputs/kitchen photos/          # every picture in photos/
    stream-recon localise outputs/kitchen later.mp4 -o outputs/kitchen-later
    stream-recon localise outputs/kitchen IMG_0042.jpg --device cpu

Exit codes: 0 done (the verdicts say which frames were placed); 2 bad input (a run without a map, a map
of another checkpoint, frames that cannot be read); 130 Ctrl-C; 143 SIGTERM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from stream_recon.app.commands._options import error_console, user_errors


def localise(
    run_dir: Annotated[Path, typer.Argument(help="Run directory written by `stream-recon run` with loop closure.")],
    frames: Annotated[list[str], typer.Argument(help="Query frames: picture files, image folders or videos.")],
    output: Annotated[
        Optional[Path],
        typer.Option("-o", "--output", help="Folder for poses_tum.txt and verdicts.json. Default: RUN/localised."),
    ] = None,
    checkpoint: Annotated[
        Optional[str], typer.Option(help="The run's checkpoint, where its run.json's is elsewhere now.")
    ] = None,
    device: Annotated[Optional[str], typer.Option(help="auto | cpu | cuda | cuda:N. Default: auto.")] = None,
) -> None:
    """Place query frames in a finished run's map: a pose in the run's world for each, or why not."""
    # OpenCV and the run's readers load with it (torch with the model, once the input is checked): when the
    # command runs, never for -h
    from stream_recon.app.run import localise as localised

    console = error_console()
    columns = (SpinnerColumn(), TextColumn("placing frames: {task.completed} done"), TimeElapsedColumn())
    with user_errors(console, localised.LocaliseError), Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("placing", total=None)
        result = localised.localise_run(run_dir, frames, output, checkpoint, device,
                                        lambda done, total: bar.update(task, completed=done, total=total))
    if result.context_note:
        console.print(f"[dim]{escape(result.context_note)}[/dim]", highlight=False)
    console.print(escape(result.summary_line()), highlight=False)
