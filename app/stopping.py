"""Stopping a run cleanly: Ctrl-C and SIGTERM become "finish this frame, flush, save".

A stopped run exits as a signal's default action would have been reported by a shell, 128 + the
signal's number: 130 for Ctrl-C (SIGINT), 143 for SIGTERM, so that a supervisor (systemd, a batch
scheduler, `timeout`) sees the signal it sent.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from rich.console import Console


class StopOnSignal:
    """First SIGINT/SIGTERM: finish the current frame, flush, save. Second: stop flushing, save.
    Any further one is ignored, so the files being written are not cut off.

    Handlers can only be installed from the main thread; elsewhere (a batch worker thread) the
    caller's own handling applies and this does nothing.
    """

    _SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, on_first: Any, console: Console) -> None:
        self._on_first = on_first
        self._console = console
        self._previous: dict[int, Any] = {}
        self.count = 0
        self.signum: int | None = None  # the first signal received

    @property
    def requested(self) -> bool:
        return self.count > 0

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for signum in self._SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: object) -> None:
        self.count += 1
        self.signum = self.signum or signum
        name = signal.Signals(signum).name
        if self.count == 1:
            self._on_first()
            self._console.print(f"[yellow]{name}: stopping after this frame and saving (again: stop now)[/yellow]")
        elif self.count == 2:
            self._console.print(f"[yellow]{name}: stopping now; writing the files of the frames done[/yellow]")
            raise KeyboardInterrupt


def interrupted_exit_code(signum: int | None) -> int:
    """The exit code of a run stopped by `signum` (None: Ctrl-C, as Python reports a KeyboardInterrupt)."""
    return 128 + (signum or signal.SIGINT)


def signal_name(signum: int | None) -> str | None:
    return None if signum is None else signal.Signals(signum).name
