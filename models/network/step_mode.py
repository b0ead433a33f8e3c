"""How the steps on this thread run: as the model was prepared, as written, or dry.

The engine's step runner sets the mode around a step (`stepping`); the builder sets it around a
warm-up's dry pass. The network's compiled parts read it (models/builds/compilation.py): on a thread
stepping as written they run the code as written, while another thread compiles them, which is how a
run streams while its compiled code is made beside it. Per thread, because Dynamo's own stance is
process-wide. A dry step launches no kernel that is not built (models/builds/kernel_builds.py), so
what it computes is garbage: a step runner records no CUDA graph of it.
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Iterator


class StepMode(enum.Enum):
    PREPARED = "prepared"  # compiled where the model was compiled
    AS_WRITTEN = "as written"  # compiled parts bypassed
    DRY = "dry"  # as written, and kernels not built yet are listed instead of launched


_mode = threading.local()


def current() -> StepMode:
    """This thread's mode (PREPARED unless a `stepping` block says otherwise)."""
    return getattr(_mode, "value", StepMode.PREPARED)


def as_written() -> bool:
    """Whether compiled parts run as written on this thread."""
    return current() is not StepMode.PREPARED


@contextlib.contextmanager
def stepping(mode: StepMode) -> Iterator[None]:
    """This thread's steps in `mode` for the block; a DRY block stays dry inside an AS_WRITTEN one."""
    previous = current()
    _mode.value = StepMode.DRY if previous is StepMode.DRY else mode
    try:
        yield
    finally:
        _mode.value = previous
