"""A kernel a child builder (models/builds/kernel_builders.py) imports by name, standing where Triton's JITFunction
stands: Triton builds a CUDA kernel only where a GPU is (the real builds in children are tests/test_gpu_fast_path.py's).
Its `preload` does what its specialization data (JSON) says: "build" writes the building process's id to "path";
"fail" raises; "die" ends the process; "stall" stops it (SIGSTOP)."""

from __future__ import annotations

import json
import os
import signal
import types
from pathlib import Path


class StandInKernel:
    def __init__(self, fn) -> None:
        self.fn = fn  # the kernel's Python function, as a JITFunction keeps it: a child imports it by its name

    def preload(self, specialization: str):
        order = json.loads(specialization)
        if order["do"] == "fail":
            raise RuntimeError("out of registers")
        if order["do"] == "die":
            os._exit(3)
        if order["do"] == "stall":
            os.kill(os.getpid(), signal.SIGSTOP)
        with Path(order["path"]).open("a") as built:
            built.write(f"{os.getpid()}\n")
        return types.SimpleNamespace(_init_handles=lambda: None)


def kernel():
    """The stand-in kernel's source."""


kernel = StandInKernel(kernel)  # as @triton.jit replaces the function by its JITFunction
