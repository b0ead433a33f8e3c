"""What a run builds for its input size, and when: the one helper a run asks about compiled code and kernels.

A CUDA run's steps need code a fresh process does not have: our Triton kernels (built at their first
launch) and, compiled, Dynamo's traces and Inductor's kernels. From what this machine's compile caches hold
for the run's key (models/builds/compilation.py: `compiled_code_key`, `record`), `RunBuilds` decides:
- compiled or not (`--compile auto`: compiled where a record says this machine compiled the size; else
  uncompiled, the size compiled beside the run for the next one, app/run/background_compile.py);
- what runs while the checkpoint loads: uncompiled, the warm-up's dry pass (models/stream/builds_ahead.py:
  our kernels built side by side on a zero model); either way, the range kernel's two early builds
  (models/builds/kernel_builds.py). A compiled run's ~4 s of Dynamo tracing and Inductor loads hold the
  interpreter: beside the load they slowed both (docs/performance-log.md, "the compiled warm-up beside the
  checkpoint's load"), before the stream they delayed the first prediction by as much;
- when a compiled run compiles: where this machine compiled the size (no memory budget), beside its stream,
  which steps as written until the code is made (models/stream/compile_while_streaming.py; the engine is
  switched between frames, `after_frame`); a stream known to be at most WHILE_STREAMING_MIN_FRAMES steps as
  written to its end; elsewhere in the warm-up;
- the warm-up before the stream (`--warm-up auto`: where the engine's first streaming step would be slow);
- after it: the record of a compiled size, or the child process that compiles an uncompiled one.

Each part keeps the supervision contract (models/supervision.py): a pass ahead that fails or stalls past
builds_ahead.AHEAD_WAIT_S leaves its work to the warm-up, with one warning line; a compile beside the stream
that fails or stalls leaves the stream as written, with one warning line; a compile child that fails, stalls
or is stopped leaves a record that makes the next run of its size compile first. run.json: settings.compile,
summary.compile_beside, summary.compiled_while_streaming, summary.timings.warm_up_parts_s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape

from stream_recon.app.options import RunOptions
from stream_recon.app.run.background_compile import CompiledSizes
from stream_recon.app.run.clock import RunClock
from stream_recon.app.run.loading import load_model_for, prepared_for_run
from stream_recon.models.builds import compilation, kernel_builds
from stream_recon.models.stream.builds_ahead import BuildsAhead
from stream_recon.models.stream.compile_while_streaming import CompileWhileStreaming
from stream_recon.models.supervision import Deadline

# A stream known to be this short steps as written to its end rather than compile beside it: a compile from
# warm caches takes 5-6 s beside the stream, which by then is past frame 110-150 at 518x392-518x518.
WHILE_STREAMING_MIN_FRAMES = 200
# The longest a run's end waits for compiled code still being made beside its stream (a short stream's):
# 3.5-3.9 s from warm caches alone. A thread left compiling is a daemon and holds no exit.
WHILE_STREAMING_END_S = 15.0


def compiled_here(key: str | None) -> bool:
    """Whether this machine's compile caches hold the size of `key` (a record of its compile)."""

    return key is not None and compilation.recorded(key, "compiled")


@dataclass(frozen=True)
class CompileChoice:
    """Whether a run compiles its model, and what it does about the compile caches."""

    compile: bool
    beside: bool = False  # uncompiled because the caches lack the size: compile it beside the run


def compile_choice(option: str, device: str, key: str | None, warm_up: str = "auto") -> CompileChoice:
    """What `--compile` (auto | on | off) means for a run whose compiled-code key is `key` (`run_key`;
    None where the input size is not known before the first frame). auto compiles where a record says
    this machine compiled that key or must compile it first (no room beside a run, or a background
    compile that failed), and where the key is not known (the compile is then paid once, as with on);
    elsewhere the run is uncompiled and compiles its size beside itself. That compile starts after the
    run's warm-up: with `--warm-up off` auto compiles as on does (at the first streaming frame)."""

    if option == "off" or not str(device).startswith("cuda"):
        return CompileChoice(False)
    if option == "on" or warm_up == "off" or key is None or compiled_here(key) or compilation.recorded(key, "compile-first"):
        return CompileChoice(True)
    return CompileChoice(False, beside=True)


def run_key(device: str, dtype: Any, model_config: Any, stream_config: Any,
            input_size: tuple[int, int] | None) -> str | None:
    """The compiled-code key of a CUDA run (models.builds.compilation.compiled_code_key); None off CUDA or
    where the input size or the model's architecture is not known before the first frame."""
    if not str(device).startswith("cuda") or input_size is None or model_config is None:
        return None


    return compilation.compiled_code_key(model_config, stream_config, input_size, dtype, torch.device(device))


def start_builds_ahead(options: RunOptions, device: str, dtype: Any, model_config: Any, engine_config: Any,
                       input_size: tuple[int, int] | None, *, compile: bool) -> BuildsAhead | None:
    """The warm-up's dry pass on a thread while the checkpoint loads (models/stream/builds_ahead.py), where it
    pays (CUDA, uncompiled) and can: the model input's size known before the first frame, and no memory
    budget (its zero model is a second copy of the weights until the pass ends). None otherwise, and
    where the warm-up is off: the first frame's own steps then build one kernel at a time, as they would."""

    if model_config is None or engine_config is None or input_size is None or options.gpu_memory is not None:
        return None
    if options.warm_up == "off" or not kernel_builds.dry_pass_pays(device, compile):
        return None
    return BuildsAhead(model_config, engine_config, input_size, device, dtype)


class RunBuilds:
    """A run's builds, asked at four moments: the model (`model`), its first frame (`before_stream`), run.json
    (`summary`) and the run's end (`finish`; `abandon` where the set-up failed)."""

    def __init__(self, options: RunOptions, device: str, dtype: Any, model_config: Any, engine_config: Any,
                 input_size: tuple[int, int] | None) -> None:
        self.options, self.device, self.dtype = options, device, dtype
        self.model_config, self.engine_config, self.input_size = model_config, engine_config, input_size
        key = run_key(device, dtype, model_config, engine_config, input_size)
        self.choice = compile_choice(options.compile, device, key, options.warm_up)
        self.ahead: BuildsAhead | None = None
        self.compiled_sizes: CompiledSizes | None = None
        # A size this machine compiled: the stream steps as written while its compiled code is made beside
        # it, rather than waiting for that before the first frame (models/stream/compile_while_streaming.py).
        # Not under a memory budget (the compiling engine's cache and activations are not in its plan).
        self.compiles_while_streaming = (self.choice.compile and options.gpu_memory is None
                                         and compiled_here(key))
        self.while_streaming: CompileWhileStreaming | None = None
        self.compiled_from_frame: int | None = None  # the first frame stepped compiled, once it is
        self.not_compiled: str | None = None  # why a run that steps as written compiles nothing beside
        self._early_builds = False  # kernels building on a thread before the checkpoint loads

    def model(self, given: Any, console: Console) -> Any:
        """The run's model, prepared (compiled as `choice` says): `given` (a caller's model, prepared here
        unless it was), or the checkpoint's, loaded while the work ahead runs beside the load."""
        if self.model_config is not None:

            if self._dry_pass_comes():  # (before the early builds, which fill Triton's cache)
                kernel_builds.start_builders(self.device)
            self._early_builds = kernel_builds.start_early_builds(self.device, self.dtype, self.model_config.num_heads,
                                                                  self.model_config.head_dim)
        if given is None:
            self.ahead = start_builds_ahead(self.options, self.device, self.dtype, self.model_config,
                                            self.engine_config, self.input_size, compile=self.choice.compile)
            model = load_model_for(self.options, self.device, console, compile=self.choice.compile)
        else:
            model = prepared_for_run(given, self.options, self.device, compile=self.choice.compile)
        if self.device.startswith("cuda") and self.engine_config is not None:
            self.compiled_sizes = CompiledSizes(self.options, model, self.device, self.dtype, self.engine_config,
                                                self.choice.beside)
        return model

    def before_stream(self, engine: Any, image: Any, stream_length: int | None, clock: RunClock,
                      console: Console) -> None:
        """At the first frame (the model input `image`, before it is pushed): the work ahead done, then the
        warm-up where it is on (`--warm-up`; auto where the engine's first streaming step would be slow and
        the stream has one), then the compiled size recorded or its compile started beside the run."""
        ahead = self._wait_for_ahead(image)
        if self.compiles_while_streaming:
            engine.steps_eagerly(True)
        self._warm_up(engine, image, stream_length, ahead, clock, console)
        if not self.compiles_while_streaming:
            return
        if stream_length is not None and stream_length <= WHILE_STREAMING_MIN_FRAMES:
            self.not_compiled = (f"the stream is {stream_length} frames, not more than {WHILE_STREAMING_MIN_FRAMES}: "
                                 "it steps as written")
            return

        self.while_streaming = CompileWhileStreaming(engine.model, engine.steps_config, image)

    def after_frame(self, engine: Any, frames_read: int) -> None:
        """Between frames, while the compiled code is made beside the stream: once it is, the engine steps
        compiled from the next frame on (one that failed leaves it stepping as written, with one warning)."""
        making = self.while_streaming
        if making is None or self.compiled_from_frame is not None:
            return
        if making.ready:
            engine.steps_eagerly(False)
            self.compiled_from_frame = frames_read

    def _dry_pass_comes(self) -> bool:
        """Whether a dry pass will build the run's kernels with child builders beside it (kernel_builders):
        uncompiled on CUDA with the warm-up not off (auto warms up where the engine's first streaming step would
        be slow: uncompiled on CUDA, where its kernels are not built, it is), and no memory budget (a child's
        CUDA runtime is not in its plan)."""

        return (self.options.warm_up != "off" and self.options.gpu_memory is None
                and kernel_builds.dry_pass_pays(self.device, self.choice.compile))

    def _warm_up(self, engine: Any, image: Any, stream_length: int | None, ahead: dict[str, float] | None,
                 clock: RunClock, console: Console) -> None:
        if not self._warms_up(engine, stream_length):
            return
        height, width = image.shape[-2:]
        spec = getattr(getattr(engine, "model", None), "inference_spec", None)
        compiled = getattr(spec, "compiled", False) and not self.compiles_while_streaming
        made = "is compiled and recorded" if compiled else "is recorded"
        if not str(self.device).startswith("cuda"):  # nothing is recorded off the GPU: the step only runs
            made = "runs once"
        console.print(f"[dim]warming up for {width}x{height} frames: the streaming step {made} before the "
                      "stream starts[/dim]", highlight=False)
        clock.time_warm_up(engine.warm_up, image, dry_pass=ahead is None)
        if ahead is not None and clock.warm_up_parts is not None:
            clock.warm_up_parts.update(ahead)
        if self.compiled_sizes is not None:
            note = self.compiled_sizes.warmed_up((height, width), getattr(engine, "memory_plan", None))
            if note:
                console.print(f"[dim]{escape(note)}[/dim]", highlight=False)

    def _wait_for_ahead(self, image: Any) -> dict[str, float] | None:
        """The dry pass run while the checkpoint loaded, done (its seconds by part) where it was for frames of
        this size; else None (the warm-up makes its own)."""
        if self.ahead is None:
            return None
        seconds = self.ahead.wait()  # unbounded-ok: BuildsAhead.wait ends AHEAD_WAIT_S after its first call
        return seconds if self.ahead.covers(image.shape[-2:]) else None

    def _warms_up(self, engine: Any, stream_length: int | None) -> bool:
        choice = self.options.warm_up
        if choice != "auto":
            return choice == "on"
        # a stream of scale frames only has no streaming step to wait for
        return engine.slow_first_step and (stream_length is None or stream_length > self.options.scale_frames)

    def helpers(self) -> dict[str, Any]:
        """The builds' helpers that ran, by run.json's name (models.supervision.Helper): the kernels built ahead
        of the stream (the warm-up's dry pass and the early builds, on CUDA) and the compile beside the stream."""
        ran = {}
        if self.ahead is not None or self._early_builds:
            ran["kernel_builds"] = kernel_builds.helper
        if self.while_streaming is not None:
            ran["compile_while_streaming"] = self.while_streaming.helper
        return ran

    def summary(self) -> dict[str, Any]:
        """run.json's summary parts of the builds: compile_beside (CUDA runs), compiled_while_streaming (where
        the compiled code was made beside the stream: from which frame the stream stepped compiled, the
        seconds it took, or why it did not)."""
        parts: dict[str, Any] = {}
        if self.compiled_sizes is not None:
            parts["compile_beside"] = self.compiled_sizes.summary()
        making = self.while_streaming
        if making is not None or self.not_compiled is not None:
            parts["compiled_while_streaming"] = {
                "from_frame": self.compiled_from_frame, "seconds": None if making is None else making.seconds,
                "off": self.not_compiled or making.helper.down_reason}
        return parts

    def finish(self, stopped_by_signal: bool) -> str | None:
        """At the run's end: the work ahead over (a stream that ended before its first frame never waited for
        it), the compile child left to finish or, after a signal, stopped. A line for the console, or None."""
        self.abandon()
        if self.while_streaming is not None:
            self.while_streaming.end(Deadline(0.0 if stopped_by_signal else WHILE_STREAMING_END_S))
        return None if self.compiled_sizes is None else self.compiled_sizes.finish(stop=stopped_by_signal)

    def abandon(self) -> None:
        """The set-up failed or the run ended: the pass ahead's thread holds the GPU until it ends, so it is
        not left running; child builders its dry pass did not end are ended."""
        if self.ahead is not None:
            self.ahead.wait()  # unbounded-ok: BuildsAhead.wait ends AHEAD_WAIT_S after its first call
        if self.model_config is not None and str(self.device).startswith("cuda"):

            kernel_builds.end_builders()
