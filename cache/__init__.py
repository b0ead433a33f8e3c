"""The two-stream KV cache: page tables, the pages' storage, the attention backends that read them (one file
each: backends/), and the camera head's token cache.

The names below are imported on first use, as models/ does its own: a light module of this package
(backend_names) can then be read without loading torch, as the CLI's option checks do.
"""

from __future__ import annotations

from .lazy_names import lazy_names

# name -> the module of this package that defines it (a module of its own maps to itself)
_HOMES = {
    "backends": "backends",
    "fp8": "fp8",
    "BackendSpec": "backend_names",
    "AttentionBackend": "kv_cache",
    "CacheStep": "kv_cache",
    "KVCache": "kv_cache",
    "CacheCapacityError": "pages",
    "CacheLayout": "pages",
    "POOL_GROWTH_PAGES": "pages",
    "PagePool": "pages",
    "VisiblePages": "pages",
    "SPECIAL_PAGES_AT_START": "paged",
    "PagedTwoStreamCache": "paged",
    "PagedKV": "store",
    "DeviceValues": "streams",
    "run_beside": "streams",
    "TokenCache": "token_cache",
}

__all__ = sorted(_HOMES)

__getattr__, __dir__ = lazy_names(__name__, _HOMES)
