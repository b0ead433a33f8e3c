"""Our Triton kernels built in child processes, each build with an interpreter of its own.

A build's Python front end holds the interpreter: on threads, eight builds of the range kernel took 4.9 s
where one takes 1.6 s (kernel_builds.MAX_BUILD_THREADS), and beside a checkpoint's load the builds and the
load wait for each other; a fresh machine's first prediction then came 3.1-4.0 s after the load, waiting for
them (docs/performance-log.md, "a compiled run steps as written while its code compiles beside the
stream"). A child builds a specialization (Triton's `JITFunction.preload`) and its launcher into Triton's on-disk
cache, which it shares with its parent (the same environment, so the same cache folder and target); the parent's own
build of it is then a cache hit, without the front end. The children start before the run's checkpoint
loads (`KernelBuilders`), so their imports overlap the load as well, and end with the dry pass they serve.

Supervised (models/supervision.py): a child that dies or does not answer within CHILD_BUILD_S turns the
children off for the process (the `Helper` they are given, kernel_builds.PROCESS.children: TURN_OFF, one
warning line), and the build it had, like every later
one, is made on the parent's thread as before. A build a child reports failed, and a kernel it cannot import
by name (one defined inside a function), are made on the parent's thread too, where an error belongs.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import queue
import select
import threading
import time
from collections.abc import Mapping
from typing import Any

from ..child_process import ChildProcess, read_message, start_child, write_message
from ..supervision import Deadline, Helper, HelperPolicy, WhenDown, WhenFull

# The longest a build waits for a child's answer, the child's start included: a start takes 2-3 s (torch's
# and Triton's imports) and a build 1-2 s on a fresh machine. Well under kernel_builds.BUILDS_WAIT_S, so a
# build a stalled child had is still made on the parent's thread within the dry pass's own deadline.
CHILD_BUILD_S = 20.0
KERNEL_BUILDERS = HelperPolicy("building kernels in child processes", WhenFull.DROP, WhenDown.TURN_OFF,
                               stall_s=CHILD_BUILD_S)


def importable_name(jit_function: Any) -> tuple[str, str] | None:
    """(module, qualified name) a child imports `jit_function` by; None for one defined inside a function."""
    fn = getattr(jit_function, "fn", None)
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname or "<locals>" in qualname:
        return None
    return module, qualname


def child_environment(device_index: int | None, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """A child's environment: this process's, with only the parent's GPU visible, so the child's current device,
    whose target Triton compiles for, is the parent's without the child selecting it (which would make a
    CUDA context there: memory on the GPU for nothing)."""
    env = dict(os.environ if environ is None else environ)
    if device_index is not None:
        visible = [name for name in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if name.strip()]
        env["CUDA_VISIBLE_DEVICES"] = visible[device_index] if device_index < len(visible) else str(device_index)
    return env


class KernelBuilders:
    """`count` child processes, started now, each building one kernel at a time.

    Started on the caller's thread, which must outlive them: Linux sends a child its parent-death signal
    (models/child_process.py, die_with_parent) when the thread that started it ends, not the process. The
    run's thread starts them, and the dry pass it waits for ends them."""

    def __init__(self, count: int, device_index: int | None, helper: Helper,
                 env: Mapping[str, str] | None = None) -> None:
        self.helper = helper  # the process's: down, no builders start again
        self._idle: queue.Queue[ChildProcess | None] = queue.Queue()  # None: closed (wakes a waiting build)
        self._children: list[ChildProcess] = []
        self._slots: dict[ChildProcess, int] = {}  # each child's place, by which `building` names its build
        self.building: dict[int, str] = {}  # what each child builds now, by its place
        self._lock = threading.Lock()
        self._closed = False
        self.built = 0  # builds the children made
        environment = child_environment(device_index, env)
        try:
            for _ in range(count):  # (a Popen each, a few milliseconds: the imports happen in the children)
                slot = len(self._children)
                child = start_child(__name__, "serve", helper=self.helper, env=environment,
                                    died=lambda code, slot=slot: self._died(slot, code))
                self._slots[child] = slot
                self._children.append(child)
                self._idle.put(child)
        except OSError as error:  # (no process to spare, say): the builds are made on the pass's threads
            self._down(None, f"a child could not be started ({error})")

    def build(self, jit_function: Any, specialization: str) -> bool:
        """Build `specialization` of `jit_function` (Triton's specialization data) in a child, into Triton's on-disk
        cache. True when a child built it; False where none did (the caller builds it itself)."""
        name = importable_name(jit_function)
        if name is None or not self.helper.is_up or self._closed:
            return False
        deadline = Deadline(CHILD_BUILD_S)
        try:
            child = self._idle.get(timeout=deadline.remaining())
        except queue.Empty:
            self._down(None, f"no child was ready within {CHILD_BUILD_S:g} s")
            return False
        if child is None or self._closed:  # closed: the sign passed on to the next build waiting
            self._idle.put(None)
            return False
        self.building[self._slots[child]] = name[1]
        try:
            write_message(child.requests, (*name, specialization))
            reply = _reply(child, deadline)
        except (OSError, ValueError, EOFError):  # (ValueError: its pipe closed by `close`)
            self._down(child, f"a child building {name[1]} died (exit code {child.process.poll()})")
            return False
        if reply is None:
            self._down(child, f"a child building {name[1]} did not answer within {CHILD_BUILD_S:g} s")
            return False
        self.helper.beat()
        self._idle.put(child)
        built = reply[0] == "built"
        self.built += built
        return built

    def _died(self, slot: int, code: int) -> str:
        """A child's death, said as its build's is (the monitor of children notices it when it happens)."""
        return f"a child building {self.building.get(slot, 'kernels')} died (exit code {code})"

    def _down(self, child: ChildProcess | None, reason: str) -> None:
        if child is not None:
            child.close()
        if not self._closed:  # (a child ended by `close` is not one that failed)
            self.helper.fail(reason)
            self.close()

    def close(self) -> None:
        """End every child now, whatever it is doing: a build cut short leaves nothing in Triton's cache (its
        files are written whole, then renamed), and the parent makes it if it still needs it."""
        with self._lock:
            self._closed = True
            children, self._children = self._children, []
        self._idle.put(None)
        for child in children:
            child.close()


def _reply(child: ChildProcess, deadline: Deadline) -> tuple | None:
    """The child's answer, or None when it has not come by `deadline`; EOFError where the child has gone. (A reply
    is a few bytes, written at once: once it starts arriving, it is whole.)"""
    readable, _, _ = select.select([child.replies], [], [], deadline.remaining())
    return read_message(child.replies) if readable else None


def serve(requests_fd: int, replies_fd: int) -> None:
    """In a child: build each (module, qualified name, specialization data) asked for, one after another, and answer
    ("built", seconds) or ("failed", why); returns when the parent closes its end. Torch, Triton and Triton's
    target are made ready first, before a request comes: the parent starts its children before its checkpoint
    loads so that these imports (2-3 s, most of a build's time on a fresh machine) overlap the load."""
    requests, replies = os.fdopen(requests_fd, "rb", buffering=0), os.fdopen(replies_fd, "wb", buffering=0)
    import torch  # noqa: F401  (our kernels' modules import it)
    from triton.runtime import driver

    with contextlib.suppress(Exception):  # (one that fails here fails again in a build, answered there)
        driver.active.get_current_target()
    while True:
        try:
            module, qualname, specialization = read_message(requests)
        except EOFError:
            return
        started = time.perf_counter()
        try:
            _make_launcher(_resolve(module, qualname).preload(specialization))
            answer: tuple = ("built", round(time.perf_counter() - started, 3))
        except Exception as error:  # noqa: BLE001 - answered: the parent builds it itself, where it raises
            answer = ("failed", f"{type(error).__name__}: {error}")
        with contextlib.suppress(BrokenPipeError):
            write_message(replies, answer)


def _make_launcher(kernel: Any) -> None:
    """The kernel's launcher made too, where Triton compiles one per signature (a C module built with the host's
    compiler, 0.2-0.4 s a kernel on a fresh machine, cached on disk by its source): the parent's first launch
    then loads it. Where Triton launches through one module for every kernel, making it costs nothing; where it
    cannot be made here, the parent makes it at its first launch, as without children."""
    # Triton: in a build child only, where the parent found it
    from triton.runtime import driver

    with contextlib.suppress(Exception):
        driver.active.launcher_cls(kernel.src, kernel.metadata)


def _resolve(module: str, qualname: str) -> Any:
    """The JITFunction named so (through a wrapper such as Triton's autotuner, whose `fn` it is)."""
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    while not hasattr(found, "preload") and hasattr(found, "fn"):
        found = found.fn
    return found
