"""Device memory of a streaming run: an estimate from its settings and shapes, and a plan that fits a budget.

What a run holds, and where each number comes from (MemoryEstimate's fields):

| part | what | how it is known |
|---|---|---|
| weights | every parameter and buffer of the prepared model on its device | measured |
| head_tables | the DPT head's UV tables for the frame size, built on the first step and kept (shared by every engine over the model) | exact (DPTHead.uv_table_bytes) |
| kv_cache | the global layers' K/V pages: the pool whole, allocated up front (GPU), or grown to its limit (CPU) | exact (cache.backends.cache_bytes) |
| camera_cache | the camera head's float32 K/V, one token per cached frame | exact |
| activations | the largest step: the scale frames together, or one streaming frame | shapes x constants below |
| graph_pools | what the recorded CUDA graphs' private pools reserve for their replays | a multiple of one streaming step, measured |
| attention_copies | backends that read through a copy (an fp8 store dequantised, pages gathered): one layer's visible K and V | exact |
| workspace | cuBLAS/cuDNN workspaces, staging buffers, the allocator's rounding | a fixed margin |
| cuda_context | the CUDA context and its libraries' kernels, outside PyTorch's allocator (CUDA only) | a fixed margin, measured |

A budget is what the whole process may hold on its GPU, its context included, as `nvidia-smi` counts a
process: `--gpu-memory 16GiB` plans for a card of 16 GiB.

`plan_memory` picks, in this order, the first setting whose estimate fits the budget: the settings
as asked; the fp8 K/V cache (when the precision was left to `auto`: half the cache's bytes,
results within the fp8 accuracy limits); then the longest shorter window down to MIN_WINDOW (this
changes results: fewer frames' patches are visible, so the plan says so). Nothing fitting is a
MemoryBudgetError that names the numbers and the smallest budget that would do.

The heads' activation constants come from traces of live tensor bytes through `GCTStream.step` on
the meta device (scripts/probes/trace_step_memory.py: bf16, frames of 518x280 to 518x518, 1 and 8 frames);
the aggregator's and the graph pools' are a GPU's, measured where the trace cannot see (autocast's
float32 outputs, the pools' reservations). `scripts/bench.py --gpu-memory` prints the estimate beside
torch's measured peak, which is how they are checked on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from stream_recon.cache import CacheLayout, PagedKV, PagedTwoStreamCache, TokenCache, backends, fp8

from ..errors import MemoryBudgetError
from ..network.config import ModelConfig
from ..network.gct import GCTStream
from .stream_config import StreamConfig

GIB = 2**30
# Model-dtype elements alive at the aggregator's peak (DINO trunk, blocks, RoPE tables, the 4 output
# layers), per token x channel of the frames stepped together. The meta trace counts 27, every tensor in
# bf16; under autocast on a GPU the residual stream and the norms' outputs are float32, and the eager
# scale step (8 frames) peaks 453.9 / 605.4 / 796.8 MiB above what the engine held at 518x294 /
# 392 / 518: 37.1-37.3 elements.
AGGREGATOR_ELEMENTS_PER_TOKEN_CHANNEL = 38
# The 4 output layers [S, P, 2C] that the heads read, per token x channel.
HEAD_INPUT_ELEMENTS_PER_TOKEN_CHANNEL = 8
# The DPT head's peak for one frame (it decodes frame by frame), in its dtype, per pixel; its UV
# tables are built in float64 on the first step of a frame size, the kept float32 tables included.
DPT_ELEMENTS_PER_PIXEL = 455
UV_TABLE_BYTES_PER_PIXEL = 665
# The recorded CUDA graphs' private pools (the step's and the heads') reserve about two streaming steps,
# idle between replays, which no eager step can use: 332 / 410 / 540 MiB at 518x294 / 392 / 518 (Hopper,
# the range kernel over fp8, windows 64 / 61 / 41) against steps of 144.4 / 192.5 / 254.3 MiB: 2.12-2.30.
GRAPH_POOL_STEPS = 2.3
WORKSPACE_BYTES = 384 * 2**20
# A process's device memory outside PyTorch's allocator: the CUDA context with the kernels its libraries
# load: 0.74-0.82 GiB on Hopper (torch 2.11, read at out-of-memory errors: 15.92 GiB in use on a 16 GB card
# against 15.10 GiB reserved by the allocator), rounded up for other drivers and libraries.
CUDA_CONTEXT_BYTES = 2**30
# A float32 step on the CPU, in the host's memory: what the process's peak RSS rose by beyond the model and
# the cache (2-core CPU, 2026-11: the full-width model with 2 DINO and 4 aggregator blocks, the same
# activations per layer and heads; 518 x 392 with 2 and 4 scale frames, 392 x 294 with 8: 0.36, 0.35 and
# 0.18 GB per scale frame), per input pixel of each frame stepped together, and a fixed part. A measurement
# of its own, not the constants above in float32: those count what PyTorch's CUDA allocator holds, and the
# CPU's kernels and allocator keep about twice as much alive per token.
HOST_ACTIVATION_BYTES_PER_PIXEL = 1750
HOST_ACTIVATION_FIXED_BYTES = 300_000_000
# The shortest window a plan falls back to: below it reconstructions degrade too much to be worth
# the run; a budget that needs less is an error instead.
MIN_WINDOW = 16


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes of device memory, by part (see the module docstring)."""

    weights: int
    head_tables: int = 0
    kv_cache: int
    camera_cache: int
    activations: int
    graph_pools: int
    attention_copies: int
    workspace: int
    cuda_context: int = 0

    @property
    def total(self) -> int:
        """Every part (each field is one)."""
        return sum(getattr(self, name) for name in self.__dataclass_fields__)

    @property
    def tensors(self) -> int:
        """What PyTorch's allocator holds at the peak: all but the CUDA context (torch's peak memory
        counters compare with this)."""
        return self.total - self.cuda_context

    @property
    def another_engine(self) -> int:
        """What this engine adds beside another over the same model (a chunk's spare, models/stream/lookahead.py,
        estimated with its window slots): all but the shared weights, head tables, workspace and CUDA context. Its
        activations count too: it steps on a stream of its own, whose memory the allocator does not share
        with the first engine's."""
        return self.total - self.weights - self.head_tables - self.workspace - self.cuda_context

    def to_dict(self) -> dict[str, int]:
        return {**{name: getattr(self, name) for name in self.__dataclass_fields__}, "total": self.total}

    def describe(self) -> str:
        parts = ", ".join(f"{name.replace('_', ' ')} {format_bytes(getattr(self, name))}" for name in self.__dataclass_fields__)
        return f"{format_bytes(self.total)} ({parts})"


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """The settings chosen for a budget, what they are estimated to take, and why they differ from
    the settings asked for (`reasons`, one sentence each)."""

    budget: int
    kv_cache: str  # the K/V precision chosen: bf16, fp16, fp32 or fp8
    window: int
    estimate: MemoryEstimate
    asked_kv_cache: str
    asked_window: int
    reasons: tuple[str, ...] = ()

    @property
    def changes_results(self) -> bool:
        """Whether the plan changes results beyond the K/V precision (a shorter window)."""
        return self.window != self.asked_window

    def apply(self, config: StreamConfig) -> StreamConfig:
        """`config` with the plan's K/V precision and window."""
        return replace(config, kv_cache=self.kv_cache, window=self.window)

    def describe(self) -> str:
        """One line for the console: the choice, why, and the estimate."""
        line = (f"memory plan for {format_bytes(self.budget)}: {self.kv_cache} K/V cache, window {self.window}; "
                f"estimated peak {self.estimate.describe()}")
        return " ".join([line, *self.reasons])

    def to_dict(self) -> dict:
        """For run.json."""
        return {"budget": self.budget, "kv_cache": self.kv_cache, "window": self.window,
                "asked": {"kv_cache": self.asked_kv_cache, "window": self.asked_window},
                "changes_results": self.changes_results, "reasons": list(self.reasons),
                "estimate": self.estimate.to_dict()}


def format_bytes(num_bytes: float) -> str:
    """A byte count for people, the one way every command shows a size: binary units (what GPU and
    host memory are counted in, and what `--gpu-memory 8GiB` reads), GiB with two decimals, MiB or
    KiB with one below that, whole bytes under one KiB."""
    if num_bytes >= GIB:
        return f"{num_bytes / GIB:.2f} GiB"
    if num_bytes >= 2**20:
        return f"{num_bytes / 2**20:.1f} MiB"
    if num_bytes >= 2**10:
        return f"{num_bytes / 2**10:.1f} KiB"
    return f"{num_bytes:.0f} B"


def hold_to_card(budget: int, device: torch.device | str = "cuda") -> None:
    """Hold this process's allocator to what a card of `budget` bytes leaves beside the CUDA context
    (torch.cuda.set_per_process_memory_fraction), as the benchmarks and the budget test do: an estimate
    short of the truth then fails here as it would on that card, rather than peaking quietly above the
    plan. torch.cuda.set_per_process_memory_fraction(1.0) lifts it."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(max(0.0, min(1.0, (budget - CUDA_CONTEXT_BYTES) / total)), index)


def paged_cache_bytes(config: ModelConfig, page_size: int, num_pages: int, dtype: torch.dtype) -> int:
    """Bytes `num_pages` pages of `page_size` tokens take in the paged K/V cache of a model of `config`,
    over all its global layers, stored in `dtype`: the count the cache's own storage makes."""
    return PagedKV.bytes_needed(config.depth, config.num_heads, config.head_dim, page_size, num_pages, dtype)


def cpu_cache_pages(config: ModelConfig, page_size: int, scale_frames: int, window: int, max_frames: int,
                    frames: int | None) -> int:
    """Pages the paged K/V cache of a CPU stream holds once `frames` frames (None: a long stream) have
    passed through it, for frames of `page_size` patch tokens and at most `max_frames` cached (a chunk's).

    The pool is the one the cache builds (cache.backends.paged_pool: it starts with the scale frames' pages and
    grows in steps), asked how far it grows for what is in use at once: every frame's patch page until the
    window is full, and the one being decided besides, and the special tokens of every frame (packed)."""
    layout = CacheLayout(page_size, config.num_special_tokens, scale_frames, window)
    frames = max_frames if frames is None else min(frames, max_frames)
    in_use = min(frames, layout.max_patch_pages) + -(-config.num_special_tokens * frames // page_size)
    return backends.paged_pool(layout, max_frames, "cpu").pages_to_hold(in_use)


def host_step_bytes(image_size: tuple[int, int], num_frames: int) -> int:
    """Host memory a float32 CPU step of `num_frames` frames of image_size (height, width) takes beyond the
    model and its cache (HOST_ACTIVATION_BYTES_PER_PIXEL: measured)."""
    height, width = image_size
    return HOST_ACTIVATION_BYTES_PER_PIXEL * height * width * num_frames + HOST_ACTIVATION_FIXED_BYTES


def weight_bytes(model: GCTStream) -> int:
    """Bytes of the model's parameters and buffers on its (prepared) device, each storage once."""
    device = model.inference_spec.device
    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type == device.type:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def estimate_memory(model: GCTStream, config: StreamConfig, image_size: tuple[int, int], *,
                    window_slots: int | None = None) -> MemoryEstimate:
    """Device bytes a StreamingEngine over `model` (prepared) with `config` (and `window_slots`, as
    StreamingEngine takes them) takes at its peak for frames of image_size (height, width), preprocessed."""
    return _Estimator(model, config, image_size).estimate(config.kv_cache, config.window, window_slots)


def cache_pages(model: GCTStream, config: StreamConfig, image_size: tuple[int, int], *,
                window_slots: int | None = None) -> int:
    """The pages the K/V cache of a StreamingEngine over `model` with `config` (and `window_slots`) may ever
    hold for frames of image_size (height, width): what an engine lends past its own for such a one beside it."""
    rows, cols = model.config.grid(*image_size)
    layout = CacheLayout(rows * cols, model.config.num_special_tokens, config.scale_frames, config.window,
                         window_slots=window_slots)
    return PagedTwoStreamCache.pages_needed(layout, config.cached_frames(model.config.max_frames))


def plan_memory(model: GCTStream, config: StreamConfig, image_size: tuple[int, int], budget: int) -> MemoryPlan:
    """The settings (K/V precision, window) under which a StreamingEngine over `model` with
    `config` fits `budget` bytes of device memory, for frames of image_size (height, width).

    Tries the settings as asked; then, if `config.kv_cache` is `auto` and the attention backend
    reads fp8, the fp8 cache; then the longest window from `config.window - 1` down to MIN_WINDOW
    (at the precision tried last). Raises MemoryBudgetError when none fits.
    """
    if budget <= 0:
        raise MemoryBudgetError(f"a GPU memory budget must be positive, got {budget} bytes")
    estimator = _Estimator(model, config, image_size)
    asked = estimator.precision(config.kv_cache)
    precisions = [asked]
    if config.kv_cache == backends.AUTO and asked != backends.FP8 and estimator.reads(backends.FP8):
        precisions.append(backends.FP8)
    for precision in precisions:
        estimate = estimator.estimate(precision, config.window)
        if estimate.total <= budget:
            reasons = () if precision == asked else (
                f"The {asked} cache would need {format_bytes(estimator.estimate(asked, config.window).total)}.",)
            return MemoryPlan(budget=budget, kv_cache=precision, window=config.window, estimate=estimate,
                              asked_kv_cache=asked, asked_window=config.window, reasons=reasons)
    precision = precisions[-1]
    for window in range(config.window - 1, MIN_WINDOW - 1, -1):
        estimate = estimator.estimate(precision, window)
        if estimate.total <= budget:
            full = estimator.estimate(precision, config.window).total
            reason = (f"Warning: the window was shortened from {config.window} to {window} frames to fit (the "
                      f"{precision} cache at window {config.window} would need {format_bytes(full)}); results change: each "
                      "frame sees fewer recent frames.")
            return MemoryPlan(budget=budget, kv_cache=precision, window=window, estimate=estimate,
                              asked_kv_cache=asked, asked_window=config.window, reasons=(reason,))
    smallest = estimator.estimate(precision, min(MIN_WINDOW, config.window))
    height, width = image_size
    raise MemoryBudgetError(
        f"a GPU memory budget of {format_bytes(budget)} cannot hold this run at {width}x{height}: the smallest setting "
        f"allowed ({precision} K/V cache, window {min(MIN_WINDOW, config.window)}) needs {smallest.describe()}; "
        f"give it at least {format_bytes(smallest.total)} (--gpu-memory) or lower the resolution"
    )


class _Estimator:
    """The estimate's fixed inputs for one model, config and frame size; `estimate` varies the
    K/V precision and the window."""

    def __init__(self, model: GCTStream, config: StreamConfig, image_size: tuple[int, int]):
        spec = model.inference_spec
        self.model_config, self.config = model.config, config
        self.device, self.dtype = spec.device, spec.dtype
        self.weights = weight_bytes(model)
        self.height, self.width = image_size
        self.head_tables = model.depth_head.uv_table_bytes(self.height, self.width)
        rows, cols = model.config.grid(self.height, self.width)
        self.patches = rows * cols
        self.tokens_per_frame = self.patches + model.config.num_special_tokens
        self.cached_frames = config.cached_frames(model.config.max_frames)
        camera = model.camera_head
        self.camera_cache = TokenCache.bytes_needed(
            camera.cache_layers(config.camera_iterations), model.config.camera_heads,
            model.config.head_in_dim // model.config.camera_heads, self.cached_frames, torch.float32)

    def precision(self, kv_cache: str) -> str:
        """The precision name `kv_cache` stands for with this model (`auto`: the model's)."""
        return backends.precision_name(backends.store_dtype(kv_cache, self.dtype))

    def reads(self, precision: str) -> bool:
        """Whether the attention asked for can read a cache of `precision`."""
        try:
            self._backend(precision)
        except ValueError:
            return False
        return True

    def estimate(self, kv_cache: str, window: int, window_slots: int | None = None) -> MemoryEstimate:
        c = self.model_config
        stored = backends.store_dtype(kv_cache, self.dtype)
        backend = self._backend(kv_cache)
        layout = CacheLayout(self.patches, c.num_special_tokens, self.config.scale_frames, window,
                             window_slots=window_slots)
        kv_bytes = backends.cache_bytes(layout, num_layers=c.depth, num_heads=c.num_heads, head_dim=c.head_dim,
                                        max_frames=self.cached_frames, dtype=self.dtype, device_type=self.device.type,
                                        stored=stored)
        streaming = self._step_bytes(1, first=False)
        records = self.device.type == "cuda" and self.config.cuda_graphs
        copies = 0
        if backend.gathers or (stored == fp8.E4M3 and backend.reads_fp8):
            # a layer's visible keys and values, at most the full window's pages' rows (a spare's too)
            full = CacheLayout(self.patches, c.num_special_tokens, self.config.scale_frames, window)
            rows = PagedTwoStreamCache.pages_needed(full, self.cached_frames) * self.patches
            copies = 2 * rows * c.embed_dim * self._element_size
        return MemoryEstimate(
            weights=self.weights,
            head_tables=self.head_tables,
            kv_cache=kv_bytes,
            camera_cache=self.camera_cache,
            activations=max(self._step_bytes(self.config.scale_frames, first=True), streaming),
            graph_pools=int(GRAPH_POOL_STEPS * streaming) if records else 0,
            attention_copies=copies,
            workspace=WORKSPACE_BYTES,
            cuda_context=CUDA_CONTEXT_BYTES if self.device.type == "cuda" else 0,
        )

    def _backend(self, kv_cache: str) -> backends.BackendSpec:
        stored = backends.store_dtype(kv_cache, self.dtype)
        return backends.resolve(self.config.attention, self.device, self.dtype, stored)

    @property
    def _element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def _step_bytes(self, num_frames: int, first: bool) -> int:
        """The activation peak of a step of `num_frames` frames: the aggregator's, or the heads'
        (their input layers plus one frame of the DPT head), whichever is larger."""
        token_channels = num_frames * self.tokens_per_frame * self.model_config.embed_dim
        pixels = self.height * self.width
        size = self._element_size
        aggregator = AGGREGATOR_ELEMENTS_PER_TOKEN_CHANNEL * token_channels * size
        heads = HEAD_INPUT_ELEMENTS_PER_TOKEN_CHANNEL * token_channels * size + DPT_ELEMENTS_PER_PIXEL * pixels * size
        if first:
            heads += max(0, UV_TABLE_BYTES_PER_PIXEL * pixels - self.head_tables)  # (head_tables: counted apart)
        return max(aggregator, heads)
