"""Stopping cleanly: Ctrl-C and SIGTERM become "finish this frame, flush, save" during a run, and end
every command at once before and after one.

A stopped command exits as a signal's default action would have been reported by a shell, 128 + the
signal's number: 130 for Ctrl-C (SIGINT), 143 for SIGTERM, 129 for SIGHUP (its terminal closed), 138 and 140
for SIGUSR1 and SIGUSR2, so that a supervisor (systemd, a batch scheduler, `timeout`) sees the signal it sent.
They stop a run alike.

Three phases, one handler each:
- from the start of the CLI until a run's stream (imports, checks, the model load): PromptInterrupt.
  Ctrl-C or SIGTERM raises KeyboardInterrupt as Python's own handler does for Ctrl-C, so that whatever
  the command made so far is undone on the way out (a run's output folder: stopped before its first
  frame, a run leaves nothing), and raises it again every half second until the program has stopped,
  because a library can swallow one: an import inside `except BaseException` (trimesh's optional imports
  are written so) loses a KeyboardInterrupt that lands in it, and the run went on as if Ctrl-C had never
  been pressed. While torch and Triton are imported (`interrupts_held`) a signal waits for the import to
  end: raised inside their native set-up it became a C++ exception that aborted the process (exit -6);
- while frames stream: StopOnSignal (finish the frame, flush, save);
- a viewer serving until it is stopped (`view`, a run kept on screen): wait_for_stop_signal.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NoReturn

from stream_recon.models.supervision import Helper, HelperPolicy, WhenDown, WhenFull, start_supervised_thread

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.console import Console

# SIGHUP: the terminal the run was started from closed (an SSH session dropped, a window shut); SIGUSR1 and
# SIGUSR2, whose default action also ends the process, are what some schedulers send ahead of a kill (Slurm's
# --signal). Each stops and saves as SIGTERM does instead of ending the process with nothing but its npz files.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
REDELIVERY_INTERVAL_S = 0.5
# A run stops within 10 s of its first SIGINT or SIGTERM: supervisors (timeout, systemd, Kubernetes)
# send SIGKILL a few seconds after one SIGTERM. The stream gets STOP_STREAM_S to finish its frame and
# what the engine buffers; then it stops as at a second signal, and closing (loop closure ended, the
# last frames written, trajectory, cloud and run.json) has the rest: STOP_CLOSE_S.
STOP_STREAM_S = 5.0
STOP_CLOSE_S = 4.0
# The thread that delivers a swallowed signal again: one that raises leaves the signal delivered once.
REDELIVERY_POLICY = HelperPolicy("the stop signal's redelivery", WhenFull.DROP, WhenDown.TURN_OFF,
                                 stall_s=REDELIVERY_INTERVAL_S)


class PromptInterrupt:
    """Ctrl-C or SIGTERM ends the program promptly even where a library swallows a KeyboardInterrupt
    (module doc).

    The first SIGINT or SIGTERM raises KeyboardInterrupt and starts a thread that delivers the same signal
    to the main thread again every REDELIVERY_INTERVAL_S until `honoured()` (the CLI is exiting) or until
    another handler owns that signal (a run's StopOnSignal, which then treats the pending one as its
    first). `signum` says which came, for the exit code (128 + it). Main thread only.
    """

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}
        self._requested = threading.Event()
        self._honoured = threading.Event()
        self._deferring = False
        self._deferred: int | None = None
        self.signum: int | None = None  # the first signal received
        self.helper = Helper(REDELIVERY_POLICY)

    def __enter__(self) -> PromptInterrupt:
        global _active
        self._previous = {signum: signal.signal(signum, self._raise) for signum in STOP_SIGNALS}
        _active = self
        return self

    def __exit__(self, *exc_info: object) -> None:
        global _active
        self.honoured()
        _active = None
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._raise:
                signal.signal(signum, previous)

    @property
    def pending(self) -> bool:
        """A signal came and the program has not stopped for it (a library swallowed it)."""
        return self._requested.is_set() and not self._honoured.is_set()

    def honoured(self) -> None:
        self._honoured.set()

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Hold a signal until the block ends, then raise it: for imports of native libraries (torch, Triton),
        whose module set-up turns a KeyboardInterrupt raised inside it into a C++ exception that aborts the
        process (SIGABRT, exit -6) instead of exiting 130 or 143; and for clean-ups that must finish. Blocks
        nest: the signal is raised when the outermost ends."""
        outermost = not self._deferring
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = not outermost
        if outermost and self._deferred is not None:
            signum, self._deferred = self._deferred, None
            self._raise(signum, None)

    def _raise(self, signum: int, frame: object) -> None:
        if self._deferring:
            self._deferred = self._deferred or signum
            return
        if not self._requested.is_set():
            self.signum = signum
            self._requested.set()
            start_supervised_thread(self.helper, self._redeliver, "interrupt-redelivery")
        raise KeyboardInterrupt

    def _redeliver(self) -> None:
        while not self._honoured.wait(REDELIVERY_INTERVAL_S):
            if signal.getsignal(self.signum) != self._raise:
                return  # StopOnSignal owns the signal now and has taken the pending one as its first
            # a real signal, not _thread.interrupt_main: that one waits for a blocking call (a sleep, a read)
            # to return before it is raised
            signal.pthread_kill(threading.main_thread().ident, self.signum)


_active: PromptInterrupt | None = None  # the CLI's, while it runs


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """The CLI's PromptInterrupt.deferred (nothing to hold outside the CLI)."""
    if _active is None:
        yield
        return
    with _active.deferred():
        yield


def swallowed_signal() -> int | None:
    """The signal still owed a stop (see PromptInterrupt.pending), or None."""
    return _active.signum if _active is not None and _active.pending else None


class StopOnSignal:
    """First stop signal (STOP_SIGNALS): finish the current frame, flush, save; if the stream has not stopped
    STOP_STREAM_S later, it stops as at a second signal. Second: stop streaming now, save. A signal
    raises KeyboardInterrupt only inside `streaming()`; elsewhere (the run closing) it raises nothing, so
    the files being written are not cut off, and the close's waits give up once `requested`.

    Handlers can only be installed from the main thread; elsewhere (a batch worker thread) the
    caller's own handling applies and this does nothing.
    """

    _SIGNALS = STOP_SIGNALS

    def __init__(self, on_first: Any, console: Console, noted: list[int] | None = None,
                 stop_stream_s: float | None = None) -> None:
        """noted: the signals_noted list this takes over from: one noted before this began is its first.
        stop_stream_s: how long the stream may go on after the first signal (None: STOP_STREAM_S)."""
        self.stop_stream_s = STOP_STREAM_S if stop_stream_s is None else stop_stream_s
        self._on_first = on_first
        self._console = console
        self._noted = noted
        self._previous: dict[int, Any] = {}
        self._streaming = False
        self.count = 0
        self.signum: int | None = None  # the first signal received

    @property
    def requested(self) -> bool:
        return self.count > 0

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for signum in self._SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
            self._previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, self._stream_overran)
            swallowed = swallowed_signal()
            if swallowed is not None:  # a signal before the stream, lost in a library: stop before the first frame
                _active.honoured()
                self.count, self.signum = 1, swallowed
                self._on_first()
            elif self._noted:  # one noted in the instant before these handlers: the same
                self.count, self.signum = 1, self._noted.pop(0)
                self._on_first()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._cancel_alarm()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    @contextlib.contextmanager
    def streaming(self) -> Iterator[None]:
        """The block where a second signal, or a stream that overran `stop_stream_s`, raises KeyboardInterrupt."""
        self._streaming = True
        try:
            yield
        finally:
            self._streaming = False
            self._cancel_alarm()

    def _handle(self, signum: int, frame: object) -> None:
        self.count += 1
        self.signum = self.signum or signum
        name = signal.Signals(signum).name
        if self.count == 1:
            self._on_first()
            if self._streaming:
                signal.setitimer(signal.ITIMER_REAL, self.stop_stream_s)
            self._say(f"[yellow]{name}: stopping after this frame and saving (again: stop now)[/yellow]")
        elif self.count == 2:
            self._say(f"[yellow]{name}: stopping now; writing the files of the frames done[/yellow]")
            if self._streaming:
                raise KeyboardInterrupt

    def _say(self, line: str) -> None:
        # after SIGHUP the terminal may be gone: a line it cannot take must not stop the saving
        with contextlib.suppress(OSError):
            self._console.print(line)

    def _stream_overran(self, signum: int, frame: object) -> None:
        if not self._streaming or self.count != 1:
            return
        self.count = 2
        self._say(f"[yellow]still streaming {self.stop_stream_s:g} s after {signal_name(self.signum)}: "
                            "stopping now; writing the files of the frames done[/yellow]")
        raise KeyboardInterrupt

    def _cancel_alarm(self) -> None:
        if signal.SIGALRM in self._previous:
            signal.setitimer(signal.ITIMER_REAL, 0)


@contextlib.contextmanager
def signals_noted() -> Iterator[list[int]]:
    """Stop signals noted in the list it gives, none raised: a run's last steps once its record is written
    (run.json), where a signal stops nothing, so that run.json, the last line and the exit code stay as
    they were. Handlers installed inside (StopOnSignal, a viewer kept serving) take over and hand back.
    Main thread only; elsewhere it notes nothing and the caller's handling applies."""
    noted: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield noted
        return
    previous = {signum: signal.signal(signum, lambda signum, frame: noted.append(signum)) for signum in STOP_SIGNALS}
    try:
        yield noted
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def interrupted_exit_code(signum: int | None) -> int:
    """The exit code of a run stopped by `signum` (None: Ctrl-C, as Python reports a KeyboardInterrupt)."""
    return 128 + (signum or signal.SIGINT)


def signal_name(signum: int | None) -> str | None:
    return None if signum is None else signal.Signals(signum).name


def wait_for_stop_signal(on_ready: Callable[[], None] | None = None) -> int:
    """Block until a stop signal (STOP_SIGNALS) arrives (main thread); returns which. A server that runs until it is
    stopped (`view`, a run's viewer kept serving) exits with interrupted_exit_code() of it, 130 or 143.
    `on_ready` runs once both signals are ours: a line that says "serving, Ctrl+C to stop" printed before
    would let a signal sent on reading it end the process with the default disposition (-15, not 143)."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("waiting for Ctrl-C or SIGTERM needs the main thread: signals reach it only")
    received: list[int] = []
    arrived = threading.Event()

    def receive(signum: int, frame: object) -> None:
        received.append(signum)
        arrived.set()

    previous = {signum: signal.signal(signum, receive) for signum in STOP_SIGNALS}
    try:
        if on_ready is not None:
            on_ready()
        while not arrived.wait(0.5):
            pass
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return received[0]


def end_process(code: object) -> NoReturn:
    """End the process with `code` as SystemExit reads it (None: 0, an int: itself, else printed, then 1).

    A daemon thread may still be inside a library's native call when a command ends: the reader of a stalled
    camera waits in FFmpeg's read until its timeout. Python 3.11 ends a daemon thread that asks for the GIL back
    while the interpreter finalizes with pthread_exit, whose unwinding through OpenCV's C++ frames aborts the
    process ("terminate called without an active exception": exit -6 where 143 was due, and the last lines
    still buffered for a pipe lost). So while such a thread is alive the interpreter is not finalized: the exit
    handlers run here, the output is flushed and the process ends. With none, or with a non-daemon thread to
    wait for, the usual exit.
    """
    others = [thread for thread in threading.enumerate() if thread is not threading.main_thread()]
    if not others or any(not thread.daemon for thread in others):
        sys.exit(code)
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    atexit._run_exitfuncs()  # what a finalizing interpreter runs: logging's flush, temporary folders' removal
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # (a closed pipe: nothing left to flush to)
            stream.flush()
    os._exit(status)
