"""The attention backends over the pages: one file each in this folder, and the table they make.

A backend's file holds its row (`ROW`, a BackendSpec: what it needs, how `auto` ranks it, what its first use
costs, how its kernels are built ahead) and its factory. The table is the folder: `cache/backend_names.py`
lists the files without importing anything (the CLI checks --attention before torch loads), and this module
imports each file for its row. Adding a backend is one file here (docs/ARCHITECTURE.md, "How to add").

Every backend reads the one paged layout (kv_cache.py): the same pages, the same page table, planned once a
step. The engine reads this table, and the CLI's option checks and `stream-recon info` through
models/attention_backends.py (the app never imports the cache).
"""

from __future__ import annotations

import importlib
from dataclasses import replace

import torch

from .. import fp8
from ..backend_names import AUTO, BackendSpec, module_name, names
from ..compiling import Compile
from ..kv_cache import KVCache
from ..packages import importable
from ..paged import SPECIAL_PAGES_AT_START, PagedTwoStreamCache
from ..pages import CacheCapacityError, CacheLayout, PagePool
from ..store import PagedKV

FP8 = "fp8"
# The half precisions: backends that run only in them (below), and in models/ the fused GELU and
# prepare_for_inference, which import this one definition (models import the cache, never the reverse).
HALF_DTYPES = (torch.bfloat16, torch.float16)
PRECISION_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", fp8.E4M3: FP8}
# How to get a package a backend needs, said once.
INSTALL_HINTS = {
    "triton": "it comes with CUDA builds of torch",
    "flashinfer": "on a CUDA machine scripts/setup-env installs it in a checkout; else pip install 'stream-recon[cuda]'",
}

def _rows() -> tuple[BackendSpec, ...]:
    rows = []
    for name in names()[1:]:
        row = importlib.import_module(f".{module_name(name)}", __name__).ROW
        if row.name != name:
            raise ImportError(f"cache/backends/{module_name(name)}.py holds the row of {row.name!r}: a file's row "
                              f"is named after the file ({name!r})")
        rows.append(row)
    return tuple(rows)


BACKENDS: tuple[BackendSpec, ...] = _rows()
_BY_NAME = {spec.name: spec for spec in BACKENDS}
AUTO_ORDER = tuple(spec.name for spec in sorted(BACKENDS, key=lambda s: s.auto_rank if s.auto_rank is not None else 99)
                   if spec.auto_rank is not None)
AUTO_SUMMARY = ("CUDA bf16/fp16: the first available of " + ", ".join(AUTO_ORDER) + "; CPU or float32: sdpa")


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
        return f"--attention {name} cannot read an fp8 K/V cache"
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
    """The backend `name` stands for on this device and dtype, over K/V stored in `stored` (None: in
    `dtype`; `auto`: the fastest available one). Raises ValueError with what to use instead when an
    explicitly named backend cannot run here."""
    device = torch.device(device)
    if name == AUTO:
        return _BY_NAME[_auto_choice(device, dtype, stored)]
    reason = unavailable_reason(name, device, dtype, stored)
    if reason is not None:
        raise ValueError(f"{reason}; use --attention auto or sdpa")
    return _BY_NAME[name]


def _auto_choice(device: torch.device, dtype: torch.dtype, stored: torch.dtype | None) -> str:
    if device.type == "cuda" and dtype in HALF_DTYPES:
        capability = torch.cuda.get_device_capability(device)[0]
        for name in AUTO_ORDER:
            if capability >= _BY_NAME[name].auto_min_capability and unavailable_reason(name, device, dtype, stored) is None:
                return name
    return "sdpa"  # the golden-parity path: the CPU, float32, or a GPU where no fast kernel runs


def auto_passed_over(device: torch.device | str, dtype: torch.dtype, stored: torch.dtype | None = None) -> str | None:
    """Where `auto` on CUDA in bf16/fp16 takes a backend after the first of its order, why the first cannot run
    here (one sentence, for the run to say); None elsewhere."""
    device = torch.device(device)
    if device.type != "cuda" or dtype not in HALF_DTYPES or not AUTO_ORDER:
        return None
    chosen = _auto_choice(device, dtype, stored)
    return None if chosen == AUTO_ORDER[0] else unavailable_reason(AUTO_ORDER[0], device, dtype, stored)


def paged_pool(layout: CacheLayout, max_frames: int, device_type: str, whole: bool = False) -> PagePool:
    """The page pool `build` gives a cache on a device of `device_type` (the memory model asks it too).

    On the CPU the pool starts with the scale frames' pages (and the pending frame's, and SPECIAL_PAGES_AT_START
    for the special tokens) and grows as frames come, one layer's copy at a time: a short stream never holds a
    whole window's pages (15 GiB at the defaults). On a GPU, or `whole`, it starts whole, its storage never
    moves (CUDA graphs write and read it; a cache beside it writes its block from another thread) and a growth
    mid-stream is no stall.
    """
    limit = PagedTwoStreamCache.pages_needed(layout, max_frames)
    first_pages = layout.scale_frames + 1 + SPECIAL_PAGES_AT_START if device_type == "cpu" and not whole else limit
    return PagePool(first_pages, max_pages=limit)


def build(backend: BackendSpec, layout: CacheLayout, *, num_layers: int, num_heads: int, head_dim: int,
          max_frames: int, dtype: torch.dtype, device: torch.device | str, compile: Compile = False,
          stored: torch.dtype | None = None, pages_beside: int = 0, beside: KVCache | None = None) -> KVCache:
    """A cache over pages, its storage allocated, served by `backend`.

    max_frames: the most frames whose special tokens can be live at once (the model's temporal RoPE range,
    or a chunk's); the pool grows up to them and no further (on a GPU it holds them from the start). dtype:
    the precision attention computes in; stored: the one K/V are stored in (None: dtype; float8_e4m3fn:
    fp8). compile: how the backend's small fixed-shape helpers are compiled (cache/compiling.py).
    pages_beside: pages the storage holds past the pool (which is then whole on every device), for one cache
    built `beside` this one later: a cache whose pool is that block, in that storage (no storage of its own).
    """
    device = torch.device(device)
    if stored not in (None, dtype) and not backend.reads_fp8:
        raise ValueError(unavailable_reason(backend.name, device, dtype, stored))
    if beside is not None:
        return _build_beside(backend, layout, beside, max_frames, compile)
    bookkeeping = PagedTwoStreamCache(layout, paged_pool(layout, max_frames, device.type, whole=pages_beside > 0))
    storage = PagedKV(num_layers, num_heads, head_dim, layout.page_size, dtype, device,
                      bookkeeping.pool.num_pages + pages_beside, stored)
    return KVCache(bookkeeping, storage, backend.factory(storage, layout, compile, device,
                                                         _most_keys(layout, max_frames)))


def _most_keys(layout: CacheLayout, max_frames: int) -> int:
    """The rows of a whole window's pool: the most keys a step of the stream reads (BackendFactory)."""
    return PagedTwoStreamCache.pages_needed(replace(layout, window_slots=None), max_frames) * layout.page_size


def _build_beside(backend: BackendSpec, layout: CacheLayout, lender: KVCache, max_frames: int,
                  compile: Compile) -> KVCache:
    """A cache whose pool is the block of pages `lender`'s storage holds past its own pool: no storage of its
    own. CacheCapacityError where the block holds fewer pages than this layout may need."""
    storage, needed = lender.storage, PagedTwoStreamCache.pages_needed(layout, max_frames)
    if layout.page_size != storage.page_size:
        raise ValueError(f"a cache of pages of {layout.page_size} tokens cannot lie in a storage of pages of "
                         f"{storage.page_size}")
    if needed > lender.pages_beside:
        raise CacheCapacityError(f"a cache beside another needs {needed} pages; its storage holds "
                                 f"{lender.pages_beside} past that cache's own")
    pool = PagePool(needed, max_pages=needed, first_id=lender.bookkeeping.pool.end_id)
    backend = backend.factory(storage, layout, compile, storage.device, _most_keys(layout, max_frames))
    return KVCache(PagedTwoStreamCache(layout, pool), storage, backend, lender=lender)


def cache_bytes(layout: CacheLayout, *, num_layers: int, num_heads: int, head_dim: int, max_frames: int,
                dtype: torch.dtype, device_type: str, stored: torch.dtype | None = None) -> int:
    """The most bytes the cache `build` makes with these arguments ever holds on a device of `device_type`: its
    pool at its limit (on a GPU from the start; a CPU pool's growth holds one layer twice besides)."""
    pages = PagedTwoStreamCache.pages_needed(layout, max_frames)
    per_layer = PagedKV.bytes_needed(1, num_heads, head_dim, layout.page_size, pages, stored or dtype)
    return (num_layers + (device_type == "cpu")) * per_layer


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
