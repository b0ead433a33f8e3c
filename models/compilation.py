"""TorchInductor's fusion of a prepared model's pure parts, compiled beside the stream.

`prepare_for_inference` replaces each fused method (the blocks' halves, the heads' pure parts) by
a `FusedFunction`: the function as written and its torch.compile'd version. Compiling a frame
size takes 6-15 s on an H100 (Dynamo's trace, Inductor's code generation, Triton's builds), and a
first call compiles where it is made, so a stream that waited for it would stop for that long at
its first streaming frame. Instead a step runner runs its first frame with the functions as
written while noting their arguments (`eager_functions(collect_into=compilation.collect())`),
records its CUDA graphs from them, and calls `Compilation.start`: a thread calls each compiled
function not compiled yet once, on copies of those arguments and a CUDA stream of its own, while
the stream replays the eager graphs. Once the progress is `ready`, the runner records its graphs
again, now from the compiled functions, which find their compiled code without compiling anything
(Dynamo's cache is per code object, shared by every wrapper of one function). A later stream of
the same frame size finds every call compiled and records compiled graphs at once; one of a new
size compiles its own calls beside it.

Which version runs is the calling thread's choice (a thread-local flag), so a spare engine's
worker, the scale frames (always eager: they run once per chunk) and the compile thread never
change what another thread runs.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import sys
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

# While the compile thread runs, the interpreter hands the GIL over at least this often (seconds;
# Python's default is 5 ms). Dynamo and Inductor are Python that holds it for whole switch
# intervals, and every wait of the stream's thread (an event, a queue) costs it one more interval
# to get the GIL back: at 0.5 ms the stream ran at about half its eager rate while a fresh machine
# compiled (H100, docs/PERFORMANCE.md).
SWITCH_INTERVAL_WHILE_COMPILING = 0.0001

_thread_state = threading.local()  # .eager: bool, .collect: Collection | None

# Held by a thread while it captures a CUDA graph, and by the compile thread while it makes a compiled
# call: the call loads new kernel modules and launches them, and a capture on another thread then
# fails (cudaErrorStreamCaptureInvalidated, H100, torch 2.11). A capture waits for at most one call.
CAPTURE_LOCK = threading.Lock()


@contextlib.contextmanager
def eager_functions(collect_into: Collection | None = None):
    """Within, on this thread, every FusedFunction runs as written (never compiling); with
    `collect_into`, each call is noted there for `Compilation.start`."""
    prior = (getattr(_thread_state, "eager", False), getattr(_thread_state, "collect", None))
    _thread_state.eager, _thread_state.collect = True, collect_into
    try:
        yield
    finally:
        _thread_state.eager, _thread_state.collect = prior


class FusedFunction:
    """A function and its compiled version: called, the compiled one, unless the calling thread is
    inside `eager_functions`."""

    def __init__(self, function: Callable, compiled: Callable):
        self.function = function
        self.compiled = compiled

    def __call__(self, *args, **kwargs):
        if not getattr(_thread_state, "eager", False):
            return self.compiled(*args, **kwargs)
        collection: Collection | None = getattr(_thread_state, "collect", None)
        if collection is not None:
            collection.note(self, args, kwargs)
        return self.function(*args, **kwargs)


def compile_static(function: Callable) -> Callable:
    """TorchInductor, one graph per input shape (every shape of a stream is fixed)."""
    return torch.compile(function, dynamic=False)


class Compilation:
    """The compile of one prepared model's FusedFunctions. A step run inside
    `eager_functions(collect_into=compilation.collect())` notes its calls; `start` compiles those
    that nothing has compiled yet on a thread of its own (a round), and says when all of that
    step's calls are compiled. A call made compiled without that compiles where it is made."""

    def __init__(self, compile_function: Callable[[Callable], Callable] = compile_static):
        self.compile_function = compile_function
        self._lock = threading.Lock()
        self._rounds: dict[tuple, _Round] = {}  # every call signature compiled or being compiled

    def fuse(self, function: Callable) -> FusedFunction:
        """`function` with a compiled version beside it."""
        return FusedFunction(function, self.compile_function(function))

    def collect(self) -> Collection:
        return Collection(self)

    def known(self, key: tuple) -> bool:
        with self._lock:
            return key in self._rounds

    def ready_for(self, collection: Collection) -> bool:
        """Whether every call of the collected step is compiled already."""
        with self._lock:
            if any(key not in self._rounds for key in collection.keys):
                return False
            return Progress({self._rounds[key] for key in collection.keys}).ready

    def start(self, collection: Collection) -> Progress:
        """Compile the collected calls not compiled yet on a new thread, each in the inference mode,
        grad mode and autocast state it was made in (Dynamo guards on them), after the work queued on
        the calling thread's CUDA stream (which wrote the copies of their arguments), one call at a
        time under CAPTURE_LOCK. Returns the progress of every call the step made."""
        with self._lock:
            calls = [call for key, call in collection.calls.items() if key not in self._rounds]
            if calls:
                new_round = _Round()
                for key in collection.calls:
                    self._rounds.setdefault(key, new_round)
                new_round.start(calls)
            return Progress({self._rounds[key] for key in collection.keys})


class Collection:
    """The calls of one eager step: every signature seen, and a copy of the arguments of those that
    the compilation does not know yet."""

    def __init__(self, compilation: Compilation):
        self.compilation = compilation
        self.keys: set[tuple] = set()
        self.calls: dict[tuple, tuple[FusedFunction, tuple, dict, _GlobalState]] = {}

    def note(self, fused: FusedFunction, args: tuple, kwargs: dict) -> None:
        state = _GlobalState.now()
        key = (_code_of(fused.function), _signature(args), _signature(tuple(sorted(kwargs.items()))), state)
        self.keys.add(key)
        if key not in self.calls and not self.compilation.known(key):
            self.calls[key] = (fused, _copied(args), _copied(kwargs), state)


class Progress:
    """Whether the compiled versions of a step's calls are all ready (or one of them failed)."""

    def __init__(self, rounds: set[_Round]):
        self._rounds = rounds

    @property
    def ready(self) -> bool:
        return all(r.done.is_set() and r.error is None for r in self._rounds)

    @property
    def failed(self) -> bool:
        return any(r.done.is_set() and r.error is not None for r in self._rounds)

    def wait(self, timeout: float | None = None) -> bool:
        """Until every round is done (True) or `timeout` seconds passed (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for r in self._rounds:
            if not r.done.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
                return False
        return True

    @property
    def seconds(self) -> float:
        """The longest round's compile time (NaN until all are done)."""
        if not all(r.done.is_set() for r in self._rounds):
            return math.nan
        return max((r.seconds for r in self._rounds), default=0.0)


class _Round:
    """One thread calling compiled functions once each, so that they compile."""

    def __init__(self):
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.seconds = math.nan

    def start(self, calls: list[tuple[FusedFunction, tuple, dict, _GlobalState]]) -> None:
        written = _event_on_current_stream(calls)
        threading.Thread(target=self._compile, args=(calls, written), name="stream-recon-compile",
                         daemon=True).start()

    def _compile(self, calls, written) -> None:
        started = time.perf_counter()
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, SWITCH_INTERVAL_WHILE_COMPILING))
        try:
            stream = None
            if written is not None:
                event, device = written
                stream = torch.cuda.Stream(device)
                stream.wait_event(event)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for fused, args, kwargs, state in calls:
                    with CAPTURE_LOCK, state.restored():
                        fused.compiled(*args, **kwargs)
                        if stream is not None:
                            stream.synchronize()  # its kernels are done before a capture may begin
                    time.sleep(0.001)  # a capture waiting for the lock takes it here
        except BaseException as error:  # the runner keeps its eager graphs
            self.error = error
            log.warning("compiling the model beside the stream failed (%s: %s); it goes on uncompiled",
                        type(error).__name__, error)
        finally:
            sys.setswitchinterval(interval)
            self.seconds = time.perf_counter() - started
            self.done.set()


@dataclass(frozen=True)
class _GlobalState:
    """What of the calling thread's state a compiled graph is specialised on (Dynamo's global-state
    guard): the camera head runs float32 inside a bf16 step, so one function is called in both."""

    inference: bool
    grad: bool
    autocast: bool
    autocast_dtype: torch.dtype
    autocast_cache: bool

    @classmethod
    def now(cls) -> _GlobalState:
        return cls(torch.is_inference_mode_enabled(), torch.is_grad_enabled(), torch.is_autocast_enabled("cuda"),
                   torch.get_autocast_dtype("cuda"), torch.is_autocast_cache_enabled())

    @contextlib.contextmanager
    def restored(self):
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode(self.inference))
            stack.enter_context(torch.set_grad_enabled(self.grad))
            if self.autocast or torch.is_autocast_enabled("cuda"):
                stack.enter_context(torch.autocast("cuda", dtype=self.autocast_dtype, enabled=self.autocast,
                                                   cache_enabled=self.autocast_cache))
            yield


def _code_of(function: Callable) -> Any:
    """What identifies a function across its bound copies: the code object (one per `def`)."""
    function = getattr(function, "__func__", function)
    return getattr(function, "__code__", function)


def _signature(values) -> tuple:
    """A hashable description of arguments as Dynamo's guards see them: tensors by shape, strides,
    dtype, device and inference mode; modules by type (their weights are graph inputs, not part of
    its identity); other objects (a RoPE table, say) by type and attributes; plain values by value."""
    if isinstance(values, torch.Tensor):
        return ("tensor", tuple(values.shape), values.stride(), values.dtype, str(values.device), values.is_inference())
    if isinstance(values, torch.nn.Module):
        return ("module", type(values))
    if isinstance(values, (tuple, list)):
        return (type(values).__name__, *(_signature(value) for value in values))
    if isinstance(values, dict):
        return ("dict", *((key, _signature(value)) for key, value in sorted(values.items())))
    if _is_plain_object(values):
        return ("object", type(values), _signature(vars(values)))
    return ("value", type(values), repr(values))


def _copied(values):
    """Arguments with every tensor copied (the caller's may be overwritten before the compile runs),
    inference tensors as inference tensors (Dynamo's guards tell them apart)."""
    if isinstance(values, torch.Tensor):
        return _copied_tensor(values)
    if isinstance(values, (tuple, list)):
        return type(values)(_copied(value) for value in values)
    if isinstance(values, dict):
        return {key: _copied(value) for key, value in values.items()}
    if _is_plain_object(values):
        copied = copy.copy(values)
        for name, value in vars(values).items():
            object.__setattr__(copied, name, _copied(value))  # (frozen dataclasses too)
        return copied
    return values


def _copied_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A copy with the same sizes and strides (Dynamo guards on both: a view's clone would be
    contiguous, and the stream's call would compile again), over a storage of its own: the span of
    the original's storage that it reads, copied whole."""
    with torch.inference_mode(tensor.is_inference()):  # asked before detach(), which may change it
        tensor = tensor.detach()
        if tensor.numel() == 0 or any(stride < 0 for stride in tensor.stride()):
            return tensor.clone()
        span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
        storage = torch.empty(span, dtype=tensor.dtype, device=tensor.device)
        storage.copy_(tensor.as_strided((span,), (1,)))
        return storage.as_strided(tensor.shape, tensor.stride())


def _is_plain_object(value) -> bool:
    """An instance with attributes of its own (a dataclass, say): not a module, function or class."""
    return hasattr(value, "__dict__") and not isinstance(
        value, (torch.nn.Module, type, types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.ModuleType))


def _event_on_current_stream(calls) -> tuple[torch.cuda.Event, torch.device] | None:
    """An event after the copies on the current CUDA stream, and its device, if any argument is on a GPU."""
    for _, args, kwargs, _ in calls:
        for value in (*_tensors(args), *_tensors(kwargs)):
            if value.is_cuda:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(value.device))
                return event, value.device
    return None


def _tensors(values):
    if isinstance(values, torch.Tensor):
        yield values
    elif isinstance(values, (tuple, list)):
        for value in values:
            yield from _tensors(value)
    elif isinstance(values, dict):
        for value in values.values():
            yield from _tensors(value)
