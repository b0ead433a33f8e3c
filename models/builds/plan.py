"""What a run builds, when and where: one table (`STAGES`) and the `Builder` that follows it.

A CUDA run's steps need code a fresh process does not have: our Triton kernels (built at their first
launch), the streaming step's CUDA graph and, compiled, Dynamo's traces and Inductor's kernels. Each
stage below is a row: what it builds, its moment, its place, what a failure does, what run.json keeps,
and when it runs (`runs`, read from the run's `Facts`). The builder asks the table, never a flag of its
own, and holds the state of what it started. The engine knows none of this: it is handed a dry-pass
context for its warm-up (`StreamingEngine.run_dry`) and told how to step (`steps_eagerly`).

Compiled or not (`--compile auto`): compiled where a record says this machine compiled the run's size
(models/builds/compilation.py: `compiled_code_key`, `record`); else uncompiled, with the size compiled in a
child for the next run. A compiled run's ~4 s of Dynamo tracing holds the interpreter: beside the checkpoint's
load it slowed both (docs/performance-log.md, "the compiled warm-up beside the checkpoint's load"), so it
compiles beside the stream instead, which steps as written until the code is made.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from ..supervision import CHILDREN, Deadline, Helper, WhenDown
from . import compilation, kernel_builds
from .ahead import BuildsAhead
from .compile_child import CHILD_LIMIT_S, CompiledSizes
from .while_streaming import CompileWhileStreaming

# A stream known to be this short steps as written to its end rather than compile beside it: a compile from
# warm caches takes 5-6 s beside the stream, which by then is past frame 110-150 at 518x392-518x518.
WHILE_STREAMING_MIN_FRAMES = 200
# The longest a run's end waits for compiled code still being made beside its stream (a short stream's):
# 3.5-3.9 s from warm caches alone. A thread left compiling is a daemon and holds no exit.
WHILE_STREAMING_END_S = 15.0


@dataclass(frozen=True)
class BuildSettings:
    """What the builds of a run depend on: its options (`--compile`, `--warm-up`, `--gpu-memory`), device,
    precision, and what is known of the model and its input before the first frame (None: not known)."""

    compile: str  # auto | on | off
    warm_up: str  # auto | on | off
    gpu_memory: str | None
    scale_frames: int
    device: str
    dtype: torch.dtype
    model_config: Any = None
    engine_config: Any = None  # the settings each chunk's engine streams with
    input_size: tuple[int, int] | None = None

    @property
    def on_cuda(self) -> bool:
        return str(self.device).startswith("cuda")


@dataclass(frozen=True)
class CompileChoice:
    """Whether a run compiles its model, and what it does about the compile caches."""

    compile: bool
    beside: bool = False  # uncompiled because the caches lack the size: compile it in a child for the next run


@dataclass
class Facts:
    """What the table's rows are decided on: the settings, the compile choice, and at the first frame the
    stream's known length and whether the engine's first streaming step would be slow."""

    settings: BuildSettings
    choice: CompileChoice
    compiled_here: bool  # this machine's caches hold the run's size
    loading_checkpoint: bool = True  # the model comes from a checkpoint (not a caller's)
    model_compiled: bool | None = None  # once the model is there
    stream_length: int | None = None
    slow_first_step: bool = False

    @property
    def dry_pass_pays(self) -> bool:
        """A dry pass builds anything: uncompiled on CUDA, with builds ahead on (kernel_builds.dry_pass_pays)."""
        compiled = self.choice.compile if self.model_compiled is None else self.model_compiled
        return kernel_builds.dry_pass_pays(self.settings.device, compiled)

    @property
    def builds_before_stream(self) -> bool:
        """A dry pass will come, and work may start for it before the model is loaded: not where the warm-up is
        off, nor under a memory budget (neither a zero model's second copy of the weights nor a child's CUDA
        runtime is in its plan)."""
        settings = self.settings
        return settings.warm_up != "off" and settings.gpu_memory is None and self.dry_pass_pays

    @property
    def warms_up(self) -> bool:
        """`--warm-up on`, or auto where the first streaming step would be slow and the stream has one."""
        if self.settings.warm_up != "auto":
            return self.settings.warm_up == "on"
        length = self.stream_length
        return self.slow_first_step and (length is None or length > self.settings.scale_frames)

    @property
    def steps_as_written(self) -> bool:
        """A size this machine compiled: the stream steps as written rather than wait for its compiled code
        (not under a memory budget: a compiling engine beside it is not in its plan)."""
        return self.choice.compile and self.settings.gpu_memory is None and self.compiled_here

    @property
    def short_stream(self) -> bool:
        return self.stream_length is not None and self.stream_length <= WHILE_STREAMING_MIN_FRAMES


@dataclass(frozen=True)
class BuildStage:
    name: str
    builds: str
    moment: str
    place: str
    on_failure: WhenDown
    records: str  # where run.json says how it went
    runs: Callable[[Facts], bool]


STAGES = (
    BuildStage("early_kernel_builds", "the range kernel's two specializations its scheduler measures at once",
               "before the checkpoint loads", "a thread, kernel-build-early", WhenDown.TURN_OFF,
               "summary.helpers.kernel_builds",
               lambda facts: facts.settings.on_cuda and facts.settings.model_config is not None),
    BuildStage("backend_builds", "the attention backend's kernels it builds on first use (FlashInfer's)",
               "before the checkpoint loads", "a thread, kernel-build-backend", WhenDown.TURN_OFF,
               "summary.helpers.kernel_builds",
               lambda facts: facts.settings.on_cuda and None not in (facts.settings.model_config,
                                                                     facts.settings.engine_config)),
    BuildStage("kernel_builders", "our Triton kernels a dry pass lists, into Triton's on-disk cache",
               "from before the checkpoint loads to the dry pass's end", "child processes, one per build thread",
               WhenDown.TURN_OFF, "summary.timings.warm_up_parts_s.kernel_builds_in_children",
               lambda facts: facts.builds_before_stream and facts.settings.model_config is not None),
    BuildStage("dry_pass_ahead", "the warm-up's dry pass on a zero-weight model of the run's settings",
               "while the checkpoint loads", "a thread, kernel-build-ahead", WhenDown.TURN_OFF,
               "summary.timings.warm_up_parts_s.kernel_builds_ahead_s",
               lambda facts: (facts.builds_before_stream and facts.loading_checkpoint
                              and None not in (facts.settings.model_config, facts.settings.engine_config,
                                               facts.settings.input_size))),
    BuildStage("dry_pass", "the warm-up's dry pass on the run's engine", "at the warm-up, where none ran ahead",
               "the run's thread, its builds on a pool", WhenDown.TURN_OFF,
               "summary.timings.warm_up_parts_s.kernel_builds_s", lambda facts: facts.dry_pass_pays and facts.warms_up),
    BuildStage("warm_up", "the streaming step's CUDA graph (and, compiled, its code where not made beside)",
               "before the first frame", "the run's thread", WhenDown.FAIL_RUN, "summary.timings.warm_up_s",
               lambda facts: facts.warms_up),
    BuildStage("compile_while_streaming", "the compiled code of a size this machine compiled before",
               "from the first frame; the stream steps as written meanwhile", "a thread, compile-while-streaming",
               WhenDown.TURN_OFF, "summary.compiled_while_streaming",
               lambda facts: facts.steps_as_written and not facts.short_stream),
    BuildStage("compile_child", "the compiled code of a new size, for the next run", "after the warm-up",
               "a child process, niced, in a session of its own", WhenDown.TURN_OFF, "summary.compile_beside",
               lambda facts: facts.settings.on_cuda and facts.choice.beside and facts.settings.engine_config is not None),
)
STAGE = MappingProxyType({stage.name: stage for stage in STAGES})  # (read only: the table is no state)


def compiled_here(key: str | None) -> bool:
    """Whether this machine's compile caches hold the size of `key` (a record of its compile)."""
    return key is not None and compilation.recorded(key, "compiled")


def compile_choice(option: str, device: str, key: str | None, warm_up: str = "auto") -> CompileChoice:
    """What `--compile` (auto | on | off) means for a run whose compiled-code key is `key` (`run_key`; None where
    the input size is not known before the first frame). auto compiles where a record says this machine compiled
    that key or must compile it first (no room beside a run, or a background compile that failed), and where
    the key is not known (the compile is then paid once, as with on); elsewhere the run is uncompiled and its
    size compiles in a child after the warm-up: with `--warm-up off` auto compiles as on does."""
    if option == "off" or not str(device).startswith("cuda"):
        return CompileChoice(False)
    if option == "on" or warm_up == "off" or key is None or compiled_here(key) or compilation.recorded(key, "compile-first"):
        return CompileChoice(True)
    return CompileChoice(False, beside=True)


def run_key(settings: BuildSettings) -> str | None:
    """The compiled-code key of a CUDA run (compilation.compiled_code_key); None off CUDA or where the input
    size or the model's architecture is not known before the first frame."""
    if not settings.on_cuda or settings.input_size is None or settings.model_config is None:
        return None
    return compilation.compiled_code_key(settings.model_config, settings.engine_config, settings.input_size,
                                         settings.dtype, torch.device(settings.device))


class Builder:
    """A run's builds, asked at its moments: the model (`model`), the first frame (`before_stream`), between
    frames (`after_frame`), run.json (`summary`, `helpers`) and the end (`finish`; `abandon` where the set-up
    failed). `say` prints a line for the user."""

    def __init__(self, settings: BuildSettings, say: Callable[[str], None]) -> None:
        self.settings, self.say = settings, say
        key = run_key(settings)
        self.choice = compile_choice(settings.compile, settings.device, key, settings.warm_up)
        self.facts = Facts(settings, self.choice, compiled_here(key))
        self.ahead: BuildsAhead | None = None
        self.compiled_sizes: CompiledSizes | None = None
        self.while_streaming: CompileWhileStreaming | None = None
        self.compiled_from_frame: int | None = None  # the first frame stepped compiled, once it is
        self.not_compiled: str | None = None  # why a compiled size's run steps as written to its end
        self._ran: set[str] = set()

    def runs(self, stage: str) -> bool:
        """Whether the table's row `stage` runs for this run, on what is known now; noted for run.json."""
        runs = STAGE[stage].runs(self.facts)
        if runs:
            self._ran.add(stage)
        return runs

    def model(self, load: Callable[[bool], Any], *, loading_checkpoint: bool) -> Any:
        """The run's model from `load(compile)` (a checkpoint's, or a caller's prepared here), the stages
        before it started first so that they run beside the load."""
        self.facts.loading_checkpoint = loading_checkpoint
        settings = self.settings
        if self.runs("kernel_builders"):  # (before the early builds, which fill Triton's cache)
            kernel_builds.start_builders(settings.device)
        if self.runs("early_kernel_builds"):
            config = settings.model_config
            if not kernel_builds.start_early_builds(settings.device, settings.dtype, config.num_heads, config.head_dim):
                self._ran.discard("early_kernel_builds")
        if self.runs("backend_builds"):
            config, engine = settings.model_config, settings.engine_config
            if not kernel_builds.start_backend_builds(settings.device, settings.dtype, config.num_heads,
                                                      config.head_dim, engine.attention, engine.kv_cache):
                self._ran.discard("backend_builds")
        if self.runs("dry_pass_ahead"):
            self.ahead = BuildsAhead(settings.model_config, settings.engine_config, settings.input_size,
                                     settings.device, settings.dtype)
        model = load(self.choice.compile)
        self.facts.model_compiled = bool(model.inference_spec.compiled)
        if settings.on_cuda and settings.engine_config is not None:
            self.compiled_sizes = CompiledSizes(settings.gpu_memory, model, settings.device, settings.dtype,
                                                settings.engine_config, self.runs("compile_child"))
        return model

    def before_stream(self, engine: Any, image: Any, stream_length: int | None) -> tuple[float, dict] | None:
        """At the first frame (the model input `image`, before it is pushed): the pass ahead done, the warm-up
        where it runs, then the size recorded, or compiled beside the stream or in a child. The warm-up's
        seconds and its seconds by part, or None where there was none."""
        self.facts.stream_length = stream_length
        self.facts.slow_first_step = bool(getattr(engine, "slow_first_step", False))
        ahead = self._wait_for_ahead(image)
        beside = self.runs("compile_while_streaming")
        if self.facts.steps_as_written:
            engine.steps_eagerly(True)
        if self.facts.steps_as_written and not beside:
            self.not_compiled = (f"the stream is {stream_length} frames, not more than {WHILE_STREAMING_MIN_FRAMES}: "
                                 "it steps as written")
        warmed = self._warm_up(engine, image, ahead) if self.runs("warm_up") else None
        if beside:
            self.while_streaming = CompileWhileStreaming(engine.model, engine.steps_config, image)
        return warmed

    def after_frame(self, engine: Any, frames_read: int) -> None:
        """Between frames, while the compiled code is made beside the stream: once it is, the engine steps
        compiled from the next frame on (one that failed leaves it stepping as written, with one warning)."""
        making = self.while_streaming
        if making is None or self.compiled_from_frame is not None:
            return
        if making.ready:
            engine.steps_eagerly(False)
            self.compiled_from_frame = frames_read

    def _warm_up(self, engine: Any, image: Any, ahead: dict[str, float] | None) -> tuple[float, dict]:
        height, width = image.shape[-2:]
        spec = getattr(getattr(engine, "model", None), "inference_spec", None)
        compiled = getattr(spec, "compiled", False) and not self.facts.steps_as_written
        made = "is compiled and recorded" if compiled else "is recorded"
        if not self.settings.on_cuda:  # nothing is recorded off the GPU: the step only runs
            made = "runs once"
        self.say(f"warming up for {width}x{height} frames: the streaming step {made} before the stream starts")
        dry_pass = kernel_builds.dry_pass if ahead is None and self.runs("dry_pass") else None
        started = time.perf_counter()
        parts = engine.warm_up(image, dry_pass=dry_pass)
        seconds = time.perf_counter() - started
        parts.update(ahead or {})
        if self.compiled_sizes is not None:
            note = self.compiled_sizes.warmed_up((height, width), getattr(engine, "memory_plan", None))
            if note:
                self.say(note)
        return seconds, parts

    def _wait_for_ahead(self, image: Any) -> dict[str, float] | None:
        """The dry pass run while the checkpoint loaded, done (its seconds by part) where it was for frames of
        this size; else None (the warm-up makes its own)."""
        if self.ahead is None:
            return None
        seconds = self.ahead.wait()  # unbounded-ok: BuildsAhead.wait ends AHEAD_WAIT_S after its first call
        return seconds if self.ahead.covers(image.shape[-2:]) else None

    def helpers(self) -> dict[str, Helper]:
        """The builds' helpers that ran, by run.json's name: the kernels built ahead of the stream (the dry
        pass, the early builds), the child builders, the compile beside the stream and the compile child."""
        ran: dict[str, Helper] = {}
        if self._ran & {"early_kernel_builds", "backend_builds", "dry_pass_ahead", "dry_pass"}:
            ran["kernel_builds"] = kernel_builds.PROCESS.ahead
        if "kernel_builders" in self._ran:
            ran["kernel_builders"] = kernel_builds.PROCESS.children
        if self.while_streaming is not None:
            ran["compile_while_streaming"] = self.while_streaming.helper
        if self.compiled_sizes is not None and self.compiled_sizes.process is not None:
            ran["compile_child"] = self.compiled_sizes.helper
        if {"kernel_builders", "compile_child"} & ran.keys():  # children: the monitor watching them
            ran.update(CHILDREN.helpers())
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
        """At the run's end: the work ahead over, the compile beside the stream waited for (not after a signal),
        the compile child left to finish or, after a signal, stopped. A line for the console, or None."""
        self.abandon()
        if self.while_streaming is not None:
            self.while_streaming.end(Deadline(0.0 if stopped_by_signal else WHILE_STREAMING_END_S))
        return None if self.compiled_sizes is None else self.compiled_sizes.finish(stop=stopped_by_signal)

    def abandon(self) -> None:
        """The set-up failed or the run ended: the pass ahead's thread holds the GPU until it ends, so it is
        not left running; child builders its dry pass did not end are ended."""
        if self.ahead is not None:
            self.ahead.wait()  # unbounded-ok: BuildsAhead.wait ends AHEAD_WAIT_S after its first call
        if "kernel_builders" in self._ran:
            kernel_builds.end_builders()


__all__ = ["CHILD_LIMIT_S", "STAGES", "BuildSettings", "Builder", "compile_choice", "run_key"]
