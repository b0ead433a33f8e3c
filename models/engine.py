"""The streaming engine: frames in one at a time, final per-frame predictions out (spec §5).

Phase 1 buffers the first `scale_frames` frames and predicts them together with bidirectional
global attention; their K/V become the pinned scale pages. Phase 2 predicts one frame per step
against scale pages + sliding window + every committed frame's special tokens. Each phase-2 frame
is appended as a pending frame and then committed (a keyframe) or rolled back (it leaves no trace:
no pages, no special tokens, no temporal index, no camera-head token).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from stream_recon.cache import (
    CacheLayout,
    ContiguousKV,
    ContiguousTwoStreamCache,
    DenseAttention,
    KVStep,
    PagedKV,
    SDPAPagedAttention,
    SplitCudnnAttention,
    TokenCache,
    TwoStreamCache,
)

from .errors import FrameError
from .fused_gelu import fuse_mlp_gelu
from .gct import GCTStream
from .graphs import GraphedStep, compile_blocks, compile_camera_head, compile_depth_head
from .pose import camera_motion_flow, decode_pose
from .prediction import FRAME_KEY, FRAME_NON_KEY, FRAME_SCALE, FramePrediction


@dataclass(frozen=True)
class KeyframePolicy:
    """`all`: every frame is kept. `interval:N`: every N-th streaming frame is kept, decided before
    the step. `flow`: decided after the step from the camera-motion flow to the last keyframe
    (keyframe when flow > threshold pixels, or after max_gap frames without one)."""

    kind: str = "all"
    interval: int = 1
    flow_threshold: float = 15.0
    max_gap: int = 30

    @classmethod
    def parse(cls, text: str, flow_threshold: float = 15.0, max_gap: int = 30) -> KeyframePolicy:
        text = text.strip().lower()
        if text == "all":
            return cls("all", 1, flow_threshold, max_gap)
        if text == "flow":
            if flow_threshold <= 0 or max_gap < 1:
                raise ValueError(f"flow keyframes need flow_threshold > 0 and max_gap >= 1, got {flow_threshold}, {max_gap}")
            return cls("flow", 1, flow_threshold, max_gap)
        if text.startswith("interval:"):
            try:
                interval = int(text.split(":", 1)[1])
            except ValueError:
                interval = 0
            if interval >= 1:
                return cls("interval", interval, flow_threshold, max_gap)
        raise ValueError(f"unknown keyframe policy {text!r}: use 'all', 'interval:N' (N >= 1) or 'flow'")


@dataclass(frozen=True)
class StreamConfig:
    scale_frames: int = 8
    window: int = 64  # sliding-window frames whose patch tokens stay visible, the current one included
    keyframes: str = "all"
    flow_threshold: float = 15.0
    max_gap: int = 30
    attention: str = "auto"  # auto | dense | sdpa | flashinfer | flashinfer-fa2 | flashinfer-fa3
    cuda_graphs: bool = True  # replay streaming steps as CUDA graphs (CUDA, contiguous layout; outputs identical)
    compile: bool = True  # fuse the transformer blocks with torch.compile (CUDA only; slower first frames)
    # With CUDA graphs and keyframes decided before the step (all, interval:N): a frame's heads and
    # its copy to the host run beside the next frame's aggregator, and push() returns the previous
    # frame's prediction (finish() returns the last one); 1.2-1.4 ms per frame faster on an H100
    # (docs/PERFORMANCE.md), outputs identical. Off: every push returns its own frame.
    pipeline: bool = True
    # CUDA, bf16/fp16, triton installed: the camera head's large layers read float16 weights with
    # float32 arithmetic (models/few_token_linear.py; half its weight traffic). Off: float32 weights.
    half_camera_weights: bool = True

    @property
    def policy(self) -> KeyframePolicy:
        return KeyframePolicy.parse(self.keyframes, self.flow_threshold, self.max_gap)


@dataclass
class _InFlight:
    """A pipelined frame: its heads and host copy are enqueued; `staged` completes with its event."""

    index: int
    timestamp: float
    frame_type: int
    staged: tuple  # (packed host buffer, rgb host buffer, event after both copies)
    rgb: torch.Tensor  # the device image the copy reads: kept alive until the copy ran


ATTENTION_BACKENDS = ("auto", "dense", "dense-triton", "dense-flashinfer", "dense-cudnn", "sdpa", "flashinfer",
                      "flashinfer-fa2", "flashinfer-fa3")


def resolve_attention(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """`auto` for bf16/fp16 on CUDA: the contiguous layout, read on Hopper or newer by our Triton
    range kernel (dense-triton; cuDNN + flash, dense-cudnn, without triton), the fastest measured
    (docs/PERFORMANCE.md); elsewhere by FlashInfer's ragged prefill when it is installed, else by
    PyTorch's flash kernel. On CPU or in float32: the paged cache with PyTorch SDPA (the
    golden-parity path)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}: use one of {', '.join(ATTENTION_BACKENDS)}")
    if name != "auto":
        return name
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return "sdpa"
    if torch.cuda.get_device_capability(device)[0] >= 9:
        try:
            import triton  # noqa: F401 - only whether it imports matters here
        except ImportError:
            return "dense-cudnn"
        return "dense-triton"
    try:
        import flashinfer  # noqa: F401 - only whether it imports matters here
    except ImportError:
        return "dense"
    return "dense-flashinfer"


def make_attention_backend(name: str, kv: PagedKV):
    """A backend over paged storage: PyTorch SDPA, or FlashInfer's paged prefill (fa2 / fa3).

    FlashInfer has no fp32 kernels, so fp32 runs always use SDPA.
    """
    if name not in ATTENTION_BACKENDS or name.startswith("dense") or name == "auto":
        raise ValueError(f"{name!r} is not a paged attention backend")
    if name == "sdpa":
        return SDPAPagedAttention(kv)
    _require_cuda_half_precision(name, kv, instead="sdpa")
    variant = "fa3" if name == "flashinfer-fa3" else "fa2"
    return _flashinfer_backends(name).FlashInferPagedAttention(kv, variant=variant)


def make_range_backend(name: str, kv: ContiguousKV, cache: ContiguousTwoStreamCache, compile: bool = False):
    """A backend over the contiguous layout: PyTorch SDPA, our Triton range kernel (dense-triton),
    cuDNN + flash merged (dense-cudnn), or FlashInfer's ragged prefill (fa3 on Hopper, fa2 elsewhere)."""
    if name == "dense":
        return DenseAttention(kv)
    _require_cuda_half_precision(name, kv, instead="dense")
    if name == "dense-triton":
        try:
            from stream_recon.cache.triton_attention import TritonRangeAttention
        except ImportError as error:
            raise ValueError(f"--attention dense-triton needs the triton package (it comes with CUDA builds of torch): {error}") from None
        return TritonRangeAttention(kv)
    if name == "dense-cudnn":
        layout = cache.layout
        full = (layout.scale_frames + layout.window_frames) * layout.patches_per_frame
        return SplitCudnnAttention(kv, (full, full + layout.patches_per_frame), compile=compile)
    variant = "fa3" if torch.cuda.get_device_capability(kv.device)[0] == 9 else "fa2"
    return _flashinfer_backends(name).FlashInferRangeAttention(kv, variant=variant)


def _store_camera_weights_in_half(model: GCTStream) -> int:
    """The camera head keeps float32 arithmetic but reads float16 weights (half the bytes of its
    weight-bound one-token layers) where triton is there to run the kernel; returns the number of
    layers converted (0 without triton: the float32 layers stay)."""
    try:
        from .few_token_linear import store_weights_in_half
    except ImportError:
        return 0
    return store_weights_in_half(model.camera_head)


def _require_cuda_half_precision(name: str, kv, instead: str) -> None:
    if kv.device.type != "cuda" or kv.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"--attention {name} needs bf16/fp16 on a CUDA device (got {kv.dtype} on {kv.device}); use --attention {instead}"
        )


def _flashinfer_backends(name: str):
    try:
        from stream_recon.cache import flashinfer_backend
    except ImportError as error:
        raise ValueError(f"--attention {name} needs the flashinfer package (pip install 'stream-recon[cuda]'): {error}") from None
    return flashinfer_backend


class StreamingEngine:
    def __init__(self, model: GCTStream, config: StreamConfig | None = None, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None):
        self.model = model.eval()
        self.config = config or StreamConfig()
        self.policy = self.config.policy
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.dtype = dtype or torch.float32
        if self.device.type == "cuda" and self.dtype != torch.float32:
            # The transformer runs in bf16/fp16 and the camera head in fp32, as the reference does.
            # The DPT head runs in bf16/fp16 too: a third faster, within the golden tolerance
            # (docs/PERFORMANCE.md; the reference keeps it in fp32); so do the MLPs' GELUs, inside
            # their first layer's cuBLASLt epilogue.
            self.model.aggregator.to(self.dtype)
            self.model.depth_head.to(self.dtype)
            fuse_mlp_gelu(self.model.aggregator)  # GELU in the product's epilogue (models/fused_gelu.py)
            if self.config.half_camera_weights:
                _store_camera_weights_in_half(self.model)
        if self.device.type == "cuda":
            # cuDNN's NHWC convolutions: the DPT head's inputs are channels-last views already.
            self.model.depth_head.to(memory_format=torch.channels_last)
        self._compiles = self.config.compile and self.device.type == "cuda"
        if self._compiles:
            compile_blocks(self.model)
            compile_depth_head(self.model)
            compile_camera_head(self.model)
        self.on_backend_ready: Callable[[str], None] | None = None
        self._image_size: tuple[int, int] | None = None
        self._buffer: list[tuple[torch.Tensor, float]] = []
        self._graph: GraphedStep | None = None
        self._host_buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._in_flight: _InFlight | None = None  # a pipelined frame whose heads may still be running
        self._ready: list[FramePrediction] = []  # predictions finished by reset(), returned next
        self._heads_stream: torch.cuda.Stream | None = None
        self.reset()

    # -- public ----------------------------------------------------------------------------
    def reset(self) -> None:
        """Start a new stream (new world frame, empty caches). A prediction still in flight is
        completed and returned first by the next push or finish."""
        self._ready += self._drain()
        self._buffer = []
        self.num_frames = 0  # frames seen, the next frame's stream index
        self.num_keyframes = 0
        self.time_counter = 0  # temporal RoPE index of the next committed frame
        self._last_key_pose: torch.Tensor | None = None
        self._last_key_index = -1
        if self._image_size is not None:
            self.cache.reset()
            self.camera_cache.reset()

    def push(self, image: torch.Tensor, timestamp: float | None = None) -> list[FramePrediction]:
        """Add one frame [3, H, W] (float in [0, 1], or uint8). Returns the predictions that became
        final, oldest first: none while the scale frames are buffered, then all of them, then one
        per frame (pipelined streaming: the previous frame's)."""
        image = self._check_frame(image)
        timestamp = float(self.num_frames + len(self._buffer)) if timestamp is None else float(timestamp)
        finished, self._ready = self._ready, []  # completed by reset(): older than anything below
        try:
            if self.num_frames == 0 and len(self._buffer) < self.config.scale_frames:
                self._buffer.append((image, timestamp))
                if len(self._buffer) < self.config.scale_frames:
                    return finished
                return finished + self._run_scale_frames()
            return finished + self._run_streaming_frame(image, timestamp)
        except BaseException:
            self._ready = finished + self._ready  # nothing computed is lost
            raise

    def finish(self) -> list[FramePrediction]:
        """End of stream: the predictions still in flight (pipelined streaming), then the frames
        still buffered (a stream shorter than the scale frames)."""
        ready, self._ready = self._ready + self._drain(), []
        if not self._buffer:
            return ready
        try:
            return ready + self._run_scale_frames()
        except BaseException:
            self._ready = ready  # nothing computed is lost
            raise

    def stats(self) -> dict:
        if self._image_size is None:  # no frame yet: same keys, nothing allocated
            return {"frames": 0, "keyframes": 0, "cached_frames": 0, "patch_frames": 0, "patch_pages_in_use": 0,
                    "special_pages_in_use": 0, "camera_tokens": 0, "cache_bytes": 0, "attention": None,
                    "cuda_graphs": False}
        return {
            "frames": self.num_frames,
            "keyframes": self.num_keyframes,
            "cached_frames": self.cache.num_committed_frames,
            "patch_frames": self.cache.num_patch_frames,
            "patch_pages_in_use": self.cache.num_patch_frames,  # one page (slot) per frame
            "special_pages_in_use": -(-self.cache.num_special_tokens // self.cache.layout.page_size),
            "camera_tokens": self.camera_cache.num_committed,
            "cache_bytes": self.kv.bytes_allocated + self.camera_cache.bytes_allocated,
            "attention": self.backend.name,
            "cuda_graphs": self._graph is not None,
        }

    # -- phases ----------------------------------------------------------------------------
    def _run_scale_frames(self) -> list[FramePrediction]:
        frames = [f for f, _ in self._buffer]
        stamps = [t for _, t in self._buffer]
        self._buffer = []
        count = len(frames)
        first_index = self.num_frames
        for _ in range(count):
            self.cache.append()
        self._apply_moves()
        images = torch.stack(frames)
        outputs = self._forward(images, num_new=count)
        host = self._to_host(outputs, images)
        self._commit(count)
        self._last_key_pose = outputs["pose_enc"][-1]
        self._last_key_index = count - 1
        return [self._prediction(host, i, first_index + i, stamps[i], FRAME_SCALE) for i in range(count)]

    def _run_streaming_frame(self, image: torch.Tensor, timestamp: float) -> list[FramePrediction]:
        index = self.num_frames
        policy = self.policy
        if policy.kind == "interval":
            keyframe = (index - self.config.scale_frames) % policy.interval == 0
        else:
            keyframe = policy.kind == "all"
        decide_later = policy.kind == "flow"
        # A frame that may be rolled back keeps the oldest window page until the decision, so it
        # sees window_frames older frames (the reference's deferred eviction).
        self.cache.append(defer_eviction=decide_later or not keyframe)
        self._apply_moves()
        if self.config.pipeline and not decide_later and self._graph_ready():
            return self._pipelined_frame(image, index, timestamp, FRAME_KEY if keyframe else FRAME_NON_KEY)
        ready = self._drain()
        outputs = self._forward(image[None], num_new=1)
        host = self._to_host(outputs, image[None])
        flow = float("nan")
        if decide_later:
            flow = camera_motion_flow(outputs["pose_enc"][0], self._last_key_pose, outputs["depth"][0])
            first = index == self.config.scale_frames
            keyframe = first or flow > policy.flow_threshold or index - self._last_key_index >= policy.max_gap
        if keyframe:
            self._commit(1)
            self._last_key_pose = outputs["pose_enc"][0].clone()
            self._last_key_index = index
        else:
            self._rollback()
        prediction = self._prediction(host, 0, index, timestamp, FRAME_KEY if keyframe else FRAME_NON_KEY)
        prediction.flow_magnitude = flow
        return ready + [prediction]

    def _pipelined_frame(self, image: torch.Tensor, index: int, timestamp: float, frame_type: int) -> list[FramePrediction]:
        """Enqueue this frame's aggregator, collect the previous frame, then enqueue this frame's
        heads and host copy on the heads stream: they run beside the next frame's aggregator."""
        graph, heads = self._graph, self._heads_stream
        try:
            # The camera position is set after the previous frame's heads, which read it.
            self._prepare_step(1, camera_stream=heads)
            graph.load(image[None], self.cache.token_ranges(-1), self.num_frames, self.time_counter)
            rgb = self._quantize(image[None].to(self.device))
            graph.replay_aggregator()
        except BaseException:
            self._undo_pending()
            raise
        ready = self._drain()  # the staging buffers are free once the previous frame is copied out
        with torch.cuda.stream(heads):
            staged = self._stage(graph.replay_heads()["packed"], rgb)
        self._in_flight = _InFlight(index, timestamp, frame_type, staged, rgb)
        if frame_type == FRAME_KEY:
            self._commit(1)
            self._last_key_index = index
        else:
            self._rollback()
        return ready

    def _graph_ready(self) -> bool:
        return self._graph is not None and self._graph.camera_version == self.camera_cache.version

    def _drain(self) -> list[FramePrediction]:
        """The frame in flight, once its copy to the host has completed (waits for it)."""
        if self._in_flight is None:
            return []
        flight, self._in_flight = self._in_flight, None
        host = self._unstage(flight.staged)
        return [self._prediction(host, 0, flight.index, flight.timestamp, flight.frame_type)]

    # -- mechanics -------------------------------------------------------------------------
    def _forward(self, images: torch.Tensor, num_new: int) -> dict[str, torch.Tensor]:
        """Predict the pending frames; the cache already holds their (empty) pages. On any error
        the pending frames are rolled back, so the stream stays usable."""
        try:
            return self._forward_pending(images, num_new)
        except BaseException:
            self._undo_pending()
            raise

    def _prepare_step(self, num_new: int, camera_stream: torch.cuda.Stream | None = None) -> None:
        """Checks and plans a step over the pending frames; `camera_stream`: where the camera
        cache's write position is set (after what that stream already holds)."""
        limit = self.model.config.max_frames
        if self.time_counter + num_new > limit:
            raise ValueError(
                f"temporal index {self.time_counter + num_new - 1} is past the model's {limit}-position RoPE table; "
                "use windowed streaming (WindowedEngine) so that each window starts a fresh cache"
            )
        if isinstance(self.kv, PagedKV):  # (graphs are never recorded over pages, which may move)
            self.kv.ensure_pages(self.cache.pool.num_pages)
        self.backend.plan(self.cache.visible(), num_new * self.cache.layout.tokens_per_frame)
        if camera_stream is not None:
            camera_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(camera_stream):  # (no stream: the current one)
            self.camera_cache.begin(num_new)

    def _forward_pending(self, images: torch.Tensor, num_new: int) -> dict[str, torch.Tensor]:
        self._prepare_step(num_new)
        if self._graph is not None and not self._graph_ready():
            self._graph = None
        if self._graph is not None and num_new == 1:
            self._graph.load(images, self.cache.token_ranges(-1), self.num_frames, self.time_counter)
            return self._graph.replay()
        slots = torch.tensor([s for i in range(-num_new, 0) for s in self.cache.token_slots(i)], dtype=torch.long)
        step = KVStep(self.kv, self.backend, slots.to(self.device))
        stream_index = torch.arange(self.num_frames, self.num_frames + num_new, device=self.device)
        time_index = torch.arange(self.time_counter, self.time_counter + num_new, device=self.device)
        with torch.inference_mode(), self._autocast():
            outputs = self.model.step(
                images.to(self.device), step, self.camera_cache, stream_index, time_index, self.config.scale_frames
            )
        # Graph replay serves the contiguous layout only: on the paged layout it leaked ~75 KB of GPU
        # memory per frame (measured, cause not found; docs/PERFORMANCE.md), so paged steps stay eager.
        if num_new == 1 and self.config.cuda_graphs and self.device.type == "cuda" and isinstance(self.kv, ContiguousKV):
            self._record_graph(images)
        return outputs

    def _record_graph(self, images: torch.Tensor) -> None:
        """After an eager streaming step: record it for the next frames (nothing runs again)."""
        autocast_dtype = self.dtype if self.dtype != torch.float32 else None
        layout = self.cache.layout
        graph = GraphedStep(self.model, self.kv, self.backend, self.camera_cache, tuple(images.shape[1:]),
                            (layout.specials_per_frame, layout.patches_per_frame), self.config.scale_frames,
                            autocast_dtype, pack=self._pack)
        graph.load(images, self.cache.token_ranges(-1), self.num_frames, self.time_counter)
        try:
            graph.record()
        except RuntimeError as error:
            # A failed capture can leave CUDA state (RNG offsets, allocator pools) unusable for this
            # process, so it is not papered over.
            raise RuntimeError(f"CUDA graph capture failed: {error}; stream with StreamConfig(cuda_graphs=False)") from error
        self._graph = graph

    def _apply_moves(self) -> None:
        moves = self.cache.take_moves()
        if moves:
            self.kv.apply_moves(moves, self.cache)

    def _commit(self, count: int) -> None:
        self.cache.commit()
        self._apply_moves()
        self.camera_cache.commit()
        self.time_counter += count
        self.num_frames += count
        self.num_keyframes += count

    def _rollback(self) -> None:
        self._undo_pending()
        self.num_frames += 1

    def _undo_pending(self) -> None:
        """Drop the pending frames from both caches, data moves included."""
        self.cache.rollback()
        self._apply_moves()
        self.camera_cache.rollback()

    def _autocast(self):
        if self.device.type == "cuda" and self.dtype != torch.float32:
            # No weight-cast cache (the transformer's weights are in self.dtype already), as in a
            # recorded step: compiled blocks then see one autocast state and compile once.
            return torch.autocast("cuda", dtype=self.dtype, cache_enabled=False)
        return torch.autocast(self.device.type, enabled=False)

    # Packed layout of a step's float outputs per frame: name -> values per frame, in this order.
    def _packed_fields(self) -> dict[str, tuple[int, ...]]:
        height, width = self._image_size
        return {"pose_enc": (9,), "c2w": (3, 4), "intrinsics": (3, 3), "depth": (height, width),
                "depth_conf": (height, width)}

    def _pack(self, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """A step's outputs as one float32 tensor [S, 30 + 2HW]: cameras decoded on the device."""
        height, width = self._image_size
        pose_enc = outputs["pose_enc"].float()  # [S, 9]
        c2w, intrinsics = decode_pose(pose_enc, height, width)
        fields = (pose_enc, c2w, intrinsics, outputs["depth"].float(), outputs["depth_conf"].float())
        return torch.cat([t.reshape(len(pose_enc), -1) for t in fields], dim=1)

    @staticmethod
    def _quantize(images: torch.Tensor) -> torch.Tensor:
        """[S, 3, H, W] floats in [0, 1] -> [S, H, W, 3] uint8."""
        return (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)

    def _to_host(self, outputs: dict[str, torch.Tensor], images: torch.Tensor) -> dict[str, np.ndarray]:
        """All of a step's per-frame results on the host, [S, ...] each, with one synchronisation:
        the cameras are decoded and the images quantised on the device, everything is packed into
        one float32 and one uint8 buffer, and both are copied at once (through pinned memory on CUDA)."""
        packed = outputs["packed"] if "packed" in outputs else self._pack(outputs)
        rgb = self._quantize(images.to(self.device))
        if self.device.type != "cuda":
            return self._unpack(packed.numpy(), rgb.numpy())
        return self._unstage(self._stage(packed, rgb))

    def _stage(self, packed: torch.Tensor, rgb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]:
        """Enqueue both copies to pinned host buffers on the current stream; the event follows them."""
        staged = self._staging(packed.shape, rgb.shape)
        staged[0].copy_(packed, non_blocking=True)
        staged[1].copy_(rgb, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return staged[0], staged[1], copied

    def _unstage(self, staged: tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]) -> dict[str, np.ndarray]:
        packed, rgb, copied = staged
        copied.synchronize()
        return self._unpack(packed.numpy(), rgb.numpy())

    def _unpack(self, packed: np.ndarray, rgb: np.ndarray) -> dict[str, np.ndarray]:
        flat, host = packed.copy(), {"image": rgb.copy()}  # own memory: the staging buffers are reused
        start = 0
        for name, shape in self._packed_fields().items():
            size = int(np.prod(shape))
            host[name] = flat[:, start : start + size].reshape(len(flat), *shape)
            start += size
        return host

    def _staging(self, float_shape, rgb_shape) -> tuple[torch.Tensor, torch.Tensor]:
        """Pinned host buffers for one step's packed outputs, kept per shape. A step stages its
        outputs only after the previous step's were copied out of them (`_unstage`)."""
        key = (tuple(float_shape), tuple(rgb_shape))
        if key not in self._host_buffers:
            self._host_buffers[key] = (torch.empty(float_shape, pin_memory=True),
                                       torch.empty(rgb_shape, dtype=torch.uint8, pin_memory=True))
        return self._host_buffers[key]

    def _prediction(self, host: dict[str, np.ndarray], row: int, index: int, timestamp: float,
                    frame_type: int) -> FramePrediction:
        return FramePrediction(
            frame_index=index,
            timestamp=timestamp,
            frame_type=frame_type,
            pose_enc=host["pose_enc"][row],
            c2w=host["c2w"][row],
            intrinsics=host["intrinsics"][row],
            depth=host["depth"][row],
            depth_conf=host["depth_conf"][row],
            image=host["image"][row],
        )

    def _check_frame(self, image) -> torch.Tensor:
        if isinstance(image, np.ndarray):
            image = torch.from_numpy(image)
        if not isinstance(image, torch.Tensor):
            raise FrameError(f"a frame must be a torch.Tensor or numpy array [3, H, W], got {type(image).__name__}")
        if image.ndim != 3 or image.shape[0] != 3:
            raise FrameError(f"a frame must have shape [3, H, W] (RGB, channels first), got {list(image.shape)}")
        if image.dtype == torch.uint8:
            image = image.float() / 255
        elif not image.is_floating_point():
            raise FrameError(f"a frame must be uint8 or float in [0, 1], got {image.dtype}")
        height, width = image.shape[1:]
        patch = self.model.config.patch_size
        if height % patch or width % patch:
            raise FrameError(
                f"frame size {height}x{width} is not a multiple of the {patch}-pixel patch; preprocess it first "
                "(stream_recon.app.preprocess)"
            )
        if self._image_size is None:
            self._setup(height, width)
        elif (height, width) != self._image_size:
            raise FrameError(
                f"frame {self.num_frames + len(self._buffer)} is {height}x{width} but the stream started at "
                f"{self._image_size[0]}x{self._image_size[1]}; every frame of a stream must have one size"
            )
        return image.float()

    def _setup(self, height: int, width: int) -> None:
        c = self.model.config
        self._image_size = (height, width)
        rows, cols = c.grid(height, width)
        layout = CacheLayout(rows * cols, c.num_special_tokens, self.config.scale_frames, self.config.window)
        kv_dtype = self.dtype if self.device.type == "cuda" else torch.float32
        attention = resolve_attention(self.config.attention, self.device, kv_dtype)
        if attention.startswith("dense"):
            self.cache = ContiguousTwoStreamCache(layout, c.max_frames)
            self.kv = ContiguousKV(c.depth, c.num_heads, c.head_dim, self.cache.capacity_tokens, kv_dtype, self.device)
            self.backend = make_range_backend(attention, self.kv, self.cache, compile=self._compiles)
        else:
            self.cache = TwoStreamCache(layout)
            self.kv = PagedKV(c.depth, c.num_heads, c.head_dim, layout.page_size, kv_dtype, self.device,
                              self.cache.pool.num_pages)
            self.backend = make_attention_backend(attention, self.kv)
        camera = self.model.camera_head
        # On CUDA, room for every camera token the temporal RoPE range allows: the storage never
        # moves, so a recorded CUDA graph stays valid for the whole stream. Elsewhere it grows.
        capacity = c.max_frames if self.device.type == "cuda" else 64
        self.camera_cache = TokenCache(camera.num_cache_layers, c.camera_heads, c.head_in_dim // c.camera_heads,
                                       torch.float32, self.device, capacity=capacity, compile=self._compiles)
        if self.device.type == "cuda":
            self._heads_stream = torch.cuda.Stream(self.device)
        if self.on_backend_ready is not None:
            self.on_backend_ready(self.backend.name)
