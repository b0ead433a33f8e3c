"""Live progress of a run: frames, both frame rates, keyframes, cache, ETA.

On a terminal, a rich progress bar redrawn in place::

    clip.mp4 ━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━  412/1200  model 38.2 FPS  e2e 35.9 FPS  kf 412  cache 72 fr + 412 traj 1.9 GB  0:00:22

Anywhere else (nohup, CI, a batch's log file) a redrawn bar would print nothing until the end, so a
plain line goes out every PROGRESS_INTERVAL_S seconds (STREAM_RECON_PROGRESS_INTERVAL overrides it),
from a timer thread: a frame that takes longer than the interval (a CPU run) still shows the run is alive::

    progress: video clip.mp4: 412/1200 frames (34%), model 38.2 FPS, e2e 35.9 FPS, 412 keyframes, cache 72 frames + 412 in the trajectory (1.9 GB), elapsed 0:00:12, ETA 0:00:22

"cache" counts what attention reads: the frames whose patch tokens are cached (the scale frames and
the window) and the frames whose few camera tokens form the trajectory memory (every keyframe of the
current window).

The bar needs a length; live sources (webcam, RTSP) have none, so they get a spinner and counts only.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

PROGRESS_INTERVAL_S = 10.0
PROGRESS_INTERVAL_ENV = "STREAM_RECON_PROGRESS_INTERVAL"


class RunProgress:
    """Context manager for a run's progress; `update(stats)` once per frame read.

    stats: the engine's `stats()` plus the pipeline's `frames_read`, `frames_done`, `model_fps`,
    `fps` (end to end) and `frames_dropped`. Unknown keys are ignored, missing ones shown as "-".
    """

    def __init__(self, console: Console, description: str, total: int | None, *,
                 interval_s: float | None = None) -> None:
        if console.is_terminal:
            self._display: _Bar | _PlainLines = _Bar(console, description, total)
        else:
            self._display = _PlainLines(console, description, total, interval_s or progress_interval_s())

    def __enter__(self) -> RunProgress:
        self._display.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._display.stop()

    def update(self, stats: dict) -> None:
        self._display.update(stats)


def progress_interval_s() -> float:
    """Seconds between two plain progress lines: PROGRESS_INTERVAL_S, or the environment's choice."""
    text = os.environ.get(PROGRESS_INTERVAL_ENV, "")
    try:
        value = float(text)
    except ValueError:
        return PROGRESS_INTERVAL_S
    return value if value > 0 else PROGRESS_INTERVAL_S


class _Bar:
    """A rich progress bar on a terminal."""

    def __init__(self, console: Console, description: str, total: int | None) -> None:
        columns: list[Any] = [TextColumn("[bold]{task.description}")]
        if total is not None:
            columns += [BarColumn(), MofNCompleteColumn()]
        else:
            columns += [SpinnerColumn(), TextColumn("{task.completed} frames")]
        columns += [TextColumn("{task.fields[rates]}"), TextColumn("{task.fields[cache]}")]
        columns += [TimeRemainingColumn()] if total is not None else [TimeElapsedColumn()]
        # transient=False: the last line stays on screen as a record of the run
        self._progress = Progress(*columns, console=console, transient=False)
        self._task = self._progress.add_task(escape(_short(description)), total=total, rates="", cache="")

    def start(self) -> None:
        self._progress.start()

    def stop(self) -> None:
        self._progress.stop()

    def update(self, stats: dict) -> None:
        self._progress.update(
            self._task,
            completed=stats.get("frames_read", 0),
            rates=format_rates(stats),
            cache=format_cache(stats),
        )


class _PlainLines:
    """One line every `interval_s` seconds, printed by a timer thread from the latest stats."""

    def __init__(self, console: Console, description: str, total: int | None, interval_s: float) -> None:
        self._console = console
        self._description = description
        self._total = total
        self._interval_s = interval_s
        self._stats: dict = {}  # replaced whole by update(): the timer thread reads one consistent dict
        self._started = time.monotonic()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._print_every_interval, name="progress-log", daemon=True)

    def start(self) -> None:
        self._started = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()

    def update(self, stats: dict) -> None:
        self._stats = stats

    def _print_every_interval(self) -> None:
        # on a fixed schedule, so that lines do not drift later by the time each one takes
        next_at = self._started + self._interval_s
        while not self._stopping.wait(max(0.0, next_at - time.monotonic())):
            self._console.print(
                progress_line(self._description, self._total, self._stats, time.monotonic() - self._started),
                markup=False, highlight=False, soft_wrap=True,
            )
            next_at += self._interval_s


def progress_line(description: str, total: int | None, stats: dict, elapsed_s: float) -> str:
    """The plain progress line: what a log reader needs, in words."""
    read = stats.get("frames_read", 0)
    frames = f"{read}/{total} frames ({100 * read // total}%)" if total else f"{read} frames"
    parts = [frames]
    if stats.get("model_fps") is not None or stats.get("fps") is not None:
        parts.append(f"model {_fps(stats.get('model_fps'))}, e2e {_fps(stats.get('fps'))}")
    if "keyframes" in stats:
        parts.append(f"{stats['keyframes']} keyframes")
    if stats.get("frames_dropped"):
        parts.append(f"{stats['frames_dropped']} dropped")
    if stats.get("patch_frames") is not None:
        parts.append(
            f"cache {stats['patch_frames']} frames + {stats.get('cached_frames', '-')} in the trajectory "
            f"({_bytes(stats.get('cache_bytes'))})"
        )
    if not read:
        parts.append("waiting for the first frame")
    parts.append(f"elapsed {_clock(elapsed_s)}")
    fps = stats.get("fps")
    if total and fps:
        parts.append(f"ETA {_clock(max(0, total - read) / fps)}")
    return f"progress: {description}: " + ", ".join(parts)


def format_rates(stats: dict) -> str:
    dropped = stats.get("frames_dropped") or 0
    text = f"model {_fps(stats.get('model_fps'))}  e2e {_fps(stats.get('fps'))}  kf {stats.get('keyframes', '-')}"
    return text + (f"  [yellow]dropped {dropped}[/yellow]" if dropped else "")


def format_cache(stats: dict) -> str:
    """Frames with patch tokens in the cache (scale + window), frames in the trajectory memory, bytes."""
    patch_frames = stats.get("patch_frames")
    trajectory = stats.get("cached_frames")
    size = stats.get("cache_bytes")
    if patch_frames is None and size is None:
        return ""
    return f"cache {_or_dash(patch_frames)} fr + {_or_dash(trajectory)} traj {_bytes(size)}"


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _fps(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} FPS"


def _clock(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))


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
