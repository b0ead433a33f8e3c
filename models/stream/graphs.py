"""One streaming frame's model step replayed as CUDA graphs.

A frame step launches a few thousand small kernels whose launch cost, not their arithmetic, sets
the frame time. Recording them once and replaying removes that cost. The key set of the global
attention changes size from frame to frame (special tokens accumulate). A cache whose backend
reads its plan from device memory (`records_attention`: the Triton range kernel) is recorded with
the rest; any other backend's attention (the SDPA reference's) runs eagerly between graph segments, on the same stream,
with everything else (DINO, frame blocks, the projections, K/V writes, RoPE, both heads) inside
the graphs:

    embed graph | blocks graph | hand-over graph || heads graph                       (attention in the graph)
    embed graph | blocks 0 | attention layer 0 | blocks 1 | ... | blocks 24 | hand-over || heads

The embed graph (DINO and the special tokens) reads no cache, so the engine may replay it for the
next frame before it has decided whether the current frame stays (flow keyframes). Inputs are
copied into static tensors before a replay; where this step writes its K/V (its special tokens' rows and
its patch page's first row) and its camera token (TokenCache's device-side start) are static tensors too. The heads are a graph of
their own, so that the engine can run a frame's heads (and its copy to the host) on a second
stream while the next frame's aggregator runs.
"""

from __future__ import annotations

import contextlib
import gc

import torch

from stream_recon.cache import DeviceValues, KVCache

from ..network.gct import GCTStream
from .precision import step_precision

# Only the capturing thread is barred from calls that are illegal during a capture: a window's
# spare engine (models/lookahead.py) records its graph on a worker thread while the stream goes on.
CAPTURE_MODE = "thread_local"


class _SplitAtAttention:
    """The cache callable during recording: writes K/V inside the current segment, then closes it,
    runs the attention eagerly (its result is a placeholder until replay) and opens the next."""

    def __init__(self, runner: RecordedStep):
        self.runner = runner

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        r = self.runner
        r.cache.write(layer, r.slots, k, v)
        query = q.to(r.cache.dtype).contiguous()
        r.graphs[-1].capture_end()
        output = r.cache.attend(layer, query).contiguous()  # allocated outside the graph pool: stays put
        r.splits.append((layer, query, output))
        r.graphs.append(torch.cuda.CUDAGraph())
        r.graphs[-1].capture_begin(pool=r.pool, capture_error_mode=CAPTURE_MODE)
        return output


class RecordedStep:
    """Records `model.step` for one frame of a fixed size and replays it, in three parts: the
    embedding (no cache), the blocks (segments split at the global attentions unless the backend
    plans on the device) and the heads (one graph, with its own memory pool, so that a frame's
    heads may run on another stream beside the next frame's aggregator). The aggregator's four
    output layers are handed over in buffers of their own.

    The cache must be planned for the frame before the blocks are replayed, as for an eager step.
    A frame's K/V go to its special tokens' rows (which may lie on two special pages) and to its patch
    page, row after row. `pack` maps the heads' outputs to the tensor the caller copies to the host;
    it is recorded too.
    """

    def __init__(self, model: GCTStream, cache: KVCache, camera_cache, image_shape: tuple[int, int, int],
                 num_scale_frames: int, autocast_dtype: torch.dtype | None, pack, descriptors: bool = False):
        device = cache.device
        self.model, self.cache, self.camera_cache = model, cache, camera_cache
        self.num_scale_frames = num_scale_frames
        self.autocast_dtype = autocast_dtype
        self.pack = pack
        self.descriptors = descriptors  # the frame's retrieval descriptor, computed in the hand-over
        self.images = torch.zeros(1, *image_shape, device=device)
        self.grid = model.config.grid(*image_shape[1:])
        # One host-to-device copy per part: the stream index for the embedding; the temporal index, the
        # special tokens' rows and the patch page's first row for the blocks. The patch rows are expanded
        # on the device.
        layout = cache.layout
        self._specials = layout.specials_per_frame
        self._embed_upload = DeviceValues(1, torch.long, device)
        self._blocks_upload = DeviceValues(2 + self._specials, torch.long, device)
        self._patch_offsets = torch.arange(layout.patches_per_frame, device=device)
        self.slots: torch.Tensor | None = None  # [T] store positions, computed inside the graph
        self.tokens: torch.Tensor | None = None  # [1, P, C] the embed graph's output
        self.pool, self.heads_pool = torch.cuda.graph_pool_handle(), torch.cuda.graph_pool_handle()
        self.embed_graph: torch.cuda.CUDAGraph | None = None
        self.graphs: list[torch.cuda.CUDAGraph] = []  # block segments
        self.handoff_graph: torch.cuda.CUDAGraph | None = None
        self.heads_graph: torch.cuda.CUDAGraph | None = None
        self.splits: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (layer, query, output) per attention
        self.handoff: list[torch.Tensor] = []  # the 4 output layers (and the descriptor), read by the heads graph
        self.outputs: dict[str, torch.Tensor] | None = None  # static: overwritten by each heads replay
        self.aggregated, self.heads_done = torch.cuda.Event(), torch.cuda.Event()
        self.camera_version = camera_cache.version
        # Set to a list to time each replay: (part, start, end) events, part "embed", "graph",
        # "attention", "handoff" or "heads".
        self.timing_events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] | None = None

    @property
    def is_current(self) -> bool:
        """The camera cache's storage is the one recorded (it never moves on CUDA)."""
        return self.camera_version == self.camera_cache.version

    def load_frame(self, images: torch.Tensor, stream_index: int) -> None:
        """The embedding's inputs: images [1, 3, H, W] float on the device, the frame's stream index."""
        self._embed_upload.set(stream_index)
        self.images.copy_(images, non_blocking=True)

    def load_position(self, time_index: int, frame_slots: tuple[list[int], int]) -> None:
        """The blocks' inputs: the temporal index and where the frame's tokens go (KVCache.frame_slots: its
        special tokens' rows, its patch page's first row)."""
        specials, patch_start = frame_slots
        self._blocks_upload.set(time_index, *specials, patch_start)

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
            tokens = self._embed()
            layers = self._blocks(tokens, self.cache.step(self._slots())) + self._descriptor(tokens)
            self.pack(self._predict(layers, height, width))
            self.handoff = [torch.empty_like(layer) for layer in layers]
            stream.synchronize()
            with _collector_paused():
                self._capture(stream, height, width)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def _capture(self, stream: torch.cuda.Stream, height: int, width: int) -> None:
        """The embedding, the block segments, the hand-over and the heads, each a graph (inside `record`)."""
        self.embed_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.embed_graph, pool=self.pool, stream=stream, capture_error_mode=CAPTURE_MODE):
            self.tokens = self._embed()
        self.graphs = [torch.cuda.CUDAGraph()]
        self.graphs[0].capture_begin(pool=self.pool, capture_error_mode=CAPTURE_MODE)
        try:
            self.slots = self._slots()
            attention = self.cache.step(self.slots) if self.cache.records_attention else _SplitAtAttention(self)
            layers = self._blocks(self.tokens, attention)
        finally:
            self.graphs[-1].capture_end()
        # The hand-over is a graph of its own: in a pipelined stream it alone waits for the
        # previous frame's heads, which read the buffers. The descriptor is made here, from the
        # embedding's output, which the next frame's embedding overwrites before these heads run.
        self.handoff_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.handoff_graph, pool=self.pool, stream=stream, capture_error_mode=CAPTURE_MODE):
            for buffer, layer in zip(self.handoff, layers + self._descriptor(self.tokens), strict=True):
                buffer.copy_(layer)
        self.heads_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.heads_graph, pool=self.heads_pool, stream=stream, capture_error_mode=CAPTURE_MODE):
            outputs = self._predict(self.handoff, height, width)
            self.outputs = {"pose_enc": outputs["pose_enc"], "depth": outputs["depth"],
                            "depth_conf": outputs["depth_conf"], "packed": self.pack(outputs)}

    def _descriptor(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        """[the frame's descriptor [1, C]] when asked for, else []: it travels after the output layers."""
        return [self.model.descriptor(tokens)] if self.descriptors else []

    def _predict(self, handed_over: list[torch.Tensor], height: int, width: int) -> dict[str, torch.Tensor]:
        """Both heads on the 4 output layers; the descriptor, when handed over after them, joins the outputs."""
        num_layers = len(self.model.config.output_layers)
        outputs = self.model.predict(handed_over[:num_layers], self.camera_cache, height, width)
        if self.descriptors:
            outputs["descriptor"] = handed_over[num_layers]
        return outputs

    def _slots(self) -> torch.Tensor:
        """[T] token rows of this step's tokens: the special rows uploaded, then the patch page's rows."""
        scalars = self._blocks_upload.values
        return torch.cat([scalars[1:1 + self._specials], scalars[1 + self._specials] + self._patch_offsets])

    def _embed(self) -> torch.Tensor:
        return self.model.aggregator.embed(self.images, self._embed_upload.values, self.num_scale_frames)

    def _blocks(self, tokens: torch.Tensor, attention) -> list[torch.Tensor]:
        return self.model.aggregator.blocks(tokens, attention, self._blocks_upload.values[0:1], *self.grid)

    def replay_embed(self) -> None:
        """Enqueue the embedding of the loaded frame on the current stream."""
        with torch.inference_mode():
            self._timed("embed", self.embed_graph.replay)

    def replay_blocks(self) -> None:
        """Enqueue the blocks on the current stream, after `replay_embed`; `aggregated` is recorded
        after them. The hand-over buffers are refilled last, after the previous heads replay has
        read them."""
        with torch.inference_mode():
            for graph, (layer, query, output) in zip(self.graphs, self.splits, strict=False):
                self._timed("graph", graph.replay)
                self._timed("attention", lambda layer=layer, query=query, output=output: output.copy_(
                    self.cache.attend(layer, query)))
            self._timed("graph", self.graphs[-1].replay)
            torch.cuda.current_stream().wait_event(self.heads_done)
            self._timed("handoff", self.handoff_graph.replay)
            self.aggregated.record()

    def replay_heads(self) -> dict[str, torch.Tensor]:
        """Enqueue the heads on the current stream, after the last blocks replay. Returns the
        static outputs (pose_enc [1, 9], depth and depth_conf [1, H, W], packed [1, N]): read or
        copy them before the next heads replay."""
        stream = torch.cuda.current_stream()
        stream.wait_event(self.aggregated)
        self._timed("heads", self.heads_graph.replay)
        self.heads_done.record(stream)
        return self.outputs

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
        return step_precision("cuda", self.autocast_dtype)


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
