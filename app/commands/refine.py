"""`stream-recon refine`: a finished run's map refined offline, in place.

Every keyframe the run kept is indexed (the stream indexes one in 16 frames), its loops verified as the
stream verifies them, and a pose graph of chunk segments (64 frames each) solved from scratch; the
predictions, trajectory_tum.txt and points.ply are then rebuilt from the refined poses (exports and `view`
read them), the stream's trajectory kept as trajectory_stream_tum.txt and run.json's summary.refine saying
what was done. The run's files stay as they were until the refined ones are all written; a refine stopped
before (Ctrl-C, SIGTERM) leaves the run exactly as it was. Needs the run's map (a run with loop closure) and
its pictures (not --no-save-images); a run is refined once.

Examples:
    stream-recon refine outputs/kitchen
    stream-recon refine outputs/kitchen --workers 4   # threads for features, checks and the frames' files

Exit codes: 0 refined; 2 bad input, or a worker that died or hung (the run is left as it was); 130 Ctrl-C;
143 SIGTERM.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from stream_recon.app.commands._options import error_console, user_errors

STAGES = {"keyframes": "indexing keyframes", "loops": "checking loop pairs", "frames": "writing refined frames"}


def refine(
    run_dir: Annotated[Path, typer.Argument(help="Run directory written by `stream-recon run` with loop closure.")],
    workers: Annotated[
        Optional[int],
        typer.Option(min=1, help="Worker threads (each with a child process) for keyframe features, loop checks and moving the frames' files. Default: the CPU cores, at most 16."),
    ] = None,
) -> None:
    """Refine a finished run offline: every keyframe indexed, loops verified, a finer pose graph solved, the
    outputs rebuilt from the refined poses."""
    # OpenCV, GTSAM and the run's readers load with it: when the command runs, never for -h
    from stream_recon.app.outputs import refined

    console = error_console()
    config = refined.RefineConfig() if workers is None else replace(refined.RefineConfig(), workers=workers)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with user_errors(console, refined.RefineError), Progress(*columns, console=console, transient=True) as bar:
        tasks: dict[str, int] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(STAGES.get(stage, stage), total=total)
            bar.update(tasks[stage], completed=done, total=total)

        result = refined.refine_run(run_dir, config, progress)
    figures = result.figures
    console.print(f"refined {run_dir}: {result.frames} frames, {figures.keyframes_indexed} keyframes indexed, "
                  f"{figures.loops_accepted} of {figures.loops_verified + figures.stream_loops} verified loops "
                  f"({figures.stream_loops} the stream's) accepted over "
                  f"{figures.nodes} segments of {figures.chunks} chunks in {result.seconds:.1f} s", highlight=False)
