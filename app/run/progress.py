"""Live progress of a run: frames, ETA, frame rate, keyframes, cache memory.

On a terminal, a rich progress bar redrawn in place, what matters first so that an 80-column terminal
keeps the count and the ETA (the source's name comes last and is the part shortened)::

    412/1200  0:00:22 left ━━━━━━━━━━━━━━━━━━  35.9 FPS  412 kf  cache 1.90 GiB  video clip.mp4

Anywhere else (nohup, CI, a batch's log file) a redrawn bar would print nothing until the end, so a
plain line goes out every PROGRESS_INTERVAL_S seconds (STREAM_RECON_PROGRESS_INTERVAL overrides it),
from a timer thread: a frame that takes longer than the interval (a CPU run) still shows the run is alive::

    progress: 412/1200 frames (34%), ETA 0:00:22, 35.9 FPS (model 38.2), 412 keyframes, attention cache 72 frames 1.90 GiB, elapsed 0:00:12: video clip.mp4

The keyframes are the run's so far. The cache is what attention reads: the frames whose patch tokens it keeps
(the scale frames and the window) and its size in memory; a long stream's next chunk starts with a fresh cache,
so its count starts again there (the line names the chunk from the second on). The frames whose few camera
tokens it also keeps are in run.json.

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
from rich.table import Column

from stream_recon.models.stream.memory import format_bytes
from stream_recon.models.supervision import Helper, HelperPolicy, WhenDown, WhenFull, start_supervised_thread

PROGRESS_INTERVAL_S = 10.0
PROGRESS_INTERVAL_ENV = "STREAM_RECON_PROGRESS_INTERVAL"


# The progress thread wakes at once when stopped; a line it is printing (a blocked terminal) is not waited out.
PRINT_JOIN_S = 1.0
# The thread that draws the progress (rich's refresh thread on a terminal, the plain lines' timer elsewhere) is a
# helper of the run: it shows the latest stats (latest wins), and one that raises turns the progress display off
# with one warning line while the run goes on. Nothing waits for it but its stop (PRINT_JOIN_S), so it has no stall
# limit of its own: the limit is that join's.
PROGRESS_POLICY = HelperPolicy("the progress display", WhenFull.LATEST, WhenDown.TURN_OFF, stall_s=PRINT_JOIN_S)


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
        self.helper = Helper(PROGRESS_POLICY, self._display.threads)

    def __enter__(self) -> RunProgress:
        self._display.start(self.helper)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._display.stop()

    def update(self, stats: dict) -> None:
        self._display.update(stats)

    def helpers(self) -> dict[str, Helper]:
        """The thread that draws the progress, by run.json's name."""
        return {"progress": self.helper}


def progress_interval_s() -> float:
    """Seconds between two plain progress lines: PROGRESS_INTERVAL_S, or the environment's choice."""
    text = os.environ.get(PROGRESS_INTERVAL_ENV, "")
    try:
        value = float(text)
    except ValueError:
        return PROGRESS_INTERVAL_S
    return value if value > 0 else PROGRESS_INTERVAL_S


class _Bar:
    """A rich progress bar on a terminal: count, time, bar, rate, keyframes, cache, then the source's name,
    which alone is shortened when the terminal is narrow."""

    def __init__(self, console: Console, description: str, total: int | None) -> None:
        columns: list[Any] = []
        if total is not None:
            columns += [MofNCompleteColumn(), TimeRemainingColumn(compact=True), TextColumn("left"),
                        BarColumn(bar_width=16)]
        else:
            columns += [TextColumn("{task.completed} frames"), TimeElapsedColumn(), SpinnerColumn()]
        columns += [TextColumn("{task.fields[rates]}"), TextColumn("{task.fields[cache]}"),
                    TextColumn("[bold]{task.description}", table_column=Column(no_wrap=True, overflow="ellipsis",
                                                                              ratio=1))]
        # transient=False: the last line stays on screen as a record of the run
        self._progress = Progress(*columns, console=console, transient=False, expand=True)
        self._task = self._progress.add_task(escape(description), total=total, rates="", cache="")
    def start(self, helper: Helper) -> None:
        self._progress.start()

    def threads(self) -> list[threading.Thread]:
        """rich's refresh thread, while it runs (rich names none of its threads: read from its Live)."""
        thread = getattr(self._progress.live, "_refresh_thread", None)
        return [] if thread is None else [thread]

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
        self._thread: threading.Thread | None = None

    def start(self, helper: Helper) -> None:
        self._started = time.monotonic()
        self._thread = start_supervised_thread(helper, self._print_every_interval, "progress-log")

    def threads(self) -> list[threading.Thread]:
        """None but the timer thread, which `start` records as the helper's."""
        return []

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=PRINT_JOIN_S)

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
    """The plain progress line: what a log reader needs, in words, the count and the ETA first."""
    read = stats.get("frames_read", 0)
    parts = [f"{read}/{total} frames ({100 * read // total}%)" if total else f"{read} frames"]
    fps = stats.get("fps")
    if total and fps:
        parts.append(f"ETA {_clock(max(0, total - read) / fps)}")
    if stats.get("model_fps") is not None or fps is not None:
        parts.append(f"{_fps(fps)} (model {_fps(stats.get('model_fps'), unit='')})")
    if "keyframes" in stats:
        parts.append(f"{stats['keyframes']} keyframes")
    if stats.get("frames_dropped"):
        parts.append(f"{stats['frames_dropped']} dropped")
    if stats.get("patch_frames") is not None:  # the chunk's own: a new chunk starts with a fresh cache
        chunk = f" in chunk {stats['chunk_index']}" if stats.get("chunk_index") else ""
        parts.append(f"attention cache {stats['patch_frames']} frames{chunk} {_bytes(stats.get('cache_bytes'))}")
    if not read:
        parts.append("waiting for the first frame")
    parts.append(f"elapsed {_clock(elapsed_s)}")
    return "progress: " + ", ".join(parts) + f": {description}"


def format_rates(stats: dict) -> str:
    """The bar's rate: frames per second end to end, the keyframes, frames a live source dropped."""
    dropped = stats.get("frames_dropped") or 0
    text = f"{_fps(stats.get('fps'))}  {stats.get('keyframes', '-')} kf"
    return text + (f"  [yellow]{dropped} dropped[/yellow]" if dropped else "")


def format_cache(stats: dict) -> str:
    """The memory attention's cache takes (its frame counts are in the plain line and run.json)."""
    size = stats.get("cache_bytes")
    return "" if size is None else f"cache {_bytes(size)}"


def _fps(value: float | None, unit: str = " FPS") -> str:
    return "-" if value is None else f"{value:.1f}{unit}"


def _clock(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))


def _bytes(count: int | None) -> str:
    return "-" if count is None else format_bytes(count)


