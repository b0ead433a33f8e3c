"""Stopping a run cleanly: Ctrl-C and SIGTERM become "finish this frame, flush, save"."""

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
        name = signal.Signals(signum).name
        if self.count == 1:
            self._on_first()
            self._console.print(f"[yellow]{name}: stopping after this frame and saving (again: stop now)[/yellow]")
        elif self.count == 2:
            self._console.print(f"[yellow]{name}: stopping now; writing the files of the frames done[/yellow]")
            raise KeyboardInterrupt
