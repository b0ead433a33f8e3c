"""Live progress of a run on the terminal: frames, both frame rates, keyframes, cache, ETA.

    clip.mp4 ━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━  412/1200  model 38.2 FPS  e2e 35.9 FPS  kf 412  cache 72 fr 1.9 GB  0:00:22

The bar needs a length; live sources (webcam, RTSP) have none, so they get a spinner and counts only.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class RunProgress:
    """Context manager around a rich Progress; `update(stats)` once per frame read.

    stats: the engine's `stats()` plus the pipeline's `frames_read`, `frames_done`, `model_fps`,
    `fps` (end to end) and `frames_dropped`. Unknown keys are ignored, missing ones shown as "-".
    """

    def __init__(self, console: Console, description: str, total: int | None) -> None:
        self._total = total
        columns: list[Any] = [TextColumn("[bold]{task.description}")]
        if total is not None:
            columns += [BarColumn(), MofNCompleteColumn()]
        else:
            columns += [SpinnerColumn(), TextColumn("{task.completed} frames")]
        columns += [TextColumn("{task.fields[rates]}"), TextColumn("{task.fields[cache]}")]
        columns += [TimeRemainingColumn()] if total is not None else [TimeElapsedColumn()]
        # transient=False: the last line stays on screen as a record of the run
        self._progress = Progress(*columns, console=console, transient=False)
        self._task = self._progress.add_task(_short(description), total=total, rates="", cache="")

    def __enter__(self) -> RunProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._progress.stop()

    def update(self, stats: dict) -> None:
        self._progress.update(
            self._task,
            completed=stats.get("frames_read", 0),
            rates=format_rates(stats),
            cache=format_cache(stats),
        )


def format_rates(stats: dict) -> str:
    dropped = stats.get("frames_dropped") or 0
    text = f"model {_fps(stats.get('model_fps'))}  e2e {_fps(stats.get('fps'))}  kf {stats.get('keyframes', '-')}"
    return text + (f"  [yellow]dropped {dropped}[/yellow]" if dropped else "")


def format_cache(stats: dict) -> str:
    cached = stats.get("cached_frames")
    size = stats.get("cache_bytes")
    if cached is None and size is None:
        return ""
    return f"cache {cached if cached is not None else '-'} fr {_bytes(size)}"


def _fps(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} FPS"


def _bytes(count: int | None) -> str:
    if count is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1024 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GB"


def _short(description: str, width: int = 40) -> str:
    return description if len(description) <= width else "…" + description[-(width - 1) :]
