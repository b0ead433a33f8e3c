"""A helper process of the stream's: a fresh interpreter that runs one of our `serve` functions and talks
to its parent through two pipes of pickled messages.

Fresh (`python -c`): neither forked, which a CUDA parent must not be, nor started by multiprocessing's
spawn, which re-runs the caller's main script (the CLI's imports: seconds) in every child. The pose-graph
solver and the loop closer are such children.
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

# A child of its own session: the terminal's Ctrl-C goes to the stream's process, which ends the child
# itself (close); a child in the same process group would die of it too, with a traceback of its own.
# A parent that dies closes the pipe: the child reads the end of it and returns.
CHILD_OWN_SESSION = True


@dataclass
class ChildProcess:
    """A started child: its process, the pipe its requests go into and the one its replies come from."""

    process: subprocess.Popen
    requests: BinaryIO
    replies: BinaryIO

    def end(self, timeout: float = 10.0) -> None:
        """End the child now, whatever it is doing; its pipes stay open (a thread may still be reading
        or writing them: it meets their end)."""
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=timeout)

    def close(self, timeout: float = 10.0) -> None:
        """End the child now, whatever it is doing, and close its pipes."""
        try:
            self.end(timeout)
        finally:
            self.requests.close()
            self.replies.close()


def start_child(module: str, function: str, *arguments: object, env: Mapping[str, str] | None = None) -> ChildProcess:
    """Run `module.function(requests_fd, replies_fd, *arguments)` in a fresh interpreter (arguments as
    Python literals; env: its environment, default this process's)."""
    child_reads, parent_writes = os.pipe()
    parent_reads, child_writes = os.pipe()
    call = ", ".join(repr(value) for value in (child_reads, child_writes, *arguments))
    try:
        process = subprocess.Popen([sys.executable, "-c", f"from {module} import {function}; {function}({call})"],
                                   pass_fds=(child_reads, child_writes), stdin=subprocess.DEVNULL,
                                   start_new_session=CHILD_OWN_SESSION,
                                   env=None if env is None else dict(env))
    except BaseException:
        for fd in (parent_writes, parent_reads):
            os.close(fd)
        raise
    finally:
        os.close(child_reads)
        os.close(child_writes)
    return ChildProcess(process, os.fdopen(parent_writes, "wb"), os.fdopen(parent_reads, "rb"))


def write_message(stream: BinaryIO, message: object) -> None:
    """One pickled message to a child process's pipe (a length, then the pickle), flushed."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)))
    stream.write(data)  # not concatenated: a keyframe's megabytes copied once less, under the GIL
    stream.flush()


def read_message(stream: BinaryIO) -> Any:
    """The next message, or raises EOFError when the other end has closed. (File reads wait without
    the GIL.)"""
    header = stream.read(8)
    if len(header) < 8:
        raise EOFError
    (size,) = struct.unpack("<Q", header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)
