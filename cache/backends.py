"""Every attention backend in one table: its layout, what it needs, how `auto` chooses, how to build it.

The CLI's choices and help, `stream-recon info`, option checks and the engine all read this table.
Adding a backend is one row here (plus its module and tests): see docs/ARCHITECTURE.md.

Layouts (kv_cache.py): `paged` (any page holds any frame; a kernel follows the page table) and
`dense` (each step's keys are one contiguous token range, read in place; CUDA graphs can record it).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch

from .dense import DenseTwoStreamCache
from .dense_attention import DenseAttention, DenseKV, SplitCudnnAttention
from .kv_cache import AttentionBackend, DenseKVCache, KVCache, PagedKVCache
from .layout import CacheLayout
from .paged import PagedTwoStreamCache
from .paged_attention import PagedKV, SDPAPagedAttention

AUTO = "auto"
HALF_DTYPES = (torch.bfloat16, torch.float16)
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


# -- factories (imports of optional packages happen only here, when a backend is built) --------
def _sdpa(storage, layout, compile, device):
    return SDPAPagedAttention(storage)


def _flashinfer_paged(variant: str) -> BackendFactory:
    def build(storage, layout, compile, device):
        from .flashinfer_backend import FlashInferPagedAttention

        return FlashInferPagedAttention(storage, variant=variant)

    return build


def _dense_sdpa(storage, layout, compile, device):
    return DenseAttention(storage)


def _dense_triton(storage, layout, compile, device):
    from .triton_attention import TritonRangeAttention

    return TritonRangeAttention(storage)


def _dense_cudnn(storage, layout, compile, device):
    # cuDNN plans per key count: the patch keys take two counts once the window is full (with and
    # without the deferred frame), which go to it; the growing special keys go to flash.
    full = (layout.scale_frames + layout.window_frames) * layout.patches_per_frame
    return SplitCudnnAttention(storage, (full, full + layout.patches_per_frame), compile=compile)


def _dense_flashinfer(storage, layout, compile, device):
    from .flashinfer_backend import FlashInferRangeAttention

    variant = "fa3" if torch.cuda.get_device_capability(device)[0] == 9 else "fa2"
    return FlashInferRangeAttention(storage, variant=variant)


BACKENDS: tuple[BackendSpec, ...] = (
    BackendSpec(name="sdpa", layout="paged", factory=_sdpa, cuda_half_only=False,
                summary="PyTorch SDPA over the gathered pages: the golden-parity reference, any device and dtype"),
    BackendSpec(name="flashinfer", layout="paged", factory=_flashinfer_paged("fa2"), needs=("flashinfer",),
                summary="FlashInfer paged prefill (fa2) over the page table"),
    BackendSpec(name="flashinfer-fa2", layout="paged", factory=_flashinfer_paged("fa2"), needs=("flashinfer",),
                summary="the same as flashinfer"),
    BackendSpec(name="flashinfer-fa3", layout="paged", factory=_flashinfer_paged("fa3"), needs=("flashinfer",),
                min_capability=9, summary="FlashInfer paged prefill, Hopper's fa3 kernels"),
    BackendSpec(name="dense", layout="dense", factory=_dense_sdpa, cuda_half_only=False,
                summary="PyTorch's flash/efficient SDPA over the visible range, read in place"),
    BackendSpec(name="dense-triton", layout="dense", factory=_dense_triton, needs=("triton",), min_capability=9,
                summary="our Triton range kernel (TMA loads) reading its bounds on the device: the whole step one CUDA graph"),
    # cuDNN beat FlashInfer on Hopper only (docs/PERFORMANCE.md); elsewhere FlashInfer comes first.
    BackendSpec(name="dense-cudnn", layout="dense", factory=_dense_cudnn, auto_min_capability=9,
                summary="cuDNN on the patch keys + flash on the special keys, merged by log-sum-exp"),
    BackendSpec(name="dense-flashinfer", layout="dense", factory=_dense_flashinfer, needs=("flashinfer",),
                summary="FlashInfer ragged prefill over the visible range (fa3 on Hopper, fa2 elsewhere)"),
)
_BY_NAME = {spec.name: spec for spec in BACKENDS}
# `auto` on CUDA in bf16/fp16, the first available in this order: the fastest measured first
# (docs/PERFORMANCE.md). On the CPU or in float32: sdpa, the golden-parity path.
AUTO_ORDER = ("dense-triton", "dense-cudnn", "dense-flashinfer", "dense")
AUTO_SUMMARY = ("CUDA bf16/fp16: the first available of " + ", ".join(AUTO_ORDER) + " (dense-cudnn on Hopper "
                "or newer); CPU or float32: sdpa")


def names() -> tuple[str, ...]:
    """Every name --attention accepts, `auto` first."""
    return (AUTO, *_BY_NAME)


@cache
def importable(package: str) -> bool:
    """Whether `package` imports here (asked once per process; the one place that asks)."""
    try:
        importlib.import_module(package)
    except ImportError:
        return False
    return True


def spec(name: str) -> BackendSpec:
    if name not in _BY_NAME:
        raise ValueError(f"unknown attention backend {name!r}: use one of {', '.join(names())}")
    return _BY_NAME[name]


def unavailable_reason(name: str, device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why backend `name` cannot run on `device` in `dtype` (one sentence), or None when it can."""
    backend, device = spec(name), torch.device(device)
    if backend.cuda_half_only and (device.type != "cuda" or dtype not in HALF_DTYPES):
        return f"--attention {name} needs bf16/fp16 on a CUDA device (got {_dtype_name(dtype)} on {device})"
    for package in backend.needs:
        if not importable(package):
            return f"--attention {name} needs the {package} package ({INSTALL_HINTS.get(package, 'pip install it')})"
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < backend.min_capability:
        return f"--attention {name} needs a GPU of compute capability {backend.min_capability}.0 or newer"
    return None


def resolve(name: str, device: torch.device | str, dtype: torch.dtype) -> BackendSpec:
    """The backend `name` stands for on this device and dtype (`auto`: the fastest available one).
    Raises ValueError with what to use instead when an explicitly named backend cannot run here."""
    device = torch.device(device)
    if name == AUTO:
        return _BY_NAME[_auto_choice(device, dtype)]
    reason = unavailable_reason(name, device, dtype)
    if reason is not None:
        fallback = "sdpa" if spec(name).layout == "paged" else "dense"
        raise ValueError(f"{reason}; use --attention auto or {fallback}")
    return _BY_NAME[name]


def _auto_choice(device: torch.device, dtype: torch.dtype) -> str:
    if device.type != "cuda" or dtype not in HALF_DTYPES:
        return "sdpa"
    capability = torch.cuda.get_device_capability(device)[0]
    for name in AUTO_ORDER:
        if capability >= _BY_NAME[name].auto_min_capability and unavailable_reason(name, device, dtype) is None:
            return name
    return "dense"


def build(backend: BackendSpec, layout: CacheLayout, *, num_layers: int, num_heads: int, head_dim: int,
          max_frames: int, dtype: torch.dtype, device: torch.device | str, compile: bool = False) -> KVCache:
    """A cache of `backend`'s layout, its storage allocated, served by `backend`.

    max_frames: the most frames whose special tokens can be live at once (the model's temporal
    RoPE range); the dense layout allocates for all of them up front, the paged one grows.
    """
    device = torch.device(device)
    if backend.layout == "dense":
        bookkeeping = DenseTwoStreamCache(layout, max_frames)
        storage = DenseKV(num_layers, num_heads, head_dim, bookkeeping.capacity_tokens, dtype, device)
        return DenseKVCache(bookkeeping, storage, backend.factory(storage, layout, compile, device))
    bookkeeping = PagedTwoStreamCache(layout)
    storage = PagedKV(num_layers, num_heads, head_dim, layout.page_size, dtype, device, bookkeeping.pool.num_pages)
    return PagedKVCache(bookkeeping, storage, backend.factory(storage, layout, compile, device))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
