"""A run's Triton kernels built while its checkpoint loads.

On a fresh machine an uncompiled warm-up spends most of its time in its dry pass (StreamingEngine.
run_dry: 3.6-4.2 s of 4.6-5.7 s at 518x392), after the checkpoint's load, its
preparation and the viewer's start (3.4-4.5 s), which mostly wait for the disk, the copies to the GPU
and imports. `BuildsAhead` runs the dry pass during them instead: on a thread,
on a model of the run's architecture prepared as the loaded one will be but with zero weights
(prepare_without_weights), in an engine of the run's settings, on a zero frame of the model input's
size. A process builds a kernel once for every model, so the run's warm-up then skips its own dry
pass. The engine's cache has one window slot: the warm-up's streaming steps
are uncached, and the slot count is no argument the kernels specialise on. A fresh machine's first
run then has its 100th prediction 2.2-4.4 s sooner.

The zero model holds a second copy of the weights on the GPU until the pass ends, beside the one
being loaded: a run with a memory budget does not start one (the plan's "dry_pass_ahead" row, plan.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import torch

from ..network.config import ModelConfig
from ..stream.engine import StreamingEngine
from ..stream.stream_config import StreamConfig
from ..supervision import Deadline, start_supervised_thread
from . import kernel_builds
from .prepare import prepare_without_weights

logger = logging.getLogger("stream_recon.models.builds.ahead")

# The longest the run's first frame waits for the pass: it takes 3.6-4.2 s of a fresh machine's start,
# most of it while the checkpoint loads, and its builds have BUILDS_WAIT_S of their
# own. A pass still running a minute after the first frame asked has stalled: builds ahead are turned off
# (kernel_builds.PROCESS.ahead) and the run's kernels build at their first launches, a few seconds in all.
AHEAD_WAIT_S = 60.0


class BuildsAhead:
    """The dry pass of a run's warm-up on a thread of its own ("kernel-build-ahead"), from construction on.

    image_size: (height, width) of the model input the run's frames will have. `wait` gives how it
    went; `covers` whether a warm-up of frames of some size may skip its own dry pass."""

    def __init__(self, model_config: ModelConfig, stream_config: StreamConfig, image_size: tuple[int, int],
                 device: str | torch.device, dtype: torch.dtype) -> None:
        self.image_size = (int(image_size[0]), int(image_size[1]))
        self.device = kernel_builds.device_with_index(torch.device(device))
        self._seconds: dict[str, float] | None = None  # set by the thread when the pass succeeded
        self._started = time.perf_counter()
        self._deadline: Deadline | None = None  # from the first `wait` on: every later one ends there too
        self._given_up = False  # the pass stalled past the deadline
        # (what `_build` raises it says itself: the warm-up then makes its own pass; a stall turns builds ahead off)
        self._thread = start_supervised_thread(kernel_builds.PROCESS.ahead,
                                               lambda: self._build(model_config, stream_config, dtype),
                                               "kernel-build-ahead")

    def _build(self, model_config: ModelConfig, stream_config: StreamConfig, dtype: torch.dtype) -> None:
        try:
            with self._own_memory():
                model = prepare_without_weights(model_config, self.device, dtype)
                engine = StreamingEngine(model, stream_config, device=self.device, dtype=dtype, window_slots=1)
                seconds = engine.run_dry(torch.zeros((3, *self.image_size), dtype=torch.uint8), kernel_builds.dry_pass)
                del engine, model
            self._seconds = {**seconds, "kernel_builds_ahead_s": round(time.perf_counter() - self._started, 3)}
        except Exception as error:  # the warm-up then makes its own dry pass
            logger.warning("building the kernels while the checkpoint loads failed (%r); the warm-up builds them",
                           error)

    @contextlib.contextmanager
    def _own_memory(self) -> Iterator[None]:
        """On CUDA, this thread's allocations in a pool of their own, handed back to the driver afterwards:
        in the allocator's shared segments the zero weights' freed blocks, interleaved with the loaded
        weights, leave holes that raise the run's peak reserved memory by 0.3-0.9 GiB at 518x392."""
        if self.device.type != "cuda":
            yield
            return
        torch.cuda.set_device(self.device)
        if not hasattr(torch.cuda, "use_mem_pool"):
            yield
        else:
            with torch.cuda.use_mem_pool(torch.cuda.MemPool(), self.device):
                yield
        torch.cuda.empty_cache()

    def wait(self) -> dict[str, float] | None:
        """Until the pass is done, AHEAD_WAIT_S from the first call at most. Its seconds by part
        (kernel_builds.dry_pass's "kernel_builds_s", "kernel_builds", "kernel_builds_wait_s"; "kernel_builds_ahead_s"
        from the start to its end, the model and engine made; "kernel_builds_ahead_wait_s", how long this
        call waited for it), or None where it failed or stalled (a stall turns the builds ahead off, with one
        warning line: its thread is a daemon, left behind)."""
        started = time.perf_counter()
        if self._deadline is None:
            self._deadline = Deadline(AHEAD_WAIT_S)
        self._thread.join(timeout=self._deadline.remaining())
        if self._thread.is_alive():
            self._given_up = True  # (what the thread does after this is no warm-up's)
            kernel_builds.PROCESS.ahead.fail(f"the dry pass beside the checkpoint's load did not finish within "
                                      f"{self._deadline.seconds:g} s")
            return None
        if self._seconds is None or self._given_up:
            return None
        return {**self._seconds, "kernel_builds_ahead_wait_s": round(time.perf_counter() - started, 3)}

    def covers(self, image_size: tuple[int, int]) -> bool:
        """Whether the pass succeeded for frames of `image_size` (height, width): a warm-up of another
        size makes its own dry pass."""
        return (self._seconds is not None and not self._given_up
                and (int(image_size[0]), int(image_size[1])) == self.image_size)
