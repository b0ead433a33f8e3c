"""The two-stream KV cache: bookkeeping of two layouts (paged, dense), their storage, the attention
backends that read them (one table: backends.py), and the camera head's token cache.

The names below are imported on first use, as models/ does its own: a light module of this package
(backend_names) can then be read without loading torch, as the CLI's option checks do.
"""

from __future__ import annotations

from .lazy_names import lazy_names

# name -> the module of this package that defines it (a module of its own maps to itself)
_HOMES = {
    "backends": "backends",
    "fp8": "fp8",
    "BackendSpec": "backends",
    "DenseTwoStreamCache": "dense",
    "SlotMove": "dense",
    "VisibleRange": "dense",
    "DenseAttention": "dense_attention",
    "DenseKV": "dense_attention",
    "SplitCudnnAttention": "dense_attention",
    "merge_partial_attention": "dense_attention",
    "AttentionBackend": "kv_cache",
    "CacheStep": "kv_cache",
    "DenseKVCache": "kv_cache",
    "KVCache": "kv_cache",
    "PagedKVCache": "kv_cache",
    "CacheCapacityError": "layout",
    "CacheLayout": "layout",
    "SPECIAL_PAGES_AT_START": "paged",
    "PagedTwoStreamCache": "paged",
    "PagedKV": "paged_attention",
    "SDPAPagedAttention": "paged_attention",
    "POOL_GROWTH_PAGES": "pages",
    "PagePool": "pages",
    "VisiblePages": "pages",
    "DeviceValues": "streams",
    "run_beside": "streams",
    "TokenCache": "token_cache",
}

__all__ = sorted(_HOMES)

__getattr__, __dir__ = lazy_names(__name__, _HOMES)
