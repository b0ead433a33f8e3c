"""A helper process of the stream's: a fresh interpreter that runs one of our `serve` functions and talks
to its parent through two pipes of pickled messages.

Fresh (`python -c`): neither forked, which a CUDA parent must not be, nor started by multiprocessing's
spawn, which re-runs the caller's main script (the CLI's imports: seconds) in every child. The loop
closer is such a child (models/loops/process.py).

The parent's side of the pipes never blocks: `MessageOutbox` keeps what the pipe cannot take now and
writes it on a later `pump`, `MessageInbox` hands over the messages that have arrived whole. The child's
side reads and writes them with plain blocking calls (`read_message`, `write_message`): its one thread
has nothing else to do meanwhile.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import fcntl
import importlib
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from .supervision import Helper, ending_child, supervise_child

# A child of its own session: the terminal's Ctrl-C goes to the stream's process, which ends the child
# itself (close); a child in the same process group would die of it too, with a traceback of its own.
# A parent that dies closes the pipe: the child reads the end of it and returns; and since a child that
# is stopped (SIGSTOP) or hung reads nothing, Linux also kills it when its parent goes (PR_SET_PDEATHSIG),
# and a parent that exits ends every child it still has (atexit).
CHILD_OWN_SESSION = True
_PR_SET_PDEATHSIG = 1
_LIVE_CHILDREN: weakref.WeakSet = weakref.WeakSet()
# The pipes' capacity, asked of Linux (F_SETPIPE_SZ; 1 MiB is its default ceiling for an unprivileged
# process): a keyframe (~1.6 MB at 518 x 378) then crosses in two writes instead of 25 of the default 64 kB.
PIPE_BYTES = 1 << 20
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
# How long ending a child waits for it to exit after SIGKILL: the kernel reaps it in milliseconds unless
# it is in uninterruptible IO, which no wait of ours may outlast.
END_WAIT_S = 5.0
_HEADER = struct.Struct("<Q")


@dataclass(eq=False)
class ChildProcess:
    """A started child: its process, the pipe its requests go into and the one its replies come from."""

    process: subprocess.Popen
    requests: BinaryIO
    replies: BinaryIO

    def end(self, timeout: float = END_WAIT_S) -> bool:
        """End the child now, whatever it is doing (stopped by SIGSTOP too: SIGKILL ends a stopped process);
        waits at most `timeout` s for it to go. True when it has gone."""
        ending_child(self.process.pid)
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGKILL)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def close(self, timeout: float = END_WAIT_S) -> bool:
        """End the child now and close its pipes; True when it has gone."""
        try:
            return self.end(timeout)
        finally:
            for pipe in (self.requests, self.replies):
                with contextlib.suppress(OSError):
                    pipe.close()


def start_child(module: str, function: str, *arguments: object, helper: Helper, env: Mapping[str, str] | None = None,
                output: BinaryIO | None = None, outlives_parent: bool = False,
                died: Callable[[int], str] | None = None, quiet: bool = False) -> ChildProcess:
    """Run `module.function(requests_fd, replies_fd, *arguments)` in a fresh interpreter (arguments as
    Python literals), a child of `helper`'s (models/supervision.py: every child is some helper's, and its
    death marks that helper down when it happens, `died(returncode)` the reason; env: its
    environment, default this process's; output: where its stdout and stderr
    go, default this process's). Call it on a thread that outlives the child: Linux sends the
    parent-death signal when the thread that started a child ends. `outlives_parent`: a child that
    finishes its work after its parent has gone (a compile for the next run), neither killed with the
    parent nor ended at its exit; it ends itself."""
    child_reads, parent_writes = os.pipe()
    parent_reads, child_writes = os.pipe()
    call = ", ".join(repr(value) for value in (child_reads, child_writes, *arguments))
    tied = "" if outlives_parent else f"from {__name__} import die_with_parent; die_with_parent({os.getpid()}); "
    code = f"{tied}from {module} import {function}; {function}({call})"
    try:
        process = subprocess.Popen([sys.executable, "-c", code],
                                   pass_fds=(child_reads, child_writes), stdin=subprocess.DEVNULL,
                                   stdout=output, stderr=None if output is None else subprocess.STDOUT,
                                   start_new_session=CHILD_OWN_SESSION,
                                   env=None if env is None else dict(env))
    except BaseException:
        for fd in (parent_writes, parent_reads):
            os.close(fd)
        raise
    finally:
        os.close(child_reads)
        os.close(child_writes)
    for fd in (parent_writes, parent_reads):
        with contextlib.suppress(OSError):  # a smaller pipe only costs more writes
            fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_BYTES)
    child = ChildProcess(process, os.fdopen(parent_writes, "wb", buffering=0), os.fdopen(parent_reads, "rb", buffering=0))
    if not outlives_parent:
        _LIVE_CHILDREN.add(child)
    supervise_child(helper, process.pid, died, quiet=quiet)
    return child


# glibc's malloc in a worker child: arrays up to 32 MiB (its ceiling for this) from the heap rather than mapped
# afresh each time, and the heap's freed top kept up to 1 GiB rather than returned. A child repeating a job on
# large temporaries (a SIFT's pyramid, a check's 1,400 x 1,400 similarities) otherwise maps, faults in and unmaps
# them on every call: on the 2-core sandbox a SIFT of a 518 x 392 picture took 90 ms in a child against 64 ms,
# and a loop check 21 ms against 14 ms, with both settings (either alone: 82-88 and 16-21 ms).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
HEAP_MAPPED_FROM = 32 << 20
HEAP_TRIMMED_FROM = 1 << 30


def keep_freed_memory() -> bool:
    """In a worker child: freed memory kept for the next job (see HEAP_MAPPED_FROM); False where the C library
    is not glibc's."""
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, HEAP_MAPPED_FROM)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, HEAP_TRIMMED_FROM))
    except (OSError, AttributeError):  # (no mallopt: another C library)
        return False


def die_with_parent(parent_pid: int) -> None:
    """In a child: be killed by Linux when the parent goes, however it goes (elsewhere: nothing)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent went before the request was made
        os._exit(1)


@atexit.register
def _end_children() -> None:
    for child in list(_LIVE_CHILDREN):
        child.end(timeout=1.0)


def write_message(stream: BinaryIO, message: object) -> None:
    """One pickled message to a child process's pipe (a length, then the pickle), flushed."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)  # not concatenated: a keyframe's megabytes copied once less, under the GIL
    stream.flush()


def read_message(stream: BinaryIO) -> Any:
    """The next message, or raises EOFError when the other end has closed. (File reads wait without
    the GIL.)"""
    (size,) = _HEADER.unpack(_read_exactly(stream, _HEADER.size))
    return pickle.loads(_read_exactly(stream, size))


def _read_exactly(stream: BinaryIO, size: int) -> bytearray:
    """`size` bytes of `stream`, read as they come (an unbuffered pipe's read returns what it holds, which may
    be less); EOFError where it ends first."""
    data = bytearray(size)
    view, got = memoryview(data), 0
    while got < size:
        count = stream.readinto(view[got:])
        if not count:
            raise EOFError
        got += count
    return data


class MessageOutbox:
    """Messages to a child, written without ever blocking: what the pipe cannot take now stays here
    until a later `pump`. `pending` counts the messages not yet wholly written."""

    def __init__(self, pipe: BinaryIO) -> None:
        self._fd = pipe.fileno()
        os.set_blocking(self._fd, False)
        self._chunks: collections.deque[memoryview] = collections.deque()
        self._ends: collections.deque[int] = collections.deque()  # chunks left when each message is written
        self.pending = 0

    def put(self, message: object) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._chunks += (memoryview(_HEADER.pack(len(data))), memoryview(data))
        self.pending += 1
        self.pump()

    def pump(self) -> None:
        """Write what the pipe takes now. Raises BrokenPipeError when the child has closed its end."""
        while self._chunks:
            try:
                written = os.write(self._fd, self._chunks[0])
            except BlockingIOError:
                return
            if written < len(self._chunks[0]):
                self._chunks[0] = self._chunks[0][written:]
                return
            self._chunks.popleft()
            if len(self._chunks) % 2 == 0:  # a message's data (its second chunk) is written
                self.pending -= 1


class MessageInbox:
    """Messages from a child, read without ever blocking: `take` returns those that have arrived whole
    and raises EOFError once the child has closed its end and nothing whole is left."""

    def __init__(self, pipe: BinaryIO) -> None:
        self._fd = pipe.fileno()
        os.set_blocking(self._fd, False)
        self._buffer = bytearray()
        self._closed = False

    def fileno(self) -> int:
        return self._fd

    @property
    def closed(self) -> bool:
        """The child has closed its end: the messages `take` last returned were its last."""
        return self._closed

    def take(self) -> list[Any]:
        while not self._closed:
            try:
                data = os.read(self._fd, PIPE_BYTES)
            except BlockingIOError:
                break
            if not data:
                self._closed = True
            self._buffer += data
        messages = []
        while len(self._buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buffer)
            if len(self._buffer) < _HEADER.size + size:
                break
            messages.append(pickle.loads(bytes(self._buffer[_HEADER.size: _HEADER.size + size])))
            del self._buffer[: _HEADER.size + size]
        if not messages and self._closed:
            raise EOFError
        return messages


class ChildDied(RuntimeError):
    """A child running a call (ChildCalls) died before it replied: its exit in one sentence."""


class ChildCalls:
    """Module-level functions called in children of ours (start_child), one child a calling thread, started at
    that thread's first call: a pool's threads (DaemonPool) get as many processes, so that the numpy and Python
    work that holds the interpreter's lock (an npz read, a file's points) runs on as many cores. A call sends
    its function's name and arguments and waits for the reply; the caller's future holds its deadline. A child
    that dies fails its call at once (its pipe ends) with ChildDied, and marks `helper` down (start_child).
    `setup`: "module.function" each child calls once before its first call (its libraries' threads, say)."""

    def __init__(self, helper: Helper, setup: str | None = None) -> None:
        self.helper, self.setup = helper, setup
        self._local = threading.local()
        self._children: list[ChildProcess] = []
        self._lock = threading.Lock()

    def call(self, function: Callable[..., Any], *args: Any) -> Any:
        """`function(*args)` in this thread's child: what it returns, or raises what it raised."""
        child = self._child()
        try:
            write_message(child.requests, (function.__module__, function.__qualname__, args))
            returned, value = read_message(child.replies)
        except (EOFError, OSError):
            reason = self._death(child)
            self.helper.fail(reason)  # (reaped here: the monitor no longer sees its exit)
            raise ChildDied(reason) from None
        if not returned:
            raise value
        return value

    def close(self) -> None:
        """End every child now (a call waiting on one gets ChildDied): all of them killed first, then each waited
        for, so that the kernel frees their memory side by side."""
        with self._lock:
            children, self._children = self._children, []
        for child in children:
            child.end(timeout=0)
        for child in children:
            child.close()

    def _child(self) -> ChildProcess:
        child = getattr(self._local, "child", None)
        if child is None:
            child = start_child(__name__, "serve_calls", self.setup, helper=self.helper,
                                died=lambda code: f"a child process of {self.helper.policy.name} died (exit status {code})")
            with self._lock:
                self._children.append(child)
            self._local.child = child
        return child

    def _death(self, child: ChildProcess) -> str:
        try:
            code = child.process.wait(timeout=END_WAIT_S)
        except subprocess.TimeoutExpired:
            code = None
        return f"a child process of {self.helper.policy.name} (pid {child.process.pid}) ended mid-call (exit status {code})"


def serve_calls(requests_fd: int, replies_fd: int, setup: str | None) -> None:
    """The child of ChildCalls: `setup` called once, then each request (module, function, args) answered with
    (True, what it returned) or (False, what it raised), until the parent closes the pipe."""
    if setup:
        _named(*setup.rsplit(".", 1))()
    with os.fdopen(requests_fd, "rb") as requests, os.fdopen(replies_fd, "wb") as replies:
        while True:
            try:
                module, name, args = read_message(requests)
            except EOFError:  # the parent has gone, or closed us
                return
            try:
                reply = (True, _named(module, name)(*args))
            except Exception as error:  # noqa: BLE001 - the parent's caller raises it
                reply = (False, _portable(error))
            write_message(replies, reply)


def _named(module: str, name: str) -> Callable[..., Any]:
    return getattr(importlib.import_module(module), name)


def _portable(error: Exception) -> Exception:
    """`error` as the parent can unpickle it: itself, else a RuntimeError saying what it was."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - any error that does not survive the pipe
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error
