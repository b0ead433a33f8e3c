"""A compiled model's code made beside its stream, which steps as written meanwhile.

A run of an input size this machine compiled before finds Inductor's kernels in its caches, but Dynamo
traces every compiled method again in each process: 3.5-3.9 s of interpreter work at 518x392, which
the warm-up before the first frame used to pay (docs/performance-log.md, "the compiled warm-up beside the
checkpoint's load"). Here the run's engine steps as written instead (`StreamingEngine.steps_eagerly`), as
an uncompiled run's does, and `CompileWhileStreaming` runs the compiled steps once on a thread of its own: an
engine of its own over the same model (modules are inputs of the compiled code, so what it compiles
serves the run's engine), its cache with one window slot, no CUDA graphs, the warm-up's steps on copies of
the stream's first frame, on a CUDA stream of its own. Once it is done the run's engine steps compiled from
its next frame on, its graph recorded once more (plan.py, `Builder.after_frame`).

It is a helper of the run (models/supervision.py, TURN_OFF): one that raises, or is not done
COMPILE_WHILE_STREAMING_S after it started, leaves the stream stepping as written for the rest of the run, with one
warning line. Nothing waits for it but the run's end, `end`'s deadline at most.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace

import torch

from ..stream.engine import StreamingEngine
from ..stream.stream_config import StreamConfig
from ..supervision import Deadline, Helper, HelperPolicy, WhenDown, WhenFull, start_supervised_thread
from . import kernel_builds

# Tracing from warm caches takes 3.5-3.9 s alone and a few more beside a stream that holds the interpreter
# too; a compile that misses the caches takes 20-30 s. Ten times that, it has stalled.
COMPILE_WHILE_STREAMING_S = 300.0
POLICY = HelperPolicy("compiling while the stream runs", WhenFull.DROP, WhenDown.TURN_OFF, stall_s=COMPILE_WHILE_STREAMING_S)


class CompileWhileStreaming:
    """The compiled steps of `model` run once on the thread "compile-while-streaming", from construction on.

    image: the stream's first frame as the engine takes it ([3, H, W]); `ready` says when the run's engine
    may step compiled."""

    def __init__(self, model: torch.nn.Module, stream_config: StreamConfig, image: torch.Tensor) -> None:
        self.helper = Helper(POLICY)
        self.seconds: float | None = None  # from the start to its end, once it succeeded
        self._started = time.perf_counter()
        config = replace(stream_config, cuda_graphs=False, gpu_memory=None)
        device = kernel_builds.device_with_index(model.inference_spec.device)  # (the caller's current GPU)
        self._thread = start_supervised_thread(self.helper, lambda: self._compile(model, config, image, device),
                                               "compile-while-streaming")

    def _compile(self, model: torch.nn.Module, config: StreamConfig, image: torch.Tensor,
                 device: torch.device) -> None:
        with self._own_stream(device):
            engine = StreamingEngine(model, config, device=device, dtype=model.inference_spec.dtype, window_slots=1)
            engine.warm_up(image)
            del engine
        self.seconds = round(time.perf_counter() - self._started, 3)

    @staticmethod
    def _own_stream(device: torch.device):
        """Its device work on a stream of its own: the legacy default stream would wait for the run's."""
        if device.type != "cuda":
            return contextlib.nullcontext()
        torch.cuda.set_device(device)
        return torch.cuda.stream(torch.cuda.Stream(device))

    @property
    def ready(self) -> bool:
        """Done, and the compiled code made; False while it runs, and for good once it is down (one
        still running past COMPILE_WHILE_STREAMING_S is marked so)."""
        if self._thread.is_alive():
            self.helper.check(has_work=True)  # (beats only at its start: stalled past COMPILE_WHILE_STREAMING_S)
            return False
        return self.helper.is_up and self.seconds is not None

    def end(self, deadline: Deadline) -> None:
        """At the run's end: wait for it until `deadline` (a daemon left running holds no exit)."""
        self._thread.join(timeout=deadline.remaining())
