"""How one engine step runs on the device: eagerly, replayed as CUDA graphs, or pipelined.

The engine decides what the cache holds (append, commit, roll back); a step runner turns one
planned step into outputs on their way to the host (`Staged`). A streaming step has two parts,
so that the next frame's embedding can run before the current frame's keyframe decision:

    begin(frame, stream index)   what reads no cache: the upload and, replayed, DINO
    finish(temporal index)       the blocks over the cache, both heads, the copy to the host

`lag` is how many frames a runner leaves in flight: 0, or 1 when a frame's heads and host copy
run on a second stream beside the next frame's blocks (pipelined). The engine picks one runner
for the stream, once (`choose_runner`).
"""

from __future__ import annotations

import contextlib
import time

import torch

from stream_recon.cache import KVCache, TokenCache

from ..network import step_mode
from ..network.gct import GCTStream
from ..network.step_mode import StepMode
from .graphs import RecordedStep
from .precision import step_precision
from .staging import FrameUpload, HostStaging, Staged, pack_outputs


class EagerRunner:
    """Every step op by op on the current stream (the CPU, or graphs turned off)."""

    lag = 0

    def __init__(self, model: GCTStream, cache: KVCache, camera_cache: TokenCache, image_size: tuple[int, int],
                 scale_frames: int, descriptors: bool = False):
        spec = model.inference_spec
        self.model, self.cache, self.camera_cache = model, cache, camera_cache
        self.image_size = image_size
        self.scale_frames = scale_frames
        self.descriptors = descriptors  # each step also computes its frames' retrieval descriptors
        self.device = spec.device
        self.autocast_dtype = spec.dtype if spec.half_precision else None
        self.staging = HostStaging(self.device)
        self.upload = FrameUpload(self.device)
        self._frame: tuple[torch.Tensor, torch.Tensor, int] | None = None  # images, rgb, stream index
        # Streaming steps as written although the model is compiled: while its compiled code is made
        # beside the stream (models/builds/while_streaming.py). Scale steps always are.
        self.eager = False

    @property
    def records(self) -> bool:
        """Whether streaming steps replay a recorded CUDA graph."""
        return False

    def steps_eagerly(self, eager: bool) -> None:
        """Streaming steps as written (True) or as the model was prepared, compiled or not (False)."""
        self.eager = eager

    @property
    def records_next(self) -> bool:
        """Whether its next streaming step is recorded (a graph it replays is still to be captured)."""
        return False

    def _as_chosen(self):
        """The context of a streaming step: as written where `eager`, else as the model was prepared."""
        return step_mode.stepping(StepMode.AS_WRITTEN) if self.eager else contextlib.nullcontext()

    def run_scale_frames(self, images: torch.Tensor, time_index: int) -> Staged:
        """The scale frames [S, 3, H, W] together (stream indices from 0), eagerly and uncompiled: they
        run once per chunk, so compiling their shapes would only delay the first prediction (by tens
        of seconds on a fresh process) for little gain; the streaming shapes are the ones compiled."""
        with step_mode.stepping(StepMode.AS_WRITTEN):
            self.begin(images, 0)
            return self.finish(time_index)

    def begin(self, images: torch.Tensor, stream_index: int) -> None:
        self._frame = (*self.upload.send(images), stream_index)

    def finish(self, time_index: int) -> Staged:
        images, rgb, stream_index = self._frame
        self._frame = None
        count = len(images)
        self._prepare(count)
        stream_positions = torch.arange(stream_index, stream_index + count, device=self.device)
        time_positions = torch.arange(time_index, time_index + count, device=self.device)
        with torch.inference_mode(), self._autocast(), self._as_chosen():
            outputs = self.model.step(images, self.cache.step(self.cache.pending_slots()), self.camera_cache,
                                      stream_positions, time_positions, self.scale_frames, descriptors=self.descriptors)
        return self.staging.send(pack_outputs(outputs, *self.image_size), rgb, *self.image_size)

    def _prepare(self, num_new: int, camera_stream: torch.cuda.Stream | None = None) -> None:
        """Plan the attention and open the camera cache's step; `camera_stream`: where the camera
        cache's write position is set (after what that stream already holds)."""
        self.cache.plan(num_new * self.cache.layout.tokens_per_frame)
        if camera_stream is not None:
            camera_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(camera_stream):  # (no stream: the current one)
            self.camera_cache.begin(num_new)

    def _autocast(self):
        return step_precision(self.device.type, self.autocast_dtype)


class GraphRunner(EagerRunner):
    """Streaming steps replayed as CUDA graphs (a cache whose storage stays put, on CUDA): the first streaming frame
    runs eagerly and is recorded, the next ones replay it. Scale frames stay eager."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.recorded: RecordedStep | None = None
        self._retired: RecordedStep | None = None  # a graph recorded the other way (`steps_eagerly`)
        # Host seconds of the first streaming frame: its eager step (compiled code loaded or compiled,
        # kernels' first launches) and the recording of its graph; what a stream waits for there.
        self.warm_up_seconds: dict[str, float] = {}

    @property
    def records(self) -> bool:
        return self.recorded is not None

    @property
    def records_next(self) -> bool:
        return self.recorded is None

    def steps_eagerly(self, eager: bool) -> None:
        """As EagerRunner's; a graph recorded the other way is dropped, and the next streaming frame
        runs as now chosen and is recorded."""
        if eager != self.eager and self.recorded is not None:
            # kept until the next one is recorded: a frame in flight may still read its static outputs
            self._retired, self.recorded = self.recorded, None
        super().steps_eagerly(eager)

    def begin(self, images: torch.Tensor, stream_index: int) -> None:
        super().begin(images, stream_index)
        if self._replays(len(images)):
            self.recorded.load_frame(self._frame[0], stream_index)
            self.recorded.replay_embed()

    def finish(self, time_index: int) -> Staged:
        images, rgb, stream_index = self._frame
        if not self._replays(len(images)):
            started = time.perf_counter()
            staged = super().finish(time_index)
            # A dry step (a warm-up listing its kernels' builds) skipped launches: not one to record.
            if len(images) == 1 and step_mode.current() is not StepMode.DRY:
                recording = time.perf_counter()
                self._record(images, stream_index, time_index)
                self.warm_up_seconds = {"first_streaming_step_s": round(recording - started, 3),
                                        "graph_record_s": round(time.perf_counter() - recording, 3)}
            return staged
        self._frame = None
        heads_stream = self._heads_stream()
        self._prepare(1, camera_stream=heads_stream)
        self.recorded.load_position(time_index, self.cache.frame_slots())
        self.recorded.replay_blocks()
        with torch.cuda.stream(heads_stream):
            packed = self.recorded.replay_heads()["packed"]
            return self.staging.send(packed, rgb, *self.image_size)

    def _heads_stream(self) -> torch.cuda.Stream | None:
        return None  # the heads run on the current stream, after the blocks

    def _replays(self, num_frames: int) -> bool:
        return num_frames == 1 and self.recorded is not None and self.recorded.is_current

    def _record(self, images: torch.Tensor, stream_index: int, time_index: int) -> None:
        """After an eager streaming step: record it for the next frames (nothing runs again)."""
        height, width = self.image_size
        recorded = RecordedStep(self.model, self.cache, self.camera_cache, tuple(images.shape[1:]),
                                self.scale_frames, self.autocast_dtype,
                                pack=lambda outputs: pack_outputs(outputs, height, width), descriptors=self.descriptors)
        recorded.load_frame(images, stream_index)
        recorded.load_position(time_index, self.cache.frame_slots())
        try:
            with self._as_chosen():
                recorded.record()
        except RuntimeError as error:
            # A failed capture can leave CUDA state (RNG offsets, allocator pools) unusable for this
            # process, so it is not papered over.
            raise RuntimeError(f"CUDA graph capture failed: {error}; stream with StreamConfig(cuda_graphs=False)") from error
        self.recorded = recorded
        if self._retired is not None:
            torch.cuda.current_stream(self.device).synchronize()  # (once: nothing reads its outputs now)
            self._retired = None


class PipelinedRunner(GraphRunner):
    """A frame's heads and its copy to the host run on a second stream, beside the next frame's
    blocks: the engine collects a frame one push later (`lag` 1)."""

    lag = 1

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._sides: dict[int, torch.cuda.Stream] = {}  # by priority
        self._side: torch.cuda.Stream | None = None  # the last frame's

    def _heads_stream(self) -> torch.cuda.Stream:
        """A side stream of the current stream's priority, so that a stream given precedence over
        another engine's (ChunkedEngine's, beside a spare) keeps it for its heads too. The heads'
        outputs are static: a frame's heads on another side stream wait for the last frame's."""
        priority = torch.cuda.current_stream(self.device).priority
        side = self._sides.get(priority)
        if side is None:
            side = self._sides[priority] = torch.cuda.Stream(self.device, priority=priority)
        if self._side is not None and side is not self._side:
            side.wait_stream(self._side)
        self._side = side
        return side


def choose_runner(model: GCTStream, cache: KVCache, camera_cache: TokenCache, image_size: tuple[int, int],
                  scale_frames: int, *, cuda_graphs: bool, pipeline: bool, descriptors: bool = False) -> EagerRunner:
    """Graphs where the cache's storage stays put on CUDA; pipelined when asked as well."""
    on_cuda = model.inference_spec.device.type == "cuda"
    if not (on_cuda and cuda_graphs and cache.records_steps):
        runner = EagerRunner
    else:
        runner = PipelinedRunner if pipeline else GraphRunner
    return runner(model, cache, camera_cache, image_size, scale_frames, descriptors)
