"""The streaming engine: frames in one at a time, final per-frame predictions out (spec §5).

Phase 1 buffers the first `scale_frames` frames and predicts them together with bidirectional
global attention; their K/V become the pinned scale pages. Phase 2 predicts one frame per step
against scale pages + sliding window + every committed frame's special tokens. Each phase-2 frame
is appended as a pending frame and then committed (a keyframe) or rolled back (it leaves no trace:
no pages, no special tokens, no temporal index, no camera-head token).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np
import torch

from stream_recon.cache import CacheLayout, KVCache, TokenCache, backends

from ..errors import MemoryBudgetError
from ..network.gct import GCTStream
from ..network.prepared import require_prepared
from .frames import checked_frame
from .keyframe_policy import FLOW, PREDICTION, TOKENS, FrameFacts, KeyframePolicy
from .memory import MemoryPlan, plan_memory
from .pose import camera_motion_flow
from .prediction import FRAME_KEY, FRAME_NON_KEY, FRAME_SCALE, FramePrediction
from .staging import Staged
from .steps import EagerRunner, choose_runner
from .stream_config import StreamConfig

# Streaming steps a warm-up predicts after its scale step: the first compiles and records the step's
# graph, the second replays it (the replay's own first launches, a pipelined runner's side stream).
WARM_UP_STEPS = 2


@dataclass
class _InFlight:
    """A streaming frame whose prediction is on its way to the host."""

    index: int
    timestamp: float
    staged: Staged
    keyframe: bool | None  # None: a flow decision still to make, from the prediction


def _host_row(host: dict[str, np.ndarray], row: int) -> dict[str, np.ndarray | None]:
    """Row `row` of a step's outputs on the host (HostStaging.receive) as FramePrediction's array fields."""
    fields = {name: host[name][row] for name in ("pose_enc", "c2w", "intrinsics", "depth", "depth_conf", "image")}
    fields["descriptor"] = host["descriptor"][row] if "descriptor" in host else None
    return fields


@dataclass
class _LastKeyframe:
    index: int
    timestamp: float
    c2w: np.ndarray  # [3, 4]
    intrinsics: np.ndarray  # [3, 3]


class StreamingEngine:
    """Frames in, predictions out, over a model made ready by `prepare_for_inference`.

    A loop of keyframe decisions and cache commits over a step runner chosen once for the stream
    (models/stream/steps.py: eager, CUDA graphs, or pipelined). `push` and `finish` return the
    predictions that are ready, oldest first; a pipelined runner keeps one frame in flight, so a
    push then returns the frame before the one it was given.
    """

    def __init__(self, model: GCTStream, config: StreamConfig | None = None, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, *, window_slots: int | None = None,
                 pages_of: KVCache | None = None):
        """window_slots: the window frames the cache's pool holds pages for (None: the window). Fewer
        only for a stream that hands its frames over (`take_over`) before its window fills: a frame
        past them is refused (CacheCapacityError) rather than evicting early, which would change results.
        pages_of: the cache (another engine's, set up with `lend_pages`) whose storage holds this engine's
        pages, in the block past its own: a chunk's spare engine's, in the current engine's storage."""
        inference = require_prepared(model, device, dtype)
        self.model = model
        self.config = config or StreamConfig()
        self.window_slots = window_slots
        self.pages_of = pages_of
        self._pages_lent = 0  # `lend_pages`
        self.policy: KeyframePolicy = self.config.policy
        self.device, self.dtype = inference.device, inference.dtype
        # The attention and the cache precision are checked now, before the first frame: a backend
        # that cannot run here (or read the cache asked for) is an error at construction, not at frame 0.
        self.backend_spec = self._resolve_backend()
        if self.config.gpu_memory is not None and self.config.gpu_memory <= 0:
            raise MemoryBudgetError(f"gpu_memory must be a positive number of bytes, got {self.config.gpu_memory}")
        if not self.config.scale_frames < self._cached_frames <= model.config.max_frames:
            raise ValueError(f"max_cached_frames={self.config.max_cached_frames} must be more than scale_frames "
                             f"({self.config.scale_frames}) and at most the model's {model.config.max_frames}")
        iterations = self.config.camera_iterations
        if iterations is not None and not 1 <= iterations <= model.camera_head.num_iterations:
            raise ValueError(f"camera_iterations must be between 1 and the model's {model.camera_head.num_iterations} "
                             f"refinement iterations, got {iterations}")
        self.on_backend_ready: Callable[[str], None] | None = None
        # With a budget: the plan made before the first frame, and who is told about it.
        self.memory_plan: MemoryPlan | None = None
        self.on_memory_plan: Callable[[MemoryPlan], None] | None = None
        self._plan_ahead: tuple[tuple[int, int], MemoryPlan] | None = None  # plan_memory_for's, by frame size
        self._image_size: tuple[int, int] | None = None
        self.cache: KVCache | None = None
        self.camera_cache: TokenCache | None = None
        self.runner: EagerRunner | None = None
        self._eager_steps = False  # `steps_eagerly`
        self._buffer: list[tuple[torch.Tensor, float]] = []
        self._in_flight: list[_InFlight] = []
        self._ready: list[FramePrediction] = []  # finished by reset(), returned next
        self.reset()

    # -- public ----------------------------------------------------------------------------
    def reset(self) -> None:
        """Start a new stream (new world frame, empty caches). Predictions still in flight are
        completed and returned first by the next push or finish."""
        self._ready += self._deliver(keep=0)
        self._buffer = []
        self.num_frames = 0  # frames submitted (decided or not): the next frame's stream index
        self.num_keyframes = 0
        self.time_counter = 0  # temporal RoPE index of the next committed frame
        self._last_keyframe: _LastKeyframe | None = None
        if self.cache is not None:
            self.cache.reset()
            self.camera_cache.reset()

    @property
    def steps_config(self) -> StreamConfig:
        """The settings its steps run under (ChunkedEngine's name for its current engine's)."""
        return self.config

    @property
    def eager_steps(self) -> bool:
        """Whether its streaming steps run as written although its model is compiled (`steps_eagerly`)."""
        return self._eager_steps

    def steps_eagerly(self, eager: bool) -> None:
        """Streaming steps as written (True) or as the model was prepared (False, the default), from the
        next frame on: a compiled model's stream runs eagerly while its compiled code is made beside it
        (models/builds/while_streaming.py). A graph recorded the other way is recorded again."""
        self._eager_steps = eager
        if self.runner is not None:
            self.runner.steps_eagerly(eager)

    def push(self, image: torch.Tensor | np.ndarray, timestamp: float | None = None, *,
             cached: bool = True) -> list[FramePrediction]:
        """Add one frame [3, H, W] (uint8, or float in [0, 1]). Returns the predictions that became
        ready, oldest first: none while the scale frames are buffered, then all of them, then one
        per frame (one frame late with a pipelined runner).

        `cached=False` (a streaming frame only): predict the frame against the cache as it is and
        leave no trace, whatever the keyframe policy says (a non-keyframe decided before its step).
        ChunkedEngine predicts frames so on a closed chunk while the next one catches up."""
        return self.push_checked(self.check_frame(image), timestamp, cached=cached)

    def push_checked(self, image: torch.Tensor, timestamp: float | None = None, *,
                     cached: bool = True) -> list[FramePrediction]:
        """`push` for a frame as `check_frame` returned it, this engine's or another's (ChunkedEngine
        checks each frame once, before anything changes, and hands it to whichever engine takes it).

        A checked frame of this stream's size is one this engine's check would return unchanged, so it
        is not checked again; one of another size (this engine's first frame, whose check sets up its
        caches, or a frame it must refuse) is checked here. A scale frame is buffered (the last one runs
        the scale step); a streaming frame's step runs in this body, the frame's one hop in this engine
        (docs/ARCHITECTURE.md, "One frame's path")."""
        if self._image_size != tuple(image.shape[1:]):
            image = self.check_frame(image)
        timestamp = float(self.num_frames + len(self._buffer)) if timestamp is None else float(timestamp)
        finished, self._ready = self._ready, []  # completed by reset(): older than anything below
        try:
            if self.num_frames == 0 and len(self._buffer) < self.config.scale_frames:
                return finished + self._take_scale_frame(image, timestamp, cached)
            # A streaming frame: begin it (what reads no cache), settle the frame before it if its decision
            # was pending, append this one, finish its step, and deliver what the runner no longer holds.
            index = self.num_frames
            self.runner.begin(image[None], index)
            ready = self._deliver(keep=0, settle_only=True)  # a pending flow decision, made now
            self._check_temporal_range(1)
            keyframe = self.policy.decided_before(self._facts(index, timestamp)) if cached else False
            # A frame that may be rolled back keeps the oldest window frame until the decision, so it
            # sees window_frames older frames (the reference's deferred eviction).
            self.cache.append(defer_eviction=keyframe is not True)
            try:
                staged = self.runner.finish(self.time_counter)
            except BaseException:
                self._undo_pending()
                raise
            flight = _InFlight(index, timestamp, staged, keyframe)
            self._in_flight.append(flight)
            self.num_frames += 1
            if keyframe is not None:
                self._settle(flight, keyframe)
            ready += self._deliver(keep=self.runner.lag)
            closing = self.config.closes_at_cached_frames
            if closing is not None and self.num_keyframes + 1 >= closing:  # decided now, delivered next
                self._ready += self._deliver(keep=0, settle_only=True)
            return finished + ready
        except BaseException:
            self._ready = finished + self._ready  # nothing computed is lost
            raise

    def _take_scale_frame(self, image: torch.Tensor, timestamp: float, cached: bool) -> list[FramePrediction]:
        """Buffer a scale frame; the last one runs the scale step (its predictions). If the step fails, this
        push's frame goes and the others stay buffered."""
        if not cached:
            raise ValueError("only a streaming frame can be predicted without caching it; the scale frames "
                             "are the cache's anchor")
        self._buffer.append((image, timestamp))
        if len(self._buffer) < self.config.scale_frames:
            return []
        try:
            return self._run_scale_frames()
        except BaseException:
            if self._buffer:  # the step took none of the frames
                self._buffer.pop()
            raise

    def start_over(self, frames: Sequence[tuple[torch.Tensor, float]]
                   ) -> tuple[list[FramePrediction], list[FramePrediction]]:
        """A chunk's rollover in place, in one call: this stream finished (what it still held, returned
        first), then a new one begun on `frames` (checked, with their timestamps), what that predicted second."""
        ended = self.finish()
        self.reset()
        return ended, [prediction for image, timestamp in frames for prediction in self.push_checked(image, timestamp)]

    def finish(self) -> list[FramePrediction]:
        """End of stream: the predictions still in flight, then the frames still buffered (a stream
        shorter than the scale frames)."""
        ready, self._ready = self._ready + self._deliver(keep=0), []
        if not self._buffer:
            return ready
        try:
            return ready + self._run_scale_frames()
        except BaseException:
            self._ready = ready  # nothing computed is lost
            raise

    @property
    def slow_first_step(self) -> bool:
        """Whether the first streaming step costs seconds where later ones cost milliseconds: it
        compiles the model's code (or loads it) or records the step as a CUDA graph. `warm_up` then
        moves that cost before the stream."""
        on_cuda = self.device.type == "cuda"
        return bool(self.model.inference_spec.compiled) or (on_cuda and self.config.cuda_graphs)

    def warm_up(self, image: torch.Tensor | np.ndarray, *,
                dry_pass: Callable[[torch.device], AbstractContextManager[dict]] | None = None) -> dict[str, float]:
        """Before the stream's first frame: predict `scale_frames` + WARM_UP_STEPS copies of `image`
        (that first frame) and forget them, so that the first streaming step's compile, its kernels'
        first launches and its graph's recording happen now and the stream never waits for them. The
        streaming steps are uncached (`push(cached=False)`): they need no window slot of their own, so
        a spare's cache with a single one (`window_slots`) warms up too. First, where the builder gives
        a `dry_pass`, the same steps run dry (`run_dry`).

        Afterwards the engine is as a fresh one but for its caches' storage and recorded graph
        (kept, as after `reset`): the stream's predictions are the ones it makes without a warm-up.
        Returns seconds by part: "scale_step_s", "streaming_steps_s", and those of the dry pass."""
        self._check_before_stream("warms up")
        image = self.check_frame(image)  # the stream's first frame: it sets the size and the caches up
        seconds: dict[str, float] = self.run_dry(image, dry_pass) if dry_pass is not None else {}
        started = time.perf_counter()
        scaled = self._predict_and_forget(image)
        done = time.perf_counter()
        return {"scale_step_s": round(scaled - started, 3), "streaming_steps_s": round(done - scaled, 3), **seconds}

    def run_dry(self, image: torch.Tensor | np.ndarray,
                dry_pass: Callable[[torch.device], AbstractContextManager[dict]]) -> dict[str, float]:
        """The warm-up's steps on copies of `image` inside `dry_pass(device)`, the builder's context
        (models/builds/kernel_builds.py: launches of kernels not built are listed and built side by
        side instead of run), then the caches zeroed: what dry steps compute is garbage, and none may
        stay, even where only masked reads go. Returns the seconds by part the context reports."""
        self._check_before_stream("runs dry")
        image = self.check_frame(image)
        with dry_pass(self.device) as seconds:
            self._predict_and_forget(image)
        self.cache.clear()
        self.camera_cache.clear()
        return seconds

    @property
    def makes_descriptors(self) -> bool:
        """Whether its steps make each frame's descriptor (GeM of its DINO patch tokens, [1024] for the released
        models): where its keyframe policy reads the frame's tokens. Off, the steps are exactly as without."""
        return TOKENS in self.policy.reads

    @property
    def at_stream_start(self) -> bool:
        """No frame taken since the last reset, none in flight or waiting: it may warm up."""
        return not (self.num_frames or self._buffer or self._in_flight or self._ready)

    def _check_before_stream(self, what: str) -> None:
        if not self.at_stream_start:
            raise ValueError(f"an engine {what} before its stream's first frame, not during a stream")

    def _predict_and_forget(self, image: torch.Tensor) -> float:
        """The warm-up's steps on copies of `image`, then a reset; returns when the scale step ended."""
        for _ in range(self.config.scale_frames):
            self.push_checked(image)
        scaled = time.perf_counter()
        for _ in range(WARM_UP_STEPS):
            self.push_checked(image, cached=False)
        self.finish()  # (the predictions are dropped: the stream's first frame is the next one pushed)
        self.reset()
        if self.device.type == "cuda":  # its work done: the stream's first frame waits for none of it
            torch.cuda.current_stream(self.device).synchronize()
        return scaled

    def lend_pages(self, num_pages: int) -> None:
        """Before its first frame: its cache's storage is to hold `num_pages` pages past its own pool, for an
        engine built with `pages_of` this engine's cache (a chunk's spare engine: one allocation for both
        engines' pages, and the spare's taken over by copies inside it)."""
        if self.cache is not None:
            raise ValueError("an engine lends pages before its first frame sets its cache up")
        self._pages_lent = num_pages

    def take_over(self, other: StreamingEngine) -> None:
        """Go on with `other`'s stream: its caches' contents (copied on the current stream), its frame
        and keyframe counts and its last keyframe; this engine's own stream is dropped. Both must have
        delivered every prediction (`finish`) and share a model, settings and frame size: a chunk's
        spare engine hands the next chunk over so, and the current engine keeps its recorded graphs."""
        if other is self:
            return
        if self._in_flight or self._ready or self._buffer or other._in_flight or other._ready or other._buffer:
            raise ValueError("an engine takes over a stream only when both have delivered every prediction (finish)")
        if other.model is not self.model or other._image_size != self._image_size or other.cache is None:
            raise ValueError("an engine takes over only a stream of its own model and frame size, once it has begun")
        self.cache.take_over(other.cache)
        self.camera_cache.take_over(other.camera_cache)
        self.num_frames, self.num_keyframes = other.num_frames, other.num_keyframes
        self.time_counter, self._last_keyframe = other.time_counter, other._last_keyframe

    def plan_memory_for(self, image_size: tuple[int, int]) -> MemoryPlan | None:
        """The memory plan the first frame will use if it is image_size (height, width), made now:
        MemoryBudgetError, before any frame, when nothing fits. A first frame of another size is
        planned for then. None without a budget (StreamConfig.gpu_memory) or once the first frame
        has been set up (its plan is `memory_plan`). Asked again for the same size, the same plan."""
        if self.config.gpu_memory is None or self.memory_plan is not None:
            return None
        size = (int(image_size[0]), int(image_size[1]))
        if self._plan_ahead is not None and self._plan_ahead[0] == size:
            return self._plan_ahead[1]
        plan = plan_memory(self.model, self.config, size, self.config.gpu_memory)
        self._plan_ahead = (size, plan)
        return plan

    @property
    def undecided_frames(self) -> int:
        """Frames predicted whose keyframe decision is still to be made (flow keyframes, pipelined)."""
        return sum(flight.keyframe is None for flight in self._in_flight)

    @property
    def image_size(self) -> tuple[int, int] | None:
        """(height, width) of the stream's frames, once the first one arrived."""
        return self._image_size

    @property
    def cache_bytes(self) -> int:
        """Device bytes the K/V and camera caches hold (0 before the first frame)."""
        if self.cache is None:
            return 0
        return self.cache.bytes_allocated + self.camera_cache.bytes_allocated

    def stats(self) -> dict:
        if self.cache is None:  # no frame yet: same keys, nothing allocated
            return {"frames": 0, "keyframes": 0, "cached_frames": 0, "patch_frames": 0, "patch_pages_in_use": 0,
                    "special_pages_in_use": 0, "camera_tokens": 0, "cache_bytes": 0, "attention": None,
                    "kv_cache": None, "cuda_graphs": False, "memory_plan": None, "compiled_code": self._compiled_code(),
                    "warm_up": None}
        return {
            "frames": self.num_frames,
            "keyframes": self.num_keyframes,
            "cached_frames": self.cache.num_committed_frames,
            "patch_frames": self.cache.num_patch_frames,
            "patch_pages_in_use": self.cache.num_patch_frames,  # one page per frame
            "special_pages_in_use": -(-self.cache.num_special_tokens // self.cache.layout.page_size),
            "camera_tokens": self.camera_cache.num_committed,
            "cache_bytes": self.cache_bytes,
            "attention": self.cache.backend_name,
            "kv_cache": backends.precision_name(self.cache.store_dtype),
            "cuda_graphs": self.runner.records,
            "warm_up": getattr(self.runner, "warm_up_seconds", None) or None,
            "memory_plan": self.memory_plan.to_dict() if self.memory_plan is not None else None,
            "compiled_code": self._compiled_code(),
        }

    def _cache_compiler(self):
        """How the caches compile their helpers: as the model's parts were compiled (InferenceSpec), or not."""
        return self.model.inference_spec.compile_function or False

    def _compiled_code(self) -> dict[str, float] | None:
        """Compiled calls loaded from kept artefacts and compiled by this process (models/builds/compilation.py);
        None where the model compiles where called, or not at all."""
        methods = getattr(self.model, "compiled_methods", None)
        return None if methods is None else {**methods.counts(), "seconds": round(methods.seconds(), 3)}

    # -- phases ----------------------------------------------------------------------------
    def _run_scale_frames(self) -> list[FramePrediction]:
        """The buffered frames' scale step. If the step fails, they stay buffered and the cache as it was,
        so that the step can run again (ChunkedEngine does, out of memory beside a spare)."""
        buffered = self._buffer
        frames = [f for f, _ in buffered]
        stamps = [t for _, t in buffered]
        count = len(frames)
        first_index = self.num_frames
        self._check_temporal_range(count)
        self._buffer = []
        for _ in range(count):
            self.cache.append()
        if len({f.dtype for f in frames}) > 1:  # uint8 and float frames in one batch: all float
            frames = [f.float() / 255 if f.dtype == torch.uint8 else f for f in frames]
        try:
            staged = self.runner.run_scale_frames(torch.stack(frames), self.time_counter)
        except BaseException:
            self._undo_pending()
            self._buffer = buffered
            raise
        self._commit(count)
        self.num_frames += count
        host = self.runner.staging.receive(staged)
        predictions = [FramePrediction(first_index + i, stamps[i], FRAME_SCALE, **_host_row(host, i)) for i in range(count)]
        self._last_keyframe = _LastKeyframe(first_index + count - 1, stamps[-1], host["c2w"][-1], host["intrinsics"][-1])
        return predictions

    # -- decisions and delivery ------------------------------------------------------------
    def _deliver(self, keep: int, settle_only: bool = False) -> list[FramePrediction]:
        """Predictions of the frames in flight but the newest `keep`, oldest first (waits for their
        copies). A frame whose keyframe decision was pending is decided first; with `settle_only`
        a frame already decided stays in flight."""
        delivered = []
        while len(self._in_flight) > keep:
            flight = self._in_flight[0]
            if settle_only and flight.keyframe is not None:
                break
            self._in_flight.pop(0)
            host = self.runner.staging.receive(flight.staged)
            facts = None
            if flight.keyframe is None:
                facts = self._facts(flight.index, flight.timestamp, host)
                flight.keyframe = self.policy.decided_after(facts)
                self._settle(flight, flight.keyframe)
            if flight.keyframe:
                self._last_keyframe = _LastKeyframe(flight.index, flight.timestamp, host["c2w"][0],
                                                    host["intrinsics"][0])
            frame_type = FRAME_KEY if flight.keyframe else FRAME_NON_KEY
            flow = facts.flow if facts is not None and facts.flow is not None else float("nan")
            delivered.append(FramePrediction(flight.index, flight.timestamp, frame_type, flow_magnitude=flow,
                                             **_host_row(host, 0)))
        return delivered

    def _facts(self, index: int, timestamp: float, host: dict[str, np.ndarray] | None = None) -> FrameFacts:
        """What the policy is told of streaming frame `index`: its place and time, and once its step's outputs
        are on the host (`host`), what the policy reads of them."""
        key, reads = self._last_keyframe, self.policy.reads
        facts = FrameFacts(index, self.config.scale_frames, timestamp, key.index, key.timestamp)
        if host is None:
            return facts
        row = _host_row(host, 0)
        flow = camera_motion_flow(row["c2w"], row["intrinsics"], row["depth"], key.c2w, key.intrinsics) \
            if FLOW in reads else None
        return dataclasses.replace(facts, flow=flow, prediction=row if PREDICTION in reads else None,
                                   tokens=row["descriptor"] if TOKENS in reads else None)

    def _settle(self, flight: _InFlight, keyframe: bool) -> None:
        """Commit a keyframe or roll a non-keyframe back."""
        if keyframe:
            self._commit(1)
        else:
            self._undo_pending()

    def _check_temporal_range(self, num_new: int) -> None:
        limit = self.model.config.max_frames
        if self.time_counter + num_new > limit:
            raise ValueError(
                f"temporal index {self.time_counter + num_new - 1} is past the model's {limit}-position RoPE table; "
                "use chunked streaming (ChunkedEngine) so that each chunk starts a fresh cache"
            )

    def _commit(self, count: int) -> None:
        self.cache.commit()
        self.camera_cache.commit()
        self.time_counter += count
        self.num_keyframes += count

    def _undo_pending(self) -> None:
        """Drop the pending frames from both caches, data moves included."""
        self.cache.rollback()
        self.camera_cache.rollback()

    # -- input and setup -------------------------------------------------------------------
    def check_frame(self, image) -> torch.Tensor:
        """The frame as a [3, H, W] tensor, uint8 or float (`frames.checked_frame`); FrameError if it cannot
        be one of this stream's frames. The stream's first frame sets its size (and caches) up."""
        image = checked_frame(image, self.model.config.patch_size, self._image_size,
                              self.num_frames + len(self._buffer))
        if self._image_size is None:
            self._setup(*image.shape[1:])
        return image

    @property
    def _kv_dtype(self) -> torch.dtype:
        return self.dtype if self.device.type == "cuda" else torch.float32

    @property
    def _kv_store_dtype(self) -> torch.dtype:
        return backends.store_dtype(self.config.kv_cache, self._kv_dtype)

    @property
    def _cached_frames(self) -> int:
        return self.config.cached_frames(self.model.config.max_frames)

    def _resolve_backend(self) -> backends.BackendSpec:
        return backends.resolve(self.config.attention, self.device, self._kv_dtype, self._kv_store_dtype)

    def _plan_memory(self, height: int, width: int) -> None:
        """Fit the budget before anything is allocated: the plan's precision and window replace the
        config's (the window only when nothing else fits; the plan says so). A plan made ahead for
        this size (plan_memory_for) is the one planning now would make: it depends only on the model,
        the config (unchanged until the first frame) and the size."""
        ahead, self._plan_ahead = self._plan_ahead, None
        if ahead is not None and ahead[0] == (height, width):
            plan = ahead[1]
        else:
            plan = plan_memory(self.model, self.config, (height, width), self.config.gpu_memory)
        self.config = plan.apply(self.config)
        self.backend_spec = self._resolve_backend()
        self.memory_plan = plan
        if self.on_memory_plan is not None:
            self.on_memory_plan(plan)

    def _setup(self, height: int, width: int) -> None:
        c = self.model.config
        if self.config.gpu_memory is not None and self.memory_plan is None:
            self._plan_memory(height, width)
        self._image_size = (height, width)
        rows, cols = c.grid(height, width)
        layout = CacheLayout(rows * cols, c.num_special_tokens, self.config.scale_frames, self.config.window,
                             window_slots=self.window_slots)
        compiled = self._cache_compiler()
        cache = backends.build(self.backend_spec, layout, num_layers=c.depth, num_heads=c.num_heads,
                               head_dim=c.head_dim, max_frames=self._cached_frames, dtype=self._kv_dtype,
                               device=self.device, compile=compiled, stored=self._kv_store_dtype,
                               pages_beside=self._pages_lent, beside=self.pages_of)
        camera = self.model.camera_head
        # On CUDA, room for every camera token the cache can hold: the storage never moves, so a
        # recorded CUDA graph stays valid for the whole stream. Elsewhere it grows.
        capacity = self._cached_frames if self.device.type == "cuda" else 64
        # The camera cache first: another thread (a spare engine's owner) may read `cache_bytes`
        # while a worker sets this engine up, and takes `cache is None` for "nothing yet".
        # Its layers set how many refinement iterations the camera head runs (CameraHead.iterations_for).
        self.camera_cache = TokenCache(camera.cache_layers(self.config.camera_iterations), c.camera_heads,
                                       c.head_in_dim // c.camera_heads,
                                       torch.float32, self.device, capacity=capacity, compile=compiled)
        self.cache = cache
        self.runner = choose_runner(self.model, self.cache, self.camera_cache, (height, width),
                                    self.config.scale_frames, cuda_graphs=self.config.cuda_graphs,
                                    pipeline=self.config.pipeline, descriptors=self.makes_descriptors)
        self.runner.steps_eagerly(self._eager_steps)
        if self.on_backend_ready is not None:
            self.on_backend_ready(self.cache.backend_name)
