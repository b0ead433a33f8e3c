"""One streaming frame's model step replayed as CUDA graphs.

A frame step launches a few thousand small kernels whose launch cost, not their arithmetic, sets
the frame time. Recording them once and replaying removes that cost. The key set of the global
attention changes size from frame to frame (special tokens accumulate). A backend that reads its
plan from device memory (`reads_plan_on_device`, the Triton range kernel) is recorded with the
rest; any other backend's attention runs eagerly between graph segments, on the same stream,
with everything else (DINO, frame blocks, the projections, K/V writes, RoPE, both heads) inside
the graphs:

    aggregator graph | hand-over graph || heads graph                         (attention in the graph)
    graph 0 | attention layer 0 | graph 1 | ... | attention layer 23 | graph 24 | hand-over || heads

Inputs are copied into static tensors before a replay; where this step writes its K/V (token
slots) and its camera token (TokenCache's device-side start) are static tensors too. The heads are
a graph of their own, so that the engine can run a frame's heads (and its copy to the host) on a
second stream while the next frame's aggregator runs.
"""

from __future__ import annotations

import contextlib
import gc

import torch

from stream_recon.cache import DeviceValues, KVStep

from .gct import GCTStream


class _SplitAtAttention:
    """The cache callable during recording: writes K/V inside the current segment, then closes it,
    runs the attention eagerly (its result is a placeholder until replay) and opens the next."""

    def __init__(self, runner: GraphedStep):
        self.runner = runner

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        r = self.runner
        r.kv.write(layer, r.slots, k, v)
        query = q.to(r.kv.dtype).contiguous()
        r.graphs[-1].capture_end()
        output = r.backend.attend(layer, query).contiguous()  # allocated outside the graph pool: stays put
        r.splits.append((layer, query, output))
        r.graphs.append(torch.cuda.CUDAGraph())
        r.graphs[-1].capture_begin(pool=r.pool)
        return output


class GraphedStep:
    """Records `model.step` for one frame of a fixed size and replays it, in two parts: the
    aggregator (segments split at the global attentions) and the heads (one graph, with its own
    memory pool, so that a frame's heads may run on another stream beside the next frame's
    aggregator). The aggregator's four output layers are handed over in buffers of their own.

    `kv` and `backend` are the engine's cache storage and attention backend (any of them); the
    backend must be planned for the frame before a replay, as for an eager step. A frame's K/V go
    to two store ranges (its special tokens, its patch tokens), `token_counts` long each. `pack`
    maps the heads' outputs to the tensor the caller copies to the host; it is recorded too.
    """

    def __init__(self, model: GCTStream, kv, backend, camera_cache, image_shape: tuple[int, int, int],
                 token_counts: tuple[int, int], num_scale_frames: int, autocast_dtype: torch.dtype | None,
                 pack):
        device = kv.device
        self.model, self.kv, self.backend, self.camera_cache = model, kv, backend, camera_cache
        self.num_scale_frames = num_scale_frames
        self.autocast_dtype = autocast_dtype
        self.pack = pack
        self.images = torch.zeros(1, *image_shape, device=device)
        # One host-to-device copy per step: stream index, temporal index, first special-token
        # position, first patch-token position. The token positions are expanded on the device.
        self._scalar_upload = DeviceValues(4, torch.long, device)
        self.scalars = self._scalar_upload.values
        specials, patches = token_counts
        self._token_offsets = torch.cat([torch.arange(specials), torch.arange(patches)]).to(device)
        self._is_special = (torch.arange(specials + patches) < specials).to(device)
        self.slots: torch.Tensor | None = None  # [T] store positions, computed inside the graph
        self.pool, self.heads_pool = torch.cuda.graph_pool_handle(), torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []  # aggregator segments
        self.handoff_graph: torch.cuda.CUDAGraph | None = None
        self.heads_graph: torch.cuda.CUDAGraph | None = None
        self.splits: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (layer, query, output) per attention
        self.handoff: list[torch.Tensor] = []  # the 4 output layers, read by the heads graph
        self.outputs: dict[str, torch.Tensor] | None = None  # static: overwritten by each heads replay
        self.aggregated, self.heads_done = torch.cuda.Event(), torch.cuda.Event()
        self.camera_version = camera_cache.version
        # Set to a list to time each replay: (part, start, end) events, part "graph", "attention",
        # "handoff" or "heads".
        self.timing_events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] | None = None

    def load(self, images: torch.Tensor, token_ranges: tuple[range, range], stream_index: int, time_index: int) -> None:
        """Copy one step's inputs into the static tensors. images [1, 3, H, W]; token_ranges: the
        store positions of the frame's special tokens and patch tokens."""
        specials, patches = token_ranges
        self._scalar_upload.set(stream_index, time_index, specials.start, patches.start)
        self.images.copy_(images, non_blocking=True)

    def record(self) -> None:
        """Capture the step (nothing executes for good). The engine runs the frame eagerly first,
        which performs the lazy initialisation (cuBLAS/cuDNN handles) that capture must not see.
        One more eager run in the capture's own context (stream, autocast settings) follows, so
        that a compiled function which recompiles for that context does so outside the capture;
        it writes the same K/V and camera token to the same places as the engine's eager run."""
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode(), self._autocast():
            height, width = self.images.shape[-2:]
            layers = self._aggregate(KVStep(self.kv, self.backend, self._slots()))
            self.pack(self.model.predict(layers, self.camera_cache, height, width))
            self.handoff = [torch.empty_like(layer) for layer in layers]
            stream.synchronize()
            with _collector_paused():
                self._capture(stream, height, width)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def _capture(self, stream: torch.cuda.Stream, height: int, width: int) -> None:
        """The aggregator segments, the hand-over and the heads, each a graph (inside `record`)."""
        self.graphs = [torch.cuda.CUDAGraph()]
        self.graphs[0].capture_begin(pool=self.pool)
        try:
            self.slots = self._slots()
            in_graph = getattr(self.backend, "reads_plan_on_device", False)
            attention = KVStep(self.kv, self.backend, self.slots) if in_graph else _SplitAtAttention(self)
            layers = self._aggregate(attention)
        finally:
            self.graphs[-1].capture_end()
        # The hand-over is a graph of its own: in a pipelined stream it alone waits for the
        # previous frame's heads, which read the buffers.
        self.handoff_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.handoff_graph, pool=self.pool, stream=stream):
            for buffer, layer in zip(self.handoff, layers, strict=True):
                buffer.copy_(layer)
        self.heads_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.heads_graph, pool=self.heads_pool, stream=stream):
            outputs = self.model.predict(self.handoff, self.camera_cache, height, width)
            self.outputs = {"pose_enc": outputs["pose_enc"], "depth": outputs["depth"],
                            "depth_conf": outputs["depth_conf"], "packed": self.pack(outputs)}

    def _slots(self) -> torch.Tensor:
        """[T] store positions of this step's tokens, from the two first positions in `scalars`."""
        return torch.where(self._is_special, self.scalars[2], self.scalars[3]) + self._token_offsets

    def _aggregate(self, attention) -> list[torch.Tensor]:
        return self.model.aggregator(self.images, attention, self.scalars[0:1], self.scalars[1:2], self.num_scale_frames)

    def replay_aggregator(self) -> None:
        """Enqueue the aggregator on the current stream; `aggregated` is recorded after it. The
        hand-over buffers are refilled last, after the previous heads replay has read them."""
        with torch.inference_mode():
            for graph, (layer, query, output) in zip(self.graphs, self.splits, strict=False):
                self._timed("graph", graph.replay)
                self._timed("attention", lambda layer=layer, query=query, output=output: output.copy_(
                    self.backend.attend(layer, query)))
            self._timed("graph", self.graphs[-1].replay)
            torch.cuda.current_stream().wait_event(self.heads_done)
            self._timed("handoff", self.handoff_graph.replay)
            self.aggregated.record()

    def replay_heads(self) -> dict[str, torch.Tensor]:
        """Enqueue the heads on the current stream, after the last aggregator replay. Returns the
        static outputs (pose_enc [1, 9], depth and depth_conf [1, H, W], packed [1, N]): read or
        copy them before the next heads replay."""
        stream = torch.cuda.current_stream()
        stream.wait_event(self.aggregated)
        self._timed("heads", self.heads_graph.replay)
        self.heads_done.record(stream)
        return self.outputs

    def replay(self) -> dict[str, torch.Tensor]:
        """The whole step on the current stream (outputs as for `replay_heads`)."""
        self.replay_aggregator()
        return self.replay_heads()

    def _timed(self, part: str, run) -> None:
        if self.timing_events is None:
            run()
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        self.timing_events.append((part, start, end))

    def _autocast(self):
        if self.autocast_dtype is None:
            return torch.autocast("cuda", enabled=False)
        # No weight-cast cache: a cached cast made during capture would be freed after it.
        return torch.autocast("cuda", dtype=self.autocast_dtype, cache_enabled=False)


@contextlib.contextmanager
def _collector_paused():
    """Python's cycle collector, run inside a capture, can free objects of earlier streams (graphs,
    pinned buffers, library modules) whose CUDA calls are illegal while a stream captures, which
    invalidates the capture. torch.cuda.graph collects before its capture for that reason; the
    segments here are captured by hand, so the collector runs first and then waits."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def compile_blocks(model: torch.nn.Module) -> int:
    """Fuse the two halves of every transformer block (around its attention) with TorchInductor.

    The blocks of one kind share one compiled graph (modules are inputs, not constants), and the
    attention call between the halves stays eager, so any cache backend still serves it.
    Returns the number of blocks compiled.
    """
    from .layers import Block

    dynamo = torch._dynamo.config
    # Block kinds x input shapes (scale frames, streaming frame) exceed the default of 8.
    dynamo.recompile_limit = max(dynamo.recompile_limit, 64)
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for block in blocks:
        _compile_methods(block, ("attention_inputs", "attention_outputs"))
    return len(blocks)


def compile_depth_head(model: torch.nn.Module) -> None:
    """Fuse the DPT head's convolutional part (`DPTHead.decode`) with TorchInductor.

    Its ~30 convolutions stay cuDNN's; the ReLUs, residual sums, bilinear resizes and UV additions
    between them (full-resolution float32 tensors) become a few fused kernels. Measured on an H100
    at 518x378: 3.0 ms eager, 1.5 ms compiled with channels-last weights (docs/PERFORMANCE.md).
    """
    _compile_methods(model.depth_head, ("decode",))


def compile_camera_head(model: torch.nn.Module) -> None:
    """Fuse the camera head's per-iteration conditioning and pose refinement (its trunk blocks are
    compiled by `compile_blocks`): fewer small kernels on the step's longest path, the camera head."""
    _compile_methods(model.camera_head, ("condition", "refine"))


def _compile_methods(module: torch.nn.Module, names: tuple[str, ...]) -> None:
    """Replace each named method of `module` by its compiled version (static shapes), once: an
    instance attribute of that name means an earlier engine on this model compiled it already."""
    for name in names:
        if name not in module.__dict__:
            setattr(module, name, torch.compile(getattr(module, name), dynamic=False))
