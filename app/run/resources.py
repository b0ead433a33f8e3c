"""Will a run fit this machine, and how slow will it be? Estimated from the settings before the model loads.

Pure functions first (numbers in, numbers or a decision out, nothing read from the machine), then
the few that read the machine (available memory, the CPU's matrix throughput) and the pre-run check
that ties them to a RunOptions.

Host memory of a CPU run: the terms are the models' memory model's (models/stream/memory.py), asked for
the settings before anything is built; what is the app's is the weights' count and the choice of smaller
settings::

    weights      parameters x 4 bytes                               (the full model: 1.16 G -> 4.6 GB)
    KV cache     pages x P patch tokens x L layers x 2 (K, V) x C x 4 bytes (paged_cache_bytes), the
                 pages those the cache's own pool grows to for the frames (cpu_cache_pages)
    activations  the scale frames processed together (phase 1), as a CPU step measured (host_step_bytes)

At the defaults on a 4:3 source (518 x 392 input, P = 1036), a long stream: 4.6 + 15.3 + 3.1 = 23 GB;
on 16:9 (518 x 294): 4.6 + 11.6 + 2.4 = 18.7 GB. 12 frames of the bundled sample: 4.6 + 4.1 + 2.4 =
11.2 GB; 3 frames: 7.4 GB (17.5 GiB and 21 GB were measured when the pool held the whole window from
the first frame). The cache term matched `cache_bytes` in run.json to the byte.

Time per frame: FLOPs from the shapes (every linear layer 2 x params x tokens, attention 4 x queries x
keys x C, the DPT head's convolutions) over the CPU's float32 matmul throughput, measured in 0.1 s at
the start of the run; the same shallow model ran at 0.83 of that throughput.

The device's memory (a GPU budget, the FP8 cache) is models/stream/memory.py's: the plan the engine keeps
for `--gpu-memory`, made from the prepared model before its first frame.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from stream_recon.app.options import OptionsError
from stream_recon.app.sources.input_size import DEFAULT_IMAGE_WIDTH, model_input_size
from stream_recon.models import SCALE_FRAMES, TRAINED_VIEWS, WINDOW, GCTStream
from stream_recon.models.stream.memory import (
    cpu_cache_pages,
    format_bytes,
    host_step_bytes,
    paged_cache_bytes,
)

if TYPE_CHECKING:
    from stream_recon.models import ModelConfig

FLOAT32_BYTES = 4
MATMUL_EFFICIENCY = 0.8  # the model's share of the measured matmul throughput
WARN_SECONDS_PER_FRAME = 1.0  # a CPU run slower than this is announced
WARN_MEMORY_SHARE = 0.85  # an estimate above this share of the available memory is announced
FAST_ANYWHERE_FLOPS = 10e9  # a frame this cheap takes well under a second on any CPU: no need to measure it


@dataclass(frozen=True)
class ModelShape:
    """What memory and compute depend on in the model: its ModelConfig (the sizes) and its parameter count
    (model_shape counts it without building the model in memory)."""

    config: ModelConfig
    num_params: int

    @property
    def dino_extra_tokens(self) -> int:
        """Tokens the DINO trunk adds to a frame's patches: the class token and the registers."""
        return 1 + self.config.dino_registers


@dataclass(frozen=True, kw_only=True)
class RunShape:
    """The settings that size a run: the source's frame size, the input width, the cache's frame counts."""

    source_size: tuple[int, int]  # (width, height) of the source's frames
    image_width: int = DEFAULT_IMAGE_WIDTH
    scale_frames: int = SCALE_FRAMES
    window: int = WINDOW
    chunk_frames: int = TRAINED_VIEWS  # frames whose special tokens a chunk can hold
    frames: int | None = None  # the stream's length when known; None: long

    @property
    def input_size(self) -> tuple[int, int]:
        """(H, W) of the model input (app.sources.preprocess's crop rule)."""
        return model_input_size(*self.source_size, self.image_width)

    def patches(self, patch_size: int) -> int:
        height, width = self.input_size
        return (height // patch_size) * (width // patch_size)

    @property
    def pixels(self) -> int:
        height, width = self.input_size
        return height * width


@dataclass(frozen=True)
class HostMemoryEstimate:
    weights_bytes: int
    cache_bytes: int
    activation_bytes: int
    cache_pages: int
    tokens_per_page: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.cache_bytes + self.activation_bytes

    def describe(self) -> str:
        weights = f"weights {format_bytes(self.weights_bytes)}" if self.weights_bytes else "beside the weights already loaded"
        return (
            f"about {format_bytes(self.total_bytes)} ({weights}, KV cache {format_bytes(self.cache_bytes)} for {self.cache_pages} "
            f"pages of {self.tokens_per_page} tokens, activations {format_bytes(self.activation_bytes)})"
        )


def estimate_host_memory(model: ModelShape, run: RunShape, *, count_weights: bool = True) -> HostMemoryEstimate:
    """Host memory of a float32 CPU run with the paged cache (the module docstring has the terms).

    count_weights: False when the model is in memory already (a batch worker's), so that the memory
    still available is compared with what the run adds."""
    config = model.config
    patches = run.patches(config.patch_size)
    pages = cpu_cache_pages(config, patches, run.scale_frames, run.window, run.chunk_frames, run.frames)
    cache = paged_cache_bytes(config, patches, pages, torch.float32)
    together = run.scale_frames if run.frames is None else min(run.frames, run.scale_frames)
    activations = host_step_bytes(run.input_size, together)
    weights = model.num_params * FLOAT32_BYTES if count_weights else 0
    return HostMemoryEstimate(weights, cache, activations, pages, patches)


@dataclass(frozen=True)
class HostMemoryPlan:
    """Whether a run fits; if not, the first smaller settings that do (flag -> value) and their estimate."""

    estimate: HostMemoryEstimate
    available_bytes: int
    smaller: dict[str, int] | None = None
    smaller_estimate: HostMemoryEstimate | None = None

    @property
    def fits(self) -> bool:
        return self.estimate.total_bytes <= self.available_bytes

    @property
    def tight(self) -> bool:
        return self.estimate.total_bytes > WARN_MEMORY_SHARE * self.available_bytes


# Smaller settings to suggest, in order of preference: the window first (cache only), then the
# input width (cache and activations), then fewer scale frames (activations).
SMALLER_SETTINGS: tuple[dict[str, int], ...] = (
    {"window": 32},
    {"image_width": 392, "window": 32},
    {"image_width": 392, "window": 16},
    {"image_width": 308, "window": 16},
    {"image_width": 224, "window": 16, "scale_frames": 4},
    {"image_width": 224, "window": 8, "scale_frames": 4},
)


def plan_host_memory(model: ModelShape, run: RunShape, available_bytes: int, *, count_weights: bool = True) -> HostMemoryPlan:
    """Does `run` fit in `available_bytes`? If not, the first of SMALLER_SETTINGS (only those that shrink
    what the user chose) whose estimate fits."""
    estimate = estimate_host_memory(model, run, count_weights=count_weights)
    plan = HostMemoryPlan(estimate, available_bytes)
    if plan.fits:
        return plan
    for settings, smaller_run in _smaller_runs(run):
        smaller_estimate = estimate_host_memory(model, smaller_run, count_weights=count_weights)
        if smaller_estimate.total_bytes <= available_bytes:
            return replace(plan, smaller=settings, smaller_estimate=smaller_estimate)
    return plan


def _smaller_runs(run: RunShape) -> Iterator[tuple[dict[str, int], RunShape]]:
    for settings in SMALLER_SETTINGS:
        if any(value > getattr(run, name) for name, value in settings.items()):
            continue  # never suggest more than the user asked for
        smaller = replace(run, **settings)
        if smaller != run:
            yield {name: value for name, value in settings.items() if value != getattr(run, name)}, smaller


def refusal_message(plan: HostMemoryPlan) -> str:
    """One line: what the run needs, what there is, and what to run instead."""
    needs = f"these settings need {plan.estimate.describe()} but {format_bytes(plan.available_bytes)} is available"
    if plan.smaller is None:
        instead = "no smaller settings fit either: free memory or use a GPU (--device cuda)"
    else:
        instead = f"{flags(plan.smaller)} needs about {format_bytes(plan.smaller_estimate.total_bytes)}"
    return f"{needs}; {instead} (--no-memory-check runs anyway)"


def flags(settings: dict[str, Any]) -> str:
    return " ".join(f"--{name.replace('_', '-')} {value}" for name, value in settings.items())


# --------------------------------------------------------------------------------------------------
# Time


def frame_flops(model: ModelShape, run: RunShape, cached_frames: int) -> float:
    """FLOPs of one streaming frame whose global attention reads `cached_frames` frames' patches."""
    config = model.config
    patches = run.patches(config.patch_size)
    tokens = patches + config.num_special_tokens
    dino_tokens = patches + model.dino_extra_tokens
    channels = config.embed_dim
    block = 24 * channels**2  # per token: qkv 3C^2 + out C^2 + MLP 8C^2 multiply-adds, 2 FLOPs each
    linear = block * (config.dino_depth * dino_tokens + 2 * config.depth * tokens)
    own_attention = 4 * channels * (config.dino_depth * dino_tokens**2 + config.depth * tokens**2)
    keys = cached_frames * patches + config.num_special_tokens * (cached_frames + 1)
    global_attention = 4 * channels * config.depth * tokens * keys
    return linear + own_attention + global_attention + _dpt_flops(model, run)


def _dpt_flops(model: ModelShape, run: RunShape) -> float:
    """The depth head's convolutions: five 3x3 at 4x the patch grid, one at 8x, one at full resolution."""
    pixels = run.pixels
    features = model.config.dpt_features
    at_4x = pixels * 16 / model.config.patch_size**2
    at_8x = pixels * 64 / model.config.patch_size**2
    return 18 * (5 * features**2 * at_4x + features * features // 2 * at_8x + features // 2 * 32 * pixels)


def seconds_per_frame(model: ModelShape, run: RunShape, flops_per_second: float) -> tuple[float, float]:
    """(first streaming frame, last or steady frame) on a device doing `flops_per_second` on matmuls.

    The global attention reads more frames as the window fills: a stream of `run.frames` frames
    (None: long) ends with scale + min(window, the streaming frames) frames cached."""
    rate = flops_per_second * MATMUL_EFFICIENCY
    frames = run.frames
    streaming = run.window if frames is None else max(1, min(run.window, frames - run.scale_frames))
    first = frame_flops(model, run, run.scale_frames + 1) / rate
    last = frame_flops(model, run, run.scale_frames + streaming) / rate
    return first, last


# --------------------------------------------------------------------------------------------------
# This machine, and the check before a run


UNKNOWN_SOURCE_SIZE = (640, 480)  # a source that does not say its frame size is assumed 4:3, as most cameras
# For a CPU user, what to try first: a third of the cache and half the activations of the defaults.
QUICKER_CPU_SETTINGS = {"image_width": 392, "window": 16}


def available_memory_bytes() -> int | None:
    """Memory the run can take without swapping (MemAvailable), or None where it cannot be read."""
    try:
        import psutil  # not a dependency: where it is missing, /proc/meminfo is read
    except ImportError:
        pass
    else:
        return int(psutil.virtual_memory().available)
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def matmul_flops_per_second(size: int = 1024, repeats: int = 3) -> float:
    """float32 matrix-multiply throughput of this CPU with torch's threads (about 0.1 s)."""

    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)  # the first call pays for thread start-up and kernel choice
    started = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    return 2 * size**3 * repeats / (time.perf_counter() - started)


def model_shape(config: ModelConfig) -> ModelShape:
    """The ModelShape of a ModelConfig; its parameters are counted on the meta device (no memory)."""

    with torch.device("meta"):
        num_params = sum(parameter.numel() for parameter in GCTStream(config).parameters())
    return ModelShape(config, num_params)


_said_slow = False  # the slow-CPU warning, once a process: a batch runs many sequences on one CPU


def check_cpu_run(options: Any, config: Any, frame_size: tuple[int, int] | None, frames: int | None,
                  *, model_loaded: bool = False) -> list[str]:
    """Before a CPU run's model loads: refuse settings that cannot fit in memory (OptionsError naming
    smaller ones). Returns the warnings to give once every refusal has had its turn: the memory is
    tight, the run will be slow (once a process). model_loaded: the weights are in memory already (a
    model passed in), so only what the run adds is compared."""
    global _said_slow

    warnings = []
    model = model_shape(config)
    run = RunShape(source_size=frame_size or UNKNOWN_SOURCE_SIZE, image_width=options.image_width,
                   scale_frames=options.scale_frames, window=options.window, chunk_frames=options.chunk_frames,
                   frames=frames)
    available = available_memory_bytes()
    if options.memory_check and available is not None:
        plan = plan_host_memory(model, run, available, count_weights=not model_loaded)
        if not plan.fits:
            raise OptionsError(refusal_message(plan))
        if plan.tight:
            warnings.append(f"these settings need {plan.estimate.describe()}, close to the {format_bytes(available)} "
                            f"available; {flags(QUICKER_CPU_SETTINGS)} needs less")
    if _said_slow or frame_flops(model, run, run.scale_frames + run.window) < FAST_ANYWHERE_FLOPS:
        return warnings  # said already, or a frame this cheap (the tiny test model, say)
    rate = matmul_flops_per_second()
    if seconds_per_frame(model, run, rate)[1] >= WARN_SECONDS_PER_FRAME:
        warnings.append(slow_cpu_message(model, run, rate))
        _said_slow = True
    return warnings


def slow_cpu_message(model: ModelShape, run: RunShape, flops_per_second: float) -> str:
    """How slow a CPU run will be, and what to do about it."""
    first, last = seconds_per_frame(model, run, flops_per_second)
    fills = run.frames is None or run.frames - run.scale_frames >= run.window
    later = f"once the {run.window}-frame window is full" if fills else f"by the last of the {run.frames} frames"
    text = (f"a CPU run is slow: about {first:.0f} s per frame at the start and {last:.0f} s {later} (this CPU "
            f"multiplies float32 matrices at {flops_per_second / 1e9:.0f} GFLOP/s); a CUDA GPU runs the model at "
            "25-40 frames per second")
    quicker = {name: value for name, value in QUICKER_CPU_SETTINGS.items() if value < getattr(run, name)}
    if quicker:
        quick_first, quick_last = seconds_per_frame(model, replace(run, **quicker), flops_per_second)
        text += f"; {flags(quicker)} takes about {quick_first:.0f}-{quick_last:.0f} s per frame"
    return text
