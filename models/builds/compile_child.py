"""Compiling an input size for the next run, in a child process beside this one (`--compile auto`).

On a machine whose compile caches do not hold a run's input size, compiling its streaming step before the
first prediction takes 20-30 s, where the uncompiled step streams only ~10 % slower a frame. So such a run
streams uncompiled from the start, and once its own warm-up is done a child process compiles that size: a
model of the same architecture with random weights (what Inductor compiles depends on shapes and dtypes, not
on weight values), the same settings, frame size and matrix-product precision flags (which Inductor's cache
keys name), warmed up as the run's engine is, with a cache of one window slot so that it needs a few GiB of
device memory beside the run. It fills Inductor's on-disk caches and leaves a record of the size
(models.builds.compilation.record); the next run of that size finds the record and compiles from the caches in a few
seconds.

The child is niced, compiles on half the cores, and runs in a session of its own: it finishes after
the run if it has to (it takes up to a minute; the run says so), and a run stopped by a signal
stops it. A compile of a key already under way (a lock file with a live process) is not started twice.
Where its estimate does not fit in the device's free memory (or in what `--gpu-memory` leaves beside the
run) it does not start, and where it fails it says so in its log: either way a record ("compile-first")
makes the next run of that size compile before its stream instead, as `--compile on` does.

Python has no thread that could compile beside the stream: a compile thread holding the interpreter
halves the stream's rate, and a compile of 10-15 s then takes ~50 s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from ..child_process import start_child
from ..network.config import ModelConfig
from ..network.gct import GCTStream
from ..stream.engine import StreamingEngine
from ..stream.memory import CUDA_CONTEXT_BYTES, estimate_memory
from ..stream.memory_size import parse_memory_size
from ..stream.stream_config import StreamConfig
from ..supervision import Helper, HelperPolicy, WhenDown, WhenFull, ending_child
from .compilation import (
    compiled_code_key,
    matmul_settings,
    record,
    recorded,
    records_folder,
    use_matmul_settings,
)
from .prepare import prepare_for_inference

CHILD_WINDOW_SLOTS = 1  # the warm-up's streaming steps are uncached: one window slot is all it needs
STOP_WAIT_S = 5.0  # a child asked to stop gets this long before it is killed
# After SIGKILL, how long the run waits to reap the child: the kernel ends a killed process at once unless
# it is stuck in the kernel itself (a driver call); then it is left to end when it can, and the run ends.
KILL_WAIT_S = 2.0
# A child still compiling this long after its start has stalled: a compile takes up to a minute;
# twenty times that is no compile. Seen so by the run (`poll`: run.json's summary, the
# run's end), it is killed and the next run of its size compiles first; one left to finish after its run
# ended ends itself then (SIGALRM, whose default action ends a process without running any of its code).
CHILD_LIMIT_S = 1200
COMPILE_CHILD = HelperPolicy("compiling the next run's size in a child process", WhenFull.DROP, WhenDown.TURN_OFF,
                             stall_s=CHILD_LIMIT_S)


class CompiledSizes:
    """A CUDA run's part in what this machine has compiled: after a compiled warm-up, the record of its
    input size; after an uncompiled one that `compile_choice` chose (`beside`), the child process that
    compiles the size for the next run, seen from the run."""

    def __init__(self, gpu_memory: str | None, model: Any, device: str, dtype: Any, stream_config: Any,
                 beside: bool) -> None:
        self.gpu_memory, self.model, self.device, self.dtype = gpu_memory, model, device, dtype
        self.stream_config = stream_config
        self.beside = beside and not model.inference_spec.compiled
        self.helper = Helper(COMPILE_CHILD)  # down: the child failed, stalled or was stopped with the run
        self.process: subprocess.Popen | None = None
        self.key: str | None = None
        self.status = "not started"
        self.started_at: float | None = None
        self.seconds: float | None = None
        self.plan: dict[str, Any] | None = None
        self.log: Path | None = None  # the child's output

    def warmed_up(self, image_size: tuple[int, int], plan: Any = None) -> str | None:
        """After the run's warm-up on frames of `image_size` (height, width): record a compiled size, or
        start compiling an uncompiled one beside the run. `plan`: the run's memory plan (--gpu-memory),
        whose K/V precision and window the child's engine takes as a spare engine does. A line for the
        console, or None."""


        self.plan = None if plan is None else {"kv_cache": plan.kv_cache, "window": plan.window}
        self.key = compiled_code_key(self.model.config, self.stream_config, image_size, self.dtype,
                                     torch.device(self.device))
        if self.model.inference_spec.compiled:
            record(self.key, "compiled", json.dumps({"size": list(image_size), "by": "a run"}))
            self.status = "compiled by the run"
            return None
        return self._start(image_size) if self.beside else None

    def _start(self, image_size: tuple[int, int]) -> str:


        height, width = image_size
        needed, room, where = self._bytes_needed(image_size), *self._room(torch.device(self.device))
        if needed > room:
            record(self.key, "compile-first", f"no room beside a run: needed {needed} bytes, {room} {where}")
            self.status = "no room"
            return (f"compiled code for {width}x{height} frames is not in this machine's caches, and compiling it "
                    f"beside the run needs {needed / 2**30:.1f} GiB of the {room / 2**30:.1f} GiB {where}: "
                    "this run streams uncompiled (about 10% slower a frame); the next run of this size compiles "
                    "before its first frame")
        lock = records_folder() / f"{self.key}.compiling"
        if _live_pid(lock) is not None:
            self.status = "already compiling"
            return (f"compiled code for {width}x{height} frames is being made by another process: this run streams "
                    "uncompiled (about 10% slower a frame)")
        request = {"stream_config": dataclasses.asdict(self.stream_config), "model_config": self.model.config.to_dict(),
                   "image_size": list(image_size), "device": str(self.device),
                   "dtype": str(self.dtype).removeprefix("torch."), "matmul": matmul_settings(), "plan": self.plan,
                   "key": self.key}
        self.log = records_folder() / f"{self.key}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        environment = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": str(compile_threads())}
        with open(self.log, "wb") as output:
            # its own session (start_child's): stopped whole, and no Ctrl-C of the terminal's
            child = start_child(__name__, "serve", json.dumps(request), helper=self.helper, env=environment,
                                output=output, outlives_parent=True, quiet=True,  # (`finish` says it)
                                died=lambda code: f"failed (exit {code}; its log: {self.log})")
        for pipe in (child.requests, child.replies):  # (it is told everything at its start)
            pipe.close()
        self.process = child.process
        self.helper.beat()
        lock.write_text(f"{self.process.pid}\n")
        self.started_at = time.perf_counter()
        self.status = "compiling"
        return (f"compiled code for {width}x{height} frames is not in this machine's caches: this run streams "
                "uncompiled (about 10% slower a frame) while a background process compiles it for the next run "
                "(--compile on compiles before the stream instead)")

    def _room(self, device: Any) -> tuple[int, str]:
        """Bytes the child may take, and where they are: the device's free memory, and under --gpu-memory
        no more than the budget leaves beside what this run's allocator has held at its peak and its CUDA
        context (the budget is the whole run's, its compile included)."""

        free = _free_bytes(device)
        free_where = "free on the GPU" if device.type == "cuda" else "available on the host"
        if self.gpu_memory is None:
            return free, free_where

        held = torch.cuda.max_memory_reserved(device) + CUDA_CONTEXT_BYTES if device.type == "cuda" else 0
        left = max(0, parse_memory_size(self.gpu_memory) - held)
        return (left, "left of --gpu-memory beside the run") if left < free else (free, free_where)

    def _bytes_needed(self, image_size: tuple[int, int]) -> int:
        """The child's device memory: its engine's tensors with one window slot, the float32 random
        weights it prepares the model from, and a CUDA context of its own."""

        config = planned(self.stream_config, self.plan)
        engine = estimate_memory(self.model, config, image_size, window_slots=CHILD_WINDOW_SLOTS)
        float32_weights = 4 * sum(parameter.numel() for parameter in self.model.parameters())
        return engine.tensors + float32_weights + CUDA_CONTEXT_BYTES

    def poll(self) -> str:
        """The status now: not started, no room, already compiling, compiling, done, failed or stalled (still
        compiling CHILD_LIMIT_S after its start: killed now). A child that ended without a record of its
        own (killed, crashed, stalled) leaves one: the next run of its size compiles first."""
        if self.process is not None and self.status == "compiling":
            code = self.process.poll()
            if code is None and time.perf_counter() - self.started_at > CHILD_LIMIT_S:
                self._stop_child(signal.SIGKILL)
                self.status = f"stalled (still compiling after {CHILD_LIMIT_S:g} s: killed; its log: {self.log})"
                self._compile_first(f"the background compile was still running after {CHILD_LIMIT_S:g} s")
                self.helper.fail(self.status, quiet=True)  # (`finish` says it)
            elif code is not None:
                self.seconds = round(time.perf_counter() - self.started_at, 1)
                self.status = "done" if code == 0 else f"failed (exit {code}; its log: {self.log})"
                if code != 0:
                    self._compile_first(f"the background compile exited {code}")
                    self.helper.fail(self.status, quiet=True)  # (`finish` says it)
        return self.status

    def finish(self, stop: bool) -> str | None:
        """At the run's end: stop the child (`stop`: the run was stopped by a signal), or let it finish on
        its own; waits STOP_WAIT_S + KILL_WAIT_S at most. A line for the console when it is still
        compiling, has failed or has stalled, else None."""
        status = self.poll()
        if status.startswith(("failed", "stalled")):
            return f"the background compile for the next run {status}; the next run of this size compiles first"
        if status != "compiling":
            return None
        if not stop:
            self.status = "finishing after the run"
            return (f"the compile for the next run goes on in the background (process {self.process.pid}, a "
                    "minute at most)")
        self.helper.fail("stopped with the run", quiet=True)
        if self._stop_child(signal.SIGTERM):
            self.status = "stopped with the run"
        else:
            self.status = (f"stopped with the run (process {self.process.pid} was killed but had not ended "
                           f"{KILL_WAIT_S:g} s later)")
        return None

    def _stop_child(self, first: signal.Signals) -> bool:
        """`first` to the child's process group, then SIGKILL after STOP_WAIT_S where it was not SIGKILL
        already; True once the child has ended (reaped), KILL_WAIT_S after the kill at the latest."""
        waits = [(first, STOP_WAIT_S)] if first != signal.SIGKILL else []
        ending_child(self.process.pid)
        for sent, wait_s in [*waits, (signal.SIGKILL, KILL_WAIT_S)]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sent)
            try:
                self.process.wait(wait_s)
                return True
            except subprocess.TimeoutExpired:
                continue
        return False

    def _compile_first(self, why: str) -> None:
        """Leave the record that makes the next run of this key compile before its stream (unless the child
        left its own, which says more)."""

        if not recorded(self.key, "compile-first"):
            record(self.key, "compile-first", why)

    def summary(self) -> dict[str, Any]:
        """For run.json."""
        self.poll()
        return {"status": self.status, "key": self.key, "seconds": self.seconds}


def planned(stream_config: Any, plan: dict[str, Any] | None) -> Any:
    """The settings an engine streams with under the run's memory plan, as a spare engine takes them: the
    plan's K/V precision and window, and no budget of its own."""
    if plan is None:
        return stream_config
    return dataclasses.replace(stream_config, kv_cache=plan["kv_cache"], window=plan["window"], gpu_memory=None)


MEMINFO = "/proc/meminfo"  # the kernel's memory figures (Linux)


def _free_bytes(device: Any) -> int:
    """Free memory where the child would run: the GPU's, or the host's for a CPU child (tests). The host's
    is the kernel's MemAvailable (reclaimable page cache included): MemFree alone is near zero on a
    machine whose page cache has filled, though that memory is the child's for the asking."""

    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open(MEMINFO) as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def compile_threads() -> int:
    """Inductor's compile workers in the child: half the cores this process may use, leaving the rest to
    the run's stream, reader, writer and viewer."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(1, cores // 2)


def _live_pid(lock: Path) -> int | None:
    """The process a lock file names, if it is still running."""
    try:
        pid = int(lock.read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


# -- the child's side --------------------------------------------------------------------------------
def random_model(model_config: Any, device: Any) -> Any:
    """A model of `model_config` on `device` with float32 random weights, as a checkpoint load leaves a
    model (float32): small normal matrices, unit norm weights, layer scales of 0.1, zero biases and
    buffers, so that no step sees NaN."""


    with torch.device("meta"):
        model = GCTStream(model_config)
    model = model.to_empty(device=device).eval()
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.zero_()
        for name, tensor in model.state_dict().items():
            if tensor.ndim >= 2:
                tensor.normal_(0.0, 0.02, generator=generator)
            elif name.endswith(("weight", "gamma")):
                tensor.fill_(1.0 if name.endswith("weight") else 0.1)
    return model


def compile_size(request: dict) -> None:
    """The child's work: the run's compiled calls made for its input size, then the record left."""


    use_matmul_settings(request["matmul"])  # before the key: it names them
    model_config = ModelConfig(**{name: tuple(value) if isinstance(value, list) else value
                                  for name, value in request["model_config"].items()})
    device, dtype = torch.device(request["device"]), getattr(torch, request["dtype"])
    height, width = request["image_size"]
    stream_config = StreamConfig(**request["stream_config"])
    key = compiled_code_key(model_config, stream_config, (height, width), dtype, device)
    if key != request["key"]:  # the two processes would not agree on what was compiled
        raise RuntimeError(f"this process's key {key} differs from the run's {request['key']}")
    started = time.perf_counter()
    model = prepare_for_inference(random_model(model_config, device), device, dtype, compile=True)
    torch.cuda.empty_cache()  # the float32 weights it was prepared from
    engine = StreamingEngine(model, planned(stream_config, request["plan"]), device=device, dtype=dtype,
                             window_slots=CHILD_WINDOW_SLOTS)
    frame = torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    parts = engine.warm_up(frame)
    seconds = round(time.perf_counter() - started, 1)
    record(key, "compiled", json.dumps({"size": [height, width], "seconds": seconds, "warm_up": parts}))
    print(json.dumps({"key": key, "seconds": seconds, "warm_up": parts}), flush=True)


def serve(requests_fd: int, replies_fd: int, request_json: str) -> None:
    """In the child (started by `CompiledSizes` through start_child): compile the size asked for. Its exit
    code says how it went: 0 compiled, else failed (the traceback in its log)."""
    for fd in (requests_fd, replies_fd):  # (everything it needs came with its start)
        os.close(fd)
    request = json.loads(request_json)
    with contextlib.suppress(OSError):
        os.nice(10)  # the run's stream comes first
    if hasattr(signal, "alarm"):  # a child left running after its run ends has no one else to stop it
        signal.alarm(int(CHILD_LIMIT_S))
    lock = records_folder() / f"{request['key']}.compiling"
    try:
        compile_size(request)
    except Exception as error:  # the next run compiles before its stream rather than failing here again
        record(request["key"], "compile-first", f"the background compile failed: {type(error).__name__}: {error}")
        raise
    finally:
        with contextlib.suppress(OSError):
            if _live_pid(lock) == os.getpid():
                lock.unlink()
