"""Every attention backend in one table: its layout, what it needs, how `auto` chooses, how to build it.

The engine reads this table, and the CLI's option checks and `stream-recon info` through
models/attention_backends.py (the app never imports the cache).
Adding a backend is one row here and its name in backend_names.py (plus its module and tests): see
docs/ARCHITECTURE.md.

Layouts (kv_cache.py): `paged` (any page holds any frame; a kernel follows the page table) and
`dense` (each step's keys are one contiguous token range, read in place; CUDA graphs can record it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import fp8
from .backend_names import AUTO, ROW_NAMES, names
from .compiling import Compile
from .dense import DenseTwoStreamCache
from .dense_attention import DenseAttention, DenseKV, SplitCudnnAttention
from .kv_cache import AttentionBackend, DenseKVCache, KVCache, PagedKVCache
from .layout import CacheLayout
from .leftover_rows import library_waves
from .packages import importable
from .paged import SPECIAL_PAGES_AT_START, PagedTwoStreamCache
from .paged_attention import PagedKV, SDPAPagedAttention
from .pages import PagePool

FP8 = "fp8"
# The half precisions: backends that run only in them (below), and in models/ the fused GELU and
# prepare_for_inference, which import this one definition (models import the cache, never the reverse).
HALF_DTYPES = (torch.bfloat16, torch.float16)
PRECISION_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", fp8.E4M3: FP8}
# How to get a package a backend needs, said once.
INSTALL_HINTS = {
    "triton": "it comes with CUDA builds of torch",
    "flashinfer": "on a CUDA machine: scripts/setup-env cuda in a checkout, else pip install 'stream-recon[cuda]'",
}

# factory(storage, layout, compile, device) -> backend
BackendFactory = Callable[[object, CacheLayout, bool, torch.device], AttentionBackend]


@dataclass(frozen=True, kw_only=True)
class BackendSpec:
    name: str
    layout: str  # "paged" | "dense"
    summary: str  # one line for --help and `info`
    factory: BackendFactory
    needs: tuple[str, ...] = ()  # packages that must import
    cuda_half_only: bool = True  # runs on CUDA in bf16/fp16 only
    min_capability: int = 0  # CUDA compute capability (major) it needs
    auto_min_capability: int = 0  # `auto` considers it from this capability on
    # It reads an fp8 (e4m3) store, through a per-layer dequantised copy of the visible keys and
    # values in the model's dtype ([N, H, D] each: a transient one, or dense-triton's reused buffer).
    # The paged layout stores the model's dtype only.
    reads_fp8: bool = False
    # The CUDA compute capability (major, minor) from which it reads an fp8 store: a Triton kernel
    # reading the codes needs Triton's e4m3 type.
    fp8_capability: tuple[int, int] = (0, 0)
    # It reads the visible keys through a per-layer copy of them (the SDPA reference's page gather),
    # which memory plans count like fp8's dequantised copies.
    gathers: bool = False
    # What its first use on a machine costs, which a run says when it picks it ("": nothing).
    first_use: str = ""


def _flashinfer_first_use(seconds: int) -> str:
    # FlashInfer compiles a kernel the first time this machine asks for it and keeps it in its own folder
    return (f"its kernels compile on first use on this machine (about {seconds} s, once: they are cached in "
            "~/.cache/flashinfer)")


# -- factories (imports of optional packages happen only here, when a backend is built) --------
def _sdpa(storage, layout, compile, device):
    return SDPAPagedAttention(storage)


def _flashinfer_paged(variant: str) -> BackendFactory:
    def build(storage, layout, compile, device):
        # FlashInfer: an optional extra, imported when its backend is built
        from .flashinfer_backend import FlashInferPagedAttention

        return FlashInferPagedAttention(storage, variant=variant)

    return build


def _dense_sdpa(storage, layout, compile, device):
    return DenseAttention(storage, library_waves("flash", device))


def _dense_triton(storage, layout, compile, device):
    # Triton: absent on some machines, imported when its backend is built
    from .triton_attention import TritonRangeAttention

    # The schedule of a store with fewer window slots than its window is the full store's, so that it
    # computes bit for bit as the full one would (a spare engine hands its frames over to one).
    unallocated = layout.window_frames - layout.allocated_window_slots
    return TritonRangeAttention(storage, schedule_keys=storage.capacity + unallocated * layout.patches_per_frame)


def _dense_cudnn(storage, layout, compile, device):
    # cuDNN plans per key count: the patch keys take two counts once the window is full (with and
    # without the deferred frame), which go to it; the growing special keys go to flash.
    full = (layout.scale_frames + layout.window_frames) * layout.patches_per_frame
    return SplitCudnnAttention(storage, (full, full + layout.patches_per_frame), compile=compile,
                               fixed_shape_waves=library_waves("cudnn", device),
                               any_shape_waves=library_waves("flash", device))


def _dense_flashinfer(storage, layout, compile, device):
    # FlashInfer: an optional extra, imported when its backend is built
    from .flashinfer_backend import FlashInferRangeAttention

    variant = "fa3" if torch.cuda.get_device_capability(device)[0] == 9 else "fa2"
    return FlashInferRangeAttention(storage, variant=variant, waves=library_waves(f"flashinfer-{variant}", device))


BACKENDS: tuple[BackendSpec, ...] = (
    BackendSpec(name="sdpa", layout="paged", factory=_sdpa, cuda_half_only=False, gathers=True,
                summary="PyTorch SDPA over the gathered pages: the golden-parity reference, any device and dtype"),
    BackendSpec(name="flashinfer", layout="paged", factory=_flashinfer_paged("fa2"), needs=("flashinfer",),
                first_use=_flashinfer_first_use(30), summary="FlashInfer paged prefill (fa2) over the page table"),
    BackendSpec(name="flashinfer-fa2", layout="paged", factory=_flashinfer_paged("fa2"), needs=("flashinfer",),
                first_use=_flashinfer_first_use(30), summary="the same as flashinfer"),
    BackendSpec(name="flashinfer-fa3", layout="paged", factory=_flashinfer_paged("fa3"), needs=("flashinfer",),
                min_capability=9, first_use=_flashinfer_first_use(90),
                summary="FlashInfer paged prefill, Hopper's fa3 kernels"),
    BackendSpec(name="dense", layout="dense", factory=_dense_sdpa, cuda_half_only=False, reads_fp8=True,
                summary="PyTorch's flash/efficient SDPA over the visible range, read in place"),
    # (Ampere on: bf16 tensor-core products; TMA loads from Hopper on, pointer loads before)
    BackendSpec(name="dense-triton", layout="dense", factory=_dense_triton, needs=("triton",), min_capability=8,
                reads_fp8=True, fp8_capability=fp8.TRITON_E4M3_CAPABILITY,
                summary="our Triton range kernel reading its bounds on the device: the whole step one CUDA graph"),
    # cuDNN is faster than FlashInfer on Hopper only (26.1 against 29.1 ms a frame at 518x378); elsewhere
    # FlashInfer comes first.
    BackendSpec(name="dense-cudnn", layout="dense", factory=_dense_cudnn, auto_min_capability=9, reads_fp8=True,
                summary="cuDNN on the patch keys + flash on the special keys, merged by log-sum-exp"),
    BackendSpec(name="dense-flashinfer", layout="dense", factory=_dense_flashinfer, needs=("flashinfer",), reads_fp8=True,
                summary="FlashInfer ragged prefill over the visible range (fa3 on Hopper, fa2 elsewhere)"),
)
_BY_NAME = {spec.name: spec for spec in BACKENDS}
if tuple(_BY_NAME) != ROW_NAMES:  # the torch-free index of the rows (backend_names.py) must name each row
    raise ImportError(f"cache/backend_names.py's ROW_NAMES {ROW_NAMES} must list the rows of BACKENDS in order: "
                      f"{tuple(_BY_NAME)}")
# `auto` on CUDA in bf16/fp16, the first available in this order: the fastest measured first
# (docs/PERFORMANCE.md, *The engine*). On the CPU or in float32: sdpa, the golden-parity path.
AUTO_ORDER = ("dense-triton", "dense-cudnn", "dense-flashinfer", "dense")
AUTO_SUMMARY = ("CUDA bf16/fp16: the first available of " + ", ".join(AUTO_ORDER) + " (dense-cudnn on Hopper "
                "or newer); CPU or float32: sdpa")


def spec(name: str) -> BackendSpec:
    if name not in _BY_NAME:
        raise ValueError(f"unknown attention backend {name!r}: use one of {', '.join(names())}")
    return _BY_NAME[name]


def store_dtype(kv_cache: str, dtype: torch.dtype) -> torch.dtype:
    """The precision a cache stores K/V in, for the model precision `dtype`: `auto` (or the name of
    `dtype` itself) stores them in `dtype`; `fp8` in float8_e4m3fn with a power-of-two scale per
    token and head (fp8.py), half of bf16's bytes."""
    if kv_cache == FP8:
        return fp8.E4M3
    if kv_cache in (AUTO, precision_name(dtype)):
        return dtype
    raise ValueError(f"unknown K/V cache precision {kv_cache!r} for a {precision_name(dtype)} model: use "
                     f"{AUTO} ({precision_name(dtype)}) or {FP8}")


def precision_name(dtype: torch.dtype) -> str:
    """bf16, fp16, fp32 or fp8: the names --dtype and --kv-cache use."""
    return PRECISION_NAMES.get(dtype, _dtype_name(dtype))


def unavailable_reason(name: str, device: torch.device | str, dtype: torch.dtype,
                       stored: torch.dtype | None = None) -> str | None:
    """Why backend `name` cannot run on `device` in `dtype` over K/V stored in `stored` (None: in
    `dtype`), in one sentence, or None when it can."""
    backend, device = spec(name), torch.device(device)
    if backend.cuda_half_only and (device.type != "cuda" or dtype not in HALF_DTYPES):
        return f"--attention {name} needs bf16/fp16 on a CUDA device (got {_dtype_name(dtype)} on {device})"
    if stored == fp8.E4M3 and not backend.reads_fp8:
        return f"--attention {name} cannot read an fp8 K/V cache (the {backend.layout} layout stores the model's dtype)"
    for package in backend.needs:
        if not importable(package):
            return f"--attention {name} needs the {package} package ({INSTALL_HINTS.get(package, 'pip install it')})"
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < backend.min_capability:
        return f"--attention {name} needs a GPU of compute capability {backend.min_capability}.0 or newer"
    if stored == fp8.E4M3 and device.type == "cuda" and torch.cuda.get_device_capability(device) < backend.fp8_capability:
        return (f"--attention {name} reads an fp8 K/V cache on a GPU of compute capability "
                f"{'.'.join(map(str, backend.fp8_capability))} or newer")
    return None


def resolve(name: str, device: torch.device | str, dtype: torch.dtype, stored: torch.dtype | None = None) -> BackendSpec:
    """The backend `name` stands for on this device and dtype, over K/V stored in `stored` (None:
    in `dtype`; `auto`: the fastest available one). Raises ValueError with what to use instead when
    an explicitly named backend cannot run here."""
    device = torch.device(device)
    if name == AUTO:
        return _BY_NAME[_auto_choice(device, dtype, stored)]
    reason = unavailable_reason(name, device, dtype, stored)
    if reason is not None:
        fallback = "sdpa" if spec(name).layout == "paged" and stored != fp8.E4M3 else "dense"
        raise ValueError(f"{reason}; use --attention auto or {fallback}")
    return _BY_NAME[name]


def _auto_choice(device: torch.device, dtype: torch.dtype, stored: torch.dtype | None) -> str:
    if device.type != "cuda" or dtype not in HALF_DTYPES:
        # the golden-parity path; over fp8 keys the dense layout's SDPA (the paged one has no fp8)
        return "dense" if stored == fp8.E4M3 else "sdpa"
    capability = torch.cuda.get_device_capability(device)[0]
    for name in AUTO_ORDER:
        if capability >= _BY_NAME[name].auto_min_capability and unavailable_reason(name, device, dtype, stored) is None:
            return name
    return "dense"


def build(backend: BackendSpec, layout: CacheLayout, *, num_layers: int, num_heads: int, head_dim: int,
          max_frames: int, dtype: torch.dtype, device: torch.device | str, compile: Compile = False,
          stored: torch.dtype | None = None) -> KVCache:
    """A cache of `backend`'s layout, its storage allocated, served by `backend`.

    max_frames: the most frames whose special tokens can be live at once (the model's temporal
    RoPE range, or a window's); the dense layout allocates for all of them up front, the paged one
    grows up to them and no further. dtype: the precision attention computes in; stored: the one
    K/V are stored in (None: dtype; float8_e4m3fn: fp8, dense layout only). compile: how the
    backend's small fixed-shape helpers are compiled (cache/compiling.py).
    """
    device = torch.device(device)
    if stored not in (None, dtype) and not backend.reads_fp8:
        raise ValueError(unavailable_reason(backend.name, device, dtype, stored))
    if backend.layout == "dense":
        bookkeeping = DenseTwoStreamCache(layout, max_frames)
        storage = DenseKV(num_layers, num_heads, head_dim, bookkeeping.capacity_tokens, dtype, device, stored)
        return DenseKVCache(bookkeeping, storage, backend.factory(storage, layout, compile, device))
    bookkeeping = PagedTwoStreamCache(layout, paged_pool(layout, max_frames, device.type))
    storage = PagedKV(num_layers, num_heads, head_dim, layout.page_size, dtype, device, bookkeeping.pool.num_pages)
    return PagedKVCache(bookkeeping, storage, backend.factory(storage, layout, compile, device))


def paged_pool(layout: CacheLayout, max_frames: int, device_type: str) -> PagePool:
    """The page pool `build` gives a paged cache on a device of `device_type` (the memory model asks it too).

    On the CPU the pool starts with the scale frames' pages (and the pending frame's, and SPECIAL_PAGES_AT_START
    for the special tokens) and grows as frames come, one layer's copy at a time: a short stream never holds a
    whole window's pages (15 GiB at the defaults). On a GPU it starts whole: a growth mid-stream is a stall.
    """
    first_pages = layout.scale_frames + 1 if device_type == "cpu" else layout.max_patch_pages
    return PagePool(first_pages + SPECIAL_PAGES_AT_START, max_pages=PagedTwoStreamCache.pages_needed(layout, max_frames))


def cache_bytes(backend: BackendSpec, layout: CacheLayout, *, num_layers: int, num_heads: int, head_dim: int,
                max_frames: int, dtype: torch.dtype, stored: torch.dtype | None = None) -> int:
    """The most bytes the cache `build` makes with these arguments ever holds: all of it up front
    (dense), or once grown to its limit (paged; the growth's transient copy of one layer included)."""
    stored = stored or dtype
    if backend.layout == "dense":
        capacity = DenseTwoStreamCache(layout, max_frames).capacity_tokens
        return DenseKV.bytes_needed(num_layers, num_heads, head_dim, capacity, stored)
    pages = PagedTwoStreamCache.pages_needed(layout, max_frames)
    per_layer = PagedKV.bytes_needed(1, num_heads, head_dim, layout.page_size, pages, stored)
    return (num_layers + 1) * per_layer


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
