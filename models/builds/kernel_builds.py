"""Our Triton kernels' first builds, listed by a dry step and built side by side.

Triton builds a kernel's specialization on its first launch, in the launching thread, one after
another: on a fresh machine the uncompiled warm-up at 518x392 builds 11 of ours, 6.6-8.3 s of its
11-15 s. A build's Python front end holds the interpreter but LLVM and
ptxas do not, so builds overlap on threads. Which specializations a stream needs depends on its
shapes, strides and alignments, so they are not listed by hand: a dry step lists them. While
`dry_launches` is active on a thread, a launch there of a kernel this process has not built is not
run; its specialization goes to a pool of threads that build it (Triton's `jit_cache_hook`, whose
True skips the launch), and the step goes on, so the builds also overlap the step's own first calls
(cuBLAS loading its kernels and so on). Whatever a dry step computes is garbage: its caller throws
it away and zeroes what kept it. Launches on other threads, of kernels already built, and builds
asked for by `warmup` run as always; the range kernel's scheduler asks so (it reads the compiled
kernel's resources at once), and `start_early_builds` makes those two before a run's checkpoint
loads. A fresh machine's first run then warmed up in 4.6-5.7 s against 10.8-12.4 s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

from ..daemon_pool import DaemonPool
from ..network import step_mode
from ..network.step_mode import StepMode
from ..supervision import Deadline, Helper, HelperPolicy, WhenDown, WhenFull, start_supervised_thread
from . import kernel_builders

# Builds at once: eight specializations of the range kernel took 13.0 s one after another and 4.9 s
# on eight threads (of 16 cores); more threads only queue on the interpreter. A warm-up lists
# 9 at 518x392, at most four at a time.
MAX_BUILD_THREADS = 8
# The longest a dry step waits for its builds once its steps are done: the warm-up's builds take 6.6-8.3 s
# one after another on a fresh machine, and Triton gives a build no limit of
# its own. Past it, a build has stalled: builds ahead are turned off, and a kernel not built yet builds at
# its first launch, as without them.
BUILDS_WAIT_S = 60.0
BUILDS_AHEAD = HelperPolicy("building kernels ahead", WhenFull.DROP, WhenDown.TURN_OFF, stall_s=BUILDS_WAIT_S)

logger = logging.getLogger("stream_recon.models.builds.kernel_builds")


@dataclass
class ProcessBuilds:
    """What the builds keep for the whole process, in one place: Triton's cache hook is the process's,
    and so is whether building ahead still works. A build that failed or stalled (its thread cannot be
    stopped, and may hold what a build needs) turns off the dry passes and the early builds (`ahead`);
    child builders that died or stalled are not started again (`children`)."""

    ahead: Helper = field(default_factory=lambda: Helper(BUILDS_AHEAD))
    children: Helper = field(default_factory=lambda: Helper(kernel_builders.KERNEL_BUILDERS))
    listing: threading.local = field(default_factory=threading.local)  # .builds: this thread's DryLaunches
    lock: threading.Lock = field(default_factory=threading.Lock)
    hook_before: list = field(default_factory=list)  # [the hook that was there before ours] once ours is in
    builders: kernel_builders.KernelBuilders | None = None  # the child builders, while they run


PROCESS = ProcessBuilds()  # the builds' one piece of process-wide state


@dataclass
class DryLaunches:
    """The kernels a dry step would have built, each being built on the pool."""

    pool: DaemonPool
    device: torch.device
    futures: dict[tuple[int, str], Future] = field(default_factory=dict)  # by (kernel, specialization key)
    names: list[str] = field(default_factory=list)  # each listed kernel's name, in launch order

    def add(self, jit_function, key: str, specialization: str) -> None:
        """A launch of a specialization not built: build it once, beside the step."""
        listed = (id(jit_function), str(key))
        if listed not in self.futures:
            self.names.append(jit_function.fn.__name__ if hasattr(jit_function, "fn") else repr(jit_function))
            self.futures[listed] = self.pool.submit(_build_in_a_child_first, jit_function, specialization, self.device)

    def wait(self, deadline: Deadline) -> None:
        """Until every listed build is done or `deadline` passes. A build that failed or is not done by
        then turns the builds ahead off (`PROCESS.ahead`, one warning line); nothing raises here: a kernel that
        was not built builds at its first launch, where an error of its own belongs."""
        done, pending = wait(self.futures.values(), timeout=deadline.remaining())
        named = dict(zip(self.futures.values(), self.names, strict=True))
        if pending:
            PROCESS.ahead.fail(f"{len(pending)} of {len(self.futures)} builds ({', '.join(named[f] for f in pending)}) did "
                        f"not finish within {deadline.seconds:g} s")
        failed = next((future for future in self.futures.values() if future in done and future.exception()), None)
        if failed is not None:
            error = failed.exception()
            PROCESS.ahead.fail(f"building {named[failed]} failed: {type(error).__name__}: {error}")


def _build_in_a_child_first(jit_function, specialization: str, device: torch.device) -> bool:
    """`_build`, after a child process of the run's builders (`start_builders`), where there are some, built the
    specialization into Triton's on-disk cache: this process's build is then a cache hit. True where a child
    built it."""
    builders = PROCESS.builders
    in_a_child = builders is not None and builders.build(jit_function, specialization)
    _build(jit_function, specialization, device)
    return in_a_child


def _build(jit_function, specialization: str, device: torch.device) -> None:
    """Build one specialization into the kernel's in-process cache (and Triton's on-disk cache),
    as its first launch on `device` would have, and load it: its first launch would otherwise load
    it on the launching thread, and make its launcher there (gcc, 0.3 s a new signature on a fresh
    machine, on the dry step's path)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)  # the pool's threads start on device 0
    kernel = jit_function.preload(specialization)
    load = getattr(kernel, "_init_handles", None)  # (Triton's CompiledKernel loads on its first launch)
    if load is not None:
        try:
            load()
        except Exception as error:  # e.g. out of resources: its first launch raises it where it belongs
            logger.debug("loading %s beside the step failed: %r", getattr(kernel, "name", "a kernel"), error)


def _hook(**call):
    """Triton's jit_cache_hook (called with key, repr, fn, compile, is_manual_warmup, already_compiled)
    before a launch builds a specialization. True skips the build and the launch; on a thread whose
    dry step lists builds, that is the point."""
    builds: DryLaunches | None = getattr(PROCESS.listing, "builds", None)
    if builds is not None and not call.get("is_manual_warmup"):
        builds.add(call["fn"].jit_function, call["key"], call["compile"]["specialization_data"])
        return True
    previous = PROCESS.hook_before[0] if PROCESS.hook_before else None
    return previous(**call) if previous is not None else None


def imported_triton() -> ModuleType:
    """Triton, imported (ImportError where it is absent)."""
    # Triton: absent on some machines; asked for only where kernels are built
    import triton

    return triton


def available() -> bool:
    """Whether this Triton lists builds through a cache hook and builds a listed one (`preload`)."""
    try:
        module = imported_triton()
    except ImportError:
        return False
    runtime = getattr(getattr(module, "knobs", None), "runtime", None)
    return (runtime is not None and hasattr(runtime, "jit_cache_hook")
            and hasattr(module.runtime.jit.JITFunction, "preload"))


def dry_pass_pays(device: str | torch.device, compiled: bool) -> bool:
    """Whether a dry pass builds anything: on CUDA, uncompiled (compiled steps build their kernels through
    Inductor, which compiles on its own workers), where this Triton lists builds (`available`), while builds
    ahead are on (`PROCESS.ahead`)."""
    return torch.device(device).type == "cuda" and not compiled and available() and PROCESS.ahead.is_up


def _install() -> None:
    """Our hook, once per process, in front of whichever hook was there (it still gets every call
    ours does not take)."""
    knobs = imported_triton().knobs
    with PROCESS.lock:
        if not PROCESS.hook_before:
            PROCESS.hook_before.append(knobs.runtime.jit_cache_hook)
            knobs.runtime.jit_cache_hook = _hook


def build_threads() -> int:
    """Threads for the builds: the cores this process may use, at most MAX_BUILD_THREADS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_BUILD_THREADS, cores))


@dataclass
class BuildReport:
    """What a dry step listed: how many builds, which kernels, and how long they took once the step was done."""

    builds: int = 0
    kernels: list[str] = field(default_factory=list)
    wait_s: float = 0.0
    in_children: int = 0  # of `builds`, those a child process built (kernel_builders)


@contextlib.contextmanager
def dry_launches(device: torch.device) -> Iterator[BuildReport]:
    """On this thread, for the block: launches of kernels not built are listed and built on threads
    instead of run. On leaving, waits for the builds (the report's `wait_s`), BUILDS_WAIT_S at most:
    afterwards every listed kernel launches without building, unless a build failed or stalled (the builds
    ahead are off then, `PROCESS.ahead`, and that kernel builds at its first launch)."""
    if getattr(PROCESS.listing, "builds", None) is not None:
        raise RuntimeError("dry launches do not nest")
    _install()
    report = BuildReport()
    pool = DaemonPool(build_threads(), "kernel-build", PROCESS.ahead)  # (daemons: a stalled build holds no exit)
    PROCESS.listing.builds = builds = DryLaunches(pool, device_with_index(torch.device(device)))
    try:
        try:
            with step_mode.stepping(StepMode.DRY):
                yield report
        finally:  # (a block that raised: the builds under way end on their own; its error is the one raised)
            PROCESS.listing.builds = None
        started = time.perf_counter()
        try:
            builds.wait(Deadline(BUILDS_WAIT_S))
        finally:
            report.builds, report.kernels = len(builds.futures), builds.names
            report.wait_s = round(time.perf_counter() - started, 3)
            report.in_children = sum(map(_built_in_a_child, builds.futures.values()))
    finally:
        pool.shutdown()  # unbounded-ok: a DaemonPool's shutdown returns at once
        end_builders()  # their work was this pass's: a later one's kernels are built by then


@contextlib.contextmanager
def dry_pass(device: torch.device) -> Iterator[dict[str, float]]:
    """The context an engine runs its warm-up's steps dry in (StreamingEngine.run_dry): `dry_launches`, its
    report as seconds by part once the block ends: "kernel_builds_s" (the pass and the builds it listed),
    "kernel_builds" (how many), "kernel_builds_in_children" (of those, how many child processes built) and
    "kernel_builds_wait_s" (of the first, the wait for the builds after the dry steps)."""
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    with dry_launches(device) as report:
        yield seconds
    seconds.update(kernel_builds_s=round(time.perf_counter() - started, 3), kernel_builds=report.builds,
                   kernel_builds_in_children=report.in_children, kernel_builds_wait_s=report.wait_s)


def _built_in_a_child(build: Future) -> bool:
    """Whether a listed build is done and a child process made it (done: nothing here waits)."""
    return (build.done() and not build.cancelled() and build.exception(timeout=0) is None
            and bool(build.result(timeout=0)))


def start_builders(device: str | torch.device) -> None:
    """On CUDA, where a dry pass lists builds (`available`, builds ahead on) and Triton's on-disk cache holds no
    build of ours (a fresh machine's cache): child processes that will build the next dry pass's kernels
    (models/builds/kernel_builders.py), one per build thread, started from now so that their imports are done
    by the time it lists them. The pass ends them; so does `end_builders`. Asked before `start_early_builds`,
    whose builds fill the cache. Where the cache holds ours, a build is a cache hit on the pass's own threads
    in tens of milliseconds, where it would wait seconds for a child's start."""
    device = torch.device(device)
    if device.type != "cuda" or not available() or not PROCESS.ahead.is_up or not PROCESS.children.is_up:
        return
    # the kernels' module imports Triton: only where kernels are built
    from stream_recon.cache.triton_attention import range_kernel_name

    if triton_cache_holds(range_kernel_name()):
        return
    with PROCESS.lock:
        if PROCESS.builders is None:
            PROCESS.builders = kernel_builders.KernelBuilders(build_threads(), device_with_index(device).index,
                                                              PROCESS.children)


def triton_cache_holds(kernel_name: str) -> bool:
    """Whether Triton's on-disk cache holds a build of a kernel of this name (any specialization or source:
    Triton files each build as <key>/<name>.json)."""
    folder = getattr(getattr(getattr(imported_triton(), "knobs", None), "cache", None), "dir", None)
    folder = folder or os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    return next(Path(folder).glob(f"*/{kernel_name}.json"), None) is not None


def end_builders() -> None:
    """The child builders ended, if any run (a run whose dry pass never came ends them so)."""
    with PROCESS.lock:
        builders, PROCESS.builders = PROCESS.builders, None
    if builders is not None:
        builders.close()


def device_with_index(device: torch.device) -> torch.device:
    """`device` with its index: "cuda" is this thread's current GPU, which a pool's thread is not told."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def build_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """A daemon thread of the builds ahead's helper (`PROCESS.ahead`) running `target`: how the cache's kernel
    measurements start a thread of their own beside the early builds."""
    return start_supervised_thread(PROCESS.ahead, target, name)


def start_backend_builds(device: str | torch.device, dtype: torch.dtype, num_heads: int, head_dim: int,
                         attention: str, kv_cache: str) -> bool:
    """On CUDA, on a thread of its own, from now: the kernels the attention backend `attention` stands for here
    builds on its first use (its row's `build_ahead`: FlashInfer compiles its kernels on a machine's first
    ask), so that they are built beside the checkpoint's load rather than at the warm-up. True when the
    thread started (a backend that builds nothing ahead starts none)."""
    device = torch.device(device)
    if device.type != "cuda" or not PROCESS.ahead.is_up:
        return False
    # the backend table imports the cache's kernels: on CUDA only
    from stream_recon.cache import backends

    backend = backends.resolve(attention, device, dtype, backends.store_dtype(kv_cache, dtype))
    if backend.build_ahead is None:
        return False
    device = device_with_index(device)

    def build() -> None:
        torch.cuda.set_device(device)
        # Whatever it raises turns the builds ahead off (`PROCESS.ahead`); the first step builds them then.
        backend.build_ahead(device, dtype, num_heads, head_dim, build_thread)

    start_supervised_thread(PROCESS.ahead, build, "kernel-build-backend")
    return True


def start_early_builds(device: str | torch.device, dtype: torch.dtype, num_heads: int, head_dim: int) -> bool:
    """On CUDA, on a thread of its own, from now: the builds a warm-up's steps wait for where they are
    asked, which a dry pass cannot hand to its pool. The range kernel's scheduler reads the compiled
    kernel's registers and shared memory before it can launch anything (cache/triton_attention.py:
    `resident_programs`): two builds of 1.1-2.0 s each on a fresh machine, on the dry steps' path
    made side by side. Started before a checkpoint loads, they are done by
    the warm-up; a step that asks sooner waits for the build under way rather than making another. True
    when the thread started."""
    device = torch.device(device)
    if device.type != "cuda" or not available() or not PROCESS.ahead.is_up:
        return False
    device = device_with_index(device)

    def build() -> None:
        # the kernels' module imports Triton: only where kernels are built
        from stream_recon.cache.triton_attention import measure_resident_programs

        torch.cuda.set_device(device)
        # Whatever it raises turns the builds ahead off (`PROCESS.ahead`); the first step then measures the kernel
        # where it is asked, and raises there where it cannot. One that stalls holds the step no longer than
        # triton_attention.RESIDENT_PROGRAMS_WAIT_S: the step then builds its own.
        measure_resident_programs(device, dtype, num_heads, head_dim, start_thread=build_thread)

    start_supervised_thread(PROCESS.ahead, build, "kernel-build-early")
    return True
